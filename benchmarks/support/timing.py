"""Wall-clock timing and XLA's cost analysis, as the benchmarks use them."""

from __future__ import annotations

import time

import numpy as np


def best_time(fn, repeats: int = 5) -> float:
  """Seconds of the fastest of `repeats` calls of `fn` after one untimed warm-up call: the floor of what this
  machine can do, the figure least disturbed by other load."""
  fn()
  ts = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t)
  return min(ts)


def median_time(fn, repeats: int) -> float:
  """Median seconds of `repeats` calls of `fn` (no warm-up call: warm it first if it compiles)."""
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def xla_cost(compiled) -> dict:
  """XLA's cost analysis of a compiled program (one dict; older JAX returns a one-element list)."""
  ca = compiled.cost_analysis()
  return ca[0] if isinstance(ca, (list, tuple)) else ca
