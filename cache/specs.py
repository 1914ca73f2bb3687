"""Cache-group specs derived from a model config: what the block pools hold and how hits align.

The model (dsv4/caches.py) pages its caches in two groups; this module describes them for the allocator:

* ``full`` (kind ``full_history``): one block = `CacheLayout.full_block_tokens` tokens of history, i.e. the
  compressed KV entries and (V4 CSA / V4.1 KV-source layers) indexer keys of that span. Every future token may
  select any of them, so a resume at position L needs every block before L (scan left to right).
* ``swa`` (kind ``sliding_window``): one row per token: window KV of every layer plus the raw compressor
  projections. A resume at L needs only the `state_tail_tokens(config)` rows before L (window and compressor
  state), i.e. the last `need_blocks` blocks before L (search right to left).
* The per-request compressor state is NOT a separate pool: it is exactly the last
  `ModelConfig.compressor_state_tokens` rows of the swa group, so it travels with every SWA checkpoint and
  `compressor_state` below only reports its size (it is never prefix-cached on its own).

V4.1 needs no special case here: `dsv4.caches.cache_array_specs` already gives compressed KV / index keys only
to KV-source ("full") layers, and reindex/reuse layers own only their window rows.

Hashing interval = gcd of the prefix-cacheable block sizes (every group's block boundary is a hash boundary);
resume alignment = lcm (a hit ends on a block edge of every group).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math

from dsv4.caches import FULL, SWA, ArraySpec, CacheLayout, cache_array_specs, state_tail_tokens
from dsv4.config import ModelConfig

FULL_HISTORY = "full_history"
SLIDING_WINDOW = "sliding_window"


@dataclasses.dataclass(frozen=True)
class GroupSpec:
  """One paged cache group: a block table per request and one block pool."""
  name: str                       # "full" or "swa": the `ArraySpec.group` of its arrays
  kind: str                       # FULL_HISTORY or SLIDING_WINDOW
  block_tokens: int
  bytes_per_block: int            # summed over every layer's array of this group
  tail_tokens: int                # SLIDING_WINDOW: rows before a resume point the next step reads; else 0
  arrays: tuple[ArraySpec, ...]

  @property
  def need_blocks(self) -> int:
    """SWA blocks that must be cached right before a resume point (0 for full-history groups)."""
    return -(-self.tail_tokens // self.block_tokens) if self.kind == SLIDING_WINDOW else 0


@dataclasses.dataclass(frozen=True)
class CompressorStateSpec:
  """The per-request compressor state: rows of the swa group (never a pool or a prefix-cache entry of its own)."""
  tokens: int                     # max over layers of `compressor_state_tokens`
  bytes_per_token: int            # comp_state_* and index_state_* rows of all layers, one token
  stored_in: str = SWA


@dataclasses.dataclass(frozen=True)
class CacheSpecs:
  groups: tuple[GroupSpec, ...]   # full-history groups first (they bound the hit search)
  hash_tokens: int                # gcd of group block sizes: one chained hash per this many tokens
  align_tokens: int               # lcm of group block sizes: every hit is a multiple of this
  compressor_state: CompressorStateSpec
  fingerprint: str                # model + layout identity, part of every block hash (extra key)

  def group(self, name: str) -> GroupSpec:
    for g in self.groups:
      if g.name == name:
        return g
    raise KeyError(f"no cache group {name!r}; groups: {[g.name for g in self.groups]}")

  @property
  def full(self) -> GroupSpec:
    return self.group(FULL)

  @property
  def swa(self) -> GroupSpec:
    return self.group(SWA)

  def units_per_block(self, name: str) -> int:
    return self.group(name).block_tokens // self.hash_tokens


def _fingerprint(config: ModelConfig, layout: CacheLayout, arrays: list[ArraySpec]) -> str:
  # Blocks are only interchangeable between engines whose arrays mean the same thing: hash the config and the
  # exact array shapes (not the weights; a different checkpoint must use a different `model` extra key).
  h = hashlib.blake2b(digest_size=8)
  h.update(repr(config).encode())
  h.update(repr((layout.swa_block_tokens, layout.full_block_tokens, str(layout.kv_dtype))).encode())
  h.update(repr([(a.layer, a.name, a.group, a.block_shape, str(a.dtype)) for a in arrays]).encode())
  return h.hexdigest()


@functools.cache
def cache_specs(config: ModelConfig, layout: CacheLayout = CacheLayout()) -> CacheSpecs:
  arrays = cache_array_specs(config, layout)
  by_group = {FULL: [a for a in arrays if a.group == FULL], SWA: [a for a in arrays if a.group == SWA]}
  groups = []
  if by_group[FULL]:  # a window-only model has no full-history group
    groups.append(GroupSpec(FULL, FULL_HISTORY, layout.full_block_tokens,
                            sum(a.bytes_per_block for a in by_group[FULL]), 0, tuple(by_group[FULL])))
  groups.append(GroupSpec(SWA, SLIDING_WINDOW, layout.swa_block_tokens,
                          sum(a.bytes_per_block for a in by_group[SWA]), state_tail_tokens(config),
                          tuple(by_group[SWA])))
  sizes = [g.block_tokens for g in groups]
  state_arrays = [a for a in by_group[SWA] if a.name.startswith(("comp_state", "index_state"))]
  comp = CompressorStateSpec(
      tokens=max([config.compressor_state_tokens(p) for p in config.layer_plan()] + [0]),
      bytes_per_token=sum(a.bytes_per_block for a in state_arrays) // layout.swa_block_tokens)
  return CacheSpecs(tuple(groups), functools.reduce(math.gcd, sizes), functools.reduce(math.lcm, sizes), comp,
                    _fingerprint(config, layout, arrays))
