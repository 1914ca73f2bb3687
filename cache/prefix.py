"""Longest prefix hit across cache groups: jitted, batched over requests.

For a request with hash units u = 0..U-1 (a unit is `hash_tokens` tokens) the host passes per unit the device
key, the parent digest (128 bits) and the tokens. A block of a group with k units per block is block j =
units [jk, (j+1)k): key of its last unit, parent digest of its first unit, its tokens. A block is present iff
its pool's table holds a block with exactly that (key, parent, tokens).

* full-history groups: scan left to right from block 0, stop at the first miss (chained hashes make any miss
  final); the group supports every aligned L up to the end of its run.
* sliding-window groups: a resume at L needs only the `need` blocks before L. Candidates are tried from the
  largest aligned L the full groups allow, right to left in steps of the alignment.
* the hit is the largest aligned L (a multiple of lcm of the block sizes) that every group supports, capped by
  `max_len` (callers pass num_tokens - 1: the last prompt token is always recomputed for its logits).

Returns hit_B and, per group, block ids [B, U // k] (-1 where no block is needed: past the hit, and for
sliding-window groups before the tail). The compressor state at L is in those swa tail rows (specs.py), so the
hit is exact for every piece of state the next step reads.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cache import pool as P
from cache.specs import FULL_HISTORY, CacheSpecs


class GroupSearch(NamedTuple):
  """Static description of one group for the search."""
  kind: str
  units_per_block: int
  need_blocks: int


def group_searches(specs: CacheSpecs) -> tuple[GroupSearch, ...]:
  return tuple(GroupSearch(g.kind, g.block_tokens // specs.hash_tokens, g.need_blocks) for g in specs.groups)


def _search_one(pools, key_Ux2, parent_Ux4, tokens_UxG, max_len, groups, align, hash_tokens):
  num_units = key_Ux2.shape[0]
  g_tok = tokens_UxG.shape[1]

  def find(pool, upb, j):
    j = jnp.clip(j, 0, num_units // upb - 1)
    u0 = j * upb
    tok = jax.lax.dynamic_slice(tokens_UxG, (u0, 0), (upb, g_tok)).reshape(-1)
    return P._find(pool, key_Ux2[u0 + upb - 1], parent_Ux4[u0], tok)

  limit = jnp.minimum(max_len, num_units * hash_tokens) // align * align
  hit = limit
  for grp, pool in zip(groups, pools):
    if grp.kind != FULL_HISTORY:
      continue
    bt = grp.units_per_block * hash_tokens

    def cond(j, pool=pool, grp=grp, bt=bt):
      return ((j + 1) * bt <= limit) & (find(pool, grp.units_per_block, j) >= 0)

    run = jax.lax.while_loop(cond, lambda j: j + 1, jnp.int32(0))
    hit = jnp.minimum(hit, run * bt // align * align)

  def tail_ok(L):
    ok = jnp.bool_(True)
    for grp, pool in zip(groups, pools):
      if grp.kind == FULL_HISTORY:
        continue
      e = L // (grp.units_per_block * hash_tokens)
      for k in range(grp.need_blocks):
        j = e - grp.need_blocks + k
        ok &= (j < 0) | (find(pool, grp.units_per_block, j) >= 0)
    return ok

  hit = jax.lax.while_loop(lambda L: (L > 0) & ~tail_ok(L), lambda L: L - align, hit)

  ids = []
  for grp, pool in zip(groups, pools):
    nb = num_units // grp.units_per_block
    js = jnp.arange(nb)
    e = hit // (grp.units_per_block * hash_tokens)
    lo = 0 if grp.kind == FULL_HISTORY else jnp.maximum(0, e - grp.need_blocks)
    want = (js >= lo) & (js < e)
    ids.append(jnp.where(want, jax.vmap(lambda j, pool=pool, grp=grp: find(pool, grp.units_per_block, j))(js),
                         -1))
  return hit, tuple(ids)


@functools.partial(jax.jit, static_argnames=("groups", "align_tokens", "hash_tokens"))
def find_hits(pools, key_BxUx2, parent_BxUx4, tokens_BxUxG, max_len_B, *, groups, align_tokens, hash_tokens):
  """Batched hybrid prefix search. pools: tuple of PoolState in the order of `groups`. Pure (no claim)."""
  return jax.vmap(lambda k, p, t, m: _search_one(pools, k, p, t, m, groups, align_tokens, hash_tokens))(
      key_BxUx2, parent_BxUx4, tokens_BxUxG, max_len_B)
