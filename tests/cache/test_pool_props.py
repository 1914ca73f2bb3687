"""Property tests: random op sequences on the jitted pool and the plain reference, states compared every step."""

import collections
import functools

import jax
import numpy as np
import jax.numpy as jnp
from hypothesis import HealthCheck, given, settings, strategies as st

from cache import pool
from cache.reference import RefPool

N, T, M = 12, 4, 6          # blocks, tokens per block, fixed id-array width (one compile per op)
MAX_PROBE = 4               # small so TABLE_FULL and tombstone reuse happen


def _pad(ids, fill=-1):
  ids = list(ids)[:M]
  return jnp.asarray(ids + [fill] * (M - len(ids)), jnp.int32)


def _ident(d, n):
  """n identities from a tiny space: keys collide constantly, parents/tokens decide exactness."""
  k = d.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
  p = d.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
  t = d.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
  keys = np.array([[0, x] for x in k] + [[0, 0]] * (M - n), np.int32)
  par = np.array([[x, 0, 0, 1] for x in p] + [[0] * 4] * (M - n), np.int32)
  tok = np.array([[x] * T for x in t] + [[0] * T] * (M - n), np.int32)
  return keys, par, tok


def _check(ref, s, holders):
  ref.check_invariants()
  ref.assert_matches(s)
  for b in range(N):
    assert ref.ref[b] == holders[b], (b, ref.ref[b], holders[b])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_pool_matches_reference(d):
  s = pool.init_pool(N, T, MAX_PROBE)
  ref = RefPool(N, T, MAX_PROBE)
  holders = collections.Counter()
  for _ in range(d.draw(st.integers(5, 30))):
    op = d.draw(st.sampled_from(["alloc", "alloc", "touch", "free", "free", "register", "register", "lookup",
                                 "evict", "reset"]))
    held = sorted(holders.elements())
    if op == "alloc":
      n = d.draw(st.integers(0, M + 2))
      before = (np.asarray(s.cached_N).copy(), np.asarray(s.key_Nx2).copy())
      s, ids, ev, ok = pool.allocate(s, n, max_n=M)
      rids, rev, rok = ref.allocate(n, max_n=M)
      assert bool(ok) == rok
      got = [int(x) for x in ids if x >= 0]
      assert got == rids and list(np.asarray(ev)[:len(got)]) == rev
      # identities vanish exactly for the reused blocks
      others = [b for b in range(N) if b not in got]
      np.testing.assert_array_equal(np.asarray(s.cached_N)[others], before[0][others])
      assert list(np.asarray(ev)[:len(got)]) == list(before[0][got])
      holders.update(got)
    elif op == "touch":
      ids = d.draw(st.lists(st.integers(-1, N - 1), max_size=M))
      if d.draw(st.booleans()) and ids:
        ids[0] = N + 3  # bad id: refused, nothing changes
      s, ok = pool.touch(s, _pad(ids))
      assert bool(ok) == ref.touch(ids)
      if ok:
        holders.update(b for b in ids if b >= 0)
    elif op == "free":
      if held and d.draw(st.booleans()):
        ids = d.draw(st.lists(st.sampled_from(held), max_size=M))
      else:
        ids = d.draw(st.lists(st.integers(-1, N - 1), max_size=M))
      if ids and d.draw(st.integers(0, 4)) == 0:
        ids[d.draw(st.integers(0, len(ids) - 1))] = d.draw(st.sampled_from([N, N + 5, -3]))   # refused
      prepend = d.draw(st.booleans())
      s, ok = pool.free(s, _pad(ids), prepend_uncached=prepend)
      assert bool(ok) == ref.free(ids, prepend_uncached=prepend)
      if ok:
        holders.subtract(b for b in ids if b >= 0)
    elif op == "register":
      pool_ids = held + list(range(N))
      # repeated ids, -1 padding and out-of-range ids (INVALID) exercise the duplicate detection
      ids = d.draw(st.lists(st.sampled_from(pool_ids + [-1, -1, N, N + 7, -4]), max_size=M))
      keys, par, tok = _ident(d, len(ids))
      s, status = pool.register(s, _pad(ids), jnp.asarray(keys), jnp.asarray(par), jnp.asarray(tok))
      rstatus = ref.register(list(ids) + [-1] * (M - len(ids)), keys, par, tok)
      assert list(np.asarray(status)) == rstatus
    elif op == "lookup":
      keys, par, tok = _ident(d, M)
      got = pool.lookup(s, jnp.asarray(keys), jnp.asarray(par), jnp.asarray(tok))
      want = ref.lookup(keys, par, tok)
      assert list(np.asarray(got)) == want
      for b, k, p, t in zip(want, keys, par, tok):  # exactness: a hit is the very identity asked for
        if b >= 0:
          assert ref._matches(b, ref._ident(k, p, t))
    elif op == "evict":
      ids = d.draw(st.lists(st.integers(-3, N + 2), max_size=M))
      s, ev = pool.evict(s, _pad(ids))
      assert list(np.asarray(ev)[:len(ids)]) == ref.evict(ids)
    else:
      s, ok = pool.reset(s)
      assert bool(ok) == ref.reset() == (not held)
    holders += collections.Counter()  # drop zero counts
    _check(ref, s, holders)
  # Nothing leaks: once every holder lets go, every block is free.
  s, ok = pool.free(s, _pad([]))
  for b in sorted(holders.elements()):
    s, ok = pool.free(s, _pad([b]))
    assert ok and ref.free([b])
  holders.clear()
  _check(ref, s, holders)
  assert int(s.num_free) == N and pool.free_queue(s) == ref.queue


def test_out_of_blocks_reported_not_crashing():
  s = pool.init_pool(4, 2)
  s, ids, ev, ok = pool.allocate(s, 3, max_n=8)
  assert ok
  s, ids2, ev2, ok2 = pool.allocate(s, 2, max_n=8)
  assert not bool(ok2) and np.all(np.asarray(ids2) == -1) and int(s.num_free) == 1
  s, ids3, _, ok3 = pool.allocate(s, 9, max_n=8)   # over the static width: refused too
  assert not bool(ok3)


def test_free_order_tail_first_and_transient_first():
  """Cached blocks appended in the given order; uncached ones put at the head in the given order."""
  s = pool.init_pool(6, 2)
  s, ids, _, _ = pool.allocate(s, 4, max_n=4)          # 0 1 2 3 held, queue [4 5]
  k = jnp.asarray([[0, 1], [0, 2], [0, 0], [0, 0]], jnp.int32)
  s, status = pool.register(s, jnp.asarray([0, 1, -1, -1]), k, jnp.zeros((4, 4), jnp.int32),
                            jnp.ones((4, 2), jnp.int32))
  assert list(np.asarray(status)) == [pool.STORED, pool.STORED, pool.SKIPPED, pool.SKIPPED]
  s, ok = pool.free(s, jnp.asarray([3, 2, 1, 0]))      # request freed tail-first
  assert pool.free_queue(s) == [3, 2, 4, 5, 1, 0]


_first_last = jax.jit(pool._first_last, static_argnames="last")
_prev_same = jax.jit(pool._prev_same)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from([-3, -1, -1, 0, 1, 2, 5, N - 1, N, N + 4]), min_size=12, max_size=12))
def test_duplicate_detection_without_sort(ids):
  """The scatter-based duplicate detection (first / last occurrence, previous same id) equals a plain scan on lists
  with repeated ids, -1 padding and out-of-range ids, and leaves the scratch at its sentinel."""
  s = pool.init_pool(N, T)
  a = jnp.asarray(ids, jnp.int32)
  valid = (a >= 0) & (a < N)
  ok = [0 <= b < N for b in ids]
  want_first = [ok[i] and all(not (ok[j] and ids[j] == ids[i]) for j in range(i)) for i in range(len(ids))]
  want_last = [ok[i] and all(not (ok[j] and ids[j] == ids[i]) for j in range(i + 1, len(ids)))
               for i in range(len(ids))]
  want_prev = [max([j for j in range(i) if ok[j] and ids[j] == ids[i]], default=-1) if ok[i] else -1
               for i in range(len(ids))]
  for fn, want in [(lambda s: _first_last(s, a, valid), want_first),
                   (lambda s: _first_last(s, a, valid, last=True), want_last),
                   (lambda s: _prev_same(s, a, valid), want_prev)]:
    s2, got = fn(s)
    assert np.asarray(got).tolist() == [int(x) if not isinstance(x, bool) else x for x in want]
    assert (np.asarray(s2.mark_N) == pool.BIG).all()


W = 12                      # a register call wider than its chunks
_CHUNKED = {c: jax.jit(functools.partial(pool._register_chunks, min_chunk=c, chunks=W)) for c in (2, 5)}
_WHOLE = jax.jit(pool._register_core)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_register_in_chunks_matches_one_batch(d):
  """The step's register (`_register_chunks`: chunk after chunk, up to the last entry that is not padding) leaves
  exactly the statuses and state of one batch and of the reference: colliding keys, repeated ids, padding between
  and after live entries, tombstones from reused blocks; chunks of 2 and of 5 (the last one padded)."""
  s = pool.init_pool(N, T, MAX_PROBE)
  ref = RefPool(N, T, MAX_PROBE)
  s, ids, _, _ = pool.allocate(s, N - 2, max_n=N)
  ref.allocate(N - 2, max_n=N)
  held = [int(x) for x in ids if x >= 0]
  for _ in range(3):
    n = d.draw(st.integers(0, W))
    ids = d.draw(st.lists(st.sampled_from(held + [-1, -1, -1, N, -4]), min_size=n, max_size=n)) + [-1] * (W - n)
    k = d.draw(st.lists(st.integers(0, 3), min_size=W, max_size=W))
    p = d.draw(st.lists(st.integers(0, 1), min_size=W, max_size=W))
    t = d.draw(st.lists(st.integers(0, 2), min_size=W, max_size=W))
    keys = np.array([[0, x] for x in k], np.int32)
    par = np.array([[x, 0, 0, 1] for x in p], np.int32)
    tok = np.array([[x] * T for x in t], np.int32)
    args = (jnp.asarray(ids, jnp.int32), jnp.asarray(keys), jnp.asarray(par), jnp.asarray(tok))
    whole, wstatus = _WHOLE(s, *args)
    s, status = _CHUNKED[d.draw(st.sampled_from([2, 5]))](s, *args)
    assert list(np.asarray(status)) == list(np.asarray(wstatus)) == ref.register(ids, keys, par, tok)
    for a, b in zip(jax.tree_util.tree_leaves(s), jax.tree_util.tree_leaves(whole)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _check(ref, s, collections.Counter(held))
    # release a few blocks and take them back: reused cached blocks leave tombstones in the table
    back = d.draw(st.lists(st.sampled_from(held), max_size=3, unique=True))
    s, ok = pool.free(s, _pad(back))
    assert ok and ref.free(back)
    s, got, _, ok = pool.allocate(s, len(back), max_n=M)
    assert ok and [int(x) for x in got if x >= 0] == ref.allocate(len(back), max_n=M)[0]
    held = [b for b in held if b not in back] + [int(x) for x in got if x >= 0]
