"""Wall-clock timing, XLA's cost analysis and per-thunk times from JAX's profiler, as the benchmarks use them."""

from __future__ import annotations

import collections
import glob
import os
import time

import jax
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


# Trace events that are Python frames or runtime wrappers around XLA's CPU thunks (they contain the thunks' time).
_NOT_THUNKS = ("$", "ThreadpoolListener", "end: ", "ThunkExecutor", "SlinkyThreadPool", "PjitFunction", "CommonPjRt",
               "ParseArguments", "PythonRefManager", "PjRt", "TfrtCpu", "Execute")


def thunk_ms(trace_dir: str, calls: int) -> collections.Counter:
  """Milliseconds per call of each XLA CPU thunk in a `jax.profiler.trace(trace_dir)` of `calls` calls, summed over
  the worker threads, by thunk name (the instruction's name in the compiled module)."""
  path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
  per = collections.Counter()
  for plane in jax.profiler.ProfileData.from_file(path).planes:
    if plane.name != "/host:CPU":
      continue
    for line in plane.lines:
      if line.name == "python":
        continue
      for ev in line.events:
        if not ev.name.startswith(_NOT_THUNKS):
          per[ev.name] += ev.duration_ns / 1e6 / calls
  return per
