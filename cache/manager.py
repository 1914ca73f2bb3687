"""KVCacheManager: the host-side planner of the paged KV cache. The state lives on the device as one value,
`cache.device_state.DeviceState`: one block pool per cache group and every request's block tables (`[slots, table
blocks]` int32 per group), kept in a `DeviceCell` the planner is given (or makes, standalone). The host keeps counts (blocks per request and group, which table entries a request holds, exact-or-conservative
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
the queue as a plan (`plan`: one int32 buffer of fixed widths) and runs it on the device state
(`device_state.apply`) right before the model program, in one pass over the state (`DeviceCell.advance`), with no
host read between; the host reads back a few counters with the sampled tokens (`read_results`, possibly one step
late). Standalone calls (`flush`, `add_requests`, lookups, reading tables) run a plan in their own jitted call (the
same `device_state.apply` through the same cell, one transfer in, one out).

Free counts: allocations are decided on the host against a count that is exact after every read of the device's
counters and lowers by every allocation since; releases only raise it when the device confirms them (siblings
may share blocks). So `allocate_for` never over-commits; when it would fail while releases are unconfirmed, the
manager syncs (applies the queue, reads the counts) and decides again, so OutOfBlocks is exact.

Errors: unknown / duplicate request ids, commits beyond allocated or known tokens, and negative counts raise
`CacheError`; running out of blocks is a return value (`OutOfBlocks`), never an exception or a silent failure.
`legacy_dense_swa=True` reproduces vLLM <= 0.22 (every sliding block hashed, every freed block appended) for the
session-switch regression test only.

Layout: this file is the host planner (the public API). The queue of bookkeeping, carving it into one buffer and
reading the results back is `cache.step_queue.StepQueue` (a part it holds, host only); the device state and the
pure functions over it are `cache.device_state`. What callers get back is in `cache.api_types`, a request's host
state in `cache.request_state`, the step plan and its static widths in `cache.step_plan`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from cache import device_state, pool
from cache.api_types import BlockTables, CacheError, OutOfBlocks, PrefixHit
from cache.checkpoints import CheckpointPolicy
from cache.device_state import DeviceCell
from cache.events import AllBlocksCleared, EventLog, KVEvent
from cache.hashing import ExtraKeys, RequestHasher, device_key, digest_words, key_int
from cache.prefix import find_hits, group_searches
from cache.request_state import HOST_HELD, Admission, HeldEntries, Int32Buffer, RequestState
from cache.specs import FULL_HISTORY, SLIDING_WINDOW, CacheSpecs
from cache.step import unpack
from cache.step_plan import StepPlan, bucket_width
from cache.step_queue import StepQueue


class KVCacheManager:
  """The host planner: admission, lookup, allocation, commits, releases and checkpoints, queued (`StepQueue`) as
  plans for the device state it runs them on (`DeviceCell`). One class over 400 lines: it is the cache's public
  API, each method one planner decision; what is not a decision lives beside it (the queue and its packing in
  `cache.step_queue`, request state in `cache.request_state`, the device half in `cache.device_state`)."""

  def __init__(self, specs: CacheSpecs, *, num_blocks: dict[str, int] | None = None,
               num_full_blocks: int | None = None, num_swa_blocks: int | None = None, retention_interval: int = 0,
               model_id: str = "", key_bits: int = 64, max_probe: int = pool.DEFAULT_MAX_PROBE,
               enable_events: bool = True, legacy_dense_swa: bool = False, dense_start: bool = True,
               rerender_tokens: int = 64, junction_checkpoints: bool = True, num_slots: int | None = None,
               max_tokens: int | None = None, device: DeviceCell | None = None):
    """num_slots / max_tokens: rows of the device block tables (requests held at once) and the longest request
    (table width). The engine fixes both (max_num_seqs, max_model_len), so its step program has one shape; left
    None (standalone use), the tables start small and grow on demand.
    device: where the device state this planner's plans run on lives (`cache.device_state.DeviceCell`, holding a
    `DeviceState` of these specs, sizes and table shape); None = a cell of its own (standalone use)."""
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
    # a hit holds every full-history block before it and, in sliding groups, the tail before it (prefix.search)
    self._hit_tails = tuple((g, p.need_blocks) for g, p in self.policies.items())
    self._hit_full = tuple(g for g in self.groups if g not in self.policies)
    # groups whose blocks are registered as they are computed (sliding groups only at checkpoints)
    self._registered = tuple(g.name for g in specs.groups if g.kind == FULL_HISTORY or legacy_dense_swa)
    self.model_id, self.key_bits = model_id, key_bits
    self.legacy = legacy_dense_swa
    self._requests: dict[str, RequestState] = {}
    self.stats = {"table_full": 0, "duplicate": 0, "queried_tokens": 0, "hit_tokens": 0, "device_calls": 0,
                  "syncs": 0, "step_plans": 0, "step_plan_overflows": 0}
    # the device tables: fixed by the engine (one step shape), else starting small and growing on demand
    self._fixed = num_slots is not None and max_tokens is not None
    if device is None:
      device = DeviceCell(device_state.init(specs, sizes, slots=num_slots or 8, max_tokens=max_tokens or 2048,
                                            max_probe=max_probe))
    self.device = device
    st = device.state
    if (tuple(int(p.num_blocks) for p in st.pools) != tuple(sizes[g] for g in self.groups)
        or len(st.tables) != len(self.groups)):
      raise ValueError("KVCacheManager: the device state was made for other groups or pool sizes")
    self.num_blocks = {g: sizes[g] for g in self.groups}
    self.queue = StepQueue(specs, sizes, slots=st.tables[0].shape[0], widths=tuple(t.shape[1] for t in st.tables),
                           key_bits=key_bits, prepend_uncached=not legacy_dense_swa, events=EventLog(enable_events),
                           stats=self.stats)
    self.peak_used = self.queue.peak_used
    self.block_tokens = self.queue.block_tokens      # the one record of each group's block size (by group name)
    self._q_admit = []          # queued admissions (Admission), sent with the next call that runs the queue
    self._admitting = {}        # request id -> Admission, queued or in flight (result not read)
    self._admitted = []         # (request id, PrefixHit) of queued admissions resolved, for take_admitted()

  @property
  def events(self) -> EventLog:
    """The KV event log (the queue emits into it as results are read)."""
    return self.queue.events

  def _memo(self, key, make):
    """A request's checkpoint schedule depends only on a few integers (lengths, run): requests of equal lengths
    share it. Bounded: cleared when it grows large."""
    out = self._memos.get(key)
    if out is None:
      if len(self._memos) > 4096:
        self._memos.clear()
      out = self._memos[key] = make()
    return out

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

  def lookup(self, token_ids, extra_keys: ExtraKeys = ExtraKeys()) -> PrefixHit:
    return self.lookup_batch([(token_ids, extra_keys)])[0]

  def lookup_batch(self, requests) -> list[PrefixHit]:
    """Pure search (nothing claimed), one jitted call after applying what is queued."""
    toks = [np.asarray(t, np.int32) for t, _ in requests]
    hashers = [self._hasher(t, e) for t, (_, e) in zip(toks, requests)]
    self.flush()
    plan = self.queue.pack_admissions(toks, hashers)
    hit, ids = find_hits(self.device.state.pools, plan.key_BxUx2, plan.par_BxUx4, plan.tok_BxUxG, plan.max_len_B,
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
      for (name, bt), gid, srch in zip(self.block_tokens.items(), ids, self._searches):
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
  def _req(self, rid: str) -> RequestState:
    if rid not in self._requests:
      raise CacheError(f"unknown request {rid!r}")
    return self._requests[rid]

  def slot_of(self, request_id: str) -> int:
    """The request's row of the device block tables (the engine's step reads its tables there)."""
    return self._req(request_id).slot

  def add_request(self, request_id: str, prompt_token_ids, extra_keys: ExtraKeys = ExtraKeys()) -> PrefixHit:
    """Look up the prompt and claim the hit blocks (every group before any allocation)."""
    return self.add_requests([(request_id, prompt_token_ids, extra_keys)])[0]

  def add_requests(self, requests, allocate_tokens=None) -> list[PrefixHit]:
    """Admit several requests in ONE device call (with everything queued, admissions queued by
    `queue_admissions` included): search, claim (the hit blocks are written into each request's table row on the
    device), and with `allocate_tokens[i]` (total tokens to cover, e.g. hit + first chunk; None = no allocation)
    their first allocation. If the pools cannot cover every admitted request's allocation, none is made (call
    allocate_for)."""
    if allocate_tokens is not None and len(allocate_tokens) != len(requests):
      raise CacheError("add_requests: allocate_tokens must have one entry per request")
    if allocate_tokens is not None and any(t is not None and t < 0 for t in allocate_tokens):
      raise CacheError("add_requests: allocate_tokens must be >= 0")
    admits = self._prepare_admissions(requests, allocate_tokens)
    if not admits:
      return []
    tgts = [a.target for a in admits if a.target is not None]
    widths = tuple(bucket_width(sum(-(-int(t) // bt) for t in tgts)) for bt in self.block_tokens.values())
    if self.queue.step_widths is not None:
      # an engine's manager: at least the step's allocation width (one admission program, see
      # StepQueue._group_dims)
      widths = tuple(max(w, bucket_width(sw[2])) for w, sw in zip(widths, self.queue.step_widths))
    self._apply(self._take_admits() + admits, widths)
    return [a.hit for a in admits]

  def queue_admissions(self, requests) -> None:
    """Queue admissions of (request id, prompt, ExtraKeys): their search, claim and table row ride the next
    device call that runs the queue, normally the engine's step program (`plan`), so an admission is no
    call of its own. Their hits are known once that call's results are read: `take_admitted()`. Until then a
    request exists only as an admission: `free(rid)` withdraws it (a queued one at once, one in flight when its
    result arrives); every other call on it raises."""
    admits = self._prepare_admissions(requests, None)
    for a in admits:
      a.queued = True
    self._q_admit += admits

  def take_admitted(self) -> list[tuple[str, PrefixHit]]:
    """(request id, PrefixHit) of every queued admission resolved since the last call, in queue order."""
    out, self._admitted = self._admitted, []
    return out

  @property
  def admissions_pending(self) -> int:
    """Queued admissions not yet sent to the device (they ride the next call that runs the queue)."""
    return len(self._q_admit)

  def is_admitting(self, request_id: str) -> bool:
    """Queued or sent, result not read yet."""
    return request_id in self._admitting

  def _prepare_admissions(self, requests, allocate_tokens) -> list[Admission]:
    """Checked, table rows taken, prompts hashed: one Admission per request (nothing sent)."""
    reqs = []
    seen = set()
    for rid, prompt, extra in requests:
      if rid in self._requests or rid in self._admitting or rid in seen:
        raise CacheError(f"request {rid!r} already exists")
      toks = np.asarray(prompt, np.int32)
      if toks.ndim != 1 or len(toks) == 0:
        raise CacheError("add_request: prompt_token_ids must be a non-empty 1-D sequence")
      seen.add(rid)
      reqs.append((rid, toks, extra))
    if not reqs:
      return []
    longest = max([len(t) for _, t, _ in reqs] + [t or 0 for t in (allocate_tokens or [])])
    for g, bt in self.block_tokens.items():
      self._ensure_width(g, -(-longest // bt))
    if self._fixed and len(self.queue.free_slots) < len(reqs):
      raise CacheError(f"add_requests: {len(reqs)} requests but {len(self.queue.free_slots)} free table rows")
    out = []
    for i, (rid, toks, extra) in enumerate(reqs):
      a = Admission(rid, toks, extra.tenant, self._hasher(toks, extra), self._take_slot(),
                    None if allocate_tokens is None else allocate_tokens[i])
      self._admitting[rid] = a
      out.append(a)
    return out

  def _resolve_admissions(self, res, admits: list[Admission]) -> None:
    """A device call's admission results: each request's state (its hit, its held table entries, its checkpoint
    junctions), its PrefixHit on the Admission and, for queued ones, in `take_admitted()`. One withdrawn while in
    flight is released at once."""
    hit, run, ids = res["hit"], res["run"], res["hit_ids"]
    hits, runs = hit[:len(admits)].tolist(), run[:len(admits)].tolist()
    tails, full = self._hit_tails, self._hit_full
    for i, a in enumerate(admits):
      toks = a.tokens
      a.hit = self._hit(i, len(toks), hit, ids)
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
      bts = self.block_tokens
      tables = {g: HeldEntries(0, n // bts[g]) for g in full}
      released = {}
      for g, need in tails:
        e = n // bts[g]
        released[g] = max(0, e - need)
        tables[g] = HeldEntries(released[g], e)
      self._requests[a.rid] = RequestState(a.rid, Int32Buffer(toks), a.hasher, a.tenant, len(toks), n, tables,
                                           {g: tables[g].n for g in self.groups}, released, junction, n == 0,
                                           slot=a.slot)
      del self._admitting[a.rid]
    if "admit_ok" in res and res["admit_ok"]:
      for g, bt in self.block_tokens.items():
        for a in admits:
          if a.target is not None:
            tab = self._requests[a.rid].tables[g]
            tab.grow(max(0, -(-a.target // bt) - tab.n))
    for a in admits:
      if a.withdrawn:
        self.free(a.rid)
      elif a.target is None and a.queued:
        self._admitted.append((a.rid, a.hit))

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
    q = self.queue
    tables, nfree = r.tables, q.nfree
    need = [(g, max(0, -(-total_tokens // bt) - tables[g].n)) for g, bt in self.block_tokens.items()]
    short = next((g for g, k in need if k > nfree[g]), None)
    if short is not None and (q.free_seen < q.free_seq or self._admitting):
      # releases not confirmed yet, or admissions whose hits are counted at the most they can take: read the exact
      # counts, then decide
      self.sync_counts()
      short = next((g for g, k in need if k > nfree[g]), None)
    if short is not None:
      return OutOfBlocks(short, dict(need)[short], nfree[short])
    for g, k in need:
      if k:
        tab = tables[g]
        if tab.n + k > q.width[g]:
          self._ensure_width(g, tab.n + k)
        start = tab.grow(k)
        q.alloc[g].append((r.slot, start, start + k))
        q.nalloc[g] += k
        nfree[g] -= k
        q.alloc_total[g] += k
        q.rids.add(r.rid)
    return BlockTables(read=functools.partial(self._tables_now, request_id))

  def _tables_now(self, request_id: str) -> dict[str, np.ndarray]:
    """The request's block ids per group, read from the device (tests, tiers, debugging)."""
    r = self._req(request_id)
    self.flush()
    rows = jax.device_get(device_state.table_rows(self.device.state, r.slot))
    out = {}
    for g, row in zip(self.groups, rows):
      held = r.tables[g].view()
      ids = np.asarray(row)[:len(held)].copy()
      if not np.array_equal(ids >= 0, held >= 0):
        raise RuntimeError(f"group {g}: device table of {request_id!r} disagrees with the host's counts")
      out[g] = ids
    return out

  def block_tables(self, request_id: str) -> BlockTables:
    """The request's tables now (applies what is queued first; one device read)."""
    return BlockTables(self._tables_now(request_id))

  # ------------------------------------------------------------------------------------------ register
  def _register(self, r: RequestState, g: str, a: int, b: int, all_held: bool = False) -> None:
    """Queue blocks a .. b - 1 of a group for registration under the request's hashes (those it still holds).
    Only a tuple is queued here; the digest words, refs and tokens of every queued block of every request are
    gathered at once when the step is packed (`_reg_words`, `_group_plan`)."""
    if a >= b:
      return
    runs = [(a, b)] if all_held else r.tables[g].held_runs(a, b)
    bt = self.block_tokens[g]
    q = self.queue
    for a, b in runs:
      infos = None
      if self.events.enabled:
        upb = bt // self._G
        infos = [(key_int(device_key(r.hasher.digests[j * upb - 1], self.key_bits)) if j else None, r.tenant, bt)
                 for j in range(a, b)]
      q.reg[g].append((r.slot, a, b, r.hasher, r.tokens.buf, infos))
      q.nreg[g] += b - a

  def _checkpoint(self, r: RequestState, boundary: int) -> None:
    for g, pol in self.policies.items():
      idx = pol.tail_blocks(boundary)
      if idx.start < idx.stop and r.tables[g].all_held(idx.start, idx.stop):
        self._register(r, g, idx.start, idx.stop, all_held=True)

  def commit(self, request_id: str, num_computed_tokens: int) -> None:
    """The model has written KV for positions [0, num_computed_tokens): cache what is reusable, release what the
    request no longer reads (both queued for the next device call)."""
    r = self._req(request_id)
    if r.rid in self.queue.rids:
      self.flush()              # its allocation is still queued (the engine's step program applied it already)
    n = num_computed_tokens
    if n < r.num_computed:
      raise CacheError(f"commit: num_computed_tokens went backwards ({r.num_computed} -> {n})")
    if n > len(r.tokens):
      raise CacheError(f"commit: {n} computed tokens but only {len(r.tokens)} tokens known (append_tokens first)")
    tables = r.tables
    bts = self.block_tokens
    for g, bt in bts.items():
      if -(-n // bt) > tables[g].n:
        raise CacheError(f"commit: {n} tokens exceed the blocks allocated in group {g}")
    start = len(r.hasher.digests) * self._G     # hash only the new units: O(new tokens)
    if n > start:
      r.hasher.update(r.tokens.buf[start:n], offset=start)
    prev, r.num_computed = r.num_computed, n
    for g in self._registered:                  # full-history groups (every group in legacy mode)
      done, upto = r.num_registered[g], n // bts[g]
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

  def _release(self, r: RequestState, g: str, upto: int) -> None:
    lo = r.released[g]
    if upto > lo:
      tab = r.tables[g]
      runs = tab.held_runs(lo, upto)
      tab.clear_front(upto)
      r.released[g] = upto
      self._queue_frees(r.slot, g, runs)

  def free(self, request_id: str) -> None:
    """End of request: checkpoint the sliding tails where the next turn resumes, then release every block, tail
    first (a chain's last blocks become evictable before its head). Its table row is reused once the device
    has applied the releases (they come first in the next call)."""
    a = self._admitting.get(request_id)
    if a is not None:
      if a in self._q_admit:          # not sent yet: nothing on the device to release
        self._q_admit.remove(a)
        del self._admitting[request_id]
        self.queue.free_slots.append(a.slot)
      else:                           # in flight: released when its result is read (`_resolve_admissions`)
        a.withdrawn = True
      return
    r = self._req(request_id)
    if r.rid in self.queue.rids:
      self.flush()
    if not self.legacy and self.policies:
      self._checkpoint(r, r.num_computed // self._align * self._align)
    for g in self.groups:
      self._queue_frees(r.slot, g, r.tables[g].held_runs(0, r.tables[g].n))
    self.queue.free_slots.append(r.slot)
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
    q = self.queue
    for g, bt in self.block_tokens.items():
      lo, hi = len(r.tables[g]), num_tokens // bt
      if self.specs.group(g).kind != SLIDING_WINDOW:
        new[g] = list(range(lo, hi))
      elif g == "swa":
        new[g] = [j for j in range(lo, hi) if j in wanted]
      else:   # other sliding groups: the tail a resume at num_tokens reads
        new[g] = [j for j in self.policies[g].tail_blocks(num_tokens) if j >= lo]
      if len(new[g]) > q.nfree[g]:
        return OutOfBlocks(g, len(new[g]), q.nfree[g])
    for g, bt in self.block_tokens.items():
      lo, hi = len(r.tables[g]), num_tokens // bt
      self._ensure_width(g, hi)
      want = set(new[g])
      r.tables[g].extend([HOST_HELD if j in want else -1 for j in range(lo, hi)])
      for j in new[g]:
        q.alloc[g].append((r.slot, j, j + 1))
      q.nalloc[g] += len(new[g])
      q.nfree[g] -= len(new[g])
      q.alloc_total[g] += len(new[g])
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
    assert self.device.advance(device_state.reset_pools)
    self.queue.identity.clear()
    self.events.emit(AllBlocksCleared())
    return True

  def num_free_blocks(self, group: str) -> int:
    """Exact free blocks now (reads the device when releases are not confirmed yet)."""
    if self.queue.unconfirmed() or self._queued():
      self.sync_counts()
    return self.queue.nfree[group]

  def blocks_to_run(self, prompt_len: int, total_tokens: int, extra_tokens: int = 0, lag: int = 0,
                    cap: int | None = None) -> dict[str, int]:
    """Blocks per group a request of prompt_len tokens that computes positions [0, total_tokens) needs to run
    alone, at the least: every full-history block up to its last row's end and, in a sliding group, the peak of
    its tail and window (`CheckpointPolicy.peak_blocks`: rows of one position, each allocating extra_tokens past it,
    commits lagging `lag` positions past the prompt). A pool of at least this many blocks per group serves it
    whatever it hits or reloads (rows shortened when it runs alone); a smaller one never can."""
    end = min(total_tokens + extra_tokens, total_tokens + extra_tokens if cap is None else cap)
    out = {}
    for g, bt in self.block_tokens.items():
      pol = self.policies.get(g)
      if pol is None:
        out[g] = -(-end // bt)
      else:
        out[g] = self._memo(("peak", g, prompt_len, total_tokens, extra_tokens, lag, cap),
                            lambda: pol.peak_blocks(prompt_len, total_tokens, extra_tokens, lag, cap))
    return out

  def room_for(self, request_id: str) -> int:
    """The most positions `allocate_to` can cover for the request now (its blocks plus the free ones, the fewest
    over the groups). Exact: reads the device's counts."""
    r = self._req(request_id)
    self.sync_counts()
    nfree = self.queue.nfree
    return min((r.tables[g].n + nfree[g]) * bt for g, bt in self.block_tokens.items())

  def free_blocks_estimate(self, group: str) -> int:
    """Free blocks as the host knows them without reading the device: never more than the truth."""
    return self.queue.nfree[group]

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
    return int(pool.lookup(self.pools[group], jnp.asarray(key), jnp.asarray(par), jnp.asarray(tok))[0]) >= 0

  # ------------------------------------------------------------------------------ the device state it plans for
  # Every call below that changes the state goes through `self.device.advance` (`cache.device_state`); the engine's
  # step program runs the same plans (`plan`, then `read_results`) inside its own pass over the state.
  @property
  def num_slots(self) -> int:
    return self.queue.num_slots

  def table_width(self, group: str) -> int:
    return self.queue.width[group]

  @property
  def device_tables(self) -> dict:
    """The device block tables per group, [slots, width] (read only; the next program donates them)."""
    return dict(zip(self.groups, self.device.state.tables))

  @property
  def pools(self) -> dict:
    """The pool states, with everything queued applied first (tests, debugging, eviction policies; read only:
    `update_pool` changes one)."""
    self.flush()
    return dict(zip(self.groups, self.device.state.pools))

  def update_pool(self, group: str, fn, *args):
    """Apply a `cache.pool` operation fn(pool, *args) -> (pool, ...) to one group's pool (after what is queued);
    returns its other outputs."""
    self.flush()
    return self.device.advance(device_state.update_pool, self.groups.index(group), fn, *args)

  def _take_slot(self) -> int:
    q = self.queue
    if not q.free_slots:
      if self._fixed:
        raise CacheError(f"no free table row: {self.num_slots} requests are held (num_slots)")
      self.flush()
      n = q.num_slots
      self.device.advance(device_state.grow, slots=2 * n)
      q.num_slots = 2 * n
      q.free_slots = list(range(2 * n - 1, n - 1, -1))
    return q.free_slots.pop()

  def _ensure_width(self, g: str, blocks: int) -> None:
    w = self.queue.width[g]
    if blocks <= w:
      return
    if self._fixed:
      raise CacheError(f"group {g}: {blocks} blocks exceed the table width {w} (max_tokens)")
    self.flush()
    nw = w
    while nw < blocks:
      nw *= 2
    # queued refs are (slot, entry) pairs, resolved against the width when packed: growing is safe
    self.queue.width[g] = nw
    self.device.advance(device_state.grow, widths=tuple(self.queue.width.values()))

  def _queue_frees(self, slot: int, g: str, runs) -> None:
    """Queue the release of these table runs of one slot, tail first (`StepQueue.queue_frees`)."""
    self.queue.queue_frees(slot, g, runs)

  def _queued(self) -> bool:
    return bool(self._q_admit) or self.queue.queued()

  def _take_admits(self) -> list:
    admits, self._q_admit = self._q_admit, []
    return admits

  def set_step_capacity(self, tokens: int, rows: int) -> None:
    """Fix the widths of the bookkeeping the engine's step program carries (one compiled shape): at most `tokens`
    new tokens over `rows` requests per step (`StepQueue.set_step_capacity`)."""
    self.queue.set_step_capacity(tokens, rows)

  def plan(self) -> StepPlan:
    """Everything queued (admissions included), as the step program's bookkeeping at its fixed widths: run it with
    `cache.device_state.apply` inside the pass that writes `self.device`, then hand its results to `read_results`
    (in any order after the step). What does not fit the widths (more runs, a table loaded from a tier with gaps)
    runs first in a call of its own."""
    q = self.queue
    if q.step_widths is None:
      raise CacheError("plan: call set_step_capacity first")
    regs_or_frees, allocs = q.overflows()
    if regs_or_frees:
      # registrations and releases go first in a call of their own (allocations stay queued: they follow the
      # releases either way; queued admissions stay for the step: they follow its allocations)
      self.stats["step_plan_overflows"] += 1
      held = q.hold_allocations()
      self._apply([])
      q.restore_allocations(held)
    if allocs:
      self.stats["step_plan_overflows"] += 1
      self._apply([])
    return q.step_plan(self.device.state, self._take_admits())

  def empty_plan(self, admit_dims=None) -> StepPlan:
    """A plan of the step's widths with nothing in it (`StepQueue.empty_plan`; benchmarks): not to be read."""
    if self.queue.step_widths is None:
      raise CacheError("empty_plan: call set_step_capacity first")
    return self.queue.empty_plan(self.device.state, admit_dims)

  def read_results(self, plan: StepPlan, buf) -> None:
    """The results of a plan's bookkeeping (its packed int32 result buffer, on the host), in any order after the
    call; the free counts only move forward."""
    layout, seq = plan.sent.layout
    res = unpack(np.asarray(buf), *layout)
    self.queue.read(res, plan.sent, seq)
    if plan.sent.admits:
      self._resolve_admissions(res, plan.sent.admits)

  def _run(self, plan: StepPlan) -> None:
    """A plan run now, alone: applied to the state (one transfer in), its results read (one transfer out)."""
    out = self.device.advance(device_state.apply, plan)
    self.stats["device_calls"] += 1
    self.read_results(plan, jax.device_get(out))

  def _apply(self, admits=None, admit_widths=None) -> None:
    """One call of its own: the queued work plus the admissions (a list of Admission; None = the queued ones), at
    the widths of what is queued."""
    admits = self._take_admits() if admits is None else admits
    self._run(self.queue.standalone_plan(self.device.state, admits, admit_widths))

  def flush(self) -> None:
    """Apply every queued operation in one device call (no-op when nothing is queued)."""
    if self._queued():
      self._apply(None)

  def run_queue(self) -> None:
    """Run what is queued (admissions included) now and read its results: in the engine's own bookkeeping program
    once the step's widths are fixed (the step program's first part, so no other shape compiles), else in a
    standalone call."""
    if not self._queued():
      return
    if self.queue.step_widths is not None:
      self._run(self.plan())
    else:
      self._apply(None)

  def sync_counts(self) -> None:
    """Apply what is queued and read the device's free counts (waits for every call sent): exact counts."""
    self.stats["syncs"] += 1
    self.run_queue()
    q = self.queue
    if q.unconfirmed() or self._admitting:     # (admissions in flight: counted at their most)
      for g, n in zip(self.groups, device_state.num_free(self.device.state)):
        q.nfree[g] = n
      q.free_seen = q.free_seq
      q.count_seq = q.calls
