"""The step program's plan: its static shape (`RaggedShape`, part of the jit key: one per engine, the runner's
`_step_shape`) and the one int32 buffer that carries it host -> device (`pack` on the host, `unpack` inside the
program)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import caches


def pow2_at_least(n: int, lo: int = 1) -> int:
  n = max(n, lo, 1)
  return 1 << (n - 1).bit_length()


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
  """Static shape of the step program (part of the jit key): N flat tokens (every row's tokens packed first, decode
  rows 1 each, prefill rows their chunk; `n_real` of them live), R rows, block tables [R, width] (the full table is
  the engine's device table read in place, the swa table gathered in the program from the rows' slots). A token id
  < 0 is -(1 + j): the token sampled by row j of the previous step program, still on the device (async
  scheduling)."""
  tokens: int
  rows: int
  swa_width: int
  full_width: int
  spec: int = 0      # speculative decoding: drafts per row (k); the MTP block drafts, rows carry their drafts

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


def live_rows(p):
  """The step's live rows (the runner packs them from row 0)."""
  return jnp.sum(p["num"] > 0)


def invariant_step_index(p, rows) -> caches.StepIndex:
  """The invariant step's `StepIndex`: the whole flat axis in one pass, its live tokens (`n_real`: every row's
  tokens come first) bounding the row-invariant ops' loops."""
  return caches.StepIndex(p["row"], p["pos"], p["start"], p["num"], rows, swa_base_R=p["swa_base"],
                          full_row_R=p.get("full_row"), live_tokens=p["n_real"][0], invariant=True)
