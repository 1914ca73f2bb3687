"""Routed-expert weights kept in the checkpoint's FP4 (e2m1 + e8m0 scales) and dequantized in the MoE step.

A quantized expert leaf replaces a dense kernel [E, in, out] by {"fp4": uint8 [E, out, in/2] (two e2m1 codes per
byte, low nibble = even column; dsv4/loading/quant.py), "scale": uint8 e8m0 [E, out, in/32]} — the stored layout,
4.3 bits a weight instead of 16. `dense_experts` turns them back into the kernel layout inside the jitted step, right
before the grouped matmuls, so device memory holds the quantized copy and one layer's dense transient.
(`load_checkpoint(..., keep_quantized=True)` produces these leaves.) Dequantization is exact: e2m1 x 2^k is
representable in float32 and bfloat16, so results equal those of the dequantized-on-load weights.
"""

from __future__ import annotations

import jax.numpy as jnp

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32


def is_quantized(w) -> bool:
  return isinstance(w, dict) and "fp4" in w


def dequant_fp4_kernel(w: dict, dtype) -> jnp.ndarray:
  """{"fp4" [E, O, I/2], "scale" [E, O, I/32]} -> kernel [E, I, O] in `dtype`."""
  p = w["fp4"].astype(jnp.uint8)
  lut = jnp.asarray(_E2M1, jnp.float32)
  v = jnp.stack([lut[p & 0x0F], lut[p >> 4]], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
  s = jnp.ldexp(jnp.float32(1.0), w["scale"].astype(jnp.int32) - 127)
  v = (v.reshape(*s.shape, GROUP) * s[..., None]).reshape(v.shape)
  return jnp.swapaxes(v, -1, -2).astype(dtype)


def dense_experts(experts: dict, dtype) -> dict:
  """The routed-expert params with every quantized leaf dequantized (dense leaves pass through)."""
  return {k: dequant_fp4_kernel(v, dtype) if is_quantized(v) else v for k, v in experts.items()}
