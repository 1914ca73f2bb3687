"""Model runner: owns the params and the paged cache pytree; turns one scheduler step into device work with one
host->device transfer of the step plan and one device->host fetch of the sampled tokens per call of the one step
program, `step_body` (jitted as `ragged_step`).

Host side (numpy, O(new tokens) per step): each running request owns a *slot* with persistent block-table rows.
`sync_tables` copies only what changed since the last step (new blocks at the end, swa blocks released behind the
window at the front), so a step never rebuilds a request's whole table or token list.

Device side: all rows of a step ride ONE flat token axis through `model.forward_ragged`: a decode row contributes 1
token, a prefill row its chunk; per-token row / position metadata and per-row block tables (`caches.StepIndex`)
travel in one packed int32 buffer with the sampling parameters, and sampling runs inside the same program. So a
mixed step (one prefill chunk + many decodes) costs its real tokens. Shapes are bucketed so compilation stays
bounded: tokens to 8 * g^k (g = `token_bucket_growth`, 2 or 4; `token_bucket_steps` > 1 adds equal steps inside
each interval), rows to max_num_seqs (4x buckets from 64 beyond 64), the full table to a power-of-two width that
covers the live context of the step, the swa table to the window + chunk (`swa_base`).

Every mode is this program:
* Batch-invariant (`batch_invariant=True`): the same plan, with `RaggedShape.invariant` set: every token runs the
  same one-token forward in order (a loop with a dynamic trip count), logits and sampling per row at a fixed
  shape, and each token's full table width follows its own position (`_invariant_calls`), so nothing in its math
  depends on what else shares the step or on how its prompt was chunked. Cost: per-token work over the live
  context, never max_model_len.
* A mesh (dsv4.sharding): params and pools carry the rule shardings (tensor and expert parallel inside the
  program). `pools_over_data=True` (the engine's default on a mesh): every pool's block axis is split over `data`
  and the program runs manual over `data` (`jax.shard_map`): data shard s holds num_blocks/D blocks and the slots
  [s*S/D, (s+1)*S/D); its requests take slots in that range (`acquire_slot(shard)`), its plan row holds its own
  rows, flat tokens and SHARD-LOCAL block ids (the engine keeps one cache manager per shard), and the sampled
  tokens are gathered over `data` so every process reads all of them. `pools_over_data=False`: one pool
  replicated over `data`, one plan.
* KV precision, kernels (`kernel_cfg`) and the model API (functional or NNX modules) are static arguments of the
  same program.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dsv4 import caches, model, sharding
from dsv4.config import ModelConfig
from dsv4.engine.sampling import SamplingParams, sample_rows_impl
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


@dataclasses.dataclass(frozen=True)
class RaggedShape(_PackedShape):
  """Static shape of the step program (part of the jit key): N flat tokens (every row's tokens packed, decode rows
  1 each, prefill rows their chunk), R rows, block tables [R, width]. `invariant`: the batch-invariant body (each
  token through the same one-token program, in order)."""
  tokens: int
  rows: int
  swa_width: int
  full_width: int
  invariant: bool = False

  def fields(self):
    N, R = self.tokens, self.rows
    return (("n_real", (1,)), ("tokens", (N,)), ("row", (N,)), ("pos", (N,)), ("start", (R,)), ("num", (R,)),
            ("last", (R,)), ("swa_base", (R,)), ("swa", (R, self.swa_width)), ("full", (R, self.full_width)),
            ("temperature", (R,)), ("top_k", (R,)), ("top_p", (R,)), ("seed", (R,)), ("step", (R,)))


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


def step_body(params, cache, buf, *, config, layout, kernel_cfg, shape: RaggedShape, record_logits: bool,
              model_api: str = "functional", graphdef=None):
  """The engine's one step program (unjitted; `ragged_step` is its one-device jit, `ModelRunner` wraps it for a
  mesh). All rows of a step on one flat token axis (`model.forward_ragged`): a decode row costs one token, a prefill
  row its chunk, padding only up to the token bucket. Logits at each row's last token, then sampling. Returns
  (cache, tokens_R, logits_RxV or None).

  model_api="nnx": params is the `nnx.State` and graphdef (static) the `nnx.GraphDef` of an `nnx_model.Model`
  (`nnx.split`); the step runs that module (`Model.ragged`, its blocks calling their own sub-modules), so a changed
  module is a changed graphdef and compiles its own program.

  shape.invariant: every real token runs the same one-token forward, in order (a loop with a dynamic trip count,
  so padding costs nothing), then each row's logits and sample at a fixed [1, D] / [1, V] shape: nothing in a
  token's math depends on what else shares the step or on how its prompt was chunked. The tables are the live
  ones (the runner sizes them by each token's own position, see `ModelRunner._invariant_calls`)."""
  p = _unpack(buf, shape)
  if model_api == "nnx":
    from flax import nnx  # local: the default path does not import Flax
    net = nnx.merge(graphdef, params)
    fwd = functools.partial(net.ragged, layout=layout, kernel_cfg=kernel_cfg)
    to_logits, h_dtype = net.logits, net.lm_head.value.dtype
  else:
    fwd = functools.partial(model.forward_ragged, params, config, layout=layout, kernel_cfg=kernel_cfg)
    to_logits, h_dtype = functools.partial(model.lm_logits, params), params["lm_head"].dtype
  if not shape.invariant:
    step = caches.StepIndex(p["row"], p["pos"], p["start"], p["num"], {caches.SWA: p["swa"], caches.FULL: p["full"]},
                            swa_base_R=p["swa_base"])
    cache, h_NxD = fwd(p["tokens"], cache, step)
    logits = to_logits(h_NxD[jnp.maximum(p["last"], 0)])
    return cache, _sample(p, logits), (logits if record_logits else None)

  def body(i, carry):
    cache, h_NxD = carry
    real = p["row"][i] >= 0          # padding: on a mesh every data shard loops to the longest shard's count
    r = jnp.maximum(p["row"][i], 0)
    pos = p["pos"][i][None]
    step = caches.StepIndex(jnp.where(real, 0, -1)[None], pos, pos, real.astype(jnp.int32)[None],
                            {caches.SWA: p["swa"][r][None], caches.FULL: p["full"][r][None]},
                            swa_base_R=p["swa_base"][r][None])
    cache, h = fwd(p["tokens"][i][None], cache, step)
    return cache, h_NxD.at[i].set(h[0].astype(h_NxD.dtype))

  h0 = jnp.zeros((shape.tokens, config.hidden_size), h_dtype)
  cache, h_NxD = jax.lax.fori_loop(0, p["n_real"][0], body, (cache, h0))

  def per_row(r):
    logits = to_logits(h_NxD[jnp.maximum(p["last"][r], 0)][None])
    q = {k: p[k][r][None] for k in ("temperature", "top_k", "top_p", "seed", "step")}
    return _sample(q, logits)[0], logits[0]

  toks, logits = jax.lax.map(per_row, jnp.arange(shape.rows))
  return cache, toks, (logits if record_logits else None)


@functools.partial(jax.jit, static_argnames=("config", "layout", "kernel_cfg", "shape", "record_logits", "model_api",
                                             "graphdef"), donate_argnames=("cache",))
def ragged_step(params, cache, buf, *, config, layout, kernel_cfg, shape: RaggedShape, record_logits: bool,
                model_api: str = "functional", graphdef=None):
  """`step_body` jitted for one device (compile logs name it `jit(ragged_step)`, on a mesh too)."""
  return step_body(params, cache, buf, config=config, layout=layout, kernel_cfg=kernel_cfg, shape=shape,
                   record_logits=record_logits, model_api=model_api, graphdef=graphdef)


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
               mesh=None, rules: sharding.Rules = sharding.Rules(), token_bucket_growth: int = 4,
               token_bucket_steps: int = 1, model_api: str = "functional", pools_over_data: bool = False):
    self.params, self.config, self.layout, self.kernel_cfg = params, config, layout, kernel_cfg
    # "functional": dsv4.model's functions (the default); "nnx": the same math through the Flax NNX modules
    # (dsv4.nnx_model), on one device.
    if model_api not in ("functional", "nnx"):
      raise ValueError(f"ModelRunner: model_api must be 'functional' or 'nnx', got {model_api!r}")
    if model_api == "nnx" and mesh is not None:
      raise ValueError("ModelRunner: model_api='nnx' runs on one device (the module state carries no mesh "
                       "shardings); drop the mesh or use model_api='functional'")
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
    if mesh is None:
      self.cache = caches.init_cache(config, layout, num_swa_blocks, num_full_blocks)
    else:
      local = self.num_shards > 1
      if local:
        sharding.check_pools_over_data(mesh, num_swa_blocks, num_full_blocks, max_num_seqs)
        rules = sharding.pools_over_data_rules(rules)
      self.shardings = dict(params=sharding.param_shardings(config, mesh, rules),
                            cache=sharding.cache_shardings(config, layout, mesh, rules, num_swa_blocks,
                                                           num_full_blocks),
                            # the step plan: one packed row per data shard (pools over data), else replicated
                            plan=NamedSharding(mesh, P("data") if local else P()))
      self._mesh_steps: dict = {}
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
    # step_tokens: real tokens run; step_slots: the flat-axis slots they were padded to (per data shard, summed)
    self.stats = {"steps": 0, "calls": 0, "device_puts": 0, "device_gets": 0, "table_entries_copied": 0,
                  "step_tokens": 0, "step_slots": 0}

  def token_buckets(self) -> list[int] | None:
    """The flat-axis sizes a step can be padded to (module `token_buckets`); None where a step's shape does not
    follow the step's total token count (batch-invariant mode, pools split over data shards)."""
    if self.batch_invariant or self.num_shards > 1:
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
  def _full_width(self, end_tokens: int) -> int:
    """Full-table width (blocks) for a step whose rows end by `end_tokens`: a power of two >= min_full_width."""
    fb = self.layout.full_block_tokens
    return min(self.max_full_width, pow2_at_least(caches.blocks_for(end_tokens, fb), self.min_full_width))

  def _widths(self, end_tokens: int) -> tuple[int, int]:
    wf = self._full_width(end_tokens)
    return min(self.max_swa_width, caches.blocks_for(wf * self.layout.full_block_tokens,
                                                     self.layout.swa_block_tokens)), wf

  @staticmethod
  def _sampling(a, i, r: Row):
    sp = r.params
    a["temperature"][i], a["top_k"][i], a["top_p"][i] = sp.temperature, sp.top_k, sp.top_p
    a["seed"][i], a["step"][i] = sp.seed & 0xFFFFFFFF, r.step

  def _swa_base(self, r: Row) -> int:
    """First swa block a row's step can touch: the block of start - state_tail_tokens (window rows, Engram ids, the
    compressor state of start - 1)."""
    return max(r.start - self._swa_tail, 0) // self.layout.swa_block_tokens

  def _swa_width(self, rows: list[Row]) -> int:
    """Swa table width: a power of two >= 8 covering every row from its base block to the block of its last token,
    so the swa table follows the window + chunk, not the context."""
    sb = self.layout.swa_block_tokens
    need = max(-(-(r.start + len(r.tokens)) // sb) - self._swa_base(r) for r in rows)
    return min(self.max_swa_width, pow2_at_least(need, 8))

  def _rows_bucket(self, n: int) -> int:
    # All of a shard's slots up to 64 (tables are [R, width] int32, cheap; one row bucket = fewer compiles), beyond
    # that 4x buckets from 64.
    cap = self.max_num_seqs // self.num_shards
    return cap if cap <= 64 else min(cap, pow4_at_least(n, 64))

  def _pack_rows(self, rows: list[Row], shape: RaggedShape) -> np.ndarray:
    N, R, ws, wf = shape.tokens, shape.rows, shape.swa_width, shape.full_width
    a = {"n_real": np.array([sum(len(r.tokens) for r in rows)], np.int32), "tokens": np.zeros(N, np.int32),
         "row": np.full(N, -1, np.int32), "pos": np.zeros(N, np.int32), "start": np.zeros(R, np.int32),
         "num": np.zeros(R, np.int32), "last": np.zeros(R, np.int32), "swa_base": np.zeros(R, np.int32),
         "swa": np.full((R, ws), -1, np.int32), "full": np.full((R, wf), -1, np.int32),
         "temperature": np.zeros(R, np.float32), "top_k": np.zeros(R, np.int32), "top_p": np.ones(R, np.float32),
         "seed": np.zeros(R, np.uint32), "step": np.zeros(R, np.int32)}
    if rows:
      slots = np.array([r.slot for r in rows], np.int64)
      base = np.array([self._swa_base(r) for r in rows], np.int64)
      cols = base[:, None] + np.arange(ws)[None, :]
      inside = cols < self.max_swa_width
      a["swa"][: len(rows)] = np.where(
          inside, self.swa_host[slots[:, None], np.minimum(cols, self.max_swa_width - 1)], -1)
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
    return _pack(a, shape)

  def _invariant_calls(self, rows: list[Row]) -> list[list[tuple[int, Row]]]:
    """Batch-invariant mode: each token's full-table width must follow its own position only (not the step's
    longest row, not its chunk's end), so a row's tokens are split at width-bucket boundaries and the step runs
    one call per width, narrowest first (a row's earlier tokens before its later ones). Returns the calls, each a
    list of (index of the row in `rows`, the part of the row it computes)."""
    by_width: dict[int, list[tuple[int, Row]]] = {}
    for i, r in enumerate(rows):
      o, n = 0, len(r.tokens)
      while o < n:
        w = self._full_width(r.start + o + 1)
        k = o + 1
        while k < n and self._full_width(r.start + k + 1) == w:
          k += 1
        by_width.setdefault(w, []).append((i, dataclasses.replace(r, tokens=r.tokens[o:k], start=r.start + o)))
        o = k
    return [by_width[w] for w in sorted(by_width)]

  # ------------------------------------------------------------------------------------------ run
  def run(self, rows: list[Row]) -> tuple[np.ndarray, np.ndarray | None]:
    """Computes the rows' tokens, samples one token per row at its last computed token. Returns (sampled token
    per row [len(rows)], logits per row [len(rows), V] when record_logits else None). Rows whose sample is not
    wanted (mid-prompt chunks) are simply ignored by the caller."""
    assert 0 < len(rows) <= self.max_num_seqs
    calls = (self._invariant_calls(rows) if self.batch_invariant else [list(enumerate(rows))])
    toks = np.zeros(len(rows), np.int32)
    logits = None
    for call in calls:
      t, l = self._call([r for _, r in call])
      # A row split over calls samples in the last one (its last token); earlier parts' samples are overwritten.
      for j, (i, _) in enumerate(call):
        toks[i] = t[j]
        if l is not None:
          logits = np.zeros((len(rows), l.shape[-1]), l.dtype) if logits is None else logits
          logits[i] = l[j]
    self.stats["steps"] += 1
    return toks, logits

  def _call(self, rows: list[Row]):
    """One dispatch of the step program: plan packed per data shard, one host->device transfer, one
    device->host fetch. Returns (tokens [len(rows)], logits [len(rows), V] or None) in `rows` order."""
    D = self.num_shards
    by_shard = [[] for _ in range(D)]
    for i, r in enumerate(rows):
      by_shard[self.shard_of_slot(r.slot)].append(i)
    totals = [sum(len(rows[i].tokens) for i in b) for b in by_shard]
    if self.batch_invariant:
      N = pow2_at_least(max(totals), 8)
    else:
      N = token_bucket(max(totals), self.token_bucket_growth, self.max_num_batched_tokens, self.token_bucket_steps)
    wf = self._full_width(max(r.start + len(r.tokens) for r in rows))
    shape = RaggedShape(N, self._rows_bucket(max(len(b) for b in by_shard)), self._swa_width(rows), wf,
                        self.batch_invariant)
    self.shapes_run.add(shape)
    self.stats["step_tokens"] += sum(totals)
    self.stats["step_slots"] += N * D
    bufs = [self._pack_rows([rows[i] for i in b], shape) for b in by_shard]
    if self.batch_invariant:
      # The one-token loop's trip count: the same on every data shard (shorter shards run padding tokens, which
      # write nothing), so the tensor / expert collectives inside it meet on every shard.
      for b in bufs:
        b[0] = max(totals)
    kw = dict(config=self.config, layout=self.layout, kernel_cfg=self.kernel_cfg, shape=shape,
              record_logits=self.record_logits, model_api=self.model_api)
    if self.mesh is None:
      (dev,) = jax.device_put([bufs[0]])                       # the step plan: one host->device transfer
      params = self.params
      if self.model_api == "nnx":
        from flax import nnx
        kw["graphdef"], params = nnx.split(self.net)           # this step's module: edits since the last step count
      self.cache, t, l = ragged_step(params, self.cache, dev, **kw)
    else:
      dev = sharding.put(np.stack(bufs) if D > 1 else bufs[0], self.shardings["plan"])
      with jax.set_mesh(self.mesh):
        self.cache, t, l = self._mesh_step(shape)(self.params, self.cache, dev)
      # replicated: this process's copy, a plain one-device array (also under jax.distributed)
      t, l = t.addressable_data(0), (None if l is None else l.addressable_data(0))
    t, l = jax.device_get((t, l))                              # the sampled tokens: one device->host transfer
    self.stats["device_puts"] += 1
    self.stats["device_gets"] += 1
    self.stats["calls"] += 1
    t, l = np.asarray(t).reshape(D, -1), (None if l is None else np.asarray(l).reshape(D, shape.rows, -1))
    out_t = np.empty(len(rows), np.int32)
    out_l = None if l is None else np.empty((len(rows), l.shape[-1]), l.dtype)
    for s, b in enumerate(by_shard):
      out_t[b] = t[s, : len(b)]
      if l is not None:
        out_l[b] = l[s, : len(b)]
    return out_t, out_l

  def _mesh_step(self, shape: RaggedShape):
    """The step program jitted for the mesh, per shape. Pools over data: `step_body` runs manual over `data`
    (tensor / expert stay automatic), each data shard on its own packed plan, its own rows and its own slice of
    the pools (SHARD-LOCAL block ids); the sampled tokens (and logits) are gathered over `data` so every process
    reads them all. Otherwise one replicated pool and one plan."""
    fn = self._mesh_steps.get(shape)
    if fn is not None:
      return fn
    body = functools.partial(step_body, config=self.config, layout=self.layout, kernel_cfg=self.kernel_cfg,
                             shape=shape, record_logits=self.record_logits, model_api=self.model_api)
    if self.num_shards > 1:
      def local(params, cache, buf_1xS):
        cache, t, l = body(params, cache, buf_1xS[0])
        gather = functools.partial(jax.lax.all_gather, axis_name="data")
        return cache, gather(t), (None if l is None else gather(l))
      inner = jax.shard_map(local, mesh=self.mesh, in_specs=(P(), P("data"), P("data")),
                            out_specs=(P("data"), P(), P()), axis_names={"data"}, check_vma=False)
    else:
      inner = body

    def ragged_step(params, cache, buf):   # the name compile logs show
      return inner(params, cache, buf)
    rep = NamedSharding(self.mesh, P())
    sh = self.shardings
    fn = jax.jit(ragged_step, in_shardings=(sh["params"], sh["cache"], sh["plan"]),
                 out_shardings=(sh["cache"], rep, rep if self.record_logits else None), donate_argnums=(1,))
    self._mesh_steps[shape] = fn
    return fn

  def step_function_name(self) -> str:
    """The step program this runner dispatches (each distinct shape in `shapes_run` is one program of it)."""
    return "ragged_step"
