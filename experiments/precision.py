r"""Precision modes on the shipped trained models: logits vs fp32, greedy-token agreement, task accuracy.

    python -m experiments.precision [--batches=4 --batch=16]

Modes: fp32 (reference), bf16 compute (`model.cast_params`, fp32 KV pools), bf16 compute + bf16 KV pools
(`CacheLayout(kv_dtype=jnp.bfloat16)`), fp32 compute + V4 FP8 KV record (`caches.FP8`; only where the model's
non-RoPE width is a multiple of 64: the shipped models have head_dim 64 / rope 16 (48 channels), so they cannot use
the record and the FP8 row says so). Greedy agreement = argmax equal to fp32's argmax, over every position and over
the answer positions; accuracy = answer positions predicted right (the task's metric).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from dsv4 import caches, model
from experiments import tasks
from experiments import train_lib

_BATCHES = flags.DEFINE_integer("batches", 4, "held-out batches per checkpoint")
_BATCH = flags.DEFINE_integer("batch", 16, "sequences per batch")
_CKPTS = flags.DEFINE_list("checkpoints", ["v4_retrieval", "v41_retrieval", "v4_count"], "shipped checkpoints")

class Mode(NamedTuple):
  name: str
  compute_dtype: Any   # the params' float dtype (model.cast_params)
  kv_dtype: Any        # the KV cache records' dtype (caches.CacheLayout.kv_dtype)


MODES = (Mode("fp32", jnp.float32, jnp.float32), Mode("bf16", jnp.bfloat16, jnp.float32),
         Mode("bf16+kv_bf16", jnp.bfloat16, jnp.bfloat16), Mode("fp32+kv_fp8", jnp.float32, caches.FP8))


def logits_for(params, config, tokens, kv_dtype):
  layout = caches.CacheLayout(kv_dtype=kv_dtype)
  B, T = tokens.shape
  cache, swa, full = caches.init_contiguous(config, B, T, layout)
  index = caches.BatchIndex(jnp.zeros((B,), jnp.int32), jnp.full((B,), T, jnp.int32), jnp.asarray(swa),
                            jnp.asarray(full))
  fn = jax.jit(lambda p, t, c, i: model.forward_aux(p, config, t, c, i, layout=layout, return_hidden=True)[1])
  return np.asarray(model.lm_logits(params, fn(params, tokens, cache, index)), np.float32)


def run(name: str, batches: int, batch: int) -> list[dict]:
  config, params, info = train_lib.load_checkpoint_dir(os.path.join(train_lib.CHECKPOINT_ROOT, name))
  spec = train_lib.task_spec_from_info(info)
  data = list(tasks.eval_batches(spec, batches, batch))
  ref = [logits_for(params, config, jnp.asarray(b["tokens"]), jnp.float32) for b in data]
  rows = []
  for mode in MODES:
    try:
      caches.CacheLayout(kv_dtype=mode.kv_dtype).validate(config)
    except ValueError as e:
      rows.append(dict(checkpoint=name, mode=mode.name, skipped=str(e)))
      continue
    p = model.cast_params(params, mode.compute_dtype)
    err = agree = agree_ans = correct = n_all = n_ans = 0.0
    for b, r in zip(data, ref):
      got = logits_for(p, config, jnp.asarray(b["tokens"]), mode.kv_dtype)
      mask = np.asarray(b["mask"], bool)
      err = max(err, float(np.max(np.abs(got - r)) / max(1.0, np.max(np.abs(r)))))
      same = np.argmax(got, -1) == np.argmax(r, -1)
      agree += same.sum()
      n_all += same.size
      agree_ans += (same & mask).sum()
      correct += ((np.argmax(got, -1) == np.asarray(b["targets"])) & mask).sum()
      n_ans += mask.sum()
    rows.append(dict(checkpoint=name, mode=mode.name, max_rel_logit_err=err, greedy_agree_all=agree / n_all,
                     greedy_agree_answers=agree_ans / n_ans, accuracy=correct / n_ans))
  return rows


def main(_):
  for name in _CKPTS.value:
    for r in run(name, _BATCHES.value, _BATCH.value):
      if "skipped" in r:
        print(f"{r['checkpoint']:14s} {r['mode']:13s} skipped: {r['skipped']}")
      else:
        print(f"{r['checkpoint']:14s} {r['mode']:13s} max|dlogit|/max|logit| {r['max_rel_logit_err']:.2e}  "
              f"greedy agree all {r['greedy_agree_all']:.4f} answers {r['greedy_agree_answers']:.4f}  "
              f"accuracy {r['accuracy']:.4f}")


if __name__ == "__main__":
  app.run(main)
