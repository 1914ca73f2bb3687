"""The serving engine: first-come-first-served scheduling with a token budget, chunked prefill mixed with decode
in one step, prefix-hit lookup at admission, per-step block allocation, preemption by recompute when the pool is
exhausted, and freeing into the eviction-ordered queue when a request finishes.

    engine = Engine(params, config, EngineConfig(...))
    engine.add_request("r0", prompt_ids, SamplingParams(max_tokens=32))
    outputs = engine.run()           # or engine.step() in a loop

The engine is the only place that knows about requests; `cache.manager.KVCacheManager` knows blocks and hashes,
`ModelRunner` knows arrays.

On a mesh with the pools split over `data` (the default, `pools_over_data=True`), each of the D data shards holds
its own num_blocks / D blocks, so the engine keeps one KVCacheManager per shard (`managers[s]`, shard-local ids)
and places each admitted request on one shard: the one whose manager gives the longest prefix hit (affinity), ties
to the most free blocks, then the fewest running rows. A request stays there while it runs (its blocks, its row
slots [s*R/D, (s+1)*R/D)); preemption frees and picks victims within its shard; re-admission may choose again.
`cache/` knows nothing of meshes: it just sees D independent managers.

Scheduling policies with state or logic of their own live beside this facade: shard placement (`placement.py`)
and in-batch shared-prefix deferral (`prefix_deferral.py`).
"""

from __future__ import annotations

import collections
import functools
import time

from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from dsv4 import caches, dspark
from dsv4.config import ModelConfig
from dsv4.engine import compile_stats, placement, schema, speculative_step
from dsv4.engine.config import EngineConfig  # noqa: F401  (re-exported: dsv4.engine.engine.EngineConfig)
from dsv4.engine.prefix_deferral import SharedPrefixDeferral
from dsv4.engine.request import Request, RequestOutput, Status
from dsv4.engine.runner import ModelRunner, Row
from dsv4.engine.sampling import SamplingParams


def _counted(method):
  """Run an engine method inside the engine's compile-log scope (its compilations are the engine's)."""
  @functools.wraps(method)
  def counted(self, *args, **kwargs):
    with self.compile_log.scope():
      return method(self, *args, **kwargs)
  return counted


class Engine:

  def __init__(self, params, config: ModelConfig, engine_config: EngineConfig = EngineConfig(), *, mesh=None,
               rules=None, pools_over_data: bool = True):
    """params: the param dict, or with EngineConfig(model_api="nnx") an `nnx_model.Model`, which the engine holds
    (not a copy): a module replaced in it runs from the next step on.
    mesh / rules: run the model step sharded on a device mesh (dsv4.sharding); None = one device.
    pools_over_data (mesh only): one block pool and cache manager per data shard (False: one pool replicated over
    `data`, one manager)."""
    # what this engine compiles (building its cache, admissions, steps), apart from anything else in the process
    self.compile_log = compile_stats.CompileLog()
    with self.compile_log.scope():
      self._build(params, config, engine_config, mesh, rules, pools_over_data)

  def _build(self, params, config, engine_config, mesh, rules, pools_over_data):
    engine_config.validate()
    # params may be an nnx_model.Model (model_api="nnx"): the runner holds that module, so editing it (replacing a
    # layer's attention, say) changes what the following steps compute.
    net = None
    if not isinstance(params, dict):
      import sys
      flax_nnx = sys.modules.get("flax.nnx")        # a Model exists only once Flax is imported
      if flax_nnx is not None and isinstance(params, flax_nnx.Module):
        if engine_config.model_api != "nnx":
          raise ValueError("Engine: an nnx_model.Model runs with EngineConfig(model_api='nnx'); pass its "
                           "params_of(...) dict for the functional path")
        if engine_config.dtype != "fp32":
          raise ValueError("Engine: dtype='bf16' casts a param dict; cast a Model's params before building it "
                           "(nnx_model.merge(config, model.cast_params(params, jnp.bfloat16)))")
        net = params
    self.config, self.ec = config, engine_config
    ec = engine_config
    self.spec = ec.num_speculative_tokens
    if self.spec and config.num_mtp_layers < 1:
      raise ValueError("EngineConfig.num_speculative_tokens > 0: the model has no drafter (ModelConfig."
                       "num_mtp_layers = 0; a checkpoint with mtp.0.* weights, or experiments/train_mtp.py)")
    if self.spec and dspark.is_dspark(config) and self.spec > config.dspark.block_size:
      raise ValueError(f"EngineConfig.num_speculative_tokens={self.spec}: the model's DSpark drafter proposes "
                       f"{config.dspark.block_size} tokens per pass (ModelConfig.dspark.block_size)")
    self.draft_lookahead = speculative_step.draft_lookahead(config, self.spec)
    if self.spec and mesh is not None:
      raise ValueError("EngineConfig.num_speculative_tokens > 0 runs on one device (no mesh)")
    from dsv4 import sharding
    D = sharding.axis_size(mesh, "data") if (mesh is not None and pools_over_data) else 1
    if D > 1:
      sharding.check_pools_over_data(mesh, ec.num_swa_blocks, ec.num_full_blocks, ec.max_num_seqs)
    self.num_shards = D
    # Block tables: one row per running request of the shard, as wide as max_model_len; KV events (block ids read
    # back) only when the tiers need them.
    self.managers = [KVCacheManager(caches.group_specs(config, ec.layout), num_full_blocks=ec.num_full_blocks // D,
                                    num_swa_blocks=ec.num_swa_blocks // D, retention_interval=ec.retention_interval,
                                    model_id=ec.model_id, num_slots=ec.max_num_seqs // D,
                                    max_tokens=ec.max_model_len, enable_events=ec.tiering is not None)
                     for _ in range(D)]
    # One device (or pools replicated over data): the one manager, as before.
    self.cache_manager = self.managers[0] if D == 1 else None
    if ec.dtype == "bf16":
      import jax.numpy as jnp

      from dsv4 import model
      params = model.cast_params(params, jnp.bfloat16)
    self.runner = ModelRunner(params, config, ec, mesh=mesh, pools_over_data=D > 1, managers=self.managers,
                              **({} if rules is None else {"rules": rules}))
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    # admissions sent with a step whose hits are not read yet: they hold table rows, not yet running
    self.admitting: list[Request] = []
    # every request not yet taken by the caller (`take_outputs` forgets finished ones: a long job's host memory
    # stays flat)
    self.requests: dict[str, Request] = {}
    self._next_index = 0
    self._inflight = None                          # the step sent but not read yet (async scheduling)
    self.async_active = ec.async_scheduling and mesh is None and ec.tiering is None
    self.stats = collections.Counter()
    self.deferral = SharedPrefixDeferral(self.managers[0].specs.align_tokens, self.stats)
    self.peak_blocks = {g: 0 for g in self.managers[0].groups}
    self.clock = time.perf_counter
    # Called with a finishing request before its blocks are freed (a prefill replica reads its state for the
    # handoff then: the partially filled last blocks are never cached, so they are gone once freed).
    self.on_finish = None
    self.tiering = None                 # KV tiers below the device: all the glue lives in dsv4/engine/tiering.py
    if ec.tiering is not None:
      from dsv4.engine.tiering import Tiering
      if net is not None:
        from dsv4 import nnx_model
        params = nnx_model.params_of(net)             # the model digest of the module's arrays
      self.tiering = Tiering(self, ec.tiering, params)

  # ------------------------------------------------------------------------------------------ intake
  def _reject(self, req: Request, why: str) -> Request:
    req.status, req.error, req.finish_reason = Status.REJECTED, why, "error"
    self.deferral.forget(req.rid)
    return req

  @_counted
  def add_request(self, rid: str, prompt, params: SamplingParams = SamplingParams(),
                  extra_keys: ExtraKeys = ExtraKeys(), arrival: float | None = None) -> Request:
    """Queue a request. Bad input (an id already in use included) is rejected with a clear per-request error;
    nothing else is affected."""
    # The one request schema (dsv4.engine.schema): types and ranges, nothing coerced, the sampler's limits included.
    V = self.config.vocab_size
    bad, prompt_list = None, []
    try:
      prompt_list = list(schema.check_prompt(prompt, V))
      schema.check_sampling(params, V)
    except schema.RequestError as e:
      bad = str(e)
    req = Request(rid, prompt_list, params, extra_keys, self.clock() if arrival is None else arrival)
    req.index = self._next_index
    self._next_index += 1
    if rid in self.requests:
      # Refused without touching the engine's state under that id: the request holding it is unaffected, and the
      # refusal is returned, not tracked (engine.requests keeps the original).
      req.status, req.error, req.finish_reason = Status.REJECTED, f"id {rid!r} is already in use", "error"
      return req
    self.requests[rid] = req
    if bad is None and len(prompt_list) >= self.ec.max_model_len:
      bad = f"prompt of {len(prompt_list)} tokens does not fit max_model_len={self.ec.max_model_len}"
    if bad is None and len(prompt_list) + params.max_tokens > self.ec.max_model_len:
      bad = (f"prompt ({len(prompt_list)}) + max_tokens ({params.max_tokens}) exceeds "
             f"max_model_len={self.ec.max_model_len}")
    if bad is not None:
      return self._reject(req, bad)
    self.waiting.append(req)
    return req

  # ------------------------------------------------------------------------------------------ schedule
  def _mgr(self, req: Request) -> KVCacheManager:
    return self.managers[req.shard]

  def _running_on(self, shard: int) -> list[Request]:
    return [r for r in self.running if r.shard == shard]

  def _rows_held(self, shard: int) -> int:
    """Table rows of the shard in use: running requests and admissions whose hits are not read yet."""
    return len(self._running_on(shard)) + sum(r.shard == shard for r in self.admitting)

  def _rows_free(self, shard: int) -> bool:
    return self._rows_held(shard) < self.ec.max_num_seqs // self.num_shards

  def _place_batch(self, reqs: list[Request]) -> list[int | None]:
    rows = [self._rows_held(s) for s in range(self.num_shards)]
    return placement.place_batch(reqs, self.managers, rows, self.ec.max_num_seqs // self.num_shards,
                                 self.ec.enable_prefix_caching)

  def _preempt(self, victim: Request):
    """Preemption by recompute: give back every block, keep the generated tokens, requeue at the front."""
    self._mgr(victim).free(victim.rid)
    self._leave(victim)
    victim.num_computed = 0
    victim.drafts = []
    victim.num_preemptions += 1
    victim.status = Status.WAITING
    self.waiting.appendleft(victim)
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
    return self.deferral.should_wait(req, self.running, self._mgr)

  def _track_usage(self):
    for g in self.peak_blocks:
      self.peak_blocks[g] = max(self.peak_blocks[g], sum(m.peak_used[g] for m in self.managers))

  def _todo(self, req: Request) -> int:
    """Tokens the request can run now: its known tokens not computed yet plus the sampled one still on the device;
    0 once the tokens in flight reach max_tokens (it finishes when they are read)."""
    if req.inflight and len(req.output) + req.inflight >= req.params.max_tokens:
      return 0
    return len(req.tokens) + req.inflight - req.num_computed

  def schedule(self, admit: bool = True) -> list[tuple[Request, int]]:
    """The step's rows: the running requests in order (admitted ones last), each its next chunk within the token
    budget, blocks allocated (preempting the latest running request of its shard when out of blocks); then (admit)
    the next admissions are queued: their prefix search and claim ride this step's program, and they run once
    their hits are read (`_take_admitted`)."""
    self._take_admitted()
    back: list[Request] = []          # admitted requests going back to the queue (out of blocks before running)
    budget = self.ec.max_num_batched_tokens
    scheduled: list[tuple[Request, int]] = []
    preempted = False
    for req in list(self.running):
      if budget <= 0:
        break
      if req not in self.running:       # preempted earlier in this loop
        continue
      if req.fresh and back:            # an earlier admission is going back to the queue: so do later ones
        back.append(self._give_back(req))
        continue
      n = min(self._todo(req), budget, self.ec.chunk_size)
      if n <= 0:
        continue
      n = self._with_drafts(req, n, budget)
      while True:
        if self._mgr(req).allocate_to(req.rid, self._alloc_end(req, n)):
          scheduled.append((req, n))
          req.fresh = False
          budget -= n
          break
        # admissions in flight on the shard hold their hits' blocks: out of blocks beside them is not "alone"
        pending = any(a.shard == req.shard for a in self.admitting)
        if req.fresh:
          # Admitted but out of blocks before its first chunk: it gives its claim back and keeps its place at the
          # head of the queue (admissions never preempt); every shard has the same number of blocks, so out of
          # blocks on a shard where nothing else runs (admitted with it at most) means it never fits.
          others = [r for r in self._running_on(req.shard) if r is not req and not r.fresh]
          if not others and not pending and not any(r.shard == req.shard for r, _ in scheduled):
            self._mgr(req).free(req.rid)
            self._leave(req)
            self._reject(req, "the KV block pool is too small for this request even when it runs alone")
          else:
            back.append(self._give_back(req))
          break
        # Blocks are per data shard: the victims are the latest running requests on req's shard.
        mine = self._running_on(req.shard)
        if mine == [req] and not pending:
          # Alone and still out of blocks: it can never fit. Reject it rather than preempt it forever.
          self._mgr(req).free(req.rid)
          self._leave(req)
          self._reject(req, "the KV block pool is too small for this request even when it runs alone")
          break
        victim = mine[-1]
        self._preempt(victim)
        preempted = True
        if victim is req:
          break
    if back:
      self.waiting.extendleft(reversed(back))       # in admission order, ahead of everything that waits
    elif admit and not preempted:
      self._queue_admissions()
    self._track_usage()
    return scheduled

  def _give_back(self, req: Request) -> Request:
    """An admitted request that has not run returns its claim and goes back to the queue (not a preemption)."""
    self._mgr(req).free(req.rid)
    self._leave(req)
    if req.num_preemptions:           # a failed admission reuses nothing: count only the one that succeeds
      req.readmit_hit_tokens -= req.num_computed
    req.num_computed = 0
    req.fresh = False
    req.status = Status.WAITING
    return req

  def _take_admitted(self) -> None:
    """Admissions whose hits were read (with a step's results, or a call that ran the queue): in queue order,
    deferral against the ones admitted before them (deferred ones go back to the head of the queue), then running
    with num_computed = the hit (tiers extend it)."""
    back: list[Request] = []
    for mgr in self.managers:
      for rid, hit in mgr.take_admitted():
        req = self.requests[rid]
        self.admitting.remove(req)
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
        self.running.append(req)
    self.waiting.extendleft(reversed(back))

  def _queue_admissions(self) -> None:
    """Candidates from the head of the queue (free rows, deferral against the running requests), placed on a shard,
    their admissions queued with the shard's manager: search and claim go with the next step program (or, on an
    engine with nothing to run, with the bookkeeping program run alone: `step`)."""
    held: list[Request] = []          # deferred this step: they keep their place at the head of the queue
    cands: list[Request] = []
    order: dict[str, int] = {}        # queue order of everything taken from the head (put back in that order)
    rows = {s: self._rows_held(s) for s in range(self.num_shards)}
    cap = self.ec.max_num_seqs // self.num_shards
    while self.waiting and len(self.running) + len(self.admitting) + len(cands) < self.ec.max_num_seqs:
      req = self.waiting[0]
      if (self.num_shards == 1 and rows[0] + len(cands) >= cap) or req.inflight:
        break                           # (a request preempted with a token in flight waits until it is read)
      order[req.rid] = len(order)
      if self._defer(req):
        held.append(self.waiting.popleft())
        continue
      cands.append(self.waiting.popleft())
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
        self.admitting.append(r)
    self.waiting.extendleft(reversed(sorted(held + back, key=lambda r: order[r.rid])))

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

  # ------------------------------------------------------------------------------------------ step
  def _leave(self, req: Request):
    """Out of the running set (finish, preemption, rejection)."""
    self.running.remove(req)
    req.slot = -1

  def _finish(self, req: Request, reason: str):
    req.status, req.finish_reason = Status.FINISHED, reason
    self.deferral.forget(req.rid)
    if self.on_finish is not None:
      self.on_finish(req)
    self._mgr(req).free(req.rid)
    self._leave(req)

  @_counted
  def stop_request(self, rid: str, reason: str = "stop") -> bool:
    """Finish a running or waiting request now, as if it had stopped at its last sampled token read (stop strings,
    a client that went away): its blocks are freed exactly as at a normal finish (what it computed is registered,
    so later requests still hit it; with tiers, written through / demoted as usual) and `finish_reason` = reason.
    A token still in flight (async scheduling) is dropped. Call between steps. False (nothing changes) if the id
    is unknown or the request already ended."""
    req = self.requests.get(rid)
    if req is None or req.status not in (Status.RUNNING, Status.WAITING):
      return False
    if req.status is Status.RUNNING:
      self._finish(req, reason)
    elif req.admitting:
      # Its admission went with a step whose result is not read: withdrawn (released when the result arrives).
      self._mgr(req).free(rid)
      self.admitting.remove(req)
      req.admitting = False
      req.status, req.finish_reason = Status.FINISHED, reason
      self.deferral.forget(rid)
    else:
      # Waiting: never admitted, or preempted (its blocks were freed then): nothing held in the manager.
      self.waiting.remove(req)
      req.status, req.finish_reason = Status.FINISHED, reason
      self.deferral.forget(rid)
    if self.tiering is not None:
      self.tiering.after_finish()       # its final registrations reach the tiers now, not at some later step
    return True

  @_counted
  def step(self) -> list[Request]:
    """One scheduler step: plan, send the step program, and read a step's results. Returns the requests that
    finished.

    Synchronous: the step just sent is read. Async (`async_active`): the step is sent first, then the PREVIOUS
    step's results are read while it runs; its sampled tokens already feed this step on the device. Host work is
    O(new tokens): each row's chunk is a slice of the request's token list, block tables never leave the device,
    and a step moves one plan buffer in and one buffer (tokens + cache counters) out."""
    scheduled = self.schedule()
    if not scheduled and any(m.admissions_pending for m in self.managers):
      # Nothing runs this step but admissions wait for their hits: the bookkeeping program runs alone (the step
      # program's own first part, no model program), and the admitted rows run in this step.
      for m in self.managers:
        m.run_queue()
      scheduled = self.schedule(admit=False)
    sent = None
    if scheduled:
      if self.tiering is not None:
        for m in self.managers:
          m.flush()                     # evictions happen (and are demoted) before the step overwrites them
        self.tiering.before_run(scheduled)
      sent = self._dispatch(scheduled)
    done = []
    if self._inflight is not None:
      done += self._collect(self._inflight)
      self._inflight = None
    if sent is not None:
      if self.async_active:
        self._inflight = sent
      else:
        done += self._collect(sent)
    if scheduled:
      self.stats["steps"] += 1
      if self.tiering is not None:
        self.tiering.after_step(scheduled)
    return done

  def _dispatch(self, scheduled):
    rows = []
    for i, (req, n) in enumerate(scheduled):
      start = req.num_computed
      nd = req.step_drafts
      known = req.tokens[start:start + n - nd]
      prev_row, drafts = -1, req.drafts[:nd]
      if len(known) < n - nd:           # the last token is the one sampled by the previous step, on the device
        if self.spec:                   # ... and so are the drafts; the device fills the row and shifts it
          known, prev_row, drafts = known + [0], req.sample_row, [0] * nd
        else:
          known = known + [-1 - req.sample_row]
      nxt = -1
      if self.spec and start + n < len(req.tokens):   # stops mid-prompt: the MTP block's input after its last token
        nxt = req.tokens[start + n]
      rows.append(Row(req.slot, known + drafts, start, req.params, len(req.output) + req.inflight, req.shard,
                      num_drafts=nd, next_token=nxt, prev_row=prev_row))
    handle = self.runner.dispatch(rows)
    for i, (req, n) in enumerate(scheduled):
      start = req.num_computed
      recomputed = max(0, min(start + n, req.max_computed) - start)
      req.recomputed_tokens += recomputed
      req.computed_tokens += n
      self.stats["computed_tokens"] += n
      self.stats["recomputed_tokens"] += recomputed
      # drafts are final only once verified (`_collect` advances past the accepted ones)
      req.num_computed = start + n - req.step_drafts
      req.max_computed = max(req.max_computed, req.num_computed)
      # commit now what is known (a prompt chunk; a decode row up to its input token, still on the device): the
      # registrations go into the next program, after this one has written the KV
      self._mgr(req).commit(req.rid, min(req.num_computed, len(req.tokens)))
    rows = []
    for i, (req, n) in enumerate(scheduled):
      samples = req.num_computed >= len(req.tokens) + req.inflight    # its last token ran: its sample is wanted
      if samples:
        req.inflight += 1
        req.sample_row = i
        req.inflight_drafts = req.step_drafts
      rows.append((req, req.num_computed, req.num_preemptions, samples, req.step_drafts))
    return handle, rows

  def _collect(self, sent) -> list[Request]:
    handle, rows = sent
    sampled, logits = self.runner.collect(handle)
    done, now = [], None
    for i, (req, end, preemptions, samples, num_drafts) in enumerate(rows):
      live = req.status is Status.RUNNING and req.num_preemptions == preemptions
      if live and min(end, len(req.tokens)) > self._mgr(req).num_committed(req.rid):
        self._mgr(req).commit(req.rid, min(end, len(req.tokens)))
      if not samples or req.status in (Status.FINISHED, Status.REJECTED):
        continue                      # mid-prompt chunk (its sample is not wanted), or it already ended
      if self.spec:
        if self._take_verified(req, sampled[i], live, num_drafts, None if logits is None else logits[i]):
          done.append(req)
        continue
      tok = int(sampled[i])
      req.inflight -= 1
      req.append_output(tok)
      if live:
        self._mgr(req).append_tokens(req.rid, [tok])
      if self.ec.record_logits:
        req.token_logits = (req.token_logits or []) + [logits[i]]
      now = self.clock() if now is None else now
      if req.first_token_time is None:
        req.first_token_time = now
      req.last_token_time = now
      if self._stops(req, tok):
        done.append(req)
    return done

  def _stops(self, req: Request, tok: int) -> bool:
    """Finishes req if tok (just appended) is a stop token or its last; True if it finished."""
    p = req.params
    reason = None
    if tok in p.stop_token_ids or (not p.ignore_eos and tok == self.config.eos_token_id):
      reason = "stop"
    elif len(req.output) >= p.max_tokens:
      reason = "length"
    if reason is None:
      return False
    if req.status is Status.RUNNING:
      self._finish(req, reason)
    else:                             # preempted while its token was in flight: it ends in the queue
      self.waiting.remove(req)
      req.status, req.finish_reason = Status.FINISHED, reason
      self.deferral.forget(req.rid)
    return True

  def _take_verified(self, req: Request, res, live: bool, num_drafts: int, logits_JxV=None) -> bool:
    """A speculative row's results (runner.RaggedShape.out_width): the accepted drafts and the decided token
    join the output one by one (a stop ends it there; later ones are dropped), each with its logits when recorded
    (logits_JxV[j]: the distribution new token j was verified or drawn from), the positions of the accepted drafts
    become computed and committed, and the new drafts are kept for the next step. True if it finished."""
    k = self.spec
    n_new = int(res[0])
    new, drafts = [int(t) for t in res[1:1 + n_new]], [int(t) for t in res[2 + k:2 + 2 * k]]
    req.inflight -= 1
    accepted = n_new - 1
    self.stats["spec_rows"] += num_drafts > 0
    self.stats["spec_draft_tokens"] += num_drafts
    self.stats["spec_accepted_tokens"] += accepted
    for d in range(1, num_drafts + 1):   # by depth: draft d is accepted only with drafts 1 .. d - 1
      self.stats[f"spec_drafts_at_{d}"] += 1
      self.stats[f"spec_accepted_at_{d}"] += d <= accepted
    if live:
      req.num_computed += accepted
      req.max_computed = max(req.max_computed, req.num_computed)
    now = self.clock()
    for j, tok in enumerate(new):
      req.append_output(tok)
      if live:
        self._mgr(req).append_tokens(req.rid, [tok])
      if logits_JxV is not None:
        req.token_logits = (req.token_logits or []) + [logits_JxV[j]]
      if req.first_token_time is None:
        req.first_token_time = now
      req.last_token_time = now
      if self._stops(req, tok):
        return True
    if live:
      self._mgr(req).commit(req.rid, min(req.num_computed, len(req.tokens)))
      req.drafts = drafts
    return False

  def compile_report(self) -> dict:
    """What this engine compiled (every jitted function and eager op its construction, admissions and steps
    caused, by name; not what other code in the process compiled), the distinct step programs it ran, and the
    transfers the runner made."""
    by_name = self.compile_log.delta()
    return {"compilations": sum(by_name.values()), "compile_seconds": round(self.compile_log.seconds(), 3),
            "persistent_cache_hits": self.compile_log.persistent_cache_hits(),
            "compilations_by_function": dict(sorted(by_name.items())),
            "step_programs": {self.runner.step_function_name(): len(self.runner.shapes_run)},
            "runner": dict(self.runner.stats)}

  def has_work(self) -> bool:
    return bool(self.waiting or self.running or self.admitting or self._inflight is not None)

  def run(self, progress=None) -> list[RequestOutput]:
    """Steps until every request ended. Returns the outputs of every request the engine holds (in the order they
    were added); they stay in `engine.requests` until `take_outputs` / `forget`."""
    while self.has_work():
      done = self.step()
      if progress is not None and done:
        progress(len(done))
    return self.outputs()

  def outputs(self) -> list[RequestOutput]:
    return [RequestOutput.of(r) for r in self.requests.values()]

  def take_outputs(self, rids) -> list[RequestOutput]:
    """The outputs of these ended requests, forgetting them (a long batch job's host memory stays flat)."""
    outs = [RequestOutput.of(self.requests[r]) for r in rids]
    self.forget(rids)
    return outs

  def forget(self, rids) -> None:
    """Drop ended requests from `engine.requests` (refuses one that is still waiting or running)."""
    for rid in rids:
      req = self.requests.get(rid)
      if req is None:
        continue
      if req.status in (Status.WAITING, Status.RUNNING):
        raise ValueError(f"forget: request {rid!r} has not ended")
      del self.requests[rid]
      self.deferral.forget(rid)

  def next_request_index(self) -> int:
    """A number no request id made by `generate` has used on this engine."""
    return self._next_index
