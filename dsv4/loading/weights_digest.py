"""The identity of a set of weights: a digest of every byte of every leaf, computed once.

Two places need it: a checkpoint's integrity file (orbax_io's per-leaf digests, checked on restore) and the KV
tiers' record fingerprint (a record written under one set of weights must never answer for another, so two
fine-tunes that differ in one element must get different digests). Both use `leaf_digest`: blake2b over the leaf's
dtype, shape and all its bytes.

Hashing a large model is a pass over all of its bytes, so it is done while the bytes are in hand anyway: the
safetensors loader feeds each tensor to a `LeafHasher` as it converts it, and orbax restore checks (and keeps) the
digests it computes. A computed leaf digest is remembered against the leaf object (a weak reference: jax arrays are
immutable, so the object identifies its bytes); `params_digest` then costs nothing for those leaves and hashes only
leaves it has never seen (a random init, a leaf a notebook replaced, a cast).
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from typing import NamedTuple

import jax
import numpy as np

_DIGEST_BYTES = 16
_lock = threading.Lock()
class _Known(NamedTuple):
  ref: weakref.ref   # to the leaf (an id can be reused once the leaf is gone)
  digest: str


_known: dict[int, _Known] = {}   # id(leaf) -> what is known about it


def _header(dtype, shape) -> bytes:
  return str(np.dtype(dtype)).encode() + str(tuple(int(s) for s in shape)).encode()


def leaf_digest(x) -> str:
  """blake2b of the leaf's dtype, shape and every byte (hex)."""
  a = np.ascontiguousarray(np.asarray(x))
  h = hashlib.blake2b(_header(a.dtype, a.shape), digest_size=_DIGEST_BYTES)
  h.update(a.reshape(-1).view(np.uint8).data if a.size else b"")
  return h.hexdigest()


class LeafHasher:
  """`leaf_digest` of an array of `shape` fed as its axis-0 slabs in any order (e.g. routed experts arriving from
  different shards): slabs are hashed as soon as every earlier slab has been, so in the usual in-order stream
  nothing is held; an early slab is copied and held until its turn."""

  def __init__(self, dtype, shape):
    self.h = hashlib.blake2b(_header(dtype, shape), digest_size=_DIGEST_BYTES)
    self.count, self.next = int(shape[0]), 0
    self.dtype = np.dtype(dtype)
    self.held: dict[int, np.ndarray] = {}

  def add(self, index: int, slab) -> None:
    a = np.ascontiguousarray(np.asarray(slab, dtype=self.dtype))
    if index != self.next:
      self.held[index] = a.copy()
      return
    self._update(a)
    while self.next in self.held:
      self._update(self.held.pop(self.next))

  def _update(self, a: np.ndarray) -> None:
    self.h.update(a.reshape(-1).view(np.uint8).data if a.size else b"")
    self.next += 1

  def hexdigest(self) -> str:
    if self.next != self.count or self.held:
      raise ValueError(f"LeafHasher: {self.next} of {self.count} slabs hashed ({len(self.held)} held)")
    return self.h.hexdigest()


def remember(leaf, digest: str) -> None:
  """Record that `leaf` (an immutable array object) has `digest`; forgotten when the leaf is garbage collected."""
  if not isinstance(leaf, jax.Array):   # numpy arrays can change in place: never remembered
    return
  ref = weakref.ref(leaf)
  key = id(leaf)
  with _lock:
    _known[key] = _Known(ref, digest)
  weakref.finalize(leaf, _forget, key, ref)


def _forget(key: int, ref) -> None:
  with _lock:
    if key in _known and _known[key].ref is ref:
      del _known[key]


def known_digest(leaf) -> str | None:
  with _lock:
    entry = _known.get(id(leaf))
  if entry is not None and entry.ref() is leaf:
    return entry.digest
  return None


def _path_str(path) -> str:
  return "/".join(str(getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))) for p in path)


def flat(tree) -> dict:
  """{"a/b/0": leaf} for a param tree (the spelling of orbax_io's digest file)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {_path_str(p): v for p, v in leaves}


def params_digest(params) -> str:
  """Digest of a whole param tree: its structure and the digest of every leaf (remembered ones are reused; the
  others are hashed in full here, every byte, and remembered)."""
  h = hashlib.blake2b(str(jax.tree_util.tree_structure(params)).encode(), digest_size=_DIGEST_BYTES)
  for path, leaf in sorted(flat(params).items()):
    d = known_digest(leaf)
    if d is None:
      d = leaf_digest(leaf)
      remember(leaf, d)
    h.update(f"{path}={d};".encode())
  return h.hexdigest()
