"""The cluster matrix (docs/cluster.md): Combined + round robin, Combined + KV-aware, P/D, P/D + L2 host memory,
P/D + distributed L3, over four workload groups (multi-turn chat, agent loops, RAG over shared documents, a no-reuse
control), on N replica actors of a tiny shipped model on Ray. Same trace, arrival pattern and SLO for every
configuration; greedy tokens are checked against a single engine. Prints a table and writes
<out_dir>/cluster.{csv,json,png}.

    python -m experiments.cluster                          # 4 replicas on a local Ray cluster (CPU, ~5-8 min)
    python -m experiments.cluster --ray_address=auto       # join a running Ray cluster instead
    python -m experiments.cluster --groups=chat,rag --configs=combined+rr,combined+kv
    python -m experiments.cluster --predict                # the node-scale model only: PREDICTED numbers (seconds)
"""

from __future__ import annotations

import functools
import json
import os
import tempfile

import numpy as np
from absl import app, flags, logging
from tqdm import tqdm

from dsv4.engine.config import EngineConfig
from dsv4.loading import orbax_io
from dsv4.serving import cluster, matrix, simulation, workloads
from experiments import plotting, train_lib

FLAGS = flags.FLAGS
SCRIPT = "cluster"


def define_flags():
  flags.DEFINE_integer("replicas", 4, "Replica actors (P/D configurations: first half prefill, second half decode).")
  flags.DEFINE_string("ray_address", "", "Join this Ray cluster ('auto' = the local one); '' = start one here.")
  flags.DEFINE_integer("num_cpus", 4, "Logical CPUs of the Ray cluster started here.")
  flags.DEFINE_list("groups", ["chat", "agent", "rag", "control"], "Workload groups.")
  flags.DEFINE_list("configs", [], "Configurations (default: all five).")
  flags.DEFINE_string("model", "v4_retrieval", "Shipped model (experiments/checkpoints/<name>).")
  flags.DEFINE_float("slo_ttft_s", 3.0, "TTFT of the SLO (goodput).")
  flags.DEFINE_float("slo_tpot_s", 0.25, "TPOT of the SLO (goodput).")
  flags.DEFINE_bool("predict", False, "Only the discrete-event model at 8 x H200 scale (predictions, no engines).")
  plotting.define_output_flags(SCRIPT, "the table and the plot", "cluster")


def loader(model: str):
  """(config, params) of a shipped trained model, as experiments.serve loads it (without its flags)."""
  d = os.path.join(train_lib.CHECKPOINT_ROOT, model)
  with open(os.path.join(d, "config.json")) as f:
    cfg = train_lib.config_from_dict(json.load(f)["config"])
  return cfg, orbax_io.restore_params(os.path.join(d, "params"), cfg)


def engine_config():
  return EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, chunk_size=128, max_model_len=1024,
                      num_full_blocks=24, num_swa_blocks=64)


COLUMNS = ("config", "group", "requests", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "itl_p99_s", "e2e_p95_s",
           "slo_attained", "hit_tokens", "transfer_bytes_mean", "transfer_s_p50", "transfer_failures", "fallbacks",
           "decode_prompt_tokens", "recomputed_tokens", "demotions", "promotions", "token_mismatches")


def print_table(rows):
  print(" | ".join(COLUMNS))
  for r in rows:
    print(" | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS))


def plot(rows, out_dir):
  groups = list(dict.fromkeys(r["group"] for r in rows))
  configs = list(dict.fromkeys(r["config"] for r in rows))
  fig, axes = plotting.new_figure(2, width=6.0)
  w = 0.8 / len(configs)
  for ci, c in enumerate(configs):
    for ax, key in zip(axes, ("hit_tokens", "ttft_p50_s")):
      vals = [next((r[key] for r in rows if r["config"] == c and r["group"] == g), 0) for g in groups]
      ax.bar(np.arange(len(groups)) + ci * w, vals, w, label=c)
  for ax, label in zip(axes, ("prefix-hit tokens", "TTFT p50 (s)")):
    ax.set_xticks(np.arange(len(groups)) + 0.4 - w / 2)
    ax.set_xticklabels(groups)
    ax.set_ylabel(label)
  plotting.legend_below(axes[0], ncol=3)
  return plotting.save_figure(fig, out_dir, "cluster")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)      # orbax's per-restore lines would bury the progress bar

  out_dir = plotting.output_dir("cluster")
  if FLAGS.predict:
    rows = simulation.predict_matrix(groups=FLAGS.groups)
    cols = ("config", "group", "requests", "ttft_p50_s", "ttft_p99_s", "e2e_p50_s", "hit_tokens", "prompt_tokens",
            "transfer_bytes_mean")
    print("PREDICTED by the discrete-event model (8 x H200 constants), not measured:")
    print(" | ".join(cols))
    for r in rows:
      print(" | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    plotting.write_table(rows, out_dir, "cluster_prediction", meta={"predicted": True})
    return 0
  configs = [c for c in cluster.MATRIX if not FLAGS.configs or c.name in FLAGS.configs]
  unknown = set(FLAGS.configs) - {c.name for c in cluster.MATRIX}
  if unknown:
    raise app.UsageError(f"--configs: unknown {sorted(unknown)}; choose from {[c.name for c in cluster.MATRIX]}")
  for g in FLAGS.groups:
    if g not in workloads.GROUPS:
      raise app.UsageError(f"--groups: unknown {g!r}; choose from {list(workloads.GROUPS)}")
  load = functools.partial(loader, FLAGS.model)
  ec = engine_config()
  cache_dir = os.path.join(tempfile.gettempdir(), "dsv4-cluster-jax-cache")
  sizes = workloads.WorkloadSizes()
  cfg, params = load()
  sessions = [s for g in FLAGS.groups for s in workloads.build(g, cfg.vocab_size, sizes)]
  ref = matrix.reference_outputs(cfg, params, ec, sessions)
  total = len(configs) * sum(len(s.turns) for s in sessions)
  with tqdm(total=total, desc="cluster matrix") as bar:
    cl = cluster.Cluster(load, ec, num_replicas=FLAGS.replicas, ray_address=FLAGS.ray_address, num_cpus=FLAGS.num_cpus,
                         compile_cache_dir=cache_dir, progress=bar.update)
    try:
      res = matrix.run_matrix(cl, FLAGS.groups, configs, sizes, cluster.SLO(FLAGS.slo_ttft_s, FLAGS.slo_tpot_s), ref)
    finally:
      cl.shutdown()
  print_table(res.rows)
  plotting.write_table(res.rows, out_dir, "cluster", meta={"mismatches": res.mismatches})
  print("plot:", plot(res.rows, out_dir))
  if res.mismatches:
    print(f"GREEDY TOKENS DIFFER from the single engine: {res.mismatches[:10]}")
    return 1
  return 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
