"""V4.1 cache quantizers (dsv4.layers.cache_quant) bit for bit against NeMo Automodel 0.7.0's own
`deepseek_v41.quantization.quantize_cache` (torch), on random inputs and on constructed exact rounding midpoints,
and the jitted op against its numpy reference."""

import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv4.layers import cache_quant
from tests.dsv4 import v41_oracle


@pytest.fixture(scope="module")
def nemo_quantize():
  root = v41_oracle.ensure_nemo()
  if root is None:
    pytest.skip("NeMo Automodel 0.7.0 wheel not available")
  if root not in sys.path:
    sys.path.insert(0, root)
  import torch
  from nemo_automodel.components.models.deepseek_v41.quantization import quantize_cache

  def run(x, fmt, block):
    return quantize_cache(torch.from_numpy(np.ascontiguousarray(x)), format=fmt, block_size=block).numpy()
  return run


def _random(rng, shape):
  """Mixed magnitudes: normal, tiny (scale floors / subnormal quotients), huge, exact zeros and -0."""
  x = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-20, 12, shape[:-1] + (1,)))
  x = x.astype(np.float32)
  x[..., ::7] = 0.0
  x[..., 3::11] = -0.0
  return x


def _midpoints(rng, fmt, block, rows=64):
  """Groups whose element 0 fixes the scale and whose other elements sit exactly on rounding midpoints
  (e2m1 midpoints, or halfway between adjacent e4m3 values), both signs, plus exact levels."""
  out = np.zeros((rows, block), np.float32)
  for r in range(rows):
    # nvfp4: keep amax / 6 inside e4m3's normal range so the scale is the exact e4m3 value computed below
    e = int(rng.integers(-6, 8)) if fmt == "nvfp4" else int(rng.integers(-30, 20))
    out[r, 0] = np.float32(6.0 * 2.0 ** e) if fmt != "fp8" else np.float32(448.0 * 2.0 ** e)
    amax = np.abs(out[r:r + 1, :]).max(axis=-1, keepdims=True)
    if fmt == "fp8":
      scale = cache_quant._pow2_ceil_np(np.maximum(amax, np.float32(1e-4)) * cache_quant._INV448)[0, 0]
      grid = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)))
      grid = grid[np.isfinite(grid) & (grid <= 448)]
      k = rng.integers(0, len(grid) - 1, block - 1)
      vals = (grid[k] + grid[k + 1]) / 2          # halfway between neighbours: a tie for round-to-nearest-even
    else:
      if fmt == "nvfp4":
        scale = np.float32(np.float32(amax[0, 0] / np.float32(6)).astype(ml_dtypes.float8_e4m3fn))
      else:
        scale = cache_quant._pow2_ceil_np(np.maximum(amax, np.float32(6 * 2.0 ** -126)) * cache_quant._INV6)[0, 0]
      pool = np.asarray(cache_quant.E2M1_MIDPOINTS + cache_quant.E2M1_LEVELS, np.float32)
      vals = pool[rng.integers(0, len(pool), block - 1)]
    signs = np.where(rng.random(block - 1) < 0.5, -1.0, 1.0).astype(np.float32)
    out[r, 1:] = (vals * signs * scale).astype(np.float32)
  return out


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
def test_bit_exact_with_nemo_random(nemo_quantize, fmt):
  rng = np.random.default_rng({"fp8": 0, "mxfp4": 1, "nvfp4": 2}[fmt])
  block = cache_quant.FORMATS[fmt]
  for shape in [(3, 5, 4 * block), (7, 3 * block + 5)]:   # complete groups and a zero-padded partial one
    x = _random(rng, shape)
    want = nemo_quantize(x, fmt, block)
    got = np.asarray(jax.jit(cache_quant.quantize_cache, static_argnums=(1, 2))(jnp.asarray(x), fmt, block))
    ref = cache_quant.quantize_cache_reference(x, fmt, block)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))   # bits, so -0 == -0 only
    np.testing.assert_array_equal(ref.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
def test_bit_exact_with_nemo_on_rounding_midpoints(nemo_quantize, fmt):
  rng = np.random.default_rng(10)
  block = cache_quant.FORMATS[fmt]
  x = _midpoints(rng, fmt, block)
  want = nemo_quantize(x, fmt, block)
  got = np.asarray(cache_quant.quantize_cache(jnp.asarray(x), fmt, block))
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
  np.testing.assert_array_equal(cache_quant.quantize_cache_reference(x, fmt, block).view(np.uint32),
                                want.view(np.uint32))
  # the construction really produced ties (not just values near them)
  amax = np.abs(x).max(-1, keepdims=True)
  assert np.all(np.isfinite(x)) and np.all(amax > 0)
  if fmt != "fp8":  # element 0 dequantizes to 6 * scale
    n = np.abs(x[:, 1:] / (want[:, :1] / 6))
    assert np.isin(n, np.asarray(cache_quant.E2M1_MIDPOINTS, np.float32)).sum() > 100


def test_e2m1_tie_rule_and_bf16_dtype():
  g = np.asarray([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 0.1, -0.1] + [0.0] * 20], np.float32)
  got = np.asarray(cache_quant.quantize_cache(jnp.asarray(g), "mxfp4"))[0, :12]
  np.testing.assert_array_equal(got, [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 0.0, -0.0])
  assert np.signbit(got[8]) and np.signbit(got[11])
  xb = jnp.asarray(_random(np.random.default_rng(3), (4, 64))).astype(jnp.bfloat16)
  out = cache_quant.quantize_cache(xb, "fp8")
  assert out.dtype == jnp.bfloat16 and out.shape == xb.shape
  with pytest.raises(ValueError, match="format must be one of"):
    cache_quant.quantize_cache(xb, "int4")


def test_model_switch_quantizes_the_cache_where_nemo_does():
  """With `quantized_cache`, the window KV in the cache lies on the FP8 / 32-channel grid and the index keys on the
  MXFP4 / 32-channel grid (re-quantizing them changes nothing: both scales are powers of two), and the logits
  move; without it neither holds. (Logits vs NeMo with quantization on: experiments/v41_quant_cache_parity.py.)"""
  import dataclasses
  from dsv4 import caches, config, model
  cfg = config.v41_tiny(engram=False)
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  B, T = 1, 24
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T)), jnp.int32)

  def run(c):
    cache, swa, full = caches.init_contiguous(c, B, T)
    idx = caches.BatchIndex(jnp.zeros(B, jnp.int32), jnp.full((B,), T, jnp.int32), jnp.asarray(swa),
                            jnp.asarray(full))
    new_cache, logits, _ = model.forward_aux(params, c, tokens, cache, idx)
    return new_cache, np.asarray(logits)

  on_cache, on = run(dataclasses.replace(cfg, quantized_cache=True))
  off_cache, off = run(cfg)
  assert np.max(np.abs(on - off)) > 1e-3 * np.max(np.abs(off))
  checked = 0
  for plan, lon, loff in zip(cfg.layer_plan(), on_cache.layers, off_cache.layers):
    for name, fmt in (("window_kv", "fp8"), ("index_keys", "mxfp4")):
      if name not in lon:
        continue
      a_on, a_off = np.asarray(lon[name]), np.asarray(loff[name])
      a_on = a_on.reshape(-1, a_on.shape[-1])
      a_off = a_off.reshape(-1, a_off.shape[-1])
      rows = np.abs(a_off).sum(-1) > 0   # written rows
      assert rows.sum() >= 8, (plan.index, name)
      np.testing.assert_array_equal(cache_quant.quantize_cache_reference(a_on[rows], fmt), a_on[rows])
      assert not np.array_equal(cache_quant.quantize_cache_reference(a_off[rows], fmt), a_off[rows])
      checked += 1
  assert checked == cfg.num_layers + 2  # every layer's window KV + the two full layers' index keys
