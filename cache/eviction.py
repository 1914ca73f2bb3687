"""Alternative eviction policies for the KV cache pools, for the eviction ablation (experiments/ablate_eviction.py).

`PolicyCacheManager` is a `KVCacheManager` whose free-queue discipline is chosen by name. The pool keeps one free
queue per group (head = evicted first); a policy decides where released blocks enter it and how they are ordered.

    lru              the default manager (docs/kv_cache.md): cached blocks appended at the tail in the order the request
                     releases them (tail-first, so a chain's last blocks go before its head; a hit refreshes a
                     block because it is re-released later); SWA checkpoints only; uncached (transient) blocks
                     prepended at the head so they are reused before any cached block.
    legacy_dense     vLLM <= 0.22: every swa block hashed, every freed block appended (`legacy_dense_swa=True`).
    append_uncached  lru with sparse SWA checkpoints but transient blocks appended at the tail like cached ones
                     (isolates the "uncached prepended" part of the fix).
    head_first       lru but a request's blocks are released head-first: its first blocks become the oldest, so
                     a chain is evicted from its head (which makes the rest of the chain unreachable).
    fifo             cached blocks evicted in order of first registration, never refreshed by a hit or a later
                     release (uncached blocks still prepended).

Implementation: everything goes through the jitted pool's ordinary operations (`free`, `touch`), so the pool's
invariants and its tests are unchanged. FIFO keeps a registration stamp per cached block from the manager's own
KV event stream (BlockStored / BlockRemoved / AllBlocksCleared, as an external index would) and, after each
release, re-sorts the cached part of the free queue by stamp by claiming those blocks (`touch`) and releasing them
again in stamp order (`free` appends cached blocks in list order). The uncached part of the queue is untouched.
"""

from __future__ import annotations

import functools

import numpy as np

from cache import pool
from cache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventLog
from cache.manager import KVCacheManager
from cache.specs import CacheSpecs

POLICIES = ("lru", "legacy_dense", "append_uncached", "head_first", "fifo")


class _StampingLog(EventLog):
  """The manager's event log, also keeping a first-registration stamp per (group, block) for FIFO."""

  def __init__(self, enabled: bool):
    super().__init__(enabled)
    self.stamp: dict[tuple[str, int], int] = {}
    self._seq = 0

  def emit(self, ev) -> None:
    if isinstance(ev, BlockStored):
      self.stamp[(ev.group, ev.block_id)] = self._seq
      self._seq += 1
    elif isinstance(ev, BlockRemoved):
      self.stamp.pop((ev.group, ev.block_id), None)
    elif isinstance(ev, AllBlocksCleared):
      self.stamp.clear()
    super().emit(ev)


class PolicyCacheManager(KVCacheManager):
  """KVCacheManager with a named eviction policy (see module docstring). Same public API."""

  def __init__(self, specs: CacheSpecs, *, policy: str = "lru", **kw):
    if policy not in POLICIES:
      raise ValueError(f"eviction policy {policy!r}: known {POLICIES}")
    if "legacy_dense_swa" in kw:
      raise ValueError("PolicyCacheManager: choose policy='legacy_dense' instead of legacy_dense_swa")
    enable_events = kw.pop("enable_events", True)
    super().__init__(specs, legacy_dense_swa=policy == "legacy_dense", enable_events=enable_events, **kw)
    self.policy_name = policy
    self.queue.prepend_uncached = policy not in ("legacy_dense", "append_uncached")
    self.queue.events = _StampingLog(enable_events)
    self.stats["fifo_reorders"] = 0

  def _queue_frees(self, slot: int, g: str, runs) -> None:
    # The base queues each run tail first. head_first releases oldest-first: one-entry runs in table order (the
    # per-block host cost is this experiment policy's, never the engine's). fifo re-sorts the queue after.
    if not runs:
      return
    if self.policy_name == "head_first":
      runs = [(i, i + 1) for a, b in reversed(runs) for i in range(b - 1, a - 1, -1)]
    super()._queue_frees(slot, g, runs)
    if self.policy_name == "fifo":
      self._fifo_reorder(g)

  def _fifo_reorder(self, name: str) -> None:
    st = self.pools[name]     # the release above is queued: applied first, then re-sorted (counts unchanged)
    cached = np.asarray(st.cached_N)
    queue = pool.free_queue(st)
    tail = [b for b in queue if cached[b]]
    stamp = self.events.stamp
    want = sorted(tail, key=lambda b: stamp[(name, b)])
    if want == tail:
      return
    self.stats["fifo_reorders"] += 1
    for chunk in _chunks(tail):
      assert bool(self.update_pool(name, pool.touch, chunk))
    for chunk in _chunks(want):
      assert bool(self.update_pool(name, functools.partial(pool.free, prepend_uncached=True), chunk))


def _chunks(ids, width=256):
  for lo in range(0, len(ids), width):
    part = ids[lo:lo + width]
    m = 16 if len(part) <= 16 else width
    yield np.asarray(list(part) + [-1] * (m - len(part)), np.int32)


def make_manager(specs: CacheSpecs, policy: str = "lru", **kw) -> KVCacheManager:
  """The plain manager for 'lru' (exactly the engine's), a PolicyCacheManager otherwise."""
  if policy == "lru":
    return KVCacheManager(specs, **kw)
  return PolicyCacheManager(specs, policy=policy, **kw)
