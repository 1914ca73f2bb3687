"""The composition matrix: every serving mode of the engine against every other. The checks live here so that
tests/dsv4/test_composition.py runs the one-device rows in the pytest process and the mesh rows in a child with 8
host devices (the host device count is fixed when JAX starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.dsv4.composition_worker v4 ROW,ROW DIR

(ROW: a `Combo.name`, e.g. mesh-fp32-tiers-interpret.) Exits non-zero on any mismatch; prints one line per row
and OK at the end.

Factors: {one device, mesh (2, 2, 2)} x {fp32, bf16, FP8 KV} x {no tiers, host + disk with a small pool} x
{XLA, interpret kernels} (every step is batch invariant). Each row runs one trace (below) and checks
* greedy tokens equal to a cold one-device engine (no tiers, no prefix caching, XLA) at the same KV precision,
  request by request;
* recorded logits within `TOL[kv]` of `model.forward_full` over the same tokens, its cache at the row's KV
  precision, on the row's kernels (see TOL);
* prefix hits > 0 (caching is on in every row), and tier hits > 0 with demoted blocks where tiers are on;
* the request that shared its steps with another gives bitwise the same logits when run alone on a fresh engine of
  the same combo.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import time

import jax
import numpy as np

from dsv4 import caches, mesh_context, model, sharding
from dsv4.config import ModelConfig, v4_tiny, v41_tiny
from dsv4.engine.api import generate
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.tiering_config import TieringConfig
from pallas_kernels import dispatch
from pallas_kernels.grouped_dot import GroupedDotTuning

MESH = (2, 2, 2)
MAX_LEN = 128
KV = {"fp32": caches.KV_DTYPES["fp32"], "bf16": caches.KV_DTYPES["bf16"], "fp8": caches.FP8}
# The interpret rows' grouped expert tiles divide the tiny experts' shapes, so their routed experts take the kernel
# (one device; a mesh that splits the experts runs the loop).
SMALL_EXPERT_TILES = GroupedDotTuning(block_cols=16, block_k=16)
FACTORS = {"mesh": (False, True), "kv": ("fp32", "bf16", "fp8"), "tiers": (False, True),
           "kernels": ("xla", "interpret")}
# Max |engine logits - forward_full logits| / max |forward_full logits|, forward_full's contiguous cache storing K/V
# at the row's precision (so both round every cached entry the same way). fp32: only the summation order differs
# (measured <= 1.5e-6). bf16 / FP8: an entry whose fp32 value differs in its last bits between the two paths (paged
# chunked writes vs one contiguous prefill) can round to the neighbouring bf16 (2^-8 relative) or e4m3 (2^-3 times
# its block scale) value, and V4.1's shared / reused KV carries such a flip into later layers; measured maxima bf16
# 2.2e-4 (V4) and 1.4e-3 (V4.1, the cold engine too), FP8 5.1e-5 (V4) and 5.3e-4 (V4.1), so 5e-3 (about one bf16
# ulp) leaves room for a few flips. Against the fp32 model (forward_full with fp32 K/V) the KV rounding itself shows:
# bf16 up to 1.1e-2, FP8 up to 6.3e-1 on the mesh rows' 8-head V4 config (its 70-token requests), which no
# tolerance of a "same math" test should absorb, hence the same-precision reference. And the row's kernels: a
# kernel sums in another order than its XLA reference, and over layers such last-bit differences can flip a near tie
# (on an AVX2 machine the V4.1 bf16 interpret row's request A was 1.6e-2 from the XLA forward_full, with the sparse
# attention and the row-dot / grouped-dot kernels on together; 0 from forward_full on the same kernels); each
# kernel's accuracy against its reference is tests/pallas_kernels' check.
TOL = {"fp32": 1e-4, "bf16": 5e-3, "fp8": 5e-3}


@dataclasses.dataclass(frozen=True)
class Combo:
  mesh: bool
  kv: str
  tiers: bool
  kernels: str

  @property
  def name(self) -> str:
    return "-".join(("mesh" if self.mesh else "one", self.kv, "tiers" if self.tiers else "notiers", self.kernels))

  @staticmethod
  def parse(name: str) -> "Combo":
    m, kv, t, k = name.split("-")
    return Combo(m == "mesh", kv, t == "tiers", k)


# Every pair of values of any two factors is in at least one row (tests/dsv4/test_composition.py checks it).
ALL_PAIRS = [Combo(False, "fp32", False, "xla"), Combo(True, "fp32", True, "interpret"),
             Combo(False, "bf16", True, "interpret"), Combo(True, "bf16", False, "xla"),
             Combo(False, "fp8", False, "interpret"), Combo(True, "fp8", True, "xla")]
FULL = [Combo(*v) for v in itertools.product(*FACTORS.values())]
REFUSED: dict[str, str] = {}      # matrix rows excluded: none


def config(variant: str, mesh: bool) -> ModelConfig:
  """The smallest tiny config with window, CSA and HCA layers (V4: 3 layers, one of each; V4.1: the whole tiny
  model), with the FP8-capable, mesh-splittable widths of `tiers_precision_worker.widen`."""
  from tests.dsv4.tiers_precision_worker import widen
  return widen(v4_tiny(num_layers=3) if variant == "v4" else v41_tiny(), mesh)


def kernel_config(kernels: str) -> dispatch.KernelConfig:
  """The kernels of a row ("xla" or "interpret"), for its engine and for its forward_full reference alike."""
  return dispatch.KernelConfig(kernels, grouped_dot_tuning=SMALL_EXPERT_TILES)


def engine_config(combo: Combo, D: int, tmp: str, tag: str = "") -> EngineConfig:
  """Few step programs (their compiles dominate on CPU): 8-token steps (one token bucket), 32-token full blocks and
  a 128-token limit with tables of the whole limit (one table width). With tiers: 3 full blocks per data shard, so
  the trace's long request evicts (and demotes) the first turn's block; without: room for everything, so the
  second turn hits the device cache."""
  tc = None
  if combo.tiers:
    tc = TieringConfig(tiers=("host", "disk"), disk_dir=os.path.join(tmp, f"{combo.name}{tag}"), policy="load",
                       write_queue=0)
  layout = caches.CacheLayout(swa_block_tokens=32, full_block_tokens=32, kv_dtype=KV[combo.kv])
  return EngineConfig(max_num_seqs=2, max_num_batched_tokens=8, chunk_size=8, max_model_len=MAX_LEN,
                      num_full_blocks=(3 if combo.tiers else 8) * D, num_swa_blocks=16 * D, record_logits=True,
                      layout=layout, kernel=kernel_config(combo.kernels), tiering=tc)


def cold_config(kv: str) -> EngineConfig:
  return dataclasses.replace(engine_config(Combo(False, kv, False, "xla"), 1, ""), enable_prefix_caching=False)


@dataclasses.dataclass
class Trace:
  """turn 1: A (40 tokens) next to B (12 tokens), 4 answer tokens each (A's first 32-token block is cached); then
  `n_long` long requests (70 tokens: 3 full blocks each, one per data shard), which under the tiers' small pool
  evict and demote A's block; then A2 = A + answer + 10 tokens, which hits A's 32 tokens (device or tiers)."""
  a: list
  b: list
  longs: list

  @staticmethod
  def make(cfg, n_long: int) -> "Trace":
    rng = np.random.default_rng(7)
    V = cfg.vocab_size
    draw = lambda n: [int(x) for x in rng.integers(2, V, n)]
    return Trace(draw(40), draw(12), [draw(70) for _ in range(n_long)])


SP = SamplingParams(max_tokens=4, ignore_eos=True)


def run_trace(eng: Engine, cfg, tr: Trace):
  """Returns the outputs of [A, B, *longs, A2] in that order."""
  a, b = generate(None, cfg, [tr.a, tr.b], SP, engine=eng)
  longs = generate(None, cfg, tr.longs, SamplingParams(max_tokens=2, ignore_eos=True), engine=eng)
  a2 = tr.a + a.output + tr.a[:10]
  (o2,) = generate(None, cfg, [a2], SP, engine=eng)
  outs = [a, b, *longs, o2]
  for o in outs:
    if o.error:
      raise AssertionError(f"request {o.rid} failed: {o.error}")
  return outs


def logits_of(eng: Engine, outs):
  return [np.stack(o.token_logits) for o in outs]


def forward_full_logits(params, cfg, outs, kv: str = "fp32", kernels: str = "xla") -> list[np.ndarray]:
  """forward_full over each request's prompt + output (one padded batch; causal, so the padding after a sequence
  changes nothing before it), at the positions that produced each output token; its contiguous cache stores K/V at
  the precision `kv`, its attention and experts run on `kernels` (the row's: see TOL)."""
  T = MAX_LEN
  toks = np.zeros((len(outs), T), np.int32)
  for i, o in enumerate(outs):
    seq = o.prompt + o.output[:-1]
    toks[i, :len(seq)] = seq
  _, logits = model.forward_full(params, cfg, toks, layout=caches.CacheLayout(kv_dtype=KV[kv]),
                                 kernel_cfg=kernel_config(kernels))
  logits = np.asarray(logits)
  return [logits[i, len(o.prompt) - 1: len(o.prompt) - 1 + len(o.output)] for i, o in enumerate(outs)]


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
  return float(np.max(np.abs(got.astype(np.float64) - want)) / max(float(np.max(np.abs(want))), 1e-30))


class Cold:
  """Per variant: the config, params, trace, and per KV precision the cold one-device engine's outputs."""

  def __init__(self, variant: str, mesh: bool):
    self.cfg = config(variant, mesh)
    self.params = model.init_params(self.cfg, jax.random.PRNGKey(0))
    self.trace = Trace.make(self.cfg, n_long=MESH[0] if mesh else 1)
    self._outs = {}

  def outs(self, kv: str):
    return self.run(kv)[0]

  def run(self, kv: str):
    """(outputs, recorded logits) of the cold engine at this KV precision."""
    if kv not in self._outs:
      eng = Engine(self.params, self.cfg, cold_config(kv))
      outs = run_trace(eng, self.cfg, self.trace)
      self._outs[kv] = (outs, logits_of(eng, outs))
    return self._outs[kv]



def check(combo: Combo, cold: Cold, tmp: str, mesh=None) -> str:
  """One row of the matrix (see the module docstring); returns a summary line, raises AssertionError on a miss."""
  t0 = time.time()
  cfg, params = cold.cfg, cold.params
  # On a mesh: the mesh default, pools split over data (batch invariance included: every data shard's token loop
  # runs the longest shard's count, padding tokens writing nothing).
  over_data = mesh is not None
  D = mesh_context.axis_size(mesh, "data") if over_data else 1
  eng = Engine(params, cfg, engine_config(combo, D, tmp), mesh=mesh, pools_over_data=over_data)
  try:
    outs = run_trace(eng, cfg, cold.trace)
    st = dict(eng.tiering.stats) if eng.tiering is not None else {}
  finally:
    if eng.tiering is not None:
      eng.tiering.close()
  want = cold.outs(combo.kv)
  names = ["A", "B"] + [f"long{i}" for i in range(len(cold.trace.longs))] + ["A2"]
  bad = [n for n, o, w in zip(names, outs, want) if o.output != w.output]
  assert not bad, f"{combo.name}: tokens differ from the cold engine's for {bad}: " \
      f"{[(o.output, w.output) for o, w in zip(outs, want)]}"
  got = logits_of(eng, outs)
  ref = forward_full_logits(params, cfg, outs, combo.kv, combo.kernels)
  errs = [rel_err(g, r) for g, r in zip(got, ref)]
  err = max(errs)
  if err > TOL[combo.kv]:
    cold_logits = cold.run(combo.kv)[1]
    raise AssertionError(
        f"{combo.name}: logits {err:.2e} from forward_full (tolerance {TOL[combo.kv]:.0e}); per request "
        f"{dict(zip(names, (f'{e:.1e}' for e in errs)))}; the cold engine's "
        f"{dict(zip(names, (f'{rel_err(c, r):.1e}' for c, r in zip(cold_logits, ref))))}; from the cold engine's "
        f"{dict(zip(names, (f'{rel_err(g, c):.1e}' for g, c in zip(got, cold_logits))))}")
  hit, tier_hit = outs[-1].hit_tokens, outs[-1].tier_hit_tokens
  assert hit > 0, f"{combo.name}: no prefix hit for A2"
  if combo.tiers:
    assert tier_hit > 0 and st.get("demoted_blocks", 0) > 0 and st.get("rejected_records", 0) == 0, \
        f"{combo.name}: tier hit {tier_hit}, stats {st}"
  else:
    assert tier_hit == 0
  # B shared its steps with A: alone on a fresh engine of the same combo, the same bits
  solo = Engine(params, cfg, engine_config(combo, D, tmp, tag="-alone"), mesh=mesh, pools_over_data=over_data)
  try:
    (ob,) = generate(None, cfg, [cold.trace.b], SP, engine=solo)
  finally:
    if solo.tiering is not None:
      solo.tiering.close()
  lb = np.stack(ob.token_logits)
  assert ob.output == outs[1].output and np.array_equal(lb.view(np.uint32), got[1].view(np.uint32)), \
      f"{combo.name}: B alone is not bitwise B batched (max diff {np.max(np.abs(lb - got[1])):.2e})"
  return (f"{combo.name}: tokens == cold, logits {err:.2e} of forward_full (tol {TOL[combo.kv]:.0e}), hit {hit} "
          f"(tier {tier_hit}), B alone == batched bit for bit ({time.time() - t0:.1f} s)")


if __name__ == "__main__":
  variant, rows, tmp = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
  if jax.device_count() < 8:
    sys.exit(f"needs 8 devices, got {jax.device_count()} (set XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  mesh = sharding.make_mesh(MESH)
  cold = Cold(variant, mesh=True)
  failed = []
  for r in rows:
    combo = Combo.parse(r)
    try:
      print(check(combo, cold, tmp, mesh if combo.mesh else None), flush=True)
    except AssertionError as e:
      print(f"FAIL {e}", flush=True)
      failed.append(r)
  if failed:
    sys.exit(f"FAIL {len(failed)} of {len(rows)} rows: {failed}")
  print("OK")
