"""Paged XLA indexer (block reads, chunked running top-k, V4.1 candidates as block ids) vs the reference
(`indexer_scores_reference` + `topk_from_scores` over a per-entry row list; the dense candidate mask). Top-k is
compared as sets with ties at the k-th score detected (then only valid near-threshold picks are required)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4.layers.attention import candidate_mask
from pallas_kernels import indexer as ix
from pallas_kernels import indexer_paged as ip

TIE = 1e-4


def make_case(seed, N, H, C, NB, E, F, dtype=jnp.float32):
  """Random pool [NB, E, C], per-query tables of F shuffled block ids with unallocated (-1) tails and holes."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((N, H, C)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((N, H)) * C ** -0.5, jnp.float32)
  pool = jnp.asarray(rng.standard_normal((NB, E, C)), dtype)
  tab = np.stack([rng.permutation(NB)[:F] for _ in range(N)]).astype(np.int32)
  for n in range(N):
    tab[n, rng.integers(F // 2, F + 1):] = -1
  tab[rng.random((N, F)) < 0.1] = -1
  nv = rng.integers(0, F * E + 1, N).astype(np.int32)
  nv[0] = 0  # sees nothing
  return q, w, pool, jnp.asarray(tab), jnp.asarray(nv)


def reference_scores(q, w, pool, tab, nv, allowed=None):
  NB, E, C = pool.shape
  rows = jnp.where(tab[:, :, None] >= 0, tab[:, :, None] * E + jnp.arange(E), -1).reshape(tab.shape[0], -1)
  return ix.indexer_scores_reference(q[:, None], w[:, None], pool.reshape(NB * E, C), rows, nv[:, None],
                                     None if allowed is None else allowed[:, None])[:, 0]


def assert_topk_matches(got_ids, ref_scores, k):
  s = np.asarray(ref_scores)
  got = np.asarray(got_ids)
  kk = min(k, s.shape[1])
  assert got.shape == (s.shape[0], kk)
  srt = -np.sort(-s, axis=1)
  ties = 0
  for n in range(s.shape[0]):
    g = got[n][got[n] >= 0]
    assert len(set(g)) == len(g), "duplicate picks"
    n_vis = int(np.isfinite(s[n]).sum())
    assert len(g) == min(kk, n_vis), (n, len(g), n_vis)
    if len(g) == 0:
      continue
    assert np.all(np.isfinite(s[n][g])), "picked an invisible entry"
    kth = srt[n][len(g) - 1]
    nxt = srt[n][len(g)] if len(g) < s.shape[1] else -np.inf
    if np.isfinite(nxt) and abs(kth - nxt) <= TIE * max(1.0, abs(kth)):
      ties += 1
      assert np.all(s[n][g] >= kth - TIE * max(1.0, abs(kth)))
    else:
      assert set(g) == set(np.flatnonzero(s[n] >= kth)), n
  return ties


@pytest.mark.parametrize("chunk", [64, 96, 10_000])  # several chunks (scan, padded last chunk) and one chunk
@pytest.mark.parametrize("seed", [0, 1])
def test_topk_paged_equals_reference(seed, chunk):
  q, w, pool, tab, nv = make_case(seed, N=6, H=4, C=16, NB=40, E=8, F=13)
  ids, vals, bmax = ip.indexer_topk_paged(q, w, pool, tab, nv, 12, chunk_entries=chunk, block_max_size=4)
  ref = reference_scores(q, w, pool, tab, nv)
  assert_topk_matches(ids, ref, 12)
  # Values are the reference scores of the picks; block maxima are the reference's per 4 entries.
  ok = np.asarray(ids) >= 0
  np.testing.assert_allclose(np.asarray(vals)[ok], np.take_along_axis(np.asarray(ref), np.asarray(ids), 1)[ok],
                             rtol=1e-5, atol=1e-5)
  want_bmax = np.asarray(ref).reshape(6, -1, 4).max(-1)
  np.testing.assert_array_equal(np.isneginf(np.asarray(bmax)), np.isneginf(want_bmax))
  f = np.isfinite(want_bmax)
  np.testing.assert_allclose(np.asarray(bmax)[f], want_bmax[f], rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(ids)[0] == -1)  # the query that sees nothing picks nothing


@pytest.mark.parametrize("seed", [0, 1])
def test_query_blocks_match_the_reference_and_a_query_ignores_its_neighbours(seed):
  """query_block (the invariant step): the queries in fixed blocks, none run past the last query that sees an
  entry; a query's picks and score bits do not change with what its block neighbours are."""
  q, w, pool, tab, nv = make_case(seed, N=8, H=4, C=16, NB=40, E=8, F=13)
  nv = nv.at[5:].set(0).at[2].set(57)                       # trailing queries see nothing (tile padding)
  kw = dict(chunk_entries=32, block_max_size=4, query_block=2)
  ids, vals, bmax = ip.indexer_topk_paged(q, w, pool, tab, nv, 12, **kw)
  assert_topk_matches(ids, reference_scores(q, w, pool, tab, nv), 12)
  assert np.all(np.asarray(ids)[5:] == -1) and np.all(np.isneginf(np.asarray(vals)[5:]))
  assert np.all(np.isneginf(np.asarray(bmax)[5:]))
  # Query 2's neighbour (3) replaced: other q, table and visible count; query 2 moved nowhere, same bits.
  q2, w2, _, tab2, nv2 = make_case(seed + 10, N=8, H=4, C=16, NB=40, E=8, F=13)
  mix = lambda a, b: a.at[3].set(b[3])
  ids2, vals2, bmax2 = ip.indexer_topk_paged(mix(q, q2), mix(w, w2), pool, mix(tab, tab2), mix(nv, nv2), 12, **kw)
  np.testing.assert_array_equal(np.asarray(ids2)[2], np.asarray(ids)[2])
  np.testing.assert_array_equal(np.asarray(vals2)[2], np.asarray(vals)[2])
  np.testing.assert_array_equal(np.asarray(bmax2)[2], np.asarray(bmax)[2])


@pytest.mark.parametrize("query_block", [0, 2])
@pytest.mark.parametrize("chunk", [16, 40, 10_000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_running_candidates_equal_candidate_blocks_of_all_maxima(seed, chunk, query_block):
  """The V4.1 candidate source merged chunk by chunk (candidate_topk_blocks) picks exactly the ids
  `candidate_blocks` picks from the whole block maxima, ties (quantized keys) included."""
  q, w, pool, tab, nv = make_case(seed, N=8, H=4, C=16, NB=40, E=8, F=13)
  pool = jnp.round(pool * 2) / 2                                  # coarse keys: equal block maxima happen
  q = jnp.round(q)
  kw = dict(chunk_entries=chunk, block_max_size=4, query_block=query_block)
  ids, vals, bmax = ip.indexer_topk_paged(q, w, pool, tab, nv, 12, **kw)
  ids2, vals2, cand = ip.indexer_topk_paged(q, w, pool, tab, nv, 12, candidate_topk_blocks=5, **kw)
  want = ip.candidate_blocks(bmax, jnp.floor_divide(nv - 1, 4), 5)
  np.testing.assert_array_equal(np.asarray(cand), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(ids2), np.asarray(ids))
  assert (np.asarray(cand) >= 0).sum() > 8


def test_topk_paged_bf16_pool_and_k_above_entries():
  q, w, pool, tab, nv = make_case(3, N=4, H=4, C=16, NB=20, E=4, F=3, dtype=jnp.bfloat16)
  ids, _, _ = ip.indexer_topk_paged(q, w, pool, tab, nv, 64, chunk_entries=4)  # k > F * E: width clipped
  assert ids.shape == (4, 12)
  assert_topk_matches(ids, reference_scores(q, w, pool, tab, nv), 64)


def test_ties_keep_lowest_ids_across_chunks():
  """Equal scores everywhere: the running merge keeps the lowest entry ids, as one top_k over all entries."""
  N, E, F = 2, 4, 6
  pool = jnp.ones((8, E, 4), jnp.float32)
  tab = jnp.asarray([[5, 3, 1, 0, 2, 4]] * N, jnp.int32)
  q, w = jnp.ones((N, 2, 4)), jnp.ones((N, 2))
  ids, _, _ = ip.indexer_topk_paged(q, w, pool, tab, jnp.asarray([24, 10], jnp.int32), 5, chunk_entries=4)
  np.testing.assert_array_equal(np.asarray(ids), [[0, 1, 2, 3, 4]] * N)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_candidate_blocks_equal_dense_mask(seed):
  rng = np.random.default_rng(seed)
  N, M, bs, kb = 5, 64, 8, 3
  scores = jnp.asarray(np.where(rng.random((N, M)) < 0.8, rng.standard_normal((N, M)), -np.inf), jnp.float32)
  nv = jnp.asarray(rng.integers(0, M + 1, N), jnp.int32)
  visible = jnp.arange(M)[None, :] < nv[:, None]
  scores = jnp.where(visible, scores, -jnp.inf)
  want = candidate_mask(scores[:, None], nv[:, None], visible[:, None], bs, kb)[:, 0]
  bmax = scores.reshape(N, M // bs, bs).max(-1)
  cb = ip.candidate_blocks(bmax, jnp.floor_divide(nv - 1, bs), kb)
  got = ix.candidate_blocks_to_allowed(cb[:, None], M, bs)[:, 0] & visible
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("seed", [0, 1])
def test_topk_candidates_equals_masked_reference(seed):
  q, w, pool, tab, nv = make_case(seed + 10, N=6, H=4, C=16, NB=40, E=16, F=5)
  rng = np.random.default_rng(seed)
  bs, M = 8, 5 * 16
  cand = np.stack([rng.permutation(M // bs)[:3] for _ in range(6)]).astype(np.int32)
  cand[1, 2] = -1  # a missing candidate
  cand = jnp.asarray(cand)
  ids, _ = ip.indexer_topk_candidates(q, w, pool, tab, nv, 12, cand, bs)
  allowed = ix.candidate_blocks_to_allowed(cand[:, None], M, bs)[:, 0]
  assert ids.shape == (6, 12)  # 3 blocks of 8 = 24 candidates >= k
  assert_topk_matches(ids, reference_scores(q, w, pool, tab, nv, allowed), 12)
  # Fewer candidate entries than k: padded to the dense path's width with -1.
  ids2, _ = ip.indexer_topk_candidates(q, w, pool, tab, nv, 30, cand[:, :2], bs)
  assert ids2.shape == (6, 30)
  allowed2 = ix.candidate_blocks_to_allowed(cand[:, None, :2], M, bs)[:, 0]
  assert_topk_matches(ids2, reference_scores(q, w, pool, tab, nv, allowed2), 30)


def test_bad_shapes_raise():
  q, w, pool, tab, nv = make_case(0, N=2, H=4, C=16, NB=8, E=8, F=2)
  with pytest.raises(ValueError, match="do not agree"):
    ip.indexer_topk_paged(q, w[:1], pool, tab, nv, 4)
  with pytest.raises(ValueError, match="block_max_size"):
    ip.indexer_topk_paged(q, w, pool, tab, nv, 4, block_max_size=3)


def test_jit_memory_does_not_grow_with_table_width():
  """The largest temporary is one chunk's [N, H, chunk] product: compiled temp bytes grow far less than the
  reference's [N, H, M] + [N, M, C] when the table is 16x wider."""
  N, H, C, E = 4, 8, 32, 32

  def temp(fn, F):
    args = (jax.ShapeDtypeStruct((N, H, C), jnp.float32), jax.ShapeDtypeStruct((N, H), jnp.float32),
            jax.ShapeDtypeStruct((4 * F, E, C), jnp.float32), jax.ShapeDtypeStruct((N, F), jnp.int32),
            jax.ShapeDtypeStruct((N,), jnp.int32))
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

  paged = lambda q, w, p, t, nv: ip.indexer_topk_paged(q, w, p, t, nv, 8, chunk_entries=1024)[0]
  ref = lambda q, w, p, t, nv: ix.topk_from_scores(reference_scores(q, w, p, t, nv), 8)[0]
  small, big = temp(paged, 64), temp(paged, 1024)
  ref_big = temp(ref, 1024)
  assert big < ref_big / 4, (big, ref_big)
  assert big < 4 * small + 2 * N * 1024 * E * 4, (small, big)
