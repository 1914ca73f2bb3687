"""What a CPU step pays for scratch memory mapped fresh every step: the same runner with glibc's allocator as the
engine sets it (`dsv4.engine.host_memory.keep_scratch_mapped`) and at glibc's defaults, side by side.

Each (budget, allocator) point runs in a child process of its own (the allocator setting is the process's and
cannot be undone), the points in turn, --rounds times: a runner for --config at the budget with --batch decode
rows at --context (bf16 compute and KV, max_model_len 64k), warmed, then --steps steps timed one by one. A child
reports the compiled step program's temp buffer (`memory_analysis`, the first round only), its minor page faults
per step and its median ms per step. At glibc's defaults a temp buffer above the mmap threshold (at most 32 MiB)
is mapped and unmapped every step: about one fault per 4 KiB page of it.

    python -m benchmarks.probes.step_faults [--config=wide_moe] [--budgets=64,2048] [--steps=10] [--rounds=2]
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

flags.DEFINE_string("config", "wide_moe", "Model config (benchmarks.step_bench.CONFIGS).")
flags.DEFINE_list("budgets", ["64", "2048"], "Token budgets (max_num_batched_tokens).")
flags.DEFINE_integer("batch", 8, "Decode rows per step.")
flags.DEFINE_integer("context", 1024, "Tokens before each row's decode token.")
flags.DEFINE_integer("steps", 10, "Steps timed per child.")
flags.DEFINE_integer("rounds", 2, "Rounds over the points (a child per point per round).")
flags.DEFINE_integer("child_budget", 0, "Internal: run one point in this process at this budget.")
flags.DEFINE_bool("child_keep", True, "Internal: the child's allocator (True: as the engine sets it).")
flags.DEFINE_bool("child_temp", False, "Internal: also report the step program's temp bytes.")
FLAGS = flags.FLAGS


def child() -> dict:
  import jax

  from benchmarks.step_bench import CONFIGS
  from benchmarks.support.bare_runner import make_runner, rows_at
  from dsv4 import caches, model
  from dsv4.engine import host_memory
  if not FLAGS.child_keep:          # glibc's defaults: the runner's call sets nothing
    host_memory.keep_scratch_mapped = lambda: False
  cfg = CONFIGS[FLAGS.config]()
  budget = FLAGS.child_budget
  layout = caches.CacheLayout(kv_dtype=jax.numpy.bfloat16)
  bf16 = model.cast_params(model.init_params(cfg, jax.random.PRNGKey(0)), jax.numpy.bfloat16)
  run = make_runner(cfg, bf16, chunk_size=min(budget, 2048), max_num_batched_tokens=budget, max_model_len=65536,
                    max_num_seqs=64, layout=layout, dtype="bf16")
  rows = rows_at(run, [FLAGS.context] * FLAGS.batch, [1] * FLAGS.batch, np.random.default_rng(0))
  for _ in range(3):
    run.run(rows)
  out = {"budget": budget, "kept": bool(host_memory.applied())}
  ts = []
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for _ in range(FLAGS.steps):
    t = time.perf_counter()
    run.run(rows)
    ts.append(time.perf_counter() - t)
  out["faults_per_step"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / FLAGS.steps
  out["ms"] = 1e3 * float(np.median(ts))
  if FLAGS.child_temp:
    comp = run.lowered_step(rows).compile()
    out["temp_bytes"] = int(comp.memory_analysis().temp_size_in_bytes)
  return out


def main(argv):
  del argv
  if FLAGS.child_budget:
    print("RESULT " + json.dumps(child()), flush=True)
    return
  res: dict = {}
  for r in range(FLAGS.rounds):
    for b in (int(x) for x in FLAGS.budgets):
      for keep in (True, False):
        cmd = [sys.executable, "-m", "benchmarks.probes.step_faults", f"--config={FLAGS.config}",
               f"--child_budget={b}", f"--child_keep={keep}", f"--child_temp={r == 0}", f"--steps={FLAGS.steps}",
               f"--batch={FLAGS.batch}", f"--context={FLAGS.context}"]
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
          raise SystemExit(f"step_faults: the child for budget {b} (keep={keep}) failed:\n{p.stderr[-2000:]}")
        got = json.loads(line[-1][len("RESULT "):])
        d = res.setdefault((b, keep), {"ms": [], "faults": []})
        d["ms"].append(got["ms"])
        d["faults"].append(got["faults_per_step"])
        d.setdefault("temp", got.get("temp_bytes"))
        d["kept"] = got["kept"]
  print(f"{FLAGS.config}: decode batch {FLAGS.batch} at context {FLAGS.context}, bf16, a child process per point, "
        f"{FLAGS.rounds} rounds of {FLAGS.steps} steps (median ms over rounds)")
  print("| budget | allocator | step temp MB | faults per step | ms per step |")
  print("|---|---|---|---|---|")
  for (b, keep), d in res.items():
    name = "kept mapped (the engine's)" if d["kept"] else "glibc defaults"
    faults = " / ".join(f"{f:,.0f}" for f in d["faults"])
    print(f"| {b} | {name} | {d['temp'] / 1e6:.1f} | {faults} | {float(np.median(d['ms'])):.1f} |")


if __name__ == "__main__":
  app.run(main)
