"""What an in-place update of a 16-bit float pool costs on XLA's CPU, the facts the step's CPU choices rest on
(docs/engine.md, the invariant step; BUILD_NOTES.md, Invariant step cost).

Writes 8 rows into a [rows, 64] pool (donated), median of --repeats calls, five ways:
  bf16 scatter             the pool's own dtype (XLA's CPU converts the whole pool to fp32 and back)
  bf16 through bits        bitcast to uint16, scatter, bitcast back (`caches.write_rows` on the CPU)
  uint16 pool              a pool stored as words (no bitcast)
  uint16 in lax.switch     the word pool's scatter inside a three-way conditional (XLA copies updated operands)
  bf16, no normalization   the bf16 scatter compiled without XLA's `float-normalization-bf16` pass; then whether a
                           bf16 dot still compiles that way

    python -m benchmarks.probes.cpu_inplace [--rows=131328] [--repeats=5]
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

flags.DEFINE_integer("rows", 131328, "Pool rows (the wide config's largest bf16 pool at max_model_len 64k).")
flags.DEFINE_integer("repeats", 5, "Timed calls per way.")
FLAGS = flags.FLAGS

NO_NORMALIZATION = {"xla_disable_hlo_passes": "float-normalization-bf16"}


def _bits(a):
  return jax.lax.bitcast_convert_type(a, jnp.uint16)


def _time(fn, pool, *args, options=None) -> float:
  compiled = jax.jit(fn, donate_argnums=0).lower(pool, *args).compile(compiler_options=options)
  p = compiled(jnp.zeros_like(pool), *args)
  jax.block_until_ready(p)
  ts = []
  for _ in range(FLAGS.repeats):
    t0 = time.perf_counter()
    p = compiled(p, *args)
    jax.block_until_ready(p)
    ts.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(ts))


def main(argv):
  del argv
  n = FLAGS.rows
  pool = jnp.zeros((n, 64), jnp.bfloat16)
  rows = jnp.ones((2048, 64), jnp.bfloat16)
  idx = jnp.where(jnp.arange(2048) < 8, jnp.arange(2048) * 7, n).astype(jnp.int32)   # 8 rows, the rest dropped

  def switched(p, i, r, k):
    branch = lambda w: (lambda p, i, r: p.at[i[:w]].set(_bits(r[:w]), mode="drop"))
    return jax.lax.switch(k, [branch(64), branch(512), branch(2048)], p, i, r)

  ways = [
      ("bf16 scatter", lambda p, i, r: p.at[i].set(r, mode="drop"), pool, None),
      ("bf16 through bits", lambda p, i, r: jax.lax.bitcast_convert_type(
          _bits(p).at[i].set(_bits(r), mode="drop"), jnp.bfloat16), pool, None),
      ("uint16 pool", lambda p, i, r: p.at[i].set(_bits(r), mode="drop"), _bits(pool), None),
      ("bf16, no normalization", lambda p, i, r: p.at[i].set(r, mode="drop"), pool, NO_NORMALIZATION),
  ]
  print(f"pool [{n}, 64], 8 rows written, median of {FLAGS.repeats} (ms):")
  for name, fn, p, options in ways:
    print(f"  {name:24s} {_time(fn, p, idx, rows, options=options):9.3f}")
  print(f"  {'uint16 in lax.switch':24s} {_time(switched, _bits(pool), idx, rows, 0):9.3f}")
  w = jnp.ones((64, 64), jnp.bfloat16)
  try:
    jax.jit(lambda x: x @ w).lower(rows).compile(compiler_options=NO_NORMALIZATION)
    print("  a bf16 dot without the pass: compiles")
  except Exception as e:   # XLA's CPU dot emitter rejects bf16 operands
    print(f"  a bf16 dot without the pass: {type(e).__name__}: {str(e).splitlines()[0][:110]}")


if __name__ == "__main__":
  app.run(main)
