"""The grouped expert matmul with block-invariant bits: y[b] = x[b] @ w[block_expert[b]] for blocks of R rows.

Contract (shared by the reference and the kernel):
  x_BxRxK          token rows already gathered into expert blocks of R rows each (B blocks; bf16, f16 or f32).
  block_expert_B   int32: the expert of each block. An id outside [0, E) marks a block that holds no pair: zeros.
  live_blocks      int32 scalar: blocks >= live_blocks hold no pair: zeros, and no work.
  w_ExKxM          every expert's weights, x's dtype.
  out_dtype        the output's dtype (None = x's); products accumulate in fp32.
Returns y_BxRxM.

Order (what makes it invariant): one program per (expert block, block_cols columns); it reads its block's expert id
from `block_expert_B` (a [1] block of it, loaded as a scalar) and indexes that expert's weights in place in the
whole [E, K, M] array, then sums its K / block_k partial dots in ascending order (no split-K). Nothing is chosen
from B, live_blocks or the other blocks, so a block's bits depend only on its own rows and its expert's weights.
Blocks of one expert read the same weight tiles (shared through L2 when they run together): an expert's weights
cross HBM about once per step, the cost of the plain grouped GEMM. Blocks past `live_blocks` (or with no expert)
do no dot and write zeros, so the work follows the live (token, expert) pairs while the shapes stay fixed.

Shapes: R is padded to a power of two >= 16 (a Triton dot tile; rows are cheap); K and M must be multiples of
block_k and block_cols (a ValueError says so). Any number of experts: JAX's Triton lowering addresses an array of
more than 2^32 bytes with 64-bit element offsets and smaller ones with 32-bit offsets, so with the kernel's 2- and
4-byte dtypes every element is reached (a bf16 w of more than 2^31 elements is over 2^32 bytes: V4.1-Flash's 384 x
5120 x 2304 gets 64-bit offsets, V4-Flash's 256 x 4096 x 2048 = 2^31 32-bit ones;
tests/pallas_kernels/test_gpu_lowering.py reads both in the Triton module).

The reference (`grouped_dot_reference`, the XLA fallback) is a loop over the live blocks, each an einsum of the
block's rows with its gathered expert weights (fp32 accumulation): one [R, K] x [K, M] product at a time, so it
never gathers B copies of the weights and its cost follows the live blocks too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import row_dot as _rd
from pallas_kernels import sparse_attention as _sa

_pl_triton = _sa._pl_triton

# ----------------------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------------------


def check_grouped(x_BxRxK, block_expert_B, w_ExKxM) -> None:
  """ValueError (one line) for a call outside the contract's shapes and dtypes."""
  if x_BxRxK.ndim != 3 or w_ExKxM.ndim != 3:
    raise ValueError(f"x_BxRxK and w_ExKxM must be rank 3, got {tuple(x_BxRxK.shape)} and {tuple(w_ExKxM.shape)}")
  _rd.check_operands(x_BxRxK, w_ExKxM, "x_BxRxK", "w_ExKxM", 1)
  if tuple(block_expert_B.shape) != (x_BxRxK.shape[0],):
    raise ValueError(f"block_expert_B must have shape ({x_BxRxK.shape[0]},), got {tuple(block_expert_B.shape)}")


def block_active(block_expert_B, live_blocks, E: int):
  """bool [B]: blocks below live_blocks whose expert id is in [0, E)."""
  e = jnp.asarray(block_expert_B, jnp.int32)
  b = jnp.arange(e.shape[0], dtype=jnp.int32)
  return (b < jnp.asarray(live_blocks, jnp.int32)) & (e >= 0) & (e < E)


def grouped_dot_reference(x_BxRxK, block_expert_B, live_blocks, w_ExKxM, *, out_dtype=None):
  """Plain-JAX reference: for each live block b, einsum(x[b], w[block_expert[b]]) in fp32; other blocks zero."""
  check_grouped(x_BxRxK, block_expert_B, w_ExKxM)
  B, R, _ = x_BxRxK.shape
  E, _, M = w_ExKxM.shape
  out_dtype = out_dtype or x_BxRxK.dtype
  e_B = jnp.asarray(block_expert_B, jnp.int32)
  active = block_active(e_B, live_blocks, E)
  prec = _rd.dot_precision(x_BxRxK.dtype)

  def body(b, y):
    w_KxM = w_ExKxM[jnp.clip(e_B[b], 0, E - 1)]
    yb = jnp.einsum("rk,km->rm", x_BxRxK[b], w_KxM, preferred_element_type=jnp.float32, precision=prec)
    yb = jnp.where(active[b], yb, 0.0).astype(out_dtype)
    return jax.lax.dynamic_update_index_in_dim(y, yb, b, 0)

  n = jnp.clip(jnp.asarray(live_blocks, jnp.int32), 0, B)
  return jax.lax.fori_loop(0, n, body, jnp.zeros((B, R, M), out_dtype))


# ----------------------------------------------------------------------------------------------------------------
# Pallas kernel
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GroupedDotTuning:
  """Static tiling of the grouped expert matmul (the row block is x's R, padded to a power of two >= 16).

  block_cols: output columns per program (power of two >= 16).
  block_k: the K step; each program sums its K / block_k partial dots in ascending order (power of two >= 16).
  num_warps / num_stages: Triton launch and software-pipelining depth of the K loop.
  debug: print the kernel jaxpr and Triton module when lowering."""
  block_cols: int = 128
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 3
  debug: bool = False

  def __post_init__(self):
    for name in ("block_cols", "block_k"):
      _rd.check_block(name, getattr(self, name))
    _rd.check_launch(self.num_warps, self.num_stages)


def row_block(R: int) -> int:
  """The kernel's row tile for blocks of R rows: a power of two >= 16."""
  return max(16, _sa._next_pow2(R))


def _grouped_dot_kernel(live_ref, expert_ref, x_ref, w_ref, o_ref, *, block_k: int):
  """One program: expert block b (x [Rp, K]), columns j*block_cols .. of its expert's weights (w [E, K, bc])."""
  E = w_ref.shape[0]
  e = _rd._pick0(expert_ref)
  active = (pl.program_id(0) < _rd._pick0(live_ref)) & (e >= 0) & (e < E)

  @pl.when(active)
  def _():
    acc = _rd.k_loop(lambda k: x_ref[:, pl.ds(k * block_k, block_k)],
                     lambda k: w_ref[e, pl.ds(k * block_k, block_k), :],
                     jnp.zeros(o_ref.shape, jnp.float32), x_ref.shape[1] // block_k, block_k, x_ref.dtype)
    o_ref[...] = acc.astype(o_ref.dtype)

  @pl.when(jnp.logical_not(active))
  def _():
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tuning", "interpret", "out_dtype"))
def grouped_dot_pallas(x_BxRxK, block_expert_B, live_blocks, w_ExKxM, *,
                       tuning: GroupedDotTuning = GroupedDotTuning(), interpret: bool = False, out_dtype=None):
  """Pallas (Triton-GPU) kernel with the contract of `grouped_dot_reference`; grid (B, M / block_cols)."""
  t = tuning
  check_grouped(x_BxRxK, block_expert_B, w_ExKxM)
  B, R, K = x_BxRxK.shape
  E, _, M = w_ExKxM.shape
  _rd.check_divides(K, M, t.block_k, t.block_cols)
  out_dtype = jnp.dtype(out_dtype or x_BxRxK.dtype)
  if B == 0:
    return jnp.zeros((0, R, M), out_dtype)
  Rp, bc = row_block(R), t.block_cols
  x = x_BxRxK if Rp == R else jnp.pad(x_BxRxK, ((0, 0), (0, Rp - R), (0, 0)))
  live_1 = jnp.reshape(jnp.clip(jnp.asarray(live_blocks, jnp.int32), 0, B), (1,))
  compiler_params = None
  if _pl_triton is not None:
    compiler_params = _pl_triton.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)
  y = pl.pallas_call(
      functools.partial(_grouped_dot_kernel, block_k=t.block_k), grid=(B, M // bc),
      in_specs=[pl.BlockSpec((1,), lambda b, j: (0,)),
                pl.BlockSpec((1,), lambda b, j: (b,)),
                pl.BlockSpec((None, Rp, K), lambda b, j: (b, 0, 0)),
                pl.BlockSpec((E, K, bc), lambda b, j: (0, 0, j))],
      out_specs=pl.BlockSpec((None, Rp, bc), lambda b, j: (b, 0, j)),
      out_shape=jax.ShapeDtypeStruct((B, Rp, M), out_dtype),
      compiler_params=compiler_params, interpret=interpret, debug=t.debug,
      name="dsv4_grouped_dot")(live_1, jnp.asarray(block_expert_B, jnp.int32), x, w_ExKxM)
  return y if Rp == R else y[:, :R]


def grouped_dot(x_BxRxK, block_expert_B, live_blocks, w_ExKxM, *, tuning: GroupedDotTuning = GroupedDotTuning(),
                interpret: bool = False, out_dtype=None):
  """Dispatcher entry point (registered as "grouped_dot"); see the module docstring for the contract."""
  return grouped_dot_pallas(x_BxRxK, block_expert_B, live_blocks, w_ExKxM, tuning=tuning or GroupedDotTuning(),
                            interpret=interpret, out_dtype=None if out_dtype is None else jnp.dtype(out_dtype).name)


KERNELS = {"grouped_dot": grouped_dot}
