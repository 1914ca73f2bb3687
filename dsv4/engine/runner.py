"""Model runner: owns the params and the paged cache pytree; turns one scheduler step into jitted device work with
one host->device transfer of the step plan and one device->host fetch of the sampled tokens.

Host side (numpy, O(new tokens) per step): each running request owns a *slot* with persistent block-table rows.
`sync_tables` copies only what changed since the last step (new blocks at the end, swa blocks released behind the
window at the front), so a step never rebuilds a request's whole table or token list.

Device side: all rows of a step ride ONE flat token axis through `model.forward_ragged` (`ragged_step`): a decode
row contributes 1 token, a prefill row its chunk; per-token row / position metadata and per-row block tables
(`caches.StepIndex`) travel in one packed int32 buffer with the sampling parameters. So a mixed step (one prefill
chunk + many decodes) costs its real tokens, not every row padded to chunk_size. Sampling runs inside the same
program on device logits. Shapes are bucketed so compilation stays bounded: tokens to 8 * g^k (g =
`token_bucket_growth`, 2 or 4; `token_bucket_steps` > 1 adds equal steps inside each interval), rows to max_num_seqs (4x buckets from 64 beyond 64), block tables to a power-of-two
width that covers the live context of the step (capped at max_model_len). The plan goes to the device in one
`device_put` call; the sampled
tokens (and logits when recorded) come back in one `device_get` call. The earlier layouts (a decode group [rows, 1]
+ a prefill group [rows, chunk_size]; every row padded to chunk_size) remain as `step_mode="groups"` / `"padded"`
for benchmarks' before / after in one run.

Batch-invariant mode (`batch_invariant=True`): every token of the step goes through one fixed-shape program
([1 row, 1 token], block tables at the max_model_len width) in order, inside one jitted loop; logits and sampling
run per row at a fixed shape too. No reduction in a request's math then depends on what else shares the step or
on how its prompt was chunked, so its logits are bitwise reproducible (at the cost of per-token work; measured in
benchmarks/engine_bench.py).

With a `mesh` (dsv4.sharding), the step runs sharded through `sharding.jit_forward` on the padded [max_num_seqs, T]
layout with max_model_len-wide tables (params and pools carry the rule shardings, batch rows split over `data`,
experts expert-parallel, logits replicated so every process samples the same tokens); sampling then runs in the
jitted sampler on those logits. `pools_over_data=True` (the engine's default on a mesh): every pool's block axis
is split over `data` and the step runs manual over `data` (sharding.jit_forward), so data shard s holds num_blocks/D
blocks and rows [s*R/D, (s+1)*R/D): its requests take slots in that range (`acquire_slot(shard)`), a row sits at
its slot's position of the [max_num_seqs, T] layout, and its tables hold SHARD-LOCAL block ids (the engine keeps
one cache manager per shard). `pools_over_data=False`: one pool replicated over `data`, rows packed from 0.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import caches, model, sharding
from dsv4.config import ModelConfig
from dsv4.engine.sampling import SamplingParams, sample_rows, sample_rows_impl
from pallas_kernels import dispatch

_HI = jax.lax.Precision.HIGHEST


def pow2_at_least(n: int, lo: int = 1) -> int:
  n = max(n, lo, 1)
  return 1 << (n - 1).bit_length()


def pow4_at_least(n: int, lo: int = 1) -> int:
  """Row buckets grow 4x (1, 4, 16, 64, 256): few programs, at most 4x padding of the (cheap) row axis."""
  b = max(lo, 1)
  while b < n:
    b *= 4
  return b


def token_buckets(growth: int, max_tokens: int, steps: int = 1) -> list[int]:
  """Flat-axis sizes a ragged step can be padded to, ascending: 8 * growth^k below the step budget's power of two,
  then that power of two; with `steps` > 1 each interval [a, growth * a] is split into `steps` equal parts (rounded
  up to a multiple of 8), so a step's padding is at most 1 + (growth - 1) / steps of its tokens above the first
  interval (growth 2, steps 4: 256, 320, 384, 448, 512, ...) at the price of more step programs."""
  out, cap, n = [], pow2_at_least(max_tokens), 8
  while n < cap:
    out.append(n)
    n *= growth
  coarse = out + [cap]
  if steps <= 1:
    return coarse
  fine = set(coarse)
  for a, b in zip(coarse[:-1], coarse[1:]):
    fine.update(-(-(a + i * (b - a) // steps) // 8) * 8 for i in range(1, steps))
  return sorted(fine)


def token_bucket(total: int, growth: int, max_tokens: int, steps: int = 1) -> int:
  """Flat-axis size for a step of `total` tokens: the smallest of `token_buckets` that holds it."""
  return next((b for b in token_buckets(growth, max_tokens, steps) if b >= total), pow2_at_least(total))


class _PackedShape:
  """A step program's static shape: `fields()` names the int32 arrays packed, in order, into its one buffer."""

  def fields(self):
    raise NotImplementedError

  @property
  def size(self) -> int:
    return sum(int(np.prod(s)) for _, s in self.fields())


def _row_fields(R: int, swa_width: int, full_width: int):
  """Per-row block tables and sampling parameters: the tail every step program packs."""
  return (("swa", (R, swa_width)), ("full", (R, full_width)), ("temperature", (R,)), ("top_k", (R,)),
          ("top_p", (R,)), ("seed", (R,)), ("step", (R,)))


@dataclasses.dataclass(frozen=True)
class GroupShape(_PackedShape):
  """Static shape of one group program (part of the jit key)."""
  rows: int
  tokens: int
  swa_width: int
  full_width: int

  def fields(self):
    R, T = self.rows, self.tokens
    return (("tokens", (R, T)), ("start", (R,)), ("num", (R,))) + _row_fields(R, self.swa_width, self.full_width)


@dataclasses.dataclass(frozen=True)
class InvariantShape(_PackedShape):
  """Static shape of the batch-invariant program: a flat token axis and fixed-width per-row tables."""
  tokens: int
  rows: int
  swa_width: int
  full_width: int

  def fields(self):
    N, R = self.tokens, self.rows
    return ((("n_real", (1,)), ("tokens", (N,)), ("row", (N,)), ("pos", (N,)), ("last", (R,)))
            + _row_fields(R, self.swa_width, self.full_width))


@dataclasses.dataclass(frozen=True)
class RaggedShape(_PackedShape):
  """Static shape of the ragged step program (part of the jit key): N flat tokens (every row's tokens packed,
  decode rows 1 each, prefill rows their chunk), R rows, block tables [R, width]."""
  tokens: int
  rows: int
  swa_width: int
  full_width: int

  def fields(self):
    N, R = self.tokens, self.rows
    return ((("tokens", (N,)), ("row", (N,)), ("pos", (N,)), ("start", (R,)), ("num", (R,)), ("last", (R,)),
             ("swa_base", (R,))) + _row_fields(R, self.swa_width, self.full_width))


def _unpack(buf, shape):
  """Slices the packed int32 buffer back into named arrays (float fields travel as their bit patterns)."""
  out, o = {}, 0
  for name, s in shape.fields():
    n = int(np.prod(s))
    x = buf[o:o + n].reshape(s)
    if name in ("temperature", "top_p"):
      x = jax.lax.bitcast_convert_type(x, jnp.float32)
    elif name == "seed":
      x = jax.lax.bitcast_convert_type(x, jnp.uint32)
    out[name] = x
    o += n
  return out


def _pack(arrays: dict, shape) -> np.ndarray:
  buf = np.empty(shape.size, np.int32)
  o = 0
  for name, s in shape.fields():
    n = int(np.prod(s))
    a = np.asarray(arrays[name])
    if a.dtype != np.int32:
      a = a.astype(np.float32).view(np.int32) if name in ("temperature", "top_p") else a.astype(np.int32)
    buf[o:o + n] = a.reshape(-1)
    o += n
  return buf


def _sample(p, logits_RxV):
  return sample_rows_impl(logits_RxV, p["temperature"], p["top_k"], p["top_p"], p["seed"], p["step"])


@functools.partial(jax.jit,
                   static_argnames=("config", "layout", "kernel_cfg", "shape", "record_logits", "model_api",
                                    "graphdef"),
                   donate_argnames=("cache",))
def ragged_step(params, cache, buf, *, config, layout, kernel_cfg, shape: RaggedShape, record_logits: bool,
                model_api: str = "functional", graphdef=None):
  """All rows of a step on one flat token axis (`model.forward_ragged`): a decode row costs one token, a prefill
  row its chunk, padding only up to the token bucket. Logits at each row's last token, then sampling. Returns
  (cache, tokens_R, logits_RxV or None). model_api="nnx": params is the `nnx.State` and graphdef (static) the
  `nnx.GraphDef` of an `nnx_model.Model` (`nnx.split`); the step runs that module (`Model.ragged`, its blocks
  calling their own sub-modules), so a changed module is a changed graphdef and compiles its own program."""
  p = _unpack(buf, shape)
  step = caches.StepIndex(p["row"], p["pos"], p["start"], p["num"], {caches.SWA: p["swa"], caches.FULL: p["full"]},
                          swa_base_R=p["swa_base"])
  if model_api == "nnx":
    from flax import nnx  # local: the default path does not import Flax
    net = nnx.merge(graphdef, params)
    cache, h_NxD = net.ragged(p["tokens"], cache, step, layout=layout, kernel_cfg=kernel_cfg)
    logits = net.logits(h_NxD[jnp.maximum(p["last"], 0)])
  else:
    cache, h_NxD = model.forward_ragged(params, config, p["tokens"], cache, step, layout=layout,
                                        kernel_cfg=kernel_cfg)
    logits = model.lm_logits(params, h_NxD[jnp.maximum(p["last"], 0)])
  return cache, _sample(p, logits), (logits if record_logits else None)


@functools.partial(jax.jit, static_argnames=("config", "layout", "kernel_cfg", "shape", "record_logits"),
                   donate_argnames=("cache",))
def group_step(params, cache, buf, *, config, layout, kernel_cfg, shape: GroupShape, record_logits: bool):
  """One group of rows: forward, logits at each row's last computed token, sampling. Returns (cache, tokens_R,
  logits_RxV or None)."""
  p = _unpack(buf, shape)
  index = caches.BatchIndex(p["start"], p["num"], p["swa"], p["full"])
  cache, h_RxTxD, _ = model.forward_aux(params, config, p["tokens"], cache, index, layout=layout,
                                        kernel_cfg=kernel_cfg, return_hidden=True)
  last = jnp.maximum(p["num"] - 1, 0)
  h_last = jnp.take_along_axis(h_RxTxD, last[:, None, None], axis=1)[:, 0]
  logits = jnp.dot(h_last, params["lm_head"], precision=_HI, preferred_element_type=jnp.float32)
  return cache, _sample(p, logits), (logits if record_logits else None)


@functools.partial(jax.jit, static_argnames=("config", "layout", "kernel_cfg", "shape", "record_logits"),
                   donate_argnames=("cache",))
def invariant_step(params, cache, buf, *, config, layout, kernel_cfg, shape: InvariantShape, record_logits: bool):
  """Batch-invariant step: each real token runs the same [1, 1] program in order (a loop with a dynamic trip
  count, so padding costs nothing); then each row's logits and sample at a fixed [1, D] / [1, V] shape."""
  p = _unpack(buf, shape)
  D = params["lm_head"].shape[0]

  def body(i, carry):
    cache, h_NxD = carry
    row = jnp.maximum(p["row"][i], 0)
    index = caches.BatchIndex(p["pos"][i][None], jnp.ones((1,), jnp.int32), p["swa"][row][None],
                              p["full"][row][None])
    cache, h, _ = model.forward_aux(params, config, p["tokens"][i][None, None], cache, index, layout=layout,
                                    kernel_cfg=kernel_cfg, return_hidden=True)
    return cache, h_NxD.at[i].set(h[0, 0].astype(h_NxD.dtype))

  h0 = jnp.zeros((shape.tokens, D), params["lm_head"].dtype)
  cache, h_NxD = jax.lax.fori_loop(0, p["n_real"][0], body, (cache, h0))

  def per_row(r):
    h = h_NxD[jnp.maximum(p["last"][r], 0)][None]
    logits = jnp.dot(h, params["lm_head"], precision=_HI, preferred_element_type=jnp.float32)
    q = {k: p[k][r][None] for k in ("temperature", "top_k", "top_p", "seed", "step")}
    return _sample(q, logits)[0], logits[0]

  toks, logits = jax.lax.map(per_row, jnp.arange(shape.rows))
  return cache, toks, (logits if record_logits else None)


def _last_token_step(params, config, layout, kernel_cfg, tokens_BxT, cache, index):
  """Padded-layout step for the sharded path: logits at each row's last computed token."""
  cache, h_BxTxD, _ = model.forward_aux(params, config, tokens_BxT, cache, index, layout=layout,
                                        kernel_cfg=kernel_cfg, return_hidden=True)
  last = jnp.maximum(index.num_tokens_B - 1, 0)
  h_last = jnp.take_along_axis(h_BxTxD, last[:, None, None], axis=1)[:, 0]
  logits = jnp.dot(h_last, params["lm_head"], precision=_HI, preferred_element_type=jnp.float32)
  return cache, logits


@dataclasses.dataclass
class Row:
  """One request's work in a step, as the engine hands it to the runner."""
  slot: int
  tokens: list[int]              # the token ids to compute (len = n)
  start: int                     # position of tokens[0]
  params: SamplingParams
  step: int                      # index of the token to sample in the request's output (the sampler's key)


class ModelRunner:

  def __init__(self, params, config: ModelConfig, layout: caches.CacheLayout, *, num_swa_blocks: int,
               num_full_blocks: int, max_num_seqs: int, chunk_size: int, max_model_len: int,
               kernel_cfg: dispatch.KernelConfig = dispatch.KernelConfig(), batch_invariant: bool = False,
               record_logits: bool = False, min_table_tokens: int = 4096, max_num_batched_tokens: int = 512,
               mesh=None, rules: sharding.Rules = sharding.Rules(), step_mode: str = "ragged",
               token_bucket_growth: int = 4, token_bucket_steps: int = 1, model_api: str = "functional",
               pools_over_data: bool = False):
    self.params, self.config, self.layout, self.kernel_cfg = params, config, layout, kernel_cfg
    # "functional": dsv4.model's functions (the default); "nnx": the same math through the Flax NNX modules
    # (dsv4.nnx_model), wired for the one-device ragged step only.
    if model_api not in ("functional", "nnx"):
      raise ValueError(f"ModelRunner: model_api must be 'functional' or 'nnx', got {model_api!r}")
    if model_api == "nnx" and (mesh is not None or batch_invariant or step_mode != "ragged"):
      raise ValueError("ModelRunner: model_api='nnx' runs the one-device ragged step only (no mesh, no "
                       "batch_invariant, step_mode='ragged')")
    self.model_api = model_api
    if model_api == "nnx":
      from dsv4 import nnx_model  # local: the default path does not import Flax
      # The module the step runs: a Model passed in is held, not copied, and split again at every step, so
      # replacing or changing one of its modules takes effect at the next step (a param dict is merged once).
      self.net = params if isinstance(params, nnx_model.Model) else nnx_model.merge(config, params)
      if self.net.config != config:
        raise ValueError("ModelRunner: the nnx_model.Model was built for another config than the runner's")
    self.max_num_seqs, self.chunk_size = max_num_seqs, chunk_size
    self.batch_invariant, self.record_logits = batch_invariant, record_logits
    # "ragged": one flat token axis (the serving path). Earlier layouts, kept for benchmarks' before/after in one
    # run: "groups" = a decode group [rows, 1] + a prefill group [rows, chunk_size]; "padded" = every row padded to
    # chunk_size in one program.
    if step_mode not in ("ragged", "groups", "padded"):
      raise ValueError(f"ModelRunner: step_mode must be 'ragged', 'groups' or 'padded', got {step_mode!r}")
    self.step_mode = step_mode
    if token_bucket_growth not in (2, 4):
      raise ValueError(f"ModelRunner: token_bucket_growth must be 2 or 4, got {token_bucket_growth}")
    # Flat-axis token buckets grow by this factor: 2 = at most 2x padding, more programs; 4 = half the programs
    # (each costs a compile of the whole model), up to 4x padding.
    self.token_bucket_growth = token_bucket_growth
    if not 1 <= token_bucket_steps <= 8:
      raise ValueError(f"ModelRunner: token_bucket_steps must be in 1..8, got {token_bucket_steps}")
    # Each growth interval split into this many buckets: a mixed step (a chunk + many decodes) pays for about its
    # real tokens instead of the next power of growth (more programs to compile).
    self.token_bucket_steps = token_bucket_steps
    self.max_num_batched_tokens = max_num_batched_tokens
    sb, fb = layout.swa_block_tokens, layout.full_block_tokens
    self.max_full_width = caches.blocks_for(max_model_len, fb)
    self.max_swa_width = caches.blocks_for(max_model_len, sb)
    # Smallest table bucket: enough entries for every top-k (so a short context selects exactly as a long one) and
    # at least min_table_tokens, so small engines compile a single width.
    need = max([config.indexer.topk * p.ratio for p in config.layer_plan() if p.has_index_query] + [1])
    self.min_full_width = min(self.max_full_width, caches.blocks_for(max(need, min_table_tokens), fb))
    self._swa_tail = caches.state_tail_tokens(config)   # swa rows before a step's start that it reads
    self.shapes_run: set = set()      # distinct step shapes used (a new one means a compile; tiering reads it)
    self.mesh = mesh
    # Data shards that own a slice of the pools and rows (1 = one pool: one device, or replicated over `data`).
    self.num_shards = sharding.axis_size(mesh, "data") if (mesh is not None and pools_over_data) else 1
    if self.num_shards > 1:
      sharding.check_pools_over_data(mesh, num_swa_blocks, num_full_blocks, max_num_seqs)
    if mesh is None:
      self.cache = caches.init_cache(config, layout, num_swa_blocks, num_full_blocks)
    else:
      self._sharded_step, self.shardings = sharding.jit_forward(
          config, mesh, rules, layout=layout, batch=max_num_seqs, num_swa_blocks=num_swa_blocks,
          num_full_blocks=num_full_blocks, kernel_cfg=kernel_cfg, step_fn=_last_token_step,
          pools_over_data=self.num_shards > 1)
      self.params = sharding.put(params, self.shardings["params"])
      # Built straight into its shards (no host copy), so it also works when no process sees the whole mesh.
      self.cache = jax.jit(lambda: caches.init_cache(config, layout, num_swa_blocks, num_full_blocks),
                           out_shardings=self.shardings["cache"])()
    # Persistent per-slot block-table rows (host), synced incrementally.
    S = max_num_seqs
    self.swa_host = np.full((S, self.max_swa_width), -1, np.int32)
    self.full_host = np.full((S, self.max_full_width), -1, np.int32)
    self.swa_synced = np.zeros(S, np.int64)    # entries copied so far
    self.swa_lo = np.zeros(S, np.int64)        # entries before this index are known released (-1)
    self.full_synced = np.zeros(S, np.int64)
    # Per data shard, its slots [s*S/D, (s+1)*S/D), lowest first.
    per = S // self.num_shards
    self.free_slots_by_shard = [list(range((s + 1) * per - 1, s * per - 1, -1)) for s in range(self.num_shards)]
    # step_tokens: real tokens run; step_slots: the flat-axis slots they were padded to (ragged step only)
    self.stats = {"steps": 0, "device_puts": 0, "device_gets": 0, "table_entries_copied": 0, "step_tokens": 0,
                  "step_slots": 0}

  def token_buckets(self) -> list[int] | None:
    """The flat-axis sizes a ragged step can be padded to (module `token_buckets`); None where a step's shape does
    not follow its token count (a mesh, batch-invariant mode, the group layouts)."""
    if self.mesh is not None or self.batch_invariant or self.step_mode != "ragged":
      return None
    return token_buckets(self.token_bucket_growth, self.max_num_batched_tokens, self.token_bucket_steps)

  # ------------------------------------------------------------------------------------------ slots / tables
  @property
  def free_slots(self) -> list[int]:
    return [x for f in self.free_slots_by_shard for x in f]

  def shard_of_slot(self, slot: int) -> int:
    return slot // (self.max_num_seqs // self.num_shards)

  def num_free_slots(self, shard: int = 0) -> int:
    return len(self.free_slots_by_shard[shard])

  def acquire_slot(self, shard: int = 0) -> int:
    return self.free_slots_by_shard[shard].pop()

  def release_slot(self, slot: int) -> None:
    self.swa_host[slot, : self.swa_synced[slot]] = -1
    self.full_host[slot, : self.full_synced[slot]] = -1
    self.swa_synced[slot] = self.swa_lo[slot] = self.full_synced[slot] = 0
    self.free_slots_by_shard[self.shard_of_slot(slot)].append(slot)

  def sync_tables(self, slot: int, swa_ids: np.ndarray, full_ids: np.ndarray) -> None:
    """Copy what changed in a request's tables since the last sync: full blocks only grow at the end; swa blocks
    grow at the end and are released (-1) from the front, behind the window. Cost O(window + new blocks)."""
    n, k = len(full_ids), int(self.full_synced[slot])
    if n > k:
      self.full_host[slot, k:n] = full_ids[k:n]
      self.stats["table_entries_copied"] += n - k
    self.full_synced[slot] = max(n, k)
    n, lo = len(swa_ids), int(self.swa_lo[slot])
    if n > lo:
      seg = swa_ids[lo:n]
      self.swa_host[slot, lo:n] = seg
      self.stats["table_entries_copied"] += n - lo
      live = np.flatnonzero(seg >= 0)
      self.swa_lo[slot] = lo + (int(live[0]) if live.size else len(seg))
    self.swa_synced[slot] = max(n, int(self.swa_synced[slot]))

  # ------------------------------------------------------------------------------------------ buckets
  def _widths(self, end_tokens: int) -> tuple[int, int]:
    fb, sb = self.layout.full_block_tokens, self.layout.swa_block_tokens
    wf = min(self.max_full_width, pow2_at_least(caches.blocks_for(end_tokens, fb), self.min_full_width))
    ws = min(self.max_swa_width, caches.blocks_for(wf * fb, sb))
    return ws, wf

  def _group(self, rows: list[Row], T: int, ws: int, wf: int):
    # Decode rows are cheap: at least 8 per program. Prefill rows cost chunk_size tokens each: from 1.
    R = min(self.max_num_seqs, pow4_at_least(len(rows), 8 if T == 1 else 1))
    shape = GroupShape(R, T, ws, wf)
    a = {"tokens": np.zeros((R, T), np.int32), "start": np.zeros(R, np.int32), "num": np.zeros(R, np.int32),
         "temperature": np.zeros(R, np.float32), "top_k": np.zeros(R, np.int32), "top_p": np.ones(R, np.float32),
         "seed": np.zeros(R, np.uint32), "step": np.zeros(R, np.int32)}
    slots = np.array([r.slot for r in rows], np.int64)
    a["swa"] = np.full((R, ws), -1, np.int32)
    a["full"] = np.full((R, wf), -1, np.int32)
    a["swa"][: len(rows)] = self.swa_host[slots, :ws]
    a["full"][: len(rows)] = self.full_host[slots, :wf]
    for i, r in enumerate(rows):
      a["tokens"][i, : len(r.tokens)] = r.tokens
      a["start"][i], a["num"][i] = r.start, len(r.tokens)
      self._sampling(a, i, r)
    return shape, _pack(a, shape)

  @staticmethod
  def _sampling(a, i, r: Row):
    sp = r.params
    a["temperature"][i], a["top_k"][i], a["top_p"][i] = sp.temperature, sp.top_k, sp.top_p
    a["seed"][i], a["step"][i] = sp.seed & 0xFFFFFFFF, r.step

  def _swa_window(self, rows: list[Row]):
    """The swa blocks a ragged step can touch, per row: from the block of start - state_tail_tokens (window rows,
    Engram ids, the compressor state of start - 1) to the block of its last token. Returns (base_B, width): the
    width is a power of two >= 8 covering every row, so the swa table follows the window + chunk, not the context."""
    sb = self.layout.swa_block_tokens
    start = np.array([r.start for r in rows], np.int64)
    end = start + np.array([len(r.tokens) for r in rows], np.int64)
    base = np.maximum(start - self._swa_tail, 0) // sb
    need = int(np.max(-(-end // sb) - base))
    return base, min(self.max_swa_width, pow2_at_least(need, 8))

  def _ragged(self, rows: list[Row], wf: int):
    # Rows: all max_num_seqs slots up to 64 (tables are [R, width] int32, cheap; one row bucket = fewer compiles),
    # beyond that 4x buckets from 64. Tokens: 8 * growth^k, capped at the step budget's power of two.
    R = self.max_num_seqs if self.max_num_seqs <= 64 else min(self.max_num_seqs, pow4_at_least(len(rows), 64))
    total = sum(len(r.tokens) for r in rows)
    N = token_bucket(total, self.token_bucket_growth, self.max_num_batched_tokens, self.token_bucket_steps)
    base, ws = self._swa_window(rows)
    shape = RaggedShape(N, R, ws, wf)
    a = {"tokens": np.zeros(N, np.int32), "row": np.full(N, -1, np.int32), "pos": np.zeros(N, np.int32),
         "start": np.zeros(R, np.int32), "num": np.zeros(R, np.int32), "last": np.zeros(R, np.int32),
         "swa_base": np.zeros(R, np.int32),
         "temperature": np.zeros(R, np.float32), "top_k": np.zeros(R, np.int32), "top_p": np.ones(R, np.float32),
         "seed": np.zeros(R, np.uint32), "step": np.zeros(R, np.int32)}
    slots = np.array([r.slot for r in rows], np.int64)
    a["swa"] = np.full((R, ws), -1, np.int32)
    a["full"] = np.full((R, wf), -1, np.int32)
    cols = base[:, None] + np.arange(ws)[None, :]
    inside = cols < self.max_swa_width
    a["swa"][: len(rows)] = np.where(inside, self.swa_host[slots[:, None], np.minimum(cols, self.max_swa_width - 1)],
                                     -1)
    a["swa_base"][: len(rows)] = base
    a["full"][: len(rows)] = self.full_host[slots, :wf]
    o = 0
    for i, r in enumerate(rows):
      n = len(r.tokens)
      a["tokens"][o:o + n] = r.tokens
      a["row"][o:o + n] = i
      a["pos"][o:o + n] = np.arange(r.start, r.start + n)
      a["start"][i], a["num"][i], a["last"][i] = r.start, n, o + n - 1
      self._sampling(a, i, r)
      o += n
    return shape, _pack(a, shape)

  def _invariant(self, rows: list[Row]):
    R = self.max_num_seqs
    total = sum(len(r.tokens) for r in rows)
    N = pow2_at_least(total, 8)
    shape = InvariantShape(N, R, self.max_swa_width, self.max_full_width)
    a = {"n_real": np.array([total], np.int32), "tokens": np.zeros(N, np.int32), "row": np.full(N, -1, np.int32),
         "pos": np.zeros(N, np.int32), "last": np.full(R, -1, np.int32),
         "temperature": np.zeros(R, np.float32), "top_k": np.zeros(R, np.int32), "top_p": np.ones(R, np.float32),
         "seed": np.zeros(R, np.uint32), "step": np.zeros(R, np.int32)}
    slots = np.array([r.slot for r in rows], np.int64)
    a["swa"] = np.full((R, shape.swa_width), -1, np.int32)
    a["full"] = np.full((R, shape.full_width), -1, np.int32)
    a["swa"][: len(rows)] = self.swa_host[slots]
    a["full"][: len(rows)] = self.full_host[slots]
    o = 0
    for i, r in enumerate(rows):
      n = len(r.tokens)
      a["tokens"][o:o + n] = r.tokens
      a["row"][o:o + n] = i
      a["pos"][o:o + n] = np.arange(r.start, r.start + n)
      a["last"][i] = o + n - 1
      self._sampling(a, i, r)
      o += n
    return shape, _pack(a, shape)

  # ------------------------------------------------------------------------------------------ run
  def run(self, rows: list[Row]) -> tuple[np.ndarray, np.ndarray | None]:
    """Computes the rows' tokens, samples one token per row at its last computed token. Returns (sampled token
    per row [len(rows)], logits per row [len(rows), V] when record_logits else None). Rows whose sample is not
    wanted (mid-prompt chunks) are simply ignored by the caller."""
    assert 0 < len(rows) <= self.max_num_seqs
    if self.mesh is not None:
      return self._run_sharded(rows)
    kw = dict(config=self.config, layout=self.layout, kernel_cfg=self.kernel_cfg, record_logits=self.record_logits)
    if self.batch_invariant:
      shape, buf = self._invariant(rows)
      self.shapes_run.add(shape)
      (dev,) = jax.device_put([buf])
      self.stats["device_puts"] += 1
      self.cache, toks, logits = invariant_step(self.params, self.cache, dev, shape=shape, **kw)
      toks, logits = jax.device_get((toks, logits))
      self.stats["device_gets"] += 1
      self.stats["steps"] += 1
      n = len(rows)
      return np.asarray(toks)[:n], (None if logits is None else np.asarray(logits)[:n])

    end = max(r.start + len(r.tokens) for r in rows)
    ws, wf = self._widths(end)
    if self.step_mode == "ragged":
      shape, buf = self._ragged(rows, wf)
      self.shapes_run.add(shape)
      self.stats["step_tokens"] += sum(len(r.tokens) for r in rows)
      self.stats["step_slots"] += shape.tokens
      (dev,) = jax.device_put([buf])                          # the step plan: one host->device transfer
      self.stats["device_puts"] += 1
      params, nnx_kw = self.params, {}
      if self.model_api == "nnx":
        from flax import nnx
        graphdef, params = nnx.split(self.net)              # this step's module: edits since the last step count
        nnx_kw = {"graphdef": graphdef}
      self.cache, toks, logits = ragged_step(params, self.cache, dev, shape=shape, model_api=self.model_api,
                                             **nnx_kw, **kw)
      toks, logits = jax.device_get((toks, logits))           # the sampled tokens: one device->host transfer
      self.stats["device_gets"] += 1
      self.stats["steps"] += 1
      n = len(rows)
      return np.asarray(toks)[:n], (None if logits is None else np.asarray(logits)[:n])
    order = [i for i, r in enumerate(rows) if len(r.tokens) == 1] + [i for i, r in enumerate(rows)
                                                                      if len(r.tokens) > 1]
    groups = []
    if self.step_mode == "padded" and any(len(r.tokens) > 1 for r in rows):
      order = list(range(len(rows)))
      dec, pre = [], list(rows)
    else:
      dec = [rows[i] for i in order if len(rows[i].tokens) == 1]
      pre = [rows[i] for i in order if len(rows[i].tokens) > 1]
    if dec:
      groups.append((len(dec), *self._group(dec, 1, ws, wf)))
    if pre:
      groups.append((len(pre), *self._group(pre, self.chunk_size, ws, wf)))
    devs = jax.device_put([buf for _, _, buf in groups])      # the step plan: one host->device transfer
    self.stats["device_puts"] += 1
    outs = []
    for (n, shape, _), dev in zip(groups, devs):
      self.shapes_run.add(shape)
      self.cache, toks, logits = group_step(self.params, self.cache, dev, shape=shape, **kw)
      outs.append((n, toks, logits))
    fetched = jax.device_get([(t, l) for _, t, l in outs])  # the sampled tokens: one device->host transfer
    self.stats["device_gets"] += 1
    self.stats["steps"] += 1
    toks = np.concatenate([np.asarray(t)[:n] for (n, _, _), (t, _) in zip(outs, fetched)])
    logits = None
    if self.record_logits:
      logits = np.concatenate([np.asarray(l)[:n] for (n, _, _), (_, l) in zip(outs, fetched)])
    inv = np.empty(len(order), np.int64)
    inv[np.asarray(order)] = np.arange(len(order))
    return toks[inv], (None if logits is None else logits[inv])

  def _run_sharded(self, rows: list[Row]):
    """Mesh path: the padded layout with full-width tables, then the jitted sampler on the replicated logits.
    Pools over data: row r sits at position r.slot (its data shard's rows hold its shard's blocks); otherwise rows
    are packed from position 0."""
    B = self.max_num_seqs
    T = 1 if all(len(r.tokens) == 1 for r in rows) else self.chunk_size
    tokens = np.zeros((B, T), np.int32)
    start = np.zeros(B, np.int32)
    num = np.zeros(B, np.int32)
    slots = np.array([r.slot for r in rows], np.int64)
    at = slots if self.num_shards > 1 else np.arange(len(rows))
    swa = np.full((B, self.max_swa_width), -1, np.int32)
    full = np.full((B, self.max_full_width), -1, np.int32)
    swa[at] = self.swa_host[slots]
    full[at] = self.full_host[slots]
    a = {"temperature": np.zeros(B, np.float32), "top_k": np.zeros(B, np.int32), "top_p": np.ones(B, np.float32),
         "seed": np.zeros(B, np.uint32), "step": np.zeros(B, np.int32)}
    for b, r in zip(at, rows):
      tokens[b, : len(r.tokens)] = r.tokens
      start[b], num[b] = r.start, len(r.tokens)
      self._sampling(a, b, r)
    self.shapes_run.add((B, T))
    sh = self.shardings
    index = sharding.put(caches.BatchIndex(start, num, swa, full), sh["index"])
    self.cache, logits = self._sharded_step(self.params, sharding.put(tokens, sh["tokens"]), self.cache, index)
    logits = logits.addressable_data(0)  # replicated: this process's copy, a plain one-device array
    toks = sample_rows(logits, *jax.device_put([a["temperature"], a["top_k"], a["top_p"], a["seed"], a["step"]]))
    toks, logits = jax.device_get((toks, logits if self.record_logits else None))
    self.stats["steps"] += 1
    return np.asarray(toks)[at], (None if logits is None else np.asarray(logits)[at])

  def step_function_name(self) -> str:
    """The step program this runner dispatches (each distinct shape in `shapes_run` is one program of it)."""
    if self.mesh is not None:
      return "sharded_step"
    if self.batch_invariant:
      return "invariant_step"
    return "ragged_step" if self.step_mode == "ragged" else "group_step"
