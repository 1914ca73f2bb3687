"""Engine step cost vs live context and real token count, one run, CPU (ratios are what to read).

1. Decode step time, batch 8, at contexts 2k / 8k / 32k / 64k with max_model_len fixed at 1M (tiny V4: window +
   CSA top-k + HCA layers): the step reads its block tables in place, so its cost follows the live context.
2. Mixed step (1 prefill chunk of 64 (or each --mixed_chunks) + 63 decodes, 64 rows) vs the chunk alone: the step's
   row-invariant ops loop over its live tokens only.
3. Compiled temp memory of the step program at max_model_len 64k vs 1M.
4. The step (batch invariant, one program) beside a plain step (`benchmarks/support/plain_step.py`: the same
   step with plain XLA ops, at a flat axis padded to a power of two of its tokens) in bf16 (compute and KV), on
   v4_tiny and on a wide MoE config (D 512, 64 experts, top-6): decode batch 8 / 64 at contexts 1k / 8k / 32k,
   prefill chunks of 512 / 2048 tokens; each point timed alternately. `--invariant_control`: a second runner of
   the same step program (its own pools and buffers) timed in the same alternation, whose ratio to the first is
   the noise floor of the table's ratios on this machine (what two instances of one program read apart).
5. (`--parts=budget`) Decode batch 8 through the step at token budgets 64 / 512 / 2048 beside the plain step: what
   the budget's width costs a step that holds 8 tokens, and each runner's minor page faults per step (scratch
   mapped fresh; the runners keep theirs mapped on the CPU, `dsv4.engine.host_memory`).

The runner is driven directly with synthetic block tables (block contents do not change the work). Prints one
markdown table per part (`--json`: also every number as JSON).

    python -m benchmarks.step_bench [--repeats=5] [--parts=decode,mixed,memory,invariant] [--json]
    python -m benchmarks.step_bench --parts=invariant --repeats=5 [--invariant_control]
    python -m benchmarks.step_bench --parts=budget --repeats=5
    python -m benchmarks.step_bench --parts=decode --repeats=3
    python -m benchmarks.step_bench --parts=mixed --mixed_chunks=64,256,512 --repeats=5
"""

from __future__ import annotations

import json
import resource
import time

import jax
import numpy as np
from absl import app, flags

from benchmarks.support.bare_runner import make_runner, rows_at
from benchmarks.support.configs import wide_moe_config
from benchmarks.support.plain_step import make_plain
from benchmarks.support.table import print_table
from dsv4 import caches
from dsv4 import config
from dsv4 import model
from dsv4.engine.step_program import ragged_step

flags.DEFINE_integer("repeats", 5, "Timed repeats per point (median reported).")
flags.DEFINE_list("parts", ["decode", "mixed", "memory", "invariant"], "Which measurements to run (also: budget).")
flags.DEFINE_list("mixed_chunks", ["64"], "Prefill chunk sizes for part 2 (each: 1 chunk + 63 decodes vs the chunk "
                  "alone).")
flags.DEFINE_list("configs", ["v4_tiny", "wide_moe"], "Model configs of part 4 (v4_tiny, wide_moe).")
flags.DEFINE_integer("invariant_max_model_len", 65536, "max_model_len of part 4's runners.")
flags.DEFINE_bool("invariant_control", False, "Part 4 also times a second runner of the invariant step (the same "
                  "program, its own pools) in the same alternation: the ratio two instances of one program read.")
flags.DEFINE_bool("json", False, "Also print every number as JSON.")
FLAGS = flags.FLAGS
M1 = 1 << 20
CONTEXTS = (2048, 8192, 32768, 65536)


def timed_alternating(runs, row_sets, repeats):
  """Median time per (runner, row set), run alternately (load from other processes hits them alike)."""
  for run, rows in zip(runs, row_sets):
    run.run(rows)  # compile + warm
  ts = [[] for _ in row_sets]
  for _ in range(repeats):
    for run, rows, t_list in zip(runs, row_sets, ts):
      t = time.perf_counter()
      run.run(rows)
      t_list.append(time.perf_counter() - t)
  return [float(np.median(t)) for t in ts]


def decode(cfg, params, rng, res):
  # 1. decode vs context at max_model_len 1M
  run = make_runner(cfg, params, max_model_len=M1, max_num_seqs=8)
  for ctx in CONTEXTS:
    (t,) = timed_alternating([run], [rows_at(run, [ctx] * 8, [1] * 8, rng)], FLAGS.repeats)
    res[f"decode_b8_ctx{ctx // 1024}k_ms"] = 1e3 * t
  res["decode_plan_bytes"] = 4 * run.step_shape.size
  res["decode_64k_over_2k"] = res["decode_b8_ctx64k_ms"] / res["decode_b8_ctx2k_ms"]


def mixed(cfg, params, rng, res):
  """2. mixed step vs chunk alone (64 rows, contexts 1k) on the flat token axis. For each chunk size C: 1 chunk of
  C + 63 decodes vs the chunk alone; on the CPU a step costs about its live tokens, so the ratio approaches
  (C + 63) / C."""
  for C in (int(c) for c in FLAGS.mixed_chunks):
    run = make_runner(cfg, params, max_model_len=8192, max_num_seqs=64, chunk_size=C,
                      max_num_batched_tokens=max(C + 63, 512))
    mixed_rows = rows_at(run, [1024] * 64, [C] + [1] * 63, rng)
    t_chunk, t_mixed = timed_alternating([run, run], [mixed_rows[:1], mixed_rows], FLAGS.repeats)
    res[f"mixed_c{C}"] = [1e3 * t_chunk, 1e3 * t_mixed, t_mixed / t_chunk, (C + 63) / C]
    del run


def memory(cfg, params, rng, res):
  # 3. compiled temp memory of the step vs max_model_len
  for mml in (65536, M1):
    run = make_runner(cfg, params, max_model_len=mml, max_num_seqs=8, max_num_batched_tokens=512)
    rows = rows_at(run, [2048] * 8, [1] * 8, rng)
    buf = run._pack_rows(rows, run.step_shape)
    comp = ragged_step.lower(run.params, run.cache, run._tables(), run.prev_tokens, jax.numpy.asarray(buf),
                             run._loop_buffers, config=cfg, layout=run.engine_config.layout,
                             kernel_cfg=run.engine_config.kernel, shape=run.step_shape, record_logits=False).compile()
    res[f"step_temp_bytes_max_len_{mml // 1024}k"] = int(comp.memory_analysis().temp_size_in_bytes)
    del run


# Part 4's points: (label, rows, tokens per row, context). Decode batch 8 / 64 at contexts 1k / 8k / 32k, prefill
# chunks of 512 / 2048 tokens at context 1k.
INVARIANT_POINTS = ([(f"decode b{b} ctx {c // 1024}k", b, 1, c) for b in (8, 64) for c in (1024, 8192, 32768)]
                    + [(f"prefill {n} ctx 1k", 1, n, 1024) for n in (512, 2048)])
CONFIGS = {"v4_tiny": config.v4_tiny, "wide_moe": wide_moe_config}


def invariant(res):
  """4. The step beside the plain step, bf16 compute and KV, max_model_len 64k, timed alternately point by point
  (both runners live at once, so load from elsewhere hits them alike). One runner pair per config (budget 2048
  tokens, 64 rows): the step compiles once, the plain step once per power of two. With --invariant_control a third
  runner of the step (same program, its own pools and buffers) joins the alternation."""
  layout = caches.CacheLayout(kv_dtype=jax.numpy.bfloat16)
  for name in FLAGS.configs:
    cfg = CONFIGS[name]()
    bf16 = model.cast_params(model.init_params(cfg, jax.random.PRNGKey(0)), jax.numpy.bfloat16)
    runs = [make_runner(cfg, bf16, max_model_len=FLAGS.invariant_max_model_len, max_num_seqs=64, chunk_size=2048,
                        max_num_batched_tokens=2048, layout=layout, dtype="bf16")
            for _ in range(3 if FLAGS.invariant_control else 2)]
    runs[0] = make_plain(runs[0])
    for i, (label, b, n, ctx) in enumerate(INVARIANT_POINTS):    # every runner: the same rows and tokens
      sets = [rows_at(getattr(r, "runner", r), [ctx] * b, [n] * b, np.random.default_rng(i)) for r in runs]
      plain, inv, *control = (1e3 * t for t in timed_alternating(runs, sets, FLAGS.repeats))
      res[f"inv_{name}_{label}"] = [plain, inv, inv / plain] + [c for t in control for c in (t, t / inv)]
    del runs


BUDGETS = (64, 512, 2048)


def budget(res):
  """5. What the step's token budget costs when the step holds few tokens: decode batch 8 at context 1k, bf16, the
  same rows through the step at budgets 64 / 512 / 2048 and through the plain step (its shape follows the 8 tokens),
  timed alternately. The live-block loops make the step's arithmetic follow the 8 tokens; what grows with the budget
  is its work at the budget's width (buffers, their copies, the expert pairs' sort)."""
  layout = caches.CacheLayout(kv_dtype=jax.numpy.bfloat16)
  for name in FLAGS.configs:
    cfg = CONFIGS[name]()
    bf16 = model.cast_params(model.init_params(cfg, jax.random.PRNGKey(0)), jax.numpy.bfloat16)
    kw = dict(max_model_len=FLAGS.invariant_max_model_len, max_num_seqs=64, layout=layout, dtype="bf16")
    runs = [make_plain(make_runner(cfg, bf16, chunk_size=64, max_num_batched_tokens=64, **kw))]
    runs += [make_runner(cfg, bf16, chunk_size=min(b, 2048), max_num_batched_tokens=b, **kw) for b in BUDGETS]
    sets = [rows_at(getattr(r, "runner", r), [1024] * 8, [1] * 8, np.random.default_rng(0)) for r in runs]
    ts = [1e3 * t for t in timed_alternating(runs, sets, FLAGS.repeats)]
    res[f"budget_{name}"] = [ts[0], *ts[1:], *(t / ts[0] for t in ts[1:])]
    res[f"budget_faults_{name}"] = [faults_per_step(r, rows) for r, rows in zip(runs, sets)]
    del runs


def faults_per_step(run, rows, steps=3) -> float:
  """The process's minor page faults per step of `run` (warm): pages mapped fresh for the step's buffers."""
  run.run(rows)
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(steps):
    run.run(rows)
  return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps


def main(argv):
  del argv
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  res = {"config": cfg.name}
  if "decode" in FLAGS.parts:
    decode(cfg, params, rng, res)
  if "mixed" in FLAGS.parts:
    mixed(cfg, params, rng, res)
  if "memory" in FLAGS.parts:
    memory(cfg, params, rng, res)
  if "invariant" in FLAGS.parts:
    invariant(res)
  if "budget" in FLAGS.parts:
    budget(res)
  if FLAGS.json:
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}, indent=1))
  print_tables(res, FLAGS.parts)


def print_tables(res: dict, parts) -> None:
  cfg = res["config"]
  if "decode" in parts:
    rows = [[f"{ctx // 1024}k", res[f"decode_b8_ctx{ctx // 1024}k_ms"]] for ctx in CONTEXTS]
    rows.append(["64k / 2k", res["decode_64k_over_2k"]])
    print_table(["context", "ms"], rows, title=f"1. Decode step, batch 8, {cfg}, max_model_len 1M (median of "
                f"{FLAGS.repeats}; plan {res['decode_plan_bytes']} bytes)")
  if "mixed" in parts:
    rows = [[C, *res[f"mixed_c{C}"]] for C in (int(c) for c in FLAGS.mixed_chunks)]
    print_table(["chunk", "chunk alone ms", "chunk + 63 decodes ms", "mixed / chunk", "real tokens (C + 63) / C"],
                rows, title=f"2. Mixed step vs the chunk alone, 64 rows at context 1k, {cfg} (timed alternately)")
  if "memory" in parts:
    print_table(["max_model_len", "step temp bytes"],
                [[f"{mml // 1024}k", res[f"step_temp_bytes_max_len_{mml // 1024}k"]] for mml in (65536, M1)],
                title="3. Compiled temp memory of the step program (budget 512 tokens, 8 rows)")
  if "invariant" in parts:
    rows = [[name, label, *res[f"inv_{name}_{label}"]] for name in FLAGS.configs for label, *_ in INVARIANT_POINTS]
    control = ["second invariant runner ms", "second / first invariant"] if FLAGS.invariant_control else []
    print_table(["config", "point", "plain ms", "invariant ms", "invariant / plain", *control], rows,
                title=f"4. The step (batch invariant) vs a plain step, bf16 compute and KV, max_model_len "
                      f"{FLAGS.invariant_max_model_len} (median of {FLAGS.repeats}, timed alternately)")
  if "budget" in parts:
    rows = [[name, *res[f"budget_{name}"]] for name in FLAGS.configs]
    print_table(["config", "plain ms", *(f"budget {b} ms" for b in BUDGETS), *(f"{b} / plain" for b in BUDGETS)],
                rows, title=f"5. Decode batch 8 at context 1k through the step at three token budgets beside the "
                            f"plain step, bf16 (median of {FLAGS.repeats}, timed alternately)")
    rows = [[name, *res[f"budget_faults_{name}"]] for name in FLAGS.configs]
    print_table(["config", "plain", *(f"budget {b}" for b in BUDGETS)], rows,
                title="5b. Minor page faults per step (the process's, 3 warm steps each)")


if __name__ == "__main__":
  app.run(main)
