"""Host memory while loading a sharded checkpoint (dsv4.loading.load_checkpoint streams shard by shard).

    python -m benchmarks.probes.load_memory [--shards=4] [--quant=none|fp8|fp8_fp4] [--naming=saved]

Writes a synthetic checkpoint (a V4-shaped config widened so each of the shards holds ~40-60 MB of bf16, or FP8 /
FP4 with scales) to a temp dir, then loads it into bf16 jax arrays in a fresh subprocess per measurement and
reports, relative to the largest shard file:

* tracemalloc peak: every numpy buffer the loader allocates on the host (jax's device buffers are not Python
  allocations, so on CPU this is the loader's transient host memory, what a GPU host would hold);
* RSS peak growth minus the loaded params' bytes (sampled every 2 ms; on CPU the "device" arrays live in RSS too,
  so they are subtracted);
* "device-warm": the same after one earlier load in the process, which excludes XLA's one-time compilation of the
  on-device expert stacking (host memory of the compiler, once per leaf shape, not per byte loaded);
* for contrast, the same load kept on the host (`as_jax=False`): the whole model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc

import jax
import ml_dtypes
import numpy as np
from absl import app, flags

from dsv4 import config, model
from dsv4.loading import safetensors_write
from dsv4.loading.safetensors_io import load_checkpoint
from dsv4.loading.safetensors_write import Quant

FLAGS = flags.FLAGS
flags.DEFINE_integer("shards", 4, "Number of shard files.")
flags.DEFINE_enum("quant", "none", ["none", "fp8", "fp8_fp4"], "Stored format of the weights.")
flags.DEFINE_enum("naming", "saved", ["original", "hf", "saved"], "Checkpoint naming.")
flags.DEFINE_string("child", "", "internal: run one measurement on this dir ('dir|mode').")


def bench_config():
  return config.ModelConfig(
      name="load_bench", variant="v4", vocab_size=8192, hidden_size=1024, num_layers=4,
      compress_ratios=config.v4_schedule(4, num_window_layers=1, hca_ratio=16),
      attention=config.AttentionConfig(num_heads=8, head_dim=128, rope_head_dim=32, q_lora_rank=256, o_groups=2,
                                       o_lora_rank=128, window=16),
      indexer=config.IndexerConfig(num_heads=8, head_dim=64, topk=8),
      moe=config.MoEConfig(n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=2, intermediate_size=512,
                           num_hash_layers=1))


def write_checkpoint(path: str, shards: int, quant: str, naming: str) -> list[str]:
  cfg = bench_config()
  rng = np.random.default_rng(0)

  def leaf(a):
    if np.issubdtype(a.dtype, np.integer):
      rows = [rng.permutation(cfg.moe.n_routed_experts)[: a.shape[1]] for _ in range(a.shape[0])]
      return np.stack(rows).astype(a.dtype)
    return (rng.standard_normal(a.shape, np.float32) * 0.02).astype(np.float32)

  params = jax.tree_util.tree_map(leaf, model.abstract_params(cfg))
  total = sum(np.asarray(x).size for x in jax.tree_util.tree_leaves(params))
  bytes_per = {"none": 2, "fp8": 1.6, "fp8_fp4": 0.8}[quant]
  q = None if quant == "none" else Quant(fp8_block=128, fp4_experts=quant == "fp8_fp4")
  return safetensors_write.save_checkpoint(params, cfg, path, naming=naming, quant=q, dtype=ml_dtypes.bfloat16,
                                           shard_bytes=int(1.1 * total * bytes_per / shards))


def _rss() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(arg: str) -> dict:
  path, mode = arg.split("|")
  cfg = bench_config()
  jax.numpy.zeros(1).block_until_ready()   # backend up before the baseline
  if mode == "device-warm":  # a first load compiles the on-device expert stacking (once per shape); measure the 2nd
    jax.block_until_ready(load_checkpoint(path, cfg, dtype=ml_dtypes.bfloat16))
  peak, stop = [0], [False]
  base = _rss()

  def sample():
    while not stop[0]:
      peak[0] = max(peak[0], _rss())
      time.sleep(0.002)

  th = threading.Thread(target=sample, daemon=True)
  th.start()
  tracemalloc.start()
  t0 = time.perf_counter()
  params = load_checkpoint(path, cfg, dtype=ml_dtypes.bfloat16, as_jax=mode.startswith("device"))
  jax.tree_util.tree_map(lambda x: getattr(x, "block_until_ready", lambda: x)(), params)
  wall = time.perf_counter() - t0
  _, tm_peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  stop[0] = True
  th.join()
  pbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
  return {"mode": mode, "tracemalloc_peak": tm_peak, "rss_growth": peak[0] - base, "params_bytes": pbytes,
          "wall_s": wall, "rss_final_growth": _rss() - base}


def main(argv):
  del argv
  if FLAGS.child:
    print(json.dumps(child(FLAGS.child)))
    return
  with tempfile.TemporaryDirectory() as d:
    files = write_checkpoint(d, FLAGS.shards, FLAGS.quant, FLAGS.naming)
    sizes = [os.path.getsize(f) for f in files]
    largest = max(sizes)
    print(f"checkpoint: {len(files)} shards ({FLAGS.naming} naming, {FLAGS.quant}), sizes MB "
          f"{[round(s / 2**20, 1) for s in sizes]}, largest {largest / 2**20:.1f} MB")
    for mode in ("device", "device-warm", "host"):
      # glibc's adaptive mmap threshold would keep freed 10-100 MB buffers in the heap and inflate RSS with
      # memory nobody uses; a fixed threshold makes RSS follow live allocations.
      env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
      out = subprocess.run([sys.executable, "-m", "benchmarks.probes.load_memory", f"--child={d}|{mode}"],
                           capture_output=True, text=True, check=True, env=env)
      r = json.loads(out.stdout.strip().splitlines()[-1])
      extra = r["rss_growth"] - r["params_bytes"]
      print(f"  load to {mode:11s}: params {r['params_bytes'] / 2**20:7.1f} MB | tracemalloc peak "
            f"{r['tracemalloc_peak'] / 2**20:7.1f} MB = {r['tracemalloc_peak'] / largest:.2f}x largest shard | "
            f"RSS peak growth {r['rss_growth'] / 2**20:7.1f} MB, minus params {extra / 2**20:7.1f} MB = "
            f"{extra / largest:.2f}x (after load: {(r['rss_final_growth'] - r['params_bytes']) / 2**20:.1f} MB) | "
            f"{r['wall_s']:.1f} s")


if __name__ == "__main__":
  app.run(main)
