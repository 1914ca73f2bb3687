"""The engine's request bookkeeping: every request it holds (`requests`, until the caller takes its output), the
waiting queue, the running rows and the admissions in flight, and each request's way in (`add`: the one schema
check) and out (`reject`, `finish`, `stop`, `end_in_queue`, `forget`). Which requests run in a step is the
scheduler's business (`dsv4.engine.scheduler`); running them, the step dispatch's (`dsv4.engine.step_dispatch`)."""

from __future__ import annotations

import collections
import os
import time

from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from dsv4.engine import schema
from dsv4.engine.config import EngineConfig
from dsv4.engine.prefix_deferral import SharedPrefixDeferral
from dsv4.engine.request import Request, RequestOutput, Status
from dsv4.engine.sampling import SamplingParams


class RequestBook:

  def __init__(self, ec: EngineConfig, vocab_size: int, managers: list[KVCacheManager],
               deferral: SharedPrefixDeferral):
    self.ec, self.vocab_size, self.managers, self.deferral = ec, vocab_size, managers, deferral
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    # admissions sent with a step whose hits are not read yet: they hold table rows, not yet running
    self.admitting: list[Request] = []
    # every request not yet taken by the caller (`take_outputs` forgets finished ones: a long job's host memory
    # stays flat)
    self.requests: dict[str, Request] = {}
    self._next_index = 0
    # Request.uid: this engine's own prefix (random: no other engine, in this process or one sharing its tiers, makes
    # the same) and the arrival index, so a request never shares per-request state with an earlier one of its id
    self._uid_prefix = os.urandom(6).hex() + ":"
    self.clock = time.perf_counter
    # Called with a finishing request before its blocks are freed (a prefill replica reads its state for the
    # handoff then: the partially filled last blocks are never cached, so they are gone once freed).
    self.on_finish = None

  # ------------------------------------------------------------------------------------------ in
  def add(self, rid: str, prompt, params: SamplingParams = SamplingParams(), extra_keys: ExtraKeys = ExtraKeys(),
          arrival: float | None = None) -> Request:
    """Queue a request. Bad input (an id already in use included) is rejected with a clear per-request error;
    nothing else is affected."""
    # The one request schema (dsv4.engine.schema): types and ranges, nothing coerced, the sampler's limits included.
    V = self.vocab_size
    bad, prompt_list = None, []
    try:
      prompt_list = list(schema.check_prompt(prompt, V))
      schema.check_sampling(params, V)
    except schema.RequestError as e:
      bad = str(e)
    req = Request(rid, prompt_list, params, extra_keys, self.clock() if arrival is None else arrival)
    req.index = self._next_index
    req.uid = f"{self._uid_prefix}{req.index}"
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
      return self.reject(req, bad)
    self.waiting.append(req)
    return req

  def next_request_index(self) -> int:
    """A number no request id made by `generate` has used on this engine."""
    return self._next_index

  # ------------------------------------------------------------------------------------------ rows
  def running_on(self, shard: int) -> list[Request]:
    return [r for r in self.running if r.shard == shard]

  def rows_held(self, shard: int) -> int:
    """Table rows of the shard in use: running requests and admissions whose hits are not read yet."""
    return len(self.running_on(shard)) + sum(r.shard == shard for r in self.admitting)

  def leave(self, req: Request):
    """Out of the running set (finish, preemption, rejection)."""
    self.running.remove(req)
    req.slot = -1

  # ------------------------------------------------------------------------------------------ out
  def reject(self, req: Request, why: str) -> Request:
    req.status, req.error, req.finish_reason = Status.REJECTED, why, "error"
    self.deferral.forget(req.rid)
    return req

  def finish(self, req: Request, reason: str):
    """A running request ends: the finish hook sees it, then its blocks are freed."""
    req.status, req.finish_reason = Status.FINISHED, reason
    self.deferral.forget(req.rid)
    if self.on_finish is not None:
      self.on_finish(req)
    self.managers[req.shard].free(req.rid)
    self.leave(req)

  def end_in_queue(self, req: Request, reason: str):
    """A waiting request ends where it waits (preempted with its last token in flight, or stopped)."""
    self.waiting.remove(req)
    req.status, req.finish_reason = Status.FINISHED, reason
    self.deferral.forget(req.rid)

  def stop(self, rid: str, reason: str) -> bool:
    """`Engine.stop_request` without the tiers: True if the request was running or waiting and now ended."""
    req = self.requests.get(rid)
    if req is None or req.status not in (Status.RUNNING, Status.WAITING):
      return False
    if req.status is Status.RUNNING:
      self.finish(req, reason)
    elif req.admitting:
      # Its admission went with a step whose result is not read: withdrawn (released when the result arrives).
      self.managers[req.shard].free(rid)
      self.admitting.remove(req)
      req.admitting = False
      req.status, req.finish_reason = Status.FINISHED, reason
      self.deferral.forget(rid)
    else:
      # Waiting: never admitted, or preempted (its blocks were freed then): nothing held in the manager.
      self.end_in_queue(req, reason)
    return True

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
