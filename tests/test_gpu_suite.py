"""benchmarks/gpu_suite.sh: what must hold before a GPU ever runs it. Fast: the flags parse into the suite's config,
the items come in their order of value, the budget skips what it cannot start (a fake clock), the watchdog ends an
overrun, the report rewrites its tables after every row, the modules the suite runs use no jax API that 0.11
removed. Slow: the whole suite as a CPU dry run (interpret-mode kernels, small shapes, the same items and files), and
kernels_bench's CPU smoke run."""

import ast
import json
import os
import subprocess
import sys

import pytest

from benchmarks.suite import budget as budget_mod
from benchmarks.suite import jax_compat, plan, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_suite.sh")


class FakeClock:
  def __init__(self):
    self.t = 100.0

  def __call__(self):
    return self.t


def test_items_in_order_of_value():
  names = [it.name for it in plan.items()]
  assert len(set(names)) == len(names)
  assert [n[0] for n in names] == sorted(n[0] for n in names)      # sections a..e in order
  assert names[:4] == ["a.versions", "a.copy", "a.matmul", "a.row_bits"] and names[4] == "b.topk"
  assert names.index("c.serve") < names.index("d.engine.bf16") < names.index("e.tuning")


def test_flags_parse_into_the_suite_config(tmp_path):
  from absl import flags

  from benchmarks import gpu_suite
  fv = flags.FlagValues()
  gpu_suite.define_flags(fv)
  fv([SCRIPT, f"--out_dir={tmp_path}", "--dry_run", "--budget_s=60", "--seed=7", "--only=a,b.kernels"])
  cfg = gpu_suite.suite_config(fv)
  assert cfg.dry_run and cfg.budget_s == 60 and cfg.seed == 7 and cfg.only == ("a", "b.kernels")
  assert cfg.out_dir == str(tmp_path) and cfg.cache_dir == os.path.join(str(tmp_path), "jax_cache")


def test_the_budget_skips_what_it_cannot_start_and_says_why(tmp_path):
  clock = FakeClock()
  cfg = plan.SuiteConfig(out_dir=str(tmp_path), cache_dir=str(tmp_path / "c"), budget_s=100.0)
  ctx = plan.Context(cfg, budget_mod.Budget(cfg.budget_s, clock))
  ran = []

  def item(name, need, cost):
    def run(c):
      ran.append(name)
      clock.t += cost
      yield {"status": "ok"}
    return plan.Item(name, need, run, name)

  items = [item("a.one", 10, 50), item("b.two", 40, 30), item("c.three", 30, 5), item("d.four", 10, 1)]
  rep = report.Report(str(tmp_path), {"mode": "test"})
  orig = plan.items
  plan.items = lambda: items
  try:
    plan.run(ctx, rep, log=lambda *a: None)
  finally:
    plan.items = orig
  # a.one leaves 50 s: b.two (needs 40) runs and leaves 20; c.three needs 30: skipped; d.four needs 10: runs
  assert ran == ["a.one", "b.two", "d.four"]
  rows = {r["item"]: r for r in rep.rows}
  assert rows["c.three"]["status"] == "skipped" and "20 s of 100 s left" in rows["c.three"]["error"]
  assert [json.loads(ln)["item"] for ln in open(rep.results)] == ["a.one", "b.two", "c.three", "d.four"]
  md = open(rep.md).read()
  assert "| c.three | skipped |" in md and "rows: ok 3, skipped 1" in md


def test_an_item_that_raises_is_its_row_and_the_next_runs(tmp_path):
  cfg = plan.SuiteConfig(out_dir=str(tmp_path), cache_dir=str(tmp_path / "c"))
  ctx = plan.Context(cfg, budget_mod.Budget(1000.0, FakeClock()))

  def boom(c):
    yield {"status": "ok", "part": 1}
    raise RuntimeError("lowering failed\nsecond line")

  def fine(c):
    yield {"status": "ok"}
  rep = report.Report(str(tmp_path), {"mode": "test"})
  orig = plan.items
  plan.items = lambda: [plan.Item("b.boom", 1, boom, ""), plan.Item("c.fine", 1, fine, "")]
  try:
    plan.run(ctx, rep, log=lambda *a: None)
  finally:
    plan.items = orig
  assert [(r["item"], r["status"]) for r in rep.rows] == [("b.boom", "ok"), ("b.boom", "error"), ("c.fine", "ok")]
  assert rep.rows[1]["error"] == "RuntimeError: second line"     # one line: the message's last


def test_the_watchdog_ends_an_overrun_after_its_last_words():
  clock = FakeClock()
  b = budget_mod.Budget(10.0, clock)
  said, exited = [], []
  dog = budget_mod.Watchdog(b, grace_s=5.0, on_expire=lambda: said.append(b.elapsed()), poll_s=0.01,
                            exit_fn=exited.append)
  dog.start()
  clock.t += 14.0                      # within budget + grace: nothing happens
  dog.thread.join(0.1)
  assert not said and not exited
  clock.t += 2.0
  dog.thread.join(2.0)
  assert said == [16.0] and exited == [3]


def _dotted(node) -> str:
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  return ".".join([node.id] + parts[::-1]) if isinstance(node, ast.Name) else ""


def test_suite_modules_use_no_jax_api_removed_in_0_11():
  """jax 0.11 removed `jax.core` helpers (concrete_or_error, is_concrete, ...) and made `jnp.empty` uninitialized; the
  GPU image has 0.11.2. Nothing the suite runs (its modules, the engine, the cache, the kernels, the main job) may
  use them or jax internals."""
  dirs = ["benchmarks/suite", "dsv4", "cache", "pallas_kernels"]
  files = [os.path.join(ROOT, "benchmarks", f) for f in ("gpu_suite.py", os.path.join("probes", "dot_row_bits.py"))]
  files += [os.path.join(ROOT, "experiments", f) for f in os.listdir(os.path.join(ROOT, "experiments"))
            if f.startswith("serve") and f.endswith(".py")]
  for d in dirs:
    for base, _, names in os.walk(os.path.join(ROOT, d)):
      files += [os.path.join(base, n) for n in names if n.endswith(".py")]
  bad = []
  for path in files:
    for node in ast.walk(ast.parse(open(path).read())):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
      elif isinstance(node, ast.Attribute):
        names = [_dotted(node)]
      if any(n and (n + ".").startswith(p) for n in names for p in jax_compat.REMOVED_MODULES) or \
         any(n in jax_compat.UNINITIALIZED for n in names):
        bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {names}")
  assert not bad, bad


def test_dry_run_xla_flags_follow_the_jaxlib_line(monkeypatch):
  monkeypatch.setattr(jax_compat, "version", lambda d: "0.11.2")
  assert jax_compat.cpu_dry_run_xla_flags("") == "--xla_backend_optimization_level=0"
  monkeypatch.setattr(jax_compat, "version", lambda d: "0.10.2")
  assert "fusion_emitters=false" in jax_compat.cpu_dry_run_xla_flags("--x=1")
  assert jax_compat.cpu_dry_run_xla_flags("--xla_backend_optimization_level=2") == (
      "--xla_backend_optimization_level=2")
  assert not jax_compat.set_config("jax_option_that_does_not_exist", 1)


def test_the_whole_suite_dry_runs_on_the_cpu(tmp_path):
  """Every item of the suite on the CPU (interpret-mode kernels, small shapes): the same code, the same files. Every
  row ok, nothing skipped, the tables written, the main job's 48 answers graded, the engine's runs compared."""
  out = tmp_path / "out"
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)             # the suite sets the dry run's own
  # the budget is the watchdog's: 900 s ran out on the AMD EPYC machine after 59 of 60 items (BUILD_NOTES, Test tiers)
  proc = subprocess.run(["bash", SCRIPT, str(out), "--dry_run", "--budget_s=1800"], capture_output=True, text=True,
                        timeout=2400, cwd=ROOT, env=env)
  rows = [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  bad = [(r["item"], r["status"], r.get("error")) for r in rows if r["status"] != "ok"]
  assert not bad, bad
  items = [r["item"] for r in rows]
  from benchmarks.suite import kernel_cases
  assert {f"b.{c.name}" for c in kernel_cases.plan()} <= set(items)
  assert {f"b.topk.{v}" for v in kernel_cases.topk_variants(True)} <= set(items)
  by = {r["item"]: r for r in rows}
  assert by["a.versions"]["backend"] == "cpu" and by["a.copy"]["copy_gbps"] > 0
  assert by["c.serve"]["answered"] == 48 and by["c.serve"]["answers_differ"] == 0
  assert by["d.engine.bf16"]["generated_tokens"] > 0 and by["d.engine.bf16"]["decode_step_ms"] > 0
  assert by["d.engine.bf16"]["bookkeeping_ms"] > 0 and by["d.engine.bf16"]["hit_tokens"] > 0
  assert by["d.engine.bf16"]["preemptions"] >= 1                  # prefix hits and preemption in the mix
  assert by["d.engine.cmdbuf"]["tokens_as_bf16_row"] and not by["d.engine.cmdbuf"]["applies"]   # CPU: ignored
  assert by["d.engine.alone"]["tokens_equal"] and by["d.engine.alone"]["logits_bitwise"]
  assert "max_dlogit" in by["d.engine.xla_vs_kernels"]
  assert by["d.engine.fp8"]["kv"] == "fp8"
  assert all(r["err_over_tol"] <= 1 for r in rows if "err_over_tol" in r)
  md = (out / "suite.md").read_text()
  assert all(f"| {i} |" in md for i in items)
  assert (out / "serve" / "outputs.jsonl").exists() and os.listdir(out / "jax_cache")


@pytest.mark.slow
def test_kernels_bench_small_runs(tmp_path):
  """benchmarks/kernels_bench.py (all cases in one process; the suite uses its inputs and counting) runs its CPU
  smoke configuration: every op covered, every case correct, the split count recorded."""
  path = tmp_path / "kb.jsonl"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.kernels_bench", "--small", "--jsonl", str(path)],
                        capture_output=True, text=True, timeout=1200, cwd=ROOT)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = [json.loads(ln) for ln in path.read_text().splitlines()]
  assert {r["op"] for r in rows} == {"sparse_attention", "indexer_scores", "indexer_topk"}
  assert all(r["ok"] and r["hot_ms"] > 0 and r["bytes"] > 0 for r in rows)
  from pallas_kernels import sparse_attention as sa
  splits = [r["num_splits"] for r in rows if r["op"] == "sparse_attention"]
  assert splits and all(1 <= s <= sa.MAX_SPLITS for s in splits), splits


@pytest.mark.slow
def test_every_kernel_program_of_the_suite_lowers_for_a_gpu_at_its_real_shapes():
  """The programs sections (b) and (e) compile on the GPU (the top-k diagnosis's variants, every kernel case, the
  tuning rows), at V4-Flash shapes with their real tunings, lower to Triton for an H200 here (abstract device,
  pallas_kernels/lowering.py): the GPU sees no kernel call untried."""
  import jax

  from benchmarks.suite import kernel_cases as kc
  from pallas_kernels import lowering
  failed = []
  todo = []
  for case in kc.plan() + kc.tuning_plan():
    args = jax.eval_shape(lambda k, case=case: kc.make_inputs(case, case.shapes(False), k), jax.random.PRNGKey(0))
    todo.append((case.name, kc.programs(case, False, args)[0], args))
  full = jax.eval_shape(lambda k: kc.TopkDiagnosis.inputs(False, k), jax.random.PRNGKey(0))
  _, _, k = kc.TopkDiagnosis.shape(False)
  for name, (tun, m) in kc.topk_variants(False).items():
    args = jax.eval_shape(lambda f, m=m: kc.TopkDiagnosis.restrict(f, m), full)
    todo.append((f"topk.{name}", kc.TopkDiagnosis.variant_fn(tun, k, False), (args,)))
  for name, kern, args in todo:
    try:
      exported = lowering.export_for_cuda(kern, *args)
    except lowering.NoGpuTarget as e:
      pytest.skip(str(e))
    except Exception as e:  # noqa: BLE001 - every case's failure is listed
      failed.append((name, f"{type(e).__name__}: {str(e)[:200]}"))
      continue
    if not lowering.custom_call_targets(exported) & set(lowering.GPU_CUSTOM_CALLS):
      failed.append((name, "no GPU kernel call in the lowered module"))
  assert not failed, failed
