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

from dsv4 import caches
from dsv4 import model
from dsv4.config import ModelConfig
from experiments import train_lib


def add_mtp(config: ModelConfig, params: dict, seed: int = 0) -> tuple[ModelConfig, dict]:
  """(config with one MTP block, params = the backbone's + a freshly initialised block)."""
  cfg = dataclasses.replace(config, num_mtp_layers=1)
  fresh = model.init_params(cfg, jax.random.PRNGKey(seed))
  return cfg, {**params, "mtp": fresh["mtp"]}


def forward_with_mtp(params, config: ModelConfig, tokens_BxT):
  """Backbone logits and MTP block 0's logits [B, T, V] over whole sequences (no cache reuse). MTP position t reads
  the token at t + 1 (the last position reads token 0: compare positions < T - 1 only)."""
  B, T = tokens_BxT.shape
  cache, step = caches.whole_sequences(config, B, T)
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
  return train_lib.make_draft_train_step(lambda d, p, toks: distill_loss(d, p, config, toks), opt)


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


# ----------------------------------------------------------------------------------------------------------
# The engine's recursion (dsv4/engine/speculative_step.py): with k drafts per step, draft 1 is the block's output
# at the frontier f (catch-up: backbone stream X_f, token f + 1); draft i + 1 is the block run at position f + i on
# its *own* previous output stream Xm_{f+i-1} and draft i as the token, writing its window KV there. A block trained
# only on backbone streams (the depth-1 objective above) has never seen its own stream as input, so its drafts past
# the first are poor. `recursive_passes` reproduces the recursion over whole sequences, one frontier per row:
# pass 0 is the catch-up pass (every position reads the backbone stream); pass j reads the backbone stream at
# positions <= f and pass j - 1's output stream one position back at positions > f. By induction pass j is exactly
# the engine's recursion at positions f + 1 .. f + j (its window KV at positions <= f is the catch-up pass's, at
# f + 1 .. q - 1 the recursion's own), so the last of k - 1 passes scores drafts 2 .. k.

def _shift_stream(Xm_1xNxnxD, B: int, T: int):
  """Each row's stream moved one position later (position t reads t - 1's; position 0 reads zeros)."""
  X = Xm_1xNxnxD.reshape((B, T) + Xm_1xNxnxD.shape[2:])
  X = jnp.concatenate([jnp.zeros_like(X[:, :1]), X[:, :-1]], axis=1)
  return X.reshape(Xm_1xNxnxD.shape)


def recursive_passes(params, config: ModelConfig, tokens_BxT, frontier_B, k: int, feed_drafts: bool = False):
  """(backbone logits [B,T,V], catch-up MTP logits [B,T,V], last recursion pass's MTP logits [B,T,V] (None for
  k = 1)) with one frontier per row. MTP logits at t predict the token at t + 2 (compare with backbone logits at
  t + 1). feed_drafts=False: the recursion reads the text's tokens (teacher forcing, training); True: each pass
  reads the previous pass's argmax one position back at positions > f, as the engine feeds its own drafts (at
  f + 1 the catch-up pass's draft 1; exact for the drafts of one frontier)."""
  B, T = tokens_BxT.shape
  cache, step = caches.whole_sequences(config, B, T)
  cache, h, _, X = model.forward_ragged_aux(params, config, tokens_BxT.reshape(-1), cache, step, return_stream=True)
  X = jax.lax.stop_gradient(X)
  nxt = jnp.concatenate([tokens_BxT[:, 1:], jnp.zeros((B, 1), tokens_BxT.dtype)], axis=1)
  cache, Xm, hm = model.mtp_forward(params, config, 0, X, nxt.reshape(-1), cache, step)
  bb = model.lm_logits(params, h).reshape(B, T, -1)
  mt0 = model.lm_logits(params, hm).reshape(B, T, -1)
  after = (jnp.arange(T)[None, :] > frontier_B[:, None]).reshape(-1)            # positions > f, flat
  mt, toks = mt0, nxt.reshape(-1)
  for _ in range(k - 1):
    stream = jnp.where(after[None, :, None, None], _shift_stream(Xm, B, T), X)
    if feed_drafts:
      prev = jnp.argmax(mt, -1).astype(toks.dtype)                               # [B,T]: prediction of t + 2
      drafted = jnp.concatenate([jnp.zeros((B, 1), toks.dtype), prev[:, :-1]], axis=1).reshape(-1)
      toks = jnp.where(after, drafted, nxt.reshape(-1))
    cache, Xm, hm = model.mtp_forward(params, config, 0, stream, toks, cache, step)
    mt = model.lm_logits(params, hm).reshape(B, T, -1)
  return bb, mt0, (mt if k > 1 else None)


def _kl(target_logits, logits):
  target = jax.nn.softmax(jax.lax.stop_gradient(target_logits), axis=-1)
  return jnp.sum(target * (jnp.log(target + 1e-20) - jax.nn.log_softmax(logits, axis=-1)), axis=-1)


def recursive_distill_loss(mtp_params, params, config: ModelConfig, tokens_BxT, frontier_B, k: int,
                           rec_weight: float):
  """Depth-1 distillation over every position (as `distill_loss`) + rec_weight x the mean KL of drafts 2 .. k
  (positions f + 1 .. f + k - 1 of the last recursion pass against the backbone one position later).
  Returns (loss, (depth-1 acceptance, teacher-forced acceptance of drafts 2 .. k))."""
  bb, mt0, mt = recursive_passes({**params, "mtp": mtp_params}, config, tokens_BxT, frontier_B, k)
  kl0 = jnp.mean(_kl(bb[:, 1:], mt0[:, :-1]))
  acc0 = jnp.mean(jnp.argmax(mt0[:, :-1], -1) == jnp.argmax(bb[:, 1:], -1))
  q = frontier_B[:, None] + jnp.arange(1, k)[None, :]                     # [B, k-1] recursion positions
  mt_q = jnp.take_along_axis(mt, q[:, :, None], axis=1)
  bb_q = jnp.take_along_axis(bb, (q + 1)[:, :, None], axis=1)
  kl_rec = jnp.mean(_kl(bb_q, mt_q))
  acc_rec = jnp.mean(jnp.argmax(mt_q, -1) == jnp.argmax(bb_q, -1))
  return kl0 + rec_weight * kl_rec, (acc0, acc_rec)


def make_recursive_train_step(config: ModelConfig, opt, k: int, rec_weight: float = 1.0):
  return train_lib.make_draft_train_step(
      lambda d, p, toks, fr: recursive_distill_loss(d, p, config, toks, fr, k, rec_weight), opt)


@functools.partial(jax.jit, static_argnames=("config", "k"))
def _engine_drafts(params, config: ModelConfig, tokens_BxT, frontier_B, k: int):
  """(backbone argmax at f + 1 .. f + k [B,k], the k drafts of frontier f as the engine makes them [B,k])."""
  # the last of the k - 1 recursion passes is exact at f + 1 .. f + k - 1 (recursive_passes), so one call has all
  bb, mt0, mt = recursive_passes(params, config, tokens_BxT, frontier_B, k, feed_drafts=True)
  drafts = jnp.take_along_axis(jnp.argmax(mt0, -1), frontier_B[:, None], axis=1)
  if k > 1:
    rec = jnp.take_along_axis(jnp.argmax(mt, -1), frontier_B[:, None] + jnp.arange(1, k)[None, :], axis=1)
    drafts = jnp.concatenate([drafts, rec], axis=1)
  q = frontier_B[:, None] + jnp.arange(1, k + 1)[None, :]
  want = jnp.take_along_axis(jnp.argmax(bb, -1), q, axis=1)
  return want, drafts


def engine_acceptance(params, config: ModelConfig, tokens_BxT, frontiers, k: int) -> dict:
  """Greedy acceptance of k recursive drafts as the engine counts it, on text the backbone would write itself (its
  greedy continuations): for each row and frontier f in `frontiers` (the row's last final position), drafts 1 .. k
  from the block and its recursion (each fed the previous draft), accepted while each equals the backbone's argmax.
  Returns by_depth (share of drafts at depth d accepted together with all before it) and acceptance_length
  (1 + mean accepted drafts: tokens per verifying row)."""
  tokens_BxT = jnp.asarray(tokens_BxT, jnp.int32)
  acc = []
  for f in frontiers:
    fr = jnp.full((tokens_BxT.shape[0],), int(f), jnp.int32)
    want, drafts = (np.asarray(x) for x in _engine_drafts(params, config, tokens_BxT, fr, k))
    acc.append(np.cumprod(want == drafts, axis=1))
  ok = np.concatenate(acc, axis=0)
  return dict(by_depth=[round(float(x), 4) for x in ok.mean(0)], acceptance_length=round(1 + float(ok.sum(1).mean()), 3))
