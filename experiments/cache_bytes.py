"""KV-cache bytes per token and at 1M context for V4-Flash and V4.1-Flash under several record formats.

    python -m experiments.cache_bytes [--context=1048576]

Row counts come from `dsv4.caches.cache_array_specs` (which arrays exist on which layer, rows per block), not from
hard-coded layer lists: full-group arrays (compressed KV, index keys) grow with the context (rows per token =
block rows / full_block_tokens); SWA-group arrays are a ring: the window KV keeps min(L, window) rows, each pooling
compressor keeps one running-pool state row (fp32, `caches.compressor_state_width`), Engram token ids keep
max_ngram - 1 ids. Also printed: bytes of one SWA checkpoint (the swa blocks a resume at an aligned point keeps)
against the bytes such a resume actually reads, per KV dtype.
Record sizes per row (the V4 / V4.1 serving records of vLLM's DeepSeek backends and NeMo's quantized cache;
docs/kv_cache.md):

  compressed KV / window KV: bf16 1024 B, fp32 2048 B, V4 fp8 record 584 B (448 fp8 + 64 bf16 + 7 UE8M0 + pad),
    V4.1 record 528 B (512 fp8 + 16 UE8M0), NVFP4 288 B (compressed rows only; the window stays in the V4.1 record);
  index keys: bf16 256 B, fp32 512 B, FP8 132 B (128 + fp32 scale), MXFP4 68 B (64 + 4 UE8M0).
"""

from __future__ import annotations

import dataclasses

from absl import app, flags
import jax.numpy as jnp

from dsv4 import caches
from dsv4.config import ModelConfig, v4_flash, v41_flash

_CONTEXT = flags.DEFINE_integer("context", 1 << 20, "context length in tokens")


@dataclasses.dataclass(frozen=True)
class Format:
  name: str
  kv_row: int        # bytes per compressed-KV row
  window_row: int    # bytes per window-KV row
  index_row: int     # bytes per index-key row


FORMATS = (
    Format("bf16", 1024, 1024, 256),
    Format("fp32", 2048, 2048, 512),
    Format("v4_fp8_record_584B+idx_fp8", 584, 584, 132),
    Format("v4_fp8_record_584B+idx_mxfp4", 584, 584, 68),
    Format("v41_record_528B+idx_fp8", 528, 528, 132),
    Format("nvfp4_288B+idx_mxfp4", 288, 528, 68),
)


def cache_bytes(config: ModelConfig, fmt: Format, context: int,
                layout: caches.CacheLayout = caches.CacheLayout()) -> dict[str, float]:
  """Bytes of one sequence's decode state at `context` tokens, by component."""
  out = {"compressed_kv": 0.0, "index_keys": 0.0, "window": 0.0, "compressor_state": 0.0, "token_ids": 0.0}
  for s in caches.cache_array_specs(config, layout):
    if s.group == caches.FULL:
      rows = context * s.block_shape[0] // layout.full_block_tokens
      out["compressed_kv" if s.name == "comp_kv" else "index_keys"] += rows * (
          fmt.kv_row if s.name == "comp_kv" else fmt.index_row)
    elif s.name == "window_kv":
      out["window"] += min(context, config.attention.window) * fmt.window_row
    elif s.name == "token_ids":
      out["token_ids"] += (config.engram.max_ngram_size - 1) * 4
    else:  # running-pool compressor state: one fp32 row per layer
      out["compressor_state"] += s.block_shape[1] * 4
  out["total"] = sum(out.values())
  return out


def per_token_bytes(config: ModelConfig, fmt: Format, layout: caches.CacheLayout = caches.CacheLayout()) -> float:
  """Asymptotic bytes per additional token (full-group rows only; the SWA group is a fixed-size ring)."""
  big = 1 << 30
  return (cache_bytes(config, fmt, 2 * big, layout)["total"] - cache_bytes(config, fmt, big, layout)["total"]) / big


def checkpoint_bytes(config: ModelConfig, layout: caches.CacheLayout) -> dict[str, float]:
  """One SWA checkpoint = the `need_blocks` swa blocks before an aligned resume point, every swa array of every
  layer; `reads` = what the next step actually reads there (W - 1 window rows, the state row of the block before
  the resume point, Engram's previous ids)."""
  specs = [s for s in caches.cache_array_specs(config, layout) if s.group == caches.SWA]
  tail = caches.state_tail_tokens(config)
  need = -(-tail // layout.swa_block_tokens)
  ckpt = need * sum(s.bytes_per_block for s in specs)
  reads = 0
  for s in specs:
    row = s.bytes_per_block // s.block_shape[0]
    if s.name == "window_kv":
      reads += (config.attention.window - 1) * row
    elif s.name == "token_ids":
      reads += (config.engram.max_ngram_size - 1) * row
    else:
      reads += row
  return {"blocks": need, "checkpoint": ckpt, "reads": reads}


def legacy_checkpoint_bytes(config: ModelConfig, block_tokens: int = 32) -> float:
  """The layout before the running-pool state: fp32 window + raw fp32 projections (a, z) of every token."""
  per_token = 0
  for p in config.layer_plan():
    per_token += config.attention.head_dim * 4
    if p.has_compressor and p.ratio > 1:
      per_token += 2 * config.compressor_width(p) * 4
    if p.kind == "csa":
      per_token += 2 * config.index_compressor_width(p) * 4
    if config.engram.layer_ids and p.index == config.engram.layer_ids[0]:
      per_token += 4
  need = -(-(config.attention.window - 1) // block_tokens)
  return need * block_tokens * per_token


def main(_):
  mib = 1 << 20
  for cfg in (v4_flash(), v41_flash()):
    print(f"== {cfg.name}: bytes per SWA checkpoint (legacy layout {legacy_checkpoint_bytes(cfg) / mib:.2f} MiB)")
    for dt in (jnp.float32, jnp.bfloat16):
      c = checkpoint_bytes(cfg, caches.CacheLayout(kv_dtype=dt))
      print(f"  kv {jnp.dtype(dt).name:9s} {c['blocks']} blocks = {c['checkpoint'] / mib:6.2f} MiB; a resume reads "
            f"{c['reads'] / mib:6.2f} MiB (+{100 * (c['checkpoint'] / c['reads'] - 1):.1f}%)")
  L = _CONTEXT.value
  for cfg in (v4_flash(), v41_flash()):
    print(f"== {cfg.name}  (context {L:,} tokens)")
    for fmt in FORMATS:
      b = cache_bytes(cfg, fmt, L)
      parts = ", ".join(f"{k} {v / 1e9:.3f} GB" if v >= 1e8 else f"{k} {v / 1e6:.2f} MB"
                        for k, v in b.items() if k != "total")
      print(f"  {fmt.name:30s} {per_token_bytes(cfg, fmt):8.1f} B/token   total {b['total'] / 1e9:.3f} GB   "
            f"({parts})")


if __name__ == "__main__":
  app.run(main)
