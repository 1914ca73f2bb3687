"""Resuming a session: exact restore of the window / compressor state vs bounded replay of the last R tokens.

Two ways to continue a sequence of P tokens whose compressed KV (every completed compressed entry and index key,
the FULL cache group) is still cached:

* **exact restore** (this project: the cache's SWA checkpoints hold, per layer, the window KV rows and the
  compressor running-pool state row at the resume point): the continuation reads the very rows a straight run would
  have written. Modelled here by continuing from the cache of the prefill itself, which is what a checkpoint
  restore copies back bit for bit.
* **bounded replay R** (replay-based servers that keep only compressed KV): the SWA group (window KV of every layer,
  compressor state, Engram token ids) is gone; the server re-runs the model over tokens [P - R, P) with the cached
  compressed entries visible, which rebuilds the window rows and the compressor state from what those R tokens alone
  give. Window rows before P - R do not exist (their block-table entries are -1, so attention masks them) and the
  compressor state before P - R is empty. Entries that complete inside the replayed span are recomputed during the
  replay (replayed tokens read those), then the cached exact entries are put back, because such servers keep the
  compressed KV of the whole prefix.

In a model with L layers a token's layer-l input depends on up to l windows of earlier tokens, so replayed rows
near P - R are computed from a truncated context; their error reaches the resume point when R < about L x window.
`resume_logits` returns the continuation's logits under both, `bytes_*` what each reads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import caches
from dsv4 import model as dsv4_model
from dsv4.config import ModelConfig

SWA, FULL = "swa", "full"


def layout_for(dtype: str, swa_block_tokens: int = 16) -> caches.CacheLayout:
  """Cache layout of the experiment. Small swa blocks so a replay start (a multiple of the block) can be cut
  exactly: the blocks before it are dropped from the table."""
  return caches.CacheLayout(swa_block_tokens=swa_block_tokens,
                            kv_dtype=jnp.bfloat16 if dtype == "bf16" else jnp.float32)


def params_in(params, dtype: str):
  return dsv4_model.cast_params(params, jnp.bfloat16) if dtype == "bf16" else params


@functools.partial(jax.jit, static_argnames=("config", "layout"))
def _step(params, config: ModelConfig, layout, cache, tokens_BxT, start_B, swa_BxS, full_BxF):
  B, T = tokens_BxT.shape
  index = caches.BatchIndex(start_B, jnp.full((B,), T, jnp.int32), swa_BxS, full_BxF)
  cache, logits, _ = dsv4_model.forward_aux(params, config, tokens_BxT, cache, index, layout=layout)
  return cache, logits


def _groups(config: ModelConfig, layout) -> dict[tuple[int, str], str]:
  return {(s.layer, s.name): s.group for s in caches.cache_array_specs(config, layout)}


def _mix(config, layout, swa_from: caches.ModelCache, full_from: caches.ModelCache) -> caches.ModelCache:
  """A cache whose SWA-group arrays come from `swa_from` and FULL-group arrays from `full_from`."""
  g = _groups(config, layout)
  return caches.ModelCache(tuple(
      {name: (full_from.layers[l][name] if g[(l, name)] == FULL else swa_from.layers[l][name]) for name in d}
      for l, d in enumerate(swa_from.layers)))


def resume_logits(params, config: ModelConfig, tokens_BxT: np.ndarray, resume_at: int, replays: list[int],
                  dtype: str = "fp32") -> dict:
  """Logits of tokens [resume_at, T) after a resume at `resume_at`, exact and with each bounded replay R.

  Returns {"exact": [B, S, V], R: [B, S, V] for R in replays} (numpy fp32), S = T - resume_at. R must be a
  multiple of the swa block (16 tokens) and <= resume_at; R = resume_at replays the whole prefix (= exact up to
  float reassociation)."""
  layout = layout_for(dtype)
  sb = layout.swa_block_tokens
  P = int(resume_at)
  B, T = tokens_BxT.shape
  p = params_in(params, dtype)
  tok = jnp.asarray(tokens_BxT, jnp.int32)
  empty, swa, full = caches.init_contiguous(config, B, T, layout)
  swa, full = jnp.asarray(swa), jnp.asarray(full)
  at = lambda s: jnp.full((B,), s, jnp.int32)
  cache_a, _ = _step(p, config, layout, empty, tok[:, :P], at(0), swa, full)
  _, logits = _step(p, config, layout, cache_a, tok[:, P:], at(P), swa, full)
  out = {"exact": np.asarray(logits, np.float32)}
  for R in replays:
    if R % sb or not 0 < R <= P:
      raise ValueError(f"replay length {R}: must be a positive multiple of {sb} and <= {P}")
    swa_r = swa.at[:, :(P - R) // sb].set(-1)      # rows before P - R do not exist
    cache_b = _mix(config, layout, empty, cache_a)   # compressed KV cached, SWA group empty
    cache_b, _ = _step(p, config, layout, cache_b, tok[:, P - R:P], at(P - R), swa_r, full)
    cache_b = _mix(config, layout, cache_b, cache_a)  # keep the cached exact compressed entries
    _, logits_r = _step(p, config, layout, cache_b, tok[:, P:], at(P), swa_r, full)
    out[R] = np.asarray(logits_r, np.float32)
  return out


def greedy_continuation(params, config: ModelConfig, prefix_BxP: np.ndarray, steps: int,
                        dtype: str = "fp32") -> np.ndarray:
  """[B, steps] greedy tokens after the prefix (exact cache, one decode step per token)."""
  layout = layout_for(dtype)
  B, P = prefix_BxP.shape
  p = params_in(params, dtype)
  cache, swa, full = caches.init_contiguous(config, B, P + steps, layout)
  swa, full = jnp.asarray(swa), jnp.asarray(full)
  cache, logits = _step(p, config, layout, cache, jnp.asarray(prefix_BxP, jnp.int32), jnp.zeros((B,), jnp.int32),
                        swa, full)
  nxt = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
  out = [nxt]
  for i in range(steps - 1):
    cache, logits = _step(p, config, layout, cache, nxt[:, None], jnp.full((B,), P + i, jnp.int32), swa, full)
    nxt = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
    out.append(nxt)
  return np.asarray(jnp.stack(out, axis=1))


def drift_stats(exact_BxSxV: np.ndarray, other_BxSxV: np.ndarray, follow_BxS: np.ndarray | None = None) -> dict:
  """Max |logit difference|, mean KL(exact || other) per token, fraction of positions whose argmax differs, and the
  first position (0-based, after the resume point) where the argmax differs (mean over rows; S where never). With
  `follow` = the exact greedy continuation as teacher-forced tokens, that first position is exactly where greedy
  decoding after a replay first emits another token."""
  d = np.abs(exact_BxSxV - other_BxSxV)
  le = exact_BxSxV - np.log(np.sum(np.exp(exact_BxSxV - exact_BxSxV.max(-1, keepdims=True)), -1,
                                   keepdims=True)) - exact_BxSxV.max(-1, keepdims=True)
  lo = other_BxSxV - np.log(np.sum(np.exp(other_BxSxV - other_BxSxV.max(-1, keepdims=True)), -1,
                                   keepdims=True)) - other_BxSxV.max(-1, keepdims=True)
  kl = np.sum(np.exp(le) * (le - lo), -1)
  a, b = exact_BxSxV.argmax(-1), other_BxSxV.argmax(-1)
  if follow_BxS is not None:
    a = follow_BxS
  diff = a != b
  S = diff.shape[1]
  first = np.where(diff.any(1), diff.argmax(1), S)
  return dict(max_abs_logit_diff=float(d.max()), mean_kl=float(kl.mean()), argmax_changed=float(diff.mean()),
              first_divergence=float(first.mean()), rows_diverged=float(diff.any(1).mean()))


# ----------------------------------------------------------------------------------------------------------
# What a resume reads / computes

def swa_state_bytes(config: ModelConfig, layout: caches.CacheLayout) -> int:
  """Bytes of one sequence's exact resume state: per layer the last `window` window-KV rows, plus one compressor
  state row per pooling compressor (and Engram's previous ids). Paged checkpoints round up to whole swa blocks;
  this is the row count a restore must read at the least."""
  W = config.attention.window
  total = 0
  for s in caches.cache_array_specs(config, layout):
    if s.group != SWA:
      continue
    row = s.bytes_per_block // s.block_shape[0]
    if s.name == "window_kv":
      total += row * W
    elif s.name == "token_ids":
      total += row * max(config.engram.max_ngram_size - 1, 0)
    else:
      total += s.bytes_per_block   # one state row
  return total


def compressed_bytes(config: ModelConfig, layout: caches.CacheLayout, tokens: int) -> int:
  """Bytes of the FULL group (compressed KV + index keys) for `tokens` tokens: read by both resumes alike."""
  total = 0
  for s in caches.cache_array_specs(config, layout):
    if s.group == FULL:
      per_entry = s.bytes_per_block / s.block_shape[0]
      ratio = layout.full_block_tokens // s.block_shape[0]
      total += int(per_entry * (tokens // ratio))
  return total


def active_params(config: ModelConfig) -> int:
  """Parameters one token touches: everything except the routed experts, plus num_experts_per_tok of them (no
  MTP, no Engram tables: a token reads a few Engram rows, not the table)."""
  shapes = dsv4_model.param_shapes(config)
  mo = config.moe
  total = 0

  def walk(tree, path):
    nonlocal total
    if dsv4_model.is_param_spec(tree):
      n = int(np.prod(tree.shape))
      if "experts" in path:
        n = n * mo.num_experts_per_tok // mo.n_routed_experts
      if "engram" in path or "mtp" in path:
        n = 0
      total += n
    elif isinstance(tree, dict):
      for k, v in tree.items():
        walk(v, path + (str(k),))
    elif isinstance(tree, (list, tuple)):
      for i, v in enumerate(tree):
        walk(v, path + (str(i),))
  walk(shapes, ())
  return total
