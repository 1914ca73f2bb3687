"""Routers: round robin (the baseline) and KV-aware (the prefix directory + `cost.RouteCostModel`).

A router picks a replica of a pool for a request from plain inputs: the request's tokens and tenant, and each
replica's load as the caller tracks it. With the directory unreachable the KV-aware router routes on load alone
(counted), so the directory's server is never a hard dependency of serving."""

from __future__ import annotations

import dataclasses

from dsv4.serving import directory
from dsv4.serving.cost import DEVICE, Candidate, Estimate, RouteCostModel, Source


@dataclasses.dataclass(frozen=True)
class Load:
  queued_prefill_tokens: int = 0
  running: int = 0


class RoundRobin:
  name = "round_robin"

  def __init__(self, pool: list[int]):
    if not pool:
      raise ValueError("RoundRobin: an empty replica pool")
    self.pool, self._next = list(pool), 0
    self.stats = {"routed": 0}

  def route(self, tokens, tenant: str, loads: dict[int, Load], alive=None) -> Estimate:
    pool = [r for r in self.pool if alive is None or r in alive]
    if not pool:
      raise RuntimeError("RoundRobin: no live replica in the pool")
    r = pool[self._next % len(pool)]
    self._next += 1
    self.stats["routed"] += 1
    return Estimate(r, 0, "", 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


class KVAware:
  name = "kv_aware"

  def __init__(self, pool: list[int], prefixes: directory.PrefixDirectory, model: RouteCostModel,
               shared_store: str = "", host_tiers: bool = False):
    """shared_store: the store every replica of the pool mounts ("" = none); host_tiers: replicas have a host tier."""
    if not pool:
      raise ValueError("KVAware: an empty replica pool")
    self.pool, self.prefixes, self.model = list(pool), prefixes, model
    self.shared_store, self.host_tiers = shared_store, host_tiers
    self.stats = {"routed": 0, "reuse_routes": 0, "directory_errors": 0, "load_only_routes": 0,
                  "predicted_reuse_tokens": 0}

  def candidates(self, matched: dict[str, int], loads: dict[int, Load], pool) -> list[Candidate]:
    out = []
    shared = matched.get(self.shared_store, 0) if self.shared_store else 0
    for r in pool:
      src = [Source(DEVICE, matched.get(directory.l1(r), 0))]
      if self.host_tiers:
        src.append(Source("host", matched.get(directory.host(r), 0)))
      if shared:
        src.append(Source(self.shared_store, shared))
      ld = loads.get(r, Load())
      out.append(Candidate(r, tuple(s for s in src if s.tokens > 0), ld.queued_prefill_tokens, ld.running))
    return out

  def route(self, tokens, tenant: str, loads: dict[int, Load], alive=None) -> Estimate:
    pool = [r for r in self.pool if alive is None or r in alive]
    if not pool:
      raise RuntimeError("KVAware: no live replica in the pool")
    try:
      matched = self.prefixes.matched(tokens, tenant)
    except Exception:  # noqa: BLE001 - directory down: route on load only
      self.stats["directory_errors"] += 1
      self.stats["load_only_routes"] += 1
      matched = {}
    est = self.model.choose(self.candidates(matched, loads, pool), len(tokens))
    self.stats["routed"] += 1
    if est.reuse_tokens:
      self.stats["reuse_routes"] += 1
      self.stats["predicted_reuse_tokens"] += est.reuse_tokens
    return est
