"""Roofline cost of one engine step at real width: the dropped tiled invariant step, a row-invariant single-pass
step on fixed-tile kernels, a plain (non-invariant) step and the row-invariant step as the engine builds it today on
a GPU, for V4-Flash and V4.1-Flash on an H200 (or H100), from the bytes and FLOPs each must move and do. A model, not a measurement: the rows where the GPU check measured a kernel print the measurement
beside the model's figure. The model and its assumptions: benchmarks/support/step_cost.py; how to read the table:
docs/engine.md (Cost at real width).

    python -m benchmarks.step_roofline
    python -m benchmarks.step_roofline --models=v4_flash --device=h100 --experts=fp8 --kv=fp8

Columns: weight / KV / activation bytes and FLOPs of the plain step (c) (the row-invariant step (b) reads the same
weights), the tiled step's (a) weight bytes, each design's roofline ms, and the ratios to (c). "(b)" cuts matmul
reductions into fixed 256-wide pieces (parallel or serial per call, same bits); "(b) no split-K" never splits them.
"(d)" is the engine's step as built on a GPU: each dense projection in fixed row blocks (`row_invariant.GPU_BLOCKING`,
128 rows, for bf16 projections; 80 at `--projections=fp8`, the block FP8 projection matmuls would take), one call (and
one read of its weights) per block, the per-token work around it on whole blocks, the routed experts once per step
on the grouped expert kernel; "(d) call floor" is its
projection calls in sequence times the same assumed 5 us (launch gaps the roofline leaves out). A second table per
model puts (d)/(c) at other row blocks (`--row_blocks`): fewer rows re-read the weights more often at prefill, more
rows pad a decode step's one block with work. "scan floor" is each
design's dependent compressor fold steps times an assumed 5 us each (latency the roofline
leaves out): (a) and (b) fold each pooling window's tokens in position order (up to ratio - 1 steps a pass), (c)
with the doubling scan (log2 of the window).
"""

from __future__ import annotations

import dataclasses

from absl import app, flags

from benchmarks.support import step_cost
from benchmarks.support.budget_width import budget_bytes
from benchmarks.support.table import print_table
from dsv4.config import get_preset
from dsv4.layers import row_invariant

flags.DEFINE_list("models", ["v4_flash", "v41_flash"], "Model presets (dsv4.config).")
flags.DEFINE_enum("device", "h200", sorted(step_cost.DEVICES), "Device description.")
flags.DEFINE_enum("experts", "mxfp4", ["mxfp4", "fp8", "bf16"], "Routed expert weight format.")
flags.DEFINE_enum("kv", "bf16", ["bf16", "fp8"], "KV pool format (bf16 rows or 584-byte FP8 records).")
flags.DEFINE_enum("compute", "bf16", ["bf16", "fp8"], "Tensor-core rate the matmuls run at.")
flags.DEFINE_enum("projections", "fp8", ["fp8", "bf16"], "Dense projection weight format (fp8 as released; bf16 as "
                  "the loader holds them today).")
flags.DEFINE_integer("tile", 64, "Tokens per tile of the dropped tiled step (a).")
flags.DEFINE_integer("row_block", 0, "Rows per projection call of (d); 0: by the projection format "
                     "(row_invariant.GPU_BLOCKING.rows, 128, for bf16 as the engine holds them; 80 for FP8).")
flags.DEFINE_list("row_blocks", ["32", "64", "80", "96", "128", "160"],
                  "Row blocks of the (d)/(c) trade table; empty: none.")
flags.DEFINE_bool("expert_loop", False, "(d) runs the routed experts in its loop of 8-pair blocks, each reading its "
                  "expert's weights, as the engine does where the grouped expert kernel cannot take them (kernels "
                  "off, or tiles that do not divide the experts' local shapes on a mesh).")
flags.register_validator("row_block", lambda v: v >= 0, "--row_block: 0 (by the projection format) or a row count")
flags.register_validator("row_blocks", lambda v: all(b.isdigit() and int(b) > 0 for b in v),
                         "--row_blocks: positive row counts")
flags.DEFINE_list("budgets", ["512", "2048", "8192"], "Engine token budgets of the budget-width table (what (d) "
                  "writes at its budget's width, traced from the step program; about 20 s per model); empty: none.")
FLAGS = flags.FLAGS

GB = 1e9


def step_rows(cfg, dev, fmt, tiling) -> list[list]:
  w = step_cost.model_weights(cfg, fmt)
  rows = []
  for pt in step_cost.default_points():
    r = {d: step_cost.step_cost(cfg, pt, d, dev, fmt, tiling, w) for d in step_cost.DESIGNS}
    c, a, b, b0, d = r["plain"], r["tiled"], r["invariant_splitk"], r["invariant"], r["blocked"]
    rows.append([pt.label, c.tally.weight_bytes / GB, a.tally.weight_bytes / GB, d.tally.weight_bytes / GB,
                 c.tally.kv_bytes / GB, c.tally.act_bytes / GB, c.tally.flops / 1e12, c.time_s * 1e3, c.bound,
                 a.time_s * 1e3, b.time_s * 1e3, b0.time_s * 1e3, d.time_s * 1e3, a.time_s / c.time_s,
                 b.time_s / c.time_s, b0.time_s / c.time_s, d.time_s / c.time_s,
                 " / ".join(f"{x.scan_steps * dev.dependent_step_s * 1e3:.3g}" for x in (a, b, c)),
                 projection_calls(w, pt, tiling) * dev.dependent_step_s * 1e3])
  return rows


def row_block_rows(cfg, dev, fmt, tiling, blocks) -> list[list]:
  """(d)/(c) at every point for each row block in `blocks`, and the worst point."""
  w = step_cost.model_weights(cfg, fmt)
  points = step_cost.default_points()
  plain = [step_cost.step_cost(cfg, pt, "plain", dev, fmt, tiling, w).time_s for pt in points]
  rows = []
  for rb in blocks:
    t = dataclasses.replace(tiling, row_block=rb)
    r = [step_cost.step_cost(cfg, pt, "blocked", dev, fmt, t, w).time_s / c for pt, c in zip(points, plain)]
    rows.append([rb, *(f"{x:.2f}" for x in r), f"{max(r):.2f}"])
  return rows


def row_block_headers():
  return ["rows per block"] + [f"(d)/(c), {pt.label}" for pt in step_cost.default_points()] + ["worst"]


def projection_calls(w, pt, tiling) -> int:
  """(d)'s dense projection calls in one step, one after another: a call per block of `row_block` live rows per
  projection (the roofline leaves their launch gaps out)."""
  tokens = pt.batch                          # decode: a token per row; prefill: the chunk
  per_pass = sum(len(lw.matmuls) for lw in w.layers) + len(w.top_matmuls)
  return per_pass * -(-tokens // tiling.row_block)


STEP_HEADERS = ["point", "weights GB (c, b)", "weights GB (a)", "weights GB (d)", "KV GB", "act GB", "TFLOP",
                "(c) ms", "bound", "(a) ms", "(b) ms", "(b) no split-K ms", "(d) ms", "(a)/(c)", "(b)/(c)",
                "(b) no split-K/(c)", "(d)/(c)", "scan floor ms (a / b / c)", "(d) call floor ms"]


def measured_rows(dev, fmt, tiling) -> list[list]:
  cfg = get_preset("v4_flash")
  rows = []
  for m in step_cost.MEASURED_H200:
    f = dataclasses.replace(fmt, kv=m.kv)
    model_ms = step_cost.layer_op_seconds(cfg, m.layer_kind, m.point, m.part, m.design, dev, f, tiling) * 1e3
    rows.append([m.case, f"{m.point.label}, one {m.layer_kind.upper()} layer's {m.part}", m.design, model_ms,
                 m.measured_ms, model_ms / m.measured_ms])
  return rows


BUDGET_POINTS = (step_cost.Point("decode", 1, 8192), step_cost.Point("decode", 64, 8192),
                 step_cost.Point("decode", 256, 8192), step_cost.Point("prefill", 512, 8192),
                 step_cost.Point("prefill", 2048, 8192), step_cost.Point("prefill", 8192, 8192))


def budget_rows(cfg, dev, fmt, tiling, budgets) -> list[list]:
  """(d) in an engine with token budget B: its step also writes the arrays spanning B (`budget_width`): the loop
  buffers (allocated unwritten on a GPU: 0 bytes; zero-filled on a CPU) and the other whole-budget ops, taken as
  written once and read once (an upper estimate: traced before fusion). A point needs B >= its tokens."""
  bb = budget_bytes(cfg)
  w = step_cost.model_weights(cfg, fmt)
  rows = []
  for B in budgets:
    moved = 2 * bb.other_ops * B
    extra = moved / dev.hbm_bytes_per_s
    ratios = []
    for pt in BUDGET_POINTS:
      if pt.batch > B:
        ratios.append("-")
        continue
      c = step_cost.step_cost(cfg, pt, "plain", dev, fmt, tiling, w).time_s
      d = step_cost.step_cost(cfg, pt, "blocked", dev, fmt, tiling, w).time_s
      ratios.append(f"{(d + extra) / c:.2f}")
    rows.append([B, bb.loop_buffers * B / GB, bb.other_ops * B / GB, extra * 1e3, *ratios])
  return rows


def budget_headers():
  return (["budget B", "loop buffers GB (CPU only)", "other ops GB (written)", "added ms"]
          + [f"(d)+B / (c), {pt.label}" for pt in BUDGET_POINTS])


MEASURED_HEADERS = ["GPU check row (H200)", "model op", "design", "model ms", "measured ms", "model / measured"]


def main(argv):
  del argv
  dev = step_cost.DEVICES[FLAGS.device]
  fmt = step_cost.Formats(experts=FLAGS.experts, kv=FLAGS.kv, compute=FLAGS.compute, projections=FLAGS.projections)
  tiling = step_cost.Tiling(tile_tokens=FLAGS.tile, row_block=FLAGS.row_block or step_cost.row_block_for(fmt),
                            expert_kernel=not FLAGS.expert_loop)
  experts_where = (f"on the grouped expert kernel where it takes them, else in a loop of {tiling.loop_expert_rows}-pair "
                   f"blocks" if tiling.expert_kernel else f"in a loop of {tiling.loop_expert_rows}-pair blocks")
  print(f"{dev.name}: HBM {dev.hbm_bytes_per_s / 1e12:.2f} TB/s, {fmt.compute} matmuls at "
        f"{dev.peak(fmt.compute) / 1e12:.0f} TFLOP/s ({dev.matmul_efficiency:.0%} of spec), {dev.num_sms} SMs; "
        f"experts {fmt.experts}, projections {fmt.projections}, KV {fmt.kv}, tile {tiling.tile_tokens}. (a) tiled "
        f"step (dropped), (b) row-invariant step on fixed-tile kernels (fixed split-K), (c) plain step, (d) the "
        f"row-invariant step as built ({tiling.row_block}-row blocks, the shared expert among the projections, the "
        f"routed experts {experts_where}).")
  for name in FLAGS.models:
    cfg = get_preset(name)
    print_table(STEP_HEADERS, step_rows(cfg, dev, fmt, tiling), title=f"{name}: one step, roofline")
    if FLAGS.row_blocks:
      print_table(row_block_headers(), row_block_rows(cfg, dev, fmt, tiling, [int(b) for b in FLAGS.row_blocks]),
                  title=f"{name}: (d)/(c) by rows per block of the row-invariant ops (the engine's GPU blocks: "
                        f"{row_invariant.GPU_BLOCKING.rows}, for its bf16 projections)")
    if FLAGS.budgets:
      bb = budget_bytes(cfg)
      print_table(budget_headers(), budget_rows(cfg, dev, fmt, tiling, [int(b) for b in FLAGS.budgets]),
                  title=f"{name}: (d) at an engine budget B: arrays spanning B ({bb.budget_loops} row-block loops "
                        f"with a buffer of B rows; per budget token {bb.loop_buffers / 1e6:.2f} MB of loop buffers, "
                        f"{bb.other_ops / 1e6:.2f} MB of other ops)")
  if dev is step_cost.H200:
    print_table(MEASURED_HEADERS, measured_rows(dev, fmt, tiling),
                title="GPU check kernel rows (BUILD_NOTES.md, GPU check) beside the model's op (v4_flash, one layer)")


if __name__ == "__main__":
  app.run(main)
