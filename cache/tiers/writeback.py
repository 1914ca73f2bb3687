"""Bounded write-behind queue: demotions to slow tiers (disk, remote) happen on a worker thread so the engine step
never waits for them, and the queue's bound is the backpressure: when it is full, `submit` waits up to
`put_timeout_s` and then drops the record (counted). Dropping is safe: a tier is a cache, a missing record is a
miss and the block is recomputed."""

from __future__ import annotations

import collections
import queue
import threading


class WriteBehind:

  def __init__(self, max_items: int = 256, put_timeout_s: float = 0.05):
    self._q: queue.Queue = queue.Queue(max_items)
    self.put_timeout_s = put_timeout_s
    self.stats = collections.Counter()
    self.pending_bytes = collections.Counter()   # per tier name: bytes queued, not written yet (cost model)
    self._lock = threading.Lock()
    self._thread = threading.Thread(target=self._run, name="kv-write-behind", daemon=True)
    self._thread.start()

  def submit(self, fn, tier_name: str, nbytes: int) -> bool:
    """Queue fn() (a write to `tier_name`). False = dropped by backpressure."""
    with self._lock:
      self.pending_bytes[tier_name] += nbytes
    try:
      self._q.put((fn, tier_name, nbytes), timeout=self.put_timeout_s)
    except queue.Full:
      with self._lock:
        self.pending_bytes[tier_name] -= nbytes
      self.stats["dropped"] += 1
      return False
    self.stats["submitted"] += 1
    self.stats["max_depth"] = max(self.stats["max_depth"], self._q.qsize())
    return True

  def _run(self):
    while True:
      item = self._q.get()
      if item is None:
        self._q.task_done()
        return
      fn, tier_name, nbytes = item
      try:
        fn()
        self.stats["written"] += 1
      except Exception:  # noqa: BLE001 - tiers count their own failures; the worker must survive
        self.stats["errors"] += 1
      finally:
        with self._lock:
          self.pending_bytes[tier_name] -= nbytes
        self._q.task_done()

  def drain(self) -> None:
    """Wait until every queued write has been attempted."""
    self._q.join()

  def close(self) -> None:
    self._q.put(None)
    self._thread.join(timeout=10)
