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
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time

import numpy as np

from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from dsv4 import caches
from dsv4.config import ModelConfig
from dsv4.engine import compile_stats
from dsv4.engine import schema
from dsv4.engine.request import Request, RequestOutput, Status
from dsv4.engine.runner import ModelRunner, Row
from dsv4.engine.sampling import SamplingParams
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
  # A request's logits are bitwise the same whatever shares its step and however its prompt is chunked (every
  # token runs one fixed-shape program; slower, see runner.py).
  batch_invariant: bool = False
  # Smallest block-table width (tokens) of a step; tables grow in powers of two with the live context up to
  # max_model_len, so a step's attention cost follows its context, not the configured limit.
  min_table_tokens: int = 4096
  # Token buckets of the flat step axis grow 8, 8g, 8g^2, ... (g = 2 or 4): 4 compiles half as many step programs
  # (a compile of the whole model each; they dominate short jobs on CPU) for up to 4x padding of a step's tokens.
  token_bucket_growth: int = 4
  # Buckets per growth interval (1..8): 4 with growth 2 pads a step to within 1.25x of its tokens (256, 320, 384,
  # ...) so a chunk plus many decodes costs about its real tokens, for more compiled programs. 1 = powers only.
  token_bucket_steps: int = 1
  # Compute dtype of params / activations: "fp32" (bit for bit today's) or "bf16" (fp32 norms, softmaxes, logits;
  # model.cast_params). The KV pools' dtype is layout.kv_dtype (fp32, bf16 or caches.FP8).
  dtype: str = "fp32"
  tiering: object = None                # dsv4.engine.tiering.TieringConfig: KV tiers below the device (None = off)
  # "functional" (dsv4.model, the default) or "nnx" (the Flax modules of dsv4.nnx_model, on one device)
  model_api: str = "functional"
  # Bucket fill: a ragged step runs padded to its token bucket (8 * g^k), so a step that spills a few tokens past a
  # bucket pays for the next one (up to g x the work). When deferring at most this fraction of the step's prefill
  # tokens to the next step keeps it in the smaller bucket, the last prefill chunks are trimmed. 0 = off.
  bucket_fill: float = 0.25
  # In-batch shared-prefix deferral: a waiting request that shares at least one resume boundary of prefix with a
  # running request that has not yet computed that part waits until the leader commits past the boundary, then hits
  # it instead of computing the same KV alongside it (a cold wave of siblings sharing a system prompt). False =
  # admit in arrival order regardless (the behaviour before).
  defer_shared_prefix: bool = True

  def validate(self):
    for name in ("max_num_seqs", "max_num_batched_tokens", "chunk_size", "max_model_len", "num_full_blocks",
                 "num_swa_blocks", "min_table_tokens"):
      v = getattr(self, name)
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
        raise ValueError(f"EngineConfig.{name}: an integer >= 1, got {v!r}")
    if not isinstance(self.retention_interval, (int, np.integer)) or self.retention_interval < 0:
      raise ValueError(f"EngineConfig.retention_interval: an integer >= 0 (0 = off), got {self.retention_interval!r}")
    if self.dtype not in ("fp32", "bf16"):
      raise ValueError(f"EngineConfig.dtype: 'fp32' or 'bf16', got {self.dtype!r}")
    if self.model_api not in ("functional", "nnx"):
      raise ValueError(f"EngineConfig.model_api: 'functional' or 'nnx', got {self.model_api!r}")
    if self.token_bucket_growth not in (2, 4):
      raise ValueError(f"EngineConfig.token_bucket_growth: 2 or 4, got {self.token_bucket_growth}")
    if not 1 <= self.token_bucket_steps <= 8:
      raise ValueError(f"EngineConfig.token_bucket_steps: 1..8, got {self.token_bucket_steps}")
    if not 0.0 <= self.bucket_fill < 1.0:
      raise ValueError(f"EngineConfig.bucket_fill: a fraction in [0, 1), got {self.bucket_fill}")
    if self.tiering is not None:
      self.tiering.validate()           # before anything is built: a bad tier setting fails at once


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
    from dsv4 import sharding
    D = sharding.axis_size(mesh, "data") if (mesh is not None and pools_over_data) else 1
    if D > 1:
      sharding.check_pools_over_data(mesh, ec.num_swa_blocks, ec.num_full_blocks, ec.max_num_seqs)
    self.num_shards = D
    self.managers = [KVCacheManager(caches.group_specs(config, ec.layout), num_full_blocks=ec.num_full_blocks // D,
                                    num_swa_blocks=ec.num_swa_blocks // D, retention_interval=ec.retention_interval,
                                    model_id=ec.model_id) for _ in range(D)]
    # One device (or pools replicated over data): the one manager, as before.
    self.cache_manager = self.managers[0] if D == 1 else None
    if ec.dtype == "bf16":
      import jax.numpy as jnp

      from dsv4 import model
      params = model.cast_params(params, jnp.bfloat16)
    self.runner = ModelRunner(params, config, ec.layout, num_swa_blocks=ec.num_swa_blocks,
                              num_full_blocks=ec.num_full_blocks, max_num_seqs=ec.max_num_seqs,
                              chunk_size=ec.chunk_size, max_model_len=ec.max_model_len, kernel_cfg=ec.kernel,
                              batch_invariant=ec.batch_invariant, record_logits=ec.record_logits,
                              min_table_tokens=ec.min_table_tokens,
                              max_num_batched_tokens=ec.max_num_batched_tokens,
                              token_bucket_growth=ec.token_bucket_growth,
                              token_bucket_steps=ec.token_bucket_steps, model_api=ec.model_api,
                              mesh=mesh, pools_over_data=D > 1, **({} if rules is None else {"rules": rules}))
    self._tables: dict[str, object] = {}     # rid -> BlockTables of this step's allocation
    self.waiting: collections.deque[Request] = collections.deque()
    self.running: list[Request] = []
    self.requests: dict[str, Request] = {}
    self.finished: list[Request] = []
    self.stats = collections.Counter()
    self._lead_keys: dict[str, object] = {}        # rid -> (extra keys, first aligned chunk) for deferral
    self._shared: dict[str, dict[str, int]] = {}   # follower -> leader -> shared prefix tokens, once stable
    self._deferred: set[str] = set()               # requests held back at least once
    self.peak_blocks = {g: 0 for g in self.managers[0].groups}
    self.clock = time.perf_counter
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
    self._lead_keys.pop(req.rid, None)
    self._shared.pop(req.rid, None)
    self.finished.append(req)
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

  def _place(self, req: Request) -> int | None:
    """The data shard for an admission: longest prefix hit, then most free blocks, then fewest running rows (only
    shards with a free row slot; None if none has one)."""
    if self.num_shards == 1:
      return 0
    salt = req.cache_salt(self.ec.enable_prefix_caching)
    best, key = None, None
    for s, m in enumerate(self.managers):
      if not self.runner.num_free_slots(s):
        continue
      k = (m.lookup(req.tokens, salt).num_tokens, sum(m.num_free_blocks(g) for g in m.groups),
           -len(self._running_on(s)), -s)
      if key is None or k > key:
        best, key = s, k
    return best

  def _preempt(self, victim: Request):
    """Preemption by recompute: give back every block, keep the generated tokens, requeue at the front."""
    self._mgr(victim).free(victim.rid)
    self._leave(victim)
    victim.num_computed = 0
    victim.num_preemptions += 1
    victim.status = Status.WAITING
    self.waiting.appendleft(victim)
    self.stats["preemptions"] += 1

  def _admit(self, req: Request) -> int:
    hit = self._mgr(req).add_request(req.rid, req.tokens, req.cache_salt(self.ec.enable_prefix_caching))
    n = hit.num_tokens
    if self.tiering is not None:
      n = self.tiering.on_admit(req, n)   # extends the device hit with what it loads from the tiers
    req.num_computed = n
    if req.num_preemptions == 0:
      req.hit_tokens, req.tier_hit_tokens = n, n - hit.num_tokens
    else:
      req.readmit_hit_tokens += n
    return n

  def _lead_key(self, req: Request):
    """Cheap candidate filter for deferral: requests whose first aligned chunk (and cache salt) differ can share
    no resume boundary; only candidates' token lists are compared."""
    k = self._lead_keys.get(req.rid)
    if k is None:
      a = self.managers[0].specs.align_tokens
      k = (req.extra_keys, tuple(req.prompt[:a])) if len(req.prompt) > a else ()
      self._lead_keys[req.rid] = k
    return k

  def _shared_len(self, req: Request, lead: Request, cap: int) -> int:
    known = self._shared.setdefault(req.rid, {})
    got = known.get(lead.rid)
    if got is not None:
      return min(got, cap)
    m = min(cap, len(lead.tokens))
    diff = np.flatnonzero(np.asarray(req.tokens[:m]) != np.asarray(lead.tokens[:m]))
    n = int(diff[0]) if len(diff) else m
    if len(diff) or m == cap:          # a mismatch (or the follower's cap) found: later steps give the same answer
      known[lead.rid] = n
    return n

  def _defer(self, req: Request) -> bool:
    """Hold `req` back this step (in-batch shared-prefix deferral, EngineConfig.defer_shared_prefix)?

    Yes when a running request (the leader: admitted earlier in this step, or still prefilling) shares at least
    one aligned resume boundary of prefix with it and will take a checkpoint at a boundary B it has not computed
    yet, with B <= the shared part (`KVCacheManager.checkpoint_boundaries`). Once the leader has committed past
    every such B, `req` is admitted and hits B. The wait is bounded by the leader's prefill of the shared part; a
    leader that is preempted or finishes leaves `running`, which releases its followers. Estimate, not a lookup:
    a follower could already hit beyond the leader's progress through another request's blocks; then it waits
    for nothing (costs steps, never the answer)."""
    if not (self.ec.defer_shared_prefix and self.ec.enable_prefix_caching and self.running):
      return False
    key = self._lead_key(req)
    if not key:
      return False
    a = self.managers[0].specs.align_tokens
    cap = (len(req.tokens) - 1) // a * a        # the longest hit any resume can give this request
    for lead in self.running:
      if lead.num_computed >= cap or self._lead_key(lead) != key:
        continue
      shared = self._shared_len(req, lead, cap) // a * a
      if shared > lead.num_computed and self._mgr(lead).checkpoint_boundaries(lead.rid, lead.num_computed,
                                                                                shared):
        self.stats["deferred_steps"] += 1
        if req.rid not in self._deferred:
          self._deferred.add(req.rid)
          self.stats["deferred_requests"] += 1
        return True
    return False

  def _track_usage(self):
    for g in self.peak_blocks:
      total = self.ec.num_full_blocks if g == caches.FULL else self.ec.num_swa_blocks
      self.peak_blocks[g] = max(self.peak_blocks[g], total - sum(m.num_free_blocks(g) for m in self.managers))

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
        tables = self._mgr(req).allocate_for(req.rid, n)
        if tables:
          self._tables[req.rid] = tables
          scheduled.append((req, n))
          budget -= n
          break
        # Blocks are per data shard: the victims are the latest running requests on req's shard.
        mine = self._running_on(req.shard)
        if mine == [req]:
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
    if not preempted:
      held: list[Request] = []          # deferred this step: they keep their place at the head of the queue
      while self.waiting and len(self.running) < self.ec.max_num_seqs and budget > 0:
        req = self.waiting[0]
        if self._defer(req):
          held.append(self.waiting.popleft())
          continue
        self._shared.pop(req.rid, None)
        shard = self._place(req)
        if shard is None:               # every shard's row slots are taken
          break
        req.shard = shard
        hit = self._admit(req)
        n = min(req.num_pending, budget, self.ec.chunk_size)
        tables = self._mgr(req).allocate_for(req.rid, n)
        if not tables:
          self._mgr(req).free(req.rid)
          req.num_computed = 0
          if req.num_preemptions:       # a failed admission reuses nothing: count only the one that succeeds
            req.readmit_hit_tokens -= hit
          # Every shard has the same number of blocks: out of blocks on an idle shard means it never fits.
          if not self._running_on(shard) and not any(r.shard == shard for r, _ in scheduled):
            self.waiting.popleft()
            self._reject(req, "the KV block pool is too small for this request even when it runs alone")
            continue
          break
        self.waiting.popleft()
        req.status = Status.RUNNING
        req.slot = self.runner.acquire_slot(shard)
        self.running.append(req)
        self._tables[req.rid] = tables
        scheduled.append((req, n))
        budget -= n
      self.waiting.extendleft(reversed(held))
    self._track_usage()
    return self._fill_bucket(scheduled)

  def _fill_bucket(self, scheduled: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
    """Trims the step's last prefill chunks so its tokens fit the next smaller token bucket, when that defers at
    most `bucket_fill` of its prefill tokens (see EngineConfig). Decode rows are never trimmed and a trimmed chunk
    keeps >= 1 token. Safe after allocation: a request's blocks cover positions up to what was allocated, the
    next step continues from num_computed, and commit releases window blocks by computed tokens only."""
    buckets = self.runner.token_buckets()
    if self.ec.bucket_fill <= 0 or not scheduled or buckets is None:
      return scheduled
    total = sum(n for _, n in scheduled)
    smaller = [b for b in buckets if b < total]
    if not smaller:
      return scheduled
    excess = total - smaller[-1]
    prefill = sum(n for _, n in scheduled if n > 1)
    trimmable = sum(n - 1 for _, n in scheduled if n > 1)
    if excess > min(trimmable, int(self.ec.bucket_fill * prefill)):
      return scheduled
    out = list(scheduled)
    for i in range(len(out) - 1, -1, -1):
      req, n = out[i]
      if excess == 0:
        break
      if n > 1:
        cut = min(excess, n - 1)
        out[i] = (req, n - cut)
        excess -= cut
    self.stats["bucket_fill_trimmed_tokens"] += total - sum(n for _, n in out)
    self.stats["bucket_fill_steps"] += 1
    return out

  # ------------------------------------------------------------------------------------------ step
  def _leave(self, req: Request):
    """Out of the running set (finish, preemption, rejection): give its runner slot back."""
    self.running.remove(req)
    self._tables.pop(req.rid, None)
    if req.slot >= 0:
      self.runner.release_slot(req.slot)
      req.slot = -1

  def _finish(self, req: Request, reason: str):
    req.status, req.finish_reason = Status.FINISHED, reason
    self._lead_keys.pop(req.rid, None)
    self._mgr(req).free(req.rid)
    self._leave(req)
    self.finished.append(req)

  @_counted
  def stop_request(self, rid: str, reason: str = "stop") -> bool:
    """Finish a running or waiting request now, as if it had stopped at its last sampled token (stop strings, a
    client that went away): its blocks are freed exactly as at a normal finish (what it computed is registered, so
    later requests still hit it; with tiers, written through / demoted as usual) and `finish_reason` = reason.
    Call between steps. False (nothing changes) if the id is unknown or the request already ended."""
    req = self.requests.get(rid)
    if req is None or req.status not in (Status.RUNNING, Status.WAITING):
      return False
    if req.status is Status.RUNNING:
      self._finish(req, reason)
    else:
      # Waiting: never admitted, or preempted (its blocks were freed then): nothing held in the manager.
      self.waiting.remove(req)
      req.status, req.finish_reason = Status.FINISHED, reason
      self._lead_keys.pop(rid, None)
      self.finished.append(req)
    self._shared.pop(rid, None)
    if self.tiering is not None:
      self.tiering.after_finish()       # its final registrations reach the tiers now, not at some later step
    return True

  @_counted
  def step(self) -> list[Request]:
    """One scheduler step + one model call. Returns the requests that finished in it.

    Host work is O(new tokens): each row's chunk is a slice of the request's incrementally kept token list, its
    block tables are synced into the runner's slot rows by what changed, and the runner makes one transfer of the
    step plan and one of the sampled tokens."""
    scheduled = self.schedule()
    if not scheduled:
      return []
    if self.tiering is not None:
      self.tiering.before_run(scheduled)
    rows = []
    for req, n in scheduled:
      tables = self._tables.pop(req.rid)
      self.runner.sync_tables(req.slot, tables.swa, tables.full)
      start = req.num_computed
      rows.append(Row(req.slot, req.tokens[start:start + n], start, req.params, len(req.output)))
    sampled, logits = self.runner.run(rows)
    done = []
    now = None
    for i, (req, n) in enumerate(scheduled):
      start = req.num_computed
      recomputed = max(0, min(start + n, req.max_computed) - start)
      req.recomputed_tokens += recomputed
      req.computed_tokens += n
      self.stats["computed_tokens"] += n
      self.stats["recomputed_tokens"] += recomputed
      req.num_computed = start + n
      req.max_computed = max(req.max_computed, req.num_computed)
      self._mgr(req).commit(req.rid, req.num_computed)
      if req.num_pending:
        continue                      # mid-prompt chunk: its row's sample is not wanted
      tok = int(sampled[i])
      req.append_output(tok)
      self._mgr(req).append_tokens(req.rid, [tok])
      if self.ec.record_logits:
        req.token_logits = (req.token_logits or []) + [logits[i]]
      now = self.clock() if now is None else now
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
    return bool(self.waiting or self.running)

  def run(self, progress=None) -> list[RequestOutput]:
    while self.has_work():
      done = self.step()
      if progress is not None and done:
        progress(len(done))
    return [RequestOutput.of(self.requests[r]) for r in self.requests]

  def outputs(self) -> list[RequestOutput]:
    return [RequestOutput.of(r) for r in self.requests.values()]
