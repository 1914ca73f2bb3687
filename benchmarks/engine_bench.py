"""Engine benchmark, everything measured in one run (ratios are what to read; CPU timings are noisy):

1. TTFT of a resumed long session (a new turn after a long history) with and without prefix reuse.
2. Throughput of the engine on a batch of requests vs the same requests run one by one through the same engine.

Prints two markdown tables (`--json`: also every number as JSON).

    python -m benchmarks.engine_bench [--history=1500] [--requests=8] [--json]
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import numpy as np
from absl import app, flags

from benchmarks.support.table import print_table
from dsv4 import config
from dsv4 import model
from dsv4.engine.api import generate
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams

flags.DEFINE_integer("history", 1500, "Tokens of the long session before the resumed turn.")
flags.DEFINE_integer("requests", 8, "Requests in the throughput comparison.")
flags.DEFINE_integer("max_tokens", 16, "Tokens generated per request.")
flags.DEFINE_integer("repeats", 3, "Repeats of the TTFT measurement (median reported).")
flags.DEFINE_bool("json", False, "Also print every number as JSON.")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  ec = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, chunk_size=128, max_model_len=4096,
                    num_full_blocks=96, num_swa_blocks=512)
  sp = SamplingParams(max_tokens=FLAGS.max_tokens, ignore_eos=True)
  history = [int(t) for t in rng.integers(2, cfg.vocab_size, FLAGS.history)]
  turn = [int(t) for t in rng.integers(2, cfg.vocab_size, 32)]
  results = {}

  # Warm-up compiles the two step shapes once (the jit cache is shared by all engines of the same shapes).
  generate(params, cfg, [history[:200]], sp, engine=Engine(params, cfg, ec))

  for reuse in (True, False):
    ttfts, hits = [], []
    for r in range(FLAGS.repeats):
      eng = Engine(params, cfg, dataclasses.replace(ec, enable_prefix_caching=reuse))
      (first,) = generate(params, cfg, [history], sp, engine=eng)
      (resumed,) = generate(params, cfg, [history + first.output + turn], sp, engine=eng)
      ttfts.append(resumed.ttft_s)
      hits.append(resumed.hit_tokens)
    results[f"resumed_ttft_s_reuse_{'on' if reuse else 'off'}"] = float(np.median(ttfts))
    results[f"resumed_hit_tokens_reuse_{'on' if reuse else 'off'}"] = int(hits[0])
  results["resumed_ttft_speedup"] = results["resumed_ttft_s_reuse_off"] / results["resumed_ttft_s_reuse_on"]

  prompts = [[int(t) for t in rng.integers(2, cfg.vocab_size, int(n))] for n in rng.integers(64, 400,
                                                                                            FLAGS.requests)]
  eng = Engine(params, cfg, dataclasses.replace(ec, enable_prefix_caching=False))
  t = time.perf_counter()
  batched = generate(params, cfg, prompts, sp, engine=eng)
  t_batched = time.perf_counter() - t
  eng = Engine(params, cfg, dataclasses.replace(ec, enable_prefix_caching=False))
  t = time.perf_counter()
  single = [generate(params, cfg, [p], sp, engine=eng)[0] for p in prompts]
  t_single = time.perf_counter() - t
  assert [o.output for o in batched] == [o.output for o in single], "batching changed an answer"
  gen = sum(len(o.output) for o in batched)
  results.update(batched_s=t_batched, one_by_one_s=t_single, batched_gen_tok_per_s=gen / t_batched,
                 one_by_one_gen_tok_per_s=gen / t_single, batched_speedup=t_single / t_batched)
  if FLAGS.json:
    print(json.dumps(results, indent=2))
  print_tables(results)


def print_tables(r: dict) -> None:
  print_table(["prefix reuse", "TTFT s (median)", "hit tokens"],
              [["on", r["resumed_ttft_s_reuse_on"], r["resumed_hit_tokens_reuse_on"]],
               ["off", r["resumed_ttft_s_reuse_off"], r["resumed_hit_tokens_reuse_off"]],
               ["off / on", r["resumed_ttft_speedup"], None]],
              title=f"1. Resumed session: {FLAGS.history}-token history + answer + 32 new tokens, v4_tiny "
                    f"(median of {FLAGS.repeats})")
  print_table(["mode", "wall s", "generated tok/s"],
              [["batched", r["batched_s"], r["batched_gen_tok_per_s"]],
               ["one by one", r["one_by_one_s"], r["one_by_one_gen_tok_per_s"]],
               ["one by one / batched", r["batched_speedup"], None]],
              title=f"2. {FLAGS.requests} requests of 64-400 prompt tokens, {FLAGS.max_tokens} generated each "
                    "(same answers checked)")


if __name__ == "__main__":
  app.run(main)
