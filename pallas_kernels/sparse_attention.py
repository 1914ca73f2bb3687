"""Sparse MLA attention over a window pool and a compressed pool, with a per-head sink.

Contract (shared by the reference and every kernel):
  q_NxHxD        queries (N flattened query tokens), already RoPE'd.
  window_pool_PxD, window_idx_NxW   rows of the SWA pool each query attends to (-1 = none).
  comp_pool_QxD,   comp_idx_NxK     rows of the compressed pool (top-k picks, or all visible HCA entries; -1 = none).
  sink_H         one logit per head, added to the softmax denominator only.
Returns out_NxHxD = sum_j p_j v_j with p = exp(s_j) / (sum_j exp(s_j) + exp(sink)), and lse_NxH = log sum_j exp(s_j)
over the real keys only (the sink is not included; -inf when a row has no valid key). K = V (one shared latent).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _gather_rows(pool_PxD, idx_NxK):
  valid = idx_NxK >= 0
  rows = jnp.take(pool_PxD, jnp.clip(idx_NxK, 0, pool_PxD.shape[0] - 1), axis=0)
  return rows, valid & (idx_NxK < pool_PxD.shape[0])


def sparse_attention_reference(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H,
                               *, scale: float):
  """Plain-XLA reference. fp32 softmax; inputs may be bf16 or fp32."""
  kv, valid = _gather_rows(window_pool_PxD, window_idx_NxW)
  if comp_pool_QxD is not None and comp_idx_NxK is not None and comp_idx_NxK.shape[-1] > 0:
    ckv, cvalid = _gather_rows(comp_pool_QxD, comp_idx_NxK)
    kv = jnp.concatenate([kv, ckv.astype(kv.dtype)], axis=1)
    valid = jnp.concatenate([valid, cvalid], axis=1)
  kv = kv.astype(jnp.float32)
  s_NxHxK = jnp.einsum("nhd,nkd->nhk", q_NxHxD.astype(jnp.float32), kv,
                       precision=jax.lax.Precision.HIGHEST) * scale
  s_NxHxK = jnp.where(valid[:, None, :], s_NxHxK, -jnp.inf)
  m = jnp.max(s_NxHxK, axis=-1)
  sink = sink_H.astype(jnp.float32)[None, :]
  m_all = jnp.maximum(m, sink)
  p = jnp.exp(s_NxHxK - m_all[..., None])
  denom_keys = jnp.sum(p, axis=-1)
  denom = denom_keys + jnp.exp(sink - m_all)
  out = jnp.einsum("nhk,nkd->nhd", p, kv, precision=jax.lax.Precision.HIGHEST) / denom[..., None]
  lse = jnp.where(denom_keys > 0, jnp.log(jnp.maximum(denom_keys, 1e-37)) + m_all, -jnp.inf)
  return out.astype(q_NxHxD.dtype), lse
