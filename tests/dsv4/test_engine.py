"""Engine acceptance: the cache never changes the answer (prefix caching on/off, preemption, chunk sizes), exact hit
accounting on scripted traces, session switching A -> A -> B -> A, per-request errors for bad input."""

import dataclasses

import jax
import numpy as np
import pytest

from dsv4 import config, model
from dsv4.engine import workloads
from dsv4.engine.api import generate, run_workload
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams

ALIGN = 128  # lcm of the group block sizes for the default layout
BASE = EngineConfig(max_num_seqs=4, max_num_batched_tokens=96, chunk_size=32, max_model_len=1024,
                    num_full_blocks=48, num_swa_blocks=160, record_logits=True)
TINY_POOL = dataclasses.replace(BASE, num_full_blocks=4, num_swa_blocks=14)


@pytest.fixture(scope="module")
def tiny():
  cfg = config.v4_tiny()
  return cfg, model.init_params(cfg, jax.random.PRNGKey(0))


def _floor(n):
  return (n // ALIGN) * ALIGN


def _run(tiny, ec, wl):
  cfg, params = tiny
  eng = Engine(params, cfg, ec)
  rep = run_workload(eng, wl)
  return eng, rep


def _assert_same_answers(rep_a, eng_a, rep_b, eng_b):
  for oa, ob in zip(rep_a.outputs, rep_b.outputs):
    assert oa.rid == ob.rid and oa.error is None and ob.error is None
    assert oa.output == ob.output, oa.rid
    la = np.stack(oa.token_logits)
    lb = np.stack(ob.token_logits)
    assert np.max(np.abs(la - lb)) <= 1e-5 * max(1.0, np.max(np.abs(la))), oa.rid


@pytest.mark.parametrize("seed", [0, 1])
def test_cache_never_changes_the_answer(tiny, seed):
  cfg, _ = tiny
  wl = workloads.chat(cfg.vocab_size, sessions=3, turns=3, system_len=140, seed=seed)
  eng_on, on = _run(tiny, BASE, wl)
  eng_off, off = _run(tiny, dataclasses.replace(BASE, enable_prefix_caching=False), wl)
  eng_chunk, chunk = _run(tiny, dataclasses.replace(BASE, chunk_size=64, max_num_batched_tokens=160), wl)
  eng_pre, pre = _run(tiny, TINY_POOL, wl)
  assert on.summary()["prefix_hit_tokens"] > 0
  assert off.summary()["prefix_hit_tokens"] == 0
  assert pre.summary()["preemptions"] > 0, "the tiny pool must force preemption"
  for rep, eng in [(off, eng_off), (chunk, eng_chunk), (pre, eng_pre)]:
    _assert_same_answers(on, eng_on, rep, eng)


def test_sampled_outputs_survive_preemption(tiny):
  cfg, _ = tiny
  wl = workloads.random_prompts(cfg.vocab_size, requests=6, prompt_len=(60, 200), seed=5)
  sp = SamplingParams(max_tokens=12, temperature=0.8, top_k=50, top_p=0.9, seed=7, ignore_eos=True)
  wl = workloads.Workload("sampled", tuple(tuple(dataclasses.replace(t, params=sp) for t in w) for w in wl.waves))
  eng_a, a = _run(tiny, BASE, wl)
  eng_b, b = _run(tiny, TINY_POOL, wl)
  assert b.summary()["preemptions"] > 0
  _assert_same_answers(a, eng_a, b, eng_b)


def test_session_switch_hits_everything_up_to_the_last_boundary(tiny):
  """A -> A -> B -> A with ample capacity: every A revisit resumes at the last aligned boundary at or before the
  end of what the previous A turn computed (its prompt + answer, minus the last sampled token whose KV is never
  computed) and below the new prompt's last token."""
  cfg, _ = tiny
  wl = workloads.switch(cfg.vocab_size, prompt_len=300, user_len=40, answer_len=20)
  eng, rep = _run(tiny, BASE, wl)
  by_session = {}
  for o in rep.outputs:
    s = o.rid.split(".")[0]
    if s in by_session:
      prev = by_session[s]
      computed_prev = len(prev.prompt) + len(prev.output) - 1
      expected = _floor(min(computed_prev, len(o.prompt) - 1))
      assert o.hit_tokens == expected, (o.rid, o.hit_tokens, expected)
      assert expected > 0
    else:
      assert o.hit_tokens == 0
    by_session[s] = o
  assert [o.rid for o in rep.outputs] == ["A.t0", "A.t1", "B.t2", "A.t3"]


@pytest.mark.parametrize("retention", [0, 128])
def test_hit_accounting_on_a_scripted_trace(tiny, retention):
  """Worked out by hand. r0: 300-token prompt, 10 answer tokens. r1 = r0's prompt + answer + 50 tokens resumes at
  floor((300 + 10 - 1) / 128) * 128 = 256. r2 shares only r0's first 200 tokens: its full blocks match up to 128, but
  a resume point needs an SWA checkpoint there: with retention_interval 0 the only checkpoints are at 256 (prompt
  boundary / end of r0, r1's) plus cache v2's dense-start checkpoints (128 * 2^k inside the prompt: 128, 256), so
  r2 hits 128 under either retention_interval (cache v1 gave 0 with retention 0)."""
  cfg, params = tiny
  rng = np.random.default_rng(11)
  p0 = [int(t) for t in rng.integers(2, cfg.vocab_size, 300)]
  sp = SamplingParams(max_tokens=10, ignore_eos=True)
  eng = Engine(params, cfg, dataclasses.replace(BASE, retention_interval=retention))
  (r0,) = generate(params, cfg, [p0], sp, engine=eng)
  p1 = p0 + r0.output + [int(t) for t in rng.integers(2, cfg.vocab_size, 50)]
  (r1,) = generate(params, cfg, [p1], sp, engine=eng)
  p2 = p0[:200] + [int(t) for t in rng.integers(2, cfg.vocab_size, 90)]
  (r2,) = generate(params, cfg, [p2], sp, engine=eng)
  assert (r0.hit_tokens, r1.hit_tokens, r2.hit_tokens) == (0, 256, 128), retention
  assert r1.computed_tokens == len(p1) - 256 + len(r1.output) - 1
  assert eng.stats["computed_tokens"] == sum(o.computed_tokens for o in (r0, r1, r2))


def test_bad_input_gets_a_clear_error_and_the_batch_goes_on(tiny):
  cfg, params = tiny
  good = [5, 6, 7, 8] * 10
  prompts = [good, [], [1, 2, cfg.vocab_size + 3], [3] * 1024, [4] * 1000, good]
  sps = [SamplingParams(max_tokens=4, ignore_eos=True)] * 4 + [SamplingParams(max_tokens=100, ignore_eos=True),
                                                               SamplingParams(max_tokens=0)]
  outs = generate(params, cfg, prompts, sps, engine=Engine(params, cfg, BASE))
  assert outs[0].error is None and len(outs[0].output) == 4
  assert "empty prompt" in outs[1].error
  assert "out of range" in outs[2].error
  assert "max_model_len" in outs[3].error
  assert "max_tokens" in outs[4].error and "exceeds" in outs[4].error
  assert "max_tokens must be >= 1" in outs[5].error


def test_pool_too_small_for_one_request_is_rejected_not_hung(tiny):
  cfg, params = tiny
  # 4 full blocks hold 512 tokens: a 700-token prompt can never fit, even alone (found mid-prefill).
  outs = generate(params, cfg, [[7] * 700, [7] * 40], SamplingParams(max_tokens=4, ignore_eos=True),
                  engine=Engine(params, cfg, TINY_POOL))
  assert "too small" in outs[0].error
  assert outs[1].error is None and len(outs[1].output) == 4


def test_admitted_together_and_too_big_for_the_pool_are_all_rejected(tiny):
  """Admitted in one step, none of them can get its first chunk's blocks even alone (1 swa block): each is rejected
  at its first allocation, not given back and re-admitted forever."""
  cfg, params = tiny
  eng = Engine(params, cfg, dataclasses.replace(TINY_POOL, num_swa_blocks=1))
  outs = generate(params, cfg, [[7] * 100, [8] * 100, [9] * 50], SamplingParams(max_tokens=4, ignore_eos=True),
                  engine=eng)
  assert all("too small" in o.error for o in outs)
  assert eng.stats["steps"] <= 3


def test_v41_cache_never_changes_the_answer():
  """V4.1 (CSA2 roles, ratio-2 pending rows, Engram token ids) through the same engine and cache manager: prefix
  hits and preemption (tiny pool) give the same tokens as caching off."""
  cfg = config.v41_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  wl = workloads.chat(cfg.vocab_size, sessions=3, turns=3, system_len=140, seed=0)
  eng_on, on = _run((cfg, params), BASE, wl)
  eng_off, off = _run((cfg, params), dataclasses.replace(BASE, enable_prefix_caching=False), wl)
  eng_pre, pre = _run((cfg, params), TINY_POOL, wl)
  assert on.summary()["prefix_hit_tokens"] > 0 and pre.summary()["preemptions"] > 0
  _assert_same_answers(on, eng_on, off, eng_off)
  _assert_same_answers(on, eng_on, pre, eng_pre)
