"""(c) The main job on this device: `experiments.serve_lib.run` (what `python -m experiments.serve` runs) with the
shipped model and its graded workload (48 requests of multi-turn recall sessions over shared documents). On the
CPU the job answers all 48 as expected (BUILD_NOTES.md, Main job), so each answer that differs from its expected
one is an answer that differs from the CPU's: the row lists their ids.
"""

from __future__ import annotations

import json
import os
import time

from experiments import serve_lib
from experiments.serve_options import ServeOptions


def run(out_dir: str, *, kernels: str, compilation_cache_dir: str, model: str = "v4_retrieval") -> dict:
  t0 = time.perf_counter()
  summary = serve_lib.run(ServeOptions(model=model, out_dir=out_dir, kernels=kernels,
                                       compilation_cache_dir=compilation_cache_dir))
  wall = time.perf_counter() - t0
  differ = []
  answered = 0
  with open(os.path.join(out_dir, "outputs.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      answered += 1
      if r.get("correct") is not True:
        differ.append(r["id"])
  row = dict(model=model, kernels=kernels, requests=summary.get("requests"), answered=answered,
             accuracy=summary.get("accuracy"), answers_differ=len(differ), differ_ids=differ[:12],
             compilations=summary.get("compilations"), compile_s=summary.get("compile_s"),
             job_wall_s=summary.get("wall_s"), call_wall_s=wall, prefix_hit_pct=summary.get("prefix_hit_pct"),
             total_tok_per_s=summary.get("total_tok_per_s"))
  row["status"] = "ok" if not differ and summary.get("errors", 0) == 0 else "mismatch"
  if differ:
    row["error"] = f"{len(differ)} of {answered} answers differ from the CPU's (first: {', '.join(differ[:4])})"
  return row
