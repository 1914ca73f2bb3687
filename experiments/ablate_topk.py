r"""Top-k ablation: retrieval accuracy and attention cost of the trained V4 model vs the indexer's k.

    python -m experiments.ablate_topk                      # full run -> experiments/results/topk.{csv,json,png}
    python -m experiments.ablate_topk --checkpoint=v4_count  # -> experiments/results/topk_v4_count.*
    python -m experiments.ablate_topk --small --out_dir=/tmp/x   # CI

The task (key-value recall or counting) comes from the checkpoint's config.json ("task"); counting rows also
carry `acc_by_count` (accuracy per true count c: with k < c occurrences the CSA layer cannot read them all).

Same parameters at every k (`dataclasses.replace(config.indexer, topk=k)`); k only changes which compressed entries
the CSA layer reads. Also reported per context length: the model with its compressed path removed (compressor KV
projection zeroed: every compressed entry is the zero vector), which is the window-only reading of the task.
Cost per query token of the CSA layer: window rows + compressed rows read, attention FLOPs (q.k and p.v), and the
indexer FLOPs (scores over all visible index keys), averaged over the positions of a sequence.
"""

from __future__ import annotations

import dataclasses
import os
import time

from absl import app, flags, logging

from experiments import plotting, tasks
from experiments import train_lib as L

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", "v4_retrieval", "Checkpoint name under experiments/checkpoints/ or a directory.")
flags.DEFINE_list("ks", ["1", "2", "4", "8", "16", "32", "64", "128"], "Top-k values.")
flags.DEFINE_list("lens", ["128", "256", "512"], "Context lengths.")
flags.DEFINE_integer("eval_batches", 8, "Held-out batches per point.")
flags.DEFINE_integer("batch", 16, "Batch size.")
flags.DEFINE_string("out_dir", os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                    "Where to write topk.csv/json/png.")
flags.DEFINE_integer("num_pairs", 0, "Override the task's stored pairs at eval (more distractors; 0: as trained).")
flags.DEFINE_bool("small", False, "CI: two k values, one length, one small batch.")


def run(checkpoint: str, ks, lens, eval_batches: int, batch: int, out_dir: str, stem: str = "topk",
        num_pairs: int = 0) -> dict:
  config, params, info = L.load_checkpoint_dir(
      checkpoint if os.path.isdir(checkpoint) else os.path.join(L.CHECKPOINT_ROOT, checkpoint))
  base = L.task_spec_from_info(info, **({"num_pairs": num_pairs} if num_pairs else {}))
  task_name = "count" if isinstance(base, tasks.CountSpec) else "recall"
  rows = []
  for T in lens:
    spec = dataclasses.replace(base, seq_len=T)
    for k in ks:
      t0 = time.time()
      cfg = L.with_topk(config, k)
      e = L.evaluate(params, cfg, spec, num_batches=eval_batches, batch=batch)
      c = L.attention_cost(cfg, T)
      rows.append(dict(seq_len=T, window=config.attention.window, path="topk", k=k, **e, **c))
      logging.info("T=%d k=%d acc=%.3f hit=%.3f (%.1fs)", T, k, e["accuracy"], e["index_hit"], time.time() - t0)
    e = L.evaluate(params, config, spec, num_batches=eval_batches, batch=batch, ablate="no_compressed")
    c = L.attention_cost(L.with_topk(config, 1), T)
    c.update(compressed_rows=0.0, compressed_rows_last=0, attn_flops=4 * config.attention.num_heads *
             config.attention.head_dim * c["window_rows"], indexer_flops=0.0)
    c["total_flops"] = c["attn_flops"]
    rows.append(dict(seq_len=T, window=config.attention.window, path="no_compressed", k=0, **e, **c))
    logging.info("T=%d no compressed path: acc=%.3f", T, e["accuracy"])

  meta = dict(checkpoint=checkpoint, config_name=config.name, task=dataclasses.asdict(base),
              eval_batches=eval_batches, batch=batch,
              note="k=0/path=no_compressed: compressor wkv zeroed (window-only reading); chance = 1/num_values")
  csv_path, json_path = plotting.write_table(rows, out_dir, stem, meta)

  fig, (ax1, ax2) = plotting.new_figure(2)
  for T in lens:
    r = [x for x in rows if x["seq_len"] == T and x["path"] == "topk"]
    line, = ax1.plot([x["k"] for x in r], [x["accuracy"] for x in r], "o-", label=f"T={T}")
    ax1.plot([x["k"] for x in r], [x["index_hit"] for x in r], "x:", color=line.get_color(), alpha=0.6)
    nc = [x for x in rows if x["seq_len"] == T and x["path"] == "no_compressed"][0]
    ax1.axhline(nc["accuracy"], color=line.get_color(), ls="--", lw=0.8)
    ax2.plot([x["k"] for x in r], [x["total_flops"] / 1e6 for x in r], "o-", color=line.get_color(),
             label=f"T={T} attn+indexer")
    ax2.plot([x["k"] for x in r], [x["attn_flops"] / 1e6 for x in r], "s:", color=line.get_color(), alpha=0.6,
             label=f"T={T} attn only")
  ax1.axhline(1.0 / base.num_values, color="gray", lw=0.8, label="chance")
  ax1.set(xscale="log", xlabel="indexer top-k", ylabel="accuracy (o) / indexer hit (x)",
          title=f"{config.name}: {task_name} vs top-k\n(dashed: compressed path removed)", ylim=(-0.02, 1.02))
  ax1.set_xscale("log", base=2)
  ax1.legend(fontsize=8)
  ax2.set_xscale("log", base=2)
  ax2.set(xlabel="indexer top-k", ylabel="MFLOPs / query token (CSA layer)", title="attention cost vs top-k")
  ax2.legend(fontsize=7)
  png = plotting.save_figure(fig, out_dir, stem)
  return dict(rows=rows, csv=csv_path, json=json_path, png=png)


def main(argv):
  del argv
  ks, lens = [int(k) for k in FLAGS.ks], [int(t) for t in FLAGS.lens]
  eval_batches, batch = FLAGS.eval_batches, FLAGS.batch
  if FLAGS.small:
    ks, lens, eval_batches, batch = [1, 8], [128], 1, 4
  stem = "topk" if FLAGS.checkpoint == "v4_retrieval" else "topk_" + os.path.basename(FLAGS.checkpoint.rstrip("/"))
  if FLAGS.num_pairs:
    stem += f"_pairs{FLAGS.num_pairs}"
  out = run(FLAGS.checkpoint, ks, lens, eval_batches, batch, FLAGS.out_dir, stem=stem, num_pairs=FLAGS.num_pairs)
  print(f"wrote {out['csv']} {out['json']} {out['png']}")
  for r in out["rows"]:
    print(f"T={r['seq_len']:4d} {r['path']:13s} k={r['k']:3d} acc={r['accuracy']:.3f} hit={r['index_hit']:.3f} "
          f"comp_rows={r['compressed_rows']:.1f} MFLOPs={r['total_flops'] / 1e6:.3f}"
          + (f" by_count={r['acc_by_count']}" if "acc_by_count" in r else ""))


if __name__ == "__main__":
  app.run(main)
