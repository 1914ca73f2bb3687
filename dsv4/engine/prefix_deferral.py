"""In-batch shared-prefix deferral (EngineConfig.defer_shared_prefix): a waiting request that shares an aligned
resume boundary of prefix with a running request that has not computed that part yet waits until the leader commits
past the boundary, then hits it instead of computing the same KV alongside it (a cold wave of siblings sharing a
system prompt). The engine asks `should_wait` at admission; this object keeps the per-request memo it needs."""

from __future__ import annotations

import collections
from typing import Callable

import numpy as np

from cache.manager import KVCacheManager
from dsv4.engine.request import Request


class SharedPrefixDeferral:

  def __init__(self, align_tokens: int, stats: collections.Counter):
    """align_tokens: the resume granularity (`specs.align_tokens`); stats: the engine's counters
    (deferred_steps, deferred_requests)."""
    self.align_tokens = align_tokens
    self.stats = stats
    self.lead_keys: dict[str, object] = {}        # rid -> (extra keys, first aligned chunk), the candidate filter
    self.shared: dict[str, dict[str, int]] = {}   # follower -> leader -> shared prefix tokens, once stable
    self.deferred: set[str] = set()               # requests held back at least once

  def forget(self, rid: str) -> None:
    """A request ended: drop everything known about it, as follower and as leader."""
    self.lead_keys.pop(rid, None)
    self.shared.pop(rid, None)
    self.deferred.discard(rid)
    for known in self.shared.values():
      known.pop(rid, None)

  def admitted(self, rid: str) -> None:
    """A request left the queue: its shared lengths were against leaders of that wait only."""
    self.shared.pop(rid, None)

  def is_empty(self) -> bool:
    return not (self.lead_keys or self.shared or self.deferred)

  def _lead_key(self, req: Request):
    """Cheap candidate filter: requests whose first aligned chunk (and cache salt) differ can share no resume
    boundary; only candidates' token lists are compared."""
    k = self.lead_keys.get(req.rid)
    if k is None:
      a = self.align_tokens
      k = (req.extra_keys, tuple(req.prompt[:a])) if len(req.prompt) > a else ()
      self.lead_keys[req.rid] = k
    return k

  def _shared_len(self, req: Request, lead: Request, cap: int) -> int:
    known = self.shared.setdefault(req.rid, {})
    got = known.get(lead.rid)
    if got is not None:
      return min(got, cap)
    m = min(cap, len(lead.tokens))
    diff = np.flatnonzero(np.asarray(req.tokens[:m]) != np.asarray(lead.tokens[:m]))
    n = int(diff[0]) if len(diff) else m
    if len(diff) or m == cap:          # a mismatch (or the follower's cap) found: later steps give the same answer
      known[lead.rid] = n
    return n

  def should_wait(self, req: Request, running: list[Request],
                  manager_of: Callable[[Request], KVCacheManager]) -> bool:
    """Hold `req` back this step?

    Yes when a running request (the leader: admitted earlier in this step, or still prefilling) shares at least
    one aligned resume boundary of prefix with it and will take a checkpoint at a boundary B it has not computed
    yet, with B <= the shared part (`KVCacheManager.checkpoint_boundaries`). Once the leader has committed past
    every such B, `req` is admitted and hits B. The wait is bounded by the leader's prefill of the shared part; a
    leader that is preempted or finishes leaves `running`, which releases its followers. Estimate, not a lookup:
    a follower could already hit beyond the leader's progress through another request's blocks; then it waits
    for nothing (costs steps, never the answer)."""
    if not running:
      return False
    key = self._lead_key(req)
    if not key:
      return False
    a = self.align_tokens
    cap = (len(req.tokens) - 1) // a * a        # the longest hit any resume can give this request
    for lead in running:
      # its progress as the cache knows it (commits follow the step that computed them; one step later with async
      # scheduling): a follower released earlier would search before the blocks are registered
      done = manager_of(lead).num_committed(lead.rid)
      if done >= cap or self._lead_key(lead) != key:
        continue
      shared = self._shared_len(req, lead, cap) // a * a
      if shared > done and manager_of(lead).checkpoint_boundaries(lead.rid, done, shared):
        self.stats["deferred_steps"] += 1
        if req.rid not in self.deferred:
          self.deferred.add(req.rid)
          self.stats["deferred_requests"] += 1
        return True
    return False
