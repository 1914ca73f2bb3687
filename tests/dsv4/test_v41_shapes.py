"""V4.1-Flash at full size without allocating: parameter count from jax.eval_shape against an independent formula,
per-layer cache shapes per role (docs/kv_cache.md, The cache pytree), config validation, and cache bytes at 1M
tokens against hand-computed sizes."""

import jax
import numpy as np
import pytest

from dsv4 import caches, config, model
from experiments.cache_bytes import FORMATS, cache_bytes, per_token_bytes


def _expected_params(cfg: config.ModelConfig) -> int:
  """Independent count (widths of docs/model.md, Presets): per-layer attention / compressor / indexer / MoE / mHC /
  Engram."""
  a, ix, mo, e, D, n = cfg.attention, cfg.indexer, cfg.moe, cfg.engram, cfg.hidden_size, cfg.mhc.hc_mult
  H, d, q, I, E = a.num_heads, a.head_dim, a.q_lora_rank, mo.intermediate_size, mo.n_routed_experts
  attn = D * q + q + q * H * d + D * d + d + H * d * a.o_lora_rank + a.o_groups * a.o_lora_rank * D + H
  ffn = D * E + 3 * E * D * I + 3 * D * I + 2 * E          # gate, experts, shared, bias + bias_vl
  hc = 2 * (n * D * (2 + n) * n + (2 + n) * n + 3)
  total = cfg.vocab_size * D * 2 + D                        # embed, head, final norm (no hc_head in V4.1)
  for i, r in enumerate(cfg.compress_ratios):
    total += attn + ffn + hc + 2 * D
    if i in cfg.kv_source_layer_ids:
      total += D * d + d + (D * d if r == 2 else 0) + d * ix.head_dim + ix.head_dim
    if i in cfg.index_source_layer_ids:
      total += q * ix.num_heads * ix.head_dim + D * ix.num_heads
    if i in e.layer_ids:
      total += e.num_embeddings[e.layer_ids.index(i)] * e.head_dim + e.hash_heads * e.head_dim * D * (n + 1) + 2 * n * D
  return total


@pytest.mark.parametrize("engram", [False, True])
def test_flash_param_count(engram):
  cfg = config.v41_flash(engram=engram)
  shapes = jax.eval_shape(lambda: model.init_params(cfg, jax.random.PRNGKey(0)))
  n = model.count_params({k: v for k, v in shapes.items() if k != "engram_token_map"})
  assert n == _expected_params(cfg)
  print(f"\nV4.1-Flash params (engram={engram}): {n:,}")
  # spot checks on the role-dependent leaves
  L = shapes["layers"]
  assert "hc_head" not in shapes
  assert "compressor" in L[2]["attn"] and "wgate" in L[2]["attn"]["compressor"]
  assert "wgate" not in L[20]["attn"]["compressor"] and "ape" not in L[20]["attn"]["compressor"]
  assert set(L[24]["attn"]["indexer"]) == {"wq_b", "weights_proj"} and "compressor" not in L[24]["attn"]
  assert "indexer" not in L[3]["attn"] and "compressor" not in L[3]["attn"]
  assert L[0]["ffn"]["experts"]["w1"].shape == (384, 5120, 2304)


def test_flash_roles_and_cache_shapes():
  cfg = config.v41_flash()
  roles = {p.index: p.kind for p in cfg.layer_plan()}
  assert [i for i, k in roles.items() if k == "full"] == [2, 8, 14, 20]
  assert [i for i, k in roles.items() if k == "reindex"] == [24, 28, 32, 36]
  assert [i for i, k in roles.items() if k == "swa"] == [0, 1]
  plans = cfg.layer_plan()
  assert [p.index for p in plans if p.uses_candidates] == [24, 28, 32, 36]
  assert plans[23].index_source == 20 and plans[27].index_source == 24 and plans[5].index_source == 2
  assert all(p.rope == "compress" for p in plans if p.ratio > 0) and not any(p.q_head_norm for p in plans)
  layout = caches.CacheLayout(swa_block_tokens=64, full_block_tokens=128, kv_dtype=np.float32)
  shapes = jax.eval_shape(lambda: caches.init_cache(cfg, layout, 4, 2))
  for i, layer in enumerate(shapes.layers):
    names = {k: tuple(v.shape) for k, v in layer.items()}
    want = {"window_kv": (4, 64, 512)}
    if i in (2, 8, 14):
      want.update(comp_kv=(2, 64, 512), index_keys=(2, 64, 128), comp_state=(4, 1, 2 * 512))
    if i == 20:
      want.update(comp_kv=(2, 128, 512), index_keys=(2, 128, 128))
    if i == 1:
      want.update(token_ids=(4, 64))
    assert names == want, (i, names)


def test_v41_schedule_errors_are_clear():
  base = config.v41_tiny()
  import dataclasses
  with pytest.raises(config.ConfigError, match="latest KV source .layer 1. has ratio 2"):
    dataclasses.replace(base, kv_source_layer_ids=(1,), index_source_layer_ids=(1, 3), candidate_source_layer_id=-1)
  with pytest.raises(config.ConfigError, match="candidate_source_layer_id"):
    dataclasses.replace(base, candidate_source_layer_id=6)
  with pytest.raises(config.ConfigError, match="V4.1 ratios"):
    dataclasses.replace(base, compress_ratios=(0, 2, 2, 2, 4, 4, 4, 4))


SPEC_V41 = {  # GB at 1M (2^20) tokens: 2.5 compressed entries per token x record / index-key bytes
    "v4_fp8_record_584B+idx_fp8": dict(compressed_kv=1.53, index_keys=0.35),
    "v41_record_528B+idx_fp8": dict(compressed_kv=1.38, index_keys=0.35),
    "nvfp4_288B+idx_mxfp4": dict(compressed_kv=0.75, index_keys=0.18),
}


def test_cache_bytes_match_spec():
  L = 1 << 20
  fm = {f.name: f for f in FORMATS}
  v41, v4 = config.v41_flash(), config.v4_flash()
  for name, want in SPEC_V41.items():
    got = cache_bytes(v41, fm[name], L)
    for k, v in want.items():
      assert abs(got[k] / 1e9 - v) <= 0.006, (name, k, got[k])
  rec = cache_bytes(v41, fm["v4_fp8_record_584B+idx_fp8"], L)
  assert abs(rec["window"] / 1e6 - 3.0) < 0.05                     # "rings 3 MB"
  assert abs(cache_bytes(v41, fm["bf16"], L)["total"] / 1e9 - 3.4) < 0.05   # "about 3.4 GB"
  # V4-Flash: CSA 3.21 + HCA 0.096 GB, index 0.73 (0.37 MXFP4), rings 3.2 MB, 4.04 GB; compressor states: one
  # running-pool row per layer (21 CSA x (4*512 + 4*128) + 20 HCA x 2*512 fp32 = 0.30 MB; raw rows were 12 MB)
  g = cache_bytes(v4, fm["v4_fp8_record_584B+idx_fp8"], L)
  assert abs(g["compressed_kv"] / 1e9 - (3.21 + 0.096)) < 0.01 and abs(g["index_keys"] / 1e9 - 0.73) < 0.005
  assert abs(g["window"] / 1e6 - 3.2) < 0.05 and abs(g["compressor_state"] / 1e6 - 0.30) < 0.01
  assert abs(g["total"] / 1e9 - 4.04) < 0.01
  assert abs(cache_bytes(v4, fm["v4_fp8_record_584B+idx_mxfp4"], L)["index_keys"] / 1e9 - 0.37) < 0.01
  assert abs(cache_bytes(v4, fm["bf16"], L)["total"] / 1e9 - 7.2) < 0.05
  assert per_token_bytes(v41, fm["v41_record_528B+idx_fp8"]) == 2.5 * 528 + 2.5 * 132
