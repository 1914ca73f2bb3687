"""The GPU suite: one process, one command, a budget it keeps, the most valuable measurement first.

    bash benchmarks/gpu_suite.sh OUT_DIR [--budget_s=510]          # on the GPU (at most 9 min with compiles)
    bash benchmarks/gpu_suite.sh OUT_DIR --dry_run                  # CPU: interpret-mode kernels, small shapes
    python -m benchmarks.gpu_suite --out_dir=OUT_DIR --list         # the items in order

Order (benchmarks/suite/plan.py): (a) versions and the measured ceilings (device-to-device copy, bf16 matmul), then
which of the model's per-token ops keep a row's bits at any row count on this device (a.row_bits); (b) the fused
top-k diagnosis, then every kernel against its reference at V4-Flash shapes, timed with the same compiled
executable, then the batch-invariant matmuls (time against XLA, a row's bits across row counts); (c) the
main job (experiments.serve as a library call, the shipped model, 48 graded answers); (d) the engine at V4-Flash
attention widths (v4_flash_layers:4, random bf16 weights; bf16 and FP8 KV; kernels vs XLA; a request alone vs
batched, bitwise; the step's while loops in its CUDA graphs); (e) kernel tuning rows while time is left.

Output: OUT_DIR/results.jsonl (a row per item, appended as it ends), OUT_DIR/suite.md (the tables, rewritten after
every row), OUT_DIR/serve/ (the main job's outputs). Compiled programs go to the persistent compilation cache
(--cache_dir, default OUT_DIR/jax_cache): a second run on the same machine compiles nothing again.

The budget (--budget_s): an item starts only with the seconds it needs left, else its row says `skipped` and why;
a watchdog ends the process (exit 3) if an item hangs past the budget plus 20 s, after writing a last row naming
it. Exit status: 0 when every row that ran is ok, 1 otherwise.
"""

from __future__ import annotations

import os
import sys
import time

import jax
from absl import app, flags

from benchmarks.suite import jax_compat, plan
from benchmarks.suite.budget import Budget, Watchdog
from benchmarks.suite.plan import SuiteConfig
from benchmarks.suite.report import Report


def define_flags(fv: flags.FlagValues = flags.FLAGS) -> None:
  """The suite's flags on `fv` (the process's flags when run; a fresh FlagValues in tests)."""
  d = dict(flag_values=fv)
  flags.DEFINE_string("out_dir", None, "Where results.jsonl, suite.md and serve/ go.", **d)
  flags.DEFINE_string("cache_dir", "", "Persistent compilation cache ('' = OUT_DIR/jax_cache).", **d)
  flags.DEFINE_bool("dry_run", False, "CPU: the same items and files, kernels in interpret mode, small shapes.", **d)
  flags.DEFINE_float("budget_s", 510.0, "Seconds for the whole suite, compiles included.", **d)
  flags.DEFINE_integer("seed", -1, "Seed of every random input (-1 = from the clock: fresh inputs each run; the "
                       "rows record it).", **d)
  flags.DEFINE_integer("compile_threads", 8, "Threads compiling kernel programs side by side.", **d)
  flags.DEFINE_integer("iters", 20, "Kernel calls per timing loop.", **d)
  flags.DEFINE_integer("repeats", 3, "Timing loops per kernel (best kept).", **d)
  flags.DEFINE_float("flush_mb", 256.0, "L2 flush buffer (MB) before each timed kernel call.", **d)
  flags.DEFINE_float("hbm_gbps", 4800.0, "Datasheet HBM bandwidth (H200 HBM3e).", **d)
  flags.DEFINE_float("peak_tflops", 989.0, "Datasheet dense bf16 rate (H100 / H200).", **d)
  flags.DEFINE_enum("serve_kernels", "auto", ["auto", "xla", "pallas"], "--kernels of the main job (c).", **d)
  flags.DEFINE_enum("engine_kernels", "auto", ["auto", "xla", "pallas"], "Kernels of the engine rows (d) on a device "
                    "(the dry run: interpret).", **d)
  flags.DEFINE_list("only", [], "Run only the items whose name starts with one of these (a.copy, b, d.engine.bf16).",
                    **d)
  flags.DEFINE_bool("list", False, "Print the items in order and exit.", **d)


define_flags()
FLAGS = flags.FLAGS


def suite_config(fv=FLAGS):
  out = os.path.abspath(fv.out_dir)
  return SuiteConfig(out_dir=out, cache_dir=os.path.abspath(fv.cache_dir or os.path.join(out, "jax_cache")),
                     dry_run=fv.dry_run, budget_s=fv.budget_s,
                     seed=fv.seed if fv.seed >= 0 else int(time.time()) % 100000,
                     compile_threads=fv.compile_threads, iters=fv.iters, repeats=fv.repeats, flush_mb=fv.flush_mb,
                     hbm_gbps=fv.hbm_gbps, peak_tflops=fv.peak_tflops, serve_kernels=fv.serve_kernels,
                     engine_kernels=fv.engine_kernels, only=tuple(fv.only))


def main(argv):
  del argv
  if FLAGS.list:
    for i, it in enumerate(plan.items()):
      print(f"{i + 1:2d}. {it.name:16s} needs {it.need_s:3.0f} s  {it.what}")
    return 0
  if not FLAGS.out_dir:
    print("gpu_suite: --out_dir is required", file=sys.stderr)
    return 2
  if FLAGS.dry_run:       # before JAX makes its CPU backend (XLA reads XLA_FLAGS then)
    os.environ["XLA_FLAGS"] = jax_compat.cpu_dry_run_xla_flags(os.environ.get("XLA_FLAGS", ""))
  cfg = suite_config()
  return run_suite(cfg)


def run_suite(cfg, clock=time.monotonic) -> int:
  budget = Budget(cfg.budget_s, clock)
  if not cfg.dry_run and jax.default_backend() != "gpu":
    print(f"gpu_suite: no GPU (JAX's backend is {jax.default_backend()}); --dry_run runs the suite on the CPU",
          file=sys.stderr)
    return 2
  applied = jax_compat.enable_persistent_cache(cfg.cache_dir)
  report = Report(cfg.out_dir, dict(mode="dry run on the CPU: numbers meaningless" if cfg.dry_run else "device",
                                    budget_s=cfg.budget_s, seed=cfg.seed, cache_dir=cfg.cache_dir,
                                    cache_options_not_applied=[k for k, v in applied.items() if not v] or None,
                                    started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))
  ctx = plan.Context(cfg, budget)

  def on_expire():
    last = report.rows[-1]["item"] if report.rows else "(none)"
    report.add(dict(section="a", item="budget", status="error",
                    error=f"killed by the watchdog at {budget.elapsed():.0f} s (budget {budget.total_s:.0f} s): "
                          f"the item after {last} hung or overran; later items not run"))
    print(f"gpu_suite: budget overrun after {last}; see {report.md}", flush=True)

  dog = Watchdog(budget, grace_s=20.0, on_expire=on_expire).start()
  try:
    plan.run(ctx, report)
  finally:
    dog.stop()
  report.header["wall_s"] = round(budget.elapsed(), 1)
  report.write_md()
  skipped = [r["item"] for r in report.rows if r["status"] == "skipped"]
  print(f"gpu_suite: {len(report.rows)} rows in {budget.elapsed():.0f} s; {report.counts()}; "
        f"skipped: {', '.join(skipped) or 'none'}; tables: {report.md}", flush=True)
  return 0 if all(r["status"] in ("ok", "skipped") for r in report.rows) else 1


if __name__ == "__main__":
  app.run(lambda argv: sys.exit(main(argv)))
