r"""Window ablation: the trained V4 model read with a different sliding window at inference.

    python -m experiments.ablate_window                    # full run -> experiments/results/window.{csv,json,png}
    python -m experiments.ablate_window --small --out_dir=/tmp/x   # CI

The window is not a parameter shape (window K=V rows come from the same `wkv` projection at any W), so
`dataclasses.replace(config.attention, window=W)` runs the same weights with another W. For each W and context
length: accuracy with the trained top-k, with the compressed path removed (window-only reading), and the cost per
query token of the CSA layer. The stored pairs end `min_gap` (= 2 x training window) tokens before the query
section, so a window-only reading can only answer once W reaches back into the store region; whether the
weights (trained at one W) make use of the longer window is what this measures.

Compression ratio: in V4 the CSA ratio is fixed at 4 (ratio 4 is what makes a layer CSA, and the compressor's
position bias `ape` has one row per in-window slot), so it cannot change at inference with the same params; HCA
ratios could, but the retrieval model has no HCA layer (see TRAIN_NOTES.md). So ratio is not swept here.
"""

from __future__ import annotations

import dataclasses
import os
import time

from absl import app, flags, logging

from experiments import plotting
from experiments import train_lib as L

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", "v4_retrieval", "Checkpoint name under experiments/checkpoints/ or a directory.")
flags.DEFINE_list("windows", ["4", "8", "16", "32", "64", "128"], "Inference windows.")
flags.DEFINE_list("lens", ["128", "256"], "Context lengths.")
flags.DEFINE_integer("eval_batches", 8, "Held-out batches per point.")
flags.DEFINE_integer("batch", 16, "Batch size.")
flags.DEFINE_string("out_dir", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                    "Where to write window.csv/json/png.")
flags.DEFINE_bool("small", False, "CI: two windows, one length, one small batch.")


def run(checkpoint: str, windows, lens, eval_batches: int, batch: int, out_dir: str, stem: str = "window") -> dict:
  config, params, info = L.load_checkpoint_dir(
      checkpoint if os.path.isdir(checkpoint) else os.path.join(L.CHECKPOINT_ROOT, checkpoint))
  base = L.task_spec_from_info(info)
  rows = []
  for T in lens:
    spec = dataclasses.replace(base, seq_len=T)
    # distance from the last stored value token to the first query: the window needed to see any stored pair
    dist = (T - spec.query_len + 1) - spec.store_end
    for W in windows:
      t0 = time.time()
      cfg = L.with_window(config, W)
      e = L.evaluate(params, cfg, spec, num_batches=eval_batches, batch=batch)
      e0 = L.evaluate(params, cfg, spec, num_batches=eval_batches, batch=batch, ablate="no_compressed")
      c = L.attention_cost(cfg, T)
      rows.append(dict(seq_len=T, window=W, trained_window=config.attention.window, k=config.indexer.topk,
                       min_query_to_store_distance=dist, accuracy=e["accuracy"], index_hit=e["index_hit"],
                       accuracy_no_compressed=e0["accuracy"], chance=e["chance"], n=e["n"], **c))
      logging.info("T=%d W=%d acc=%.3f window-only=%.3f (%.1fs)", T, W, e["accuracy"], e0["accuracy"],
                   time.time() - t0)
  meta = dict(checkpoint=checkpoint, config_name=config.name, task=dataclasses.asdict(base),
              eval_batches=eval_batches, batch=batch,
              note="accuracy_no_compressed: compressor wkv zeroed (window-only reading). Compression ratio not "
                   "swept: V4 CSA ratio is fixed at 4 for given params; the model has no HCA layer.")
  csv_path, json_path = plotting.write_table(rows, out_dir, stem, meta)

  fig, (ax1, ax2) = plotting.new_figure(2)
  for T in lens:
    r = [x for x in rows if x["seq_len"] == T]
    line, = ax1.plot([x["window"] for x in r], [x["accuracy"] for x in r], "o-", label=f"T={T} top-k")
    ax1.plot([x["window"] for x in r], [x["accuracy_no_compressed"] for x in r], "x--", color=line.get_color(),
             label=f"T={T} window only")
    ax2.plot([x["window"] for x in r], [x["total_flops"] / 1e6 for x in r], "o-", color=line.get_color(),
             label=f"T={T}")
  ax1.axvline(config.attention.window, color="k", lw=0.6, ls=":", label="trained window")
  ax1.axhline(1.0 / base.num_values, color="gray", lw=0.8, label="chance")
  ax1.set_xscale("log", base=2)
  ax1.set(xlabel="inference window W", ylabel="accuracy", ylim=(-0.02, 1.02),
          title=f"{config.name}: recall vs window (k={config.indexer.topk})")
  ax1.legend(fontsize=7)
  ax2.set_xscale("log", base=2)
  ax2.set(xlabel="inference window W", ylabel="MFLOPs / query token (CSA layer)", title="attention cost vs window")
  ax2.legend(fontsize=8)
  png = plotting.save_figure(fig, out_dir, stem)
  return dict(rows=rows, csv=csv_path, json=json_path, png=png)


def main(argv):
  del argv
  windows, lens = [int(w) for w in FLAGS.windows], [int(t) for t in FLAGS.lens]
  eval_batches, batch = FLAGS.eval_batches, FLAGS.batch
  if FLAGS.small:
    windows, lens, eval_batches, batch = [8, 16], [128], 1, 4
  out = run(FLAGS.checkpoint, windows, lens, eval_batches, batch, FLAGS.out_dir)
  print(f"wrote {out['csv']} {out['json']} {out['png']}")
  for r in out["rows"]:
    print(f"T={r['seq_len']:4d} W={r['window']:4d} acc={r['accuracy']:.3f} window-only="
          f"{r['accuracy_no_compressed']:.3f} MFLOPs={r['total_flops'] / 1e6:.3f}")


if __name__ == "__main__":
  app.run(main)
