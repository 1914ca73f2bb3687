"""This model vs the transformers reference, same machine, same run: prefill tokens/s and decode step time.

Two configurations: the tiny transformers oracle config (tests/dsv4/oracle_util.py, HF_TINY_KWARGS; the
reference is described in docs/references.md) and a wider one with the real V4-Flash attention widths (D 4096,
64 heads x 512, q_lora 1024, 8 x 1024 output groups, window 128, indexer 64 x 128) but only 4 layers [window,
window, CSA m=4, HCA m=128] and small MoE (benchmarks/support/configs.py). Both models hold the same weights (the
reference writes them, our loader reads them) and the script checks that their logits agree before timing anything.

    python -m benchmarks.model_vs_hf [--configs=tiny,wide] [--prefill=512] [--decode_steps=8] [--json]
    python -m benchmarks.model_vs_hf --configs=wide --decode_steps=4 --repeats=2     # wide config only (the recorded comparison)

Where the time goes (`--roofline`, on by default): the same run measures this machine's read bandwidth (a jitted
sum over 1 GiB) and both frameworks' dense matmul rates at the wide model's biggest shape (x[T, 4096] @
w[4096, 32768], T = 1 and the prefill length, fp32 and bf16), then prints each model's floor: a decode step cannot
beat (bytes it must read) / bandwidth, a prefill cannot beat (its flops) / (the framework's matmul rate).

Prints markdown tables (agreement and speed, the decode MoE path, the roofline); `--json` also prints every number
per configuration as JSON.
"""

from __future__ import annotations

import json
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.support.configs import WIDE_HF, wide_config
from benchmarks.support.table import print_table
from benchmarks.support.timing import best_time, median_time, xla_cost
from dsv4 import caches, model
from dsv4 import config
from dsv4.layers import moe
from dsv4.loading.safetensors_io import load_checkpoint
from tests.dsv4 import oracle_util

flags.DEFINE_list("configs", ["tiny", "wide"], "Which configurations to run.")
flags.DEFINE_integer("prefill", 512, "Prefill length (tiny); the wide config uses --wide_prefill.")
flags.DEFINE_integer("wide_prefill", 256, "Prefill length for the wide config.")
flags.DEFINE_integer("decode_steps", 8, "Decode steps timed after the prefill.")
flags.DEFINE_integer("repeats", 3, "Prefill repeats (median).")
flags.DEFINE_bool("compare_moe_sorted", True, "Also time decode with every routed-expert call on the sorted "
                  "ragged_dot path (the code before the decode MoE fix), same run.")
flags.DEFINE_bool("json", False, "Also print every number of each configuration as JSON.")
flags.DEFINE_bool("roofline", True, "Measure read bandwidth and matmul rates (JAX and torch, fp32 and bf16) in the "
                  "same run and report each model's distance from its floor.")
FLAGS = flags.FLAGS

def run_one(name: str, cfg: config.ModelConfig, overrides: dict | None, T: int, steps: int, repeats: int) -> dict:
  import torch  # local: torch and transformers are test extras, needed only for the HF side
  from transformers import DynamicCache
  hf = oracle_util.build_oracle(seed=0, overrides=overrides)
  with tempfile.TemporaryDirectory() as d:
    oracle_util.save_oracle_weights(hf, d)
    params = load_checkpoint(d, cfg)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (1, T + steps)).astype(np.int32)

  # Correctness first: same logits on the prefill.
  _, ours = model.forward_full(params, cfg, jnp.asarray(tokens[:, :T]))
  ref = oracle_util.hf_logits(hf, tokens[:, :T])
  rel = float(np.max(np.abs(np.asarray(ours) - ref)) / np.max(np.abs(ref)))

  # Prefill: full forward of T tokens (ours jitted and warmed up above).
  def ours_prefill():
    jax.block_until_ready(model.forward_full(params, cfg, jnp.asarray(tokens[:, :T]))[1])

  def hf_prefill():
    with torch.no_grad():
      hf(input_ids=torch.as_tensor(tokens[:, :T], dtype=torch.long))

  t_ours = median_time(ours_prefill, repeats)
  t_hf = median_time(hf_prefill, repeats)

  # Decode: prefill into a cache, then time one-token steps.
  layout = caches.CacheLayout()
  cache, swa, full = caches.init_contiguous(cfg, 1, T + steps, layout)
  tabs = (jnp.asarray(swa), jnp.asarray(full))
  idx = caches.BatchIndex(jnp.zeros(1, jnp.int32), jnp.full((1,), T, jnp.int32), *tabs)
  cache, _ = model.forward_jit(params, cfg, jnp.asarray(tokens[:, :T]), cache, idx, layout)
  warm = caches.BatchIndex(jnp.full((1,), T, jnp.int32), jnp.zeros((1,), jnp.int32), *tabs)  # compile, no write
  cache, lg = model.forward_jit(params, cfg, jnp.asarray(tokens[:, T:T + 1]), cache, warm, layout)
  # the prefill and warm step run asynchronously: without this wait their execution lands in the timed steps
  # (an earlier version of this script did not wait: a "first-timing effect", ~229 vs ~145 ms per step)
  jax.block_until_ready(lg)
  t = time.perf_counter()
  for s in range(steps):
    idx = caches.BatchIndex(jnp.full((1,), T + s, jnp.int32), jnp.ones((1,), jnp.int32), *tabs)
    cache, lg = model.forward_jit(params, cfg, jnp.asarray(tokens[:, T + s:T + s + 1]), cache, idx, layout)
  jax.block_until_ready(lg)
  d_ours = (time.perf_counter() - t) / steps
  out_extra = {}
  if FLAGS.compare_moe_sorted:
    # Before the decode MoE fix, in the same run: every routed-expert call on the sorted `lax.ragged_dot` path
    # (on CPU: every expert's weights transposed and every token times every expert, each step).
    d_gathered = d_ours
    d_sorted = _decode_time(params, cfg, tokens, T, steps, layout, tabs, cache_fn=lambda: _prefilled(
        params, cfg, tokens, T, steps, layout), moe_path=moe.routed_experts_sorted)
    d_again = _decode_time(params, cfg, tokens, T, steps, layout, tabs, cache_fn=lambda: _prefilled(
        params, cfg, tokens, T, steps, layout), moe_path=None)
    out_extra = {"ours_decode_step_ms_moe_sorted": 1e3 * d_sorted, "ours_decode_step_ms_again": 1e3 * d_again,
                 "decode_moe_sorted_over_gathered": d_sorted / min(d_gathered, d_again)}
  def hf_decode():
    with torch.no_grad():
      hcache = DynamicCache(config=hf.config)
      hf(input_ids=torch.as_tensor(tokens[:, :T], dtype=torch.long), past_key_values=hcache, use_cache=True)
      t = time.perf_counter()
      for s in range(steps):
        out = hf(input_ids=torch.as_tensor(tokens[:, T + s:T + s + 1], dtype=torch.long), past_key_values=hcache,
                 use_cache=True)
      return (time.perf_counter() - t) / steps, out

  # HF's first pass in a process pays one-off costs (allocator, kernel selection) that ours paid in its warm
  # step: time a second pass, report both.
  d_hf_first, _ = hf_decode()
  d_hf, out = hf_decode()
  out_extra["hf_decode_step_ms_first_pass"] = 1e3 * d_hf_first
  dec_rel = float(np.max(np.abs(np.asarray(lg)[0, -1] - out.logits[0, -1].numpy())) /
                  np.max(np.abs(out.logits[0, -1].numpy())))
  return {"config": name, "params": model.count_params(params), "prefill_tokens": T,
          "prefill_logits_max_rel_diff": rel, "decode_logits_max_rel_diff": dec_rel,
          "ours_prefill_tok_per_s": T / t_ours, "hf_prefill_tok_per_s": T / t_hf,
          "prefill_speedup_vs_hf": t_hf / t_ours,
          "ours_decode_step_ms": 1e3 * d_ours, "hf_decode_step_ms": 1e3 * d_hf, "decode_speedup_vs_hf": d_hf / d_ours,
          "decode_bytes_accessed_per_step": _decode_bytes(params, cfg, T, steps, layout),
          "prefill_flops": _prefill_flops(params, cfg, T, layout), **out_extra}


def _prefilled(params, cfg, tokens, T, steps, layout):
  cache, swa, full = caches.init_contiguous(cfg, 1, T + steps, layout)
  tabs = (jnp.asarray(swa), jnp.asarray(full))
  idx = caches.BatchIndex(jnp.zeros(1, jnp.int32), jnp.full((1,), T, jnp.int32), *tabs)
  cache, _ = model.forward_jit(params, cfg, jnp.asarray(tokens[:, :T]), cache, idx, layout)
  return cache


def _decode_time(params, cfg, tokens, T, steps, layout, tabs, cache_fn, moe_path):
  """Decode step time with the routed experts forced onto `moe_path` (None: the default dispatch); retraces."""
  saved = moe.routed_experts
  try:
    if moe_path is not None:
      moe.routed_experts = moe_path
    jax.clear_caches()
    cache = cache_fn()
    warm = caches.BatchIndex(jnp.full((1,), T, jnp.int32), jnp.zeros((1,), jnp.int32), *tabs)
    cache, lg = model.forward_jit(params, cfg, jnp.asarray(tokens[:, T:T + 1]), cache, warm, layout)
    jax.block_until_ready(lg)
    t = time.perf_counter()
    for s in range(steps):
      idx = caches.BatchIndex(jnp.full((1,), T + s, jnp.int32), jnp.ones((1,), jnp.int32), *tabs)
      cache, lg = model.forward_jit(params, cfg, jnp.asarray(tokens[:, T + s:T + s + 1]), cache, idx, layout)
    jax.block_until_ready(lg)
    return (time.perf_counter() - t) / steps
  finally:
    moe.routed_experts = saved
    jax.clear_caches()


def roofline(T: int) -> dict:
  """This machine's read bandwidth and both frameworks' matmul rates at the wide model's largest projection
  (wq_b / wo_a / wo_b are [4096 x 32768]-sized), fp32 and bf16. Best of 5 each."""
  import torch  # local: a test extra, needed only for the HF side
  out = {}
  big = jnp.ones((1 << 28,), jnp.float32)                       # 1 GiB
  total = jax.jit(jnp.sum)
  out["jax_read_GBps"] = big.nbytes / 1e9 / best_time(lambda: total(big).block_until_ready())
  del big
  tb = torch.ones(1 << 28, dtype=torch.float32)
  with torch.no_grad():
    out["torch_read_GBps"] = tb.numel() * 4 / 1e9 / best_time(lambda: tb.sum())
  del tb
  K, N = 4096, 32768
  rng = np.random.default_rng(0)
  w32 = rng.standard_normal((K, N), np.float32)
  dot = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
  for rows in (1, T):
    x32 = rng.standard_normal((rows, K), np.float32)
    for name, jdt, tdt in (("fp32", jnp.float32, torch.float32), ("bf16", jnp.bfloat16, torch.bfloat16)):
      xj, wj = jnp.asarray(x32, jdt), jnp.asarray(w32, jdt)
      tj = best_time(lambda: dot(xj, wj).block_until_ready())
      xt, wt = torch.from_numpy(x32).to(tdt), torch.from_numpy(w32).to(tdt)
      with torch.no_grad():
        tt = best_time(lambda: xt @ wt)
      gf = 2 * rows * K * N / 1e9
      out[f"jax_matmul_{rows}x{K}x{N}_{name}_GFLOPs"] = gf / tj
      out[f"torch_matmul_{rows}x{K}x{N}_{name}_GFLOPs"] = gf / tt
      del xj, wj, xt, wt
  return out


def _prefill_flops(params, cfg, T, layout):
  """XLA's flop count of the T-token prefill (the timed program: forward_jit into a fresh contiguous cache)."""
  cache, swa, full = caches.init_contiguous(cfg, 1, T, layout)
  idx = caches.BatchIndex(jnp.zeros((1,), jnp.int32), jnp.full((1,), T, jnp.int32), jnp.asarray(swa),
                          jnp.asarray(full))
  comp = model.forward_jit.lower(params, cfg, jnp.zeros((1, T), jnp.int32), cache, idx, layout).compile()
  return float(xla_cost(comp).get("flops", float("nan")))


def _decode_bytes(params, cfg, T, steps, layout):
  """XLA's own estimate of bytes a decode step reads and writes (the step is memory-bound at these widths)."""
  cache, swa, full = caches.init_contiguous(cfg, 1, T + steps, layout)
  idx = caches.BatchIndex(jnp.full((1,), T, jnp.int32), jnp.ones((1,), jnp.int32), jnp.asarray(swa),
                          jnp.asarray(full))
  comp = model.forward_jit.lower(params, cfg, jnp.zeros((1, 1), jnp.int32), cache, idx, layout).compile()
  return float(xla_cost(comp).get("bytes accessed", float("nan")))


def main(argv):
  del argv
  results = []
  for name in FLAGS.configs:
    if name == "tiny":
      results.append(run_one("tiny", config.v4_tiny(), None, FLAGS.prefill, FLAGS.decode_steps, FLAGS.repeats))
    elif name == "wide":
      results.append(run_one("wide", wide_config(), WIDE_HF, FLAGS.wide_prefill, FLAGS.decode_steps,
                             FLAGS.repeats))
    else:
      raise app.UsageError(f"unknown config {name!r}")
    r = results[-1]
    if FLAGS.roofline:
      rl = roofline(r["prefill_tokens"])
      T, K, N = r["prefill_tokens"], 4096, 32768
      # Floors: a decode step must read its bytes; a prefill must do its flops at the framework's best matmul rate.
      floor_dec = r["decode_bytes_accessed_per_step"] / 1e9 / rl["jax_read_GBps"]
      rl["ours_decode_floor_ms"] = 1e3 * floor_dec
      rl["ours_decode_over_floor"] = r["ours_decode_step_ms"] / 1e3 / floor_dec
      rl["hf_decode_over_floor"] = r["hf_decode_step_ms"] / 1e3 / (r["decode_bytes_accessed_per_step"] / 1e9
                                                                  / rl["torch_read_GBps"])
      for who, key in (("ours", "jax"), ("hf", "torch")):
        rate = rl[f"{key}_matmul_{T}x{K}x{N}_fp32_GFLOPs"]
        floor_pre = r["prefill_flops"] / 1e9 / rate
        rl[f"{who}_prefill_floor_s"] = floor_pre
        rl[f"{who}_prefill_over_floor"] = (T / r[f"{who}_prefill_tok_per_s"]) / floor_pre
      r["roofline"] = rl
    if FLAGS.json:
      print(json.dumps(r, indent=2), flush=True)
  print_tables(results)


def print_tables(results: list[dict]) -> None:
  print_table(
      ["config", "params", "prefill tokens", "logits max rel diff (prefill / decode)", "ours prefill tok/s",
       "HF prefill tok/s", "prefill speedup vs HF", "ours decode ms", "HF decode ms (2nd pass / 1st)",
       "decode speedup vs HF"],
      [[r["config"], r["params"], r["prefill_tokens"],
        [r["prefill_logits_max_rel_diff"], r["decode_logits_max_rel_diff"]], r["ours_prefill_tok_per_s"],
        r["hf_prefill_tok_per_s"], r["prefill_speedup_vs_hf"], r["ours_decode_step_ms"],
        [r["hf_decode_step_ms"], r["hf_decode_step_ms_first_pass"]], r["decode_speedup_vs_hf"]]
       for r in results],
      title="This model vs transformers eager, same weights (speedup = HF time / ours: > 1 means ours is faster)")
  moe_rows = [[r["config"], r["ours_decode_step_ms"], r["ours_decode_step_ms_again"],
               r["ours_decode_step_ms_moe_sorted"], r["decode_moe_sorted_over_gathered"]]
              for r in results if "ours_decode_step_ms_moe_sorted" in r]
  if moe_rows:
    print_table(["config", "decode ms (default)", "decode ms (default, again)", "decode ms (sorted ragged_dot MoE)",
                 "sorted / best default"], moe_rows, title="Decode MoE path, same run")
  with_rl = [r for r in results if "roofline" in r]
  if with_rl:
    print_table(
        ["config", "read GB/s (JAX / torch)", "decode GB/step (XLA)", "ours decode floor ms",
         "ours decode / floor", "HF decode / floor", "prefill GFLOP (XLA)", "ours prefill floor s",
         "ours prefill / floor", "HF prefill floor s", "HF prefill / floor"],
        [[r["config"], [rl["jax_read_GBps"], rl["torch_read_GBps"]], r["decode_bytes_accessed_per_step"] / 1e9,
          rl["ours_decode_floor_ms"], rl["ours_decode_over_floor"], rl["hf_decode_over_floor"],
          r["prefill_flops"] / 1e9, rl["ours_prefill_floor_s"], rl["ours_prefill_over_floor"],
          rl["hf_prefill_floor_s"], rl["hf_prefill_over_floor"]]
         for r, rl in ((r, r["roofline"]) for r in with_rl)],
        title="Roofline (floor: decode = bytes / read bandwidth; prefill = XLA flops / fp32 matmul rate)")
    mm = []
    for r in with_rl:
      for rows in (1, r["prefill_tokens"]):
        for who, key in (("JAX", "jax"), ("torch", "torch")):
          mm.append([r["config"], f"{rows} x 4096 x 32768", who,
                     r["roofline"][f"{key}_matmul_{rows}x4096x32768_fp32_GFLOPs"],
                     r["roofline"][f"{key}_matmul_{rows}x4096x32768_bf16_GFLOPs"]])
    print_table(["config", "matmul", "framework", "fp32 GFLOP/s", "bf16 GFLOP/s"], mm,
                title="Dense matmul rates at the wide model's largest projection")


if __name__ == "__main__":
  app.run(main)
