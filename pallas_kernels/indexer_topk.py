"""Streaming Lightning-indexer kernel with a fused top-k: writes only the k picked entry ids.

Contract: `indexer_topk_reference` = `topk_from_scores(indexer_scores_reference(...), k)` (the set of ids; -1 for picks
that are not visible), with the same arguments as `indexer_scores` (num_visible, optional allowed mask, optional
num_keys_B), plus two options the kernel can use to skip work:
  * FP8 index keys (`Fp8IndexKeys`: e4m3 [P, C] with one f32 scale per row); since ReLU(s x) = s ReLU(x) for s > 0,
    the row scale multiplies the [heads, entries] dot result, never the keys.
  * V4.1 candidate restriction by block ids (`candidate_blocks_BxTxC`, block_size entries per block, -1 = none):
    the kernel scores only the entries of the candidate blocks (cost O(candidates x block_size), not O(M)).
  * the entry list as a block table (`indexer.PagedRows`: the [S, F] table as the caller keeps it and each
    sequence's row): a program gathers the words of its sequence's row that its steps visit (only up to the
    tile's visible count), so no [B, M] list is built and the cost follows the visible context.

Kernel (Pallas-Triton): grid (B, T / block_t, chunks). A program holds its block_t x H queries (q, weights) in
registers for the whole loop, walks the live entries of its chunk block_m at a time (gathering key rows by id with
masked loads, one [block_t * H, C] x [C, block_m] dot, ReLU, head-weighted sum), and keeps the chunk's scores on chip
([block_t, chunk] in registers). The top-k is then selected on chip by a 32-step radix (bitwise binary) search for
the k-th largest score on the order-preserving integer image of the f32 scores, ties at the cut broken by entry
order, and the picked ids are compacted with a prefix sum and stored. With one chunk (M <= select_chunk) nothing but
the k ids leaves the chip; with several, each chunk writes its k candidates (ids + scores) and a small XLA top_k
merges them (n_chunks x k values instead of M scores).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import fp8 as _fp8
from pallas_kernels import indexer as _ix
from pallas_kernels import sparse_attention as _sa

try:  # Pallas-Triton (deprecated in JAX 0.11, still shipped); see BUILD_NOTES.md, Kernels.
  from jax.experimental.pallas import triton as _pl_triton
except ImportError:  # pragma: no cover
  _pl_triton = None

_INT_MIN = -(2 ** 31)


class Fp8IndexKeys(NamedTuple):
  """FP8 index-key pool (a pytree): keys e4m3 [P, C], scale f32 [P] (row r = keys[r] * scale[r])."""
  keys: jax.Array
  scale: jax.Array

  @property
  def shape(self):
    return self.keys.shape

  @property
  def bytes_per_row(self) -> int:
    return self.keys.shape[1] + 4


def quantize_index_keys(k_PxC) -> Fp8IndexKeys:
  """Per-row symmetric e4m3 quantization (amax -> 448)."""
  k = k_PxC.astype(jnp.float32)
  amax = jnp.max(jnp.abs(k), axis=-1)
  s = jnp.where(amax > 0, amax / 448.0, 1.0)
  return Fp8IndexKeys((k / s[:, None]).astype(jnp.float8_e4m3fn), s.astype(jnp.float32))


def dequantize_index_keys(pool: Fp8IndexKeys, dtype=jnp.float32):
  return (pool.keys.astype(jnp.float32) * pool.scale[:, None]).astype(dtype)


def quantize_index_queries(q_BxTxHxC, w_BxTxH):
  """FP8 queries for the FP8 x FP8 dot (`IndexerTopkTuning(fp8_query=True)`): per (query, head) symmetric e4m3
  (amax -> 448), the scale folded into the head weight, since w ReLU(s x) = (w s) ReLU(x) for s > 0. Returns
  (q e4m3, w f32, q dequantized f32): the kernel's answer with fp8_query is the reference's on the dequantized q."""
  q = q_BxTxHxC.astype(jnp.float32)
  amax = jnp.max(jnp.abs(q), axis=-1)
  s = jnp.where(amax > 0, amax / 448.0, 1.0)
  q8 = (q / s[..., None]).astype(jnp.float8_e4m3fn)
  return q8, w_BxTxH.astype(jnp.float32) * s, q8.astype(jnp.float32) * s[..., None]


def candidate_entries(block_ids_BxTxC, M: int, block_size: int):
  """Entry ids [B, T, C * block_size] of the candidate blocks (-1 for invalid, out-of-range or repeated blocks, so
  every entry appears at most once, as in the dense `allowed` mask)."""
  nb = -(-M // block_size)
  ids = block_ids_BxTxC.astype(jnp.int32)
  ok = (ids >= 0) & (ids < nb)
  C = ids.shape[-1]
  earlier = jnp.tril(jnp.ones((C, C), bool), -1)
  dup = jnp.any((ids[..., :, None] == ids[..., None, :]) & earlier & ok[..., None, :], axis=-1)
  ok &= ~dup
  ent = ids[..., None] * block_size + jnp.arange(block_size, dtype=jnp.int32)
  ent = jnp.where(ok[..., None] & (ent < M), ent, -1)
  return ent.reshape(*ids.shape[:-1], C * block_size)


def indexer_topk_reference(q_BxTxHxC, w_BxTxH, key_pool, key_rows_BxM, num_visible_BxT, k: int, allowed_BxTxM=None,
                           num_keys_B=None, candidate_blocks_BxTxC=None, block_size: int = 8):
  """Reference ids [B, T, min(k, M)] (-1 = no visible pick)."""
  if isinstance(key_pool, Fp8IndexKeys):
    key_pool = dequantize_index_keys(key_pool)
  M = key_rows_BxM.shape[1]
  if candidate_blocks_BxTxC is not None:
    cand = _ix.candidate_blocks_to_allowed(candidate_blocks_BxTxC, M, block_size)
    allowed_BxTxM = cand if allowed_BxTxM is None else allowed_BxTxM & cand
  scores = _ix.indexer_scores_reference(q_BxTxHxC, w_BxTxH, key_pool, key_rows_BxM, num_visible_BxT,
                                        allowed_BxTxM, num_keys_B)
  return _ix.topk_from_scores(scores, k)[0]


# ----------------------------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class IndexerTopkTuning:
  """block_t: queries per program (0 = auto: block_t * H ~ 64 MMA rows; 1 with candidate blocks).
  block_m: entries per inner step (power of two). select_chunk: entries whose scores one program keeps on chip
  (power of two; M above it is split into chunks merged by XLA).
  fp8_query: with FP8 keys, quantize q to e4m3 per (query, head) (`quantize_index_queries`) and score with an
  e4m3 x e4m3 dot (Hopper's FP8 tensor cores: twice the bf16 rate, for the compute-bound prefill indexer). Off by
  default: it rounds q to 3 mantissa bits, so picks can differ from the bf16-q reference at near-ties; its contract
  is the reference on the dequantized q. Needs C a multiple of 64 (two half-width dots of K >= 32)."""
  block_t: int = 0
  block_m: int = 64
  select_chunk: int = 4096
  num_warps: int = 8
  num_stages: int = 2
  fp8_query: bool = False
  debug: bool = False

  def __post_init__(self):
    for name in ("block_t", "block_m", "select_chunk"):
      v = getattr(self, name)
      if v < 0 or (v and v & (v - 1)) or (name != "block_t" and v == 0):
        raise ValueError(f"{name} must be a power of two (block_t may be 0 = auto), got {v}")
    if self.select_chunk < self.block_m:
      raise ValueError("select_chunk must be >= block_m")


def _sortable(x):
  """f32 -> int32 whose signed order is the float order (-inf lowest; no NaN here)."""
  b = jax.lax.bitcast_convert_type(x, jnp.int32)
  return jnp.where(b < 0, b ^ 0x7FFFFFFF, b)


def _gather(ref, r, c, m, other):
  if _pl_triton is None:  # pragma: no cover
    return jnp.where(m, ref[r, c], jnp.asarray(other, ref.dtype))
  return _pl_triton.load(ref.at[r, c], mask=m, other=jnp.asarray(other, ref.dtype))


def _topk_kernel(live_ref, *refs, **kw):
  """A sequence (batch row) at or past `live` (the step's dead tokens, one per row in the engine's call): the
  program returns, reading and writing nothing more."""
  chunk = pl.program_id(2)         # read here: interpret mode has no program ids inside the conditional

  @pl.when(pl.program_id(0) < _sa._pick(live_ref[...], 0))
  def _():
    _kernel(chunk, *refs, **kw)


def _kernel(chunk, *refs, H, C, P, bt, bm, nblk, k, kout, per_query, has_allowed, fp8, write_scores, cdtype, prec,
            epb):
  """epb > 0: the entry list is a block table (refs after the entry ids: the sequence's row [1], the whole table
  [S, F]); entry m's pool row is table[row, m // epb] * epb + m % epb, read a block of words per step."""
  it = iter(refs)
  q_ref, w_ref, nv_ref, ent_ref, rows_ref = next(it), next(it), next(it), next(it), next(it)
  table_ref = next(it) if epb else None
  allowed_ref = next(it) if has_allowed else None
  key_refs = (next(it), next(it)) if fp8 else (next(it),)
  ids_ref = next(it)
  sc_ref = next(it) if write_scores else None
  MC = nblk * bm

  # q [bt * H, C] (FP8: even channels then odd channels) is loaded once and held for the whole loop. An e4m3 q
  # (fp8_query) stays e4m3: the dots take e4m3 on both sides.
  fp8_dot = q_ref.dtype == jnp.float8_e4m3fn
  if fp8:
    q_lo = q_ref[:, pl.ds(0, C // 2)]
    q_hi = q_ref[:, pl.ds(C // 2, C // 2)]
    if not fp8_dot:
      q_lo, q_hi = q_lo.astype(cdtype), q_hi.astype(cdtype)
  else:
    q = q_ref[...].astype(cdtype)
  w = w_ref[...].astype(jnp.float32)  # [bt * H]
  nv = nv_ref[...]  # [bt] visible entries per query (num_keys applied)
  live = jnp.max(nv)

  row = jnp.sum(rows_ref[...]) if epb else None

  def body(j, s_all):
    if epb:  # this step's words of the sequence's own table row (only entries some query of the tile sees)
      ent1 = ent_ref[0, pl.ds(j * bm, bm)] if per_query else ent_ref[pl.ds(j * bm, bm)]
      inb = (ent1 >= 0) & (ent1 < live)
      blk = _ix._table_words(table_ref, row, ent1 // epb, inb)
      rows1 = jnp.where(inb & (blk >= 0), blk * epb + ent1 % epb, -1)
    elif per_query:  # [1, MC] blocks: this query's own entry list
      ent1, rows1 = ent_ref[0, pl.ds(j * bm, bm)], rows_ref[0, pl.ds(j * bm, bm)]
    else:
      ent1, rows1 = ent_ref[pl.ds(j * bm, bm)], rows_ref[pl.ds(j * bm, bm)]
    valid = (rows1 >= 0) & (rows1 < P) & (ent1 >= 0) & (ent1 < live)
    safe = jnp.where(valid, rows1, 0)
    if fp8:
      keys_ref, scale_ref = key_refs
      W = C // 2
      r2 = jnp.broadcast_to(safe[:, None], (bm, W))
      c2 = jax.lax.broadcasted_iota(jnp.int32, (bm, W), 1)
      words = _gather(keys_ref, r2, c2, jnp.broadcast_to(valid[:, None], (bm, W)), 0).astype(jnp.int32)
      # Dequant-free: the two e4m3 bytes of each word are converted (hardware cast on sm_90) straight to the dot's
      # input type, unscaled; the row scale multiplies the scores after the dot (ReLU(s x) = s ReLU(x), s > 0).
      # With fp8_query the bytes feed the e4m3 x e4m3 dot as they are (a bitcast, no conversion at all).
      k_lo, k_hi = _fp8.word_bytes_as_e4m3(words)
      if not fp8_dot:
        k_lo, k_hi = k_lo.astype(cdtype), k_hi.astype(cdtype)
      dn = (((1,), (1,)), ((), ()))
      dprec = None if fp8_dot else prec
      s = (jax.lax.dot_general(q_lo, k_lo, dn, preferred_element_type=jnp.float32, precision=dprec)
           + jax.lax.dot_general(q_hi, k_hi, dn, preferred_element_type=jnp.float32, precision=dprec))
      rs = _gather(scale_ref, safe, jnp.zeros_like(safe), valid, 0.0) if scale_ref.ndim == 2 else None
      s = s * rs[None, :]
    else:
      (pool_ref,) = key_refs
      r2 = jnp.broadcast_to(safe[:, None], (bm, C))
      c2 = jax.lax.broadcasted_iota(jnp.int32, (bm, C), 1)
      keys = _gather(pool_ref, r2, c2, jnp.broadcast_to(valid[:, None], (bm, C)), 0).astype(cdtype)
      s = jax.lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                              precision=prec)  # [bt * H, bm]
    s = jnp.maximum(s, 0.0) * w[:, None]
    s = jnp.sum(s.reshape(bt, H, bm), axis=1)  # [bt, bm]
    vis = valid[None, :] & (ent1[None, :] < nv[:, None])
    if allowed_ref is not None:
      vis = vis & (allowed_ref[:, pl.ds(j * bm, bm)] != 0)
    s = jnp.where(vis, s, -jnp.inf)
    # Keep the chunk's scores on chip: write block j into the [bt, nblk, bm] carry.
    blk = jax.lax.broadcasted_iota(jnp.int32, (bt, nblk, bm), 1)
    return jnp.where(blk == j, s[:, None, :], s_all)

  if per_query:
    stop = nblk
  else:  # the chunk's entries are first, first + 1, ...: stop at the tile's largest visible count
    first = chunk * MC
    stop = jnp.clip((live - first + bm - 1) // bm, 0, nblk)
  s_all = jax.lax.fori_loop(0, stop, body, jnp.full((bt, nblk, bm), -jnp.inf, jnp.float32))
  s_all = s_all.reshape(bt, MC)

  # Radix select: the k-th largest sortable key per query, one bit at a time from the top (unsigned image).
  key = _sortable(s_all)
  kk = min(k, MC)

  def bit_step(i, prefix_u):
    bit = jnp.left_shift(jnp.int32(1), 31 - i)
    cand_u = prefix_u | bit
    cnt = jnp.sum((key >= (cand_u ^ _INT_MIN)[:, None]).astype(jnp.int32), axis=1)
    return jnp.where(cnt >= kk, cand_u, prefix_u)

  thr = jax.lax.fori_loop(0, 32, bit_step, jnp.zeros((bt,), jnp.int32)) ^ _INT_MIN  # [bt]
  gt = key > thr[:, None]
  eq = key == thr[:, None]
  need = kk - jnp.sum(gt.astype(jnp.int32), axis=1)
  eq_i = eq.astype(jnp.int32)
  sel = gt | (eq & ((jnp.cumsum(eq_i, axis=1) - eq_i) < need[:, None]))
  sel_i = sel.astype(jnp.int32)
  slot = jnp.cumsum(sel_i, axis=1) - sel_i
  pos = jax.lax.broadcasted_iota(jnp.int32, (bt, MC), 1)
  # Exactly kk lanes are selected (the radix cut counts every lane, -inf ones too), so their slots 0 .. kk - 1 cover
  # the part of the block the caller reads, each written once; the rest is never read. No fill beforehand: on a GPU
  # a block store and a scatter store to the same addresses by different threads have no order without a barrier
  # (a -1 fill after the pick loses it: the H200 check saw this, interpret mode cannot). Unselected lanes are masked
  # off (never stored on GPU). Interpret mode discharges the masked store as gather, select, scatter: a masked lane
  # writes back what it read, so masked lanes may share trash slots (equal values) but must never land on a pick's
  # slot; they fold into kout trash slots past the picks, so the block is 2 x kout wide, not as wide as the chunk.
  dest = jnp.where(sel, slot, kout + pos % kout)
  row = jax.lax.broadcasted_iota(jnp.int32, (bt, MC), 0)
  ent_full = ent_ref[...] if per_query else ent_ref[...][None, :]  # [1, MC]
  out_ids = jnp.where(s_all > -jnp.inf, jnp.broadcast_to(ent_full, (bt, MC)), -1)
  if _pl_triton is None:  # pragma: no cover
    ids_ref[row, dest] = jnp.where(sel, out_ids, -1)
  else:
    _pl_triton.store(ids_ref.at[row, dest], out_ids, mask=sel)
  if sc_ref is not None:
    if _pl_triton is None:  # pragma: no cover
      sc_ref[row, dest] = jnp.where(sel, s_all, -jnp.inf)
    else:
      _pl_triton.store(sc_ref.at[row, dest], s_all, mask=sel)


def _next_pow2(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


def _fp8_words(keys_PxC):
  """e4m3 keys as uint16 words [P, C / 2] (channel 2i low byte, 2i+1 high byte): 2-byte elements keep JAX-Triton's
  32-bit offsets valid for every pool size (see fp8.py)."""
  return _fp8._to_u16(keys_PxC)


@functools.partial(jax.jit, static_argnames=("k", "block_size", "interpret", "tuning"))
def indexer_topk_pallas(q_BxTxHxC, w_BxTxH, key_pool, key_rows_BxM, num_visible_BxT, allowed_BxTxM=None,
                        num_keys_B=None, candidate_blocks_BxTxC=None, *, k: int, block_size: int = 8,
                        live=None, interpret: bool = False, tuning: IndexerTopkTuning | None = None):
  """Fused indexer + top-k with the contract of `indexer_topk_reference` (compare as sets; ties at the k-th score
  may be broken differently). live: optional int scalar; sequences b >= live may hold anything (their programs
  neither read nor write)."""
  t = tuning or IndexerTopkTuning()
  B, T, H, C = q_BxTxHxC.shape
  M = key_rows_BxM.shape[1]
  fp8 = isinstance(key_pool, Fp8IndexKeys)
  P = key_pool.shape[0]
  if H & (H - 1) or C % (32 if fp8 else 16):
    raise ValueError(f"indexer heads must be a power of two and the head dim a multiple of 16 (32 with FP8 keys), "
                     f"got H={H}, C={C}")
  _ix.check_num_keys(num_keys_B, B)
  nv = _ix.effective_visible(num_visible_BxT, num_keys_B).astype(jnp.int32)
  kk = min(k, M)
  cdtype = q_BxTxHxC.dtype if q_BxTxHxC.dtype in (jnp.float32, jnp.bfloat16, jnp.float16) else jnp.bfloat16
  prec = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST) if cdtype == jnp.float32 else None
  bm = t.block_m
  per_query = candidate_blocks_BxTxC is not None
  paged = isinstance(key_rows_BxM, _ix.PagedRows)
  if paged:  # the table whole, as the caller keeps it; each program reads its sequence's row in place
    row_Bx1, table, nv = _ix.paged_table_args(key_rows_BxM, nv)

  q, w = q_BxTxHxC, w_BxTxH
  if fp8 and t.fp8_query:
    if C % 64:
      raise ValueError(f"fp8_query needs the index head dim to be a multiple of 64, got {C}")
    q, w, _ = quantize_index_queries(q, w)
  if fp8:  # even channels, then odd: the two bytes of each uint16 word feed two half-width dots
    q = jnp.concatenate([q[..., 0::2], q[..., 1::2]], axis=-1)
  if per_query:
    bt = 1
    ent = candidate_entries(candidate_blocks_BxTxC, M, block_size)  # [B, T, E]
    E = ent.shape[-1]
    Ep = max(bm, _next_pow2(E))
    ent = jnp.pad(ent, ((0, 0), (0, 0), (0, Ep - E)), constant_values=-1)
    rows = None if paged else jnp.where(ent >= 0, jnp.take_along_axis(key_rows_BxM[:, None, :].astype(jnp.int32),
                                                                      jnp.maximum(ent, 0), axis=2), -1)
    MC, nchunks, Tp = Ep, 1, T
  else:
    bt = t.block_t or max(1, 64 // H)
    bt = min(bt, _next_pow2(T))
    Tp = -(-T // bt) * bt
    MC = min(t.select_chunk, max(bm, _next_pow2(M)))
    nchunks = -(-M // MC)
    Mp = nchunks * MC
    ent = jnp.where(jnp.arange(Mp) < M, jnp.arange(Mp, dtype=jnp.int32), -1)
    rows = None if paged else jnp.pad(key_rows_BxM.astype(jnp.int32), ((0, 0), (0, Mp - M)), constant_values=-1)
  kout = _next_pow2(kk)
  nblk = MC // bm
  qf = jnp.pad(q, ((0, 0), (0, Tp - T), (0, 0), (0, 0))).reshape(B, Tp * H, C)
  wf = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, Tp - T), (0, 0))).reshape(B, Tp * H)
  nvp = jnp.pad(nv, ((0, 0), (0, Tp - T)))

  live_1 = jnp.reshape(jnp.clip(jnp.asarray(B if live is None else live, jnp.int32), 0, B), (1,))
  args = [live_1, qf, wf, nvp]
  in_specs = [pl.BlockSpec((1,), lambda b, i, c: (0,)),
              pl.BlockSpec((None, bt * H, C), lambda b, i, c: (b, i, 0)),
              pl.BlockSpec((None, bt * H), lambda b, i, c: (b, i)),
              pl.BlockSpec((None, bt), lambda b, i, c: (b, i))]
  args.append(ent)
  in_specs.append(pl.BlockSpec((None, 1, MC), lambda b, i, c: (b, i, 0)) if per_query
                  else pl.BlockSpec((MC,), lambda b, i, c: (c,)))
  if paged:
    args += [row_Bx1, table]
    in_specs += [pl.BlockSpec((None, 1), lambda b, i, c: (b, 0)), pl.BlockSpec(table.shape, lambda b, i, c: (0, 0))]
  else:
    args.append(rows)
    in_specs.append(pl.BlockSpec((None, 1, MC), lambda b, i, c: (b, i, 0)) if per_query
                    else pl.BlockSpec((None, MC), lambda b, i, c: (b, c)))
  has_allowed = allowed_BxTxM is not None
  if has_allowed:
    if per_query:
      al = jnp.take_along_axis(allowed_BxTxM.astype(jnp.int8), jnp.maximum(ent, 0), axis=2)
      args.append(al)
      in_specs.append(pl.BlockSpec((None, 1, MC), lambda b, i, c: (b, i, 0)))
    else:
      al = jnp.pad(allowed_BxTxM.astype(jnp.int8), ((0, 0), (0, Tp - T), (0, nchunks * MC - M)))
      args.append(al)
      in_specs.append(pl.BlockSpec((None, bt, MC), lambda b, i, c: (b, i, c)))
  if fp8:
    words = _fp8_words(key_pool.keys)
    scale = key_pool.scale.astype(jnp.float32).reshape(P, 1)
    args += [words, scale]
    in_specs += [pl.BlockSpec(words.shape, lambda b, i, c: (0, 0)), pl.BlockSpec(scale.shape, lambda b, i, c: (0, 0))]
  else:
    args.append(key_pool)
    in_specs.append(pl.BlockSpec(key_pool.shape, lambda b, i, c: (0, 0)))

  write_scores = nchunks > 1
  W = 2 * kout  # k slots + kout trash slots for masked lanes (never written on GPU); a power of two
  out_shape = [jax.ShapeDtypeStruct((B, Tp, nchunks * W), jnp.int32)]
  out_specs = [pl.BlockSpec((None, bt, W), lambda b, i, c: (b, i, c))]
  if write_scores:
    out_shape.append(jax.ShapeDtypeStruct((B, Tp, nchunks * W), jnp.float32))
    out_specs.append(pl.BlockSpec((None, bt, W), lambda b, i, c: (b, i, c)))
  kernel = functools.partial(_topk_kernel, H=H, C=C, P=P, bt=bt, bm=bm, nblk=nblk, k=kk, kout=kout, per_query=per_query,
                             has_allowed=has_allowed, fp8=fp8, write_scores=write_scores, cdtype=cdtype, prec=prec,
                             epb=key_rows_BxM.entries_per_block if paged else 0)
  compiler_params = None
  if _pl_triton is not None:
    compiler_params = _pl_triton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)
  outs = pl.pallas_call(kernel, grid=(B, Tp // bt, nchunks), in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, compiler_params=compiler_params, interpret=interpret, debug=t.debug,
                        name="dsv4_indexer_topk")(*args)
  kc = min(kk, MC)        # the slots each chunk writes (one chunk: MC >= M, so all kk)
  ids = outs[0].reshape(B, Tp, nchunks, W)[:, :T, :, :kc]
  if not write_scores:
    return ids[:, :, 0]
  sc = outs[1].reshape(B, Tp, nchunks, W)[:, :T, :, :kc].reshape(B, T, nchunks * kc)
  ids = ids.reshape(B, T, nchunks * kc)
  vals, pick = jax.lax.top_k(sc, kk)
  return jnp.where(jnp.isfinite(vals), jnp.take_along_axis(ids, pick, axis=-1), -1).astype(jnp.int32)


def indexer_topk_kernel(q_BxTxHxC, w_BxTxH, key_pool, key_rows_BxM, num_visible_BxT, k, allowed_BxTxM=None, *,
                        num_keys_B=None, candidate_blocks_BxTxC=None, block_size: int = 8, live=None,
                        interpret: bool = False, tuning=None):
  """Dispatcher entry point (registered as "indexer_topk"). `tuning` may be an IndexerTuning (ignored fields) or an
  IndexerTopkTuning."""
  if not isinstance(tuning, IndexerTopkTuning):
    tuning = None
  return indexer_topk_pallas(q_BxTxHxC, w_BxTxH, key_pool, key_rows_BxM, num_visible_BxT, allowed_BxTxM,
                             num_keys_B, candidate_blocks_BxTxC, k=int(k), block_size=int(block_size), live=live,
                             interpret=interpret, tuning=tuning)


KERNELS = {"indexer_topk": indexer_topk_kernel}
