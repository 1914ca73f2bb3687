"""Row-invariant operations: a row's result has the same bits whatever the other rows of the call hold, however many
there are and wherever the row sits among them (docs/engine.md, the invariant step).

XLA's CPU dot changes its summation order with the number of rows of the call, but at one shape a row's result does
not depend on the other rows or on its place among them (`python -m benchmarks.probes.dot_row_bits`). So every op
here runs its rows in fixed blocks of `RowBlocking` rows, each block one call at that one shape, in a device loop
whose trip count is the number of blocks holding live rows: a row's bits follow the block shape only, and the cost
follows the live rows, never the padded width of the call. Row-local work between the dots (norms, softmaxes,
elementwise maths) rides in the same loop (`map_row_blocks`), so a whole per-token segment of the model is one
loop, also where the segment spans the code of two modules: a `RowFn` hands one module's row-local work to the loop
the other owns (a sublayer's input made in its first loop, the block's work after it as its tail).

The routed experts are one grouped formulation for every batch size (`grouped_experts`): token-expert pairs sorted
by expert, each expert's pairs cut into blocks of `RowBlocking.expert_rows`, one [rows, D] x [D, I] product per live
block with that block's expert's weights (each expert's weights read once per block of its own pairs, never per
token), and each token's K results summed in the order of its expert ids. Where the kernel configuration sends
"grouped_dot" to the grouped expert kernel, the same grouping runs every live block in one kernel call per product
instead of a loop (`grouped_experts_kernel`, `pallas_kernels/grouped_dot.py`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core as _jex_core     # the current trace, as an opaque token: `LoopBuffers`

from dsv4 import caches
from pallas_kernels import dispatch


@dataclasses.dataclass(frozen=True)
class RowBlocking:
  """Row blocks of the row-invariant ops (static: a row's bits depend on them, so one engine keeps them fixed).

  rows: rows per block of the projections and per-token segments (more = fewer weight re-reads at prefill, more
    padding work for a step with few live tokens; any count, not only a power of two).
  attention_rows: queries per block of the attention's XLA paths over the pools (sparse window + top-k, HCA, V4.1's
    candidate scoring). Each query there reads its own keys in a fixed order, and at decode that read follows the
    query's context: a padding query in a live block costs a whole context's reads, so a step with few live tokens
    wants small blocks (the projections' rows would make 24 of a 32-row block at decode batch 8 pay them).
  expert_rows: pairs per block of the grouped expert matmul (an expert with one pair in the step still pays a
    whole block; decode steps hold about one pair per expert).
  kernel_expert_rows: the same on the grouped expert kernel (`grouped_experts_kernel`; a Triton dot tile: a power
    of two >= 16).
  outputs_in_inputs: a loop's float output with the shape and dtype of one of its inputs (a sublayer's new mHC
    streams) takes that input's buffer: the loop reads each block of the input from the buffer it carries, before
    it writes the block's outputs there, so XLA reuses an input that nothing reads after the loop instead of
    filling a new buffer across the token budget; the rows past the live blocks then hold the input's rows,
    unspecified as before. For the CPU, which fills a new buffer with zeros (a GPU allocates it unwritten, and a
    still-read input would cost a copy there). Not for a loop of one block (the whole buffer: XLA compiles it with
    other rounding).
  carry_buffers: inside `carried_loop_buffers` (the engine's step program), a loop's other float outputs are
    written into buffers the program was handed and hands back (`LoopBuffers`), so a step fills no new buffer
    across the token budget at all: the engine keeps them from one step to the next. For the CPU, where a new
    buffer is zero-filled (and each first touch of fresh memory faults a page in); a GPU's unwritten buffers cost
    nothing, and carrying them would keep every loop's buffer alive at once. Not for loops of one block (as
    above)."""
  rows: int = 32
  attention_rows: int = 8
  expert_rows: int = 8
  kernel_expert_rows: int = 16
  outputs_in_inputs: bool = False
  carry_buffers: bool = False

  def __post_init__(self):
    if min(self.rows, self.attention_rows, self.expert_rows, self.kernel_expert_rows) < 1:
      raise ValueError(f"RowBlocking: blocks of at least one row, got {self}")


# The CPU's blocks: its dot streams the weights from memory at any row count, so small blocks (little padding
# work at decode) cost it nothing at prefill. The attention's 8-query blocks keep decode's padding queries off the
# context reads for some loop trips at prefill (256 per layer at 2,048 tokens: v4_tiny's 2,048-token prefill went
# from 0.84 to 0.95 of a plain step, its decode of 8 rows at 32k from 1.30 to 0.99; BUILD_NOTES).
CPU_BLOCKING = RowBlocking(outputs_in_inputs=True, carry_buffers=True)
# A GPU's: a block's projection is one fixed-shape dot that reads the weights from HBM, so a block of R rows does R
# FLOPs per byte of the bf16 projection weights the engine holds (the loader dequantizes FP8 at load). An H200's
# ridge (bf16 tensor cores / HBM) is about 165 FLOPs a byte: at 128 rows a prefill chunk's blocks run near the
# tensor-core rate (32 rows: 2.9x a plain step's time at a 2,048-token chunk by the roofline) and a decode step's
# one block stays bound by its weight reads (the padding rows' arithmetic hides under them). FP8 projection
# matmuls, if built, would want about 80 (2R FLOPs a byte). `python -m benchmarks.step_roofline
# --projections=bf16` prints the trade per block size.
# The attention's XLA paths keep the projections' blocks there: a GPU's kernels take the live bound instead, and
# a loop trip is a host round trip (`d.engine.cmdbuf`), so 8-query blocks would cost a prefill 16x the trips.
GPU_BLOCKING = RowBlocking(rows=128, attention_rows=128)


def blocking() -> RowBlocking:
  """The row blocks of the backend the program is traced for (JAX's default backend): a row's bits follow them,
  so they are fixed per backend, never chosen from a step's rows."""
  return GPU_BLOCKING if jax.default_backend() == "gpu" else CPU_BLOCKING


# Slots per iteration of the grouped expert kernel's layout loops (row gathers and the activation: row-local, so
# their bits do not depend on it).
LAYOUT_ROWS = 256


def live_count(live, n: int):
  """The live row count as an int32 scalar clipped to [0, n] (None = all n rows)."""
  if live is None:
    return jnp.int32(n)
  return jnp.clip(jnp.asarray(live, jnp.int32), 0, n)


def map_row_blocks(fn, live, *xs, block: int | None = None, prev=(), carry=None):
  """`fn` over fixed [block, ...] slices (axis 0) of the pytrees `xs`, for the blocks holding a row < live, in
  order, in a device loop. Returns fn's outputs (a pytree of [block, ...] arrays) assembled over all N rows; rows
  of blocks past the live ones are unspecified (`_unfilled`: zeros on the CPU). `fn` must be row-local (row i of
  its outputs from row i of its inputs): then a row's result depends on the block shape only. live: None (all
  rows, a static trip count) or an int scalar.

  prev: further [N, ...] arrays handed to `fn` after `xs`, each shifted one row back (row i of a block holds row
  i - 1 of the array; the first row of block 0 is unspecified): a row's predecessor, without a shifted copy of
  the whole array.

  carry: None, or a pytree threaded through the blocks in order: `fn(*blocks, carry)` then returns (outputs,
  carry), and so does this call (the carry after the last live block). For exact state across blocks (integer
  counts), never for float data a row's result would then depend on."""
  block = block or blocking().rows
  N = jax.tree_util.tree_leaves(xs)[0].shape[0]
  Np = -(-N // block) * block
  if Np != N:
    pad = lambda a: jnp.pad(a, [(0, Np - N)] + [(0, 0)] * (a.ndim - 1))
    xs, prev = jax.tree_util.tree_map(pad, xs), jax.tree_util.tree_map(pad, prev)

  def shifted(a, i):
    b = jax.lax.dynamic_slice_in_dim(a, jnp.maximum(i * block - 1, 0), block, 0)
    return jnp.where(i == 0, jnp.roll(b, 1, axis=0), b)

  # The loop slices its inputs as carried (a narrow float as its bits, `_carried`) and converts each block: an
  # input that an earlier loop returned is then that loop's buffer itself (the bitcasts cancel outside the loop),
  # never a converted copy of it across the budget.
  dtypes = jax.tree_util.tree_map(lambda a: a.dtype, (xs, prev))
  xs_c, prev_c = jax.tree_util.tree_map(_carried, (xs, prev))

  def sl(i, xs_c=xs_c):
    (xs_d, prev_d) = dtypes
    return (*jax.tree_util.tree_map(
                lambda a, d: caches.from_bits(jax.lax.dynamic_slice_in_dim(a, i * block, block, 0), d), xs_c, xs_d),
            *jax.tree_util.tree_map(lambda a, d: caches.from_bits(shifted(a, i), d), prev_c, prev_d))

  if carry is not None:
    body_fn = fn
    shapes = jax.eval_shape(lambda *a: body_fn(*a, carry)[0], *sl(0))
  else:
    shapes = jax.eval_shape(lambda *a: fn(*a), *sl(0))
  # On the CPU a narrow float output is carried as its bit pattern (`caches.updates_through_bits`): a block's
  # update in place instead of a pass over all N rows per block. Bits in, the same bits out.
  out_leaves, out_tree = jax.tree_util.tree_flatten(shapes)
  in_leaves, in_tree = jax.tree_util.tree_flatten(xs)
  carrier = LoopBuffers.current() if Np > block else None
  # with carried buffers every float output has its own (an input's buffer may be a carried one, which the program
  # must hand back as it is)
  into = (_outputs_into_inputs(out_leaves, in_leaves, Np)
          if blocking().outputs_in_inputs and Np > block and carrier is None else {})
  held = {}             # output leaf -> the carried buffer it is written into
  inits = []
  for k, o in enumerate(out_leaves):
    if k in into:
      inits.append(_carried(in_leaves[into[k]]))
    elif carrier is not None and jnp.issubdtype(o.dtype, jnp.floating):
      held[k], buf = carrier.take((Np, *o.shape[1:]), o.dtype)
      inits.append(buf)
    else:
      inits.append(_carried(_unfilled((Np, *o.shape[1:]), o.dtype)))
  outs = jax.tree_util.tree_unflatten(out_tree, inits)

  def body(i, state):
    outs, c = state
    # an input whose buffer holds an output is read from there: its block, before the block is written
    ins, carried = jax.tree_util.tree_leaves(xs_c), jax.tree_util.tree_leaves(outs)
    for k, j in into.items():
      ins[j] = carried[k]
    blocks = sl(i, jax.tree_util.tree_unflatten(in_tree, ins))
    got, c = (fn(*blocks), None) if carry is None else fn(*blocks, c)
    return jax.tree_util.tree_map(
        lambda o, g, s: jax.lax.dynamic_update_slice_in_dim(o, _carried(g.astype(s.dtype)), i * block, 0),
        outs, got, shapes), c

  nb = Np // block if live is None else (live_count(live, N) + block - 1) // block
  outs, c = jax.lax.fori_loop(0, nb, body, (outs, carry))
  results = jax.tree_util.tree_map(lambda o, s: caches.from_bits(o[:N], s.dtype), outs, shapes)
  carried, returned = jax.tree_util.tree_leaves(outs), jax.tree_util.tree_leaves(results)
  for k, b in held.items():
    carrier.wrote(b, carried[k], returned[k] if Np == N else None)
  return results if carry is None else (results, c)


class RowFn(NamedTuple):
  """Row-local work over [N, ...] arrays, handed to the code that owns a row-block loop so it runs in that loop (no
  loop of its own, no [N, ...] buffer between the two): `fn` on each block of `args` (pytrees of [N, ...] arrays,
  sliced with the loop's rows).

  As a sublayer's `tail`: fn(y_block, *arg_blocks) -> a pytree of [rows, ...] blocks, run on the sublayer's output
  rows in its last loop; the sublayer then returns fn's outputs in place of y (`map_row_blocks_then`). As a
  sublayer's input (the attention's, `model.token_fn`): fn(*arg_blocks) -> (input block, carry blocks), made in
  its first loop."""
  fn: Callable
  args: tuple = ()


def tail_after(f, tail: RowFn | None) -> RowFn:
  """A tail that maps a sublayer's output rows with the row-local `f` before `tail` does its work (tail None: `f`
  alone). How an edited module changes its output rows: it passes `tail_after(f, tail)` on to its parent's call
  (`nnx_model.Attention`)."""
  if tail is None:
    return RowFn(f)
  return RowFn(lambda y, *blocks: tail.fn(f(y), *blocks), tail.args)


def map_row_blocks_then(fn, tail: RowFn | None, live, *xs, block: int | None = None):
  """`map_row_blocks(fn, live, *xs)` with `tail.fn` on fn's output rows (and the rows of `tail.args`) in the same
  loop; tail None: fn's output. Both row-local, so a row's bits still follow the block shape only."""
  if tail is None:
    return map_row_blocks(fn, live, *xs, block=block)
  n = len(xs)
  return map_row_blocks(lambda *b: tail.fn(fn(*b[:n]), *b[n:]), live, *xs, *tail.args, block=block)


def run_rows(rows: RowFn, live, *, block: int | None = None):
  """The outputs of `rows` ([N, ...]: its fn on the live row blocks of its args, in one loop)."""
  return map_row_blocks(rows.fn, live, *rows.args, block=block)


def _outputs_into_inputs(out_leaves, in_leaves, Np: int) -> dict[int, int]:
  """Output leaf k -> the input leaf whose buffer it takes (`RowBlocking.outputs_in_inputs`): the first unclaimed
  input of its [Np, ...] shape and float dtype (an integer output's dead rows may be slots or ids that a later op
  acts on, so they keep the buffer's fill). Never a `prev` array: a block reads its predecessor's last row."""
  into, taken = {}, set()
  for k, o in enumerate(out_leaves):
    for j, a in enumerate(in_leaves):
      if (j not in taken and tuple(a.shape) == (Np, *o.shape[1:]) and a.dtype == o.dtype
          and jnp.issubdtype(o.dtype, jnp.floating)):
        into[k] = j
        taken.add(j)
        break
  return into


# The count of float loop buffers made so far in the step program being traced (`distinct_fills`), or None.
_FILLS: contextvars.ContextVar[list | None] = contextvars.ContextVar("row_invariant_fills", default=None)


@contextlib.contextmanager
def distinct_fills():
  """While a step program is traced in it, each float loop buffer the CPU fills (`_unfilled`) gets its own fill
  value, so that XLA cannot merge the fills into one shared array that it then copies into each loop: a fill
  writes a buffer, a copy reads one as well. The values are unspecified rows either way; the count restarts with
  each step program, so the same program traces to the same constants (its compilation cache key)."""
  token = _FILLS.set([0])
  try:
    yield
  finally:
    _FILLS.reset(token)


def _unfilled(shape, dtype):
  """A loop's output buffer before its blocks are written: `jax.lax.empty`, which a GPU allocates without writing
  it (so a buffer spanning the token budget costs nothing for its dead rows) and the CPU fills with zeros (inside
  `distinct_fills` a float buffer with a value of its own). Rows of blocks past the live ones keep whatever it
  holds: no live row ever reads them (tests/dsv4/test_row_invariant.py fills them with NaN)."""
  fills = _FILLS.get()
  if fills is not None and jnp.issubdtype(dtype, jnp.floating) and jax.default_backend() == "cpu":
    fills[0] += 1
    return jnp.full(shape, fills[0], dtype)
  return jax.lax.empty(shape, dtype)


def _carried(a):
  """How `map_row_blocks` carries an output array (see `caches.updates_through_bits`)."""
  return caches.as_bits(a) if caches.updates_through_bits(a.dtype) else a


def _carried_dtype(dtype):
  """The dtype `_carried` gives an array of `dtype`."""
  dtype = jnp.dtype(dtype)
  return jnp.dtype(caches.UINT_OF_SIZE[dtype.itemsize]) if caches.updates_through_bits(dtype) else dtype


_LOOP_BUFFERS: contextvars.ContextVar = contextvars.ContextVar("dsv4_loop_buffers", default=None)


def _current_trace():
  """An opaque token of the trace being built (equal for the same trace), or None where this jax has no such
  API (then no loop takes a carried buffer)."""
  get = getattr(_jex_core, "get_opaque_trace_state", None)
  return None if get is None else get()


class LoopBuffers:
  """The float output buffers of one program's row-block loops, handed in by its caller and handed back at its end
  (`RowBlocking.carry_buffers`; `carried_loop_buffers` opens one): each loop of the program, in trace order,
  takes the next buffer and writes its live blocks into it; rows past them keep what an earlier step left there,
  which no live row reads (as `_unfilled`'s rows). A buffer that a later loop takes over as its output
  (`RowBlocking.outputs_in_inputs`) or that `grouped_expert_sums` adds into is followed there, so the program
  hands back each buffer's last value and XLA writes every one of them in place (nothing copied).

  Only loops traced at the program's own level take a buffer (one inside another loop's body, a conditional or a
  `shard_map` region makes its own), and only loops of more than one block. `given` None: no buffers yet; the
  loops make theirs as without a carrier and `shapes` lists what they would take (`loop_buffer_shapes`)."""

  def __init__(self, given):
    self.given = None if given is None else tuple(given)
    self.shapes: list[jax.ShapeDtypeStruct] = []
    self._last: list = []               # each buffer's latest value (carried form)
    self._by_id: dict = {}              # id of a loop's returned array -> its buffer
    self._alive: list = []              # those arrays, so their ids stay theirs while the program traces
    self._trace = _current_trace()

  @staticmethod
  def current() -> "LoopBuffers | None":
    """The carrier loops traced here write into, or None (none open, another trace level, or not this
    backend's blocking)."""
    c = _LOOP_BUFFERS.get()
    if c is None or not blocking().carry_buffers or c._trace is None or _current_trace() != c._trace:
      return None
    return c

  def take(self, shape, dtype) -> tuple[int, jax.Array]:
    """(index, buffer) of the next loop output of `shape` and float `dtype`, the buffer as carried (`_carried`)."""
    k = len(self.shapes)
    want = jax.ShapeDtypeStruct(tuple(shape), _carried_dtype(dtype))
    self.shapes.append(want)
    if self.given is None:            # as without a carrier (`_unfilled`: distinct fills on the CPU)
      buf = _carried(_unfilled(want.shape, dtype))
    else:
      if k >= len(self.given) or (self.given[k].shape, self.given[k].dtype) != (want.shape, want.dtype):
        got = "none" if k >= len(self.given) else f"{self.given[k].shape} {self.given[k].dtype}"
        raise ValueError(f"LoopBuffers: loop output {k} wants {want.shape} {want.dtype}, the program was handed "
                         f"{got} (buffers from another program's `loop_buffer_shapes`)")
      buf = self.given[k]
    self._last.append(buf)
    return k, buf

  def holding(self, a) -> int | None:
    """The buffer array `a` (a loop's returned output) was written into, or None."""
    return self._by_id.get(id(a))

  def wrote(self, k: int, carried, returned=None) -> None:
    """Buffer k now holds `carried` (the loop's output as carried); `returned` (what the loop returned for it, or
    None) may be taken over by a later writer."""
    self._last[k] = carried
    if returned is not None:
      self._by_id[id(returned)] = k
      self._alive.append(returned)

  def follow(self, before, after) -> None:
    """`after` is `before` updated in place (its buffer's next value), when `before` is a carried buffer."""
    k = self.holding(before)
    if k is not None:
      self.wrote(k, _carried(after), after)

  def result(self) -> tuple:
    """Every buffer's last value, in the order they were handed in (() without buffers)."""
    if self.given is None:
      return ()
    if len(self._last) != len(self.given):
      raise ValueError(f"LoopBuffers: the program's loops took {len(self._last)} buffers of the "
                       f"{len(self.given)} it was handed (buffers from another program's `loop_buffer_shapes`)")
    return tuple(self._last)


def updated_in_place(before, after):
  """Returns `after`, an op's update of `before` (same shape and dtype) that XLA can make in place, e.g. a loop
  carrying it: if `before` is one of the open `LoopBuffers`' buffers, `after` becomes its next value, so the
  program hands that buffer back updated instead of keeping `before` alive (a copy)."""
  carrier = LoopBuffers.current()
  if carrier is not None:
    carrier.follow(before, after)
  return after


@contextlib.contextmanager
def carried_loop_buffers(given):
  """The `LoopBuffers` the row-block loops traced inside write into (`given`: the buffers, in trace order; None:
  record their shapes only)."""
  c = LoopBuffers(given)
  token = _LOOP_BUFFERS.set(c)
  try:
    yield c
  finally:
    _LOOP_BUFFERS.reset(token)


def loop_buffer_shapes(fn, *args, **kwargs) -> tuple:
  """The buffers `fn(*args, **kwargs)`'s loops take inside `carried_loop_buffers` (traced abstractly, nothing runs):
  what its caller makes once and then hands in and takes back on every call. () where this backend's blocking
  carries none."""
  if not blocking().carry_buffers:
    return ()

  def traced(*a):
    with carried_loop_buffers(None) as c:
      fn(*a, **kwargs)
      found.extend(c.shapes)
    return ()

  found: list = []
  jax.eval_shape(traced, *args)
  return tuple(found)


def rows_dot(x_NxK, w_KxM, live=None, *, block: int | None = None, precision=None, preferred_element_type=None):
  """`jnp.dot(x, w)` whose row n has the same bits for any row count and any other rows: fixed [block, K] x [K, M]
  products over the live row blocks (`map_row_blocks`)."""
  return map_row_blocks(lambda xb: jnp.dot(xb, w_KxM, precision=precision,
                                           preferred_element_type=preferred_element_type), live, x_NxK, block=block)


def rows_dot_reference(x_NxK, w_KxM, *, precision=None, preferred_element_type=None):
  """Plain reference of `rows_dot` (equal up to fp32 summation order; a row's bits follow the call's row count)."""
  return jnp.dot(x_NxK, w_KxM, precision=precision, preferred_element_type=preferred_element_type)


class ExpertLayout(NamedTuple):
  """Where the live token-expert pairs go in the grouped layout (pairs of one expert in flat pair order, a stable
  counting sort by expert): rank_NxK each pair's rank among its expert's pairs (rows past the live tokens, and ids
  of no pair, unspecified) and sizes_E the pairs per expert."""
  rank_NxK: jax.Array
  sizes_E: jax.Array


def expert_ranks(seen_E, ids_RxK, live_R):
  """One block of tokens' pair ranks: (seen_E + the block's pairs per expert, rank_RxK), rank = the pairs of the
  same expert seen before the block plus those earlier in the block (flat order). Rows not `live_R` and ids of
  no pair (>= E) count nothing. Integer and exact, so the blocks' size never changes a rank."""
  R, K = ids_RxK.shape
  E = seen_E.shape[0]
  e = jnp.where(live_R[:, None], ids_RxK.astype(jnp.int32), E).reshape(-1)
  before = jnp.tril(e[:, None] == e[None, :], k=-1)              # an earlier pair of the block, same expert
  rank = seen_E[jnp.minimum(e, E - 1)] + jnp.sum(before, axis=1, dtype=jnp.int32)
  return seen_E.at[e].add(1, mode="drop"), rank.reshape(R, K)


def expert_layout(ids_NxK, num_experts: int, live=None) -> ExpertLayout:
  """The `ExpertLayout` of the live pairs in one loop over the live row blocks (`map_row_blocks` with the counts
  as its carry): its cost follows the live tokens, where an argsort would span the budget's N x K pairs. The
  MoE makes the same ranks in its router's loop instead (`moe.moe`), so the layout adds no loop there."""
  N = ids_NxK.shape[0]

  def block(ids, live_R, seen):
    seen, rank = expert_ranks(seen, ids, live_R)
    return rank, seen
  # the live mask as an input (a block's padding rows read False)
  rank, sizes = map_row_blocks(block, live, ids_NxK, jnp.arange(N) < live_count(live, N),
                               carry=jnp.zeros((num_experts,), jnp.int32))
  return ExpertLayout(rank, sizes)


def _layout_slots(ids_NxK, num_experts: int, live, layout: ExpertLayout | None, block: int):
  """(ok [P] live pair with an expert, e [P] its expert (clipped), rank [P], sizes [E], first_block [E + 1] each
  expert's first block of `block` pairs (first_block[E] = the live block count), first_pair [E])."""
  N, K = ids_NxK.shape
  layout = layout or expert_layout(ids_NxK, num_experts, live)
  e = ids_NxK.reshape(-1).astype(jnp.int32)
  ok = jnp.repeat(jnp.arange(N) < live_count(live, N), K) & (e < num_experts)
  sizes = layout.sizes_E
  first_block = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                 jnp.cumsum((sizes + block - 1) // block).astype(jnp.int32)])
  first_pair = (jnp.cumsum(sizes) - sizes).astype(jnp.int32)
  return ok, jnp.clip(e, 0, num_experts - 1), layout.rank_NxK.reshape(-1), sizes, first_block, first_pair


def expert_blocks(ids_NxK, num_experts: int, live=None, *, block: int | None = None,
                  layout: ExpertLayout | None = None):
  """The grouped layout of `grouped_experts`: pairs (token n, choice k) of live tokens in expert order (stable, so
  by flat pair index within an expert), each expert's pairs padded to whole blocks. layout: the pairs' ranks if
  the caller made them (None: `expert_layout`).

  Returns (order [P]: the live pairs' indices in expert order, then unspecified positions; sizes [E] pairs per
  expert, first_block [E + 1] each expert's first block (exclusive cumsum; first_block[E] = the live block count),
  first_pair [E] each expert's first position in `order`)."""
  block = block or blocking().expert_rows
  P = ids_NxK.size
  ok, e, rank, sizes, first_block, first_pair = _layout_slots(ids_NxK, num_experts, live, layout, block)
  pos = jnp.where(ok, first_pair[e] + rank, P)
  order = _unfilled((P,), jnp.int32).at[pos].set(jnp.arange(P, dtype=jnp.int32), mode="drop")
  return order, sizes, first_block, first_pair


def grouped_experts(x_NxD, ids_NxK, weights_NxK, expert_fn, num_experts: int, live=None, *,
                    block: int | None = None, uniform_trips: bool = False, layout: ExpertLayout | None = None):
  """The [N, D] results of `grouped_expert_rows` (its arguments and rows)."""
  return run_rows(grouped_expert_rows(x_NxD, ids_NxK, weights_NxK, expert_fn, num_experts, live, block=block,
                                      uniform_trips=uniform_trips, layout=layout), live)


def grouped_expert_rows(x_NxD, ids_NxK, weights_NxK, expert_fn, num_experts: int, live=None, *,
                        block: int | None = None, uniform_trips: bool = False,
                        layout: ExpertLayout | None = None) -> RowFn:
  """`grouped_expert_sums` as rows: each token's fp32 sum cast to x's dtype in the caller's loop (`RowFn`), so that
  the caller's next row-local work (the MoE's shared expert) reads them in its own loop."""
  sums = grouped_expert_sums(x_NxD, ids_NxK, weights_NxK, expert_fn, num_experts, live, block=block,
                             uniform_trips=uniform_trips, layout=layout)
  return RowFn(lambda o: o.astype(x_NxD.dtype), (sums,))


def grouped_expert_sums(x_NxD, ids_NxK, weights_NxK, expert_fn, num_experts: int, live=None, *,
                        block: int | None = None, uniform_trips: bool = False, layout: ExpertLayout | None = None):
  """sum_k weights[n, k] * expert_fn(ids[n, k], x[n]) for every live token n, row-invariant and with each expert's
  weights read once per block of its own pairs.

  expert_fn(e, x_RxD) -> [R, D]: expert e (a traced int32 scalar) on a fixed block of R = `block` rows (row-local;
  its products then have one shape for every block). The loop runs the live blocks in expert order; a block adds
  its rows into their tokens' outputs, so a token's K results are added in the order of its expert ids (its own
  choices, whatever shares the step), starting from zeros, in fp32. Dead tokens (>= live) get zeros, or
  unspecified values past the live row blocks (`map_row_blocks`). An id of `num_experts` is no pair (an expert
  another device holds: `moe`'s expert shards). Returns the fp32 sums [N, D].
  uniform_trips: run the bound ceil(live * K / block) + E on the live block count instead of the count itself (the
  extra blocks hold no pair and add nothing): the trip count then follows `live` only, not the routing, so shards
  of a mesh that share `live` run the same trips and collectives inside `expert_fn` meet. live None: a static
  bound (every row may be real; the loop is then differentiable). layout: the pairs' `ExpertLayout` if the caller
  made it (None: `expert_layout`, a loop over the live tokens)."""
  block = block or blocking().expert_rows
  N, K = ids_NxK.shape
  D = x_NxD.shape[1]
  order, sizes, first_block, first_pair = expert_blocks(ids_NxK, num_experts, live, block=block, layout=layout)
  w_flat = weights_NxK.reshape(-1)
  lane = jnp.arange(block, dtype=jnp.int32)

  def body(b, out):
    e = jnp.clip(jnp.searchsorted(first_block, b, side="right").astype(jnp.int32) - 1, 0, num_experts - 1)
    j = first_pair[e] + (b - first_block[e]) * block + lane           # positions in `order`
    ok = j < first_pair[e] + sizes[e]
    pair = order[jnp.minimum(j, order.shape[0] - 1)]
    tok = pair // K
    xb = jnp.where(ok[:, None], x_NxD[tok], 0).astype(x_NxD.dtype)
    h = expert_fn(e, xb)
    h = h * jnp.where(ok, w_flat[pair], 0)[:, None].astype(h.dtype)
    # a token has at most one pair per expert, so a block's rows go to distinct tokens (no order inside the add)
    return out.at[jnp.where(ok, tok, N)].add(h.astype(out.dtype), mode="drop")

  # fp32 sums (cast once at the end, in the caller's loop): XLA's CPU scatter-add of a 16-bit float converts the
  # whole [N, D] buffer to fp32 and back on every block
  if live is None:
    # no engine step (training, a plain forward): a static bound, so the loop is a scan and differentiable; the
    # blocks past the live ones hold no pair and add nothing
    trips = -(-N * K // block) + min(num_experts, N * K)
    return jax.lax.fori_loop(0, trips, body, jnp.zeros((N, D), jnp.float32))
  if uniform_trips:
    trips = (live_count(live, N) * K + block - 1) // block + num_experts
  else:
    trips = first_block[num_experts]
  # zeros over the live rows only (rows past them: unspecified)
  out = map_row_blocks(lambda xb: jnp.zeros((xb.shape[0], D), jnp.float32), live, x_NxD)
  return updated_in_place(out, jax.lax.fori_loop(0, trips, body, out))


def grouped_experts_kernel(x_NxD, ids_NxK, weights_NxK, w_gate_ExDxI, w_up_ExDxI, w_down_ExIxD, act, live,
                           kernel_cfg, *, block: int | None = None, layout: ExpertLayout | None = None):
  """The [N, D] results of `grouped_expert_kernel_rows` (its arguments and rows)."""
  return run_rows(grouped_expert_kernel_rows(x_NxD, ids_NxK, weights_NxK, w_gate_ExDxI, w_up_ExDxI, w_down_ExIxD,
                                             act, live, kernel_cfg, block=block, layout=layout), live)


def grouped_expert_kernel_rows(x_NxD, ids_NxK, weights_NxK, w_gate_ExDxI, w_up_ExDxI, w_down_ExIxD, act, live,
                               kernel_cfg, *, block: int | None = None, layout: ExpertLayout | None = None) -> RowFn:
  """`grouped_expert_kernel_sums` with each token's fp32 sum cast to x's dtype in the caller's loop (as
  `grouped_expert_rows`)."""
  sums = grouped_expert_kernel_sums(x_NxD, ids_NxK, weights_NxK, w_gate_ExDxI, w_up_ExDxI, w_down_ExIxD, act, live,
                                    kernel_cfg, block=block, layout=layout)
  return RowFn(lambda *b: sums.fn(*b).astype(x_NxD.dtype), sums.args)


def grouped_expert_kernel_sums(x_NxD, ids_NxK, weights_NxK, w_gate_ExDxI, w_up_ExDxI, w_down_ExIxD, act, live,
                               kernel_cfg, *, block: int | None = None, down_dtype=None,
                               layout: ExpertLayout | None = None) -> RowFn:
  """`grouped_experts` of a gated MLP (act(x @ w_gate, x @ w_up) @ w_down) with its products on the grouped
  expert kernel (`dispatch.grouped_dot`): the same grouping (pairs laid out by expert, blocks of `block` pairs of one
  expert) laid out once as [B, block, D] rows, every live block in one call per product instead of a loop, blocks
  past the live ones doing no work. A block's bits depend on its own rows and its expert only (the kernel's fixed
  tiles and K order), and each token adds its K results from zeros in the order of its expert ids, as
  `grouped_experts` does: a token's bits ignore the other tokens. Dead tokens (>= live) get zeros, or unspecified
  values past the live row blocks.

  B is static: ceil(N * K / block) blocks of pairs plus one partial block per expert at most, rounded up to whole
  `LAYOUT_ROWS` slots. Where the kernel
  config serves the XLA reference (`dispatch.grouped_dot`'s fallback: a loop over the live blocks, one product
  each), the bits stay row-invariant the same way. An id of E is no pair (an expert another device holds).
  down_dtype: the down product's output dtype (None = x's; float32 where it is a partial sum over a slice of the
  intermediate dimension that a psum completes: `moe`'s expert shards). layout: as `grouped_expert_sums`.
  Returns the per-token fp32 sums as rows (`RowFn`), for the caller's loop."""
  block = block or blocking().kernel_expert_rows
  N, K = ids_NxK.shape
  D = x_NxD.shape[1]
  E = w_gate_ExDxI.shape[0]
  P = N * K
  ok, e, rank, _, first_block, _ = _layout_slots(ids_NxK, E, live, layout, block)
  per_layout = max(1, LAYOUT_ROWS // block)
  nb = -(-(-(-P // block) + min(E, P)) // per_layout) * per_layout        # whole layout blocks of slots
  dead = nb * block                                                     # the slot of no row
  # token-major pair -> its row in h (dead: none); slot -> token (N: no token)
  slot_of_pair = jnp.where(ok, first_block[e] * block + rank, dead)
  tok_of_slot = jnp.full((dead,), N, jnp.int32).at[slot_of_pair].set(jnp.arange(P, dtype=jnp.int32) // K,
                                                                      mode="drop")
  blocks = jnp.arange(nb, dtype=jnp.int32)
  live_blocks = first_block[E]
  block_expert = jnp.where(blocks < live_blocks,
                           jnp.searchsorted(first_block, blocks, side="right").astype(jnp.int32) - 1, E)
  # The layout and the activation in loops over the live slots (`LAYOUT_ROWS` a time): their cost follows the live
  # pairs, not the budget's N * K (the kernels skip the dead blocks themselves).
  live_slots = live_blocks * block
  xs = map_row_blocks(lambda t: jnp.where((t < N)[:, None], x_NxD[jnp.minimum(t, N - 1)], 0).astype(x_NxD.dtype),
                      live_slots, tok_of_slot, block=LAYOUT_ROWS).reshape(nb, block, D)
  gate = dispatch.grouped_dot(xs, block_expert, live_blocks, w_gate_ExDxI, cfg=kernel_cfg)
  up = dispatch.grouped_dot(xs, block_expert, live_blocks, w_up_ExDxI, cfg=kernel_cfg)
  I = gate.shape[-1]
  a = map_row_blocks(lambda g, u: act(g, u).astype(x_NxD.dtype), live_slots, gate.reshape(dead, I),
                     up.reshape(dead, I), block=LAYOUT_ROWS).reshape(nb, block, I)
  h = dispatch.grouped_dot(a, block_expert, live_blocks, w_down_ExIxD, out_dtype=down_dtype,
                           cfg=kernel_cfg).reshape(dead, D)
  w_flat = weights_NxK.reshape(-1)

  def combine(ids_RxK, tok_R):
    """A block of tokens' K results added from zeros in fp32 (as the loop's), each token's in expert-id order."""
    by_expert = jnp.argsort(ids_RxK, axis=1, stable=True)
    out = jnp.zeros((tok_R.shape[0], D), jnp.float32)
    for k in range(K):
      pair = tok_R * K + by_expert[:, k].astype(jnp.int32)
      sp = slot_of_pair[pair]
      hk = jnp.where((sp < dead)[:, None], h[jnp.minimum(sp, dead - 1)], 0) * w_flat[pair][:, None].astype(h.dtype)
      out = out + hk.astype(out.dtype)
    return out
  return RowFn(combine, (ids_NxK, jnp.arange(N, dtype=jnp.int32)))


def grouped_kernel_fits(D: int, I: int, tuning) -> bool:
  """Whether the grouped expert kernel can take experts of [D, I] in and [I, D] out: its tiles divide the shapes
  (of any expert count: its offsets reach every weight, `pallas_kernels/grouped_dot.py`)."""
  return all(n % tuning.block_k == 0 and n % tuning.block_cols == 0 for n in (D, I))


def grouped_experts_reference(x_NxD, ids_NxK, weights_NxK, expert_fn_all):
  """Plain reference of `grouped_experts`: expert_fn_all(ids_P, x_PxD) -> [P, D] on each pair's own expert (a
  gather of its weights), weighted and summed over k."""
  N, K = ids_NxK.shape
  h = expert_fn_all(ids_NxK.reshape(-1), jnp.repeat(x_NxD, K, axis=0))
  h = h * weights_NxK.reshape(-1)[:, None].astype(h.dtype)
  return jnp.sum(h.reshape(N, K, -1), axis=1).astype(x_NxD.dtype)
