"""The serving engine: requests in, one step program per step, outputs out.

    engine = Engine(params, config, EngineConfig(...))
    engine.add_request("r0", prompt_ids, SamplingParams(max_tokens=32))
    outputs = engine.run()           # or engine.step() in a loop

This file builds the parts and runs the step loop; each part is a file named for it: the request bookkeeping
(`request_book.py`: every request held, the waiting queue, the running rows, a request's way in and out), the
scheduler (`scheduler.py`: which requests run in a step and how much of each, admission, preemption by recompute,
shard placement), and the step dispatch (`step_dispatch.py`: a scheduled step turned into the runner's rows, its
results read back). The engine's parts are the only places that know about requests; `cache.manager.KVCacheManager`
knows blocks and hashes, `ModelRunner` knows arrays.

On a mesh with the pools split over `data` (the default, `pools_over_data=True`), each of the D data shards holds
its own num_blocks / D blocks, so the engine keeps one KVCacheManager per shard (`managers[s]`, shard-local ids,
each with its own `cache.device_state.DeviceState`) and places each admitted request on one shard: the one whose
manager gives the longest prefix hit (affinity), ties to the most free blocks, then the fewest running rows. A
request stays there while it runs (its blocks, its row slots [s*R/D, (s+1)*R/D)); preemption frees and picks victims
within its shard; re-admission may choose again. `cache/` knows nothing of meshes: it just sees D independent
managers.
"""

from __future__ import annotations

import collections
import functools
import sys

import jax.numpy as jnp

from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from dsv4 import caches, dspark, mesh_context, model, sharding
from dsv4.config import ModelConfig
from dsv4.engine import compile_stats, speculative_step
from dsv4.engine.config import EngineConfig
from dsv4.engine.prefix_deferral import SharedPrefixDeferral
from dsv4.engine.request import Request, RequestOutput
from dsv4.engine.request_book import RequestBook
from dsv4.engine.runner import ModelRunner
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.scheduler import Scheduler
from dsv4.engine.step_dispatch import StepDispatch
from dsv4.engine.tiering import Tiering
from pallas_kernels import dispatch


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
    dispatch.check_backend(engine_config.kernel)     # "pallas" off a GPU: refused here, not at the first step
    # params may be an nnx_model.Model (model_api="nnx"): the runner holds that module, so editing it (replacing a
    # layer's attention, say) changes what the following steps compute.
    net = None
    if not isinstance(params, dict):
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
    D = mesh_context.axis_size(mesh, "data") if (mesh is not None and pools_over_data) else 1
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

      params = model.cast_params(params, jnp.bfloat16)
    self.runner = ModelRunner(params, config, ec, mesh=mesh, pools_over_data=D > 1, managers=self.managers,
                              **({} if rules is None else {"rules": rules}))
    self._inflight = None                          # the step sent but not read yet (async scheduling)
    self.async_active = ec.async_scheduling and mesh is None and ec.tiering is None
    self.stats = collections.Counter()
    self.deferral = SharedPrefixDeferral(self.managers[0].specs.align_tokens, self.stats)
    self.book = RequestBook(ec, config.vocab_size, self.managers, self.deferral)
    self.scheduler = Scheduler(ec, self.book, self.managers, self.deferral, self.stats, spec=self.spec,
                               draft_lookahead=self.draft_lookahead, async_active=self.async_active)
    self.dispatcher = StepDispatch(config, self.runner, self.book, self.managers, self.stats, spec=self.spec,
                                   record_logits=ec.record_logits)
    self.peak_blocks = self.scheduler.peak_blocks
    self.tiering = None                 # KV tiers below the device: all the glue lives in dsv4/engine/tiering.py
    if ec.tiering is not None:
      if net is not None:
        from dsv4 import nnx_model  # local: the default path does not import Flax
        params = nnx_model.params_of(net)             # the model digest of the module's arrays
      self.tiering = self.scheduler.tiering = Tiering(self, ec.tiering, params)


  # ------------------------------------------------------------------------------------------ requests
  # the request book's state, read where the engine is the handle (tests, the API, the tiers, a replica)
  @property
  def requests(self) -> dict[str, Request]:
    return self.book.requests

  @property
  def waiting(self):
    return self.book.waiting

  @property
  def running(self) -> list[Request]:
    return self.book.running

  @property
  def admitting(self) -> list[Request]:
    return self.book.admitting

  @property
  def on_finish(self):
    """Called with a finishing request before its blocks are freed (a prefill replica reads its state for the
    handoff then: the partially filled last blocks are never cached, so they are gone once freed)."""
    return self.book.on_finish

  @on_finish.setter
  def on_finish(self, hook) -> None:
    self.book.on_finish = hook

  @property
  def clock(self):
    """The clock of arrivals and token times (time.perf_counter; a replica sets one clock for every process)."""
    return self.book.clock

  @clock.setter
  def clock(self, fn) -> None:
    self.book.clock = fn

  @_counted
  def add_request(self, rid: str, prompt, params: SamplingParams = SamplingParams(),
                  extra_keys: ExtraKeys = ExtraKeys(), arrival: float | None = None) -> Request:
    """Queue a request (`RequestBook.add`). Bad input (an id already in use included) is rejected with a clear
    per-request error; nothing else is affected."""
    return self.book.add(rid, prompt, params, extra_keys, arrival)

  @_counted
  def stop_request(self, rid: str, reason: str = "stop") -> bool:
    """Finish a running or waiting request now, as if it had stopped at its last sampled token read (stop strings,
    a client that went away): its blocks are freed exactly as at a normal finish (what it computed is registered,
    so later requests still hit it; with tiers, written through / demoted as usual) and `finish_reason` = reason.
    A token still in flight (async scheduling) is dropped. Call between steps. False (nothing changes) if the id
    is unknown or the request already ended."""
    if not self.book.stop(rid, reason):
      return False
    if self.tiering is not None:
      self.tiering.after_finish()       # its final registrations reach the tiers now, not at some later step
    return True

  # ------------------------------------------------------------------------------------------ step
  @_counted
  def step(self) -> list[Request]:
    """One scheduler step: plan, send the step program, and read a step's results. Returns the requests that
    finished.

    Synchronous: the step just sent is read. Async (`async_active`): the step is sent first, then the PREVIOUS
    step's results are read while it runs; its sampled tokens already feed this step on the device. Host work is
    O(new tokens): each row's chunk is a slice of the request's token list, block tables never leave the device,
    and a step moves one plan buffer in and one buffer (tokens + cache counters) out."""
    scheduled = self.scheduler.schedule()
    if not scheduled and any(m.admissions_pending for m in self.managers):
      # Nothing runs this step but admissions wait for their hits: the bookkeeping program runs alone (the step
      # program's own first part, no model program), and the admitted rows run in this step.
      for m in self.managers:
        m.run_queue()
      scheduled = self.scheduler.schedule(admit=False)
    sent = None
    if scheduled:
      if self.tiering is not None:
        for m in self.managers:
          m.flush()                     # evictions happen (and are demoted) before the step overwrites them
        self.tiering.before_run(scheduled)
      sent = self.dispatcher.dispatch(scheduled)
    done = []
    if self._inflight is not None:
      done += self.dispatcher.collect(self._inflight)
      self._inflight = None
    if sent is not None:
      if self.async_active:
        self._inflight = sent
      else:
        done += self.dispatcher.collect(sent)
    if scheduled:
      self.stats["steps"] += 1
      if self.tiering is not None:
        self.tiering.after_step(scheduled)
    return done

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
    return self.book.outputs()

  def take_outputs(self, rids) -> list[RequestOutput]:
    """The outputs of these ended requests, forgetting them (a long batch job's host memory stays flat)."""
    return self.book.take_outputs(rids)

  def forget(self, rids) -> None:
    """Drop ended requests from `engine.requests` (refuses one that is still waiting or running)."""
    self.book.forget(rids)

  def next_request_index(self) -> int:
    """A number no request id made by `generate` has used on this engine."""
    return self.book.next_request_index()
