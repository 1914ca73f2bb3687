"""benchmarks/gpu_check.sh: the plan's order, the report, and the plumbing that must not waste a GPU run: one process
per case with its own timeout, rows written after every case, a failing, crashing or hanging case recorded and the
next one run, a global budget. The dry run (CPU, tiny shapes, interpret mode / XLA timing) runs the whole plan."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import gpu_check as gc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")


def _run(out, *flags, timeout=600):
  proc = subprocess.run(["bash", SCRIPT, "--out", str(out), *flags], capture_output=True, text=True,
                        timeout=timeout, cwd=ROOT)
  rows = [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]
  return proc, rows


def test_plan_priority_order():
  cases = gc.plan()
  names = [c.name for c in cases]
  assert len(set(names)) == len(names)
  kinds = [c.kind for c in cases]
  assert kinds == sorted(kinds)  # every correctness case before the first timing case
  assert all(c.impl == "triton" for c in cases)
  # each kernel, each layout the model or the bench uses, is checked before anything is timed
  corr = [gc.planned_row(c, False) for c in cases if c.kind == "correctness"]
  assert {r["op"] for r in corr} == {"sparse_attention", "indexer_scores", "indexer_topk"}
  assert {r["layout"].split("(")[0] for r in corr} == {"plain", "fp8_paged", "fp8_record", "fp8_keys"}
  assert all(r["shapes"]["H"] == 64 and r["shapes"]["D"] == 512 for r in corr if r["op"] == "sparse_attention")
  timed = [gc.planned_row(c, False)["shapes"] for c in cases if c.kind == "timing"]
  assert {(s["N"], s["fmt"]) for s in timed if s.get("mode") == "decode" and s.get("layer") == "csa"} == {
      (64, "bf16"), (64, "fp8_paged"), (128, "bf16"), (128, "fp8_paged")}  # the decode table
  for dry in (False, True):
    for c in cases:
      r = gc.planned_row(c, dry)
      assert r["kernel"] and r["shape_text"] and r["dtype"] and r["layout"], r


def test_markdown_rows_and_roofline():
  base = gc.planned_row(gc.plan()[0], False)
  t = gc.planned_row([c for c in gc.plan() if c.kind == "timing"][0], False)
  rows = [dict(base, status="ok", err_over_tol=0.1, seconds=3.0),
          dict(base, case="x", status="timeout", error="killed after 90 s"),
          dict(t, status="ok", err_over_tol=0.0, kernel_ms=0.0125, hot_ms=0.01, tflops=6.7, gbps=4023.0,
               pct_hbm=83.8, pct_tc=0.7, roofline_pct=83.8, bound="HBM", predicted_pct=58.2, num_splits=2),
          dict(t, case="y", status="skipped", error="global budget of 400 s used up")]
  md = gc.render_markdown(rows, {"jax": "0.11.0", "devices": ["NVIDIA H200"]},
                          dict(planned=4, done=4, elapsed=10.0, budget=400.0, hbm_gbps=4800.0, peak_tflops=989.0))
  assert md.count("\n| correct.") + md.count("\n| x |") == 2 and md.count("\n| time.") + md.count("\n| y |") == 2
  assert "83.8 (HBM) | 58.2 |" in md and "killed after 90 s" in md and "ok 2, timeout 1, skipped 1" in md


def test_failing_crashing_and_hanging_cases_do_not_stop_the_run(tmp_path):
  """An injected exception, a crash (abort) and a hang (killed at its 2 s limit) each become a row; the run goes on
  and writes every row and the table."""
  cases = [c.name for c in gc.plan()[:3]]
  inject = [f"--inject={cases[0]}=raise", f"--inject={cases[1]}=hang", f"--inject={cases[2]}=crash"]
  proc, rows = _run(tmp_path, "--no-env", "--case-timeout", "2", "--only", ",".join(cases), *inject, timeout=120)
  assert proc.returncode == 1, proc.stdout + proc.stderr
  assert [r["case"] for r in rows] == cases
  assert [r["status"] for r in rows] == ["error", "timeout", "error"]
  assert "RuntimeError: injected failure" in rows[0]["error"]  # the error's last line, from the case's log
  assert "killed after 2 s" in rows[1]["error"] and rows[1]["seconds"] < 15
  assert "without a result" in rows[2]["error"]
  assert all(r["kernel"] and r["shape_text"] and r["dtype"] and r["layout"] for r in rows)
  md = (tmp_path / "gpu_check.md").read_text()
  assert all(f"| {c} |" in md for c in cases)


def test_budget_used_up_gives_skipped_rows(tmp_path):
  proc, rows = _run(tmp_path, "--budget", "0", timeout=60)
  assert proc.returncode == 0, proc.stdout + proc.stderr  # nothing ran, nothing failed
  assert [r["case"] for r in rows] == [c.name for c in gc.plan()]
  assert {r["status"] for r in rows} == {"skipped"}
  assert (tmp_path / "gpu_check.md").exists()


def test_list_prints_the_plan():
  out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--list"], capture_output=True,
                       text=True, cwd=ROOT, timeout=60).stdout
  assert len(out.splitlines()) == len(gc.plan())


@pytest.mark.slow
def test_dry_run_writes_one_row_per_planned_case(tmp_path):
  """The whole plan on the CPU: tiny shapes, the kernels in interpret mode, timed (one iteration) beside the XLA
  reference. One injected failure and one injected wrong answer are recorded and every later case still runs."""
  planned = [c.name for c in gc.plan()]
  wrong = [c for c in planned if c.startswith("correct.topk")][0]
  proc, rows = _run(tmp_path, "--dry-run", f"--inject={planned[0]}=raise", f"--inject={wrong}=mismatch")
  assert [r["case"] for r in rows] == planned, proc.stdout[-3000:] + proc.stderr[-3000:]
  status = {r["case"]: r["status"] for r in rows}
  assert status.pop(planned[0]) == "error" and status.pop(wrong) == "mismatch"
  assert set(status.values()) == {"ok"}, [(r["case"], r.get("error")) for r in rows if r["status"] != "ok"]
  assert proc.returncode == 1
  for r in rows[1:]:
    assert r["dry_run"] and r["arrays"] and r["seconds"] > 0
  timed = [r for r in rows if r["kind"] == "timing"]
  assert timed and all(r["hot_ms"] > 0 and r["bytes"] > 0 and r["flops"] > 0 for r in timed)
  assert all("[dry run: interpret mode on the CPU]" in r["kernel"] for r in timed)
  # the interpret-mode kernel is what is timed, the reference beside it: both real, non-zero numbers
  assert all(r["kernel_ms"] > 0 and r["xla_ms"] > 0 and r["roofline_pct"] > 0 for r in timed)
  assert all(r["predicted_pct"] > 0 for r in timed if r["case"].startswith("time.sparse.decode"))
  env = json.loads((tmp_path / "env.json").read_text())
  assert env["backend"] == "cpu" and env["dry_run"]
  md = (tmp_path / "gpu_check.md").read_text()
  assert all(f"| {c} |" in md for c in planned)
  assert all((tmp_path / r["log"]).exists() for r in rows)


@pytest.mark.slow
def test_kernels_bench_small_runs(tmp_path):
  """benchmarks/kernels_bench.py (all cases in one process; gpu_check uses its inputs, timing and checks) runs its
  CPU smoke configuration: every op covered, every case correct, the split count recorded."""
  path = tmp_path / "kb.jsonl"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.kernels_bench", "--small", "--jsonl", str(path)],
                        capture_output=True, text=True, timeout=1200, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = [json.loads(ln) for ln in path.read_text().splitlines()]
  assert {r["op"] for r in rows} == {"sparse_attention", "indexer_scores", "indexer_topk"}
  assert all(r["ok"] and r["hot_ms"] > 0 and r["bytes"] > 0 for r in rows)
  # The split rule gives small decode batches up to MAX_SPLITS splits (one block per split at least).
  from pallas_kernels import sparse_attention as sa
  splits = [r["num_splits"] for r in rows if r["op"] == "sparse_attention"]
  assert splits and all(1 <= s <= sa.MAX_SPLITS for s in splits), splits
