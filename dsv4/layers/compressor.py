"""KV compressors: V4 CSA (ratio m, overlapping windows of 2m, stride m, position bias), V4 HCA (ratio m,
non-overlapping), V4.1 CSA2 ratio 2 (gated pooling, no bias) and ratio 1 (projection only). Spec §1.6, §2.3.

Chunked and incremental use share one path: the chunk's raw projections (a_j, z_j + ape) are written into the
SWA-group state pools first; then every window that completes inside the chunk is pooled from rows read back
through the block table (rows of earlier chunks and of this one alike), normalised, RoPE'd at the window start and
written into the full-group pool as entry n = window index. A window that is still open produces nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsv4 import caches
from dsv4.layers.norms import rms_norm
from dsv4.layers.rope import apply_rope

_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class CompressorSpec:
  ratio: int
  width: int           # output width w (head_dim for KV, index head_dim for index keys)
  overlap: bool        # V4 CSA: width 2m windows, stride m (projections are 2w wide: A | B halves)
  gated: bool          # softmax-gated pooling (False only for V4.1 ratio 1)
  position_bias: bool  # V4 `ape`


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepContext:
  """Per-step addressing shared by all layers."""
  pos_BxT: jax.Array
  valid_BxT: jax.Array
  start_B: jax.Array
  end_B: jax.Array          # start + num_tokens
  swa_table_BxS: jax.Array
  full_table_BxF: jax.Array
  swa_block_tokens: int = dataclasses.field(metadata=dict(static=True))
  full_block_tokens: int = dataclasses.field(metadata=dict(static=True))

  def token_slots(self):
    return caches.slots_for(self.swa_table_BxS, self.pos_BxT, self.swa_block_tokens, self.valid_BxT)


def project(p, x_BxTxD, spec: CompressorSpec, pos_BxT):
  """Raw per-token projections: a (kv) and z (score, with the position bias), fp32."""
  a = jnp.dot(x_BxTxD.astype(jnp.float32), p["wkv"].astype(jnp.float32), precision=_HI)
  if not spec.gated:
    return a, None
  z = jnp.dot(x_BxTxD.astype(jnp.float32), p["wgate"].astype(jnp.float32), precision=_HI)
  if spec.position_bias:
    z = z + p["ape"].astype(jnp.float32)[pos_BxT % spec.ratio]
  return a, z


def _emit_slots(ctx: StepContext, entry_BxE, ratio: int):
  """Full-group pool rows for entries that complete inside this chunk; -1 otherwise."""
  last_tok = entry_BxE * ratio + ratio - 1
  emitted = (entry_BxE >= 0) & (last_tok >= ctx.start_B[:, None]) & (last_tok < ctx.end_B[:, None])
  return caches.slots_for(ctx.full_table_BxF, entry_BxE, ctx.full_block_tokens // ratio, emitted)


def compress_step(p, x_BxTxD, spec: CompressorSpec, ctx: StepContext, state: dict | None, out_pool,
                  inv_freq, eps: float, state_prefix: str = "comp_state", return_latent: bool = False,
                  quantize_rows=None):
  """Runs one chunk through a compressor. Returns (updated state pools {name: pool}, new out pool), plus, with
  `return_latent`, (pre-RoPE latent [B,E,w], entry ids [B,E], full-group slots [B,E] (-1: not emitted)) of the
  entries considered in this chunk: V4.1 derives its index keys from that latent (spec §2.4). `quantize_rows`
  (V4.1 quantized cache) is applied to the post-RoPE rows before they are stored."""
  q_rows = quantize_rows or (lambda r: r)
  m, w = spec.ratio, spec.width
  a, z = project(p, x_BxTxD, spec, ctx.pos_BxT)

  if not spec.gated or m == 1:
    # Ratio 1: every token is its own entry, no pooling state.
    entry = ctx.pos_BxT
    latent = rms_norm(a, p["norm"], eps)
    rows = q_rows(apply_rope(latent, entry * m, inv_freq))
    slots = _emit_slots(ctx, jnp.where(ctx.valid_BxT, entry, -1), m)
    if return_latent:
      return {}, caches.write_rows(out_pool, slots, rows), (latent, entry, slots)
    return {}, caches.write_rows(out_pool, slots, rows)

  kv_name, score_name = f"{state_prefix}_kv", f"{state_prefix}_score"
  tok_slots = ctx.token_slots()
  state = {kv_name: state[kv_name], score_name: state[score_name]}
  state[kv_name] = caches.write_rows(state[kv_name], tok_slots, a)
  state[score_name] = caches.write_rows(state[score_name], tok_slots, z)

  # Rows from the start of the earliest window that can complete in this chunk (minus one window if overlapping)
  # to the end of the chunk. Static length: the chunk plus up to 2m - 1 earlier rows, rounded up to windows.
  B, T = ctx.pos_BxT.shape
  lead = 2 * m if spec.overlap else m
  t_ext = -(-(T + lead - 1) // m) * m
  base_B = (ctx.start_B // m) * m - (m if spec.overlap else 0)
  ext_pos = base_B[:, None] + jnp.arange(t_ext)[None, :]
  ext_ok = (ext_pos >= 0) & (ext_pos < ctx.end_B[:, None])
  ext_slots = caches.slots_for(ctx.swa_table_BxS, ext_pos, ctx.swa_block_tokens, ext_ok)
  kv_rows, ok_kv = caches.read_rows(state[kv_name], ext_slots)
  sc_rows, _ = caches.read_rows(state[score_name], ext_slots)
  kv_rows = jnp.where(ok_kv[..., None], kv_rows, 0.0)
  sc_rows = jnp.where(ok_kv[..., None], sc_rows, -jnp.inf)

  nw = t_ext // m
  kv_w = kv_rows.reshape(B, nw, m, -1)
  sc_w = sc_rows.reshape(B, nw, m, -1)
  first_entry_B = base_B // m
  if spec.overlap:
    # Entry n pools window n-1's A halves and window n's B halves over 2m slots.
    kv_w = jnp.concatenate([kv_w[:, :-1, :, :w], kv_w[:, 1:, :, w:]], axis=2)
    sc_w = jnp.concatenate([sc_w[:, :-1, :, :w], sc_w[:, 1:, :, w:]], axis=2)
    first_entry_B = first_entry_B + 1
  n_entries = kv_w.shape[1]
  any_ok = jnp.any(jnp.isfinite(sc_w), axis=2, keepdims=True)
  probs = jax.nn.softmax(jnp.where(any_ok, sc_w, 0.0), axis=2)
  pooled = jnp.sum(jnp.where(any_ok, probs, 0.0) * kv_w, axis=2)          # [B, E, w]
  entry_BxE = first_entry_B[:, None] + jnp.arange(n_entries)[None, :]
  latent = rms_norm(pooled, p["norm"], eps)
  rows = q_rows(apply_rope(latent, entry_BxE * m, inv_freq))
  slots = _emit_slots(ctx, entry_BxE, m)
  if return_latent:
    return state, caches.write_rows(out_pool, slots, rows), (latent, entry_BxE, slots)
  return state, caches.write_rows(out_pool, slots, rows)
