"""The node-scale discrete-event model runs the real router, directory and workload generator: every request is
served, KV-aware routing predicts at least round robin's prefix hits, and P/D transfer sizes follow the records."""

from dsv4.serving import cluster
from dsv4.serving import simulation
from dsv4.serving import workloads


def test_simulation_predicts_the_matrix_shape():
  nc = simulation.NodeConstants()
  block, tail = 1_000_000, 3_000_000
  state = lambda L: -(-L // 128) * block + tail        # noqa: E731
  for g in ("chat", "rag"):
    sessions = workloads.build(g, 64, workloads.WorkloadSizes())
    rr = simulation.simulate(cluster.MATRIX[0], sessions, block, state, nc)
    kv = simulation.simulate(cluster.MATRIX[1], sessions, block, state, nc)
    pd = simulation.simulate(cluster.MATRIX[2], sessions, block, state, nc)
    assert len(rr) == len(kv) == len(pd) == sum(len(s.turns) for s in sessions)
    assert sum(r["hit_tokens"] for r in kv) > sum(r["hit_tokens"] for r in rr)
    assert all(r["transfer_bytes"] == state(r["prompt_len"]) for r in pd)
    assert all(r["transfer_bytes"] == 0 for r in kv)
    assert all(r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] for r in rr + kv + pd)


def test_handed_state_bytes_is_the_sizing_count():
  from benchmarks.sizing import handoff_state_bytes
  from dsv4 import caches
  from dsv4 import config
  cfg = config.v4_flash()
  specs = caches.group_specs(cfg, caches.CacheLayout())
  for L in (1, 45, 127, 128, 129, 300, 1000):
    assert simulation.handed_state_bytes(specs, L) == handoff_state_bytes(cfg, caches.CacheLayout(), L + 1), L
