"""Lightning indexer: scores sum_h w_h * ReLU(q_h . k) over paged index keys, visibility mask, top-k.

Contract:
  q_BxTxHxC       indexer queries (RoPE'd), w_BxTxH head weights (scale already folded in).
  key_pool_PxC    the layer's index-key pool, flat rows.
  key_rows_BxM    pool row of entry m of sequence b (-1 = not allocated).
  num_visible_BxT entries 0..num_visible-1 are visible to the query (causality).
  allowed_BxTxM   optional extra restriction (V4.1 candidate blocks).
  num_keys_B      optional int [B]: only entries 0..num_keys_B[b]-1 of sequence b are live (the live length of the
                  sequence's index keys, e.g. its context // ratio); entries beyond are invisible and kernels never
                  read their rows or score them (cost O(live entries), not O(M)). None = all M entries.
Scores are -inf where not visible / not allowed. Top-k returns entry ids (0..M-1) with -1 for picks that are not
visible; only the set matters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_num_keys(num_keys_B, B):
  if num_keys_B is None:
    return
  if tuple(num_keys_B.shape) != (B,) or not jnp.issubdtype(num_keys_B.dtype, jnp.integer):
    raise ValueError(f"num_keys_B must be an integer array of shape ({B},), got "
                     f"{num_keys_B.dtype}{tuple(num_keys_B.shape)}")


def effective_visible(num_visible_BxT, num_keys_B):
  """Entries 0..n-1 visible to each query, with the per-sequence live length applied."""
  if num_keys_B is None:
    return num_visible_BxT
  return jnp.minimum(num_visible_BxT, jnp.asarray(num_keys_B, num_visible_BxT.dtype)[:, None])


def indexer_scores_reference(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM=None,
                             num_keys_B=None):
  check_num_keys(num_keys_B, q_BxTxHxC.shape[0])
  num_visible_BxT = effective_visible(num_visible_BxT, num_keys_B)
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
                           allowed_BxTxM=None, num_keys_B=None):
  scores = indexer_scores_reference(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT,
                                    allowed_BxTxM, num_keys_B)
  ids, _ = topk_from_scores(scores, k)
  return ids, scores


# ----------------------------------------------------------------------------------------------------------------
# V4.1 candidate blocks: blocked <-> dense representation of `allowed_BxTxM`.
# ----------------------------------------------------------------------------------------------------------------


def candidate_blocks_to_allowed(block_ids_BxTxC, M: int, block_size: int = 8):
  """Dense allowed mask [B,T,M] from candidate block ids [B,T,C] (-1 / out of range = no block)."""
  nb = -(-M // block_size)
  valid = (block_ids_BxTxC >= 0) & (block_ids_BxTxC < nb)
  hit = (block_ids_BxTxC[..., None] == jnp.arange(nb)[None, None, None, :]) & valid[..., None]
  blk_BxTxNb = jnp.any(hit, axis=2)
  return jnp.repeat(blk_BxTxNb, block_size, axis=-1)[..., :M]


# ----------------------------------------------------------------------------------------------------------------
# Pallas kernel: scores only (top-k stays `topk_from_scores`, applied by the dispatcher's caller).
# ----------------------------------------------------------------------------------------------------------------

import dataclasses  # noqa: E402
import functools  # noqa: E402

from jax.experimental import pallas as pl  # noqa: E402

try:  # Pallas-Triton (deprecated in JAX 0.11, still shipped); see BUILD_NOTES.md, Kernels.
  from jax.experimental.pallas import triton as _pl_triton
except ImportError:  # pragma: no cover
  _pl_triton = None


@dataclasses.dataclass(frozen=True)
class IndexerTuning:
  """block_t: query tokens per program (0 = auto: block_t * H ~ 128 rows for the dot);
  block_m: index entries per program (power of two)."""
  block_t: int = 0
  block_m: int = 64
  num_warps: int = 4
  num_stages: int = 2
  skip_invisible: bool = True

  def __post_init__(self):
    for name in ("block_t", "block_m"):
      v = getattr(self, name)
      if v < 0 or (v and v & (v - 1)):
        raise ValueError(f"{name} must be a power of two (or 0 for block_t), got {v}")
    if self.block_m == 0:
      raise ValueError("block_m must be > 0")


def _indexer_kernel(*refs, has_allowed, P, H, block_t, block_m, skip_invisible, cdtype):
  if has_allowed:
    q_ref, w_ref, rows_ref, nv_ref, pool_ref, allowed_ref, o_ref = refs
  else:
    q_ref, w_ref, rows_ref, nv_ref, pool_ref, o_ref = refs
    allowed_ref = None
  m0 = pl.program_id(2) * block_m
  nv = nv_ref[...]

  def compute():
    rows = rows_ref[...]
    valid_row = (rows >= 0) & (rows < P)
    safe = jnp.where(valid_row, rows, 0)
    C = pool_ref.shape[1]
    r2 = jnp.broadcast_to(safe[:, None], (block_m, C))
    c2 = jax.lax.broadcasted_iota(jnp.int32, (block_m, C), 1)
    m2 = jnp.broadcast_to(valid_row[:, None], (block_m, C))
    if _pl_triton is None:  # pragma: no cover
      keys = jnp.where(m2, pool_ref[r2, c2], jnp.zeros((), pool_ref.dtype))
    else:  # masked: rows behind invalid ids are never read (zeros)
      keys = _pl_triton.load(pool_ref.at[r2, c2], mask=m2, other=jnp.zeros((), pool_ref.dtype))
    keys = keys.astype(cdtype)  # [bm, C]
    prec = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST) if cdtype == jnp.float32 else None  # not TF32
    s = jax.lax.dot_general(q_ref[...].astype(cdtype), keys, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32, precision=prec)  # [bt*H, bm]
    s = jnp.maximum(s, 0.0) * w_ref[...].astype(jnp.float32)[:, None]
    s = jnp.sum(s.reshape(block_t, H, block_m), axis=1)  # [bt, bm]
    ent = m0 + jax.lax.broadcasted_iota(jnp.int32, (block_t, block_m), 1)
    vis = (ent < nv[:, None]) & valid_row[None, :]
    if allowed_ref is not None:
      vis = vis & (allowed_ref[...] != 0)
    return jnp.where(vis, s, -jnp.inf)

  if skip_invisible:
    o_ref[...] = jax.lax.cond(m0 < jnp.max(nv), compute,
                              lambda: jnp.full((block_t, block_m), -jnp.inf, jnp.float32))
  else:
    o_ref[...] = compute()


@functools.partial(jax.jit, static_argnames=("interpret", "tuning"))
def indexer_scores_pallas(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM=None,
                          num_keys_B=None, *, interpret: bool = False, tuning: IndexerTuning | None = None):
  """Pallas (Triton-GPU) kernel with the contract of `indexer_scores_reference`. num_keys_B is folded into the
  per-query visible count, so tiles past a sequence's live length are skipped (never read)."""
  t = tuning or IndexerTuning()
  B, T, H, C = q_BxTxHxC.shape
  check_num_keys(num_keys_B, B)
  num_visible_BxT = effective_visible(num_visible_BxT, num_keys_B)
  P = key_pool_PxC.shape[0]
  M = key_rows_BxM.shape[1]
  assert H & (H - 1) == 0, "indexer heads must be a power of two"
  bt = t.block_t or max(1, 128 // H)
  bt = min(bt, 1 << max(0, (T - 1).bit_length()))
  bm = t.block_m
  Tp, Mp = -(-T // bt) * bt, -(-M // bm) * bm
  cdtype = q_BxTxHxC.dtype if q_BxTxHxC.dtype in (jnp.float32, jnp.bfloat16, jnp.float16) else jnp.bfloat16

  q = jnp.pad(q_BxTxHxC, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).reshape(B, Tp * H, C)
  w = jnp.pad(w_BxTxH.astype(jnp.float32), ((0, 0), (0, Tp - T), (0, 0))).reshape(B, Tp * H)
  rows = jnp.pad(key_rows_BxM.astype(jnp.int32), ((0, 0), (0, Mp - M)), constant_values=-1)
  nv = jnp.pad(num_visible_BxT.astype(jnp.int32), ((0, 0), (0, Tp - T)))
  args = [q, w, rows, nv, key_pool_PxC]
  in_specs = [pl.BlockSpec((None, bt * H, C), lambda b, i, j: (b, i, 0)),
              pl.BlockSpec((None, bt * H), lambda b, i, j: (b, i)),
              pl.BlockSpec((None, bm), lambda b, i, j: (b, j)),
              pl.BlockSpec((None, bt), lambda b, i, j: (b, i)),
              pl.BlockSpec(key_pool_PxC.shape, lambda b, i, j: (0, 0))]
  if allowed_BxTxM is not None:
    allowed = jnp.pad(allowed_BxTxM.astype(jnp.int8), ((0, 0), (0, Tp - T), (0, Mp - M)))
    args.append(allowed)
    in_specs.append(pl.BlockSpec((None, bt, bm), lambda b, i, j: (b, i, j)))
  kernel = functools.partial(_indexer_kernel, has_allowed=allowed_BxTxM is not None, P=P, H=H, block_t=bt,
                             block_m=bm, skip_invisible=t.skip_invisible, cdtype=cdtype)
  compiler_params = None
  if _pl_triton is not None:
    compiler_params = _pl_triton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)
  out = pl.pallas_call(
      kernel, grid=(B, Tp // bt, Mp // bm), in_specs=in_specs,
      out_specs=pl.BlockSpec((None, bt, bm), lambda b, i, j: (b, i, j)),
      out_shape=jax.ShapeDtypeStruct((B, Tp, Mp), jnp.float32),
      compiler_params=compiler_params, interpret=interpret, name="dsv4_indexer_scores")(*args)
  return out[:, :T, :M]


def indexer_scores_kernel(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM=None, *,
                          num_keys_B=None, interpret: bool = False, tuning: IndexerTuning | None = None):
  """Dispatcher entry point (registered as "indexer_scores")."""
  return indexer_scores_pallas(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM,
                               num_keys_B, interpret=interpret, tuning=tuning)


KERNELS = {"indexer_scores": indexer_scores_kernel}
