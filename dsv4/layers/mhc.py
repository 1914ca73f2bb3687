"""Manifold-constrained hyper-connections (mHC); docs/model.md, Residual streams.

The residual is `hc_mult` streams X_BxTxNxD. Each sublayer computes from X (fp32): `pre` (collapse weights),
`post` (expand weights) and `comb` (a Sinkhorn-normalised NxN stream mixing), then
X' = post * F(sum_j pre_j X_j) + comb^T X.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4.config import MHCConfig
from dsv4.layers.norms import unweighted_rms_norm


def sinkhorn(logits_NxN, cfg: MHCConfig):
  """softmax over rows + eps, column-normalise, then (iters - 1) rounds of row- then column-normalisation."""
  p = jax.nn.softmax(logits_NxN, axis=-1) + cfg.eps
  p = p / (jnp.sum(p, axis=-2, keepdims=True) + cfg.eps)

  def body(_, p):
    p = p / (jnp.sum(p, axis=-1, keepdims=True) + cfg.eps)
    return p / (jnp.sum(p, axis=-2, keepdims=True) + cfg.eps)

  return jax.lax.fori_loop(0, cfg.sinkhorn_iters - 1, body, p)


def hc_coefficients(params, X_BxTxNxD, cfg: MHCConfig, norm_eps: float):
  """Returns pre_BxTxN, post_BxTxN, comb_BxTxNxN (fp32)."""
  n = cfg.hc_mult
  flat = unweighted_rms_norm(X_BxTxNxD.reshape(*X_BxTxNxD.shape[:-2], -1).astype(jnp.float32), norm_eps)
  mix = jnp.dot(flat, params["fn"].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  base, scale = params["base"].astype(jnp.float32), params["scale"].astype(jnp.float32)
  pre = jax.nn.sigmoid(mix[..., :n] * scale[0] + base[:n]) + cfg.eps
  post = 2.0 * jax.nn.sigmoid(mix[..., n:2 * n] * scale[1] + base[n:2 * n])
  comb_logits = (mix[..., 2 * n:] * scale[2] + base[2 * n:]).reshape(*mix.shape[:-1], n, n)
  return pre, post, sinkhorn(comb_logits, cfg)


def collapse(pre_BxTxN, X_BxTxNxD):
  return jnp.einsum("btn,btnd->btd", pre_BxTxN, X_BxTxNxD.astype(jnp.float32)).astype(X_BxTxNxD.dtype)


def expand(y_BxTxD, X_BxTxNxD, post_BxTxN, comb_BxTxNxN):
  """X'_k = post_k * y + sum_j comb[j, k] X_j."""
  dt = X_BxTxNxD.dtype
  mixed = jnp.einsum("btjk,btjd->btkd", comb_BxTxNxN.astype(dt), X_BxTxNxD,
                     precision=jax.lax.Precision.HIGHEST)
  return post_BxTxN.astype(dt)[..., None] * y_BxTxD[..., None, :] + mixed


def hc_head(params, X_BxTxNxD, cfg: MHCConfig, norm_eps: float):
  """Final collapse of the streams (V4 `hc_head`)."""
  flat = unweighted_rms_norm(X_BxTxNxD.reshape(*X_BxTxNxD.shape[:-2], -1).astype(jnp.float32), norm_eps)
  mix = jnp.dot(flat, params["fn"].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
  pre = jax.nn.sigmoid(mix * params["scale"].astype(jnp.float32) + params["base"].astype(jnp.float32)) + cfg.eps
  return collapse(pre, X_BxTxNxD)
