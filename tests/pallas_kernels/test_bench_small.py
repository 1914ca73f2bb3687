"""benchmarks/kernels_bench.py --small runs on CPU (interpret mode) and its correctness checks pass."""

import json

from benchmarks import kernels_bench


def test_bench_small(tmp_path):
  out = tmp_path / "bench.json"
  assert kernels_bench.main(["--small", "--json", str(out)]) == 0
  rows = json.loads(out.read_text())
  assert {r["op"] for r in rows} == {"sparse_attention", "indexer_scores"}
  assert all(r["ok"] and r["kernel_ms"] > 0 and r["gbps"] > 0 for r in rows)
