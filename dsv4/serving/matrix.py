"""The seed's test matrix: every configuration of `cluster.MATRIX` over the four workload groups on one cluster,
plus a single engine run of the same sessions as the reference for greedy tokens."""

from __future__ import annotations

import dataclasses

from cache.hashing import ExtraKeys
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams
from dsv4.serving import metrics, workloads
# names, not the module: run_matrix's `cluster` argument is a Cluster
from dsv4.serving.cluster import MATRIX, SLO, Cluster


def reference_outputs(config, params, engine_config, sessions: list[workloads.Session]) -> dict[str, list[int]]:
  """Each turn on one engine, in session order (a turn's prompt is built from the reference's own answers)."""
  eng = Engine(params, config, engine_config)
  out = {}
  for s in sessions:
    answers = []
    for k in range(len(s.turns)):
      rid = f"{s.sid}.t{k}"
      eng.add_request(rid, s.prompt(k, answers), SamplingParams(max_tokens=s.max_tokens, ignore_eos=True),
                      ExtraKeys(tenant=s.tenant))
      eng.run()
      r = eng.take_outputs([rid])[0]
      if r.error:
        raise RuntimeError(f"reference {rid}: {r.error}")
      answers.append(list(r.output))
      out[rid] = list(r.output)
  return out


@dataclasses.dataclass(frozen=True)
class MatrixResult:
  rows: list[dict]                      # one per (config, group): metrics.summarize + labels
  mismatches: list[str]                 # "<config>/<rid>" whose tokens differ from the reference
  runs: dict                            # (config, group) -> the raw run


def run_matrix(cluster: Cluster, groups, configs=MATRIX, sizes=workloads.WorkloadSizes(), slo=SLO(),
               reference: dict | None = None, faults=None) -> MatrixResult:
  """faults: optional (config name, group) -> tuple of cluster.Fault."""
  rows, bad, runs = [], [], {}
  traces = {g: workloads.build(g, cluster.config.vocab_size, sizes) for g in groups}
  for cfg in configs:
    cluster.configure(cfg)
    for g in groups:
      run = cluster.run(traces[g], (faults or {}).get((cfg.name, g), ()))
      runs[(cfg.name, g)] = run
      row = {"config": cfg.name, "group": g, **metrics.summarize(run, slo)}
      if reference is not None:
        wrong = [r["rid"] for r in run["requests"] if r["output"] != reference[r["rid"]]]
        missing = [rid for rid in reference if rid.split(".")[0] in {s.sid for s in traces[g]}
                   and rid not in {r["rid"] for r in run["requests"]}]
        bad += [f"{cfg.name}/{x}" for x in wrong + missing]
        row["token_mismatches"] = len(wrong) + len(missing)
      rows.append(row)
  return MatrixResult(rows, bad, runs)
