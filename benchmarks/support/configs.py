"""The "wide" configuration: V4-Flash's attention widths in a 4-layer model small enough for a CPU.

D 4096, 64 heads x 512, q_lora 1024, 8 x 1024 output groups, window 128, indexer 64 x 128, layers
[window, window, CSA m=4, HCA m=128], 4 small experts. `WIDE_HF` is the same model as keyword overrides of the tiny
transformers oracle config (tests/dsv4/oracle_util.py), `wide_config()` as this repo's ModelConfig.
"""

from __future__ import annotations

import dataclasses

from dsv4 import config

WIDE_HF = dict(
    vocab_size=1024, hidden_size=4096, moe_intermediate_size=512, num_hidden_layers=4, num_attention_heads=64,
    head_dim=512, q_lora_rank=1024, partial_rotary_factor=0.125, o_groups=8, o_lora_rank=1024,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    layer_types=["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"], sliding_window=128, index_n_heads=64, index_head_dim=128,
    index_topk=32)


def wide_config() -> config.ModelConfig:
  """`config.v4_flash_layers(4)` with the oracle config's top-32 (the transformers model it is compared with)."""
  return dataclasses.replace(config.v4_flash_layers(4), name="wide4", indexer=config.IndexerConfig(topk=32))


def wide_moe_config() -> config.ModelConfig:
  """v4_tiny's layers (window, CSA m=4 with its indexer, HCA) at a wide residual and a V4-Flash-shaped router: D 512,
  64 routed experts, top-6, one shared expert, hash routing in layer 0."""
  return dataclasses.replace(config.v4_tiny(), name="v4_wide_moe", hidden_size=512,
                             moe=config.MoEConfig(n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=6,
                                                  intermediate_size=128, num_hash_layers=1))
