"""Plain-Python references with the semantics of cache/pool.py and cache/prefix.py. Used by tests and benchmarks
only. Same table geometry and probing as the jitted pool, so whole states (not just answers) can be compared.
"""

from __future__ import annotations

import numpy as np

from cache import pool
from cache.hashing import DIGEST_WORDS


class RefPool:
  def __init__(self, num_blocks: int, block_tokens: int, max_probe: int = pool.DEFAULT_MAX_PROBE):
    self.n, self.t, self.max_probe = num_blocks, block_tokens, max_probe
    self.reset_all()

  def reset_all(self):
    n = self.n
    self.ref = [0] * n
    self.queue = list(range(n))          # head (evicted first) ... tail
    self.cached = [False] * n
    self.key = [(0, 0)] * n
    self.parent = [(0,) * DIGEST_WORDS] * n
    self.tokens = [(0,) * self.t] * n
    self.slot = [-1] * n
    self.table = [pool.EMPTY] * pool.table_slots(n)

  @classmethod
  def from_state(cls, st: pool.PoolState) -> "RefPool":
    """A reference pool holding exactly the state of a jitted pool (to run reference searches on it)."""
    r = cls(st.num_blocks, st.block_tokens, st.max_probe)
    r.ref = [int(x) for x in np.asarray(st.ref_N)]
    r.queue = pool.free_queue(st)
    r.cached = [bool(x) for x in np.asarray(st.cached_N)]
    r.key = [tuple(int(y) for y in x) for x in np.asarray(st.key_Nx2)]
    r.parent = [tuple(int(y) for y in x) for x in np.asarray(st.parent_Nx4)]
    r.tokens = [tuple(int(y) for y in x) for x in np.asarray(st.tokens_NxT)]
    r.slot = [int(x) for x in np.asarray(st.slot_N)]
    r.table = [int(x) for x in np.asarray(st.table_S)]
    return r

  @property
  def num_free(self) -> int:
    return len(self.queue)

  # identity helpers ---------------------------------------------------------------------------------------
  @staticmethod
  def _ident(key2, parent4, tokens):
    return (tuple(int(x) for x in key2), tuple(int(x) for x in parent4), tuple(int(x) for x in tokens))

  def _matches(self, b, ident):
    return (self.key[b], self.parent[b], self.tokens[b]) == ident

  def _probe(self, key2):
    m = len(self.table) - 1
    home = int(key2[1]) & m
    return [(home + i) & m for i in range(self.max_probe)]

  def _find(self, ident):
    for s in self._probe(ident[0]):
      e = self.table[s]
      if e == pool.EMPTY:
        return -1
      if e >= 0 and self._matches(e, ident):
        return e
    return -1

  def _drop_identity(self, b):
    self.table[self.slot[b]] = pool.TOMB
    self.cached[b], self.slot[b], self.key[b] = False, -1, (0, 0)

  # operations ---------------------------------------------------------------------------------------------
  def allocate(self, n, max_n=None):
    if n < 0 or n > len(self.queue) or (max_n is not None and n > max_n):
      return [], [], False
    ids, ev = [], []
    for _ in range(n):
      b = self.queue.pop(0)
      ev.append(self.cached[b])
      if self.cached[b]:
        self._drop_identity(b)
      self.ref[b] = 1
      ids.append(b)
    return ids, ev, True

  def touch(self, ids):
    if any(not (-1 <= b < self.n) for b in ids):
      return False
    for b in ids:
      if b < 0:
        continue
      if self.ref[b] == 0:
        self.queue.remove(b)
      self.ref[b] += 1
    return True

  def free(self, ids, prepend_uncached=True):
    if any(not (-1 <= b < self.n) for b in ids):
      return False
    counts = {}
    for b in ids:
      if b >= 0:
        counts[b] = counts.get(b, 0) + 1
    if any(c > self.ref[b] for b, c in counts.items()):
      return False
    head = []
    for b in ids:
      if b < 0:
        continue
      self.ref[b] -= 1
      if self.ref[b] == 0:
        if self.cached[b] or not prepend_uncached:
          self.queue.append(b)
        else:
          head.append(b)
    self.queue[:0] = head
    return True

  def register(self, ids, keys, parents, tokens):
    status = []
    for b, k, p, t in zip(ids, keys, parents, tokens):
      b = int(b)
      if b == -1:
        status.append(pool.SKIPPED)
        continue
      if not (0 <= b < self.n) or self.ref[b] == 0:
        status.append(pool.INVALID)
        continue
      ident = self._ident(k, p, t)
      if self.cached[b]:
        status.append(pool.ALREADY if self._matches(b, ident) else pool.INVALID)
        continue
      dup, free = -1, -1
      for s in self._probe(ident[0]):
        e = self.table[s]
        if free < 0 and e < 0:
          free = s
        if e >= 0 and self._matches(e, ident):
          dup = e
          break
        if e == pool.EMPTY:
          break
      if dup >= 0:
        status.append(pool.DUPLICATE)
      elif free < 0:
        status.append(pool.TABLE_FULL)
      else:
        self.table[free] = b
        self.cached[b], self.slot[b] = True, free
        self.key[b], self.parent[b], self.tokens[b] = ident
        status.append(pool.STORED)
    return status

  def lookup(self, keys, parents, tokens):
    return [self._find(self._ident(k, p, t)) for k, p, t in zip(keys, parents, tokens)]

  def evict(self, ids):
    out = []
    for b in ids:
      act = 0 <= b < self.n and self.ref[b] == 0 and self.cached[b]
      if act:
        self._drop_identity(b)
      out.append(act)
    return out

  def reset(self):
    if any(self.ref):
      return False
    self.reset_all()
    return True

  # comparison ---------------------------------------------------------------------------------------------
  def check_invariants(self):
    q = set(self.queue)
    assert len(q) == len(self.queue), "block twice in the free queue"
    for b in range(self.n):
      assert (b in q) == (self.ref[b] == 0), f"block {b}: free={b in q} ref={self.ref[b]}"
      if self.cached[b]:
        assert self.table[self.slot[b]] == b
    assert sum(e >= 0 for e in self.table) == sum(self.cached)

  def assert_matches(self, st: pool.PoolState):
    """Compare every observable field of a jitted PoolState with this reference."""
    np.testing.assert_array_equal(np.asarray(st.ref_N), self.ref, err_msg="ref counts")
    assert pool.free_queue(st) == self.queue, (pool.free_queue(st), self.queue)
    assert int(st.num_free) == len(self.queue)
    np.testing.assert_array_equal(np.asarray(st.cached_N), self.cached, err_msg="cached")
    np.testing.assert_array_equal(np.asarray(st.slot_N), self.slot, err_msg="slots")
    np.testing.assert_array_equal(np.asarray(st.table_S), self.table, err_msg="table")
    # scratch arrays are back at their sentinel after every operation (they carry nothing between calls)
    assert (np.asarray(st.claim_S) == pool.BIG).all(), "claim_S scratch not reset"
    assert (np.asarray(st.mark_N) == pool.BIG).all(), "mark_N scratch not reset"
    c = np.asarray(self.cached)
    if c.any():
      np.testing.assert_array_equal(np.asarray(st.key_Nx2)[c], np.asarray(self.key)[c], err_msg="keys")
      np.testing.assert_array_equal(np.asarray(st.parent_Nx4)[c], np.asarray(self.parent)[c])
      np.testing.assert_array_equal(np.asarray(st.tokens_NxT)[c], np.asarray(self.tokens)[c])


def ref_hybrid_hit(groups, pools, key_Ux2, parent_Ux4, tokens_UxG, max_len, align_tokens, hash_tokens):
  """Reference of prefix.find_hits for one request.

  groups: sequence of (kind, units_per_block, need_blocks); pools: matching RefPools. Returns
  (hit_tokens, [per-group list of block ids, -1 where not needed]).
  """
  num_units = len(key_Ux2)
  limit = min(max_len, num_units * hash_tokens) // align_tokens * align_tokens

  def block_ident(k, upb, j):
    u0, u1 = j * upb, (j + 1) * upb
    return key_Ux2[u1 - 1], parent_Ux4[u0], np.asarray(tokens_UxG[u0:u1]).reshape(-1)

  def find(ref_pool, k, upb, j):
    return ref_pool.lookup(*[[x] for x in block_ident(k, upb, j)])[0]

  hit = limit
  for (kind, upb, need), ref_pool in zip(groups, pools):
    if kind == "full_history":
      bt = upb * hash_tokens
      j = 0
      while (j + 1) * bt <= limit and find(ref_pool, kind, upb, j) >= 0:
        j += 1
      hit = min(hit, j * bt // align_tokens * align_tokens)

  def swa_ok(L):
    for (kind, upb, need), ref_pool in zip(groups, pools):
      if kind != "full_history":
        e = L // (upb * hash_tokens)
        if any(find(ref_pool, kind, upb, j) < 0 for j in range(max(0, e - need), e)):
          return False
    return True

  while hit > 0 and not swa_ok(hit):
    hit -= align_tokens
  out = []
  for (kind, upb, need), ref_pool in zip(groups, pools):
    nb = num_units // upb
    ids = [-1] * nb
    e = hit // (upb * hash_tokens)
    lo = 0 if kind == "full_history" else max(0, e - need)
    for j in range(lo, e):
      ids[j] = find(ref_pool, kind, upb, j)
    out.append(ids)
  return hit, out
