"""Mixture of experts: sqrt-softplus scores, bias-corrected (or hash) choice, clamped SwiGLU experts, shared
expert. Routed experts run as one grouped matmul (`lax.ragged_dot`) over token-expert pairs sorted by expert.
Spec §1.8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4.config import MoEConfig

_HI = jax.lax.Precision.HIGHEST


def swiglu(gate, up, limit: float):
  return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def route(params, x_NxD, token_ids_N, cfg: MoEConfig, hashed: bool):
  """Returns expert ids [N, k] and weights [N, k]."""
  logits = jnp.dot(x_NxD.astype(jnp.float32), params["gate"].astype(jnp.float32), precision=_HI)
  scores = jnp.sqrt(jax.nn.softplus(logits))
  if hashed:
    ids = params["tid2eid"][token_ids_N].astype(jnp.int32)
  else:
    _, ids = jax.lax.top_k(scores + params["bias"].astype(jnp.float32), cfg.num_experts_per_tok)
  w = jnp.take_along_axis(scores, ids, axis=-1)
  w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
  return ids, w


def routed_experts(params, x_NxD, ids_NxK, w_NxK, cfg: MoEConfig):
  N, K = ids_NxK.shape
  E = cfg.n_routed_experts
  flat_ids = ids_NxK.reshape(-1)
  order = jnp.argsort(flat_ids, stable=True)
  token_of = order // K
  xs = x_NxD[token_of]
  sizes = jnp.bincount(flat_ids, length=E).astype(jnp.int32)
  gate = jax.lax.ragged_dot(xs, params["w1"], sizes, precision=_HI)
  up = jax.lax.ragged_dot(xs, params["w3"], sizes, precision=_HI)
  h = jax.lax.ragged_dot(swiglu(gate, up, cfg.swiglu_limit).astype(x_NxD.dtype), params["w2"], sizes,
                         precision=_HI)
  h = h * w_NxK.reshape(-1)[order][:, None].astype(h.dtype)
  return jnp.zeros_like(x_NxD).at[token_of].add(h.astype(x_NxD.dtype))


def shared_expert(params, x_NxD, cfg: MoEConfig):
  gate = jnp.dot(x_NxD, params["w1"], precision=_HI)
  up = jnp.dot(x_NxD, params["w3"], precision=_HI)
  return jnp.dot(swiglu(gate, up, cfg.swiglu_limit), params["w2"], precision=_HI)


def moe(params, x_BxTxD, token_ids_BxT, cfg: MoEConfig, hashed: bool):
  B, T, D = x_BxTxD.shape
  x = x_BxTxD.reshape(B * T, D)
  ids, w = route(params, x, token_ids_BxT.reshape(-1), cfg, hashed)
  out = routed_experts(params["experts"], x, ids, w, cfg) + shared_expert(params["shared"], x, cfg)
  return out.reshape(B, T, D)
