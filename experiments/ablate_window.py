r"""Window ablation: the trained V4 model read with a different sliding window at inference.

    python -m experiments.ablate_window                  # full run -> out/ablate_window/window.{csv,json,png}
    python -m experiments.ablate_window --small --out_dir=/tmp/x   # CI
    python -m experiments.ablate_window --refresh_results    # refresh the committed experiments/results/window.*
    python -m experiments.ablate_window --replot --refresh_results   # re-draw the committed plot from its table

Output goes to --out_dir (default out/ablate_window/, untracked); --refresh_results writes the committed
experiments/results/ instead. --replot re-draws window.png from the window.json already there, without the sweep.

The window is not a parameter shape (window K=V rows come from the same `wkv` projection at any W), so
`dataclasses.replace(config.attention, window=W)` runs the same weights with another W. For each W and context
length: accuracy with the trained top-k, with the compressed path removed (window-only reading), and the cost per
query token of the CSA layer. The stored pairs end `min_gap` (= 2 x training window) tokens before the query
section, so a window-only reading can only answer once W reaches back into the store region; whether the
weights (trained at one W) make use of the longer window is what this measures.

Compression ratio: in V4 the CSA ratio is fixed at 4 (ratio 4 is what makes a layer CSA, and the compressor's
position bias `ape` has one row per in-window slot), so it cannot change at inference with the same params; HCA
ratios could, but the retrieval model has no HCA layer (see TRAIN_NOTES.md). So ratio is not swept here.

Plot: accuracy (filled, solid: trained top-k; hollow, dashed: window only) and cost against W on a log2 axis, one
colour / marker per context length; vertical lines at the trained window and at the W a window-only reading needs to
reach the stored pairs.
"""

from __future__ import annotations

import dataclasses
import os
import time

from absl import app, flags, logging

from experiments import plotting
from experiments import train_lib

FLAGS = flags.FLAGS
SCRIPT = "ablate_window"


def define_flags():
  """The command line (defined when run as a script, so importing `run` / `plot` defines no flags)."""
  flags.DEFINE_string("checkpoint", "v4_retrieval", "Checkpoint name under experiments/checkpoints/ or a directory.")
  flags.DEFINE_list("windows", ["4", "8", "16", "32", "64", "128"], "Inference windows.")
  flags.DEFINE_list("lens", ["128", "256"], "Context lengths.")
  flags.DEFINE_integer("eval_batches", 8, "Held-out batches per point.")
  flags.DEFINE_integer("batch", 16, "Batch size.")
  flags.DEFINE_bool("small", False, "CI: two windows, one length, one small batch.")
  flags.DEFINE_bool("replot", False, "Re-draw the plot from the table already in the output directory (no sweep).")
  plotting.define_output_flags(SCRIPT, "window.csv/json/png")


def run(checkpoint: str, windows, lens, eval_batches: int, batch: int, out_dir: str, stem: str = "window") -> dict:
  config, params, info = train_lib.load_checkpoint_dir(
      checkpoint if os.path.isdir(checkpoint) else os.path.join(train_lib.CHECKPOINT_ROOT, checkpoint))
  base = train_lib.task_spec_from_info(info)
  rows = []
  for T in lens:
    spec = dataclasses.replace(base, seq_len=T)
    # distance from the last stored value token to the first query: the window needed to see any stored pair
    dist = (T - spec.query_len + 1) - spec.store_end
    for W in windows:
      t0 = time.time()
      cfg = train_lib.with_window(config, W)
      e = train_lib.evaluate(params, cfg, spec, num_batches=eval_batches, batch=batch)
      e0 = train_lib.evaluate(params, cfg, spec, num_batches=eval_batches, batch=batch, ablate="no_compressed")
      c = train_lib.attention_cost(cfg, T)
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

  png = plotting.save_figure(plot(rows, meta), out_dir, stem)
  return dict(rows=rows, csv=csv_path, json=json_path, png=png)


def plot(rows: list[dict], meta: dict):
  """Accuracy (trained top-k / window only) and cost vs W (log2 axis), one colour / marker per context length."""
  lens = sorted({x["seq_len"] for x in rows})
  windows = sorted({x["window"] for x in rows})
  fig, (acc, cost) = plotting.new_figure(2, width=5.2)
  n = len(lens)
  for i, T in enumerate(lens):
    r = sorted((x for x in rows if x["seq_len"] == T), key=lambda x: x["window"])
    w = [x["window"] for x in r]
    acc.plot(w, [x["accuracy"] for x in r], label=f"T={T}: trained top-k", **plotting.series_style(i, n, "-"))
    acc.plot(w, [x["accuracy_no_compressed"] for x in r], label=f"T={T}: window only (compressed path removed)",
             **plotting.series_style(i, n, "--", hollow=True))
    cost.plot(w, [x["total_flops"] / 1e6 for x in r], label=f"T={T}", **plotting.series_style(i, n, "-"))
  need: dict[int, list[int]] = {}   # one line per distinct distance (equal at every T when the store is fixed)
  for x in rows:
    need.setdefault(x["min_query_to_store_distance"], [])
    if x["seq_len"] not in need[x["min_query_to_store_distance"]]:
      need[x["min_query_to_store_distance"]].append(x["seq_len"])
  for j, (d, ts) in enumerate(sorted(need.items())):
    acc.axvline(d, color="0.35", lw=0.9, ls=("-.", (0, (3, 1, 1, 1, 1, 1)))[j % 2], zorder=1,
                label=f"W that reaches the stored pairs: {d} (T={', '.join(map(str, ts))})")
  trained = rows[0]["trained_window"]
  acc.axvline(trained, color="k", lw=0.7, ls=":", zorder=1, label=f"trained window ({trained})")
  acc.axhline(rows[0]["chance"], color="gray", lw=0.8, zorder=20, label="chance")
  for ax in (acc, cost):
    plotting.knob_axis(ax, windows, "inference window W")
  title = meta.get("config_name", meta.get("checkpoint", ""))
  acc.set(ylabel="accuracy", ylim=(-0.02, 1.05), title=f"{title}: recall vs window (k={rows[0]['k']})")
  cost.set(ylabel="MFLOPs / query token (CSA layer)", title="attention cost vs window")
  plotting.legend_below(acc, ncol=1)
  plotting.legend_below(cost, ncol=1)
  return fig


def main(argv):
  del argv
  windows, lens = [int(w) for w in FLAGS.windows], [int(t) for t in FLAGS.lens]
  eval_batches, batch = FLAGS.eval_batches, FLAGS.batch
  if FLAGS.small:
    windows, lens, eval_batches, batch = [8, 16], [128], 1, 4
  out_dir = plotting.output_dir()
  if FLAGS.replot:
    print("wrote", plotting.replot(plot, out_dir, "window"))
    return
  out = run(FLAGS.checkpoint, windows, lens, eval_batches, batch, out_dir)
  print(f"wrote {out['csv']} {out['json']} {out['png']}")
  for r in out["rows"]:
    print(f"T={r['seq_len']:4d} W={r['window']:4d} acc={r['accuracy']:.3f} window-only="
          f"{r['accuracy_no_compressed']:.3f} MFLOPs={r['total_flops'] / 1e6:.3f}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
