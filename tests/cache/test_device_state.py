"""The paged cache's device half as one value (`cache.device_state`): a pytree of every group's pool and tables, the
pure functions over it against plain numpy, the one place it is written (`DeviceCell.advance`), and a planner
that holds no device array of its own."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cache import device_state
from cache.device_state import DeviceCell, DeviceState
from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from cache.specs import FULL_HISTORY, SLIDING_WINDOW, CacheSpecs, GroupSpec

SPECS = CacheSpecs((GroupSpec("full", FULL_HISTORY, 16, 1, 0), GroupSpec("swa", SLIDING_WINDOW, 8, 1, 11)))


def test_the_state_is_one_pytree_of_pools_and_tables():
  state = device_state.init(SPECS, {"full": 40, "swa": 24}, slots=4, max_tokens=256)
  assert [p.num_blocks for p in state.pools] == [40, 24]
  assert [t.shape for t in state.tables] == [(4, 16), (4, 32)]
  leaves, treedef = jax.tree_util.tree_flatten(state)
  again = jax.tree_util.tree_unflatten(treedef, leaves)
  assert isinstance(again, DeviceState) and len(leaves) == len(jax.tree_util.tree_leaves(state.pools)) + 2


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 3), st.integers(0, 5), st.lists(st.integers(0, 12), min_size=2, max_size=2), st.data())
def test_table_rows_and_grow_match_numpy(slot, more_slots, more_width, data):
  state = device_state.init(SPECS, {"full": 40, "swa": 24}, slots=4, max_tokens=128)
  rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
  host = [rng.integers(-1, 40, t.shape).astype(np.int32) for t in state.tables]
  state = state._replace(tables=tuple(jax.device_put(h) for h in host))
  rows = jax.device_get(device_state.table_rows(state, slot))
  for row, h in zip(rows, host):
    np.testing.assert_array_equal(row, h[slot])
  widths = tuple(h.shape[1] + w for h, w in zip(host, more_width))
  grown, out = device_state.grow(state, slots=4 + more_slots, widths=widths)
  assert out is None
  for t, h, w in zip(grown.tables, host, widths):
    want = np.full((4 + more_slots, w), -1, np.int32)
    want[:h.shape[0], :h.shape[1]] = h
    np.testing.assert_array_equal(np.asarray(t), want)


def test_the_cell_is_where_the_state_changes():
  cell = DeviceCell(device_state.init(SPECS, {"full": 40, "swa": 24}, slots=4, max_tokens=128))
  before = cell.state
  out = cell.advance(lambda s, k: (s._replace(tables=tuple(t + k for t in s.tables)), "done"), 1)
  assert out == "done" and cell.state is not before
  assert all(int(np.asarray(t).min()) == 0 for t in cell.state.tables)


def test_a_manager_holds_no_device_array_and_runs_through_its_cell():
  cell = DeviceCell(device_state.init(SPECS, {"full": 40, "swa": 40}, slots=4, max_tokens=256))
  m = KVCacheManager(SPECS, num_blocks={"full": 40, "swa": 40}, num_slots=4, max_tokens=256, device=cell)
  prompt = np.arange(2, 100, dtype=np.int32)
  m.add_requests([("a", prompt, ExtraKeys())], allocate_tokens=[len(prompt)])
  m.commit("a", len(prompt))
  m.free("a")
  m.flush()
  assert m.lookup(prompt).num_tokens == 96
  assert m.device is cell and m.pools["full"] is cell.state.pools[0]

  def arrays(obj, seen):
    if id(obj) in seen or isinstance(obj, DeviceCell):
      return []
    seen.add(id(obj))
    if isinstance(obj, jax.Array):
      return [obj]
    if isinstance(obj, dict):
      return [a for v in obj.values() for a in arrays(v, seen)]
    if isinstance(obj, (list, tuple, set)):
      return [a for v in obj for a in arrays(v, seen)]
    if hasattr(obj, "__dict__"):
      return arrays(vars(obj), seen)
    return []
  assert arrays(m, set()) == []


def test_a_cell_of_other_sizes_is_refused():
  cell = DeviceCell(device_state.init(SPECS, {"full": 40, "swa": 24}, slots=4, max_tokens=128))
  with pytest.raises(ValueError, match="other groups or pool sizes"):
    KVCacheManager(SPECS, num_blocks={"full": 40, "swa": 40}, num_slots=4, max_tokens=128, device=cell)
