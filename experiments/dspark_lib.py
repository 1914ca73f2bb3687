"""A DSpark drafter for the trained tiny V4.1 models (dsv4/dspark.py), trained on a frozen backbone, and its
acceptance as the engine would see it.

Training is self-distillation at every anchor of every sequence: slot i of the block drafted from the anchor at
position a should predict what the backbone predicts at position a + i (the token at a + i + 1), KL(backbone ||
draft), with the Markov bias reading the true previous tokens (teacher forcing). A greedy engine accepts a draft
exactly when it equals the backbone's argmax, so the backbone's distribution is the target, as for V4's MTP block
(experiments/mtp_lib.py). The backbone's parameters never change.

`engine_acceptance` drafts as the engine does (the Markov bias reads the draft's own previous proposal) from anchors
on the backbone's greedy continuations and counts the accepted prefix of each block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import dspark, model
from dsv4.config import DSparkConfig, ModelConfig
from experiments import train_lib


def add_dspark(config: ModelConfig, params: dict, ds: DSparkConfig, num_stages: int, seed: int = 0):
  """(config with a DSpark drafter, params = the backbone's + freshly initialised stages)."""
  if config.variant != "v41":
    raise ValueError(f"add_dspark: DSpark is V4.1's drafter; the model is {config.variant}")
  cfg = dataclasses.replace(config, num_mtp_layers=num_stages, dspark=ds)
  fresh = model.init_params(cfg, jax.random.PRNGKey(seed))
  return cfg, {**{k: v for k, v in params.items() if k != "mtp"}, "mtp": fresh["mtp"]}


def _anchors(B: int, T: int):
  """Every anchor with at least one label: positions 0 .. T - 2 of each row."""
  return jnp.broadcast_to(jnp.arange(T - 1, dtype=jnp.int32)[None], (B, T - 1))


def distill_loss(draft_params, params, config: ModelConfig, tokens_BxT):
  """(KL(backbone_{a+i} || slot i of the block at a) over every anchor a and slot with a label, the greedy
  acceptance of single slots (argmax equal))."""
  full = {**params, "mtp": draft_params}
  B, T = tokens_BxT.shape
  blk = config.dspark.block_size
  logits_bb, feats = dspark.sequence_features(params, config, tokens_BxT)
  logits_bb, feats = jax.lax.stop_gradient(logits_bb), jax.lax.stop_gradient(feats)
  anchors = _anchors(B, T)
  draft = dspark.train_logits(full, config, tokens_BxT, feats, anchors)              # [B, A, blk, V]
  tgt_pos = anchors[..., None] + jnp.arange(blk)                                      # backbone position of slot i
  valid = (tgt_pos <= T - 2).astype(jnp.float32)
  tgt = jnp.take_along_axis(logits_bb, jnp.clip(tgt_pos, 0, T - 1).reshape(B, -1)[..., None], axis=1)
  tgt = jax.nn.softmax(tgt.reshape(draft.shape), axis=-1)
  logq = jax.nn.log_softmax(draft, axis=-1)
  kl = jnp.sum(tgt * (jnp.log(tgt + 1e-20) - logq), axis=-1)
  n = jnp.maximum(jnp.sum(valid), 1.0)
  acc = jnp.sum((jnp.argmax(draft, -1) == jnp.argmax(tgt, -1)) * valid) / n
  return jnp.sum(kl * valid) / n, acc


def make_train_step(config: ModelConfig, opt):
  return train_lib.make_draft_train_step(lambda d, p, toks: distill_loss(d, p, config, toks), opt)


def engine_acceptance(params, config: ModelConfig, cont_BxT, anchors, k: int) -> dict:
  """Greedy drafting as the engine does it, from each anchor (a list of positions) of the backbone's greedy
  continuations cont [B, T]: k drafts per block, accepted while they equal the continuation. Returns by_depth
  (fraction of blocks whose draft d was accepted, d = 1..k) and acceptance_length (1 + mean accepted drafts)."""
  if not 1 <= k <= config.dspark.block_size:
    raise ValueError(f"engine_acceptance: k={k} outside 1..block_size={config.dspark.block_size}")
  toks = jnp.asarray(cont_BxT, jnp.int32)
  anchors_BxA = jnp.broadcast_to(jnp.asarray(anchors, jnp.int32)[None], (toks.shape[0], len(anchors)))
  drafts = np.asarray(_drafts_at(params, config, toks, anchors_BxA))[..., :k]        # [B, A, k]
  cont = np.asarray(cont_BxT)
  want = np.stack([cont[:, a + 1:a + 1 + k] for a in anchors], axis=1)               # [B, A, k]
  ok = np.cumprod(drafts == want, axis=-1)
  return dict(by_depth=ok.mean(axis=(0, 1)).tolist(), acceptance_length=float(1.0 + ok.sum(-1).mean()))


@functools.partial(jax.jit, static_argnames=("config",))
def _drafts_at(params, config: ModelConfig, toks_BxT, anchors_BxA):
  """Greedy blocks [B, A, block] drafted from each anchor, as the engine drafts (own previous draft)."""
  _, feats = dspark.sequence_features(params, config, toks_BxT)
  h = dspark.hidden_at_anchors(params, config, toks_BxT, feats, anchors_BxA)
  B, A = anchors_BxA.shape
  anchor_tok = jnp.take_along_axis(toks_BxT, anchors_BxA, axis=1).reshape(B * A)
  return dspark.greedy_drafts(params, h.reshape(B * A, *h.shape[2:]), anchor_tok).reshape(B, A, -1)
