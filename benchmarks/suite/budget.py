"""The suite's time budget: items start only with enough seconds left; a watchdog ends the process cleanly when an
item overruns the whole budget (a hung compile or kernel cannot be interrupted inside the process).

The clock is injected (`time.monotonic` in the suite, a fake in tests), so the skip logic is tested without waiting.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import Callable


@dataclasses.dataclass
class Budget:
  total_s: float
  clock: Callable[[], float] = time.monotonic
  start: float | None = None

  def __post_init__(self):
    if self.start is None:
      self.start = self.clock()

  def elapsed(self) -> float:
    return self.clock() - self.start

  def left(self) -> float:
    return self.total_s - self.elapsed()

  def allows(self, need_s: float) -> bool:
    """Whether an item that needs `need_s` seconds may start now."""
    return self.left() >= need_s


class Watchdog:
  """Past the budget plus `grace_s`, calls `on_expire()` (the report's last words) and ends the process with exit
  status 3: the budget is a promise to the machine's lease, kept even when an item hangs. `stop()` disarms it."""

  def __init__(self, budget: Budget, grace_s: float, on_expire: Callable[[], None], poll_s: float = 1.0,
               exit_fn: Callable[[int], None] = os._exit):
    self.budget, self.grace_s, self.on_expire, self.poll_s, self.exit_fn = budget, grace_s, on_expire, poll_s, exit_fn
    self._stop = threading.Event()
    self.thread = threading.Thread(target=self._run, name="gpu-suite-watchdog", daemon=True)

  def start(self) -> "Watchdog":
    self.thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()

  def _run(self):
    while not self._stop.wait(self.poll_s):
      if self.budget.left() < -self.grace_s:
        try:
          self.on_expire()
        finally:
          sys.stdout.flush()
          sys.stderr.flush()
          self.exit_fn(3)
        return
