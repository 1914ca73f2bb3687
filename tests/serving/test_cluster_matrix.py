"""The cluster matrix end to end on a local Ray cluster (4 replica actors of the tiny shipped retrieval model, CPU):
the five configurations over the four workload groups with greedy tokens equal to one engine's, KV-aware routing
hitting at least as many prefix tokens as round robin (strictly more on chat and RAG), every P/D transfer carrying
exactly the state `benchmarks.sizing` computes and the decode replica computing no prompt token after it, and the
faults: a replica killed mid-run (re-routed, restarted empty), a transfer backend down, the directory's Redis down.
Nothing lost, tokens unchanged."""

import functools
import os
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("ray")

from benchmarks.sizing import handoff_state_bytes  # noqa: E402
from dsv4.serving import cluster  # noqa: E402
from dsv4.serving import matrix  # noqa: E402
from dsv4.serving import workloads  # noqa: E402
from experiments import cluster as experiment  # noqa: E402


def _transfer_engine_unavailable() -> str:
  """Why the Mooncake transfer engine (every replica's KV transfer endpoint) cannot load here, or "": checked in a
  child process, as Mooncake never loads into a pytest worker (tests/isolation.py)."""
  r = subprocess.run([sys.executable, "-c", "import mooncake.engine"], capture_output=True, text=True, timeout=120)
  if r.returncode == 0:
    return ""
  last = (r.stderr.strip().splitlines() or ["no message"])[-1]
  return (f"the Mooncake transfer engine cannot load here ({last}); the replicas need it: pip install "
          f"mooncake-transfer-engine-non-cuda and the system library it names")


@pytest.mark.slow
def test_cluster_matrix_and_faults():
  why = _transfer_engine_unavailable()
  if why:
    pytest.skip(why)
  load = functools.partial(experiment.loader, "v4_retrieval")
  ec = experiment.engine_config()
  cfg, params = load()
  sizes = workloads.WorkloadSizes()
  sessions = [s for g in workloads.GROUPS for s in workloads.build(g, cfg.vocab_size, sizes)]
  ref = matrix.reference_outputs(cfg, params, ec, sessions)
  cl = cluster.Cluster(load, ec, num_replicas=4, compile_cache_dir=os.path.join(tempfile.gettempdir(),
                                                                                "dsv4-cluster-jax-cache"))
  try:
    res = matrix.run_matrix(cl, workloads.GROUPS, cluster.MATRIX, sizes, reference=ref)
    assert res.mismatches == []
    row = {(r["config"], r["group"]): r for r in res.rows}
    for g in ("chat", "agent", "rag"):
      assert row[("combined+kv", g)]["hit_tokens"] >= row[("combined+rr", g)]["hit_tokens"], g
    for g in ("chat", "rag"):
      assert row[("combined+kv", g)]["hit_tokens"] > row[("combined+rr", g)]["hit_tokens"], g
    for (name, g), run in res.runs.items():
      st = run["stats"]
      assert len(run["requests"]) == sum(len(s.turns) for s in workloads.build(g, cfg.vocab_size, sizes))
      if not name.startswith("pd"):
        continue
      assert st["fallbacks"] == 0 and st["transfer_failures"] == 0 and st["reprefilled"] == 0, (name, g, st)
      for r in run["requests"]:
        assert r["transfer_payload_bytes"] == handoff_state_bytes(cfg, ec.layout, r["prompt_len"] + 1), r["rid"]
        assert r["transfer_bytes"] > r["transfer_payload_bytes"]          # + record headers and checksums
        # the decode replica resumed exactly where the prefill replica stopped: it computed no prompt token
        assert r["state_point"] == r["decode_hit_tokens"] == r["prompt_len"], r["rid"]
        assert r["decode_prompt_tokens_computed"] == 0, r["rid"]

    def check(run, group):
      sessions = {s.sid for s in workloads.build(group, cfg.vocab_size, sizes)}
      want = {rid: t for rid, t in ref.items() if rid.split(".")[0] in sessions}
      assert {r["rid"]: r["output"] for r in run["requests"]} == want

    chat = workloads.build("chat", cfg.vocab_size, sizes)
    # a combined replica killed while it serves, restarted empty later: its requests are re-routed and completed
    cl.configure(cluster.MATRIX[1])
    run = cl.run(chat, (cluster.Fault(0.6, "kill", 1), cluster.Fault(2.0, "restart", 1)))
    check(run, "chat")
    assert run["stats"]["killed"] == 1 and run["stats"]["restarted"] == 1 and run["stats"]["rerouted"] >= 1
    # the transfer backend of a prefill replica down: its requests fall back to Combined, counted
    cl.configure(cluster.MATRIX[2])
    run = cl.run(chat, (cluster.Fault(0.0, "transfer_down", 0),))
    check(run, "chat")
    assert run["stats"]["fallbacks"] >= 1 and run["stats"]["transfer_failures"] >= 1
    assert run["stats"]["reprefilled"] == 0
    # the directory's Redis (also the L3 store) down mid-run: load-only routing, tiers degrade to recompute
    cl.configure(cluster.MATRIX[4])
    run = cl.run(chat, (cluster.Fault(0.5, "redis_down"),))
    check(run, "chat")
    assert run["stats"]["router"]["directory_errors"] >= 1
  finally:
    cl.shutdown()
