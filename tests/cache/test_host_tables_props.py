"""The manager's host-side table bookkeeping (no device): a request's held entries kept as a run [lo, n) that
switches to an explicit mask on a gap, and queued runs expanded to table refs with numpy, both against a plain
list of HOST_HELD / -1 entries. Pure numpy: cheap."""

import numpy as np
from hypothesis import given, settings, strategies as st

from cache.step_queue import StepQueue
from cache.request_state import HOST_HELD, HeldEntries

OPS = st.lists(st.one_of(
    st.tuples(st.just("grow"), st.integers(0, 5)),
    st.tuples(st.just("extend"), st.lists(st.sampled_from([HOST_HELD, -1]), max_size=5)),
    st.tuples(st.just("clear"), st.integers(0, 30))), max_size=12)


@settings(max_examples=60, deadline=None)
@given(OPS, st.integers(0, 6), st.integers(0, 6))
def test_held_matches_a_plain_mask(ops, lo, n):
  lo = min(lo, n)
  held = HeldEntries(lo, n)
  plain = [-1] * lo + [HOST_HELD] * (n - lo)
  for op, arg in ops:
    if op == "grow":
      assert held.grow(arg) == len(plain)
      plain += [HOST_HELD] * arg
    elif op == "extend":
      held.extend(arg)
      plain += list(arg)
    else:
      held.clear_front(arg)
      plain[:arg] = [-1] * min(arg, len(plain))
    assert len(held) == len(plain)
    assert list(held.view()) == plain
    for a in range(len(plain) + 1):
      for b in range(a, len(plain) + 2):
        runs = held.held_runs(a, b)
        want = [j for j in range(a, min(b, len(plain))) if plain[j] >= 0]
        assert [j for x, y in runs for j in range(x, y)] == want
        assert all(y > x for x, y in runs) and all(y1 < x2 for (_, y1), (x2, _) in zip(runs, runs[1:]))
        if b > a and b <= len(plain):
          assert held.all_held(a, b) == all(plain[j] >= 0 for j in range(a, b))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6), st.integers(0, 4)), min_size=1, max_size=8),
       st.booleans())
def test_queued_runs_expand_to_refs_in_order(runs, reverse):
  runs = [(s, a, a + k) for s, a, k in runs]
  width = 16
  mgr = StepQueue.__new__(StepQueue)        # only the width is read
  mgr.width = {"g": width}
  want = [s * width + j for s, a, b in runs for j in (range(b - 1, a - 1, -1) if reverse else range(a, b))]
  assert mgr._refs("g", runs, reverse=reverse).tolist() == want
  # registrations carry more fields after (slot, a, b)
  assert mgr._refs("g", [r + (None, None) for r in runs], reverse=reverse).tolist() == want
