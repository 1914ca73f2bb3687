"""KVCacheManager: the host-side planner of the paged KV cache. The DEVICE owns the state: one block pool per
cache group (jitted, donated arrays) and every request's block tables (`[slots, table blocks]` int32 per group).
The host keeps counts (blocks per request and group, which table entries a request holds, exact-or-conservative
free counts) and hashes, and never needs a block id: every queued operation names table positions
(slot, entry), which the device resolves.

It works from plain `cache.specs.CacheSpecs` (any number of full-history and sliding-window groups); the model
side builds them (`dsv4.caches.group_specs(config, layout)`).

Lifecycle of a request (all token counts are absolute positions in the request):

    mgr = KVCacheManager(specs, num_blocks={"full": ..., "swa": ...}, retention_interval=0)
    hit = mgr.add_request("r1", prompt_ids, ExtraKeys(tenant="t"))   # lookup + claim; hit.num_tokens to skip
    ok = mgr.allocate_for("r1", n)             # blocks covering positions [0, num_computed + n), or OutOfBlocks
                                               # (nothing changed: the scheduler waits or preempts)
    ... model step writes KV for the chunk (its tables: mgr.slot_of("r1") rows of the device tables) ...
    mgr.commit("r1", num_computed)             # register full blocks + checkpoints, release rows behind the tail
    mgr.append_tokens("r1", [sampled])         # outputs, so later blocks can be hashed
    mgr.free("r1")                             # end-of-request checkpoint, then release everything (tail first)
    mgr.take_events()                          # BlockStored / BlockRemoved / AllBlocksCleared

**No host round trip of its own per step.** `commit`, `free` and `allocate_for` only queue work. The engine takes
the queue (`take_step_plan`: one int32 buffer of fixed widths) and runs it on the device state
(`apply_step_packed`) right before the model program, with no host read between; the host reads back a few
counters with the sampled tokens (`on_step_result`, possibly one step late). Standalone calls (`flush`, `add_requests`, lookups, reading
tables) apply the queue in their own jitted call (`apply_step_packed`, one transfer in, one out).

Free counts: allocations are decided on the host against a count that is exact after every read of the device's
counters and lowers by every allocation since; releases only raise it when the device confirms them (siblings
may share blocks). So `allocate_for` never over-commits; when it would fail while releases are unconfirmed, the
manager syncs (applies the queue, reads the counts) and decides again, so OutOfBlocks is exact.

Errors: unknown / duplicate request ids, commits beyond allocated or known tokens, and negative counts raise
`CacheError`; running out of blocks is a return value (`OutOfBlocks`), never an exception or a silent failure.
`legacy_dense_swa=True` reproduces vLLM <= 0.22 (every sliding block hashed, every freed block appended) for the
session-switch regression test only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cache import pool as P
from cache.checkpoints import CheckpointPolicy
from cache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventLog, KVEvent
from cache.hashing import ExtraKeys, RequestHasher, device_key, digest_words, key_int, keys_from_words
from cache.prefix import find_hits, group_searches
from cache.specs import FULL_HISTORY, SLIDING_WINDOW, CacheSpecs
from cache.step import AdmitPlan, GroupPlan, InputCarver, apply_step_packed, result_layout, unpack


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
  """Per-group block tables of one request (dict by group name; `.full` / `.swa` for today's engine). Read from
  the device tables lazily, on first access (tests, tiers, debugging: the engine's step never reads them)."""

  def __init__(self, mgr: "KVCacheManager | None", rid: str | None, tables: dict[str, np.ndarray] | None = None):
    self._mgr, self._rid, self._tables = mgr, rid, tables

  @property
  def tables(self) -> dict[str, np.ndarray]:
    if self._tables is None:
      self._tables = self._mgr._tables_now(self._rid)
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


def _empty(shape) -> np.ndarray:
  return np.empty(shape, np.int32)


HELD = 1         # host table entry: the request holds a block there (its id lives in the device table only)


class _Buf:
  """A growable int32 numpy buffer (doubling): a request's token list, or the explicit HELD / -1 mask of a table
  with gaps (`_Held`). Slices and masks replace per-block Python loops."""

  __slots__ = ("buf", "n")

  def __init__(self, ids: np.ndarray):
    self.n = len(ids)
    self.buf = np.empty(max(16, self.n + self.n // 4), np.int32)   # room for a few decode / chunk appends
    self.buf[:self.n] = ids

  def __len__(self):
    return self.n

  def view(self) -> np.ndarray:
    return self.buf[:self.n]

  def extend(self, vals) -> int:
    """Append the values of `vals`; returns the start index (`extend_fill` appends one value repeated)."""
    vals = np.asarray(vals, np.int32)
    start = self.n
    self._grow(start + len(vals))
    self.buf[start:start + len(vals)] = vals
    self.n = start + len(vals)
    return start

  def extend_fill(self, value: int, count: int) -> int:
    start = self.n
    self._grow(start + count)
    self.buf[start:start + count] = value
    self.n = start + count
    return start

  def _grow(self, need: int):
    if need > len(self.buf):
      b = np.empty(max(need, 2 * len(self.buf)), np.int32)
      b[:self.n] = self.buf[:self.n]
      self.buf = b


class _Held:
  """Which entries of one request's block table in one group hold a block (the ids live on the device). Normally a
  run [lo, n): full-history groups hold every entry from 0, sliding groups release from the front, and hits and
  allocations leave no gap, so the common operations are integer updates, no array work. A load from a lower tier
  can leave gaps (`extend_for_load`): the entries then become an explicit HELD / -1 mask (`mask`, a _Buf)."""

  __slots__ = ("lo", "n", "mask")

  def __init__(self, lo: int = 0, n: int = 0):
    self.lo, self.n, self.mask = min(lo, n), n, None

  def __len__(self):
    return self.n

  def view(self) -> np.ndarray:
    """HELD / -1 per entry (a copy in the run form)."""
    if self.mask is not None:
      return self.mask.view()
    out = np.full(self.n, -1, np.int32)
    out[self.lo:] = HELD
    return out

  def all_held(self, a: int, b: int) -> bool:
    """Entries [a, b) (a < b) all held."""
    if self.mask is None:
      return self.lo <= a and b <= self.n
    return b <= self.n and self.mask.buf[a:b].min() >= 0

  def held_runs(self, a: int, b: int) -> list[tuple[int, int]]:
    """The held entries in [a, b) as maximal runs (lo, hi), ascending."""
    b = min(b, self.n)
    if self.mask is None:
      lo = max(a, self.lo)
      return [(lo, b)] if lo < b else []
    if a >= b:
      return []
    held = np.concatenate([[False], self.mask.buf[a:b] >= 0, [False]])
    edges = np.flatnonzero(held[1:] != held[:-1]) + a
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))

  def grow(self, count: int) -> int:
    """Append `count` held entries; returns the first one's index."""
    start = self.n
    if self.mask is not None:
      self.mask.extend_fill(HELD, count)
    self.n += count
    return start

  def extend(self, vals) -> None:
    """Append entries HELD / -1 as given (a gap switches to the explicit mask)."""
    vals = np.asarray(vals, np.int32)
    if self.mask is None and (vals >= 0).all():
      self.n += len(vals)
      return
    if self.mask is None:
      self.mask = _Buf(self.view())
    self.mask.extend(vals)
    self.n += len(vals)

  def clear_front(self, upto: int) -> None:
    """Entries before `upto` no longer held (released)."""
    if self.mask is None:
      self.lo = max(self.lo, min(upto, self.n))
    else:
      self.mask.buf[:min(upto, self.n)] = -1


@dataclasses.dataclass
class _Request:
  rid: str
  tokens: _Buf
  hasher: RequestHasher
  tenant: str
  prompt_len: int
  num_computed: int
  tables: dict[str, _Held]             # which table entries it holds; the ids are on the device
  num_registered: dict[str, int]       # full groups: leading blocks already offered to the cache
  released: dict[str, int]             # sliding groups: leading blocks already released
  junctions: tuple[int, ...] = ()      # extra checkpoint boundaries (junction, dense start past the run)
  dense: bool = True                   # take the dense-start checkpoints (only a request that hit nothing does)
  plan: tuple[int, ...] | None = None  # its checkpoint boundaries (policy.plan), computed at the first commit
  slot: int = -1                       # its row of the device block tables


@dataclasses.dataclass
class _Sent:
  """What the host needs to read one device call's results: its result layout, the blocks allocated by all calls
  sent so far (to turn the device's free counts back into the current ones), the releases sent so far, and, with
  events on, the registrations it carried."""
  layout: tuple
  alloc_total: dict
  free_seq: int
  regs: dict | None


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """The queued bookkeeping of one engine step, as the step program takes it: `buf` (one int32 host buffer) plus
  the static arguments of `cache.step.step_packed` (`statics`, hashable). Results: `KVCacheManager.on_step_result`."""
  buf: np.ndarray
  statics: tuple
  sent: _Sent

  def kwargs(self) -> dict:
    return dict(self.statics)


def _bucket(n: int, lo: int = 16) -> int:
  """Static widths in powers of 4 from `lo`, so each shape compiles a handful of times at most."""
  w = lo
  while w < n:
    w *= 4
  return w


_ADMIT_ROWS_FIXED = 16   # engines with at most this many table rows admit at one fixed batch width


def _units_bucket(n: int) -> int:
  """Hash units per request in a search: powers of 4 from 64 (2048 tokens at 32-token units)."""
  return _bucket(n, 64)


class KVCacheManager:

  def __init__(self, specs: CacheSpecs, *, num_blocks: dict[str, int] | None = None,
               num_full_blocks: int | None = None, num_swa_blocks: int | None = None, retention_interval: int = 0,
               model_id: str = "", key_bits: int = 64, max_probe: int = P.DEFAULT_MAX_PROBE,
               enable_events: bool = True, legacy_dense_swa: bool = False, dense_start: bool = True,
               rerender_tokens: int = 64, junction_checkpoints: bool = True, num_slots: int | None = None,
               max_tokens: int | None = None):
    """num_slots / max_tokens: rows of the device block tables (requests held at once) and the longest request
    (table width). The engine fixes both (max_num_seqs, max_model_len), so its step program has one shape; left
    None (standalone use), the tables start small and grow on demand."""
    if not isinstance(specs, CacheSpecs):
      raise TypeError("KVCacheManager: pass cache.specs.CacheSpecs (the model side builds them: "
                      "dsv4.caches.group_specs(config, layout))")
    self.specs = specs
    self.groups = specs.names
    sizes = dict(num_blocks or {})
    if num_full_blocks is not None:
      sizes.setdefault("full", num_full_blocks)
    if num_swa_blocks is not None:
      sizes.setdefault("swa", num_swa_blocks)
    missing = [g for g in self.groups if g not in sizes]
    if missing or set(sizes) - set(self.groups):
      raise ValueError(f"KVCacheManager: num_blocks must name exactly the groups {list(self.groups)}; got "
                       f"{sorted(sizes)}")
    self._searches = group_searches(specs)
    self._G = specs.hash_tokens
    self._bt_of = {g.name: g.block_tokens for g in specs.groups}
    self._kind = {g.name: g.kind for g in specs.groups}
    self._bt = tuple(g.block_tokens for g in specs.groups)
    self.policies = {g.name: CheckpointPolicy(specs.align_tokens, g.block_tokens, g.tail_tokens,
                                              retention_interval, dense_start and not legacy_dense_swa,
                                              0 if legacy_dense_swa else rerender_tokens)
                     for g in specs.groups if g.kind == SLIDING_WINDOW}
    if not self.policies:   # validate the knob even without sliding groups
      CheckpointPolicy(specs.align_tokens, specs.align_tokens, 0, retention_interval)
    self.junction_checkpoints = junction_checkpoints and not legacy_dense_swa
    self._pol0 = next(iter(self.policies.values()), None)    # the policy that places boundaries (all agree)
    self._memos = {}
    self._align = specs.align_tokens
    self._group_bt = tuple(zip(self.groups, self._bt))
    # groups whose blocks are registered as they are computed (sliding groups only at checkpoints)
    self._registered_bt = tuple((g, bt) for g, bt in self._group_bt
                                if self._kind[g] == FULL_HISTORY or legacy_dense_swa)
    self._pools = {g.name: P.init_pool(sizes[g.name], g.block_tokens, max_probe) for g in specs.groups}
    self.num_blocks = {g: sizes[g] for g in self.groups}
    self.model_id, self.key_bits = model_id, key_bits
    self.legacy = legacy_dense_swa
    self.prepend_uncached = not legacy_dense_swa
    self.events = EventLog(enable_events)
    self._requests: dict[str, _Request] = {}
    # (group, block id) -> (key, tenant) of cached blocks, only to label BlockRemoved events.
    self._identity: dict[tuple[str, int], tuple[int, str]] = {}
    # device block tables: per group [slots, width], -1 where no block
    self._fixed = num_slots is not None and max_tokens is not None
    slots = num_slots or 8
    width = {g: max(8, -(-(max_tokens or 2048) // bt)) for g, bt in zip(self.groups, self._bt)}
    self._tab = {g: jnp.full((slots, width[g]), -1, jnp.int32) for g in self.groups}
    self._width = dict(width)      # the tables' widths, without touching the device arrays
    self._free_slots = list(range(slots - 1, -1, -1))
    # free counts (see the module doc): exact at the last read, minus every allocation since
    self._nfree = dict(sizes)
    self._alloc_total = {g: 0 for g in self.groups}     # blocks allocated by all calls queued so far
    self._free_seq = 0          # releases queued so far (any count change upwards is unconfirmed until read)
    self._free_seen = 0         # releases whose effect the free counts include
    self._count_seq = -1        # the call whose counts were read last (older reads are ignored)
    self._calls = 0
    self.peak_used = {g: 0 for g in self.groups}
    self._step_widths = None
    self._step_rows = None
    self._reset_queue()
    self._out_layouts = {}      # result buffer layout per (input layout, widths): computed once each
    self._in_treedefs = {}
    self.stats = {"table_full": 0, "duplicate": 0, "queried_tokens": 0, "hit_tokens": 0, "device_calls": 0,
                  "syncs": 0, "step_plans": 0, "step_plan_overflows": 0}

  def _memo(self, key, make):
    """A request's checkpoint schedule depends only on a few integers (lengths, run): requests of equal lengths
    share it. Bounded: cleared when it grows large."""
    out = self._memos.get(key)
    if out is None:
      if len(self._memos) > 4096:
        self._memos.clear()
      out = self._memos[key] = make()
    return out

  # ------------------------------------------------------------------------------------------ slots, tables
  @property
  def num_slots(self) -> int:
    return self._tab[self.groups[0]].shape[0]

  def table_width(self, group: str) -> int:
    return self._tab[group].shape[1]

  def slot_of(self, request_id: str) -> int:
    """The request's row of the device block tables (the engine's step reads its tables there)."""
    return self._req(request_id).slot

  def _take_slot(self) -> int:
    if not self._free_slots:
      if self._fixed:
        raise CacheError(f"no free table row: {self.num_slots} requests are held (num_slots)")
      self.flush()
      n = self.num_slots
      self._tab = {g: jnp.pad(t, ((0, n), (0, 0)), constant_values=-1) for g, t in self._tab.items()}
      self._free_slots = list(range(2 * n - 1, n - 1, -1))
    return self._free_slots.pop()

  def _ensure_width(self, g: str, blocks: int) -> None:
    w = self.table_width(g)
    if blocks <= w:
      return
    if self._fixed:
      raise CacheError(f"group {g}: {blocks} blocks exceed the table width {w} (max_tokens)")
    self.flush()
    nw = w
    while nw < blocks:
      nw *= 2
    # queued refs are (slot, entry) pairs, resolved against the width when packed: growing is safe
    self._tab[g] = jnp.pad(self._tab[g], ((0, 0), (0, nw - w)), constant_values=-1)
    self._width[g] = nw

  @property
  def device_tables(self) -> dict:
    """The device block tables per group, [slots, width] (what the engine's step reads; do not keep them: the
    next call donates them)."""
    return self._tab

  # ------------------------------------------------------------------------------------------ queue
  def _reset_queue(self):
    # Every queued operation is a run of table entries of one slot: plain tuples here, turned into arrays for all
    # runs of a step at once when it is packed (numpy per step, not per request or per block).
    # registrations: (slot, a, b, hasher, token buffer, event infos or None) = blocks a .. b - 1, all held
    self._q_reg = {g: [] for g in self.groups}
    self._q_free = {g: [] for g in self.groups}     # (slot, a, b): release entries b - 1 down to a (eviction order)
    self._q_alloc = {g: [] for g in self.groups}    # (slot, a, b): fill entries a .. b - 1
    self._q_nreg = {g: 0 for g in self.groups}      # entries queued per kind (the step's widths)
    self._q_nfree = {g: 0 for g in self.groups}
    self._q_nalloc = {g: 0 for g in self.groups}
    # requests with queued allocations: a commit or free of theirs applies the queue first (the device runs
    # registrations and releases before allocations)
    self._q_rids = set()

  def _queued(self) -> bool:
    return any(self._q_nreg[g] or self._q_nfree[g] or self._q_nalloc[g] for g in self.groups)

  @property
  def pools(self) -> dict:
    """The pool states, with everything queued applied first (tests, debugging, eviction policies)."""
    self.flush()
    return self._pools

  def flush(self) -> None:
    """Apply every queued operation in one device call (no-op when nothing is queued)."""
    if self._queued():
      self._apply(None)

  def _group_dims(self, g: str):
    """(registrations, frees, allocations queued for group g, and their static widths)."""
    nr, nf, na = self._q_nreg[g], self._q_nfree[g], self._q_nalloc[g]
    return nr, nf, na, _bucket(nr), _bucket(nf), _bucket(na)

  def _refs(self, g, runs, reverse=False):
    """Table refs (slot * width + entry) of queued runs (slot, a, b, ...) in queue order: entries a .. b - 1, or
    b - 1 down to a (reverse: a request's releases go tail first). One numpy pass over every run."""
    if len(runs[0]) == 3:
      s, a, b = np.array(runs, np.int64).reshape(-1, 3).T
    else:
      s, a, b = (np.fromiter((c[k] for c in runs), np.int64, len(runs)) for k in range(3))
    cnt = b - a
    k = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)   # index inside its run
    ent = np.repeat(b - 1, cnt) - k if reverse else np.repeat(a, cnt) + k
    return np.repeat(s * self.table_width(g), cnt) + ent

  def _group_plan(self, g: str, take, dims) -> GroupPlan:
    """The queued work of group g as a GroupPlan; `take(shape)` hands out the (uninitialised) arrays, views of the
    step's one input buffer (InputCarver) in leaf order."""
    bt = self._bt_of[g]
    regs, frees, allocs = self._q_reg[g], self._q_free[g], self._q_alloc[g]
    nr, nf, na, r, f, a = dims
    ref, key, par, tok = take((r,)), take((r, 2)), take((r, 4)), take((r, bt))
    ref[nr:], key[nr:], par[nr:], tok[nr:] = -1, 0, 0, 0
    if regs:      # every run at once (numpy), not per block
      ref[:nr] = self._refs(g, regs)
      kw, pw = self._reg_words(g)
      key[:nr] = keys_from_words(kw, self.key_bits)
      par[:nr] = pw
      np.concatenate([c[4][c[1] * bt:c[2] * bt] for c in regs], out=tok[:nr].reshape(-1))
    fr = take((f,))
    fr[nf:] = -1
    if frees:
      fr[:nf] = self._refs(g, frees, reverse=True)
    al = take((a,))
    al[na:] = -1
    if allocs:
      al[:na] = self._refs(g, allocs)
    return GroupPlan(ref, key, par, tok, fr, al)

  def _in_treedef(self, with_admit: bool):
    if with_admit not in self._in_treedefs:
      plans = tuple(GroupPlan(*range(6)) for _ in self.groups)
      self._in_treedefs[with_admit] = jax.tree_util.tree_structure((plans, AdmitPlan(*range(6)) if with_admit else None))
    return self._in_treedefs[with_admit]

  def _statics(self, admit_widths=None):
    return dict(groups=self._searches, block_tokens=self._bt, align=self._align,
                hash_tokens=self._G, prepend=self.prepend_uncached,
                admit_widths=admit_widths or tuple(16 for _ in self.groups))

  def _carve(self, dims, admit=None):
    """Every queued operation (and the admission batch) carved into one InputCarver; resets the queue. Returns
    (carver, in_layout, _Sent without layout)."""
    shapes = []
    for (_, _, _, r, f, a), bt in zip(dims, self._bt):
      shapes += [(r,), (r, 2), (r, 4), (r, bt), (f,), (a,)]
    if admit is not None:
      b, u = self._admit_dims(admit[0])
      shapes += [(b, u, 2), (b, u, 4), (b, u, self._G), (b,), (b,), (b,)]
    carver = InputCarver(shapes)
    for g, d in zip(self.groups, dims):
      self._group_plan(g, carver.take, d)
    if admit is not None:
      self._pack(*admit, take=carver.take)
    regs = None
    if self.events.enabled:
      regs = {g: self._q_reg[g] for g in self.groups}
    sent = _Sent(None, dict(self._alloc_total), self._free_seq, regs)
    self._calls += 1
    self._reset_queue()
    return carver, (self._in_treedef(admit is not None), carver.shapes), sent

  def _apply(self, admit=None, admit_widths=None):
    """One device call: the queued work plus, with admit = (token arrays, hashers, allocate targets or None,
    slots), the batched admission. Every plan array is a view of one int32 buffer (one transfer in); every result
    comes back in one int32 buffer (one transfer out), unpacked as numpy views."""
    dims = [self._group_dims(g) for g in self.groups]
    carver, in_layout, sent = self._carve(dims, admit)
    statics = self._statics(admit_widths)
    pools = tuple(self._pools[g] for g in self.groups)
    tabs = tuple(self._tab[g] for g in self.groups)
    lkey = (in_layout, tuple(statics["admit_widths"]), tuple(t.shape for t in tabs))
    if lkey not in self._out_layouts:
      self._out_layouts[lkey] = result_layout(pools, tabs, in_layout, **statics)
    sent.layout = self._out_layouts[lkey]
    pools, tabs, out = apply_step_packed(pools, tabs, carver.buf, in_layout=in_layout, **statics)
    self._pools, self._tab = dict(zip(self.groups, pools)), dict(zip(self.groups, tabs))
    res = unpack(np.asarray(jax.device_get(out)), *sent.layout)   # the one device -> host transfer
    self.stats["device_calls"] += 1
    self._on_result(res, sent, self._calls)
    return res

  def _on_result(self, res, sent: _Sent, seq: int) -> None:
    """Read one call's results: refusals are bugs (raise), events, and the free counts."""
    counts = res["counters"] if "counters" in res else [None] * len(self.groups)
    for gi, g in enumerate(self.groups):
      c = counts[gi]
      if c is None:
        bad_reg = int(np.count_nonzero(res["status"][gi] == P.INVALID))
        bad_free, bad_alloc = not res["free_ok"][gi], not res["alloc_ok"][gi]
        dup = int(np.count_nonzero(res["status"][gi] == P.DUPLICATE))
        full = int(np.count_nonzero(res["status"][gi] == P.TABLE_FULL))
        nfree = int(res["num_free"][gi])
      else:
        nfree, bad_reg, bad_free, bad_alloc, dup, full = (int(x) for x in c)
      if bad_reg:
        raise RuntimeError(f"register refused {bad_reg} block(s) of group {g}")
      if bad_free:
        raise RuntimeError(f"free refused blocks of group {g}")
      if bad_alloc:
        raise RuntimeError(f"allocate failed in group {g} after the free check")
      self.stats["duplicate"] += dup
      self.stats["table_full"] += full
      if c is None and self.events.enabled:
        self._events_of(g, gi, res, sent)
      if seq > self._count_seq:
        # the device count after this call, less what calls sent after it allocate (releases sent after it are
        # not counted until a later read confirms them)
        self._nfree[g] = nfree - (self._alloc_total[g] - sent.alloc_total[g])
        self.peak_used[g] = max(self.peak_used[g], self.num_blocks[g] - nfree)
    if seq > self._count_seq:
      self._count_seq = seq
      self._free_seen = sent.free_seq

  def _events_of(self, g, gi, res, sent: _Sent):
    regs = sent.regs[g]
    if regs:
      n = sum(c[2] - c[1] for c in regs)
      ids, st = res["reg_ids"][gi][:n], res["status"][gi][:n]
      keys = None
      infos = [i for c in regs for i in c[5]]
      for i in np.flatnonzero(st == P.STORED):
        if keys is None:
          keys = keys_from_words(self._reg_words(g, regs)[0], self.key_bits)
        kk = key_int(keys[i])
        parent, tenant, bt = infos[i]
        b = int(ids[i])
        self._identity[(g, b)] = (kk, tenant)
        self.events.emit(BlockStored(kk, parent, g, tenant, b, bt))
    for ids, ev in ((res["alloc_ids"][gi], res["alloc_ev"][gi]),
                    (res["admit_ids"][gi], res["admit_ev"][gi]) if "admit_ids" in res else ((), ())):
      for b, e in zip(ids, ev):
        if e:
          k, tenant = self._identity.pop((g, int(b)))
          self.events.emit(BlockRemoved(k, g, tenant, int(b)))

  # ------------------------------------------------------------------------------------------ the step program
  def set_step_capacity(self, tokens: int, rows: int) -> None:
    """Fix the widths of the bookkeeping the engine's step program carries (one compiled shape): at most
    `tokens` new tokens over `rows` requests per step. A step whose queue does not fit (a long request's end
    releases many blocks at once) applies it in a call of its own first (`take_step_plan`)."""
    w = []
    for g, bt in zip(self.groups, self._bt):
      need = self.policies[g].need_blocks if g in self.policies else 0
      a = -(-tokens // bt) + rows
      w.append((-(-(a + 2 * rows * need) // 8) * 8, -(-(2 * a + rows * need) // 8) * 8, -(-a // 8) * 8))
    self._step_widths = tuple(w)
    self._step_rows = rows

  def take_step_plan(self) -> StepPlan:
    """Everything queued, as the step program's bookkeeping (fixed widths, see set_step_capacity). The caller
    runs `cache.step.step_packed(pools, tables, plan.buf, **plan.kwargs())` on `device_state()` and hands the new
    state back (`set_device_state`) and, when it reads them, the results (`on_step_result`)."""
    if self._step_widths is None:
      raise CacheError("take_step_plan: call set_step_capacity first")
    dims = [self._group_dims(g) for g in self.groups]
    if any(d[0] > w[0] or d[1] > w[1] for d, w in zip(dims, self._step_widths)):
      # too much for the fixed widths: registrations and releases go first in a call of their own (allocations
      # stay queued: they follow the releases either way)
      self.stats["step_plan_overflows"] += 1
      allocs, nalloc, rids = self._q_alloc, self._q_nalloc, self._q_rids
      self._q_alloc, self._q_nalloc = {g: [] for g in self.groups}, {g: 0 for g in self.groups}
      tot = dict(self._alloc_total)
      for g in self.groups:
        self._alloc_total[g] -= nalloc[g]
      self._apply(None)
      self._q_alloc, self._q_nalloc, self._q_rids, self._alloc_total = allocs, nalloc, rids, tot
      dims = [self._group_dims(g) for g in self.groups]
    if any(d[2] > w[2] for d, w in zip(dims, self._step_widths)):
      self.stats["step_plan_overflows"] += 1
      self._apply(None)
      dims = [self._group_dims(g) for g in self.groups]
    dims = [(nr, nf, na, r, f, a) for (nr, nf, na, _, _, _), (r, f, a) in zip(dims, self._step_widths)]
    carver, in_layout, sent = self._carve(dims)
    results = "all" if self.events.enabled else "counts"
    statics = self._statics()
    key = (in_layout, results, tuple(t.shape for t in self._tab.values()))
    if key not in self._out_layouts:
      self._out_layouts[key] = result_layout(tuple(self._pools.values()), tuple(self._tab.values()), in_layout,
                                             results=results, **statics)
    sent.layout = self._out_layouts[key]
    self.stats["step_plans"] += 1
    return StepPlan(carver.buf, tuple(sorted({**statics, "in_layout": in_layout, "results": results}.items())),
                    dataclasses.replace(sent, layout=(sent.layout, self._calls)))

  def device_state(self):
    """(pools, tables) as tuples in group order, for the step program (which donates them)."""
    return tuple(self._pools[g] for g in self.groups), tuple(self._tab[g] for g in self.groups)

  def set_device_state(self, pools, tables) -> None:
    self._pools, self._tab = dict(zip(self.groups, pools)), dict(zip(self.groups, tables))

  def on_step_result(self, plan: StepPlan, buf) -> None:
    """The results of a step program's bookkeeping (its packed int32 result buffer, on the host), in any order
    after the step; the free counts only move forward."""
    layout, seq = plan.sent.layout
    self._on_result(unpack(np.asarray(buf), *layout), plan.sent, seq)

  def sync_counts(self) -> None:
    """Apply what is queued and read the device's free counts (waits for every call sent): exact counts."""
    self.stats["syncs"] += 1
    if self._queued():
      if self._step_widths is not None:
        # the engine's own bookkeeping program (same widths and statics: no compile of another shape)
        plan = self.take_step_plan()
        pools, tables, out = apply_step_packed(*self.device_state(), plan.buf, **dict(plan.statics))
        self.set_device_state(pools, tables)
        self.stats["device_calls"] += 1
        self.on_step_result(plan, jax.device_get(out))
      else:
        self._apply(None)
    if self._free_seen < self._free_seq:
      nf = jax.device_get([self._pools[g].num_free for g in self.groups])
      for g, n in zip(self.groups, nf):
        self._nfree[g] = int(n)
      self._free_seen = self._free_seq
      self._count_seq = self._calls

  @property
  def policy(self) -> CheckpointPolicy:
    """The policy of the sliding group named "swa" (or the first sliding group): today's engine / tiers."""
    return self.policies["swa"] if "swa" in self.policies else next(iter(self.policies.values()))

  # ------------------------------------------------------------------------------------------------ lookup
  def _hasher(self, tokens: np.ndarray, extra: ExtraKeys) -> RequestHasher:
    h = RequestHasher(dataclasses.replace(extra, model=extra.model or self.model_id,
                                          layout=self.specs.fingerprint), self.specs.hash_tokens, self.key_bits)
    h.update(tokens)
    return h

  def _admit_dims(self, toks):
    """(requests, hash units per request) of an admission batch: static widths."""
    per_align = self._align // self._G
    u = _units_bucket(max(len(t) // self._G for t in toks))
    b = 1 << (len(toks) - 1).bit_length()        # powers of 2: padding rows cost a whole search each
    if self._step_rows is not None and self._step_rows <= _ADMIT_ROWS_FIXED:
      # an engine admitting into few rows: one admission shape (each new shape is a compile of the whole
      # bookkeeping program, seconds; a few padded rows' searches cost far less)
      b = max(b, self._step_rows)
    return b, -(-u // per_align) * per_align

  def _pack(self, toks, hashers, targets=None, slots=None, take=_empty) -> AdmitPlan:
    """The admission batch as an AdmitPlan (arrays from `take`, see _group_plan). Keys and parents of all requests
    in one numpy pass (one bytes join), not per request."""
    g = self._G
    b, u = self._admit_dims(toks)
    key, par, tok, max_len, target, slot = (take((b, u, 2)), take((b, u, 4)), take((b, u, g)), take((b,)),
                                            take((b,)), take((b,)))
    nb = len(toks)
    ns = np.array([min(u, len(h.digests)) for h in hashers], np.int64)
    tot = int(ns.sum())
    key[...] = 0
    par[...] = 0
    if tot:
      w = np.frombuffer(b"".join(h.blob[:16 * n] for h, n in zip(hashers, ns.tolist())),
                        dtype="<u4").reshape(tot, 4)
      starts = np.cumsum(ns) - ns
      rows = np.repeat(np.arange(nb), ns)
      cols = np.arange(tot) - np.repeat(starts, ns)
      key[rows, cols] = keys_from_words(w, self.key_bits)
      pw = np.empty((tot, 4), np.int32)            # parent of unit c = digest of unit c - 1, the root for c = 0
      pw[1:] = w[:-1].view(np.int32)
      has = ns > 0
      pw[starts[has]] = np.frombuffer(b"".join(h.root for h, k in zip(hashers, has) if k), "<i4").reshape(-1, 4)
      par[rows, cols] = pw
    rows = tok.reshape(b, u * g)
    rows[nb:] = 0
    for i, t in enumerate(toks):         # one slice copy per request (the tokens are O(prompt) anyway)
      k = min(len(t) // g, u) * g
      rows[i, :k] = t[:k]
      rows[i, k:] = 0
    max_len[:] = 0
    max_len[:nb] = np.maximum(np.fromiter((len(t) for t in toks), np.int64, nb) - 1, 0)
    target[:] = -1
    if targets is not None:
      target[:nb] = [-1 if t is None else t for t in targets]
    slot[:] = -1
    if slots is not None:
      slot[:nb] = slots
    return AdmitPlan(key, par, tok, max_len, target, slot)

  def lookup(self, token_ids, extra_keys: ExtraKeys = ExtraKeys()) -> PrefixHit:
    return self.lookup_batch([(token_ids, extra_keys)])[0]

  def lookup_batch(self, requests) -> list[PrefixHit]:
    """Pure search (nothing claimed), one jitted call after applying what is queued."""
    toks = [np.asarray(t, np.int32) for t, _ in requests]
    hashers = [self._hasher(t, e) for t, (_, e) in zip(toks, requests)]
    self.flush()
    plan = self._pack(toks, hashers)
    pools = tuple(self._pools[n] for n in self.groups)
    hit, ids = find_hits(pools, plan.key_BxUx2, plan.par_BxUx4, plan.tok_BxUxG, plan.max_len_B,
                         groups=self._searches, align_tokens=self.specs.align_tokens,
                         hash_tokens=self.specs.hash_tokens)
    hit, ids = jax.device_get((hit, ids))
    return [self._hit(i, len(t), hit, ids, compact=False) for i, t in enumerate(toks)]

  def _hit(self, i, n_query, hit, ids, compact=True) -> PrefixHit:
    """Request i's PrefixHit. ids per group: [B, blocks] tables, or (compact, apply_step's form) sliding groups
    as their tail only, [B, need_blocks], placed before the hit here."""
    n = int(hit[i])

    def blocks():
      out = {}
      for name, gid, bt, srch in zip(self.groups, ids, self._bt, self._searches):
        e = n // bt
        if compact and srch.kind != FULL_HISTORY:
          tab = np.full(e, -1, np.int32)
          k = min(e, gid.shape[1])
          if k:
            tab[e - k:] = gid[i, gid.shape[1] - k:]
          out[name] = tab
        else:
          out[name] = gid[i, :e].copy()
      return out
    self.stats["queried_tokens"] += n_query
    self.stats["hit_tokens"] += n
    return PrefixHit(n, make=blocks)

  # ------------------------------------------------------------------------------------------- requests
  def _req(self, rid: str) -> _Request:
    if rid not in self._requests:
      raise CacheError(f"unknown request {rid!r}")
    return self._requests[rid]

  def add_request(self, request_id: str, prompt_token_ids, extra_keys: ExtraKeys = ExtraKeys()) -> PrefixHit:
    """Look up the prompt and claim the hit blocks (every group before any allocation)."""
    return self.add_requests([(request_id, prompt_token_ids, extra_keys)])[0]

  def add_requests(self, requests, allocate_tokens=None) -> list[PrefixHit]:
    """Admit several requests in ONE device call (with everything queued): search, claim (the hit blocks are
    written into each request's table row on the device), and with `allocate_tokens[i]` (total tokens to cover,
    e.g. hit + first chunk; None = no allocation) their first allocation. If the pools cannot cover every
    admitted request's allocation, none is made (call allocate_for)."""
    reqs = []
    seen = set()
    for rid, prompt, extra in requests:
      if rid in self._requests or rid in seen:
        raise CacheError(f"request {rid!r} already exists")
      toks = np.asarray(prompt, np.int32)
      if toks.ndim != 1 or len(toks) == 0:
        raise CacheError("add_request: prompt_token_ids must be a non-empty 1-D sequence")
      seen.add(rid)
      reqs.append((rid, toks, extra))
    if not reqs:
      return []
    if allocate_tokens is not None and len(allocate_tokens) != len(reqs):
      raise CacheError("add_requests: allocate_tokens must have one entry per request")
    if allocate_tokens is not None and any(t is not None and t < 0 for t in allocate_tokens):
      raise CacheError("add_requests: allocate_tokens must be >= 0")
    longest = max([len(t) for _, t, _ in reqs] + [t or 0 for t in (allocate_tokens or [])])
    for g, bt in zip(self.groups, self._bt):
      self._ensure_width(g, -(-longest // bt))
    if self._fixed and len(self._free_slots) < len(reqs):
      raise CacheError(f"add_requests: {len(reqs)} requests but {len(self._free_slots)} free table rows")
    slots = [self._take_slot() for _ in reqs]
    hashers = [self._hasher(t, e) for _, t, e in reqs]
    tgts = [t for t in allocate_tokens if t is not None] if allocate_tokens is not None else []
    widths = tuple(_bucket(sum(-(-int(t) // bt) for t in tgts)) for bt in self._bt)
    res = self._apply(([t for _, t, _ in reqs], hashers, allocate_tokens, slots), widths)
    hit, run, ids = res["hit"], res["run"], res["hit_ids"]
    hits, runs = hit[:len(reqs)].tolist(), run[:len(reqs)].tolist()
    # a hit holds every full-history block before it and, in sliding groups, the tail before it (prefix.search)
    tails = [(g, p.block_tokens, p.need_blocks) for g, p in self.policies.items()]
    full = [(g, bt) for g, bt in self._group_bt if g not in self.policies]
    out = []
    for i, (rid, toks, extra) in enumerate(reqs):
      h = self._hit(i, len(toks), hit, ids)
      n, rn = hits[i], runs[i]
      junction = ()
      # A junction inside the dense-start gap (run < 2 * hit, or nothing hit): where the dense schedule could not
      # reach the end of a prefix another request computed. Past 2 * hit the run is most likely this conversation's
      # own earlier turn whose checkpoint was evicted (memory pressure); a checkpoint there is superseded by this
      # turn's own, and taking it anyway made a fixed budget collapse (BUILD_NOTES.md, Cache bookkeeping,
      # "Checkpoint placement").
      if self.junction_checkpoints and rn > n and (n == 0 or rn < 2 * n):
        junction = (rn,)
      if n and self._pol0 is not None:
        # dense start over what nobody computed before it (past its run): a later request sharing part of it hits
        # more than half, so its junction falls inside that rule (a document after a cached system prompt)
        junction += self._memo(("dense", len(toks), rn), lambda: self._pol0.dense_points(len(toks), after=rn))
      tables = {g: _Held(0, n // bt) for g, bt in full}
      released = {}
      for g, bt, need in tails:
        e = n // bt
        released[g] = max(0, e - need)
        tables[g] = _Held(released[g], e)
      r = _Request(rid, _Buf(toks), hashers[i], extra.tenant, len(toks), n, tables,
                   {g: tables[g].n for g in self.groups}, released, junction, n == 0, slot=slots[i])
      self._requests[rid] = r
      out.append(h)
    if allocate_tokens is not None and res["admit_ok"]:
      for g, bt in self._group_bt:
        for i, (rid, _, _) in enumerate(reqs):
          t = allocate_tokens[i]
          if t is not None:
            tab = self._requests[rid].tables[g]
            tab.grow(max(0, -(-t // bt) - tab.n))
    return out

  def num_committed(self, request_id: str) -> int:
    """Tokens committed so far (what the cache will have registered after the next call)."""
    return self._req(request_id).num_computed

  def append_tokens(self, request_id: str, token_ids) -> None:
    r = self._req(request_id)
    if isinstance(token_ids, (list, tuple)) and len(token_ids) == 1:     # a decode step's one token: no array
      r.tokens.extend_fill(token_ids[0], 1)
    else:
      r.tokens.extend(np.atleast_1d(np.asarray(token_ids, np.int64)))

  def allocate_for(self, request_id: str, num_new_tokens: int) -> BlockTables | OutOfBlocks:
    """Blocks for positions up to num_computed + num_new_tokens in every group, all or nothing."""
    r = self._req(request_id)
    if num_new_tokens < 0:
      raise CacheError(f"allocate_for: num_new_tokens must be >= 0, got {num_new_tokens}")
    return self.allocate_to(request_id, r.num_computed + num_new_tokens)

  def allocate_to(self, request_id: str, total_tokens: int) -> BlockTables | OutOfBlocks:
    """Blocks for positions [0, total_tokens) in every group, all or nothing. Decided on the host by counts; the
    device fills the table entries in the next call (the engine's step program). The returned tables are read
    from the device on first access (not by the engine)."""
    r = self._req(request_id)
    tables, nfree = r.tables, self._nfree
    need = [(g, max(0, -(-total_tokens // bt) - tables[g].n)) for g, bt in self._group_bt]
    short = next((g for g, k in need if k > nfree[g]), None)
    if short is not None and self._free_seen < self._free_seq:
      self.sync_counts()           # releases not confirmed yet: read the exact counts, then decide
      short = next((g for g, k in need if k > nfree[g]), None)
    if short is not None:
      return OutOfBlocks(short, dict(need)[short], nfree[short])
    for g, k in need:
      if k:
        tab = tables[g]
        if tab.n + k > self._width[g]:
          self._ensure_width(g, tab.n + k)
        start = tab.grow(k)
        self._q_alloc[g].append((r.slot, start, start + k))
        self._q_nalloc[g] += k
        nfree[g] -= k
        self._alloc_total[g] += k
        self._q_rids.add(r.rid)
    return BlockTables(self, request_id)

  def _tables_now(self, request_id: str) -> dict[str, np.ndarray]:
    """The request's block ids per group, read from the device (tests, tiers, debugging)."""
    r = self._req(request_id)
    self.flush()
    rows = jax.device_get({g: self._tab[g][r.slot] for g in self.groups})
    out = {}
    for g in self.groups:
      held = r.tables[g].view()
      ids = np.asarray(rows[g])[:len(held)].copy()
      if not np.array_equal(ids >= 0, held >= 0):
        raise RuntimeError(f"group {g}: device table of {request_id!r} disagrees with the host's counts")
      out[g] = ids
    return out

  def block_tables(self, request_id: str) -> BlockTables:
    """The request's tables now (applies what is queued first; one device read)."""
    return BlockTables(None, None, self._tables_now(request_id))

  # ------------------------------------------------------------------------------------------ register
  def _register(self, r: _Request, g: str, a: int, b: int, all_held: bool = False) -> None:
    """Queue blocks a .. b - 1 of a group for registration under the request's hashes (those it still holds).
    Only a tuple is queued here; the digest words, refs and tokens of every queued block of every request are
    gathered at once when the step is packed (`_reg_words`, `_group_plan`)."""
    if a >= b:
      return
    runs = [(a, b)] if all_held else r.tables[g].held_runs(a, b)
    bt = self._bt_of[g]
    for a, b in runs:
      infos = None
      if self.events.enabled:
        upb = bt // self._G
        infos = [(key_int(device_key(r.hasher.digests[j * upb - 1], self.key_bits)) if j else None, r.tenant, bt)
                 for j in range(a, b)]
      self._q_reg[g].append((r.slot, a, b, r.hasher, r.tokens.buf, infos))
      self._q_nreg[g] += b - a

  def _reg_words(self, g: str, regs=None):
    """(key digest words [R, 4] uint32, parent words [R, 4] int32) of every queued registration of group g: one
    bytes join and two numpy gathers, not per block. Each run contributes only the digests its blocks span (from
    the parent of its first block to the key of its last), so the cost follows the blocks registered, not the
    requests' lengths."""
    regs = self._q_reg[g] if regs is None else regs
    upb = self._bt_of[g] // self._G
    parts, at = [], []
    n_words = 0
    for c in regs:
      h, a, b = c[3], c[1], c[2]
      u0, u1 = a * upb - 1, b * upb      # units u0 .. u1 - 1; unit -1 is the root
      if u0 < 0:
        parts.append(h.root)
      parts.append(h.blob[16 * max(u0, 0):16 * u1])
      at.append(n_words - u0)            # unit u of this run sits at word n_words + u - u0 of the join
      n_words += u1 - u0
    w = np.frombuffer(b"".join(parts), dtype="<u4").reshape(-1, 4)
    a = np.fromiter((c[1] for c in regs), np.int64, len(regs))
    counts = np.fromiter((c[2] for c in regs), np.int64, len(regs)) - a
    j = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts - a, counts)     # block index
    base = np.repeat(np.asarray(at, np.int64), counts)
    return w[base + (j + 1) * upb - 1], w[base + j * upb - 1].view(np.int32)

  def _checkpoint(self, r: _Request, boundary: int) -> None:
    for g, pol in self.policies.items():
      idx = pol.tail_blocks(boundary)
      if idx.start < idx.stop and r.tables[g].all_held(idx.start, idx.stop):
        self._register(r, g, idx.start, idx.stop, all_held=True)

  def commit(self, request_id: str, num_computed_tokens: int) -> None:
    """The model has written KV for positions [0, num_computed_tokens): cache what is reusable, release what the
    request no longer reads (both queued for the next device call)."""
    r = self._req(request_id)
    if r.rid in self._q_rids:
      self.flush()              # its allocation is still queued (the engine's step program applied it already)
    n = num_computed_tokens
    if n < r.num_computed:
      raise CacheError(f"commit: num_computed_tokens went backwards ({r.num_computed} -> {n})")
    if n > len(r.tokens):
      raise CacheError(f"commit: {n} computed tokens but only {len(r.tokens)} tokens known (append_tokens first)")
    tables = r.tables
    for g, bt in self._group_bt:
      if -(-n // bt) > tables[g].n:
        raise CacheError(f"commit: {n} tokens exceed the blocks allocated in group {g}")
    start = len(r.hasher.digests) * self._G     # hash only the new units: O(new tokens)
    if n > start:
      r.hasher.update(r.tokens.buf[start:n], offset=start)
    prev, r.num_computed = r.num_computed, n
    for g, bt in self._registered_bt:           # full-history groups (every group in legacy mode)
      done, upto = r.num_registered[g], n // bt
      if upto > done:
        self._register(r, g, done, upto)
        r.num_registered[g] = upto
    if self.policies:
      if not self.legacy:
        pol = self._pol0
        if r.plan is None:
          r.plan = self._memo(("plan", r.prompt_len, r.junctions, r.dense),
                              lambda: pol.plan(r.prompt_len, r.junctions, r.dense))
        if r.plan and (prev < r.plan[-1] or pol.retention_interval):
          for p in pol.select(r.plan, prev, n):
            self._checkpoint(r, p)
      for g, pol in self.policies.items():
        self._release(r, g, pol.releasable_blocks(n))

  def _release(self, r: _Request, g: str, upto: int) -> None:
    lo = r.released[g]
    if upto > lo:
      tab = r.tables[g]
      runs = tab.held_runs(lo, upto)
      tab.clear_front(upto)
      r.released[g] = upto
      self._queue_frees(r.slot, g, runs)

  def _queue_frees(self, slot: int, g: str, runs) -> None:
    """Queue the release of these table runs of one slot, tail first (a chain's last blocks become evictable
    before its head)."""
    if runs:
      q = self._q_free[g]
      for a, b in reversed(runs):
        q.append((slot, a, b))
        self._q_nfree[g] += b - a
      self._free_seq += 1

  def free(self, request_id: str) -> None:
    """End of request: checkpoint the sliding tails where the next turn resumes, then release every block, tail
    first (a chain's last blocks become evictable before its head). Its table row is reused once the device
    has applied the releases (they come first in the next call)."""
    r = self._req(request_id)
    if r.rid in self._q_rids:
      self.flush()
    if not self.legacy and self.policies:
      self._checkpoint(r, r.num_computed // self._align * self._align)
    for g in self.groups:
      self._queue_frees(r.slot, g, r.tables[g].held_runs(0, r.tables[g].n))
    self._free_slots.append(r.slot)
    del self._requests[request_id]

  def checkpoint_boundaries(self, request_id: str, lo: int, hi: int) -> list[int]:
    """Aligned boundaries P, lo < P <= hi, at which this request's commits will make a resume point findable
    (its sliding-group checkpoints; every aligned boundary when there is no sliding group, since full-history
    blocks are registered as they are computed). The end-of-request checkpoint is not included (it depends on
    when the request stops). Schedulers use this to hold back a request that shares this one's prefix."""
    r = self._req(request_id)
    if self.legacy or not self.policies:
      a = self.specs.align_tokens
      return list(range((max(lo, 0) // a + 1) * a, hi + 1, a))
    return next(iter(self.policies.values())).boundaries(lo, hi, r.prompt_len, r.junctions, r.dense)

  # ------------------------------------------------------------------- tiers: externally loaded prefix
  def extend_for_load(self, request_id: str, num_tokens: int, tail_blocks) -> BlockTables | OutOfBlocks:
    """Blocks to receive a prefix [num_computed, num_tokens) loaded from a lower tier: every full-history block up
    to num_tokens, but sliding-group blocks only at the table indices in `tail_blocks` (the checkpoint tails the
    resume reads; -1 elsewhere, as after a device hit). All or nothing; applied at once (ids read back,
    BlockRemoved events emitted). The caller writes the rows, then `commit(request_id, num_tokens)`."""
    r = self._req(request_id)
    if num_tokens % self.specs.align_tokens or num_tokens <= r.num_computed or num_tokens > len(r.tokens) - 1:
      raise CacheError(f"extend_for_load: {num_tokens} must be aligned, > {r.num_computed} and < {len(r.tokens)}")
    self.sync_counts()
    wanted = set(int(j) for j in tail_blocks)
    new = {}
    for g, bt in zip(self.groups, self._bt):
      lo, hi = len(r.tables[g]), num_tokens // bt
      if self.specs.group(g).kind != SLIDING_WINDOW:
        new[g] = list(range(lo, hi))
      elif g == "swa":
        new[g] = [j for j in range(lo, hi) if j in wanted]
      else:   # other sliding groups: the tail a resume at num_tokens reads
        new[g] = [j for j in self.policies[g].tail_blocks(num_tokens) if j >= lo]
      if len(new[g]) > self._nfree[g]:
        return OutOfBlocks(g, len(new[g]), self._nfree[g])
    for g, bt in zip(self.groups, self._bt):
      lo, hi = len(r.tables[g]), num_tokens // bt
      self._ensure_width(g, hi)
      want = set(new[g])
      r.tables[g].extend([HELD if j in want else -1 for j in range(lo, hi)])
      for j in new[g]:
        self._q_alloc[g].append((r.slot, j, j + 1))
      self._q_nalloc[g] += len(new[g])
      self._nfree[g] -= len(new[g])
      self._alloc_total[g] += len(new[g])
    self.flush()
    return self.block_tables(request_id)

  def extend_for_import(self, request_id: str, num_tokens: int) -> BlockTables | OutOfBlocks:
    """Blocks to receive state [num_computed, num_tokens) computed elsewhere (another engine's partially filled
    last blocks), at any point, aligned or not: every group's blocks up to num_tokens, owned by the request exactly
    like blocks it allocates for a step. All or nothing; applied at once (ids read back). The caller writes the
    rows, then `commit(request_id, num_tokens)`: blocks that are complete are registered as after a step, a partially
    filled last block stays the request's own (never cached) until a later step completes it."""
    r = self._req(request_id)
    if not r.num_computed < num_tokens < len(r.tokens):
      raise CacheError(f"extend_for_import: {num_tokens} must be > {r.num_computed} and < {len(r.tokens)} (the last "
                       f"known token is always computed)")
    got = self.allocate_to(request_id, num_tokens)
    if not got:
      return got
    return self.block_tables(request_id)

  # -------------------------------------------------------------------------------------------- misc
  def take_events(self) -> list[KVEvent]:
    self.flush()
    return self.events.take()

  def reset_prefix_cache(self) -> bool:
    """Drop every cached identity; refused (False) while any request holds blocks."""
    if self._requests:
      return False
    self.flush()
    for g in self.groups:
      self._pools[g], ok = P.reset(self._pools[g])
      assert bool(ok)
    self._identity.clear()
    self.events.emit(AllBlocksCleared())
    return True

  def num_free_blocks(self, group: str) -> int:
    """Exact free blocks now (reads the device when releases are not confirmed yet)."""
    if self._free_seen < self._free_seq or self._queued():
      self.sync_counts()
    return self._nfree[group]

  def free_blocks_estimate(self, group: str) -> int:
    """Free blocks as the host knows them without reading the device: never more than the truth."""
    return self._nfree[group]

  def usage(self, group: str) -> float:
    """Fraction of blocks held by requests (cached-but-free blocks count as free, as in vLLM)."""
    return 1.0 - self.num_free_blocks(group) / self.num_blocks[group]

  def is_cached(self, group: str, token_ids, extra_keys: ExtraKeys, block: int) -> bool:
    """Whether block `block` of `group` for this token prefix is findable (tests, debugging)."""
    toks = np.asarray(token_ids, np.int32)
    h = self._hasher(toks, extra_keys)
    bt = self.specs.group(group).block_tokens
    upb = bt // self.specs.hash_tokens
    if len(h.digests) < (block + 1) * upb:
      return False
    key = device_key(h.digests[(block + 1) * upb - 1], self.key_bits)[None]
    par = digest_words(h.parent(block * upb))[None]
    tok = toks[block * bt:(block + 1) * bt][None]
    return int(P.lookup(self.pools[group], jnp.asarray(key), jnp.asarray(par), jnp.asarray(tok))[0]) >= 0
