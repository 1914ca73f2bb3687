"""A `ModelRunner` without an engine, and rows placed on it at given contexts: what the step benchmarks and probes
time (`benchmarks/step_bench.py`, `benchmarks/probes/step_profile.py`) and the tests that check their baseline. No
flags here, so tests can import it beside any benchmark script."""

from __future__ import annotations

import numpy as np

from dsv4 import caches
from dsv4.engine.config import EngineConfig
from dsv4.engine.runner import ModelRunner, Row
from dsv4.engine.sampling import SamplingParams


def make_runner(cfg, params, *, max_model_len, max_num_seqs, chunk_size=64, max_num_batched_tokens=4096, **kw):
  """A runner without an engine (its own block tables, `rows_at` sets them); kw: further EngineConfig fields."""
  layout = kw.pop("layout", caches.CacheLayout())
  nf = 8 * 64 * 1024 // layout.full_block_tokens + 8
  ec = EngineConfig(num_swa_blocks=4 * max_num_seqs + 64, num_full_blocks=nf, max_num_seqs=max_num_seqs,
                    chunk_size=chunk_size, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                    layout=layout, **kw)
  return ModelRunner(params, cfg, ec)


def rows_at(run: ModelRunner, contexts, ntoks, rng):
  """One row per context: tables cover [0, ctx + n) (full blocks distinct per row, swa blocks only for the tail
  the window reads, released (-1) before it, as in serving)."""
  lay = run.engine_config.layout
  out = []
  for i, (ctx, n) in enumerate(zip(contexts, ntoks)):
    slot = i
    end = ctx + n
    nfb = -(-end // lay.full_block_tokens)
    full = (np.arange(nfb) + i * (64 * 1024 // lay.full_block_tokens)) % run.cache.layers[1]["comp_kv"].shape[0]
    nsb = -(-end // lay.swa_block_tokens)
    swa = np.full(nsb, -1, np.int32)
    live = max(0, (ctx - 64) // lay.swa_block_tokens)
    swa[live:] = (np.arange(nsb - live) + 4 * i) % run.cache.layers[0]["window_kv"].shape[0]
    run.set_tables(slot, swa, full.astype(np.int32))
    out.append(Row(slot, [int(t) for t in rng.integers(2, 500, n)], ctx, SamplingParams(), 0))
  return out
