"""Lightning indexer: scores sum_h w_h * ReLU(q_h . k) over paged index keys, visibility mask, top-k.

Contract:
  q_BxTxHxC       indexer queries (RoPE'd), w_BxTxH head weights (scale already folded in).
  key_pool_PxC    the layer's index-key pool, flat rows.
  key_rows_BxM    pool row of entry m of sequence b (-1 = not allocated).
  num_visible_BxT entries 0..num_visible-1 are visible to the query (causality).
  allowed_BxTxM   optional extra restriction (V4.1 candidate blocks).
Scores are -inf where not visible / not allowed. Top-k returns entry ids (0..M-1) with -1 for picks that are not
visible; only the set matters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def indexer_scores_reference(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM=None):
  P = key_pool_PxC.shape[0]
  keys_BxMxC = jnp.take(key_pool_PxC, jnp.clip(key_rows_BxM, 0, P - 1), axis=0).astype(jnp.float32)
  dots = jnp.einsum("bthc,bmc->bthm", q_BxTxHxC.astype(jnp.float32), keys_BxMxC,
                    precision=jax.lax.Precision.HIGHEST)
  s_BxTxM = jnp.einsum("bthm,bth->btm", jax.nn.relu(dots), w_BxTxH.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
  M = key_rows_BxM.shape[1]
  visible = (jnp.arange(M)[None, None, :] < num_visible_BxT[..., None])
  visible &= ((key_rows_BxM >= 0) & (key_rows_BxM < P))[:, None, :]
  if allowed_BxTxM is not None:
    visible &= allowed_BxTxM
  return jnp.where(visible, s_BxTxM, -jnp.inf)


def topk_from_scores(scores_BxTxM, k: int):
  """Top-k entry ids; -1 where the picked score is -inf (fewer than k visible)."""
  k_eff = min(k, scores_BxTxM.shape[-1])
  vals, ids = jax.lax.top_k(scores_BxTxM, k_eff)
  return jnp.where(jnp.isfinite(vals), ids, -1).astype(jnp.int32), vals


def indexer_topk_reference(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, k: int,
                           allowed_BxTxM=None):
  scores = indexer_scores_reference(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT,
                                    allowed_BxTxM)
  ids, _ = topk_from_scores(scores, k)
  return ids, scores
