"""TieredStore: the ordered tiers below the device (L2 host, L3 disk, L4 shared store) behind one interface.

* `put` (demotion): the host tier is written at once (a memory copy); slower tiers through the bounded write-behind
  queue. Every successful write is published in the directory.
* `locate`: for each key, the tiers that hold it (local tiers from their own index, shared tiers from the
  directory kept in the L4 server, or by asking the store when there is no remote directory).
* `fetch`: batched gets per tier, fastest tier first, under a deadline: a tier call still running at the deadline
  is abandoned (its result discarded) and the caller recomputes what did not arrive.
* `promote`: a record read from a lower tier is copied into the tiers above it.
Failures never raise: a down tier is a miss (degrade order: remote -> local -> recompute)."""

from __future__ import annotations

import concurrent.futures as cf
import time

from cache.tiers.directory import LocalDirectory, RedisDirectory
from cache.tiers.tier import Tier
from cache.tiers.writeback import WriteBehind


class TieredStore:

  def __init__(self, tiers: list[Tier], *, engine_id: str = "e0", write_behind: WriteBehind | None = None,
               directory=None):
    self.tiers = list(tiers)
    self.engine_id = engine_id
    self.wb = write_behind
    if directory is None:
      redis_tiers = [t for t in self.tiers if t.backend.name == "redis"]
      directory = RedisDirectory(redis_tiers[0].backend.client) if redis_tiers else LocalDirectory()
    self.directory = directory
    self._pool = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-tier-get")
    self.stats = {"timeouts": 0, "directory_errors": 0}

  def dir_name(self, tier: Tier) -> str:
    return tier.name if tier.shared else f"{tier.name}@{self.engine_id}"

  def _publish(self, tier, key, tenant, nbytes):
    try:
      self.directory.publish(key, self.dir_name(tier), tenant, nbytes, tier.policy.ttl_s)
    except Exception:  # noqa: BLE001 - the directory is advisory; a dead server must not fail a write path
      self.stats["directory_errors"] += 1

  def _write(self, tier: Tier, key: str, data: bytes, tenant: str):
    if tier.put(key, data, tenant):
      self._publish(tier, key, tenant, len(data))

  def put(self, key: str, data: bytes, tenant: str = "", below: int = -1, upto: int | None = None) -> None:
    """Write a record into tiers (below, upto) (default: all). Host synchronously, the others write-behind."""
    hi = len(self.tiers) if upto is None else upto
    for i, tier in enumerate(self.tiers):
      if i <= below or i >= hi:
        continue
      if tier.backend.name == "host" or self.wb is None:
        self._write(tier, key, data, tenant)
      elif not self.wb.submit(lambda t=tier: self._write(t, key, data, tenant), tier.name, len(data)):
        tier.metrics["dropped_backpressure"] += 1

  def promote(self, key: str, data: bytes, tenant: str, source: int) -> None:
    self.put(key, data, tenant, upto=source)

  def locate(self, keys: list[str]) -> list[list[int]]:
    """Per key, the indices of the tiers that (probably) hold it, fastest first."""
    out = [[] for _ in keys]
    if not keys:
      return out
    entries = None
    for i, tier in enumerate(self.tiers):
      if tier.shared and getattr(self.directory, "remote", False):
        if not tier.available():
          continue
        if entries is None:
          try:
            entries = self.directory.lookup_many(keys)
          except Exception as e:  # noqa: BLE001
            tier._fail("directory", e)
            entries = [None] * len(keys)
        have = [e is not None and tier.name in e["tiers"] for e in entries]
      else:
        have = tier.contains_many(keys)
      for j, h in enumerate(have):
        if h:
          out[j].append(i)
    return out

  def fetch(self, wanted: dict[int, list[str]], deadline: float) -> dict[str, tuple[bytes, int]]:
    """wanted: tier index -> keys. Returns key -> (bytes, tier index) for what arrived before the deadline."""
    got: dict[str, tuple[bytes, int]] = {}
    for i in sorted(wanted):
      keys = [k for k in wanted[i] if k not in got]
      if not keys:
        continue
      left = deadline - time.monotonic()
      if left <= 0:
        self.stats["timeouts"] += 1
        self.tiers[i].metrics["timeouts"] += 1
        continue
      fut = self._pool.submit(self.tiers[i].get_many, keys)
      try:
        vals = fut.result(timeout=left)
      except cf.TimeoutError:
        self.stats["timeouts"] += 1
        self.tiers[i].metrics["timeouts"] += 1
        self.tiers[i].metrics["fallbacks"] += 1
        continue
      for k, v in zip(keys, vals):
        if v is not None:
          got[k] = (v, i)
    return got

  def backlog_bytes(self) -> dict[str, int]:
    return dict(self.wb.pending_bytes) if self.wb else {}

  def drain(self) -> None:
    if self.wb:
      self.wb.drain()

  def summary(self) -> list[dict]:
    return [t.summary() for t in self.tiers]

  def close(self) -> None:
    if self.wb:
      self.wb.drain()
      self.wb.close()
    self._pool.shutdown(wait=False, cancel_futures=True)
    for t in self.tiers:
      t.close()
