"""Load vs recompute (docs/tiers.md): loading N records from a tier costs n * latency + bytes / bandwidth (plus
the bytes already queued for that tier by write-behind, which share its bandwidth); recomputing costs tokens / measured
prefill rate. Both sides are measured while serving (exponential moving averages) and can be calibrated at start.
A load also gets a time budget (recompute time x `budget_factor`, at most `max_load_s`): past it the load is
abandoned and the request recomputes from the last point that did load."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TierSpeed:
  latency_s: float = 1e-3          # per batched request
  s_per_byte: float = 1.0 / 1e9


@dataclasses.dataclass(frozen=True)
class Decision:
  load: bool
  load_s: float
  recompute_s: float
  budget_s: float


class CostModel:

  def __init__(self, prefill_tokens_per_s: float = 2000.0, ema: float = 0.3, budget_factor: float = 2.0,
               max_load_s: float = 5.0, min_budget_s: float = 0.05):
    self.prefill_tps = prefill_tokens_per_s
    self.ema, self.budget_factor, self.max_load_s, self.min_budget_s = ema, budget_factor, max_load_s, min_budget_s
    self.tiers: dict[str, TierSpeed] = {}
    self.prefill_measured = False

  def speed(self, tier: str) -> TierSpeed:
    return self.tiers.setdefault(tier, TierSpeed())

  def calibrate(self, tier: str, latency_s: float, bytes_per_s: float) -> None:
    self.tiers[tier] = TierSpeed(max(latency_s, 0.0), 1.0 / max(bytes_per_s, 1.0))

  def observe_load(self, tier: str, nbytes: int, seconds: float) -> None:
    s = self.speed(tier)
    per_byte = max(seconds - s.latency_s, 0.0) / max(nbytes, 1)
    s.s_per_byte += self.ema * (per_byte - s.s_per_byte)

  def observe_prefill(self, tokens: int, seconds: float) -> None:
    if tokens <= 0 or seconds <= 0:
      return
    rate = tokens / seconds
    if not self.prefill_measured:
      self.prefill_tps, self.prefill_measured = rate, True
    else:
      self.prefill_tps += self.ema * (rate - self.prefill_tps)

  def load_seconds(self, plan: dict[str, tuple[int, int]], backlog_bytes: dict[str, int] | None = None) -> float:
    """plan: tier -> (batched requests, bytes)."""
    backlog_bytes = backlog_bytes or {}
    t = 0.0
    for tier, (n, b) in plan.items():
      s = self.speed(tier)
      t += n * s.latency_s + (b + max(backlog_bytes.get(tier, 0), 0)) * s.s_per_byte
    return t

  def recompute_seconds(self, tokens: int) -> float:
    return tokens / max(self.prefill_tps, 1e-9)

  def decide(self, plan, tokens: int, backlog_bytes=None) -> Decision:
    load_s, rec_s = self.load_seconds(plan, backlog_bytes), self.recompute_seconds(tokens)
    budget = min(self.max_load_s, max(self.min_budget_s, self.budget_factor * rec_s))
    return Decision(load_s < rec_s, load_s, rec_s, budget)
