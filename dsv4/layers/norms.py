"""RMSNorm variants (fp32 math, weight kept in fp32, cast once at the end, as the references do)."""

import jax
import jax.numpy as jnp


def rms_norm(x, weight, eps: float):
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return (weight.astype(jnp.float32) * y).astype(x.dtype)


def unweighted_rms_norm(x, eps: float):
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
