"""V4.1's quantized cache as NeMo Automodel 0.7.0 runs it (`deepseek_v41/quantization.py`, `quantize_cache`):
quantize-dequantize of cache values in groups of consecutive channels, each group with its own scale.

* "fp8"   (window KV, 32 channels):   scale = 2^ceil(log2(max(amax, 1e-4) * (1/448))), values -> float8 e4m3
                                      (round to nearest even) after clamping to +-448.
* "mxfp4" (index q / k, 32 channels): scale = 2^ceil(log2(max(amax, 6 * 2^-126) * (1/6))), values -> e2m1.
* "nvfp4" (compressed KV, 16 chans):  scale = e4m3(max(amax, 6 * 2^-9) / 6) (an e4m3 number, not a power of
                                      two; torch's cast saturates at 448, so groups with amax > 2688 get
                                      scale 448 and their values clamp at +-6 * 448), values -> e2m1.

e2m1 rounding: clamp to +-6, magnitude to the nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}; a magnitude exactly on a
midpoint {.25, .75, 1.25, 1.75, 2.5, 3.5, 5} goes to the level with the even index (0, 1, 2, 4 of the list, i.e.
.25 -> 0, .75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4); the sign is copied (so -0.1 -> -0).
"2^ceil(log2(v))" is done on the float bits (exponent + 1 unless the mantissa is zero), as NeMo does, never with
a logarithm. A trailing partial group is zero-padded. The result has the input's dtype and shape.

`quantize_cache` is the jitted op; `quantize_cache_reference` the plain numpy version beside it. Both are
checked bit for bit against NeMo's torch function in tests/dsv4/test_cache_quant.py.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import jax
import jax.numpy as jnp

FORMATS = {"fp8": 32, "mxfp4": 32, "nvfp4": 16}   # format -> NeMo's block size for it
E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_INV448 = np.float32(1.0 / 448.0)
_INV6 = np.float32(1.0 / 6.0)


def _check(fmt: str, block_size: int):
  if fmt not in FORMATS or block_size <= 0:
    raise ValueError(f"cache quantization: format must be one of {sorted(FORMATS)} and block_size > 0, "
                     f"got {fmt!r}, {block_size}")


# ----------------------------------------------------------------------------------------------------------
# jitted

def _pow2_ceil(v):
  """Positive normal float32 -> the smallest power of two >= v (on the bits)."""
  bits = jax.lax.bitcast_convert_type(v, jnp.int32)
  exp = (bits >> 23) & 255
  inc = ((bits & ((1 << 23) - 1)) != 0).astype(jnp.int32)
  return jax.lax.bitcast_convert_type((exp + inc) << 23, jnp.float32)


def _e2m1(x):
  mag = jnp.abs(x)
  mids = jnp.asarray(E2M1_MIDPOINTS, jnp.float32)
  lower = jnp.sum(mag[..., None] > mids, axis=-1)               # = torch.bucketize(mag, mids) (right=False)
  tie = mag == mids[jnp.minimum(lower, 6)]
  sel = lower + (tie & (lower % 2 == 1)).astype(lower.dtype)
  return jnp.copysign(jnp.asarray(E2M1_LEVELS, jnp.float32)[sel], x)


def quantize_cache(values, fmt: str, block_size: int | None = None):
  """Quantize-dequantize `values` [..., C] in groups of `block_size` channels (default: NeMo's for `fmt`)."""
  block_size = block_size or FORMATS.get(fmt, 0)
  _check(fmt, block_size)
  dtype = values.dtype
  C = values.shape[-1]
  pad = -C % block_size
  x = values.astype(jnp.float32)
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  g = x.reshape(*x.shape[:-1], -1, block_size)
  amax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
  if fmt == "fp8":
    scale = _pow2_ceil(jnp.maximum(amax, np.float32(1e-4)) * _INV448)
    q = jnp.clip(g / scale, -448.0, 448.0).astype(jnp.float8_e4m3fn).astype(jnp.float32)
  else:
    if fmt == "nvfp4":
      # torch's float -> float8_e4m3fn cast saturates at 448; ml_dtypes / XLA give NaN from 464 on: clamp first
      scale = jnp.minimum(jnp.maximum(amax, np.float32(6 * 2.0 ** -9)) / np.float32(6), np.float32(448))
      scale = scale.astype(jnp.float8_e4m3fn)
      scale = scale.astype(jnp.float32)
    else:
      scale = _pow2_ceil(jnp.maximum(amax, np.float32(6 * 2.0 ** -126)) * _INV6)
    q = _e2m1(jnp.clip(g / scale, -6.0, 6.0))
  out = (q * scale).reshape(x.shape)[..., :C]
  return out.astype(dtype)


def fp8_window_kv(x):
  return quantize_cache(x, "fp8", 32)


def nvfp4_compressed_kv(x):
  return quantize_cache(x, "nvfp4", 16)


def mxfp4_index(x):
  return quantize_cache(x, "mxfp4", 32)


# ----------------------------------------------------------------------------------------------------------
# plain numpy reference

def _pow2_ceil_np(v: np.ndarray) -> np.ndarray:
  m, e = np.frexp(v.astype(np.float64))          # v = m * 2^e, m in [0.5, 1)
  return np.where(m == 0.5, v, np.ldexp(1.0, e)).astype(np.float32)


def quantize_cache_reference(values, fmt: str, block_size: int | None = None) -> np.ndarray:
  block_size = block_size or FORMATS.get(fmt, 0)
  _check(fmt, block_size)
  v = np.asarray(values)
  C = v.shape[-1]
  x = np.zeros((*v.shape[:-1], -(-C // block_size) * block_size), np.float32)
  x[..., :C] = v
  g = x.reshape(*x.shape[:-1], -1, block_size)
  amax = np.abs(g).max(axis=-1, keepdims=True)
  with np.errstate(over="ignore", invalid="ignore"):
    if fmt == "fp8":
      scale = _pow2_ceil_np(np.maximum(amax, np.float32(1e-4)) * _INV448)
      q = np.clip(g / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    else:
      if fmt == "nvfp4":
        scale = np.minimum(np.maximum(amax, np.float32(6 * 2.0 ** -9)) / np.float32(6), np.float32(448))
        scale = scale.astype(ml_dtypes.float8_e4m3fn)  # saturating, as torch's cast
        scale = scale.astype(np.float32)
      else:
        scale = _pow2_ceil_np(np.maximum(amax, np.float32(6 * 2.0 ** -126)) * _INV6)
      n = np.clip(g / scale, -6, 6)
      mag = np.abs(n)
      levels = np.asarray(E2M1_LEVELS, np.float32)
      # nearest level; exact midpoints to the even-index level
      idx = np.searchsorted(np.asarray(E2M1_MIDPOINTS, np.float32), mag, side="left")
      on_mid = np.isin(mag, np.asarray(E2M1_MIDPOINTS, np.float32))
      idx = np.where(on_mid & (idx % 2 == 1), idx + 1, idx)
      q = np.copysign(levels[idx], n)
  out = (q * scale).reshape(x.shape)[..., :C]
  return out.astype(v.dtype)
