"""What the host keeps per request: its tokens (`Int32Buffer`), which entries of its block tables hold a block
(`HeldEntries`; the block ids themselves live on the device only) and the rest of its bookkeeping (`RequestState`).
Pure numpy, no device."""

from __future__ import annotations

import dataclasses

import numpy as np

from cache.hashing import RequestHasher

HOST_HELD = 1    # host table entry: the request holds a block there (its id lives in the device table only)


class Int32Buffer:
  """A growable int32 numpy buffer (doubling): a request's token list, or the explicit HOST_HELD / -1 mask of a table
  with gaps (`HeldEntries`). Slices and masks replace per-block Python loops."""

  __slots__ = ("buf", "n")

  def __init__(self, ids: np.ndarray):
    self.n = len(ids)
    self.buf = np.empty(max(16, self.n + self.n // 4), np.int32)   # room for a few decode / chunk appends
    self.buf[:self.n] = ids

  def __len__(self):
    return self.n

  def view(self) -> np.ndarray:
    return self.buf[:self.n]

  def extend(self, vals) -> int:
    """Append the values of `vals`; returns the start index (`extend_fill` appends one value repeated)."""
    vals = np.asarray(vals, np.int32)
    start = self.n
    self._grow(start + len(vals))
    self.buf[start:start + len(vals)] = vals
    self.n = start + len(vals)
    return start

  def extend_fill(self, value: int, count: int) -> int:
    start = self.n
    self._grow(start + count)
    self.buf[start:start + count] = value
    self.n = start + count
    return start

  def _grow(self, need: int):
    if need > len(self.buf):
      b = np.empty(max(need, 2 * len(self.buf)), np.int32)
      b[:self.n] = self.buf[:self.n]
      self.buf = b


class HeldEntries:
  """Which entries of one request's block table in one group hold a block (the ids live on the device). Normally a
  run [lo, n): full-history groups hold every entry from 0, sliding groups release from the front, and hits and
  allocations leave no gap, so the common operations are integer updates, no array work. A load from a lower tier
  can leave gaps (`extend_for_load`): the entries then become an explicit HOST_HELD / -1 mask (`mask`, an
  Int32Buffer)."""

  __slots__ = ("lo", "n", "mask")

  def __init__(self, lo: int = 0, n: int = 0):
    self.lo, self.n, self.mask = min(lo, n), n, None

  def __len__(self):
    return self.n

  def view(self) -> np.ndarray:
    """HOST_HELD / -1 per entry (a copy in the run form)."""
    if self.mask is not None:
      return self.mask.view()
    out = np.full(self.n, -1, np.int32)
    out[self.lo:] = HOST_HELD
    return out

  def all_held(self, a: int, b: int) -> bool:
    """Entries [a, b) (a < b) all held."""
    if self.mask is None:
      return self.lo <= a and b <= self.n
    return b <= self.n and self.mask.buf[a:b].min() >= 0

  def held_runs(self, a: int, b: int) -> list[tuple[int, int]]:
    """The held entries in [a, b) as maximal runs (lo, hi), ascending."""
    b = min(b, self.n)
    if self.mask is None:
      lo = max(a, self.lo)
      return [(lo, b)] if lo < b else []
    if a >= b:
      return []
    held = np.concatenate([[False], self.mask.buf[a:b] >= 0, [False]])
    edges = np.flatnonzero(held[1:] != held[:-1]) + a
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))

  def grow(self, count: int) -> int:
    """Append `count` held entries; returns the first one's index."""
    start = self.n
    if self.mask is not None:
      self.mask.extend_fill(HOST_HELD, count)
    self.n += count
    return start

  def extend(self, vals) -> None:
    """Append entries HOST_HELD / -1 as given (a gap switches to the explicit mask)."""
    vals = np.asarray(vals, np.int32)
    if self.mask is None and (vals >= 0).all():
      self.n += len(vals)
      return
    if self.mask is None:
      self.mask = Int32Buffer(self.view())
    self.mask.extend(vals)
    self.n += len(vals)

  def clear_front(self, upto: int) -> None:
    """Entries before `upto` no longer held (released)."""
    if self.mask is None:
      self.lo = max(self.lo, min(upto, self.n))
    else:
      self.mask.buf[:min(upto, self.n)] = -1


@dataclasses.dataclass
class RequestState:
  rid: str
  tokens: Int32Buffer
  hasher: RequestHasher
  tenant: str
  prompt_len: int
  num_computed: int
  tables: dict[str, HeldEntries]             # which table entries it holds; the ids are on the device
  num_registered: dict[str, int]       # full groups: leading blocks already offered to the cache
  released: dict[str, int]             # sliding groups: leading blocks already released
  junctions: tuple[int, ...] = ()      # extra checkpoint boundaries (junction, dense start past the run)
  dense: bool = True                   # take the dense-start checkpoints (only a request that hit nothing does)
  plan: tuple[int, ...] | None = None  # its checkpoint boundaries (policy.plan), computed at the first commit
  slot: int = -1                       # its row of the device block tables


@dataclasses.dataclass(eq=False)
class Admission:
  """A request being admitted: checked, hashed, its table row taken, its search and claim queued or sent
  (`KVCacheManager.queue_admissions` / `add_requests`). Becomes a RequestState when the call's result is read."""
  rid: str
  tokens: np.ndarray
  tenant: str
  hasher: RequestHasher
  slot: int
  target: int | None = None          # tokens to cover with blocks in the same call (add_requests' allocate_tokens)
  queued: bool = False               # from queue_admissions: its hit goes to take_admitted()
  withdrawn: bool = False            # freed while in flight: released as soon as its result is read
  hit: "object" = None               # its PrefixHit, once resolved
