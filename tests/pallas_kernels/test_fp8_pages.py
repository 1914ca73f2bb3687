"""FP8 rows: the in-kernel decode (bitcast, conversion, one scale multiply) vs float64 for every code, record <->
paged layout (byte exact), and the kernel on every FP8 storage path (record, record via uint16 view, paged) vs
dequantize-then-reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fp8
from pallas_kernels import sparse_attention as sa
from tests.pallas_kernels.test_sparse_attention import TOL, assert_close, make_case


def _bytes(a):
  a = np.asarray(a if a.dtype != jnp.float8_e4m3fn else jax.lax.bitcast_convert_type(a, jnp.uint8))
  return a.view(np.uint8)


def test_ue8m0_scale_is_exact_for_every_exponent():
  got = np.asarray(fp8.ue8m0_to_f32(jnp.arange(255, dtype=jnp.int32)), np.float64)
  np.testing.assert_array_equal(got, 2.0 ** (np.arange(255) - 127.0))


def _decode_words_kernel(w_ref, e8_ref, lo_ref, hi_ref):
  """The kernels' decode on one tile: a word loaded once, both bytes bitcast + converted, one scale multiply."""
  lo, hi = fp8.word_bytes_as_e4m3(w_ref[...])
  scale = fp8.ue8m0_to_f32(e8_ref[...])[:, None]
  lo_ref[...] = fp8.e4m3_to_f32(lo) * scale
  hi_ref[...] = fp8.e4m3_to_f32(hi) * scale


@pytest.mark.parametrize("e8", [1, 5, 16, 60, 120, 127, 128, 140, 200, 228, 254])
def test_in_kernel_decode_matches_conversion_for_every_code(e8):
  """Every (low byte, high byte) e4m3 pair of a uint16 word, decoded by the kernels' path inside a Pallas kernel
  (interpret mode), equals the e4m3 value times 2^(e8 - 127) (computed in float64) wherever that is a finite f32
  normal; e4m3fn's two NaN codes decode as NaN."""
  from jax.experimental import pallas as pl
  words = jnp.arange(65536, dtype=jnp.int32).astype(jnp.uint16).reshape(256, 256)
  e8s = jnp.full((256,), e8, jnp.int32)
  out = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  lo, hi = pl.pallas_call(_decode_words_kernel, out_shape=[out, out], interpret=True)(words, e8s)
  codes = np.asarray(jax.lax.bitcast_convert_type(jnp.arange(256, dtype=jnp.int32).astype(jnp.uint8),
                                                  jnp.float8_e4m3fn).astype(jnp.float32), np.float64)
  w = np.arange(65536).reshape(256, 256)
  for got, byte in ((lo, w & 0xFF), (hi, w >> 8)):
    want = codes[byte] * 2.0 ** (e8 - 127)
    got = np.asarray(got, np.float64)
    nan = np.isnan(want)
    assert nan.sum() == 2 * 256 and np.isnan(got[nan]).all()
    ok = ~nan & ((np.abs(want) >= 2.0 ** -126) | (want == 0)) & (np.abs(want) < 3.4e38)
    np.testing.assert_array_equal(got[ok], want[ok])


@pytest.mark.parametrize("P,page_size", [(37, 4), (64, 64), (5, 2)])
def test_record_paged_roundtrip(P, page_size):
  rng = np.random.default_rng(P)
  x = jnp.asarray(rng.standard_normal((P, 512)) * np.exp(rng.uniform(-8, 8, (P, 1))), jnp.bfloat16)
  rec = sa.quantize_kv_fp8(x)
  pg = sa.record_to_paged(rec, page_size)
  assert pg.pages.dtype == jnp.uint16 and pg.page_size == page_size
  assert pg.data_bytes_per_row == 576 and pg.bytes_per_row == 584  # TMA box of 576 B + 8 B of scale tail
  assert pg.shape == (-(-P // page_size) * page_size, 512)
  # Row data is 576 contiguous bytes, rows of a page back to back, 16-byte aligned; the tail holds the scales.
  page_bytes = np.asarray(pg.pages).view(np.uint8).reshape(pg.pages.shape[0], -1)
  assert page_bytes.shape[1] == page_size * 584 and (page_size * 584) % 16 == 0
  r = min(P - 1, page_size + 1)
  pgi, slot = divmod(r, page_size)
  row = page_bytes[pgi, slot * 576:(slot + 1) * 576]
  np.testing.assert_array_equal(row[:448], _bytes(rec.nope[r]))
  np.testing.assert_array_equal(row[448:], np.asarray(rec.rope[r]).view(np.uint8))
  np.testing.assert_array_equal(page_bytes[pgi, page_size * 576 + slot * 8:][:8], _bytes(rec.scale[r]))
  back = sa.paged_to_record(pg)
  for a, b in zip(back, rec):
    np.testing.assert_array_equal(_bytes(a[:P]), _bytes(b))
  np.testing.assert_array_equal(np.asarray(sa.dequantize_kv_fp8(back)[:P]), np.asarray(sa.dequantize_kv_fp8(rec)))


@pytest.mark.parametrize("path", ["rec", "rec16", "paged"])
def test_kernel_fp8_paths(path):
  N, H, D, P, Q, W, K = 5, 16, 128, 30, 60, 8, 24
  q, wp, wi, cp, ci, sink = make_case(11, N, H, D, P, Q, W, K, jnp.bfloat16, sink_kind="large")
  cp = cp * jnp.asarray(np.exp(np.random.default_rng(1).uniform(-4, 4, (Q, 1))), jnp.bfloat16)
  rec_w, rec_c = sa.quantize_kv_fp8(wp), sa.quantize_kv_fp8(cp)
  want = sa.sparse_attention_reference(q, sa.dequantize_kv_fp8(rec_w, jnp.bfloat16), wi,
                                       sa.dequantize_kv_fp8(rec_c, jnp.bfloat16), ci, sink, scale=D ** -0.5)
  tun = sa.SparseAttentionTuning(block_h=16, block_k=8, num_splits=2)
  if path == "rec16":
    tun = sa.SparseAttentionTuning(block_h=16, block_k=8, fp8_u16_min_elems=0)
  pw, pc = rec_w, rec_c
  if path == "paged":
    pw, pc = sa.record_to_paged(rec_w, 2), sa.record_to_paged(rec_c, 4)  # pages divide P, Q: no extra rows
  got = sa.sparse_attention_pallas(q, pw, wi, pc, ci, sink, scale=D ** -0.5, interpret=True, tuning=tun)
  # bf16 outputs: tolerance relative to the output's scale (rows differ in magnitude by e^+-4).
  atol = TOL[jnp.bfloat16][0] * max(1.0, float(jnp.max(jnp.abs(want[0].astype(jnp.float32)))))
  assert_close(got[0], want[0], atol, TOL[jnp.bfloat16][1], "out")
  assert_close(got[1], want[1], 3e-4, 3e-4, "lse")
  # The reference reads the paged layout too; a mixed (bf16 window, paged compressed) call works.
  ref = sa.sparse_attention_reference(q, pw, wi, pc, ci, sink, scale=D ** -0.5)
  assert_close(ref[0], want[0], atol, TOL[jnp.bfloat16][1], "ref")
  mixed = sa.sparse_attention_pallas(q, sa.dequantize_kv_fp8(rec_w, jnp.bfloat16), wi, pc, ci, sink,
                                     scale=D ** -0.5, interpret=True, tuning=tun)
  assert_close(mixed[0], want[0], atol, TOL[jnp.bfloat16][1], "mixed")


@pytest.mark.parametrize("fmt", ["f32", "fp8_paged"])
def test_nonfinite_rows_behind_invalid_ids(fmt):
  """Rows only reachable through invalid ids (-1 -> row 0, ids >= P, ids past the valid length) hold NaN / inf:
  the kernel never reads them (masked loads) and the answer equals the one with those rows zeroed."""
  N, H, D, P, Q, W, K = 4, 16, 128, 20, 40, 8, 16
  q, wp, wi, cp, ci, sink = make_case(5, N, H, D, P, Q, W, K, jnp.float32)
  wi = jnp.where(wi == 0, 1, wi)
  ci = jnp.where(ci == 0, 1, ci)  # row 0 only reachable through invalid ids
  bad_w = wp.at[0].set(jnp.nan)
  bad_c = cp.at[0].set(jnp.inf)
  clean_c = cp.at[0].set(0.0)
  if fmt == "fp8_paged":
    clean_c = sa.record_to_paged(sa.quantize_kv_fp8(clean_c), 4)
    bad_c = sa.record_to_paged(sa.quantize_kv_fp8(bad_c), 4)
    assert not np.isfinite(np.asarray(sa.dequantize_kv_fp8(sa.paged_to_record(bad_c))[0])).all()
  want = sa.sparse_attention_reference(q, wp.at[0].set(0.0), wi, clean_c, ci, sink, scale=D ** -0.5)
  for ref_or_kernel in ("reference", "kernel"):
    if ref_or_kernel == "reference":
      got = sa.sparse_attention_reference(q, bad_w, wi, bad_c, ci, sink, scale=D ** -0.5)
    else:
      got = sa.sparse_attention_pallas(q, bad_w, wi, bad_c, ci, sink, scale=D ** -0.5, interpret=True,
                                       tuning=sa.SparseAttentionTuning(block_h=16, block_k=8))
    assert not np.isnan(np.asarray(got[0])).any(), ref_or_kernel
    assert_close(got[0], want[0], 3e-5, 3e-5, ref_or_kernel)
    assert_close(got[1], want[1], 3e-4, 3e-4, ref_or_kernel)
