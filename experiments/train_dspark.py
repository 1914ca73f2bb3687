r"""Train a DSpark drafter (V4.1's block drafter, dsv4/dspark.py) for a shipped tiny V4.1 model, its backbone frozen,
and measure its acceptance.

    python -m experiments.train_dspark --model=v41_motif      # -> out/train_dspark/v41_motif_dspark/
    python -m experiments.train_dspark --small                 # CI smoke run (a few steps, temp dir)

Self-distillation at every anchor of the model's own task sequences (experiments/dspark_lib.py). Reported, before and
after training: teacher-forced single-slot agreement on held-out task sequences, and the engine-like acceptance of
--eval_k drafts per block (by depth, and the acceptance length 1 + mean accepted) from anchors on the backbone's
greedy continuations of held-out prompts. The checkpoint (orbax params incl. `mtp`, config.json with the DSpark
config and this command) loads with `experiments.train_lib.load_trained(DIR)`; the backbone's arrays are the
shipped ones, unchanged.
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

from dsv4.config import DSparkConfig
from experiments import dspark_lib
from experiments import mtp_lib
from experiments import tasks
from experiments import train_lib

FLAGS = flags.FLAGS
flags.DEFINE_string("model", "v41_motif", "Shipped V4.1 checkpoint name (experiments/checkpoints/) or directory.")
flags.DEFINE_integer("steps", 400, "Optimizer steps.")
flags.DEFINE_integer("batch", 16, "Sequences per step.")
flags.DEFINE_float("lr", 3e-3, "Peak learning rate (AdamW, warmup + cosine).")
flags.DEFINE_integer("seed", 0, "Init seed of the drafter (data seeds are the step numbers).")
flags.DEFINE_integer("stages", 3, "DSpark stages (the released drafter has 3).")
flags.DEFINE_integer("block_size", 7, "Drafts per pass (the released drafter: 5; 7 lets the engine run k = 1..7).")
flags.DEFINE_list("target_layers", [], "Backbone layers whose input streams are the features (default: every "
                  "layer after the first).")
flags.DEFINE_integer("markov_rank", 16, "Rank of the Markov transition head.")
flags.DEFINE_integer("experts", 4, "Routed experts per stage.")
flags.DEFINE_integer("experts_per_tok", 2, "Routed experts per token.")
flags.DEFINE_integer("noise_token", 2, "Input id of the block's positions after the anchor (the tiny tasks never "
                     "use id 2 inside a sequence body: it is SEP).")
flags.DEFINE_integer("eval_batches", 4, "Held-out batches (of --batch) for the acceptance figures.")
flags.DEFINE_integer("gen_tokens", 48, "Free-continuation length for the engine-like acceptance.")
flags.DEFINE_integer("eval_k", 5, "Drafts per block of the engine-like acceptance.")
flags.DEFINE_string("out_dir", None, "Checkpoint directory (default out/train_dspark/<model>_dspark; --small: temp "
                    "dir).")
flags.DEFINE_bool("small", False, "CI smoke run: 2 steps, 1 eval batch of 2, 8 generated tokens.")

_EVAL_SEED = 1_000_000   # held-out data: seeds no training step uses


def _eval(params, config, spec, batches, batch, gen_tokens, k):
  held = [tasks.make_batch(spec, _EVAL_SEED + i, batch)["tokens"] for i in range(batches)]
  B, T = held[0].shape
  agree = [float(dspark_lib.distill_loss(params["mtp"], params, config, jnp.asarray(t))[1]) for t in held]
  cut = T // 2
  by_depth, lengths = [], []
  for t in held:
    cont, _ = mtp_lib.greedy_continuations(params, config, t[:, :cut], gen_tokens)
    anchors = list(range(cut - 1, cut + gen_tokens - 1 - k))
    got = dspark_lib.engine_acceptance(params, config, cont, anchors, k)
    by_depth.append(got["by_depth"])
    lengths.append(got["acceptance_length"])
  return {"task_slot_agreement": round(float(np.mean(agree)), 4),
          f"free_k{k}_by_depth": [round(float(x), 4) for x in np.mean(by_depth, axis=0)],
          f"free_k{k}_acceptance_length": round(float(np.mean(lengths)), 3)}


def main(argv):
  del argv
  cmd = "python -m experiments.train_dspark " + " ".join(shlex.quote(a) for a in sys.argv[1:])
  steps, batch, eval_batches, gen_tokens, k = FLAGS.steps, FLAGS.batch, FLAGS.eval_batches, FLAGS.gen_tokens, \
      FLAGS.eval_k
  if FLAGS.small:
    steps, batch, eval_batches, gen_tokens = 2, 2, 1, 8
    k = min(k, 2)
  directory = FLAGS.model if os.path.isdir(FLAGS.model) else os.path.join(train_lib.CHECKPOINT_ROOT, FLAGS.model)
  if not os.path.isdir(directory):
    raise app.UsageError(f"--model: no checkpoint directory {directory!r}")
  for name, lo in (("block_size", 1), ("stages", 1), ("markov_rank", 1), ("experts", 1), ("experts_per_tok", 1),
                   ("steps", 1), ("batch", 1)):
    if getattr(FLAGS, name) < lo:
      raise app.UsageError(f"--{name}={getattr(FLAGS, name)}: must be >= {lo}")
  if FLAGS.experts_per_tok > FLAGS.experts:
    raise app.UsageError(f"--experts_per_tok={FLAGS.experts_per_tok}: at most --experts={FLAGS.experts}")
  if not 1 <= k <= FLAGS.block_size:
    raise app.UsageError(f"--eval_k={k}: must be in 1..--block_size={FLAGS.block_size}")
  config, params, info = train_lib.load_checkpoint_dir(directory)
  if config.variant != "v41":
    raise app.UsageError(f"--model: DSpark is V4.1's drafter; {FLAGS.model!r} is {config.variant} "
                         f"(V4: experiments/train_mtp.py)")
  targets = tuple(int(x) for x in FLAGS.target_layers) or tuple(range(1, config.num_layers)) or (0,)
  ds = DSparkConfig(block_size=FLAGS.block_size, target_layer_ids=targets, markov_rank=FLAGS.markov_rank,
                    noise_token_id=FLAGS.noise_token, n_routed_experts=FLAGS.experts,
                    num_experts_per_tok=FLAGS.experts_per_tok)
  spec = train_lib.task_spec_from_info(info)
  out_dir = FLAGS.out_dir or (tempfile.mkdtemp(prefix="dsv4_train_dspark_") if FLAGS.small else
                              os.path.join("out", "train_dspark", os.path.basename(directory.rstrip("/")) + "_dspark"))
  try:   # target layers and the noise token are checked against the loaded model's config
    config, params = dspark_lib.add_dspark(config, params, ds, FLAGS.stages, FLAGS.seed)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  before = _eval(params, config, spec, eval_batches, batch, gen_tokens, k)
  logging.info("before training: %s", before)

  opt, _ = train_lib.make_optimizer(FLAGS.lr, max(1, steps // 10), steps)
  draft = params["mtp"]
  backbone = {key: v for key, v in params.items() if key != "mtp"}
  opt_state = opt.init(draft)
  train_step = dspark_lib.make_train_step(config, opt)
  history, t0 = [], time.time()
  for step in range(1, steps + 1):
    toks = jnp.asarray(tasks.make_batch(spec, step, batch)["tokens"])
    draft, opt_state, loss, acc = train_step(draft, backbone, opt_state, toks)
    if step % 25 == 0 or step in (1, steps):
      history.append(dict(step=step, kl=round(float(loss), 4), slot_agreement=round(float(acc), 4),
                          wall_s=round(time.time() - t0, 1)))
      logging.info("step %d: %s", step, history[-1])
  params = {**backbone, "mtp": draft}
  after = _eval(params, config, spec, eval_batches, batch, gen_tokens, k)
  logging.info("after training: %s", after)
  meta = dict(task=info["task"], command=cmd, base_model=FLAGS.model, steps_done=steps,
              train_seconds=round(time.time() - t0, 1), acceptance_before=before, acceptance_after=after,
              small=FLAGS.small)
  train_lib.save_checkpoint(params, config, out_dir, meta)
  with open(os.path.join(out_dir, "train_log.json"), "w") as f:
    json.dump(dict(history=history, acceptance_before=before, acceptance_after=after), f, indent=1)
  print(json.dumps(dict(out_dir=out_dir, steps=steps, acceptance_before=before, acceptance_after=after), indent=1))


if __name__ == "__main__":
  app.run(main)
