"""A tier = a backend + its policy (capacity, LRU, TTL, per-tenant quota) + its metrics and events + failure
handling. A tier failure is never an exception to the caller: a failed get is a miss, a failed put is a dropped
record, and the tier is skipped for `retry_after_s` (so a dead store costs one timeout, not one per block).

For a local tier (host, disk) the index here is the truth, except that a disk directory may be shared by several
engines: a key the index lacks is looked up on disk (one stat) and adopted when another engine wrote it, and an
indexed record that has vanished (another engine evicted it) is dropped from the index on the miss. For a shared
tier (Redis, Mooncake) other engines write too: the index only accounts this engine's writes (capacity and quota
of what *we* put there); existence is asked of the store (through the directory), and the server enforces TTL.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import numpy as np


@dataclasses.dataclass(frozen=True)
class TierPolicy:
  capacity_bytes: int = 1 << 30
  ttl_s: float | None = None             # None = no expiry
  tenant_quota_bytes: int | None = None  # most bytes one tenant may hold in this tier (None = capacity)
  retry_after_s: float = 2.0             # after a failure the tier is skipped this long


@dataclasses.dataclass(frozen=True)
class TierEvent:
  tier: str
  what: str          # stored | removed | expired | hit | rejected | failed | dropped
  key: str
  tenant: str = ""
  nbytes: int = 0


@dataclasses.dataclass
class _Entry:
  size: int
  tenant: str
  expires: float | None


class Tier:

  def __init__(self, backend, policy: TierPolicy = TierPolicy(), *, name: str | None = None,
               clock=time.monotonic, keep_events: int = 10000):
    self.backend, self.policy, self.clock = backend, policy, clock
    self.name = name or backend.name
    self.shared = bool(getattr(backend, "shared", False))
    self._index: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
    self._tenant_bytes: collections.Counter = collections.Counter()
    self.used_bytes = 0
    self._lock = threading.RLock()
    self.down_until = 0.0
    self.last_error = ""
    self.ok = True                      # False from a failure until the next operation that succeeds
    # local backends that other processes may also write (a disk directory): probe the keys the index lacks
    self._probe = None if self.shared else getattr(backend, "sizes_many", None)
    self.metrics = collections.Counter()
    self.load_latencies_s: list[float] = []
    self.events: collections.deque[TierEvent] = collections.deque(maxlen=keep_events)
    if hasattr(backend, "keys_with_sizes") and not self.shared:
      for k, s in backend.keys_with_sizes():     # records left by an earlier run (disk): tenant unknown until read
        self._index[k] = _Entry(s, "", None)
        self.used_bytes += s

  # ------------------------------------------------------------------------------------------ health
  def available(self) -> bool:
    return self.clock() >= self.down_until

  def _fail(self, op: str, e: BaseException) -> None:
    self.metrics["failures"] += 1
    self.last_error = f"{op}: {type(e).__name__}: {e}"
    self.ok = False
    self.down_until = self.clock() + self.policy.retry_after_s
    self.events.append(TierEvent(self.name, "failed", op))

  def check(self) -> bool:
    """One round trip to the store now (backends with `ping`; the backend's own timeout applies). A store that does
    not answer is marked down and counted like any failure, so a bad URL shows at start-up, not at first use."""
    ping = getattr(self.backend, "ping", None)
    if ping is None:
      return True
    try:
      ping()
    except Exception as e:  # noqa: BLE001 - any client error means the same: not reachable
      self._fail("connect", e)
      return False
    self.ok = True
    return True

  def _emit(self, what, key, tenant="", nbytes=0):
    self.events.append(TierEvent(self.name, what, key, tenant, nbytes))

  def take_events(self) -> list[TierEvent]:
    out = list(self.events)
    self.events.clear()
    return out

  # ------------------------------------------------------------------------------------------ index
  def _drop_entry(self, key: str, what: str) -> None:
    e = self._index.pop(key, None)
    if e is not None:
      self.used_bytes -= e.size
      self._tenant_bytes[e.tenant] -= e.size
      self._emit(what, key, e.tenant, e.size)

  def _adopt(self, key: str, size: int) -> None:
    """A record another engine wrote into our (shared) directory: indexed as at start-up (tenant unknown until read,
    no TTL of ours)."""
    self._index[key] = _Entry(size, "", None)
    self._tenant_bytes[""] += size
    self.used_bytes += size
    self.metrics["adopted"] += 1

  def _expired(self, key: str) -> bool:
    e = self._index.get(key)
    return e is not None and e.expires is not None and self.clock() >= e.expires

  def _make_room(self, size: int, tenant: str) -> bool:
    cap, quota = self.policy.capacity_bytes, self.policy.tenant_quota_bytes
    if size > cap or (quota is not None and size > quota):
      return False
    victims = []
    if quota is not None:  # the tenant's own least recently used records go first
      over = self._tenant_bytes[tenant] + size - quota
      for k, e in self._index.items():
        if over <= 0:
          break
        if e.tenant == tenant:
          victims.append(k)
          over -= e.size
    freed = sum(self._index[k].size for k in victims)
    over = self.used_bytes - freed + size - cap
    for k, e in self._index.items():
      if over <= 0:
        break
      if k not in victims:
        victims.append(k)
        over -= e.size
    for k in victims:
      self._remove_backend(k)
      self._drop_entry(k, "removed")
      self.metrics["evicted"] += 1
    return True

  def _remove_backend(self, key):
    try:
      self.backend.delete(key)
    except Exception as e:  # noqa: BLE001 - any backend error is a tier failure, never the caller's
      self._fail("delete", e)

  # ------------------------------------------------------------------------------------------ ops
  def put(self, key: str, data: bytes, tenant: str = "") -> bool:
    if not self.available():
      self.metrics["dropped_down"] += 1
      self._emit("dropped", key, tenant, len(data))
      return False
    with self._lock:
      if key in self._index:
        self._drop_entry(key, "removed")
      if not self._make_room(len(data), tenant):
        self.metrics["refused_too_big"] += 1
        self._emit("dropped", key, tenant, len(data))
        return False
    t0 = time.perf_counter()
    try:
      self.backend.put(key, data, self.policy.ttl_s)
    except Exception as e:  # noqa: BLE001
      self._fail("put", e)
      self._emit("dropped", key, tenant, len(data))
      return False
    self.ok = True
    self.metrics["write_s_total_us"] += int((time.perf_counter() - t0) * 1e6)
    with self._lock:
      ttl = self.policy.ttl_s
      self._index[key] = _Entry(len(data), tenant, None if ttl is None else self.clock() + ttl)
      self.used_bytes += len(data)
      self._tenant_bytes[tenant] += len(data)
    self.metrics["stored"] += 1
    self.metrics["bytes_written"] += len(data)
    self._emit("stored", key, tenant, len(data))
    return True

  def contains_many(self, keys: list[str]) -> list[bool]:
    """Local tiers: from the index (TTL applied). Shared tiers: ask the store."""
    if not self.available():
      return [False] * len(keys)
    if not self.shared:
      with self._lock:
        out, expired = [], set()
        for k in keys:
          if self._expired(k):
            self._remove_backend(k)
            self._drop_entry(k, "expired")
            self.metrics["expired"] += 1
            expired.add(k)
          out.append(k in self._index)
      miss = [i for i, h in enumerate(out) if not h and keys[i] not in expired]
      if miss and self._probe is not None:
        try:
          sizes = self._probe([keys[i] for i in miss])
        except Exception as e:  # noqa: BLE001
          self._fail("stat", e)
          return out
        with self._lock:
          for i, size in zip(miss, sizes):
            if size is not None:
              if keys[i] not in self._index:
                self._adopt(keys[i], size)
              out[i] = True
      return out
    try:
      out = list(self.backend.exists_many(keys))
    except Exception as e:  # noqa: BLE001
      self._fail("exists", e)
      return [False] * len(keys)
    self.ok = True
    return out

  def get_many(self, keys: list[str]) -> list[bytes | None]:
    """Bytes per key, None for a miss or a failure (counted)."""
    if not keys:
      return []
    if not self.available():
      self.metrics["skipped_down"] += len(keys)
      return [None] * len(keys)
    t0 = time.perf_counter()
    try:
      vals = list(self.backend.get_many(keys))
    except Exception as e:  # noqa: BLE001
      self._fail("get", e)
      return [None] * len(keys)
    dt = time.perf_counter() - t0
    self.ok = True
    self.load_latencies_s.append(dt)
    got = [v for v in vals if v is not None]
    self.metrics["bytes_read"] += sum(len(v) for v in got)
    dead = set()          # arrived, but not to be served: expired, or (host) removed while the get ran
    with self._lock:
      for k, v in zip(keys, vals):
        if v is None:
          if self._probe is not None and k in self._index:   # another engine removed it from the shared directory
            self._drop_entry(k, "removed")
          continue
        if k in self._index:
          if self._expired(k):
            self._remove_backend(k)
            self._drop_entry(k, "expired")
            self.metrics["expired"] += 1
            dead.add(k)
            continue
          self._index.move_to_end(k)
        elif self._probe is not None:
          self._adopt(k, len(v))
        elif not self.shared:
          dead.add(k)
    return [None if (v is None or k in dead) else v for k, v in zip(keys, vals)]

  def reject(self, key: str, why: str) -> None:
    """A record read from this tier failed verification: delete it so nobody reads it again."""
    self.metrics["rejected"] += 1
    self._emit("rejected", key)
    self.last_error = f"rejected {key}: {why}"
    self._remove_backend(key)
    with self._lock:
      self._drop_entry(key, "removed")

  def note_hit(self, key: str, tokens: int, nbytes: int) -> None:
    self.metrics["hit_records"] += 1
    self.metrics["hit_tokens"] += tokens
    self._emit("hit", key, "", nbytes)

  def summary(self) -> dict:
    lat = np.array(self.load_latencies_s) * 1e3
    pct = (lambda q: float(np.percentile(lat, q)) if lat.size else float("nan"))
    return {"tier": self.name, **{k: int(v) for k, v in self.metrics.items()}, "used_bytes": self.used_bytes,
            "records": len(self._index), "load_ms_p50": pct(50), "load_ms_p99": pct(99),
            "failures": int(self.metrics["failures"]), "last_error": self.last_error, "ok": self.ok,
            "down": not self.available()}

  def close(self):
    try:
      self.backend.close()
    except Exception:  # noqa: BLE001
      pass
