"""Honest compile accounting: how many XLA programs an engine really built, and for which functions.

`CompileLog` listens to JAX's own backend-compile event (`/jax/core/compile/backend_compile_duration`, fired once
per program JAX hands to XLA; persistent-cache hits are counted apart) and keys it by the function name JAX
attaches. A log counts only what compiles *inside its scope* (`with log.scope():`) on the thread that entered it:
the engine enters its log around its own work (construction, admission, steps), so its report holds the programs
that engine caused — its step programs, the sampler, the cache's programs, tier transfers, any stray eager op —
and nothing another engine or the caller compiled in the same process meanwhile.
"""

from __future__ import annotations

import collections
import contextlib
import threading

from jax import monitoring

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

_lock = threading.Lock()
_installed = [False]
_active = threading.local()   # .logs: the CompileLogs whose scope this thread is inside (innermost last)


def _logs() -> list:
  logs = getattr(_active, "logs", None)
  if logs is None:
    logs = _active.logs = []
  return logs


def _on_duration(event: str, duration: float, **kwargs) -> None:
  if event != _BACKEND_COMPILE:
    return
  name = str(kwargs.get("fun_name", "?"))
  for log in set(_logs()):
    with _lock:
      log._counts[name] += 1
      log._seconds += float(duration)


def _on_event(event: str, **kwargs) -> None:
  if event == _CACHE_HIT:
    for log in set(_logs()):
      with _lock:
        log._hits += 1


def install() -> None:
  """Start listening (idempotent; listeners are process-wide and cheap)."""
  with _lock:
    if _installed[0]:
      return
    _installed[0] = True
  monitoring.register_event_duration_secs_listener(_on_duration)
  monitoring.register_event_listener(_on_event)


class CompileLog:
  """Compilations caused inside this log's scope (see the module docstring)."""

  def __init__(self):
    install()
    self.reset()

  def reset(self) -> None:
    with _lock:
      self._counts = collections.Counter()
      self._seconds = 0.0
      self._hits = 0

  @contextlib.contextmanager
  def scope(self):
    """Count what compiles on this thread until the block ends (re-entrant)."""
    logs = _logs()
    logs.append(self)
    try:
      yield self
    finally:
      logs.remove(self)

  def delta(self) -> dict[str, int]:
    with _lock:
      return dict(self._counts)

  def total(self) -> int:
    return sum(self.delta().values())

  def seconds(self) -> float:
    with _lock:
      return float(self._seconds)

  def persistent_cache_hits(self) -> int:
    with _lock:
      return self._hits


def jit_cache_sizes(fns: dict) -> dict[str, int]:
  """Distinct compiled programs held by each jitted function (name -> count); -1 where JAX offers no count."""
  out = {}
  for name, f in fns.items():
    size = getattr(f, "_cache_size", None)
    out[name] = int(size()) if callable(size) else -1
  return out
