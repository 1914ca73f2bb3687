"""Lightning indexer straight from the paged key pool, plain XLA: scores and top-k without per-entry gathers.

`indexer.indexer_scores_reference` (the reference) gathers one pool row per (query, entry) and builds the whole
[N, H, M] product; its cost and memory follow M = the table width. This path is what the model runs when no Pallas
kernel is selected:

* keys are read block by block through the block table (`jnp.take` of whole [E, C] blocks: one contiguous copy
  per block, not one small row copy per entry);
* entries are scored in chunks of `chunk_entries` (a loop over the chunks some query can see, when there are
  several) and a running top-k is merged chunk by chunk, so the [N, H, chunk] product is the largest temporary,
  whatever M is, and the cost follows the live context;
* the score is one matmul per query (q [H, C] x keys [C, chunk]), ReLU, and the head-weighted sum;
* V4.1 candidate restriction by block ids (`candidate_blocks_NxCb`, entries [c*bs, (c+1)*bs)): only the
  candidates' entries are gathered and scored (O(Cb * bs) per query, independent of M), instead of a dense
  [N, M] mask over every entry;
* V4.1 candidate source: the per-block score maxima come out of the same pass (`block_max_size`).

Equality with the reference: identical scores up to fp32 summation order; `lax.top_k` keeps the lower index
among equal values and the running merge keeps earlier chunks (lower entry ids) first, so the picked set equals
`topk_from_scores` of the reference scores except at near-ties at the k-th score (tests detect those).

Contract (flat token axis N; each query already carries its own row's block table):
  q_NxHxC, w_NxH     indexer queries (RoPE'd) and head weights (scale folded in).
  key_blocks_BxExC   the layer's index-key pool as [num_blocks, E entries per block, C] (the cache layout).
  table_NxF          block ids of the query's row (-1 = none); entry m lives in block table[m // E], row m % E.
  num_visible_N      entries 0..n-1 are visible (causality; 0 for padding tokens).
Returns ids_Nxk (entry ids, -1 where fewer than k are visible; k = min(k, F * E)), vals_Nxk, and the block maxima
[N, F * E / block_max_size] when block_max_size > 0 (else None).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import word_pool as _word_pool

_HI = jax.lax.Precision.HIGHEST


def _score(q_NxHxC, w_NxH, keys_NxMxC):
  dots = jnp.einsum("nhc,nmc->nhm", q_NxHxC, keys_NxMxC.astype(jnp.float32), precision=_HI)
  return jnp.einsum("nhm,nh->nm", jax.nn.relu(dots), w_NxH, precision=_HI)


def _chunk_scores(q, w, key_blocks_BxExC, tab_NxFc, first_entry, nv_N):
  """Scores [N, Fc * E] of the entries of blocks tab_NxFc (entry ids first_entry + 0..Fc*E-1), -inf if invisible."""
  NB, E, C = key_blocks_BxExC.shape
  N, Fc = tab_NxFc.shape
  ok_blk = (tab_NxFc >= 0) & (tab_NxFc < NB)
  keys = _word_pool.take(key_blocks_BxExC, jnp.clip(tab_NxFc, 0, NB - 1)).reshape(N, Fc * E, C)
  s = _score(q, w, keys)
  ent = first_entry + jnp.arange(Fc * E, dtype=jnp.int32)
  vis = (ent[None, :] < nv_N[:, None]) & jnp.repeat(ok_blk, E, axis=1)
  return jnp.where(vis, s, -jnp.inf), ent


def _block_max(s_NxM, bs):
  N, M = s_NxM.shape
  return jnp.max(s_NxM.reshape(N, M // bs, bs), axis=-1)


def _finish(vals, ids):
  return jnp.where(jnp.isfinite(vals), ids, -1).astype(jnp.int32), vals


def indexer_topk_paged(q_NxHxC, w_NxH, key_blocks_BxExC, table_NxF, num_visible_N, k: int, *,
                       chunk_entries: int = 4096, block_max_size: int = 0, query_block: int = 0,
                       table_rows_N=None, candidate_topk_blocks: int = 0):
  """Top-k entry ids over all visible entries of each query's row (see the module docstring).

  candidate_topk_blocks > 0 (with block_max_size): the third output is the V4.1 candidate blocks instead of the
  block maxima: `candidate_blocks` of them (the newest visible block forced in, then the highest maxima), merged
  chunk by chunk as a running top-k, so nothing is kept at the table's width. Same ids as `candidate_blocks` over
  the whole maxima (earlier chunks first: among equal maxima the lower block id wins, as in one top_k).

  table_rows_N (int32 [N], optional): table_NxF is then a table of any number of rows [S, F] and query n's is
  row table_rows_N[n] (the invariant step passes the engine's device table, whose width is max_model_len's: each
  chunk reads only its own columns of each query's row, so nothing costs the table width).

  query_block > 0 (the invariant step): the queries run in fixed blocks of that many, in a loop over the blocks up
  to the last query that sees an entry, so a tile holding a few live tokens gathers and scores keys for those
  blocks only (every query gathers its own row's keys: that is the cost that follows the query count), and a
  query's picks come from a call of one fixed shape whatever its neighbours are. A query that sees no entry gets
  what the whole call would give it (ids -1, scores and block maxima -inf)."""
  N = q_NxHxC.shape[0]
  rows_N = jnp.arange(N, dtype=jnp.int32) if table_rows_N is None else table_rows_N.astype(jnp.int32)
  if query_block and N > query_block:
    return _by_query_blocks(q_NxHxC, w_NxH, key_blocks_BxExC, table_NxF, rows_N, num_visible_N, k, query_block,
                            chunk_entries=chunk_entries, block_max_size=block_max_size,
                            candidate_topk_blocks=candidate_topk_blocks)
  N, H, C = q_NxHxC.shape
  NB, E, C2 = key_blocks_BxExC.shape
  F = table_NxF.shape[1]
  if (C2 != C or w_NxH.shape != (N, H) or num_visible_N.shape != (N,) or rows_N.shape != (N,)
      or (table_rows_N is None and table_NxF.shape[0] != N)):
    raise ValueError(f"indexer_topk_paged: shapes q {q_NxHxC.shape}, w {w_NxH.shape}, keys {key_blocks_BxExC.shape}"
                     f", table {table_NxF.shape}, num_visible {num_visible_N.shape}, table rows "
                     f"{None if table_rows_N is None else table_rows_N.shape} do not agree")
  if block_max_size and E % block_max_size:
    raise ValueError(f"indexer_topk_paged: block_max_size {block_max_size} must divide the {E} entries per block")
  if candidate_topk_blocks and not block_max_size:
    raise ValueError("indexer_topk_paged: candidate_topk_blocks needs block_max_size (the candidate block size)")
  q = q_NxHxC.astype(jnp.float32)
  w = w_NxH.astype(jnp.float32)
  nv = num_visible_N.astype(jnp.int32)
  M = F * E
  kk = min(k, M)
  fc = max(1, min(F, chunk_entries // E))  # blocks per chunk
  nc = -(-F // fc)
  def table_cols(c):  # [N, fc]: columns c * fc .. of each query's table row (-1 past the table)
    col = c * fc + jnp.arange(fc, dtype=jnp.int32)
    return jnp.where(col[None, :] < F, table_NxF[rows_N[:, None], jnp.minimum(col, F - 1)[None, :]], -1)

  last_blk = jnp.floor_divide(nv - 1, block_max_size) if block_max_size else None  # -1: sees nothing
  if nc == 1:
    s, _ = _chunk_scores(q, w, key_blocks_BxExC, table_cols(0), 0, nv)
    vals, ids = jax.lax.top_k(s, kk)
    bmax = _block_max(s, block_max_size) if block_max_size else None
    if candidate_topk_blocks:
      bmax = candidate_blocks(bmax, last_blk, candidate_topk_blocks)
    return (*_finish(vals, ids), bmax)
  # Only the chunks some query of the call can see are scored (a dynamic trip count: the cost follows the live
  # context, not the table width). A chunk a query cannot see leaves its running top-k as it was (its scores are
  # -inf and sort after every kept value), so the trip count, which its neighbours set, never changes its picks.
  live = (jnp.max(nv, initial=0) + fc * E - 1) // (fc * E)
  nbm = fc * E // block_max_size if block_max_size else 0
  nct = min(candidate_topk_blocks, M // block_max_size) if candidate_topk_blocks else 0

  def body(c, carry):
    vals, ids, bmax = carry
    s, ent = _chunk_scores(q, w, key_blocks_BxExC, table_cols(c), c * (fc * E), nv)
    # Earlier chunks first: among equal scores the lower entry id wins, as in one top_k over all entries.
    v2, pick = jax.lax.top_k(jnp.concatenate([vals, s], axis=1), kk)
    all_ids = jnp.concatenate([ids, jnp.broadcast_to(ent[None, :], (N, fc * E))], axis=1)
    if nct:      # running candidate blocks: (maxima, block ids), the newest visible block forced in (+inf)
      cv, cid = bmax
      blk = c * nbm + jnp.arange(nbm, dtype=jnp.int32)
      bm = jnp.where(blk[None, :] == last_blk[:, None], jnp.inf, _block_max(s, block_max_size))
      cv2, cpick = jax.lax.top_k(jnp.concatenate([cv, bm], axis=1), nct)
      bmax = cv2, jnp.take_along_axis(jnp.concatenate([cid, jnp.broadcast_to(blk[None, :], (N, nbm))], axis=1),
                                      cpick, axis=1)
    elif block_max_size:
      bmax = jax.lax.dynamic_update_slice_in_dim(bmax, _block_max(s, block_max_size), c * nbm, axis=1)
    return v2, jnp.take_along_axis(all_ids, pick, axis=1), bmax

  if nct:
    bm0 = (jnp.full((N, nct), -jnp.inf, jnp.float32), jnp.full((N, nct), -1, jnp.int32))
  else:
    bm0 = jnp.full((N, nc * nbm), -jnp.inf, jnp.float32)
  init = (jnp.full((N, kk), -jnp.inf, jnp.float32), jnp.full((N, kk), -1, jnp.int32), bm0)
  vals, ids, bm = jax.lax.fori_loop(0, live, body, init)
  if nct:
    bmax = jnp.where(bm[0] > -jnp.inf, bm[1], -1).astype(jnp.int32)
  else:
    bmax = bm[:, :M // block_max_size] if block_max_size else None
  return (*_finish(vals, ids), bmax)


def _by_query_blocks(q_NxHxC, w_NxH, key_blocks_BxExC, table_SxF, rows_N, num_visible_N, k: int, qb: int, **kw):
  N, F = rows_N.shape[0], table_SxF.shape[1]
  if N % qb:
    raise ValueError(f"indexer_topk_paged: query_block {qb} must divide the {N} queries")
  M = F * key_blocks_BxExC.shape[1]
  kk = min(k, M)
  bms, nct = kw["block_max_size"], kw["candidate_topk_blocks"]
  sees = jnp.where(num_visible_N > 0, jnp.arange(N, dtype=jnp.int32), -1)
  live = (jnp.max(sees) + qb) // qb                       # 0 when no query sees anything

  def body(b, carry):
    cut = lambda a: jax.lax.dynamic_slice_in_dim(a, b * qb, qb, axis=0)
    got = indexer_topk_paged(cut(q_NxHxC), cut(w_NxH), key_blocks_BxExC, table_SxF, cut(num_visible_N), k,
                             table_rows_N=cut(rows_N), **kw)
    return tuple(c if g is None else jax.lax.dynamic_update_slice_in_dim(c, g, b * qb, axis=0)
                 for c, g in zip(carry, got))

  if nct:      # a query that sees nothing has no candidate
    third = jnp.full((N, min(nct, M // bms)), -1, jnp.int32)
  else:
    third = jnp.full((N, M // bms), -jnp.inf, jnp.float32) if bms else None
  init = (jnp.full((N, kk), -1, jnp.int32), jnp.full((N, kk), -jnp.inf, jnp.float32), third)
  return jax.lax.fori_loop(0, live, body, init)


def candidate_blocks(block_max_NxNb, last_block_N, topk_blocks: int):
  """V4.1 candidate blocks (docs/model.md, Lightning indexer) as ids [N, min(topk_blocks, Nb)] (-1 = none) from
  block maxima: the block of the newest visible entry (`last_block_N`, -1 when none) is forced in, then the highest
  maxima; blocks with no visible entry (max -inf) never count. Same rule as `dsv4.layers.attention.candidate_mask`
  except at exact ties of finite block maxima at the cut: this keeps exactly topk_blocks (lowest block id first), the
  dense threshold keeps every tied block."""
  N, nb = block_max_NxNb.shape
  blk = jnp.where(jnp.arange(nb)[None, :] == last_block_N[:, None], jnp.inf, block_max_NxNb)
  vals, ids = jax.lax.top_k(blk, min(topk_blocks, nb))
  return jnp.where(vals > -jnp.inf, ids, -1).astype(jnp.int32)


def indexer_topk_candidates(q_NxHxC, w_NxH, key_blocks_BxExC, table_NxF, num_visible_N, k: int,
                            candidate_blocks_NxCb, block_size: int, table_rows_N=None):
  """Top-k over the entries of the candidate blocks only (O(Cb * block_size) per query, independent of M).
  table_rows_N: as in `indexer_topk_paged` (query n's table is table_NxF[table_rows_N[n]]).

  Returns (ids [N, min(k, F * E)] entry ids, -1 = none; vals). Candidate ids are sorted first so that the
  scored entries are in increasing id order: ties then break toward the lower entry id, as over the dense mask."""
  N, H, C = q_NxHxC.shape
  NB, E, _ = key_blocks_BxExC.shape
  F = table_NxF.shape[1]
  M = F * E
  kk = min(k, M)
  nbm = M // block_size if M % block_size == 0 else -(-M // block_size)
  cb = candidate_blocks_NxCb.astype(jnp.int32)
  cb = jnp.where((cb >= 0) & (cb < nbm), cb, jnp.iinfo(jnp.int32).max)
  cb = jnp.sort(cb, axis=1)
  ok_cb = cb != jnp.iinfo(jnp.int32).max
  ent = jnp.where(ok_cb[:, :, None], cb[:, :, None] * block_size + jnp.arange(block_size)[None, None, :], -1)
  ent = ent.reshape(N, -1)  # [N, Cb * bs]
  rows_N = jnp.arange(N) if table_rows_N is None else table_rows_N
  blk = table_NxF[rows_N[:, None], jnp.clip(ent // E, 0, F - 1)]
  ok = (ent >= 0) & (ent < M) & (ent < num_visible_N[:, None]) & (blk >= 0) & (blk < NB)
  keys = key_blocks_BxExC[jnp.clip(blk, 0, NB - 1), jnp.maximum(ent, 0) % E]  # [N, Cb*bs, C]
  s = jnp.where(ok, _score(q_NxHxC.astype(jnp.float32), w_NxH.astype(jnp.float32), keys), -jnp.inf)
  if s.shape[1] < kk:  # fewer candidate entries than k: pad so the output width matches the dense path
    pad = kk - s.shape[1]
    s = jnp.pad(s, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    ent = jnp.pad(ent, ((0, 0), (0, pad)), constant_values=-1)
  vals, pick = jax.lax.top_k(s, kk)
  return _finish(vals, jnp.take_along_axis(ent, pick, axis=1))
