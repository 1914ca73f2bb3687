"""The routed experts (one grouped formulation for every batch size) and their gathered reference equal a plain
per-token loop over the chosen experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4.config import MoEConfig
from dsv4.layers import moe


def _reference(p, x, ids, w, cfg):
  x, ids, w = np.asarray(x, np.float64), np.asarray(ids), np.asarray(w, np.float64)
  w1, w3, w2 = (np.asarray(p[k], np.float64) for k in ("w1", "w3", "w2"))
  out = np.zeros_like(x)
  lim = cfg.swiglu_limit
  for n in range(x.shape[0]):
    for k in range(ids.shape[1]):
      e = ids[n, k]
      g, u = x[n] @ w1[e], x[n] @ w3[e]
      g = np.minimum(g, lim)
      h = (g / (1 + np.exp(-g))) * np.clip(u, -lim, lim)
      out[n] += w[n, k] * (h @ w2[e])
  return out


@pytest.mark.parametrize("N", [1, 3, 40])
def test_routed_paths_equal_reference(N):
  cfg = MoEConfig(n_routed_experts=8, num_experts_per_tok=2, intermediate_size=16)
  D, E, I, K = 24, 8, 16, 2
  ks = jax.random.split(jax.random.PRNGKey(N), 5)
  p = {"w1": jax.random.normal(ks[0], (E, D, I)) / 5, "w3": jax.random.normal(ks[1], (E, D, I)) / 5,
       "w2": jax.random.normal(ks[2], (E, I, D)) / 4}
  x = jax.random.normal(ks[3], (N, D))
  rng = np.random.default_rng(N)
  ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32))
  w = jax.random.uniform(ks[4], (N, K))
  want = _reference(p, x, ids, w, cfg)
  tol = 1e-5 * max(1.0, np.max(np.abs(want)))
  for fn in (moe.routed_experts_reference, moe.routed_experts):
    got = np.asarray(jax.jit(fn, static_argnums=4)(p, x, ids, w, cfg))
    assert np.max(np.abs(got - want)) <= tol, fn.__name__
