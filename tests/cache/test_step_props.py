"""apply_step (one jitted call per engine step) vs the plain reference: random plans of registrations, frees and
allocations on every group, applied in the documented order (register, free, allocate); full pool state compared
after every step."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from cache import pool
from cache.reference import RefPool
from cache.specs import SLIDING_WINDOW, CacheSpecs, GroupSpec
from cache.prefix import group_searches
from cache.step import GroupPlan, InputCarver, apply_step, apply_step_packed, result_layout, unpack

T = 4
SPECS = CacheSpecs((GroupSpec("a", SLIDING_WINDOW, T, 1, 3), GroupSpec("b", SLIDING_WINDOW, T, 1, 7)))
N = {"a": 10, "b": 14}
W = 8                      # register / free / allocate widths
MAX_PROBE = 4


S, TW = 4, 6                # table rows x entries per group


def packed(pools, tables, plans, admit, **kw):
  """apply_step through the manager's path: plans carved into one int32 buffer, results in one buffer, unpacked."""
  leaves, treedef = jax.tree_util.tree_flatten((plans, admit))
  c = InputCarver([np.shape(x) for x in leaves])
  for x in leaves:
    c.take(np.shape(x))[...] = x
  in_layout = (treedef, c.shapes)
  layout = result_layout(pools, tables, in_layout, **kw)
  pools, tables, out = apply_step_packed(pools, tables, c.buf, in_layout=in_layout, **kw)
  return pools, tables, unpack(np.asarray(out), *layout)


def _runs(entries, width):
  """Release runs (slot, a, b, entries so far) of table positions slot * TW + e, in list order: an entry right
  below the previous one in the same row extends its run (a run releases b - 1 down to a); padded to `width` rows."""
  out = []
  for e in entries:
    s, j = divmod(e, TW)
    if out and out[-1][0] == s and out[-1][1] == j + 1:
      out[-1] = (s, j, out[-1][2])
    else:
      out.append((s, j, j + 1))
  ends = np.cumsum([b - a for _, a, b in out]).tolist()
  rows = [(s, a, b, n) for (s, a, b), n in zip(out, ends)]
  return np.array(rows + [(0, 0, 0, len(entries))] * (width - len(rows)), np.int32).reshape(width, 4)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from(["pytree", "packed"]))
def test_apply_step_matches_reference(d, path):
  """Plans name table positions (slot * TW + entry); the reference resolves them on the host against its own copy
  of the tables, runs the plain pool, and writes the same entries; pools and tables are compared after each step."""
  pools = tuple(pool.init_pool(N[g], T, MAX_PROBE) for g in SPECS.names)
  tables = tuple(jnp.full((S, TW), -1, jnp.int32) for _ in SPECS.names)
  refs = [RefPool(N[g], T, MAX_PROBE) for g in SPECS.names]
  host = [np.full(S * TW, -1, np.int64) for _ in SPECS.names]
  prepend = d.draw(st.booleans())
  for _ in range(d.draw(st.integers(2, 8))):
    plans, want = [], []
    for gi, g in enumerate(SPECS.names):
      held = [int(e) for e in np.flatnonzero(host[gi] >= 0)]
      empty = [int(e) for e in np.flatnonzero(host[gi] < 0)]
      # repeats and -1 padding; a registration of an empty entry resolves to -1 (skipped)
      reg = d.draw(st.lists(st.sampled_from(held + empty[:2] + [-1]), max_size=W))
      k = d.draw(st.lists(st.integers(0, 3), min_size=W, max_size=W))
      p = d.draw(st.lists(st.integers(0, 1), min_size=W, max_size=W))
      t = d.draw(st.lists(st.integers(0, 2), min_size=W, max_size=W))
      key = np.array([[0, x] for x in k], np.int32)
      par = np.array([[x, 0, 0, 1] for x in p], np.int32)
      tok = np.array([[x] * T for x in t], np.int32)
      fr = d.draw(st.lists(st.sampled_from(held), max_size=W, unique=True)) if held else []
      if d.draw(st.booleans()):
        fr.sort(reverse=True)          # neighbours merge into longer runs
      ids_fr = [int(host[gi][e]) for e in fr]
      free_left = refs[gi].num_free + sum(1 for b in set(ids_fr)
                                          if sum(1 for e in held if host[gi][e] == b) == ids_fr.count(b))
      now_empty = sorted(set(empty) | set(fr))
      n = d.draw(st.integers(0, min(W, free_left, len(now_empty))))
      al = d.draw(st.permutations(now_empty))[:n] if n else []
      rr = np.array(reg + [-1] * (W - len(reg)), np.int32)
      plans.append(GroupPlan(rr, key, par, tok, _runs(fr, W),
                             np.array(al + [-1] * (W - len(al)), np.int32)))
      want.append((reg, key, par, tok, fr, al))
    kw = dict(groups=group_searches(SPECS), block_tokens=(T, T), align=SPECS.align_tokens,
              hash_tokens=SPECS.hash_tokens, prepend=prepend, admit_widths=(W, W), free_chunks=(3, 3))
    if path == "pytree":
      pools, tables, res = apply_step(pools, tables, tuple(plans), None, **kw)
    else:
      pools, tables, res = packed(pools, tables, tuple(plans), None, **kw)
    res = jax.device_get(res)
    for gi, (reg, key, par, tok, fr, al) in enumerate(want):
      ref, tab = refs[gi], host[gi]
      ids = [int(tab[e]) if e >= 0 else -1 for e in reg] + [-1] * (W - len(reg))
      assert list(res["status"][gi]) == ref.register(ids, key, par, tok)
      # the device releases in chunks of `free_chunks` entries, each one release call
      ids_fr = [int(tab[e]) for e in fr]
      ok = all([ref.free(ids_fr[c:c + 3], prepend_uncached=prepend) for c in range(0, len(ids_fr), 3)])
      assert bool(res["free_ok"][gi]) == ok
      tab[fr] = -1
      got_ids, got_ev, ok = ref.allocate(len(al), max_n=W)
      assert ok and bool(res["alloc_ok"][gi])
      assert [int(x) for x in res["alloc_ids"][gi][:len(al)]] == got_ids
      assert list(res["alloc_ev"][gi][:len(al)]) == got_ev
      tab[al] = got_ids
      ref.check_invariants()
      ref.assert_matches(pools[gi])
      assert int(res["num_free"][gi]) == ref.num_free
      assert np.array_equal(np.asarray(tables[gi]).reshape(-1), tab)
