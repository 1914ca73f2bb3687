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
  max_tokens: int = 16
  temperature: float = 0.0          # 0 = greedy
  top_k: int = 0                    # 0 = off
  top_p: float = 1.0                # 1 = off
  seed: int = 0
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False

  def validate(self) -> str | None:
    """The error message, or None; the rules (types, ranges, the sampler's limits) are in dsv4.engine.schema."""
    from dsv4.engine import schema   # schema imports this module
    try:
      schema.check_sampling(self)
    except schema.RequestError as e:
      return str(e)
    return None


def sample_rows_impl(logits_BxV, temperature_B, top_k_B, top_p_B, seed_B, step_B):
  """Greedy where temperature == 0, otherwise temperature / top-k / top-p sampling with per-row keys.

  Traceable body: the engine's step program calls it on device logits (no host round trip); `sample_rows` is the
  standalone jitted version."""
  logits = logits_BxV.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1)
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
  scaled = jnp.where(scaled >= cutoff, scaled, -jnp.inf)

  def draw(seed, step, row):
    key = jax.random.fold_in(jax.random.PRNGKey(seed), step)
    return jax.random.categorical(key, row)

  sampled = jax.vmap(draw)(seed_B, step_B, scaled)
  return jnp.where(temperature_B > 0, sampled, greedy).astype(jnp.int32)


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
