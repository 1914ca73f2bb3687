"""The engine's scheduler: which requests run in a step and how much of each. First come, first served with a token
budget: the running requests in order, each its next chunk (chunked prefill mixed with decode), blocks allocated per
step, preemption by recompute when a shard's pool runs out; then the next admissions, queued with their shard's
cache manager (their prefix search and claim ride the step's program, their hits read with its results). A request
the pool cannot serve even alone is refused at admission (`TOO_SMALL`), before anything is searched or loaded.

Policies with state or logic of their own live beside it: shard placement (`placement.py`), in-batch shared-prefix
deferral (`prefix_deferral.py`). The requests themselves are the request book's
(`request_book.py`); running the step is the step dispatch's (`step_dispatch.py`)."""

from __future__ import annotations

from cache.manager import KVCacheManager
from dsv4.engine import placement
from dsv4.engine.config import EngineConfig
from dsv4.engine.prefix_deferral import SharedPrefixDeferral
from dsv4.engine.request import Request, Status
from dsv4.engine.request_book import RequestBook

# The one refusal for a request the pool cannot serve: the same with tiers or without, before anything is loaded.
TOO_SMALL = "the KV block pool is too small for this request even when it runs alone"


class Scheduler:

  def __init__(self, ec: EngineConfig, book: RequestBook, managers: list[KVCacheManager],
               deferral: SharedPrefixDeferral, stats, *, spec: int, draft_lookahead: int, async_active: bool):
    """spec: drafts per row (0 = off); draft_lookahead: positions a drafting row's MTP block runs past its
    frontier; async_active: steps are read one step late."""
    self.ec, self.book, self.managers, self.deferral, self.stats = ec, book, managers, deferral, stats
    self.spec, self.draft_lookahead, self.async_active = spec, draft_lookahead, async_active
    self.num_shards = len(managers)
    self.peak_blocks = {g: 0 for g in managers[0].groups}
    self.tiering = None     # the engine's KV tiers (`dsv4.engine.tiering`): they extend a device hit at admission

  def _mgr(self, req: Request) -> KVCacheManager:
    return self.managers[req.shard]

  def schedule(self, admit: bool = True) -> list[tuple[Request, int]]:
    """The step's rows: the running requests in order (admitted ones last), each its next chunk within the token
    budget, blocks allocated (preempting the latest running request of its shard when out of blocks); then (admit)
    the next admissions are queued: their prefix search and claim ride this step's program, and they run once
    their hits are read (`take_admitted`)."""
    self.take_admitted()
    back: list[Request] = []          # admitted requests going back to the queue (out of blocks before running)
    budget = self.ec.max_num_batched_tokens
    scheduled: list[tuple[Request, int]] = []
    preempted = False
    order = {r.rid: i for i, r in enumerate(self.book.running)}
    for req in list(self.book.running):
      if budget <= 0:
        break
      if req not in self.book.running:       # preempted earlier in this loop
        continue
      if req.fresh and back:            # an earlier admission is going back to the queue: so do later ones
        back.append(self._give_back(req))
        continue
      n = min(self._todo(req), budget, self.ec.chunk_size)
      if n <= 0:
        continue
      n = self._with_drafts(req, n, budget)
      while True:
        if self.managers[req.shard].allocate_to(req.rid, self._alloc_end(req, n)):
          scheduled.append((req, n))
          req.fresh = False
          budget -= n
          break
        # Out of blocks. Whatever holds blocks beside it on its shard makes room first (a request admitted alone
        # fits: `_queue_admissions` refused what cannot); alone, it runs a shorter row.
        # admissions in flight on the shard hold their hits' blocks: out of blocks beside them is not "alone"
        pending = any(a.shard == req.shard for a in self.book.admitting)
        mine = self.book.running_on(req.shard)
        if req.fresh:
          # Admitted but out of blocks before its first chunk. The admissions behind it in this step hold their
          # hits and tier loads: they give them back first (their turn comes next), so the head of an admission
          # batch never starves behind its own batch. Beside requests that ran, or admissions in flight, it gives
          # its claim back and keeps its place at the head of the queue (admissions never preempt).
          later = [r for r in mine if r.fresh and r is not req]
          if later:
            back.extend(self._give_back(r) for r in later)
            continue
          if len(mine) > 1 or pending:
            back.append(self._give_back(req))
            break
        elif len(mine) > 1 or pending:
          # Blocks are per data shard: the victim is the latest running request on req's shard (one admitted but
          # not run yet gives its claim back: not a preemption).
          victim = mine[-1]
          if victim.fresh:
            back.append(self._give_back(victim))
            continue
          self.preempt(victim)
          preempted = True
          if victim is req:
            break
          continue
        # Alone on its shard: a shorter row fits (at worst one position).
        n = self._shorter_row(req, n)
        self.stats["shortened_rows"] += n > 0
        if n == 0:
          self.managers[req.shard].free(req.rid)
          self.book.leave(req)
          self.book.reject(req, TOO_SMALL)
          break
    if back:
      back.sort(key=lambda r: order[r.rid])
      self.book.waiting.extendleft(reversed(back))       # in admission order, ahead of everything that waits
    elif admit and not preempted:
      self._queue_admissions()
    self._track_usage()
    return scheduled

  def take_admitted(self) -> None:
    """Admissions whose hits were read (with a step's results, or a call that ran the queue): in queue order,
    deferral against the ones admitted before them (deferred ones go back to the head of the queue), then running
    with num_computed = the hit (tiers extend it)."""
    back: list[Request] = []
    for mgr in self.managers:
      for rid, hit in mgr.take_admitted():
        req = self.book.requests[rid]
        self.book.admitting.remove(req)
        req.admitting = False
        self.deferral.admitted(rid)
        if self._defer(req):
          mgr.free(rid)
          req.status = Status.WAITING
          back.append(req)
          continue
        self._admitted(req, hit.num_tokens)
        req.status = Status.RUNNING
        req.slot = mgr.slot_of(rid)
        req.step_drafts = 0
        req.fresh = True
        self.book.running.append(req)
    self.book.waiting.extendleft(reversed(back))

  def _queue_admissions(self) -> None:
    """Candidates from the head of the queue (free rows, deferral against the running requests), placed on a shard,
    their admissions queued with the shard's manager: search and claim go with the next step program (or, on an
    engine with nothing to run, with the bookkeeping program run alone: `step`)."""
    held: list[Request] = []          # deferred this step: they keep their place at the head of the queue
    cands: list[Request] = []
    order: dict[str, int] = {}        # queue order of everything taken from the head (put back in that order)
    rows = {s: self.book.rows_held(s) for s in range(self.num_shards)}
    cap = self.ec.max_num_seqs // self.num_shards
    while self.book.waiting and len(self.book.running) + len(self.book.admitting) + len(cands) < self.ec.max_num_seqs:
      req = self.book.waiting[0]
      if (self.num_shards == 1 and rows[0] + len(cands) >= cap) or req.inflight:
        break                           # (a request preempted with a token in flight waits until it is read)
      if not self.fits_alone(req):     # before anything is searched, claimed or loaded
        self.book.reject(self.book.waiting.popleft(), TOO_SMALL)
        continue
      order[req.rid] = len(order)
      if self._defer(req):
        held.append(self.book.waiting.popleft())
        continue
      cands.append(self.book.waiting.popleft())
    places = self._place_batch(cands) if cands else []
    by_shard: dict[int, list[Request]] = {}
    back = []
    for req, s in zip(cands, places):
      if s is None:
        back.append(req)
        continue
      req.shard = s
      by_shard.setdefault(s, []).append(req)
    for s, reqs in by_shard.items():
      self.managers[s].queue_admissions([(r.rid, r.tokens, r.cache_salt(self.ec.enable_prefix_caching))
                                         for r in reqs])
      for r in reqs:
        r.admitting = True
        self.book.admitting.append(r)
    self.book.waiting.extendleft(reversed(sorted(held + back, key=lambda r: order[r.rid])))

  def _give_back(self, req: Request) -> Request:
    """An admitted request that has not run returns its claim and goes back to the queue (not a preemption)."""
    self.managers[req.shard].free(req.rid)
    self.book.leave(req)
    if req.num_preemptions:           # a failed admission reuses nothing: count only the one that succeeds
      req.readmit_hit_tokens -= req.num_computed
    req.num_computed = 0
    req.fresh = False
    req.status = Status.WAITING
    return req

  def preempt(self, victim: Request):
    """Preemption by recompute: give back every block, keep the generated tokens, requeue at the front."""
    self.managers[victim.shard].free(victim.rid)
    self.book.leave(victim)
    victim.num_computed = 0
    victim.drafts = []
    victim.num_preemptions += 1
    victim.status = Status.WAITING
    self.book.waiting.appendleft(victim)
    self.stats["preemptions"] += 1

  def _admitted(self, req: Request, hit_tokens: int) -> int:
    n = hit_tokens
    if self.tiering is not None:
      n = self.tiering.on_admit(req, n)   # extends the device hit with what it loads from the tiers
    req.num_computed = n
    if req.num_preemptions == 0:
      req.hit_tokens, req.tier_hit_tokens = n, n - hit_tokens
    else:
      req.readmit_hit_tokens += n
    return n

  def _defer(self, req: Request) -> bool:
    """Hold `req` back this step (in-batch shared-prefix deferral, EngineConfig.defer_shared_prefix)?"""
    if not (self.ec.defer_shared_prefix and self.ec.enable_prefix_caching):
      return False
    return self.deferral.should_wait(req, self.book.running, self._mgr)

  def _place_batch(self, reqs: list[Request]) -> list[int | None]:
    rows = [self.book.rows_held(s) for s in range(self.num_shards)]
    return placement.place_batch(reqs, self.managers, rows, self.ec.max_num_seqs // self.num_shards,
                                 self.ec.enable_prefix_caching)

  def _todo(self, req: Request) -> int:
    """Tokens the request can run now: its known tokens not computed yet plus the sampled one still on the device;
    0 once the tokens in flight reach max_tokens (it finishes when they are read)."""
    if req.inflight and len(req.output) + req.inflight >= req.params.max_tokens:
      return 0
    return len(req.tokens) + req.inflight - req.num_computed

  def _with_drafts(self, req: Request, n: int, budget: int) -> int:
    """Tokens of req's row this step with speculative decoding: a decode row (its one pending token is the last
    decided one) also verifies the drafts it holds, as many as its remaining output, the budget and the chunk
    allow. Sets req.step_drafts."""
    req.step_drafts = 0
    if not self.spec or self._todo(req) != 1:
      return n
    if req.inflight:
      # async: the row continues the unread step (its decided token and drafts fill it on the device); that step
      # adds at least one token, so at most max_tokens - output - 2 more can still be needed after this row's first
      have, left = self.spec, req.params.max_tokens - len(req.output) - 2
    elif req.drafts and req.num_computed == len(req.tokens) - 1:
      have, left = len(req.drafts), req.params.max_tokens - len(req.output) - 1
    else:
      return n
    req.step_drafts = max(min(have, self.spec, left, budget - 1, self.ec.chunk_size - 1), 0)
    return 1 + req.step_drafts

  def _alloc_end(self, req: Request, n: int) -> int:
    """Positions req's blocks must cover for a row of n tokens: with speculative decoding a row that decides a
    token also runs V4's MTP block k - 1 positions past its frontier (its recursive drafts write window KV there;
    `draft_lookahead`)."""
    end = req.num_computed + n
    if self.spec and req.num_computed + n - req.step_drafts >= len(req.tokens) + req.inflight:
      end += self.draft_lookahead
    if self.spec and req.inflight:
      end += req.inflight_drafts      # the unread step may accept all its drafts: the row then starts that much later
    return min(end, self.ec.max_model_len)

  def _shorter_row(self, req: Request, n: int) -> int:
    """The longest row shorter than n whose blocks fit what req holds plus the free blocks (0: none), its drafts
    trimmed with it."""
    room = self.managers[req.shard].room_for(req.rid)
    drafts = req.step_drafts
    for m in range(n - 1, 0, -1):
      req.step_drafts = max(0, drafts - (n - m))
      if self._alloc_end(req, m) <= room:
        return m
    req.step_drafts = 0
    return 0

  def blocks_alone(self, req: Request) -> dict[str, int]:
    """Blocks per group `req` needs to run alone on a shard, at the least (`KVCacheManager.blocks_to_run`): its
    prompt and every output token but the last computed, a drafting row's lookahead (and, async, the drafts of its
    unread step) allocated past each row, commits one token behind past the prompt when async. A hit or a tier
    reload never needs more, so this is the admission's whole rule: within every group's pool (per data shard) it
    is admitted, waits or is preempted, never refused; beyond it, it is refused at admission."""
    extra = (self.draft_lookahead + (self.spec if self.async_active else 0)) if self.spec else 0
    total = min(len(req.prompt) + req.params.max_tokens - 1, self.ec.max_model_len)
    return self.managers[0].blocks_to_run(len(req.prompt), total, extra, int(self.async_active),
                                          self.ec.max_model_len)

  def fits_alone(self, req: Request) -> bool:
    mgr = self.managers[0]                   # (every shard's pool has as many blocks)
    return all(n <= mgr.num_blocks[g] for g, n in self.blocks_alone(req).items())

  def _track_usage(self):
    for g in self.peak_blocks:
      self.peak_blocks[g] = max(self.peak_blocks[g], sum(m.peak_used[g] for m in self.managers))
