"""benchmarks.support.plain_step, the baseline `step_bench` times the step against: it still traces the model as
the model is (its swapped ops take the arguments the model passes), and on one decode step and one prefill step
it gives the step's greedy tokens (fp32, where the two differ only in summation order)."""

import jax
import numpy as np

from benchmarks.support.bare_runner import make_runner, rows_at
from benchmarks.support.plain_step import make_plain
from dsv4 import caches, config, model


def test_the_plain_step_runs_the_model_and_agrees_with_the_step():
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  kw = dict(max_model_len=4096, max_num_seqs=4, chunk_size=64, max_num_batched_tokens=64,
            layout=caches.CacheLayout())
  runs = [make_plain(make_runner(cfg, params, **kw)), make_runner(cfg, params, **kw)]
  for contexts, ntoks in (([0, 0], [40, 17]), ([40, 17], [1, 1])):
    outs = []
    for r in runs:
      rows = rows_at(getattr(r, "runner", r), contexts, ntoks, np.random.default_rng(0))
      outs.append([int(t) for t in np.asarray(r.run(rows)[0]).reshape(-1)])
    assert outs[0] == outs[1]
