"""The step program's plan: its static shape (`RaggedShape`, part of the jit key) and the one int32 buffer that carries
it host -> device (`pack` on the host, `unpack` inside the program), with the buckets the shape is padded to so
compilation stays bounded: tokens to 8 * g^k (g = `token_bucket_growth`, 2 or 4; `token_bucket_steps` > 1 adds
equal steps inside each interval), rows to powers of four, tables to powers of two (the runner picks the widths)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import caches


def pow2_at_least(n: int, lo: int = 1) -> int:
  n = max(n, lo, 1)
  return 1 << (n - 1).bit_length()


def pow4_at_least(n: int, lo: int = 1) -> int:
  """Row buckets grow 4x (1, 4, 16, 64, 256): few programs, at most 4x padding of the (cheap) row axis."""
  b = max(lo, 1)
  while b < n:
    b *= 4
  return b


def token_buckets(growth: int, max_tokens: int, steps: int = 1) -> list[int]:
  """Flat-axis sizes a ragged step can be padded to, ascending: 8 * growth^k below the step budget's power of two,
  then that power of two; with `steps` > 1 each interval [a, growth * a] is split into `steps` equal parts (rounded
  up to a multiple of 8), so a step's padding is at most 1 + (growth - 1) / steps of its tokens above the first
  interval (growth 2, steps 4: 256, 320, 384, 448, 512, ...) at the price of more step programs."""
  out, cap, n = [], pow2_at_least(max_tokens), 8
  while n < cap:
    out.append(n)
    n *= growth
  coarse = out + [cap]
  if steps <= 1:
    return coarse
  fine = set(coarse)
  for a, b in zip(coarse[:-1], coarse[1:]):
    fine.update(-(-(a + i * (b - a) // steps) // 8) * 8 for i in range(1, steps))
  return sorted(fine)


def token_bucket(total: int, growth: int, max_tokens: int, steps: int = 1) -> int:
  """Flat-axis size for a step of `total` tokens: the smallest of `token_buckets` that holds it."""
  return next((b for b in token_buckets(growth, max_tokens, steps) if b >= total), pow2_at_least(total))


class _PackedShape:
  """A step program's static shape: `fields()` names the int32 arrays packed, in order, into its one buffer."""

  def fields(self):
    raise NotImplementedError

  @property
  def size(self) -> int:
    return sum(int(np.prod(s)) for _, s in self.fields())


def result_width(spec: int) -> int:
  """Int32 results per row of a step: 1 (the sampled token), or with k drafts 1 + (k + 1) + k: the number of new
  tokens, the new tokens (accepted drafts, then the sampled one), the next drafts."""
  return 2 + 2 * spec if spec else 1


@dataclasses.dataclass(frozen=True)
class RaggedShape(_PackedShape):
  """Static shape of the step program (part of the jit key): N flat tokens (every row's tokens packed, decode rows
  1 each, prefill rows their chunk), R rows, block tables [R, width] (gathered in the program from the rows'
  slots of the device tables). `invariant`: the tiled body (the flat axis cut into fixed tiles of `tile` tokens,
  each through the same fixed-shape forward, in order). A token id < 0 is -(1 + j): the token sampled by row j of the previous step program, still
  on the device (async scheduling)."""
  tokens: int
  rows: int
  swa_width: int
  full_width: int
  invariant: bool = False
  spec: int = 0      # speculative decoding: drafts per row (k); the MTP block drafts, rows carry their drafts
  tile: int = 0      # invariant: tokens per fixed-shape tile of the device loop (tokens is a multiple of it)

  def fields(self):
    N, R = self.tokens, self.rows
    spec = (("ndraft", (R,)), ("next_tok", (R,)), ("prev_row", (R,))) if self.spec else ()
    return (("n_real", (1,)), ("tokens", (N,)), ("row", (N,)), ("pos", (N,)), ("start", (R,)), ("num", (R,)),
            ("last", (R,)), ("slot", (R,)), ("swa_base", (R,)), ("temperature", (R,)), ("top_k", (R,)),
            ("top_p", (R,)), ("seed", (R,)), ("step", (R,))) + spec

  @property
  def out_width(self) -> int:
    return result_width(self.spec)


_FLOAT_FIELDS = ("temperature", "top_p")     # float32 fields travel as their bit patterns


def unpack(buf, shape: _PackedShape) -> dict:
  """In the program: slices the packed int32 buffer back into named arrays."""
  out, o = {}, 0
  for name, s in shape.fields():
    n = int(np.prod(s))
    x = buf[o:o + n].reshape(s)
    if name in _FLOAT_FIELDS:
      x = jax.lax.bitcast_convert_type(x, jnp.float32)
    elif name == "seed":
      x = jax.lax.bitcast_convert_type(x, jnp.uint32)
    out[name] = x
    o += n
  return out


def pack(arrays: dict, shape: _PackedShape) -> np.ndarray:
  """On the host: the named arrays (every field of `shape.fields()`) as the one int32 buffer the program reads."""
  buf = np.empty(shape.size, np.int32)
  o = 0
  for name, s in shape.fields():
    n = int(np.prod(s))
    a = np.asarray(arrays[name])
    if a.dtype != np.int32:
      a = a.astype(np.float32).view(np.int32) if name in _FLOAT_FIELDS else a.astype(np.int32)
    buf[o:o + n] = a.reshape(-1)
    o += n
  return buf


def invariant_step_index(p, rows) -> caches.StepIndex:
  """The invariant step's `StepIndex`: the whole flat axis in one pass, its live tokens (`n_real`: every row's
  tokens come first) bounding the row-invariant ops' loops."""
  return caches.StepIndex(p["row"], p["pos"], p["start"], p["num"], rows, swa_base_R=p["swa_base"],
                          full_row_R=p.get("full_row"), live_tokens=p["n_real"][0], invariant=True)
