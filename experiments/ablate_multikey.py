r"""Top-k and window ablations on the multi-key task, per m (the number of far slots one answer needs).

    python -m experiments.ablate_multikey                    # full -> out/ablate_multikey/multikey_{topk,window}.*
    python -m experiments.ablate_multikey --refresh_results  # the committed experiments/results/
    python -m experiments.ablate_multikey --small --out_dir=/tmp/x   # CI
    python -m experiments.ablate_multikey --replot --refresh_results

The checkpoints (`--checkpoints`, default the shipped v4_multikey and v41_multikey) were trained on
`tasks.MultiKeySpec` with m drawn per sequence from (1, 2, 4, 8, 16); here each m is evaluated on its own
(`ms=(m,)`), with the same weights at every top-k / window (`train_lib.with_topk`, `with_window`).

* top-k sweep (`multikey_topk.*`): accuracy and indexer hit (the fraction of the m slot tokens inside a picked
  entry) vs k. An answer needs all m slots: about 2m entries of V4's overlapping ratio-4 compressor (a slot token
  lies in two entries), m entries of V4.1's ratio-2 one; so the knee should move right with m.
* window sweep (`multikey_window.*`): accuracy vs the inference window W at the trained k, and with the compressed
  path removed (compressor `wkv` zeroed: the window-only reading). The slots end `min_gap` (2 x the trained window)
  tokens before the query.
"""

from __future__ import annotations

import dataclasses
import os
import time

from absl import app, flags, logging

from experiments import plotting
from experiments import train_lib

FLAGS = flags.FLAGS
SCRIPT = "ablate_multikey"


def define_flags():
  flags.DEFINE_list("checkpoints", ["v4_multikey", "v41_multikey"], "Checkpoints trained on the multi-key task.")
  flags.DEFINE_list("ks", ["1", "2", "4", "8", "16", "32", "64"], "Top-k values.")
  flags.DEFINE_list("windows", ["4", "8", "16", "32", "64", "128"], "Inference windows.")
  flags.DEFINE_list("ms", ["1", "4", "16"], "Slot counts m evaluated.")
  flags.DEFINE_integer("eval_batches", 8, "Held-out batches per point.")
  flags.DEFINE_integer("batch", 16, "Batch size.")
  flags.DEFINE_bool("small", False, "CI: one checkpoint, two k, two windows, m = 1 and 4, one small batch.")
  flags.DEFINE_bool("replot", False, "Re-draw the plots from the tables already in the output directory.")
  plotting.define_output_flags(SCRIPT, "multikey_topk / multikey_window .csv/json/png")


def _load(name):
  d = name if os.path.isdir(name) else os.path.join(train_lib.CHECKPOINT_ROOT, name)
  config, params, info = train_lib.load_checkpoint_dir(d)
  return os.path.basename(name.rstrip("/")), config, params, train_lib.task_spec_from_info(info)


def run(checkpoints, ks, windows, ms, eval_batches: int, batch: int, out_dir: str) -> dict:
  topk_rows, win_rows = [], []
  for ck in checkpoints:
    name, config, params, spec = _load(ck)
    for m in ms:
      s = dataclasses.replace(spec, ms=(m,))
      for k in ks:
        t0 = time.time()
        e = train_lib.evaluate(params, train_lib.with_topk(config, k), s, num_batches=eval_batches, batch=batch)
        topk_rows.append(dict(model=name, variant=config.variant, m=m, k=k, trained_k=config.indexer.topk,
                              seq_len=s.seq_len, accuracy=e["accuracy"], index_hit=e["index_hit"], n=e["n"],
                              chance=1.0 / (m + 1)))
        logging.info("%s m=%d k=%d acc=%.3f hit=%.3f (%.1fs)", name, m, k, e["accuracy"], e["index_hit"],
                     time.time() - t0)
      for W in windows:
        cfg = train_lib.with_window(config, W)
        e = train_lib.evaluate(params, cfg, s, num_batches=eval_batches, batch=batch)
        e0 = train_lib.evaluate(params, cfg, s, num_batches=eval_batches, batch=batch, ablate="no_compressed")
        win_rows.append(dict(model=name, variant=config.variant, m=m, window=W, trained_window=config.attention.window,
                             k=config.indexer.topk, seq_len=s.seq_len, accuracy=e["accuracy"],
                             accuracy_no_compressed=e0["accuracy"], n=e["n"], chance=1.0 / (m + 1),
                             store_to_query=(s.seq_len - 2) - (s.store_end - 1)))
        logging.info("%s m=%d W=%d acc=%.3f window-only=%.3f", name, m, W, e["accuracy"], e0["accuracy"])
  meta = dict(checkpoints=list(checkpoints), eval_batches=eval_batches, batch=batch,
              note="chance = 1/(m+1); index_hit = fraction of the m slot tokens inside a picked entry")
  out = {}
  for stem, rows, fn in (("multikey_topk", topk_rows, plot_topk), ("multikey_window", win_rows, plot_window)):
    csv_path, json_path = plotting.write_table(rows, out_dir, stem, meta)
    out[stem] = dict(rows=rows, csv=csv_path, json=json_path, png=plotting.save_figure(fn(rows, meta), out_dir, stem))
  return out


def _panels(rows):
  models = list(dict.fromkeys(r["model"] for r in rows))
  fig, axes = plotting.new_figure(len(models), width=4.8)
  return models, fig, axes


def plot_topk(rows: list[dict], meta: dict):
  """Accuracy (filled, solid) and indexer hit (hollow, dashed) vs k, one colour per m, one panel per model."""
  models, fig, axes = _panels(rows)
  ks = sorted({r["k"] for r in rows})
  for ax, name in zip(axes, models):
    ms = sorted({r["m"] for r in rows if r["model"] == name})
    for i, m in enumerate(ms):
      r = sorted((x for x in rows if x["model"] == name and x["m"] == m), key=lambda x: x["k"])
      k = [x["k"] for x in r]
      ax.plot(k, [x["accuracy"] for x in r], label=f"m={m}: accuracy", **plotting.series_style(i, len(ms), "-"))
      ax.plot(k, [x["index_hit"] for x in r], label=f"m={m}: slots in the top-k",
              **plotting.series_style(i, len(ms), "--", hollow=True))
      ax.axhline(1.0 / (m + 1), color=f"C{i}", lw=0.8, ls=":", zorder=1, label=f"m={m}: chance")
    tk = r[0]["trained_k"]
    ax.axvline(tk, color="k", lw=0.7, ls="-.", zorder=1, label=f"trained k ({tk})")
    plotting.knob_axis(ax, ks, "indexer top-k (entries)")
    ax.set(ylabel="accuracy / fraction of slots selected", ylim=(-0.02, 1.05),
           title=f"{name}: multi-key accuracy vs top-k")
    plotting.legend_below(ax, ncol=2)
  return fig


def plot_window(rows: list[dict], meta: dict):
  """Accuracy with the trained top-k (filled) and window-only (hollow, dashed) vs W, one colour per m."""
  models, fig, axes = _panels(rows)
  ws = sorted({r["window"] for r in rows})
  for ax, name in zip(axes, models):
    ms = sorted({r["m"] for r in rows if r["model"] == name})
    for i, m in enumerate(ms):
      r = sorted((x for x in rows if x["model"] == name and x["m"] == m), key=lambda x: x["window"])
      w = [x["window"] for x in r]
      ax.plot(w, [x["accuracy"] for x in r], label=f"m={m}: trained top-k", **plotting.series_style(i, len(ms), "-"))
      ax.plot(w, [x["accuracy_no_compressed"] for x in r], label=f"m={m}: window only",
              **plotting.series_style(i, len(ms), "--", hollow=True))
    ax.axvline(r[0]["trained_window"], color="k", lw=0.7, ls=":", zorder=1,
               label=f"trained window ({r[0]['trained_window']})")
    ax.axvline(r[0]["store_to_query"], color="0.35", lw=0.9, ls="-.", zorder=1,
               label=f"W reaching the first slot ({r[0]['store_to_query']})")
    plotting.knob_axis(ax, ws, "inference window W (tokens)")
    ax.set(ylabel="accuracy", ylim=(-0.02, 1.05), title=f"{name}: multi-key accuracy vs window")
    plotting.legend_below(ax, ncol=2)
  return fig


def main(argv):
  del argv
  out_dir = plotting.output_dir()
  if FLAGS.replot:
    for stem, fn in (("multikey_topk", plot_topk), ("multikey_window", plot_window)):
      print("wrote", plotting.save_figure(fn(*plotting.read_table(out_dir, stem)), out_dir, stem))
    return
  cks, ks, ws, ms = FLAGS.checkpoints, [int(x) for x in FLAGS.ks], [int(x) for x in FLAGS.windows], \
      [int(x) for x in FLAGS.ms]
  eb, b = FLAGS.eval_batches, FLAGS.batch
  if FLAGS.small:
    cks, ks, ws, ms, eb, b = cks[:1], [2, 32], [16, 64], [1, 4], 1, 4
  out = run(cks, ks, ws, ms, eb, b, out_dir)
  for stem, o in out.items():
    print(f"wrote {o['csv']} {o['json']} {o['png']}")
    for r in o["rows"]:
      print(stem, {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})


if __name__ == "__main__":
  define_flags()
  app.run(main)
