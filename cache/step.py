"""One jitted call per engine step: every group's registrations, frees and allocations, plus the batched prefix
search of newly admitted requests, the claim of their hit blocks and their first allocation.

The manager queues a step's operations on the host (`GroupPlan` per group, `AdmitPlan` for admissions) and ships
them in one host->device transfer; the results come back in one device->host transfer. Order inside the call
(the order the host issued them in; see KVCacheManager):
  1. register   (blocks the requests still hold: commits / end-of-request checkpoints)
  2. free       (released blocks, eviction order)
  3. allocate   (counts queued by allocate_for since the last call)
  4. search + claim (admissions; pure search, then touch of every hit block, all groups, before any allocation)
  5. admission allocation: blocks to cover `target_B` tokens of each admitted request, all or nothing for the
     batch (if the pools cannot cover every admitted request, none is allocated and the host falls back to
     per-request allocate_for).
Each part costs O(ids it touches x probe length); nothing walks the pool (pool.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from cache import pool as P
from cache.prefix import search


class GroupPlan(NamedTuple):
  reg_ids_R: jax.Array
  reg_key_Rx2: jax.Array
  reg_par_Rx4: jax.Array
  reg_tok_RxT: jax.Array
  free_ids_F: jax.Array
  alloc_n: jax.Array          # scalar: blocks to allocate (width static: `alloc_widths`)


class AdmitPlan(NamedTuple):
  key_BxUx2: jax.Array
  par_BxUx4: jax.Array
  tok_BxUxG: jax.Array
  max_len_B: jax.Array
  target_B: jax.Array         # tokens to cover with blocks after the hit (-1: no admission allocation)


def _admit_need(hit_B, target_B, block_tokens):
  have = hit_B // block_tokens
  want = -(-jnp.maximum(target_B, 0) // block_tokens)
  return jnp.where(target_B >= 0, jnp.maximum(0, want - have), 0)


@functools.partial(jax.jit, donate_argnums=0,
                   static_argnames=("groups", "block_tokens", "align", "hash_tokens", "prepend", "alloc_widths",
                                    "admit_widths"))
def apply_step(pools, plans, admit, *, groups, block_tokens, align, hash_tokens, prepend, alloc_widths,
               admit_widths):
  """pools / plans: tuples in the order of `groups`; admit: AdmitPlan or None. Returns (pools, results)."""
  pools = list(pools)
  res = {"status": [], "alloc_ids": [], "alloc_ev": [], "alloc_ok": [], "free_ok": []}
  for i, plan in enumerate(plans):
    st = pools[i]
    st, status = P._register_core(st, plan.reg_ids_R, plan.reg_key_Rx2, plan.reg_par_Rx4, plan.reg_tok_RxT)
    # register read ref_N (held blocks) and free writes it: make the write depend on that read so that XLA keeps
    # ref_N in place (pool.py, `_after`)
    st, fok = P._free_core(st, P._after(plan.free_ids_F, -1, status), prepend)
    st, ids, ev, aok = P._allocate_core(st, plan.alloc_n, alloc_widths[i])
    pools[i] = st
    res["status"].append(status)
    res["free_ok"].append(fok)
    res["alloc_ids"].append(ids)
    res["alloc_ev"].append(ev)
    res["alloc_ok"].append(aok)
  if admit is not None:
    hit, run, ids = search(tuple(pools), admit.key_BxUx2, admit.par_BxUx4, admit.tok_BxUxG, admit.max_len_B,
                           groups, align, hash_tokens)
    res["hit"], res["run"], res["hit_ids"] = hit, run, ids
    for i in range(len(pools)):
      pools[i], _ = P._touch_core(pools[i], ids[i].reshape(-1))
    needs = [_admit_need(hit, admit.target_B, bt) for bt in block_tokens]
    ok = jnp.bool_(True)
    for i in range(len(pools)):
      ok &= jnp.sum(needs[i]) <= pools[i].num_free
    res["admit_ok"] = ok
    res["admit_ids"], res["admit_ev"] = [], []
    for i in range(len(pools)):
      n = jnp.where(ok, jnp.sum(needs[i]), 0)
      pools[i], aids, aev, _ = P._allocate_core(pools[i], n, admit_widths[i])
      res["admit_ids"].append(aids)
      res["admit_ev"].append(aev)
  res["num_free"] = [p.num_free for p in pools]
  return tuple(pools), res
