"""Glue between the engine's device cache (L1) and the tiers below it (cache/tiers): which rows make a record,
when blocks are demoted, and what an admission loads.

* **Identity.** After every step the blocks each scheduled request has computed get their chained digests (the same
  `RequestHasher` the manager uses), so a `BlockStored` event (group, device key, block id) tells us exactly which
  prefix a device block holds. One record = one block of one group, every layer's arrays (full: compressed KV +
  index keys; swa: window rows + compressor state rows + Engram token ids). An SWA checkpoint at P is the
  `need_blocks` swa records right before P: window rows *and* the compressor state a resume at P still reads.
* **Demotion** (`demote="evict"`, default): when the manager evicts a cached block (BlockRemoved at allocation), its
  rows are copied off the device before the step overwrites them and written host-first, then write-behind to
  disk / the shared store. `demote="store"` writes every block when it is registered (what engines sharing an L4
  store want: the other engine can hit a conversation this engine still holds).
* **Promotion** at admission: after the device hit h1, look for the longest aligned point P > h1 that the tiers can
  complete for *every* group (full blocks [h1, P), the swa tails of P and of every checkpoint boundary the manager
  registers on the way), ask the cost model whether loading beats recomputing P - h1 tokens, allocate device
  blocks, fetch under the time budget, verify every record (checksum, fingerprint, digest, parent, tokens,
  manifest), write the rows into the device pools, and commit P' (the largest point whose records all arrived and
  verified). Anything else (tier down, timeout, corrupt or foreign record) just lowers P' down to h1: the request
  recomputes, it never fails.

Its configuration is `tiering_config.TieringConfig`; the device copies of whole blocks (one
device or a mesh) are `block_copies`.
"""

from __future__ import annotations

import dataclasses
import time

import jax.numpy as jnp
import numpy as np

from cache.hashing import ExtraKeys, RequestHasher, device_key, key_int
from cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from cache.tiers import record
from cache.tiers.backends import TierError, make_backend
from cache.tiers.cost import CostModel
from cache.tiers.store import TieredStore
from cache.tiers.tier import Tier, TierPolicy
from cache.tiers.writeback import WriteBehind
from dsv4 import caches
from dsv4.engine.block_copies import ID_BUCKETS, id_bucket
from dsv4.engine.request import Status
from dsv4.engine.tiering_config import TieringConfig
from dsv4.loading.weights_digest import params_digest
from pallas_kernels import dispatch


@dataclasses.dataclass(frozen=True)
class _Ident:
  group: str
  key: str                 # record key
  fp: record.Fingerprint
  digest: bytes
  parent: bytes
  start: int
  tokens: tuple[int, ...]


@dataclasses.dataclass
class HandedTail:
  """The part of a handed-off state past its aligned point (`dsv4.engine.handoff`), kept in memory until its
  request's admission reaches `base`: rows per group and block index, written into blocks the request owns."""
  base: int                                        # P: where the admission must stand (device hit or tier load)
  point: int                                       # L: where the request resumes
  tokens: tuple[int, ...]                          # the request's tokens [0, L) the rows were verified against
  rows: dict[str, dict[int, list[np.ndarray]]]     # group -> block index -> record arrays
  adopted: int = 0                                 # admissions that used it (a re-admission may use it again)


class Tiering:
  """The tiers' glue for one engine (module doc). One class over 400 lines: identity, demotion and promotion share
  one per-engine state (which prefix each device block holds, the tiered store, its cost model and write-behind
  queue); split, each part would reach into the others' maps."""

  def __init__(self, engine, tc: TieringConfig, params=None):
    tc.validate()
    self.tc, self.engine = tc, engine
    # One cache manager per data shard (pools split over `data` on a mesh; one otherwise), shard-local block ids.
    # Specs, policies, model id and key bits are the same on every shard: read from the first.
    self.mgrs, self.runner = list(engine.managers), engine.runner
    self.mgr = self.mgrs[0]
    self.num_shards = len(self.mgrs)
    self.specs = self.mgr.specs
    self.groups = {g.name: g for g in self.specs.groups}
    # cache.specs are plain (no arrays): the model's arrays per group come from dsv4.caches; the record components
    # (and their dtypes) are the pool arrays as stored, an FP8 pool's three arrays each on its own
    arrays = caches.cache_array_specs(engine.config, engine.ec.layout)
    self.names, self.manifest = {}, {}
    for g in self.groups:
      names, entries = [], []
      for a in arrays:
        if a.group != g:
          continue
        x = self.runner.kv_pool(a.layer, a.name)
        if isinstance(x, dispatch.Fp8KVPool):
          for p, (field, arr) in enumerate(zip(x._fields, x)):
            names.append((a.layer, a.name, p))
            entries.append(record.ArrayEntry(f"L{a.layer}/{a.name}.{field}", record.dtype_str(arr.dtype),
                                             tuple(arr.shape[1:])))
        else:
          names.append((a.layer, a.name, -1))
          entries.append(record.ArrayEntry(f"L{a.layer}/{a.name}", record.dtype_str(x.dtype), tuple(x.shape[1:])))
      self.names[g], self.manifest[g] = tuple(names), tuple(entries)
    # blocks per shard of each group's pool (the out-of-range id that drops a write)
    self.shard_blocks = {g: self._blocks(g) // self.num_shards
                         for g in self.groups}
    self.model_digest = tc.model_digest or (params_digest(params) if params is not None else "")
    # An engine that drafts keeps its draft layers' window state (V4's MTP block, V4.1's DSpark context KV) in every
    # swa block; one that does not leaves those rows unwritten. Its records are another layout: a drafting engine
    # never loads a block without draft state (a miss, not drafts from empty rows), and a record says which it is.
    # (The record's fingerprint, hence its key, carries it; the block digests stay the manager's.)
    self.state_layout = self.specs.fingerprint + ("+drafts" if engine.spec else "")
    self.layout_fp = f"{self.state_layout}/rec{record.FORMAT_VERSION}"
    caps = list(tc.capacity_bytes) + [1 << 30] * (len(tc.tiers) - len(tc.capacity_bytes))
    tiers = []
    self.startup_errors = []
    self._not_started: dict[str, str] = {}     # tier -> why it could not start (left out)
    for kind, cap in zip(tc.tiers, caps):
      pol = TierPolicy(cap, tc.ttl_s, tc.tenant_quota_bytes, tc.retry_after_s)
      # A bad URL (ValueError) or a missing client package (ImportError) is a setup error and raises here; a store
      # that is down or a directory that cannot be made is a tier that cannot serve now (requests still run).
      try:
        backend = make_backend(kind, disk_dir=tc.disk_dir, store_url=tc.store_url, timeout_s=tc.tier_timeout_s)
      except (TierError, OSError, RuntimeError) as e:  # cannot start at all: left out, reported
        self.startup_errors.append(f"{kind}: {e}")
        self._not_started[kind] = str(e)
        continue
      tier = Tier(backend, pol)
      tier.check()                    # one ping under the tier timeout: unreachable = marked down and counted now
      tiers.append(tier)
    self.store = TieredStore(tiers, engine_id=tc.engine_id,
                             write_behind=WriteBehind(tc.write_queue) if tc.write_queue else None)
    self.cost = CostModel(tc.prefill_tokens_per_s, max_load_s=tc.load_timeout_s)
    self._ident: dict[tuple[str, int], _Ident] = {}
    # per request (Request.uid: a later request reusing an id starts afresh): its identities' keys, its hasher
    self._rid_keys: dict[str, set] = {}
    self._hashed: dict[str, tuple[RequestHasher, int]] = {}
    self._owner: dict[str, object] = {}          # uid -> the Request
    self._resident: dict[tuple[int, str, int], _Ident] = {}      # (shard, group, block id) -> identity
    self._resident_by_key: dict[str, tuple[int, str, int]] = {}  # record key -> (shard, group, device block id)
    self._step_t0 = None
    self.stats = {"admissions_probed": 0, "tier_hit_tokens": 0, "loaded_records": 0, "rejected_records": 0,
                  "chose_recompute": 0, "chose_load": 0, "l1_copied_records": 0, "degraded": 0, "demoted_blocks": 0,
                  "no_room": 0, "load_s_total": 0.0, "handed_tails_adopted": 0, "handed_tail_tokens": 0}
    self.handed_tails: dict[str, HandedTail] = {}     # request id -> its handed-off state past the aligned point
    self.decisions: list[dict] = []

  # ---------------------------------------------------------------------------------------------- identity
  def _fingerprint(self, extra: ExtraKeys) -> record.Fingerprint:
    return record.Fingerprint(f"{self.model_digest}|{extra.model or self.mgr.model_id}", self.tc.tokenizer_id,
                              self.layout_fp, extra.tenant, extra.adapter)

  def _hasher(self, extra: ExtraKeys, tokens) -> RequestHasher:
    h = RequestHasher(dataclasses.replace(extra, model=extra.model or self.mgr.model_id,
                                          layout=self.specs.fingerprint), self.specs.hash_tokens, self.mgr.key_bits)
    h.update(np.asarray(tokens, np.int32))
    return h

  def _ident_of(self, h: RequestHasher, fp: record.Fingerprint, tokens, group: str, j: int) -> _Ident:
    bt = self.groups[group].block_tokens
    upb = bt // self.specs.hash_tokens
    d = h.digests[(j + 1) * upb - 1]
    return _Ident(group, record.record_key(fp, group, d, self.tc.key_bits), fp, d, h.parent(j * upb), j * bt,
                  tuple(int(t) for t in tokens[j * bt:(j + 1) * bt]))

  def _learn(self, req) -> None:
    """Identities of the blocks req has computed, so BlockStored events can be mapped to prefixes."""
    extra = req.cache_salt(self.engine.ec.enable_prefix_caching)
    toks = req.all_tokens[:req.num_computed]
    self._owner[req.uid] = req
    prev = self._hashed.get(req.uid)
    if prev is None or prev[1] > len(toks):
      prev = (self._hasher(extra, []), 0)
    h, done = prev
    h.update(np.asarray(toks, np.int32))
    fp = self._fingerprint(extra)
    keys = self._rid_keys.setdefault(req.uid, set())
    for g, spec in self.groups.items():
      bt = spec.block_tokens
      for j in range(done // bt, len(toks) // bt):
        ident = self._ident_of(h, fp, toks, g, j)
        k = (g, key_int(device_key(ident.digest, self.mgr.key_bits)))
        self._ident[k] = ident
        keys.add(k)
    self._hashed[req.uid] = (h, len(toks) // self.specs.hash_tokens * self.specs.hash_tokens)

  def _forget_finished(self) -> None:
    for uid in list(self._rid_keys):
      r = self._owner[uid]
      if self.engine.requests.get(r.rid) is not r or r.status in (Status.FINISHED, Status.REJECTED):
        for k in self._rid_keys.pop(uid):
          self._ident.pop(k, None)
        self._hashed.pop(uid, None)
        del self._owner[uid]
    for rid, tail in list(self.handed_tails.items()):
      r = self.engine.requests.get(rid)
      if (r is None and tail.adopted) or (r is not None and r.status in (Status.FINISHED, Status.REJECTED)):
        del self.handed_tails[rid]

  # ---------------------------------------------------------------------------------------------- demotion
  def _process_events(self) -> None:
    """Map new BlockStored to prefixes; demote what the manager evicted (before the step overwrites it)."""
    out = []
    for s, mgr in enumerate(self.mgrs):
      for ev in mgr.take_events():
        if isinstance(ev, BlockStored):
          ident = self._ident.get((ev.group, ev.block_hash))
          if ident is not None:
            loc = (s, ev.group, ev.block_id)
            self._resident[loc] = ident
            self._resident_by_key[ident.key] = loc
            if self.tc.demote == "store":
              out.append((*loc, ident))
        elif isinstance(ev, BlockRemoved):
          loc = (s, ev.group, ev.block_id)
          ident = self._resident.pop(loc, None)
          if ident is not None:
            if self._resident_by_key.get(ident.key) == loc:     # (another shard may hold the same prefix)
              self._resident_by_key.pop(ident.key)
            if self.tc.demote == "evict":
              out.append((*loc, ident))
        elif isinstance(ev, AllBlocksCleared):
          for loc in [loc for loc in self._resident if loc[0] == s]:
            ident = self._resident.pop(loc)
            if self._resident_by_key.get(ident.key) == loc:
              self._resident_by_key.pop(ident.key)
    self._demote(out)

  def _demote(self, blocks) -> None:
    if not blocks or not self.store.tiers:
      return
    first = self.store.tiers[0]
    by_group: dict[str, list] = {}
    for s, g, b, ident in blocks:
      if not first.contains_many([ident.key])[0]:
        by_group.setdefault(g, []).append(((s, b), ident))
    for g, items in by_group.items():
      rows = self._read(g, [loc for loc, _ in items])
      for i, (_, ident) in enumerate(items):
        hdr = record.RecordHeader(ident.fp, g, ident.digest, ident.parent, ident.start, ident.tokens, self.manifest[g])
        data = record.encode(hdr, [r[i] for r in rows])
        self.store.put(ident.key, data, ident.fp.tenant)
        self.stats["demoted_blocks"] += 1

  # ---------------------------------------------------------------------------------------------- device copies
  def _blocks(self, g) -> int:
    """Blocks of group g's pool over all shards (every component of a group has as many)."""
    return self.runner.kv_pool(*self.names[g][0]).shape[0]

  def _dev_read(self, g, shard_N, ids_N) -> list[np.ndarray]:
    out = self.runner.read_kv_blocks(self.names[g], shard_N, ids_N)
    return [x.view(record.np_dtype(e.dtype)) for x, e in zip(out, self.manifest[g])]     # bits -> the stored dtype

  def _dev_write(self, g, shard_N, ids_N, rows) -> None:
    """rows: host arrays of the stored dtypes, sent to the device as their bits."""
    rows = tuple(jnp.asarray(r.view(caches.UINT_OF_SIZE[r.dtype.itemsize]) if jnp.issubdtype(r.dtype, jnp.floating) else r)
                 for r in rows)
    self.runner.write_kv_blocks(self.names[g], shard_N, ids_N, rows)

  def _read(self, g, locs) -> list[np.ndarray]:
    """Rows of blocks (shard, shard-local id) of group g, per record component: raw stored arrays on the host."""
    out = []
    for lo in range(0, len(locs), ID_BUCKETS[-1]):
      part = locs[lo:lo + ID_BUCKETS[-1]]
      n = id_bucket(len(part))
      sh, ids = np.zeros(n, np.int32), np.zeros(n, np.int32)
      sh[:len(part)] = [s for s, _ in part]
      ids[:len(part)] = [b for _, b in part]
      out.append([r[:len(part)] for r in self._dev_read(g, sh, ids)])
    return [np.concatenate(c) for c in zip(*out)] if len(out) > 1 else out[0]

  # ---------------------------------------------------------------------------------------------- engine hooks
  def warmup(self) -> None:
    """Compile the device copy programs for every bucket now (benchmarks: keeps compiles out of TTFT)."""
    for g in self.groups:
      nb = self._blocks(g)
      for n in ID_BUCKETS:
        # out of range (and, on a mesh, no shard's): reads clamp, writes are dropped
        sh, ids = np.full(n, -1, np.int32), np.full(n, nb, np.int32)
        rows = self._dev_read(g, sh, ids)
        self._dev_write(g, sh, ids, rows)
    self.runner.wait_kv()

  def before_run(self, scheduled) -> None:
    self._process_events()
    self._step_t0 = (time.perf_counter(), sum(n for _, n in scheduled), any(n > 1 for _, n in scheduled),
                     self.runner.num_step_programs())

  def after_finish(self) -> None:
    """A request was finished outside a step (Engine.stop_request): its end-of-request registrations reach the
    tiers now (write-through; identities still known), then its identities are dropped."""
    self._process_events()
    self._forget_finished()

  def after_step(self, scheduled) -> None:
    if self._step_t0 is not None:
      t0, toks, prefill, shapes = self._step_t0
      if prefill and self.runner.num_step_programs() == shapes:   # a step that compiled says nothing about the rate
        self.cost.observe_prefill(toks, time.perf_counter() - t0)
      self._step_t0 = None
    for req, _ in scheduled:
      self._learn(req)
    self._process_events()
    self._forget_finished()

  def _candidates(self, h1: int, cap: int) -> list[int]:
    A = self.specs.align_tokens
    return list(range(h1 + A, cap // A * A + 1, A))

  def _required(self, h1: int, P: int, prompt_len: int) -> tuple[int, set[int]]:
    """Full blocks [h1/fb, P/fb) and the swa block indices a resume at P needs from the tiers: P's tail only.
    Checkpoints at boundaries between h1 and P are optional (`_optional`): whether they were ever stored depends on
    the placement of the request that computed them (a request that hit takes dense-start ones only past its run), so
    requiring them made a reload stop short of a P whose tail is there."""
    pol = self.mgr.policies[caches.SWA]
    swa = set(pol.tail_blocks(P))
    nfull = P // self.groups[caches.FULL].block_tokens if caches.FULL in self.groups else 0
    if swa and min(swa) < h1 // self.groups[caches.SWA].block_tokens:
      # a tail reaching behind the device hit (window longer than the alignment): those swa rows are neither in the
      # request's table nor loadable into it, so this P cannot be served from the tiers
      return nfull, None
    return nfull, swa

  def _optional(self, req, h1: int, P: int) -> list[set[int]]:
    """Swa tails (index sets) of the checkpoint boundaries in (h1, P) this request's commit at P would take
    (the manager's own placement for it): loaded with P's when the tiers have them whole (they become device
    checkpoints again), skipped otherwise."""
    pol = self.mgr.policies[caches.SWA]
    lo = h1 // self.groups[caches.SWA].block_tokens
    tails = [set(pol.tail_blocks(b)) for b in self.mgrs[req.shard].checkpoint_boundaries(req.rid, h1, P - 1)]
    return [t for t in tails if t and min(t) >= lo]

  def on_admit(self, req, h1: int) -> int:
    """Extend the device hit h1 from the tiers, then by a handed-off state's tail. Returns the tokens the request
    may skip (>= h1)."""
    return self._adopt_handed_tail(req, self._load_from_tiers(req, h1))

  def _adopt_handed_tail(self, req, h: int) -> int:
    """With a handed-off tail for req and the admission standing at its aligned point: blocks the request owns for
    [h, L), the tail's rows written into them, committed at L. Otherwise (no tail, the admission fell short of or
    went past its base, no room) h unchanged: the request computes from h."""
    tail = self.handed_tails.get(req.rid)
    if tail is None or h != tail.base or tuple(req.all_tokens[:tail.point]) != tail.tokens:
      return h
    mgr = self.mgrs[req.shard]
    tables = mgr.extend_for_import(req.rid, tail.point)
    if not tables:
      self.stats["no_room"] += 1
      return h
    self._process_events()          # demote what that allocation evicted before we overwrite it
    s = req.shard
    self._write({g: [(s, int(tables[g][j]), arrs) for j, arrs in sorted(by_block.items())]
                 for g, by_block in tail.rows.items()})
    mgr.commit(req.rid, tail.point)
    req.num_computed = tail.point
    self._learn(req)
    self._process_events()
    tail.adopted += 1
    self.stats["handed_tails_adopted"] += 1
    self.stats["handed_tail_tokens"] += tail.point - h
    return tail.point

  def _load_from_tiers(self, req, h1: int) -> int:
    """Extend the device hit h1 from the tiers. Returns the tokens the request may skip (>= h1)."""
    if self.tc.policy == "recompute" or not self.store.tiers:
      return h1
    self._process_events()
    toks = req.all_tokens
    cands = self._candidates(h1, len(toks) - 1)
    if not cands:
      return h1
    self.stats["admissions_probed"] += 1
    extra = req.cache_salt(self.engine.ec.enable_prefix_caching)
    h = self._hasher(extra, toks)
    fp = self._fingerprint(extra)
    has_full = caches.FULL in self.groups
    fb = self.groups[caches.FULL].block_tokens if has_full else 1
    j0 = h1 // fb
    full_ids = [self._ident_of(h, fp, toks, caches.FULL, j) for j in range(j0, cands[-1] // fb)] if has_full else []
    pol = self.mgr.policies[caches.SWA]
    swa_idx = sorted({j for P in cands for j in pol.tail_blocks(P)}
                     | {j for b in pol.boundaries(h1, cands[-1], len(toks)) for j in pol.tail_blocks(b)})
    swa_ids = {j: self._ident_of(h, fp, toks, caches.SWA, j) for j in swa_idx}
    keys = [i.key for i in full_ids] + [swa_ids[j].key for j in swa_idx]
    # Hybrid across L1 and the tiers: a block the device still caches (but the device hit could not use, because
    # another group's block was evicted) is copied on the device (-1 = L1) instead of loaded.
    locs = {k: ([-1] if k in self._resident_by_key else []) + l for k, l in zip(keys, self.store.locate(keys))}
    nf = 0
    while nf < len(full_ids) and locs[full_ids[nf].key]:
      nf += 1
    best = None
    for P in reversed(cands):
      need_full, need_swa = self._required(h1, P, len(toks))
      if need_swa is not None and need_full - j0 <= nf and all(locs[swa_ids[j].key] for j in need_swa):
        best = P
        break
    if best is None:
      return h1
    need_full, need_swa = self._required(h1, best, len(toks))
    opt = {j for t in self._optional(req, h1, best) if all(locs[swa_ids[j].key] for j in t) for j in t}
    # required records first: the fetch tries them first while the time budget lasts
    plan_ids = full_ids[:need_full - j0] + [swa_ids[j] for j in sorted(need_swa)] + \
        [swa_ids[j] for j in sorted(opt - need_swa)]
    plan: dict[str, list] = {}
    for ident in plan_ids:
      if locs[ident.key][0] < 0:
        continue
      t = self.store.tiers[locs[ident.key][0]].name
      n, b = plan.get(t, (0, 0))
      plan[t] = (1, b + sum(a.nbytes for a in self.manifest[ident.group]))
    dec = self.cost.decide(plan, best - h1, self.store.backlog_bytes())
    self.decisions.append({"rid": req.rid, "h1": h1, "P": best, "load_s": dec.load_s, "recompute_s": dec.recompute_s,
                           "cost_model_load": dec.load, "plan": plan})
    if self.tc.policy == "auto" and not dec.load:
      self.stats["chose_recompute"] += 1
      return h1
    self.stats["chose_load"] += 1
    budget = dec.budget_s if self.tc.policy == "auto" else self.tc.load_timeout_s
    t_start = time.perf_counter()
    deadline = time.monotonic() + budget
    # Fetch and verify first (into host memory), then allocate exactly what the verified point needs.
    arrays, src = self._fetch_verified(plan_ids, locs, deadline)
    # The largest point whose records all arrived and verified (degrade: never resume on incomplete state).
    P2 = h1
    for P in reversed([c for c in cands if c <= best]):
      nfull, nswa = self._required(h1, P, len(toks))
      if nswa is not None and all(i.key in arrays for i in full_ids[:nfull - j0]) and \
         all(swa_ids[j].key in arrays for j in nswa):
        P2 = P
        break
    if P2 < best:
      self.stats["degraded"] += 1
    if P2 == h1:
      return h1
    nfull, own = self._required(h1, P2, len(toks))
    nswa = set(own)
    for t in self._optional(req, h1, P2):     # optional tails that arrived whole
      if all(swa_ids[j].key in arrays for j in t):
        nswa |= t
    mgr = self.mgrs[req.shard]
    tables = mgr.extend_for_load(req.rid, P2, nswa)
    if not tables and nswa != own:          # no room for the optional tails too: P2's own tail is enough
      nswa = own
      tables = mgr.extend_for_load(req.rid, P2, nswa)
    if not tables:
      self.stats["no_room"] += 1
      return h1
    self._process_events()          # demote what that allocation evicted before we overwrite it
    s = req.shard
    self._write({caches.FULL: [(s, int(tables.full[j]), arrays[full_ids[j - j0].key]) for j in range(j0, nfull)],
                 caches.SWA: [(s, int(tables.swa[j]), arrays[swa_ids[j].key]) for j in sorted(nswa)]})
    mgr.commit(req.rid, P2)
    req.num_computed = P2
    self._learn(req)
    self._process_events()
    for ident in full_ids[:nfull - j0]:
      if src[ident.key] >= 0:
        self.store.tiers[src[ident.key]].note_hit(ident.key, fb, 0)
    for j in nswa:
      if src[swa_ids[j].key] >= 0:
        self.store.tiers[src[swa_ids[j].key]].metrics["hit_records"] += 1
    self.stats["l1_copied_records"] += sum(1 for v in src.values() if v < 0)
    self.stats["tier_hit_tokens"] += P2 - h1
    self.stats["load_s_total"] += time.perf_counter() - t_start
    return P2

  def _fetch_verified(self, plan_ids, locs, deadline):
    """Fetch every planned record from the first tier that has it; on a miss, failure or bad record try the next
    tier that has it, while the budget lasts. Returns (key -> arrays, key -> source tier index)."""
    arrays, src, data_of = {}, {}, {}
    by_key = {i.key: i for i in plan_ids}
    tries = {i.key: list(locs[i.key]) for i in plan_ids}
    on_device = {}
    for k, t in tries.items():
      if t and t[0] < 0:
        t.pop(0)
        if k in self._resident_by_key:        # still cached on the device after our own allocation
          on_device.setdefault(self._resident_by_key[k][1], []).append(k)
        else:                                 # our allocation evicted (and so demoted) it: look again
          tries[k] = self.store.locate([k])[0]
    for g, ks in on_device.items():          # (from any shard: the rows go through the host)
      rows = self._read(g, [(self._resident_by_key[k][0], self._resident_by_key[k][2]) for k in ks])
      for i, k in enumerate(ks):
        arrays[k], src[k] = [r[i] for r in rows], -1
    while True:
      wanted: dict[int, list[str]] = {}
      for k, t in tries.items():
        if k not in arrays and t:
          wanted.setdefault(t.pop(0), []).append(k)
      if not wanted or time.monotonic() >= deadline:
        break
      t0 = time.perf_counter()
      got = self.store.fetch(wanted, deadline)
      dt = time.perf_counter() - t0
      for ti, ks in wanted.items():
        b = sum(len(got[k][0]) for k in ks if k in got)
        if b:
          self.cost.observe_load(self.store.tiers[ti].name, b, dt)
      for k, (data, ti) in got.items():
        ident = by_key[k]
        exp = record.Expect(ident.fp, ident.group, ident.digest, ident.parent, ident.start, ident.tokens,
                            self.manifest[ident.group])
        try:
          arrays[k] = record.decode(data, exp)
        except record.RecordError as e:
          self.store.tiers[ti].reject(k, str(e))
          self.stats["rejected_records"] += 1
          continue
        src[k], data_of[k] = ti, data
        self.stats["loaded_records"] += 1
    for k, ti in src.items():
      if ti > 0 and k in data_of:
        self.store.promote(k, data_of[k], by_key[k].fp.tenant, ti)
    return arrays, src

  def _write(self, per_group) -> None:
    """per_group: group -> [(shard, shard-local block id, record arrays)]; each component's raw arrays go into
    that shard's pool as they are."""
    for g, items in per_group.items():
      if not items:
        continue
      local = np.array([b for _, b, _ in items])
      if (local < 0).any() or (local >= self.shard_blocks[g]).any():   # -1 would wrap to the last block
        raise RuntimeError(f"tier load into an unallocated {g} block: {local}")
      n = id_bucket(len(items))
      sh = np.full(n, -1, np.int32)                 # padding: no shard's (mesh), out of range (one pool): dropped
      sh[:len(items)] = [s for s, _, _ in items]
      ids = np.full(n, self.shard_blocks[g], np.int32)
      ids[:len(items)] = local
      rows = []
      for a_i, e in enumerate(self.manifest[g]):
        r = np.zeros((n, *e.shape), record.np_dtype(e.dtype))
        for i, (_, _, arrs) in enumerate(items):
          r[i] = arrs[a_i]
        rows.append(r)
      self._dev_write(g, sh, ids, tuple(rows))

  # ---------------------------------------------------------------------------------------------- control
  def drop_device_cache(self) -> int:
    """Demote every block the device still caches, then drop L1 (prefix identities and the pool contents). Only
    between requests. Returns the number of blocks demoted."""
    self._process_events()
    blocks = [(*loc, ident) for loc, ident in self._resident.items()]     # (shard, group, block id, identity)
    before = self.stats["demoted_blocks"]
    self._demote(blocks)
    self.store.drain()
    if not all([m.reset_prefix_cache() for m in self.mgrs]):
      raise RuntimeError("drop_device_cache: requests still hold blocks")
    self._process_events()
    self.runner.reset_kv_cache()
    return self.stats["demoted_blocks"] - before

  def flush(self) -> None:
    self._process_events()
    self.store.drain()

  def unavailable(self) -> dict[str, str]:
    """The tiers not serving now, tier -> reason: those that could not start (left out), and those whose last
    operation failed (the start-up ping included) until one succeeds again. Empty when every tier is up. Callers
    warn (or refuse to serve) from this right after constructing the engine."""
    out = dict(self._not_started)
    for t in self.store.tiers:
      if not t.ok:
        out[t.name] = t.last_error or "down"
    return out

  def summary(self) -> dict:
    # tiers that never started get an entry too, so every asked-for tier shows its failures and last error
    dead = [{"tier": k, "failures": 1, "last_error": why, "ok": False, "down": True, "started": False}
            for k, why in self._not_started.items()]
    return {**self.stats, "prefill_tokens_per_s": self.cost.prefill_tps, "tiers": self.store.summary() + dead,
            "write_behind": dict(self.store.wb.stats) if self.store.wb else {},
            "startup_errors": self.startup_errors, "unavailable": self.unavailable()}

  def close(self) -> None:
    self.store.close()
