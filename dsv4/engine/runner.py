"""Model runner: owns the params and the paged cache pytree; turns one scheduler step into device work: the cache
manager's bookkeeping program then ONE step program, `step_body` (jitted as `ragged_step`), back to back, with one
host->device transfer (the packed step plan and the queued bookkeeping) and one device->host transfer (the sampled
tokens and the cache's counters).

Block tables never visit the host: the cache manager keeps them on the device ([slots, width] per group, next to
its pools), each row of a step names its manager slot, and the program gathers the row's tables there (the full
table from entry 0 at a width that follows the live context, the swa table from the row's base block: window +
chunk). On one device the manager's queued work (registrations, releases, allocations that write the tables) runs
right before the model on the device (`cache.step.apply_step_packed`, a fixed shape per engine: compiled once,
not inside every step shape's program), with no host read between, and the host plans with counts only.

All rows of a step ride ONE flat token axis through `model.forward_ragged`: a decode row contributes 1 token, a
prefill row its chunk; per-token row / position metadata and per-row slots travel in the packed int32 plan with
the sampling parameters, and sampling runs inside the same program. So a mixed step (one prefill chunk + many
decodes) costs its real tokens. Shapes are bucketed so compilation stays bounded: tokens to 8 * g^k
(g = `token_bucket_growth`, 2 or 4; `token_bucket_steps` > 1 adds equal steps inside each interval), rows to
max_num_seqs (4x buckets from 64 beyond 64), the full table to a power-of-two width that covers the live context of
the step, the swa table to the window + chunk (`swa_base`); the bookkeeping has fixed widths per engine.

Async scheduling: `dispatch` sends a step and returns at once; `collect` waits for it. The sampled tokens also
stay on the device (`prev_tokens`), and a token id -(1 + j) in the next plan means "row j's sample of the
previous step", so the engine can send step N+1 before it reads step N.

Every mode is this program:
* Batch-invariant (`batch_invariant=True`): the same plan, with `RaggedShape.invariant` set: every token runs the
  same one-token forward in order (a loop with a dynamic trip count), logits and sampling per row at a fixed
  shape, and each token's full table width follows its own position (`_invariant_calls`), so nothing in its math
  depends on what else shares the step or on how its prompt was chunked. Cost: per-token work over the live
  context, never max_model_len.
* A mesh (dsv4.sharding): params and pools carry the rule shardings (tensor and expert parallel inside the
  program). `pools_over_data=True` (the engine's default on a mesh): every pool's block axis is split over `data`
  and the program runs manual over `data` (`jax.shard_map`): data shard s holds num_blocks/D blocks and its own
  cache manager (max_num_seqs/D slots, SHARD-LOCAL block ids); its plan row holds its own rows, and the sampled
  tokens are gathered over `data` so every process reads all of them. `pools_over_data=False`: one pool
  replicated over `data`, one plan. On a mesh the managers apply their bookkeeping in their own call before the
  step and their tables travel with it (stacked per shard): the one place block tables still cross the host.
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

from cache import step as cache_step
from dsv4 import caches, model, sharding
from dsv4.config import ModelConfig
from dsv4.engine.sampling import SamplingParams, sample_rows_impl, verify_drafts
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


def result_width(spec: int) -> int:
  """Int32 results per row of a step: 1 (the sampled token), or with k drafts 1 + (k + 1) + k: the number of new
  tokens, the new tokens (accepted drafts, then the sampled one), the next drafts."""
  return 2 + 2 * spec if spec else 1


@dataclasses.dataclass(frozen=True)
class RaggedShape(_PackedShape):
  """Static shape of the step program (part of the jit key): N flat tokens (every row's tokens packed, decode rows
  1 each, prefill rows their chunk), R rows, block tables [R, width] (gathered in the program from the rows'
  slots of the device tables). `invariant`: the batch-invariant body (each token through the same one-token
  program, in order). A token id < 0 is -(1 + j): the token sampled by row j of the previous step program, still
  on the device (async scheduling)."""
  tokens: int
  rows: int
  swa_width: int
  full_width: int
  invariant: bool = False
  spec: int = 0      # speculative decoding: drafts per row (k); the MTP block drafts, rows carry their drafts

  def fields(self):
    N, R = self.tokens, self.rows
    spec = (("ndraft", (R,)), ("next_tok", (R,)), ("prev_row", (R,))) if self.spec else ()
    return (("n_real", (1,)), ("tokens", (N,)), ("row", (N,)), ("pos", (N,)), ("start", (R,)), ("num", (R,)),
            ("last", (R,)), ("slot", (R,)), ("swa_base", (R,)), ("temperature", (R,)), ("top_k", (R,)),
            ("top_p", (R,)), ("seed", (R,)), ("step", (R,))) + spec

  @property
  def out_width(self) -> int:
    return result_width(self.spec)


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


def _row_tables(tables, p, shape: RaggedShape):
  """Each row's block tables [R, width], gathered from the device tables [slots, W] at its slot: the full table
  from entry 0 (width follows the live context), the swa table from its base block (the window + chunk)."""
  out = {}
  slot = jnp.maximum(p["slot"], 0)
  for g, t in tables.items():
    w = t.shape[1]
    if g == caches.SWA:
      cols = p["swa_base"][:, None] + jnp.arange(shape.swa_width, dtype=jnp.int32)[None]
      out[g] = jnp.where(cols < w, t[slot[:, None], jnp.minimum(cols, w - 1)], -1)
    else:
      out[g] = t[slot, :min(shape.full_width, w)]
      if shape.full_width > w:
        out[g] = jnp.pad(out[g], ((0, 0), (0, shape.full_width - w)), constant_values=-1)
  return out


def step_body(params, cache, tables, prev_tokens, buf, *, config, layout, kernel_cfg, shape: RaggedShape,
              record_logits: bool, model_api: str = "functional", graphdef=None):
  """The engine's one step program (unjitted; `ragged_step` is its one-device jit, `ModelRunner` wraps it for a
  mesh): all rows on one flat token axis (`model.forward_ragged`): a decode row costs one token, a prefill row its
  chunk, padding only up to the token bucket. Logits at each row's last token, then sampling.

  tables: per group the device block tables [slots, W], as the cache's bookkeeping program left them (it runs
  right before this one on the device, `cache.step.apply_step_packed`; no host read between). prev_tokens [S]: the
  previous step's sampled tokens, which a token id -(1 + j) refers to.

  Returns (cache, tables, None, out [S] int32: the sampled token per row padded to S, the same tokens as the next
  step's prev_tokens (kept on the device), logits_RxV or None).

  model_api="nnx": params is the `nnx.State` and graphdef (static) the `nnx.GraphDef` of an `nnx_model.Model`
  (`nnx.split`); the step runs that module (`Model.ragged`, its blocks calling their own sub-modules), so a changed
  module is a changed graphdef and compiles its own program.

  shape.invariant: every real token runs the same one-token forward, in order (a loop with a dynamic trip count,
  so padding costs nothing), then each row's logits and sample at a fixed [1, D] / [1, V] shape: nothing in a
  token's math depends on what else shares the step or on how its prompt was chunked. The tables are the live
  ones (the runner sizes them by each token's own position, see `ModelRunner._invariant_calls`)."""
  p = _unpack(buf, shape)
  if shape.spec:
    p = _continue_rows(p, prev_tokens, shape)
  else:
    toks_in = p["tokens"]
    p["tokens"] = jnp.where(toks_in < 0, prev_tokens[jnp.clip(-toks_in - 1, 0, prev_tokens.shape[0] - 1)], toks_in)
  rows = _row_tables(tables, p, shape)
  S = prev_tokens.shape[0]
  if model_api == "nnx":
    from flax import nnx  # local: the default path does not import Flax
    net = nnx.merge(graphdef, params)
    fwd = functools.partial(net.ragged, layout=layout, kernel_cfg=kernel_cfg)
    to_logits, h_dtype = net.logits, net.lm_head.value.dtype
  else:
    fwd = functools.partial(model.forward_ragged, params, config, layout=layout, kernel_cfg=kernel_cfg)
    to_logits, h_dtype = functools.partial(model.lm_logits, params), params["lm_head"].dtype

  def out(cache, toks):
    padded = jnp.zeros((S,), jnp.int32).at[:toks.shape[0]].set(toks.astype(jnp.int32), mode="drop")
    return cache, tables, None, padded, padded

  if shape.spec:
    if model_api != "functional":
      raise ValueError("speculative decoding runs the functional model (model_api='functional')")
    cache, res_RxW, logits = _speculative(params, config, layout, kernel_cfg, shape, p, rows, cache)
    padded = jnp.zeros((S, shape.out_width), jnp.int32).at[:shape.rows].set(res_RxW, mode="drop")
    return cache, tables, None, padded, padded, (logits if record_logits else None)

  if not shape.invariant:
    step = caches.StepIndex(p["row"], p["pos"], p["start"], p["num"], rows, swa_base_R=p["swa_base"])
    cache, h_NxD = fwd(p["tokens"], cache, step)
    logits = to_logits(h_NxD[jnp.maximum(p["last"], 0)])
    return (*out(cache, _sample(p, logits)), (logits if record_logits else None))

  def body(i, carry):
    cache, h_NxD = carry
    real = p["row"][i] >= 0          # padding: on a mesh every data shard loops to the longest shard's count
    r = jnp.maximum(p["row"][i], 0)
    pos = p["pos"][i][None]
    step = caches.StepIndex(jnp.where(real, 0, -1)[None], pos, pos, real.astype(jnp.int32)[None],
                            {g: t[r][None] for g, t in rows.items()}, swa_base_R=p["swa_base"][r][None])
    cache, h = fwd(p["tokens"][i][None], cache, step)
    return cache, h_NxD.at[i].set(h[0].astype(h_NxD.dtype))

  h0 = jnp.zeros((shape.tokens, config.hidden_size), h_dtype)
  cache, h_NxD = jax.lax.fori_loop(0, p["n_real"][0], body, (cache, h0))

  def per_row(r):
    logits = to_logits(h_NxD[jnp.maximum(p["last"][r], 0)][None])
    q = {k: p[k][r][None] for k in ("temperature", "top_k", "top_p", "seed", "step")}
    return _sample(q, logits)[0], logits[0]

  toks, logits = jax.lax.map(per_row, jnp.arange(shape.rows))
  return (*out(cache, toks), (logits if record_logits else None))


def _continue_rows(p, prev_RxW, shape: RaggedShape):
  """Async scheduling with drafts: a row with prev_row = j >= 0 continues row j of the previous step, whose results
  (`prev_RxW`, [rows, out_width]) are still on the device: its first token is j's decided token and the rest are
  j's drafts, and everything the host planned assuming no draft of j was accepted (positions, start, the sampler's
  output index) moves by the number j accepted."""
  K = shape.spec
  j = jnp.maximum(p["prev_row"], 0)
  cont = p["prev_row"] >= 0
  acc = jnp.where(cont, prev_RxW[j, 0] - 1, 0)
  decided = jnp.take_along_axis(prev_RxW[j], (1 + jnp.maximum(acc, 0))[:, None], axis=1)[:, 0]
  row_N = jnp.maximum(p["row"], 0)
  off_N = jnp.arange(p["tokens"].shape[0]) - (p["last"] - p["num"] + 1)[row_N]
  draft_N = prev_RxW[j[row_N], 2 + K + jnp.clip(off_N - 1, 0, K - 1)]
  tok_N = jnp.where(off_N == 0, decided[row_N], draft_N)
  real_cont = cont[row_N] & (p["row"] >= 0)
  p = dict(p)
  p["tokens"] = jnp.where(real_cont, tok_N, p["tokens"])
  p["pos"] = p["pos"] + jnp.where(real_cont, acc[row_N], 0)
  p["start"], p["step"] = p["start"] + acc, p["step"] + acc
  return p


def _speculative(params, config, layout, kernel_cfg, shape: RaggedShape, p, rows, cache):
  """The step with MTP drafts (shape.spec = k). A row's tokens end with its drafts (p["ndraft"] of them: a decode
  row is [last decided token, drafts...]). One backbone pass scores every draft; `verify_drafts` accepts a prefix
  and decides one more token (exactly greedy; distribution-preserving when sampled). Then:
  * the compressors' state rows are rewritten at each row's last accepted position (the forward left the state
    after the row's last token there, which may be a rejected draft);
  * MTP block 0 catches up on the positions that just became final (its input at position t is the token at
    t + 1: the next token in the row, the decided one at the frontier, or p["next_tok"] for a row that stops
    mid-prompt), writing its window KV there; its output at the frontier is the first next draft;
  * k - 1 more one-position runs of the block on its own output stream give the remaining drafts.
  KV written past the frontier (rejected drafts, the recursion's positions) is overwritten before anything reads
  it: every step writes its positions before attending, and reads stop at each query's position.
  Returns (cache, results [R, out_width], the logits the decided token was drawn from [R, V])."""
  K, R, N = shape.spec, shape.rows, shape.tokens
  step = caches.StepIndex(p["row"], p["pos"], p["start"], p["num"], rows, swa_base_R=p["swa_base"])
  cache, h_NxD, auxes, X = model.forward_ragged_aux(params, config, p["tokens"], cache, step, layout=layout,
                                                     kernel_cfg=kernel_cfg, return_stream=True, tap_states=True)
  last = jnp.maximum(p["last"], 0)
  ndraft = jnp.where(p["num"] > 0, jnp.minimum(p["ndraft"], K), 0)
  base = last - ndraft                                  # flat index of the input whose logits score draft 1
  j = jnp.arange(K + 1)[None, :]
  scored = jnp.minimum(base[:, None] + j, last[:, None])
  logits_RxJxV = model.lm_logits(params, h_NxD[scored])
  drafts_RxK = p["tokens"][jnp.minimum(base[:, None] + 1 + j[:, :K], N - 1)]
  accepted, new_RxJ = verify_drafts(logits_RxJxV, drafts_RxK, ndraft, p["temperature"], p["top_k"], p["top_p"],
                                    p["seed"], p["step"])
  decided = jnp.take_along_axis(new_RxJ, accepted[:, None], axis=1)[:, 0]
  frontier = base + accepted                            # flat index of each row's last final position
  n = jnp.arange(N)
  row_N = jnp.maximum(p["row"], 0)
  real = p["row"] >= 0
  at_frontier = real & (n == frontier[row_N])
  cache = model.store_states(cache, auxes, step, at_frontier & (ndraft[row_N] > 0), layout=layout)

  # MTP block 0 over the same positions: the token after each position, the decided / next prompt token at the
  # frontier (a mid-prompt row: the host's next_tok).
  samples = p["next_tok"] < 0
  after_frontier = jnp.where(samples, decided, p["next_tok"])
  shifted = jnp.concatenate([p["tokens"][1:], jnp.zeros((1,), p["tokens"].dtype)])
  nxt_N = jnp.where(at_frontier, after_frontier[row_N], shifted)
  cache, Xm, hm = model.mtp_forward(params, config, 0, X, nxt_N, cache, step, layout=layout, kernel_cfg=kernel_cfg)
  draft = jnp.argmax(model.lm_logits(params, hm[frontier]), axis=-1).astype(jnp.int32)
  drafts = [draft]
  # The recursion: position frontier + i, the block's own stream, the previous draft. Only rows that sampled draft.
  drafting = samples & (p["num"] > 0) & (p["slot"] >= 0)
  pos = p["pos"][frontier] + 1
  Xr = Xm[:, frontier]
  for _ in range(K - 1):
    rstep = caches.StepIndex(jnp.where(drafting, jnp.arange(R), -1), pos, pos, drafting.astype(jnp.int32), rows,
                             swa_base_R=p["swa_base"])
    cache, Xr, hr = model.mtp_forward(params, config, 0, Xr, drafts[-1], cache, rstep, layout=layout,
                                      kernel_cfg=kernel_cfg)
    drafts.append(jnp.argmax(model.lm_logits(params, hr), axis=-1).astype(jnp.int32))
    pos = pos + 1
  drafts_RxK = jnp.where(drafting[:, None], jnp.stack(drafts, axis=1), 0)
  res = jnp.concatenate([(accepted + 1)[:, None], new_RxJ, drafts_RxK], axis=1)
  chosen = jnp.take_along_axis(logits_RxJxV, accepted[:, None, None], axis=1)[:, 0]
  return cache, res.astype(jnp.int32), chosen


_STEP_STATICS = ("config", "layout", "kernel_cfg", "shape", "record_logits", "model_api", "graphdef")


@functools.partial(jax.jit, static_argnames=_STEP_STATICS, donate_argnames=("cache", "tables"))
def ragged_step(params, cache, tables, prev_tokens, buf, *, config, layout, kernel_cfg, shape: RaggedShape,
                record_logits: bool, model_api: str = "functional", graphdef=None):
  """`step_body` jitted for one device (compile logs name it `jit(ragged_step)`, on a mesh too)."""
  return step_body(params, cache, tables, prev_tokens, buf, config=config, layout=layout, kernel_cfg=kernel_cfg,
                   shape=shape, record_logits=record_logits, model_api=model_api, graphdef=graphdef)


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


@dataclasses.dataclass
class _Dispatched:
  """A step sent to the device: per program call, (its rows, rows per shard, output buffer, logits, plans)."""
  num_rows: int
  calls: list


class ModelRunner:

  def __init__(self, params, config: ModelConfig, layout: caches.CacheLayout, *, num_swa_blocks: int,
               num_full_blocks: int, max_num_seqs: int, chunk_size: int, max_model_len: int,
               kernel_cfg: dispatch.KernelConfig = dispatch.KernelConfig(), batch_invariant: bool = False,
               record_logits: bool = False, min_table_tokens: int = 4096, max_num_batched_tokens: int = 512,
               mesh=None, rules: sharding.Rules = sharding.Rules(), token_bucket_growth: int = 4,
               token_bucket_steps: int = 1, model_api: str = "functional", pools_over_data: bool = False,
               managers=None, num_speculative_tokens: int = 0):
    """managers: the engine's cache managers (one per data shard): the step reads each row's block tables from
    their device tables (rows name their manager slot) and, on one device, runs their queued bookkeeping inside
    the step program. None (benchmarks, tests): the runner keeps its own tables, set with `set_tables`."""
    self.params, self.config, self.layout, self.kernel_cfg = params, config, layout, kernel_cfg
    self.managers = managers
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
    # k > 0: every step runs the speculative program (verification, the MTP block's catch-up and k drafts per row)
    if num_speculative_tokens and (batch_invariant or mesh is not None or model_api != "functional"
                                   or config.num_mtp_layers < 1):
      raise ValueError("ModelRunner: speculative decoding needs an MTP block and runs on one device, with the "
                       "functional model, without batch invariance")
    self.spec = num_speculative_tokens
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
    S = max_num_seqs
    if managers is None:     # the runner's own device tables (slot rows), for use without an engine
      self._own_tables = {caches.SWA: jnp.full((S, self.max_swa_width), -1, jnp.int32),
                          caches.FULL: jnp.full((S, self.max_full_width), -1, jnp.int32)}
    # the previous step program's sampled tokens (a token id -(1 + j) in a plan refers to its entry j)
    self.prev_tokens = jnp.zeros((S // self.num_shards,), jnp.int32)
    if self.spec:                    # with drafts: each row's whole result (`RaggedShape.out_width`)
      self.prev_tokens = jnp.zeros((S, result_width(self.spec)), jnp.int32)
    # fused: the cache bookkeeping is sent with the step and runs on the device right before it (one device with
    # managers); on a mesh the managers apply it in their own call before the step and the tables travel with it
    self.fused = managers is not None and mesh is None
    if managers is not None:
      for m in managers:
        m.set_step_capacity(max_num_batched_tokens, S // self.num_shards)
    # step_tokens: real tokens run; step_slots: the flat-axis slots they were padded to (per data shard, summed)
    self.stats = {"steps": 0, "calls": 0, "device_puts": 0, "device_gets": 0, "step_tokens": 0, "step_slots": 0,
                  "host_bytes_in": 0, "host_bytes_out": 0}

  def token_buckets(self) -> list[int] | None:
    """The flat-axis sizes a step can be padded to (module `token_buckets`); None where a step's shape does not
    follow the step's total token count (batch-invariant mode, pools split over data shards)."""
    if self.batch_invariant or self.num_shards > 1:
      return None
    return token_buckets(self.token_bucket_growth, self.max_num_batched_tokens, self.token_bucket_steps)

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
    # with drafts, the MTP block's recursion writes up to k - 1 positions past a row's last token, and a row that
    # continues an unread step lands up to k positions later than planned (async scheduling)
    extra = max(2 * self.spec - 1, 0)
    need = max(-(-(r.start + len(r.tokens) + extra) // sb) - self._swa_base(r) for r in rows)
    return min(self.max_swa_width, pow2_at_least(need, 8))

  def _rows_bucket(self, n: int) -> int:
    # All of a shard's slots up to 64 (tables are [R, width] int32, cheap; one row bucket = fewer compiles), beyond
    # that 4x buckets from 64.
    cap = self.max_num_seqs // self.num_shards
    return cap if cap <= 64 else min(cap, pow4_at_least(n, 64))

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
    """Computes the rows' tokens, samples one token per row at its last computed token, and waits for them.
    Returns (sampled token per row [len(rows)], logits per row [len(rows), V] when record_logits else None). Rows
    whose sample is not wanted (mid-prompt chunks) are simply ignored by the caller."""
    return self.collect(self.dispatch(rows))

  def dispatch(self, rows: list[Row]) -> "_Dispatched":
    """Sends the step (its cache bookkeeping and its rows) to the device without waiting for it. Row j's sampled
    token stays on the device as `prev_tokens[j]` for the next dispatch (a token id -(1 + j) refers to it);
    `collect` reads it."""
    assert 0 < len(rows) <= self.max_num_seqs
    calls = (self._invariant_calls(rows) if self.batch_invariant else [list(enumerate(rows))])
    sent = [(call, *self._call([r for _, r in call])) for call in calls]
    self.stats["steps"] += 1
    return _Dispatched(len(rows), sent)

  def collect(self, d: "_Dispatched") -> tuple[np.ndarray, np.ndarray | None]:
    """Waits for a dispatched step: (sampled token per row, or with drafts each row's `result_width` results;
    logits per row or None). Hands each manager the results of its bookkeeping."""
    toks = np.zeros((d.num_rows, result_width(self.spec)) if self.spec else d.num_rows, np.int32)
    logits = None
    for call, by_shard, out, l, plans in d.calls:
      out, l = jax.device_get((out, l))                        # one device->host transfer per call
      self.stats["device_gets"] += 1
      self.stats["host_bytes_out"] += sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves((out, l)))
      out = tuple(np.asarray(x) for x in out) if isinstance(out, tuple) else np.asarray(out)
      D = len(by_shard)
      if plans:                                                # the bookkeeping's counters came with the tokens
        out, kv_res = out
        self.managers[0].on_step_result(plans[0], kv_res)
      # [D * rows] or, gathered over a mesh's data axis, [D, rows]; with drafts each row has a result vector
      t = out.reshape(D, -1, result_width(self.spec)) if self.spec else out.reshape(D, -1)
      l = None if l is None else np.asarray(l).reshape(D, -1, np.asarray(l).shape[-1])
      for s, b in enumerate(by_shard):
        for k, j in enumerate(b):
          i = call[j][0]
          # a row split over calls (batch-invariant) samples in its last one: earlier samples are overwritten
          toks[i] = t[s, k]
          if l is not None:
            logits = np.zeros((d.num_rows, l.shape[-1]), l.dtype) if logits is None else logits
            logits[i] = l[s, k]
    return toks, logits

  def _call(self, rows: list[Row]):
    """One dispatch of the step program: plan packed per data shard, one host->device transfer. Returns
    (rows per shard, the device's output buffer, logits or None, the bookkeeping plans it carried)."""
    D = self.num_shards
    by_shard = [[] for _ in range(D)]
    for i, r in enumerate(rows):
      by_shard[r.shard].append(i)
    totals = [sum(len(rows[i].tokens) for i in b) for b in by_shard]
    if self.batch_invariant:
      N = pow2_at_least(max(totals), 8)
    else:
      N = token_bucket(max(totals), self.token_bucket_growth, self.max_num_batched_tokens, self.token_bucket_steps)
    wf = self._full_width(max(r.start + len(r.tokens) for r in rows) + (2 * self.spec if self.spec else 0))
    shape = RaggedShape(N, self._rows_bucket(max(len(b) for b in by_shard)), self._swa_width(rows), wf,
                        self.batch_invariant, self.spec)
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
    plans = []
    self.stats["calls"] += 1
    self.stats["device_puts"] += 1
    if self.mesh is None:
      params, kv = self.params, None
      if self.model_api == "nnx":
        from flax import nnx
        kw["graphdef"], params = nnx.split(self.net)           # this step's module: edits since the last step count
      kv_res = None
      if self.fused:
        m = self.managers[0]
        plan = m.take_step_plan()
        pools, tabs = m.device_state()
        (dev, kvbuf) = jax.device_put([bufs[0], plan.buf])      # the step plan: one host->device transfer
        self.stats["host_bytes_in"] += bufs[0].nbytes + plan.buf.nbytes
        # the cache's bookkeeping program, then the model's, back to back on the device (no host read between):
        # its shape is fixed per engine, so it compiles once, not inside every step shape's program
        pools, tabs, kv_res = cache_step.apply_step_packed(pools, tabs, kvbuf, **plan.kwargs())
        tables = dict(zip(m.groups, tabs))
        plans.append(plan)
      else:
        (dev,) = jax.device_put([bufs[0]])
        self.stats["host_bytes_in"] += bufs[0].nbytes
        tables = self._tables()
      tables, _, out, prev, l = self._run_one(params, tables, dev, kw)
      if self.fused:
        m.set_device_state(pools, tuple(tables[g] for g in m.groups))
      elif self.managers is None:
        self._own_tables = tables
      self.prev_tokens = prev
      if kv_res is not None:
        out = (out, kv_res)
    else:
      # the managers apply their bookkeeping in their own call; their tables travel with the step (stacked per
      # data shard)
      tables, dev = self.mesh_inputs(bufs)
      with jax.set_mesh(self.mesh):
        self.cache, _, _, out, l = self._mesh_step(shape)(self.params, self.cache, tables, self.prev_tokens, dev)
      # replicated: this process's copy, a plain one-device array (also under jax.distributed)
      out, l = out.addressable_data(0), (None if l is None else l.addressable_data(0))
    return by_shard, out, l, plans

  def mesh_inputs(self, bufs):
    """(tables, plan) of a mesh step: the managers' queued bookkeeping applied in their own calls, every shard's
    block tables stacked over `data` and put with the plan's sharding, the per-shard plans likewise."""
    D = self.num_shards
    if self.managers is not None:
      for m in self.managers:
        m.flush()
    per = [jax.device_get(self._tables(s)) for s in range(D)]
    tables = {g: np.stack([np.asarray(t[g]) for t in per]) if D > 1 else np.asarray(per[0][g]) for g in per[0]}
    self.stats["host_bytes_in"] += sum(b.nbytes for b in bufs) + sum(t.nbytes for t in tables.values())
    dev = sharding.put(np.stack(bufs) if D > 1 else bufs[0], self.shardings["plan"])
    return {g: sharding.put(t, self.shardings["plan"]) for g, t in tables.items()}, dev

  def _run_one(self, params, tables, dev, kw):
    self.cache, tables, _, out, prev, l = ragged_step(params, self.cache, tables, self.prev_tokens, dev, **kw)
    return tables, None, out, prev, l

  def _mesh_step(self, shape: RaggedShape):
    """The step program jitted for the mesh, per shape. Pools over data: `step_body` runs manual over `data`
    (tensor / expert stay automatic), each data shard on its own packed plan, its own rows, its own tables and
    its own slice of the pools (SHARD-LOCAL block ids); the sampled tokens (and logits) are gathered over `data`
    so every process reads them all. Otherwise one replicated pool and one plan."""
    fn = self._mesh_steps.get(shape)
    if fn is not None:
      return fn
    body = functools.partial(step_body, config=self.config, layout=self.layout, kernel_cfg=self.kernel_cfg,
                             shape=shape, record_logits=self.record_logits, model_api=self.model_api)
    if self.num_shards > 1:
      def local(params, cache, tables, prev, buf_1xS):
        cache, _, _, out, _, l = body(params, cache, {g: t[0] for g, t in tables.items()}, prev, buf_1xS[0])
        gather = functools.partial(jax.lax.all_gather, axis_name="data")
        return cache, gather(out), (None if l is None else gather(l))
      inner = jax.shard_map(local, mesh=self.mesh, in_specs=(P(), P("data"), P("data"), P(), P("data")),
                            out_specs=(P("data"), P(), P()), axis_names={"data"}, check_vma=False)
    else:
      def inner(params, cache, tables, prev, buf):
        cache, _, _, out, _, l = body(params, cache, tables, prev, buf)
        return cache, out, l

    def ragged_step(params, cache, tables, prev, buf):   # the name compile logs show
      cache, out, l = inner(params, cache, tables, prev, buf)
      return cache, None, None, out, l
    rep = NamedSharding(self.mesh, P())
    sh = self.shardings
    fn = jax.jit(ragged_step, in_shardings=(sh["params"], sh["cache"], sh["plan"], rep, sh["plan"]),
                 out_shardings=(sh["cache"], None, None, rep, rep if self.record_logits else None),
                 donate_argnums=(1,))
    self._mesh_steps[shape] = fn
    return fn

  def step_function_name(self) -> str:
    """The step program this runner dispatches (each distinct shape in `shapes_run` is one program of it)."""
    return "ragged_step"
