"""V4.1 speculative decoding with the DSpark drafter in the engine: every draft the engine proposes equals the draft
recomputed from scratch over the whole sequence (`dspark.reference_drafts`), also after a prefix hit and after a
preemption (the stages' context KV lives in the SWA group and travels with it); drafts never change a greedy
answer, synchronous or async; k beyond the block size is refused at construction."""

import dataclasses

import jax
import numpy as np
import pytest

from dsv4 import config, dspark, model
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams

EC = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, chunk_size=32, max_model_len=256, num_full_blocks=24,
                  num_swa_blocks=64)


@pytest.fixture(scope="module")
def drafter():
  cfg = dataclasses.replace(
      config.v41_tiny(engram=False), num_mtp_layers=3,
      dspark=config.DSparkConfig(block_size=5, target_layer_ids=(5, 6, 7), markov_rank=8, noise_token_id=3,
                                 n_routed_experts=4, num_experts_per_tok=2))
  return cfg, model.init_params(cfg, jax.random.PRNGKey(0))


def _prompts(cfg, seed, lengths, shared=0):
  rng = np.random.default_rng(seed)
  head = list(rng.integers(4, cfg.vocab_size, size=shared))
  return [head + list(rng.integers(4, cfg.vocab_size, size=int(n))) for n in lengths]


def _run(params, cfg, ec, prompts, max_tokens, check=None, waves=1):
  """Runs the prompts (in `waves` arrival waves) to the end; check(eng) after every step."""
  eng = Engine(params, cfg, ec)
  per = -(-len(prompts) // waves)
  pending = [(f"r{i}", p) for i, p in enumerate(prompts)]
  while pending or eng.has_work():
    if pending and not eng.has_work() or (pending and len(eng.running) == 0):
      for rid, p in pending[:per]:
        eng.add_request(rid, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
      pending = pending[per:]
    eng.step()
    if check is not None:
      check(eng)
  return eng, {o.rid: o.output for o in eng.outputs()}


def _checker(cfg, params, seen, hits, per_request: int = 1 << 30):
  """Checks each running request's proposal against the reference (at most `per_request` per request: each check
  is a whole-sequence forward)."""
  checked = {}

  def check(eng):
    for r in eng.running:
      hits.append(r.hit_tokens)
      if r.drafts and r.num_computed == len(r.tokens) - 1 and checked.get(r.rid, 0) < per_request:
        want = [int(t) for t in dspark.reference_drafts(params, cfg, r.tokens, 256)]
        assert r.drafts == want[:len(r.drafts)], (r.rid, len(r.tokens))
        seen.append(len(r.tokens))
        checked[r.rid] = checked.get(r.rid, 0) + 1
  return check


@pytest.mark.parametrize("swa_blocks", [9, 7], ids=["roomy", "preempting"])
def test_served_drafts_equal_drafts_from_scratch(drafter, swa_blocks):
  """Synchronous steps so the host holds each step's drafts: with chunked prefill, prefix hits on a shared head
  and (7 swa blocks) a pool small enough to preempt, every proposal equals the one recomputed over the whole
  sequence (the roomy trace checks 3 proposals per request; both in the slow tier)."""
  cfg, params = drafter
  prompts = _prompts(cfg, 1, [40, 25, 60, 33, 20, 9], shared=140)
  ec = dataclasses.replace(EC, num_speculative_tokens=5, async_scheduling=False, num_swa_blocks=swa_blocks)
  seen, hits = [], []
  per_request = 3 if swa_blocks > 7 else 1 << 30
  eng, got = _run(params, cfg, ec, prompts, 8, _checker(cfg, params, seen, hits, per_request), waves=2)
  assert len(seen) >= 10 and max(hits) > 0
  assert eng.stats["preemptions"] > 0 or swa_blocks > 7
  _, want = _run(params, cfg, EC, prompts, 8)
  assert got == want


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_drafts_never_change_greedy_tokens(drafter, async_scheduling):
  cfg, params = drafter
  prompts = _prompts(cfg, 2, [45, 90, 17])
  _, want = _run(params, cfg, EC, prompts, 16)
  eng, got = _run(params, cfg, dataclasses.replace(EC, num_speculative_tokens=3, async_scheduling=async_scheduling),
                  prompts, 16)
  assert got == want
  assert eng.stats["spec_draft_tokens"] > 0


def test_k_beyond_the_block_is_refused(drafter):
  cfg, params = drafter
  with pytest.raises(ValueError, match="DSpark drafter proposes 5 tokens"):
    Engine(params, cfg, dataclasses.replace(EC, num_speculative_tokens=6))


def test_tier_reloads_carry_the_draft_state(drafter, tmp_path):
  """Host + disk tiers under a pool that evicts the first wave's blocks: the second wave reloads them from the tiers
  (the stages' context KV is part of every SWA block) and every proposal still equals the one from scratch."""
  from dsv4.engine.tiering_config import TieringConfig
  cfg, params = drafter
  prompts = _prompts(cfg, 3, [30, 45, 20, 38], shared=140)
  tc = TieringConfig(tiers=("host", "disk"), disk_dir=str(tmp_path / "disk"), policy="load", write_queue=0)
  ec = dataclasses.replace(EC, num_speculative_tokens=5, async_scheduling=False, num_full_blocks=3,
                           num_swa_blocks=24, tiering=tc)
  fillers = _prompts(cfg, 9, [230, 230])     # between the waves: they evict (demote) the first wave's blocks
  seen, hits = [], []
  eng = Engine(params, cfg, ec)
  tier_hits = 0
  check = _checker(cfg, params, seen, hits)
  for wave in (prompts[:2], fillers[:1], fillers[1:], prompts[2:]):
    for i, p in enumerate(wave):
      eng.add_request(f"w{len(seen)}_{i}", p, SamplingParams(max_tokens=8, ignore_eos=True))
    while eng.has_work():
      eng.step()
      check(eng)
      tier_hits = max([tier_hits] + [r.tier_hit_tokens for r in eng.running])
  assert tier_hits > 0 and len(seen) >= 8


def test_handoff_carries_the_draft_state(drafter):
  """Prefill on one engine, export the state as the request finishes, import it in a drafting decode engine: its
  first proposals (read from the imported context KV of the draft stages) equal the ones from scratch."""
  from cache.hashing import ExtraKeys
  from dsv4.engine import handoff
  from dsv4.engine.tiering_config import TieringConfig
  cfg, params = drafter
  tenant = ExtraKeys(tenant="t")
  tiered = lambda ec, name: Engine(params, cfg, dataclasses.replace(
      ec, tiering=TieringConfig(tiers=("host",), policy="load", write_queue=0, engine_id=name, model_digest="d")))
  prompts = {f"p{n}": p for n, p in zip((181, 45), _prompts(cfg, 4, [181, 45]))}
  drafting = dataclasses.replace(EC, num_speculative_tokens=5, async_scheduling=False)

  def prefill(ec, name):
    pre = tiered(ec, name)
    exported = {}
    pre.on_finish = lambda r: exported.__setitem__(r.rid, handoff.export_state(pre, r, tenant))
    for rid, p in prompts.items():
      pre.add_request(rid, p, SamplingParams(max_tokens=1, ignore_eos=True), tenant)
    return {o.rid: o.output for o in pre.run()}, exported

  # a prefill engine that does not draft writes no draft state: a drafting receiver refuses its records
  first, exported = prefill(EC, "prefill0")
  dec = tiered(drafting, "decode0")
  with pytest.raises(handoff.HandoffError):
    handoff.import_state(dec, "p181", prompts["p181"] + first["p181"], tenant, exported["p181"][1])
  first, exported = prefill(drafting, "prefill")
  dec = tiered(drafting, "decode")
  for rid, p in prompts.items():
    handoff.import_state(dec, rid, p + first[rid], tenant, exported[rid][1])
    dec.add_request(rid, p + first[rid], SamplingParams(max_tokens=6, ignore_eos=True), tenant)
  seen, hits = [], []
  check = _checker(cfg, params, seen, hits)
  while dec.has_work():
    dec.step()
    check(dec)
  assert len(seen) >= 2 and min(hits) == min(len(p) for p in prompts.values())


@pytest.mark.parametrize("kind,kv", [("dspark", "bf16"), ("dspark", "fp8"), ("mtp", "bf16")])
def test_drafts_on_or_off_same_bits(drafter, kind, kv):
  """The invariant step in bf16 (the default): each greedy request run alone without drafts, and batched with
  async drafting (DSpark k = 5, V4's MTP block k = 3; drafts accepted or not, rows crossing tiles): the same tokens
  and the same logits, bit for bit."""
  from dsv4 import caches
  cfg, params = drafter
  if kind == "mtp":
    cfg = dataclasses.replace(config.v4_tiny(num_layers=3), num_mtp_layers=1)
  if kv == "fp8":   # the FP8 record quantizes the non-RoPE channels in blocks of 64
    from tests.dsv4.tiers_precision_worker import widen
    cfg = widen(cfg, False)
  if kind == "mtp" or kv == "fp8":
    params = model.init_params(cfg, jax.random.PRNGKey(0))
  prompts = _prompts(cfg, 5, [45, 90, 17, 30])
  ec = dataclasses.replace(EC, dtype="bf16", record_logits=True,
                           layout=caches.CacheLayout(kv_dtype=caches.FP8 if kv == "fp8" else jax.numpy.bfloat16))
  alone = {}
  for i, p in enumerate(prompts):
    eng = Engine(params, cfg, ec)
    eng.add_request(f"r{i}", p, SamplingParams(max_tokens=12, ignore_eos=True))
    alone.update({o.rid: o for o in eng.run()})
  eng = Engine(params, cfg, dataclasses.replace(ec, num_speculative_tokens=5 if kind == "dspark" else 3))
  for i, p in enumerate(prompts):
    eng.add_request(f"r{i}", p, SamplingParams(max_tokens=12, ignore_eos=True))
  both = {o.rid: o for o in eng.run()}
  assert eng.stats["spec_draft_tokens"] > 0
  for rid, o in alone.items():
    assert both[rid].output == o.output, rid
    np.testing.assert_array_equal(np.stack(both[rid].token_logits), np.stack(o.token_logits), err_msg=rid)
