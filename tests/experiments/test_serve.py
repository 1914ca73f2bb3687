"""The main job runs end to end on the embedded default and writes outputs, metrics and the summary table."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_serve_main_job(tmp_path):
  reqs = tmp_path / "reqs.jsonl"
  with open(reqs, "w") as f:
    f.write(json.dumps({"id": "ok", "prompt": [5, 6, 7] * 20, "max_tokens": 4}) + "\n")
    f.write(json.dumps({"id": "bad", "prompt": [1, 2, 10**9], "max_tokens": 4}) + "\n")
  out = tmp_path / "out"
  proc = subprocess.run([sys.executable, "-m", "experiments.serve", f"--requests={reqs}", f"--out_dir={out}",
                         "--max_num_seqs=2", "--chunk_size=32"], cwd=ROOT, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "prefix_hit_tokens" in proc.stdout and "ttft_p50_s" in proc.stdout
  assert "request bad: error: token id 1000000000 out of range" in proc.stdout
  lines = [json.loads(l) for l in open(out / "outputs.jsonl")]
  assert [l["id"] for l in lines] == ["ok", "bad"]
  assert len(lines[0]["output"]) >= 1 and lines[1]["error"]
  summary = json.load(open(out / "metrics.json"))["summary"]
  assert summary["requests"] == 2 and summary["errors"] == 1 and summary["compiled_step_shapes"] <= 2
