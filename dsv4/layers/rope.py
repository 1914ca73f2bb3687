"""Partial, interleaved RoPE on the trailing `rope_dim` channels ("[nope | rope]" layout);
docs/model.md, RoPE.

Two frequency tables: "main" (plain theta, window-only layers) and "compress" (compress theta with frequency-only
YaRN, every RoPE inside a compressed layer). Channels (2i, 2i+1) of the rope slice form one complex number.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from dsv4.config import AttentionConfig, YarnConfig


def plain_inv_freq(rope_dim: int, theta: float) -> np.ndarray:
  return 1.0 / (theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))


def yarn_inv_freq(rope_dim: int, theta: float, yarn: YarnConfig) -> np.ndarray:
  """Frequency-only YaRN: high frequencies kept, low ones divided by `factor`, linear ramp between."""
  f = plain_inv_freq(rope_dim, theta)
  L0 = yarn.original_max_position_embeddings

  def dim_for(rotations):
    return rope_dim * math.log(L0 / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low = max(math.floor(dim_for(yarn.beta_fast)), 0)
  high = min(math.ceil(dim_for(yarn.beta_slow)), rope_dim - 1)
  ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float64) - low) / max(high - low, 1e-3), 0.0, 1.0)
  return f / yarn.factor * ramp + f * (1.0 - ramp)


def inv_freq_for(attn: AttentionConfig, table: str) -> np.ndarray:
  if table == "main":
    return plain_inv_freq(attn.rope_head_dim, attn.rope_theta).astype(np.float32)
  return yarn_inv_freq(attn.rope_head_dim, attn.compress_rope_theta, attn.yarn).astype(np.float32)


def apply_rope(x_Sx_D, pos_S, inv_freq, *, inverse: bool = False):
  """Rotate the trailing 2*len(inv_freq) channels of x by pos*inv_freq (or its inverse).

  x: [..., D] with leading dims matching pos (pos broadcasts over any head axes placed between: pass pos already
  shaped to broadcast against x[..., 0]).
  """
  r = 2 * inv_freq.shape[0]
  ang = pos_S.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  if inverse:
    sin = -sin
  nope, rope = x_Sx_D[..., :-r], x_Sx_D[..., -r:].astype(jnp.float32)
  a, b = rope[..., 0::2], rope[..., 1::2]
  rotated = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(rope.shape)
  return jnp.concatenate([nope, rotated.astype(x_Sx_D.dtype)], axis=-1)
