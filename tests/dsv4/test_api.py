"""run_workload / engine accounting: progress reaches the total when requests are rejected mid-run, tenants and
sessions keep separate histories, re-admission hits count only the admission that succeeds."""

import dataclasses

import jax
import pytest

from dsv4 import config, model
from dsv4.engine.api import generate, run_workload
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.workloads import Turn, Workload

EC = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, chunk_size=32, max_model_len=1024,
                  num_full_blocks=16, num_swa_blocks=64)
SP = SamplingParams(max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
  cfg = config.v4_tiny(num_layers=2, vocab_size=64)
  return cfg, model.init_params(cfg, jax.random.PRNGKey(0))


def test_progress_counts_requests_rejected_mid_run(tiny):
  cfg, params = tiny
  # 4 full blocks hold 512 tokens: the 700-token prompt is rejected by the scheduler, not at intake
  eng = Engine(params, cfg, dataclasses.replace(EC, num_full_blocks=4, num_swa_blocks=14))
  wl = Workload("w", ((Turn("a", (7,) * 700, SP), Turn("b", (5, 6) * 20, SP), Turn("c", (3,), SP, rid="c",
                                                                                   expected=(9,))),
                      (Turn("b", (8,), SP),)))
  seen = []
  rep = run_workload(eng, wl, progress=seen.append)
  assert sum(seen) == wl.num_requests == 4
  assert "too small" in rep.outputs[0].error and rep.outputs[1].error is None
  s = rep.summary()
  assert s["requests"] == 4 and s["errors"] == 1 and s["graded"] == 1
  assert s["accuracy"] == float(rep.outputs[2].output[:1] == [9])
  # session b's second turn continued b's history
  assert rep.outputs[3].prompt == rep.outputs[1].prompt + rep.outputs[1].output + [8]


def test_tenants_and_sessionless_turns_keep_separate_histories(tiny):
  cfg, params = tiny
  eng = Engine(params, cfg, EC)
  p = tuple([0] + [3, 4, 5, 6] * 40)
  wl = Workload("w", ((Turn("s", p, SP, tenant="A"), Turn("s", (9,), SP, rid="B.s", tenant="B"),
                       Turn("", (10,), SP, rid="x"), Turn("", (11,), SP, rid="y")),
                      (Turn("s", (12,), SP, rid="A.2", tenant="A"), Turn("s", (13,), SP, rid="B.2", tenant="B"))))
  out = {o.rid: o for o in run_workload(eng, wl).outputs}
  assert out["x"].prompt == [10] and out["y"].prompt == [11]
  assert out["A.2"].prompt[:len(p)] == list(p) and out["B.2"].prompt[0] == 9
  assert out["A.2"].hit_tokens > 0 and out["B.2"].hit_tokens == 0


def test_failed_admission_does_not_count_readmit_hits(tiny):
  cfg, params = tiny
  eng = Engine(params, cfg, EC)
  p = [0] + [3, 4, 5, 6] * 75                               # 301 tokens: 256 of them hit once cached
  generate(params, cfg, [p], SP, engine=eng)
  eng.add_request("long", [7, 8] * 100, SamplingParams(max_tokens=8, ignore_eos=True))
  eng.step()                                                # "long" is running
  r = eng.add_request("again", p + [9], SP)
  r.num_preemptions = 1                                     # as if preempted: its hits count as re-admission hits
  real, calls = eng.cache_manager.allocate_to, []

  def fail_once(rid, total):
    calls.append(rid)
    return False if calls.count("again") == 1 and rid == "again" else real(rid, total)

  eng.cache_manager.allocate_to = fail_once
  eng.run()
  assert calls.count("again") >= 2 and r.error is None
  assert r.readmit_hit_tokens == 256
