"""`compressor.window_pool_scan`: the compressors' running pools, segments in parallel, each folded in position order.

Against two references: the left fold along the whole flat axis (`lax.scan`, one merge per token: the chain whose bits
every chunking reproduces), bit for bit at XLA's default optimisation level (a child process: the suite's level-0
code generation contracts multiply-adds differently in the two loop bodies, tests/xla_test_flags.py); and a float64
model of the pooling itself (softmax-weighted mean of each segment's prefix), within fp32 rounding."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.layers.compressor import merge, window_pool_scan
from tests.isolation import run_in_child


@jax.jit
def _token_by_token(reset_N, lse_NxW, mean_NxW):
  def fold(carry, x):
    reset, lse, mean = x
    ml, mm = merge(carry[0], carry[1], lse, mean)
    out = (jnp.where(reset, lse, ml), jnp.where(reset, mean, mm))
    return out, out

  _, (lse, mean) = jax.lax.scan(fold, (lse_NxW[0], mean_NxW[0]), (reset_N, lse_NxW, mean_NxW))
  return lse, mean


def _step_like(rng, n: int, ratio: int) -> np.ndarray:
  """Resets as a ragged step makes them: rows of random lengths starting at random positions (a row's first token
  resets), and every window start resets."""
  reset = np.zeros(n, bool)
  pos = 0
  for i in range(n):
    if i == 0 or rng.random() < 0.08:
      pos = int(rng.integers(0, 4 * ratio))
      reset[i] = True
    reset[i] |= pos % ratio == 0
    pos += 1
  return reset


def _pairs(rng, n, w):
  return rng.normal(size=(n, w)).astype(np.float32), rng.normal(size=(n, w)).astype(np.float32)


def test_bits_equal_the_token_by_token_fold(request):
  if run_in_child(request, default_xla_opt=True):
    return
  rng = np.random.default_rng(0)
  scan = jax.jit(window_pool_scan)
  for n, w, ratio in [(1, 8, 4), (7, 16, 4), (64, 64, 4), (64, 64, 128), (256, 128, 128), (256, 32, 4)]:
    for _ in range(3):
      reset = _step_like(rng, n, ratio)
      lse, mean = _pairs(rng, n, w)
      for got, want in zip(scan(reset, lse, mean), _token_by_token(reset, lse, mean)):
        assert np.array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32)), (n, w, ratio)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 96), st.sampled_from([4, 16, 128]), st.integers(0, 2**31 - 1))
def test_pools_match_a_float64_model(n, ratio, seed):
  """Each token's pool is log-sum-exp and softmax-weighted mean of its segment's tokens up to itself."""
  rng = np.random.default_rng(seed)
  reset = _step_like(rng, n, ratio)
  lse, mean = _pairs(rng, n, 8)
  got_l, got_m = (np.asarray(x) for x in jax.jit(window_pool_scan)(reset, lse, mean))
  start = 0
  for t in range(n):
    start = t if reset[t] else start
    z = lse[start:t + 1].astype(np.float64)
    want_l = np.log(np.sum(np.exp(z - z.max(0)), 0)) + z.max(0)
    want_m = np.sum(np.exp(z - want_l) * mean[start:t + 1], 0)
    np.testing.assert_allclose(got_l[t], want_l, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_m[t], want_m, rtol=1e-4, atol=1e-5)


def test_a_tokens_pool_ignores_the_other_segments():
  """Changing every token outside a segment leaves that segment's pools bit for bit (the property that makes a
  row's compressor state independent of what shares the step), at the suite's level too."""
  rng = np.random.default_rng(1)
  reset = _step_like(rng, 128, 16)
  lse, mean = _pairs(rng, 128, 32)
  starts = np.flatnonzero(reset)
  a, b = int(starts[2]), int(starts[3])
  lse2, mean2 = _pairs(rng, 128, 32)
  lse2[a:b], mean2[a:b] = lse[a:b], mean[a:b]
  one = [np.asarray(x)[a:b] for x in jax.jit(window_pool_scan)(reset, lse, mean)]
  two = [np.asarray(x)[a:b] for x in jax.jit(window_pool_scan)(reset, lse2, mean2)]
  for x, y in zip(one, two):
    assert np.array_equal(x.view(np.uint32), y.view(np.uint32))
