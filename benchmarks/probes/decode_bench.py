"""Model decode step vs live context, with a breakdown of where the time goes (one run, CPU; read the ratios).

Decode step (`model.forward_ragged_jit`, batch 8, one token per row) at contexts 2k / 8k / 32k / 64k; block tables
sized to the live context (the pool and max_model_len do not enter the step), three indexer paths in the same run:
  paged     the model's path: keys read block-wise from the pool, chunked running top-k (indexer_paged.py);
  reference the previous path: per-entry row lists, [N, M, C] key gather, dense [N, H, M] scores, top-k;
  no_score  the indexer's score pass removed (the first k visible entries picked): the floor of the step, i.e.
            everything that is not the O(live entries) score pass.
Configs: `v4_tiny` (hidden 64; its HCA ratio 16 reads ctx/16 entries densely), `v4_tiny_hca128` (same with
Flash's HCA ratio 128) and `flash_quarter`: V4-Flash layer mix
(window, CSA m=4, HCA m=128, CSA) with every width a quarter of Flash's (hidden 1024, 16 x 128 attention heads,
16 x 32 indexer heads, top-k 512, window 128, 8 experts of 512, 6 active), so per-token dense work and the
indexer's per-entry work (H_ix * C_ix) both shrink ~16x and their ratio stays near Flash's.

    python -m benchmarks.probes.decode_bench [--repeats=3] [--configs=v4_tiny,flash_quarter]
"""

from __future__ import annotations

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from dsv4 import caches, model
from dsv4.config import ModelConfig, v4_tiny
from dsv4.layers import attention
from pallas_kernels import dispatch

flags.DEFINE_integer("repeats", 3, "Timed repeats per point (median).")
flags.DEFINE_list("configs", ["v4_tiny", "flash_quarter"], "Configs to run.")
flags.DEFINE_list("contexts", ["2048", "8192", "32768", "65536"], "Contexts (tokens already cached).")
flags.DEFINE_bool("flops", False, "Also report XLA's compiled cost analysis (flops) per point: a load-independent "
                  "breakdown (a lax.scan body, the paged path's chunk loop, may be counted once).")
FLAGS = flags.FLAGS
B = 8


def flash_quarter() -> ModelConfig:
  t = v4_tiny()
  return dataclasses.replace(
      t, name="flash_quarter", hidden_size=1024, compress_ratios=(0, 4, 128, 4),
      attention=dataclasses.replace(t.attention, num_heads=16, head_dim=128, rope_head_dim=16, q_lora_rank=256,
                                    o_groups=2, o_lora_rank=256, window=128),
      indexer=dataclasses.replace(t.indexer, num_heads=16, head_dim=32, topk=512),
      moe=dataclasses.replace(t.moe, n_routed_experts=8, num_experts_per_tok=6, intermediate_size=512))


CONFIGS = {"v4_tiny": v4_tiny, "flash_quarter": flash_quarter,
           # v4_tiny with Flash's HCA ratio (128 instead of 16): HCA then reads ctx/128 entries, as in V4-Flash.
           "v4_tiny_hca128": lambda: dataclasses.replace(v4_tiny(hca_ratio=128), name="v4_tiny_hca128")}


def _no_score(p, config, plan, x_NxD, cq_NxR, ctx, key_pool, inv_freq, candidate_blocks_NxCb=None,
              block_max_size=0):
  """Stand-in for the indexer: the first k visible entries (no score pass); keeps the rest of the step."""
  k = config.indexer.topk
  nv = attention.num_visible(ctx, plan.ratio)
  ids = jnp.arange(k, dtype=jnp.int32)[None, :] + jnp.zeros_like(nv)[:, None]
  return jnp.where(ids < nv[:, None], ids, -1), None


def step_inputs(cfg, layout, ctx, nf, ns):
  rows = []
  for i in range(B):
    end = ctx + 1
    full = (np.arange(caches.blocks_for(end, layout.full_block_tokens)) + i * (nf // B)) % nf
    nsb = caches.blocks_for(end, layout.swa_block_tokens)
    swa = np.full(nsb, -1, np.int32)
    live = max(0, (ctx - cfg.attention.window) // layout.swa_block_tokens)
    swa[live:] = (np.arange(nsb - live) + (ns // B) * i) % ns  # released window blocks are -1, as in serving
    rows.append(([7 + i], ctx, {caches.SWA: swa, caches.FULL: full.astype(np.int32)}))
  wf = caches.bucket(caches.blocks_for(ctx + 1, layout.full_block_tokens))
  ws = caches.blocks_for(wf * layout.full_block_tokens, layout.swa_block_tokens)
  toks, st = caches.make_step_index(rows, B, min_tokens=B, table_widths={caches.SWA: ws, caches.FULL: wf})
  return jnp.asarray(toks), jax.tree_util.tree_map(jnp.asarray, st)


def time_step(params, cfg, layout, cache, toks, st, repeats):
  cache, h = model.forward_ragged_jit(params, cfg, toks, cache, st, layout)
  h.block_until_ready()
  ts = []
  for _ in range(repeats):
    t = time.perf_counter()
    cache, h = model.forward_ragged_jit(params, cfg, toks, cache, st, layout)
    h.block_until_ready()
    ts.append(time.perf_counter() - t)
  return cache, 1e3 * float(np.median(ts))


def main(argv):
  del argv
  layout = caches.CacheLayout()
  ctxs = [int(c) for c in FLAGS.contexts]
  res = {}
  orig_uses, orig_paged = dispatch.uses_kernel, attention.indexer_select_paged
  for name in FLAGS.configs:
    cfg = CONFIGS[name]()
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    nf = B * caches.blocks_for(max(ctxs) + 1, layout.full_block_tokens) + B
    ns = B * caches.blocks_for(2 * cfg.attention.window, layout.swa_block_tokens) + B
    cache = caches.init_cache(cfg, layout, ns, nf)
    for mode in ("paged", "reference", "no_score"):
      dispatch.uses_kernel = (lambda c, op, *a, **k: True) if mode == "reference" else orig_uses
      attention.indexer_select_paged = _no_score if mode == "no_score" else orig_paged
      jax.clear_caches()
      for ctx in ctxs:
        toks, st = step_inputs(cfg, layout, ctx, nf, ns)
        cache, ms = time_step(params, cfg, layout, cache, toks, st, FLAGS.repeats)
        res[f"{name}_{mode}_ctx{ctx // 1024}k_ms"] = ms
        if FLAGS.flops:
          comp = model.forward_ragged_jit.lower(params, cfg, toks, cache, st, layout).compile()
          ca = comp.cost_analysis()
          ca = ca[0] if isinstance(ca, (list, tuple)) else ca
          res[f"{name}_{mode}_ctx{ctx // 1024}k_gflops"] = float(ca.get("flops", 0.0)) / 1e9
        print(name, mode, ctx, f"{ms:.2f} ms", flush=True)
      res[f"{name}_{mode}_{ctxs[-1] // 1024}k_over_{ctxs[0] // 1024}k"] = (
          res[f"{name}_{mode}_ctx{ctxs[-1] // 1024}k_ms"] / res[f"{name}_{mode}_ctx{ctxs[0] // 1024}k_ms"])
    dispatch.uses_kernel, attention.indexer_select_paged = orig_uses, orig_paged
    jax.clear_caches()
    del cache, params
  print(json.dumps({k: round(v, 3) for k, v in res.items()}, indent=1))


if __name__ == "__main__":
  app.run(main)
