r"""Train a small DeepSeek-V4 model on long-range key-value recall or counting, indexer included (TRAIN_NOTES.md).

Reproduce the shipped checkpoints (exact commands, incl. --stop_after, in their config.json "command"):

    python -m experiments.train --out_dir=experiments/checkpoints/v4_retrieval
    python -m experiments.train --task=count ...   # experiments/checkpoints/v4_count, see TRAIN_NOTES.md

Without --out_dir a run writes out/train/<variant>_<retrieval|count>/ (untracked), so it never overwrites a shipped
checkpoint; passing --out_dir=experiments/checkpoints/<name> (as those commands do) refreshes that checkpoint.

CI smoke run (a few steps, tiny shapes, checkpoint in a temp dir):

    python -m experiments.train --small

Two phases, each one jit compile of a fixed-shape train step:
  1. dense warm-up (`--dense_warmup_steps`): the CSA layer reads *all* visible compressed entries (top-k = M), so
     the main attention learns which entry holds the answer while the indexer is trained by the KL loss toward
     that attention distribution (DeepSeek's indexer warm-up);
  2. sparse training at the target top-k, KL loss kept on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import tempfile
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np

from experiments import tasks
from experiments import train_lib

FLAGS = flags.FLAGS
flags.DEFINE_enum("variant", "v4", ["v4", "v41"], "Model variant (v41: layer 0 window, layer 1 ratio-2 "
                  "KV-source + indexer, further layers ratio-2 reuse; train_lib.retrieval_config).")
flags.DEFINE_integer("num_layers", 2, "Layers (V4: layer 0 window-only, then CSA/HCA alternating).")
flags.DEFINE_integer("hidden_size", 64, "Hidden size.")
flags.DEFINE_integer("window", 16, "Sliding window.")
flags.DEFINE_integer("topk", 8, "Indexer top-k in the sparse phase.")
flags.DEFINE_enum("task", "kv", ["kv", "count", "multikey", "motif"], "kv: key-value recall (tasks.KVRecallSpec); "
                  "count: how often a key occurs, 1..--max_count times beyond the window (tasks.CountSpec); "
                  "multikey: the fraction of m slots that hold the key, m drawn from --ms (tasks.MultiKeySpec); "
                  "motif: language modelling of repeated motifs with switches and substitutions (tasks.MotifSpec; "
                  "loss on every position after the first period, no attention supervision: use "
                  "--dense_warmup_steps=0).")
flags.DEFINE_integer("motif_p_lo", 2, "motif task: shortest motif.")
flags.DEFINE_integer("motif_p_hi", 8, "motif task: longest motif (<= window / 2).")
flags.DEFINE_float("sub_prob", 0.03, "motif task: per-token substitution probability.")
flags.DEFINE_bool("motif_chain", False, "motif task: motifs are runs of one fixed token cycle (tasks.MotifSpec.chain: "
                  "only the wrap to the motif's first token needs the context).")
flags.DEFINE_list("ms", ["1", "2", "4", "8", "16"], "multikey task: slot counts m drawn per sequence.")
flags.DEFINE_integer("max_count", 8, "count task: maximum count C (counts uniform in 1..C).")
flags.DEFINE_bool("distractors", True, "count task: fill the unused slots with other key tokens.")
flags.DEFINE_bool("fixed_key", False, "count task: always count the same key token.")
flags.DEFINE_bool("sup_all_slots", False, "count task: attention supervision / hit over every filled slot.")
flags.DEFINE_enum("count_mode", "count", ["count", "majority"], "count task: count c, or which of two keys is "
                  "more frequent.")
flags.DEFINE_integer("seq_len", 128, "Training context length.")
flags.DEFINE_integer("num_pairs", 8, "Stored key-value pairs per sequence.")
flags.DEFINE_integer("num_queries", 4, "Queries (supervised answers) per sequence.")
flags.DEFINE_integer("batch", 16, "Batch size.")
flags.DEFINE_integer("steps", 700, "Total optimizer steps (both phases).")
flags.DEFINE_integer("dense_warmup_steps", 300, "Steps of the dense-compressed warm-up phase (0: none).")
flags.DEFINE_float("lr", 5e-3, "Peak learning rate (AdamW, linear warmup + cosine decay).")
flags.DEFINE_integer("warmup", 50, "LR warmup steps.")
flags.DEFINE_float("weight_decay", 0.01, "AdamW weight decay.")
flags.DEFINE_float("kl_weight", 1.0, "Weight of the indexer KL loss.")
flags.DEFINE_float("attn_sup_weight", 1.0, "Dense warm-up only: weight of -log(main-attention mass on the "
                   "compressed entries holding the asked pair) (attention supervision; 0 disables).")
flags.DEFINE_bool("kl_on_all", False, "Indexer KL on every position (default: answer positions only).")
flags.DEFINE_integer("seed", 0, "Init seed (data seeds are the step numbers).")
flags.DEFINE_integer("log_every", 10, "Log every N steps.")
flags.DEFINE_integer("eval_every", 100, "Held-out eval every N steps (0: only at the end).")
flags.DEFINE_integer("eval_batches", 8, "Held-out eval batches (of --batch) per context length.")
flags.DEFINE_list("eval_lens", ["128", "256", "512"], "Context lengths of the final eval.")
flags.DEFINE_string("out_dir", None, "Checkpoint directory (default: out/train/<variant>_retrieval or _count, "
                    "untracked; --small: a temp dir). --out_dir=experiments/checkpoints/<name> refreshes a shipped "
                    "checkpoint.")
flags.DEFINE_bool("small", False, "CI smoke run: tiny shapes, a few steps, checkpoint in a temp dir.")
flags.DEFINE_float("max_minutes", 14.0, "Stop training (and save) after this wall time.")
flags.DEFINE_integer("stop_after", 0, "Stop (and save) after this many steps without changing the LR schedule "
                     "(0: run --steps); reproduces a run that --max_minutes cut short.")


def _batch(spec, seed, B):
  b = tasks.make_batch(spec, seed, B)
  return {k: jnp.asarray(b[k]) for k in ("tokens", "targets", "mask", "src_pos")}


def train(argv_cmd: str) -> dict:
  small = FLAGS.small
  seq_len, batch, steps, dense = FLAGS.seq_len, FLAGS.batch, FLAGS.steps, FLAGS.dense_warmup_steps
  eval_lens = [int(x) for x in FLAGS.eval_lens]
  window, num_pairs, num_queries, eval_batches = FLAGS.window, FLAGS.num_pairs, FLAGS.num_queries, FLAGS.eval_batches
  max_count = FLAGS.max_count
  if small:
    seq_len, batch, steps, dense, window, num_pairs, num_queries = 64, 2, 2, 2, 8, 2, 2
    eval_lens, eval_batches, max_count = [64], 1, 3
  config = train_lib.retrieval_config(FLAGS.variant, num_layers=FLAGS.num_layers, window=window, vocab_size=64,
                                      index_topk=FLAGS.topk, hidden_size=FLAGS.hidden_size)
  if FLAGS.task == "count":
    spec = tasks.CountSpec(seq_len=seq_len, max_count=max_count, min_gap=max(2 * window, 8),
                           distractors=FLAGS.distractors, fixed_key=FLAGS.fixed_key,
                           sup_all_slots=FLAGS.sup_all_slots, mode=FLAGS.count_mode)
    config = dataclasses.replace(config, name=config.name.replace("retrieval", "count"))
  elif FLAGS.task == "multikey":
    ms = tuple(int(m) for m in FLAGS.ms)
    if small:
      ms = (1, 2)
    spec = tasks.MultiKeySpec(seq_len=seq_len, ms=ms, min_gap=max(2 * window, 8))
    config = dataclasses.replace(config, name=config.name.replace("retrieval", "multikey"))
  elif FLAGS.task == "motif":
    p_hi = min(FLAGS.motif_p_hi, window // 2) if small else FLAGS.motif_p_hi
    if 2 * p_hi > window:
      raise app.UsageError(f"--motif_p_hi={p_hi}: two periods must fit the window ({window})")
    spec = tasks.MotifSpec(seq_len=seq_len, p_lo=FLAGS.motif_p_lo, p_hi=p_hi, sub_prob=FLAGS.sub_prob,
                           chain=FLAGS.motif_chain)
    config = dataclasses.replace(config, name=config.name.replace("retrieval", "motif"))
  else:
    spec = tasks.KVRecallSpec(seq_len=seq_len, num_pairs=num_pairs, num_queries=num_queries,
                              min_gap=max(2 * window, 8))
  spec.validate()
  # Attention supervision needs the answer's far sources (src_pos); the motif task has none (all -1), so the term
  # would be -log(0) at every position: off. The indexer KL stays (it ranks entries like the main attention does).
  attn_sup_weight = 0.0 if FLAGS.task == "motif" else FLAGS.attn_sup_weight
  default_name = f"{FLAGS.variant}_{dict(kv='retrieval').get(FLAGS.task, FLAGS.task)}"
  out_dir = FLAGS.out_dir or (tempfile.mkdtemp(prefix="dsv4_train_small_") if small else
                              os.path.join("out", "train", default_name))
  logging.info("config %s\ntask %s\nout_dir %s", config, spec, out_dir)

  params = train_lib.init(config, FLAGS.seed)
  fparams, iparams = train_lib.split_params(params)
  opt, sched = train_lib.make_optimizer(FLAGS.lr, FLAGS.warmup, steps, FLAGS.weight_decay)
  opt_state = opt.init(fparams)
  dense_cfg = train_lib.with_topk(config, train_lib.dense_topk(config, seq_len))
  phases = [(dense_cfg, min(dense, steps), "dense"), (config, steps - min(dense, steps), "sparse")]
  history, evals = [], []
  t_start = time.time()
  step = 0
  stopped_early = False
  t_last, step_last = time.time(), 0
  for cfg, n, phase in phases:
    if n <= 0:
      continue
    train_step = train_lib.make_train_step(cfg, opt, FLAGS.kl_weight, FLAGS.kl_on_all,
                                           attn_sup_weight if phase == "dense" else 0.0)
    for _ in range(n):
      fparams, opt_state, m = train_step(fparams, iparams, opt_state, _batch(spec, step, batch))
      step += 1
      if step % FLAGS.log_every == 0 or step == 1 or step == steps:
        m = {k: float(v) for k, v in m.items()}
        now = time.time()
        rec = dict(step=step, phase=phase, lr=float(sched(step)), wall_s=round(now - t_start, 1),
                   step_s=round((now - t_last) / max(step - step_last, 1), 3), **m)
        t_last, step_last = now, step
        history.append(rec)
        logging.info("step %d [%s] loss %.4f ce %.4f kl %.4f sup %.3f acc %.3f gnorm %.2f (%.2fs/step, %.0fs)", step,
                     phase, m["loss"], m["ce"], m["kl"], m["attn_sup"], m["acc"], m["gnorm"], rec["step_s"],
                     rec["wall_s"])
      if FLAGS.eval_every and step % FLAGS.eval_every == 0 and step < steps:
        params = train_lib.merge_params(fparams, iparams)
        e = train_lib.evaluate(params, config, spec, num_batches=2, batch=batch)
        evals.append(dict(step=step, seq_len=seq_len, **e))
        logging.info("eval step %d: %s", step, e)
      if (time.time() - t_start) / 60 > FLAGS.max_minutes or (FLAGS.stop_after and step >= FLAGS.stop_after):
        stopped_early = True
        break
    if stopped_early:
      logging.warning("stopping at step %d (--max_minutes / --stop_after)", step)
      break
  train_s = time.time() - t_start

  params = train_lib.merge_params(fparams, iparams)
  final = {}
  for T in eval_lens:
    s = dataclasses.replace(spec, seq_len=T)
    final[str(T)] = dict(full_topk=train_lib.evaluate(params, config, s, num_batches=eval_batches, batch=batch),
                         no_compressed=train_lib.evaluate(params, config, s, num_batches=eval_batches, batch=batch,
                                                          ablate="no_compressed"))
    logging.info("final eval T=%d: %s", T, final[str(T)])
  meta = dict(task=dataclasses.asdict(spec), command=argv_cmd, steps_done=step, train_seconds=round(train_s, 1),
              final_eval=final, small=small,
              flags={k: FLAGS[k].value for k in ("task", "max_count", "distractors", "fixed_key", "sup_all_slots",
                                                  "ms", "count_mode", "motif_p_lo", "motif_p_hi", "sub_prob", "motif_chain", "variant", "num_layers", "hidden_size", "window",
                                                  "topk",
                                                  "seq_len", "num_pairs", "num_queries", "batch", "steps",
                                                  "dense_warmup_steps", "lr", "warmup", "weight_decay",
                                                  "kl_weight", "attn_sup_weight", "kl_on_all", "seed")})
  train_lib.save_checkpoint(params, config, out_dir, meta)
  with open(os.path.join(out_dir, "train_log.json"), "w") as f:
    json.dump(dict(history=history, evals=evals, final_eval=final), f, indent=1)
  logging.info("saved %s (%.0fs training)", out_dir, train_s)
  return dict(out_dir=out_dir, final_eval=final, steps=step, train_seconds=train_s)


def main(argv):
  del argv
  cmd = "python -m experiments.train " + " ".join(shlex.quote(a) for a in sys.argv[1:])
  out = train(cmd)
  print(json.dumps(dict(out_dir=out["out_dir"], steps=out["steps"], train_seconds=round(out["train_seconds"], 1),
                        final_eval=out["final_eval"]), indent=1))


if __name__ == "__main__":
  app.run(main)
