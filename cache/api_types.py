"""What `KVCacheManager` hands its callers: a prefix hit (`PrefixHit`), a request's block tables (`BlockTables`,
read from the device lazily), the all-or-nothing refusal `OutOfBlocks` (a value, never an exception), and
`CacheError` for bad use of the manager."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


class CacheError(ValueError):
  """Bad use of the manager (unknown request, inconsistent counts)."""


class PrefixHit:
  """num_tokens: tokens to skip (aligned; 0 = miss). block_ids: per group, the table prefix for [0, num_tokens);
  sliding groups -1 before the tail. Built on first access (the engine reads only num_tokens)."""

  __slots__ = ("num_tokens", "_ids", "_make")

  def __init__(self, num_tokens: int, block_ids: dict[str, np.ndarray] | None = None, make=None):
    self.num_tokens, self._ids, self._make = num_tokens, block_ids, make

  @property
  def block_ids(self) -> dict[str, np.ndarray]:
    if self._ids is None:
      self._ids = self._make()
    return self._ids

  def __repr__(self):
    return f"PrefixHit(num_tokens={self.num_tokens})"

  @property
  def full(self) -> np.ndarray:
    return self.block_ids["full"]

  @property
  def swa(self) -> np.ndarray:
    return self.block_ids["swa"]


class BlockTables:
  """Per-group block tables of one request (dict by group name; `.full` / `.swa` for today's engine): the tables
  themselves, or `read` (no arguments) that reads them from the device on first access (tests, tiers, debugging:
  the engine's step never reads them)."""

  def __init__(self, tables: dict[str, np.ndarray] | None = None, read: Callable[[], dict] | None = None):
    self._tables, self._read = tables, read

  @property
  def tables(self) -> dict[str, np.ndarray]:
    if self._tables is None:
      self._tables = self._read()
    return self._tables

  def __getitem__(self, name: str) -> np.ndarray:
    return self.tables[name]

  @property
  def full(self) -> np.ndarray:
    return self.tables.get("full", np.zeros(0, np.int32))

  @property
  def swa(self) -> np.ndarray:
    return self.tables["swa"]

  def __bool__(self):
    return True


@dataclasses.dataclass(frozen=True)
class OutOfBlocks:
  group: str
  needed: int
  free: int

  def __bool__(self):                  # `if not mgr.allocate_for(...)` reads naturally
    return False

