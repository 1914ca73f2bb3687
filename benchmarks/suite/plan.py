"""The suite's items in order of value, and the loop that runs them under the budget.

An item has a name (`a.copy`, `b.kernels`, ...), the seconds it needs to start (`need_s`: less left and it is
skipped, with the reason in its row) and a function that returns its rows. An exception in an item is its row's
`error`; the next item runs. An item that yields several rows (the kernels, the top-k variants) checks the budget
before each. Every later section reads what earlier ones measured from `Context` (the ceilings).
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from typing import Callable, Iterator

import jax

from benchmarks.suite import ceilings, engine_width as ew, invariant_dots, kernel_cases as kc, row_bits, serve_job
from benchmarks.suite.budget import Budget
from benchmarks.suite.kernel_cases import TopkDiagnosis
from benchmarks.suite.report import Report, error_line
from pallas_kernels import dispatch


@dataclasses.dataclass(frozen=True)
class SuiteConfig:
  out_dir: str
  cache_dir: str
  dry_run: bool = False
  budget_s: float = 510.0
  seed: int = 0
  compile_threads: int = 8
  iters: int = 20
  repeats: int = 3
  flush_mb: float = 256.0
  hbm_gbps: float = 4800.0
  peak_tflops: float = 989.0
  serve_kernels: str = "auto"
  engine_kernels: str = "auto"
  only: tuple[str, ...] = ()


@dataclasses.dataclass
class Context:
  cfg: SuiteConfig
  budget: Budget
  ceilings: dict = dataclasses.field(default_factory=dict)
  engine: dict = dataclasses.field(default_factory=dict)   # what (d)'s items share: model, prompts, first run


@dataclasses.dataclass(frozen=True)
class Item:
  name: str
  need_s: float       # seconds it needs to start (real run); the dry run needs a tenth
  run: Callable[[Context], Iterator[dict]]
  what: str


# ------------------------------------------------------------------------------------------------ (a)


def _versions(ctx):
  yield dict(ceilings.versions(), status="ok")


def _copy(ctx):
  row = ceilings.copy_bandwidth(16 if ctx.cfg.dry_run else 2048)
  row["pct_datasheet"] = 100 * row["copy_gbps"] / ctx.cfg.hbm_gbps
  ctx.ceilings.update(row)
  yield dict(row, status="ok")


def _matmul(ctx):
  row = ceilings.matmul_rate(256 if ctx.cfg.dry_run else 8192)
  row["pct_datasheet"] = 100 * row["matmul_tflops"] / ctx.cfg.peak_tflops
  ctx.ceilings.update(row)
  yield dict(row, status="ok")


def _row_bits(ctx):
  yield from row_bits.run(ctx.cfg.dry_run, ctx.cfg.seed, ctx.cfg.compile_threads)


# ------------------------------------------------------------------------------------------------ (b), (e)


TOPK_TABLE = "Fused top-k diagnosis (B=64, M=32768, k=512, bf16 keys; variants of its tuning)"
KERNEL_TABLE = "Each kernel vs its XLA reference, then timed (the same compiled executable)"
RUN_TABLE = "Engine runs"
CMP_TABLE = "Comparisons"


def _topk_diagnosis(ctx):
  diag = TopkDiagnosis(ctx.cfg.dry_run, ctx.cfg.seed)
  futures = diag.compile(ctx.cfg.compile_threads)
  for name, fut in futures.items():
    if not ctx.budget.allows(_need(ctx, 5)):
      yield dict(item=f"b.topk.{name}", table=TOPK_TABLE, status="skipped", error=_skip_why(ctx))
      continue
    try:
      exe, compile_s = fut.result()
      yield dict(diag.run_variant(name, exe, compile_s), item=f"b.topk.{name}", table=TOPK_TABLE)
    except Exception as e:  # noqa: BLE001 - a variant that fails to lower, compile or run is its row
      traceback.print_exc()
      yield dict(item=f"b.topk.{name}", table=TOPK_TABLE, variant=name, status="error",
                 error=error_line(e))


def _kernel_rows(ctx, cases, prefix, table=KERNEL_TABLE):
  flush = kc.Flusher(0 if ctx.cfg.dry_run else ctx.cfg.flush_mb)
  iters, repeats = (1, 1) if ctx.cfg.dry_run else (ctx.cfg.iters, ctx.cfg.repeats)
  prepared, failed = [], {}
  for i, case in enumerate(cases):
    try:
      prepared.append(kc.prepare(case, ctx.cfg.dry_run, ctx.cfg.seed + i))
    except Exception as e:  # noqa: BLE001 - a kernel that does not lower is its row's error
      traceback.print_exc()
      failed[case.name] = "lowering: " + error_line(e)
  futures = kc.compile_all(prepared, ctx.cfg.compile_threads)
  for case in cases:
    item = f"{prefix}.{case.name}"
    if case.name in failed:
      yield dict(item=item, table=table, kernel=case.op, status="error", error=failed[case.name])
      continue
    if not ctx.budget.allows(_need(ctx, 5)):
      yield dict(item=item, table=table, kernel=case.op, status="skipped", error=_skip_why(ctx))
      continue
    try:
      pr = futures[case.name].result()
      yield dict(kc.run_case(pr, iters=iters, repeats=repeats, flush=flush, ceilings=ctx.ceilings,
                             hbm_gbps=ctx.cfg.hbm_gbps, peak_tflops=ctx.cfg.peak_tflops), item=item, table=table)
    except Exception as e:  # noqa: BLE001 - compile / launch failures are rows
      traceback.print_exc()
      yield dict(item=item, table=table, kernel=case.op, status="error", error=error_line(e))


def _kernels(ctx):
  yield from _kernel_rows(ctx, kc.plan(), "b")


def _invariant_dots(ctx):
  c = ctx.cfg
  yield from invariant_dots.run(c.dry_run, c.seed, iters=c.iters, repeats=c.repeats, flush_mb=c.flush_mb,
                                hbm_gbps=c.hbm_gbps, peak_tflops=c.peak_tflops)


def _tuning(ctx):
  yield from _kernel_rows(ctx, kc.tuning_plan(), "e", table="")


# ------------------------------------------------------------------------------------------------ (c)


def _serve(ctx):
  yield serve_job.run(os.path.join(ctx.cfg.out_dir, "serve"), kernels=ctx.cfg.serve_kernels,
                      compilation_cache_dir=ctx.cfg.cache_dir)


# ------------------------------------------------------------------------------------------------ (d)


def _engine_setup(ctx):
  wl = ew.Workload.dry() if ctx.cfg.dry_run else ew.Workload.real()
  cfg, params = ew.model(ctx.cfg.dry_run, ctx.cfg.seed)
  prompts = wl.prompts(cfg.vocab_size, ctx.cfg.seed)
  kernels = "interpret" if ctx.cfg.dry_run else ctx.cfg.engine_kernels
  ctx.engine.update(wl=wl, cfg=cfg, params=params, prompts=prompts, kernels=kernels)
  return ew, wl, cfg, params, prompts, kernels


def _engine_row(ew, ctx, res, *, kv, kernels) -> dict:
  cfg, wl = ctx.engine["cfg"], ctx.engine["wl"]
  context = (wl.prompt_min + wl.prompt_max) // 2 + wl.max_tokens // 2
  row = {k: v for k, v in res.items() if k != "outputs"}
  row.update(table=RUN_TABLE, model=cfg.name, kv=kv, kernels=kernels, requests=len(res["outputs"]),
             decode_roofline_ms=ew.roofline_ms(cfg, "decode", res.get("decode_rows"), context, kv),
             decode_plain_roofline_ms=ew.roofline_ms(cfg, "decode", res.get("decode_rows"), context, kv, "plain"),
             prefill_roofline_ms=ew.roofline_ms(cfg, "prefill", res.get("prefill_tokens"), context, kv),
             prefill_plain_roofline_ms=ew.roofline_ms(cfg, "prefill", res.get("prefill_tokens"), context, kv,
                                                      "plain"))
  verdicts = dispatch.validation_verdicts()
  if verdicts:
    row["kernels_validated"] = {k[0]: v for k, v in verdicts.items()}
  errors = [o.rid for o in res["outputs"] if o.error]
  row["status"] = "ok" if not errors else "error"
  if errors:
    row["error"] = f"{len(errors)} requests failed (first {errors[0]})"
  return row


def _engine_bf16(ctx):
  ew, wl, cfg, params, prompts, kernels = _engine_setup(ctx)
  ec = ew.engine_config(cfg, wl, prompts, kv="bf16", kernels=kernels)
  res = ew.serve(params, cfg, ec, prompts, wl.max_tokens, bookkeeping_samples=8)
  ctx.engine["bf16"] = res["outputs"]
  yield dict(_engine_row(ew, ctx, res, kv="bf16", kernels=kernels), item="d.engine.bf16")


def _engine_cmdbuf(ctx):
  """`d.engine.bf16` with the row-block loops inside the step's CUDA graphs (`ew.LOOP_COMMAND_BUFFERS`): its steps
  against that row's are what the loops' host round trips cost; its tokens must be the same."""
  if "cfg" not in ctx.engine:
    _engine_setup(ctx)
  wl, cfg, params, prompts, kernels = (ctx.engine[k] for k in ("wl", "cfg", "params", "prompts", "kernels"))
  ec = ew.engine_config(cfg, wl, prompts, kv="bf16", kernels=kernels, command_buffers=ew.LOOP_COMMAND_BUFFERS)
  res = ew.serve(params, cfg, ec, prompts, wl.max_tokens)
  row = dict(_engine_row(ew, ctx, res, kv="bf16", kernels=kernels), command_buffers=ec.gpu_step_command_buffers,
             applies=jax.default_backend() == "gpu")
  if "bf16" in ctx.engine and row["status"] == "ok":
    same = [list(a.output) == list(b.output) for a, b in zip(ctx.engine["bf16"], res["outputs"])]
    row["tokens_as_bf16_row"] = all(same)
    if not all(same):
      row.update(status="mismatch", error=f"{same.count(False)} requests' tokens differ from d.engine.bf16's")
  yield row


def _engine_alone(ctx):
  if "bf16" not in ctx.engine:
    yield dict(status="skipped", error="the batched bf16 run did not finish")
    return
  wl, cfg, params, prompts = (ctx.engine[k] for k in ("wl", "cfg", "params", "prompts"))
  ec = ew.engine_config(cfg, wl, prompts, kv="bf16", kernels=ctx.engine["kernels"])
  picks = [0, len(prompts) - 1]      # the first request of the first group and the last one
  alone = [ew.serve(params, cfg, ec, [prompts[i]], wl.max_tokens)["outputs"][0] for i in picks]
  batched = [ctx.engine["bf16"][i] for i in picks]
  row = dict(ew.bitwise_alone(batched, alone), table=CMP_TABLE, requests=[f"r{i}" for i in picks], kv="bf16",
             kernels=ctx.engine["kernels"])
  row["status"] = "ok" if row["tokens_equal"] and row["logits_bitwise"] else "mismatch"
  if row["status"] != "ok":
    row["error"] = "a request alone differs from itself in the batch (tokens or logits)"
  yield row


def _engine_xla(ctx):
  if "bf16" not in ctx.engine:
    yield dict(status="skipped", error="the batched bf16 run did not finish")
    return
  wl, cfg, params, prompts = (ctx.engine[k] for k in ("wl", "cfg", "params", "prompts"))
  ec = ew.engine_config(cfg, wl, prompts, kv="bf16", kernels="xla")
  res = ew.serve(params, cfg, ec, prompts, wl.max_tokens)
  yield _engine_row(ew, ctx, res, kv="bf16", kernels="xla")
  yield dict(ew.compare_logits(ctx.engine["bf16"], res["outputs"]), table=CMP_TABLE, item="d.engine.xla_vs_kernels",
             kv="bf16", kernels=f"xla vs {ctx.engine['kernels']}", status="ok")


def _engine_fp8(ctx):
  if "cfg" not in ctx.engine:
    _engine_setup(ctx)
  wl, cfg, params, prompts, kernels = (ctx.engine[k] for k in ("wl", "cfg", "params", "prompts", "kernels"))
  ec = ew.engine_config(cfg, wl, prompts, kv="fp8", kernels=kernels)
  res = ew.serve(params, cfg, ec, prompts, wl.max_tokens, bookkeeping_samples=8)
  yield _engine_row(ew, ctx, res, kv="fp8", kernels=kernels)


# ------------------------------------------------------------------------------------------------ the plan


def items() -> list[Item]:
  return [
      Item("a.versions", 5, _versions, "jax, jaxlib, triton, driver, GPU"),
      Item("a.copy", 10, _copy, "device-to-device copy bandwidth (2 GiB)"),
      Item("a.matmul", 10, _matmul, "bf16 8192^3 matmul rate"),
      Item("a.row_bits", 25, _row_bits, "which per-token ops (norms, softmax, mHC, router, RoPE, row_dot) keep a "
           "row's bits at 1..2048 rows: can the step run them at a width that follows the live rows"),
      Item("b.topk", 40, _topk_diagnosis, "fused top-k diagnosis: repeats, sentinel, selected lanes, tunings"),
      Item("b.kernels", 40, _kernels, "every kernel vs its reference at V4-Flash shapes, timed (same executable)"),
      Item("b.invariant_dots", 50, _invariant_dots, "row_dot vs jnp.dot (N 1..2048, 4096^2; k_splits 8 at N 1, "
           "64), the engine's row blocks (R 32..160 at 1 and 2048 live rows), grouped_dot vs its reference (256 "
           "experts), a row's bits across row counts"),
      Item("c.serve", 60, _serve, "the main job (experiments.serve, shipped model): 48 graded answers"),
      Item("d.engine.bf16", 90, _engine_bf16, "engine at V4-Flash widths, bf16 KV, kernels"),
      Item("d.engine.alone", 40, _engine_alone, "two requests alone vs batched, bitwise"),
      Item("d.engine.cmdbuf", 80, _engine_cmdbuf, "d.engine.bf16 with the step's while loops inside its CUDA graphs "
           "(EngineConfig.gpu_step_command_buffers): what the loops' host round trips cost"),
      Item("d.engine.xla", 60, _engine_xla, "the XLA path vs the kernels: first divergent token, max |dlogit|"),
      Item("d.engine.fp8", 60, _engine_fp8, "engine at V4-Flash widths, FP8 KV, kernels"),
      Item("e.tuning", 20, _tuning, "sparse decode tilings, as many as time allows"),
  ]


def _need(ctx, need_s: float) -> float:
  return need_s / 10 if ctx.cfg.dry_run else need_s


def _skip_why(ctx) -> str:
  b = ctx.budget
  return f"budget: {max(b.left(), 0):.0f} s of {b.total_s:.0f} s left"


def selected(item: Item, only: tuple[str, ...]) -> bool:
  return not only or any(item.name.startswith(o) or o.startswith(item.name) for o in only)


def run(ctx: Context, report: Report, log=print) -> None:
  """Every item in order; each row stamped with its section, item and seconds, and reported as it comes."""
  for item in items():
    if not selected(item, ctx.cfg.only):
      continue
    if not ctx.budget.allows(_need(ctx, item.need_s)):
      _emit(report, dict(item=item.name, status="skipped",
                         error=f"{_skip_why(ctx)}; needs {_need(ctx, item.need_s):.0f} s to start"), item, 0.0, log)
      continue
    t0 = time.perf_counter()
    try:
      for row in item.run(ctx):
        _emit(report, row, item, time.perf_counter() - t0, log)
        t0 = time.perf_counter()
    except Exception as e:  # noqa: BLE001 - an item's failure is its row; the suite goes on
      traceback.print_exc()
      _emit(report, dict(status="error", error=error_line(e)), item,
            time.perf_counter() - t0, log)


def _emit(report: Report, row: dict, item: Item, seconds: float, log) -> None:
  row = dict(row)
  row.setdefault("item", item.name)
  row = {"section": item.name[0], "item": row.pop("item"), "status": row.pop("status", "ok"), **row,
         "seconds": round(seconds, 1)}
  report.add(row)
  log(f"[{len(report.rows):3d}] {row['item']:52s} {row['status']:8s} {row['seconds']:6.1f}s "
      f"{row.get('error', '')[:160]}")
