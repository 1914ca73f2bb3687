"""The bookkeeping the host planner (`cache.manager.KVCacheManager`) queues for the device, as runs of table entries
(registrations, releases, allocations; never a block id), carved into one int32 buffer (`StepPlan`) for
`cache.device_state.apply` or the engine's step, and the results read back: the free counts the planner decides
with, refusals, KV events. Pure host: it never touches a device array (the planner runs plans through its
`DeviceCell`).

Free counts: exact at the last read of a call's results, minus every allocation queued since; releases raise them
only once a read confirms them (siblings may share blocks), so the planner never over-commits
(`cache/manager.py`'s module doc)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from cache import device_state, pool
from cache.events import BlockRemoved, BlockStored, EventLog
from cache.hashing import key_int, keys_from_words
from cache.prefix import group_searches
from cache.specs import FULL_HISTORY, CacheSpecs
from cache.step import AdmitPlan, GroupPlan, InputCarver
from cache.step_plan import ADMIT_ROWS_FIXED, SentCall, StepPlan, bucket_width, units_bucket_width


# Entries per chunk of the step program's release loop, at most. A chunk costs O(its entries + the step's runs), so
# the width matters little: 256 and 4,096 measured the same on the CPU (BUILD_NOTES.md, Cache bookkeeping, Open).
FREE_CHUNK_MAX = 256
_FEW_RUNS = 64        # below this many runs, host index arrays are built run by run (numpy call overhead)


def _empty(shape) -> np.ndarray:
  return np.empty(shape, np.int32)


class StepQueue:
  """The queue, its packing into plans and its results (module doc). Over 400 lines because carving the queue into
  the buffer and reading the buffer back share one layout: split, each half would restate the other's."""

  def __init__(self, specs: CacheSpecs, num_blocks: dict[str, int], *, slots: int, widths: tuple, key_bits: int,
               prepend_uncached: bool, events: EventLog, stats: dict):
    self.groups = specs.names
    self._index = {g: i for i, g in enumerate(self.groups)}
    self.block_tokens = dict(zip(self.groups, specs.block_tokens))   # the one record of each group's block size
    self._G, self._align = specs.hash_tokens, specs.align_tokens
    self._searches = group_searches(specs)
    self.key_bits, self.prepend_uncached, self.events, self.stats = key_bits, prepend_uncached, events, stats
    self.num_blocks = dict(num_blocks)
    # (group, block id) -> (key, tenant) of cached blocks, only to label BlockRemoved events.
    self.identity: dict[tuple[str, int], tuple[int, str]] = {}
    # the device tables' shape as the host plans it: rows (slots) and entries per row (width)
    self.width = dict(zip(self.groups, widths))
    self.num_slots = slots
    self.free_slots = list(range(slots - 1, -1, -1))
    # free counts (module doc): exact at the last read, minus every allocation since
    self.nfree = dict(num_blocks)
    self.alloc_total = {g: 0 for g in self.groups}     # blocks allocated by all calls queued so far
    self.free_seq = 0          # releases queued so far (any count change upwards is unconfirmed until read)
    self.free_seen = 0         # releases whose effect the free counts include
    self.count_seq = -1        # the call whose counts were read last (older reads are ignored)
    self.calls = 0
    self.peak_used = {g: 0 for g in self.groups}
    self.step_widths = None
    self.step_rows = None
    self._free_chunks = tuple(64 for _ in self.groups)     # entries released per iteration of the device's loop
    self._out_layouts = {}      # result buffer layout per (input layout, widths): computed once each
    self._in_treedefs = {}
    self._reset_queue()

  # ------------------------------------------------------------------------------------------ queue
  def _reset_queue(self):
    # Every queued operation is a run of table entries of one slot: plain tuples here, turned into arrays for all
    # runs of a step at once when it is packed (numpy per step, not per request or per block).
    # registrations: (slot, a, b, hasher, token buffer, event infos or None) = blocks a .. b - 1, all held
    self.reg = {g: [] for g in self.groups}
    self.frees = {g: [] for g in self.groups}      # (slot, a, b): release entries b - 1 down to a (eviction order)
    self.alloc = {g: [] for g in self.groups}      # (slot, a, b): fill entries a .. b - 1
    self.nreg = {g: 0 for g in self.groups}        # entries queued per kind (the step's widths)
    self.nfree_q = {g: 0 for g in self.groups}
    self.nalloc = {g: 0 for g in self.groups}
    # requests with queued allocations: a commit or free of theirs applies the queue first (the device runs
    # registrations and releases before allocations)
    self.rids = set()

  def queue_frees(self, slot: int, g: str, runs) -> None:
    """Queue the release of these table runs of one slot, tail first (a chain's last blocks become evictable
    before its head)."""
    if runs:
      q = self.frees[g]
      for a, b in reversed(runs):
        q.append((slot, a, b))
        self.nfree_q[g] += b - a
      self.free_seq += 1

  def queued(self) -> bool:
    """Anything queued besides admissions (the planner keeps those)."""
    return any(self.nreg[g] or self.nfree_q[g] or self.nalloc[g] for g in self.groups)

  def unconfirmed(self) -> bool:
    """Releases queued or sent whose effect on the free counts no read has confirmed yet."""
    return self.free_seen < self.free_seq

  def hold_allocations(self):
    """Take the queued allocations out of the queue (they stay counted), for a call that must run the rest first;
    `restore_allocations` puts them back."""
    held = self.alloc, self.nalloc, self.rids, dict(self.alloc_total)
    self.alloc, self.nalloc = {g: [] for g in self.groups}, {g: 0 for g in self.groups}
    for g in self.groups:
      self.alloc_total[g] -= held[1][g]
    return held

  def restore_allocations(self, held) -> None:
    self.alloc, self.nalloc, self.rids, self.alloc_total = held

  def _group_dims(self, g: str):
    """(registrations, release runs, allocations queued for group g, and their static widths)."""
    nr, nf, na = self.nreg[g], len(self.frees[g]), self.nalloc[g]
    if self.step_widths is not None:
      # an engine's manager: the step's fixed widths whenever the queue fits them, so an admission call compiles
      # one bookkeeping program, not one per queue size
      w = self.step_widths[self._index[g]]
      if nr <= w[0] and nf <= w[1] and na <= w[2]:
        return nr, nf, na, *w
    return nr, nf, na, bucket_width(nr), bucket_width(nf), bucket_width(na)

  def _refs(self, g, runs, reverse=False):
    """Table refs (slot * width + entry) of queued runs (slot, a, b, ...) in queue order: entries a .. b - 1, or
    b - 1 down to a (reverse: a request's releases go tail first). A few runs: one arange each; more: one numpy pass
    over every run."""
    w = self.width[g]
    if len(runs) <= _FEW_RUNS:     # one arange per run: cheaper than the vectorised pass's dozen numpy calls
      if reverse:
        parts = [np.arange(c[0] * w + c[2] - 1, c[0] * w + c[1] - 1, -1) for c in runs]
      else:
        parts = [np.arange(c[0] * w + c[1], c[0] * w + c[2]) for c in runs]
      return np.concatenate(parts)
    if len(runs[0]) == 3:
      s, a, b = np.array(runs, np.int64).reshape(-1, 3).T
    else:
      s, a, b = (np.fromiter((c[k] for c in runs), np.int64, len(runs)) for k in range(3))
    cnt = b - a
    k = np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)   # index inside its run
    ent = np.repeat(b - 1, cnt) - k if reverse else np.repeat(a, cnt) + k
    return np.repeat(s * w, cnt) + ent

  def _reg_words(self, g: str, regs=None):
    """(key digest words [R, 4] uint32, parent words [R, 4] int32) of every queued registration of group g: one
    bytes join and two numpy gathers, not per block. Each run contributes only the digests its blocks span (from
    the parent of its first block to the key of its last), so the cost follows the blocks registered, not the
    requests' lengths."""
    regs = self.reg[g] if regs is None else regs
    upb = self.block_tokens[g] // self._G
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
    if len(regs) <= _FEW_RUNS:     # block j of a run: key = its last unit, parent = the unit before its first
      kidx = np.concatenate([np.arange(o + (c[1] + 1) * upb - 1, o + c[2] * upb, upb) for o, c in zip(at, regs)])
      return w[kidx], w[kidx - upb].view(np.int32)
    a = np.fromiter((c[1] for c in regs), np.int64, len(regs))
    counts = np.fromiter((c[2] for c in regs), np.int64, len(regs)) - a
    j = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts - a, counts)     # block index
    base = np.repeat(np.asarray(at, np.int64), counts)
    return w[base + (j + 1) * upb - 1], w[base + j * upb - 1].view(np.int32)

  def _group_plan(self, g: str, take, dims) -> GroupPlan:
    """The queued work of group g as a GroupPlan; `take(shape)` hands out the (uninitialised) arrays, views of the
    step's one input buffer (InputCarver) in leaf order."""
    bt = self.block_tokens[g]
    regs, frees, allocs = self.reg[g], self.frees[g], self.alloc[g]
    nr, nf, na, r, f, a = dims
    ref, key, par, tok = take((r,)), take((r, 2)), take((r, 4)), take((r, bt))
    ref[nr:], key[nr:], par[nr:], tok[nr:] = -1, 0, 0, 0
    if regs:      # every run at once (numpy), not per block
      ref[:nr] = self._refs(g, regs)
      kw, pw = self._reg_words(g)
      key[:nr] = keys_from_words(kw, self.key_bits)
      par[:nr] = pw
      np.concatenate([c[4][c[1] * bt:c[2] * bt] for c in regs], out=tok[:nr].reshape(-1))
    fr = take((f, 4))
    fr[nf:, :3] = 0
    fr[nf:, 3] = self.nfree_q[g]
    if frees:                 # runs as queued (a request's tail first); the device releases b - 1 down to a
      fr[:nf, :3] = frees
      np.cumsum(fr[:nf, 2] - fr[:nf, 1], out=fr[:nf, 3])
    al = take((a,))
    al[na:] = -1
    if allocs:
      al[:na] = self._refs(g, allocs)
    return GroupPlan(ref, key, par, tok, fr, al)

  def _in_treedef(self, with_admit: bool):
    if with_admit not in self._in_treedefs:
      plans = tuple(GroupPlan(*range(6)) for _ in self.groups)
      admit = AdmitPlan(*range(6)) if with_admit else None
      self._in_treedefs[with_admit] = jax.tree_util.tree_structure((plans, admit))
    return self._in_treedefs[with_admit]

  def _statics(self, admit_widths=None):
    return dict(groups=self._searches, block_tokens=tuple(self.block_tokens.values()), align=self._align,
                hash_tokens=self._G, prepend=self.prepend_uncached,
                admit_widths=admit_widths or tuple(16 for _ in self.groups), free_chunks=self._free_chunks)

  def _carve(self, dims, admits=None, admit_dims=None):
    """Every queued operation (and the admissions, a list of Admission) carved into one InputCarver; resets the
    queue. admit_dims = (rows, units): an admission region of that shape even without
    admissions (all padding). Returns (carver, in_layout, SentCall without layout)."""
    shapes = []
    for (_, _, _, r, f, a), bt in zip(dims, self.block_tokens.values()):
      shapes += [(r,), (r, 2), (r, 4), (r, bt), (f, 4), (a,)]
    toks = None
    if admits:
      toks = [a.tokens for a in admits]
      admit_dims = self.admit_dims(toks)
      # The admissions' hits take blocks that are free but cached (a touch), besides what they allocate: unknown
      # until the result is read, so the host counts the most they can take as allocated by this call (its read
      # replaces the count with the device's). Without it a plan made before the read (async scheduling) can
      # promise blocks a hit already took, and the device refuses that allocation.
      for (g, bt), grp in zip(self.block_tokens.items(), self._searches):
        most = sum(len(t) // bt if grp.kind == FULL_HISTORY else grp.need_blocks for t in toks)
        self.nfree[g] -= most
        self.alloc_total[g] += most
    if admit_dims is not None:
      b, u = admit_dims
      shapes += [(b, u, 2), (b, u, 4), (b, u, self._G), (b,), (b,), (b,)]
    carver = InputCarver(shapes)
    for g, d in zip(self.groups, dims):
      self._group_plan(g, carver.take, d)
    if admits:
      targets = [a.target for a in admits] if any(a.target is not None for a in admits) else None
      self.pack_admissions(toks, [a.hasher for a in admits], targets, [a.slot for a in admits], take=carver.take)
    elif admit_dims is not None:          # an admission region with no row in it
      key, par, tok, max_len, target, slot = (carver.take(sh) for sh in shapes[-6:])
      key[...], par[...], tok[...], max_len[...], target[...], slot[...] = 0, 0, 0, 0, -1, -1
    regs = None
    if self.events.enabled:
      regs = {g: self.reg[g] for g in self.groups}
    sent = SentCall(None, dict(self.alloc_total), self.free_seq, regs, admits or None)
    self.calls += 1
    self._reset_queue()
    return carver, (self._in_treedef(admit_dims is not None), carver.shapes), sent

  # ------------------------------------------------------------------------------------------ plans
  def overflows(self) -> tuple[bool, bool]:
    """(registrations or releases, allocations) queued beyond the step's fixed widths."""
    dims = [self._group_dims(g) for g in self.groups]
    return (any(d[0] > w[0] or d[1] > w[1] for d, w in zip(dims, self.step_widths)),
            any(d[2] > w[2] for d, w in zip(dims, self.step_widths)))

  def step_plan(self, state, admits) -> StepPlan:
    """Everything queued and the admissions (a list of Admission), as the step program's bookkeeping at its fixed
    widths (`set_step_capacity`; the planner ran what did not fit first). state: the DeviceState it will run on
    (its shapes only)."""
    dims = [(nr, nf, na, r, f, a) for (nr, nf, na, _, _, _), (r, f, a) in
            zip((self._group_dims(g) for g in self.groups), self.step_widths)]
    self.stats["step_plans"] += 1
    return self._plan(state, *self._carve(dims, admits), "all" if self.events.enabled else "counts")

  def standalone_plan(self, state, admits, admit_widths=None) -> StepPlan:
    """Everything queued and the admissions, at the widths of what is queued (a call of the planner's own)."""
    dims = [self._group_dims(g) for g in self.groups]
    return self._plan(state, *self._carve(dims, admits), "all", admit_widths)

  def empty_plan(self, state, admit_dims=None) -> StepPlan:
    """A step plan with nothing in it (all padding) of the step's fixed widths and, with admit_dims = (rows,
    units), an admission region of that shape: what the step program costs with nothing to do (benchmarks). The
    queue is left as it is; the plan's results are not to be read (`KVCacheManager.read_results`)."""
    dims = [(0, 0, 0, r, f, a) for r, f, a in self.step_widths]
    saved = (self.reg, self.frees, self.alloc, self.nreg, self.nfree_q, self.nalloc, self.rids, self.calls)
    self._reset_queue()
    self.stats["step_plans"] += 1
    plan = self._plan(state, *self._carve(dims, None, admit_dims), "all" if self.events.enabled else "counts")
    (self.reg, self.frees, self.alloc, self.nreg, self.nfree_q, self.nalloc, self.rids, self.calls) = saved
    return plan

  def _plan(self, state, carver, in_layout, sent, results, admit_widths=None) -> StepPlan:
    statics = self._statics(admit_widths)
    key = (in_layout, results, statics["admit_widths"], tuple(t.shape for t in state.tables))
    layout = self._out_layouts.get(key)
    if layout is None:
      layout = self._out_layouts[key] = device_state.result_layout(state, in_layout, results, statics)
    return StepPlan(carver.buf, tuple(sorted({**statics, "in_layout": in_layout, "results": results}.items())),
                    dataclasses.replace(sent, layout=(layout, self.calls)))

  def set_step_capacity(self, tokens: int, rows: int) -> None:
    """Fix the widths of the bookkeeping the engine's step program carries (one compiled shape): at most
    `tokens` new tokens over `rows` requests per step. Releases are runs of table entries (a request's end is one
    run per group however long it is), at most 2 per row, released on the device in chunks of the width a step's
    own commits need, as many chunks as there are entries. A step whose queue does not fit (more runs, a table
    loaded from a tier with gaps) applies it in a call of its own first (`KVCacheManager.plan`)."""
    w, chunks = [], []
    for (g, bt), grp in zip(self.block_tokens.items(), self._searches):
      need = grp.need_blocks
      a = -(-tokens // bt) + rows
      w.append((-(-(a + 2 * rows * need) // 8) * 8, -(-2 * rows // 8) * 8, -(-a // 8) * 8))
      chunks.append(min(-(-(2 * a + rows * need) // 8) * 8, FREE_CHUNK_MAX))
    self.step_widths = tuple(w)
    self._free_chunks = tuple(chunks)
    self.step_rows = rows

  # ------------------------------------------------------------------------------------------ results
  def read(self, res, sent: SentCall, seq: int) -> None:
    """Read one call's results (unpacked): refusals are bugs (raise), events, and the free counts. The admissions it
    carried are the planner's (`KVCacheManager._resolve_admissions`)."""
    counts = res["counters"] if "counters" in res else [None] * len(self.groups)
    for gi, g in enumerate(self.groups):
      c = counts[gi]
      if c is None:
        bad_reg = int(np.count_nonzero(res["status"][gi] == pool.INVALID))
        bad_free, bad_alloc = not res["free_ok"][gi], not res["alloc_ok"][gi]
        dup = int(np.count_nonzero(res["status"][gi] == pool.DUPLICATE))
        full = int(np.count_nonzero(res["status"][gi] == pool.TABLE_FULL))
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
      if seq > self.count_seq:
        # the device count after this call, less what calls sent after it allocate (releases sent after it are
        # not counted until a later read confirms them)
        self.nfree[g] = nfree - (self.alloc_total[g] - sent.alloc_total[g])
        self.peak_used[g] = max(self.peak_used[g], self.num_blocks[g] - nfree)
    if seq > self.count_seq:
      self.count_seq = seq
      self.free_seen = sent.free_seq

  def _events_of(self, g, gi, res, sent: SentCall):
    regs = sent.regs[g]
    if regs:
      n = sum(c[2] - c[1] for c in regs)
      ids, st = res["reg_ids"][gi][:n], res["status"][gi][:n]
      keys = None
      infos = [i for c in regs for i in c[5]]
      for i in np.flatnonzero(st == pool.STORED):
        if keys is None:
          keys = keys_from_words(self._reg_words(g, regs)[0], self.key_bits)
        kk = key_int(keys[i])
        parent, tenant, bt = infos[i]
        b = int(ids[i])
        self.identity[(g, b)] = (kk, tenant)
        self.events.emit(BlockStored(kk, parent, g, tenant, b, bt))
    for ids, ev in ((res["alloc_ids"][gi], res["alloc_ev"][gi]),
                    (res["admit_ids"][gi], res["admit_ev"][gi]) if "admit_ids" in res else ((), ())):
      for b, e in zip(ids, ev):
        if e:
          k, tenant = self.identity.pop((g, int(b)))
          self.events.emit(BlockRemoved(k, g, tenant, int(b)))

  # ------------------------------------------------------------------------------------------ admission batch
  def admit_dims(self, toks):
    """(requests, hash units per request) of an admission batch: static widths."""
    per_align = self._align // self._G
    u = units_bucket_width(max(len(t) // self._G for t in toks))
    b = 1 << (len(toks) - 1).bit_length()        # powers of 2: padding rows cost a whole search each
    if self.step_rows is not None and self.step_rows <= ADMIT_ROWS_FIXED:
      # an engine admitting into few rows: one admission shape (each new shape is a compile of the whole
      # bookkeeping program, seconds; a few padded rows' searches cost far less)
      b = max(b, self.step_rows)
    return b, -(-u // per_align) * per_align

  def pack_admissions(self, toks, hashers, targets=None, slots=None, take=_empty) -> AdmitPlan:
    """The admission batch as an AdmitPlan (arrays from `take`, see _group_plan). Keys and parents of all requests
    from one bytes join, copied per request for a few requests, in one scattered numpy pass for many."""
    g = self._G
    b, u = self.admit_dims(toks)
    key, par, tok, max_len, target, slot = (take((b, u, 2)), take((b, u, 4)), take((b, u, g)), take((b,)),
                                            take((b,)), take((b,)))
    nb = len(toks)
    ns_l = [min(u, len(h.digests)) for h in hashers]
    tot = sum(ns_l)
    key[...] = 0
    par[...] = 0
    if tot and nb <= _FEW_RUNS:      # a few requests: slice copies per request beat the scattered pass below
      w = np.frombuffer(b"".join(h.blob[:16 * n] for h, n in zip(hashers, ns_l)), dtype="<u4").reshape(tot, 4)
      kw, pw = keys_from_words(w, self.key_bits), w.view(np.int32)
      o = 0
      for i, (h, n) in enumerate(zip(hashers, ns_l)):
        if n:                        # parent of unit c = digest of unit c - 1, the root for c = 0
          key[i, :n] = kw[o:o + n]
          par[i, 0] = np.frombuffer(h.root, "<i4")
          par[i, 1:n] = pw[o:o + n - 1]
          o += n
    elif tot:
      ns = np.array(ns_l, np.int64)
      w = np.frombuffer(b"".join(h.blob[:16 * n] for h, n in zip(hashers, ns_l)), dtype="<u4").reshape(tot, 4)
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
    max_len[:nb] = [max(len(t) - 1, 0) for t in toks]
    target[:] = -1
    if targets is not None:
      target[:nb] = [-1 if t is None else t for t in targets]
    slot[:] = -1
    if slots is not None:
      slot[:nb] = slots
    return AdmitPlan(key, par, tok, max_len, target, slot)

  # ------------------------------------------------------------------------------------------ the step program
