"""A pool of narrow floats (bf16, float8) held as its unsigned words, read as the floats.

Why: XLA's CPU updates a slice of a float array narrower than 32 bits by converting the whole array to fp32 and
back (its float-normalization pass), so writing a step's few KV rows into a bf16 pool costs passes over the pool,
work that follows the pool's size, not the rows written. An unsigned word array is updated in place. So on the CPU
the model's caches hold their narrow float pools as words (`dsv4/caches.py`), and hand them to the ops here as a
`WordPool`: a row read gathers the words and converts only the rows it took (`take`, `WordPool.__getitem__`; XLA
fuses the conversion into the gather, also inside a loop body), so a read costs what it reads. A Pallas kernel
gets the whole pool converted (`floats`): on the CPU kernels only run in interpret mode, and GPUs hold plain pools
(they update narrow floats in place).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WordPool:
  """`words` (an unsigned array of `dtype`'s width) standing for the `dtype` array with the same bits; `shape` and
  `dtype` are the float array's."""
  words: jax.Array
  dtype: Any = dataclasses.field(metadata=dict(static=True))

  def __post_init__(self):
    object.__setattr__(self, "dtype", np.dtype(self.dtype))
    if (not jnp.issubdtype(self.words.dtype, jnp.unsignedinteger)
        or np.dtype(self.words.dtype).itemsize != self.dtype.itemsize):
      raise ValueError(f"WordPool: words of {self.dtype} must be unsigned of {self.dtype.itemsize} bytes, got "
                       f"{self.words.dtype}")

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.words.shape)

  @property
  def ndim(self) -> int:
    return len(self.words.shape)

  def floats(self) -> jax.Array:
    """The whole pool as floats (a pass over it on the CPU)."""
    return jax.lax.bitcast_convert_type(self.words, self.dtype)

  def reshape(self, *shape) -> "WordPool":
    return WordPool(self.words.reshape(*shape), self.dtype)

  def __getitem__(self, idx) -> jax.Array:
    return jax.lax.bitcast_convert_type(self.words[idx], self.dtype)


def take(pool, idx, axis: int = 0, **kw):
  """`jnp.take(pool, idx, axis)` for a plain pool or a `WordPool` (the taken words converted)."""
  if isinstance(pool, WordPool):
    return jax.lax.bitcast_convert_type(jnp.take(pool.words, idx, axis=axis, **kw), pool.dtype)
  return jnp.take(pool, idx, axis=axis, **kw)


def _is_word_pool(x) -> bool:
  return isinstance(x, WordPool)


def floats(tree):
  """`tree` with every `WordPool` in it converted to its float array (for a Pallas kernel)."""
  return jax.tree_util.tree_map(lambda x: x.floats() if isinstance(x, WordPool) else x, tree, is_leaf=_is_word_pool)
