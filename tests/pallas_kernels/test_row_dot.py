"""The row-invariant matmul (interpret mode) against its reference on fresh random inputs, and its invariance: a
row's bits do not depend on the number of rows, `live`, its place in the call or the other rows; rows >= live are
exact zeros; dispatch routes "xla" to the reference and "interpret" to the kernel. All of it with and without the
fixed split of K (k_splits)."""

import dataclasses
import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels import row_dot as rd

# derandomize comes from the suite's hypothesis profile (tests/conftest.py)
SETTINGS = dict(max_examples=4, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
TUNE = rd.RowDotTuning(block_rows=16, block_cols=32, block_k=16)  # small tiles: several of each in small shapes
K, M = 64, 64
K_SPLIT = 128  # 8 K steps: 2 per split at k_splits 4 (at one step per split the fixed sum is the serial one)
DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


def bits(y):
  y = np.asarray(y)
  return y.view({2: np.uint16, 4: np.uint32}[y.dtype.itemsize])


def split(k_splits):
  return dataclasses.replace(TUNE, k_splits=k_splits)


def kernel(x, w, live=None, *, tuning=TUNE, **kw):
  return rd.row_dot(x, w, live, tuning=tuning, interpret=True, **kw)


def operands(seed, N, K, M, dtype):
  kx, kw = jax.random.split(jax.random.PRNGKey(seed))
  return (jax.random.normal(kx, (N, K), jnp.float32).astype(dtype),
          (jax.random.normal(kw, (K, M), jnp.float32) * K ** -0.5).astype(dtype))


def assert_close(got, want, dtype):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: the two fp32 sums may round to neighbouring bf16 values
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@hypothesis.settings(**SETTINGS)
@hypothesis.given(seed=st.integers(0, 2 ** 31 - 1), N=st.integers(1, 40), k_steps=st.integers(1, 4),
                  m_blocks=st.integers(1, 3), dtype=st.sampled_from(sorted(DTYPES)), live=st.integers(-1, 41))
def test_kernel_matches_reference(seed, N, k_steps, m_blocks, dtype, live):
  """Any N (padded to the row block inside), K and M of whole blocks, live None (-1 here) or anywhere in [0, N+1];
  rows >= live exact zeros."""
  dt = DTYPES[dtype]
  x, w = operands(seed, N, 16 * k_steps, 32 * m_blocks, dt)
  lv = None if live < 0 else jnp.int32(live)
  got = kernel(x, w, lv)
  assert got.shape == (N, 32 * m_blocks) and got.dtype == dt
  assert_close(got, rd.row_dot_reference(x, w, lv), dt)
  if lv is not None:
    assert not np.asarray(got[live:], np.float32).any()


@hypothesis.settings(**SETTINGS)
@hypothesis.given(seed=st.integers(0, 2 ** 31 - 1), N=st.integers(1, 40), k_splits=st.sampled_from([2, 4]),
                  steps_per_split=st.integers(1, 2), dtype=st.sampled_from(sorted(DTYPES)), live=st.integers(-1, 41))
def test_split_kernel_matches_reference(seed, N, k_splits, steps_per_split, dtype, live):
  """The fixed split of K: the same contract (rows >= live exact zeros, out dtype x's)."""
  dt = DTYPES[dtype]
  x, w = operands(seed, N, 16 * k_splits * steps_per_split, 64, dt)
  lv = None if live < 0 else jnp.int32(live)
  got = kernel(x, w, lv, tuning=split(k_splits))
  assert got.shape == (N, 64) and got.dtype == dt
  assert_close(got, rd.row_dot_reference(x, w, lv), dt)
  if lv is not None:
    assert not np.asarray(got[live:], np.float32).any()


def test_out_dtype():
  x, w = operands(1, 5, K, M, jnp.bfloat16)
  got = kernel(x, w, out_dtype=jnp.float32)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(rd.row_dot_reference(x, w, out_dtype=jnp.float32)),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k_splits", [1, 2, 4])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_row_keeps_its_bits_whatever_the_batch(dtype, k_splits):
  """The same row alone, among 6, 16, 17 and 40 rows, at any place, among permuted neighbours, under any live that
  keeps it: identical bits (the kernel chooses nothing from the row count, the split of K included)."""
  dt = DTYPES[dtype]
  tune = split(k_splits)
  run = functools.partial(kernel, tuning=tune)
  x, w = operands(7, 40, K_SPLIT, M, dt)
  row = x[0]
  alone = bits(run(row[None], w))[0]
  for n in (6, 16, 17, 40):
    assert np.array_equal(bits(run(x[:n], w))[0], alone), n
  rng = np.random.default_rng(0)
  for place in (0, 5, 15, 16, 39):                  # its place in the call: first, inside, block edges, last
    for _ in range(2):                               # and the other rows shuffled around it
      others = rng.permutation(np.arange(1, 40))
      order = np.insert(others, place, 0)
      y = bits(run(x[order], w, jnp.int32(40)))
      assert np.array_equal(y[place], alone), place
  for live in (1, 2, 16, 17, 33):
    assert np.array_equal(bits(run(x, w, jnp.int32(live)))[0], alone), live
  # the check sees a change of summation order: another block_k gives the row other fp32 bits
  other = rd.row_dot(row[None], w, tuning=dataclasses.replace(tune, block_k=32), interpret=True,
                     out_dtype=jnp.float32)
  assert not np.array_equal(bits(other), bits(run(row[None], w, out_dtype=jnp.float32)))


def test_the_split_is_there():
  """k_splits 1 and 4 sum one row's products in different orders (serial vs four partials added left to right):
  different fp32 bits, each stable across row counts."""
  x, w = operands(11, 17, K_SPLIT, M, jnp.float32)
  serial, parts = (bits(kernel(x[:1], w, tuning=split(s)))[0] for s in (1, 4))
  assert not np.array_equal(serial, parts)
  for s, alone in ((1, serial), (4, parts)):
    assert np.array_equal(bits(kernel(x, w, tuning=split(s)))[0], alone), s


@pytest.mark.parametrize("k_splits", [1, 4])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_rows_at_or_past_live_are_zero(dtype, k_splits):
  dt = DTYPES[dtype]
  run = functools.partial(kernel, tuning=split(k_splits))
  x, w = operands(3, 37, K, M, dt)
  full = bits(run(x, w))
  for live in (0, 1, 15, 16, 17, 37):
    y = run(x, w, jnp.int32(live))
    assert not np.asarray(y[live:], np.float32).any() and not np.signbit(np.asarray(y[live:], np.float32)).any()
    assert np.array_equal(bits(y)[:live], full[:live])  # the live rows are untouched by the cut


def test_bad_shapes_and_tunings_are_one_line_errors():
  x, w = operands(0, 4, 48, 64, jnp.bfloat16)
  with pytest.raises(ValueError, match="multiples of block_k"):
    rd.row_dot(x, w, tuning=rd.RowDotTuning(block_k=32), interpret=True)
  with pytest.raises(ValueError, match="share one of"):
    rd.row_dot(x, w.astype(jnp.float32), tuning=TUNE, interpret=True)
  with pytest.raises(ValueError, match="disagree on K"):
    rd.row_dot(x[:, :32], w, tuning=TUNE, interpret=True)
  with pytest.raises(ValueError, match="do not split into k_splits=2 equal parts"):
    rd.row_dot(x, w, tuning=split(2), interpret=True)     # 48 / 16 = 3 K steps
  for bad in (dict(block_rows=8), dict(block_cols=48), dict(block_k=0), dict(num_warps=3), dict(num_stages=0),
              dict(k_splits=0), dict(k_splits=3), dict(k_splits=-2)):
    with pytest.raises(ValueError) as e:
      rd.RowDotTuning(**bad)
    assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="k_splits must be a power of two >= 1, got 3"):
    rd.RowDotTuning(k_splits=3)


def test_auto_small_case_keeps_the_split():
  """`auto`'s validation case keeps two K steps per split (all k_splits of them: they set the partials' sum)."""
  S = jax.ShapeDtypeStruct
  a = dispatch.RowDotArgs(S((64, 4096), jnp.bfloat16), S((4096, 4096), jnp.bfloat16))
  case = dispatch._row_dot_small(a, {}, rd.RowDotTuning(k_splits=8))
  assert case.args.x_NxK.shape == (64, 1024) and case.args.w_KxM.shape == (1024, 256)
  assert case.tuning.k_splits == 8


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_dispatch_routes(backend, monkeypatch):
  """"xla" is the reference and never the kernel; "interpret" is the kernel with the configured tuning."""
  x, w = operands(5, 9, K, M, jnp.bfloat16)
  calls = []
  real = dispatch._KERNELS["row_dot"]
  monkeypatch.setitem(dispatch._KERNELS, "row_dot", lambda *a, **k: calls.append(k) or real(*a, **k))
  cfg = dispatch.KernelConfig(backend, row_dot_tuning=TUNE)
  got = dispatch.row_dot(x, w, 4, cfg=cfg)
  assert got.shape == (9, M) and not np.asarray(got[4:], np.float32).any()
  if backend == "xla":
    assert not calls
    assert np.array_equal(bits(got), bits(rd.row_dot_reference(x, w, 4)))
  else:
    assert calls == [dict(out_dtype="bfloat16", interpret=True, tuning=TUNE)]
    assert np.array_equal(bits(got), bits(kernel(x, w, jnp.int32(4))))
  assert dispatch.uses_kernel(cfg, "row_dot", x, w, 4) == (backend == "interpret")


def test_auto_validates_on_a_gpu(monkeypatch, recwarn):
  """'auto' on a (simulated) GPU validates the kernel once in a child process on its small case, then serves the
  call with it; another row count is the same configuration."""
  from tests.pallas_kernels import validation_kernels as vk
  monkeypatch.setattr(dispatch, "_on_gpu", lambda: True)
  monkeypatch.setitem(dispatch._KERNELS, "row_dot", vk.row_dot)
  dispatch.clear_validations()
  vk.CALLS.clear()
  try:
    x, w = operands(9, 70, 128, 256, jnp.bfloat16)
    got = dispatch.row_dot(x, w, 66)
    assert vk.CALLS["row_dot"] == 1 and list(dispatch.validation_verdicts().values()) == [True]
    assert np.array_equal(bits(got), bits(rd.row_dot(x, w, jnp.int32(66), interpret=True)))
    dispatch.row_dot(x[:3], w, 2)
    assert vk.CALLS["row_dot"] == 2 and len(dispatch.validation_verdicts()) == 1
    assert not [m for m in recwarn if "dispatch" in str(m.message)]
  finally:
    dispatch.clear_validations()
