"""KV events: what a router (or an external cache index) needs to track which prefixes live where.

Hashes are the 64-bit device keys as signed ints (`hashing.key_int`). `parent_hash` is the key of the previous
block of the same group (None for a group's first block), so a consumer can rebuild chains.
"""

from __future__ import annotations

import dataclasses
from typing import Union


@dataclasses.dataclass(frozen=True)
class BlockStored:
  block_hash: int
  parent_hash: int | None
  group: str
  tenant: str
  block_id: int
  num_tokens: int


@dataclasses.dataclass(frozen=True)
class BlockRemoved:
  block_hash: int
  group: str
  tenant: str
  block_id: int


@dataclasses.dataclass(frozen=True)
class AllBlocksCleared:
  pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventLog:
  """An append-only queue drained by `take`. Disabled logs drop everything (no cost)."""

  def __init__(self, enabled: bool = True):
    self.enabled = enabled
    self._events: list[KVEvent] = []

  def emit(self, ev: KVEvent) -> None:
    if self.enabled:
      self._events.append(ev)

  def take(self) -> list[KVEvent]:
    out, self._events = self._events, []
    return out
