"""Bucket fill on vs off (EngineConfig.bucket_fill), same workload, one run: steps, real tokens, padded flat-axis
slots and wall time of the engine loop (programs compiled in a warm-up pass first, then timed passes alternate).

A ragged step runs padded to its token bucket (8 * g^k); a step that spills a few tokens past a bucket pays for
the next one. Bucket fill trims the last prefill chunks (at most --fill of the step's prefill tokens) to stay in
the smaller bucket. The workload mixes decoding requests with long prompts arriving, so mixed steps spill.

    python -m benchmarks.probes.bucket_fill_bench [--fill=0.25] [--repeats=2]
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import numpy as np
from absl import app, flags

from dsv4 import config
from dsv4 import model
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams

flags.DEFINE_float("fill", 0.25, "bucket_fill of the 'on' engine.")
flags.DEFINE_integer("repeats", 2, "Timed passes per setting (alternating; median reported).")
flags.DEFINE_integer("growth", 4, "token_bucket_growth (the engine default is 4).")
FLAGS = flags.FLAGS


def workload(vocab: int, seed: int = 0):
  """12 requests: short prompts that decode for a while, long prompts in 64-token chunks beside them."""
  rng = np.random.default_rng(seed)
  lens = [24, 700, 40, 520, 16, 900, 32, 610, 20, 450, 28, 800]
  return [(f"r{i}", rng.integers(2, vocab, n).tolist(), SamplingParams(max_tokens=24 + 4 * (i % 3), ignore_eos=True))
          for i, n in enumerate(lens)]


def serve(params, cfg, ec, reqs):
  eng = Engine(params, cfg, ec)
  for rid, prompt, sp in reqs:
    eng.add_request(rid, prompt, sp)
  t = time.perf_counter()
  eng.run()
  wall = time.perf_counter() - t
  return eng, wall


def main(argv):
  del argv
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  base = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, chunk_size=64, max_model_len=2048,
                      num_full_blocks=256, num_swa_blocks=512, token_bucket_growth=FLAGS.growth)
  settings = {"off": dataclasses.replace(base, bucket_fill=0.0),
              "on": dataclasses.replace(base, bucket_fill=FLAGS.fill)}
  reqs = workload(cfg.vocab_size)
  outs, res = {}, {"config": cfg.name, "buckets": None}
  for name, ec in settings.items():            # warm-up: compiles every program either setting uses
    eng, _ = serve(params, cfg, ec, reqs)
    res["buckets"] = eng.runner.token_buckets()
  walls = {k: [] for k in settings}
  for _ in range(FLAGS.repeats):
    for name, ec in settings.items():
      eng, wall = serve(params, cfg, ec, reqs)
      walls[name].append(wall)
      outs[name] = eng
  for name, eng in outs.items():
    rs = eng.runner.stats
    res[name] = {"steps": eng.stats["steps"], "step_tokens": rs["step_tokens"], "step_slots": rs["step_slots"],
                 "padding_x": round(rs["step_slots"] / rs["step_tokens"], 3),
                 "trimmed_tokens": eng.stats["bucket_fill_trimmed_tokens"],
                 "trimmed_steps": eng.stats["bucket_fill_steps"], "wall_s": round(float(np.median(walls[name])), 3)}
  same = all(outs["on"].requests[r].output == outs["off"].requests[r].output for r, _, _ in reqs)
  res["same_tokens"] = same
  res["wall_off_over_on"] = round(res["off"]["wall_s"] / res["on"]["wall_s"], 3)
  res["slots_off_over_on"] = round(res["off"]["step_slots"] / res["on"]["step_slots"], 3)
  print(json.dumps(res, indent=1))


if __name__ == "__main__":
  app.run(main)
