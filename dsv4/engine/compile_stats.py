"""Honest compile accounting: how many XLA programs a process really built, and for which functions.

Two independent counts, because either alone can mislead:

* `CompileLog` listens to JAX's own backend-compile event (`/jax/core/compile/backend_compile_duration`, fired once
  per program JAX hands to XLA, including persistent-cache hits, which it reports separately) and keys it by the
  function name JAX attaches. It sees *everything* compiled while it listens: the engine's step programs, the
  sampler, the cache manager's pool ops and prefix search, and any stray eager op that compiles per shape.
* `jit_cache_sizes` reads the executable cache of named jitted functions (`_cache_size()`): the number of distinct
  programs each one holds, whatever process-level cache served them.

The engine reports both in its metrics; tests bound them.
"""

from __future__ import annotations

import collections
import threading

from jax import monitoring

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_counts: collections.Counter = collections.Counter()   # fun_name -> backend compiles (process-wide)
_seconds: collections.Counter = collections.Counter()
_hits = [0]
_installed = [False]


def _on_duration(event: str, duration: float, **kwargs) -> None:
  if event != _BACKEND_COMPILE:
    return
  name = str(kwargs.get("fun_name", "?"))
  with _lock:
    _counts[name] += 1
    _seconds[name] += float(duration)


def _on_event(event: str, **kwargs) -> None:
  if event == _CACHE_HIT:
    with _lock:
      _hits[0] += 1


def install() -> None:
  """Start listening (idempotent; listeners are process-wide and cheap)."""
  with _lock:
    if _installed[0]:
      return
    _installed[0] = True
  monitoring.register_event_duration_secs_listener(_on_duration)
  monitoring.register_event_listener(_on_event)


class CompileLog:
  """A window onto the process-wide counts: `delta()` is what compiled since this log was created (or `reset`)."""

  def __init__(self):
    install()
    self.reset()

  def reset(self) -> None:
    with _lock:
      self._base = collections.Counter(_counts)
      self._base_s = collections.Counter(_seconds)
      self._base_hits = _hits[0]

  def delta(self) -> dict[str, int]:
    with _lock:
      return {k: v - self._base.get(k, 0) for k, v in _counts.items() if v - self._base.get(k, 0) > 0}

  def total(self) -> int:
    return sum(self.delta().values())

  def seconds(self) -> float:
    with _lock:
      return float(sum(v - self._base_s.get(k, 0.0) for k, v in _seconds.items()))

  def persistent_cache_hits(self) -> int:
    with _lock:
      return _hits[0] - self._base_hits


def jit_cache_sizes(fns: dict) -> dict[str, int]:
  """Distinct compiled programs held by each jitted function (name -> count); -1 where JAX offers no count."""
  out = {}
  for name, f in fns.items():
    size = getattr(f, "_cache_size", None)
    out[name] = int(size()) if callable(size) else -1
  return out
