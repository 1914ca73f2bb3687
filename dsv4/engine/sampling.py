"""Sampling parameters and a batched, jitted sampler.

Each row carries its own temperature / top-k / top-p and a key derived from (seed, index of the token in the
request's output), so a request samples the same tokens whatever batch it lands in and however often it is
preempted and recomputed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """One request's sampling. Types and ranges are checked where requests come in (`schema.check_sampling`)."""
  max_tokens: int = 16
  temperature: float = 0.0          # 0 = greedy
  top_k: int = 0                    # 0 = off
  top_p: float = 1.0                # 1 = off
  seed: int = 0
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False


def filtered_scores(logits_BxV, temperature_B, top_k_B, top_p_B):
  """The sampler's scores: logits / temperature, -inf outside top-k and outside the top-p nucleus (fp32).
  softmax of them is the distribution a sampled row draws from."""
  logits = logits_BxV.astype(jnp.float32)
  V = logits.shape[-1]
  scaled = logits / jnp.maximum(temperature_B, 1e-6)[:, None]
  sorted_desc = -jnp.sort(-scaled, axis=-1)
  # top-k: keep scores >= the k-th largest
  k = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, V), V)
  kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
  scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
  # top-p: smallest prefix of the sorted distribution whose mass reaches p
  sorted_desc = jnp.where(jnp.arange(V)[None, :] < k[:, None], sorted_desc, -jnp.inf)
  probs = jax.nn.softmax(sorted_desc, axis=-1)
  cum = jnp.cumsum(probs, axis=-1) - probs
  cutoff_idx = jnp.sum(cum < top_p_B[:, None], axis=-1) - 1
  cutoff = jnp.take_along_axis(sorted_desc, jnp.maximum(cutoff_idx, 0)[:, None], axis=-1)
  return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


def _key(seed, step):
  return jax.random.fold_in(jax.random.PRNGKey(seed), step)


def sample_rows_impl(logits_BxV, temperature_B, top_k_B, top_p_B, seed_B, step_B, exclude_B=None):
  """Greedy where temperature == 0, otherwise temperature / top-k / top-p sampling with per-row keys.
  exclude_B (sampled rows; -1 = none): a token that must not be drawn (a rejected draft: the draw is then from the
  distribution with that token removed and the rest renormalized).

  Traceable body: the engine's step program calls it on device logits (no host round trip); `sample_rows` is the
  standalone jitted version."""
  greedy = jnp.argmax(logits_BxV.astype(jnp.float32), axis=-1)
  scaled = filtered_scores(logits_BxV, temperature_B, top_k_B, top_p_B)
  if exclude_B is not None:
    scaled = jnp.where(jnp.arange(scaled.shape[-1])[None, :] == exclude_B[:, None], -jnp.inf, scaled)

  def draw(seed, step, row):
    return jax.random.categorical(_key(seed, step), row)

  sampled = jax.vmap(draw)(seed_B, step_B, scaled)
  return jnp.where(temperature_B > 0, sampled, greedy).astype(jnp.int32)


def verify_drafts(logits_RxJxV, drafts_RxK, num_drafts_R, temperature_R, top_k_R, top_p_R, seed_R, step_R):
  """Speculative verification of greedy drafts (J = K + 1 scored positions per row: logits j score the token after
  the row's j-th input; drafts_RxK[:, j] is the draft the row put at input j + 1; rows use their first
  num_drafts_R drafts).

  Greedy rows accept the longest prefix of drafts equal to the argmax. Sampled rows accept draft j with probability
  p_j(draft) (p the row's sampling distribution; the draft distribution is a point mass, so this is rejection
  sampling: the output tokens are distributed exactly as without drafts), and at the first rejection draw from p
  with the rejected draft removed; after the last accepted draft one more token is drawn from p either way. Token
  i of the output uses the keys of output index step_R + i (the draw: the sampler's key; the acceptance test:
  that key folded with 1).

  Returns (accepted_R: drafts accepted, tokens_RxJ: the accepted drafts then the new token, 0-padded)."""
  R, J, V = logits_RxJxV.shape
  K = J - 1
  flat = logits_RxJxV.reshape(R * J, V)
  rep = lambda x: jnp.repeat(x, J)
  probs = jax.nn.softmax(filtered_scores(flat, rep(temperature_R), rep(top_k_R), rep(top_p_R)), axis=-1)
  probs = probs.reshape(R, J, V)[:, :K]
  d = jnp.clip(drafts_RxK, 0, V - 1)
  p_draft = jnp.take_along_axis(probs, d[..., None], axis=-1)[..., 0]
  greedy_ok = jnp.argmax(logits_RxJxV[:, :K].astype(jnp.float32), axis=-1) == d
  j = jnp.arange(K)[None, :]
  u = jax.vmap(lambda s, t: jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(_key(s, t + i), 1)))(
      jnp.arange(K)))(seed_R, step_R) if K else jnp.zeros((R, 0))
  ok = jnp.where(temperature_R[:, None] > 0, u < p_draft, greedy_ok) & (j < num_drafts_R[:, None])
  accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
  at = jnp.take_along_axis(logits_RxJxV, accepted[:, None, None], axis=1)[:, 0]
  rejected = jnp.where(accepted < num_drafts_R,
                       jnp.take_along_axis(jnp.pad(d, ((0, 0), (0, 1))), accepted[:, None], axis=1)[:, 0], -1)
  new = sample_rows_impl(at, temperature_R, top_k_R, top_p_R, seed_R, step_R + accepted, exclude_B=rejected)
  cols = jnp.arange(J)[None, :]
  tokens = jnp.where(cols < accepted[:, None], jnp.pad(d, ((0, 0), (0, 1))),
                     jnp.where(cols == accepted[:, None], new[:, None], 0))
  return accepted.astype(jnp.int32), tokens.astype(jnp.int32)


sample_rows = jax.jit(sample_rows_impl)


def sample(logits_BxV, params: list[SamplingParams], steps: list[int]) -> np.ndarray:
  B = logits_BxV.shape[0]
  pad = B - len(params)
  params = list(params) + [SamplingParams()] * pad
  steps = list(steps) + [0] * pad
  out = sample_rows(logits_BxV,
                    jnp.asarray([p.temperature for p in params], jnp.float32),
                    jnp.asarray([p.top_k for p in params], jnp.int32),
                    jnp.asarray([p.top_p for p in params], jnp.float32),
                    jnp.asarray([p.seed for p in params], jnp.uint32),
                    jnp.asarray(steps, jnp.int32))
  return np.asarray(out)[: B - pad]
