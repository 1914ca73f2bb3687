"""(d) The engine at V4-Flash attention widths: `dsv4.config.v4_flash_layers` (64 heads x 512, indexer 64 x 128
top-512, window 128, CSA m=4 / HCA m=128) with random bf16 weights, served through `Engine` exactly as
`dsv4.engine.api.generate` serves it.

The workload (`Workload.real`): 64 requests of 4-8k-token prompts, 64 greedy tokens each; the requests come in
groups of four that share a prefix (prefix hits), and the full-history pool holds 75% of the blocks the whole batch
would hold at once, so rows may be preempted and readmitted along the way (the row counts the preemptions; the dry
run's pool, 30%, preempts). The dry
run (`Workload.dry`) is the same mix at v4_tiny widths (head_dim 128 with 64 RoPE channels: the FP8 record needs
whole 64-channel blocks) and short prompts.

Runs, most telling first (each a fresh engine; one compiled step program serves them all per KV dtype):
  bf16 KV with the kernels (`auto`: each kernel configuration validated once against XLA on a GPU; the dry run:
  `interpret`); the same requests alone (one engine each), compared bitwise with their batched tokens and logits;
  the XLA path (`xla`) compared with the kernels' (first divergent token, max |dlogit|); FP8 KV with the kernels.
Measured per run: tokens/s, step wall (ms) for decode-only steps and for steps with prefill chunks (an
`Engine.step` call's wall, counted for the step it read back: with async scheduling a call sends step N and waits
for step N-1), the host's time per step outside that wait (`Engine.step` wall minus `ModelRunner.collect`), the
cache's bookkeeping program alone on the device per step (`cache.device_state.apply` re-run on copies of a
sample of the steps' own inputs), compilations and compile seconds; beside each step kind, the roofline at that
point of the step as built and of a plain step (`roofline_ms`: designs (d) `blocked` and (c) `plain` of
`benchmarks/support/step_cost.py`), so a measured step far above (d) shows what the model leaves out (launches,
device loops' trip tests, the host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.support import step_cost as sc
from cache import device_state
from dsv4 import caches, config as C
from dsv4.engine import runner as runner_mod
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams
from dsv4.model import cast_params, init_params
from pallas_kernels import dispatch


@dataclasses.dataclass(frozen=True)
class Workload:
  num_requests: int
  prompt_min: int
  prompt_max: int
  max_tokens: int
  group: int            # requests per shared prefix
  shared_prefix: int    # tokens each group shares
  pool_fraction: float  # full-history blocks as a fraction of the batch's peak need (< 1: preemptions)
  max_num_seqs: int
  max_num_batched_tokens: int
  chunk_size: int

  @staticmethod
  def real() -> "Workload":
    return Workload(64, 4096, 8192, 64, 4, 2048, 0.75, 64, 8192, 2048)

  @staticmethod
  def dry() -> "Workload":
    return Workload(8, 160, 200, 6, 4, 128, 0.3, 8, 256, 64)

  def prompts(self, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(0, self.num_requests, self.group):
      prefix = rng.integers(2, vocab, self.shared_prefix).tolist()
      for _ in range(min(self.group, self.num_requests - g)):
        n = int(rng.integers(self.prompt_min, self.prompt_max + 1))
        out.append(prefix + rng.integers(2, vocab, n - self.shared_prefix).tolist())
    return out


def model(dry: bool, seed: int):
  """(config, bf16 params): v4_flash_layers:4 on a device, v4_tiny in the dry run."""
  if dry:
    cfg = C.v4_tiny()
    cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, head_dim=128, rope_head_dim=64),
                              indexer=dataclasses.replace(cfg.indexer, head_dim=64))
  else:
    cfg = C.v4_flash_layers(4)
  params = jax.jit(lambda k: cast_params(init_params(cfg, k), jnp.bfloat16))(jax.random.PRNGKey(seed))
  return cfg, params


# XLA's default command types plus the loops' (`EngineConfig.gpu_step_command_buffers`).
LOOP_COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"


def engine_config(cfg, wl: Workload, prompts, *, kv: str, kernels: str, record_logits: bool = True,
                  command_buffers: str = ""):
  """The engine for `prompts`: rows and token budget of the workload, the full-history pool at `pool_fraction` of
  the blocks the whole batch would hold at once (128-token blocks; a group's shared prefix counted once), never
  less than the longest request needs plus one."""
  max_len = wl.prompt_max + wl.max_tokens + 64
  blocks = [-(-(len(p) + wl.max_tokens) // 128) for p in prompts]
  need = sum(blocks) - (len(prompts) - -(-len(prompts) // wl.group)) * (wl.shared_prefix // 128)
  num_full = max(int(need * wl.pool_fraction), max(blocks) + 1)
  kv_dtype = {"bf16": jnp.bfloat16, "fp8": caches.FP8}[kv]
  return EngineConfig(max_num_seqs=wl.max_num_seqs, max_num_batched_tokens=wl.max_num_batched_tokens,
                      chunk_size=wl.chunk_size, max_model_len=max_len, num_full_blocks=num_full,
                      num_swa_blocks=max(4 * wl.max_num_seqs * -(-(wl.chunk_size + 256) // 32), 512),
                      dtype="bf16", record_logits=record_logits, model_id=cfg.name,
                      layout=caches.CacheLayout(kv_dtype=kv_dtype), kernel=dispatch.KernelConfig(backend=kernels),
                      gpu_step_command_buffers=command_buffers)


class _BookkeepingSampler:
  """Wraps the runner's `device_state.apply` for one run: copies of the inputs of up to `keep` steps (after `skip`
  warm-up steps) are kept, then `device_ms` re-runs the same jitted program on fresh copies of each (its state is
  donated) and reports the median device wall per call."""

  def __init__(self, keep: int, skip: int):
    self.keep, self.skip, self.seen, self.samples = keep, skip, 0, []

  @contextlib.contextmanager
  def installed(self):
    real = runner_mod.device_state
    sampler = self

    class Proxy:
      def __getattr__(self, name):
        return getattr(real, name)

      @staticmethod
      def apply(state, plan, buf=None):
        sampler.seen += 1
        if sampler.skip < sampler.seen <= sampler.skip + sampler.keep:
          copy = lambda t: jax.tree_util.tree_map(lambda x: x.copy(), t)
          sampler.samples.append((copy(state), plan, buf))   # buf is not donated
        return real.apply(state, plan, buf)

    runner_mod.device_state = Proxy()
    try:
      yield self
    finally:
      runner_mod.device_state = real

  def device_ms(self, repeats: int = 3) -> float | None:
    times = []
    for state, plan, buf in self.samples:
      best = float("inf")
      for _ in range(repeats + 1):
        st = jax.tree_util.tree_map(lambda x: x.copy(), state)
        jax.block_until_ready(st)
        t0 = time.perf_counter()
        jax.block_until_ready(device_state.apply(st, plan, buf))
        best = min(best, time.perf_counter() - t0)
      times.append(best * 1e3)
    self.samples.clear()
    return statistics.median(times) if times else None


def serve(params, cfg, ec, prompts, max_tokens: int, *, bookkeeping_samples: int = 0) -> dict:
  """Every prompt through one fresh engine, step by step; the outputs and the step measurements."""
  sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
  t_build = time.perf_counter()
  eng = Engine(params, cfg, ec)
  build_s = time.perf_counter() - t_build
  runner = eng.runner
  # Each dispatched step's (rows, tokens) by its handle; `collected` lists the steps read back during one
  # Engine.step call. With async scheduling a call sends step N and reads step N-1 (its wait is N-1's device time),
  # so a call's wall is counted for the step it read: for a synchronous engine that is the step it sent.
  info, collected, collect_s = {}, [], [0.0]
  real_dispatch, real_collect = runner.dispatch, runner.collect

  def dispatch(rows):
    handle = real_dispatch(rows)
    info[id(handle)] = (len(rows), sum(len(r.tokens) for r in rows))
    return handle

  def collect(d):
    t0 = time.perf_counter()
    try:
      return real_collect(d)
    finally:
      collect_s[0] += time.perf_counter() - t0
      collected.append(info.pop(id(d), None))

  runner.dispatch, runner.collect = dispatch, collect      # this engine's runner only: measured, not changed
  sampler = _BookkeepingSampler(bookkeeping_samples, skip=2)
  rids = [f"r{i}" for i in range(len(prompts))]
  steps = []
  t0 = time.perf_counter()
  with sampler.installed():
    for rid, p in zip(rids, prompts):
      eng.add_request(rid, p, sp)
    while eng.has_work():
      collected.clear()
      c_before = collect_s[0]
      s0 = time.perf_counter()
      eng.step()
      wall = time.perf_counter() - s0
      read = [c for c in collected if c is not None]
      if read:
        rows, toks = read[-1]
        steps.append(dict(kind="decode" if toks == rows else "prefill", rows=rows, tokens=toks, wall=wall,
                          host=wall - (collect_s[0] - c_before)))
  wall = time.perf_counter() - t0
  outs = eng.take_outputs(rids)
  bookkeeping_ms = sampler.device_ms() if bookkeeping_samples else None
  rep = eng.compile_report()
  # the first steps compile: step times are read from the steps after the first two of each kind
  res = dict(outputs=outs, wall_s=wall, build_s=build_s, steps=len(steps), compilations=rep["compilations"],
             compile_s=rep["compile_seconds"], preemptions=int(eng.stats.get("preemptions", 0)),
             bookkeeping_ms=bookkeeping_ms)
  for kind in ("decode", "prefill"):
    ks = [s for s in steps if s["kind"] == kind][2:]
    res[f"{kind}_steps"] = len(ks)
    res[f"{kind}_step_ms"] = 1e3 * statistics.median([s["wall"] for s in ks]) if ks else None
    res[f"{kind}_host_ms"] = 1e3 * statistics.median([s["host"] for s in ks]) if ks else None
    res[f"{kind}_rows"] = statistics.median([s["rows"] for s in ks]) if ks else None
    res[f"{kind}_tokens"] = statistics.median([s["tokens"] for s in ks]) if ks else None
  gen = sum(len(o.output) for o in outs)
  prompt = sum(len(o.prompt) for o in outs)
  hit = sum(o.hit_tokens for o in outs)
  res.update(generated_tokens=gen, prompt_tokens=prompt, hit_tokens=hit, gen_tok_per_s=gen / wall,
             computed_tok_per_s=(prompt - hit + gen) / wall)
  return res


def roofline_ms(cfg, kind: str, batch: float | None, context: int, kv: str, design: str = "blocked") -> float | None:
  """The roofline of `design` at this point (benchmarks/support/step_cost.py: "blocked" is the step as built, "plain"
  a non-invariant step; None where it cannot cost the point): random bf16 weights, so experts and projections
  stored bf16."""
  if not batch:
    return None
  try:
    point = sc.Point(kind, int(round(batch)), int(context))
    cost = sc.step_cost(cfg, point, design, sc.H200, sc.Formats(experts="bf16", kv=kv, projections="bf16"))
    return cost.time_s * 1e3
  except Exception:  # noqa: BLE001 - a cost model that cannot cost this config leaves the column empty
    return None


def compare_logits(a_outs, b_outs) -> dict:
  """First divergent token (request, position) and max |dlogit| over the positions both computed with the same
  inputs (beside the largest |logit| there, for scale)."""
  first, max_d, max_l, equal = None, 0.0, 0.0, 0
  for i, (a, b) in enumerate(zip(a_outs, b_outs)):
    if list(a.output) == list(b.output):
      equal += 1
    elif first is None:
      pos = next(j for j, (x, y) in enumerate(zip(list(a.output) + [None], list(b.output) + [None])) if x != y)
      first = f"{a.rid}@{pos}"
    if a.token_logits is not None and b.token_logits is not None:
      for j, (la, lb) in enumerate(zip(a.token_logits, b.token_logits)):
        if list(a.output[:j]) != list(b.output[:j]):
          break                       # past a divergence the inputs differ: not a like-for-like logit
        la, lb = np.asarray(la, np.float32), np.asarray(lb, np.float32)
        max_d = max(max_d, float(np.max(np.abs(la - lb))))
        max_l = max(max_l, float(np.max(np.abs(la))))
  return dict(requests_equal=f"{equal}/{len(a_outs)}", first_divergent=first, max_dlogit=max_d, max_abs_logit=max_l)


def bitwise_alone(batched_outs, alone_outs) -> dict:
  same_tokens = all(list(a.output) == list(b.output) for a, b in zip(batched_outs, alone_outs))
  same_logits = all(a.token_logits is not None and b.token_logits is not None and len(a.token_logits) ==
                    len(b.token_logits) and all(np.array_equal(np.asarray(x), np.asarray(y))
                                                for x, y in zip(a.token_logits, b.token_logits))
                    for a, b in zip(batched_outs, alone_outs))
  return dict(tokens_equal=same_tokens, logits_bitwise=same_logits)
