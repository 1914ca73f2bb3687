"""The paged cache's device half as one value: `DeviceState`, every cache group's block pool and block tables (on a
mesh with the pools split over `data`: one value per data shard), and the pure functions over it.

    state = device_state.init(specs, {"full": 4096, "swa": 4096}, slots=64, max_tokens=65536)
    state, results = device_state.apply(state, plan)     # a StepPlan of KVCacheManager.plan(); donates `state`
    rows = device_state.table_rows(state, slot)          # a request's block ids per group (tiers, P/D handoff)

The host planner (`cache.manager.KVCacheManager`) never holds these arrays: it writes plans and reads results. The
value lives in a `DeviceCell`, and every program that changes it goes through `DeviceCell.advance` (the manager's
own calls: `apply`; the engine's step: the bookkeeping, then the model reading the new tables), so one line of code
writes it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cache import pool
from cache.specs import CacheSpecs
from cache.step import jitted_step_packed, result_layout as _step_result_layout
from cache.step_plan import StepPlan


class DeviceState(NamedTuple):
  """pools: `pool.PoolState` per group; tables: int32 [slots, width] per group (-1 = no block), a request's row at
  its slot. Both in the order of `CacheSpecs.groups`."""
  pools: tuple
  tables: tuple


def table_widths(specs: CacheSpecs, max_tokens: int) -> tuple[int, ...]:
  """Entries per table row of each group for requests of at most max_tokens positions (at least 8)."""
  return tuple(max(8, -(-max_tokens // bt)) for bt in specs.block_tokens)


def init(specs: CacheSpecs, num_blocks: dict[str, int], *, slots: int, max_tokens: int,
         max_probe: int = pool.DEFAULT_MAX_PROBE) -> DeviceState:
  """Empty pools of num_blocks[group] blocks and empty tables of `slots` rows wide enough for max_tokens."""
  pools = tuple(pool.init_pool(num_blocks[g.name], g.block_tokens, max_probe) for g in specs.groups)
  tables = jax.device_put(tuple(np.full((slots, w), -1, np.int32) for w in table_widths(specs, max_tokens)))
  return DeviceState(pools, tables)


def apply(state: DeviceState, plan: StepPlan, buf=None) -> tuple[DeviceState, jax.Array]:
  """Run a plan's bookkeeping (registrations, releases, allocations, admissions: `cache.step.step_core`) on the
  state, jitted with `state` donated. buf: the plan's buffer already on the device (the engine sends it with the
  model's plan in one transfer); None = `plan.buf`. Returns (new state, the packed int32 results, on the device:
  `KVCacheManager.read_results`)."""
  pools, tables, out = jitted_step_packed()(state.pools, state.tables, plan.buf if buf is None else buf,
                                            **plan.kwargs())
  return DeviceState(pools, tables), out


def result_layout(state: DeviceState, in_layout, results: str, statics: dict):
  """(treedef, shapes, dtypes) of `apply`'s result buffer for a plan of this input layout (memoised per shape)."""
  return _step_result_layout(state.pools, state.tables, in_layout, results=results, **statics)


@jax.jit
def _rows(tables, slot):
  return tuple(t[slot] for t in tables)


def table_rows(state: DeviceState, slot: int) -> tuple:
  """The block ids of table row `slot` in every group (device arrays; -1 where no block): what a request holds."""
  return _rows(state.tables, jnp.int32(slot))


def grow(state: DeviceState, slots: int | None = None, widths: tuple | None = None) -> tuple[DeviceState, None]:
  """Tables with more rows (slots) and / or wider rows (widths per group), padded with -1."""
  tables = []
  for i, t in enumerate(state.tables):
    s, w = t.shape
    ns = s if slots is None else max(s, slots)
    nw = w if widths is None else max(w, widths[i])
    tables.append(t if (ns, nw) == (s, w) else jnp.pad(t, ((0, ns - s), (0, nw - w)), constant_values=-1))
  return state._replace(tables=tuple(tables)), None


def reset_pools(state: DeviceState) -> tuple[DeviceState, bool]:
  """Every pool emptied of its cached identities (`pool.reset`); (state, whether every pool allowed it)."""
  pools, ok = [], True
  for st in state.pools:
    st, k = pool.reset(st)
    pools.append(st)
    ok = ok and bool(k)
  return state._replace(pools=tuple(pools)), ok


def update_pool(state: DeviceState, index: int, fn, *args) -> tuple[DeviceState, object]:
  """Pool `index` replaced by fn(pool, *args)'s first output (a `cache.pool` operation: evict, touch, free);
  returns (state, fn's other outputs)."""
  st, *rest = fn(state.pools[index], *args)
  pools = state.pools[:index] + (st,) + state.pools[index + 1:]
  return state._replace(pools=pools), (rest[0] if len(rest) == 1 else tuple(rest))


def num_free(state: DeviceState) -> list[int]:
  """Free blocks per group, read from the device (waits for every program sent on the state)."""
  return [int(n) for n in jax.device_get([p.num_free for p in state.pools])]


class DeviceCell:
  """Where a DeviceState lives between programs. `advance(program, *args)` runs program(state, *args) -> (state,
  out), keeps the new state and returns `out`: the one place the state is written. `state` is for reading (its
  arrays are donated by the next program: do not keep them)."""

  __slots__ = ("_state",)

  def __init__(self, state: DeviceState):
    self._state = state

  @property
  def state(self) -> DeviceState:
    return self._state

  def advance(self, program, *args, **kwargs):
    self._state, out = program(self._state, *args, **kwargs)
    return out

