"""V4.1 Engram (docs/model.md, V4.1 Engram): a hashed n-gram memory added to the residual streams before some layers.

Follows NeMo Automodel 0.7.0 `deepseek_v41/engram.py` (itself DeepSeek's released `inference/engram.py`):

* token ids are first mapped to a *normalised* vocabulary (`token_map`, derived from the tokenizer: NFKC, NFD,
  strip accents, lower case, whitespace folding; `compressed_token_map` below);
* for the current token and the previous `max_ngram_size - 1` ones (positions < 0 -> the pad token's id), the
  products `tok[t - s] * mult[s]` (int64, wrapping) are XOR-folded; the n-gram of size n+1 has hash
  `fold_n mod prime[n, h]` for each of `n_heads` primes, plus a per-head row offset into one table;
* the looked-up rows [hash_heads * head_dim] are projected to (hc_mult + 1) * D: per-stream keys and one value;
  a gate per stream `sigmoid(signed_sqrt(<rms(X_k) * q*k_w, rms(key_k)> / sqrt(D)))` mixes the value into stream k.

JAX has no int64 by default, so the int64 arithmetic is emulated exactly in uint32 byte limbs: the product
`tok * mult` (tok < 2^24) limb by limb with carries, XOR limb-wise, then the *signed* 64-bit value mod p by
Horner over bytes (needs p < 2^24; Flash primes are ~1.6e7) with a correction of 2^64 mod p when the sign bit is
set. `hash_ids_reference` is the same in numpy int64 for tests.

The previous tokens of a chunk come from the cache: the SWA-group `token_ids` rows (read back through the block
table exactly like the window), so chunked prefill and decode hash exactly like the full forward.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Regex, normalizers

from dsv4.config import EngramConfig, ModelConfig


def _next_prime(start: int, seen: set[int]) -> int:
  c = start + 1
  while True:
    if c >= 2 and (c == 2 or (c % 2 and all(c % d for d in range(3, math.isqrt(c) + 1, 2)))) and c not in seen:
      return c
    c += 1


@functools.cache
def hash_constants(cfg: EngramConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """primes [L, hash_heads], offsets [L, hash_heads], multipliers [L, max_ngram] (int64), per Engram layer."""
  primes, offsets, mults, seen = [], [], [], set()
  bound = max(1, (np.iinfo(np.int64).max // cfg.compressed_vocab_size) // 2)
  for layer_id, rows in zip(cfg.layer_ids, cfg.num_embeddings):
    lp = []
    for _ in range(cfg.max_ngram_size - 1):
      cur = cfg.vocab_size - 1
      for _ in range(cfg.n_heads):
        cur = _next_prime(cur, seen)
        seen.add(cur)
        lp.append(cur)
    if sum(lp) > rows:
      raise ValueError(f"engram.num_embeddings: layer {layer_id} needs {sum(lp)} rows for its hash buckets, "
                       f"config has {rows}")
    primes.append(lp)
    offsets.append(np.cumsum([0, *lp[:-1]]))
    vals = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(cfg.max_ngram_size,), dtype=np.int64)
    mults.append(vals * 2 + 1)
  return (np.asarray(primes, np.int64), np.asarray(offsets, np.int64), np.asarray(mults, np.int64))


def hash_ids_reference(token_map, tokens_BxT, cfg: EngramConfig, prev_BxP=None):
  """numpy int64 reference: hash rows [B, T, L, hash_heads]. prev_BxP: previous raw ids (-1 = none)."""
  primes, offsets, mults = hash_constants(cfg)
  tm = np.asarray(token_map, np.int64)
  pad = tm[cfg.pad_token_id]
  B, T = tokens_BxT.shape
  P = cfg.max_ngram_size - 1
  prev = np.full((B, P), -1, np.int64) if prev_BxP is None else np.asarray(prev_BxP, np.int64)
  ext = np.concatenate([prev, np.asarray(tokens_BxT, np.int64)], axis=1)
  comp = np.where(ext >= 0, tm[np.maximum(ext, 0)], -1)
  out = []
  with np.errstate(over="ignore"):
    blocked = np.zeros((B, T), bool)
    toks = []
    for s in range(cfg.max_ngram_size):
      src = comp[:, P - s: P - s + T]
      blocked = blocked | (src == -1)
      toks.append(np.where(blocked, pad, src))
    prod = np.stack(toks, -1)[:, :, None, :] * mults[None, None]   # [B, T, L, n]
    rolling = prod[..., 0]
    for s in range(1, cfg.max_ngram_size):
      rolling = rolling ^ prod[..., s]
      hs = slice((s - 1) * cfg.n_heads, s * cfg.n_heads)
      out.append(np.mod(rolling[..., None], primes[None, None, :, hs]))
  return np.concatenate(out, -1) + offsets[None, None]


# ----------------------------------------------------------------------------------------------------------
# Exact int64 emulation in uint32 byte limbs.

def _bytes_of(x) -> np.ndarray:
  """int64 array -> [..., 8] little-endian byte limbs (of the two's-complement value)."""
  u = np.asarray(x, np.int64).astype(np.uint64)
  return np.stack([(u >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(8)], -1).astype(np.uint32)


def hash_ids(token_map, ext_tokens_BxE, cfg: EngramConfig, T: int):
  """Hash rows [B, T, L, hash_heads] (int32) for the last T positions of ext_tokens (raw ids, -1 = none / blocked),
  which holds max_ngram_size - 1 earlier tokens in front of the chunk. Vectorised over layers, sizes and heads
  (a handful of XLA ops: the byte-limb loops run 8 steps each)."""
  primes, offsets, mults = hash_constants(cfg)
  n, H = cfg.max_ngram_size, cfg.n_heads
  L = primes.shape[0]
  P = n - 1
  tm = jnp.asarray(token_map, jnp.int32)
  pad = tm[cfg.pad_token_id]
  comp = jnp.where(ext_tokens_BxE >= 0, tm[jnp.clip(ext_tokens_BxE, 0, tm.shape[0] - 1)], -1)
  blocked = jnp.zeros(comp[:, :T].shape, bool)
  toks = []
  for s in range(n):
    src = comp[:, P - s: P - s + T]
    blocked = blocked | (src == -1)
    toks.append(jnp.where(blocked, pad, src).astype(jnp.uint32))
  tok = jnp.stack(toks, -1)[:, :, None, :]                       # [B, T, 1, n]  (< 2^24)
  mb = _bytes_of(mults)                                          # [L, n, 8]
  carry = jnp.zeros(tok.shape[:2] + (L, n), jnp.uint32)
  limbs = []
  for i in range(8):                                             # tok * mult mod 2^64, byte by byte
    acc = tok * jnp.asarray(mb[..., i]) + carry                  # < 2^24 * 2^8 + 2^25 < 2^32
    limbs.append(acc & jnp.uint32(0xFF))
    carry = acc >> 8
  prod = jnp.stack(limbs, -1)                                    # [B, T, L, n, 8]
  rolling = jax.lax.associative_scan(jnp.bitwise_xor, prod, axis=3)[:, :, :, 1:]   # [B, T, L, n-1, 8]
  p = jnp.asarray(primes.reshape(L, n - 1, H).astype(np.uint32))  # < 2^24
  assert int(primes.max()) < (1 << 24), "Engram primes must stay below 2^24 for the uint32 emulation"
  r = jnp.zeros(rolling.shape[:-1] + (H,), jnp.uint32)
  for i in reversed(range(8)):                                   # unsigned value mod p (Horner over bytes)
    r = (r * jnp.uint32(256) + rolling[..., i, None]) % p
  k = jnp.asarray((np.asarray([[[(1 << 64) % int(q) for q in row] for row in lay]
                               for lay in primes.reshape(L, n - 1, H)], np.int64)).astype(np.uint32))
  neg = (rolling[..., 7] >= 128)[..., None]                      # two's-complement sign: value - 2^64
  r = jnp.where(neg, (r + p - k) % p, r)
  return r.reshape(*r.shape[:3], (n - 1) * H).astype(jnp.int32) + jnp.asarray(offsets.astype(np.int32))


def engram(params, X_BxTxNxD, hash_BxTxH, eps: float):
  """Adds the gated memory value to every stream."""
  B, T, N, D = X_BxTxNxD.shape
  emb = jnp.take(params["embed"], hash_BxTxH, axis=0).reshape(B, T, -1)
  kv = jnp.dot(emb, params["wkv"], precision=jax.lax.Precision.HIGHEST)
  key = kv[..., : N * D].astype(jnp.float32).reshape(B, T, N, D)
  value = kv[..., N * D:].astype(jnp.float32)
  hidden = X_BxTxNxD.astype(jnp.float32)
  w = params["q_weight"].astype(jnp.float32) * params["k_weight"].astype(jnp.float32)
  rstd = jax.lax.rsqrt(jnp.mean(hidden * hidden, -1) + eps) * jax.lax.rsqrt(jnp.mean(key * key, -1) + eps)
  dot = jnp.sum(hidden * w * key, -1) * rstd * D ** -0.5
  gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)), dot))
  return (hidden + gate[..., None] * value[:, :, None, :]).astype(X_BxTxNxD.dtype)


def compressed_token_map(tokenizer) -> tuple[np.ndarray, int]:
  """The released normalised-vocabulary map of a HF fast tokenizer (NeMo `_compressed_token_map`)."""
  sentinel = "\ue000"
  norm = normalizers.Sequence([
      normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
      normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
      normalizers.Strip(), normalizers.Replace(sentinel, " ")])
  backend = tokenizer.backend_tokenizer
  key_to_id, out = {}, []
  for tid in range(len(tokenizer)):
    text = backend.decode([tid], skip_special_tokens=False)
    if "\ufffd" in text:
      key = backend.id_to_token(tid)
    else:
      n = norm.normalize_str(text)
      key = n if n else text
    key_to_id.setdefault(key, len(key_to_id))
    out.append(key_to_id[key])
  return np.asarray(out, np.int32), len(key_to_id)


def check_config(config: ModelConfig) -> None:
  hash_constants(config.engram)
