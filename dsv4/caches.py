"""The model's cache pytree: paged pools addressed by block tables.

Two cache groups share the block tables of a step (spec §3, kv_lifecycle.md §1.4):

* ``swa`` group, blocks of `CacheLayout.swa_block_tokens` tokens, one row per token:
  - ``window_kv``: post-norm, post-RoPE K=V latent of every layer (the sliding window reads the last W rows);
  - ``comp_state_kv`` / ``comp_state_score``: the raw compressor projections (a_j, z_j + ape) of every token, fp32,
    on layers that pool (ratio > 1). The compressor state at any position is simply the last
    `ModelConfig.compressor_state_tokens` rows, so a window-sized tail of SWA blocks is an exact resume point
    (no separate per-request compressor state to save or restore);
  - ``index_state_kv`` / ``index_state_score``: the same for the V4 Lightning indexer's own compressor.
  - ``token_ids`` (V4.1 Engram, int32, on the first Engram layer only): the raw token ids, so the n-gram hash of a
    chunk reads the previous max_ngram_size - 1 ids back through the block table like the window.
* ``full`` group, blocks of `CacheLayout.full_block_tokens` tokens (a multiple of every ratio), one row per
  compressed entry: ``comp_kv`` (compressed KV) and ``index_keys``. In V4.1 only the KV-source ("full") layers own
  them; reindex / reuse layers read their source's pools within the same step (spec §3.2).

Contiguous use (notebooks, tests) is the same code with an identity block table: `init_contiguous`.
A paged pool (cache/ and the engine) allocates blocks and hands the model block tables.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cache.specs import FULL_HISTORY, SLIDING_WINDOW, CacheSpecs, GroupSpec
from dsv4.config import LayerPlan, ModelConfig

SWA = "swa"
FULL = "full"


@dataclasses.dataclass(frozen=True)
class CacheLayout:
  """How cache rows are grouped into blocks. Independent of the model weights."""
  swa_block_tokens: int = 32
  full_block_tokens: int = 128
  kv_dtype: Any = jnp.float32

  def validate(self, config: ModelConfig) -> None:
    align = config.full_block_alignment
    if self.full_block_tokens % align:
      raise ValueError(f"CacheLayout.full_block_tokens: {self.full_block_tokens} must be a multiple of every "
                       f"compress ratio (lcm = {align})")
    if self.swa_block_tokens <= 0:
      raise ValueError("CacheLayout.swa_block_tokens: must be positive")


@dataclasses.dataclass(frozen=True)
class ArraySpec:
  """One per-layer cache array: its group and the shape of one block (without the block axis)."""
  layer: int
  name: str
  group: str
  block_shape: tuple[int, ...]
  dtype: Any

  @property
  def bytes_per_block(self) -> int:
    return int(np.prod(self.block_shape)) * jnp.dtype(self.dtype).itemsize


def layer_array_specs(config: ModelConfig, layout: CacheLayout, plan: LayerPlan) -> list[ArraySpec]:
  a, ix = config.attention, config.indexer
  sb, fb = layout.swa_block_tokens, layout.full_block_tokens
  out = [ArraySpec(plan.index, "window_kv", SWA, (sb, a.head_dim), layout.kv_dtype)]
  if plan.has_compressor and plan.ratio > 1:
    w = config.compressor_width(plan)
    out += [ArraySpec(plan.index, "comp_state_kv", SWA, (sb, w), jnp.float32),
            ArraySpec(plan.index, "comp_state_score", SWA, (sb, w), jnp.float32)]
  if plan.kind == "csa":  # V4 indexer has its own compressor
    w = config.index_compressor_width(plan)
    out += [ArraySpec(plan.index, "index_state_kv", SWA, (sb, w), jnp.float32),
            ArraySpec(plan.index, "index_state_score", SWA, (sb, w), jnp.float32)]
  if config.engram.layer_ids and plan.index == config.engram.layer_ids[0]:
    # V4.1 Engram hashes the previous max_ngram_size - 1 token ids: kept as SWA-group rows (one copy, on the first
    # Engram layer), read back through the block table like the window.
    out.append(ArraySpec(plan.index, "token_ids", SWA, (sb,), jnp.int32))
  if plan.has_compressor:
    out.append(ArraySpec(plan.index, "comp_kv", FULL, (fb // plan.ratio, a.head_dim), layout.kv_dtype))
  if plan.has_index_keys:
    out.append(ArraySpec(plan.index, "index_keys", FULL, (fb // plan.ratio, ix.head_dim), layout.kv_dtype))
  return out


def cache_array_specs(config: ModelConfig, layout: CacheLayout) -> list[ArraySpec]:
  layout.validate(config)
  return [s for p in config.layer_plan() for s in layer_array_specs(config, layout, p)]


def state_tail_tokens(config: ModelConfig) -> int:
  """Tokens before a resume point whose SWA-group rows the next step reads (window and compressor states)."""
  need = config.attention.window - 1
  if config.engram.layer_ids:
    need = max(need, config.engram.max_ngram_size - 1)
  for p in config.layer_plan():
    need = max(need, config.compressor_state_tokens(p) - 1)
  return need


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelCache:
  """Per layer a dict of paged arrays [num_blocks, *block_shape]. Goes in and comes out of the step."""
  layers: tuple[dict[str, jax.Array], ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BatchIndex:
  """Where each sequence of a step stands and which blocks back it.

  start_pos_B: position of the first token of this step's chunk; num_tokens_B: valid tokens in the chunk (the
  rest of the T axis is padding, never written). Block tables list block ids (-1 = none) per sequence.
  """
  start_pos_B: jax.Array
  num_tokens_B: jax.Array
  swa_table_BxS: jax.Array
  full_table_BxF: jax.Array


def init_cache(config: ModelConfig, layout: CacheLayout, num_swa_blocks: int, num_full_blocks: int) -> ModelCache:
  layers = [dict() for _ in range(config.num_layers)]
  for s in cache_array_specs(config, layout):
    n = num_swa_blocks if s.group == SWA else num_full_blocks
    fill = -jnp.inf if s.name.endswith("_score") else 0
    layers[s.layer][s.name] = jnp.full((n, *s.block_shape), fill, s.dtype)
  return ModelCache(tuple(layers))


def blocks_for(tokens: int, block_tokens: int) -> int:
  return max(1, math.ceil(tokens / block_tokens))


def contiguous_tables(batch: int, max_len: int, layout: CacheLayout) -> tuple[np.ndarray, np.ndarray]:
  """Identity block tables: sequence b owns blocks [b*n, (b+1)*n)."""
  ns, nf = blocks_for(max_len, layout.swa_block_tokens), blocks_for(max_len, layout.full_block_tokens)
  swa = np.arange(batch * ns, dtype=np.int32).reshape(batch, ns)
  full = np.arange(batch * nf, dtype=np.int32).reshape(batch, nf)
  return swa, full


def init_contiguous(config: ModelConfig, batch: int, max_len: int,
                    layout: CacheLayout = CacheLayout()) -> tuple[ModelCache, np.ndarray, np.ndarray]:
  """A cache for `batch` sequences of up to `max_len` tokens, plus its identity block tables."""
  swa, full = contiguous_tables(batch, max_len, layout)
  return init_cache(config, layout, swa.size, full.size), swa, full


# ----------------------------------------------------------------------------------------------------------
# How a step addresses the pools. A "slot" is a flat row index into a pool reshaped to [num_blocks * rows, ...];
# -1 means "no row" (padding, negative position, unallocated block). Writes to -1 are dropped; reads of -1 are
# masked by the caller.

def slots_for(table_BxS, index_BxT, rows_per_block: int, valid_BxT):
  """Flat pool rows for row `index` (token position or entry id) of each sequence, via its block table."""
  S = table_BxS.shape[1]
  blk = index_BxT // rows_per_block
  in_table = (index_BxT >= 0) & (blk < S)
  block_id = jnp.take_along_axis(table_BxS, jnp.clip(blk, 0, S - 1), axis=1)
  ok = valid_BxT & in_table & (block_id >= 0)
  return jnp.where(ok, block_id * rows_per_block + index_BxT % rows_per_block, -1).astype(jnp.int32)


def write_rows(pool_NBxRx_, slots_BxT, rows_BxTx_):
  """Scatter rows into a paged pool; slots of -1 are dropped (mapped out of bounds)."""
  nb, r = pool_NBxRx_.shape[:2]
  flat = pool_NBxRx_.reshape(nb * r, *pool_NBxRx_.shape[2:])
  idx = jnp.where(slots_BxT >= 0, slots_BxT, nb * r).reshape(-1)
  rows = rows_BxTx_.reshape(-1, *pool_NBxRx_.shape[2:]).astype(pool_NBxRx_.dtype)
  return flat.at[idx].set(rows, mode="drop").reshape(pool_NBxRx_.shape)


def read_rows(pool_NBxRx_, slots_BxT):
  nb, r = pool_NBxRx_.shape[:2]
  flat = pool_NBxRx_.reshape(nb * r, *pool_NBxRx_.shape[2:])
  return jnp.take(flat, jnp.clip(slots_BxT, 0, nb * r - 1), axis=0), slots_BxT >= 0


def flat_pool(pool_NBxRx_):
  return pool_NBxRx_.reshape(pool_NBxRx_.shape[0] * pool_NBxRx_.shape[1], *pool_NBxRx_.shape[2:])


# ---------------------------------------------------------------------------------------------------------------
# Group specs for the block allocator (cache/ works from these plain specs and never imports the model).

def _layout_fingerprint(config: ModelConfig, layout: CacheLayout, arrays: list[ArraySpec]) -> str:
  # Blocks are only interchangeable between engines whose arrays mean the same thing: hash the config and the
  # exact array shapes (not the weights; a different checkpoint must use a different `model` extra key).
  h = hashlib.blake2b(digest_size=8)
  h.update(repr(config).encode())
  h.update(repr((layout.swa_block_tokens, layout.full_block_tokens, str(layout.kv_dtype))).encode())
  h.update(repr([(a.layer, a.name, a.group, a.block_shape, str(a.dtype)) for a in arrays]).encode())
  return h.hexdigest()


@functools.cache
def group_specs(config: ModelConfig, layout: CacheLayout = CacheLayout()) -> CacheSpecs:
  """The model's paged groups as plain `cache.specs.CacheSpecs`: "full" (full history: compressed KV, indexer
  keys) and "swa" (sliding window: window rows + raw compressor projections; resume tail = state_tail_tokens)."""
  arrays = cache_array_specs(config, layout)
  full = [a for a in arrays if a.group == FULL]
  swa = [a for a in arrays if a.group == SWA]
  groups = []
  if full:  # a window-only model has no full-history group
    groups.append(GroupSpec(FULL, FULL_HISTORY, layout.full_block_tokens, sum(a.bytes_per_block for a in full), 0,
                            note=",".join(sorted({a.name for a in full}))))
  groups.append(GroupSpec(SWA, SLIDING_WINDOW, layout.swa_block_tokens, sum(a.bytes_per_block for a in swa),
                          state_tail_tokens(config), note=",".join(sorted({a.name for a in swa}))))
  return CacheSpecs(tuple(groups), _layout_fingerprint(config, layout, arrays))
