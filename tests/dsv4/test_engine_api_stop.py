"""Engine API edges: stop_request (running mid-decode, mid-prefill, waiting) frees like a normal finish and keeps
prefix caching working; an id already in use is a per-request error that leaves the original alone; outputs report
device and tier hits apart."""

import dataclasses

import jax
import numpy as np
import pytest

from dsv4 import config, model
from dsv4.engine.api import generate
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.request import RequestOutput, Status
from dsv4.engine.sampling import SamplingParams

EC = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, chunk_size=32, max_model_len=1024,
                  num_full_blocks=16, num_swa_blocks=64)
ALIGN = 128


@pytest.fixture(scope="module")
def tiny():
  cfg = config.v4_tiny(num_layers=2, vocab_size=64)
  return cfg, model.init_params(cfg, jax.random.PRNGKey(0))


def _free(eng):
  m = eng.cache_manager
  return {g: m.num_free_blocks(g) for g in m.groups}


def test_stop_request_running_prefilling_and_waiting(tiny):
  """The synchronous engine's timeline (each step read before the next: a request's state between steps is final;
  with async scheduling a stop also drops the token in flight, tests/dsv4/test_engine_async.py)."""
  cfg, params = tiny
  eng = Engine(params, cfg, dataclasses.replace(EC, async_scheduling=False))
  free0 = _free(eng)
  rng = np.random.default_rng(0)
  pa = [int(t) for t in rng.integers(2, cfg.vocab_size, 300)]
  pb = [int(t) for t in rng.integers(2, cfg.vocab_size, 400)]
  long = SamplingParams(max_tokens=50, ignore_eos=True)
  a = eng.add_request("a", pa, long)
  b = eng.add_request("b", pb, long)
  c = eng.add_request("c", [5, 6, 7] * 10, SamplingParams(max_tokens=3, ignore_eos=True))
  while len(a.output) < 3:
    eng.step()
  assert b.status is Status.RUNNING and 0 < b.num_computed < len(pb) and c.status is Status.WAITING
  # a mid-decode: finished now with what it sampled
  out_a = list(a.output)
  assert eng.stop_request("a") is True
  assert a.status is Status.FINISHED and a.finish_reason == "stop" and a.output == out_a and a not in eng.running
  assert eng.stop_request("a") is False and eng.stop_request("nobody") is False
  # c waiting (never admitted): finished with its own reason, nothing to free
  assert eng.stop_request("c", reason="abort") is True
  assert c.status is Status.FINISHED and c.finish_reason == "abort" and c not in eng.waiting and c.output == []
  # b mid-prefill
  while b.num_computed < 150:
    eng.step()
  b_computed = b.num_computed
  assert eng.stop_request("b", "cancelled") and b.finish_reason == "cancelled" and b.output == []
  assert not eng.has_work() and eng.step() == []
  assert _free(eng) == free0                           # every block back, as after normal finishes
  assert [o.finish_reason for o in eng.outputs()] == ["stop", "cancelled", "abort"]
  # what the stopped requests computed is registered: later requests sharing their prefixes hit it
  more = [int(t) for t in rng.integers(2, cfg.vocab_size, 20)]
  sp = SamplingParams(max_tokens=2, ignore_eos=True)
  ra, rb = generate(params, cfg, [pa + out_a + more, pb + more], sp, engine=eng)
  assert ra.hit_tokens == (len(pa) + len(out_a) - 1) // ALIGN * ALIGN == 256
  assert rb.hit_tokens == b_computed // ALIGN * ALIGN >= 128
  assert ra.tier_hit_tokens == 0 and ra.device_hit_tokens == ra.hit_tokens      # no tiers: every hit is L1
  assert ra.error is None and rb.error is None and _free(eng) == free0


def test_an_id_in_use_is_a_per_request_error(tiny):
  cfg, params = tiny
  eng = Engine(params, cfg, EC)
  sp = SamplingParams(max_tokens=4, ignore_eos=True)
  x = eng.add_request("x", [3, 4, 5] * 20, sp)
  eng.add_request("y", [6, 7] * 20, sp)
  eng.add_request("z", [8, 9] * 20, sp)               # waiting: two rows per step
  eng.step()
  for rid in ("x", "z"):                              # running, waiting
    dup = eng.add_request(rid, [1, 2, 3], sp)
    assert dup.status is Status.REJECTED and dup.finish_reason == "error"
    assert dup.error == f"id {rid!r} is already in use"
  assert eng.requests["x"] is x and eng.requests["z"].prompt == [8, 9] * 20
  outs = {o.rid: o for o in eng.run()}
  assert set(outs) == {"x", "y", "z"}
  assert all(o.error is None and len(o.output) == 4 and o.finish_reason == "length" for o in outs.values())
  dup = eng.add_request("y", [1, 2, 3], sp)           # finished, still tracked
  assert dup.status is Status.REJECTED and "already in use" in dup.error
  assert eng.requests["y"].output == outs["y"].output and not eng.has_work()
  # the same answer as a fresh engine gives: the refusals touched nothing
  (ref,) = generate(params, cfg, [[3, 4, 5] * 20], sp, engine=Engine(params, cfg, EC))
  assert outs["x"].output == ref.output


def test_request_output_keeps_its_positional_form():
  # callers build error rows positionally (11 fields); the tier split is an added, defaulted field
  o = RequestOutput("r", [], [], "error", "bad", 0, 0, 0, 0, None, None)
  assert o.tier_hit_tokens == 0 and o.device_hit_tokens == 0
  assert dataclasses.replace(o, hit_tokens=384, tier_hit_tokens=256).device_hit_tokens == 128
