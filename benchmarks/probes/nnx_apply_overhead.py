"""What running the model through the Flax NNX modules (`nnx_model.apply`) costs next to `model.forward`, in one
run, same inputs:

* whether the two traced programs (jaxprs of a prefill step) are identical: then XLA compiles the same program and
  the run time cost is nil by construction;
* trace time of each (median of --iters traces after a warm-up one, interleaved; `apply` adds `nnx.merge` of the cached graphdef and the
  tree check);
* jitted step wall time of each after the compile (median of --iters, interleaved; noisy on a shared CPU, only the ratio in
  this run means anything).

    python -m benchmarks.probes.nnx_apply_overhead [--variant v4|v41] [--iters 5] [--tokens 64]
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from dsv4 import caches, config, model, nnx_model

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_enum("variant", "v4", ["v4", "v41"], "tiny model variant")
  flags.DEFINE_integer("iters", 5, "timed runs per path (median reported)")
  flags.DEFINE_integer("tokens", 64, "prefill tokens per row")


def main(argv):
  del argv
  args = FLAGS

  cfg = config.v4_tiny() if args.variant == "v4" else config.v41_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  B, T = 2, args.tokens
  cache, swa, full = caches.init_contiguous(cfg, B, T, caches.CacheLayout())
  toks = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, cfg.vocab_size, jnp.int32)
  idx = caches.BatchIndex(jnp.zeros(B, jnp.int32), jnp.full((B,), T, jnp.int32), jnp.asarray(swa),
                          jnp.asarray(full))

  def fwd(p, t, c, i):
    return model.forward(p, cfg, t, c, i)

  def app(p, t, c, i):
    return nnx_model.apply(p, t, c, i, config=cfg)

  nnx_model.abstract_model(cfg)  # the one-off eval_shape of the modules, outside the timed traces
  fns = {"forward": fwd, "apply": app}
  jitted = {k: jax.jit(f) for k, f in fns.items()}
  jaxprs = {k: str(jax.make_jaxpr(f)(params, toks, cache, idx)) for k, f in fns.items()}  # warm-up traces
  for k in fns:
    jax.block_until_ready(jitted[k](params, toks, cache, idx))                             # compile
  trace_t, step_t = {k: [] for k in fns}, {k: [] for k in fns}
  for _ in range(args.iters):  # interleaved, so load drift on a shared box hits both alike
    for k, f in fns.items():
      fresh = lambda *a, f=f: f(*a)  # a new function object: make_jaxpr caches traces per function
      t0 = time.perf_counter()
      jax.make_jaxpr(fresh)(params, toks, cache, idx)
      trace_t[k].append(time.perf_counter() - t0)
      t0 = time.perf_counter()
      jax.block_until_ready(jitted[k](params, toks, cache, idx))
      step_t[k].append(time.perf_counter() - t0)
  trace_s = {k: statistics.median(v) for k, v in trace_t.items()}
  step_s = {k: statistics.median(v) for k, v in step_t.items()}
  print(f"{cfg.name} ({args.variant}), prefill B={B} T={T}, median of {args.iters}")
  print(f"jaxprs identical: {jaxprs['forward'] == jaxprs['apply']} ({len(jaxprs['forward'].splitlines())} lines)")
  print(f"trace  forward {trace_s['forward'] * 1e3:8.1f} ms   apply {trace_s['apply'] * 1e3:8.1f} ms   "
        f"ratio {trace_s['apply'] / trace_s['forward']:.2f}")
  print(f"step   forward {step_s['forward'] * 1e3:8.1f} ms   apply {step_s['apply'] * 1e3:8.1f} ms   "
        f"ratio {step_s['apply'] / step_s['forward']:.2f}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
