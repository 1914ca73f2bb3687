"""The grouped expert matmul (interpret mode) against its reference on fresh random inputs, and its invariance: a
block's bits depend only on its rows and its expert, not on the other blocks, their experts, B, its place or
live_blocks; blocks past live_blocks or without an expert are exact zeros; dispatch routes "xla" to the reference
and "interpret" to the kernel."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels import grouped_dot as gd

# derandomize comes from the suite's hypothesis profile (tests/conftest.py)
SETTINGS = dict(max_examples=4, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
TUNE = gd.GroupedDotTuning(block_cols=32, block_k=16)
E, K, M = 5, 64, 64
DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


def bits(y):
  y = np.asarray(y)
  return y.view({2: np.uint16, 4: np.uint32}[y.dtype.itemsize])


def kernel(x, experts, live, w, **kw):
  return gd.grouped_dot(x, jnp.asarray(experts, jnp.int32), jnp.int32(live), w, tuning=TUNE, interpret=True, **kw)


def operands(seed, B, R, K, M, dtype, E=E):
  kx, kw = jax.random.split(jax.random.PRNGKey(seed))
  return (jax.random.normal(kx, (B, R, K), jnp.float32).astype(dtype),
          (jax.random.normal(kw, (E, K, M), jnp.float32) * K ** -0.5).astype(dtype))


@hypothesis.settings(**SETTINGS)
@hypothesis.given(seed=st.integers(0, 2 ** 31 - 1), B=st.integers(1, 7), R=st.sampled_from([3, 16, 20]),
                  k_steps=st.integers(1, 4), m_blocks=st.integers(1, 3), dtype=st.sampled_from(sorted(DTYPES)),
                  data=st.data())
def test_kernel_matches_reference(seed, B, R, k_steps, m_blocks, dtype, data):
  """Any B, R (padded to the row tile inside: 3 -> 16, 20 -> 32), K and M of whole blocks, experts in [-1, E] (out
  of range: no pair), live_blocks anywhere in [0, B + 1]; the dead blocks exact zeros."""
  dt = DTYPES[dtype]
  x, w = operands(seed, B, R, 16 * k_steps, 32 * m_blocks, dt)
  experts = np.asarray(data.draw(st.lists(st.integers(-1, E), min_size=B, max_size=B)), np.int32)
  live = data.draw(st.integers(0, B + 1))
  got = kernel(x, experts, live, w)
  assert got.shape == (B, R, 32 * m_blocks) and got.dtype == dt
  want = gd.grouped_dot_reference(x, jnp.asarray(experts), jnp.int32(live), w)
  tol = 1e-5 if dt == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=tol, atol=tol)
  dead = (np.arange(B) >= live) | (experts < 0) | (experts >= E)
  assert not np.asarray(got, np.float32)[dead].any()


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_block_keeps_its_bits_whatever_the_others(dtype):
  """Block 0 (expert 3) alone, then at several places among 1..8 blocks of other rows and experts, under any
  live_blocks that keeps it: identical bits."""
  dt = DTYPES[dtype]
  R = 16
  x, w = operands(11, 8, R, K, M, dt)
  target = x[0]
  alone = bits(kernel(target[None], [3], 1, w))[0]
  rng = np.random.default_rng(1)
  for B, place in ((2, 0), (2, 1), (5, 3), (8, 7), (8, 0)):
    order = np.insert(rng.permutation(np.arange(1, 8))[:B - 1], place, 0)
    experts = rng.integers(-1, E + 1, B)
    experts[place] = 3
    for live in sorted({place + 1, B}):
      y = bits(kernel(x[order], experts, live, w))
      assert np.array_equal(y[place], alone), (B, place, live)
  # the check sees a change of summation order: another block_k gives the block other fp32 bits
  f32 = dict(out_dtype=jnp.float32)
  other = gd.grouped_dot(target[None], jnp.asarray([3], jnp.int32), jnp.int32(1), w, interpret=True,
                         tuning=gd.GroupedDotTuning(block_cols=32, block_k=32), **f32)
  assert not np.array_equal(bits(other), bits(kernel(target[None], [3], 1, w, **f32)))


def test_dead_blocks_are_zero():
  x, w = operands(2, 6, 16, K, M, jnp.bfloat16)
  experts = np.array([0, 4, -1, 2, 5, 1], np.int32)  # -1 and 5 (= E): no expert
  full = bits(kernel(x, experts, 6, w))
  for live in (0, 1, 3, 6):
    y = np.asarray(kernel(x, experts, live, w), np.float32)
    dead = (np.arange(6) >= live) | (experts < 0) | (experts >= E)
    assert not y[dead].any() and not np.signbit(y[dead]).any()
    assert np.array_equal(bits(kernel(x, experts, live, w))[~dead], full[~dead])


def test_bad_shapes_and_tunings_are_one_line_errors():
  x, w = operands(0, 2, 16, 48, 64, jnp.bfloat16)
  with pytest.raises(ValueError, match="multiples of block_k"):
    gd.grouped_dot(x, jnp.zeros((2,), jnp.int32), 2, w, tuning=gd.GroupedDotTuning(block_k=32), interpret=True)
  with pytest.raises(ValueError, match="block_expert_B must have shape"):
    gd.grouped_dot(x, jnp.zeros((3,), jnp.int32), 2, w, tuning=TUNE, interpret=True)
  for bad in (dict(block_cols=8), dict(block_k=24), dict(num_warps=5), dict(num_stages=0)):
    with pytest.raises(ValueError):
      gd.GroupedDotTuning(**bad)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_dispatch_routes(backend, monkeypatch):
  """"xla" is the reference and never the kernel; "interpret" is the kernel with the configured tuning."""
  x, w = operands(5, 4, 16, K, M, jnp.float32)
  experts = jnp.asarray([1, 0, 4, 1], jnp.int32)
  calls = []
  real = dispatch._KERNELS["grouped_dot"]
  monkeypatch.setitem(dispatch._KERNELS, "grouped_dot", lambda *a, **k: calls.append(k) or real(*a, **k))
  cfg = dispatch.KernelConfig(backend, grouped_dot_tuning=TUNE)
  got = dispatch.grouped_dot(x, experts, 3, w, cfg=cfg)
  assert got.shape == (4, 16, M) and not np.asarray(got[3]).any()
  if backend == "xla":
    assert not calls
    assert np.array_equal(bits(got), bits(gd.grouped_dot_reference(x, experts, jnp.int32(3), w)))
  else:
    assert calls == [dict(out_dtype="float32", interpret=True, tuning=TUNE)]
    assert np.array_equal(bits(got), bits(kernel(x, experts, 3, w)))
  assert dispatch.uses_kernel(cfg, "grouped_dot", x, experts, 3, w) == (backend == "interpret")


def test_auto_validates_on_a_gpu(monkeypatch, recwarn):
  """'auto' on a (simulated) GPU validates the kernel once in a child process on its small case, then serves the
  call with it; another block count is the same configuration."""
  from tests.pallas_kernels import validation_kernels as vk
  monkeypatch.setattr(dispatch, "_on_gpu", lambda: True)
  monkeypatch.setitem(dispatch._KERNELS, "grouped_dot", vk.grouped_dot)
  dispatch.clear_validations()
  vk.CALLS.clear()
  try:
    x, w = operands(9, 6, 32, 128, 256, jnp.bfloat16)
    experts = jnp.asarray([0, 4, 2, 2, -1, 1], jnp.int32)
    got = dispatch.grouped_dot(x, experts, 5, w)
    assert vk.CALLS["grouped_dot"] == 1 and list(dispatch.validation_verdicts().values()) == [True]
    assert np.array_equal(bits(got), bits(gd.grouped_dot(x, experts, 5, w, interpret=True)))
    dispatch.grouped_dot(x[:2], experts[:2], 2, w)
    assert vk.CALLS["grouped_dot"] == 2 and len(dispatch.validation_verdicts()) == 1
    assert not [m for m in recwarn if "dispatch" in str(m.message)]
  finally:
    dispatch.clear_validations()
