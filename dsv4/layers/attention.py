"""Hybrid attention layer: sliding window + compressed entries (top-k or all) + per-head sink. See docs/model.md,
Attention layer.

Order within a step: write this chunk's window KV and compressor rows into the pools, emit the entries that complete
in the chunk, then attend by reading everything (window rows, compressed entries) back through the block tables.
The same code serves full prefill, chunked prefill and decode; a contiguous cache is an identity block table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv4 import caches
from dsv4.config import LayerPlan, ModelConfig
from dsv4.layers import cache_quant, row_invariant
from dsv4.layers.compressor import (CompressorCall, CompressorSpec, StepContext, compress_steps,
                                    joint_opening_rows)
from dsv4.layers.norms import rms_norm, unweighted_rms_norm
from dsv4.layers.rope import apply_rope, inv_freq_for
from dsv4.layers.row_invariant import RowFn, map_row_blocks, map_row_blocks_then
from pallas_kernels import dispatch

_HI = jax.lax.Precision.HIGHEST


def kv_compressor_spec(config: ModelConfig, plan: LayerPlan) -> CompressorSpec:
  return CompressorSpec(ratio=plan.ratio, width=config.attention.head_dim, overlap=plan.overlap,
                        gated=plan.ratio > 1, position_bias=config.variant == "v4")


def index_compressor_spec(config: ModelConfig, plan: LayerPlan) -> CompressorSpec:
  return CompressorSpec(ratio=plan.ratio, width=config.indexer.head_dim, overlap=plan.overlap, gated=True,
                        position_bias=True)


def entry_rows(ctx: StepContext, ratio: int):
  """Pool rows [N, M] of entries 0..M-1 of each token's row (-1 where no block); M = live table width in entries."""
  rpb = ctx.full_block_tokens // ratio
  M = ctx.full_table_RxF.shape[1] * rpb
  ids = jnp.arange(M, dtype=jnp.int32)[None, :]
  return caches.row_slots(ctx.full_table_RxF, ctx.full_row_N[:, None], ids, rpb, ctx.valid_N[:, None])


def paged_entry_rows(ctx: StepContext, ratio: int):
  """`entry_rows` as the indexer kernels take it: the step's table as it is and each token's row of it (they read
  the words they visit in place; no [N, M] list). Padding tokens see nothing through `num_visible`."""
  return dispatch.PagedRows(ctx.full_table_RxF, ctx.full_row_N, ctx.full_block_tokens // ratio)


def num_visible(ctx: StepContext, ratio: int):
  """Compressed entries each query may see (its causal prefix); 0 for padding tokens."""
  return jnp.where(ctx.valid_N, (ctx.pos_N + 1) // ratio, 0)


def indexer_query(p, config: ModelConfig, inv_freq):
  """The row function (x [R, D], cq [R, q_lora], pos [R]) -> (indexer queries [R, H, C] (RoPE'd), head weights
  [R, H] (fp32, scales folded in)): row-local, run in the attention's projection loop."""
  ix = config.indexer

  def qw(x, cq, pos):
    q = jnp.dot(cq, p["wq_b"], precision=_HI).reshape(x.shape[0], ix.num_heads, ix.head_dim)
    q = apply_rope(q, pos[:, None], inv_freq)
    if config.quantized_cache:  # NeMo: MXFP4 index queries (32 channels) after RoPE
      q = cache_quant.mxfp4_index(q)
    w = jnp.dot(x, p["weights_proj"], precision=_HI).astype(jnp.float32)
    return q, w * (ix.head_dim ** -0.5) * (ix.num_heads ** -0.5)
  return qw


def indexer_select(config: ModelConfig, plan: LayerPlan, qw, ctx: StepContext, key_pool, rows_NxM, kernel_cfg,
                   allowed_NxM=None):
  """Lightning indexer through `dispatch.indexer_scores` (the reference, or the score kernel): returns (top-k entry
  ids [N,k] with -1 for invisible picks, scores [N,M]). rows_NxM: `entry_rows` or `paged_entry_rows`. O(M) memory
  per query; the model uses it where the scores themselves are needed (the V4.1 candidate source's block maxima
  with a kernel selected, aux outputs). qw: the queries and head weights of `indexer_query` ([N, H, C], [N, H])."""
  q, w = qw
  nv = num_visible(ctx, plan.ratio)
  # One query per "batch row" (B = N, T = 1): each flat token brings its own row's entry list.
  scores = dispatch.indexer_scores(q[:, None], w[:, None], caches.flat_pool(key_pool), rows_NxM, nv[:, None],
                                   None if allowed_NxM is None else allowed_NxM[:, None], cfg=kernel_cfg)[:, 0]
  ids, _ = dispatch.topk_from_scores(scores, config.indexer.topk)
  return ids, scores


def _fused_topk_call(config: ModelConfig, plan: LayerPlan, qw, ctx: StepContext, key_pool,
                     candidate_blocks_NxCb=None):
  """Arguments of `dispatch.indexer_topk` for the layer's queries qw (B = N flat tokens, T = 1)."""
  q, w = qw
  nv = num_visible(ctx, plan.ratio)
  cand = None if candidate_blocks_NxCb is None else candidate_blocks_NxCb[:, None]
  args = (q[:, None], w[:, None], caches.flat_pool(key_pool), paged_entry_rows(ctx, plan.ratio), nv[:, None],
          config.indexer.topk)
  return args, dict(candidate_blocks_BxTxC=cand, block_size=config.indexer.candidate_block_size)


def indexer_select_fused(config: ModelConfig, plan: LayerPlan, qw, ctx: StepContext, key_pool, kernel_cfg,
                         candidate_blocks_NxCb=None):
  """Lightning indexer through the fused top-k kernel (`dispatch.indexer_topk`: scores stay on chip, only the k ids
  come back; V4.1 reindex layers score only their candidate blocks). Returns ids [N, k] (-1 = no visible pick), or
  None when `kernel_cfg` does not send "indexer_topk" at these shapes to a kernel (the caller then takes the paged
  XLA path). The index keys are read as the cache stores them (float; an FP8 KV cache keeps them in bf16)."""
  args, kw = _fused_topk_call(config, plan, qw, ctx, key_pool, candidate_blocks_NxCb)
  kw = dict(kw, live=ctx.live)      # the kernel's programs of tokens past the live ones return at once
  if not dispatch.uses_kernel(kernel_cfg, "indexer_topk", *args, **kw):
    return None
  return dispatch.indexer_topk(*args, cfg=kernel_cfg, **kw)[:, 0]


# Entries per scored chunk of the paged indexer in the invariant step (fixed, so the running top-k merges in the
# same order whatever the table width), and queries per scored block (fixed, so a tile with a few live tokens
# gathers keys for those only: each query reads its own row's keys).
INVARIANT_INDEX_CHUNK = 1024
INVARIANT_INDEX_QUERIES = 8


def indexer_select_paged(config: ModelConfig, plan: LayerPlan, qw, ctx: StepContext, key_pool,
                         candidate_blocks_NxCb=None, block_max_size: int = 0, candidate_topk_blocks: int = 0):
  """Lightning indexer read block-wise from the paged pool, chunked running top-k (pallas_kernels/indexer_paged.py):
  no [N, M, C] key copy and no [N, H, M] product. With candidate blocks (V4.1 reindex layers) only their entries
  are scored. Returns (ids [N,k], block maxima [N, M / block_max_size] or None); with candidate_topk_blocks (the
  V4.1 candidate source) the candidate block ids [N, Cb] instead of the maxima, merged as a running top-k."""
  q, w = qw
  nv = num_visible(ctx, plan.ratio)
  k = config.indexer.topk
  key_pool = caches.pool_view(key_pool)
  # Each query reads its row's table (ctx.full_row_N; padding tokens: row 0's, but nv = 0 hides every entry).
  if candidate_blocks_NxCb is not None:   # each query on its own candidates: in row blocks over the live tokens
    def picks(q, w, nv, cand, rows):
      return dispatch.indexer_topk_candidates(q, w, key_pool, ctx.full_table_RxF, nv, k, cand,
                                              config.indexer.candidate_block_size, table_rows_N=rows)[0]
    return map_row_blocks(picks, ctx.live, q, w, nv, candidate_blocks_NxCb, ctx.full_row_N,
                          block=row_invariant.blocking().attention_rows), None
  # The invariant step's tables span max_model_len: smaller chunks keep a short context from scoring a whole
  # default chunk of invisible entries (the loop runs only the chunks some query can see).
  chunk = {"chunk_entries": INVARIANT_INDEX_CHUNK, "query_block": INVARIANT_INDEX_QUERIES} if ctx.invariant else {}
  ids, _, bmax = dispatch.indexer_topk_paged(q, w, key_pool, ctx.full_table_RxF, nv, k,
                                             block_max_size=block_max_size, table_rows_N=ctx.full_row_N,
                                             candidate_topk_blocks=candidate_topk_blocks, **chunk)
  return ids, bmax


def _block_max_of_scores(scores_NxM, bs):
  N, M = scores_NxM.shape
  nb = -(-M // bs)
  padded = jnp.pad(scores_NxM, ((0, 0), (0, nb * bs - M)), constant_values=-jnp.inf)
  return jnp.max(padded.reshape(N, nb, bs), axis=-1)


def dense_compressed_attention(q_NxHxD, comp_pool_PxD, rows_NxM, ctx: StepContext, ratio: int, scale: float):
  """Head-averaged attention distribution of the queries over *all* visible compressed entries [N, M].

  The training target for the indexer (DeepSeek warm up their indexer with a KL loss toward it); not used at
  inference."""
  M = rows_NxM.shape[1]
  keys = caches.gather_flat(comp_pool_PxD, rows_NxM)
  logits = jnp.einsum("nhd,nmd->nhm", q_NxHxD.astype(jnp.float32), keys.astype(jnp.float32),
                      precision=_HI) * scale
  visible = (jnp.arange(M)[None, :] < num_visible(ctx, ratio)[:, None]) & (rows_NxM >= 0)
  logits = jnp.where(visible[:, None, :], logits, -jnp.inf)
  any_vis = jnp.any(visible, axis=-1)[:, None, None]
  probs = jax.nn.softmax(jnp.where(any_vis, logits, 0.0), axis=-1)
  return jnp.where(any_vis, probs, 0.0).mean(axis=1)


def candidate_mask(scores_BxTxM, num_visible_BxT, visible_BxTxM, block_size: int, topk_blocks: int):
  """Reference (dense) form of the V4.1 candidates; the model now keeps block ids (`dispatch.candidate_blocks`).

  V4.1 hierarchical candidates (docs/model.md, Lightning indexer; NeMo `_select_candidate_blocks`): blocks of
  `block_size` entries scored by their max; the block of the newest visible entry is forced in; the top
  `topk_blocks` finite blocks are kept; returned as a dense mask over entries [B, T, M] (& visible).

  Memory: the dense mask is B*T*M bytes (fine for tests / short prefills; at Flash width with M = 1M entries a
  chunk of 1k queries would need 1 GB). Block ids [B, T, topk_blocks] (int32, 8 KB per query) are the compact
  form (`pallas_kernels.indexer.candidate_blocks_to_allowed` expands them); the selection rule is the same.
  A threshold at the k-th block score replaces an explicit scatter: equivalent except for exact ties between
  finite block maxima, which the reference breaks by its own top-k order."""
  M = scores_BxTxM.shape[-1]
  nb = -(-M // block_size)
  padded = jnp.pad(scores_BxTxM, ((0, 0), (0, 0), (0, nb * block_size - M)), constant_values=-jnp.inf)
  blk = jnp.max(padded.reshape(*scores_BxTxM.shape[:2], nb, block_size), axis=-1)
  last = jnp.floor_divide(num_visible_BxT - 1, block_size)
  blk = jnp.where(jnp.arange(nb)[None, None, :] == last[..., None], jnp.inf, blk)
  k = min(topk_blocks, nb)
  kth = jax.lax.top_k(blk, k)[0][..., k - 1:k]
  keep = (blk >= kth) & (blk > -jnp.inf)
  return jnp.repeat(keep, block_size, axis=-1)[..., :M] & visible_BxTxM


def attention_layer(p, config: ModelConfig, plan: LayerPlan, x_NxD, ctx: StepContext, cache_layer: dict,
                    kernel_cfg: dispatch.KernelConfig, collect_aux: bool = False, tail: RowFn | None = None):
  """Returns (new cache_layer, out_NxD, aux dict); with `tail`, its outputs in place of out (see
  `attention_layer_shared`)."""
  cache_layer, out, aux, _ = attention_layer_shared(p, config, plan, x_NxD, ctx, cache_layer, kernel_cfg,
                                                    collect_aux, None, tail=tail)
  return cache_layer, out, aux


def _entry_ids_to_pool_rows(ctx: StepContext, ratio: int, ids_NxK):
  """(pool rows [N, k], their `live_length` [N]) of the picked entry ids through each token's block table (O(k), no
  [N, M] row list), over the live tokens; tokens past them get length 0 (their rows are unspecified)."""
  def rows(ids, full_row, valid):
    r = caches.row_slots(ctx.full_table_RxF, full_row[:, None], ids, ctx.full_block_tokens // ratio,
                         valid[:, None] & (ids >= 0))
    return r, live_length(r)
  r, n = map_row_blocks(rows, ctx.live, ids_NxK, ctx.full_row_N, ctx.valid_N)
  return r, jnp.where(_live_tokens(ctx), n, 0)


def _live_tokens(ctx: StepContext):
  """[N] valid tokens inside the live count (`StepContext.live`)."""
  if ctx.live is None:
    return ctx.valid_N
  return ctx.valid_N & (jnp.arange(ctx.valid_N.shape[0]) < ctx.live)


def _select(config: ModelConfig, plan: LayerPlan, qw, ctx: StepContext, key_pool, kernel_cfg, cand_blocks,
            candidate_source: bool, q_attn, comp_pool, collect_aux: bool, aux: dict):
  """Indexer top-k for one layer's queries qw (`indexer_query`) -> (ids [N, k], candidate block ids [N, Cb] when
  candidate_source else None).

  With the fused top-k kernel selected (`dispatch.uses_kernel(.., "indexer_topk", ..)`): the kernel over the live
  entry list (V4 CSA, V4.1 full and reindex layers; candidate blocks passed as block ids). The V4.1 candidate source
  needs every score for its block maxima: the score kernel (`indexer_scores`) when selected. Otherwise the paged XLA
  path (block reads, chunked running top-k; V4.1 reindex layers score only their candidate blocks). Aux outputs
  (training, tests) always come from the scores [N, M]."""
  ix = config.indexer
  bs = ix.candidate_block_size
  E = ctx.full_block_tokens // plan.ratio
  nv = num_visible(ctx, plan.ratio)
  ids = bmax = rows = scores = None
  if candidate_source:
    args, _ = _fused_topk_call(config, plan, qw, ctx, key_pool)
    paged = not dispatch.uses_kernel(kernel_cfg, "indexer_scores", *args[:5]) and E % bs == 0
  else:
    ids = indexer_select_fused(config, plan, qw, ctx, key_pool, kernel_cfg, cand_blocks)
    paged = ids is None
  if (ids is None and not paged) or collect_aux:
    # The score kernel reads the table in place; the aux target and a candidate mask need the [N, M] list.
    dense = collect_aux or cand_blocks is not None
    rows = entry_rows(ctx, plan.ratio) if dense else paged_entry_rows(ctx, plan.ratio)
    M = rows.shape[1]
    allowed = None
    if cand_blocks is not None:
      visible = (jnp.arange(M)[None, :] < nv[:, None]) & (rows >= 0)
      allowed = dispatch.candidate_blocks_to_allowed(cand_blocks[:, None], M, bs)[:, 0] & visible
    s_ids, scores = indexer_select(config, plan, qw, ctx, key_pool, rows, kernel_cfg, allowed)
    if ids is None and not paged:
      ids = s_ids
      bmax = _block_max_of_scores(scores, bs) if candidate_source else None
  cand = None
  if paged:   # the candidate source's blocks come out of the same pass, merged chunk by chunk
    ids, cand = indexer_select_paged(config, plan, qw, ctx, key_pool, cand_blocks, bs if candidate_source else 0,
                                     ix.candidate_topk_blocks if candidate_source else 0)
  elif candidate_source:
    cand = dispatch.candidate_blocks(bmax, jnp.floor_divide(nv - 1, bs), ix.candidate_topk_blocks)
  if collect_aux:
    aux.update(topk_ids=ids, index_scores=scores,
               comp_attn_target=dense_compressed_attention(q_attn, comp_pool, rows, ctx, plan.ratio,
                                                           config.attention.head_dim ** -0.5))
  return ids, cand


def live_length(ids_NxK):
  """1 + the last position of each row holding an id >= 0 (0 for none): the per-query valid length
  `dispatch.sparse_attention` takes, exact whatever order the ids come in."""
  pos = jnp.arange(1, ids_NxK.shape[1] + 1, dtype=jnp.int32)
  return jnp.max(jnp.where(ids_NxK >= 0, pos[None, :], 0), axis=1, initial=0).astype(jnp.int32)


def attention_layer_shared(p, config: ModelConfig, plan: LayerPlan, x_NxD, ctx: StepContext, cache_layer: dict,
                           kernel_cfg: dispatch.KernelConfig, collect_aux: bool, shared: dict | None,
                           tail: RowFn | None = None):
  """`attention_layer` plus the V4.1 CSA2 state handed from layer to layer (docs/model.md, per-layer plan), on the
  flat token axis:

  shared = {"comp_pool": the latest KV source's compressed-KV pool (flat, already holding this step's entries),
            "index_pool": its index-key pool, "ids": the latest top-k entry ids [N,k], "cand": the candidate
            block ids [N, Cb] of the candidate source (or None; -1 = none, blocks of candidate_block_size entries)}.
  A full layer replaces it, a reindex layer replaces "ids" (and the candidate source sets "cand"), a reuse layer
  reads it unchanged. Reuse / reindex layers own no full-group arrays. Returns (cache_layer, out, aux, shared).
  tail (`row_invariant.RowFn`): the caller's row-local work on out's rows, run in the output projection's loop;
  its outputs are returned in place of out.
  x_NxD: the layer's input rows, or a `RowFn` that makes them (fn(*arg blocks) -> (x block, carry blocks)) in the
  projection loop, so they are never stored; carry's rows ([N, ...]) then go to the tail after its args.
  """
  a, eps = config.attention, config.rms_norm_eps
  N = ctx.pos_N.shape[0]
  head = x_NxD if isinstance(x_NxD, RowFn) else RowFn(lambda x: (x, None), (x_NxD,))
  H, d = a.num_heads, a.head_dim
  inv_freq = inv_freq_for(a, plan.rope)
  cache_layer = dict(cache_layer)
  aux = {}
  pos = ctx.pos_N

  # The compressors' per-token work before their folds (`compressor.opening_rows`) rides in the projection loop.
  v41_kinds = plan.kind in ("full", "reindex", "reuse")
  # A V4 CSA layer's KV and index compressors fold the same windows: side by side, one fold for both.
  calls = []
  if plan.has_compressor:
    calls.append(CompressorCall(p["compressor"], kv_compressor_spec(config, plan), cache_layer.get("comp_state"),
                                cache_layer["comp_kv"],
                                cache_quant.nvfp4_compressed_kv if config.quantized_cache and v41_kinds else None,
                                "comp_state_rows"))
  if plan.kind == "csa":
    calls.append(CompressorCall(p["indexer"]["compressor"], index_compressor_spec(config, plan),
                                cache_layer["index_state"], cache_layer["index_keys"], None, "index_state_rows"))
  opening = joint_opening_rows(calls, ctx, inv_freq, eps) if calls else RowFn(lambda x: None)

  def project(head_args, pos, row, valid, opening_args):
    x, carry = head.fn(*head_args)
    # Query path: low-rank, q_a norm, optional weightless per-head norm, RoPE.
    cq = rms_norm(jnp.dot(x, p["wq_a"], precision=_HI), p["q_norm"], eps)
    q = jnp.dot(cq, p["wq_b"], precision=_HI).reshape(x.shape[0], H, d)
    if plan.q_head_norm:
      q = unweighted_rms_norm(q, eps)
    q = apply_rope(q, pos[:, None], inv_freq)
    # Window KV (K = V), RoPE'd at the token's position.
    kv = apply_rope(rms_norm(jnp.dot(x, p["wkv"], precision=_HI), p["kv_norm"], eps), pos, inv_freq)
    if config.quantized_cache:  # NeMo: FP8 window KV (32 channels) after RoPE
      kv = cache_quant.fp8_window_kv(kv)
    # Window: each query reads [max(t - W + 1, 0), t], oldest first and from column 0, so the valid ids lead the
    # row and the window length is min(t + 1, W) (0 for padding). The id lists over the live tokens only, in the
    # projections' loop; the lengths ([N] ints) for every token: a kernel's program of a token past the live rows
    # finds length 0 and reads none of its (unspecified) ids.
    win_pos = jnp.maximum(pos - (a.window - 1), 0)[:, None] + jnp.arange(a.window)[None, :]
    win_idx = ctx.swa_slots(row[:, None], win_pos, valid[:, None] & (win_pos <= pos[:, None]))
    # the indexer's queries too, where the layer computes its own top-k
    index_qw = indexer_query(p["indexer"], config, inv_freq)(x, cq, pos) if plan.has_index_query else None
    opened = opening.fn(x, *opening_args)
    return q, caches.stored_rows(cache_layer["window_kv"], kv), win_idx, index_qw, opened, carry
  q, kv, win_idx, index_qw, opened, carry = map_row_blocks(project, ctx.live, head.args, pos, ctx.row_N, ctx.valid_N,
                                                           opening.args)
  if carry is not None:
    if tail is None:
      raise ValueError("attention_layer: an input made in the projection loop (RowFn) needs a tail for its carry")
    tail = RowFn(tail.fn, (*tail.args, carry))

  # Window: this step's rows are written before any query reads its window.
  cache_layer["window_kv"] = caches.write_rows(cache_layer["window_kv"], ctx.token_slots(), kv)
  win_len = jnp.where(_live_tokens(ctx), jnp.minimum(pos + 1, a.window), 0).astype(jnp.int32)

  compressed = compress_steps(calls, ctx, inv_freq, eps, opened, return_latent=v41_kinds, taps=aux) if calls else []

  comp_pool, comp_idx, comp_len = None, None, None
  if v41_kinds:
    if plan.has_compressor:
      state, cache_layer["comp_kv"], (lat, ent, slots) = compressed[0]
      if state is not None:
        cache_layer["comp_state"] = state
      if plan.has_index_keys:
        def index_keys(lat, ent):
          keys = rms_norm(jnp.dot(lat, p["indexer"]["wk"], precision=_HI), p["indexer"]["k_norm"], eps)
          keys = apply_rope(keys, ent * plan.ratio, inv_freq)
          if config.quantized_cache:  # NeMo: MXFP4 index keys (32 channels) after RoPE
            keys = cache_quant.mxfp4_index(keys)
          return caches.stored_rows(cache_layer["index_keys"], keys)
        keys = map_row_blocks(index_keys, ctx.live, lat, ent)
        cache_layer["index_keys"] = caches.write_rows(cache_layer["index_keys"], slots, keys)
      shared = {"comp_pool": caches.flat_pool(cache_layer["comp_kv"]), "index_pool": cache_layer["index_keys"],
                "ids": None, "cand": None}
    if shared is None:
      raise ValueError(f"layer {plan.index}: a CSA2 {plan.kind} layer needs its KV source (layer {plan.kv_source}) "
                       f"to run earlier in the same step")
    comp_pool = shared["comp_pool"]
    if plan.has_index_query:
      ids, cand = _select(config, plan, index_qw, ctx, shared["index_pool"], kernel_cfg,
                          shared["cand"] if plan.uses_candidates else None, plan.candidate_source, q, comp_pool,
                          collect_aux, aux)
      shared = dict(shared, ids=ids)
      if plan.candidate_source:
        shared["cand"] = cand
    comp_idx, comp_len = _entry_ids_to_pool_rows(ctx, plan.ratio, shared["ids"])
  elif plan.has_compressor:
    state, cache_layer["comp_kv"] = compressed[0]
    if state is not None:
      cache_layer["comp_state"] = state
    comp_pool = caches.flat_pool(cache_layer["comp_kv"])
  if plan.kind == "csa":
    cache_layer["index_state"], cache_layer["index_keys"] = compressed[1]
    ids, _ = _select(config, plan, index_qw, ctx, cache_layer["index_keys"], kernel_cfg,
                     None, False, q, comp_pool, collect_aux, aux)
    comp_idx, comp_len = _entry_ids_to_pool_rows(ctx, plan.ratio, ids)
  elif plan.dense_compressed and not ctx.invariant:
    rows = entry_rows(ctx, plan.ratio)
    nv = num_visible(ctx, plan.ratio)
    comp_idx = jnp.where(jnp.arange(rows.shape[1])[None, :] < nv[:, None], rows, -1)
    comp_len = jnp.minimum(nv, rows.shape[1]).astype(jnp.int32)

  window_pool = caches.flat_pool(cache_layer["window_kv"])
  if plan.dense_compressed and ctx.invariant:
    # Window + every visible compressed entry in fixed blocks of entries, in position order (online softmax): the
    # HCA kernel when `kernel_cfg` sends "hca_attention" to one, else its XLA reference (pallas_kernels/
    # hca_attention.py), the same block order, each query on its own in fixed query blocks over the live tokens.
    # The engine's table as it is, with each token's row: the kernel reads only the words of its visible entries.
    def hca(q, win_idx, win_len, nv, full_row, live=None):
      return dispatch.hca_attention(q, window_pool, win_idx, win_len, comp_pool, ctx.full_table_RxF, nv, p["sink"],
                                    scale=d ** -0.5, entries_per_block=ctx.full_block_tokens // plan.ratio,
                                    table_rows_N=full_row, cfg=kernel_cfg, live=live)
    nv = num_visible(ctx, plan.ratio)
    if dispatch.uses_kernel(kernel_cfg, "hca_attention", q, window_pool, win_idx, win_len, comp_pool,
                            ctx.full_table_RxF, nv, p["sink"], scale=d ** -0.5,
                            entries_per_block=ctx.full_block_tokens // plan.ratio, table_rows_N=ctx.full_row_N,
                            live=ctx.live):
      # one call over the flat axis; the programs of tokens past the live ones return without writing
      out = hca(q, win_idx, win_len, nv, ctx.full_row_N, ctx.live)
    else:
      out = map_row_blocks(hca, ctx.live, q, win_idx, win_len, nv, ctx.full_row_N,
                           block=row_invariant.blocking().attention_rows)
  else:
    # Per-query valid lengths: the kernels stop their loops there (O(live ids), not O(W + K)).
    def sparse(q, win_idx, comp_idx, win_len, comp_len, live=None):
      return dispatch.sparse_attention(q, window_pool, win_idx, comp_pool, comp_idx, p["sink"], scale=d ** -0.5,
                                        cfg=kernel_cfg, window_len_N=win_len, comp_len_N=comp_len, live=live)[0]
    if dispatch.uses_kernel(kernel_cfg, "sparse_attention", q, window_pool, win_idx, comp_pool, comp_idx, p["sink"],
                            scale=d ** -0.5, window_len_N=win_len, comp_len_N=comp_len, live=ctx.live):
      # one call over the flat axis; the programs of tokens past the live ones return without writing
      out = sparse(q, win_idx, comp_idx, win_len, comp_len, ctx.live)
    else:   # the XLA reference, each query on its own: fixed query blocks over the live tokens
      out = map_row_blocks(sparse, ctx.live, q, win_idx, comp_idx, win_len, comp_len,
                           block=row_invariant.blocking().attention_rows)
  out = map_row_blocks_then(lambda o, ps: output_projection(p, config, o, ps, inv_freq), tail, ctx.live,
                            out.reshape(N, H, d), pos)
  return cache_layer, out, aux, shared


def output_projection(p, config: ModelConfig, out_NxHxD, pos_N, inv_freq):
  """The attention output path: RoPE undone at each query's position, then the grouped low-rank projection (group g
  of heads -> its own o_lora block, then one mixing matrix)."""
  a = config.attention
  N, H, d = out_NxHxD.shape
  out = apply_rope(out_NxHxD, pos_N[:, None], inv_freq, inverse=True)
  G = a.o_groups
  grouped = out.reshape(N, G, (H // G) * d)
  # Group-major operands: XLA CPU then runs each group as one matrix product (3.5x faster at 8 tokens than the
  # token-major einsum, which it lowers to a strided per-group GEMV; measured with
  # benchmarks/probes/decode_profile.py).
  o_GxNxR = jnp.einsum("gni,gir->gnr", grouped.transpose(1, 0, 2), p["wo_a"], precision=_HI)
  o = o_GxNxR.transpose(1, 0, 2).reshape(N, G * a.o_lora_rank)
  return jnp.dot(o, p["wo_b"], precision=_HI)
