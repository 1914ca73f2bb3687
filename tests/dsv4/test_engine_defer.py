"""In-batch shared-prefix deferral (EngineConfig.defer_shared_prefix): a cold wave of sessions that share only a
system prompt, all admitted in one step, hits the system prompt from the second session on; the answers are those
of a run without any cache.

Hand computation (v4_tiny: 128-token full blocks = resume alignment, 32-token swa blocks, 1-block tail). The wave is
3 sessions, each a 256-token system prompt + 300..340 own tokens (workloads.chat, seed 4). The leader (first in the
queue, hits nothing) takes the dense-start checkpoints 128 and 256 (and its re-render boundary, >= 384), so the
followers, which share exactly 256 tokens with it, are held back until it has computed 256 tokens and then hit
S = 256. Without deferral all three are admitted in the first step and hit nothing: [0, 0, 0]."""

import dataclasses

import jax
import numpy as np
import pytest

from dsv4 import config, model
from dsv4.engine import workloads
from dsv4.engine.api import run_workload
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine

EC = EngineConfig(max_num_seqs=4, max_num_batched_tokens=192, chunk_size=64, max_model_len=1024,
                  num_full_blocks=48, num_swa_blocks=160, record_logits=True)


@pytest.fixture(scope="module")
def tiny():
  cfg = config.v4_tiny()
  return cfg, model.init_params(cfg, jax.random.PRNGKey(0))


def _wave(cfg):
  wl = workloads.chat(cfg.vocab_size, sessions=3, turns=1, system_len=256, user_len=(300, 340),
                      answer_len=(4, 6), seed=4)
  prompts = [t.new_tokens for t in wl.waves[0]]
  # the trace must share exactly the 256-token system prompt (a chance match at 256 would change the hand count)
  assert all(p[:256] == prompts[0][:256] for p in prompts)
  assert len({p[256] for p in prompts}) == 3
  return wl


def _run(tiny, ec):
  cfg, params = tiny
  eng = Engine(params, cfg, ec)
  return eng, run_workload(eng, _wave(cfg))


def test_cold_wave_followers_hit_the_system_prompt(tiny):
  eng_on, on = _run(tiny, EC)
  eng_off, off = _run(tiny, dataclasses.replace(EC, defer_shared_prefix=False))
  eng_nc, nc = _run(tiny, dataclasses.replace(EC, enable_prefix_caching=False))
  assert [o.hit_tokens for o in on.outputs] == [0, 256, 256]
  assert [o.hit_tokens for o in off.outputs] == [0, 0, 0]
  assert eng_on.stats["deferred_requests"] == 2 and eng_on.stats["deferred_steps"] > 0
  assert eng_off.stats["deferred_steps"] == 0 and eng_nc.stats["deferred_steps"] == 0
  # the followers computed 256 tokens fewer each
  assert [o.computed_tokens for o in on.outputs] == [o.computed_tokens - h for o, h in zip(nc.outputs,
                                                                                        [0, 256, 256])]
  for rep, eng in [(on, eng_on), (off, eng_off)]:
    for o, ref in zip(rep.outputs, nc.outputs):
      assert o.error is None and o.output == ref.output, o.rid
      la = np.stack(o.token_logits)
      lb = np.stack(ref.token_logits)
      assert np.max(np.abs(la - lb)) <= 1e-5 * max(1.0, np.max(np.abs(lb))), o.rid


def test_followers_wait_only_for_the_leaders_shared_prefill(tiny):
  """The leader computes 64 tokens per step (chunk_size): it passes 256 after 4 steps, so the followers are held
  back exactly in steps 1..4 (2 followers x 4 steps). Their admissions (search and claim) go with step 5's
  program; its results are read while step 6 runs (async scheduling), so they run from step 7 (from step 6
  without async scheduling)."""
  cfg, params = tiny
  eng = Engine(params, cfg, EC)
  wl = _wave(cfg)
  for t in wl.waves[0]:
    eng.add_request(t.session, list(t.new_tokens), t.params)
  admitted = {}
  while eng.has_work():
    eng.step()
    for r in eng.running:
      admitted.setdefault(r.rid, eng.stats["steps"])
  assert admitted == {"chat0": 1, "chat1": 7, "chat2": 7}
  assert eng.stats["deferred_steps"] == 8


def test_preempted_leader_releases_its_followers(tiny):
  """A leader that leaves `running` (here: preempted, and queued behind its followers) holds nobody back: the
  first follower is admitted at once and leads the others (the old leader included); nothing deadlocks and the
  answers are those of a run without cache."""
  cfg, params = tiny
  eng = Engine(params, cfg, EC)
  wl = _wave(cfg)
  for t in wl.waves[0]:
    eng.add_request(t.session, list(t.new_tokens), t.params)
  eng.step()
  lead = eng.requests["chat0"]
  assert eng.running == [lead] and [r.rid for r in eng.waiting] == ["chat1", "chat2"]
  eng.scheduler.preempt(lead)
  eng.waiting.rotate(-1)           # [chat1, chat2, chat0]
  eng.step()
  assert [r.rid for r in eng.running] == ["chat1"]
  assert [r.rid for r in eng.waiting] == ["chat2", "chat0"]
  while eng.has_work():
    eng.step()
  nc = Engine(params, cfg, dataclasses.replace(EC, enable_prefix_caching=False))
  ref = run_workload(nc, wl)
  assert [eng.requests[o.rid.split(".")[0]].output for o in ref.outputs] == [o.output for o in ref.outputs]
  assert [eng.requests[r].hit_tokens for r in ("chat1", "chat2")] == [0, 256]
  assert eng.requests["chat0"].readmit_hit_tokens == 256
