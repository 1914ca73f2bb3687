"""Byte stores behind one small interface. A backend only moves bytes; capacity, LRU, TTL, quotas, metrics and
failure handling live in `tier.Tier`. Every method may raise `TierError` (or any OSError / client error, which the
tier turns into a miss): a backend never decides what a failure means for a request.

    get_many(keys) -> list[bytes | None]      put(key, data, ttl_s) -> None      delete(key) -> None
    exists_many(keys) -> list[bool]           close() -> None
    ping() -> None                            (optional: a start-up round trip that raises if the store is down)
    sizes_many(keys) -> list[int | None]      (optional, local stores other processes also write: see DiskBackend)

Backends: `HostBackend` (process memory, numpy-free bytes), `DiskBackend` (one file per record, written to a temp
name then renamed, so a reader never sees half a record), `RedisBackend` (a real Redis server; the L4 store shared
by engines in other processes), `MooncakeBackend` (Mooncake Store).
"""

from __future__ import annotations

import os
import threading
import time
import urllib.parse

from cache.tiers.servers import mooncake_client_unavailable


class TierError(RuntimeError):
  """A tier could not serve or take a record (down, timed out, full, unwritable)."""


class HostBackend:
  name = "host"
  shared = False

  def __init__(self):
    self._d: dict[str, bytes] = {}
    self._lock = threading.Lock()

  def get_many(self, keys):
    with self._lock:
      return [self._d.get(k) for k in keys]

  def put(self, key, data, ttl_s=None):
    with self._lock:
      self._d[key] = bytes(data)

  def delete(self, key):
    with self._lock:
      self._d.pop(key, None)

  def exists_many(self, keys):
    with self._lock:
      return [k in self._d for k in keys]

  def keys_with_sizes(self):
    with self._lock:
      return [(k, len(v)) for k, v in self._d.items()]

  def close(self):
    pass


class DiskBackend:
  """One file per record under `root`. Writes go to a unique temp name in the same directory and are renamed into
  place (atomic on POSIX), so a crash or a full disk leaves either the old state or a stray temp file, never a
  torn record under a real name. No fsync: this is a cache, a lost record is a miss."""
  name = "disk"
  shared = False

  def __init__(self, root: str):
    self.root = os.path.abspath(os.path.expanduser(root))
    try:
      os.makedirs(self.root, exist_ok=True)
    except OSError as e:  # unwritable / not a directory: the tier starts down, requests still run
      raise TierError(f"disk tier: cannot create {self.root}: {e}") from e

  def _path(self, key):
    return os.path.join(self.root, key.replace(":", "_") + ".rec")

  def get_many(self, keys):
    out = []
    for k in keys:
      try:
        with open(self._path(k), "rb") as f:
          out.append(f.read())
      except FileNotFoundError:
        out.append(None)
    return out

  def put(self, key, data, ttl_s=None):
    tmp = os.path.join(self.root, f".tmp-{os.getpid()}-{threading.get_ident()}-{key.replace(':', '_')}")
    try:
      with open(tmp, "wb") as f:
        f.write(data)
      os.replace(tmp, self._path(key))
    except BaseException:
      try:
        os.unlink(tmp)
      except OSError:
        pass
      raise

  def delete(self, key):
    try:
      os.unlink(self._path(key))
    except FileNotFoundError:
      pass

  def exists_many(self, keys):
    return [os.path.exists(self._path(k)) for k in keys]

  def sizes_many(self, keys):
    """Size of each key's record file, None if absent: one stat per key, so a tier can pick up records that another
    engine sharing the directory wrote after this one indexed it."""
    out = []
    for k in keys:
      try:
        out.append(os.stat(self._path(k)).st_size)
      except OSError:
        out.append(None)
    return out

  def keys_with_sizes(self):
    """Records already on disk (a restarted engine reuses them), oldest first."""
    out = []
    for n in os.listdir(self.root):
      if n.endswith(".rec") and not n.startswith(".tmp-"):
        p = os.path.join(self.root, n)
        try:
          st = os.stat(p)
        except OSError:
          continue
        out.append((st.st_mtime, n[:-4].replace("_", ":", 1), st.st_size))
    return [(k, s) for _, k, s in sorted(out)]

  def close(self):
    pass


class RedisBackend:
  """A Redis server (`redis://host:port/db`). Values are whole records; TTL is enforced by the server (PX)."""
  name = "redis"
  shared = True

  def __init__(self, url: str, timeout_s: float = 1.0):
    try:
      import redis  # the client; imported here so the other tiers work without it
    except ImportError as e:
      raise ImportError("the redis tier needs the 'redis' package: pip install redis") from e
    parse_redis_url(url)
    self.url = url
    self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                       health_check_interval=0, retry_on_timeout=False)

  def ping(self):
    self.client.ping()

  def get_many(self, keys):
    if not keys:
      return []
    return list(self.client.mget(keys))

  def put(self, key, data, ttl_s=None):
    self.client.set(key, data, px=int(ttl_s * 1000) if ttl_s else None)

  def delete(self, key):
    self.client.delete(key)

  def exists_many(self, keys):
    if not keys:
      return []
    p = self.client.pipeline(transaction=False)
    for k in keys:
      p.exists(k)
    return [bool(x) for x in p.execute()]

  def close(self):
    self.client.close()


def parse_redis_url(url: str) -> tuple[str, int, int]:
  """(host, port, db) of redis://host[:port][/db] (or rediss://), or ValueError saying what is wrong with it."""
  if not isinstance(url, str) or not url:
    raise ValueError("a Redis URL is required, e.g. redis://127.0.0.1:6379/0")
  u = urllib.parse.urlparse(url)
  if u.scheme not in ("redis", "rediss"):
    raise ValueError(f"a Redis URL starts with redis:// or rediss:// (e.g. redis://127.0.0.1:6379/0), got {url!r}")
  try:
    port = 6379 if u.port is None else u.port
  except ValueError:
    port = 0
  if not 1 <= port <= 65535:
    raise ValueError(f"the port of a Redis URL must be a number in [1, 65535], got {url!r}")
  if not u.hostname:
    raise ValueError(f"a Redis URL needs a host, e.g. redis://127.0.0.1:6379/0, got {url!r}")
  db = u.path.strip("/")
  if db and not db.isdigit():
    raise ValueError(f"the database of a Redis URL (after the last /) must be a number, got {url!r}")
  return u.hostname, port, int(db or 0)


def parse_mooncake_url(url: str) -> tuple[str, str]:
  u = urllib.parse.urlparse(url)
  if u.scheme != "mooncake" or not u.hostname or not u.port:
    raise ValueError(f"mooncake store url must look like mooncake://127.0.0.1:50051?metadata=http://..., got {url!r}")
  meta = urllib.parse.parse_qs(u.query).get("metadata", [""])[0]
  if not meta:
    raise ValueError(f"mooncake store url needs ?metadata=<metadata server>: {url!r}")
  return f"{u.hostname}:{u.port}", meta


class MooncakeBackend:
  """Mooncake Store as an L4 tier (the store SGLang HiCache and vLLM use). URL:
  ``mooncake://<master host>:<rpc port>?metadata=<http metadata server url>``. The engine's client mounts no memory
  of its own (global_segment_size 0): records live in the segments of `mooncake_client` processes (one per node,
  `cache.tiers.servers` starts them in tests), so they outlive any engine. Presence is asked of the master
  (`batch_is_exist`): its object metadata is this backend's global directory. Expiry is Mooncake's lease /
  eviction (watermark), not a per-record TTL."""
  name = "mooncake"
  shared = True

  def __init__(self, url: str, timeout_s: float = 1.0, local_buffer_bytes: int = 16 << 20):
    master, meta = parse_mooncake_url(url)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    try:
      from mooncake.store import MooncakeDistributedStore  # local: the optional Mooncake client
    except ImportError as e:      # a setup error, not a store that is down: never a silently missing tier
      raise ImportError(mooncake_client_unavailable(e)) from e
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


def make_backend(kind: str, *, disk_dir: str = "", store_url: str = "", timeout_s: float = 1.0):
  if kind == "host":
    return HostBackend()
  if kind == "disk":
    if not disk_dir:
      raise ValueError("the disk tier needs a directory (--kv_disk_dir)")
    return DiskBackend(disk_dir)
  if kind == "redis":
    if not store_url:     # never a silent default server: the caller says which store
      raise ValueError("the redis tier needs a store URL (--kv_store_url), e.g. redis://127.0.0.1:6379/0")
    return RedisBackend(store_url, timeout_s)
  if kind == "mooncake":
    return MooncakeBackend(store_url, timeout_s)
  raise ValueError(f"unknown KV tier {kind!r} (host, disk, redis, mooncake)")


def now() -> float:
  return time.monotonic()


TIER_KINDS = ("host", "disk", "redis", "mooncake")
SHARED_KINDS = ("redis", "mooncake")


def check_tier_places(tiers, disk_dir: str, store_url: str, names: dict) -> None:
  """The tier list and where its tiers live; a one-line ValueError naming the field (or flag) otherwise."""
  bad = [t for t in tiers if t not in TIER_KINDS]
  if bad:
    raise ValueError(f"{names['tiers']}: unknown tier(s) {', '.join(map(repr, bad))}; choose from "
                     f"{', '.join(TIER_KINDS)}")
  if len(set(tiers)) != len(tiers):
    raise ValueError(f"{names['tiers']}: each tier at most once, got {','.join(tiers)}")
  if "disk" in tiers and not disk_dir:
    raise ValueError(f"{names['disk_dir']} is required with the disk tier (the directory of its record files)")
  shared = [t for t in tiers if t in SHARED_KINDS]
  if len(shared) > 1:
    raise ValueError(f"{names['tiers']}: one shared store per engine ({names['store_url']} names one), got "
                     f"{' and '.join(shared)}")
  if not shared:
    return
  kind = shared[0]
  if not store_url:     # never a silent default server
    eg = "redis://127.0.0.1:6379/0" if kind == "redis" else "mooncake://127.0.0.1:50051?metadata=http://..."
    raise ValueError(f"{names['store_url']} is required with the {kind} tier, e.g. {eg} (start a local one: "
                     f"python -m cache.tiers.servers {kind})")
  try:
    if kind == "redis":
      parse_redis_url(store_url)
    else:
      parse_mooncake_url(store_url)
  except ValueError as e:
    raise ValueError(f"{names['store_url']}: bad {kind} URL {store_url!r}: {e}") from None
