"""The serving engine: first-come-first-served scheduling with a token budget, chunked prefill mixed with decode
in one step, prefix-hit lookup at admission, per-step block allocation, preemption by recompute when the pool is
exhausted, and freeing into the eviction-ordered queue when a request finishes.

    engine = Engine(params, config, EngineConfig(...))
    engine.add_request("r0", prompt_ids, SamplingParams(max_tokens=32))
    outputs = engine.run()           # or engine.step() in a loop

The engine is the only place that knows about requests; `cache.manager.KVCacheManager` knows blocks and hashes,
`ModelRunner` knows arrays.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from dsv4 import caches
from dsv4.config import ModelConfig
from dsv4.engine.request import Request, RequestOutput, Status
from dsv4.engine.runner import ModelRunner
from dsv4.engine.sampling import SamplingParams, sample
from pallas_kernels import dispatch


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  max_num_seqs: int = 8                 # rows per step
  max_num_batched_tokens: int = 512     # token budget per step
  chunk_size: int = 64                  # longest prefill chunk of one request per step
  max_model_len: int = 2048
  num_full_blocks: int = 256
  num_swa_blocks: int = 512
  enable_prefix_caching: bool = True
  retention_interval: int = 0
  model_id: str = "dsv4"
  record_logits: bool = False           # keep each sampled position's logits (tests, analysis)
  layout: caches.CacheLayout = caches.CacheLayout()
  kernel: dispatch.KernelConfig = dispatch.KernelConfig()

  def validate(self):
    if self.chunk_size < 1 or self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
      raise ValueError("EngineConfig: chunk_size, max_num_batched_tokens and max_num_seqs must be >= 1")


class Engine:

  def __init__(self, params, config: ModelConfig, engine_config: EngineConfig = EngineConfig()):
    engine_config.validate()
    self.config, self.ec = config, engine_config
    ec = engine_config
    self.cache_manager = KVCacheManager(caches.group_specs(config, ec.layout), num_full_blocks=ec.num_full_blocks,
                                        num_swa_blocks=ec.num_swa_blocks, retention_interval=ec.retention_interval,
                                        model_id=ec.model_id)
    self.runner = ModelRunner(params, config, ec.layout, num_swa_blocks=ec.num_swa_blocks,
                              num_full_blocks=ec.num_full_blocks, max_num_seqs=ec.max_num_seqs,
                              chunk_size=ec.chunk_size, max_model_len=ec.max_model_len, kernel_cfg=ec.kernel)
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    self.requests: dict[str, Request] = {}
    self.finished: list[Request] = []
    self.stats = collections.Counter()
    self.peak_blocks = {g: 0 for g in self.cache_manager.groups}
    self.clock = time.perf_counter

  # ------------------------------------------------------------------------------------------ intake
  def _reject(self, req: Request, why: str) -> Request:
    req.status, req.error, req.finish_reason = Status.REJECTED, why, "error"
    self.finished.append(req)
    return req

  def add_request(self, rid: str, prompt, params: SamplingParams = SamplingParams(),
                  extra_keys: ExtraKeys = ExtraKeys(), arrival: float | None = None) -> Request:
    """Queue a request. Bad input is rejected with a clear per-request error; nothing else is affected."""
    if rid in self.requests:
      raise ValueError(f"duplicate request id {rid!r}")
    try:
      prompt_list = [int(t) for t in np.asarray(prompt).reshape(-1)] if len(prompt) else []
    except (TypeError, ValueError) as e:
      prompt_list, bad = [], f"prompt is not a sequence of integer token ids ({e})"
    else:
      bad = None
    req = Request(rid, prompt_list, params, extra_keys, self.clock() if arrival is None else arrival)
    self.requests[rid] = req
    V = self.config.vocab_size
    if bad is None:
      bad = params.validate()
    if bad is None and not prompt_list:
      bad = "empty prompt"
    if bad is None and any(t < 0 or t >= V for t in prompt_list):
      t = next(t for t in prompt_list if t < 0 or t >= V)
      bad = f"token id {t} out of range [0, {V})"
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
  def _preempt(self, victim: Request):
    """Preemption by recompute: give back every block, keep the generated tokens, requeue at the front."""
    self.cache_manager.free(victim.rid)
    self.running.remove(victim)
    victim.num_computed = 0
    victim.num_preemptions += 1
    victim.status = Status.WAITING
    self.waiting.appendleft(victim)
    self.stats["preemptions"] += 1

  def _admit(self, req: Request) -> int:
    hit = self.cache_manager.add_request(req.rid, req.all_tokens, req.cache_salt(self.ec.enable_prefix_caching))
    req.num_computed = hit.num_tokens
    if req.num_preemptions == 0:
      req.hit_tokens = hit.num_tokens
    else:
      req.readmit_hit_tokens += hit.num_tokens
    return hit.num_tokens

  def _track_usage(self):
    for g in self.cache_manager.groups:
      total = self.ec.num_full_blocks if g == caches.FULL else self.ec.num_swa_blocks
      self.peak_blocks[g] = max(self.peak_blocks[g], total - self.cache_manager.num_free_blocks(g))

  def schedule(self) -> list[tuple[Request, int]]:
    budget = self.ec.max_num_batched_tokens
    scheduled: list[tuple[Request, int]] = []
    preempted = False
    for req in list(self.running):
      if budget <= 0:
        break
      if req not in self.running:       # preempted earlier in this loop
        continue
      n = min(req.num_pending, budget, self.ec.chunk_size)
      while True:
        if self.cache_manager.allocate_for(req.rid, n):
          scheduled.append((req, n))
          budget -= n
          break
        if self.running == [req]:
          # Alone and still out of blocks: it can never fit. Reject it rather than preempt it forever.
          self.cache_manager.free(req.rid)
          self.running.remove(req)
          self._reject(req, "the KV block pool is too small for this request even when it runs alone")
          break
        victim = self.running[-1]
        self._preempt(victim)
        preempted = True
        if victim is req:
          break
    if not preempted:
      while self.waiting and len(self.running) < self.ec.max_num_seqs and budget > 0:
        req = self.waiting[0]
        self._admit(req)
        n = min(req.num_pending, budget, self.ec.chunk_size)
        if not self.cache_manager.allocate_for(req.rid, n):
          self.cache_manager.free(req.rid)
          req.num_computed = 0
          if not self.running and not scheduled:
            self.waiting.popleft()
            self._reject(req, "the KV block pool is too small for this request even when it runs alone")
            continue
          break
        self.waiting.popleft()
        req.status = Status.RUNNING
        self.running.append(req)
        scheduled.append((req, n))
        budget -= n
    self._track_usage()
    return scheduled

  # ------------------------------------------------------------------------------------------ step
  def _finish(self, req: Request, reason: str):
    req.status, req.finish_reason = Status.FINISHED, reason
    self.cache_manager.free(req.rid)
    self.running.remove(req)
    self.finished.append(req)

  def step(self) -> list[Request]:
    """One scheduler step + one model call. Returns the requests that finished in it."""
    scheduled = self.schedule()
    if not scheduled:
      return []
    rows = []
    for req, n in scheduled:
      tables = self.cache_manager.block_tables(req.rid)
      toks = req.all_tokens[req.num_computed: req.num_computed + n]
      rows.append((toks, req.num_computed, tables.swa, tables.full))
    logits = self.runner.run(rows)
    sample_rows, sample_idx = [], []
    for i, (req, n) in enumerate(scheduled):
      start = req.num_computed
      recomputed = max(0, min(start + n, req.max_computed) - start)
      req.recomputed_tokens += recomputed
      req.computed_tokens += n
      self.stats["computed_tokens"] += n
      self.stats["recomputed_tokens"] += recomputed
      req.num_computed = start + n
      req.max_computed = max(req.max_computed, req.num_computed)
      self.cache_manager.commit(req.rid, req.num_computed)
      if req.num_pending == 0:
        sample_rows.append(req)
        sample_idx.append(i)
    done = []
    if sample_rows:
      # Sample every row of the fixed-shape batch (one compiled sampler), keep the rows that finished a prompt.
      row_params = [SamplingParams()] * logits.shape[0]
      row_steps = [0] * logits.shape[0]
      for req, i in zip(sample_rows, sample_idx):
        row_params[i], row_steps[i] = req.params, len(req.output)
      all_toks = sample(logits, row_params, row_steps)
      toks = [all_toks[i] for i in sample_idx]
      now = self.clock()
      logits_np = np.asarray(logits) if self.ec.record_logits else None
      for j, (req, tok) in enumerate(zip(sample_rows, toks)):
        tok = int(tok)
        req.output.append(tok)
        self.cache_manager.append_tokens(req.rid, [tok])
        if self.ec.record_logits:
          req.token_logits = (req.token_logits or []) + [logits_np[sample_idx[j]]]
        if req.first_token_time is None:
          req.first_token_time = now
        req.last_token_time = now
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok == self.config.eos_token_id):
          self._finish(req, "stop")
          done.append(req)
        elif len(req.output) >= p.max_tokens:
          self._finish(req, "length")
          done.append(req)
    self.stats["steps"] += 1
    return done

  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  def run(self, progress=None) -> list[RequestOutput]:
    while self.has_work():
      done = self.step()
      if progress is not None and done:
        progress(len(done))
    return [RequestOutput.of(self.requests[r]) for r in self.requests]

  def outputs(self) -> list[RequestOutput]:
    return [RequestOutput.of(r) for r in self.requests.values()]
