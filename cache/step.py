"""One jitted call per engine step: every group's registrations, frees and allocations, plus the batched prefix
search of newly admitted requests, the claim of their hit blocks and their first allocation.

The manager queues a step's operations on the host (`GroupPlan` per group, `AdmitPlan` for admissions) and ships
them in one host->device transfer; the results come back in one device->host transfer: `apply_step_packed` takes
every plan array carved out of ONE int32 buffer (`InputCarver`, static offsets) and returns every result packed
into ONE int32 buffer (`unpack` gives numpy views on the host). `apply_step` is the same step with pytrees in and out
(tests, direct use). Order inside the call
(the order the host issued them in; see KVCacheManager):
  1. register   (blocks the requests still hold: commits / end-of-request checkpoints)
  2. free       (released blocks, eviction order)
  3. allocate   (counts queued by allocate_for since the last call)
  4. search + claim (admissions; pure search, then touch of every hit block, all groups, before any allocation;
     sliding groups touch only the tail a resume reads, `[B, need_blocks]`, and return only that tail)
  5. admission allocation: blocks to cover `target_B` tokens of each admitted request, all or nothing for the
     batch (if the pools cannot cover every admitted request, none is allocated and the host falls back to
     per-request allocate_for).
Each part costs O(ids it touches x probe length); nothing walks the pool (pool.py).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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


_STATIC = ("groups", "block_tokens", "align", "hash_tokens", "prepend", "alloc_widths", "admit_widths")


def step_core(pools, plans, admit, *, groups, block_tokens, align, hash_tokens, prepend, alloc_widths,
              admit_widths):
  """pools / plans: tuples in the order of `groups`; admit: AdmitPlan or None. Returns (pools, results).
  results["hit_ids"]: per group, full-history groups [B, U // k] (-1 past the hit), sliding groups the tail only,
  [B, need_blocks] (see prefix.search, compact form)."""
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
    hit, run, _, ids = search(tuple(pools), admit.key_BxUx2, admit.par_BxUx4, admit.tok_BxUxG, admit.max_len_B,
                              groups, align, hash_tokens)
    res["hit"], res["run"], res["hit_ids"] = hit, run, ids
    for i in range(len(pools)):     # sliding groups: only the tail ids (not the scattered [B, U // k] table)
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


apply_step = jax.jit(step_core, donate_argnums=0, static_argnames=_STATIC)


# ---------------------------------------------------------------------------------------------------------
# One buffer in, one buffer out. Layout = (treedef, shapes[, dtypes]); every leaf is int32 (bools as 0 / 1).

class InputCarver:
  """Carves the plan arrays of one step out of ONE host int32 buffer, in pytree leaf order, so the whole plan is a
  single host->device transfer with no concatenation copy. `take(shape)` returns an uninitialised view (callers
  fill every element); `buf` / `shapes` after the last take."""

  def __init__(self, shapes):
    self.shapes = tuple(tuple(int(d) for d in sh) for sh in shapes)
    sizes = [math.prod(sh) for sh in self.shapes]
    self.buf = np.empty(sum(sizes), np.int32)
    self._off = np.cumsum([0] + sizes).tolist()
    self._k = 0

  def take(self, shape):
    k = self._k
    if tuple(shape) != self.shapes[k]:
      raise ValueError(f"InputCarver: leaf {k} has shape {tuple(shape)}, layout says {self.shapes[k]}")
    self._k += 1
    return self.buf[self._off[k]:self._off[k + 1]].reshape(shape)


def unpack(buf, treedef, shapes, dtypes=None):
  """The pytree packed by `_pack_device` / an InputCarver: slices of `buf` (numpy views on the host, static slices
  in a jit). dtypes: bool leaves come back as bool (host: a small copy)."""
  leaves, o = [], 0
  for k, sh in enumerate(shapes):
    n = math.prod(sh)
    x = buf[o:o + n].reshape(sh)
    if dtypes is not None and dtypes[k] == np.dtype(bool):
      x = x != 0
    leaves.append(x)
    o += n
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _pack_device(tree):
  leaves = jax.tree_util.tree_leaves(tree)
  return jnp.concatenate([jnp.ravel(x).astype(jnp.int32) for x in leaves]) if leaves else jnp.zeros(0, jnp.int32)


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("in_layout",) + _STATIC)
def apply_step_packed(pools, buf, *, in_layout, groups, block_tokens, align, hash_tokens, prepend, alloc_widths,
                      admit_widths):
  """`step_core` with (plans, admit) unpacked from one int32 buffer (in_layout = (treedef, shapes), static) and
  every result packed into one int32 buffer (layout: `result_layout`)."""
  plans, admit = unpack(buf, *in_layout)
  pools, res = step_core(pools, plans, admit, groups=groups, block_tokens=block_tokens, align=align,
                         hash_tokens=hash_tokens, prepend=prepend, alloc_widths=alloc_widths,
                         admit_widths=admit_widths)
  return pools, _pack_device(res)


def result_layout(pools, in_layout, **kw):
  """(treedef, shapes, dtypes) of `apply_step_packed`'s result buffer (abstract evaluation; cache it per
  in_layout and statics)."""
  treedef, shapes = in_layout
  args = jax.tree_util.tree_unflatten(treedef, [jax.ShapeDtypeStruct(sh, jnp.int32) for sh in shapes])
  out = jax.eval_shape(functools.partial(step_core, **kw), pools, *args)[1]
  leaves, rdef = jax.tree_util.tree_flatten(out)
  return rdef, tuple(x.shape for x in leaves), tuple(np.dtype(x.dtype) for x in leaves)
