"""Global directory: record key -> which tiers hold it (tier names; engine-local tiers are suffixed with the engine
id), tenant, size, state, expiry. Kept in the L4 server (a Redis hash per key, `dsv4dir:<key>`) so every engine
and a router see the same view; without an L4 server it is a dict in this process.

The directory is advisory: a record it lists may have been evicted or expired by the server since (then the get
misses and the request degrades), and a record is verified on every load regardless of what the directory says."""

from __future__ import annotations

import time


class LocalDirectory:
  remote = False

  def __init__(self):
    self._d: dict[str, dict] = {}

  def publish(self, key, tier, tenant, nbytes, ttl_s=None):
    e = self._d.setdefault(key, {"tiers": set(), "tenant": tenant, "bytes": nbytes, "state": "ready"})
    e["tiers"].add(tier)
    e["expires"] = None if ttl_s is None else time.time() + ttl_s

  def unpublish(self, key, tier):
    e = self._d.get(key)
    if e:
      e["tiers"].discard(tier)
      if not e["tiers"]:
        del self._d[key]

  def lookup_many(self, keys):
    now = time.time()
    out = []
    for k in keys:
      e = self._d.get(k)
      out.append(None if e is None or (e.get("expires") and e["expires"] < now) else e)
    return out


class RedisDirectory:
  remote = True

  def __init__(self, client):
    self.client = client

  @staticmethod
  def _k(key):
    return "dsv4dir:" + key

  def publish(self, key, tier, tenant, nbytes, ttl_s=None):
    p = self.client.pipeline(transaction=False)
    p.hset(self._k(key), mapping={f"t:{tier}": 1, "tenant": tenant, "bytes": nbytes, "state": "ready"})
    if ttl_s:
      p.pexpire(self._k(key), int(ttl_s * 1000))
    p.execute()

  def unpublish(self, key, tier):
    self.client.hdel(self._k(key), f"t:{tier}")

  def lookup_many(self, keys):
    if not keys:
      return []
    p = self.client.pipeline(transaction=False)
    for k in keys:
      p.hgetall(self._k(k))
    out = []
    for h in p.execute():
      if not h:
        out.append(None)
        continue
      h = {(a.decode() if isinstance(a, bytes) else a): (b.decode() if isinstance(b, bytes) else b)
           for a, b in h.items()}
      out.append({"tiers": {f[2:] for f in h if f.startswith("t:")}, "tenant": h.get("tenant", ""),
                  "bytes": int(h.get("bytes", 0)), "state": h.get("state", "")})
    return out
