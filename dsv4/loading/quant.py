"""Weight dequantization for DeepSeek-V4 / V4.1 checkpoints (docs/model.md, Loading checkpoints), plus the matching
quantizers used by the tests and by `save_*_safetensors(..., quant=...)`.

Formats (all numpy, host side; the loader dequantizes once to float32):

* FP8 e4m3 block-scaled: weight `[..., R, C]` stored as float8_e4m3fn, scale `[..., ceil(R/b), ceil(C/b)]` with
  one scale per b x b block (b = 128 for V4, 32 for V4.1). Scales are usually e8m0 ("ue8m0": a biased power of two,
  value = 2**(byte - 127)); plain float scales (V3-style `weight_scale_inv` in fp32/bf16) are accepted too.
  value = fp8 * scale.
* FP4 e2m1 (MXFP4-style, routed experts): weight `[..., R, C/2]` int8 (or uint8) holding two e2m1 codes per byte,
  scale `[..., R, C/32]` e8m0: one scale per row and 32 consecutive columns.
  **Nibble order: the low nibble (bits 0-3) is column 2j, the high nibble (bits 4-7) is column 2j+1.** Source:
  transformers 5.23.0 `integrations/finegrained_fp8.py`, `Fp8Dequantize._unpack_fp4` (the code that dequantizes
  DeepSeek-V4 FP4 experts when loading with `dequantize=True`: `low = u8 & 0xF; high = (u8 >> 4) & 0xF;
  stack([lut[low], lut[high]], -1)`), which agrees with the OCP MX convention used by vLLM's MXFP4 utilities
  ("low->high nibble order"). `tests/dsv4/test_hf_parity.py` cross-checks this module against that transformers
  function.
  e2m1 code -> value: bit 3 sign, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
FP4_GROUP = 32
FP4_E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)

# Default FP8 block edge per model variant (V4: 128x128 blocks; V4.1: 32x32).
FP8_BLOCK = {"v4": 128, "v41": 32}


class QuantError(ValueError):
  """Inconsistent quantized tensor / scale pair. The loader rewraps it with the tensor name."""


def e8m0_to_float(scale) -> np.ndarray:
  """e8m0 (bytes or ml_dtypes.float8_e8m0fnu) -> float32 powers of two. Byte 255 is NaN."""
  s = np.asarray(scale)
  if s.dtype == ml_dtypes.float8_e8m0fnu:
    return s.astype(np.float32)
  if s.dtype in (np.uint8, np.int8):
    b = s.view(np.uint8).astype(np.int32)
    out = np.ldexp(np.float32(1.0), b - 127).astype(np.float32)
    return np.where(b == 255, np.float32(np.nan), out)
  return s.astype(np.float32)  # already a float multiplier


def float_to_e8m0(scale_pow2) -> np.ndarray:
  """Exact powers of two (float) -> ml_dtypes.float8_e8m0fnu."""
  return np.asarray(scale_pow2, np.float32).astype(ml_dtypes.float8_e8m0fnu)


def _expand_blocks(scale_f32, rows: int, cols: int, br: int, bc: int) -> np.ndarray:
  s = np.repeat(np.repeat(scale_f32, br, axis=-2), bc, axis=-1)
  return s[..., :rows, :cols]


def dequant_fp8_block(weight, scale, block: int | tuple[int, int] = 128) -> np.ndarray:
  """FP8 e4m3 weight [..., R, C] x block scale [..., ceil(R/br), ceil(C/bc)] -> float32 [..., R, C]."""
  br, bc = (block, block) if isinstance(block, int) else block
  w = np.asarray(weight)
  if w.dtype != ml_dtypes.float8_e4m3fn:
    if w.dtype in (np.uint8, np.int8):
      w = w.view(ml_dtypes.float8_e4m3fn)
    else:
      raise QuantError(f"FP8 weight must be float8_e4m3fn, found {w.dtype}")
  if w.ndim < 2:
    raise QuantError(f"FP8 block-scaled weight must be at least 2-D, found shape {list(w.shape)}")
  s = np.asarray(scale)
  R, C = w.shape[-2:]
  want = (*w.shape[:-2], math.ceil(R / br), math.ceil(C / bc))
  if tuple(s.shape) != want:
    raise QuantError(f"FP8 scale shape {list(s.shape)} does not fit weight {list(w.shape)} with "
                     f"{br}x{bc} blocks (expected {list(want)})")
  sf = e8m0_to_float(s)
  if R % br == 0 and C % bc == 0:  # broadcast per block: no full-size scale array (host memory while loading)
    out = w.astype(np.float32).reshape(*w.shape[:-2], R // br, br, C // bc, bc)
    out *= sf[..., :, None, :, None]
    return out.reshape(w.shape)
  return w.astype(np.float32) * _expand_blocks(sf, R, C, br, bc)


def unpack_fp4(packed) -> np.ndarray:
  """int8/uint8 [..., C/2] -> float32 [..., C]; low nibble first (see module docstring)."""
  p = np.asarray(packed)
  if p.dtype not in (np.int8, np.uint8):
    raise QuantError(f"FP4-packed weight must be int8 or uint8, found {p.dtype}")
  u = p.view(np.uint8)
  lo, hi = u & 0x0F, u >> 4
  return np.stack([FP4_E2M1_VALUES[lo], FP4_E2M1_VALUES[hi]], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])


def dequant_fp4(packed, scale, group: int = FP4_GROUP) -> np.ndarray:
  """FP4 e2m1 packed [..., R, C/2] x e8m0 scale [..., R, C/group] -> float32 [..., R, C]."""
  v = unpack_fp4(packed)
  s = np.asarray(scale)
  C = v.shape[-1]
  if C % group:
    raise QuantError(f"FP4 row width {C} is not a multiple of the scale group {group}")
  want = (*v.shape[:-1], C // group)
  if tuple(s.shape) != want:
    raise QuantError(f"FP4 scale shape {list(s.shape)} does not fit packed weight {list(np.shape(packed))} "
                     f"(expected {list(want)}: one scale per row and {group} columns)")
  out = v.reshape(*want, group)
  out *= e8m0_to_float(s)[..., None]  # in place: unpack_fp4 returned a fresh array
  return out.reshape(v.shape)


# ----------------------------------------------------------------------------------------------------------
# Quantizers (the inverse; used by tests and by the writers). Power-of-two scales, round to nearest.

def _pow2_scale(amax, fmt_max: float) -> np.ndarray:
  amax = np.maximum(np.asarray(amax, np.float32), np.float32(1e-30))
  return np.exp2(np.ceil(np.log2(amax / fmt_max))).astype(np.float32)


def quantize_fp8_block(w, block: int | tuple[int, int] = 128) -> tuple[np.ndarray, np.ndarray]:
  """float [..., R, C] -> (float8_e4m3fn [..., R, C], e8m0 scale [..., ceil(R/br), ceil(C/bc)])."""
  br, bc = (block, block) if isinstance(block, int) else block
  w = np.asarray(w, np.float32)
  R, C = w.shape[-2:]
  nr, nc = math.ceil(R / br), math.ceil(C / bc)
  pad = [(0, 0)] * (w.ndim - 2) + [(0, nr * br - R), (0, nc * bc - C)]
  blocks = np.pad(np.abs(w), pad).reshape(*w.shape[:-2], nr, br, nc, bc)
  scale = _pow2_scale(blocks.max(axis=(-3, -1)), FP8_E4M3_MAX)
  q = (w / _expand_blocks(scale, R, C, br, bc)).astype(ml_dtypes.float8_e4m3fn)
  return q, float_to_e8m0(scale)


def quantize_fp4(w, group: int = FP4_GROUP) -> tuple[np.ndarray, np.ndarray]:
  """float [..., R, C] -> (int8 [..., R, C/2] low nibble first, e8m0 scale [..., R, C/group])."""
  w = np.asarray(w, np.float32)
  C = w.shape[-1]
  if C % group or C % 2:
    raise QuantError(f"FP4 row width {C} must be a multiple of {group}")
  g = w.reshape(*w.shape[:-1], C // group, group)
  scale = _pow2_scale(np.abs(g).max(axis=-1), FP4_E2M1_MAX)
  x = (g / scale[..., None]).reshape(w.shape)
  # nearest e2m1 code (ties to the lower magnitude, deterministic)
  mags = FP4_E2M1_VALUES[:8]
  code = np.argmin(np.abs(np.abs(x)[..., None] - mags), axis=-1).astype(np.uint8)
  code = code | np.where(np.signbit(x) & (code > 0), np.uint8(8), np.uint8(0))
  pairs = code.reshape(*w.shape[:-1], C // 2, 2)
  packed = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8).view(np.int8)
  return packed, float_to_e8m0(scale)
