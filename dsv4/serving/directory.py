"""The global prefix directory: which replica (device cache, host tier) or shared store holds which prefix.

Entries live in `cache.tiers.directory` (Redis hashes shared by every process, or a local dict), one per
full-history block of a prefix, keyed by the block's chained hash as the engine's KV events publish it
(`pfx:<hash>`). The hash chain is salted with the tenant, the model id and the cache layout, so a tenant's entries
are never even looked up for another tenant; each entry also carries its tenant and the fingerprint (model id |
layout) and a lookup ignores an entry whose labels are not the request's. Locations:

* `L1@<replica>`   the replica's device prefix cache (BlockStored / BlockRemoved events),
* `host@<replica>` its host tier, where a block goes when the device evicts it (demotion on BlockRemoved),
* `<store>`        a shared store every replica mounting it can load from (written when the block is registered).

Replicas publish from their own KV events (`DirectoryFeed`); the router reads (`PrefixDirectory`). Entries expire
after a TTL (server side with Redis), and `drop_replica` forgets everything a replica held when it restarts empty:
the directory is advisory, a stale entry costs a miss (the engine verifies every load and recomputes), never a
wrong answer."""

from __future__ import annotations

import dataclasses

import numpy as np

from cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from cache.hashing import ExtraKeys, RequestHasher, device_key, key_int

FULL = "full"


def l1(replica: int) -> str:
  return f"L1@r{replica}"


def host(replica: int) -> str:
  return f"host@r{replica}"


def entry_key(block_hash: int) -> str:
  return f"pfx:{block_hash}"


@dataclasses.dataclass(frozen=True)
class KeySpace:
  """What a router needs to name a request's prefix blocks as the engines do (plain values a replica reports)."""
  model_id: str
  layout: str             # the cache specs' fingerprint
  hash_tokens: int        # tokens per hash unit
  block_tokens: int       # tokens per full-history block
  key_bits: int = 64

  @property
  def fingerprint(self) -> str:
    return f"{self.model_id}|{self.layout}"

  def block_hashes(self, tokens, tenant: str) -> list[int]:
    """The hash of every complete full-history block of `tokens`, in order, as the engine's BlockStored events
    name them (the same chain, extra keys and truncation as the cache manager)."""
    n = len(tokens) // self.block_tokens
    if n == 0:
      return []
    h = RequestHasher(ExtraKeys(tenant=tenant, model=self.model_id, layout=self.layout), self.hash_tokens,
                      self.key_bits)
    h.update(np.asarray(tokens[:n * self.block_tokens], np.int32))
    upb = self.block_tokens // self.hash_tokens
    return [key_int(device_key(h.digests[(j + 1) * upb - 1], self.key_bits)) for j in range(n)]

  def block_keys(self, tokens, tenant: str) -> list[str]:
    return [entry_key(b) for b in self.block_hashes(tokens, tenant)]


class DirectoryFeed:
  """A replica's side: its engine's KV events (full-history group) into directory entries."""

  def __init__(self, directory, replica: int, space: KeySpace, block_bytes: int, ttl_s: float | None = 600.0,
               host_tier: bool = False, shared_store: str = ""):
    self.dir, self.replica, self.space = directory, replica, space
    self.block_bytes, self.ttl_s = block_bytes, ttl_s
    self.host_tier, self.shared_store = host_tier, shared_store
    self.stats = {"published": 0, "unpublished": 0, "errors": 0}

  def consume(self, events) -> None:
    """Never raises: a directory that is down loses updates (counted); the engines are unaffected."""
    try:
      for ev in events:
        if isinstance(ev, AllBlocksCleared):
          self.dir.drop_location(l1(self.replica))
          continue
        if getattr(ev, "group", None) != FULL:
          continue
        k = entry_key(ev.block_hash)
        if isinstance(ev, BlockStored):
          self._publish(k, l1(self.replica), ev.tenant)
          if self.shared_store:        # written through to the shared store as it is registered
            self._publish(k, self.shared_store, ev.tenant)
        elif isinstance(ev, BlockRemoved):
          self.dir.unpublish(k, l1(self.replica))
          self.stats["unpublished"] += 1
          if self.host_tier:           # evicted from the device = demoted to the host tier
            self._publish(k, host(self.replica), ev.tenant)
    except Exception:  # noqa: BLE001 - advisory state: a dead directory must not stop a replica
      self.stats["errors"] += 1

  def _publish(self, key, location, tenant):
    self.dir.publish(key, location, tenant, self.block_bytes, self.ttl_s, self.space.fingerprint)
    self.stats["published"] += 1

  def restarted(self) -> int:
    """This replica came up empty: forget every location it held before."""
    return drop_replica(self.dir, self.replica)


def drop_replica(directory, replica: int) -> int:
  return directory.drop_location(l1(replica)) + directory.drop_location(host(replica))


class PrefixDirectory:
  """The router's side: for a request, the leading prefix tokens each location holds."""

  def __init__(self, directory, space: KeySpace):
    self.dir, self.space = directory, space

  def matched(self, tokens, tenant: str) -> dict[str, int]:
    """location -> tokens of the request's prefix held there (a contiguous run of blocks from the start).
    Raises whatever the directory's server raises (the router degrades to load-only routing)."""
    keys = self.space.block_keys(tokens, tenant)
    if not keys:
      return {}
    run: dict[str, int] = {}
    live: set[str] | None = None
    for j, e in enumerate(self.dir.lookup_many(keys)):
      ok = (e is not None and e.get("tenant", "") == tenant
            and e.get("fingerprint", "") in ("", self.space.fingerprint))
      here = set(e["tiers"]) if ok else set()
      live = here if live is None else live & here
      if not live:
        break
      for loc in live:
        run[loc] = (j + 1) * self.space.block_tokens
    return run
