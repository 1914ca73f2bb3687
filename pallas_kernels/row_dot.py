"""A row-invariant matmul: y = x @ w whose row bits do not depend on the number of rows or on the other rows.

Contract (shared by the reference and the kernel):
  x_NxK            rows (bf16, f16 or f32), the same dtype as w.
  w_KxM            weights.
  live             None (every row) or an int32 scalar: rows >= live may hold anything and give exact zeros.
  out_dtype        the output's dtype (None = x's); products accumulate in fp32.
Returns y_NxM.

Why a kernel: XLA's GPU dot goes to cuBLAS, which picks its kernel (tiles, split-K) from the row count, so a row's
bits change with the batch it sits in (benchmarks/probes/dot_row_bits.py shows it). Here nothing is chosen from N:
every program owns a fixed block_rows x block_cols tile and reduces over K in block_k steps in ascending order,
so an output element sees the same products in the same order whatever N, `live` or its neighbours are.

Fixed split-K (`RowDotTuning.k_splits` = S > 1): a third grid axis of S programs per output tile; program s reduces
K range [s K/S, (s+1) K/S) in ascending block_k steps into an fp32 partial of a [S, N, M] buffer, and the wrapper
adds the partials left to right, ((p0 + p1) + p2) + ..., as unrolled elementwise adds (a jnp.sum's tree is XLA's
choice), then casts. S comes from the tuning, never from N, so the bits still depend on (block_k, k_splits) only.
It exists for decode: with few rows there are only M / block_cols output tiles (32 at M = 4096), too few programs
to stream the weights at HBM rate; S multiplies them. Its price: the fp32 buffer written once and read once.

One launch covers every row; the programs of one column block read the same weight tiles, shared through L2, so
the weights cross HBM about once (the cost of a plain GEMM). A program whose row block starts at or past `live`
does no dot and writes zeros: the shapes stay fixed while the work follows the live rows.

Shapes: N is padded to a multiple of block_rows in the wrapper (rows are cheap, and padding rows never touch a live
row's reduction); K and M must be multiples of block_k and block_cols (a ValueError says so): padding the weights
would copy them on every call, so a model pads its weights once, at load time, if ever.

The reference (`row_dot_reference`, the XLA fallback) is jnp.dot with fp32 accumulation: the same numbers within
the rounding of a different summation order, and not row invariant on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import sparse_attention as _sa

_pl_triton = _sa._pl_triton

DOT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


# ----------------------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------------------


def check_operands(x, w, x_name: str, w_name: str, k_axis: int) -> None:
  """ValueError (one line) for operands the kernels do not take: mismatched dtypes or contraction sizes."""
  if x.dtype != w.dtype or jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in DOT_DTYPES]:
    raise ValueError(f"{x_name} and {w_name} must share one of bfloat16, float16, float32; got {x.dtype} and "
                     f"{w.dtype}")
  if x.shape[-1] != w.shape[k_axis]:
    raise ValueError(f"{x_name} {tuple(x.shape)} and {w_name} {tuple(w.shape)} disagree on K")


def dot_precision(dtype):
  """fp32 operands get HIGHEST (IEEE products, never TF32); 16-bit operands the default (exact products)."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def live_rows_mask(N: int, live):
  """bool [N]: rows below `live` (None = every row)."""
  if live is None:
    return jnp.ones((N,), bool)
  return jnp.arange(N, dtype=jnp.int32) < jnp.asarray(live, jnp.int32)


def row_dot_reference(x_NxK, w_KxM, live=None, *, out_dtype=None):
  """Plain-JAX reference: jnp.dot with fp32 accumulation, rows >= live zero."""
  check_operands(x_NxK, w_KxM, "x_NxK", "w_KxM", 0)
  y = jnp.dot(x_NxK, w_KxM, preferred_element_type=jnp.float32, precision=dot_precision(x_NxK.dtype))
  y = jnp.where(live_rows_mask(x_NxK.shape[0], live)[:, None], y, 0.0)
  return y.astype(out_dtype or x_NxK.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Pallas kernel
# ----------------------------------------------------------------------------------------------------------------


def check_block(name: str, v: int, least: int = 16) -> None:
  if v < least or v & (v - 1):
    raise ValueError(f"{name} must be a power of two >= {least} (a Triton dot tile), got {v}")


def check_launch(num_warps: int, num_stages: int) -> None:
  if num_warps not in (1, 2, 4, 8, 16):
    raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {num_warps}")
  if num_stages < 1:
    raise ValueError(f"num_stages must be >= 1, got {num_stages}")


@dataclasses.dataclass(frozen=True)
class RowDotTuning:
  """Static tiling of the row-invariant matmul. Nothing here is chosen from the row count: that is the invariance.

  block_rows / block_cols: the output tile of one program (powers of two >= 16).
  block_k: the K step; each program sums its partial dots in ascending order (power of two >= 16).
  k_splits: S, the fixed split of K (a power of two; K / block_k must be a multiple of it). S > 1 launches S
    programs per output tile, each over K / S, and adds their fp32 partials in the fixed order p0 + p1 + ... At
    decode (N <= 64 rows, one row block) the grid is M / block_cols x S programs: for V4-Flash's K = M = 4096 with
    block_cols 128 that is 32 x S, so S = 4 or 8 (128 or 256 programs on 132 SMs, 16 or 8 K steps of 64 each)
    fills the machine, at the cost of an S x N_padded x M fp32 buffer (8 MiB for S = 8, N <= 64, M = 4096) written
    and read once; the buffer grows with N (256 MiB at 2048 rows), which prefill pays. A change of k_splits (or
    block_k) changes the bits, so one engine keeps one tuning for every step, decode and prefill alike; never pick
    S from the row count.
  num_warps / num_stages: Triton launch and software-pipelining depth of the K loop.
  debug: print the kernel jaxpr and Triton module when lowering."""
  block_rows: int = 64
  block_cols: int = 128
  block_k: int = 64
  k_splits: int = 1
  num_warps: int = 4
  num_stages: int = 3
  debug: bool = False

  def __post_init__(self):
    for name in ("block_rows", "block_cols", "block_k"):
      check_block(name, getattr(self, name))
    if self.k_splits < 1 or self.k_splits & (self.k_splits - 1):
      raise ValueError(f"k_splits must be a power of two >= 1, got {self.k_splits}")
    check_launch(self.num_warps, self.num_stages)


def check_divides(K: int, M: int, block_k: int, block_cols: int, k_splits: int = 1) -> None:
  if K % block_k or M % block_cols:
    raise ValueError(f"K={K} and M={M} must be multiples of block_k={block_k} and block_cols={block_cols} (pad the "
                     "weights once at load time, or pick a tuning whose blocks divide them)")
  if (K // block_k) % k_splits:
    raise ValueError(f"K / block_k = {K // block_k} K steps do not split into k_splits={k_splits} equal parts")


def _pick0(ref):
  """The one element of a [1] ref as a scalar (Triton has no vector indexing)."""
  return _sa._pick(ref[...], 0)


def k_loop(x_tile, w_tile, acc, num_k: int, block_k: int, cdtype):
  """acc + sum over k = 0 .. num_k - 1 (in that order) of x_tile(k) @ w_tile(k): the fixed reduction."""
  prec = _sa._precision_for(cdtype)

  def body(k, acc):
    return acc + _sa._dot_nn(x_tile(k).astype(cdtype), w_tile(k).astype(cdtype), prec)

  return jax.lax.fori_loop(0, num_k, body, acc)


def _row_dot_kernel(live_ref, x_ref, w_ref, o_ref, *, block_k: int):
  """One program: rows i*block_rows .., columns j*block_cols .., K split s; refs x [block_rows, K / S],
  w [K / S, block_cols] (S = k_splits), o the tile of the output (S = 1) or of split s's fp32 partial."""
  br, bc = o_ref.shape
  row0 = pl.program_id(0) * br
  live = _pick0(live_ref)

  @pl.when(row0 < live)
  def _():
    acc = k_loop(lambda k: x_ref[:, pl.ds(k * block_k, block_k)], lambda k: w_ref[pl.ds(k * block_k, block_k), :],
                 jnp.zeros((br, bc), jnp.float32), x_ref.shape[1] // block_k, block_k, x_ref.dtype)
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (br, bc), 0)
    o_ref[...] = jnp.where(rows < live, acc, 0.0).astype(o_ref.dtype)

  @pl.when(row0 >= live)
  def _():
    o_ref[...] = jnp.zeros((br, bc), o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tuning", "interpret", "out_dtype"))
def row_dot_pallas(x_NxK, w_KxM, live=None, *, tuning: RowDotTuning = RowDotTuning(), interpret: bool = False,
                   out_dtype=None):
  """Pallas (Triton-GPU) kernel with the contract of `row_dot_reference`; grid (cdiv(N, block_rows),
  M / block_cols, k_splits)."""
  t = tuning
  check_operands(x_NxK, w_KxM, "x_NxK", "w_KxM", 0)
  (N, K), M = x_NxK.shape, w_KxM.shape[1]
  check_divides(K, M, t.block_k, t.block_cols, t.k_splits)
  out_dtype = jnp.dtype(out_dtype or x_NxK.dtype)
  br, bc, S = t.block_rows, t.block_cols, t.k_splits
  Np = max(1, -(-N // br)) * br
  nrb, ks = Np // br, K // S
  x = x_NxK if Np == N else jnp.pad(x_NxK, ((0, Np - N), (0, 0)))
  live_1 = jnp.reshape(jnp.clip(jnp.asarray(N if live is None else live, jnp.int32), 0, N), (1,))
  compiler_params = None
  if _pl_triton is not None:
    compiler_params = _pl_triton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)
  y = pl.pallas_call(
      functools.partial(_row_dot_kernel, block_k=t.block_k), grid=(nrb, M // bc, S),
      in_specs=[pl.BlockSpec((1,), lambda i, j, s: (0,)),
                pl.BlockSpec((br, ks), lambda i, j, s: (i, s)),
                pl.BlockSpec((ks, bc), lambda i, j, s: (s, j))],
      # the partials as [S * Np, M] (split s's rows at s * Np): 2-D blocks, no squeezed axis
      out_specs=pl.BlockSpec((br, bc), lambda i, j, s: (s * nrb + i, j)),
      out_shape=jax.ShapeDtypeStruct((S * Np, M), out_dtype if S == 1 else jnp.float32),
      compiler_params=compiler_params, interpret=interpret, debug=t.debug, name="dsv4_row_dot")(live_1, x, w_KxM)
  if S == 1:
    return y if Np == N else y[:N]
  parts_SxNxM = y.reshape(S, Np, M)[:, :N]
  acc = parts_SxNxM[0]
  for s in range(1, S):  # left to right, one elementwise add each: the order is ours, not a reduction tree's
    acc = acc + parts_SxNxM[s]
  return acc.astype(out_dtype)


def row_dot(x_NxK, w_KxM, live=None, *, tuning: RowDotTuning = RowDotTuning(), interpret: bool = False,
            out_dtype=None):
  """Dispatcher entry point (registered as "row_dot"); see the module docstring for the contract."""
  return row_dot_pallas(x_NxK, w_KxM, live, tuning=tuning or RowDotTuning(), interpret=interpret,
                        out_dtype=None if out_dtype is None else jnp.dtype(out_dtype).name)


KERNELS = {"row_dot": row_dot}
