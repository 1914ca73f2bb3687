"""The queued bookkeeping of one engine step as the step program takes it (`StepPlan`), what the host keeps to
read a device call's results back (`SentCall`), and the static widths the queue is padded to (`bucket_width`), so
the bookkeeping program compiles for a handful of shapes only."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class SentCall:
  """What the host needs to read one device call's results: its result layout, the blocks allocated by all calls
  sent so far (to turn the device's free counts back into the current ones), the releases sent so far, and, with
  events on, the registrations it carried."""
  layout: tuple
  alloc_total: dict
  free_seq: int
  regs: dict | None
  admits: list | None = None     # the admissions it carried (cache.request_state.Admission), in batch order


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """The queued bookkeeping of one engine step, as the step program takes it: `buf` (one int32 host buffer) plus
  the static arguments of `cache.step.step_packed` (`statics`, hashable). Results: `KVCacheManager.read_results`."""
  buf: np.ndarray
  statics: tuple
  sent: SentCall

  def kwargs(self) -> dict:
    return dict(self.statics)


def bucket_width(n: int, lo: int = 16) -> int:
  """Static widths in powers of 4 from `lo`, so each shape compiles a handful of times at most."""
  w = lo
  while w < n:
    w *= 4
  return w


ADMIT_ROWS_FIXED = 16   # engines with at most this many table rows admit at one fixed batch width


def units_bucket_width(n: int) -> int:
  """Hash units per request in a search: powers of 4 from 64 (2048 tokens at 32-token units)."""
  return bucket_width(n, 64)
