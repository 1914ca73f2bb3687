"""Engine step cost vs live context and real token count, one run, CPU (ratios are what to read).

1. Decode step time, batch 8, at contexts 2k / 8k / 32k / 64k with max_model_len fixed at 1M (tiny V4: window +
   CSA top-k + HCA layers), with block tables bucketed by the live context ("after", the runner's default) and
   spanning max_model_len ("before": min_table_tokens = max_model_len, the runner's earlier behaviour); with each
   step plan's bytes and table widths (the swa table covers only the window + chunk, the full table the live
   context).
2. Mixed step (1 prefill chunk of 64 (or each --mixed_chunks) + 63 decodes, 64 rows) vs the chunk alone, all rows
   on one flat token axis: the step with power-of-two token buckets ("after") and with `token_bucket_steps`
   buckets per doubling ("after_steps4": buckets 1.25x apart).
3. Compiled temp memory of a decode step (`memory_analysis().temp_size_in_bytes`) at max_model_len 64k vs 1M.
4. The batch-invariant (tiled) step vs the bucketed step in bf16 (compute and KV): decode batch 8 / 64 at contexts
   1k / 8k / 32k, prefill chunks of 512 / 2048 tokens, each point timed alternately (`--tiles` sets tile_tokens).

The runner is driven directly with synthetic block tables (block contents do not change the work). Prints one
markdown table per part (`--json`: also every number as JSON). For the model-side breakdown of part 1 (indexer
paths, no-score floor) see the probe `python -m benchmarks.probes.decode_bench`.

    python -m benchmarks.step_bench [--repeats=5] [--parts=decode,mixed,memory,invariant] [--json]
    python -m benchmarks.step_bench --parts=invariant --tiles=16,64 --repeats=5
    python -m benchmarks.step_bench --parts=decode --repeats=3
    python -m benchmarks.step_bench --parts=mixed --mixed_chunks=64,256,512 --repeats=5
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
from absl import app, flags

from benchmarks.support.table import print_table
from dsv4 import caches
from dsv4 import config
from dsv4 import model
from dsv4.engine.config import EngineConfig
from dsv4.engine.runner import ModelRunner, Row
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.step_plan import RaggedShape, token_bucket
from dsv4.engine.step_program import ragged_step

flags.DEFINE_integer("repeats", 5, "Timed repeats per point (median reported).")
flags.DEFINE_list("parts", ["decode", "mixed", "memory", "invariant"], "Which measurements to run.")
flags.DEFINE_list("mixed_chunks", ["64"], "Prefill chunk sizes for part 2 (each: 1 chunk + 63 decodes vs the chunk "
                  "alone).")
flags.DEFINE_list("mixed_bucket_steps", ["1", "4"], "token_bucket_steps for part 2's ragged step (growth 2): 1 = "
                  "power-of-two buckets (a chunk + 63 decodes spills into the next power), 4 = buckets 1.25x apart.")
flags.DEFINE_bool("decode_only", False, "Run part 1 (decode vs context) only (= --parts=decode; the model-side "
                  "breakdown of this part: python -m benchmarks.probes.decode_bench).")
flags.DEFINE_integer("invariant_max_model_len", 65536, "max_model_len of part 4's runners (the invariant step "
                     "reads its table in place, so this should not move its cost).")
flags.DEFINE_list("tiles", ["16", "64"], "tile_tokens of the invariant step in part 4 (each timed at every point).")
flags.DEFINE_bool("json", False, "Also print every number as JSON.")
FLAGS = flags.FLAGS
M1 = 1 << 20
CONTEXTS = (2048, 8192, 32768, 65536)


def make_runner(cfg, params, *, max_model_len, max_num_seqs, chunk_size=64, min_table_tokens=4096, **kw):
  """A runner without an engine (its own block tables, `rows_at` sets them); kw: further EngineConfig fields. Parts
  1-3 measure the bucketed step (batch_invariant=False unless kw says otherwise)."""
  layout = kw.pop("layout", caches.CacheLayout())
  kw.setdefault("batch_invariant", False)
  nf = 8 * 64 * 1024 // layout.full_block_tokens + 8
  ec = EngineConfig(num_swa_blocks=4 * max_num_seqs + 64, num_full_blocks=nf, max_num_seqs=max_num_seqs,
                    chunk_size=chunk_size, max_model_len=max_model_len, min_table_tokens=min_table_tokens,
                    max_num_batched_tokens=4096, layout=layout, **kw)
  return ModelRunner(params, cfg, ec)


def rows_at(run: ModelRunner, contexts, ntoks, rng):
  """One row per context: tables cover [0, ctx + n) (full blocks distinct per row, swa blocks only for the tail
  the window reads, released (-1) before it, as in serving)."""
  lay = run.engine_config.layout
  out = []
  for i, (ctx, n) in enumerate(zip(contexts, ntoks)):
    slot = i
    end = ctx + n
    nfb = -(-end // lay.full_block_tokens)
    full = (np.arange(nfb) + i * (64 * 1024 // lay.full_block_tokens)) % run.cache.layers[1]["comp_kv"].shape[0]
    nsb = -(-end // lay.swa_block_tokens)
    swa = np.full(nsb, -1, np.int32)
    live = max(0, (ctx - 64) // lay.swa_block_tokens)
    swa[live:] = (np.arange(nsb - live) + 4 * i) % run.cache.layers[0]["window_kv"].shape[0]
    run.set_tables(slot, swa, full.astype(np.int32))
    out.append(Row(slot, [int(t) for t in rng.integers(2, 500, n)], ctx, SamplingParams(), 0))
  return out


def timed(run, rows, repeats):
  run.run(rows)  # compile + warm
  ts = []
  for _ in range(repeats):
    t = time.perf_counter()
    run.run(rows)
    ts.append(time.perf_counter() - t)
  return float(np.median(ts))


def timed_alternating(run, row_sets, repeats):
  """Median time per row set, the sets run alternately (load from other processes hits them alike)."""
  for rows in row_sets:
    run.run(rows)  # compile + warm
  ts = [[] for _ in row_sets]
  for _ in range(repeats):
    for rows, t_list in zip(row_sets, ts):
      t = time.perf_counter()
      run.run(rows)
      t_list.append(time.perf_counter() - t)
  return [float(np.median(t)) for t in ts]


def decode(cfg, params, rng, res):
  # 1. decode vs context at max_model_len 1M
  for label, mtt in (("after", 4096), ("before", M1)):
    run = make_runner(cfg, params, max_model_len=M1, max_num_seqs=8, min_table_tokens=mtt)
    for ctx in CONTEXTS:
      run.shapes_run.clear()
      res[f"decode_b8_ctx{ctx // 1024}k_ms_{label}"] = 1e3 * timed(run, rows_at(run, [ctx] * 8, [1] * 8, rng),
                                                                   FLAGS.repeats)
      (shape,) = run.shapes_run        # the step plan sent host -> device: tokens, rows, swa + full tables
      res[f"decode_b8_ctx{ctx // 1024}k_plan_bytes_{label}"] = 4 * shape.size
      res[f"decode_b8_ctx{ctx // 1024}k_table_widths_swa_full_{label}"] = [shape.swa_width, shape.full_width]
    del run
  for label in ("after", "before"):
    res[f"decode_64k_over_2k_{label}"] = res[f"decode_b8_ctx64k_ms_{label}"] / res[f"decode_b8_ctx2k_ms_{label}"]


def mixed(cfg, params, rng, res):
  """2. mixed step vs chunk alone (64 rows, contexts 1k) on the flat token axis.
  For each chunk size C of --mixed_chunks: 1 chunk of C + 63 decodes vs the chunk alone. On CPU a step costs about
  its token count (a decode token ~ a prefill token, measured by "two chunks"), so the ratio approaches
  (C + 63) / C: the 63 decodes ride almost free only beside a long chunk."""
  for C in (int(c) for c in FLAGS.mixed_chunks):
    sfx = "" if C == 64 else f"_c{C}"
    res[f"real_tokens_mixed_over_chunk{sfx}"] = (C + 63) / C      # the floor when a decode token costs a prefill one
    for label, mode, steps in _mixed_modes(C):
      run = make_runner(cfg, params, max_model_len=8192, max_num_seqs=64, token_bucket_growth=2,
                        token_bucket_steps=steps, chunk_size=C)
      # The row sets live in the runner at once (slot 0 = the chunk in all), timed alternately. "Two chunks"
      # (C + 63 prefill tokens, ragged only) fills the same flat-axis bucket as the mixed step with prefill tokens
      # only: does a decode token cost what a prefill token does?
      mixed = rows_at(run, [1024] * 64, [C] + [1] * 63, rng)
      chunk = mixed[:1]
      sets = [chunk, mixed]
      if mode == "ragged":
        sets.append([mixed[0], rows_at(run, [1024, 1024], [C, 63], rng)[1]])
        res[f"buckets_chunk_mixed_{label}{sfx}"] = [token_bucket(n, 2, run.engine_config.max_num_batched_tokens,
                                                                  steps) for n in (C, C + 63)]
      ts = timed_alternating(run, sets, FLAGS.repeats)
      t_chunk, t_mixed = ts[:2]
      res[f"chunk_alone_ms_{label}{sfx}"], res[f"mixed_1chunk_63dec_ms_{label}{sfx}"] = 1e3 * t_chunk, 1e3 * t_mixed
      res[f"mixed_over_chunk_{label}{sfx}"] = t_mixed / t_chunk
      if mode == "ragged":
        res[f"two_chunks_{C}_63_ms_{label}{sfx}"] = 1e3 * ts[2]
        res[f"mixed_over_two_chunks_{label}{sfx}"] = t_mixed / ts[2]
      del run


def _mixed_modes(C: int) -> list[tuple[str, str, int]]:
  """(label, step_mode, token_bucket_steps) timed for chunk size C in part 2."""
  return [("after", "ragged", 1)] + [(f"after_steps{k}", "ragged", k) for k in map(int, FLAGS.mixed_bucket_steps)
                                      if k != 1]


def memory(cfg, params, rng, res):
  # 3. compiled temp memory of a decode step vs max_model_len (live context 2k)
  for mml in (65536, M1):
    run = make_runner(cfg, params, max_model_len=mml, max_num_seqs=8)
    rows = rows_at(run, [2048] * 8, [1] * 8, rng)
    shape = RaggedShape(8, run._rows_bucket(len(rows)), run._swa_width(rows), run._full_width(2049))
    buf = run._pack_rows(rows, shape)
    comp = ragged_step.lower(run.params, run.cache, run._tables(), run.prev_tokens, jax.numpy.asarray(buf),
                             config=cfg, layout=run.engine_config.layout, kernel_cfg=run.engine_config.kernel,
                             shape=shape, record_logits=False).compile()
    res[f"decode_temp_bytes_max_len_{mml // 1024}k"] = int(comp.memory_analysis().temp_size_in_bytes)
    del run


# Part 4's points: (label, rows, tokens per row, context). Decode batch 8 / 64 at contexts 1k / 8k / 32k, prefill
# chunks of 512 / 2048 tokens at context 1k.
INVARIANT_POINTS = ([(f"decode b{b} ctx {c // 1024}k", b, 1, c) for b in (8, 64) for c in (1024, 8192, 32768)]
                    + [(f"prefill {n} ctx 1k", 1, n, 1024) for n in (512, 2048)])


def invariant(cfg, params, rng, res):
  """4. The batch-invariant (tiled) step vs the bucketed step, bf16 compute and KV, max_model_len 64k, timed
  alternately point by point (both runners live at once, so load from elsewhere hits them alike)."""
  bf16 = model.cast_params(params, jax.numpy.bfloat16)
  layout = caches.CacheLayout(kv_dtype=jax.numpy.bfloat16)
  for tile in (int(t) for t in FLAGS.tiles):
    for label, b, n, ctx in INVARIANT_POINTS:
      runs = [make_runner(cfg, bf16, max_model_len=FLAGS.invariant_max_model_len, max_num_seqs=max(b, 8), chunk_size=max(n, 64),
                          batch_invariant=inv, tile_tokens=tile, layout=layout) for inv in (False, True)]
      sets = [rows_at(run, [ctx] * b, [n] * b, rng) for run in runs]
      for run, rows in zip(runs, sets):
        run.run(rows)                                          # compile + warm
      ts = [[], []]
      for _ in range(FLAGS.repeats):
        for run, rows, t_list in zip(runs, sets, ts):
          t = time.perf_counter()
          run.run(rows)
          t_list.append(time.perf_counter() - t)
      normal, inv = (1e3 * float(np.median(t)) for t in ts)
      res[f"inv_t{tile}_{label}"] = [normal, inv, inv / normal]
      del runs


def main(argv):
  del argv
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  res = {"config": cfg.name}
  parts = ["decode"] if FLAGS.decode_only else FLAGS.parts
  if "decode" in parts:
    decode(cfg, params, rng, res)
  if "mixed" in parts:
    mixed(cfg, params, rng, res)
  if "memory" in parts:
    memory(cfg, params, rng, res)
  if "invariant" in parts:
    invariant(cfg, params, rng, res)
  if FLAGS.json:
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}, indent=1))
  print_tables(res, parts)


def print_tables(res: dict, parts) -> None:
  cfg = res["config"]
  if "decode" in parts:
    rows = []
    for ctx in CONTEXTS:
      k = f"decode_b8_ctx{ctx // 1024}k"
      a, b = res[f"{k}_ms_after"], res[f"{k}_ms_before"]
      rows.append([f"{ctx // 1024}k", a, b, b / a, [res[f"{k}_plan_bytes_after"], res[f"{k}_plan_bytes_before"]],
                   "swa {} / full {}".format(*res[f"{k}_table_widths_swa_full_after"]),
                   "swa {} / full {}".format(*res[f"{k}_table_widths_swa_full_before"])])
    rows.append(["64k / 2k", res["decode_64k_over_2k_after"], res["decode_64k_over_2k_before"], None, None, None,
                 None])
    print_table(["context", "ms (tables bucketed to context)", "ms (tables span max_model_len)", "before / after",
                 "plan bytes (after / before)", "table widths, after", "table widths, before"], rows,
                title=f"1. Decode step, batch 8, {cfg}, max_model_len 1M (median of {FLAGS.repeats})")
  if "mixed" in parts:
    rows = []
    for C in (int(c) for c in FLAGS.mixed_chunks):
      sfx = "" if C == 64 else f"_c{C}"
      for label, mode, _ in _mixed_modes(C):
        rows.append([C, label, res[f"chunk_alone_ms_{label}{sfx}"], res[f"mixed_1chunk_63dec_ms_{label}{sfx}"],
                     res[f"mixed_over_chunk_{label}{sfx}"], res[f"real_tokens_mixed_over_chunk{sfx}"],
                     res.get(f"two_chunks_{C}_63_ms_{label}{sfx}"), res.get(f"mixed_over_two_chunks_{label}{sfx}"),
                     res.get(f"buckets_chunk_mixed_{label}{sfx}")])
    print_table(["chunk", "layout", "chunk alone ms", "chunk + 63 decodes ms", "mixed / chunk",
                 "real tokens (C + 63) / C", "chunk + 63 prefill tokens ms", "mixed / that",
                 "token buckets (chunk / mixed)"], rows,
                title=f"2. Mixed step vs the chunk alone, 64 rows at context 1k, {cfg} (timed alternately)")
  if "memory" in parts:
    print_table(["max_model_len", "decode step temp bytes"],
                [[f"{mml // 1024}k", res[f"decode_temp_bytes_max_len_{mml // 1024}k"]] for mml in (65536, M1)],
                title="3. Compiled temp memory of a decode step (batch 8, context 2k)")
  if "invariant" in parts:
    rows = [[label, tile, *res[f"inv_t{tile}_{label}"]] for tile in (int(t) for t in FLAGS.tiles)
            for label, *_ in INVARIANT_POINTS]
    print_table(["point", "tile", "bucketed ms", "invariant ms", "invariant / bucketed"], rows,
                title=f"4. Batch-invariant (tiled) step vs the bucketed step, bf16 compute and KV, {cfg}, "
                      f"max_model_len {FLAGS.invariant_max_model_len} (median of {FLAGS.repeats}, timed alternately)")


if __name__ == "__main__":
  app.run(main)
