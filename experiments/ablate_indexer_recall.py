r"""Indexer recall@k with bf16 / FP8 / FP4 index keys, and what it costs in task accuracy (recall_lib).

    python -m experiments.ablate_indexer_recall          # full run -> out/ablate_indexer_recall/indexer_recall.*
    python -m experiments.ablate_indexer_recall --refresh_results   # the committed experiments/results/
    python -m experiments.ablate_indexer_recall --small --out_dir=/tmp/x   # CI
    python -m experiments.ablate_indexer_recall --replot --refresh_results

Three parts, one table (`part` column):

* `random`: an indexer with random weights at V4-Flash width (64 heads x 128, ratio 4) and V4.1-Flash width
  (32 x 128, ratio 2) over the entries of a 8k..128k context (recall_lib.random_indexer), a few query positions;
* `trained`: the trained tiny models (indexer 8 heads x 32) on the multi-key task text at long context: the prefix
  is prefilled, its index-key pool quantized, and the last query positions scored against it;
* `accuracy`: the same models at their training length, answer accuracy with each key format and top-k, per m
  (the number of slots the answer needs), the cost of the recall lost.

recall@k = |top-k(format) ∩ top-k(fp32)| / k per query position (queries and head weights fp32).
"""

from __future__ import annotations

import dataclasses
import os
import time

from absl import app, flags, logging
import numpy as np

from experiments import plotting
from experiments import recall_lib
from experiments import tasks
from experiments import train_lib

FLAGS = flags.FLAGS
SCRIPT = "ablate_indexer_recall"
QUANT = ("bf16", "fp8", "fp4")


def define_flags():
  flags.DEFINE_list("ks", ["64", "128", "256", "512", "1024", "2048"], "Top-k values (random and long context).")
  flags.DEFINE_list("contexts", ["8192", "16384", "32768", "65536", "131072"], "Random-indexer context lengths.")
  flags.DEFINE_integer("queries", 16, "Query positions per random-indexer point.")
  flags.DEFINE_list("checkpoints", ["v4_multikey", "v41_multikey"], "Trained checkpoints.")
  flags.DEFINE_list("trained_contexts", ["4096"], "Context lengths for the trained models' recall.")
  flags.DEFINE_list("acc_ks", ["4", "8", "16", "32"], "Top-k values of the accuracy part.")
  flags.DEFINE_list("ms", ["1", "4", "16"], "Slot counts m of the accuracy part.")
  flags.DEFINE_integer("eval_batches", 4, "Accuracy batches per point.")
  flags.DEFINE_integer("batch", 16, "Accuracy batch size.")
  flags.DEFINE_bool("trained_only", False, "Only the trained models' recall at --trained_contexts, written as its "
                    "own table `indexer_recall_trained` (no plot): the long-context rows beside the main run's.")
  flags.DEFINE_bool("small", False, "CI: random part only, two contexts, two k, few queries.")
  flags.DEFINE_bool("replot", False, "Re-draw the plot from the table already in the output directory (no sweep).")
  plotting.define_output_flags(SCRIPT, "indexer_recall.csv/json/png")


FLASH = {"v4_flash": (64, 128, 4), "v41_flash": (32, 128, 2)}   # indexer heads, dim, ratio (dsv4/config.py)


def random_part(contexts, ks, queries: int, seed: int = 0) -> list[dict]:
  rows = []
  for name, (H, C, ratio) in FLASH.items():
    for T in contexts:
      M = T // ratio
      q, w, k = recall_lib.random_indexer(H, C, M, queries, seed)
      ref = recall_lib.index_scores(q, w, k)
      for fmt in QUANT:
        s = recall_lib.index_scores(q, w, recall_lib.quantize_keys(k, fmt))
        for kk in ks:
          if kk >= M:
            continue
          rows.append(dict(part="random", model=f"random {name} width", key_format=fmt, context=T, entries=M,
                           k=kk, recall=recall_lib.recall_at_k(ref, s, kk), queries=queries,
                           key_bytes_per_entry=recall_lib.KEY_BYTES[fmt](C), index_heads=H, index_dim=C))
      logging.info("random %s T=%d done", name, T)
  return rows


def _load(name):
  d = name if os.path.isdir(name) else os.path.join(train_lib.CHECKPOINT_ROOT, name)
  config, params, info = train_lib.load_checkpoint_dir(d)
  return os.path.basename(name.rstrip("/")), config, params, train_lib.task_spec_from_info(info)


def trained_part(checkpoints, contexts, ks, num_query: int = 8, batch: int = 2) -> list[dict]:
  rows = []
  for ck in checkpoints:
    name, config, params, spec = _load(ck)
    for T in contexts:
      s = dataclasses.replace(spec, seq_len=T, ms=(max(spec.ms),)) if isinstance(spec, tasks.MultiKeySpec) else \
          dataclasses.replace(spec, seq_len=T)
      b = tasks.make_batch(s, tasks.EVAL_SEED_BASE + 3, batch)
      t0 = time.time()
      out = recall_lib.prefill_then_query(params, config, b["tokens"], num_query)
      for li, ref in enumerate(out["fp32"][1]):
        ref = ref.reshape(-1, ref.shape[-1])
        M = int(np.isfinite(ref).sum(-1).max())
        for fmt in QUANT:
          sc = out[fmt][1][li].reshape(-1, ref.shape[-1])
          for kk in ks:
            if kk >= M:
              continue
            rows.append(dict(part="trained", model=name, key_format=fmt, context=T, entries=M, k=kk,
                             recall=recall_lib.recall_at_k(ref, sc, kk), queries=ref.shape[0],
                             key_bytes_per_entry=recall_lib.KEY_BYTES[fmt](config.indexer.head_dim),
                             index_heads=config.indexer.num_heads, index_dim=config.indexer.head_dim))
      logging.info("trained %s T=%d (%.0fs)", name, T, time.time() - t0)
  return rows


def accuracy_part(checkpoints, ks, ms, eval_batches: int, batch: int) -> list[dict]:
  rows = []
  for ck in checkpoints:
    name, config, params, spec = _load(ck)
    T = spec.seq_len
    for m in ms:
      s = dataclasses.replace(spec, ms=(m,)) if isinstance(spec, tasks.MultiKeySpec) else spec
      for kk in ks:
        cfg = train_lib.with_topk(config, kk)
        hits = {f: 0 for f in recall_lib.FORMATS}
        rec = {f: [] for f in QUANT}
        n = 0
        for b in tasks.eval_batches(s, eval_batches, batch):
          out = recall_lib.prefill_then_query(params, cfg, b["tokens"], 3)
          ans = b["targets"][:, T - 2]
          ref = out["fp32"][1][0][:, 1]     # the answer position's scores (query step: SEP, K, answer)
          for f, (lg, sc) in out.items():
            hits[f] += int(np.sum(lg[:, 1].argmax(-1) == ans))
            if f in rec:
              rec[f].append(recall_lib.recall_at_k(ref, sc[0][:, 1], kk))
          n += len(ans)
        for f in recall_lib.FORMATS:
          rows.append(dict(part="accuracy", model=name, key_format=f, context=T, m=m, k=kk, accuracy=hits[f] / n,
                           recall=float(np.mean(rec[f])) if f in rec else 1.0, n=n, chance=1.0 / (m + 1)))
        logging.info("accuracy %s m=%d k=%d: %s", name, m, kk, {f: hits[f] / n for f in hits})
  return rows


def run(out_dir: str, *, contexts, ks, queries, checkpoints, trained_contexts, acc_ks, ms, eval_batches,
        batch) -> dict:
  rows = random_part(contexts, ks, queries)
  if checkpoints:
    rows += trained_part(checkpoints, trained_contexts, ks)
    rows += accuracy_part(checkpoints, acc_ks, ms, eval_batches, batch)
  meta = dict(note="recall = |top-k(format keys) ∩ top-k(fp32 keys)| / k; fp8 = per-row e4m3 (FP8 index-key pool), "
                   "fp4 = MXFP4 e2m1 per 32 channels (V4.1 / NeMo); queries fp32")
  csv_path, json_path = plotting.write_table(rows, out_dir, "indexer_recall", meta)
  png = plotting.save_figure(plot(rows, meta), out_dir, "indexer_recall")
  return dict(rows=rows, csv=csv_path, json=json_path, png=png)


def plot(rows: list[dict], meta: dict):
  """(1) random Flash-width recall vs k at the longest context; (2) the same vs context at k = 512; (3) trained
  models' recall vs k at long context; (4) accuracy vs top-k at the largest m, one colour per key format."""
  parts = {r["part"] for r in rows}
  ncol = 2 + ("trained" in parts) + ("accuracy" in parts)
  fig, axes = plotting.new_figure(ncol, width=4.4)
  fmt_i = {f: i for i, f in enumerate(("fp32",) + QUANT)}
  rnd = [r for r in rows if r["part"] == "random"]
  Tmax = max(r["context"] for r in rnd)
  ax = axes[0]
  models = sorted({r["model"] for r in rnd})
  for mi, m in enumerate(models):
    for f in QUANT:
      r = sorted((x for x in rnd if x["model"] == m and x["key_format"] == f and x["context"] == Tmax),
                 key=lambda x: x["k"])
      st = plotting.series_style(fmt_i[f], 4, ("-", "--")[mi % 2], hollow=mi % 2 == 1)
      ax.plot([x["k"] for x in r], [x["recall"] for x in r], label=f"{f} keys, {m}", **st)
  plotting.knob_axis(ax, sorted({x["k"] for x in rnd}), "indexer top-k")
  ax.set(ylabel="recall@k (of the fp32-key top-k)", title=f"random weights, context {Tmax // 1024}k")
  plotting.legend_below(ax, ncol=1)
  ax = axes[1]
  k_ref = 512 if any(x["k"] == 512 for x in rnd) else max(x["k"] for x in rnd)
  for mi, m in enumerate(models):
    for f in QUANT:
      r = sorted((x for x in rnd if x["model"] == m and x["key_format"] == f and x["k"] == k_ref),
                 key=lambda x: x["context"])
      st = plotting.series_style(fmt_i[f], 4, ("-", "--")[mi % 2], hollow=mi % 2 == 1)
      ax.plot([x["context"] for x in r], [x["recall"] for x in r], label=f"{f} keys, {m}", **st)
  plotting.knob_axis(ax, sorted({x["context"] for x in rnd}), "context (tokens)")
  ax.set(ylabel=f"recall@{k_ref}", title=f"random weights, top-k {k_ref}")
  plotting.legend_below(ax, ncol=1)
  col = 2
  if "trained" in parts:
    ax = axes[col]
    col += 1
    tr = [r for r in rows if r["part"] == "trained"]
    for mi, m in enumerate(sorted({x["model"] for x in tr})):
      for f in QUANT:
        r = sorted((x for x in tr if x["model"] == m and x["key_format"] == f), key=lambda x: x["k"])
        T = r[0]["context"] if r else 0
        st = plotting.series_style(fmt_i[f], 4, ("-", "--")[mi % 2], hollow=mi % 2 == 1)
        ax.plot([x["k"] for x in r], [x["recall"] for x in r], label=f"{f} keys, {m} (T={T})", **st)
    plotting.knob_axis(ax, sorted({x["k"] for x in tr}), "indexer top-k")
    ax.set(ylabel="recall@k", title="trained tiny models (8 x 32 indexer)")
    plotting.legend_below(ax, ncol=1)
  if "accuracy" in parts:
    ax = axes[col]
    ac = [r for r in rows if r["part"] == "accuracy"]
    mmax = max(x["m"] for x in ac)
    for mi, m in enumerate(sorted({x["model"] for x in ac})):
      for f in ("fp32",) + QUANT:
        r = sorted((x for x in ac if x["model"] == m and x["key_format"] == f and x["m"] == mmax),
                   key=lambda x: x["k"])
        st = plotting.series_style(fmt_i[f], 4, ("-", "--")[mi % 2], hollow=mi % 2 == 1)
        ax.plot([x["k"] for x in r], [x["accuracy"] for x in r], label=f"{f} keys, {m}", **st)
    ax.axhline(1.0 / (mmax + 1), color="gray", lw=0.8, zorder=20, label="chance")
    plotting.knob_axis(ax, sorted({x["k"] for x in ac}), "indexer top-k")
    ax.set(ylabel="task accuracy", ylim=(-0.02, 1.05), title=f"multi-key task, m = {mmax}")
    plotting.legend_below(ax, ncol=1)
  return fig


def main(argv):
  del argv
  out_dir = plotting.output_dir()
  if FLAGS.replot:
    print("wrote", plotting.replot(plot, out_dir, "indexer_recall"))
    return
  if FLAGS.trained_only:
    rows = trained_part(FLAGS.checkpoints, [int(x) for x in FLAGS.trained_contexts], [int(x) for x in FLAGS.ks])
    csv_path, _ = plotting.write_table(rows, out_dir, "indexer_recall_trained",
                                       dict(note="trained models' recall@k at long context (prefill in chunks)"))
    print("wrote", csv_path)
    for r in rows:
      print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})
    return
  if FLAGS.small:
    out = run(out_dir, contexts=[8192, 16384], ks=[64, 512], queries=2, checkpoints=[], trained_contexts=[],
              acc_ks=[], ms=[], eval_batches=0, batch=0)
  else:
    out = run(out_dir, contexts=[int(x) for x in FLAGS.contexts], ks=[int(x) for x in FLAGS.ks],
              queries=FLAGS.queries, checkpoints=FLAGS.checkpoints,
              trained_contexts=[int(x) for x in FLAGS.trained_contexts], acc_ks=[int(x) for x in FLAGS.acc_ks],
              ms=[int(x) for x in FLAGS.ms], eval_batches=FLAGS.eval_batches, batch=FLAGS.batch)
  print(f"wrote {out['csv']} {out['json']} {out['png']}")
  for r in out["rows"]:
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})


if __name__ == "__main__":
  define_flags()
  app.run(main)
