"""Speculative decoding with the MTP block (EngineConfig.num_speculative_tokens): drafts never change a greedy
answer (with preemption and prefix hits, with drafts the block proposed and with drafts forced to be partly wrong),
sampled rows keep the target distribution (chi-square on the verifier), pools return to their free counts, and a
prefix hit carries the MTP block's window so a resumed request drafts as if it had computed everything."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import config, model
from dsv4.engine import sampling
from dsv4.engine.api import WorkloadReport
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams
from experiments import train_lib

EC = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, chunk_size=32, max_model_len=512, num_full_blocks=5,
                  num_swa_blocks=20)


@pytest.fixture(scope="module")
def trained():
  """The shipped retrieval model with its trained MTP block (experiments/train_mtp.py)."""
  return train_lib.load_trained("v4_retrieval_mtp")


@pytest.fixture(scope="module")
def hca():
  """Random weights, window + CSA + HCA layers (every compressor state the verifier must roll back)."""
  cfg = dataclasses.replace(config.v4_tiny(num_layers=3), num_mtp_layers=1)
  return cfg, model.init_params(cfg, jax.random.PRNGKey(3))


def _free(eng):
  m = eng.cache_manager
  return {g: m.num_free_blocks(g) for g in m.groups}


def _prompts(cfg, seed, lengths, shared=0):
  rng = np.random.default_rng(seed)
  head = list(rng.integers(1, cfg.vocab_size, size=shared))
  return [head + list(rng.integers(1, cfg.vocab_size, size=int(n))) for n in lengths]


def _run(params, cfg, ec, prompts, max_tokens, force=None):
  """Runs prompts to the end; force(req) -> drafts replaces the block's drafts before every step."""
  eng = Engine(params, cfg, ec)
  for i, p in enumerate(prompts):
    eng.add_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
  while eng.has_work():
    if force is not None:
      for r in eng.running:
        if r.drafts:
          r.drafts = force(r)
    eng.step()
  return eng, [o.output for o in eng.outputs()]


def test_trained_drafts_give_the_same_greedy_tokens(trained):
  """The trained draft on prompts with a shared head, a pool small enough to preempt: the same tokens as without
  drafts, drafts accepted, hits and preemptions happened, every block back in the pool."""
  cfg, params = trained
  prompts = _prompts(cfg, 0, [70, 20, 150, 45], shared=130)
  base, want = _run(params, cfg, EC, prompts, 16)
  eng, got = _run(params, cfg, dataclasses.replace(EC, num_speculative_tokens=3), prompts, 16)
  assert eng.async_active and got == want
  assert eng.stats["spec_accepted_tokens"] > 0 and eng.stats["preemptions"] > 0
  assert sum(o.hit_tokens for o in eng.outputs()) > 0
  at = [eng.stats[f"spec_accepted_at_{d}"] for d in (1, 2, 3)]        # by depth: each needs the ones before it
  assert sum(at) == eng.stats["spec_accepted_tokens"] and at == sorted(at, reverse=True)
  assert eng.stats["spec_drafts_at_1"] == eng.stats["spec_rows"]
  assert eng.stats["steps"] < base.stats["steps"]
  assert _free(eng) == {"full": EC.num_full_blocks, "swa": EC.num_swa_blocks}
  s = WorkloadReport(eng.outputs(), 1.0, eng.stats, {}).summary()       # what serve's table and metrics show
  assert s["accepted_draft_tokens"] == eng.stats["spec_accepted_tokens"] and 1 < s["tokens_per_drafting_row"] <= 4
  assert "draft_tokens" not in WorkloadReport(base.outputs(), 1.0, base.stats, {}).summary()


def test_trained_drafts_synchronous(trained):
  """The same trace through the synchronous engine (drafts on the host between steps)."""
  cfg, params = trained
  prompts = _prompts(cfg, 0, [70, 20, 150, 45, 100], shared=130)
  _, want = _run(params, cfg, EC, prompts, 24)
  eng, got = _run(params, cfg, dataclasses.replace(EC, num_speculative_tokens=3, async_scheduling=False), prompts,
                  24)
  assert got == want and eng.stats["spec_accepted_tokens"] > 0 and eng.stats["preemptions"] > 0
  assert _free(eng) == {"full": EC.num_full_blocks, "swa": EC.num_swa_blocks}


def test_sampled_async_equals_sync(trained):
  """Seeded sampling with drafts: the async engine (rows filled and shifted on the device) draws exactly the tokens
  of the synchronous one, the keys following each token's index in the output."""
  cfg, params = trained
  prompts = _prompts(cfg, 3, [60, 25, 110], shared=40)
  outs = []
  for a in (True, False):
    eng = Engine(params, cfg, dataclasses.replace(EC, num_speculative_tokens=2, async_scheduling=a))
    for i, p in enumerate(prompts):
      eng.add_request(f"r{i}", p, SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=i,
                                                 ignore_eos=True))
    outs.append([o.output for o in eng.run()])
    assert eng.stats["spec_accepted_tokens"] > 0
  assert outs[0] == outs[1]


def test_partly_wrong_drafts_never_change_tokens(hca):
  """Drafts forced to the true continuation with random wrong tokens in it (every acceptance length, so every
  compressor-state rollback path runs, HCA and CSA and the indexer's): the same tokens, no block leaked."""
  cfg, params = hca
  prompts = _prompts(cfg, 1, [45, 90, 17, 64])
  ec = dataclasses.replace(EC, num_full_blocks=24, num_swa_blocks=64)
  _, want = _run(params, cfg, ec, prompts, 30)
  rng = np.random.default_rng(5)
  ref = {f"r{i}": w for i, w in enumerate(want)}

  def force(req):
    k = 3
    d = list(ref[req.rid][len(req.output):len(req.output) + k])
    if d and rng.random() < 0.7:
      j = int(rng.integers(0, len(d)))
      d[j] = (d[j] + 1 + int(rng.integers(0, cfg.vocab_size - 1))) % cfg.vocab_size
    return d

  # synchronous: the forced drafts are host values (async rows take the block's drafts on the device)
  eng, got = _run(params, cfg, dataclasses.replace(ec, num_speculative_tokens=3, async_scheduling=False), prompts,
                  30, force)
  assert got == want
  s = eng.stats
  assert 0 < s["spec_accepted_tokens"] < s["spec_draft_tokens"]
  assert _free(eng) == {"full": ec.num_full_blocks, "swa": ec.num_swa_blocks}


def test_prefix_hit_carries_the_mtp_window(trained):
  """A request resumed from a prefix hit drafts exactly what it drafts computed cold: the hit brought the MTP
  block's window KV (a layer of the sliding-window group) with the backbone's."""
  cfg, params = trained
  ec = dataclasses.replace(EC, num_speculative_tokens=2, num_full_blocks=24, num_swa_blocks=64)
  a, b = _prompts(cfg, 2, [150, 40], shared=0)
  target = a[:140] + b

  def first_drafts(warm):
    eng = Engine(params, cfg, ec)
    if warm:
      eng.add_request("w", a, SamplingParams(max_tokens=1, ignore_eos=True))
      eng.run()
    req = eng.add_request("t", target, SamplingParams(max_tokens=4, ignore_eos=True))
    while not req.output:
      eng.step()
    return req.hit_tokens, list(req.drafts), req.output[:1]

  cold, warm = first_drafts(False), first_drafts(True)
  assert cold[0] == 0 and warm[0] == 128
  assert warm[1:] == cold[1:]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_rejection_sampling_keeps_the_distribution(temperature, top_k, top_p):
  """Chi-square over 20,000 verifications on an 8-token vocabulary: the first output token (accepted draft or the
  draw after a rejection) follows the sampler's distribution, and so does the second given the first accepted."""
  V, n = 8, 20_000
  logits = jax.random.normal(jax.random.PRNGKey(7), (3, V)) * 1.5
  top = np.argsort(-np.asarray(logits), axis=-1)
  drafts = jnp.array([[top[0, 0], top[1, 1]]] * n, jnp.int32)   # the likeliest first draft, a less likely second
  lg = jnp.broadcast_to(logits, (n, 3, V))
  full = lambda x: jnp.full((n,), x)
  acc, toks = jax.jit(sampling.verify_drafts)(lg, drafts, full(2).astype(jnp.int32), full(temperature),
                                             full(top_k).astype(jnp.int32), full(top_p),
                                             jnp.arange(n, dtype=jnp.uint32), jnp.zeros((n,), jnp.int32))
  acc, toks = np.asarray(acc), np.asarray(toks)
  p = np.asarray(jax.nn.softmax(sampling.filtered_scores(logits, jnp.full((3,), temperature),
                                                         jnp.full((3,), top_k), jnp.full((3,), top_p))))

  def chi2_ok(samples, probs):
    counts = np.bincount(samples, minlength=V)
    live = probs > 0
    assert counts[~live].sum() == 0, "a token outside top-k / top-p was drawn"
    expected = probs[live] * len(samples)
    stat = ((counts[live] - expected) ** 2 / expected).sum()
    dof = live.sum() - 1
    return stat < dof + 6 * np.sqrt(2 * dof)          # ~ p > 1e-6 for these dof: a real bias fails, noise passes

  assert chi2_ok(toks[:, 0], p[0])
  second = toks[acc >= 1, 1]
  assert len(second) > 500 and chi2_ok(second, p[1])


def test_refusals(trained):
  cfg, params = trained
  no_mtp = dataclasses.replace(cfg, num_mtp_layers=0)
  with pytest.raises(ValueError, match="no drafter"):
    Engine({k: v for k, v in params.items() if k != "mtp"}, no_mtp, dataclasses.replace(EC, num_speculative_tokens=2))
  for bad in (dict(num_speculative_tokens=9),
              dict(num_speculative_tokens=40),
              dict(num_speculative_tokens=2, model_api="nnx")):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
      dataclasses.replace(EC, **bad).validate()


@pytest.mark.parametrize("kv,dtype", [("fp32", "fp32"), ("fp8", "bf16")])
def test_drafts_compose_with_tiers_and_kv_precision(kv, dtype, tmp_path):
  """The composition trace (tests/dsv4/composition_worker.py) with host + disk tiers under a pool that demotes and
  reloads, at fp32 and at FP8 KV with bf16 compute: drafts change no token, the reload happened, no block leaked."""
  from tests.dsv4 import composition_worker
  cfg = dataclasses.replace(composition_worker.config("v4", False), num_mtp_layers=1)
  params = model.init_params(cfg, jax.random.PRNGKey(4))
  tr = composition_worker.Trace.make(cfg, 2)
  outs = {}
  combo = composition_worker.Combo(False, kv, True, "xla")
  for k in (0, 2):
    ec = dataclasses.replace(composition_worker.engine_config(combo, 1, str(tmp_path), f"k{k}"),
                             record_logits=False, dtype=dtype, num_speculative_tokens=k)
    eng = Engine(params, cfg, ec)
    outs[k] = composition_worker.run_trace(eng, cfg, tr)
    assert _free(eng) == {"full": ec.num_full_blocks, "swa": ec.num_swa_blocks}
  assert [o.output for o in outs[2]] == [o.output for o in outs[0]]
  assert outs[2][-1].tier_hit_tokens > 0
