"""The Pallas kernels inside the engine: a short trace (prefill chunks next to decodes) with
`KernelConfig("interpret")` (sparse MLA with per-query window / compressed lengths, the fused indexer top-k, the
score kernel for the V4.1 candidate source, the grouped expert kernel) gives the XLA backend's greedy tokens and logits, and the model's indexer
really goes through the fused top-k kernel when kernels are on."""

import dataclasses

import jax
import numpy as np
import pytest

from dsv4 import config, model
from dsv4.engine.api import generate
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams
from pallas_kernels import dispatch
from pallas_kernels.grouped_dot import GroupedDotTuning

# Small tables (a 128-token limit) keep the interpret-mode indexer to at most 128 entries per query.
EC = EngineConfig(max_num_seqs=3, max_num_batched_tokens=32, chunk_size=16, max_model_len=128, num_full_blocks=8,
                  num_swa_blocks=32, record_logits=True)


SMALL = GroupedDotTuning(block_cols=16, block_k=16)


def _spy(monkeypatch, ops=("sparse_attention", "indexer_scores", "indexer_topk", "grouped_dot")):
  """Count the calls (at trace time) of the registered kernels."""
  calls = {op: 0 for op in ops}
  for op in ops:
    fn = dispatch._KERNELS[op]

    def counted(*a, _fn=fn, _op=op, **k):
      calls[_op] += 1
      return _fn(*a, **k)

    monkeypatch.setitem(dispatch._KERNELS, op, counted)
  return calls


def _run(cfg, params, backend, prompts, max_tokens, ec):
  # grouped expert tiles that divide the tiny experts' shapes (D 64, I 32), so the routed experts take the kernel
  eng = Engine(params, cfg, dataclasses.replace(ec, kernel=dispatch.KernelConfig(backend, grouped_dot_tuning=SMALL)))
  outs = generate(params, cfg, prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), engine=eng)
  assert all(o.error is None for o in outs), [o.error for o in outs]
  return [list(o.output) for o in outs], [np.stack(o.token_logits) for o in outs]


def _compare(cfg, monkeypatch, prompt_lens, max_tokens, ec):
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(2, cfg.vocab_size, n)] for n in prompt_lens]
  want_toks, want_logits = _run(cfg, params, "xla", prompts, max_tokens, ec)
  calls = _spy(monkeypatch)
  got_toks, got_logits = _run(cfg, params, "interpret", prompts, max_tokens, ec)
  assert got_toks == want_toks
  for g, w in zip(got_logits, want_logits):
    np.testing.assert_allclose(g, w, atol=2e-3 * max(1.0, np.abs(w).max()), rtol=2e-3)
  return calls


def test_engine_interpret_kernels_give_the_xla_tokens(monkeypatch):
  """V4 with one layer of each kind (window, CSA with the fused top-k, HCA), one 8-token step program: the 36-token
  prompt gives the CSA layer 9 visible entries for top-k 8, so the kernels really select; 8-token steps put a
  prefill chunk and decode rows in one step."""
  ec = dataclasses.replace(EC, max_num_batched_tokens=8, chunk_size=8)
  calls = _compare(config.v4_tiny(num_layers=3), monkeypatch, (36, 21, 5), 3, ec)
  assert calls["sparse_attention"] > 0 and calls["indexer_topk"] > 0 and calls["grouped_dot"] > 0
  assert calls["indexer_scores"] == 0  # V4 has no candidate source: every indexer goes through the fused top-k


@pytest.mark.matrix   # on demand, ~2 min on 2 cores: 4 layers, two step programs, interpret-mode compiles
def test_engine_interpret_kernels_give_the_xla_tokens_v4(monkeypatch):
  """The whole tiny V4 (two CSA layers) with 16-token chunks next to decodes in 32-token steps."""
  calls = _compare(config.v4_tiny(), monkeypatch, (45, 38, 9), 3, EC)
  assert calls["sparse_attention"] > 0 and calls["indexer_topk"] > 0 and calls["indexer_scores"] == 0


@pytest.mark.matrix   # on demand, ~1.5 min on 2 cores: 8 layers in interpret mode
def test_engine_interpret_kernels_give_the_xla_tokens_v41(monkeypatch):
  """V4.1 (CSA2 full / reuse / reindex layers, ratio 2 and 1, a candidate source and a reindex layer restricted to
  its candidate blocks): past 32 tokens the ratio-1 layers have more than 4 candidate blocks of 8 entries."""
  calls = _compare(config.v41_tiny(), monkeypatch, (50, 41, 7), 3, EC)
  assert calls["sparse_attention"] > 0 and calls["indexer_topk"] > 0 and calls["indexer_scores"] > 0
