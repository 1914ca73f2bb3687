"""Model runner: owns the params and the paged cache pytree; turns one scheduler step into device work: the cache
manager's bookkeeping program then ONE step program (`step_program.step_body`, jitted as `ragged_step`), back to
back, with one host->device transfer (the packed step plan and the queued bookkeeping) and one device->host
transfer (the sampled tokens and the cache's counters).

Block tables never visit the host: they live on the device in the cache's `DeviceState` ([slots, width] per group,
next to its pools, in the manager's `DeviceCell`), each row of a step names its manager slot, and the program
gathers the row's tables there (the full table from entry 0 at a width that follows the live context, the swa table
from the row's base block: window + chunk). On one device a step is ONE pass over that state (`_call`:
`DeviceCell.advance`): the manager's plan (registrations, releases, allocations that write the tables) runs right
before the model on the device (`cache.device_state.apply`, a fixed shape per engine: compiled once, not inside
every step shape's program), the model reads the tables it left, and the new state is kept; no host read between,
and the host plans with counts only.

The runner packs a step's rows into the program's plan (`step_plan`), always at the engine's one shape
(`_step_shape`): the whole token budget, every row slot, the full table at max_model_len (read in place) and the swa
table at the widest window + chunk a row can touch. The model's ops are row-invariant and loop over the live tokens
only (docs/engine.md, the invariant step), so one shape costs what the step holds.

Async scheduling: `dispatch` sends a step and returns at once; `collect` waits for it. The sampled tokens also
stay on the device (`prev_tokens`), and a token id -(1 + j) in the next plan means "row j's sample of the
previous step", so the engine can send step N+1 before it reads step N.

A mesh (dsv4.sharding): params and pools carry the rule shardings (tensor and expert parallel inside the program).
`pools_over_data=True` (the engine's default on a mesh): every pool's block axis is split over `data` and the
program runs manual over `data` (`jax.shard_map`): data shard s holds num_blocks/D blocks and its own cache manager
(max_num_seqs/D slots, SHARD-LOCAL block ids); its plan row holds its own rows, and the sampled tokens are gathered
over `data` so every process reads all of them. `pools_over_data=False`: one pool replicated over `data`, one plan.
On a mesh the managers apply their bookkeeping in their own call before the step and their tables travel with it
(stacked per shard): the one place block tables still cross the host.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from cache import device_state
from dsv4 import caches, mesh_context, sharding
from dsv4.config import ModelConfig
from dsv4.engine import block_copies, host_memory, speculative_step
from dsv4.engine.config import EngineConfig
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.step_plan import RaggedShape, pack, pow2_at_least, result_width
from dsv4.engine.step_program import (StepOutput, jitted_ragged_step, step_body, step_compiler_options,
                                     step_loop_buffer_shapes)
from dsv4.layers import row_invariant


@dataclasses.dataclass
class Row:
  """One request's work in a step, as the engine hands it to the runner."""
  slot: int                      # its row of its cache manager's device tables
  tokens: list[int]              # the token ids to compute (len = n); -(1 + j): row j's sample of the last step
  start: int                     # position of tokens[0]
  params: SamplingParams
  step: int                      # index of the token to sample in the request's output (the sampler's key)
  shard: int = 0                 # data shard (its manager, its slice of the pools) on a mesh
  num_drafts: int = 0            # speculative decoding: tokens[-num_drafts:] are drafts to verify
  next_token: int = -1           # speculative decoding, a row that stops mid-prompt: the prompt token after it
  prev_row: int = -1             # speculative decoding, async: continues this row of the previous step (its decided
                                 # token and drafts fill the row on the device; its accepted count shifts positions)


class _SentCall(NamedTuple):
  """One program call of a dispatched step, as `collect` reads it."""
  rows: list                     # (index of the row in the step, the part of the row this call computes)
  by_shard: list                 # per data shard, the indices into `rows` it holds
  results: jax.Array             # `StepOutput.results`
  logits: jax.Array | None
  plan: object | None            # the cache bookkeeping plan this call carried (fused: one device with managers)
  plan_results: jax.Array | None  # ... and its results (the cache's counters), read with the tokens


@dataclasses.dataclass
class _Dispatched:
  """A step sent to the device: its number of rows and its program calls (one)."""
  num_rows: int
  calls: list[_SentCall]


class ModelRunner:
  """Params, the model's paged cache and the step programs of one engine (module doc). One class over 400 lines:
  it is the one place that writes the model's cache (the step, on one device or a mesh, and the KV tiers' block
  writes), and each of those needs the cache's layout and shardings it holds."""

  def __init__(self, params, config: ModelConfig, engine_config: EngineConfig, *, mesh=None,
               rules: sharding.Rules = sharding.Rules(), pools_over_data: bool = False, managers=None):
    """engine_config: the engine's settings, read whole (pools, rows, layout, kernels, modes); the runner
    does not cast params (EngineConfig.dtype is the engine's business).
    mesh / rules: run the step sharded on a device mesh (dsv4.sharding); None = one device.
    pools_over_data (mesh only): every pool's block axis split over `data`, one manager per data shard.
    managers: the engine's cache managers (one per data shard): the step reads each row's block tables from
    their device tables (rows name their manager slot) and, on one device, runs their queued bookkeeping inside
    the step program. None (benchmarks, tests): the runner keeps its own tables, set with `set_tables`."""
    engine_config.validate()
    ec = self.engine_config = engine_config
    if jax.default_backend() == "cpu":   # a step's scratch past glibc's mmap threshold: reuse its pages
      host_memory.keep_scratch_mapped()
    self.params, self.config = params, config
    self.managers = managers
    # "functional": dsv4.model's functions (the default); "nnx": the same math through the Flax NNX modules
    # (dsv4.nnx_model), on one device.
    if ec.model_api == "nnx" and mesh is not None:
      raise ValueError("ModelRunner: EngineConfig.model_api='nnx' runs on one device (the module state carries no "
                       "mesh shardings); drop the mesh or use model_api='functional'")
    if ec.model_api == "nnx":
      from dsv4 import nnx_model  # local: the default path does not import Flax
      # The module the step runs: a Model passed in is held, not copied, and split again at every step, so
      # replacing or changing one of its modules takes effect at the next step (a param dict is merged once).
      self.net = params if isinstance(params, nnx_model.Model) else nnx_model.merge(config, params)
      if self.net.config != config:
        raise ValueError("ModelRunner: the nnx_model.Model was built for another config than the runner's")
    # k > 0: every step runs the speculative program (verification, the MTP block's catch-up and k drafts per row);
    # EngineConfig.validate already refused it with the NNX modules
    self.spec = ec.num_speculative_tokens
    if self.spec and (mesh is not None or config.num_mtp_layers < 1):
      raise ValueError("ModelRunner: EngineConfig.num_speculative_tokens > 0 needs a model with an MTP block "
                       "(ModelConfig.num_mtp_layers >= 1) and runs on one device (no mesh)")
    layout = ec.layout
    sb, fb = layout.swa_block_tokens, layout.full_block_tokens
    self.max_full_width = caches.blocks_for(ec.max_model_len, fb)
    self.max_swa_width = caches.blocks_for(ec.max_model_len, sb)
    self._swa_tail = caches.state_tail_tokens(config)   # swa rows before a step's start that it reads
    self.shapes_run: set = set()      # distinct step shapes used (a new one means a compile; tiering reads it)
    self.mesh = mesh
    # Data shards that own a slice of the pools and rows (1 = one pool: one device, or replicated over `data`).
    self.num_shards = mesh_context.axis_size(mesh, "data") if (mesh is not None and pools_over_data) else 1
    self.step_shape = self._step_shape()
    num_swa_blocks, num_full_blocks = ec.num_swa_blocks, ec.num_full_blocks
    if mesh is None:
      self.cache = caches.init_cache_on_device(config, layout, num_swa_blocks, num_full_blocks)
    else:
      local = self.num_shards > 1
      if local:
        sharding.check_pools_over_data(mesh, num_swa_blocks, num_full_blocks, ec.max_num_seqs)
        rules = sharding.pools_over_data_rules(rules)
      self.shardings = dict(params=sharding.param_shardings(config, mesh, rules),
                            cache=sharding.cache_shardings(config, layout, mesh, rules, num_swa_blocks,
                                                           num_full_blocks),
                            # the step plan: one packed row per data shard (pools over data), else replicated
                            plan=NamedSharding(mesh, PartitionSpec("data") if local else PartitionSpec()))
      self._mesh_steps: dict = {}
      self.params = sharding.put(params, self.shardings["params"])
      # Built straight into its shards (no host copy), so it also works when no process sees the whole mesh.
      self.cache = jax.jit(lambda: caches.init_cache(config, layout, num_swa_blocks, num_full_blocks),
                           out_shardings=self.shardings["cache"])()
    S = ec.max_num_seqs
    if managers is None:     # the runner's own device tables (slot rows), for use without an engine
      self._own_tables = {caches.SWA: jnp.full((S, self.max_swa_width), -1, jnp.int32),
                          caches.FULL: jnp.full((S, self.max_full_width), -1, jnp.int32)}
    # the previous step program's sampled tokens (a token id -(1 + j) in a plan refers to its entry j)
    self.prev_tokens = jax.device_put(np.zeros((S // self.num_shards,), np.int32))
    if self.spec:                    # with drafts: each row's whole result (`RaggedShape.out_width`)
      self.prev_tokens = jax.device_put(np.zeros((S, result_width(self.spec)), np.int32))
    # fused: the cache bookkeeping is sent with the step and runs on the device right before it (one device with
    # managers); on a mesh the managers apply it in their own call before the step and the tables travel with it
    self.fused = managers is not None and mesh is None
    # the one-device step program, jitted with this engine's compiler options (on the CPU: LLVM's level)
    self._one_device_step = jitted_ragged_step(step_compiler_options(ec.cpu_step_opt_level,
                                                                     ec.gpu_step_command_buffers))
    # the row-block loops' buffers, carried from one step to the next on the CPU (`StepOutput.loop_buffers`), and
    # their shapes; made here for the engine's one step program, not inside a step
    self._loop_buffers, self._loop_buffer_shapes, self._loop_buffer_key = (), (), None
    if mesh is None:
      params, kw = self._one_device_program(self.step_shape)
      self._step_loop_buffers(params, self._tables(), self._pack_rows([], self.step_shape), kw)
    self._mesh_copies = None              # block copies on the mesh (the KV tiers' reads and writes)
    if managers is not None:
      for m in managers:
        m.set_step_capacity(ec.max_num_batched_tokens, S // self.num_shards)
    # step_tokens: real tokens run; step_slots: the flat-axis slots they were padded to (per data shard, summed)
    self.stats = {"steps": 0, "calls": 0, "device_puts": 0, "device_gets": 0, "step_tokens": 0, "step_slots": 0,
                  "host_bytes_in": 0, "host_bytes_out": 0}

  # ------------------------------------------------------------------------------------------ tables
  def set_tables(self, slot: int, swa_ids, full_ids) -> None:
    """Write one slot's block tables (runner without managers: benchmarks, tests)."""
    if self.managers is not None:
      raise ValueError("set_tables: this runner reads its tables from the cache managers")
    for g, ids in ((caches.SWA, swa_ids), (caches.FULL, full_ids)):
      t = self._own_tables[g]
      row = np.full(t.shape[1], -1, np.int32)
      row[:len(ids)] = ids
      self._own_tables[g] = t.at[slot].set(jnp.asarray(row))

  def _tables(self, shard: int = 0) -> dict:
    if self.managers is None:
      return dict(self._own_tables)
    return {g: self.managers[shard].device_tables[g] for g in (caches.SWA, caches.FULL)
            if g in self.managers[shard].device_tables}

  # ------------------------------------------------------------------------------------------ shape
  @staticmethod
  def _sampling(a, i, r: Row):
    sp = r.params
    a["temperature"][i], a["top_k"][i], a["top_p"][i] = sp.temperature, sp.top_k, sp.top_p
    a["seed"][i], a["step"][i] = sp.seed & 0xFFFFFFFF, r.step

  def _swa_base(self, r: Row) -> int:
    """First swa block a row's step can touch: the block of start - state_tail_tokens (window rows, Engram ids, the
    compressor state of start - 1)."""
    return max(r.start - self._swa_tail, 0) // self.engine_config.layout.swa_block_tokens

  def _draft_extra(self) -> int:
    """Swa positions a drafting row may touch past its planned tokens: a row that continues an unread step lands up
    to k positions later than planned (async scheduling), and V4's MTP recursion writes up to k - 1 more."""
    return self.spec + speculative_step.draft_lookahead(self.config, self.spec) if self.spec else 0

  def _step_shape(self) -> RaggedShape:
    """The step program's one shape: the whole token budget (rounded up to whole row blocks of the row-invariant
    ops), every row slot, the full table at max_model_len (the tables are read in place, and the attention and
    indexer reductions are over fixed key blocks, so the width never enters a token's math) and the swa table at
    the widest window + chunk a row can touch."""
    ec = self.engine_config
    T = row_invariant.blocking().rows
    N = -(-ec.max_num_batched_tokens // T) * T
    sb = ec.layout.swa_block_tokens
    longest = min(max(ec.chunk_size, 1 + self.spec), ec.max_num_batched_tokens) + self._draft_extra()
    swa = min(self.max_swa_width, pow2_at_least(-(-(longest + self._swa_tail) // sb) + 2, 8))
    return RaggedShape(N, ec.max_num_seqs // self.num_shards, swa, self.max_full_width, self.spec)

  def _pack_rows(self, rows: list[Row], shape: RaggedShape) -> np.ndarray:
    N, R = shape.tokens, shape.rows
    a = {"n_real": np.array([sum(len(r.tokens) for r in rows)], np.int32), "tokens": np.zeros(N, np.int32),
         "row": np.full(N, -1, np.int32), "pos": np.zeros(N, np.int32), "start": np.zeros(R, np.int32),
         "num": np.zeros(R, np.int32), "last": np.zeros(R, np.int32), "slot": np.full(R, -1, np.int32),
         "swa_base": np.zeros(R, np.int32), "temperature": np.zeros(R, np.float32), "top_k": np.zeros(R, np.int32),
         "top_p": np.ones(R, np.float32), "seed": np.zeros(R, np.uint32), "step": np.zeros(R, np.int32),
         "ndraft": np.zeros(R, np.int32), "next_tok": np.full(R, -1, np.int32), "prev_row": np.full(R, -1, np.int32)}
    o = 0
    for i, r in enumerate(rows):
      n = len(r.tokens)
      a["tokens"][o:o + n] = r.tokens
      a["row"][o:o + n] = i
      a["pos"][o:o + n] = np.arange(r.start, r.start + n)
      a["start"][i], a["num"][i], a["last"][i] = r.start, n, o + n - 1
      a["slot"][i], a["swa_base"][i] = r.slot, self._swa_base(r)
      if shape.spec:
        a["ndraft"][i], a["next_tok"][i], a["prev_row"][i] = r.num_drafts, r.next_token, r.prev_row
      self._sampling(a, i, r)
      o += n
    return pack(a, shape)

  # ------------------------------------------------------------------------------------------ run
  def run(self, rows: list[Row]) -> tuple[np.ndarray, np.ndarray | None]:
    """Computes the rows' tokens, samples one token per row at its last computed token, and waits for them.
    Returns (sampled token per row [len(rows)], logits per row [len(rows), V] when record_logits else None). Rows
    whose sample is not wanted (mid-prompt chunks) are simply ignored by the caller."""
    return self.collect(self.dispatch(rows))

  def dispatch(self, rows: list[Row]) -> "_Dispatched":
    """Sends the step (its cache bookkeeping and its rows) to the device without waiting for it. Row j's sampled
    token stays on the device as `prev_tokens[j]` for the next dispatch (a token id -(1 + j) refers to it);
    `collect` reads it."""
    assert 0 < len(rows) <= self.engine_config.max_num_seqs
    sent = [self._call(list(enumerate(rows)))]
    self.stats["steps"] += 1
    return _Dispatched(len(rows), sent)

  def collect(self, d: _Dispatched) -> tuple[np.ndarray, np.ndarray | None]:
    """Waits for a dispatched step: (sampled token per row, or with drafts each row's `result_width` results;
    logits per row or None). Hands each manager the results of its bookkeeping."""
    toks = np.zeros((d.num_rows, result_width(self.spec)) if self.spec else d.num_rows, np.int32)
    logits = None
    for sent in d.calls:
      # one device->host transfer per call: the tokens, the logits, the bookkeeping's counters
      results, call_logits, plan_results = jax.device_get((sent.results, sent.logits, sent.plan_results))
      self.stats["device_gets"] += 1
      self.stats["host_bytes_out"] += sum(np.asarray(x).nbytes
                                          for x in jax.tree_util.tree_leaves((results, call_logits, plan_results)))
      if sent.plan is not None:
        self.managers[0].read_results(sent.plan, plan_results)
      results = np.asarray(results)
      D = len(sent.by_shard)
      # [D * rows] or, gathered over a mesh's data axis, [D, rows]; with drafts each row has a result vector
      per_shard = results.reshape(D, -1, result_width(self.spec)) if self.spec else results.reshape(D, -1)
      if call_logits is not None:   # [rows, V], with drafts [rows, k + 1, V] (one per token a row can decide)
        call_logits = np.asarray(call_logits)
        call_logits = call_logits.reshape(D, -1, *call_logits.shape[-(2 if self.spec else 1):])
      for s, rows_of_shard in enumerate(sent.by_shard):
        for k, j in enumerate(rows_of_shard):
          i = sent.rows[j][0]
          toks[i] = per_shard[s, k]
          if call_logits is not None:
            if logits is None:
              logits = np.zeros((d.num_rows, *call_logits.shape[2:]), call_logits.dtype)
            logits[i] = call_logits[s, k]
    return toks, logits

  def _call(self, call: list[tuple[int, Row]]) -> _SentCall:
    """One dispatch of the step program for `call` (the step's rows): plan packed per data shard, one host->device
    transfer."""
    rows = [r for _, r in call]
    D = self.num_shards
    by_shard = [[] for _ in range(D)]
    for i, r in enumerate(rows):
      by_shard[r.shard].append(i)
    totals = [sum(len(rows[i].tokens) for i in b) for b in by_shard]
    shape = self.step_shape
    self.shapes_run.add(shape)
    self.stats["step_tokens"] += sum(totals)
    self.stats["step_slots"] += shape.tokens * D
    bufs = [self._pack_rows([rows[i] for i in b], shape) for b in by_shard]
    # The live token count: the same on every data shard (a shorter shard's extra tokens are padding, which writes
    # nothing), so the row-invariant ops' loops run the same trips and the tensor / expert collectives inside meet.
    for b in bufs:
      b[0] = max(totals)
    self.stats["calls"] += 1
    self.stats["device_puts"] += 1
    if self.mesh is not None:
      # the managers apply their bookkeeping in their own call; their tables travel with the step (stacked per
      # data shard)
      tables, dev = self.mesh_inputs(bufs)
      with jax.set_mesh(self.mesh):
        out = self._mesh_step(shape)(self.params, self.cache, tables, self.prev_tokens, dev)
      self.cache = out.cache
      # replicated: this process's copy, a plain one-device array (also under jax.distributed)
      return _SentCall(call, by_shard, out.results.addressable_data(0),
                       None if out.logits is None else out.logits.addressable_data(0), None, None)
    params, kw = self._one_device_program(shape)
    if not self.fused:                  # no managers (benchmarks, tests): the runner's own tables
      (dev,) = jax.device_put([bufs[0]])
      self.stats["host_bytes_in"] += bufs[0].nbytes
      tables = self._tables()
      out = self._one_device_step(params, self.cache, tables, self.prev_tokens, dev,
                                  self._step_loop_buffers(params, tables, dev, kw), **kw)
      self.cache, self.prev_tokens, self._own_tables = out.cache, out.prev_tokens, out.tables
      self._loop_buffers = out.loop_buffers
      return _SentCall(call, by_shard, out.results, out.logits, None, None)
    manager = self.managers[0]
    plan = manager.plan()                                        # the cache's bookkeeping, planned on the host
    (dev, kvbuf) = jax.device_put([bufs[0], plan.buf])           # the step plan: one host->device transfer
    self.stats["host_bytes_in"] += bufs[0].nbytes + plan.buf.nbytes

    def one_pass(state):
      """The step over the cache's device state and the model's cache: the bookkeeping program, then the model's,
      back to back on the device (no host read between; the bookkeeping's shape is fixed per engine, so it
      compiles once, not inside every step shape's program)."""
      state, plan_results = device_state.apply(state, plan, kvbuf)
      tables = dict(zip(manager.groups, state.tables))
      out = self._one_device_step(params, self.cache, tables, self.prev_tokens, dev,
                                  self._step_loop_buffers(params, tables, dev, kw), **kw)
      return state._replace(tables=tuple(out.tables[g] for g in manager.groups)), (out, plan_results)

    out, plan_results = manager.device.advance(one_pass)
    self.cache, self.prev_tokens, self._loop_buffers = out.cache, out.prev_tokens, out.loop_buffers
    return _SentCall(call, by_shard, out.results, out.logits, plan, plan_results)

  def _one_device_program(self, shape: RaggedShape) -> tuple:
    """(params, statics) of the one-device step program at `shape`: with the NNX modules, this step's module
    state and graph (edits since the last step count)."""
    ec = self.engine_config
    kw = dict(config=self.config, layout=ec.layout, kernel_cfg=ec.kernel, shape=shape,
              record_logits=ec.record_logits, model_api=ec.model_api)
    params = self.params
    if ec.model_api == "nnx":
      from flax import nnx  # local: the default path does not import Flax
      kw["graphdef"], params = nnx.split(self.net)
    return params, kw

  def _step_loop_buffers(self, params, tables, dev, kw) -> tuple:
    """The one-device step's loop buffers (`StepOutput.loop_buffers`): the last step's, or fresh ones (zeros, put
    on the device once) for a step program whose loops take others (the runner's first, made when it is built;
    an NNX module changed since the last step)."""
    # the same program as the last step's (its statics and the same params object): its buffers, without hashing
    # every argument's shape again on the step's host path
    key = (kw["shape"], kw.get("graphdef"), kw.get("model_api"), id(params))
    if key == self._loop_buffer_key:
      return self._loop_buffers
    shapes = step_loop_buffer_shapes(params, self.cache, tables, self.prev_tokens, dev, **kw)
    if shapes != self._loop_buffer_shapes:
      self._loop_buffers = tuple(jax.device_put([np.zeros(s.shape, s.dtype) for s in shapes]))
      self._loop_buffer_shapes = shapes
    self._loop_buffer_key = key
    return self._loop_buffers

  def lowered_step(self, rows: list[Row] = ()):
    """The one-device step program lowered as its next step would run it on `rows` (its statics, its loop
    buffers): what probes and tests read its compiled HLO and memory from."""
    params, kw = self._one_device_program(self.step_shape)
    tables, dev = self._tables(), np.asarray(self._pack_rows(list(rows), self.step_shape))
    return self._one_device_step.lower(params, self.cache, tables, self.prev_tokens, dev,
                                       self._step_loop_buffers(params, tables, dev, kw), **kw)

  def mesh_inputs(self, bufs):
    """(tables, plan) of a mesh step: the managers' queued bookkeeping applied in their own calls, every shard's
    block tables stacked over `data` and put with the plan's sharding, the per-shard plans likewise."""
    D = self.num_shards
    if self.managers is not None:
      for m in self.managers:
        m.flush()
    per = [self._tables(s) for s in range(D)]
    self.stats["host_bytes_in"] += sum(b.nbytes for b in bufs)
    dev = sharding.put(np.stack(bufs) if D > 1 else bufs[0], self.shardings["plan"])
    return {g: self._tables_on_mesh([t[g] for t in per]) for g in per[0]}, dev

  def _tables_on_mesh(self, per_shard):
    """One group's block tables as the step's input on the mesh, device to device (no host round trip): each
    device of data shard k gets a copy of shard k's table ([S, W] replicated when D == 1, else stacked [D, S, W]
    over `data`). Under jax.distributed each process places only its addressable devices' copies."""
    D = self.num_shards
    sh = self.shardings["plan"]
    shape = per_shard[0].shape if D == 1 else (D,) + per_shard[0].shape
    arrays = []
    for d, idx in sh.addressable_devices_indices_map(shape).items():
      k = 0 if D == 1 else idx[0].start or 0
      arrays.append(jax.device_put(per_shard[k] if D == 1 else per_shard[k][None], d))
    return jax.make_array_from_single_device_arrays(shape, sh, arrays)

  def _mesh_step(self, shape: RaggedShape):
    """The step program jitted for the mesh, per shape: a `StepOutput` without tables or prev_tokens (a mesh step
    reads its tables as inputs and never runs async). Pools over data: `step_body` runs manual over `data`
    (tensor / expert stay automatic), each data shard on its own packed plan, its own rows, its own tables and its
    own slice of the pools (SHARD-LOCAL block ids); the sampled tokens (and logits) are gathered over `data` so
    every process reads them all. Otherwise one replicated pool and one plan."""
    fn = self._mesh_steps.get(shape)
    if fn is not None:
      return fn
    ec = self.engine_config
    body = functools.partial(step_body, config=self.config, layout=ec.layout, kernel_cfg=ec.kernel, shape=shape,
                             record_logits=ec.record_logits, model_api=ec.model_api)
    if self.num_shards > 1:
      def local(params, cache, tables, prev, buf_1xS):
        out = body(params, cache, {g: t[0] for g, t in tables.items()}, prev, buf_1xS[0])
        gather = functools.partial(jax.lax.all_gather, axis_name="data")
        return out.cache, gather(out.results), (None if out.logits is None else gather(out.logits))
      over_data, replicated = PartitionSpec("data"), PartitionSpec()
      inner = jax.shard_map(local, mesh=self.mesh,
                            in_specs=(replicated, over_data, over_data, replicated, over_data),
                            out_specs=(over_data, replicated, replicated), axis_names={"data"}, check_vma=False)
    else:
      def inner(params, cache, tables, prev, buf):
        out = body(params, cache, tables, prev, buf)
        return out.cache, out.results, out.logits

    def ragged_step(params, cache, tables, prev, buf):   # the name compile logs show
      cache, results, logits = inner(params, cache, tables, prev, buf)
      return StepOutput(cache, None, results, None, logits)
    rep = NamedSharding(self.mesh, PartitionSpec())
    sh = self.shardings
    opts = step_compiler_options(ec.cpu_step_opt_level, ec.gpu_step_command_buffers)
    fn = jax.jit(ragged_step, in_shardings=(sh["params"], sh["cache"], sh["plan"], rep, sh["plan"]),
                 out_shardings=StepOutput(sh["cache"], None, rep, None, rep if ec.record_logits else None),
                 donate_argnums=(1,), compiler_options=dict(opts) or None)
    self._mesh_steps[shape] = fn
    return fn

  # ------------------------------------------------------------------------------------------ KV blocks
  # The narrow interface the KV tiers use (dsv4.engine.tiering): whole pool blocks copied between the runner's cache
  # and host arrays, as raw stored bits, on one device or on the mesh (block_copies). A component is
  # (layer, array name, part), see block_copies.component.
  def kv_pool(self, layer: int, name: str, part: int = -1):
    """One layer's pool array as stored (part -1: an `Fp8KVPool` whole for an FP8 pool; else that array of it,
    `block_copies.component`): shapes and dtypes of the records."""
    return block_copies.component(self.cache, layer, name, part)

  def read_kv_blocks(self, names: tuple, shard_N, ids_N) -> list[np.ndarray]:
    """Host copies (bits) of the named components' rows at blocks (shard_N, shard-local ids_N); ids out of range
    read a clamped row."""
    if self.mesh is None:
      return [np.asarray(x) for x in block_copies.read_blocks(self.cache, names, jnp.asarray(ids_N))]
    return self._block_copies().read(self.cache, names, shard_N, ids_N)

  def write_kv_blocks(self, names: tuple, shard_N, ids_N, rows) -> None:
    """Writes rows (bits or stored dtypes) into the named components at (shard_N, ids_N); out-of-range ids (and,
    on a mesh, rows of no shard) are dropped."""
    if self.mesh is None:
      self.cache = block_copies.write_blocks(self.cache, names, jnp.asarray(ids_N), rows)
    else:
      self.cache = self._block_copies().write(self.cache, names, shard_N, ids_N, rows)

  def reset_kv_cache(self) -> None:
    """Fresh pools (zeros), made in place with this runner's pool layout (on a mesh: sharded, no host copy)."""
    ec = self.engine_config

    def fresh():
      return caches.init_cache(self.config, ec.layout, ec.num_swa_blocks, ec.num_full_blocks)

    self.cache = jax.jit(fresh, out_shardings=self.shardings["cache"])() if self.mesh is not None else fresh()

  def wait_kv(self) -> None:
    """Blocks until every queued write into the cache is done."""
    jax.block_until_ready(self.cache)

  def num_step_programs(self) -> int:
    """Distinct step shapes run so far (a new one was a compile)."""
    return len(self.shapes_run)

  def _block_copies(self):
    if self._mesh_copies is None:        # made at first use: an engine without tiers never copies blocks
      self._mesh_copies = block_copies.MeshBlockCopies(self, self.num_shards)
    return self._mesh_copies

  def step_function_name(self) -> str:
    """The step program this runner dispatches (each distinct shape in `shapes_run` is one program of it)."""
    return "ragged_step"
