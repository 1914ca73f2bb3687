"""HCA attention in the invariant step's block order: the window, then every visible compressed entry in position
order, read through each query's block table.

Contract (shared by the reference and the kernel):
  q_NxHxD          queries (N flattened query tokens), already RoPE'd.
  window_pool_PxD, window_idx_NxW, window_len_N   the flat SWA pool, each query's window rows (-1 = none) and the
                   number of valid leading ids (0 for a padding token: the query then gives 0).
  comp_pool_QxD    the flat compressed pool (entries of every row).
  table_SxF        full-group block tables, one row per sequence slot (block ids, -1 = none), as the engine keeps
                   them: never copied per query.
  table_rows_N     the row of table_SxF holding query n's table (None = arange(N): an [N, F] table, one row per
                   query; a row outside the table sees nothing). Entry e of query n lives at pool row
                   table[rows[n], e // E] * E + e % E, E = `entries_per_block` (full_block_tokens // ratio).
  num_visible_N    the query's visible entries 0 .. nv-1 (its causal prefix; 0 for padding).
  live             optional int scalar: queries n >= live may hold anything in the output (the kernel's programs of
                   those queries return at once, writing nothing; the reference computes them). None = all N.
  sink_H           one logit per head, added to the softmax denominator only.
Returns out_NxHxD = sum_j p_j v_j, p = exp(s_j) / (sum_j exp(s_j) + exp(sink)), in q's dtype (fp32 accumulation);
0 for a query with no window row. K = V (one shared latent). Ids / blocks outside the pools are invalid like -1.
Pools are plain arrays, `Fp8KVPool` or `Fp8PagedPool` (sparse_attention.py has the formats).

Order (what makes it batch invariant): an online softmax over the window rows first, then over the entries in
position order, a block at a time; each query's loops stop at its own window length and its own visible count, so
nothing a neighbour brings (its count, its place in the batch, the number of queries) reaches its reduction. The
reference (`hca_attention_reference`, the model's XLA path too: `dispatch.hca_attention` without a kernel) runs
blocks of DENSE_BLOCK_ENTRIES = 64 entries, looped over the blocks some query of the call can see, a block a query
cannot see leaving its running (max, sum, accumulator) untouched.

The Pallas kernel (`hca_attention_pallas`, Pallas-Triton like the sparse kernel): grid (query token, head block),
no key split (a split would change the order). A program keeps block_h heads of one query in registers, reads its
window ids a block of block_k per step, then computes the pool rows of entries j*block_k .. from its own table
row, read in place in the [S, F] table (one masked gather of block_k table words a step, only up to its visible
count: the table of a 1M-token context is 8192 words, and a per-query copy of it would cost the table width, not
the context), gathers those rows and runs the online softmax in base 2 (fp32 accumulators, IEEE dots for
fp32 inputs). Row loads, the chunk plan and the in-kernel FP8 decode are the sparse kernel's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import sparse_attention as _sa

_pl_triton = _sa._pl_triton

# Entries per block of the reference's online softmax: a fixed shape, so a token's reduction never depends on the
# table width or on its neighbours; small enough that a short context reads little past its live entries.
DENSE_BLOCK_ENTRIES = 64


# ----------------------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------------------


def table_rows(table_SxF, table_rows_N, N: int):
  """Each query's row of the table as int32 [N] (None = arange(N), the table then having one row per query)."""
  if table_rows_N is None:
    if table_SxF.shape[0] != N:
      raise ValueError(f"a table of {table_SxF.shape[0]} rows for {N} queries needs table_rows_N")
    return jnp.arange(N, dtype=jnp.int32)
  if tuple(table_rows_N.shape) != (N,):
    raise ValueError(f"table_rows_N must have shape ({N},), got {tuple(table_rows_N.shape)}")
  return table_rows_N.astype(jnp.int32)


def entry_pool_rows(table_SxF, ids_NxK, num_visible_N, entries_per_block: int, table_rows_N=None):
  """Pool rows of entry ids [N, K] through each query's table row (-1 past its visible count, where no block, or
  for a row outside the table). Reads only the [N, K] table words the ids name."""
  S, F = table_SxF.shape
  rows = table_rows(table_SxF, table_rows_N, ids_NxK.shape[0])
  blk = ids_NxK // entries_per_block
  in_table = ((ids_NxK >= 0) & (blk < F) & (ids_NxK < num_visible_N[:, None])
              & ((rows >= 0) & (rows < S))[:, None])
  block_id = table_SxF.astype(jnp.int32)[jnp.clip(rows, 0, S - 1)[:, None], jnp.clip(blk, 0, F - 1)]
  ok = in_table & (block_id >= 0)
  return jnp.where(ok, block_id * entries_per_block + ids_NxK % entries_per_block, -1).astype(jnp.int32)


def _masked_scores(q_NxHxD, pool, rows_NxK, ok_NxK, scale: float):
  kv, valid = _sa._gather_rows(pool, jnp.where(ok_NxK, rows_NxK, -1))
  ok = ok_NxK & valid
  kv = jnp.where(ok[..., None], kv.astype(jnp.float32), 0.0)
  s = jnp.einsum("nhd,nkd->nhk", q_NxHxD, kv, precision=jax.lax.Precision.HIGHEST) * scale
  return jnp.where(ok[:, None, :], s, -jnp.inf), kv, ok


def hca_attention_reference(q_NxHxD, window_pool_PxD, window_idx_NxW, window_len_N, comp_pool_QxD, table_SxF,
                            num_visible_N, sink_H, table_rows_N=None, live=None, *, scale: float,
                            entries_per_block: int, block: int = DENSE_BLOCK_ENTRIES):
  """Plain-JAX reference: the window's softmax, then blocks of `block` entries in position order (online softmax,
  fp32), looped over the blocks some query can see; a block a query cannot see leaves its carry untouched."""
  q = q_NxHxD.astype(jnp.float32)
  W = window_idx_NxW.shape[1]
  wl = jnp.asarray(window_len_N, jnp.int32)
  s, kv, _ = _masked_scores(q, window_pool_PxD, window_idx_NxW,
                            (jnp.arange(W)[None, :] < wl[:, None]) & (window_idx_NxW >= 0), scale)
  m = jnp.max(s, axis=-1)
  m = jnp.where(jnp.isfinite(m), m, 0.0)         # padding tokens (no window row): any finite anchor
  p = jnp.exp(s - m[..., None])
  l = jnp.sum(p, axis=-1)
  acc = jnp.einsum("nhk,nkd->nhd", p, kv, precision=jax.lax.Precision.HIGHEST)
  nv = jnp.asarray(num_visible_N, jnp.int32)

  def body(b, carry):
    m, l, acc = carry
    ids = jnp.broadcast_to(b * block + jnp.arange(block, dtype=jnp.int32)[None, :], (q.shape[0], block))
    rows = entry_pool_rows(table_SxF, ids, nv, entries_per_block, table_rows_N)
    s, kv, ok = _masked_scores(q, comp_pool_QxD, rows, rows >= 0, scale)
    m2 = jnp.maximum(m, jnp.max(s, axis=-1))
    corr = jnp.exp(m - m2)
    p = jnp.exp(s - m2[..., None])
    l2 = l * corr + jnp.sum(p, axis=-1)
    acc2 = acc * corr[..., None] + jnp.einsum("nhk,nkd->nhd", p, kv, precision=jax.lax.Precision.HIGHEST)
    seen = jnp.any(ok, axis=-1)
    return (jnp.where(seen[:, None], m2, m), jnp.where(seen[:, None], l2, l),
            jnp.where(seen[:, None, None], acc2, acc))

  live = (jnp.max(nv, initial=0) + block - 1) // block
  m, l, acc = jax.lax.fori_loop(0, live, body, (m, l, acc))
  denom = l + jnp.exp(sink_H.astype(jnp.float32)[None, :] - m)
  ok = (denom > 0) & jnp.isfinite(denom)
  out = jnp.where(ok[..., None], acc / jnp.where(ok, denom, 1.0)[..., None], 0.0)
  return out.astype(q_NxHxD.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Pallas kernel
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HcaAttentionTuning:
  """Static tiling of the HCA kernel (`None` in the call = `default_tuning(pools)`).

  block_h: heads per program (power of two, >= 16 for the Triton dot; smaller H is padded).
  block_k: window ids / entries per step (power of two, dividing DENSE_BLOCK_ENTRIES so that the steps tile the
    reference's 64-entry blocks in order).
  num_warps / num_stages: Triton launch and software-pipelining depth of the key loops.
  `default_tuning` picks the spill-free tilings below. debug: print the kernel jaxpr and Triton module when
  lowering."""
  block_h: int = 64
  block_k: int = 16
  num_warps: int = 8
  num_stages: int = 3
  debug: bool = False

  def __post_init__(self):
    for name in ("block_h", "block_k"):
      v = getattr(self, name)
      if v <= 0 or v & (v - 1):
        raise ValueError(f"{name} must be a positive power of two, got {v}")
    if DENSE_BLOCK_ENTRIES % self.block_k:
      raise ValueError(f"block_k must divide {DENSE_BLOCK_ENTRIES}, got {self.block_k}")


# Spill-free at sm_90a (benchmarks/sm90_compile.py, docs/kernels.md): the table gather in front of each step's row
# gather costs registers the sparse kernel's tilings do not have. bf16: 64 heads, 2 stages (3 spill ~400 B); FP8:
# 16 heads and 4 warps a program (32 heads spill ~450 B; 8 warps spill 12 B of the FP8 record once the table row
# is a loaded index), four programs a token, their rows shared through L2, two CTAs an SM.
BF16_TUNING = HcaAttentionTuning(num_stages=2)
FP8_TUNING = HcaAttentionTuning(block_h=16, num_warps=4)


def default_tuning(pools) -> HcaAttentionTuning:
  return FP8_TUNING if any(_sa.is_fp8_pool(p) for p in pools if p is not None) else BF16_TUNING


def _hca_kernel(live_ref, *refs, **kw):
  """A query at or past `live` (the step's dead tokens): the program returns, reading and writing nothing more."""
  @pl.when(pl.program_id(0) < _sa._pick(live_ref[...], 0))
  def _():
    _hca_program(*refs, **kw)


def _hca_program(*refs, plan, Dn, wmeta, cmeta, block_k, epb, F, qk_scale2, cdtype):
  """One program: one query token, block_h heads; the window, then the entries 0..nv-1 in order.

  refs: q, sink, lens [win_len, nv, table row], window ids [nblk, block_k], table [S * F] (whole, flat, read in
  place), window pool arrays, comp pool arrays, out."""
  q_ref, sink_ref, lens_ref, widx_ref, table_ref = refs[:5]
  nw, nc = wmeta[0], cmeta[0]
  warrs = refs[5:5 + nw]
  carrs = refs[5 + nw:5 + nw + nc]
  o_ref = refs[5 + nw + nc]
  prec = _sa._precision_for(cdtype)
  bk = block_k

  bh = q_ref.shape[0]
  q_chunks = [q_ref[:, pl.ds(c0, w)].astype(cdtype) for c0, w, _ in plan]
  carry = (jnp.full((bh,), -jnp.inf, jnp.float32), jnp.zeros((bh,), jnp.float32),
           tuple(jnp.zeros((bh, w), jnp.float32) for _, w, _ in plan))
  lens = lens_ref[...]
  wl = jnp.clip(_sa._pick(lens, 0), 0, widx_ref.shape[0] * bk)
  nv = jnp.clip(_sa._pick(lens, 1), 0, F * epb)

  def step(carry, valid, ids, arrs, kind, meta):
    m, l, accs = carry
    safe = jnp.where(valid, ids, 0)  # explicit clamp: never rely on interpret-mode clamping
    ks = _sa._load_plan(arrs, kind, meta, safe, valid, plan, Dn, cdtype)
    s = _sa._dot_nt(q_chunks[0], ks[0], prec)
    for qc, kc in zip(q_chunks[1:], ks[1:]):
      s = s + _sa._dot_nt(qc, kc, prec)
    s = jnp.where(valid[None, :], s * qk_scale2, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    pc = p.astype(cdtype)
    accs = tuple(a * alpha[:, None] + _sa._dot_nn(pc, kc, prec) for a, kc in zip(accs, ks))
    return m_new, l, accs

  _, wkind, wP, wpm = wmeta

  def wbody(j, carry):
    ids = widx_ref[pl.ds(j, 1), :].reshape(bk)
    posn = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
    valid = (ids >= 0) & (ids < wP) & (posn < wl)
    return step(carry, valid, ids, warrs, wkind, wpm)

  carry = jax.lax.fori_loop(0, (wl + bk - 1) // bk, wbody, carry)

  _, ckind, cP, cpm = cmeta
  # The first word of the query's row of the flat table (the wrapper zeroes nv for a row outside it), read here so
  # that it holds no register through the window loop.
  row0 = _sa._pick(lens_ref[...], 2)

  def cbody(j, carry):
    e = j * bk + jax.lax.broadcasted_iota(jnp.int32, (bk,), 0)
    inb = e < nv
    word = row0 + jnp.where(inb, e // epb, 0)
    if _pl_triton is None:  # pragma: no cover - no Triton backend: plain gather + select
      blk = jnp.where(inb, table_ref[word], -1)
    else:  # a masked gather of this step's words of the query's own table row
      blk = _pl_triton.load(table_ref.at[word], mask=inb, other=-1)
    rows = blk * epb + e % epb
    valid = inb & (blk >= 0) & (rows < cP)
    return step(carry, valid, rows, carrs, ckind, cpm)

  carry = jax.lax.fori_loop(0, (nv + bk - 1) // bk, cbody, carry)

  m, l, accs = carry
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  sink2 = sink_ref[...].astype(jnp.float32) * _sa._LOG2E
  denom = l + jnp.exp2(sink2 - m_safe)
  ok = (denom > 0) & (denom < jnp.inf)
  inv = jnp.where(ok, 1.0 / jnp.where(ok, denom, 1.0), 0.0)  # no key at all (padding): acc = 0, out 0
  for (c0, w, _), a in zip(plan, accs):
    o_ref[:, pl.ds(c0, w)] = (a * inv[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "entries_per_block", "interpret", "tuning"))
def hca_attention_pallas(q_NxHxD, window_pool_PxD, window_idx_NxW, window_len_N, comp_pool_QxD, table_SxF,
                         num_visible_N, sink_H, table_rows_N=None, live=None, *, scale: float, entries_per_block: int,
                         interpret: bool = False, tuning: HcaAttentionTuning | None = None):
  """Pallas (Triton-GPU) kernel with the contract of `hca_attention_reference` (`live`: queries at or past it are
  skipped, their outputs unspecified)."""
  t = tuning or default_tuning([window_pool_PxD, comp_pool_QxD])
  N, H, D = q_NxHxD.shape
  for name, x in (("window_len_N", window_len_N), ("num_visible_N", num_visible_N)):
    _sa.check_len(name, x, window_idx_NxW, N)
  pools = [window_pool_PxD, comp_pool_QxD]
  plan = _sa._chunk_plan(D, pools, 0)
  fp8_pools = [p for p in pools if _sa.is_fp8_pool(p)]
  Dn = _sa._nope_dim(fp8_pools[0]) if fp8_pools else D
  perm = _sa._plan_perm(plan, Dn)
  identity = perm == list(range(D))
  cdtype = q_NxHxD.dtype if q_NxHxD.dtype in (jnp.float32, jnp.bfloat16, jnp.float16) else jnp.bfloat16

  bh = min(t.block_h, max(16, _sa._next_pow2(H)))
  Hp = -(-H // bh) * bh
  q = q_NxHxD if identity else q_NxHxD[:, :, jnp.asarray(perm)]
  q = q if Hp == H else jnp.pad(q, ((0, 0), (0, Hp - H), (0, 0)))
  sink = sink_H.astype(jnp.float32)
  sink = sink if Hp == H else jnp.pad(sink, (0, Hp - H))

  bk = t.block_k
  widx = _sa._pad_idx(window_idx_NxW, bk)
  S, F = table_SxF.shape
  rows_N = table_rows(table_SxF, table_rows_N, N)
  in_table = (rows_N >= 0) & (rows_N < S)
  # The table goes in whole, as the engine keeps it: each program gathers the words of its own row it visits, so
  # nothing per query is built at the table's width. lens[:, 3] (a power-of-two block): window length, visible
  # count (0 for a row outside the table), table row, unused.
  table = table_SxF.astype(jnp.int32).reshape(S * F)  # flat: a row is one scalar offset in the kernel
  lens_Nx4 = jnp.stack([jnp.clip(window_len_N.astype(jnp.int32), 0, window_idx_NxW.shape[1]),
                        jnp.where(in_table, num_visible_N.astype(jnp.int32), 0),
                        jnp.where(in_table, rows_N, 0) * F, jnp.zeros_like(rows_N)], axis=1)

  live_1 = jnp.reshape(jnp.clip(jnp.asarray(N if live is None else live, jnp.int32), 0, N), (1,))
  args = [live_1, q, sink, lens_Nx4, widx, table]
  in_specs = [pl.BlockSpec((1,), lambda n, h: (0,)),
              pl.BlockSpec((None, bh, D), lambda n, h: (n, h, 0)),
              pl.BlockSpec((bh,), lambda n, h: (h,)),
              pl.BlockSpec((None, 4), lambda n, h: (n, 0)),
              pl.BlockSpec((None,) + widx.shape[1:], lambda n, h: (n, 0, 0)),
              pl.BlockSpec(table.shape, lambda n, h: (0,))]
  metas = []
  for pool in pools:
    kind, arrs = _sa._pool_kind_arrays(pool, 2 ** 31)
    for a in arrs:
      args.append(a)
      in_specs.append(pl.BlockSpec(a.shape, lambda n, h, nd=a.ndim: (0,) * nd))
    pmeta = None
    if kind == "paged":
      pmeta = (pool.page_size, pool.row_words, pool.scale_cols // 2, pool.tail_word0)
    metas.append((len(arrs), kind, _sa.pool_rows(pool), pmeta))

  kernel = functools.partial(_hca_kernel, plan=plan, Dn=Dn, wmeta=metas[0], cmeta=metas[1], block_k=bk,
                             epb=int(entries_per_block), F=F, qk_scale2=float(scale) * _sa._LOG2E, cdtype=cdtype)
  compiler_params = None
  if _pl_triton is not None:
    compiler_params = _pl_triton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)
  out = pl.pallas_call(
      kernel, grid=(N, Hp // bh), in_specs=in_specs,
      out_specs=pl.BlockSpec((None, bh, D), lambda n, h: (n, h, 0)),
      out_shape=jax.ShapeDtypeStruct((N, Hp, D), q_NxHxD.dtype),
      compiler_params=compiler_params, interpret=interpret, debug=t.debug, name="dsv4_hca")(*args)
  out = out[:, :H]
  if not identity:
    out = out[:, :, jnp.asarray(sorted(range(D), key=perm.__getitem__))]
  return out


def hca_attention_kernel(q_NxHxD, window_pool_PxD, window_idx_NxW, window_len_N, comp_pool_QxD, table_SxF,
                         num_visible_N, sink_H, table_rows_N=None, live=None, *, scale: float, entries_per_block: int,
                         interpret: bool = False, tuning: HcaAttentionTuning | None = None):
  """Dispatcher entry point (registered as "hca_attention")."""
  return hca_attention_pallas(q_NxHxD, window_pool_PxD, window_idx_NxW, window_len_N, comp_pool_QxD, table_SxF,
                              num_visible_N, sink_H, table_rows_N, live, scale=float(scale),
                              entries_per_block=int(entries_per_block), interpret=interpret, tuning=tuning)


KERNELS = {"hca_attention": hca_attention_kernel}
