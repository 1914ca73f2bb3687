"""The GPU check: kernel correctness at V4-Flash shapes, then the decode / prefill timing tables, one process per case.

  benchmarks/gpu_check.sh [--out DIR] [--budget 400] [--only SUBSTR,...] [--case-timeout S]
  benchmarks/gpu_check.sh --dry-run --out DIR      # CPU: the same plumbing, tiny shapes (interpret mode / XLA)
  benchmarks/gpu_check.sh --list                   # the plan, in priority order

Output (DIR = --out, else $OUT, else gpu_check_out), rewritten after every case, so a run cut short still leaves
every finished row:
  results.jsonl   one JSON row per planned case, appended as soon as the case ends (skipped ones included);
  gpu_check.md    the markdown tables (correctness, timing), rebuilt after each case;
  env.json        jax / jaxlib / devices / nvidia-smi, from a child process;
  logs/<case>.log the case's stdout + stderr.

A row: `case`, `kind` (correctness | timing), `kernel` (op and implementation), `shapes` (the shape parameters),
`arrays` (every input array's shape and dtype, as run), `dtype`, `layout` (plain, fp8_record, fp8_paged(page),
fp8_keys), `tuning`, `status` and `error` (the last line of the failure): ok; mismatch (the kernel's answer is
outside tolerance: err_over_tol > 1); error (raised or crashed); timeout (killed at its per-case limit); skipped
(the global budget ran out first). Timing rows add the device time per call with L2 flushed (`kernel_ms`, see
benchmarks/kernels_bench.py for the method), `hot_ms`, FLOPs and bytes, and the roofline: `pct_hbm` (bytes / time
against --hbm-gbps), `pct_tc` (FLOPs / time against --peak-tflops), `roofline_pct` = max(bytes / HBM, FLOPs / peak) /
time, i.e. how close the case is to its own bound; `predicted_pct` is the design's estimate for that case
(docs/kernels.md, Roofline per configuration), the number the measured one is judged against. A timing row checks
its answer first and is not timed if wrong.

Order: every correctness case, then the timing cases. Each case runs in its own
process (`python -m benchmarks.gpu_check --child NAME`) under min(its timeout, budget left); a failure, crash or
hang is recorded and the next case runs. This file (the plan, the parent, the report) imports no JAX, so the parent
cannot be the thing that fails; the case side, which does, is benchmarks/gpu_check_cases.py. Exit status: 0 when
every case that ran is ok, 1 otherwise.

--dry-run: the same plan and plumbing on a CPU with tiny shapes: correctness cases run the kernels in Pallas
interpret mode; timing cases time the interpret-mode kernel (one iteration, hot: a CPU has no L2 to flush, so `kernel_ms` is
`hot_ms`) and the XLA reference beside it (`xla_ms`), so the roofline columns hold real, if meaningless, CPU
numbers.
--inject NAME=raise|hang|crash|mismatch (repeatable) makes one case fail that way (tests of the plumbing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATUSES = ("ok", "mismatch", "error", "timeout", "skipped")
MIN_CASE_S = 10.0  # a case needs at least this much budget to start (JAX's start-up alone takes seconds)


# ------------------------------------------------------------------------------------------------ the plan


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  kind: str  # "correctness" | "timing"
  op: str  # "sparse_attention" | "hca_attention" | "indexer_scores" | "indexer_topk"
  impl: str  # "triton"
  params: dict
  timeout: float

  @property
  def kernel(self) -> str:
    return f"{self.op} (Pallas-Triton)"


# V4-Flash: 64 heads x d 512 (64 RoPE), window 128, top-512; indexer 64 heads x 128.
_SPARSE = dict(H=64, D=512, W=128, K=512, page_size=64, lens=False)
_SPARSE_DRY = dict(H=16, D=128, W=16, K=32, page_size=4)
_INDEXER = dict(HI=64, C=128, k=512, cand=0, block_size=8)
_INDEXER_DRY = dict(HI=16, C=32, k=16)


def _sparse(name, kind, *, mode, kind_, fmt, N, ctx, impl="triton", timeout=None, dry=None, op="sparse_attention",
            **kw):
  p = dict(_SPARSE, mode=mode, layer=kind_, fmt=fmt, N=N, ctx=ctx, **kw)
  if kind_ == "hca":
    p["K"] = ctx // 128
  d = dict(_SPARSE_DRY, N=2 if mode == "decode" else 16, ctx=512 if kind_ == "csa" else 2048)
  if kind_ == "hca":
    d["K"] = d["ctx"] // 128
  d.update(dry or {})
  p["dry"] = d
  t = timeout or (90.0 if kind == "correctness" else 120.0)
  return Case(name, kind, op, impl, p, t)


def _indexer(name, kind, *, op, mode, keys, B, T, ctx, timeout=None, **kw):
  p = dict(_INDEXER, mode=mode, keys=keys, B=B, T=T, ctx=ctx, topk=op == "indexer_topk", **kw)
  d = dict(_INDEXER_DRY, B=2, T=1 if mode == "decode" else 16, ctx=512)
  if p.get("cand"):
    d["cand"] = 4
  p["dry"] = d
  t = timeout or (90.0 if kind == "correctness" else 120.0)
  return Case(name, kind, op, "triton", p, t)


def plan() -> list[Case]:
  """Every case, in priority order (correctness of each kernel, then timing)."""
  C, T = "correctness", "timing"
  cases = [
      # correctness at V4-Flash shapes: each kernel, each pool layout the model or the bench uses
      _sparse("correct.sparse.decode_csa.bf16.b64", C, mode="decode", kind_="csa", fmt="bf16", N=64, ctx=8192),
      _sparse("correct.sparse.decode_csa.fp8_paged.b64", C, mode="decode", kind_="csa", fmt="fp8_paged", N=64,
              ctx=8192),
      _sparse("correct.sparse.decode_csa.fp8_record.b64", C, mode="decode", kind_="csa", fmt="fp8_record", N=64,
              ctx=8192),
      _indexer("correct.topk.decode.fp8_keys.b64.128k", C, op="indexer_topk", mode="decode", keys="fp8", B=64, T=1,
               ctx=131072),
      _indexer("correct.topk.decode.bf16_keys.b64.128k", C, op="indexer_topk", mode="decode", keys="bf16", B=64,
               T=1, ctx=131072),
      _indexer("correct.scores.decode.bf16.b64.128k", C, op="indexer_scores", mode="decode", keys="bf16", B=64,
               T=1, ctx=131072),
      _sparse("correct.sparse.decode_hca.bf16.b64.128k.lens", C, mode="decode", kind_="hca", fmt="bf16", N=64,
              ctx=131072, lens=True, dry=dict(lens=True)),
      _sparse("correct.sparse.prefill_csa.bf16.q4096.32k", C, mode="prefill", kind_="csa", fmt="bf16", N=4096,
              ctx=32768),
      _indexer("correct.topk.decode.v41_candidates.b64.128k", C, op="indexer_topk", mode="decode", keys="bf16",
               B=64, T=1, ctx=131072, cand=64),
      _indexer("correct.topk.prefill.bf16.q4096.16k", C, op="indexer_topk", mode="prefill", keys="bf16", B=1,
               T=4096, ctx=16384),
      _sparse("correct.sparse.decode_csa.f32.b8", C, mode="decode", kind_="csa", fmt="f32", N=8, ctx=8192),
      # the decode and prefill tables (issue targets: decode >= 80% HBM bf16, >= 50% FP8; prefill >= 600 TF/s)
      _sparse("time.sparse.decode_csa.bf16.b64", T, mode="decode", kind_="csa", fmt="bf16", N=64, ctx=8192),
      _sparse("time.sparse.decode_csa.fp8_paged.b64", T, mode="decode", kind_="csa", fmt="fp8_paged", N=64,
              ctx=8192),
      _sparse("time.sparse.decode_csa.bf16.b128", T, mode="decode", kind_="csa", fmt="bf16", N=128, ctx=8192),
      _sparse("time.sparse.decode_csa.fp8_paged.b128", T, mode="decode", kind_="csa", fmt="fp8_paged", N=128,
              ctx=8192),
      _sparse("time.sparse.prefill_csa.bf16.q4096.32k", T, mode="prefill", kind_="csa", fmt="bf16", N=4096,
              ctx=32768),
      _sparse("time.sparse.prefill_csa.fp8_paged.q4096.32k", T, mode="prefill", kind_="csa", fmt="fp8_paged",
              N=4096, ctx=32768),
      _sparse("time.sparse.decode_hca.bf16.b64.128k", T, mode="decode", kind_="hca", fmt="bf16", N=64,
              ctx=131072),
      _sparse("time.sparse.decode_hca.fp8_paged.b64.128k", T, mode="decode", kind_="hca", fmt="fp8_paged", N=64,
              ctx=131072),
      # the invariant step's HCA kernel (window, then every entry through the row's table): checked, then timed
      _sparse("time.hca.decode_invariant.bf16.b64.128k", T, mode="decode", kind_="hca", fmt="bf16", N=64,
              ctx=131072, lens=True, dry=dict(lens=True), op="hca_attention"),
      _sparse("time.hca.decode_invariant.fp8_paged.b64.128k", T, mode="decode", kind_="hca", fmt="fp8_paged",
              N=64, ctx=131072, lens=True, dry=dict(lens=True), op="hca_attention"),
      _indexer("time.topk.decode.fp8_keys.b64.128k", T, op="indexer_topk", mode="decode", keys="fp8", B=64, T=1,
               ctx=131072),
      _indexer("time.topk.decode.bf16_keys.b64.128k", T, op="indexer_topk", mode="decode", keys="bf16", B=64,
               T=1, ctx=131072),
      _indexer("time.scores.decode.bf16.b64.128k", T, op="indexer_scores", mode="decode", keys="bf16", B=64, T=1,
               ctx=131072),
      _indexer("time.topk.prefill.bf16.q4096.32k", T, op="indexer_topk", mode="prefill", keys="bf16", B=1,
               T=4096, ctx=32768),
  ]
  return cases


def shapes_of(case: Case, dry: bool) -> dict:
  p = dict(case.params)
  d = p.pop("dry")
  if dry:
    p.update(d)
  return p


def _layout(p) -> str:
  if "fmt" in p:
    return {"fp8_paged": f"fp8_paged(page {p['page_size']})", "fp8_record": "fp8_record(584 B rows)"}.get(
        p["fmt"], "plain")
  return "fp8_keys(e4m3 + f32 row scale)" if p["keys"] == "fp8" else "plain"


def _dtype(p) -> str:
  if "fmt" in p:
    return {"f32": "f32", "bf16": "bf16"}.get(p["fmt"], "bf16 q, fp8 e4m3 pools (UE8M0 scales, bf16 rope)")
  return "bf16 q, " + ("fp8 e4m3 keys" if p["keys"] == "fp8" else "bf16 keys")


def _shape_text(p) -> str:
  if "fmt" in p:
    s = f"{p['mode']} {p['layer']} N={p['N']} H={p['H']} D={p['D']} W={p['W']} K={p['K']} ctx={p['ctx']}"
    return s + (" +lens" if p.get("lens") else "")
  s = f"{p['mode']} B={p['B']} T={p['T']} H={p['HI']} C={p['C']} M={p['ctx'] // 4} ctx={p['ctx']}"
  s += f" k={p['k']}" if p.get("topk") else ""
  return s + (f" cand={p['cand']}x{p['block_size']}" if p.get("cand") else "")


def planned_row(case: Case, dry: bool) -> dict:
  p = shapes_of(case, dry)
  return dict(case=case.name, kind=case.kind, kernel=case.kernel, op=case.op, impl=case.impl, shapes=p,
              shape_text=_shape_text(p), dtype=_dtype(p), layout=_layout(p), dry_run=dry)


# ------------------------------------------------------------------------------------------------ parent


def _default_out() -> str:
  return os.environ.get("OUT") or "gpu_check_out"


def parse_args(argv):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=None, help="output dir (default: $OUT, else gpu_check_out)")
  ap.add_argument("--budget", type=float, default=400.0, help="seconds for the whole run (cases past it: skipped)")
  ap.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, interpret mode / XLA timing")
  ap.add_argument("--only", default="", help="comma-separated substrings: run only cases whose name has one")
  ap.add_argument("--case-timeout", type=float, default=0.0, help="override every case's timeout (seconds)")
  ap.add_argument("--inject", action="append", default=[], metavar="NAME=MODE",
                  help="make a case fail: raise | hang | crash | mismatch (plumbing tests)")
  ap.add_argument("--list", action="store_true", help="print the plan and exit")
  ap.add_argument("--no-env", action="store_true", help="skip the JAX environment probe (a child importing JAX)")
  ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="H200 HBM3e")
  ap.add_argument("--peak-tflops", type=float, default=989.0, help="H100 / H200 dense bf16")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--flush-mb", type=float, default=256.0)
  ap.add_argument("--jax-cache", default="/tmp/dsv4_gpu_check_jax_cache",
                  help="persistent compilation cache shared by the case processes ('' = off)")
  # child mode (one case, in its own process)
  ap.add_argument("--child", default="", help=argparse.SUPPRESS)
  ap.add_argument("--result", default="", help=argparse.SUPPRESS)
  ap.add_argument("--child-inject", default="", help=argparse.SUPPRESS)
  ap.add_argument("--env-only", action="store_true", help=argparse.SUPPRESS)
  return ap.parse_args(argv)


def last_line(text: str) -> str:
  lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
  return lines[-1][:400] if lines else ""


def _kill_group(proc):
  for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
      os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
      return
    try:
      proc.wait(timeout=5)
      return
    except subprocess.TimeoutExpired:
      continue


def _child_env(dry_run: bool) -> dict:
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  if dry_run and "xla_backend_optimization_level" not in env.get("XLA_FLAGS", ""):
    # CPU plumbing run: compile time is most of it. LLVM level 0 and (jaxlib 0.10.x only: XLA aborts on flags it
    # does not know) the older CPU emitter, as the test suite does (tests/xla_test_flags.py); same semantics.
    flags = [env.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]
    try:
      import importlib.metadata
      if importlib.metadata.version("jaxlib").startswith("0.10."):
        flags.append("--xla_cpu_use_fusion_emitters=false")
    except Exception:  # noqa: BLE001 - no metadata: level 0 only
      pass
    env["XLA_FLAGS"] = " ".join(flags).strip()
  return env


def _run_child(cmd, log_path, timeout, env=None):
  """Run cmd in its own process group, output to log_path; (returncode | None on timeout, seconds)."""
  t0 = time.monotonic()
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env or dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
      rc = proc.wait(timeout=max(timeout, 0.1))
    except subprocess.TimeoutExpired:
      _kill_group(proc)
      rc = None
  return rc, time.monotonic() - t0


def _read(path) -> str:
  try:
    with open(path) as f:
      return f.read()
  except OSError:
    return ""


def write_atomic(path, text):
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def _fmt(x, spec):
  return "" if x is None or (isinstance(x, float) and x != x) else format(x, spec)


def render_markdown(rows: list[dict], env: dict, meta: dict) -> str:
  counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
  dev = ", ".join(env.get("devices") or []) or env.get("error", "?")
  lines = [f"# GPU check ({'dry run, CPU: numbers meaningless' if meta.get('dry_run') else 'device'})", "",
           f"jax {env.get('jax', '?')} / jaxlib {env.get('jaxlib', '?')} on {dev} "
           f"({env.get('nvidia_smi') or 'no nvidia-smi'}); {meta['done']} of {meta['planned']} cases, "
           f"{meta['elapsed']:.0f} s of a {meta['budget']:.0f} s budget; "
           + ", ".join(f"{k} {v}" for k, v in counts.items() if v), ""]
  corr = [r for r in rows if r["kind"] == "correctness"]
  timed = [r for r in rows if r["kind"] == "timing"]
  if corr:
    lines += ["## Correctness (kernel vs plain-JAX reference)", "",
              "| case | kernel | shapes | dtype | layout | status | err/tol | s | error |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in corr:
      lines.append(f"| {r['case']} | {r['kernel']} | {r['shape_text']} | {r['dtype']} | {r['layout']} | "
                   f"{r['status']} | {_fmt(r.get('err_over_tol'), '.3g')} | {_fmt(r.get('seconds'), '.0f')} | "
                   f"{r.get('error', '')} |")
    lines.append("")
  if timed:
    lines += ["## Timing (L2 flushed; roofline: H200 %s GB/s, %s TFLOP/s)" % (meta["hbm_gbps"], meta["peak_tflops"]),
              "", "| case | kernel | shapes | dtype | layout | status | err/tol | ms | hot ms | XLA ms | TFLOP/s | "
              "GB/s | % HBM | % TC | roofline % (bound) | predicted % | splits | error |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in timed:
      bound = f" ({r['bound']})" if r.get("bound") else ""
      lines.append(
          f"| {r['case']} | {r['kernel']} | {r['shape_text']} | {r['dtype']} | {r['layout']} | {r['status']} | "
          f"{_fmt(r.get('err_over_tol'), '.3g')} | {_fmt(r.get('kernel_ms'), '.4f')} | "
          f"{_fmt(r.get('hot_ms'), '.4f')} | {_fmt(r.get('xla_ms'), '.4f')} | "
          f"{_fmt(r.get('tflops'), '.3g')} | {_fmt(r.get('gbps'), '.3g')} | {_fmt(r.get('pct_hbm'), '.3g')} | "
          f"{_fmt(r.get('pct_tc'), '.3g')} | {_fmt(r.get('roofline_pct'), '.3g')}{bound} | "
          f"{_fmt(r.get('predicted_pct'), '.3g')} | {r.get('num_splits') or ''} | {r.get('error', '')} |")
    lines.append("")
  return "\n".join(lines)


def _env(args, out) -> dict:
  env = dict(python=sys.version.split()[0], executable=sys.executable, host=os.uname().nodename,
             started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
  try:
    env["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=20).stdout.strip() or None
  except Exception:  # noqa: BLE001 - no GPU tools: recorded as None
    env["nvidia_smi"] = None
  path = os.path.join(out, "logs", "env.json.part")
  cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--child", "env", "--env-only", "--result", path]
  rc, _ = _run_child(cmd, os.path.join(out, "logs", "env.log"), 90)
  try:
    env.update(json.loads(_read(path)))
  except ValueError:
    env["error"] = f"jax environment probe failed (rc {rc}): {last_line(_read(os.path.join(out, 'logs', 'env.log')))}"
  return env


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.child:  # one case in this process (benchmarks/gpu_check_cases.py imports JAX; the parent never does)
    from benchmarks import gpu_check_cases
    return gpu_check_cases.child_main(args)
  cases = plan()
  if args.only:
    keys = [k for k in args.only.split(",") if k]
    cases = [c for c in cases if any(k in c.name for k in keys)]
  if args.list:
    for i, c in enumerate(cases):
      r = planned_row(c, args.dry_run)
      print(f"{i + 1:2d}. {c.name:52s} {c.kernel:32s} {r['shape_text']} | {r['dtype']} | {r['layout']} "
            f"| timeout {c.timeout:.0f} s")
    return 0
  inject = {}
  for item in args.inject:
    name, _, mode = item.partition("=")
    if mode not in ("raise", "hang", "crash", "mismatch"):
      print(f"--inject {item}: mode must be raise, hang, crash or mismatch", file=sys.stderr)
      return 2
    inject[name] = mode
  out = os.path.abspath(args.out or _default_out())
  os.makedirs(os.path.join(out, "logs"), exist_ok=True)
  results = os.path.join(out, "results.jsonl")
  md_path = os.path.join(out, "gpu_check.md")
  open(results, "w").close()
  t_start = time.monotonic()
  meta = dict(planned=len(cases), done=0, elapsed=0.0, budget=args.budget, dry_run=args.dry_run,
              hbm_gbps=args.hbm_gbps, peak_tflops=args.peak_tflops)
  env = _env(args, out) if args.budget > 0 and not args.no_env else {"error": "environment not probed"}
  env["dry_run"] = args.dry_run
  write_atomic(os.path.join(out, "env.json"), json.dumps(env, indent=1) + "\n")
  print(f"# gpu_check: {len(cases)} cases, budget {args.budget:.0f} s, out {out}", flush=True)
  print(f"# env {json.dumps(env)}", flush=True)
  rows: list[dict] = []
  for i, case in enumerate(cases):
    row = planned_row(case, args.dry_run)
    left = args.budget - (time.monotonic() - t_start)
    timeout = min(args.case_timeout or case.timeout, left)
    if left < MIN_CASE_S:
      row.update(status="skipped", error=f"global budget of {args.budget:.0f} s used up ({max(left, 0):.0f} s left)")
    else:
      part = os.path.join(out, "logs", case.name + ".json.part")
      if os.path.exists(part):
        os.remove(part)
      log = os.path.join(out, "logs", case.name + ".log")
      cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--child", case.name, "--result", part,
             "--hbm-gbps", str(args.hbm_gbps), "--peak-tflops", str(args.peak_tflops), "--iters", str(args.iters),
             "--repeats", str(args.repeats), "--flush-mb", str(args.flush_mb), "--jax-cache", args.jax_cache]
      cmd += ["--dry-run"] if args.dry_run else []
      cmd += ["--child-inject", inject[case.name]] if case.name in inject else []
      rc, secs = _run_child(cmd, log, timeout, _child_env(args.dry_run))
      got = None
      try:
        got = json.loads(_read(part))
      except ValueError:
        pass
      if rc is None:
        row.update(status="timeout", error=f"killed after {timeout:.0f} s (per-case limit "
                   f"{args.case_timeout or case.timeout:.0f} s, budget left {left:.0f} s); last output: "
                   f"{last_line(_read(log))}")
        if got:  # a timing case writes its checked row before timing
          row.update({k: v for k, v in got.items() if k not in ("status", "error")})
          row["error"] += f" (answer checked first: err/tol {_fmt(got.get('err_over_tol'), '.3g')})"
      elif got is None:
        row.update(status="error", error=f"exit {rc} without a result: {last_line(_read(log))}")
      else:
        row.update(got)
        if rc != 0 and row["status"] == "ok":  # crashed after writing its checked row (during timing)
          row.update(status="error", error=f"exit {rc} after the check passed: {last_line(_read(log))}")
      row["seconds"] = round(secs, 1)
      row["log"] = os.path.relpath(log, out)
    rows.append(row)
    with open(results, "a") as f:
      f.write(json.dumps(row) + "\n")
    meta.update(done=i + 1, elapsed=time.monotonic() - t_start)
    write_atomic(md_path, render_markdown(rows, env, meta))
    extra = ""
    if row.get("kernel_ms") is not None:
      extra = f"  {row['kernel_ms']:.4f} ms  roofline {_fmt(row.get('roofline_pct'), '.3g')}%"
    print(f"[{i + 1:2d}/{len(cases)} {meta['elapsed']:5.0f}s] {case.name:52s} {row['status']:8s} "
          f"err/tol {_fmt(row.get('err_over_tol'), '.3g'):>6s}{extra}  {row.get('error', '')[:160]}", flush=True)
  print()
  print(_read(md_path))
  return 0 if all(r["status"] == "ok" for r in rows if r["status"] != "skipped") else 1


if __name__ == "__main__":
  sys.exit(main())
