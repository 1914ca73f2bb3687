"""Indexer score kernel (interpret mode) vs the XLA reference; top-k compared as sets with ties detected."""

import hypothesis
import hypothesis.strategies as st
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import indexer as ix
from pallas_kernels import indexer_topk

SETTINGS = dict(max_examples=4, deadline=None,   # derandomize: the suite's hypothesis profile (tests/conftest.py)
                suppress_health_check=[hypothesis.HealthCheck.too_slow, hypothesis.HealthCheck.data_too_large])


def make_case(seed, B, T, H, C, P, M, dtype, with_allowed):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, H, C)).astype(np.float32)
  w = (rng.standard_normal((B, T, H)) * C ** -0.5).astype(np.float32)
  kp = rng.standard_normal((P, C)).astype(np.float32)
  rows = rng.permutation(P)[: B * M].reshape(B, M) if B * M <= P else rng.integers(0, P, (B, M))
  for b in range(B):  # ragged allocation: -1 tail
    rows[b, rng.integers(M // 2, M + 1):] = -1
  rows[rng.random((B, M)) < 0.1] = P + 3  # out of range: masked like -1
  nv = rng.integers(0, M + 1, (B, T))
  nv[0, 0] = 0  # a query that sees nothing: all -inf
  allowed = jnp.asarray(rng.random((B, T, M)) < 0.6) if with_allowed else None
  return (jnp.asarray(q, dtype), jnp.asarray(w), jnp.asarray(kp, dtype), jnp.asarray(rows, jnp.int32),
          jnp.asarray(nv, jnp.int32), allowed)


ROWS = [4, 0, 9, 0, 2, 11, 7, 3]   # 8 sequences on a 12-row table; sequences 1 and 3 share row 0


def paged_case(seed, T=1, fp8=False, E=4, F=24, S=12, P=200, H=16, C=32):
  """Sequence b's entries through table row ROWS[b] (blocks -1, in range, and past the pool); sequences 0 and 7
  see nothing (padding). Returns (q, w, pool, PagedRows, nv) and the same entry lists as an [B, M] list."""
  rng = np.random.default_rng(seed)
  B, M = len(ROWS), F * E
  q = jnp.asarray(rng.standard_normal((B, T, H, C)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((B, T, H)) * C ** -0.5, jnp.float32)
  kp = jnp.asarray(rng.standard_normal((P, C)), jnp.float32)
  if fp8:
    kp = indexer_topk.quantize_index_keys(kp)
  table = rng.integers(-1, P // E, (S, F))
  table[rng.random((S, F)) < 0.05] = P // E + 2  # blocks past the pool: invalid like -1
  nv = rng.integers(1, M + 1, (B, T))
  nv[0] = nv[7] = 0
  paged = ix.PagedRows(jnp.asarray(table, jnp.int32), jnp.asarray(ROWS, jnp.int32), E)
  return (q, w, kp, paged, jnp.asarray(nv, jnp.int32)), paged.as_rows()


def assert_scores_close(got, want, atol, rtol):
  got, want = np.asarray(got), np.asarray(want)
  assert not np.isnan(got).any(), "NaN leaked into the scores"
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
  assert not np.isposinf(got).any()
  f = np.isfinite(want)
  np.testing.assert_allclose(got[f], want[f], atol=atol, rtol=rtol)


def assert_topk_sets_match(got_scores, want_scores, k, tie_tol):
  """Top-k compared as sets. Where the reference's k-th and (k+1)-th scores are within tie_tol (a tie the two
  implementations may break differently), only require the kernel's picks to be valid near-threshold picks."""
  gid, _ = ix.topk_from_scores(jnp.asarray(got_scores), k)
  wid, wv = ix.topk_from_scores(jnp.asarray(want_scores), k)
  gid, wid, ws = np.asarray(gid), np.asarray(wid), np.asarray(want_scores)
  srt = -np.sort(-ws, axis=-1)
  ties = 0
  for idx in np.ndindex(*gid.shape[:-1]):
    g, w = set(gid[idx][gid[idx] >= 0]), set(wid[idx][wid[idx] >= 0])
    kk = min(k, ws.shape[-1])
    kth = srt[idx][kk - 1]
    nxt = srt[idx][kk] if kk < ws.shape[-1] else -np.inf
    if np.isfinite(nxt) and abs(kth - nxt) <= tie_tol:
      ties += 1
      assert len(g) == len(w)
      picked = ws[idx][list(g)]
      assert np.all(picked >= kth - tie_tol)
    else:
      assert g == w, (idx, sorted(g ^ w))
  return ties


@pytest.mark.parametrize("with_allowed", [False, True])
@pytest.mark.parametrize("T,block_t", [(1, 0), (7, 2)])  # decode (T=1) and a ragged prefill chunk
@hypothesis.settings(**SETTINGS)
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_scores_and_topk_f32(seed, T, block_t, with_allowed):
  B, H, C, P, M = 3, 16, 32, 200, 45
  args = make_case(seed, B, T, H, C, P, M, jnp.float32, with_allowed)
  want = ix.indexer_scores_reference(*args)
  got = ix.indexer_scores_pallas(*args, interpret=True, tuning=ix.IndexerTuning(block_t=block_t, block_m=16))
  assert got.shape == want.shape and got.dtype == jnp.float32
  assert_scores_close(got, want, 2e-5, 2e-5)
  assert np.all(np.isneginf(np.asarray(got)[0, 0]))
  assert_topk_sets_match(got, want, k=8, tie_tol=1e-4)


def test_scores_bf16_and_ties_detected():
  B, T, H, C, P, M = 2, 4, 16, 64, 100, 40
  q, w, kp, rows, nv, _ = make_case(11, B, T, H, C, P, M, jnp.bfloat16, False)
  w = jnp.abs(w)
  # Force ties: sequence 1 points every entry at the same key row -> all its visible scores are equal.
  rows = rows.at[1, :].set(jnp.where(rows[1] >= 0, rows[1, 0], rows[1]))
  nv = nv.at[1].set(M)
  want = ix.indexer_scores_reference(q, w, kp, rows, nv)
  got = ix.indexer_scores_pallas(q, w, kp, rows, nv, interpret=True, tuning=ix.IndexerTuning(block_m=16))
  assert_scores_close(got, want, 1e-3, 1e-3)
  ids, _ = ix.topk_from_scores(want, M)  # k = M: every visible entry picked
  for b in range(B):
    for t in range(T):
      v = np.asarray(ids[b, t])
      assert set(v[v >= 0]) == set(np.nonzero(np.isfinite(np.asarray(want[b, t])))[0])
  assert assert_topk_sets_match(got, want, k=3, tie_tol=1e-3) >= T  # the tie detector fired on sequence 1


def test_candidate_blocks_to_allowed():
  blocks = jnp.asarray([[[0, 2, -1], [5, 9, 1]]], jnp.int32)  # 9 >= num blocks: ignored
  a = np.asarray(ix.candidate_blocks_to_allowed(blocks, M=21, block_size=4))
  assert a.shape == (1, 2, 21)
  np.testing.assert_array_equal(np.nonzero(a[0, 0])[0], [0, 1, 2, 3, 8, 9, 10, 11])
  np.testing.assert_array_equal(np.nonzero(a[0, 1])[0], [4, 5, 6, 7, 20])


def test_tuning_validation():
  with pytest.raises(ValueError):
    ix.IndexerTuning(block_m=48)
  with pytest.raises(ValueError):
    ix.IndexerTuning(block_t=3)


@pytest.mark.parametrize("block_m,skip", [(16, True), (32, False)])
def test_scores_read_rows_of_a_wider_table(block_m, skip):
  """PagedRows (more table rows than sequences, two sequences on one row, padding sequences): the score kernel's
  scores equal its scores on the [B, M] entry list bit for bit, and the reference's on both forms agree."""
  (q, w, kp, paged, nv), rows = paged_case(3, T=3)
  tun = ix.IndexerTuning(block_m=block_m, skip_invisible=skip)
  got = np.asarray(ix.indexer_scores_pallas(q, w, kp, paged, nv, interpret=True, tuning=tun))
  np.testing.assert_array_equal(got, np.asarray(ix.indexer_scores_pallas(q, w, kp, rows, nv, interpret=True,
                                                                         tuning=tun)))
  want = ix.indexer_scores_reference(q, w, kp, paged, nv)
  np.testing.assert_array_equal(np.asarray(want), np.asarray(ix.indexer_scores_reference(q, w, kp, rows, nv)))
  assert_scores_close(got, want, 1e-5, 1e-5)
  assert np.isneginf(got[0]).all() and np.isneginf(got[7]).all()
