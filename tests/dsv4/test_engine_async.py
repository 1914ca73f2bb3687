"""Async scheduling: the engine that plans step N+1 before reading step N's tokens gives the same tokens as the
synchronous one, token for token, on random mixes (prompt lengths, chunking, prefix hits, stop tokens, greedy and
seeded sampling, preemption); and a long job's host state returns to empty."""

import dataclasses

import numpy as np
import pytest

from dsv4.engine.api import generate
from dsv4.engine.engine import Engine
from dsv4.engine.request import Status
from dsv4.engine.sampling import SamplingParams

# test_engine.py's configurations and model: the same step programs, compiled once for the suite
from tests.dsv4.test_engine import BASE, TINY_POOL, tiny  # noqa: F401,E402  (tiny: the shared fixture)


def _mix(cfg, seed, n=7):
  """Prompts sharing a system prompt (hits), random lengths and budgets, some seeded sampling, some stop ids."""
  rng = np.random.default_rng(seed)
  system = [int(t) for t in rng.integers(2, cfg.vocab_size, 140)]
  prompts, sps = [], []
  for i in range(n):
    own = [int(t) for t in rng.integers(2, cfg.vocab_size, int(rng.integers(3, 120)))]
    prompts.append(system + own if i % 2 == 0 else own)
    sampled = i % 3 == 1
    stop = [int(t) for t in rng.integers(2, cfg.vocab_size, 40)] if i % 3 == 2 else []
    sps.append(SamplingParams(max_tokens=int(rng.integers(1, 40)), temperature=0.8 if sampled else 0.0,
                              top_k=20 if sampled else 0, seed=int(rng.integers(1 << 30)), stop_token_ids=stop,
                              ignore_eos=True))
  return prompts, sps


@pytest.mark.parametrize("ec", [BASE, TINY_POOL], ids=["ample", "preempting"])
@pytest.mark.parametrize("seed", [0, 1])
def test_async_equals_sync(tiny, ec, seed):
  cfg, params = tiny
  prompts, sps = _mix(cfg, seed)
  runs = {}
  for mode in (True, False):
    eng = Engine(params, cfg, dataclasses.replace(ec, async_scheduling=mode))
    assert eng.async_active is mode
    runs[mode] = (generate(params, cfg, prompts, sps, engine=eng), eng)
  (a, eng_a), (s, eng_s) = runs[True], runs[False]
  assert [o.output for o in a] == [o.output for o in s]
  assert [o.finish_reason for o in a] == [o.finish_reason for o in s]
  assert all(o.error is None for o in a)
  if ec is TINY_POOL:
    assert eng_a.stats["preemptions"] > 0, "the tiny pool must force preemption"
  assert eng_a.stats["steps"] <= eng_s.stats["steps"] + len(prompts)


def test_a_long_job_leaves_no_host_state_behind(tiny):
  """Requests served through `generate` are forgotten once returned: the engine's request tables, the cache
  manager's requests and the deferral maps are empty again, and every table row is free."""
  cfg, params = tiny
  eng = Engine(params, cfg, BASE)
  rng = np.random.default_rng(5)
  for batch in range(3):
    prompts = [[int(t) for t in rng.integers(2, cfg.vocab_size, int(rng.integers(4, 60)))] for _ in range(6)]
    outs = generate(params, cfg, prompts, SamplingParams(max_tokens=3, ignore_eos=True), engine=eng)
    assert all(len(o.output) == 3 for o in outs)
    assert len({o.rid for o in outs}) == 6
    assert eng.requests == {} and not eng.waiting and not eng.running and eng._inflight is None
    assert eng.deferral.is_empty()
    mgr = eng.cache_manager
    assert mgr._requests == {} and len(mgr.queue.free_slots) == mgr.num_slots


def test_stop_token_seen_one_step_late_is_not_emitted(tiny):
  """A request whose stop token is read one step late has run one more step: that token is dropped, its blocks
  are freed, and its output ends at the stop token exactly as in the synchronous engine."""
  cfg, params = tiny
  prompt = [int(t) for t in np.random.default_rng(2).integers(2, cfg.vocab_size, 50)]
  greedy = generate(params, cfg, [prompt], SamplingParams(max_tokens=8, ignore_eos=True),
                    engine=Engine(params, cfg, dataclasses.replace(BASE, async_scheduling=False)))[0].output
  stop = greedy[3]
  k = greedy.index(stop)
  eng = Engine(params, cfg, BASE)
  out = generate(params, cfg, [prompt], SamplingParams(max_tokens=8, stop_token_ids=[stop], ignore_eos=True),
                 engine=eng)[0]
  assert out.output == greedy[:k + 1] and out.finish_reason == "stop"
  assert eng.cache_manager.num_free_blocks("full") == BASE.num_full_blocks
  assert eng.cache_manager.num_free_blocks("swa") == BASE.num_swa_blocks
  assert eng.requests == {} and all(r.status is not Status.RUNNING for r in [])


@pytest.mark.slow
def test_async_bench_runs_and_both_modes_agree():
  """`python -m benchmarks.async_bench` at tiny sizes: prints the table and the same tokens both ways (its speed
  is what it prints, not asserted here)."""
  import subprocess
  import sys
  out = subprocess.run([sys.executable, "-m", "benchmarks.async_bench", "--requests=4", "--max_tokens=6",
                        "--repeats=1"], capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "same tokens: True" in out.stdout and "| async |" in out.stdout, out.stdout
