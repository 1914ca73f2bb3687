"""Prefill / decode state handoff between two engines in one process (no Ray, no transfer engine): a prefill
engine runs the prompt and samples the first token, its whole state is exported as it finishes, and a decode
engine imports it and continues. The decode engine computes no prompt token (its hit is the whole prompt, its
computed tokens are its output tokens) and its greedy tokens equal one engine's that computed everything. Prompts
cover a tail past an aligned point (the partial full block, a partial swa block) and a prompt shorter than the
alignment (the tail is the whole state). A record that fails verification stores nothing."""

import dataclasses

import jax
import pytest

from benchmarks.sizing import handoff_state_bytes
from cache.hashing import ExtraKeys
from dsv4 import config as C
from dsv4 import model
from dsv4.engine import handoff
from dsv4.engine.engine import Engine, EngineConfig
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.tiering import TieringConfig

EC = EngineConfig(max_num_seqs=2, max_num_batched_tokens=128, chunk_size=128, max_model_len=384, num_full_blocks=8,
                  num_swa_blocks=40)
DECODE_TOKENS = 4
TENANT = ExtraKeys(tenant="t")


def _tiered(params, cfg, name):
  tc = TieringConfig(tiers=("host",), policy="load", write_queue=0, engine_id=name, model_digest="tiny")
  return Engine(params, cfg, dataclasses.replace(EC, tiering=tc))


@pytest.fixture(scope="module")
def world():
  cfg = C.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  rng = jax.random.PRNGKey(7)
  # 213 = 128 + 85: the state past the aligned point is a partial full block and three swa blocks, the last partial;
  # 77 < 128: no aligned part at all
  prompts = {f"p{n}": [int(t) for t in jax.random.randint(jax.random.fold_in(rng, n), (n,), 2, cfg.vocab_size)]
             for n in (213, 77)}
  ref = Engine(params, cfg, EC)
  for rid, p in prompts.items():
    ref.add_request(rid, p, SamplingParams(max_tokens=1 + DECODE_TOKENS, ignore_eos=True), TENANT)
  want = {o.rid: o.output for o in ref.run()}
  pre = _tiered(params, cfg, "prefill")
  exported = {}
  pre.on_finish = lambda r: exported.__setitem__(r.rid, handoff.export_state(pre, r, TENANT))
  for rid, p in prompts.items():
    pre.add_request(rid, p, SamplingParams(max_tokens=1, ignore_eos=True), TENANT)
  first = {o.rid: o.output for o in pre.run()}
  return cfg, params, prompts, want, first, exported


def test_decode_resumes_where_prefill_stopped(world):
  cfg, params, prompts, want, first, exported = world
  dec = _tiered(params, cfg, "decode")
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
    assert o.hit_tokens == len(p) and o.computed_tokens == DECODE_TOKENS, (rid, o.hit_tokens, o.computed_tokens)
  assert dec.tiering.stats["handed_tails_adopted"] == len(prompts)
  assert dec.tiering.handed_tails == {}


def test_a_corrupt_or_missing_record_stores_nothing(world):
  cfg, params, prompts, want, first, exported = world
  dec = _tiered(params, cfg, "decode2")
  p = prompts["p213"]
  tokens = p + first["p213"]
  plan, recs = exported["p213"]
  host = dec.tiering.store.tiers[0]
  for bad in (recs[:-1], recs[:-1] + [recs[-1][:-1] + bytes([recs[-1][-1] ^ 1])],
              [recs[1]] + [recs[0]] + recs[2:]):
    with pytest.raises(handoff.HandoffError):
      handoff.import_state(dec, "p213", tokens, TENANT, bad)
    assert dec.tiering.handed_tails == {} and not any(host.contains_many(list(plan.keys)))
  with pytest.raises(handoff.HandoffError):       # another tenant's state
    handoff.import_state(dec, "p213", tokens, ExtraKeys(tenant="u"), recs)
