"""Indexer recall@k under quantized index keys, and what it costs in task accuracy.

recall@k of a key format = |top-k with the format's keys  ∩  top-k with fp32 keys| / k, per query, averaged: the
fraction of the exact selection the served indexer keeps. Queries and head weights stay fp32; only the stored index
keys change, through this project's own quantizers:

* "bf16": a bfloat16 round trip (the cache's bf16 index-key pool);
* "fp8":  `pallas_kernels.indexer_topk.quantize_index_keys` (e4m3, one fp32 scale per key row: the FP8 index-key
          pool the fused top-k kernel reads);
* "fp4":  `dsv4.layers.cache_quant.mxfp4_index` (e2m1, a power-of-two scale per 32 channels: V4.1's MXFP4 index
          keys as NeMo runs them).

Keys are quantized and dequantized to fp32, so scores differ only by what the format loses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import caches
from dsv4 import model as dsv4_model
from dsv4.layers import cache_quant
from pallas_kernels import indexer_topk

FORMATS = ("fp32", "bf16", "fp8", "fp4")
KEY_BYTES = {"fp32": lambda C: 4 * C, "bf16": lambda C: 2 * C, "fp8": lambda C: C + 4,
             "fp4": lambda C: C // 2 + C // 32}   # per key row: values + scales


def quantize_keys(k_MxC, fmt: str):
  """Index keys after a round trip through `fmt` (fp32 values)."""
  k = jnp.asarray(k_MxC, jnp.float32)
  if fmt == "fp32":
    return k
  if fmt == "bf16":
    return k.astype(jnp.bfloat16).astype(jnp.float32)
  if fmt == "fp8":
    return indexer_topk.dequantize_index_keys(indexer_topk.quantize_index_keys(k))
  if fmt == "fp4":
    return cache_quant.mxfp4_index(k)
  raise ValueError(f"key format {fmt!r} not in {FORMATS}")


@jax.jit
def index_scores(q_QxHxC, w_QxH, k_MxC):
  """Lightning indexer scores I(t, n) = sum_h w_h ReLU(q_h . k_n), fp32."""
  dots = jnp.einsum("qhc,mc->qhm", q_QxHxC, k_MxC, precision=jax.lax.Precision.HIGHEST)
  return jnp.einsum("qhm,qh->qm", jax.nn.relu(dots), w_QxH, precision=jax.lax.Precision.HIGHEST)


def recall_at_k(ref_QxM, other_QxM, k: int) -> float:
  """Mean over queries of |top-k(other) ∩ top-k(ref)| / k, over the finite (visible) entries."""
  ref, other = np.asarray(ref_QxM), np.asarray(other_QxM)
  out = []
  for r, o in zip(ref, other):
    vis = np.isfinite(r)
    kk = min(k, int(vis.sum()))
    if kk == 0:
      continue
    r = np.where(vis, r, -np.inf)
    o = np.where(vis, o, -np.inf)
    a = np.argpartition(-r, kk - 1)[:kk]
    b = np.argpartition(-o, kk - 1)[:kk]
    out.append(len(np.intersect1d(a, b)) / kk)
  return float(np.mean(out)) if out else float("nan")


# ----------------------------------------------------------------------------------------------------------
# Random indexer at a given width (V4-Flash: 64 heads x 128; V4.1-Flash: 32 x 128)

def random_indexer(num_heads: int, head_dim: int, num_entries: int, num_queries: int, seed: int = 0):
  """(q [Q,H,C], w [Q,H], k [M,C]) of an indexer with random weights on random inputs: keys RMS-normalised (the
  indexer normalises its keys; RoPE is a rotation, so it leaves i.i.d. Gaussian keys i.i.d.), queries unit-variance
  per channel, head weights N(0, 1) x C^-1/2 x H^-1/2 (the indexer's scale)."""
  rng = np.random.default_rng(seed)
  k = rng.standard_normal((num_entries, head_dim)).astype(np.float32)
  k /= np.sqrt(np.mean(k * k, axis=-1, keepdims=True))
  q = rng.standard_normal((num_queries, num_heads, head_dim)).astype(np.float32)
  w = (rng.standard_normal((num_queries, num_heads)) * head_dim ** -0.5 * num_heads ** -0.5).astype(np.float32)
  return jnp.asarray(q), jnp.asarray(w), jnp.asarray(k)


# ----------------------------------------------------------------------------------------------------------
# Trained models: the index-key pool of the cache, quantized between the prefill and the query step

def index_layers(config) -> list[int]:
  """Layers whose cache holds index keys (V4 CSA, V4.1 full)."""
  return [p.index for p in config.layer_plan() if p.has_index_keys]


def with_quantized_index_keys(cache: caches.ModelCache, layers: list[int], fmt: str) -> caches.ModelCache:
  new = []
  for l, d in enumerate(cache.layers):
    d = dict(d)
    if l in layers and fmt != "fp32":
      k = d["index_keys"]
      d["index_keys"] = quantize_keys(k.reshape(-1, k.shape[-1]), fmt).reshape(k.shape).astype(k.dtype)
    new.append(d)
  return caches.ModelCache(tuple(new))


@functools.partial(jax.jit, static_argnames=("config", "collect_aux"))
def _step(params, config, cache, tokens_BxT, start_B, swa, full, collect_aux: bool = False):
  B, T = tokens_BxT.shape
  index = caches.BatchIndex(start_B, jnp.full((B,), T, jnp.int32), swa, full)
  return dsv4_model.forward_aux(params, config, tokens_BxT, cache, index, collect_aux=collect_aux)


def prefill_then_query(params, config, tokens_BxT: np.ndarray, num_query: int, fmts=FORMATS,
                       prefill_chunk: int = 2048):
  """Prefill tokens [0, T - num_query) in chunks of `prefill_chunk` (one compiled shape; a whole 8k prefill at once
  would hold every position's indexer product), then for each key format run the last num_query tokens against
  the cache with that format's index keys. Returns {fmt: (logits [B, Q, V], [per index layer: index_scores
  [B, Q, M]])}."""
  B, T = tokens_BxT.shape
  P = T - num_query
  cache, swa, full = caches.init_contiguous(config, B, T)
  swa, full = jnp.asarray(swa), jnp.asarray(full)
  tok = jnp.asarray(tokens_BxT, jnp.int32)
  for s in range(0, P, prefill_chunk):
    n = min(prefill_chunk, P - s)
    cache, _, _ = _step(params, config, cache, tok[:, s:s + n], jnp.full((B,), s, jnp.int32), swa, full)
  layers = index_layers(config)
  out = {}
  for fmt in fmts:
    c = with_quantized_index_keys(cache, layers, fmt)
    _, logits, auxes = _step(params, config, c, tok[:, P:], jnp.full((B,), P, jnp.int32), swa, full,
                             collect_aux=True)
    out[fmt] = (np.asarray(logits), [np.asarray(auxes[l]["index_scores"]) for l in layers
                                     if "index_scores" in auxes[l]])
  return out
