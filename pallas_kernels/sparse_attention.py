"""Sparse MLA attention over a window pool and a compressed pool, with a per-head sink.

Contract (shared by the reference and every kernel):
  q_NxHxD        queries (N flattened query tokens), already RoPE'd.
  window_pool_PxD, window_idx_NxW   rows of the SWA pool each query attends to (-1 = none).
  comp_pool_QxD,   comp_idx_NxK     rows of the compressed pool (top-k picks, or all visible HCA entries; -1 = none).
  sink_H         one logit per head, added to the softmax denominator only.
Returns out_NxHxD = sum_j p_j v_j with p = exp(s_j) / (sum_j exp(s_j) + exp(sink)), and lse_NxH = log sum_j exp(s_j)
over the real keys only (the sink is not included; -inf when a row has no valid key). K = V (one shared latent).

Ids outside [0, pool rows) are invalid exactly like -1 (clamped for the read and masked explicitly).
A pool is either a plain [P, D] array (any float dtype) or an `Fp8KVPool` (V4 FP8 record, dequantized in-kernel).

The Pallas kernel (`sparse_attention_pallas`) is written for the Pallas-Triton GPU backend (see NOTES.md for why):
grid (query token, head block, key split); each program keeps block_h heads of one query token in registers, walks
the token's window ids and then its compressed ids block_k at a time, gathers those rows straight from the pool by
indexing the pool ref with the id vector, and runs an online softmax (base 2). With one split it applies the sink and
writes the final out/lse; with several splits (decode at small batch) it writes per-split partials that a tiny XLA
epilogue merges (flash-decoding).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Pallas-Triton: deprecated in JAX 0.11 but still shipped; see NOTES.md.
  from jax.experimental.pallas import triton as _pl_triton
except ImportError:  # pragma: no cover - future JAX without the Triton backend.
  _pl_triton = None

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


# ----------------------------------------------------------------------------------------------------------------
# FP8 cache rows (V4 serving record, spec §1.9 / anchors §0): the first D - R channels as e4m3 in blocks of 64 with
# one power-of-two (UE8M0) scale per block, the last R (RoPE) channels kept bf16. The record's 7 scales + 1 pad byte
# are stored as 8 uint8 exponents (bias 127) so every in-kernel shape stays a power of two.
# ----------------------------------------------------------------------------------------------------------------


class Fp8KVPool(NamedTuple):
  """A quantized KV pool (a pytree). nope_PxDn float8_e4m3fn, scale_PxS uint8 UE8M0 exponents (S >= Dn / block,
  unused columns are padding), rope_PxR bfloat16. Row r dequantizes to
  concat(nope[r, c] * 2^(scale[r, c // block] - 127), rope[r])."""
  nope: jax.Array
  scale: jax.Array
  rope: jax.Array

  @property
  def shape(self):
    return (self.nope.shape[0], self.nope.shape[1] + self.rope.shape[1])

  @property
  def block(self) -> int:
    return FP8_BLOCK

  @property
  def bytes_per_row(self) -> int:
    return (self.nope.shape[1] * self.nope.dtype.itemsize + self.scale.shape[1] * self.scale.dtype.itemsize
            + self.rope.shape[1] * self.rope.dtype.itemsize)


FP8_BLOCK = 64
_E4M3_MAX = 448.0


def _next_pow2(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


def quantize_kv_fp8(x_PxD, rope_dim: int = 64) -> Fp8KVPool:
  """Quantize KV rows to the V4 FP8 record: e4m3 + UE8M0 scale per 64 channels (nope part), bf16 RoPE part."""
  P, D = x_PxD.shape
  Dn = D - rope_dim
  assert Dn % FP8_BLOCK == 0, (D, rope_dim)
  nb = Dn // FP8_BLOCK
  xn = x_PxD[:, :Dn].astype(jnp.float32).reshape(P, nb, FP8_BLOCK)
  amax = jnp.max(jnp.abs(xn), axis=-1)
  # Smallest power of two with amax / 2^e <= 448 (UE8M0: scale = 2^(e8 - 127)).
  e = jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-30) / _E4M3_MAX))
  e = jnp.where(amax > 0, e, 0.0)
  e8 = jnp.clip(e + 127.0, 0.0, 254.0)
  scale = jnp.exp2(e8 - 127.0)
  q = jnp.clip(xn / scale[..., None], -_E4M3_MAX, _E4M3_MAX).astype(jnp.float8_e4m3fn).reshape(P, Dn)
  s_cols = _next_pow2(nb)
  scale_u8 = jnp.zeros((P, s_cols), jnp.uint8).at[:, :nb].set(e8.astype(jnp.uint8))
  return Fp8KVPool(q, scale_u8, x_PxD[:, Dn:].astype(jnp.bfloat16))


def dequantize_kv_fp8(pool: Fp8KVPool, dtype=jnp.float32):
  """Reference dequantization of a whole pool (or of gathered rows: any leading shape)."""
  Dn = pool.nope.shape[-1]
  nb = Dn // FP8_BLOCK
  sc = jnp.exp2(pool.scale[..., :nb].astype(jnp.float32) - 127.0)
  nope = pool.nope.astype(jnp.float32).reshape(*pool.nope.shape[:-1], nb, FP8_BLOCK) * sc[..., None]
  nope = nope.reshape(pool.nope.shape)
  return jnp.concatenate([nope, pool.rope.astype(jnp.float32)], axis=-1).astype(dtype)


def pool_rows(pool) -> int:
  return pool.shape[0]


def pool_row_bytes(pool) -> int:
  if isinstance(pool, Fp8KVPool):
    return pool.bytes_per_row
  return pool.shape[1] * jnp.dtype(pool.dtype).itemsize


# ----------------------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------------------


def _gather_rows(pool, idx_NxK):
  P = pool_rows(pool)
  valid = (idx_NxK >= 0) & (idx_NxK < P)
  safe = jnp.where(valid, idx_NxK, 0)
  if isinstance(pool, Fp8KVPool):
    rows = dequantize_kv_fp8(Fp8KVPool(*(jnp.take(a, safe, axis=0) for a in pool)), jnp.float32)
  else:
    rows = jnp.take(pool, safe, axis=0)
  return rows, valid


def sparse_attention_reference(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H,
                               *, scale: float):
  """Plain-XLA reference. fp32 softmax; inputs may be bf16 or fp32 (or Fp8KVPool, dequantized first).

  Numerics: the key max m (not max(m, sink)) anchors the exponentials, so lse stays exact for sinks far above the
  logits; out uses denominator l + exp(sink - m) and is 0 when that is 0 or inf (all-invalid rows, sink = +inf).
  """
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
  """Static tiling of the sparse attention kernel.

  block_h: heads per program (power of two, >= 16 for the Triton dot; smaller H is padded).
  block_k: keys (gathered rows) per inner step (power of two).
  num_splits: key splits per (token, head block); 0 = auto (split only when there are fewer programs than
    target_programs / 2 = one wave of 132 H200 SMs; then aim for ~2 waves).
  chunk_d: the latent is processed in column chunks of this width (power of two; 0 = whole row for plain pools,
    the FP8 block for FP8 pools). Chunks bound register pressure and carry the per-block FP8 scales.
  """
  block_h: int = 64
  block_k: int = 32
  num_splits: int = 0
  chunk_d: int = 0
  num_warps: int = 8
  num_stages: int = 2
  target_programs: int = 264

  def __post_init__(self):
    for name in ("block_h", "block_k"):
      v = getattr(self, name)
      if v <= 0 or v & (v - 1):
        raise ValueError(f"{name} must be a positive power of two, got {v}")
    if self.chunk_d and self.chunk_d & (self.chunk_d - 1):
      raise ValueError(f"chunk_d must be a power of two, got {self.chunk_d}")
    if self.num_splits < 0:
      raise ValueError("num_splits must be >= 0")


def _chunk_plan(D: int, pools, chunk_d: int):
  """Column chunks (start, width) shared by every pool: FP8 pools force FP8_BLOCK-aligned chunks that do not
  straddle the nope/rope boundary."""
  fp8 = [p for p in pools if isinstance(p, Fp8KVPool)]
  w = chunk_d or (FP8_BLOCK if fp8 else D)
  if fp8:
    w = min(w, FP8_BLOCK)
    for p in fp8:
      assert p.nope.shape[1] % w == 0 and p.shape[1] == D, (p.nope.shape, p.rope.shape, D)
  assert D % w == 0, (D, w)
  return tuple((c, w) for c in range(0, D, w))


def _pool_arrays(pool):
  return tuple(pool) if isinstance(pool, Fp8KVPool) else (pool,)


def _load_chunk(refs, is_fp8, ids, c0, w, dtype):
  """Gather rows `ids` (already clamped) of one column chunk from a pool, as `dtype` [len(ids), w]."""
  if not is_fp8:
    return refs[0][ids, pl.ds(c0, w)].astype(dtype)
  nope_ref, scale_ref, rope_ref = refs
  Dn = nope_ref.shape[1]
  if c0 >= Dn:
    return rope_ref[ids, pl.ds(c0 - Dn, w)].astype(dtype)
  e = scale_ref[ids, c0 // FP8_BLOCK].astype(jnp.float32)
  s = jnp.exp2(e - 127.0)
  return (nope_ref[ids, pl.ds(c0, w)].astype(jnp.float32) * s[:, None]).astype(dtype)


def _dot_nt(a, b):
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_nn(a, b):
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _sparse_kernel(*refs, plan, pools_meta, block_k, nblocks, num_splits, per_split, qk_scale2, cdtype):
  """One program: one query token, block_h heads, one split of the key blocks.

  refs: q, sink, then per pool (idx, pool arrays...), then outputs (out, lse)."""
  q_ref, sink_ref = refs[0], refs[1]
  pos = 2
  pool_refs = []
  for n_arr, is_fp8, P in pools_meta:
    pool_refs.append((refs[pos], refs[pos + 1:pos + 1 + n_arr], is_fp8, P))
    pos += 1 + n_arr
  o_ref, lse_ref = refs[pos], refs[pos + 1]

  bh = q_ref.shape[0]
  q_chunks = [q_ref[:, pl.ds(c0, w)].astype(cdtype) for c0, w in plan]
  m0 = jnp.full((bh,), -jnp.inf, jnp.float32)
  l0 = jnp.zeros((bh,), jnp.float32)
  acc0 = tuple(jnp.zeros((bh, w), jnp.float32) for _, w in plan)
  carry = (m0, l0, acc0)

  split = pl.program_id(2)
  lo = split * per_split
  hi = jnp.minimum(lo + per_split, sum(nblocks))
  base = 0
  for (idx_ref, arrs, is_fp8, P), nb in zip(pool_refs, nblocks):
    def body(j, carry, idx_ref=idx_ref, arrs=arrs, is_fp8=is_fp8, P=P):
      m, l, accs = carry
      ids = idx_ref[pl.ds(j * block_k, block_k)]
      valid = (ids >= 0) & (ids < P)
      safe = jnp.where(valid, ids, 0)  # explicit clamp: never rely on interpret-mode clamping
      ks = [_load_chunk(arrs, is_fp8, safe, c0, w, cdtype) for c0, w in plan]
      s = _dot_nt(q_chunks[0], ks[0])
      for qc, kc in zip(q_chunks[1:], ks[1:]):
        s = s + _dot_nt(qc, kc)
      s = jnp.where(valid[None, :], s * qk_scale2, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=1))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp2(m - m_safe)
      p = jnp.exp2(s - m_safe[:, None])
      l = l * alpha + jnp.sum(p, axis=1)
      pc = p.astype(cdtype)
      accs = tuple(a * alpha[:, None] + _dot_nn(pc, kc) for a, kc in zip(accs, ks))
      return m_new, l, accs

    start = jnp.clip(lo - base, 0, nb)
    stop = jnp.clip(hi - base, 0, nb)
    carry = jax.lax.fori_loop(start, stop, body, carry)
    base += nb

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
  for (c0, w), a in zip(plan, accs):
    o_ref[:, pl.ds(c0, w)] = (a * inv[:, None]).astype(o_ref.dtype)
  lse_ref[...] = lse


def _merge_splits(o_NxSxHxD, lse_NxSxH, sink_H, out_dtype):
  m = jnp.max(lse_NxSxH, axis=1)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  w = jnp.exp(lse_NxSxH - m_safe[:, None, :])
  L = jnp.sum(w, axis=1)
  denom = L + jnp.exp(sink_H.astype(jnp.float32)[None, :] - m_safe)
  acc = jnp.einsum("nsh,nshd->nhd", w, o_NxSxHxD, precision=jax.lax.Precision.HIGHEST)
  ok = (denom > 0) & jnp.isfinite(denom)
  out = jnp.where(ok[..., None], acc / jnp.where(ok, denom, 1.0)[..., None], 0.0)
  lse = jnp.where(L > 0, jnp.log(jnp.maximum(L, 1e-37)) + m_safe, -jnp.inf)
  return out.astype(out_dtype), lse


def _pad_idx(idx_NxK, block_k):
  K = idx_NxK.shape[1]
  Kp = max(block_k, -(-K // block_k) * block_k)
  if Kp != K:
    idx_NxK = jnp.pad(idx_NxK, ((0, 0), (0, Kp - K)), constant_values=-1)
  return idx_NxK.astype(jnp.int32)


def auto_num_splits(N: int, head_blocks: int, nblocks: int, target_programs: int) -> int:
  progs = N * head_blocks
  if 2 * progs >= target_programs:  # at least one full wave of SMs already
    return 1
  return max(1, min(nblocks, -(-target_programs // progs), 64))


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "tuning"))
def sparse_attention_pallas(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H, *,
                            scale: float, interpret: bool = False, tuning: SparseAttentionTuning | None = None):
  """Pallas (Triton-GPU) kernel with the contract of `sparse_attention_reference`."""
  t = tuning or SparseAttentionTuning()
  N, H, D = q_NxHxD.shape
  pools = [(window_pool_PxD, window_idx_NxW)]
  if comp_pool_QxD is not None and comp_idx_NxK is not None and comp_idx_NxK.shape[-1] > 0:
    pools.append((comp_pool_QxD, comp_idx_NxK))
  plan = _chunk_plan(D, [p for p, _ in pools], t.chunk_d)
  cdtype = q_NxHxD.dtype if q_NxHxD.dtype in (jnp.float32, jnp.bfloat16, jnp.float16) else jnp.bfloat16

  bh = min(t.block_h, max(16, _next_pow2(H)))
  Hp = -(-H // bh) * bh
  q = q_NxHxD if Hp == H else jnp.pad(q_NxHxD, ((0, 0), (0, Hp - H), (0, 0)))
  sink = sink_H.astype(jnp.float32)
  sink = sink if Hp == H else jnp.pad(sink, (0, Hp - H))
  nhb = Hp // bh

  bk = t.block_k
  idxs = [_pad_idx(idx, bk) for _, idx in pools]
  nblocks = tuple(i.shape[1] // bk for i in idxs)
  total = sum(nblocks)
  S = t.num_splits or auto_num_splits(N, nhb, total, t.target_programs)
  S = max(1, min(S, total))
  per_split = -(-total // S)
  S = -(-total // per_split)

  args = [q, sink]
  in_specs = [pl.BlockSpec((None, bh, D), lambda n, h, s: (n, h, 0)),
              pl.BlockSpec((bh,), lambda n, h, s: (h,))]
  meta = []
  for (pool, _), idx in zip(pools, idxs):
    args.append(idx)
    in_specs.append(pl.BlockSpec((None, idx.shape[1]), lambda n, h, s: (n, 0)))
    arrs = _pool_arrays(pool)
    for a in arrs:
      args.append(a)
      in_specs.append(pl.BlockSpec(a.shape, lambda n, h, s, nd=a.ndim: (0,) * nd))
    meta.append((len(arrs), isinstance(pool, Fp8KVPool), pool_rows(pool)))

  if S == 1:
    out_shape = [jax.ShapeDtypeStruct((N, Hp, D), q_NxHxD.dtype), jax.ShapeDtypeStruct((N, Hp), jnp.float32)]
    out_specs = [pl.BlockSpec((None, bh, D), lambda n, h, s: (n, h, 0)),
                 pl.BlockSpec((None, bh), lambda n, h, s: (n, h))]
  else:
    out_shape = [jax.ShapeDtypeStruct((N, S, Hp, D), jnp.float32), jax.ShapeDtypeStruct((N, S, Hp), jnp.float32)]
    out_specs = [pl.BlockSpec((None, None, bh, D), lambda n, h, s: (n, s, h, 0)),
                 pl.BlockSpec((None, None, bh), lambda n, h, s: (n, s, h))]

  kernel = functools.partial(_sparse_kernel, plan=plan, pools_meta=tuple(meta), block_k=bk, nblocks=nblocks,
                             num_splits=S, per_split=per_split, qk_scale2=float(scale) * _LOG2E, cdtype=cdtype)
  compiler_params = None
  if _pl_triton is not None:
    compiler_params = _pl_triton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)
  out, lse = pl.pallas_call(
      kernel, grid=(N, nhb, S), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=compiler_params, interpret=interpret, name="dsv4_sparse_mla")(*args)
  if S > 1:
    out, lse = _merge_splits(out, lse, sink, q_NxHxD.dtype)
  return out[:, :H], lse[:, :H]


def sparse_attention_kernel(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H, *,
                            scale: float, interpret: bool = False, tuning: SparseAttentionTuning | None = None):
  """Dispatcher entry point (registered as "sparse_attention")."""
  return sparse_attention_pallas(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H,
                                 scale=float(scale), interpret=interpret, tuning=tuning)


KERNELS = {"sparse_attention": sparse_attention_kernel}
