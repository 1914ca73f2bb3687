"""The kernels at V4-Flash's head shapes in interpret mode, against the plain-JAX references.

* FP8 rows at d = 512: 448 e4m3 channels in seven 64-channel blocks, each with its own UE8M0 scale, + 64 bf16 RoPE
  channels, on every storage path (record, record read as uint16, paged). The rows are built so the seven blocks of
  a row differ in magnitude by up to 2^18, and the test first shows that moving any block's scale to its neighbour
  moves the reference answer far outside the tolerance, which is set per output block (each block's own magnitude):
  a kernel that applied a wrong block's scale would fail.
* The tunings the kernels ship with (`default_tuning`: block_h 64, block_k 16 for bf16; block_h 32 for FP8) at 64
  heads x d 512, with one split, auto splits at batch 3 and a batch-1 decode over window 128 + top-512 ids; the
  fused top-k's default tuning at 64 heads x 128 with FP8 keys.
Small batches and contexts keep each case to seconds; the default tier runs the paged FP8 path at d 512, the
shipped tuning in bf16 and the fused top-k; the other FP8 paths and the FP8 x shipped-tuning cases (3-5 s each) are in
the slow tier."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import indexer as ix
from pallas_kernels import indexer_topk as it
from pallas_kernels import sparse_attention as sa
from tests.pallas_kernels.test_indexer import make_case as indexer_case
from tests.pallas_kernels.test_indexer_topk import assert_ids_match
from tests.pallas_kernels.test_sparse_attention import TOL, assert_close, make_case

D, ROPE, BLOCKS = 512, 64, 7
BLOCK_EXP = np.array([-6, 4, 0, 8, -3, -10, 2])  # per-block magnitude 2^e: exponents >= 2 apart, so 7 scales


def fp8_rows(rng, P):
  """[P, 512] rows whose seven FP8 blocks have distinct magnitudes (and a per-row factor), RoPE part plain."""
  x = rng.standard_normal((P, D)).astype(np.float32)
  x[:, :D - ROPE] *= np.repeat(2.0 ** BLOCK_EXP, 64)[None, :]
  x *= np.exp(rng.uniform(-2, 2, (P, 1)))
  return jnp.asarray(x, jnp.bfloat16)


def case(seed, N=5, H=16, P=24, Q=40, W=8, K=24):
  q, _, wi, _, ci, sink = make_case(seed, N, H, D, P, Q, W, K, jnp.bfloat16)
  rng = np.random.default_rng(seed)
  return q, sa.quantize_kv_fp8(fp8_rows(rng, P)), wi, sa.quantize_kv_fp8(fp8_rows(rng, Q)), ci, sink


def block_tols(want):
  """Absolute tolerance per 64-channel column block of the output (the seven FP8 blocks, then RoPE), relative to
  that block's own magnitude: one tolerance for the whole row would be set by the largest block (2^8 here) and miss
  an error in a block 2^18 smaller."""
  w = np.abs(np.asarray(want, np.float32)).reshape(*want.shape[:-1], D // 64, 64)
  return TOL[jnp.bfloat16][0] * np.maximum(w.max(axis=tuple(range(w.ndim - 2)) + (w.ndim - 1,)), 2.0 ** -12)


def assert_close_blockwise(got, want, what):
  tols = block_tols(want)
  for b, tol in enumerate(tols):
    cols = slice(64 * b, 64 * (b + 1))
    assert_close(got[..., cols], want[..., cols], tol, TOL[jnp.bfloat16][1], f"{what} block {b}")


def test_fp8_test_rows_use_all_seven_scales():
  """Each row carries seven different block scales, and swapping any block's scale with its neighbour's changes
  the reference output by far more than the tolerance (so the kernel tests below see a block / scale mixup)."""
  q, wp, wi, cp, ci, sink = case(0)
  scales = np.asarray(cp.scale[:, :BLOCKS]).astype(int)
  assert cp.nope.shape == (40, 448) and cp.scale.shape[1] == 8
  assert all(len(set(r)) == BLOCKS for r in scales)
  assert int(jnp.sum((ci >= 0) & (ci < 40))) >= 20  # enough compressed rows are attended to
  want = np.asarray(sa.sparse_attention_reference(q, wp, wi, cp, ci, sink, scale=D ** -0.5)[0], np.float32)
  tols = block_tols(want)
  for b in range(BLOCKS):
    perm = list(range(8))
    perm[b], perm[(b + 1) % BLOCKS] = perm[(b + 1) % BLOCKS], perm[b]
    swapped = sa.Fp8KVPool(cp.nope, cp.scale[:, jnp.asarray(perm)], cp.rope)
    got = np.asarray(sa.sparse_attention_reference(q, wp, wi, swapped, ci, sink, scale=D ** -0.5)[0], np.float32)
    err = np.abs(got - want).reshape(*want.shape[:-1], D // 64, 64).max(axis=(0, 1, 3))
    assert err[b] > 20 * tols[b] and err[(b + 1) % BLOCKS] > 20 * tols[(b + 1) % BLOCKS], (b, err / tols)


@pytest.mark.parametrize("path", [pytest.param("record", marks=pytest.mark.slow),
                                  pytest.param("record_u16", marks=pytest.mark.slow), "paged"])
def test_fp8_d512_every_storage_path(path):
  q, wp, wi, cp, ci, sink = case(1)
  want = sa.sparse_attention_reference(q, sa.dequantize_kv_fp8(wp, jnp.bfloat16), wi,
                                       sa.dequantize_kv_fp8(cp, jnp.bfloat16), ci, sink, scale=D ** -0.5)
  tun = sa.SparseAttentionTuning(block_h=16, block_k=8, num_splits=2)
  if path == "record_u16":
    tun = sa.SparseAttentionTuning(block_h=16, block_k=8, fp8_u16_min_elems=0)  # the >= 2^31-element path
  if path == "paged":
    wp, cp = sa.record_to_paged(wp, 4), sa.record_to_paged(cp, 8)
  got = sa.sparse_attention_pallas(q, wp, wi, cp, ci, sink, scale=D ** -0.5, interpret=True, tuning=tun)
  assert_close_blockwise(got[0], want[0], "out")
  assert_close(got[1], want[1], 3e-4, 3e-4, "lse")


def flash_case(seed, fmt, N=3):
  """64 heads x 512, window 16 + 40 compressed ids (ragged, -1 and out-of-range ids, per-query lengths)."""
  q, wp, wi, cp, ci, sink = make_case(seed, N, 64, D, 40, 90, 16, 40, jnp.bfloat16)
  if fmt == "fp8_paged":
    rng = np.random.default_rng(seed)
    wp = sa.record_to_paged(sa.quantize_kv_fp8(fp8_rows(rng, 40)), 8)
    cp = sa.record_to_paged(sa.quantize_kv_fp8(fp8_rows(rng, 90)), 10)
  lens = jnp.asarray([16, 7, 0][:N], jnp.int32), jnp.asarray([40, 0, 33][:N], jnp.int32)
  return (q, wp, wi, cp, ci, sink, *lens)


@pytest.mark.parametrize("fmt,splits", [("bf16", 0), pytest.param("bf16", 1, marks=pytest.mark.slow),
                                        pytest.param("fp8_paged", 0, marks=pytest.mark.slow),
                                        pytest.param("fp8_paged", 1, marks=pytest.mark.slow)])
def test_v4_flash_tuning(fmt, splits):
  """The shipped tuning for the format (bf16: all 64 heads in one program, block_k 16; FP8: two head blocks of 32) at
  d 512; 0 = auto (one split here: 56 ids of partials would outweigh their rows; the batch-1 test below splits),
  1 = one split (the prefill / large-batch path)."""
  base = sa.BF16_TUNING if fmt == "bf16" else sa.FP8_TUNING
  tun = dataclasses.replace(base, num_splits=splits)
  assert (tun.block_h, tun.block_k) == ((64, 16) if fmt == "bf16" else (32, 16))
  args = flash_case(2, fmt)
  assert sa.chosen_num_splits(3, 64, [16, 40], tun) == 1
  got = sa.sparse_attention_pallas(*args, scale=D ** -0.5, interpret=True, tuning=tun)
  want = sa.sparse_attention_reference(*args[:6], scale=D ** -0.5, window_len_N=args[6], comp_len_N=args[7])
  assert_close_blockwise(got[0], want[0], "out")
  assert_close(got[1], want[1], 3e-4, 3e-4, "lse")


@pytest.mark.parametrize("fmt", ["fp8_paged", pytest.param("fp8_record", marks=pytest.mark.slow)])
def test_v4_flash_batch1_decode_many_splits(fmt):
  """Batch-1 decode at the shipped FP8 tuning: window 128 + top-512 ids (40 blocks of 16), auto splits (10 splits
  of 4 blocks, the byte cap), ragged lengths (window 77, compressed 300: splits past the live blocks are empty), FP8 at d 512 with
  seven block scales per row."""
  rng = np.random.default_rng(9)
  q, _, _, _, _, sink = make_case(9, 1, 64, D, 8, 8, 8, 8, jnp.bfloat16)
  rec_w, rec_c = sa.quantize_kv_fp8(fp8_rows(rng, 160)), sa.quantize_kv_fp8(fp8_rows(rng, 640))
  wi = jnp.asarray(rng.permutation(160)[None, :128], jnp.int32)
  ci = jnp.asarray(rng.permutation(640)[None, :512], jnp.int32)
  wl, cl = jnp.asarray([77], jnp.int32), jnp.asarray([300], jnp.int32)
  pw, pc = (sa.record_to_paged(rec_w, 16), sa.record_to_paged(rec_c, 64)) if fmt == "fp8_paged" else (rec_w, rec_c)
  tun = sa.FP8_TUNING
  assert sa.chosen_num_splits(1, 64, [128, 512], tun, row_bytes=584) == 10
  got = sa.sparse_attention_pallas(q, pw, wi, pc, ci, sink, wl, cl, scale=D ** -0.5, interpret=True, tuning=tun)
  want = sa.sparse_attention_reference(q, rec_w, wi, rec_c, ci, sink, scale=D ** -0.5, window_len_N=wl,
                                       comp_len_N=cl)
  assert_close_blockwise(got[0], want[0], "out")
  assert_close(got[1], want[1], 3e-4, 3e-4, "lse")


def test_fused_topk_default_tuning_fp8_keys():
  """IndexerTopkTuning() at the V4-Flash indexer's 64 heads x 128 with FP8 keys (decode: one query per sequence)."""
  B, T, H, C, P, M = 2, 1, 64, 128, 300, 150
  q, w, kp, rows, nv, _ = indexer_case(4, B, T, H, C, P, M, jnp.bfloat16, False)
  keys = it.quantize_index_keys(kp.astype(jnp.float32))
  want = ix.indexer_scores_reference(q, jnp.abs(w), it.dequantize_index_keys(keys), rows, nv)
  got = it.indexer_topk_pallas(q, jnp.abs(w), keys, rows, nv, k=32, interpret=True, tuning=it.IndexerTopkTuning())
  scale = float(jnp.max(jnp.abs(jnp.where(jnp.isfinite(want), want, 0))))
  assert_ids_match(got, want, 32, 1e-4 * max(1.0, scale))
