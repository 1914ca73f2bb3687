"""Bucket fill (EngineConfig.bucket_fill): a step that spills a few tokens past a token bucket has its last prefill
chunks trimmed to fit the smaller bucket. Same answers as without it, fewer padded slots, decode rows untouched."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from dsv4 import config, model
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams

# The bucketed step (bucket fill is its rule; the invariant step has no token buckets): buckets 8, 32, 128, 256
# (growth 4, budget 256).
EC = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, chunk_size=64, max_model_len=1024,
                  num_full_blocks=48, num_swa_blocks=160, record_logits=True, token_bucket_growth=4,
                  batch_invariant=False)


@pytest.fixture(scope="module")
def tiny():
  cfg = config.v4_tiny()
  return cfg, model.init_params(cfg, jax.random.PRNGKey(0))


def _serve(tiny, ec):
  cfg, params = tiny
  rng = np.random.default_rng(5)
  eng = Engine(params, cfg, ec)
  # Two short prompts (decoding from step 2 on) beside two long ones (64-token chunks): step 1 is 10 + 10 + 64 + 64
  # = 148 tokens (bucket 256, 128 with 20 tokens deferred); later steps 1 + 1 + 64 + 64 = 130 (2 deferred).
  for i, n in enumerate((10, 10, 300, 260)):
    eng.add_request(f"r{i}", rng.integers(2, cfg.vocab_size, n).tolist(),
                    SamplingParams(max_tokens=12, ignore_eos=True))
  eng.run()
  return eng


def test_bucket_fill_same_answers_fewer_slots(tiny):
  on = _serve(tiny, EC)
  off = _serve(tiny, dataclasses.replace(EC, bucket_fill=0.0))
  assert on.stats["bucket_fill_steps"] > 0 and on.stats["bucket_fill_trimmed_tokens"] > 0
  assert off.stats["bucket_fill_steps"] == 0
  # The same real tokens, fewer padded slots.
  assert on.runner.stats["step_tokens"] == off.runner.stats["step_tokens"]
  assert on.runner.stats["step_slots"] < off.runner.stats["step_slots"]
  for rid, ra in on.requests.items():
    rb = off.requests[rid]
    assert ra.error is None and rb.error is None
    assert ra.output == rb.output, rid
    la, lb = np.stack(ra.token_logits), np.stack(rb.token_logits)
    assert np.max(np.abs(la - lb)) <= 1e-5 * max(1.0, np.max(np.abs(la))), rid


def test_bucket_fill_rules(tiny):
  cfg, params = tiny
  eng = Engine(params, cfg, EC)
  assert eng.runner.token_buckets() == [8, 32, 128, 256]
  # stand-ins for requests: the rule reads only whether a row verifies drafts (a decode row, never trimmed)
  a, b, c, d = (types.SimpleNamespace(step_drafts=0) for _ in range(4))
  # 1 + 1 + 64 + 64 = 130 -> 128: the last prefill row gives 2 tokens; decode rows untouched.
  assert eng.scheduler.fill_bucket([(a, 1), (b, 64), (c, 1), (d, 64)]) == [(a, 1), (b, 64), (c, 1), (d, 62)]
  # Excess spread backwards over prefill rows, each keeps >= 1 token: 40 -> 32 (8 deferred <= 25% of 40).
  assert eng.scheduler.fill_bucket([(a, 30), (b, 4), (c, 3), (d, 3)]) == [(a, 29), (b, 1), (c, 1), (d, 1)]
  # Too much to defer (64 + 64 + 64 = 192 -> 128 would defer 64 of 192 > 25%): unchanged.
  s = [(a, 64), (b, 64), (c, 64)]
  assert eng.scheduler.fill_bucket(s) == s
  # Only decode rows: nothing to trim.
  s = [(a, 1)] * 4
  assert eng.scheduler.fill_bucket(s) == s
  # Exactly a bucket: nothing spills.
  s = [(a, 64), (b, 64)]
  assert eng.scheduler.fill_bucket(s) == s
  # Off, or a mesh / batch-invariant runner (no token buckets): unchanged.
  s = [(a, 1), (b, 64), (c, 1), (d, 64)]
  assert Engine(params, cfg, dataclasses.replace(EC, bucket_fill=0.0)).scheduler.fill_bucket(s) == s
  assert Engine(params, cfg, dataclasses.replace(EC, batch_invariant=True)).scheduler.fill_bucket(s) == s
  with pytest.raises(ValueError, match="bucket_fill"):
    Engine(params, cfg, dataclasses.replace(EC, bucket_fill=1.0))


@pytest.mark.parametrize("growth,steps", [(2, 1), (2, 4), (4, 4), (4, 3), (2, 8)])
def test_token_bucket_steps_bound_the_padding(growth, steps):
  from dsv4.engine import step_plan
  budget = 2048
  fine = step_plan.token_buckets(growth, budget, steps)
  coarse = step_plan.token_buckets(growth, budget)
  assert fine == sorted(set(fine)) and set(coarse) <= set(fine) and all(b % 8 == 0 for b in fine)
  assert fine[-1] == coarse[-1] == budget
  # Every step of t tokens pads to at most (1 + (growth - 1) / steps) t, up to the multiple-of-8 rounding.
  for t in range(1, budget + 1):
    b = step_plan.token_bucket(t, growth, budget, steps)
    assert b >= t and b in fine
    assert b <= max(8, (1 + (growth - 1) / steps) * t + 8), (t, b)
  if steps == 1:
    assert fine == coarse
  else:
    assert len(fine) > len(coarse)


def test_token_bucket_steps_same_answers_fewer_slots(tiny):
  fine = _serve(tiny, dataclasses.replace(EC, token_bucket_steps=4))
  coarse = _serve(tiny, EC)
  assert fine.runner.token_buckets() == [8, 16, 24, 32, 56, 80, 104, 128, 160, 192, 224, 256]
  assert fine.runner.stats["step_slots"] < coarse.runner.stats["step_slots"]
  for rid, ra in fine.requests.items():
    rb = coarse.requests[rid]
    assert ra.error is None and ra.output == rb.output, rid
    la, lb = np.stack(ra.token_logits), np.stack(rb.token_logits)
    assert np.max(np.abs(la - lb)) <= 1e-5 * max(1.0, np.max(np.abs(la))), rid
  with pytest.raises(ValueError, match="token_bucket_steps"):
    Engine(tiny[1], tiny[0], dataclasses.replace(EC, token_bucket_steps=0))
