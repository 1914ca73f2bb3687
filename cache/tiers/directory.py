"""Global directory: record key -> which tiers hold it (tier names; engine-local tiers are suffixed with the engine
id), tenant, size, state, expiry, and optionally the fingerprint of what was stored. Kept in the L4 server (a Redis
hash per key, `dsv4dir:<key>`) so every engine and a router see the same view; without an L4 server it is a dict
in this process. A set per location (`dsv4dirloc:<location>`) lists the keys published there, so everything one
location held can be dropped at once (a replica that restarted empty).

The directory is advisory: a record it lists may have been evicted or expired by the server since (then the get
misses and the request degrades), and a record is verified on every load regardless of what the directory says."""

from __future__ import annotations

import time


class LocalDirectory:
  remote = False

  def __init__(self):
    self._d: dict[str, dict] = {}

  def publish(self, key, tier, tenant, nbytes, ttl_s=None, fingerprint=""):
    e = self._d.setdefault(key, {"tiers": set(), "tenant": tenant, "bytes": nbytes, "state": "ready",
                                 "fingerprint": fingerprint})
    e["tiers"].add(tier)
    e["expires"] = None if ttl_s is None else time.time() + ttl_s

  def unpublish(self, key, tier):
    e = self._d.get(key)
    if e:
      e["tiers"].discard(tier)
      if not e["tiers"]:
        del self._d[key]

  def drop_location(self, tier) -> int:
    """Forget every entry's `tier` location (its holder restarted empty). Returns the keys it was listed for."""
    n = 0
    for key in [k for k, e in self._d.items() if tier in e["tiers"]]:
      self.unpublish(key, tier)
      n += 1
    return n

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

  @staticmethod
  def _loc(tier):
    return "dsv4dirloc:" + tier

  def publish(self, key, tier, tenant, nbytes, ttl_s=None, fingerprint=""):
    p = self.client.pipeline(transaction=False)
    fields = {f"t:{tier}": 1, "tenant": tenant, "bytes": nbytes, "state": "ready"}
    if fingerprint:
      fields["fp"] = fingerprint
    p.hset(self._k(key), mapping=fields)
    p.sadd(self._loc(tier), key)
    if ttl_s:
      p.pexpire(self._k(key), int(ttl_s * 1000))
    p.execute()

  def unpublish(self, key, tier):
    p = self.client.pipeline(transaction=False)
    p.hdel(self._k(key), f"t:{tier}")
    p.srem(self._loc(tier), key)
    p.execute()

  def drop_location(self, tier) -> int:
    keys = [k.decode() if isinstance(k, bytes) else k for k in self.client.smembers(self._loc(tier))]
    p = self.client.pipeline(transaction=False)
    for k in keys:
      p.hdel(self._k(k), f"t:{tier}")
    p.delete(self._loc(tier))
    p.execute()
    return len(keys)

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
      tiers = {f[2:] for f in h if f.startswith("t:")}
      if not tiers:                 # every location dropped: the hash holds only its labels
        out.append(None)
        continue
      out.append({"tiers": tiers, "tenant": h.get("tenant", ""), "bytes": int(h.get("bytes", 0)),
                  "state": h.get("state", ""), "fingerprint": h.get("fp", "")})
    return out
