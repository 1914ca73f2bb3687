"""The one request schema: every bad input is refused (never coerced) with a message naming the field, through
`parse_request` (the JSONL path) and through `generate` (the Python path); the good requests of the same batch finish
and the engine keeps serving; the caching-off salt cannot be forged from user strings."""

import dataclasses

import jax
import numpy as np
import pytest

from cache.hashing import ExtraKeys
from dsv4 import config, model
from dsv4.engine import schema
from dsv4.engine.api import generate
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.request import Request
from dsv4.engine.sampling import SamplingParams
from tests.dsv4.schema_cases import BAD, GOOD_PROMPT

V = 64
EC = EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, chunk_size=32, max_model_len=256,
                  num_full_blocks=16, num_swa_blocks=64)


@pytest.mark.parametrize("name,req,err,_", BAD, ids=[b[0] for b in BAD])
def test_parse_request_refuses(name, req, err, _):
  if isinstance(req, str):
    pytest.skip("raw text: only the JSONL reader sees it (tests/experiments/test_serve.py)")
  with pytest.raises(schema.RequestError) as e:
    schema.parse_request(req, vocab_size=V, default_id="line0")
  assert err in str(e.value)


def test_parse_request_accepts_every_field():
  d = {"id": "a", "prompt": [0, 5, 6], "max_tokens": 3, "temperature": 0.5, "top_k": 2**31 - 1, "top_p": 0.9,
       "seed": 2**32 - 1, "stop_token_ids": [1, 2], "ignore_eos": False, "tenant": "t", "session": "s",
       "expected": [41]}
  r = schema.parse_request(d, vocab_size=V, default_id="line0")
  assert r == schema.RequestSpec("a", (0, 5, 6), SamplingParams(3, 0.5, 2**31 - 1, 0.9, 2**32 - 1, (1, 2), False),
                                 "t", "s", (41,))
  assert schema.parse_request({"prompt": [1]}, vocab_size=V, default_id="line7").id == "line7"
  # numpy / jax arrays of integer ids are prompts; float arrays and 2-D arrays are not
  assert schema.check_prompt(np.array([1, 2], np.int32), V) == (1, 2)
  assert schema.check_prompt(jax.numpy.array([3, 4]), V) == (3, 4)
  for bad in (np.array([1.0, 2.0]), np.zeros((1, 2), np.int32)):
    with pytest.raises(schema.RequestError, match="1-D sequence of integer token ids"):
      schema.check_prompt(bad, V)


@pytest.fixture(scope="module")
def tiny():
  cfg = dataclasses.replace(config.v4_tiny(), vocab_size=V)
  return cfg, model.init_params(cfg, jax.random.PRNGKey(0))


def test_generate_refuses_each_bad_request_alone_and_keeps_serving(tiny):
  cfg, params = tiny
  cases = [(n, r, e) for n, r, e, via_generate in BAD if via_generate]
  good_sp = SamplingParams(max_tokens=3, ignore_eos=True)
  prompts, sps = [GOOD_PROMPT], [good_sp]
  for _, req, _ in cases:
    prompts.append(req["prompt"])
    sps.append(SamplingParams(**{k: v for k, v in req.items() if k != "prompt"}))
  prompts.append(GOOD_PROMPT[:20])
  sps.append(dataclasses.replace(good_sp, temperature=1.0, seed=2**32 - 1, top_k=2**31 - 1))
  eng = Engine(params, cfg, EC)
  outs = generate(params, cfg, prompts, sps, engine=eng)
  for (name, _, err), o in zip(cases, outs[1:-1]):
    assert o.error is not None and err in o.error, (name, o.error)
    assert o.finish_reason == "error" and o.output == []
  for o in (outs[0], outs[-1]):
    assert o.error is None and len(o.output) == 3
  # nothing invalid reached the engine's queue; the same engine serves the next batch (same answer as before)
  assert eng.requests == {} and not eng.waiting and not eng.running     # generate forgot what it returned
  (again,) = generate(params, cfg, [GOOD_PROMPT], good_sp, engine=eng)
  assert again.error is None and again.output == outs[0].output


def test_nocache_salt_is_unambiguous():
  # The old salt was adapter + "|nocache:" + rid + ":" + preemptions: these two collided.
  a = Request("c", [1], SamplingParams(), ExtraKeys(adapter="x|nocache:b"))
  b = Request("b|nocache:c", [1], SamplingParams(), ExtraKeys(adapter="x"))
  old = lambda r: f"{r.extra_keys.adapter}|nocache:{r.rid}:{r.num_preemptions}"
  assert old(a) == old(b)                                       # the crafted pair
  assert a.cache_salt(False).blob() != b.cache_salt(False).blob()
  # a request never matches itself after a preemption, and caching on keeps the user's keys as they are
  sa = a.cache_salt(False).blob()
  a.num_preemptions += 1
  assert a.cache_salt(False).blob() != sa and a.cache_salt(True) == a.extra_keys
  # every field is length-prefixed: moving characters between fields changes the encoding
  assert ExtraKeys(tenant="ab").blob() != ExtraKeys(tenant="a", model="b").blob()
  assert ExtraKeys(adapter="x", private="y").blob() != ExtraKeys(adapter="xy").blob()
