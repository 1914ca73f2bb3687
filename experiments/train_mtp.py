r"""Train an MTP draft block for a shipped tiny model (its backbone frozen) and measure its acceptance rate.

    python -m experiments.train_mtp --model=v4_retrieval        # -> out/train_mtp/v4_retrieval_mtp/
    python -m experiments.train_mtp --small                     # CI smoke run (a few steps, temp dir)

Self-distillation on the model's own task sequences (experiments/mtp_lib.py): the block at position t learns the
backbone's distribution at t + 1. Reported, before and after training: teacher-forced greedy acceptance of one draft
on held-out task sequences (all positions) and on the backbone's greedy free continuations of task prompts.
The checkpoint (orbax params incl. `mtp`, config.json with num_mtp_layers = 1 and this command) loads with
`experiments.train_lib.load_trained(DIR)`; the backbone's arrays are the shipped ones, unchanged.
"""

from __future__ import annotations

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

from experiments import mtp_lib
from experiments import tasks
from experiments import train_lib

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "v4_retrieval", "Shipped checkpoint name (experiments/checkpoints/) or directory.")
flags.DEFINE_integer("steps", 300, "Optimizer steps.")
flags.DEFINE_integer("batch", 16, "Sequences per step.")
flags.DEFINE_float("lr", 3e-3, "Peak learning rate (AdamW, warmup + cosine).")
flags.DEFINE_integer("seed", 0, "Init seed of the block (data seeds are offsets of the step number).")
flags.DEFINE_integer("eval_batches", 4, "Held-out batches (of --batch) for the acceptance figures.")
flags.DEFINE_integer("gen_tokens", 24, "Free-continuation length for the acceptance on generated text.")
flags.DEFINE_string("out_dir", None, "Checkpoint directory (default out/train_mtp/<model>_mtp; --small: temp dir).")
flags.DEFINE_bool("small", False, "CI smoke run: 2 steps, 1 eval batch of 2, 4 generated tokens.")
flags.DEFINE_integer("recursion_depth", 1, "Drafts per step the block is trained for: 1 = the depth-1 objective "
                     "only; k > 1 adds the engine's recursion (drafts 2 .. k read the block's own stream and "
                     "previous draft; mtp_lib.recursive_passes), one random frontier per sequence.")
flags.DEFINE_float("rec_weight", 1.0, "Weight of the recursion drafts' KL (--recursion_depth > 1).")
flags.DEFINE_integer("eval_k", 5, "Drafts per step of the engine-like acceptance on free continuations "
                     "(mtp_lib.engine_acceptance).")

_EVAL_SEED = 1_000_000   # held-out data: seeds no training step uses


def _eval(params, config, spec, batches, batch, gen_tokens, eval_k=0):
  held = [tasks.make_batch(spec, _EVAL_SEED + i, batch)["tokens"] for i in range(batches)]
  task_acc = float(np.mean([mtp_lib.acceptance(params, config, t) for t in held]))
  cut = spec.seq_len // 2
  gen = []
  for t in held:
    cont, w = mtp_lib.greedy_continuations(params, config, t[:, :cut], gen_tokens)
    gen.append(mtp_lib.acceptance(params, config, cont, w))
  out = dict(task=round(task_acc, 4), free_generation=round(float(np.mean(gen)), 4))
  if eval_k:
    # k recursive drafts per frontier, every 4th position of the continuations, as the engine accepts them
    P, L = cut, cut + gen_tokens
    frontiers = list(range(P - 1, L - 1 - eval_k, 4)) or [P - 1]
    eng = [mtp_lib.engine_acceptance(params, config, mtp_lib.greedy_continuations(params, config, t[:, :cut],
                                                                                  gen_tokens)[0], frontiers, eval_k)
           for t in held]
    out[f"free_k{eval_k}_by_depth"] = [round(float(x), 4) for x in np.mean([e["by_depth"] for e in eng], axis=0)]
    out[f"free_k{eval_k}_acceptance_length"] = round(float(np.mean([e["acceptance_length"] for e in eng])), 3)
  return out


def main(argv):
  del argv
  cmd = "python -m experiments.train_mtp " + " ".join(shlex.quote(a) for a in sys.argv[1:])
  steps, batch, eval_batches, gen_tokens = FLAGS.steps, FLAGS.batch, FLAGS.eval_batches, FLAGS.gen_tokens
  depth, eval_k = FLAGS.recursion_depth, FLAGS.eval_k
  if FLAGS.small:
    steps, batch, eval_batches, gen_tokens = 2, 2, 1, 4
    eval_k = min(eval_k, 2)
  if depth < 1:
    raise app.UsageError(f"--recursion_depth={depth}: must be >= 1")
  directory = FLAGS.model if os.path.isdir(FLAGS.model) else os.path.join(train_lib.CHECKPOINT_ROOT, FLAGS.model)
  if not os.path.isdir(directory):
    raise app.UsageError(f"--model: no checkpoint directory {directory!r}")
  config, params, info = train_lib.load_checkpoint_dir(directory)
  if config.variant != "v4":
    raise app.UsageError(f"--model: MTP blocks are V4-only; {FLAGS.model!r} is {config.variant}")
  spec = train_lib.task_spec_from_info(info)
  out_dir = FLAGS.out_dir or (tempfile.mkdtemp(prefix="dsv4_train_mtp_") if FLAGS.small else
                              os.path.join("out", "train_mtp", os.path.basename(directory.rstrip("/")) + "_mtp"))
  config, params = mtp_lib.add_mtp(config, params, FLAGS.seed)
  before = _eval(params, config, spec, eval_batches, batch, gen_tokens, eval_k)
  logging.info("acceptance before training: %s", before)

  opt, _ = train_lib.make_optimizer(FLAGS.lr, max(1, steps // 10), steps)
  mtp_params = params["mtp"]
  backbone = {k: v for k, v in params.items() if k != "mtp"}
  opt_state = opt.init(mtp_params)
  if depth == 1:
    train_step = mtp_lib.make_train_step(config, opt)
  else:
    rec_step = mtp_lib.make_recursive_train_step(config, opt, depth, FLAGS.rec_weight)
    T = spec.seq_len
    if T // 4 > T - 1 - depth:
      raise app.UsageError(f"--recursion_depth={depth}: too deep for sequences of {T}")

    def train_step(mtp_params, backbone, opt_state, toks):   # one random frontier per row, f + k <= T - 1
      fr = np.random.default_rng(step).integers(T // 4, T - depth, size=toks.shape[0]).astype(np.int32)
      mtp_params, opt_state, loss, (acc, acc_rec) = rec_step(mtp_params, backbone, opt_state, toks, jnp.asarray(fr))
      train_step.acc_rec = acc_rec
      return mtp_params, opt_state, loss, acc
  history, t0 = [], time.time()
  for step in range(1, steps + 1):
    toks = jnp.asarray(tasks.make_batch(spec, step, batch)["tokens"])
    mtp_params, opt_state, loss, acc = train_step(mtp_params, backbone, opt_state, toks)
    if step % 25 == 0 or step in (1, steps):
      history.append(dict(step=step, kl=round(float(loss), 4), accept=round(float(acc), 4),
                          wall_s=round(time.time() - t0, 1)))
      if depth > 1:
        history[-1]["accept_recursion"] = round(float(train_step.acc_rec), 4)
      logging.info("step %d: %s", step, history[-1])
  params = {**backbone, "mtp": mtp_params}
  after = _eval(params, config, spec, eval_batches, batch, gen_tokens, eval_k)
  logging.info("acceptance after training: %s", after)
  meta = dict(task=info["task"], command=cmd, base_model=FLAGS.model, steps_done=steps,
              train_seconds=round(time.time() - t0, 1), acceptance_before=before, acceptance_after=after,
              recursion_depth=depth, rec_weight=FLAGS.rec_weight, small=FLAGS.small)
  train_lib.save_checkpoint(params, config, out_dir, meta)
  with open(os.path.join(out_dir, "train_log.json"), "w") as f:
    json.dump(dict(history=history, acceptance_before=before, acceptance_after=after), f, indent=1)
  print(json.dumps(dict(out_dir=out_dir, steps=steps, acceptance_before=before, acceptance_after=after), indent=1))


if __name__ == "__main__":
  app.run(main)
