"""Sparse MLA attention over a window pool and a compressed pool, with a per-head sink.

Contract (shared by the reference and every kernel):
  q_NxHxD        queries (N flattened query tokens), already RoPE'd.
  window_pool_PxD, window_idx_NxW   rows of the SWA pool each query attends to (-1 = none).
  comp_pool_QxD,   comp_idx_NxK     rows of the compressed pool (top-k picks, or all visible HCA entries; -1 = none).
  sink_H         one logit per head, added to the softmax denominator only.
  window_len_N, comp_len_N   optional int [N]: valid leading ids per query (ids at positions >= len are ignored
                 like -1 and never read; the kernel's loops stop there). None = the whole row.
  live           optional int scalar: queries n >= live may hold anything in both outputs (the kernel's programs
                 of those queries return at once, writing nothing; the reference computes them). None = all N.
Returns out_NxHxD = sum_j p_j v_j with p = exp(s_j) / (sum_j exp(s_j) + exp(sink)), and lse_NxH = log sum_j exp(s_j)
over the real keys only (the sink is not included; -inf when a row has no valid key). K = V (one shared latent).

Ids outside [0, pool rows) are invalid exactly like -1 (clamped for the read and masked explicitly).
A pool is a plain [P, D] array (any float dtype), an `Fp8KVPool` (the V4 584-byte FP8 record, the interchange
format) or an `Fp8PagedPool` (576-byte rows + per-page scale tail, uint16 storage; see fp8.py); FP8 rows are
dequantized in-kernel by a bitcast to float8_e4m3fn, the type conversion and one multiply by the block's scale.

The Pallas kernel (`sparse_attention_pallas`) is written for the Pallas-Triton GPU backend (BUILD_NOTES.md, Kernels
says why): grid (query token, head block, key split); each program keeps block_h heads of one query token in
registers, loads the token's id rows once, walks its window ids and then its compressed ids block_k at a time,
gathers those rows straight from the pool by indexing the pool ref with the id vector, and runs an online softmax
(base 2). With one split it applies the sink and writes the final out/lse; with more (decode batches whose programs
leave the last wave of SMs part-empty; `auto_num_splits`) it writes per-split partials in the output dtype that
one fused XLA pass merges (flash-decoding). Default tilings per pool format (`default_tuning`) are the ones that
compile without register spills for sm_90a (benchmarks/sm90_compile.py). Rows behind invalid ids are never read (masked loads, zero fill), so non-finite data
there cannot leak; fp32 inputs use HIGHEST (IEEE) dots.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import fp8 as _fp8
from pallas_kernels import word_pool as _word_pool

try:  # Pallas-Triton: deprecated in JAX 0.11 but still shipped; see BUILD_NOTES.md, Kernels.
  from jax.experimental.pallas import triton as _pl_triton
except ImportError:  # pragma: no cover - future JAX without the Triton backend.
  _pl_triton = None

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


FP8_BLOCK = _fp8.FP8_BLOCK
Fp8KVPool = _fp8.Fp8KVPool
Fp8PagedPool = _fp8.Fp8PagedPool
quantize_kv_fp8 = _fp8.quantize_kv_fp8
dequantize_kv_fp8 = _fp8.dequantize_kv_fp8
record_to_paged = _fp8.record_to_paged
paged_to_record = _fp8.paged_to_record
MAX_SPLITS = 32  # key splits per (token, head block) (flash decoding); see auto_num_splits


def _next_pow2(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


def pool_rows(pool) -> int:
  return pool.shape[0]


def is_fp8_pool(pool) -> bool:
  return isinstance(pool, (Fp8KVPool, Fp8PagedPool))


def pool_row_bytes(pool) -> int:
  if is_fp8_pool(pool):
    return pool.bytes_per_row
  return pool.shape[1] * jnp.dtype(pool.dtype).itemsize


# ----------------------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------------------


def _gather_rows(pool, idx_NxK):
  P = pool_rows(pool)
  valid = (idx_NxK >= 0) & (idx_NxK < P)
  safe = jnp.where(valid, idx_NxK, 0)
  if isinstance(pool, Fp8PagedPool):
    pool = paged_to_record(pool)  # the reference reads the interchange record
  if isinstance(pool, Fp8KVPool):
    rows = dequantize_kv_fp8(Fp8KVPool(*(_word_pool.take(a, safe) for a in pool)), jnp.float32)
  else:
    rows = _word_pool.take(pool, safe)
  # Rows behind invalid ids are zeros (not row 0's data): a non-finite row there must not give 0 x NaN.
  return jnp.where(valid[..., None], rows, jnp.zeros((), rows.dtype)), valid


def apply_len(idx_NxK, len_N):
  """Ids at positions >= len_N[n] become -1 (None = every position counts). The per-query valid length is an upper
  bound on the live ids, like FlashMLA's topk_length: kernels stop their loops there."""
  if len_N is None or idx_NxK is None:
    return idx_NxK
  pos = jnp.arange(idx_NxK.shape[-1], dtype=jnp.int32)
  return jnp.where(pos[None, :] < jnp.asarray(len_N, jnp.int32)[:, None], idx_NxK, -1)


def check_len(name, len_N, idx_NxK, N):
  if len_N is None:
    return
  if idx_NxK is None:
    raise ValueError(f"{name} given without ids")
  if tuple(len_N.shape) != (N,) or not jnp.issubdtype(len_N.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array of shape ({N},), got {len_N.dtype}{tuple(len_N.shape)}")


def sparse_attention_reference(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H,
                               *, scale: float, window_len_N=None, comp_len_N=None):
  """Plain-XLA reference. fp32 softmax; inputs may be bf16 or fp32 (or Fp8KVPool, dequantized first).

  window_len_N / comp_len_N (optional int [N]): only the first len ids of each query's row count; the rest are
  ignored exactly like -1 (None = all).

  Numerics: the key max m (not max(m, sink)) anchors the exponentials, so lse stays exact for sinks far above the
  logits; out uses denominator l + exp(sink - m) and is 0 when that is 0 or inf (all-invalid rows, sink = +inf).
  """
  N = q_NxHxD.shape[0]
  check_len("window_len_N", window_len_N, window_idx_NxW, N)
  check_len("comp_len_N", comp_len_N, comp_idx_NxK, N)
  window_idx_NxW = apply_len(window_idx_NxW, window_len_N)
  comp_idx_NxK = apply_len(comp_idx_NxK, comp_len_N)
  kv, valid = _gather_rows(window_pool_PxD, window_idx_NxW)
  kv = kv.astype(jnp.float32)
  if comp_pool_QxD is not None and comp_idx_NxK is not None and comp_idx_NxK.shape[-1] > 0:
    ckv, cvalid = _gather_rows(comp_pool_QxD, comp_idx_NxK)
    kv = jnp.concatenate([kv, ckv.astype(jnp.float32)], axis=1)
    valid = jnp.concatenate([valid, cvalid], axis=1)
  s_NxHxK = jnp.einsum("nhd,nkd->nhk", q_NxHxD.astype(jnp.float32), kv,
                       precision=jax.lax.Precision.HIGHEST) * scale
  s_NxHxK = jnp.where(valid[:, None, :], s_NxHxK, -jnp.inf)
  m = jnp.max(s_NxHxK, axis=-1)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s_NxHxK - m_safe[..., None])
  l = jnp.sum(p, axis=-1)
  sink = sink_H.astype(jnp.float32)[None, :]
  denom = l + jnp.exp(sink - m_safe)
  acc = jnp.einsum("nhk,nkd->nhd", p, kv, precision=jax.lax.Precision.HIGHEST)
  ok = (denom > 0) & jnp.isfinite(denom)
  out = jnp.where(ok[..., None], acc / jnp.where(ok, denom, 1.0)[..., None], 0.0)
  lse = jnp.where(l > 0, jnp.log(jnp.maximum(l, 1e-37)) + m_safe, -jnp.inf)
  return out.astype(q_NxHxD.dtype), lse


# ----------------------------------------------------------------------------------------------------------------
# Pallas kernel
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SparseAttentionTuning:
  """Static tiling of the sparse attention kernel. `None` in the kernel's call means `default_tuning(pools)`:
  `BF16_TUNING` for float pools, `FP8_TUNING` when a pool is FP8 (docs/kernels.md has the ptxas numbers behind both).

  block_h: heads per program (power of two, >= 16 for the Triton dot; smaller H is padded). 64 (all heads of a
    token) gives Hopper wgmma (M = 64 per warpgroup); below 64 Triton falls back to mma.sync.
  block_k: keys (gathered rows) per inner step (power of two).
  num_splits: key splits per (token, head block), 0 = auto (`auto_num_splits`: fill whole waves of `num_sms` x
    `ctas_per_sm` programs, at most MAX_SPLITS, at least 2 key blocks a split, and never more partial bytes than
    key bytes).
  chunk_d: column chunk width when every pool is a plain array (power of two; 0 = whole row). With an FP8 pool
    the plan is fixed: each 64-channel FP8 block is two 32-wide chunks (even / odd channels: the two bytes of a
    uint16 word), then the RoPE channels.
  fp8_u16_min_elems: a record pool's e4m3 array with at least this many elements is read through a uint16 view
    (the paged layout's path), because 32-bit element offsets overflow at 2^31 one-byte elements while JAX's
    Triton lowering only switches to 64-bit offsets above 2^32 bytes. Tests lower it to force that path.
  num_stages: Triton software-pipelining depth of the key loop (3: two steps' gathers in flight, cp.async into
    shared memory, while one computes).
  id_row_max: an id row of at most this many (padded) ids is loaded once per program and each step picks its
    block from registers; a wider row is read one block per step (2048 ids = 8 registers a thread at 8 warps).
  num_sms / ctas_per_sm: the wave the split rule fills (H200: 132 SMs; one resident program per SM at the
    shipped tilings, by register count).
  debug: print the kernel jaxpr and Triton module when lowering (pallas_call(debug=True)).
  """
  block_h: int = 64
  block_k: int = 16
  num_splits: int = 0
  chunk_d: int = 0
  num_warps: int = 8
  num_stages: int = 3
  num_sms: int = 132
  ctas_per_sm: int = 1
  fp8_u16_min_elems: int = 2 ** 31
  id_row_max: int = 2048
  debug: bool = False

  def __post_init__(self):
    for name in ("block_h", "block_k"):
      v = getattr(self, name)
      if v <= 0 or v & (v - 1):
        raise ValueError(f"{name} must be a positive power of two, got {v}")
    if self.chunk_d and self.chunk_d & (self.chunk_d - 1):
      raise ValueError(f"chunk_d must be a power of two, got {self.chunk_d}")
    if not 0 <= self.num_splits <= MAX_SPLITS:
      raise ValueError(f"num_splits must be 0 (auto) .. {MAX_SPLITS}, got {self.num_splits}")


# bf16 pools: all 64 heads in one program (wgmma, the PV accumulator split by columns over the two warpgroups, 128
# registers a thread), 16 keys a step: 255 registers and no spill at sm_90a; 32 keys a step spills, and so does an
# id row of more than 512 ids held in registers (top-2048, HCA), which therefore read their ids a block per step.
BF16_TUNING = SparseAttentionTuning(id_row_max=512)
# FP8 pools: the dequantized row is 15 column chunks, each with its own [heads, 32] PV dot; at 64 heads Triton
# gives those narrow dots a layout that repeats the accumulator in both warpgroups (spills), so the heads are split
# in two programs per token (mma.sync, 251 registers, no spill). The second program's rows come from L2.
FP8_TUNING = SparseAttentionTuning(block_h=32)


def default_tuning(pools) -> SparseAttentionTuning:
  return FP8_TUNING if any(is_fp8_pool(p) for p in pools if p is not None) else BF16_TUNING


def _chunk_plan(D: int, pools, chunk_d: int):
  """Column chunks shared by q, the accumulators and every pool: tuples (q_col0, width, recipe).

  Without FP8 pools: ("plain", c0) chunks of chunk_d (default: whole row). With FP8 pools (all sharing the nope
  width Dn and D = Dn + R): ("nope", blk, parity) = channels blk*64 + 2j + parity (j < 32), then ("rope", r0) =
  channels Dn + r0 + j. q is permuted into this chunk order by the wrapper and the output permuted back, so a
  uint16 word's two e4m3 bytes land in two chunks without any in-kernel interleave."""
  fp8 = [p for p in pools if is_fp8_pool(p)]
  if not fp8:
    w = chunk_d or D
    if D % w:
      raise ValueError(f"chunk_d {w} does not divide d {D}")
    return tuple((c, w, ("plain", c)) for c in range(0, D, w))
  Dn = _nope_dim(fp8[0])
  for p in fp8:
    if _nope_dim(p) != Dn or p.shape[1] != D or Dn % FP8_BLOCK:
      raise ValueError(f"FP8 pools must share nope width {Dn} (multiple of {FP8_BLOCK}) and d {D}")
  half = FP8_BLOCK // 2
  plan = [((blk * 2 + par) * half, half, ("nope", blk, par)) for blk in range(Dn // FP8_BLOCK) for par in (0, 1)]
  R = D - Dn
  rw = min(R, FP8_BLOCK) if R else 0
  plan += [(Dn + r0, rw, ("rope", r0)) for r0 in range(0, R, rw)] if R else []
  return tuple(plan)


def _nope_dim(pool) -> int:
  return pool.nope_dim if isinstance(pool, Fp8PagedPool) else pool.nope.shape[1]


def _plan_perm(plan, Dn):
  """Channel order of the chunk plan (a permutation of range(D))."""
  cols = []
  for _, w, rec in plan:
    if rec[0] == "plain":
      cols += list(range(rec[1], rec[1] + w))
    elif rec[0] == "nope":
      cols += [rec[1] * FP8_BLOCK + 2 * j + rec[2] for j in range(w)]
    else:
      cols += list(range(Dn + rec[1], Dn + rec[1] + w))
  return cols


def _pool_kind_arrays(pool, u16_min_elems: int):
  """(kind, arrays) the kernel reads: "plain" [P, D]; "rec" (e4m3 nope, scale, rope); "rec16" (the same with the
  e4m3 array viewed as uint16 [P, Dn / 2]); "paged" (uint16 pages)."""
  if isinstance(pool, Fp8PagedPool):
    return "paged", (pool.pages,)
  if isinstance(pool, Fp8KVPool):
    if pool.nope.size >= u16_min_elems:
      return "rec16", (_fp8._to_u16(pool.nope), pool.scale, pool.rope)
    return "rec", tuple(pool)
  return "plain", (pool,)


def _masked_gather(ref, r, c, m, other=0):
  """ref[r, c] for full [bk, w] int index arrays, masked (never read) where not `m`, filled with `other`.

  Zero fill matters: a row behind an invalid id is never touched, so a non-finite value there cannot reach the
  output as 0 x NaN. Pure-array indexing also keeps interpret mode able to discharge the load."""
  if _pl_triton is None:  # pragma: no cover - no Triton backend: plain gather + select
    return jnp.where(m, ref[r, c], jnp.asarray(other, ref.dtype))
  return _pl_triton.load(ref.at[r, c], mask=m, other=jnp.asarray(other, ref.dtype))


def _load_plan(refs, kind, meta, ids, valid, plan, Dn, dtype):
  """Rows `ids` (clamped) of a pool, dequantized, as one `dtype` [bk, w] array per plan chunk; rows that are not
  `valid` are never read (zeros; FP8 scales read as 2^0).

  Every word is loaded once: a uint16 word of e4m3 pairs (paged, rec16) feeds both parity chunks of its block, and a
  row's scale bytes (or scale words) are loaded together and picked per block. FP8 decode is a bitcast to
  float8_e4m3fn, the type conversion and one multiply by the block's scale (fp8.py)."""
  bk = ids.shape[0]
  m_row = valid[:, None]
  out = {}
  scales = None
  if kind == "paged":
    (pages_ref,) = refs
    ps, rw, sw, tail0 = meta
    page, slot = ids // ps, ids % ps
    base = (slot * rw)[:, None]
    page2 = page[:, None]
  for i, (_, w, rec) in enumerate(plan):
    if i in out:
      continue
    j = jax.lax.broadcasted_iota(jnp.int32, (bk, w), 1)
    rows = jnp.broadcast_to(ids[:, None], (bk, w))
    m = jnp.broadcast_to(m_row, (bk, w))
    if kind == "plain":  # a float pool, in the plan's channel order (which FP8 pools beside it may permute)
      if rec[0] == "nope":
        cols = rec[1] * FP8_BLOCK + 2 * j + rec[2]
      else:
        cols = (Dn if rec[0] == "rope" else 0) + rec[1] + j
      out[i] = _masked_gather(refs[0], rows, cols, m).astype(dtype)
      continue
    if rec[0] == "rope":
      if kind == "paged":
        x = _fp8.bf16_words_to_f32(_masked_gather(pages_ref, jnp.broadcast_to(page2, (bk, w)),
                                                  base + Dn // 2 + rec[1] + j, m))
      else:
        x = _masked_gather(refs[2], rows, rec[1] + j, m)
      out[i] = x.astype(dtype)
      continue
    blk, par = rec[1], rec[2]
    if scales is None:  # the row's scale bytes / words, once per step
      if kind == "paged":
        c = jax.lax.broadcasted_iota(jnp.int32, (bk, sw), 1)
        scales = _masked_gather(pages_ref, jnp.broadcast_to(page2, (bk, sw)), tail0 + slot[:, None] * sw + c,
                                jnp.broadcast_to(m_row, (bk, sw)), 127 * 257).astype(jnp.int32)
      else:
        scale_ref = refs[1]
        sc = scale_ref.shape[1]
        c = jax.lax.broadcasted_iota(jnp.int32, (bk, sc), 1)
        scales = _masked_gather(scale_ref, jnp.broadcast_to(ids[:, None], (bk, sc)), c,
                                jnp.broadcast_to(m_row, (bk, sc)), 127).astype(jnp.int32)
    if kind == "paged":
      e8 = _pick_col(scales, blk // 2)
      e8 = (jnp.right_shift(e8, 8) if blk % 2 else e8) & 0xFF
    else:
      e8 = _pick_col(scales, blk)
    scale = _fp8.ue8m0_to_f32(e8)[:, None]
    pair = i + 1 - 2 * par  # the other parity chunk of this block
    if kind in ("paged", "rec16"):
      if kind == "paged":
        words = _masked_gather(pages_ref, jnp.broadcast_to(page2, (bk, w)), base + blk * (FP8_BLOCK // 2) + j, m)
      else:
        words = _masked_gather(refs[0], rows, blk * (FP8_BLOCK // 2) + j, m)
      lo, hi = _fp8.word_bytes_as_e4m3(words)
      byp = {0: lo, 1: hi}
      out[i] = (_fp8.e4m3_to_f32(byp[par]) * scale).astype(dtype)
      out[pair] = (_fp8.e4m3_to_f32(byp[1 - par]) * scale).astype(dtype)
    else:  # "rec": the e4m3 array itself, one byte per channel (each byte is read once, by its parity chunk)
      x = _masked_gather(refs[0], rows, blk * FP8_BLOCK + 2 * j + par, m)
      out[i] = (_fp8.e4m3_to_f32(x) * scale).astype(dtype)
  return [out[i] for i in range(len(plan))]


def _pick_col(x_BxC, c: int):
  """Column c (static) of a small [B, C] tile as [B] (Triton has no vector indexing; C is a handful of scales)."""
  if x_BxC.shape[1] == 1:
    return jnp.sum(x_BxC, axis=1)
  return jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, x_BxC.shape, 1) == c, x_BxC, 0), axis=1)


def _dot_nt(a, b, precision=None):
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                             precision=precision)


def _dot_nn(a, b, precision=None):
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                             precision=precision)


def _precision_for(cdtype):
  """fp32 MMA inputs get HIGHEST (Triton's default dot precision would silently be TF32); 16-bit inputs keep the
  default (exact products, f32 accumulation)."""
  return (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST) if cdtype == jnp.float32 else None


def _pick(vec, i):
  """Element i (static) of a short loaded vector, as a scalar (Triton has no vector indexing)."""
  return jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, vec.shape, 0) == i, vec, 0))


def _sparse_kernel(live_ref, *refs, **kw):
  """A query at or past `live` (the step's dead tokens): the program returns, reading and writing nothing more."""
  split = pl.program_id(2)         # read here: interpret mode has no program ids inside the conditional

  @pl.when(pl.program_id(0) < _pick(live_ref[...], 0))
  def _():
    _sparse_program(split, *refs, **kw)


def _sparse_program(split, *refs, plan, Dn, pools_meta, block_k, num_splits, qk_scale2, cdtype, id_row_max):
  """One program: one query token, block_h heads, one split of the query's live key blocks.

  refs: q, sink, lens (valid leading ids per pool for this query), then per pool (ids [nblk, block_k], pool
  arrays...), then outputs (out, lse)."""
  q_ref, sink_ref, lens_ref = refs[0], refs[1], refs[2]
  pos = 3
  pool_refs = []
  for n_arr, kind, P, meta in pools_meta:
    pool_refs.append((refs[pos], refs[pos + 1:pos + 1 + n_arr], (kind, meta), P))
    pos += 1 + n_arr
  o_ref, lse_ref = refs[pos], refs[pos + 1]
  prec = _precision_for(cdtype)

  bh = q_ref.shape[0]
  q_chunks = [q_ref[:, pl.ds(c0, w)].astype(cdtype) for c0, w, _ in plan]
  m0 = jnp.full((bh,), -jnp.inf, jnp.float32)
  l0 = jnp.zeros((bh,), jnp.float32)
  acc0 = tuple(jnp.zeros((bh, w), jnp.float32) for _, w, _ in plan)
  carry = (m0, l0, acc0)

  # Live blocks of this query: the loops stop at the per-query valid length (ids past it are never touched).
  lens_vec = lens_ref[...]
  lens = [_pick(lens_vec, i) for i in range(len(pool_refs))]
  live = [(ln + block_k - 1) // block_k for ln in lens]
  total = sum(live[1:], live[0])
  per_split = (total + num_splits - 1) // num_splits
  lo = split * per_split
  hi = jnp.minimum(lo + per_split, total)
  base = 0
  for (idx_ref, arrs, kind_meta, P), nb, ln in zip(pool_refs, live, lens):
    nblk = idx_ref.shape[0]
    if nblk * block_k <= id_row_max:
      # The whole id row is loaded once per program, checked once (-1 = invalid: bad id or past the length), and
      # each step picks its block out of registers: no dependent id load in front of every gather.
      tile = idx_ref[...]
      posn = (jax.lax.broadcasted_iota(jnp.int32, tile.shape, 0) * block_k
              + jax.lax.broadcasted_iota(jnp.int32, tile.shape, 1))
      tagged = jnp.where((tile >= 0) & (tile < P) & (posn < ln), tile, -1)
      row_of = jax.lax.broadcasted_iota(jnp.int32, tile.shape, 0)

      def block_ids(j, tagged=tagged, row_of=row_of):
        ids = jnp.sum(jnp.where(row_of == j, tagged, 0), axis=0)
        return ids >= 0, ids
    else:  # a row too wide to hold in registers (e.g. HCA over a very long context): one block per step

      def block_ids(j, idx_ref=idx_ref, P=P, ln=ln):
        ids = idx_ref[pl.ds(j, 1), :].reshape(block_k)
        posn = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        return (ids >= 0) & (ids < P) & (posn < ln), ids

    def body(j, carry, arrs=arrs, kind_meta=kind_meta, block_ids=block_ids):
      kind, meta = kind_meta
      m, l, accs = carry
      valid, ids = block_ids(j)
      safe = jnp.where(valid, ids, 0)  # explicit clamp: never rely on interpret-mode clamping
      ks = _load_plan(arrs, kind, meta, safe, valid, plan, Dn, cdtype)
      s = _dot_nt(q_chunks[0], ks[0], prec)
      for qc, kc in zip(q_chunks[1:], ks[1:]):
        s = s + _dot_nt(qc, kc, prec)
      s = jnp.where(valid[None, :], s * qk_scale2, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp2(m - m_safe)
      p = jnp.exp2(s - m_safe[:, None])
      l = l * alpha + jnp.sum(p, axis=1)
      pc = p.astype(cdtype)
      accs = tuple(a * alpha[:, None] + _dot_nn(pc, kc, prec) for a, kc in zip(accs, ks))
      return m_new, l, accs

    start = jnp.clip(lo - base, 0, nb)
    stop = jnp.clip(hi - base, 0, nb)
    carry = jax.lax.fori_loop(start, stop, body, carry)
    base = base + nb

  m, l, accs = carry
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  lse = jnp.where(l > 0, (m_safe + jnp.log2(jnp.maximum(l, 1e-37))) * _LN2, -jnp.inf)
  if num_splits == 1:
    sink2 = sink_ref[...].astype(jnp.float32) * _LOG2E
    denom = l + jnp.exp2(sink2 - m_safe)
  else:
    denom = l
  ok = (denom > 0) & (denom < jnp.inf)
  inv = jnp.where(ok, 1.0 / jnp.where(ok, denom, 1.0), 0.0)
  for (c0, w, _), a in zip(plan, accs):
    o_ref[:, pl.ds(c0, w)] = (a * inv[:, None]).astype(o_ref.dtype)
  lse_ref[...] = lse


def _merge_splits(o_NxSxHxD, lse_NxSxH, sink_H, out_dtype):
  """Flash-decoding merge of per-split normalized partials. Written as a broadcast multiply and a sum over the split
  axis (not an einsum, which XLA may hand to a batched GEMM with a contraction of S <= 16) so it fuses into one pass
  over the partials, which at decode sizes sit in L2."""
  m = jnp.max(lse_NxSxH, axis=1)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lse_NxSxH - m_safe[:, None, :])
  L = jnp.sum(w, axis=1)
  denom = L + jnp.exp(sink_H.astype(jnp.float32)[None, :] - m_safe)
  acc = jnp.sum(w[..., None] * o_NxSxHxD.astype(jnp.float32), axis=1)
  ok = (denom > 0) & jnp.isfinite(denom)
  out = jnp.where(ok[..., None], acc / jnp.where(ok, denom, 1.0)[..., None], 0.0)
  lse = jnp.where(L > 0, jnp.log(jnp.maximum(L, 1e-37)) + m_safe, -jnp.inf)
  return out.astype(out_dtype), lse


def _pad_idx(idx_NxK, block_k):
  """[N, K] ids -> [N, nblk, block_k] with nblk a power of two (a Triton block), padded with -1."""
  N, K = idx_NxK.shape
  nblk = _next_pow2(max(1, -(-K // block_k)))
  Kp = nblk * block_k
  if Kp != K:
    idx_NxK = jnp.pad(idx_NxK, ((0, 0), (0, Kp - K)), constant_values=-1)
  return idx_NxK.astype(jnp.int32).reshape(N, nblk, block_k)


def auto_num_splits(programs: int, nblocks: int, max_splits: int, wave: int) -> int:
  """Key splits for `programs` (token, head block) programs over `nblocks` key blocks, one wave = `wave` resident
  programs (SMs x CTAs per SM). The grid's last wave is what decode loses to: 128 programs on 132 SMs is 97% busy,
  96 programs 73%. So: the fewest splits whose total fills its waves to >= 90%, else the best-filled; at most
  `max_splits` (the caller's byte cap) and at least two key blocks a split (each split rereads q and writes a
  partial)."""
  top = max(1, min(MAX_SPLITS, max_splits, nblocks // 2))

  def fill(s):
    n = programs * s
    return n / (-(-n // wave) * wave)

  for s in range(1, top + 1):
    if fill(s) >= 0.9:
      return s
  return max(range(1, top + 1), key=lambda s: (fill(s), -s))


def chosen_num_splits(N: int, H: int, id_widths, tuning: SparseAttentionTuning | None = None, *,
                      row_bytes: int = 1024, out_bytes: int = 2, D: int = 512) -> int:
  """The split count the kernel uses for N queries, H heads and id rows of these widths (benchmarks report it).

  The byte cap: a split writes a [block_h, D] partial (out_bytes each) and reads its share of the rows
  (row_bytes each); splitting past the point where partials outweigh the rows (batch 1: 640 rows of 1 KB against
  64 KB partials -> 10 splits) adds traffic instead of hiding latency."""
  t = tuning or BF16_TUNING
  bh = min(t.block_h, max(16, _next_pow2(H)))
  nhb = -(-H // bh)
  total = sum(max(1, -(-w // t.block_k)) for w in id_widths)
  if t.num_splits:
    S = min(t.num_splits, total)
  else:
    cap = max(1, (sum(id_widths) * row_bytes) // (bh * D * out_bytes))
    S = auto_num_splits(N * nhb, total, cap, t.num_sms * t.ctas_per_sm)
  return -(-total // -(-total // S))  # every split gets a block: 20 blocks in 16 splits is 10 splits of 2


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "tuning"))
def sparse_attention_pallas(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H,
                            window_len_N=None, comp_len_N=None, *, scale: float, live=None, interpret: bool = False,
                            tuning: SparseAttentionTuning | None = None):
  """Pallas (Triton-GPU) kernel with the contract of `sparse_attention_reference` (same optional lengths; `live`:
  queries at or past it are skipped, their outputs unspecified)."""
  t = tuning or default_tuning([window_pool_PxD, comp_pool_QxD])
  N, H, D = q_NxHxD.shape
  check_len("window_len_N", window_len_N, window_idx_NxW, N)
  check_len("comp_len_N", comp_len_N, comp_idx_NxK, N)
  pools = [(window_pool_PxD, window_idx_NxW, window_len_N)]
  if comp_pool_QxD is not None and comp_idx_NxK is not None and comp_idx_NxK.shape[-1] > 0:
    pools.append((comp_pool_QxD, comp_idx_NxK, comp_len_N))
  plan = _chunk_plan(D, [p for p, _, _ in pools], t.chunk_d)
  fp8_pools = [p for p, _, _ in pools if is_fp8_pool(p)]
  Dn = _nope_dim(fp8_pools[0]) if fp8_pools else D
  perm = _plan_perm(plan, Dn)
  identity = perm == list(range(D))
  cdtype = q_NxHxD.dtype if q_NxHxD.dtype in (jnp.float32, jnp.bfloat16, jnp.float16) else jnp.bfloat16

  bh = min(t.block_h, max(16, _next_pow2(H)))
  Hp = -(-H // bh) * bh
  q = q_NxHxD if identity else q_NxHxD[:, :, jnp.asarray(perm)]
  q = q if Hp == H else jnp.pad(q, ((0, 0), (0, Hp - H), (0, 0)))
  sink = sink_H.astype(jnp.float32)
  sink = sink if Hp == H else jnp.pad(sink, (0, Hp - H))
  nhb = Hp // bh

  bk = t.block_k
  idxs = [_pad_idx(idx, bk) for _, idx, _ in pools]
  # Per-query valid lengths (clipped to the id width); a power-of-two column count for the Triton block.
  lens = [jnp.full((N,), idx.shape[1], jnp.int32) if ln is None else jnp.clip(ln.astype(jnp.int32), 0, idx.shape[1])
          for (_, idx, ln) in pools]  # the unpadded widths
  lens_Nx2 = jnp.stack(lens + [jnp.zeros((N,), jnp.int32)] * (2 - len(lens)), axis=1)
  row_bytes = max(pool_row_bytes(p) for p, _, _ in pools)
  S = chosen_num_splits(N, H, [idx.shape[1] for _, idx, _ in pools], t, row_bytes=row_bytes,
                        out_bytes=jnp.dtype(q_NxHxD.dtype).itemsize, D=D)

  live_1 = jnp.reshape(jnp.clip(jnp.asarray(N if live is None else live, jnp.int32), 0, N), (1,))
  args = [live_1, q, sink, lens_Nx2]
  in_specs = [pl.BlockSpec((1,), lambda n, h, s: (0,)),
              pl.BlockSpec((None, bh, D), lambda n, h, s: (n, h, 0)),
              pl.BlockSpec((bh,), lambda n, h, s: (h,)),
              pl.BlockSpec((None, 2), lambda n, h, s: (n, 0))]
  meta = []
  for (pool, _, _), idx in zip(pools, idxs):
    args.append(idx)
    in_specs.append(pl.BlockSpec((None,) + idx.shape[1:], lambda n, h, s: (n, 0, 0)))
    kind, arrs = _pool_kind_arrays(pool, t.fp8_u16_min_elems)
    for a in arrs:
      args.append(a)
      in_specs.append(pl.BlockSpec(a.shape, lambda n, h, s, nd=a.ndim: (0,) * nd))
    pmeta = None
    if kind == "paged":
      pmeta = (pool.page_size, pool.row_words, pool.scale_cols // 2, pool.tail_word0)
    meta.append((len(arrs), kind, pool_rows(pool), pmeta))

  if S == 1:
    out_shape = [jax.ShapeDtypeStruct((N, Hp, D), q_NxHxD.dtype), jax.ShapeDtypeStruct((N, Hp), jnp.float32)]
    out_specs = [pl.BlockSpec((None, bh, D), lambda n, h, s: (n, h, 0)),
                 pl.BlockSpec((None, bh), lambda n, h, s: (n, h))]
  else:
    # Normalized partials in the output dtype (bf16 for bf16 q: half the bytes of f32 partials); lse stays f32.
    out_shape = [jax.ShapeDtypeStruct((N, S, Hp, D), q_NxHxD.dtype), jax.ShapeDtypeStruct((N, S, Hp), jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, bh, D), lambda n, h, s: (n, s, h, 0)),
                 pl.BlockSpec((None, None, bh), lambda n, h, s: (n, s, h))]

  kernel = functools.partial(_sparse_kernel, plan=plan, Dn=Dn, pools_meta=tuple(meta), block_k=bk, num_splits=S,
                             qk_scale2=float(scale) * _LOG2E, cdtype=cdtype, id_row_max=t.id_row_max)
  compiler_params = None
  if _pl_triton is not None:
    compiler_params = _pl_triton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)
  out, lse = pl.pallas_call(
      kernel, grid=(N, nhb, S), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=compiler_params, interpret=interpret, debug=t.debug, name="dsv4_sparse_mla")(*args)
  if S > 1:
    out, lse = _merge_splits(out, lse, sink, q_NxHxD.dtype)
  out = out[:, :H]
  if not identity:
    out = out[:, :, jnp.asarray(sorted(range(D), key=perm.__getitem__))]
  return out, lse[:, :H]


def sparse_attention_kernel(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H, *,
                            scale: float, window_len_N=None, comp_len_N=None, live=None, interpret: bool = False,
                            tuning: SparseAttentionTuning | None = None):
  """Dispatcher entry point (registered as "sparse_attention")."""
  return sparse_attention_pallas(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H,
                                 window_len_N, comp_len_N, scale=float(scale), live=live, interpret=interpret,
                                 tuning=tuning)


KERNELS = {"sparse_attention": sparse_attention_kernel}
