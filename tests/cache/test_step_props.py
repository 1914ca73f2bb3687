"""apply_step (one jitted call per engine step) vs the plain reference: random plans of registrations, frees and
allocations on every group, applied in the documented order (register, free, allocate); full pool state compared
after every step."""

import collections

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from cache import pool as P
from cache.reference import RefPool
from cache.specs import SLIDING_WINDOW, CacheSpecs, GroupSpec
from cache.prefix import group_searches
from cache.step import GroupPlan, InputCarver, apply_step, apply_step_packed, result_layout, unpack

T = 4
SPECS = CacheSpecs((GroupSpec("a", SLIDING_WINDOW, T, 1, 3), GroupSpec("b", SLIDING_WINDOW, T, 1, 7)))
N = {"a": 10, "b": 14}
W = 8                      # register / free / allocate widths
MAX_PROBE = 4


def packed(pools, plans, admit, **kw):
  """apply_step through the manager's path: plans carved into one int32 buffer, results in one buffer, unpacked."""
  leaves, treedef = jax.tree_util.tree_flatten((plans, admit))
  c = InputCarver([np.shape(x) for x in leaves])
  for x in leaves:
    c.take(np.shape(x))[...] = x
  in_layout = (treedef, c.shapes)
  layout = result_layout(pools, in_layout, **kw)
  pools, out = apply_step_packed(pools, c.buf, in_layout=in_layout, **kw)
  return pools, unpack(np.asarray(out), *layout)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from(["pytree", "packed"]))
def test_apply_step_matches_reference(d, path):
  pools = tuple(P.init_pool(N[g], T, MAX_PROBE) for g in SPECS.names)
  refs = [RefPool(N[g], T, MAX_PROBE) for g in SPECS.names]
  holders = [collections.Counter() for _ in SPECS.names]
  prepend = d.draw(st.booleans())
  for _ in range(d.draw(st.integers(2, 8))):
    plans, want = [], []
    for gi, g in enumerate(SPECS.names):
      held = sorted(holders[gi].elements())
      # repeats, -1 padding and out-of-range ids (INVALID)
      reg = d.draw(st.lists(st.sampled_from(held + [-1, 0, N[g], -3]), max_size=W))
      k = d.draw(st.lists(st.integers(0, 3), min_size=W, max_size=W))
      p = d.draw(st.lists(st.integers(0, 1), min_size=W, max_size=W))
      t = d.draw(st.lists(st.integers(0, 2), min_size=W, max_size=W))
      key = np.array([[0, x] for x in k], np.int32)
      par = np.array([[x, 0, 0, 1] for x in p], np.int32)
      tok = np.array([[x] * T for x in t], np.int32)
      c = collections.Counter(held)
      fr = []
      for b in d.draw(st.lists(st.sampled_from(held), max_size=W)) if held else []:
        if c[b]:
          fr.append(b)
          c[b] -= 1
      free_left = refs[gi].num_free + sum(1 for b in set(fr) if c[b] == 0)
      n = d.draw(st.integers(0, min(W, free_left)))
      ids = np.array(reg + [-1] * (W - len(reg)), np.int32)
      fids = np.array(fr + [-1] * (W - len(fr)), np.int32)
      plans.append(GroupPlan(ids, key, par, tok, fids, np.int32(n)))
      want.append((list(ids), key, par, tok, fr, n))
    call = apply_step if path == "pytree" else packed
    pools, res = call(pools, tuple(plans), None, groups=group_searches(SPECS), block_tokens=(T, T),
                            align=SPECS.align_tokens, hash_tokens=SPECS.hash_tokens, prepend=prepend,
                            alloc_widths=(W, W), admit_widths=(W, W))
    res = jax.device_get(res)
    for gi, (ids, key, par, tok, fr, n) in enumerate(want):
      ref = refs[gi]
      assert list(res["status"][gi]) == ref.register(ids, key, par, tok)
      assert bool(res["free_ok"][gi]) == ref.free(fr, prepend_uncached=prepend)
      holders[gi].subtract(fr)
      got_ids, got_ev, ok = ref.allocate(n, max_n=W)
      assert ok and bool(res["alloc_ok"][gi])
      assert [int(x) for x in res["alloc_ids"][gi][:n]] == got_ids
      assert list(res["alloc_ev"][gi][:n]) == got_ev
      holders[gi].update(got_ids)
      holders[gi] += collections.Counter()
      ref.check_invariants()
      ref.assert_matches(pools[gi])
      assert int(res["num_free"][gi]) == ref.num_free
