"""benchmarks/gpu_check.sh --small (-> kernels_bench.py --small --report) runs on CPU in interpret mode: correctness
checks pass, every op is covered, results stream to JSONL with the split count, the JSON + markdown report is
written."""

import json
import os
import subprocess


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_check_small(tmp_path):
  out = tmp_path / "check"
  proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), "--small", str(out)],
                        capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
  assert {r["op"] for r in rows} == {"sparse_attention", "indexer_scores", "indexer_topk"}
  # CPU interpret-mode timings are meaningless (the flushed difference may even be nan); they must exist.
  assert all(r["ok"] and r["hot_ms"] > 0 and r["flush_ms"] > 0 and r["bytes"] > 0 for r in rows)
  assert all(r["num_splits"] in (1, 2) for r in rows if r["op"] == "sparse_attention")
  report = json.loads((out / "gpu_check.json").read_text())
  assert report["env"]["backend"] == "cpu" and len(report["results"]) == len(rows)
  assert all(s["ok"] for s in report["summary"].values())
  md = (out / "gpu_check.md").read_text()
  assert md.count("\n| ") == len(rows) + 1  # header + one row per case
