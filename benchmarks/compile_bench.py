"""XLA CPU compile cost of the model's forward: process CPU seconds (user + system) of the first `forward_full` call
(trace + lower + compile; the run itself is tiny), and the size of the optimized HLO module.

CPU seconds, not wall time, so that a loaded machine does not change the number much. Prints a one-row markdown
table. Run it with `XLA_FLAGS=--xla_backend_optimization_level=0` for what the test suite's processes pay.

    python -m benchmarks.compile_bench [--layers=2] [--tokens=32]
"""

import os
import resource
import tempfile

import jax
import numpy as np
from absl import app, flags

from benchmarks.support.table import print_table
from dsv4 import config, model

flags.DEFINE_integer("layers", 2, "v4_tiny layers")
flags.DEFINE_integer("tokens", 32, "prompt tokens (2 rows)")
FLAGS = flags.FLAGS


def _cpu_s() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def main(_):
  dump = tempfile.mkdtemp(prefix="dsv4-hlo-")
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} --xla_dump_hlo_pass_re=^$"
  cfg = config.v4_tiny(num_layers=FLAGS.layers, vocab_size=64)
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  tokens = np.ones((2, FLAGS.tokens), np.int32)
  t0 = _cpu_s()
  model.forward_full(params, cfg, tokens)
  first = _cpu_s() - t0
  t0 = _cpu_s()
  model.forward_full(params, cfg, tokens)
  second = _cpu_s() - t0
  opt = [f for f in os.listdir(dump) if "forward_jit" in f and f.endswith("cpu_after_optimizations.txt")]
  lines = sum(open(os.path.join(dump, f)).read().count("\n") for f in opt)
  print_table(["config", "layers", "tokens (x 2 rows)", "first forward_full CPU s (trace + compile)",
               "second call CPU s", "optimized HLO lines (forward_jit)"],
              [["v4_tiny", FLAGS.layers, FLAGS.tokens, round(first, 1), round(second, 2), lines]])


if __name__ == "__main__":
  app.run(main)
