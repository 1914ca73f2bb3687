"""Engine steps per second, synchronous vs async scheduling, on a decode-heavy workload (tiny widths, CPU).

    python -m benchmarks.async_bench                      # 64 requests x 256 generated tokens, v4_tiny
    python -m benchmarks.async_bench --requests=16 --max_tokens=32 --repeats=1     # quick look

Both engines run the same requests (greedy) on the same model; each is warmed up first (every step program
compiled) and the modes are timed alternately `--repeats` times (medians), so load from other processes hits both
alike. Prints steps/s, tokens/s, host time per step outside the device wait, the ratio async / sync, and checks
that both produced the same tokens.
"""

from __future__ import annotations

import dataclasses
import time

from absl import app, flags
import jax
import numpy as np

from dsv4 import config, model
from dsv4.engine.api import generate
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams

flags.DEFINE_integer("requests", 64, "Requests (all admitted at once: max_num_seqs = requests).")
flags.DEFINE_integer("prompt_len", 16, "Prompt tokens per request.")
flags.DEFINE_integer("max_tokens", 256, "Generated tokens per request.")
flags.DEFINE_integer("repeats", 3, "Timed runs per mode, alternating (median reported).")
flags.DEFINE_string("preset", "v4_tiny", "Model preset (tiny widths keep the device step short).")
FLAGS = flags.FLAGS


def run_once(params, cfg, ec, prompts, max_tokens):
  eng = Engine(params, cfg, ec)
  sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
  generate(params, cfg, prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True), engine=eng)   # compile
  generate(params, cfg, prompts, sp, engine=eng)                                                   # all shapes
  steps0 = eng.stats["steps"]
  t = time.perf_counter()
  outs = generate(params, cfg, prompts, sp, engine=eng)
  wall = time.perf_counter() - t
  return wall, eng.stats["steps"] - steps0, [o.output for o in outs]


def main(argv):
  del argv
  cfg = config.get_preset(FLAGS.preset)
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  n, L, T = FLAGS.requests, FLAGS.prompt_len, FLAGS.max_tokens
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(2, cfg.vocab_size, L)] for _ in range(n)]
  ec = EngineConfig(max_num_seqs=n, max_num_batched_tokens=max(256, n * 4), chunk_size=64,
                    max_model_len=L + T + 64, num_full_blocks=n * (-(-(L + T + 64) // 128)) + 8,
                    num_swa_blocks=n * 8 + 16, enable_prefix_caching=False)
  print(f"# {FLAGS.preset}, {n} requests x {T} generated tokens (prompt {L}), max_num_seqs {n}, CPU "
        f"({jax.devices()[0].platform}), {FLAGS.repeats} alternating runs per mode")
  res = {True: [], False: []}
  toks = {}
  for _ in range(FLAGS.repeats):
    for mode in (False, True):
      wall, steps, out = run_once(params, cfg, dataclasses.replace(ec, async_scheduling=mode), prompts, T)
      res[mode].append((wall, steps))
      toks[mode] = out
  print("| mode | steps | wall s (median) | steps/s | tokens/s |")
  print("|---|---|---|---|---|")
  rate = {}
  for mode in (False, True):
    wall = float(np.median([w for w, _ in res[mode]]))
    steps = res[mode][0][1]
    rate[mode] = steps / wall
    print(f"| {'async' if mode else 'sync'} | {steps} | {wall:.2f} | {rate[mode]:.1f} | {n * T / wall:.0f} |")
  print(f"async / sync steps per second: {rate[True] / rate[False]:.2f}x; same tokens: {toks[True] == toks[False]}")


if __name__ == "__main__":
  app.run(main)
