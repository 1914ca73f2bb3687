"""The tiny HF transformers DeepSeek-V4 oracle (docs/references.md, V4): config, build, randomisation of the
params HF initialises to constants, and weight export with the torch safetensors writer.

Imports torch / transformers lazily (about 4-10 s): call from a module-scoped fixture.
"""

from __future__ import annotations

import os

import numpy as np

from dsv4.config import ModelConfig

# The tiny config (= dsv4.config.v4_tiny()) as DeepseekV4Config kwargs.
HF_TINY_KWARGS = dict(
    vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=1, head_dim=64, q_lora_rank=32,
    partial_rotary_factor=0.25,
    o_groups=2, o_lora_rank=16,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    layer_types=["sliding_attention", "compressed_sparse_attention",
                 "heavily_compressed_attention", "compressed_sparse_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    sliding_window=16, index_n_heads=8, index_head_dim=32, index_topk=8,
    hc_mult=4, hc_sinkhorn_iters=20, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32.0, "beta_slow": 1.0},
    max_position_embeddings=1048576, rms_norm_eps=1e-6)


def hf_config(initializer_range: float = 0.02, overrides: dict | None = None):
  from transformers import DeepseekV4Config
  cfg = DeepseekV4Config(**{**HF_TINY_KWARGS, **(overrides or {})}, initializer_range=initializer_range)
  cfg._attn_implementation = "eager"
  return cfg


def config_mismatches(hf, cfg: ModelConfig) -> list[str]:
  """Fields where the HF config and ours disagree (empty when they describe the same model)."""
  a, ix, mo = cfg.attention, cfg.indexer, cfg.moe
  kinds = {"sliding_attention": 0}
  ratios = [kinds.get(t, hf.compress_rates.get(t)) for t in hf.layer_types]
  yarn = hf.rope_parameters["compress"] if "compress" in hf.rope_parameters else hf.rope_parameters
  pairs = {
      "vocab_size": (hf.vocab_size, cfg.vocab_size), "hidden_size": (hf.hidden_size, cfg.hidden_size),
      "num_layers": (hf.num_hidden_layers, cfg.num_layers), "compress_ratios": (tuple(ratios), cfg.compress_ratios),
      "num_heads": (hf.num_attention_heads, a.num_heads), "head_dim": (hf.head_dim, a.head_dim),
      "rope_head_dim": (int(hf.head_dim * hf.partial_rotary_factor), a.rope_head_dim),
      "q_lora_rank": (hf.q_lora_rank, a.q_lora_rank), "o_groups": (hf.o_groups, a.o_groups),
      "o_lora_rank": (hf.o_lora_rank, a.o_lora_rank), "window": (hf.sliding_window, a.window),
      "rope_theta": (hf.rope_theta, a.rope_theta), "compress_rope_theta": (hf.compress_rope_theta, a.compress_rope_theta),
      "yarn.factor": (yarn["factor"], a.yarn.factor),
      "yarn.original_max_position_embeddings": (yarn["original_max_position_embeddings"],
                                                a.yarn.original_max_position_embeddings),
      "yarn.beta_fast": (yarn["beta_fast"], a.yarn.beta_fast), "yarn.beta_slow": (yarn["beta_slow"], a.yarn.beta_slow),
      "index_n_heads": (hf.index_n_heads, ix.num_heads), "index_head_dim": (hf.index_head_dim, ix.head_dim),
      "index_topk": (hf.index_topk, ix.topk), "n_routed_experts": (hf.n_routed_experts, mo.n_routed_experts),
      "n_shared_experts": (hf.n_shared_experts, mo.n_shared_experts),
      "num_experts_per_tok": (hf.num_experts_per_tok, mo.num_experts_per_tok),
      "moe_intermediate_size": (hf.moe_intermediate_size, mo.intermediate_size),
      "routed_scaling_factor": (hf.routed_scaling_factor, mo.routed_scaling_factor),
      "swiglu_limit": (hf.swiglu_limit, mo.swiglu_limit),
      "num_hash_layers": (sum(t == "hash_moe" for t in hf.mlp_layer_types), mo.num_hash_layers),
      "hc_mult": (hf.hc_mult, cfg.mhc.hc_mult), "hc_sinkhorn_iters": (hf.hc_sinkhorn_iters, cfg.mhc.sinkhorn_iters),
      "hc_eps": (hf.hc_eps, cfg.mhc.eps), "rms_norm_eps": (hf.rms_norm_eps, cfg.rms_norm_eps),
      "scoring_func": (hf.scoring_func, "sqrtsoftplus"),
      "tie_word_embeddings": (bool(hf.tie_word_embeddings), False),
  }
  return [f"{k}: HF {h!r} vs ours {o!r}" for k, (h, o) in pairs.items() if h != o]


def build_oracle(seed: int = 0, initializer_range: float = 0.02, overrides: dict | None = None):
  """The fp32 eager HF model with every constant-initialised param randomised (HF's constant init hides mistakes:
  sinks, position_bias, hc base, e_score_correction_bias and tid2eid start at zero; norms and hc scales at one)."""
  import torch
  from transformers import DeepseekV4ForCausalLM
  torch.manual_seed(seed)
  model = DeepseekV4ForCausalLM(hf_config(initializer_range, overrides)).float().eval()
  g = torch.Generator().manual_seed(seed + 1)
  E, k = model.config.n_routed_experts, model.config.num_experts_per_tok
  with torch.no_grad():
    for name, t in model.state_dict().items():
      leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name.rsplit(".", 2)[-2]
      if name.endswith("tid2eid"):
        t.copy_(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t.shape[0])]))
      elif leaf in ("sinks", "position_bias", "base", "hc_base"):
        t.copy_(torch.randn(t.shape, generator=g) * 0.5)
      elif leaf == "e_score_correction_bias":
        t.copy_(torch.randn(t.shape, generator=g) * 0.1)
      elif leaf in ("scale", "hc_scale") or "norm" in leaf:
        t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
  return model


def save_oracle_weights(model, directory: str) -> str:
  """model.state_dict() -> directory/model.safetensors via safetensors.torch (the reference's own writer)."""
  from safetensors.torch import save_file
  os.makedirs(directory, exist_ok=True)
  sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
  path = os.path.join(directory, "model.safetensors")
  save_file(sd, path, metadata={"format": "pt"})
  return path


def hf_logits(model, tokens_1xT: np.ndarray) -> np.ndarray:
  import torch
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(tokens_1xT, dtype=torch.long)).logits.float().numpy()
