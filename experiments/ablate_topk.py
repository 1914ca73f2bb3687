r"""Top-k ablation: retrieval accuracy and attention cost of the trained V4 model vs the indexer's k.

    python -m experiments.ablate_topk                        # full run -> out/ablate_topk/topk.{csv,json,png}
    python -m experiments.ablate_topk --checkpoint=v4_count  # -> out/ablate_topk/topk_v4_count.*
    python -m experiments.ablate_topk --small --out_dir=/tmp/x   # CI
    python -m experiments.ablate_topk --refresh_results      # refresh the committed experiments/results/topk.*
    python -m experiments.ablate_topk --replot --refresh_results   # re-draw the committed plot from its table

Output goes to --out_dir (default out/ablate_topk/, untracked); --refresh_results writes the committed
experiments/results/ instead. --replot re-draws <stem>.png from the <stem>.json already there, without the sweep.

The task (key-value recall or counting) comes from the checkpoint's config.json ("task"); counting rows also
carry `acc_by_count` (accuracy per true count c: with k < c occurrences the CSA layer cannot read them all).

Same parameters at every k (`dataclasses.replace(config.indexer, topk=k)`); k only changes which compressed entries
the CSA layer reads. Also reported per context length: the model with its compressed path removed (compressor KV
projection zeroed: every compressed entry is the zero vector), which is the window-only reading of the task.
Cost per query token of the CSA layer: window rows + compressed rows read, attention FLOPs (q.k and p.v), and the
indexer FLOPs (scores over all visible index keys), averaged over the positions of a sequence.

Plot: accuracy, indexer hit and cost (MFLOPs per query token) against k on a log2 axis, one colour / marker per
context length; the compressed-path-removed accuracy and chance are horizontal lines on the accuracy panel.
"""

from __future__ import annotations

import dataclasses
import os
import time

from absl import app, flags, logging

from experiments import plotting
from experiments import train_lib

FLAGS = flags.FLAGS
SCRIPT = "ablate_topk"


def define_flags():
  """The command line (defined when run as a script, so importing `run` / `plot` defines no flags)."""
  flags.DEFINE_string("checkpoint", "v4_retrieval", "Checkpoint name under experiments/checkpoints/ or a directory.")
  flags.DEFINE_list("ks", ["1", "2", "4", "8", "16", "32", "64", "128"], "Top-k values.")
  flags.DEFINE_list("lens", ["128", "256", "512"], "Context lengths.")
  flags.DEFINE_integer("eval_batches", 8, "Held-out batches per point.")
  flags.DEFINE_integer("batch", 16, "Batch size.")
  flags.DEFINE_integer("num_pairs", 0, "Override the task's stored pairs at eval (more distractors; 0: as trained).")
  flags.DEFINE_bool("small", False, "CI: two k values, one length, one small batch.")
  flags.DEFINE_bool("replot", False, "Re-draw the plot from the table already in the output directory (no sweep).")
  plotting.define_output_flags(SCRIPT, "topk[_<checkpoint>].csv/json/png")


def run(checkpoint: str, ks, lens, eval_batches: int, batch: int, out_dir: str, stem: str = "topk",
        num_pairs: int = 0) -> dict:
  config, params, info = train_lib.load_checkpoint_dir(
      checkpoint if os.path.isdir(checkpoint) else os.path.join(train_lib.CHECKPOINT_ROOT, checkpoint))
  base = train_lib.task_spec_from_info(info, **({"num_pairs": num_pairs} if num_pairs else {}))
  rows = []
  for T in lens:
    spec = dataclasses.replace(base, seq_len=T)
    for k in ks:
      t0 = time.time()
      cfg = train_lib.with_topk(config, k)
      e = train_lib.evaluate(params, cfg, spec, num_batches=eval_batches, batch=batch)
      c = train_lib.attention_cost(cfg, T)
      rows.append(dict(seq_len=T, window=config.attention.window, path="topk", k=k, **e, **c))
      logging.info("T=%d k=%d acc=%.3f hit=%.3f (%.1fs)", T, k, e["accuracy"], e["index_hit"], time.time() - t0)
    e = train_lib.evaluate(params, config, spec, num_batches=eval_batches, batch=batch, ablate="no_compressed")
    c = train_lib.attention_cost(train_lib.with_topk(config, 1), T)
    c.update(compressed_rows=0.0, compressed_rows_last=0, attn_flops=4 * config.attention.num_heads *
             config.attention.head_dim * c["window_rows"], indexer_flops=0.0)
    c["total_flops"] = c["attn_flops"]
    rows.append(dict(seq_len=T, window=config.attention.window, path="no_compressed", k=0, **e, **c))
    logging.info("T=%d no compressed path: acc=%.3f", T, e["accuracy"])

  meta = dict(checkpoint=checkpoint, config_name=config.name, task=dataclasses.asdict(base),
              eval_batches=eval_batches, batch=batch,
              note="k=0/path=no_compressed: compressor wkv zeroed (window-only reading); chance = 1/num_values")
  csv_path, json_path = plotting.write_table(rows, out_dir, stem, meta)

  png = plotting.save_figure(plot(rows, meta), out_dir, stem)
  return dict(rows=rows, csv=csv_path, json=json_path, png=png)


def plot(rows: list[dict], meta: dict):
  """Accuracy, indexer hit and cost vs k (log2 axis), one colour / marker per context length."""
  lens = sorted({x["seq_len"] for x in rows})
  ks = sorted({x["k"] for x in rows if x["path"] == "topk"})
  task_name = "count" if meta.get("task", {}).get("kind") == "count" else "recall"
  fig, (acc, hit, cost) = plotting.new_figure(3, width=4.6)
  n = len(lens)
  for i, T in enumerate(lens):
    r = sorted((x for x in rows if x["seq_len"] == T and x["path"] == "topk"), key=lambda x: x["k"])
    k = [x["k"] for x in r]
    st = plotting.series_style(i, n)
    acc.plot(k, [x["accuracy"] for x in r], label=f"T={T}", **st)
    hit.plot(k, [x["index_hit"] for x in r], label=f"T={T}", **st)
    cost.plot(k, [x["total_flops"] / 1e6 for x in r], label=f"T={T}: attention + indexer",
              **plotting.series_style(i, n, linestyle="-"))
    cost.plot(k, [x["attn_flops"] / 1e6 for x in r], label=f"T={T}: attention only",
              **plotting.series_style(i, n, linestyle="--", hollow=True))
    nc = [x for x in rows if x["seq_len"] == T and x["path"] == "no_compressed"]
    if nc:   # lines of decreasing width (as the series), so equal baselines still all show
      acc.axhline(nc[0]["accuracy"], color=st["color"], ls=":", lw=st["linewidth"] + 0.5, alpha=0.8,
                  zorder=st["zorder"], label=f"T={T}: compressed path removed")
  chance = rows[0].get("chance")
  if chance is not None:
    acc.axhline(chance, color="gray", lw=0.8, zorder=20, label="chance")   # thin, on top: never hidden
  title = meta.get("config_name", meta.get("checkpoint", ""))
  for ax in (acc, hit, cost):
    plotting.knob_axis(ax, ks, "indexer top-k")
  acc.set(ylabel="accuracy", ylim=(-0.02, 1.05), title=f"{title}: {task_name} vs top-k")
  hit.set(ylabel="indexer hit (answer entry among the top-k)", ylim=(-0.02, 1.05), title="indexer hit vs top-k")
  cost.set(ylabel="MFLOPs / query token (CSA layer)", title="attention cost vs top-k")
  plotting.legend_below(acc, ncol=1)
  plotting.legend_below(hit, ncol=1)
  plotting.legend_below(cost, ncol=1)
  return fig


def main(argv):
  del argv
  ks, lens = [int(k) for k in FLAGS.ks], [int(t) for t in FLAGS.lens]
  eval_batches, batch = FLAGS.eval_batches, FLAGS.batch
  if FLAGS.small:
    ks, lens, eval_batches, batch = [1, 8], [128], 1, 4
  stem = "topk" if FLAGS.checkpoint == "v4_retrieval" else "topk_" + os.path.basename(FLAGS.checkpoint.rstrip("/"))
  if FLAGS.num_pairs:
    stem += f"_pairs{FLAGS.num_pairs}"
  out_dir = plotting.output_dir()
  if FLAGS.replot:
    print("wrote", plotting.replot(plot, out_dir, stem))
    return
  out = run(FLAGS.checkpoint, ks, lens, eval_batches, batch, out_dir, stem=stem, num_pairs=FLAGS.num_pairs)
  print(f"wrote {out['csv']} {out['json']} {out['png']}")
  for r in out["rows"]:
    print(f"T={r['seq_len']:4d} {r['path']:13s} k={r['k']:3d} acc={r['accuracy']:.3f} hit={r['index_hit']:.3f} "
          f"comp_rows={r['compressed_rows']:.1f} MFLOPs={r['total_flops'] / 1e6:.3f}"
          + (f" by_count={r['acc_by_count']}" if "acc_by_count" in r else ""))


if __name__ == "__main__":
  define_flags()
  app.run(main)
