"""Longest prefix hit across cache groups: jitted, batched over requests, reading only what a hit needs.

For a request with hash units u = 0..U-1 (a unit is `hash_tokens` tokens) the host passes per unit the device
key, the parent digest (128 bits) and the tokens. A block of a group with k units per block is block j =
units [jk, (j+1)k): key of its last unit, parent digest of its first unit, its tokens. A block is present iff
its pool's table holds a block with exactly that (key, parent, tokens).

* full-history groups: ONE batched lookup of every block of every request (vectorised probing); the run is the
  leading present blocks (chained hashes make any miss final); it supports every aligned L up to its end.
* sliding-window groups: a resume at L needs only the `need` blocks before L. Candidates are tried from the
  largest aligned L the full groups allow, right to left in steps of the alignment; each step looks up only the
  tail blocks of the candidates still open (all requests at once).
* the hit is the largest aligned L (a multiple of lcm of the block sizes) that every group supports, capped by
  `max_len` (callers pass num_tokens - 1: the last prompt token is always recomputed for its logits).

Returns hit_B, the full-history run (aligned, capped; where a hit would end if every sliding tail existed: the
"junction" the checkpoint policy pins) and, per group, block ids [B, U // k] (-1 where no block is needed: past
the hit, and for sliding-window groups before the tail).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cache import pool
from cache.specs import FULL_HISTORY, CacheSpecs


class GroupSearch(NamedTuple):
  """Static description of one group for the search."""
  kind: str
  units_per_block: int
  need_blocks: int


def group_searches(specs: CacheSpecs) -> tuple[GroupSearch, ...]:
  return tuple(GroupSearch(g.kind, g.block_tokens // specs.hash_tokens, g.need_blocks) for g in specs.groups)


def _block_idents(key_BxUx2, parent_BxUx4, tokens_BxUxG, upb, j_BxK):
  """(key, parent, tokens) of blocks j (shape [B, K]) of a group with `upb` units per block, flattened to B*K."""
  b, u, g = tokens_BxUxG.shape
  nb = u // upb
  j = jnp.clip(j_BxK, 0, nb - 1)
  bi = jnp.arange(b)[:, None]
  key = key_BxUx2[bi, j * upb + upb - 1]
  par = parent_BxUx4[bi, j * upb]
  tok = tokens_BxUxG.reshape(b, nb, upb * g)[bi, j]
  k = j_BxK.shape[1]
  return key.reshape(b * k, 2), par.reshape(b * k, -1), tok.reshape(b * k, -1)


def _all_block_idents(key_BxUx2, parent_BxUx4, tokens_BxUxG, upb):
  """`_block_idents` of every block (j = 0 .. U // upb - 1) as strided slices and a reshape: no gather over the
  request's tokens (at XLA's level 0 on the CPU a gather costs per element, a reshape nothing)."""
  b, u, g = tokens_BxUxG.shape
  nb = u // upb
  key = key_BxUx2[:, upb - 1:nb * upb:upb]
  par = parent_BxUx4[:, :nb * upb:upb]
  return key.reshape(b * nb, 2), par.reshape(b * nb, -1), tokens_BxUxG.reshape(b * nb, upb * g)


def _lookup(pool_state, key_BxUx2, parent_BxUx4, tokens_BxUxG, upb, j_BxK):
  ids = pool.lookup_blocks(pool_state, *_block_idents(key_BxUx2, parent_BxUx4, tokens_BxUxG, upb, j_BxK))
  return ids.reshape(j_BxK.shape)


def search(pools, key_BxUx2, parent_BxUx4, tokens_BxUxG, max_len_B, groups, align, hash_tokens):
  """Traceable batched search (see module doc). Returns (hit_B, full_run_B, ids per group, compact ids per
  group): the compact form is the same ids for full-history groups and only the tail, [B, need_blocks] (blocks
  e - need .. e - 1 for e = hit // block_tokens, -1 where missing or < 0), for sliding-window groups."""
  b, num_units, _ = key_BxUx2.shape
  limit = jnp.minimum(max_len_B, num_units * hash_tokens) // align * align
  run_tokens = limit
  full_ids = {}
  for gi, (grp, pool_state) in enumerate(zip(groups, pools)):
    if grp.kind != FULL_HISTORY:
      continue
    bt = grp.units_per_block * hash_tokens
    nb = num_units // grp.units_per_block
    ids = pool.lookup_blocks(pool_state, *_all_block_idents(key_BxUx2, parent_BxUx4, tokens_BxUxG,
                                                            grp.units_per_block)).reshape(b, nb)
    run = jnp.sum(jnp.cumprod(ids >= 0, axis=1), axis=1)
    run_tokens = jnp.minimum(run_tokens, run * bt // align * align)
    full_ids[gi] = ids
  sliding = [(gi, grp, pool_state) for gi, (grp, pool_state) in enumerate(zip(groups, pools))
             if grp.kind != FULL_HISTORY]

  def tails(L_B):
    """Per sliding group the tail ids at L (-1 = missing or not needed) and whether every tail is present."""
    ok = jnp.ones(b, bool)
    out = []
    for gi, grp, pool_state in sliding:
      e = L_B // (grp.units_per_block * hash_tokens)
      js = e[:, None] - grp.need_blocks + jnp.arange(grp.need_blocks)[None]
      ids = _lookup(pool_state, key_BxUx2, parent_BxUx4, tokens_BxUxG, grp.units_per_block, js)
      ids = jnp.where(js >= 0, ids, -1)
      ok &= jnp.all((js < 0) | (ids >= 0), axis=1)
      out.append(ids)
    return ok, out

  hit = run_tokens
  tail_ids = [jnp.full((b, grp.need_blocks), -1, jnp.int32) for _, grp, _ in sliding]
  if sliding:
    def cond(c):
      return jnp.any(c[1])

    def body(c):
      L, open_, kept = c
      ok, ids = tails(L)
      done = open_ & (ok | (L <= 0))
      kept = [jnp.where(done[:, None], i, k) for i, k in zip(ids, kept)]
      L = jnp.where(open_ & ~done, L - align, L)
      return L, open_ & ~done, kept

    hit, _, tail_ids = jax.lax.while_loop(cond, body, (hit, jnp.ones(b, bool), tail_ids))
    hit = jnp.maximum(hit, 0)
  out, compact = [], []
  si = 0
  for gi, grp in enumerate(groups):
    nb = num_units // grp.units_per_block
    e = hit // (grp.units_per_block * hash_tokens)
    js = jnp.arange(nb)[None]
    if grp.kind == FULL_HISTORY:
      out.append(jnp.where(js < e[:, None], full_ids[gi], -1))
      compact.append(out[-1])
    else:
      t = tail_ids[si]
      si += 1
      tj = e[:, None] - grp.need_blocks + jnp.arange(grp.need_blocks)[None]
      rows = jnp.broadcast_to(jnp.arange(b)[:, None], tj.shape)
      keep = (tj >= 0) & (e[:, None] > 0)
      ids = jnp.full((b, nb), -1, jnp.int32).at[rows, jnp.where(keep, tj, nb)].set(t, mode="drop")
      out.append(ids)
      compact.append(jnp.where(keep, t, -1))
  return hit, run_tokens, tuple(out), tuple(compact)


SEARCH_ROW_CHUNKS = 2      # `search_rows`: batches of at least 16 rows are searched in this many chunks


def search_rows(pools, key_BxUx2, parent_BxUx4, tokens_BxUxG, max_len_B, groups, align, hash_tokens,
                chunks: int = SEARCH_ROW_CHUNKS, min_rows: int = 16):
  """`search` chunk of rows after chunk, only up to the last row that can hit (an aligned limit > 0): the same
  results, since rows are searched independently and a row with limit 0 (padding: max_len 0) gets hit 0, run 0 and
  no ids. An engine admits at one fixed batch width (`ADMIT_ROWS_FIXED`), mostly padding rows, and a search costs
  per row (every block's tokens are compared)."""
  b, num_units, _ = key_BxUx2.shape
  args = (key_BxUx2, parent_BxUx4, tokens_BxUxG, max_len_B)
  if b < min_rows or b % chunks:
    return search(pools, *args, groups, align, hash_tokens)
  c = b // chunks
  limit = jnp.minimum(max_len_B, num_units * hash_tokens) // align * align
  n = (jnp.max(jnp.where(limit > 0, jnp.arange(b, dtype=jnp.int32), -1)) + c) // c   # chunks up to the last live row
  shapes = jax.eval_shape(lambda: search(pools, *args, groups, align, hash_tokens))
  hit, run, out, compact = shapes
  init = (jnp.zeros(hit.shape, hit.dtype), jnp.zeros(run.shape, run.dtype),
          tuple(jnp.full(x.shape, -1, x.dtype) for x in out), tuple(jnp.full(x.shape, -1, x.dtype) for x in compact))

  def body(carry):
    k, res = carry
    part = search(pools, *(jax.lax.dynamic_slice_in_dim(x, k * c, c) for x in args), groups, align, hash_tokens)
    res = jax.tree.map(lambda r, p: jax.lax.dynamic_update_slice_in_dim(r, p.astype(r.dtype), k * c, 0), res, part)
    return k + 1, res

  return jax.lax.while_loop(lambda carry: carry[0] < n, body, (jnp.int32(0), init))[1]


@functools.partial(jax.jit, static_argnames=("groups", "align_tokens", "hash_tokens"))
def find_hits(pools, key_BxUx2, parent_BxUx4, tokens_BxUxG, max_len_B, *, groups, align_tokens, hash_tokens):
  """Batched hybrid prefix search. pools: tuple of PoolState in the order of `groups`. Pure (no claim).
  Returns (hit_B, ids per group)."""
  hit, _, ids, _ = search(pools, key_BxUx2, parent_BxUx4, tokens_BxUxG, max_len_B, groups, align_tokens, hash_tokens)
  return hit, ids
