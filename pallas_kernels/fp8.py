"""FP8 compressed-KV rows: the V4 584-byte record (interchange format) and a TMA-friendly paged layout.

Record (`Fp8KVPool`; docs/kernels.md, FP8 cache formats): per row 448 e4m3 channels, 7 UE8M0 scale bytes + 1 pad
byte, 64 bf16 RoPE channels = 584 bytes. Kept as three arrays whose bytes equal the record.

Paged layout (`Fp8PagedPool`, after FlashMLA's sm90 sparse FP8 cache): one uint16 array [num_pages, page_words].
A page holds page_size rows of *data* (576 bytes each: the 448 e4m3 bytes, then the 64 bf16 RoPE channels) followed
by a per-page *scale tail* (page_size x 8 bytes: 7 UE8M0 exponents + 1 pad). Every data row is 576 contiguous bytes
at a 16-byte aligned offset (page_size even), so one TMA box (or one coalesced row copy) fetches it; the scales of a
row are 8 bytes at a known offset in the same page. Storage is uint16 on purpose: an e4m3 byte pool indexed with
32-bit element offsets overflows past 2^31 elements (2 GiB of FP8), while JAX's Triton lowering switches to 64-bit
offsets only above 2^32 *bytes*; with 2-byte elements the two limits coincide, so every pool size is addressed
correctly. Word i of a row's e4m3 part holds channels 2i (low byte) and 2i+1 (high byte).

In-kernel dequant: each loaded word is split into its two e4m3 bytes, bitcast to float8_e4m3fn and converted by the
type conversion (`e4m3_to_f32`; sm_90 converts e4m3 in hardware), then multiplied once by the 64-channel block's
UE8M0 scale, built from the exponent byte's bits (`ue8m0_to_f32`). The kernels once decoded e4m3 with integer
shifts and masks (about 40 ALU ops per channel); the conversion lowers for Triton and runs in interpret mode, so no
path needs that decode any more.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

# ----------------------------------------------------------------------------------------------------------------
# FP8 cache rows (the V4 serving record, docs/kernels.md): the first D - R channels as e4m3 in blocks of 64 with
# one power-of-two (UE8M0) scale per block, the last R (RoPE) channels kept bf16. The record's 7 scales + 1 pad byte
# are stored as 8 uint8 exponents (bias 127) so every in-kernel shape stays a power of two.
# ----------------------------------------------------------------------------------------------------------------


class Fp8KVPool(NamedTuple):
  """A quantized KV pool (a pytree). nope_PxDn float8_e4m3fn, scale_PxS uint8 UE8M0 exponents (S >= Dn / block,
  unused columns are padding), rope_PxR bfloat16. Row r dequantizes to
  concat(nope[r, c] * 2^(scale[r, c // block] - 127), rope[r])."""
  nope: jax.Array
  scale: jax.Array
  rope: jax.Array

  @property
  def shape(self):
    return (self.nope.shape[0], self.nope.shape[1] + self.rope.shape[1])

  @property
  def block(self) -> int:
    return FP8_BLOCK

  @property
  def bytes_per_row(self) -> int:
    return (self.nope.shape[1] * self.nope.dtype.itemsize + self.scale.shape[1] * self.scale.dtype.itemsize
            + self.rope.shape[1] * self.rope.dtype.itemsize)


FP8_BLOCK = 64
_E4M3_MAX = 448.0


def _next_pow2(x: int) -> int:
  return 1 << max(0, (int(x) - 1).bit_length())


def quantize_kv_fp8(x_PxD, rope_dim: int = 64) -> Fp8KVPool:
  """Quantize KV rows to the V4 FP8 record: e4m3 + UE8M0 scale per 64 channels (nope part), bf16 RoPE part."""
  P, D = x_PxD.shape
  Dn = D - rope_dim
  assert Dn % FP8_BLOCK == 0, (D, rope_dim)
  nb = Dn // FP8_BLOCK
  xn = x_PxD[:, :Dn].astype(jnp.float32).reshape(P, nb, FP8_BLOCK)
  amax = jnp.max(jnp.abs(xn), axis=-1)
  # Smallest power of two with amax / 2^e <= 448 (UE8M0: scale = 2^(e8 - 127)).
  e = jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-30) / _E4M3_MAX))
  e = jnp.where(amax > 0, e, 0.0)
  e8 = jnp.clip(e + 127.0, 0.0, 254.0)
  scale = jnp.exp2(e8 - 127.0)
  q = jnp.clip(xn / scale[..., None], -_E4M3_MAX, _E4M3_MAX).astype(jnp.float8_e4m3fn).reshape(P, Dn)
  s_cols = _next_pow2(nb)
  scale_u8 = jnp.zeros((P, s_cols), jnp.uint8).at[:, :nb].set(e8.astype(jnp.uint8))
  return Fp8KVPool(q, scale_u8, x_PxD[:, Dn:].astype(jnp.bfloat16))


def dequantize_kv_fp8(pool: Fp8KVPool, dtype=jnp.float32):
  """Reference dequantization of a whole pool (or of gathered rows: any leading shape)."""
  Dn = pool.nope.shape[-1]
  nb = Dn // FP8_BLOCK
  sc = jnp.exp2(pool.scale[..., :nb].astype(jnp.float32) - 127.0)
  nope = pool.nope.astype(jnp.float32).reshape(*pool.nope.shape[:-1], nb, FP8_BLOCK) * sc[..., None]
  nope = nope.reshape(pool.nope.shape)
  return jnp.concatenate([nope, pool.rope.astype(jnp.float32)], axis=-1).astype(dtype)




# ----------------------------------------------------------------------------------------------------------------
# Paged layout
# ----------------------------------------------------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=["pages"],
                   meta_fields=["page_size", "nope_dim", "rope_dim", "scale_cols"])
@dataclasses.dataclass(frozen=True)
class Fp8PagedPool:
  """pages: uint16 [num_pages, page_size * (row_words + scale_cols / 2)] (see module docstring). Row r lives in
  page r // page_size, slot r % page_size."""
  pages: jax.Array
  page_size: int
  nope_dim: int = 448
  rope_dim: int = 64
  scale_cols: int = 8

  def __post_init__(self):
    if self.page_size % 2 or self.scale_cols % 2 or self.nope_dim % FP8_BLOCK:
      raise ValueError(f"Fp8PagedPool: page_size {self.page_size} and scale_cols {self.scale_cols} must be even, "
                       f"nope_dim {self.nope_dim} a multiple of {FP8_BLOCK}")
    if hasattr(self.pages, "shape") and self.pages.shape[1] != self.page_size * self.page_words_per_row:
      raise ValueError(f"Fp8PagedPool: pages {self.pages.shape} do not hold {self.page_size} rows of "
                       f"{self.page_words_per_row} words")

  @property
  def row_words(self) -> int:  # data words of one row: e4m3 pairs, then bf16 RoPE
    return self.nope_dim // 2 + self.rope_dim

  @property
  def page_words_per_row(self) -> int:
    return self.row_words + self.scale_cols // 2

  @property
  def tail_word0(self) -> int:  # first word of the page's scale tail
    return self.page_size * self.row_words

  @property
  def shape(self):
    return (self.pages.shape[0] * self.page_size, self.nope_dim + self.rope_dim)

  @property
  def bytes_per_row(self) -> int:
    return 2 * self.page_words_per_row

  @property
  def data_bytes_per_row(self) -> int:
    return 2 * self.row_words


def _to_u16(x_PxC):
  """Reinterpret the bytes of a [P, C] array (1- or 2-byte dtype) as uint16 [P, C * itemsize / 2]."""
  P, C = x_PxC.shape
  if x_PxC.dtype.itemsize == 2:
    return jax.lax.bitcast_convert_type(x_PxC, jnp.uint16)
  u8 = jax.lax.bitcast_convert_type(x_PxC, jnp.uint8) if x_PxC.dtype != jnp.uint8 else x_PxC
  return jax.lax.bitcast_convert_type(u8.reshape(P, C // 2, 2), jnp.uint16)


def _from_u16(w_PxW, dtype):
  P, W = w_PxW.shape
  if jnp.dtype(dtype).itemsize == 2:
    return jax.lax.bitcast_convert_type(w_PxW, dtype)
  u8 = jax.lax.bitcast_convert_type(w_PxW, jnp.uint8).reshape(P, 2 * W)
  return u8 if dtype == jnp.uint8 else jax.lax.bitcast_convert_type(u8, dtype)


def record_to_paged(rec: Fp8KVPool, page_size: int = 64) -> Fp8PagedPool:
  """Record -> paged layout (rows padded with zeros to whole pages). Byte-exact: paged_to_record inverts it."""
  P, Dn = rec.nope.shape
  R, S = rec.rope.shape[1], rec.scale.shape[1]
  S2 = S + (S % 2)
  npg = -(-P // page_size)
  pad = npg * page_size - P
  nope, scale, rope = rec.nope, rec.scale, rec.rope
  if S2 != S:
    scale = jnp.pad(scale, ((0, 0), (0, S2 - S)))
  if pad:
    nope = jnp.pad(nope, ((0, pad), (0, 0)))
    scale = jnp.pad(scale, ((0, pad), (0, 0)))
    rope = jnp.pad(rope, ((0, pad), (0, 0)))
  data = jnp.concatenate([_to_u16(nope), _to_u16(rope.astype(jnp.bfloat16))], axis=1)
  tail = _to_u16(scale.astype(jnp.uint8))
  pages = jnp.concatenate([data.reshape(npg, -1), tail.reshape(npg, -1)], axis=1)
  return Fp8PagedPool(pages, page_size, Dn, R, S2)


def paged_to_record(pg: Fp8PagedPool) -> Fp8KVPool:
  """Paged layout -> record (all num_pages * page_size rows)."""
  npg, ps = pg.pages.shape[0], pg.page_size
  data = pg.pages[:, :pg.tail_word0].reshape(npg * ps, pg.row_words)
  tail = pg.pages[:, pg.tail_word0:].reshape(npg * ps, pg.scale_cols // 2)
  nope = _from_u16(data[:, :pg.nope_dim // 2], jnp.float8_e4m3fn)
  rope = _from_u16(data[:, pg.nope_dim // 2:], jnp.bfloat16)
  scale = _from_u16(tail, jnp.uint8)
  return Fp8KVPool(nope, scale, rope)


# ----------------------------------------------------------------------------------------------------------------
# In-kernel decoding (jnp ops on loaded values; also used by the reference tests)
# ----------------------------------------------------------------------------------------------------------------


def as_e4m3(x):
  """e4m3 codes as float8_e4m3fn: an e4m3 array as is; integer bytes (uint8 / int32 in 0..255, e.g. a byte taken
  out of a loaded uint16 word) by a bitcast of their low byte (Triton: trunci + bitcast, no arithmetic)."""
  if x.dtype == jnp.float8_e4m3fn:
    return x
  if x.dtype != jnp.uint8:
    x = x.astype(jnp.uint8)
  return jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn)


def e4m3_to_f32(x):
  """e4m3 codes (see `as_e4m3`) -> f32 by the type conversion: Triton lowers it to `tt.fp_to_fp`, which sm_90 runs
  as the hardware e4m3x2 -> f16x2 conversion (two channels per instruction) and one widening; exact for every
  finite code. e4m3fn's NaN codes (0x7f / 0xff, never written by the quantizer) decode as NaN; rows behind invalid
  ids are never loaded, so a NaN there cannot reach an output."""
  return as_e4m3(x).astype(jnp.float32)


def ue8m0_to_f32(e8):
  """UE8M0 exponent bytes (int, 0..254) -> the scale 2^(e8 - 127) as f32, exactly, built from bits (exp2 need not
  be exact): e8 << 23 is that f32 for e8 >= 1; e8 = 0 is the subnormal 2^-127 (a GPU that flushes subnormals
  reads it as 0; the quantizer writes e8 = 0 only for blocks whose amax is below 2^-118)."""
  e8 = e8.astype(jnp.int32)
  return jax.lax.bitcast_convert_type(jnp.where(e8 > 0, jnp.left_shift(e8, 23), 1 << 22), jnp.float32)


def word_bytes_as_e4m3(words):
  """uint16 words holding two e4m3 codes -> (low byte, high byte) as float8_e4m3fn: the word is loaded once and both
  channels come out of it (channel 2i is the low byte, 2i+1 the high byte)."""
  w = words.astype(jnp.int32)
  return as_e4m3(w & 0xFF), as_e4m3(jnp.right_shift(w, 8) & 0xFF)


def bf16_words_to_f32(w):
  """uint16 words holding bf16 bit patterns -> f32 (exact)."""
  return jax.lax.bitcast_convert_type(jnp.left_shift(w.astype(jnp.int32), 16), jnp.float32)
