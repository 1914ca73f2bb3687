"""Lightning indexer: scores sum_h w_h * ReLU(q_h . k) over paged index keys, visibility mask, top-k.

Contract:
  q_BxTxHxC       indexer queries (RoPE'd), w_BxTxH head weights (scale already folded in).
  key_pool_PxC    the layer's index-key pool, flat rows.
  key_rows_BxM    pool row of entry m of sequence b (-1 = not allocated): an int [B, M] list, or `PagedRows` (the
                  block table as the engine keeps it, [S, F], and each sequence's row of it; M = F * E), which the
                  kernels read in place, a block of table words per step, never building the [B, M] list.
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

from pallas_kernels import word_pool as _word_pool


@jax.tree_util.register_pytree_node_class
class PagedRows:
  """Entry lists through a block table: entry m of sequence b lives at pool row
  table_SxF[rows_B[b], m // E] * E + m % E (E = entries_per_block, static), -1 where the block is -1 or rows_B[b]
  is outside the table. Stands in for key_rows_BxM ([B, M], M = F * E: `shape` says so) so that a caller with the
  engine's [slots, max_model_len / block] table passes it as it is."""

  def __init__(self, table_SxF, rows_B, entries_per_block: int):
    self.table_SxF, self.rows_B, self.entries_per_block = table_SxF, rows_B, int(entries_per_block)

  def tree_flatten(self):
    return (self.table_SxF, self.rows_B), self.entries_per_block

  @classmethod
  def tree_unflatten(cls, entries_per_block, leaves):
    return cls(*leaves, entries_per_block)

  @property
  def shape(self):
    return (self.rows_B.shape[0], self.table_SxF.shape[1] * self.entries_per_block)

  @property
  def dtype(self):
    return jnp.dtype(jnp.int32)

  def pool_rows(self, ent_BxK):
    """Pool rows [B, K] of entry ids (-1 for ids < 0 or >= M, no block, or a row outside the table); reads only
    the table words the ids name."""
    S, F = self.table_SxF.shape
    E = self.entries_per_block
    rows = self.rows_B.astype(jnp.int32)
    ok = (ent_BxK >= 0) & (ent_BxK < F * E) & ((rows >= 0) & (rows < S))[:, None]
    blk = self.table_SxF.astype(jnp.int32)[jnp.clip(rows, 0, S - 1)[:, None], jnp.clip(ent_BxK // E, 0, F - 1)]
    return jnp.where(ok & (blk >= 0), blk * E + ent_BxK % E, -1).astype(jnp.int32)

  def as_rows(self):
    """The [B, M] entry list (the references' form)."""
    B, M = self.shape
    return self.pool_rows(jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32)[None, :], (B, M)))


def entry_rows_list(key_rows_BxM):
  """key_rows_BxM as an int [B, M] list (`PagedRows` expanded; the references read it whole)."""
  return key_rows_BxM.as_rows() if isinstance(key_rows_BxM, PagedRows) else key_rows_BxM


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
  key_rows_BxM = entry_rows_list(key_rows_BxM)
  P = key_pool_PxC.shape[0]
  keys_BxMxC = _word_pool.take(key_pool_PxC, jnp.clip(key_rows_BxM, 0, P - 1)).astype(jnp.float32)
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


def _table_words(table_ref, row, col, mask):
  """Words table[row, col] (col [n]) where mask, else -1: a masked gather from the table left in memory."""
  rowv = jnp.full(col.shape, row, jnp.int32)
  col = jnp.where(mask, col, 0)
  if _pl_triton is None:  # pragma: no cover
    return jnp.where(mask, table_ref[rowv, col], -1)
  return _pl_triton.load(table_ref.at[rowv, col], mask=mask, other=-1)


def _indexer_kernel(*refs, has_allowed, P, H, block_t, block_m, skip_invisible, cdtype, M, epb):
  """epb > 0: the entry list is a block table (refs: the sequence's row [1], the whole table [S, F]) and entry m's
  pool row is table[row, m // epb] * epb + m % epb; else an entry-list block [block_m]."""
  it = iter(refs)
  q_ref, w_ref = next(it), next(it)
  rows_ref = next(it)
  table_ref = next(it) if epb else None
  nv_ref, pool_ref = next(it), next(it)
  allowed_ref = next(it) if has_allowed else None
  o_ref = next(it)
  m0 = pl.program_id(2) * block_m
  nv = nv_ref[...]

  def compute():
    if epb:  # this tile's table words of the sequence's row (entries past the visible ones are not read)
      ent1 = m0 + jax.lax.broadcasted_iota(jnp.int32, (block_m,), 0)
      inb = (ent1 < M) & (ent1 < jnp.max(nv))
      blk = _table_words(table_ref, jnp.sum(rows_ref[...]), ent1 // epb, inb)
      rows = jnp.where(inb & (blk >= 0), blk * epb + ent1 % epb, -1)
    else:
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


def paged_table_args(key_rows: PagedRows, nv_BxT):
  """(each sequence's row [B, 1], the table int32 [S, F], nv with 0 for a sequence whose row is outside the
  table): what the kernels take for a `PagedRows` entry list. Nothing here is [B, F]."""
  S = key_rows.table_SxF.shape[0]
  rows = key_rows.rows_B.astype(jnp.int32)
  ok = (rows >= 0) & (rows < S)
  return (jnp.where(ok, rows, 0)[:, None], key_rows.table_SxF.astype(jnp.int32),
          jnp.where(ok[:, None], nv_BxT, 0))


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
  paged = isinstance(key_rows_BxM, PagedRows)
  assert H & (H - 1) == 0, "indexer heads must be a power of two"
  bt = t.block_t or max(1, 128 // H)
  bt = min(bt, 1 << max(0, (T - 1).bit_length()))
  bm = t.block_m
  Tp, Mp = -(-T // bt) * bt, -(-M // bm) * bm
  cdtype = q_BxTxHxC.dtype if q_BxTxHxC.dtype in (jnp.float32, jnp.bfloat16, jnp.float16) else jnp.bfloat16

  q = jnp.pad(q_BxTxHxC, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).reshape(B, Tp * H, C)
  w = jnp.pad(w_BxTxH.astype(jnp.float32), ((0, 0), (0, Tp - T), (0, 0))).reshape(B, Tp * H)
  nv = jnp.pad(num_visible_BxT.astype(jnp.int32), ((0, 0), (0, Tp - T)))
  args = [q, w]
  in_specs = [pl.BlockSpec((None, bt * H, C), lambda b, i, j: (b, i, 0)),
              pl.BlockSpec((None, bt * H), lambda b, i, j: (b, i))]
  if paged:  # the table whole, as the caller keeps it; each program reads its sequence's row in place
    row_Bx1, table, nv = paged_table_args(key_rows_BxM, nv)
    args += [row_Bx1, table]
    in_specs += [pl.BlockSpec((None, 1), lambda b, i, j: (b, 0)), pl.BlockSpec(table.shape, lambda b, i, j: (0, 0))]
  else:
    args.append(jnp.pad(key_rows_BxM.astype(jnp.int32), ((0, 0), (0, Mp - M)), constant_values=-1))
    in_specs.append(pl.BlockSpec((None, bm), lambda b, i, j: (b, j)))
  args += [nv, key_pool_PxC]
  in_specs += [pl.BlockSpec((None, bt), lambda b, i, j: (b, i)),
               pl.BlockSpec(key_pool_PxC.shape, lambda b, i, j: (0, 0))]
  if allowed_BxTxM is not None:
    allowed = jnp.pad(allowed_BxTxM.astype(jnp.int8), ((0, 0), (0, Tp - T), (0, Mp - M)))
    args.append(allowed)
    in_specs.append(pl.BlockSpec((None, bt, bm), lambda b, i, j: (b, i, j)))
  kernel = functools.partial(_indexer_kernel, has_allowed=allowed_BxTxM is not None, P=P, H=H, block_t=bt,
                             block_m=bm, skip_invisible=t.skip_invisible, cdtype=cdtype, M=M,
                             epb=key_rows_BxM.entries_per_block if paged else 0)
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
