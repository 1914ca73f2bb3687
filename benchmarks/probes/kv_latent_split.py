"""The shared K = V latent is one head, so tensor parallelism cannot split it by head: keep it whole on every tensor
shard ("replicated") or split its feature dimension over `tensor` ("feature")? Measured in one run, both rules:

* per-device KV pool bytes of V4-Flash at a stated batch x context (exact, from the shardings);
* for a tiny V4 (8 heads) on a (1, tensor, 1) mesh of host devices: collectives in the compiled decode and prefill
  steps (counted in the optimized HLO), per-device cache bytes, and the step's wall time (median of --iters runs
  after a warm-up; CPU host devices share the cores, so only the ratio within this run means anything).

    python -m benchmarks.probes.kv_latent_split [--tensor 8] [--iters 5]
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks import sizing
from dsv4 import caches, config, model, sharding
from tests.dsv4.sharding_worker import wide

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_integer("tensor", 8, "tensor-parallel size (host devices on the CPU)")
  flags.DEFINE_integer("iters", 5, "timed steps per placement")
  flags.DEFINE_integer("batch", 32, "V4-Flash pools: sequences")
  flags.DEFINE_integer("context", 131072, "V4-Flash pools: tokens per sequence")


def main(argv):
  del argv
  args = FLAGS
  sizing.force_host_devices(args.tensor)

  mesh = sharding.make_mesh({"tensor": args.tensor})
  flash = config.v4_flash()
  lay_bf16 = caches.CacheLayout(kv_dtype=jnp.bfloat16)
  n_swa, n_full = sizing.pool_blocks(flash, lay_bf16, args.batch, args.context, 512)
  print(f"V4-Flash pools (bf16) for {args.batch} x {args.context} tokens on tensor={args.tensor}:")
  for kv in ("replicated", "feature"):
    total, dev = sizing.pool_bytes(flash, lay_bf16, mesh, sharding.Rules(kv_latent=kv), n_swa, n_full)
    print(f"  kv_latent={kv:<10}  per device {dev / 1e9:7.2f} GB of {total / 1e9:.2f} GB")

  cfg = wide(config.v4_tiny())
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  B, T, L = 8, 32, 96
  layout = caches.CacheLayout()
  _, swa, full = caches.init_contiguous(cfg, B, L, layout)
  rng = np.random.default_rng(0)
  print(f"\ntiny V4 ({cfg.attention.num_heads} heads, latent {cfg.attention.head_dim}) on (data, tensor, expert) = "
        f"(1, {args.tensor}, 1), batch {B}:")
  print(f"  {'kv_latent':<11} {'step':<8} {'all-reduce':>10} {'all-gather':>10} {'other coll.':>11} "
        f"{'cache B/dev':>12} {'ms/step':>9}")
  for kv in ("replicated", "feature"):
    rules = sharding.Rules(kv_latent=kv)
    call, sh = sharding.jit_forward(cfg, mesh, rules, layout=layout, batch=B, num_swa_blocks=swa.size,
                                    num_full_blocks=full.size)
    p = sharding.put(params, sh["params"])
    cache = sharding.put(caches.init_cache(cfg, layout, swa.size, full.size), sh["cache"])
    dev_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree_util.tree_leaves(cache))
    for name, tt, start in (("prefill", T, 0), ("decode", 1, T)):
      toks = rng.integers(0, cfg.vocab_size, (B, tt)).astype(np.int32)
      idx = caches.BatchIndex(np.full(B, start, np.int32), np.full(B, tt, np.int32), swa, full)
      tk, ix = sharding.put(toks, sh["tokens"]), sharding.put(idx, sh["index"])
      with jax.set_mesh(mesh):
        hlo = call.jitted.lower(p, tk, cache, ix).compile().as_text()
      n_ar = len(re.findall(r"= [^=]*all-reduce(-start)?\(", hlo))
      n_ag = len(re.findall(r"= [^=]*all-gather(-start)?\(", hlo))
      n_other = len(re.findall(r"= [^=]*(all-to-all|collective-permute|reduce-scatter)(-start)?\(", hlo))
      cache, out = call(p, tk, cache, ix)      # warm-up (compiles through the cached executable)
      jax.block_until_ready(out)
      times = []
      for _ in range(args.iters):
        # Same inputs each time: rewriting the same rows keeps the cache state and the work identical.
        t0 = time.perf_counter()
        cache, out = call(p, tk, cache, ix)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
      print(f"  {kv:<11} {name:<8} {n_ar:>10} {n_ag:>10} {n_other:>11} {dev_bytes:>12} "
            f"{1e3 * float(np.median(times)):>9.1f}", flush=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)
