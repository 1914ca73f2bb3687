"""A draft for the trained tiny models: an MTP block trained on a frozen backbone, and its acceptance rate.

The block is trained by self-distillation: at position t it should predict what the backbone predicts at t + 1
(KL(backbone_{t+1} || mtp_t), the backbone's distribution as the target), because a greedy speculative step accepts a
draft exactly when it equals the backbone's argmax. The backbone's parameters never change, so the backbone's
answers (and every shipped number) stay as they were.

`acceptance` is the teacher-forced greedy acceptance of one draft (k = 1): over positions t < T - 1 of sequences the
backbone reads, the fraction where argmax(mtp_t) == argmax(backbone_{t+1}). On the backbone's own greedy
continuations (`greedy_continuations`) that is the rate a greedy engine with one draft per step would see.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dsv4 import caches
from dsv4 import model
from dsv4.config import ModelConfig


def add_mtp(config: ModelConfig, params: dict, seed: int = 0) -> tuple[ModelConfig, dict]:
  """(config with one MTP block, params = the backbone's + a freshly initialised block)."""
  cfg = dataclasses.replace(config, num_mtp_layers=1)
  fresh = model.init_params(cfg, jax.random.PRNGKey(seed))
  return cfg, {**params, "mtp": fresh["mtp"]}


def forward_with_mtp(params, config: ModelConfig, tokens_BxT):
  """Backbone logits and MTP block 0's logits [B, T, V] over whole sequences (no cache reuse). MTP position t reads
  the token at t + 1 (the last position reads token 0: compare positions < T - 1 only)."""
  B, T = tokens_BxT.shape
  cache, swa, full = caches.init_contiguous(config, B, T)
  idx = caches.BatchIndex(jnp.zeros(B, jnp.int32), jnp.full((B,), T, jnp.int32), jnp.asarray(swa),
                          jnp.asarray(full))
  step = caches.step_index_from_batch(idx, T)
  cache, h, _, X = model.forward_ragged_aux(params, config, tokens_BxT.reshape(-1), cache, step, return_stream=True)
  nxt = jnp.concatenate([tokens_BxT[:, 1:], jnp.zeros((B, 1), tokens_BxT.dtype)], axis=1)
  _, _, hm = model.mtp_forward(params, config, 0, X, nxt.reshape(-1), cache, step)
  return model.lm_logits(params, h).reshape(B, T, -1), model.lm_logits(params, hm).reshape(B, T, -1)


def distill_loss(mtp_params, params, config: ModelConfig, tokens_BxT):
  """(KL(backbone_{t+1} || mtp_t) averaged over t < T - 1, greedy acceptance of one draft)."""
  bb, mt = forward_with_mtp({**params, "mtp": mtp_params}, config, tokens_BxT)
  target = jax.nn.softmax(jax.lax.stop_gradient(bb[:, 1:]), axis=-1)
  logq = jax.nn.log_softmax(mt[:, :-1], axis=-1)
  kl = jnp.sum(target * (jnp.log(target + 1e-20) - logq), axis=-1)
  acc = jnp.mean(jnp.argmax(mt[:, :-1], -1) == jnp.argmax(bb[:, 1:], -1))
  return jnp.mean(kl), acc


def make_train_step(config: ModelConfig, opt):
  @jax.jit
  def step(mtp_params, params, opt_state, tokens_BxT):
    (loss, acc), grads = jax.value_and_grad(distill_loss, has_aux=True)(mtp_params, params, config, tokens_BxT)
    updates, opt_state = opt.update(grads, opt_state, mtp_params)
    return optax.apply_updates(mtp_params, updates), opt_state, loss, acc
  return step


@functools.partial(jax.jit, static_argnames=("config",))
def _accept_counts(params, config: ModelConfig, tokens_BxT, weight_BxT):
  bb, mt = forward_with_mtp(params, config, tokens_BxT)
  ok = (jnp.argmax(mt[:, :-1], -1) == jnp.argmax(bb[:, 1:], -1)).astype(jnp.float32)
  w = weight_BxT[:, :-1]
  return jnp.sum(ok * w), jnp.sum(w)


def acceptance(params, config: ModelConfig, tokens_BxT, weight_BxT=None) -> float:
  """Teacher-forced greedy acceptance of one draft over the positions with weight 1 (default: all t < T - 1)."""
  tokens_BxT = jnp.asarray(tokens_BxT, jnp.int32)
  w = jnp.ones(tokens_BxT.shape, jnp.float32) if weight_BxT is None else jnp.asarray(weight_BxT, jnp.float32)
  hit, n = _accept_counts(params, config, tokens_BxT, w)
  return float(hit) / max(float(n), 1.0)


def greedy_continuations(params, config: ModelConfig, prompts_BxP, new_tokens: int):
  """The backbone's greedy continuation of each prompt, `new_tokens` long, as [B, P + new_tokens] with a weight
  that is 1 where a draft is checked against the continuation. Whole-sequence forwards at one fixed width (the model
  is causal, so the zeros past position T - 1 do not change its logits): one compile, a few dozen tokens of a tiny
  model on the CPU."""
  toks = np.asarray(prompts_BxP, np.int32)
  B, P = toks.shape
  out = np.zeros((B, P + new_tokens), np.int32)
  out[:, :P] = toks
  backbone = {k: v for k, v in params.items() if k != "mtp"}
  cfg = dataclasses.replace(config, num_mtp_layers=0)
  for i in range(new_tokens - 1):
    T = P + i
    _, logits = model.forward_full(backbone, cfg, out)
    out[:, T] = np.argmax(np.asarray(logits[:, T - 1]), -1)
  weight = np.zeros(out.shape, np.float32)
  # drafts made at t = P - 1 .. (checked against the backbone at t + 1, which reads only continuation tokens)
  weight[:, P - 1:P + new_tokens - 2] = 1.0
  return out, weight
