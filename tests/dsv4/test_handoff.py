"""Prefill / decode state handoff between two engines in one process (no Ray, no transfer engine): a prefill
engine runs the prompt and samples the first token, its whole state is exported as it finishes, and a decode
engine imports it and continues. The decode engine computes no prompt token (its hit is the whole prompt, its
computed tokens are its output tokens) and its greedy tokens equal one engine's that computed everything. Prompts
cover a tail past an aligned point (the partial full block, a partial swa block) and a prompt shorter than the
alignment (the tail is the whole state). A record that fails verification stores nothing. V4 (window + CSA) in the
default tier; V4.1 (Engram ids) and a model with an MTP block drafting in the slow tier."""

import dataclasses

import jax
import pytest

from benchmarks.sizing import handoff_state_bytes
from cache.hashing import ExtraKeys
from dsv4 import config, model
from dsv4.engine import handoff
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.tiering_config import TieringConfig

# the engine shapes of the other fast engine tests (tests/dsv4/test_api.py): their step programs are shared
EC = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, chunk_size=32, max_model_len=1024,
                  num_full_blocks=16, num_swa_blocks=64)
DECODE_TOKENS = 4
TENANT = ExtraKeys(tenant="t")


def _tiered(params, cfg, ec, name):
  tc = TieringConfig(tiers=("host",), policy="load", write_queue=0, engine_id=name, model_digest="tiny")
  return Engine(params, cfg, dataclasses.replace(ec, tiering=tc))


def _model(name):
  """(config, engine config). v4: window + CSA; v41: Engram token ids, ratio-2 / ratio-1 sources; v4_mtp: window +
  CSA + HCA and an MTP block drafting (its window layer is part of the state)."""
  if name == "v4":
    return config.v4_tiny(num_layers=2, vocab_size=64), EC
  if name == "v41":
    return config.v41_tiny(), EC
  return (dataclasses.replace(config.v4_tiny(num_layers=3), num_mtp_layers=1),
          dataclasses.replace(EC, num_speculative_tokens=2))


@pytest.fixture(scope="module", params=["v4", "v41", "v4_mtp"])
def world(request):
  cfg, ec = _model(request.param)
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  rng = jax.random.PRNGKey(7)
  # 181 = 128 + 53: the state past the aligned point is a partial full block and two swa blocks, the last partial;
  # 45 < 128: no aligned part at all
  prompts = {f"p{n}": [int(t) for t in jax.random.randint(jax.random.fold_in(rng, n), (n,), 3, cfg.vocab_size)]
             for n in (181, 45)}
  ref = Engine(params, cfg, ec)
  for rid, p in prompts.items():
    ref.add_request(rid, p, SamplingParams(max_tokens=1 + DECODE_TOKENS, ignore_eos=True), TENANT)
  want = {o.rid: o.output for o in ref.run()}
  pre = _tiered(params, cfg, ec, "prefill")
  exported = {}
  pre.on_finish = lambda r: exported.__setitem__(r.rid, handoff.export_state(pre, r, TENANT))
  for rid, p in prompts.items():
    pre.add_request(rid, p, SamplingParams(max_tokens=1, ignore_eos=True), TENANT)
  first = {o.rid: o.output for o in pre.run()}
  return cfg, params, ec, prompts, want, first, exported


def test_decode_resumes_where_prefill_stopped(world):
  cfg, params, ec, prompts, want, first, exported = world
  dec = _tiered(params, cfg, ec, "decode")
  for rid, p in prompts.items():
    plan, recs = exported[rid]
    tokens = p + first[rid]
    assert plan.point == len(p) and plan.payload_bytes == handoff_state_bytes(cfg, EC.layout, len(tokens))
    got = handoff.import_state(dec, rid, tokens, TENANT, recs)
    assert got == plan
    dec.add_request(rid, tokens, SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True), TENANT)
  outs = {o.rid: o for o in dec.run()}
  for rid, p in prompts.items():
    o = outs[rid]
    assert first[rid] + o.output == want[rid], rid
    assert o.hit_tokens == len(p), (rid, o.hit_tokens)      # admitted at the prompt's end: no prompt token computed
    if not ec.num_speculative_tokens:                        # (verified drafts count as computed tokens)
      assert o.computed_tokens == DECODE_TOKENS, (rid, o.computed_tokens)
  assert dec.tiering.stats["handed_tails_adopted"] == len(prompts)
  assert dec.tiering.handed_tails == {}


def test_a_preempted_decode_request_adopts_its_tail_again(world):
  cfg, params, ec, prompts, want, first, exported = world
  dec = _tiered(params, cfg, ec, "decode3")
  p = prompts["p181"]
  tokens = p + first["p181"]
  handoff.import_state(dec, "p181", tokens, TENANT, exported["p181"][1])
  dec.add_request("p181", tokens, SamplingParams(max_tokens=DECODE_TOKENS, ignore_eos=True), TENANT)
  dec.step()
  dec.step()
  (req,) = dec.running
  dec.scheduler.preempt(req)           # as the scheduler does when the pool runs short
  (o,) = dec.run()
  assert first["p181"] + o.output == want["p181"]
  # the re-admission hit the aligned part on the device and adopted the tail again: it recomputed only its own
  # output positions, no prompt token
  assert req.readmit_hit_tokens == len(p) and dec.tiering.stats["handed_tails_adopted"] == 2


def test_a_corrupt_or_missing_record_stores_nothing(world):
  cfg, params, ec, prompts, want, first, exported = world
  dec = _tiered(params, cfg, ec, "decode2")
  p = prompts["p181"]
  tokens = p + first["p181"]
  plan, recs = exported["p181"]
  host = dec.tiering.store.tiers[0]
  for bad in (recs[:-1], recs[:-1] + [recs[-1][:-1] + bytes([recs[-1][-1] ^ 1])],
              [recs[1]] + [recs[0]] + recs[2:]):
    with pytest.raises(handoff.HandoffError):
      handoff.import_state(dec, "p181", tokens, TENANT, bad)
    assert dec.tiering.handed_tails == {} and not any(host.contains_many(list(plan.keys)))
  with pytest.raises(handoff.HandoffError):       # another tenant's state
    handoff.import_state(dec, "p181", tokens, ExtraKeys(tenant="u"), recs)
