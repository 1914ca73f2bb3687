"""The invariant step's tiles: the step plan's flat token axis cut into fixed tiles of `RaggedShape.tile` tokens,
each run as a step of its own through the same fixed-shape program, in order, in a device loop over the live tiles
(docs/engine.md, the invariant step). `step_program` runs the model this way; `speculative_step` its
verification pass and the MTP block's catch-up."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4 import caches
from dsv4.engine.step_plan import RaggedShape


def tile_index(p, i, tile: int, rows) -> tuple[jax.Array, caches.StepIndex]:
  """Tile i of a packed plan as a step of its own: its `tile` flat tokens, and per row the part of the row's
  tokens that falls in the tile (start and count; 0 = the row is not in this tile). A row's tokens are contiguous
  on the flat axis, so a row cut by a tile boundary continues in the next tile exactly as a chunked prefill
  continues in the next step: its KV and compressor state rows are in the cache by then."""
  o = i * tile
  toks = jax.lax.dynamic_slice_in_dim(p["tokens"], o, tile)
  row = jax.lax.dynamic_slice_in_dim(p["row"], o, tile)
  pos = jax.lax.dynamic_slice_in_dim(p["pos"], o, tile)
  first = p["last"] - p["num"] + 1                  # flat offset of each row's first token
  lo = jnp.maximum(first, o)
  hi = jnp.minimum(first + p["num"], o + tile)
  num = jnp.where(p["num"] > 0, jnp.maximum(hi - lo, 0), 0)
  start = p["start"] + jnp.maximum(lo - first, 0)
  return toks, caches.StepIndex(row, pos, start, num, rows, swa_base_R=p["swa_base"], full_row_R=p.get("full_row"),
                                invariant=True)


def tiled(fn, p, rows, cache, shape: RaggedShape):
  """The invariant body: the flat axis in fixed tiles of `shape.tile` tokens, each through the same fixed-shape
  `fn(i, tokens_T, step, cache) -> (cache, outputs)` (outputs: a pytree of per-token arrays [T, ...]), in order,
  in a device loop whose trip count is the live tile count (padding: at most one tile). Returns (cache, outputs
  assembled over the flat axis [N, ...]; rows past the live tiles are zeros).

  Every matmul of a token has the tile's shape whatever the step holds, attention and the indexer read fixed-width
  tables (`RaggedShape.full_width` is the engine's maximum) over fixed blocks, and the compressors fold in position
  order, so a token's outputs have the same bits alone, batched, or cut into other chunks."""
  T = shape.tile
  num_tiles = (p["n_real"][0] + T - 1) // T
  out_shapes = jax.eval_shape(lambda c: fn(0, *tile_index(p, 0, T, rows), c)[1], cache)
  outs0 = jax.tree_util.tree_map(lambda a: jnp.zeros((shape.tokens, *a.shape[1:]), a.dtype), out_shapes)

  def body(i, carry):
    cache, outs = carry
    cache, got = fn(i, *tile_index(p, i, T, rows), cache)
    outs = jax.tree_util.tree_map(lambda o, g: jax.lax.dynamic_update_slice_in_dim(o, g.astype(o.dtype), i * T, 0),
                                  outs, got)
    return cache, outs

  return jax.lax.fori_loop(0, num_tiles, body, (cache, outs0))
