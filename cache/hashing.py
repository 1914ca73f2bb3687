"""Chained block hashes, computed on the host with hashlib.blake2b over a canonical byte encoding.

digest(unit u) = blake2b_128(b"dsv4/kv/1" | parent digest (16 B) | extra blob | int32 LE tokens of the unit),
with parent = the digest of unit u-1, or for u = 0 the root digest blake2b_128(b"dsv4/kv/root" | extra blob).
A unit is `CacheSpecs.hash_tokens` tokens (the gcd of the group block sizes); a group block of k units is named
by the digest of its last unit, which already covers the whole prefix (parent chaining).

Extra keys (tenant salt, model/layout fingerprint, adapter id) enter the root and every unit, so two tenants never
share a block and a blob-less prefix never meets a salted one.

On the device a block is keyed by a *truncated* key (two int32 words from the digest's first 8 bytes, optionally
masked to `key_bits` bits so tests can force collisions). The key only finds candidates: a hit additionally
compares the block's stored tokens and its stored parent digest (all 128 bits) with the request's, so a key
collision can never return another prefix's blocks; a false hit would need a blake2b-128 collision of the
parent prefix (BUILD_NOTES.md, Cache bookkeeping, "Exact hits"; docs/kv_cache.md).
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

DIGEST_BYTES = 16
DIGEST_WORDS = DIGEST_BYTES // 4


@dataclasses.dataclass(frozen=True)
class ExtraKeys:
  """Everything besides tokens that decides whether cached KV may be reused."""
  tenant: str = ""        # cache salt: different tenants never share blocks
  model: str = ""         # weights identity (checkpoint name / revision)
  adapter: str = ""       # LoRA / adapter id, "" for none
  layout: str = ""        # filled in by the manager: `CacheSpecs.fingerprint`
  private: str = ""       # per-admission key when prefix caching is off (the engine's salt): matches nothing else

  def blob(self) -> bytes:
    # Every field length-prefixed: no choice of user strings can make two different key sets encode alike.
    out = b""
    for v in (self.tenant, self.model, self.adapter, self.layout, self.private):
      b = v.encode("utf-8")
      out += len(b).to_bytes(4, "little") + b
    return out


def root_digest(extra_blob: bytes) -> bytes:
  return hashlib.blake2b(b"dsv4/kv/root" + extra_blob, digest_size=DIGEST_BYTES).digest()


def unit_digest(parent: bytes, tokens: np.ndarray, extra_blob: bytes) -> bytes:
  h = hashlib.blake2b(b"dsv4/kv/1", digest_size=DIGEST_BYTES)
  h.update(parent)
  h.update(extra_blob)
  h.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
  return h.digest()


def digest_words(d: bytes) -> np.ndarray:
  """All 128 bits as 4 int32 (the parent identity stored per block and compared on a hit)."""
  return np.frombuffer(d, dtype="<i4").copy()


def device_key(d: bytes, key_bits: int = 64) -> np.ndarray:
  """Truncated table key as int32[2] = (hi, lo); lo's low bits pick the home slot."""
  k = int.from_bytes(d[:8], "little")
  if key_bits < 64:
    k &= (1 << key_bits) - 1
  return np.array([k >> 32, k & 0xFFFFFFFF], dtype=np.uint32).view(np.int32)


def key_int(key2: np.ndarray) -> int:
  """The device key as one signed int64 (what KV events publish)."""
  hi, lo = (int(x) & 0xFFFFFFFF for x in np.asarray(key2))
  v = (hi << 32) | lo
  return v - (1 << 64) if v >= 1 << 63 else v


def keys_from_words(w_Ux4: np.ndarray, key_bits: int = 64) -> np.ndarray:
  """Device keys (int32 [U, 2] = hi, lo; as `device_key`) of digests given as little-endian uint32 words."""
  # the key is the digest's first 64 bits (little-endian: word 1 high, word 0 low), masked to key_bits; done on the
  # two 32-bit words, without a uint64 detour
  w = np.asarray(w_Ux4, np.uint32)
  lo, hi = w[:, 0], w[:, 1]
  if key_bits < 64:
    hi = hi & np.uint32((1 << max(key_bits - 32, 0)) - 1)
    lo = lo & np.uint32((1 << min(key_bits, 32)) - 1)
  out = np.empty((len(w), 2), np.int32)
  out[:, 0] = hi.view(np.int32)
  out[:, 1] = lo.view(np.int32)
  return out


class RequestHasher:
  """Incremental chained hashes of one request's tokens (prompt, then outputs as they arrive)."""

  def __init__(self, extra: ExtraKeys, hash_tokens: int, key_bits: int = 64):
    self.extra_blob = extra.blob()
    self.hash_tokens = hash_tokens
    self.key_bits = key_bits
    self.root = root_digest(self.extra_blob)
    self.digests: list[bytes] = []      # digests[u] names the prefix [0, (u+1)*hash_tokens)
    self.blob = bytearray()             # the same digests concatenated: read for many requests at once (manager)

  def update(self, tokens: np.ndarray, offset: int = 0) -> None:
    """Hash every complete unit not hashed yet. `tokens` = the request's tokens from position `offset` on (a
    multiple of hash_tokens, at most the first unhashed position), so callers can pass only the new part."""
    g = self.hash_tokens
    if offset % g or offset > len(self.digests) * g:
      raise ValueError(f"RequestHasher.update: offset {offset} must be a multiple of {g} <= {len(self.digests) * g}")
    n = (offset + len(tokens)) // g
    for u in range(len(self.digests), n):
      parent = self.digests[u - 1] if u else self.root
      s = u * g - offset
      d = unit_digest(parent, tokens[s:s + g], self.extra_blob)
      self.digests.append(d)
      self.blob += d

  def parent(self, u: int) -> bytes:
    return self.digests[u - 1] if u else self.root

  def arrays(self, num_units: int) -> tuple[np.ndarray, np.ndarray]:
    """(key_Ux2, parent_Ux4) for units [0, num_units), zero-padded past the hashed ones (vectorised)."""
    key = np.zeros((num_units, 2), np.int32)
    par = np.zeros((num_units, DIGEST_WORDS), np.int32)
    n = min(num_units, len(self.digests))
    if n:
      w = np.frombuffer(b"".join(self.digests[:n]), dtype="<u4").reshape(n, DIGEST_WORDS)
      key[:n] = keys_from_words(w, self.key_bits)
      par[0] = np.frombuffer(self.root, dtype="<i4")
      par[1:n] = w[:n - 1].view(np.int32)
    return key, par

  def rows(self, key_units, parent_units) -> tuple[np.ndarray, np.ndarray]:
    """(key_Mx2 of digests[key_units], parent_Mx4 = words of parent(parent_units)), vectorised: what `register`
    stores per block (a block is named by its last unit's digest and chained to the digest before its first)."""
    w = np.frombuffer(b"".join(self.digests[u] for u in key_units), dtype="<u4").reshape(-1, DIGEST_WORDS)
    par = np.frombuffer(b"".join(self.parent(u) for u in parent_units), dtype="<i4").reshape(-1, DIGEST_WORDS)
    return keys_from_words(w, self.key_bits), par.copy()
