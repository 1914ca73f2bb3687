"""The device half of `KVCacheManager` (cache/manager.py): the device state it owns (one block pool per cache
group and every request's block tables), the queue of bookkeeping the host planner fills (registrations, releases,
allocations, as runs of table entries), carving that queue into one int32 buffer, running it (`apply_step_packed`,
or the engine's step program through `take_step_plan`), and reading the results back: the free counts, refusals,
KV events. A mixin: `KVCacheManager` inherits it and sets the group layout it reads (`groups`, `_bt`, `_bt_of`,
`_G`, `_align`, `_searches`, `policies`, `key_bits`, `prepend_uncached`, `events`, `stats`) before calling
`_init_device_state`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from cache import pool
from cache.api_types import CacheError
from cache.events import BlockRemoved, BlockStored
from cache.hashing import key_int, keys_from_words
from cache.specs import FULL_HISTORY
from cache.step import AdmitPlan, GroupPlan, InputCarver, apply_step_packed, result_layout, unpack
from cache.step_plan import ADMIT_ROWS_FIXED, SentCall, StepPlan, bucket_width, units_bucket_width


# Entries per chunk of the step program's release loop, at most. A chunk costs O(its entries + the step's runs), so
# the width matters little: 256 and 4,096 measured the same on the CPU (BUILD_NOTES.md, Cache bookkeeping, Open).
FREE_CHUNK_MAX = 256
_FEW_RUNS = 64        # below this many runs, host index arrays are built run by run (numpy call overhead)


def _empty(shape) -> np.ndarray:
  return np.empty(shape, np.int32)


class DeviceQueue:
  """Device state, the bookkeeping queue and its results (see the module doc); mixed into KVCacheManager."""

  def _init_device_state(self, sizes: dict[str, int], max_probe: int, num_slots: int | None,
                         max_tokens: int | None) -> None:
    """The device state (pools, block tables), the host's view of its free counts, and an empty queue. Called by
    the manager's __init__ once its group layout is set."""
    self._pools = {g.name: pool.init_pool(sizes[g.name], g.block_tokens, max_probe) for g in self.specs.groups}
    self.num_blocks = {g: sizes[g] for g in self.groups}
    # (group, block id) -> (key, tenant) of cached blocks, only to label BlockRemoved events.
    self._identity: dict[tuple[str, int], tuple[int, str]] = {}
    # device block tables: per group [slots, width], -1 where no block
    self._fixed = num_slots is not None and max_tokens is not None
    slots = num_slots or 8
    width = {g: max(8, -(-(max_tokens or 2048) // bt)) for g, bt in zip(self.groups, self._bt)}
    self._tab = jax.device_put({g: np.full((slots, width[g]), -1, np.int32) for g in self.groups})
    self._width = dict(width)      # the tables' widths, without touching the device arrays
    self._free_slots = list(range(slots - 1, -1, -1))
    # free counts (see cache/manager.py's module doc): exact at the last read, minus every allocation since
    self._nfree = dict(sizes)
    self._alloc_total = {g: 0 for g in self.groups}     # blocks allocated by all calls queued so far
    self._free_seq = 0          # releases queued so far (any count change upwards is unconfirmed until read)
    self._free_seen = 0         # releases whose effect the free counts include
    self._count_seq = -1        # the call whose counts were read last (older reads are ignored)
    self._calls = 0
    self.peak_used = {g: 0 for g in self.groups}
    self._step_widths = None
    self._step_rows = None
    self._free_chunks = tuple(64 for _ in self.groups)     # entries released per iteration of the device's loop
    self._reset_queue()
    self._q_admit = []          # queued admissions (Admission), sent with the next call that runs the queue
    self._admitting = {}        # request id -> Admission, queued or in flight (result not read)
    self._admitted = []         # (request id, PrefixHit) of queued admissions resolved, for take_admitted()
    self._out_layouts = {}      # result buffer layout per (input layout, widths): computed once each
    self._in_treedefs = {}

  # ------------------------------------------------------------------------------------------ slots, tables
  @property
  def num_slots(self) -> int:
    return self._tab[self.groups[0]].shape[0]

  def table_width(self, group: str) -> int:
    return self._tab[group].shape[1]

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

  def _queue_frees(self, slot: int, g: str, runs) -> None:
    """Queue the release of these table runs of one slot, tail first (a chain's last blocks become evictable
    before its head)."""
    if runs:
      q = self._q_free[g]
      for a, b in reversed(runs):
        q.append((slot, a, b))
        self._q_nfree[g] += b - a
      self._free_seq += 1

  def _queued(self) -> bool:
    return bool(self._q_admit) or any(self._q_nreg[g] or self._q_nfree[g] or self._q_nalloc[g] for g in self.groups)

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
    """(registrations, release runs, allocations queued for group g, and their static widths)."""
    nr, nf, na = self._q_nreg[g], len(self._q_free[g]), self._q_nalloc[g]
    if self._step_widths is not None:
      # an engine's manager: the step's fixed widths whenever the queue fits them, so an admission call compiles
      # one bookkeeping program, not one per queue size
      w = self._step_widths[self.groups.index(g)]
      if nr <= w[0] and nf <= w[1] and na <= w[2]:
        return nr, nf, na, *w
    return nr, nf, na, bucket_width(nr), bucket_width(nf), bucket_width(na)

  def _refs(self, g, runs, reverse=False):
    """Table refs (slot * width + entry) of queued runs (slot, a, b, ...) in queue order: entries a .. b - 1, or
    b - 1 down to a (reverse: a request's releases go tail first). A few runs: one arange each; more: one numpy pass
    over every run."""
    w = self.table_width(g)
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
    fr = take((f, 4))
    fr[nf:, :3] = 0
    fr[nf:, 3] = self._q_nfree[g]
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
    return dict(groups=self._searches, block_tokens=self._bt, align=self._align,
                hash_tokens=self._G, prepend=self.prepend_uncached,
                admit_widths=admit_widths or tuple(16 for _ in self.groups), free_chunks=self._free_chunks)

  def _carve(self, dims, admits=None, admit_dims=None):
    """Every queued operation (and the admissions, a list of Admission) carved into one InputCarver; resets the
    queue (admissions included). admit_dims = (rows, units): an admission region of that shape even without
    admissions (all padding). Returns (carver, in_layout, SentCall without layout)."""
    shapes = []
    for (_, _, _, r, f, a), bt in zip(dims, self._bt):
      shapes += [(r,), (r, 2), (r, 4), (r, bt), (f, 4), (a,)]
    toks = None
    if admits:
      toks = [a.tokens for a in admits]
      admit_dims = self._admit_dims(toks)
      # The admissions' hits take blocks that are free but cached (a touch), besides what they allocate: unknown
      # until the result is read, so the host counts the most they can take as allocated by this call (its read
      # replaces the count with the device's). Without it a plan made before the read (async scheduling) can
      # promise blocks a hit already took, and the device refuses that allocation.
      for g, grp, bt in zip(self.groups, self._searches, self._bt):
        most = sum(len(t) // bt if grp.kind == FULL_HISTORY else grp.need_blocks for t in toks)
        self._nfree[g] -= most
        self._alloc_total[g] += most
    if admit_dims is not None:
      b, u = admit_dims
      shapes += [(b, u, 2), (b, u, 4), (b, u, self._G), (b,), (b,), (b,)]
    carver = InputCarver(shapes)
    for g, d in zip(self.groups, dims):
      self._group_plan(g, carver.take, d)
    if admits:
      targets = [a.target for a in admits] if any(a.target is not None for a in admits) else None
      self._pack(toks, [a.hasher for a in admits], targets, [a.slot for a in admits], take=carver.take)
      self._q_admit = []
    elif admit_dims is not None:          # an admission region with no row in it
      key, par, tok, max_len, target, slot = (carver.take(sh) for sh in shapes[-6:])
      key[...], par[...], tok[...], max_len[...], target[...], slot[...] = 0, 0, 0, 0, -1, -1
    regs = None
    if self.events.enabled:
      regs = {g: self._q_reg[g] for g in self.groups}
    sent = SentCall(None, dict(self._alloc_total), self._free_seq, regs, admits or None)
    self._calls += 1
    self._reset_queue()
    return carver, (self._in_treedef(admit_dims is not None), carver.shapes), sent

  def _apply(self, admits=None, admit_widths=None):
    """One device call: the queued work plus the admissions (a list of Admission; None = the queued ones). Every
    plan array is a view of one int32 buffer (one transfer in); every result comes back in one int32 buffer (one
    transfer out), unpacked as numpy views."""
    dims = [self._group_dims(g) for g in self.groups]
    carver, in_layout, sent = self._carve(dims, self._q_admit if admits is None else admits)
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

  def _on_result(self, res, sent: SentCall, seq: int) -> None:
    """Read one call's results: refusals are bugs (raise), events, and the free counts."""
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
      if seq > self._count_seq:
        # the device count after this call, less what calls sent after it allocate (releases sent after it are
        # not counted until a later read confirms them)
        self._nfree[g] = nfree - (self._alloc_total[g] - sent.alloc_total[g])
        self.peak_used[g] = max(self.peak_used[g], self.num_blocks[g] - nfree)
    if seq > self._count_seq:
      self._count_seq = seq
      self._free_seen = sent.free_seq
    if sent.admits:
      self._resolve_admissions(res, sent.admits)

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
        self._identity[(g, b)] = (kk, tenant)
        self.events.emit(BlockStored(kk, parent, g, tenant, b, bt))
    for ids, ev in ((res["alloc_ids"][gi], res["alloc_ev"][gi]),
                    (res["admit_ids"][gi], res["admit_ev"][gi]) if "admit_ids" in res else ((), ())):
      for b, e in zip(ids, ev):
        if e:
          k, tenant = self._identity.pop((g, int(b)))
          self.events.emit(BlockRemoved(k, g, tenant, int(b)))

  # ------------------------------------------------------------------------------------------ admission batch
  def _admit_dims(self, toks):
    """(requests, hash units per request) of an admission batch: static widths."""
    per_align = self._align // self._G
    u = units_bucket_width(max(len(t) // self._G for t in toks))
    b = 1 << (len(toks) - 1).bit_length()        # powers of 2: padding rows cost a whole search each
    if self._step_rows is not None and self._step_rows <= ADMIT_ROWS_FIXED:
      # an engine admitting into few rows: one admission shape (each new shape is a compile of the whole
      # bookkeeping program, seconds; a few padded rows' searches cost far less)
      b = max(b, self._step_rows)
    return b, -(-u // per_align) * per_align

  def _pack(self, toks, hashers, targets=None, slots=None, take=_empty) -> AdmitPlan:
    """The admission batch as an AdmitPlan (arrays from `take`, see _group_plan). Keys and parents of all requests
    from one bytes join, copied per request for a few requests, in one scattered numpy pass for many."""
    g = self._G
    b, u = self._admit_dims(toks)
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
  def set_step_capacity(self, tokens: int, rows: int) -> None:
    """Fix the widths of the bookkeeping the engine's step program carries (one compiled shape): at most
    `tokens` new tokens over `rows` requests per step. Releases are runs of table entries (a request's end is one
    run per group however long it is), at most 2 per row, released on the device in chunks of the width a step's
    own commits need, as many chunks as there are entries. A step whose queue does not fit (more runs, a table
    loaded from a tier with gaps) applies it in a call of its own first (`take_step_plan`)."""
    w, chunks = [], []
    for g, bt in zip(self.groups, self._bt):
      need = self.policies[g].need_blocks if g in self.policies else 0
      a = -(-tokens // bt) + rows
      w.append((-(-(a + 2 * rows * need) // 8) * 8, -(-2 * rows // 8) * 8, -(-a // 8) * 8))
      chunks.append(min(-(-(2 * a + rows * need) // 8) * 8, FREE_CHUNK_MAX))
    self._step_widths = tuple(w)
    self._free_chunks = tuple(chunks)
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
      self._apply([])                 # (queued admissions stay for the step: they follow its allocations)
      self._q_alloc, self._q_nalloc, self._q_rids, self._alloc_total = allocs, nalloc, rids, tot
      dims = [self._group_dims(g) for g in self.groups]
    if any(d[2] > w[2] for d, w in zip(dims, self._step_widths)):
      self.stats["step_plan_overflows"] += 1
      self._apply([])
      dims = [self._group_dims(g) for g in self.groups]
    dims = [(nr, nf, na, r, f, a) for (nr, nf, na, _, _, _), (r, f, a) in zip(dims, self._step_widths)]
    return self._step_plan(*self._carve(dims, self._q_admit))

  def empty_step_plan(self, admit_dims=None) -> StepPlan:
    """A step plan with nothing in it (all padding) of the step's fixed widths and, with admit_dims = (rows,
    units), an admission region of that shape: what the step program costs with nothing to do (benchmarks). The
    queue is left as it is; the plan's results are not to be handed back (`on_step_result`)."""
    if self._step_widths is None:
      raise CacheError("empty_step_plan: call set_step_capacity first")
    dims = [(0, 0, 0, r, f, a) for r, f, a in self._step_widths]
    saved = (self._q_reg, self._q_free, self._q_alloc, self._q_nreg, self._q_nfree, self._q_nalloc, self._q_rids,
             self._calls)
    self._reset_queue()
    plan = self._step_plan(*self._carve(dims, None, admit_dims))
    (self._q_reg, self._q_free, self._q_alloc, self._q_nreg, self._q_nfree, self._q_nalloc, self._q_rids,
     self._calls) = saved
    return plan

  def _step_plan(self, carver, in_layout, sent) -> StepPlan:
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

  def run_queue(self) -> None:
    """Run what is queued (admissions included) now and read its results: in the engine's own bookkeeping program
    once the step's widths are fixed (the step program's first part, so no other shape compiles), else in a
    standalone call."""
    if not self._queued():
      return
    if self._step_widths is not None:
      plan = self.take_step_plan()
      pools, tables, out = apply_step_packed(*self.device_state(), plan.buf, **dict(plan.statics))
      self.set_device_state(pools, tables)
      self.stats["device_calls"] += 1
      self.on_step_result(plan, jax.device_get(out))
    else:
      self._apply(None)

  def sync_counts(self) -> None:
    """Apply what is queued and read the device's free counts (waits for every call sent): exact counts."""
    self.stats["syncs"] += 1
    self.run_queue()
    if self._free_seen < self._free_seq or self._admitting:     # (admissions in flight: counted at their most)
      nf = jax.device_get([self._pools[g].num_free for g in self.groups])
      for g, n in zip(self.groups, nf):
        self._nfree[g] = int(n)
      self._free_seen = self._free_seq
      self._count_seq = self._calls
