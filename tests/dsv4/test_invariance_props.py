"""Batch invariance by construction, as a property: on random traces (batch mixes, arrival waves, chunk sizes,
prefix caching on / off, async on / off, greedy and seeded sampling, a pool small enough to preempt; in the slow
tier also drafts on / off and host-tier reloads), in bf16 compute with bf16 or FP8 KV, every request's tokens and
recorded logits are bitwise those of the same request run alone on a fresh engine (with drafts: alone with the same
k, since a sampled row's draws follow its verifications; greedy rows equal drafts off too,
tests/dsv4/test_dspark_engine.py). The claim depends on the code XLA generates, so each test runs in a child process at XLA's
default optimisation level (tests/isolation.py), as users run.

On a fixed mesh (2, 2, 2) = data x tensor x expert, pools split over `data`, the same property: the traces and the
comparison are these, the engines (batched and alone) run on the mesh, in a child with 8 host devices. Admission
places a request on a data shard (longest hit, most free blocks, fewest rows), so alone and batched it may run on
different shards: the bits must not change. Async scheduling is not active on a mesh (`Engine.async_active`), so
its draw changes nothing there; drafts are refused on a mesh (one device only), so those traces have none (the
slow tier's tier reloads included).

Every engine here shares one `EngineConfig` shape (rows, token budget, tile), so one compiled step program per pool
shape serves every example of a test: the traces vary only what the scheduler decides. The default tier's draw runs
every engine, batched and alone, on one pool (`ONE_POOL`: a request alone fits it, a batch preempts), as the mesh
draws do: one pool shape, so its child compiles the step and the cache's bookkeeping once each (at XLA's default
level, a second pool shape was a third of its run); the other draws keep the roomy pool beside the tight one, so a
request's bits must also ignore the pool's size."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from dsv4 import caches, config, model, sharding
from dsv4.engine.api import generate
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams
from tests.dsv4.tiers_precision_worker import widen
from tests.isolation import run_in_child

# The one step shape of these tests: 4 rows, 64 tokens, tables at max_model_len 384.
ROOMY = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, chunk_size=32, max_model_len=384,
                     num_full_blocks=12, num_swa_blocks=40, record_logits=True, dtype="bf16")
# Same step program, a pool that preempts when four requests run (cache shapes differ: a second compile).
TIGHT = dataclasses.replace(ROOMY, num_full_blocks=3, num_swa_blocks=9)
# The default draw's one pool for every engine: a request alone fits it; small enough that the reload trace (below)
# preempts and large enough that it hits the prefix cache (the test asserts both over its traces).
ONE_POOL = dataclasses.replace(ROOMY, num_full_blocks=4, num_swa_blocks=12)
PREFIXES = 3          # shared document prefixes the prompts draw from (prefix hits)
MESH = (2, 2, 2)      # data x tensor x expert; tiny V4 / V4.1 split 4 heads, 2 output groups, 8 experts over it
# On the mesh every engine, batched or alone, has TIGHT's pool per data shard (2 of the 4 rows there): a mesh engine
# compiles its step anew (the persistent cache serves the later engines), so one cache shape means one compile. A
# request alone always fits it; two long requests on one shard preempt.
MESH_POOL = dataclasses.replace(ROOMY, num_full_blocks=3 * MESH[0], num_swa_blocks=9 * MESH[0])


def _model(variant: str, kv: str, drafter: bool = False):
  cfg = config.v4_tiny(num_layers=3) if variant == "v4" else config.v41_tiny()
  if kv == "fp8":
    cfg = widen(cfg, mesh=False)        # the FP8 record needs 64-channel blocks
  if drafter and variant == "v4":
    cfg = dataclasses.replace(cfg, num_mtp_layers=1)
  elif drafter:
    cfg = dataclasses.replace(cfg, num_mtp_layers=2, dspark=config.DSparkConfig(
        block_size=4, target_layer_ids=(4, 7), markov_rank=8, noise_token_id=1, n_routed_experts=4,
        num_experts_per_tok=2))
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  layout = caches.CacheLayout(kv_dtype=caches.FP8 if kv == "fp8" else jnp.bfloat16)
  return cfg, params, layout


@st.composite
def traces(draw, vocab: int, with_drafts: bool = False, with_tiers: bool = False):
  """Requests (prompt, sampling), plus the scheduler's choices for the batched run."""
  rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
  # documents past one 128-token full block, so a request that shares one can hit it
  prefixes = [[int(t) for t in rng.integers(2, vocab, int(rng.integers(130, 300)))] for _ in range(PREFIXES)]
  reqs = []
  for i in range(draw(st.integers(2, 5))):
    head = prefixes[draw(st.integers(0, PREFIXES - 1))][:draw(st.integers(0, 300))]
    tail = [int(t) for t in rng.integers(2, vocab, draw(st.integers(1, 40)))]
    temperature = draw(st.sampled_from([0.0, 0.8]))
    sp = SamplingParams(max_tokens=draw(st.integers(1, 4)), temperature=temperature, top_k=16, seed=i,
                        ignore_eos=True)
    reqs.append((head + tail, sp))
  run = dict(chunk_size=draw(st.sampled_from([4, 8, 16, 32, 64])),
             enable_prefix_caching=draw(st.booleans()), async_scheduling=draw(st.booleans()),
             tight=draw(st.booleans()), waves=draw(st.integers(1, 3)),
             drafts=draw(st.sampled_from([0, 3])) if with_drafts else 0,
             tiers=draw(st.booleans()) if with_tiers else False)
  if run["tiers"]:     # a reload needs a block evicted by the tight pool and asked for again by a later wave
    run.update(tight=True, enable_prefix_caching=True, waves=3)
  return reqs, run


def _reload_trace(vocab: int, drafts: int = 3, tiers: bool = True, mesh: bool = False):
  """A trace that hits, preempts and (tiers) reloads from the tier for certain: a document read, then a long
  request the tight pool can only hold by evicting (demoting) the document's blocks, then the document read again.
  On the mesh each data shard has its own pool, so a second long request comes with the document (waves: the
  document and one long request, the other long request, the document again): one lands on the document's shard.
  Every property below runs it beside its drawn traces, so what a test asserts it saw does not hang on the draws
  of one Hypothesis version (derandomized draws change with the version)."""
  rng = np.random.default_rng(7)
  doc = [int(t) for t in rng.integers(2, vocab, 270)]
  others = [[int(t) for t in rng.integers(2, vocab, 300)] for _ in range(2 if mesh else 1)]
  sp = SamplingParams(max_tokens=3, ignore_eos=True)
  run = dict(chunk_size=64, enable_prefix_caching=True, async_scheduling=False, tight=True, waves=3, drafts=drafts,
             tiers=tiers)
  return [(p, sp) for p in [doc + [5], *others, doc + [9, 4]]], run


class _Alone:
  """Each request's tokens and logits alone on a fresh roomy engine (memoised across examples), and the data shard
  it ran on; on `mesh` if given (the mesh is fixed, only the batch varies)."""

  def __init__(self, cfg, params, ec, mesh=None):
    self.cfg, self.params, self.ec, self.mesh, self.memo = cfg, params, ec, mesh, {}

  def __call__(self, prompt, sp, drafts: int = 0):
    key = (tuple(prompt), sp, drafts)
    if key not in self.memo:
      eng = Engine(self.params, self.cfg, dataclasses.replace(self.ec, num_speculative_tokens=drafts),
                   mesh=self.mesh)
      shard = []
      eng.on_finish = lambda r: shard.append(r.shard)
      (o,) = generate(self.params, self.cfg, [prompt], sp, engine=eng)
      assert o.error is None, o.error
      self.memo[key] = (o.output, np.stack(o.token_logits), shard[0])
    return self.memo[key]


def _batched(cfg, params, ec, reqs, waves: int, mesh=None, before_wave=None):
  """All requests through one engine, submitted in `waves` groups (each after the previous group's first steps);
  before_wave(engine, w), if given, runs before each later group w is submitted."""
  eng = Engine(params, cfg, ec, mesh=mesh)
  groups = np.array_split(np.arange(len(reqs)), waves)
  for w, g in enumerate(groups):
    if w and before_wave is not None:
      before_wave(eng, w)
    for i in g:
      eng.add_request(f"r{i}", reqs[i][0], reqs[i][1])
    for _ in range(2):
      if eng.has_work():
        eng.step()
  while eng.has_work():
    eng.step()
  return eng, [eng.requests[f"r{i}"] for i in range(len(reqs))]


def _check(variant: str, kv: str, examples: int, drafts: bool = False, tiers: bool = False, mesh=None,
           budget: int | None = None, one_pool: bool = False):
  """one_pool: every engine, batched or alone, on ONE_POOL (one device only)."""
  cfg, params, layout = _model(variant, kv, drafts)
  tight = ONE_POOL if one_pool else TIGHT if mesh is None else MESH_POOL
  roomy = dataclasses.replace(tight if one_pool else ROOMY if mesh is None else MESH_POOL, layout=layout)
  if budget is not None:       # another token budget: another step shape (one more compile per pool shape)
    roomy, tight = (dataclasses.replace(c, max_num_batched_tokens=budget) for c in (roomy, tight))
  alone = _Alone(cfg, params, roomy, mesh)
  seen = {"preemptions": 0, "hits": 0, "drafted": 0, "tier_hits": 0, "shards_differ": 0}

  @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
  @given(traces(cfg.vocab_size, drafts, tiers))
  @example(_reload_trace(cfg.vocab_size, 3 if drafts else 0, tiers, mesh=mesh is not None))
  def prop(trace):
    reqs, run = trace
    tc = None
    if run["tiers"]:
      from dsv4.engine.tiering_config import TieringConfig
      tc = TieringConfig(tiers=("host",), policy="load", write_queue=0)
    ec = dataclasses.replace(tight if run["tight"] else roomy, layout=layout, chunk_size=run["chunk_size"],
                             enable_prefix_caching=run["enable_prefix_caching"],
                             async_scheduling=run["async_scheduling"], num_speculative_tokens=run["drafts"],
                             tiering=tc)
    eng, outs = _batched(cfg, params, ec, reqs, run["waves"], mesh)
    seen["preemptions"] += eng.stats["preemptions"]
    seen["hits"] += sum(r.hit_tokens + r.readmit_hit_tokens for r in outs)
    seen["drafted"] += eng.stats["spec_draft_tokens"]
    # tokens loaded from the tier at any admission (a request preempted after its first admission reloads on its
    # readmission, which Request.tier_hit_tokens does not count)
    seen["tier_hits"] += eng.tiering.stats["tier_hit_tokens"] if eng.tiering is not None else 0
    for (prompt, sp), r in zip(reqs, outs):
      assert r.error is None, r.error
      want_tokens, want_logits, alone_shard = alone(prompt, sp, run["drafts"])
      seen["shards_differ"] += r.shard != alone_shard      # finished on another data shard than alone
      assert r.output == want_tokens, (run, len(prompt))
      got = np.stack(r.token_logits)
      assert np.array_equal(got.view(np.uint32), want_logits.view(np.uint32)), (run, len(prompt))

  prop()
  return seen


@pytest.mark.parametrize("variant,kv", [("v4", "bf16")])
def test_invariant_logits_on_random_traces(variant, kv, request):
  """The default tier's draw: V4, bf16 compute and KV, two traces (derandomized in CI) and the reload trace, every
  engine on `ONE_POOL` (one pool shape: one compile of each program in the child); they must have preempted and hit
  the prefix cache."""
  if run_in_child(request, default_xla_opt=True):
    return
  seen = _check(variant, kv, examples=2, one_pool=True)
  assert seen["preemptions"] > 0 and seen["hits"] > 0, seen


@pytest.mark.parametrize("variant,kv", [("v4", "fp8"), ("v41", "bf16"), ("v41", "fp8")])
def test_invariant_logits_on_random_traces_every_variant(variant, kv, request):
  """V4 and V4.1, bf16 and FP8 KV, more traces; the traces must have preempted and hit the prefix cache."""
  if run_in_child(request, default_xla_opt=True):
    return
  seen = _check(variant, kv, examples=10)
  assert seen["preemptions"] > 0 and seen["hits"] > 0, seen


@pytest.mark.parametrize("variant,kv", [("v4", "bf16"), ("v41", "fp8")])
def test_invariant_logits_with_drafts_and_tier_reloads(variant, kv, request):
  """The same property with the model's drafter (V4: MTP, V4.1: DSpark) drafting 0 or 3 tokens per step and a
  host tier under the tight pool: the traces must have drafted, preempted and reloaded from the tier."""
  if run_in_child(request, default_xla_opt=True):
    return
  seen = _check(variant, kv, examples=8, drafts=True, tiers=True)
  assert seen["drafted"] > 0 and seen["preemptions"] > 0 and seen["tier_hits"] > 0, seen


@pytest.mark.slow
def test_invariant_logits_at_a_gpus_row_blocks(request, monkeypatch):
  """The property with the row blocks the engine uses on a GPU (`row_invariant.GPU_BLOCKING`: 128 rows), on the CPU:
  V4, bf16, a budget of 200 tokens (a step of 256 rows, two blocks), so a batched step's live rows span blocks
  that a request alone fills differently."""
  if run_in_child(request, default_xla_opt=True):
    return
  from dsv4.layers import row_invariant
  monkeypatch.setattr(row_invariant, "blocking", lambda: row_invariant.GPU_BLOCKING)
  _check("v4", "bf16", examples=3, budget=200)


def _mesh_child(request, monkeypatch) -> bool:
  """As run_in_child (at XLA's default level), the child with 8 host devices for the fixed mesh."""
  flags = os.environ.get("XLA_FLAGS", "")
  monkeypatch.setenv("XLA_FLAGS", f"{flags} --xla_force_host_platform_device_count=8".strip())
  if run_in_child(request, timeout_s=3000, default_xla_opt=True):
    return True
  assert jax.device_count() >= 8, jax.device_count()
  return False


def test_invariant_logits_on_random_traces_on_a_mesh(request, monkeypatch):
  """The smallest mesh draw (slow tier, tests/slow_tier.py: a mesh engine compiles for about a minute): V4, bf16
  compute and KV, two traces on the fixed mesh (2, 2, 2), pools over data, alone on the same mesh; some request
  must have finished on another data shard than alone."""
  if _mesh_child(request, monkeypatch):
    return
  seen = _check("v4", "bf16", examples=2, mesh=sharding.make_mesh(MESH))
  assert seen["shards_differ"] > 0, seen


@pytest.mark.parametrize("variant,kv", [("v41", "bf16"), ("v41", "fp8")])   # FP8 KV: V4.1's (V4 FP8 on one device)
def test_invariant_logits_on_random_traces_on_a_mesh_every_variant(variant, kv, request, monkeypatch):
  """V4 and V4.1, bf16 and FP8 KV, more traces on the fixed mesh: they must have preempted, hit the prefix cache
  and run requests on another data shard than alone."""
  if _mesh_child(request, monkeypatch):
    return
  seen = _check(variant, kv, examples=8, mesh=sharding.make_mesh(MESH))
  assert seen["preemptions"] > 0 and seen["hits"] > 0 and seen["shards_differ"] > 0, seen


def test_invariant_logits_with_tier_reloads_on_a_mesh(request, monkeypatch):
  """The same property with a host tier under the tight pool on the fixed mesh (V4, bf16; no drafts, refused on a
  mesh): the traces must have preempted and reloaded from the tier."""
  if _mesh_child(request, monkeypatch):
    return
  seen = _check("v4", "bf16", examples=6, tiers=True, mesh=sharding.make_mesh(MESH))
  assert seen["preemptions"] > 0 and seen["tier_hits"] > 0, seen
