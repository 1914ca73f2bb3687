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
import importlib.metadata
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cache import pool
from cache.prefix import search_rows
from cache.specs import FULL_HISTORY


class GroupPlan(NamedTuple):
  """One group's queued work, addressed by block-table position, never by block id: a ref is `slot * W + j` into
  the group's tables [S, W] (entry j of the request in slot `slot`), -1 = padding. The device resolves refs to ids,
  so the host never needs to know which block a request holds."""
  reg_ref_R: jax.Array        # blocks to register (the id is read from the table)
  reg_key_Rx2: jax.Array
  reg_par_Rx4: jax.Array
  reg_tok_RxT: jax.Array
  free_run_Fx4: jax.Array     # runs (slot, a, b, entries through this run) to release, in order, each entry b - 1
                              # down to a (eviction order); a released entry becomes -1; a = b: padding
  alloc_ref_A: jax.Array      # entries to fill with newly allocated blocks, packed at the front (count = refs >= 0)


class AdmitPlan(NamedTuple):
  key_BxUx2: jax.Array
  par_BxUx4: jax.Array
  tok_BxUxG: jax.Array
  max_len_B: jax.Array
  target_B: jax.Array         # tokens to cover with blocks after the hit (-1: no admission allocation)
  slot_B: jax.Array           # table row that receives the request's hit (and allocated) blocks; -1 = padding


def _admit_need(hit_B, target_B, block_tokens):
  have = hit_B // block_tokens
  want = -(-jnp.maximum(target_B, 0) // block_tokens)
  return jnp.where(target_B >= 0, jnp.maximum(0, want - have), 0)


def resolve(table_SxW, ref_M):
  """Block ids at table positions (-1 for padding refs)."""
  flat = table_SxW.reshape(-1)
  return jnp.where(ref_M >= 0, flat[jnp.clip(ref_M, 0, flat.shape[0] - 1)], -1)


def _write(table_SxW, ref_M, ids_M):
  s, w = table_SxW.shape
  flat = table_SxW.reshape(-1)
  return flat.at[jnp.where(ref_M >= 0, ref_M, s * w)].set(ids_M, mode="drop").reshape(s, w)


_STATIC = ("groups", "block_tokens", "align", "hash_tokens", "prepend", "admit_widths", "free_chunks")


def _free_runs(st, tab, run_Fx4, chunk, prepend, after):
  """Release the runs' table entries in order (each run b - 1 down to a) as a device loop over fixed chunks of
  `chunk` entries whose trip count is the live entry count: a request's end releases all its blocks as ONE run, so
  the work follows the entries released, never a width sized for the longest request. Each chunk is one release
  (`pool._free_core`: cached blocks join the LRU ring in list order, so chunking leaves the ring as one release
  would; uncached ones go on the stack with the chunk's first entry on top). run_Fx4 rows: (slot, a, b, entries
  through this run) (the host's running sum; padding rows a = b and the total). `after`: values the loop must
  follow (the registrations' reads of the same arrays; see pool._after). Returns (state, table, no chunk
  refused)."""
  s_F, a_F, b_F, ends_F = run_Fx4[:, 0], run_Fx4[:, 1], run_Fx4[:, 2], run_Fx4[:, 3]
  f = run_Fx4.shape[0]
  w = tab.shape[1]
  total = ends_F[-1]
  trips = jnp.where(jnp.all(after != pool._NEVER), (total + chunk - 1) // chunk, 0)
  k_C = jnp.arange(chunk, dtype=jnp.int32)

  def body(c):
    k, st, tab, ok = c
    e_C = k * chunk + k_C
    # the run of each entry, #{runs ending at or before it}: every run's end counted at its place in the chunk (ends
    # before the chunk at 0, after it dropped), then a running sum: O(runs + chunk), where a compare of every entry
    # with every run it may touch grew as chunk x runs and made wide chunks slower than many narrow ones
    at = jnp.clip(ends_F - k * chunk, 0, chunk)
    r_C = jnp.minimum(jnp.cumsum(jnp.zeros(chunk, jnp.int32).at[at].add(1, mode="drop")), f - 1)
    ent_C = ends_F[r_C] - 1 - e_C + a_F[r_C]      # b - 1 at the run's first entry, a at its last
    ref_C = jnp.where(e_C < total, s_F[r_C] * w + ent_C, -1)
    ids_C = resolve(tab, ref_C)
    st, fok = pool._free_core(st, ids_C, prepend)
    tab = _write(tab, pool._after(ref_C, -1, ids_C), jnp.full_like(ids_C, -1))
    return k + 1, st, tab, ok & fok

  _, st, tab, ok = jax.lax.while_loop(lambda c: c[0] < trips, body, (jnp.int32(0), st, tab, jnp.bool_(True)))
  return st, tab, ok


def step_core(pools, tables, plans, admit, *, groups, block_tokens, align, hash_tokens, prepend, admit_widths,
              free_chunks):
  """pools / tables / plans: tuples in the order of `groups`; admit: AdmitPlan or None. Returns (pools, tables,
  results). results["hit_ids"]: per group, full-history groups [B, U // k] (-1 past the hit), sliding groups the
  tail only, [B, need_blocks] (see prefix.search, compact form). Hit and allocated ids are also written into the
  admitted requests' table rows."""
  pools, tables = list(pools), list(tables)
  res = {"status": [], "reg_ids": [], "alloc_ids": [], "alloc_ev": [], "alloc_ok": [], "free_ok": []}
  for i, plan in enumerate(plans):
    st, tab = pools[i], tables[i]
    reg_ids = resolve(tab, plan.reg_ref_R)
    st, status = pool._register_chunks(st, reg_ids, plan.reg_key_Rx2, plan.reg_par_Rx4, plan.reg_tok_RxT)
    # register read ref_N (held blocks) and the releases write it: the loop follows that read so that XLA keeps
    # ref_N in place (pool.py, `_after`)
    st, tab, fok = _free_runs(st, tab, plan.free_run_Fx4, free_chunks[i], prepend, jnp.concatenate([status, reg_ids]))
    n = jnp.sum(plan.alloc_ref_A >= 0, dtype=jnp.int32)
    st, ids, ev, aok = pool._allocate_core(st, n, plan.alloc_ref_A.shape[0])
    tab = _write(tab, plan.alloc_ref_A, ids)
    pools[i], tables[i] = st, tab
    res["status"].append(status)
    res["reg_ids"].append(reg_ids)
    res["free_ok"].append(fok)
    res["alloc_ids"].append(ids)
    res["alloc_ev"].append(ev)
    res["alloc_ok"].append(aok)
  if admit is not None:
    hit, run, _, ids = search_rows(tuple(pools), admit.key_BxUx2, admit.par_BxUx4, admit.tok_BxUxG, admit.max_len_B,
                              groups, align, hash_tokens)
    res["hit"], res["run"], res["hit_ids"] = hit, run, ids
    b = admit.slot_B.shape[0]
    for i, grp in enumerate(groups):     # sliding groups: only the tail ids (not the scattered [B, U // k] table)
      pools[i], _ = pool._touch_core(pools[i], ids[i].reshape(-1))
      w = tables[i].shape[1]
      k = ids[i].shape[1]
      if grp.kind == FULL_HISTORY:
        j = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32)[None], (b, k))
      else:
        e = hit // (grp.units_per_block * hash_tokens)
        j = e[:, None] - k + jnp.arange(k, dtype=jnp.int32)[None]
      ok = (admit.slot_B[:, None] >= 0) & (j >= 0) & (j < w) & (ids[i] >= 0)
      tables[i] = _write(tables[i], jnp.where(ok, admit.slot_B[:, None] * w + j, -1).reshape(-1),
                         ids[i].reshape(-1))
    needs = [_admit_need(hit, admit.target_B, bt) for bt in block_tokens]
    ok = jnp.bool_(True)
    for i in range(len(pools)):
      ok &= jnp.sum(needs[i]) <= pools[i].num_free
    res["admit_ok"] = ok
    res["admit_ids"], res["admit_ev"] = [], []
    for i in range(len(pools)):
      need = jnp.where(ok, needs[i], 0)
      n = jnp.sum(need)
      pools[i], aids, aev, _ = pool._allocate_core(pools[i], n, admit_widths[i])
      # allocated entry k goes to request r (cumulative needs) at table index have_r + (k - first_r)
      w = tables[i].shape[1]
      kk = jnp.arange(admit_widths[i], dtype=jnp.int32)
      ends = jnp.cumsum(need)
      # searchsorted(ends, kk, side="right") as one compare-and-count ([widths, B] is small): jnp's searchsorted
      # lowers to a while loop of many tiny thunks
      r = jnp.minimum(jnp.sum(ends[None, :] <= kk[:, None], axis=1, dtype=jnp.int32), b - 1)
      j = hit[r] // block_tokens[i] + kk - (ends[r] - need[r])
      ref = jnp.where((kk < n) & (j < w), admit.slot_B[r] * w + j, -1)
      tables[i] = _write(tables[i], ref, aids)
      res["admit_ids"].append(aids)
      res["admit_ev"].append(aev)
  res["num_free"] = [p.num_free for p in pools]
  return tuple(pools), tuple(tables), res


apply_step = jax.jit(step_core, donate_argnums=(0, 1), static_argnames=_STATIC)


# ---------------------------------------------------------------------------------------------------------
# One buffer in, one buffer out. Layout = (treedef, shapes[, dtypes]); every leaf is int32 (bools as 0 / 1).

class InputCarver:
  """Carves the plan arrays of one step out of ONE host int32 buffer, in pytree leaf order, so the whole plan is a
  single host->device transfer with no concatenation copy. `take(shape)` returns an uninitialised view (callers
  fill every element); `buf` / `shapes` after the last take."""

  def __init__(self, shapes):
    # plain Python: a step carves a few dozen leaves, where numpy's per-call cost would dominate
    self.shapes = tuple(tuple(map(int, sh)) for sh in shapes)
    self._off = off = [0]
    for sh in self.shapes:
      off.append(off[-1] + math.prod(sh))
    self.buf = np.empty(off[-1], np.int32)
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


def step_packed(pools, tables, buf, *, in_layout, results="all", **statics):
  """`step_core` with (plans, admit) unpacked from one int32 buffer (in_layout = (treedef, shapes), static) and
  its results packed into one int32 buffer (layout: `result_layout`). Traceable: the engine's step program calls
  it before the model. results="counts": only the counters a host that keeps counts needs (free blocks, refusals,
  duplicate / table-full registrations per group), not the ids ("all": events and tiers need them)."""
  plans, admit = unpack(buf, *in_layout)
  pools, tables, res = step_core(pools, tables, plans, admit, **statics)
  if results == "counts":
    res = counters(res)
  return pools, tables, _pack_device(res)


def counters(res):
  """Per group [num_free, register refused, free refused, allocate refused, duplicates, table full]."""
  out = []
  for i in range(len(res["num_free"])):
    st = res["status"][i]
    out.append(jnp.stack([res["num_free"][i], jnp.sum(st == pool.INVALID), (~res["free_ok"][i]).astype(jnp.int32),
                          (~res["alloc_ok"][i]).astype(jnp.int32), jnp.sum(st == pool.DUPLICATE),
                          jnp.sum(st == pool.TABLE_FULL)]).astype(jnp.int32))
  out = {"counters": out}
  if "hit" in res:         # admissions carried: their hits, runs and claimed ids (the host builds their state)
    out.update({k: res[k] for k in ("hit", "run", "hit_ids", "admit_ok")})
  return out


def _cpu_compiler_options() -> dict:
  # Integer loops over a few hundred entries, where LLVM's optimisation costs more than it returns (the main job's
  # admission program: 24 -> 9 s of compile on a loaded 2-core box, its bookkeeping program 11 -> 5 s), and the
  # program is hundreds of small fusions, each its own LLVM module: XLA's older elemental emitter generates them
  # faster than the MLIR fusion emitters (about 3.5 -> 2.1 s and 2.2 -> 1.3 s more). Runtime: BUILD_NOTES.md,
  # Compile time. The emitter flag only on the jaxlib line it was checked on: XLA refuses an option it does not know.
  options = {"xla_backend_optimization_level": 0}
  try:
    if importlib.metadata.version("jaxlib").startswith("0.10."):
      options["xla_cpu_use_fusion_emitters"] = False
  except importlib.metadata.PackageNotFoundError:
    pass
  return options


# XLA options of the bookkeeping programs on the CPU; other backends keep XLA's defaults. None = XLA's defaults on
# the CPU too.
CPU_COMPILER_OPTIONS: dict | None = _cpu_compiler_options()


@functools.cache
def _jitted_step_packed(backend: str, options: tuple):
  return jax.jit(step_packed, donate_argnums=(0, 1), static_argnames=("in_layout", "results") + _STATIC,
                 compiler_options=dict(options) or None)


def jitted_step_packed():
  """The jitted `step_packed` of the default backend (pools and tables donated; compile logs name it
  `jit(step_packed)`), with that backend's compiler options."""
  backend = jax.default_backend()
  options = CPU_COMPILER_OPTIONS if backend == "cpu" and CPU_COMPILER_OPTIONS else {}
  return _jitted_step_packed(backend, tuple(sorted(options.items())))


def apply_step_packed(pools, tables, buf, **kw):
  """Runs `step_packed` jitted (`jitted_step_packed`)."""
  return jitted_step_packed()(pools, tables, buf, **kw)


_RESULT_LAYOUTS: dict = {}


def result_layout(pools, tables, in_layout, results="all", **kw):
  """(treedef, shapes, dtypes) of `step_packed`'s result buffer. Abstract evaluation traces the whole step (about
  half a second on a CPU), so layouts are memoised here by the abstract signature, shared by every manager of the
  process (an engine, a test, a benchmark point builds managers again and again with the same shapes)."""
  leaves, tdef = jax.tree_util.tree_flatten((pools, tables))
  key = (tdef, tuple((x.shape, np.dtype(x.dtype)) for x in leaves), in_layout, results, tuple(sorted(kw.items())))
  if key not in _RESULT_LAYOUTS:
    _RESULT_LAYOUTS[key] = _result_layout(pools, tables, in_layout, results, **kw)
  return _RESULT_LAYOUTS[key]


def _result_layout(pools, tables, in_layout, results, **kw):
  treedef, shapes = in_layout
  args = jax.tree_util.tree_unflatten(treedef, [jax.ShapeDtypeStruct(sh, jnp.int32) for sh in shapes])
  out = jax.eval_shape(functools.partial(step_core, **kw), pools, tables, *args)[2]
  if results == "counts":
    out = jax.eval_shape(counters, out)
  leaves, rdef = jax.tree_util.tree_flatten(out)
  return rdef, tuple(x.shape for x in leaves), tuple(np.dtype(x.dtype) for x in leaves)
