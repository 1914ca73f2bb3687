"""Fused indexer top-k kernel (interpret mode) vs the reference: id sets compared order-insensitively, excluding
queries whose reference scores tie at the k-th place (those only need valid near-cut picks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels import indexer as ix
from pallas_kernels import indexer_topk as it
from tests.pallas_kernels.jaxpr_shapes import per_query_table_shapes
from tests.pallas_kernels.test_indexer import ROWS, make_case, paged_case


def assert_ids_match(got_ids, want_scores, k, tie_tol):
  """Each query: same number of picks; the set equals the reference's top-k unless the k-th and (k+1)-th reference
  scores tie within tie_tol, in which case every pick must score >= the k-th score - tie_tol and all strictly
  larger scores must be picked. Returns the number of tied queries."""
  got, ws = np.asarray(got_ids), np.asarray(want_scores)
  wid, _ = ix.topk_from_scores(jnp.asarray(ws), k)
  wid = np.asarray(wid)
  kk = min(k, ws.shape[-1])
  srt = -np.sort(-ws, axis=-1)
  ties = 0
  for idx in np.ndindex(*got.shape[:-1]):
    g = got[idx][got[idx] >= 0]
    assert len(set(g.tolist())) == len(g), ("duplicate picks", idx, g)
    w = set(wid[idx][wid[idx] >= 0].tolist())
    assert len(g) == len(w), (idx, sorted(g), sorted(w))
    kth = srt[idx][kk - 1]
    nxt = srt[idx][kk] if kk < ws.shape[-1] else -np.inf
    if np.isfinite(nxt) and abs(kth - nxt) <= tie_tol:
      ties += 1
      assert np.all(ws[idx][g] >= kth - tie_tol), idx
      assert set(np.nonzero(ws[idx] > kth + tie_tol)[0].tolist()) <= set(g.tolist()), idx
    else:
      assert set(g.tolist()) == w, (idx, sorted(set(g.tolist()) ^ w))
  return ties


@pytest.mark.parametrize("T,block_t,chunk,with_allowed", [
    (1, 0, 4096, False),   # decode, one chunk: only k ids leave the kernel
    (1, 0, 16, True),      # decode, 3 chunks merged
    (7, 2, 32, False),     # ragged prefill tile, 2 chunks
    (5, 4, 64, True),
])
def test_topk_f32(T, block_t, chunk, with_allowed):
  B, H, C, P, M = 3, 16, 32, 200, 45
  args = make_case(T * 13 + chunk, B, T, H, C, P, M, jnp.float32, with_allowed)
  q, w, kp, rows, nv, al = args
  nk = jnp.asarray([M, 20, 0], jnp.int32)
  want = ix.indexer_scores_reference(q, w, kp, rows, nv, al, nk)
  tun = it.IndexerTopkTuning(block_t=block_t, block_m=16, select_chunk=chunk)
  got = it.indexer_topk_pallas(q, w, kp, rows, nv, al, nk, k=8, interpret=True, tuning=tun)
  assert got.shape == (B, T, 8) and got.dtype == jnp.int32
  assert_ids_match(got, want, 8, 1e-4)
  assert np.all(np.asarray(got)[2] == -1)  # num_keys = 0: nothing visible
  assert np.all(np.asarray(got)[0, 0] == -1)  # num_visible = 0


def test_topk_k_larger_than_the_chunk():
  """k above select_chunk: each chunk can only offer its whole chunk (the merge reads the slots a chunk wrote,
  never past them: the kernel writes nothing else)."""
  B, T, H, C, P, M = 2, 3, 16, 32, 128, 45
  q, w, kp, rows, nv, _ = make_case(5, B, T, H, C, P, M, jnp.float32, False)
  want = ix.indexer_scores_reference(q, w, kp, rows, nv)
  got = it.indexer_topk_pallas(q, w, kp, rows, nv, k=20, interpret=True,
                               tuning=it.IndexerTopkTuning(block_m=16, select_chunk=16))
  assert got.shape == (B, T, 20)
  assert_ids_match(got, want, 20, 1e-4)


@pytest.mark.parametrize("M", [4096, 9000], ids=["one_chunk", "three_chunks"])
def test_topk_production_tiling(M):
  """The tiling the H200 check ran (k 512, select_chunk 4096, block_m 64): one full chunk (prefill at 16k: 4096
  entries) and several chunks, the last one partial (decode: M above select_chunk, each chunk offers 512 of its
  4096 lanes). Interpret mode fills the outputs with INT_MIN / NaN first, so a slot the kernel left unwritten fails
  here; the ordering of stores on a GPU is test_gpu_lowering.py's business."""
  B, T, H, C = 2, 2, 16, 32
  q, w, kp, rows, nv, _ = make_case(11, B, T, H, C, B * M, M, jnp.float32, False)
  nk = jnp.asarray([M, M - 1000], jnp.int32)
  want = ix.indexer_scores_reference(q, w, kp, rows, nv, None, nk)
  got = it.indexer_topk_pallas(q, w, kp, rows, nv, None, nk, k=512, interpret=True,
                               tuning=it.IndexerTopkTuning(block_m=64, select_chunk=4096))
  assert got.shape == (B, T, 512)
  assert_ids_match(got, want, 512, 1e-4)
  assert np.all(np.asarray(got)[0, 0] == -1)  # make_case: query (0, 0) sees nothing


def test_topk_k_larger_than_visible_and_ties_detected():
  """Duplicated key rows give exact ties at the cut; k > visible entries pads with -1."""
  B, T, H, C, P, M = 2, 2, 16, 32, 64, 32
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((B, T, H, C)), jnp.float32)
  w = jnp.asarray(np.abs(rng.standard_normal((B, T, H))), jnp.float32)
  base = rng.standard_normal((8, C)).astype(np.float32)
  kp = jnp.asarray(base[rng.integers(0, 8, P)])  # only 8 distinct keys: ties everywhere
  rows = jnp.asarray(rng.permutation(P)[:B * M].reshape(B, M), jnp.int32)
  nv = jnp.asarray([[M, 5], [17, M]], jnp.int32)
  want = ix.indexer_scores_reference(q, w, kp, rows, nv)
  got = it.indexer_topk_pallas(q, w, kp, rows, nv, k=10, interpret=True,
                               tuning=it.IndexerTopkTuning(block_m=16, select_chunk=16))
  ties = assert_ids_match(got, want, 10, 1e-5)
  assert ties >= 1  # the tie detector really saw ties
  assert np.sum(np.asarray(got)[0, 1] >= 0) == 5  # 5 visible < k


def test_topk_fp8_keys_and_bf16():
  B, T, H, C, P, M = 2, 3, 16, 64, 120, 40
  q, w, kp, rows, nv, _ = make_case(3, B, T, H, C, P, M, jnp.bfloat16, False)
  w = jnp.abs(w)
  fk = it.quantize_index_keys(kp.astype(jnp.float32) * 3.0)
  assert fk.keys.dtype == jnp.float8_e4m3fn and fk.scale.shape == (P,)
  deq = it.dequantize_index_keys(fk)
  want = ix.indexer_scores_reference(q, w, deq, rows, nv)
  got = it.indexer_topk_pallas(q, w, fk, rows, nv, k=6, interpret=True, tuning=it.IndexerTopkTuning(block_m=16))
  assert_ids_match(got, want, 6, 2e-2 * float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(want), want, 0)))))
  ref = it.indexer_topk_reference(q, w, fk, rows, nv, 6)
  assert ref.shape == got.shape
  # The dispatcher's XLA path accepts FP8 keys too.
  assert dispatch.indexer_topk(q, w, fk, rows, nv, 6).shape == got.shape


@pytest.mark.parametrize("chunk", [64, 16])  # one chunk (ids only), several chunks (candidates merged by XLA)
def test_topk_fp8_query_dot(chunk):
  """fp8_query: q rounded to e4m3 per (query, head), scale folded into the head weight, e4m3 x e4m3 dots. Equals
  the reference run on the dequantized q (its contract; the dequantized q really differs from q). That the dots are
  e4m3 on both sides is checked on the lowered module (test_gpu_lowering.py)."""
  B, T, H, C, P, M = 2, 3, 16, 64, 120, 40
  q, w, kp, rows, nv, _ = make_case(5, B, T, H, C, P, M, jnp.bfloat16, False)
  w = jnp.abs(w)
  fk = it.quantize_index_keys(kp.astype(jnp.float32))
  q8, w8, qd = it.quantize_index_queries(q, w)
  assert q8.dtype == jnp.float8_e4m3fn and float(jnp.max(jnp.abs(qd - q.astype(jnp.float32)))) > 1e-3
  np.testing.assert_allclose(np.asarray(w8), np.asarray(w) * np.asarray(jnp.max(jnp.abs(q.astype(jnp.float32)), -1)
                                                                          / 448.0), rtol=1e-6)
  want = ix.indexer_scores_reference(qd, w, it.dequantize_index_keys(fk), rows, nv)
  tun = it.IndexerTopkTuning(block_m=16, select_chunk=chunk, fp8_query=True)
  got = it.indexer_topk_pallas(q, w, fk, rows, nv, k=6, interpret=True, tuning=tun)
  assert_ids_match(got, want, 6, 1e-4 * float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(want), want, 0)))))
  with pytest.raises(ValueError, match="multiple of 64"):
    it.indexer_topk_pallas(q[..., :32], w, it.quantize_index_keys(kp[:, :32].astype(jnp.float32)), rows, nv, k=6,
                           interpret=True, tuning=tun)


def test_topk_v41_candidate_blocks():
  """Candidate blocks (with a repeated and an out-of-range id): the kernel scores only those blocks and matches the
  reference with the dense candidate mask."""
  B, T, H, C, P, M, bs = 2, 3, 16, 32, 200, 45, 8
  q, w, kp, rows, nv, _ = make_case(5, B, T, H, C, P, M, jnp.float32, False)
  rng = np.random.default_rng(5)
  cb = rng.integers(-1, 6, (B, T, 4))
  cb[0, 0] = [2, 2, 9, 0]  # repeated + out of range
  cb = jnp.asarray(cb, jnp.int32)
  allowed = ix.candidate_blocks_to_allowed(cb, M, bs)
  want = ix.indexer_scores_reference(q, w, kp, rows, nv, allowed)
  got = it.indexer_topk_pallas(q, w, kp, rows, nv, None, None, cb, k=8, block_size=bs, interpret=True,
                               tuning=it.IndexerTopkTuning(block_m=16))
  assert_ids_match(got, want, 8, 1e-4)
  ref = it.indexer_topk_reference(q, w, kp, rows, nv, 8, candidate_blocks_BxTxC=cb, block_size=bs)
  assert_ids_match(ref, want, 8, 1e-4)


@pytest.mark.parametrize("live", [0, 3, 7])
@pytest.mark.parametrize("chunk,cand", [(4096, False), (16, False), (4096, True)],
                         ids=["one_chunk", "chunks_merged", "candidates"])
def test_live_bound_keeps_the_live_sequences_ids(live, chunk, cand):
  """As the engine calls it (one flat token per sequence, T = 1): with `live`, the programs of sequences at or past
  it return without writing; the ids below it are bit for bit those of the call with every sequence live. (Both
  calls are one compiled program: in interpret mode XLA compiles the kernel's maths.)"""
  B, T, H, C, P, M, bs = 7, 1, 16, 32, 200, 45, 8
  q, w, kp, rows, nv, _ = make_case(11, B, T, H, C, P, M, jnp.float32, False)
  cb = jnp.asarray(np.random.default_rng(11).integers(-1, 6, (B, T, 4)), jnp.int32) if cand else None
  tun = it.IndexerTopkTuning(block_m=16, select_chunk=chunk)
  call = jax.jit(lambda n: it.indexer_topk_pallas(q, w, kp, rows, nv, None, None, cb, k=8, block_size=bs, live=n,
                                                  interpret=True, tuning=tun))
  full, got = np.asarray(call(jnp.int32(B))), np.asarray(call(jnp.int32(live)))
  np.testing.assert_array_equal(got[:live], full[:live])
  if chunk >= M:       # one chunk: the kernel's ids are the result; dead rows never written (interpret mode's fill)
    assert np.all(got[live:] < -1)
  allowed = None if cb is None else ix.candidate_blocks_to_allowed(cb, M, bs)
  assert_ids_match(full, ix.indexer_scores_reference(q, w, kp, rows, nv, allowed), 8, 1e-4)


def test_dispatch_indexer_topk_interpret():
  B, T, H, C, P, M = 2, 2, 16, 32, 90, 30
  q, w, kp, rows, nv, al = make_case(9, B, T, H, C, P, M, jnp.float32, True)
  nk = jnp.asarray([30, 11], jnp.int32)
  got = dispatch.indexer_topk(q, w, kp, rows, nv, 5, al, cfg=dispatch.KernelConfig("interpret"), num_keys_B=nk)
  want = ix.indexer_scores_reference(q, w, kp, rows, nv, al, nk)
  assert_ids_match(got, want, 5, 1e-4)


@pytest.mark.parametrize("fused", [False, True], ids=["scores", "topk"])
def test_nonfinite_key_rows_behind_invalid_ids(fused):
  """Key rows reachable only through invalid rows (-1 -> row 0, >= P) or past num_keys hold NaN: never read."""
  B, T, H, C, P, M = 2, 2, 16, 32, 60, 24
  q, w, kp, rows, nv, _ = make_case(8, B, T, H, C, P, M, jnp.float32, False)
  w = jnp.abs(w)
  rows = jnp.where(rows == 0, 1, rows)
  rows = rows.at[:, 20:].set(P - 1)  # past num_keys below
  rows = jnp.where(rows == P - 1, jnp.where(jnp.arange(M)[None, :] >= 20, P - 1, 2), rows)
  nk = jnp.asarray([20, 20], jnp.int32)
  bad = kp.at[0].set(jnp.nan).at[P - 1].set(jnp.inf)
  want = ix.indexer_scores_reference(q, w, kp.at[0].set(0.0).at[P - 1].set(0.0), rows, nv, None, nk)
  if fused:
    got = it.indexer_topk_pallas(q, w, bad, rows, nv, None, nk, k=6, interpret=True,
                                 tuning=it.IndexerTopkTuning(block_m=8))
    assert_ids_match(got, want, 6, 1e-4)
  else:
    got = np.asarray(ix.indexer_scores_pallas(q, w, bad, rows, nv, None, nk, interpret=True,
                                              tuning=ix.IndexerTuning(block_m=8)))
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(np.isinf(got), np.isinf(np.asarray(want)))
    f = np.isfinite(np.asarray(want))
    np.testing.assert_allclose(got[f], np.asarray(want)[f], rtol=2e-5, atol=2e-5)


# ---- entry lists as the engine keeps them: a block table [S, F] and each sequence's row (`PagedRows`) -------------


def test_paged_rows_are_the_entry_list():
  (_, _, _, paged, _), rows = paged_case(0)
  E, table = paged.entries_per_block, np.asarray(paged.table_SxF)
  want = np.where(table[ROWS][:, :, None] >= 0, table[ROWS][:, :, None] * E + np.arange(E), -1).reshape(len(ROWS), -1)
  np.testing.assert_array_equal(np.asarray(rows), want)
  assert paged.shape == rows.shape


@pytest.mark.parametrize("fp8", [False, True], ids=["f32", "fp8"])
@pytest.mark.parametrize("chunk,cand", [(128, False), (32, False), (128, True)],
                         ids=["one_chunk", "chunks_merged", "v41_candidates"])
def test_topk_reads_rows_of_a_wider_table(chunk, cand, fp8):
  """PagedRows with more table rows than sequences (two on one row, padding sequences): the kernel's ids equal its
  ids on the [B, M] entry list exactly, the reference's are the same on both forms, and the kernel matches it."""
  (q, w, kp, paged, nv), rows = paged_case(1, T=2, fp8=fp8)
  cb = None
  if cand:
    cb = jnp.asarray(np.random.default_rng(1).integers(-1, paged.shape[1] // 8, (len(ROWS), 2, 4)), jnp.int32)
  tun = it.IndexerTopkTuning(block_m=16, select_chunk=chunk)
  run = lambda r: np.asarray(it.indexer_topk_pallas(q, w, kp, r, nv, None, None, cb, k=8, interpret=True,
                                                    tuning=tun))
  got = run(paged)
  np.testing.assert_array_equal(got, run(rows))
  ref = lambda r: np.asarray(it.indexer_topk_reference(q, w, kp, r, nv, 8, candidate_blocks_BxTxC=cb))
  np.testing.assert_array_equal(ref(paged), ref(rows))
  allowed = None if cb is None else ix.candidate_blocks_to_allowed(cb, paged.shape[1], 8)
  keys = it.dequantize_index_keys(kp) if fp8 else kp
  scores = ix.indexer_scores_reference(q, w, keys, paged, nv, allowed)
  np.testing.assert_array_equal(np.asarray(scores), np.asarray(ix.indexer_scores_reference(q, w, keys, rows, nv,
                                                                                           allowed)))
  assert_ids_match(got, scores, 8, 1e-4)
  assert (got[0] == -1).all() and (got[7] == -1).all()


def test_dispatch_topk_with_paged_rows_and_its_validation_case():
  """dispatch.indexer_topk takes PagedRows on every backend; the validation `auto` runs on a GPU (small case,
  random inputs, error measure) handles them, on the CPU with interpret."""
  args, rows = paged_case(2)
  k = 6
  got = dispatch.indexer_topk(*args, k, cfg=dispatch.KernelConfig("interpret"))
  want = dispatch.indexer_topk(*args, k, cfg=dispatch.KernelConfig("xla"))
  np.testing.assert_array_equal(np.asarray(want), np.asarray(dispatch.indexer_topk(*args[:3], rows, args[4], k,
                                                                                    cfg=dispatch.KernelConfig("xla"))))
  assert_ids_match(got, ix.indexer_scores_reference(*args), k, 1e-4)
  check = dispatch._CHECKS["indexer_topk"]
  a, static = dispatch._topk_args(*args, k)
  small = check.small_case(a, static, None)
  assert isinstance(small.args.key_rows_BxM, dispatch.PagedRows)
  inputs = check.random_inputs(small.args, static, jax.random.PRNGKey(0))
  out = dispatch._RUN["indexer_topk"](dispatch._KERNELS["indexer_topk"], inputs, static, dict(interpret=True))
  assert check.err_over_tol(out, check.reference(inputs, static), inputs, static) <= 1.0


def test_kernel_paths_build_no_per_query_entry_list():
  """The fused top-k and the score kernel through the dispatcher, 64 sequences on a 4096-block table of 80 rows (3
  entries a block): no intermediate has both a 64 and a 4096 or 12288 dimension (the scores, the score op's
  output, are at the entry width: there only integer arrays count). The per-query list is caught."""
  n, f, s, E, H, C = 64, 4096, 80, 3, 4, 32
  spec = jax.ShapeDtypeStruct
  qa = (spec((n, 1, H, C), jnp.bfloat16), spec((n, 1, H), jnp.float32), spec((1000, C), jnp.bfloat16))
  tab, rows_B, nv = spec((s, f), jnp.int32), spec((n,), jnp.int32), spec((n, 1), jnp.int32)
  cfg = dispatch.KernelConfig("interpret")
  topk = lambda q, w, kp, t, r, v: dispatch.indexer_topk(q, w, kp, ix.PagedRows(t, r, E), v, 32, cfg=cfg)
  scores = lambda q, w, kp, t, r, v: dispatch.indexer_scores(q, w, kp, ix.PagedRows(t, r, E), v, cfg=cfg)
  widths = (f, f * E)
  assert per_query_table_shapes(topk, *qa, tab, rows_B, nv, n=n, widths=widths) == []
  assert per_query_table_shapes(scores, *qa, tab, rows_B, nv, n=n, widths=widths, ints_only=True) == []
  # the check can fail: the [N, M] entry list the model used to pass
  topk_list = lambda q, w, kp, t, r, v: dispatch.indexer_topk(q, w, kp, ix.PagedRows(t, r, E).as_rows(), v, 32,
                                                              cfg=cfg)
  assert per_query_table_shapes(topk_list, *qa, tab, rows_B, nv, n=n, widths=widths)
