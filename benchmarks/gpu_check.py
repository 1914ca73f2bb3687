"""The GPU check: kernel correctness at V4-Flash shapes, then the decode / prefill timing tables, one process per case.

  benchmarks/gpu_check.sh [--out DIR] [--budget 400] [--mosaic] [--only SUBSTR,...] [--case-timeout S]
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
time, i.e. how close the case is to its own bound. A timing row checks its answer first and is not timed if wrong.

Order: every correctness case (Triton kernels), then the timing cases, then with --mosaic the Mosaic GPU kernel
(a small correctness case with a short timeout first: a deadlock costs that timeout only). Each case runs in its own
process (`python -m benchmarks.gpu_check --child NAME`) under min(its timeout, budget left); a failure, crash or
hang is recorded and the next case runs. This file imports no JAX in the parent, so the parent cannot be the thing
that fails. Exit status: 0 when every case that ran is ok, 1 otherwise.

--dry-run: the same plan and plumbing on a CPU with tiny shapes: correctness cases run the kernels in Pallas
interpret mode, timing cases time the XLA reference in their place (labelled so), Mosaic cases only lower for CUDA.
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
  op: str  # "sparse_attention" | "indexer_scores" | "indexer_topk"
  impl: str  # "triton" | "mosaic"
  params: dict
  timeout: float

  @property
  def kernel(self) -> str:
    return f"{self.op} ({'Mosaic GPU' if self.impl == 'mosaic' else 'Pallas-Triton'})"


# V4-Flash: 64 heads x d 512 (64 RoPE), window 128, top-512; indexer 64 heads x 128.
_SPARSE = dict(H=64, D=512, W=128, K=512, page_size=64, lens=False)
_SPARSE_DRY = dict(H=16, D=128, W=16, K=32, page_size=4)
_INDEXER = dict(HI=64, C=128, k=512, cand=0, block_size=8)
_INDEXER_DRY = dict(HI=16, C=32, k=16)
_MOSAIC_DRY = dict(H=64, D=512, W=128, K=512, ctx=4096)  # the kernel's only shape; lowered, not run


def _sparse(name, kind, *, mode, kind_, fmt, N, ctx, impl="triton", timeout=None, dry=None, **kw):
  p = dict(_SPARSE, mode=mode, layer=kind_, fmt=fmt, N=N, ctx=ctx, **kw)
  if kind_ == "hca":
    p["K"] = ctx // 128
  d = dict(_SPARSE_DRY, N=2 if mode == "decode" else 16, ctx=512 if kind_ == "csa" else 2048)
  if kind_ == "hca":
    d["K"] = d["ctx"] // 128
  d.update(dry or {})
  p["dry"] = d
  t = timeout or (90.0 if kind == "correctness" else 120.0)
  return Case(name, kind, "sparse_attention", impl, p, t)


def _indexer(name, kind, *, op, mode, keys, B, T, ctx, timeout=None, **kw):
  p = dict(_INDEXER, mode=mode, keys=keys, B=B, T=T, ctx=ctx, topk=op == "indexer_topk", **kw)
  d = dict(_INDEXER_DRY, B=2, T=1 if mode == "decode" else 16, ctx=512)
  if p.get("cand"):
    d["cand"] = 4
  p["dry"] = d
  t = timeout or (90.0 if kind == "correctness" else 120.0)
  return Case(name, kind, op, "triton", p, t)


def plan(mosaic: bool = False) -> list[Case]:
  """Every case, in priority order (correctness of each kernel, then timing; Mosaic last, only if asked)."""
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
      _indexer("time.topk.decode.fp8_keys.b64.128k", T, op="indexer_topk", mode="decode", keys="fp8", B=64, T=1,
               ctx=131072),
      _indexer("time.topk.decode.bf16_keys.b64.128k", T, op="indexer_topk", mode="decode", keys="bf16", B=64,
               T=1, ctx=131072),
      _indexer("time.scores.decode.bf16.b64.128k", T, op="indexer_scores", mode="decode", keys="bf16", B=64, T=1,
               ctx=131072),
      _indexer("time.topk.prefill.bf16.q4096.32k", T, op="indexer_topk", mode="prefill", keys="bf16", B=1,
               T=4096, ctx=32768),
  ]
  if mosaic:
    cases += [
        _sparse("correct.mosaic.decode_csa.bf16.b2", C, mode="decode", kind_="csa", fmt="bf16", N=2, ctx=8192,
                impl="mosaic", timeout=60.0, dry=_MOSAIC_DRY),
        _sparse("time.mosaic.decode_csa.bf16.b64", T, mode="decode", kind_="csa", fmt="bf16", N=64, ctx=8192,
                impl="mosaic", dry=_MOSAIC_DRY),
        _sparse("time.mosaic.prefill_csa.bf16.q4096.32k", T, mode="prefill", kind_="csa", fmt="bf16", N=4096,
                ctx=32768, impl="mosaic", dry=_MOSAIC_DRY),
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
  return s + (f" k={p['k']}" if p.get("topk") else "") + (f" cand={p['cand']}x{p['block_size']}" if p.get("cand") else "")


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
  ap.add_argument("--mosaic", action="store_true", help="also run the Mosaic GPU kernel (after the Triton cases)")
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


def _last_line(text: str) -> str:
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


def _write_atomic(path, text):
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
              "", "| case | kernel | shapes | dtype | layout | status | err/tol | ms | hot ms | TFLOP/s | GB/s | "
              "% HBM | % TC | roofline % (bound) | splits | error |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in timed:
      bound = f" ({r['bound']})" if r.get("bound") else ""
      lines.append(
          f"| {r['case']} | {r['kernel']} | {r['shape_text']} | {r['dtype']} | {r['layout']} | {r['status']} | "
          f"{_fmt(r.get('err_over_tol'), '.3g')} | {_fmt(r.get('kernel_ms'), '.4f')} | {_fmt(r.get('hot_ms'), '.4f')} | "
          f"{_fmt(r.get('tflops'), '.1f')} | {_fmt(r.get('gbps'), '.0f')} | {_fmt(r.get('pct_hbm'), '.1f')} | "
          f"{_fmt(r.get('pct_tc'), '.1f')} | {_fmt(r.get('roofline_pct'), '.1f')}{bound} | "
          f"{r.get('num_splits') or ''} | {r.get('error', '')} |")
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
    env["error"] = f"jax environment probe failed (rc {rc}): {_last_line(_read(os.path.join(out, 'logs', 'env.log')))}"
  return env


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.child:
    return child_main(args)
  cases = plan(args.mosaic)
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
  _write_atomic(os.path.join(out, "env.json"), json.dumps(env, indent=1) + "\n")
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
      cmd += ["--mosaic"] if case.impl == "mosaic" else []
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
                   f"{_last_line(_read(log))}")
        if got:  # a timing case writes its checked row before timing
          row.update({k: v for k, v in got.items() if k not in ("status", "error")})
          row["error"] += f" (answer checked first: err/tol {_fmt(got.get('err_over_tol'), '.3g')})"
      elif got is None:
        row.update(status="error", error=f"exit {rc} without a result: {_last_line(_read(log))}")
      else:
        row.update(got)
        if rc != 0 and row["status"] == "ok":  # crashed after writing its checked row (during timing)
          row.update(status="error", error=f"exit {rc} after the check passed: {_last_line(_read(log))}")
      row["seconds"] = round(secs, 1)
      row["log"] = os.path.relpath(log, out)
    rows.append(row)
    with open(results, "a") as f:
      f.write(json.dumps(row) + "\n")
    meta.update(done=i + 1, elapsed=time.monotonic() - t_start)
    _write_atomic(md_path, render_markdown(rows, env, meta))
    extra = ""
    if row.get("kernel_ms") is not None:
      extra = f"  {row['kernel_ms']:.4f} ms  roofline {_fmt(row.get('roofline_pct'), '.1f')}%"
    print(f"[{i + 1:2d}/{len(cases)} {meta['elapsed']:5.0f}s] {case.name:52s} {row['status']:8s} "
          f"err/tol {_fmt(row.get('err_over_tol'), '.3g'):>6s}{extra}  {row.get('error', '')[:160]}", flush=True)
  print()
  print(_read(md_path))
  return 0 if all(r["status"] == "ok" for r in rows if r["status"] != "skipped") else 1


# ------------------------------------------------------------------------------------------------ child


def child_main(args) -> int:
  """Run one case; write its result row (JSON) to --result. Never raises: failures become rows."""
  if args.child_inject == "raise":  # before any import: the parent must report it from the log alone
    raise RuntimeError("injected failure (--inject raise)")
  if args.child_inject == "hang":
    print("injected hang (--inject hang)", flush=True)
    while True:
      time.sleep(3600)
  if args.child_inject == "crash":
    print("injected crash (--inject crash)", flush=True)
    os.abort()
  if args.env_only:
    _child_write(args.result, _jax_env())
    return 0
  cases = {c.name: c for c in plan(mosaic=True)}
  case = cases[args.child]
  try:
    row = run_case(case, args)
  except Exception as e:  # noqa: BLE001 - a lowering / compile / launch failure is a row, not a crash
    import traceback
    traceback.print_exc()
    row = dict(status="error", error=_last_line(f"{type(e).__name__}: {e}"))
  _child_write(args.result, row)
  return 0


def _child_write(path, row):
  _write_atomic(path, json.dumps(row, default=_json_default))


def _json_default(x):
  try:
    return float(x)
  except (TypeError, ValueError):
    return str(x)


def _jax_env() -> dict:
  import jax
  env = dict(jax=jax.__version__, backend=jax.default_backend(), devices=[d.device_kind for d in jax.devices()])
  try:
    import jaxlib
    env["jaxlib"] = jaxlib.__version__
  except Exception:  # noqa: BLE001
    pass
  return env


def _arrays(names, args):
  import jax
  out = {}
  for name, a in zip(names, args):
    if a is None:
      continue
    leaves = jax.tree_util.tree_leaves_with_path(a)
    for path, leaf in leaves:
      key = name + jax.tree_util.keystr(path)
      out[key] = [list(leaf.shape), str(leaf.dtype)]
  return out


def run_case(case: Case, args) -> dict:
  import jax
  if args.jax_cache and not args.dry_run:
    try:
      jax.config.update("jax_compilation_cache_dir", args.jax_cache)
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    except Exception:  # noqa: BLE001 - an optional speed-up
      pass
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not args.dry_run:
    raise RuntimeError(f"no GPU (backend {jax.default_backend()}): use --dry-run on a CPU")
  p = shapes_of(case, args.dry_run)
  # A timing case writes its checked row before timing: a timeout then still records the check.
  partial = lambda row: _child_write(args.result, dict(row, error="timing not finished"))
  ctx = dict(args=args, p=p, case=case, dry=args.dry_run, inject=args.child_inject, partial=partial)
  if case.op == "sparse_attention":
    return _run_sparse(**ctx)
  return _run_indexer(**ctx)


def _timing(args, dry):
  if dry:
    return dict(iters=1, repeats=1, flush_elems=1024)
  return dict(iters=args.iters, repeats=args.repeats, flush_elems=int(args.flush_mb * 2 ** 20 / 4))


def _roofline(row, flops, nbytes, ms, args):
  row.update(flops=flops, bytes=nbytes, kernel_ms=ms)
  s = ms * 1e-3 if ms is not None else float("nan")
  if not s > 0:
    return row
  t_hbm = nbytes / (args.hbm_gbps * 1e9)
  t_tc = flops / (args.peak_tflops * 1e12)
  row.update(tflops=flops / s / 1e12, gbps=nbytes / s / 1e9, pct_hbm=100 * t_hbm / s, pct_tc=100 * t_tc / s,
             roofline_pct=100 * max(t_hbm, t_tc) / s, bound="HBM" if t_hbm >= t_tc else "TC")
  return row


def _judged(row, err, case, partial, what) -> bool:
  """Record the correctness verdict; True when the case goes on to its timing (a timing case that matched; the
  row so far is written first, so a timeout in the timing keeps it)."""
  row["err_over_tol"] = err
  if not err <= 1.0:
    row.update(status="mismatch", error=f"{what} = {err:.3g} (> 1)")
    return False
  row["status"] = "ok"
  if case.kind != "timing":
    return False
  partial(row)
  return True


def _sparse_inputs(p, key):
  import jax
  import jax.numpy as jnp
  from benchmarks import kernels_bench as kb
  from pallas_kernels import sparse_attention as sa
  N, H, D, W, K, ctx = p["N"], p["H"], p["D"], p["W"], p["K"], p["ctx"]
  hca, prefill = p["layer"] == "hca", p["mode"] == "prefill"
  E = ctx // (128 if hca else 4)  # compressed entries per sequence
  seqs = 1 if prefill else N
  k1, k2, k3, k4, k5, k6 = jax.random.split(key, 6)
  q = (jax.random.normal(k1, (N, H, D), jnp.float32) * 0.05)
  win_pool, win_idx, comp_pool, comp_idx = kb.synthetic_rows(k2, k3, k4, N=N, D=D, W=W, K=K, E=E, seqs=seqs,
                                                             hca=hca, prefill=prefill, ctx=ctx, dtype=jnp.float32,
                                                             ratio=128 if hca else 4)
  sink = jax.random.normal(k5, (H,), jnp.float32)
  fmt = p["fmt"]
  dt = jnp.float32 if fmt == "f32" else jnp.bfloat16
  q = q.astype(dt)
  win_pool, comp_pool = win_pool.astype(dt), comp_pool.astype(dt)
  if fmt in ("fp8_paged", "fp8_record"):
    win_pool, comp_pool = sa.quantize_kv_fp8(win_pool), sa.quantize_kv_fp8(comp_pool)
    if fmt == "fp8_paged":
      win_pool = sa.record_to_paged(win_pool, p["page_size"])
      comp_pool = sa.record_to_paged(comp_pool, p["page_size"])
  wl = cl = None
  if p.get("lens"):  # the model passes per-query live lengths: ragged, some rows empty
    kw, kc = jax.random.split(k6)
    wl = jax.random.randint(kw, (N,), 0, W + 1).astype(jnp.int32)
    cl = jax.random.randint(kc, (N,), 0, K + 1).astype(jnp.int32)
  return (q, win_pool, win_idx.astype(jnp.int32), comp_pool, comp_idx.astype(jnp.int32), sink, wl, cl)


def _run_sparse(args, p, case, dry, inject, partial):
  import jax
  from benchmarks import kernels_bench as kb
  from pallas_kernels import sparse_attention as sa
  row = {}
  inputs = jax.jit(lambda key: _sparse_inputs(p, key))(jax.random.PRNGKey(0))  # one compile, not one per op
  names = ("q", "window_pool", "window_idx", "comp_pool", "comp_idx", "sink", "window_len", "comp_len")
  row["arrays"] = _arrays(names, inputs)
  D = p["D"]
  scale = D ** -0.5
  q, wp, wi, cp, ci, sink, wl, cl = inputs
  ref = jax.jit(lambda *a: sa.sparse_attention_reference(*a[:6], scale=scale, window_len_N=a[6], comp_len_N=a[7]))
  if case.impl == "mosaic":
    from pallas_kernels import sparse_attention_mgpu as mg
    row["tuning"] = dict(block_k=mg.BLOCK_K, warpgroups=3)
    if dry:  # no Mosaic GPU on a CPU: lower it for CUDA at these shapes instead
      from pallas_kernels import lowering
      S = lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype)
      lowering.export_for_cuda(mg.sparse_attention_mgpu, *[S(x) for x in inputs], scale=scale)
      row.update(status="ok", err_over_tol=None, note="dry run: lowered for CUDA only")
      return row
    kern = jax.jit(lambda *a: mg.sparse_attention_mgpu(*a, scale=scale))
    row["num_splits"] = 1
  elif dry and case.kind == "timing":
    kern = ref  # the plumbing only: interpret-mode kernels in timing loops take minutes on a CPU
    row["kernel"] = case.kernel + " [dry run: XLA reference timed in its place]"
  else:
    tuning = sa.SparseAttentionTuning(block_h=16, block_k=16) if dry else sa.SparseAttentionTuning()
    row["tuning"] = dataclasses.asdict(tuning)
    row["num_splits"] = sa.chosen_num_splits(q.shape[0], q.shape[1], [wi.shape[1], ci.shape[1]], tuning)
    kern = jax.jit(lambda *a: sa.sparse_attention_pallas(*a, scale=scale, interpret=dry, tuning=tuning))
  got = kern(*inputs)
  want = ref(*inputs)
  if inject == "mismatch":
    got = (got[0] * 1.5, got[1])
  tol = (1e-4, 1e-4) if p["fmt"] == "f32" else (1.5e-2, 2e-2)
  err = max(kb.tol_ratio(got[0], want[0], *tol), kb.tol_ratio(got[1], want[1], 1e-3, 1e-3))
  del got, want
  if not _judged(row, err, case, partial, "max |kernel - reference| / tol"):
    return row
  H = p["H"]
  wi_l, ci_l = sa.apply_len(wi, wl), sa.apply_len(ci, cl)
  uw, aw = kb.unique_valid(wi_l, sa.pool_rows(wp))
  uc, ac = kb.unique_valid(ci_l, sa.pool_rows(cp))
  flops = 2.0 * H * (aw + ac) * (D + D)
  nbytes = (q.size * q.dtype.itemsize * 2 + uw * sa.pool_row_bytes(wp) + uc * sa.pool_row_bytes(cp))
  ms, hot, flush = kb.device_time_ms(kern, inputs, 5, **_timing(args, dry))
  row.update(hot_ms=hot, flush_ms=flush)
  return _roofline(row, flops, nbytes, ms, args)


def _run_indexer(args, p, case, dry, inject, partial):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from benchmarks import kernels_bench as kb
  from pallas_kernels import dispatch
  from pallas_kernels import indexer as ix
  from pallas_kernels import indexer_topk as itk
  row = {}
  B, T, H, C, ctx = p["B"], p["T"], p["HI"], p["C"], p["ctx"]
  M = ctx // 4
  q, w, pool, rows, nv = jax.jit(lambda key: kb.indexer_case(key, B=B, T=T, H=H, C=C, M=M, prefill=p["mode"] == "prefill",
                                                               ctx=ctx, fp8=p["keys"] == "fp8"))(jax.random.PRNGKey(0))
  nk = jnp.full((B,), M, jnp.int32)
  cand = None
  if p.get("cand"):
    nb = -(-M // p["block_size"])
    cand = jax.random.randint(jax.random.PRNGKey(1), (B, T, p["cand"]), -1, nb).astype(jnp.int32)
  inputs = (q, w, pool, rows, nv, None, nk, cand)
  row["arrays"] = _arrays(("q", "w", "key_pool", "key_rows", "num_visible", "allowed", "num_keys", "candidates"),
                          inputs)
  k = p["k"]
  check_scores = jax.jit(lambda *a: dispatch._topk_check_scores(a, dict(k=k, block_size=p["block_size"])))
  if case.op == "indexer_topk":
    tuning = itk.IndexerTopkTuning(block_m=32, select_chunk=64) if dry else itk.IndexerTopkTuning()
    ref = jax.jit(lambda *a: itk.indexer_topk_reference(*a[:5], k, a[5], a[6], a[7], p["block_size"]))
    kern = jax.jit(lambda *a: itk.indexer_topk_pallas(*a[:6], num_keys_B=a[6], candidate_blocks_BxTxC=a[7], k=k,
                                                      block_size=p["block_size"], interpret=dry, tuning=tuning))
  else:
    tuning = ix.IndexerTuning(block_m=32) if dry else ix.IndexerTuning()
    ref = jax.jit(lambda *a: ix.indexer_scores_reference(*a[:7]))
    kern = jax.jit(lambda *a: ix.indexer_scores_pallas(*a[:6], num_keys_B=a[6], interpret=dry, tuning=tuning))
  row["tuning"] = dataclasses.asdict(tuning)
  if dry and case.kind == "timing":
    kern = ref
    row["kernel"] = case.kernel + " [dry run: XLA reference timed in its place]"
  got = np.asarray(kern(*inputs))
  scores = np.asarray(check_scores(*inputs))
  if inject == "mismatch":
    got = np.where(got >= 0, (got + 1) % M, got) if case.op == "indexer_topk" else got * 1.5
  if case.op == "indexer_topk":
    err = float(dispatch._topk_err(got, scores, None, dict(k=k)))
  else:
    err = float(dispatch._scores_err(got, scores, None, {}))
  del got, scores
  if not _judged(row, err, case, partial, "max error / tol"):
    return row
  pairs = float(np.minimum(np.asarray(nv), M).sum())
  flops = 2.0 * H * C * pairs
  uk, _ = kb.unique_valid(rows, pool.shape[0])
  row_bytes = pool.bytes_per_row if isinstance(pool, itk.Fp8IndexKeys) else C * 2
  out_bytes = B * T * min(k, M) * 4 if case.op == "indexer_topk" else B * T * M * 4
  nbytes = q.size * 2 + w.size * 4 + uk * row_bytes + out_bytes
  ms, hot, flush = kb.device_time_ms(kern, inputs, 1, **_timing(args, dry))
  row.update(hot_ms=hot, flush_ms=flush)
  return _roofline(row, flops, nbytes, ms, args)


if __name__ == "__main__":
  sys.exit(main())
