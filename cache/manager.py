"""KVCacheManager: the host-side facade the engine calls. Owns one block pool per cache group (jitted, donated
array state), the requests' block tables and hashes, checkpoints of the sliding groups, and the KV event stream.

It works from plain `cache.specs.CacheSpecs` (any number of full-history and sliding-window groups); the model
side builds them (`dsv4.caches.group_specs(config, layout)`).

Lifecycle of a request (all token counts are absolute positions in the request):

    mgr = KVCacheManager(specs, num_blocks={"full": ..., "swa": ...}, retention_interval=0)
    hit = mgr.add_request("r1", prompt_ids, ExtraKeys(tenant="t"))   # lookup + claim; hit.num_tokens to skip
    tables = mgr.allocate_for("r1", n)         # BlockTables covering positions [0, num_computed + n), or
                                               # OutOfBlocks (nothing changed: the scheduler waits or preempts)
    ... model step writes KV for the chunk ...
    mgr.commit("r1", num_computed)             # register full blocks + checkpoints, release rows behind the tail
    mgr.append_tokens("r1", [sampled])         # outputs, so later blocks can be hashed
    mgr.free("r1")                             # end-of-request checkpoint, then release everything (tail first)
    mgr.take_events()                          # BlockStored / BlockRemoved / AllBlocksCleared

**One device call per step.** Operations are queued on the host and applied by ONE jitted `step.apply_step`
(one transfer in, one out) when a result is needed:
* `commit`, `free` and `allocate_for` never call the device: registrations and frees are queued; allocations are
  decided against an exact host mirror of the free counts (so OutOfBlocks is answered at once) and their block ids
  are filled in by the next call. `BlockTables` returned by allocate_for resolve lazily on first access.
* `add_requests([...])` (or `add_request`) runs the queued work plus the batched search, the claim and, with
  `allocate_tokens`, the first allocation of every admitted request, in that one call.
* `flush()` applies what is queued (the engine calls it, or `block_tables`, once per step before the model runs).
So a decode step costs one call; a step that admits requests through `add_requests` costs one call too.

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


@dataclasses.dataclass(frozen=True)
class PrefixHit:
  num_tokens: int                      # tokens to skip (aligned; 0 = miss)
  block_ids: dict[str, np.ndarray]     # per group, the table prefix for [0, num_tokens); sliding: -1 before the tail

  @property
  def full(self) -> np.ndarray:
    return self.block_ids["full"]

  @property
  def swa(self) -> np.ndarray:
    return self.block_ids["swa"]


class BlockTables:
  """Per-group block tables of one request (dict by group name; `.full` / `.swa` for today's engine). Built
  lazily: the ids of blocks allocated since the last device call are filled in on first access."""

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


PENDING = -2     # table entry: allocated, id filled in by the next device call


class _Buf:
  """A growable int32 numpy buffer (doubling): a request's block table of one group (entries: block id, -1
  released / not needed, PENDING) or its token list. Slices and masks replace per-block Python loops."""

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


@dataclasses.dataclass
class _Request:
  rid: str
  tokens: _Buf
  hasher: RequestHasher
  tenant: str
  prompt_len: int
  num_computed: int
  tables: dict[str, _Buf]            # -1: released / not needed; PENDING: allocated, id not known yet
  num_registered: dict[str, int]       # full groups: leading blocks already offered to the cache
  released: dict[str, int]             # sliding groups: leading blocks already released
  junctions: tuple[int, ...] = ()      # extra checkpoint boundaries (shared-prefix junction)
  dense: bool = True                   # take the dense-start checkpoints (only a request that hit nothing does)
  plan: tuple[int, ...] | None = None  # its checkpoint boundaries (policy.plan), computed at the first commit


def _bucket(n: int, lo: int = 16) -> int:
  """Static widths in powers of 4 from `lo`, so each shape compiles a handful of times at most."""
  w = lo
  while w < n:
    w *= 4
  return w


def _units_bucket(n: int) -> int:
  """Hash units per request in a search: powers of 4 from 64 (2048 tokens at 32-token units)."""
  return _bucket(n, 64)


class KVCacheManager:

  def __init__(self, specs: CacheSpecs, *, num_blocks: dict[str, int] | None = None,
               num_full_blocks: int | None = None, num_swa_blocks: int | None = None, retention_interval: int = 0,
               model_id: str = "", key_bits: int = 64, max_probe: int = P.DEFAULT_MAX_PROBE,
               enable_events: bool = True, legacy_dense_swa: bool = False, dense_start: bool = True,
               rerender_tokens: int = 64, junction_checkpoints: bool = True):
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
    self._pools = {g.name: P.init_pool(sizes[g.name], g.block_tokens, max_probe) for g in specs.groups}
    self.num_blocks = {g: sizes[g] for g in self.groups}
    self.model_id, self.key_bits = model_id, key_bits
    self.legacy = legacy_dense_swa
    self.prepend_uncached = not legacy_dense_swa
    self.events = EventLog(enable_events)
    self._requests: dict[str, _Request] = {}
    # (group, block id) -> (key, tenant) of cached blocks, only to label BlockRemoved events.
    self._identity: dict[tuple[str, int], tuple[int, str]] = {}
    # Host mirror of reference counts and free counts (exact): allocate_for answers without the device.
    self._ref = {g: np.zeros(sizes[g], np.int32) for g in self.groups}
    self._nfree = dict(sizes)
    # releases not yet applied to the mirror: settled in one numpy pass per step, before anything reads the counts
    self._unsettled = {g: [] for g in self.groups}
    self._reset_queue()
    self._out_layouts = {}      # result buffer layout per (input layout, widths): computed once each
    self._in_treedefs = {}
    self.stats = {"table_full": 0, "duplicate": 0, "queried_tokens": 0, "hit_tokens": 0, "device_calls": 0}

  # ------------------------------------------------------------------------------------------ queue
  def _reset_queue(self):
    # chunks (ids, hasher, first block index, explicit block indices or None (= contiguous), tokens [m, bt], event
    # infos or None), one per _register call (never
    # empty); turned into arrays for all chunks at once when the step is packed (numpy per step, not per request)
    self._q_reg = {g: [] for g in self.groups}
    self._q_free = {g: [] for g in self.groups}     # arrays of released ids (eviction order), concatenated per step
    self._q_alloc = {g: [] for g in self.groups}    # (table, table indices) waiting for ids
    self._q_nalloc = {g: 0 for g in self.groups}
    self._q_rids = set()          # requests whose tables hold PENDING (ids of queued allocations, not known yet)

  @property
  def pools(self) -> dict:
    """The pool states, with everything queued applied first (tests, debugging, eviction policies)."""
    self.flush()
    return self._pools

  def flush(self) -> None:
    """Apply every queued operation in one device call (no-op when nothing is queued)."""
    if any(self._q_reg[g] or self._q_free[g] or self._q_nalloc[g] for g in self.groups):
      self._check_free_counts(self._apply(None))

  def _group_dims(self, g: str):
    """(registrations, frees, their static widths) queued for group g."""
    nr = sum(len(c[0]) for c in self._q_reg[g])
    nf = sum(len(a) for a in self._q_free[g])
    return nr, nf, _bucket(nr), _bucket(nf)

  def _group_plan(self, g: str, take=_empty, dims=None) -> GroupPlan:
    """The queued work of group g as a GroupPlan; `take(shape)` hands out the (uninitialised) arrays, views of the
    step's one input buffer (InputCarver) in leaf order."""
    bt = self._bt_of[g]
    regs, frees = self._q_reg[g], self._q_free[g]
    nr, nf, r, f = dims or self._group_dims(g)
    ids, key, par, tok = take((r,)), take((r, 2)), take((r, 4)), take((r, bt))
    ids[nr:], key[nr:], par[nr:], tok[nr:] = -1, 0, 0, 0
    if regs:      # whole chunks at once (numpy), not per block
      np.concatenate([c[0] for c in regs], out=ids[:nr])
      kw, pw = self._reg_words(g)
      key[:nr] = keys_from_words(kw, self.key_bits)
      par[:nr] = pw
      np.concatenate([c[4] for c in regs], out=tok[:nr])
    fr = take((f,))
    fr[nf:] = -1
    if frees:
      np.concatenate(frees, out=fr[:nf])
    n = take(())
    n[...] = self._q_nalloc[g]
    return GroupPlan(ids, key, par, tok, fr, n)

  def _settle(self) -> None:
    """Apply the queued releases to the host mirror: one pass over all of them (not numpy calls per request)."""
    for g in self.groups:
      q = self._unsettled[g]
      if not q:
        continue
      a = np.concatenate(q) if len(q) > 1 else q[0]
      q.clear()
      ref = self._ref[g]
      np.subtract.at(ref, a, 1)        # exact when siblings release the same block in one step
      z = a[ref[a] == 0]
      self._nfree[g] += len(np.unique(z)) if len(z) > 1 else len(z)

  def _in_treedef(self, with_admit: bool):
    if with_admit not in self._in_treedefs:
      plans = tuple(GroupPlan(*range(6)) for _ in self.groups)
      self._in_treedefs[with_admit] = jax.tree_util.tree_structure((plans, AdmitPlan(*range(5)) if with_admit else None))
    return self._in_treedefs[with_admit]

  def _apply(self, admit=None, admit_widths=None):
    """One device call: the queued work plus, with admit = (token arrays, hashers, allocate targets or None), the
    batched admission. Every plan array is a view of one int32 buffer (one transfer in); every result comes back
    in one int32 buffer (one transfer out), unpacked as numpy views."""
    self._settle()
    G = self._G
    shapes = []
    dims = [self._group_dims(g) for g in self.groups]
    for (_, _, r, f), bt in zip(dims, self._bt):
      shapes += [(r,), (r, 2), (r, 4), (r, bt), (f,), ()]
    if admit is not None:
      b, u = self._admit_dims(admit[0])
      shapes += [(b, u, 2), (b, u, 4), (b, u, G), (b,), (b,)]
    carver = InputCarver(shapes)
    plans = tuple(self._group_plan(g, carver.take, d) for g, d in zip(self.groups, dims))
    if admit is not None:
      self._pack(*admit, take=carver.take)
    alloc_w = tuple(_bucket(self._q_nalloc[g]) for g in self.groups)
    if admit_widths is None:
      admit_widths = tuple(16 for _ in self.groups)
    in_layout = (self._in_treedef(admit is not None), carver.shapes)
    statics = dict(groups=self._searches, block_tokens=self._bt, align=self.specs.align_tokens, hash_tokens=G,
                   prepend=self.prepend_uncached, alloc_widths=alloc_w, admit_widths=admit_widths)
    pools = tuple(self._pools[g] for g in self.groups)
    lkey = (in_layout, alloc_w, admit_widths)
    if lkey not in self._out_layouts:
      self._out_layouts[lkey] = result_layout(pools, in_layout, **statics)
    pools, out = apply_step_packed(pools, carver.buf, in_layout=in_layout, **statics)
    res = unpack(np.asarray(jax.device_get(out)), *self._out_layouts[lkey])   # the one device -> host transfer
    self.stats["device_calls"] += 1
    self._pools = dict(zip(self.groups, pools))
    for gi, g in enumerate(self.groups):
      if not res["free_ok"][gi]:
        raise RuntimeError(f"free refused blocks of group {g}: {self._q_free[g]}")
      if not res["alloc_ok"][gi]:
        raise RuntimeError(f"allocate of {self._q_nalloc[g]} blocks failed in group {g} after the free check")
      self._after_register(g, res["status"][gi])
      ids, ev = res["alloc_ids"][gi], res["alloc_ev"][gi]
      self._removed(g, ids[:self._q_nalloc[g]], ev[:self._q_nalloc[g]])
      k = 0
      for tab, idx in self._q_alloc[g]:
        tab.buf[idx] = ids[k:k + len(idx)]
        k += len(idx)
      self._ref[g][ids[:self._q_nalloc[g]]] = 1
    self._reset_queue()
    return res

  def _check_free_counts(self, res):
    for gi, g in enumerate(self.groups):
      if int(res["num_free"][gi]) != self._nfree[g]:
        raise RuntimeError(f"group {g}: device free count {int(res['num_free'][gi])} != host {self._nfree[g]}")

  def _removed(self, g, ids, ev):
    if not self.events.enabled:   # identities are tracked only to label events
      return
    for b, e in zip(ids, ev):
      if e:
        k, tenant = self._identity.pop((g, int(b)))
        self.events.emit(BlockRemoved(k, g, tenant, int(b)))

  def _after_register(self, g, status):
    regs = self._q_reg[g]
    if not regs:
      return
    ids = np.concatenate([c[0] for c in regs])
    st = np.asarray(status)[:len(ids)]
    if (st == P.INVALID).any():
      raise RuntimeError(f"register refused block {int(ids[np.argmax(st == P.INVALID)])} of group {g}")
    self.stats["duplicate"] += int(np.count_nonzero(st == P.DUPLICATE))
    self.stats["table_full"] += int(np.count_nonzero(st == P.TABLE_FULL))
    if not self.events.enabled:
      return
    keys = keys_from_words(self._reg_words(g)[0], self.key_bits)
    infos = [i for c in regs for i in c[5]]
    for i in np.flatnonzero(st == P.STORED):
      kk = key_int(keys[i])
      parent, tenant, bt = infos[i]
      b = int(ids[i])
      self._identity[(g, b)] = (kk, tenant)
      self.events.emit(BlockStored(kk, parent, g, tenant, b, bt))

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
    per_align = self.specs.align_tokens // self._G
    u = _units_bucket(max(len(t) // self._G for t in toks))
    b = 1 << (len(toks) - 1).bit_length()        # powers of 2: padding rows cost a whole search each
    return b, -(-u // per_align) * per_align

  def _pack(self, toks, hashers, targets=None, take=_empty) -> AdmitPlan:
    """The admission batch as an AdmitPlan (arrays from `take`, see _group_plan). Keys and parents of all requests
    in one numpy pass (one bytes join), not per request."""
    g = self._G
    b, u = self._admit_dims(toks)
    key, par, tok, max_len, target = take((b, u, 2)), take((b, u, 4)), take((b, u, g)), take((b,)), take((b,))
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
    tok[nb:] = 0
    for i, t in enumerate(toks):
      nu = len(t) // g
      tok[i, :nu] = t[:nu * g].reshape(nu, g)
      tok[i, nu:] = 0
    max_len[:] = 0
    max_len[:nb] = np.maximum(np.fromiter((len(t) for t in toks), np.int64, nb) - 1, 0)
    target[:] = -1
    if targets is not None:
      target[:nb] = [-1 if t is None else t for t in targets]
    return AdmitPlan(key, par, tok, max_len, target)

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
    blocks = {}
    for name, gid, bt, srch in zip(self.groups, ids, self._bt, self._searches):
      e = n // bt
      if compact and srch.kind != FULL_HISTORY:
        tab = np.full(e, -1, np.int32)
        k = min(e, gid.shape[1])
        if k:
          tab[e - k:] = gid[i, gid.shape[1] - k:]
        blocks[name] = tab
      else:
        blocks[name] = gid[i, :e].copy()
    self.stats["queried_tokens"] += n_query
    self.stats["hit_tokens"] += n
    return PrefixHit(n, blocks)

  # ------------------------------------------------------------------------------------------- requests
  def _req(self, rid: str) -> _Request:
    if rid not in self._requests:
      raise CacheError(f"unknown request {rid!r}")
    return self._requests[rid]

  def add_request(self, request_id: str, prompt_token_ids, extra_keys: ExtraKeys = ExtraKeys()) -> PrefixHit:
    """Look up the prompt and claim the hit blocks (every group before any allocation)."""
    return self.add_requests([(request_id, prompt_token_ids, extra_keys)])[0]

  def add_requests(self, requests, allocate_tokens=None) -> list[PrefixHit]:
    """Admit several requests in ONE device call (with everything queued): search, claim, and with
    `allocate_tokens[i]` (total tokens to cover, e.g. hit + first chunk; None = no allocation) their first
    allocation. If the pools cannot cover every admitted request's allocation, none is made (check
    `block_tables` / call allocate_for)."""
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
    if allocate_tokens is not None and len(allocate_tokens) != len(reqs):
      raise CacheError("add_requests: allocate_tokens must have one entry per request")
    if allocate_tokens is not None and any(t is not None and t < 0 for t in allocate_tokens):
      raise CacheError("add_requests: allocate_tokens must be >= 0")
    hashers = [self._hasher(t, e) for _, t, e in reqs]
    tgts = [t for t in allocate_tokens if t is not None] if allocate_tokens is not None else []
    widths = tuple(_bucket(sum(-(-int(t) // bt) for t in tgts)) for bt in self._bt)
    res = self._apply(([t for _, t, _ in reqs], hashers, allocate_tokens), widths)
    hit, run, ids = res["hit"], res["run"], res["hit_ids"]
    out = []
    nb = len(reqs)
    for gi, g in enumerate(self.groups):    # claims (the device did them) mirrored on the host, all requests at once
      gid = ids[gi][:nb]          # -1 past the hit (full groups) / outside the tail (sliding groups)
      got = gid[gid >= 0]
      if len(got):          # siblings may claim the same block: count it once (checked against the device after)
        ref = self._ref[g]
        self._nfree[g] -= int(np.count_nonzero(ref[np.unique(got)] == 0))
        np.add.at(ref, got, 1)
    for i, (rid, toks, extra) in enumerate(reqs):
      h = self._hit(i, len(toks), hit, ids)
      n = h.num_tokens
      junction = ()
      # A junction inside the dense-start gap (run < 2 * hit, or nothing hit): where the dense schedule could not
      # reach the end of a prefix another request computed. Past 2 * hit the run is most likely this conversation's
      # own earlier turn whose checkpoint was evicted (memory pressure); a checkpoint there is superseded by this
      # turn's own, and taking it anyway made a fixed budget collapse (BUILD_NOTES.md, Cache bookkeeping,
      # "Checkpoint placement").
      if self.junction_checkpoints and int(run[i]) > n and (n == 0 or int(run[i]) < 2 * n):
        junction = (int(run[i]),)
      tables = {g: _Buf(h.block_ids[g]) for g in self.groups}
      released = {g: max(0, n // p.block_tokens - p.need_blocks) for g, p in self.policies.items()}
      r = _Request(rid, _Buf(toks), hashers[i], extra.tenant, len(toks), n, tables,
                   {g: len(tables[g]) for g in self.groups}, released, junction, n == 0)
      self._requests[rid] = r
      out.append(h)
    if allocate_tokens is not None:
      if res["admit_ok"]:
        for gi, g in enumerate(self.groups):
          ids_g = res["admit_ids"][gi]
          k = 0
          bt = self._bt[gi]
          for i, (rid, _, _) in enumerate(reqs):
            t = allocate_tokens[i]
            if t is None:
              continue
            tab = self._requests[rid].tables[g]
            need = max(0, -(-t // bt) - len(tab))
            tab.extend(ids_g[k:k + need])
            k += need
          self._ref[g][ids_g[:k]] = 1
          self._nfree[g] -= k
          self._removed(g, ids_g[:k], res["admit_ev"][gi][:k])
    self._check_free_counts(res)
    return out

  def append_tokens(self, request_id: str, token_ids) -> None:
    r = self._req(request_id)
    r.tokens.extend(np.atleast_1d(np.asarray(token_ids, np.int64)))

  def allocate_for(self, request_id: str, num_new_tokens: int) -> BlockTables | OutOfBlocks:
    """Blocks for positions up to num_computed + num_new_tokens in every group, all or nothing. Decided on the
    host (exact free counts); the ids are filled in by the next device call (the returned tables are lazy)."""
    r = self._req(request_id)
    if num_new_tokens < 0:
      raise CacheError(f"allocate_for: num_new_tokens must be >= 0, got {num_new_tokens}")
    self._settle()
    total = r.num_computed + num_new_tokens
    need = {}
    for g, bt in zip(self.groups, self._bt):
      need[g] = max(0, -(-total // bt) - len(r.tables[g]))
      if need[g] > self._nfree[g]:
        return OutOfBlocks(g, need[g], self._nfree[g])
    for g in self.groups:
      if need[g]:
        start = r.tables[g].extend_fill(PENDING, need[g])
        self._q_alloc[g].append((r.tables[g], np.arange(start, start + need[g])))
        self._q_rids.add(r.rid)
        self._q_nalloc[g] += need[g]
        self._nfree[g] -= need[g]
    return BlockTables(self, request_id)

  def _tables_now(self, request_id: str) -> dict[str, np.ndarray]:
    r = self._req(request_id)
    if r.rid in self._q_rids:
      self.flush()
    return {g: r.tables[g].view().copy() for g in self.groups}

  def block_tables(self, request_id: str) -> BlockTables:
    """The request's tables now (applies what is queued if some ids are not known yet)."""
    return BlockTables(None, None, self._tables_now(request_id))

  # ------------------------------------------------------------------------------------------ register
  def _register(self, r: _Request, g: str, block_idx, all_held: bool = False) -> None:
    """Queue blocks (by table index) of a group for registration under the request's hashes. Only the ids (a
    copy: the table may release them before the call) and a token view are taken here; the digest words of every
    queued block of every request are gathered at once when the step is packed (`_reg_words`)."""
    bt = self._bt_of[g]
    tab = r.tables[g]
    js = None
    if isinstance(block_idx, range):
      a, b = block_idx.start, block_idx.stop
      if a >= b:
        return
      ids = tab.buf[a:b]
      if all_held or ids.min() >= 0:     # the usual case (commit, checkpoint): contiguous, all held
        ids = ids.copy()
        tok = r.tokens.buf[a * bt:b * bt].reshape(-1, bt)     # a view (token positions never change)
        block_idx = None
    if block_idx is not None:
      js = np.asarray(block_idx, np.int64)
      if not len(js):
        return
      v = tab.buf[js]
      keep = v >= 0
      js, ids = js[keep], v[keep]
      if not len(js):
        return
      a = int(js[0])
      tok = r.tokens.buf[:(int(js.max()) + 1) * bt].reshape(-1, bt)[js]      # (blocks, bt), one gather
    infos = None
    if self.events.enabled:
      upb = bt // self._G
      jl = range(a, a + len(ids)) if js is None else js.tolist()
      infos = [(key_int(device_key(r.hasher.digests[j * upb - 1], self.key_bits)) if j else None, r.tenant, bt)
               for j in jl]
    self._q_reg[g].append((ids, r.hasher, a, js, tok, infos))

  def _reg_words(self, g: str):
    """(key digest words [R, 4] uint32, parent words [R, 4] int32) of every queued registration of group g: one
    bytes join and two numpy gathers, not per block. Each chunk contributes only the digests its blocks span (from
    the parent of its first block to the key of its last), so the cost follows the blocks registered, not the
    requests' lengths."""
    regs = self._q_reg[g]
    upb = self._bt_of[g] // self._G
    parts, lo, base, n_words = [], [], [], 0
    for c in regs:
      h, a, js = c[1], c[2], c[3]
      first, last = (a, a + len(c[0]) - 1) if js is None else (int(js.min()), int(js.max()))
      u0, u1 = first * upb - 1, (last + 1) * upb      # units u0 .. u1 - 1; unit -1 is the root
      if u0 < 0:
        parts.append(h.root)
      parts.append(h.blob[16 * max(u0, 0):16 * u1])
      lo.append(u0)
      base.append(n_words)
      n_words += u1 - u0
    w = np.frombuffer(b"".join(parts), dtype="<u4").reshape(-1, 4)
    counts = np.fromiter((len(c[0]) for c in regs), np.int64, len(regs))
    tot = int(counts.sum())
    starts = np.cumsum(counts) - counts
    j = (np.arange(tot) - np.repeat(starts, counts)
         + np.repeat(np.fromiter((c[2] for c in regs), np.int64, len(regs)), counts))
    for k, c in enumerate(regs):      # explicit (non-contiguous) block lists: rare
      if c[3] is not None:
        j[starts[k]:starts[k] + counts[k]] = c[3]
    # in the joined words, unit u of chunk k sits at base_k + u - lo_k (the root is unit -1)
    at = np.repeat(np.asarray(base, np.int64) - np.asarray(lo, np.int64), counts)
    return w[at + (j + 1) * upb - 1], w[at + j * upb - 1].view(np.int32)

  def _checkpoint(self, r: _Request, boundary: int) -> None:
    for g, pol in self.policies.items():
      idx = pol.tail_blocks(boundary)
      tab = r.tables[g]
      if len(idx) and idx.stop <= len(tab) and tab.buf[idx.start:idx.stop].min() >= 0:
        self._register(r, g, idx, all_held=True)

  def commit(self, request_id: str, num_computed_tokens: int) -> None:
    """The model has written KV for positions [0, num_computed_tokens): cache what is reusable, release what the
    request no longer reads (both queued for the next device call)."""
    r = self._req(request_id)
    if r.rid in self._q_rids:
      self.flush()              # the engine reads block_tables (one flush) before the model runs; tests may not
    n = num_computed_tokens
    if n < r.num_computed:
      raise CacheError(f"commit: num_computed_tokens went backwards ({r.num_computed} -> {n})")
    if n > len(r.tokens):
      raise CacheError(f"commit: {n} computed tokens but only {len(r.tokens)} tokens known (append_tokens first)")
    for g, bt in zip(self.groups, self._bt):
      if -(-n // bt) > len(r.tables[g]):
        raise CacheError(f"commit: {n} tokens exceed the blocks allocated in group {g}")
    start = len(r.hasher.digests) * self._G     # hash only the new units: O(new tokens)
    if n > start:
      r.hasher.update(r.tokens.buf[start:n], offset=start)
    prev, r.num_computed = r.num_computed, n
    for g, bt in zip(self.groups, self._bt):
      if self._kind[g] == FULL_HISTORY or self.legacy:
        self._register(r, g, range(r.num_registered[g], n // bt))
        r.num_registered[g] = max(r.num_registered[g], n // bt)
    if not self.legacy and self.policies:
      pol = self._pol0
      if r.plan is None:
        r.plan = pol.plan(r.prompt_len, r.junctions, r.dense)
      for p in pol.select(r.plan, prev, n):
        self._checkpoint(r, p)
    for g, pol in self.policies.items():
      self._release(r, g, pol.releasable_blocks(n))

  def _release(self, r: _Request, g: str, upto: int) -> None:
    lo = r.released[g]
    ids = None
    if upto > lo:
      seg = r.tables[g].buf[lo:upto]     # a view: -1 written below lands in the table
      rev = seg[::-1]
      ids = rev[rev >= 0]                 # a copy (boolean mask), tail first
      seg[:] = -1
    r.released[g] = max(lo, upto)
    self._free_ids(g, ids)

  def _free_ids(self, g: str, ids) -> None:
    """Queue releases (eviction order) and update the host mirror."""
    if ids is None or not len(ids):
      return
    a = np.asarray(ids, np.int32)
    self._unsettled[g].append(a)       # the mirror is updated once per step (_settle)
    self._q_free[g].append(a)

  def free(self, request_id: str) -> None:
    """End of request: checkpoint the sliding tails where the next turn resumes, then release every block, tail
    first (a chain's last blocks become evictable before its head)."""
    r = self._req(request_id)
    if r.rid in self._q_rids:
      self.flush()              # ids of blocks allocated since the last call are needed to release them
    if not self.legacy and self.policies:
      self._checkpoint(r, next(iter(self.policies.values())).floor_align(r.num_computed))
    for g in self.groups:
      rev = r.tables[g].view()[::-1]
      self._free_ids(g, rev[rev >= 0])
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
    resume reads; -1 elsewhere, as after a device hit). All or nothing; applied at once (ids known, BlockRemoved
    events emitted). The caller writes the rows, then `commit(request_id, num_tokens)`."""
    r = self._req(request_id)
    if num_tokens % self.specs.align_tokens or num_tokens <= r.num_computed or num_tokens > len(r.tokens) - 1:
      raise CacheError(f"extend_for_load: {num_tokens} must be aligned, > {r.num_computed} and < {len(r.tokens)}")
    if r.rid in self._q_rids:
      self.flush()
    self._settle()
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
      want = set(new[g])
      r.tables[g].extend([PENDING if j in want else -1 for j in range(lo, hi)])
      if new[g]:
        self._q_alloc[g].append((r.tables[g], np.asarray(new[g], np.int64)))
        self._q_rids.add(r.rid)
        self._q_nalloc[g] += len(new[g])
        self._nfree[g] -= len(new[g])
    self.flush()
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
    self._settle()
    return self._nfree[group]

  def usage(self, group: str) -> float:
    """Fraction of blocks held by requests (cached-but-free blocks count as free, as in vLLM)."""
    self._settle()
    return 1.0 - self._nfree[group] / self.num_blocks[group]

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
