"""What the engine's step program writes at the width of its token budget, counted from the product's own traced
program.

The step has fixed shapes (the token budget N), and its row-invariant ops loop over the live row blocks only, but
some arrays still span the whole budget:

* loop buffers: each `row_invariant.map_row_blocks` loop fills an [N, ...] output block by block, so the buffer is
  created at N rows and initialised (zeros) before the loop runs, however few blocks it fills;
* other ops: what the step computes on whole [N, ...] arrays outside those loops (the routed experts' pair sort
  and layouts over N x top-k pairs, the per-token sums, the compressors' inputs, masks and index lists).

Those bytes follow the budget, not the live tokens: a decode step holding 8 tokens in an engine whose budget admits
an 8,192-token prefill chunk writes them all.

`budget_bytes` traces `model.forward_ragged` (abstract parameters and cache: nothing is allocated) at two budgets,
as on a GPU (narrow floats updated in place, `caches.updates_through_bits`), and sums the bytes of the arrays the
program's top level creates; a device loop's body works on fixed blocks and is not counted, its carried buffers
are (the loop's outputs). Views (reshapes, squeezes, broadcasts, which XLA folds into their users) and the loop
buffers' allocations (`jax.lax.empty`) are left out.
The difference over the budgets' difference is the bytes per budget token. It counts arrays as traced, before
XLA fuses anything, so "other ops" is an upper estimate of what a fused program writes; a loop buffer is written
once to initialise it whatever the fusion.
"""

from __future__ import annotations

import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import caches, model
from dsv4.config import ModelConfig
from pallas_kernels import dispatch

# Primitives whose inner jaxprs run once per call at the call's own shapes (entered); loops and conditionals are
# counted by their outputs.
_INLINE = {"pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
           "remat", "checkpoint", "jit"}
# Kernels whose programs past the live rows return without writing (pallas_kernels/row_dot.py, grouped_dot.py,
# sparse_attention.py, hca_attention.py, indexer_topk.py: their `live`); the other kernels' outputs count as
# written whole.
_SKIP_DEAD_ROWS = {"dsv4_row_dot", "dsv4_grouped_dot", "dsv4_sparse_mla", "dsv4_hca", "dsv4_indexer_topk"}
# Arrays no GPU kernel writes: views XLA folds into their users, and `jax.lax.empty` (a loop buffer's allocation).
_UNWRITTEN = {"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "bitcast_convert_type", "empty"}


@dataclasses.dataclass(frozen=True)
class BudgetBytes:
  """Bytes per budget token the step's top level creates: `loop_buffers` (the row-block loops' [N, ...] outputs)
  and `other_ops` (by primitive in `by_primitive`), and the count of loops with such a buffer."""
  loop_buffers: float
  other_ops: float
  by_primitive: dict[str, float]
  budget_loops: int

  @property
  def per_token(self) -> float:
    return self.loop_buffers + self.other_ops


def _kernel_name(params) -> str:
  return params.get("name") or getattr(params.get("name_and_src_info"), "name", "")    # JAX versions differ


def _walk(jaxpr, N: int, totals: dict[str, float], loops: list[int]):
  # a broadcast that starts a loop's carry is written (a memset), not folded into a user
  loop_inits = {id(v) for e in jaxpr.eqns if e.primitive.name == "while" for v in e.invars}
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    inner = [v for k, v in eqn.params.items() if k in ("jaxpr", "call_jaxpr", "fun_jaxpr")]
    if name in _INLINE and inner:
      j = inner[0]
      _walk(getattr(j, "jaxpr", j), N, totals, loops)
      continue
    if name in _UNWRITTEN and not (name == "broadcast_in_dim" and id(eqn.outvars[0]) in loop_inits):
      continue
    if name == "pallas_call" and _kernel_name(eqn.params) in _SKIP_DEAD_ROWS:
      continue
    if name == "pad" and eqn.invars[0].aval.shape == eqn.outvars[0].aval.shape:
      continue                    # pads nothing: XLA drops it
    out, spans = 0, False
    for v in eqn.outvars:
      shape = getattr(v.aval, "shape", None)
      if shape is None:
        continue
      out += int(np.prod(shape, dtype=np.int64)) * jnp.dtype(v.aval.dtype).itemsize
      spans |= any(d >= N for d in shape)
    totals[name] = totals.get(name, 0) + out
    loops[0] += name == "while" and spans


def _traced_bytes(cfg: ModelConfig, N: int, rows: int, dtype, kernels: bool) -> tuple[dict[str, float], int]:
  layout = caches.CacheLayout(kv_dtype=dtype)
  params = jax.eval_shape(lambda: model.cast_params(model.init_params(cfg, jax.random.PRNGKey(0)), dtype))
  cache = jax.eval_shape(lambda: caches.init_cache(cfg, layout, 4 * rows + 64, 8 * rows + 8))
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  step = caches.StepIndex(i32(N), i32(N), i32(rows), i32(rows), {caches.SWA: i32(rows, 4), caches.FULL: i32(rows, 8)},
                          swa_base_R=i32(rows), full_row_R=i32(rows), live_tokens=i32(), invariant=True)
  kernel_cfg = dispatch.KernelConfig(backend="interpret" if kernels else "xla")
  fn = functools.partial(model.forward_ragged, config=cfg, layout=layout, kernel_cfg=kernel_cfg)
  with mock.patch.object(caches, "updates_through_bits", lambda dtype: False):     # as on a GPU
    closed = jax.make_jaxpr(lambda p, t, c, s: fn(p, tokens_N=t, cache=c, step=s))(params, i32(N), cache, step)
  totals: dict[str, float] = {}
  loops = [0]
  _walk(closed.jaxpr, N, totals, loops)
  return totals, loops[0]


@functools.cache
def budget_bytes(cfg: ModelConfig, budgets: tuple[int, int] = (256, 512), rows: int = 64, dtype=jnp.bfloat16,
                 kernels: bool = True) -> BudgetBytes:
  """Bytes per budget token the step's traced program creates at its top level (see the module docstring).
  kernels: the step as a GPU runs it, with its Pallas kernels (traced in interpret mode; a kernel's outputs count
  as written whole unless its programs past the live rows skip, `_SKIP_DEAD_ROWS`); else with every op's XLA
  reference."""
  (a, loops), (b, _) = (_traced_bytes(cfg, n, rows, dtype, kernels) for n in budgets)
  span = budgets[1] - budgets[0]
  by = {k: (b.get(k, 0) - a.get(k, 0)) / span for k in set(a) | set(b)}
  by = {k: v for k, v in sorted(by.items(), key=lambda kv: -kv[1]) if v > 0}
  loop = by.pop("while", 0.0)
  return BudgetBytes(loop, sum(by.values()), by, loops)
