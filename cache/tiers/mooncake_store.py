"""Mooncake Store as an L4 tier (the store SGLang HiCache and vLLM use), behind the same backend interface as Redis.

URL: ``mooncake://<master host>:<rpc port>?metadata=<http metadata server url>``. The engine's client mounts no
memory of its own (global_segment_size 0): records live in the segments of `mooncake_client` processes (one per
node, started by `MooncakeServer` in tests), so they outlive any engine. Presence is asked of the master
(`batch_is_exist`): the master's object metadata is the global directory for this backend. Server-side expiry is
Mooncake's lease / eviction (watermark), not a per-record TTL."""

from __future__ import annotations

import os
import urllib.parse

from cache.tiers.backends import TierError


def parse_url(url: str) -> tuple[str, str]:
  u = urllib.parse.urlparse(url)
  if u.scheme != "mooncake" or not u.hostname or not u.port:
    raise ValueError(f"mooncake store url must look like mooncake://127.0.0.1:50051?metadata=http://..., got {url!r}")
  meta = urllib.parse.parse_qs(u.query).get("metadata", [""])[0]
  if not meta:
    raise ValueError(f"mooncake store url needs ?metadata=<metadata server>: {url!r}")
  return f"{u.hostname}:{u.port}", meta


class MooncakeBackend:
  name = "mooncake"
  shared = True

  def __init__(self, url: str, timeout_s: float = 1.0, local_buffer_bytes: int = 16 << 20):
    master, meta = parse_url(url)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    try:
      from mooncake.store import MooncakeDistributedStore
    except ImportError as e:      # a setup error, not a store that is down: never a silently missing tier
      raise ImportError("the mooncake tier needs the Mooncake client: pip install mooncake-transfer-engine "
                        f"(or mooncake-transfer-engine-non-cuda) ({e})") from e
    self.store = MooncakeDistributedStore()
    rc = self.store.setup("127.0.0.1", meta, 0, local_buffer_bytes, "tcp", "", master)
    if rc != 0:
      raise TierError(f"mooncake tier: setup against {master} failed (rc={rc})")

  def get_many(self, keys):
    out = []
    for k in keys:
      v = self.store.get(k)
      out.append(bytes(v) if v else None)
    return out

  def put(self, key, data, ttl_s=None):
    rc = self.store.put(key, bytes(data))
    if rc != 0:
      raise TierError(f"mooncake put {key} failed (rc={rc})")

  def delete(self, key):
    self.store.remove(key)

  def exists_many(self, keys):
    if not keys:
      return []
    res = self.store.batch_is_exist(list(keys))
    if any(r < 0 for r in res):
      raise TierError(f"mooncake batch_is_exist failed: {res}")
    return [r == 1 for r in res]

  def close(self):
    self.store.close()
