"""Does a running sum cost O(n^2) in the cache's programs on the CPU? JAX lowers `jnp.cumsum` to a reduce-window
there, which would be quadratic if XLA ran it as written; the release loop (`cache.step._free_runs`,
`cache.pool._free_core`) takes running sums over a chunk of entries, so it decides whether wide chunks pay.

    python -m benchmarks.probes.cumsum_cpu [--sizes 256,1024,4096] [--iters 200]

Compiled with the cache's own CPU options (`cache.step.CPU_COMPILER_OPTIONS`). Prints, per length, us per call
of `jnp.cumsum`, of `lax.associative_scan(add)` (log-depth) and of an elementwise add (the call floor). Read: if
the cumsum grew with n^2 it would be 16x per 4x of n."""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from cache import step as cache_step

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("sizes", "256,1024,4096", "running-sum lengths")
  flags.DEFINE_integer("iters", 200, "timed calls per length")


def _us_per_call(f, x, iters: int) -> float:
  f(x).block_until_ready()
  t = time.perf_counter()
  for _ in range(iters):
    r = f(x)
  r.block_until_ready()
  return (time.perf_counter() - t) / iters * 1e6


def main(argv):
  del argv
  a = FLAGS
  opts = dict(cache_step.CPU_COMPILER_OPTIONS or {}) if jax.default_backend() == "cpu" else {}
  jit = lambda f: jax.jit(f, compiler_options=opts or None)
  cumsum, scan, floor = jit(jnp.cumsum), jit(lambda x: jax.lax.associative_scan(jnp.add, x)), jit(lambda x: x + 1)
  print("| n | cumsum us | associative scan us | add (floor) us |\n|---|---|---|---|")
  for n in (int(s) for s in a.sizes.split(",")):
    x = jnp.asarray(np.random.default_rng(0).integers(0, 2, n), jnp.int32)
    assert np.array_equal(cumsum(x), scan(x))
    print(f"| {n} | {_us_per_call(cumsum, x, a.iters):.1f} | {_us_per_call(scan, x, a.iters):.1f} | "
          f"{_us_per_call(floor, x, a.iters):.1f} |")


if __name__ == "__main__":
  define_flags()
  app.run(main)
