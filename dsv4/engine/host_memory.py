"""The CPU backend's step scratch, kept mapped from one step to the next.

XLA's CPU runtime allocates each execution's temp buffer (the `preallocated-temp` of its buffer assignment) with
`posix_memalign` and frees it when the execution ends. glibc serves a request above its mmap threshold (adaptive,
at most 32 MiB) with a mapping of its own and unmaps it on free, so a step program whose temp buffer is larger
takes a page fault on every 4 KiB page it touches, every step, and the kernel zeroes each page first: the wide MoE
config's step at a 2,048-token budget (a 66.7 MB temp) took 16,294 faults and 87.3 ms a step, 48.8 ms with the
setting below (`python -m benchmarks.probes.step_faults`; BUILD_NOTES, Invariant step cost). A plain step sized to
its tokens has a small temp and never paid it, nor does a GPU (XLA pools device memory there).

`keep_scratch_mapped` sets glibc's allocator once per process so that large blocks come from its arenas and stay:

* `M_MMAP_MAX` 0: no block gets a mapping of its own (a thread's arena grows a heap instead, or the main arena
  grows its break);
* `M_TOP_PAD` 64 MiB: an arena grows by that much more than asked and keeps that much free at its top when it
  trims (a thread's heap holds at most 64 MiB);
* `M_TRIM_THRESHOLD` 1 GiB: an arena gives its free top back to the system only past that.

The next step's temp buffer then lands on pages the last one touched. The setting is the whole process's: any large
allocation (numpy arrays, XLA's buffers) is served the same way, and up to 1 GiB free per arena stays mapped. Where
the C library is not glibc (macOS, musl) there is nothing to set and the step keeps its faults.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from absl import logging

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
SETTINGS = ((M_MMAP_MAX, 0), (M_TOP_PAD, 64 << 20), (M_TRIM_THRESHOLD, 1 << 30))
_NAMES = {M_TRIM_THRESHOLD: "M_TRIM_THRESHOLD", M_TOP_PAD: "M_TOP_PAD", M_MMAP_MAX: "M_MMAP_MAX"}

_state: dict = {}


def glibc():
  """The process's C library when it is glibc (it has `gnu_get_libc_version` and `mallopt`), else None."""
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
  except OSError:
    return None
  if not (hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt")):
    return None
  return libc


def keep_scratch_mapped() -> bool:
  """Sets glibc's allocator to keep large blocks mapped (module docstring), once per process. True when set (now
  or before), False where the C library is not glibc or refused a setting (logged once)."""
  if "applied" not in _state:
    libc = glibc()
    if libc is None:
      logging.info("host_memory: the C library is not glibc; a CPU step larger than its mmap threshold keeps "
                   "mapping fresh scratch pages every step")
      _state["applied"] = False
    else:
      refused = [_NAMES[p] for p, v in SETTINGS if libc.mallopt(ctypes.c_int(p), ctypes.c_int(v)) != 1]
      if refused:
        logging.warning("host_memory: glibc refused mallopt %s; CPU steps may map fresh scratch pages every step",
                        ", ".join(refused))
      _state["applied"] = not refused
  return _state["applied"]


def applied() -> bool:
  """Whether `keep_scratch_mapped` has set the allocator in this process."""
  return bool(_state.get("applied"))
