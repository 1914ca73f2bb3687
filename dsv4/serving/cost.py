"""The router's cost model: where should a request run, and is reusing a cached prefix worth it?

For one candidate replica, with `reuse` tokens of the request's prefix reachable from one source (its device cache,
its host tier, the shared store):

    benefit = reuse / prefill rate                                   (the prefill it avoids)
    cost    = directory lookup + read / transfer of those records    (nothing for the device cache)
              + the target's queue (prefill tokens ahead of it) + its decode pressure (running requests)

Reuse happens only when benefit > lookup + read; the replica with the smallest estimated time to first token wins.
The read's own time budget stops a remote read that approaches the re-prefill it replaces (the engine abandons it
there and recomputes). Pure Python over plain numbers: the tier speeds and the load-vs-recompute arithmetic are
`cache.tiers.cost.CostModel`'s, so one model decides both in the router and in the engine."""

from __future__ import annotations

import dataclasses

from cache.tiers.cost import CostModel

DEVICE = "device"       # the replica's own device prefix cache: no read


@dataclasses.dataclass(frozen=True)
class Source:
  """Tokens of the request's prefix reachable on a replica from one place."""
  place: str             # DEVICE, or a tier name ("host", "redis", ...)
  tokens: int


@dataclasses.dataclass(frozen=True)
class Candidate:
  replica: int
  sources: tuple[Source, ...] = ()
  queued_prefill_tokens: int = 0     # prompt tokens admitted or waiting there, not computed yet
  running: int = 0                   # requests decoding there


@dataclasses.dataclass(frozen=True)
class Estimate:
  replica: int
  reuse_tokens: int
  place: str             # where the reused tokens come from ("" = nothing reused)
  benefit_s: float
  read_s: float
  queue_s: float
  decode_pressure_s: float
  ttft_s: float
  load_budget_s: float   # a read still running past this is abandoned for recompute


@dataclasses.dataclass(frozen=True)
class RouteCosts:
  lookup_s: float = 2e-4                  # one directory round trip
  bytes_per_token: float = 256.0          # record bytes per reused token (from the record sizes)
  decode_s_per_running: float = 2e-3      # how much each running request slows a prefill at that replica
  budget_factor: float = 1.0              # a read may take at most this x the re-prefill it replaces


class RouteCostModel:

  def __init__(self, speeds: CostModel, costs: RouteCosts = RouteCosts()):
    self.speeds, self.costs = speeds, costs

  def read_seconds(self, place: str, tokens: int) -> float:
    if place == DEVICE or tokens <= 0:
      return 0.0
    return self.speeds.load_seconds({place: (1, int(tokens * self.costs.bytes_per_token))})

  def estimate(self, c: Candidate, prompt_tokens: int) -> Estimate:
    """The best reuse choice on this candidate (possibly none) and its estimated time to first token."""
    c_ = self.costs
    queue_s = self.speeds.recompute_seconds(c.queued_prefill_tokens)
    pressure_s = c.running * c_.decode_s_per_running
    best = (self.speeds.recompute_seconds(prompt_tokens), 0, "", 0.0, 0.0, 0.0)
    for s in c.sources:
      n = min(s.tokens, max(prompt_tokens - 1, 0))      # the last prompt token is always computed
      if n <= 0:
        continue
      benefit = self.speeds.recompute_seconds(n)
      read = self.read_seconds(s.place, n)
      lookup = 0.0 if s.place == DEVICE else c_.lookup_s
      if benefit <= read + lookup:        # not worth it: recomputing those tokens is at least as fast
        continue
      t = lookup + read + self.speeds.recompute_seconds(prompt_tokens - n)
      if t < best[0]:
        best = (t, n, s.place, benefit, read, lookup)
    t, n, place, benefit, read, _ = best
    budget = c_.budget_factor * self.speeds.recompute_seconds(n) if n else 0.0
    return Estimate(c.replica, n, place, benefit, read, queue_s, pressure_s, t + queue_s + pressure_s, budget)

  def choose(self, candidates: list[Candidate], prompt_tokens: int) -> Estimate:
    """The candidate with the smallest estimated TTFT (ties: the first listed)."""
    if not candidates:
      raise ValueError("RouteCostModel.choose: no candidate replica")
    ests = [self.estimate(c, prompt_tokens) for c in candidates]
    return min(ests, key=lambda e: e.ttft_s)
