"""Cache-group specs: plain data describing what the block pools hold and how hits align.

`cache/` knows nothing about the model: the model side (`dsv4.caches.group_specs`) derives a `CacheSpecs` from its
config and hands it to `KVCacheManager`. A group is one block table per request and one block pool:

* kind FULL_HISTORY: every future token may read any block (compressed KV, indexer keys), so a resume at L needs
  every block before L (scan left to right, stop at the first miss).
* kind SLIDING_WINDOW: a resume at L reads only the `tail_tokens` rows before L (window rows, pending compressor
  rows), i.e. the last `need_blocks` blocks before L. Any number of such groups, each with its own block size and
  tail, may coexist (e.g. a window group in the KV dtype plus small compressor-state groups).

Hashing interval = gcd of the group block sizes (every block boundary is a hash boundary); resume alignment = lcm
(a hit ends on a block edge of every group).
"""

from __future__ import annotations

import dataclasses
import functools
import math

FULL_HISTORY = "full_history"
SLIDING_WINDOW = "sliding_window"
KINDS = (FULL_HISTORY, SLIDING_WINDOW)


@dataclasses.dataclass(frozen=True)
class GroupSpec:
  """One paged cache group."""
  name: str
  kind: str                       # FULL_HISTORY or SLIDING_WINDOW
  block_tokens: int
  bytes_per_block: int            # summed over every layer's array of this group (memory accounting only)
  tail_tokens: int = 0            # SLIDING_WINDOW: rows before a resume point the next step reads; else 0
  note: str = ""                  # free text for reports (which arrays the model keeps here)

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"GroupSpec {self.name!r}: kind {self.kind!r} not in {KINDS}")
    if self.block_tokens <= 0 or self.bytes_per_block < 0 or self.tail_tokens < 0:
      raise ValueError(f"GroupSpec {self.name!r}: block_tokens must be > 0, bytes and tail >= 0")
    if self.kind == FULL_HISTORY and self.tail_tokens:
      raise ValueError(f"GroupSpec {self.name!r}: a full-history group has no tail")

  @property
  def need_blocks(self) -> int:
    """Blocks that must be cached right before a resume point (0 for full-history groups: all of them)."""
    return -(-self.tail_tokens // self.block_tokens) if self.kind == SLIDING_WINDOW else 0

  @property
  def checkpoint_bytes(self) -> int:
    """Bytes one checkpoint (the tail before a resume point) of this group pins; 0 for full-history groups."""
    return self.need_blocks * self.bytes_per_block


@dataclasses.dataclass(frozen=True)
class CacheSpecs:
  groups: tuple[GroupSpec, ...]
  fingerprint: str = ""           # model + layout identity, part of every block hash (extra key)

  def __post_init__(self):
    if not self.groups:
      raise ValueError("CacheSpecs: at least one group")
    names = [g.name for g in self.groups]
    if len(set(names)) != len(names):
      raise ValueError(f"CacheSpecs: duplicate group names {names}")
    # full-history groups first: they bound the hit search before the sliding groups are checked
    order = sorted(self.groups, key=lambda g: g.kind != FULL_HISTORY)
    object.__setattr__(self, "groups", tuple(order))

  @property
  def hash_tokens(self) -> int:
    return functools.reduce(math.gcd, [g.block_tokens for g in self.groups])

  @property
  def align_tokens(self) -> int:
    return functools.reduce(math.lcm, [g.block_tokens for g in self.groups])

  @property
  def names(self) -> tuple[str, ...]:
    return tuple(g.name for g in self.groups)

  @property
  def block_tokens(self) -> tuple[int, ...]:
    """Tokens per block of each group, in group order."""
    return tuple(g.block_tokens for g in self.groups)

  def group(self, name: str) -> GroupSpec:
    for g in self.groups:
      if g.name == name:
        return g
    raise KeyError(f"no cache group {name!r}; groups: {list(self.names)}")

  def of_kind(self, kind: str) -> tuple[GroupSpec, ...]:
    return tuple(g for g in self.groups if g.kind == kind)

  @property
  def full(self) -> GroupSpec:
    """The group named "full" (today's engine), else the first full-history group."""
    return self._named_or_first("full", FULL_HISTORY)

  @property
  def swa(self) -> GroupSpec:
    """The group named "swa" (today's engine), else the first sliding-window group."""
    return self._named_or_first("swa", SLIDING_WINDOW)

  def _named_or_first(self, name, kind):
    for g in self.groups:
      if g.name == name:
        return g
    g = self.of_kind(kind)
    if not g:
      raise KeyError(f"no {kind} group; groups: {list(self.names)}")
    return g[0]

  def units_per_block(self, name: str) -> int:
    return self.group(name).block_tokens // self.hash_tokens

  @property
  def checkpoint_bytes(self) -> int:
    """Bytes one resume checkpoint pins across all sliding groups (the tails a resume reads)."""
    return sum(g.checkpoint_bytes for g in self.groups)
