"""benchmarks/kernels_bench.py --small runs on CPU (interpret mode): correctness checks pass, every op is covered,
results stream to JSONL with the split count, and timing is device-side (flushed loop minus flush-only loop)."""

import json

from benchmarks import kernels_bench


def test_bench_small(tmp_path):
  out = tmp_path / "bench.jsonl"
  assert kernels_bench.main(["--small", "--jsonl", str(out), "--json", str(tmp_path / "all.json")]) == 0
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  assert {r["op"] for r in rows} == {"sparse_attention", "indexer_scores", "indexer_topk"}
  assert all(r["ok"] and r["kernel_ms"] >= 0 and r["hot_ms"] > 0 and r["bytes"] > 0 for r in rows)
  assert all(r["num_splits"] in (1, 2) for r in rows if r["op"] == "sparse_attention")
  assert {r["env"]["backend"] for r in rows} == {"cpu"}
  assert len(json.loads((tmp_path / "all.json").read_text())["results"]) == len(rows)
