"""The real GPU lowering (jax.export(..., platforms=("cuda",))) of every kernel at V4-Flash shapes, on CPU.

Only lowers (Pallas -> Triton IR inside an XLA custom call); nothing executes, so these shapes cost no memory.
A kernel that cannot be lowered for a GPU fails here. The lowering targets an abstract H200 (`lowering.py`: JAX 0.11
needs an AbstractDevice to lower Pallas-Triton without a GPU; 0.10 falls back to compute capability 9.0); a JAX that
can target no GPU here skips these tests with the reason."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import indexer as ix
from pallas_kernels import indexer_topk as it
from pallas_kernels import lowering
from pallas_kernels import sparse_attention as sa

S = jax.ShapeDtypeStruct
H, D, W, TOPK, ROPE = 64, 512, 128, 512, 64  # V4-Flash: 64 heads, d 512 (64 RoPE), window 128, top-k 512
TRITON = "__gpu$xla.gpu.triton"


def export_for_cuda(*a, **k):
  try:
    return lowering.export_for_cuda(*a, **k)
  except lowering.NoGpuTarget as e:
    pytest.skip(str(e))


def test_lowering_runs_under_an_abstract_h200():
  with lowering.abstract_gpu_target():
    device = jax.sharding.get_abstract_mesh().abstract_device
  assert device is not None and device.device_kind == "NVIDIA H200" and device.platform == "gpu"


def test_abstract_h200_gives_triton_compute_capability_90():
  """JAX >= 0.11 reads the Triton target from the abstract device (and refuses to lower without a GPU otherwise)."""
  try:
    from jax._src.pallas.triton import gpu_info
  except ImportError:
    pytest.skip(f"jax {jax.__version__}: no jax._src.pallas.triton.gpu_info; its Triton lowering falls back to "
                "compute capability 9.0 without a device")
  with lowering.abstract_gpu_target():
    assert gpu_info.get_gpu_info().compute_capability == 90


def pool_spec(rows, fp8):
  if fp8:
    return sa.Fp8KVPool(S((rows, D - ROPE), jnp.float8_e4m3fn), S((rows, 8), jnp.uint8), S((rows, ROPE), jnp.bfloat16))
  return S((rows, D), jnp.bfloat16)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("name,N,K,splits", [
    ("decode_b1_csa", 1, TOPK, 0),          # auto -> split-K (flash decoding)
    ("decode_b64_csa", 64, TOPK, 0),
    ("decode_b256_hca_128k", 256, 1024, 0),  # HCA at 128k context: 128k / 128 entries
    ("prefill_4k_csa", 4096, TOPK, 1),
])
def test_sparse_attention_lowers_for_cuda(name, N, K, splits, fp8):
  ctx = 131072
  window_rows, comp_rows = max(N, 256) * W, max(N, 64) * ctx // 4
  exp = export_for_cuda(
      sa.sparse_attention_pallas, S((N, H, D), jnp.bfloat16), pool_spec(window_rows, fp8), S((N, W), jnp.int32),
      pool_spec(comp_rows, fp8), S((N, K), jnp.int32), S((H,), jnp.float32), scale=D ** -0.5,
      tuning=sa.SparseAttentionTuning(num_splits=splits))
  assert TRITON in lowering.custom_call_targets(exp)
  assert exp.out_avals[0].shape == (N, H, D) and exp.out_avals[1].shape == (N, H)


@pytest.mark.parametrize("allowed", [False, True], ids=["dense", "v41_candidates"])
@pytest.mark.parametrize("name,B,T,M", [
    ("decode_b64_128k", 64, 1, 131072 // 4),
    ("prefill_4k", 1, 4096, 16384 // 4),
])
def test_indexer_lowers_for_cuda(name, B, T, M, allowed):
  HI, C = 64, 128  # indexer: 64 heads x 128
  exp = export_for_cuda(
      ix.indexer_scores_pallas, S((B, T, HI, C), jnp.bfloat16), S((B, T, HI), jnp.float32), S((B * M, C), jnp.bfloat16),
      S((B, M), jnp.int32), S((B, T), jnp.int32), S((B, T, M), jnp.bool_) if allowed else None)
  assert TRITON in lowering.custom_call_targets(exp)
  assert exp.out_avals[0].shape == (B, T, M)


def test_lowering_check_has_teeth():
  """A non-power-of-two head dim (V3.2's 576) cannot lower on Triton: the export check must fail."""
  with pytest.raises(Exception, match="power of 2"):
    export_for_cuda(
        sa.sparse_attention_pallas, S((4, H, 576), jnp.bfloat16), S((1024, 576), jnp.bfloat16), S((4, W), jnp.int32),
        S((1024, 576), jnp.bfloat16), S((4, TOPK), jnp.int32), S((H,), jnp.float32), scale=576 ** -0.5)


def paged_spec(rows, page_size=64):
  pg = sa.Fp8PagedPool(S((rows // page_size, page_size * 292), jnp.uint16), page_size)
  return pg


@pytest.mark.parametrize("name,N,K", [("decode_b64_csa", 64, TOPK), ("prefill_4k_csa", 4096, TOPK)])
def test_paged_fp8_lowers_for_cuda(name, N, K):
  """The TMA-friendly page layout (576 B rows + per-page scale tail, uint16 storage) at V4-Flash shapes."""
  ctx = 131072
  exp = export_for_cuda(
      sa.sparse_attention_pallas, S((N, H, D), jnp.bfloat16), paged_spec(max(N, 256) * W), S((N, W), jnp.int32),
      paged_spec(max(N, 64) * ctx // 4), S((N, K), jnp.int32), S((H,), jnp.float32), S((N,), jnp.int32),
      S((N,), jnp.int32), scale=D ** -0.5)
  assert TRITON in lowering.custom_call_targets(exp)
  assert exp.out_avals[0].shape == (N, H, D)


def test_huge_fp8_record_pool_goes_through_uint16_view():
  """An e4m3 array past 2^31 elements (but under 2^32 bytes) would overflow JAX-Triton's 32-bit element offsets:
  the kernel reads it as uint16 words (offsets < 2^31), visible as a ui16 operand of the Triton custom call."""
  rows = (2 ** 31) // 448 + 1024  # 2^31 + 458752 e4m3 elements, < 2^32 bytes
  exp = export_for_cuda(
      sa.sparse_attention_pallas, S((64, H, D), jnp.bfloat16), pool_spec(256 * W, False), S((64, W), jnp.int32),
      pool_spec(rows, True), S((64, TOPK), jnp.int32), S((H,), jnp.float32), scale=D ** -0.5)
  assert f"tensor<{rows}x224xui16>" in exp.mlir_module()
  small = export_for_cuda(
      sa.sparse_attention_pallas, S((64, H, D), jnp.bfloat16), pool_spec(256 * W, False), S((64, W), jnp.int32),
      pool_spec(4096, True), S((64, TOPK), jnp.int32), S((H,), jnp.float32), scale=D ** -0.5)
  assert "tensor<4096x448xf8E4M3FN>" in small.mlir_module()


@pytest.mark.parametrize("default_precision", [False, True], ids=["kernel", "teeth"])
def test_fp32_dots_are_ieee_not_tf32(default_precision, capsys, monkeypatch):
  """Triton's default dot precision for f32 is TF32; the kernel asks for HIGHEST, which lowers to IEEE (printed
  without an inputPrecision attribute). With the default precision forced back, tf32 appears: the check has teeth."""
  if default_precision:
    monkeypatch.setattr(sa, "_precision_for", lambda cdtype: None)
  N = 8 if default_precision else 4  # distinct shapes: the jit trace cache must not hand back the other variant
  export_for_cuda(
      sa.sparse_attention_pallas, S((N, 16, 64), jnp.float32), S((256, 64), jnp.float32), S((N, 16), jnp.int32),
      None, None, S((16,), jnp.float32), scale=0.125, tuning=sa.SparseAttentionTuning(block_k=16, debug=True))
  dots = [ln for ln in capsys.readouterr().out.splitlines() if "tt.dot" in ln]
  assert len(dots) == 2
  assert all(("inputPrecision = tf32" in ln) == default_precision for ln in dots), dots


@pytest.mark.parametrize("keys", ["bf16", "fp8"])
@pytest.mark.parametrize("name,B,T,M,cand", [
    ("decode_b64_128k", 64, 1, 131072 // 4, False),   # 8 chunks of 4096 on chip, merged
    ("decode_b64_8k", 64, 1, 8192 // 4, False),       # one chunk: only the k ids are written
    ("prefill_4k", 1, 4096, 16384 // 4, False),
    ("decode_b64_128k_v41", 64, 1, 131072 // 4, True),  # 64 candidate blocks of 8
])
def test_indexer_topk_lowers_for_cuda(name, B, T, M, cand, keys):
  HI, C, K = 64, 128, 512
  P = B * M
  pool = (it.Fp8IndexKeys(S((P, C), jnp.float8_e4m3fn), S((P,), jnp.float32)) if keys == "fp8"
          else S((P, C), jnp.bfloat16))
  exp = export_for_cuda(
      it.indexer_topk_pallas, S((B, T, HI, C), jnp.bfloat16), S((B, T, HI), jnp.float32), pool,
      S((B, M), jnp.int32), S((B, T), jnp.int32), None, S((B,), jnp.int32),
      S((B, T, 64), jnp.int32) if cand else None, k=K)
  assert TRITON in lowering.custom_call_targets(exp)
  assert exp.out_avals[0].shape == (B, T, K)


@pytest.mark.parametrize("M,stores", [(131072 // 4, 2), (8192 // 4, 1)], ids=["chunks", "one_chunk"])
def test_indexer_topk_writes_each_output_once(M, stores, capsys):
  """The fused top-k's Triton module stores each output once (the picked ids; with several chunks also their
  scores): a fill of the block before the pick's scatter would be a second store to the same addresses, unordered
  across threads on a GPU (the H200 check lost picks that way; interpret mode runs stores in order)."""
  B, HI, C = 64, 64, 128
  export_for_cuda(
      it.indexer_topk_pallas, S((B, 1, HI, C), jnp.bfloat16), S((B, 1, HI), jnp.float32), S((B * M, C), jnp.bfloat16),
      S((B, M), jnp.int32), S((B, 1), jnp.int32), None, S((B,), jnp.int32), None, k=512,
      tuning=it.IndexerTopkTuning(debug=True))
  ir = capsys.readouterr().out.splitlines()
  assert sum("tt.store" in ln for ln in ir) == stores, [ln for ln in ir if "tt.store" in ln]


def _triton_module(capsys, *specs, **kw):
  export_for_cuda(sa.sparse_attention_pallas, *specs, scale=D ** -0.5, **kw)
  return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("id_row", ["registers", "per_step"])
def test_fp8_paged_decode_loads_each_word_once(id_row, capsys):
  """The Triton module of the FP8 paged decode (window 128 + top-512, the FP8 tuning's block_k 16): per pool and
  step one load of the row's scale words [16 x 4], seven loads of e4m3 word pairs [16 x 32] (one per 64-channel
  block, feeding both of its byte chunks) and one RoPE load [16 x 64]; e4m3 is decoded by the type conversion
  (`tt.fp_to_fp`, 2 pools x 14 chunks), not integer arithmetic. The id rows are loaded once per program
  ([8 x 16], [32 x 16]) unless `id_row_max` sends them through one [1 x 16] load per step."""
  import dataclasses
  N = 4
  tun = dataclasses.replace(sa.FP8_TUNING, debug=True, id_row_max=2048 if id_row == "registers" else 0)
  ir = _triton_module(capsys, S((N, H, D), jnp.bfloat16), paged_spec(4096), S((N, W), jnp.int32),
                      paged_spec(8192), S((N, TOPK), jnp.int32), S((H,), jnp.float32), tuning=tun)
  loads = [ln for ln in ir if "tt.load" in ln]
  i16 = lambda shape: sum(f"tensor<{shape}x!tt.ptr<i16>>" in ln for ln in loads)
  assert (i16("16x4"), i16("16x32"), i16("16x64")) == (2, 14, 2)
  assert sum("tt.fp_to_fp" in ln and "f8E4M3FN" in ln for ln in ir) == 28
  once = [sum(f"tensor<{s}x!tt.ptr<i32>>" in ln for ln in loads) for s in ("8x16", "32x16", "1x16")]
  assert once == ([1, 1, 0] if id_row == "registers" else [0, 0, 2])


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8_paged"])
def test_batch1_decode_many_splits_lowers(fmt):
  """Batch 1 at 64 heads splits the keys 10 ways (window 128 + top-512 = 40 blocks of 16; the byte cap: 640 rows
  against 64 KB partials); the split partials [1, 10, 64, 512] come out of the Triton call and are merged by XLA."""
  assert sa.chosen_num_splits(1, H, [W, TOPK]) == 10
  pool = paged_spec(256 * W) if fmt == "fp8_paged" else pool_spec(256 * W, fmt == "fp8")
  cpool = paged_spec(64 * 32768) if fmt == "fp8_paged" else pool_spec(64 * 32768, fmt == "fp8")
  exp = export_for_cuda(
      sa.sparse_attention_pallas, S((1, H, D), jnp.bfloat16), pool, S((1, W), jnp.int32), cpool,
      S((1, TOPK), jnp.int32), S((H,), jnp.float32), S((1,), jnp.int32), S((1,), jnp.int32), scale=D ** -0.5)
  assert TRITON in lowering.custom_call_targets(exp)
  assert "tensor<1x10x64x512xbf16>" in exp.mlir_module()
  assert exp.out_avals[0].shape == (1, H, D)


def test_fp8_dot_lowers_for_triton():
  """Triton-under-JAX lowers a dot of two e4m3 tiles to `tt.dot` on f8E4M3FN operands (the FP8 tensor-core path an
  FP8-query indexer would use; the kernels do not use it yet, see BUILD_NOTES.md, Kernels)."""
  from jax.experimental import pallas as pl

  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jax.lax.dot_general(a_ref[...], b_ref[...], (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)

  def f(a, b):
    return pl.pallas_call(kernel, out_shape=S((64, 32), jnp.float32), debug=True,
                          compiler_params=sa._pl_triton.CompilerParams(num_warps=4, num_stages=1))(a, b)

  import contextlib
  import io
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    export_for_cuda(f, S((64, 128), jnp.float8_e4m3fn), S((32, 128), jnp.float8_e4m3fn))
  dots = [ln for ln in buf.getvalue().splitlines() if "tt.dot" in ln]
  assert dots and all("xf8E4M3FN>" in ln for ln in dots), dots


@pytest.mark.parametrize("name,B,T,M", [("decode_b64_128k", 64, 1, 131072 // 4), ("prefill_4k", 1, 4096, 16384 // 4)])
def test_indexer_topk_fp8_query_lowers_to_fp8_dots(name, B, T, M, capsys):
  """fp8_query: the fused top-k's score dots take e4m3 on both sides (`tt.dot` on f8E4M3FN); without it they take
  bf16 (the keys converted, unscaled)."""
  HI, C, K = 64, 128, 512
  P = B * M
  pool = it.Fp8IndexKeys(S((P, C), jnp.float8_e4m3fn), S((P,), jnp.float32))
  for fp8_query in (True, False):
    exp = export_for_cuda(
        it.indexer_topk_pallas, S((B, T, HI, C), jnp.bfloat16), S((B, T, HI), jnp.float32), pool, S((B, M), jnp.int32),
        S((B, T), jnp.int32), None, S((B,), jnp.int32), None, k=K,
        tuning=it.IndexerTopkTuning(fp8_query=fp8_query, debug=True))
    assert TRITON in lowering.custom_call_targets(exp)
    dots = [ln for ln in capsys.readouterr().out.splitlines() if "tt.dot" in ln]
    assert len(dots) == 2
    assert all(("xf8E4M3FN> *" in ln) == fp8_query for ln in dots), dots


@pytest.mark.parametrize("table", ["per_query", "slots"])
@pytest.mark.parametrize("pool", ["bf16", "fp8", "fp8_paged"])
@pytest.mark.parametrize("name,N,F", [
    ("decode_b64_1m_table", 64, 8192),   # HCA (ratio 128, one entry per 128-token block): tables at 1M tokens
    ("prefill_4k_128k_table", 4096, 1024),
])
def test_hca_attention_lowers_for_cuda(name, N, F, pool, table):
  """The invariant step's HCA kernel (window, then every visible entry through the row's table, block_k a step):
  an [N, F] table, or the engine's [slots, F] table with each query's row, read in place."""
  from pallas_kernels import hca_attention as hk
  rows = max(N, 64) * F
  if pool == "fp8_paged":
    wp, cp = paged_spec(max(N, 256) * W), paged_spec(rows)
  else:
    wp, cp = pool_spec(max(N, 256) * W, pool == "fp8"), pool_spec(rows, pool == "fp8")
  tab = (S((N, F), jnp.int32),) if table == "per_query" else (S((257, F), jnp.int32),)
  exp = export_for_cuda(
      hk.hca_attention_pallas, S((N, H, D), jnp.bfloat16), wp, S((N, W), jnp.int32), S((N,), jnp.int32), cp,
      *tab, S((N,), jnp.int32), S((H,), jnp.float32), None if table == "per_query" else S((N,), jnp.int32),
      scale=D ** -0.5, entries_per_block=1)
  assert TRITON in lowering.custom_call_targets(exp)
  assert exp.out_avals[0].shape == (N, H, D)


@pytest.mark.parametrize("keys", ["bf16", "fp8"])
@pytest.mark.parametrize("name,B,F,cand", [
    ("decode_b64_1m_table", 64, 8192, False),    # CSA (ratio 4, 32 entries a 128-token block): 1M-token tables
    ("decode_b64_1m_table_v41", 64, 8192, True),
])
def test_indexer_kernels_lower_with_paged_rows(name, B, F, cand, keys):
  """The fused top-k and the score kernel on `PagedRows` (the engine's [slots, F] table and each sequence's row,
  read in place a block of words per step)."""
  HI, C, K, E = 64, 128, 512, 32
  P = 4096 * E
  pool = (it.Fp8IndexKeys(S((P, C), jnp.float8_e4m3fn), S((P,), jnp.float32)) if keys == "fp8"
          else S((P, C), jnp.bfloat16))
  paged = ix.PagedRows(S((257, F), jnp.int32), S((B,), jnp.int32), E)
  exp = export_for_cuda(
      it.indexer_topk_pallas, S((B, 1, HI, C), jnp.bfloat16), S((B, 1, HI), jnp.float32), pool, paged,
      S((B, 1), jnp.int32), None, None, S((B, 1, 64), jnp.int32) if cand else None, k=K)
  assert TRITON in lowering.custom_call_targets(exp)
  assert exp.out_avals[0].shape == (B, 1, K)
  if keys == "bf16" and not cand:
    exp = export_for_cuda(ix.indexer_scores_pallas, S((B, 1, HI, C), jnp.bfloat16), S((B, 1, HI), jnp.float32),
                          pool, paged, S((B, 1), jnp.int32))
    assert TRITON in lowering.custom_call_targets(exp)


@pytest.mark.parametrize("name,N,K,M,k_splits", [("decode_q_a", 1, 4096, 1024, 1),
                                                 ("decode_square_ksplit8", 64, 4096, 4096, 8),
                                                 ("prefill_square", 2048, 4096, 4096, 1),
                                                 ("prefill_o_b", 2048, 8192, 4096, 1)])
def test_row_dot_lowers_for_cuda(name, N, K, M, k_splits):
  """The row-invariant matmul at V4-Flash projection shapes: one Triton call, N padded to the row block inside (with
  the fixed split of K: the same one call, its partials added after it)."""
  from pallas_kernels import row_dot as rd
  exp = export_for_cuda(rd.row_dot_pallas, S((N, K), jnp.bfloat16), S((K, M), jnp.bfloat16), S((), jnp.int32),
                        tuning=rd.RowDotTuning(k_splits=k_splits))
  assert TRITON in lowering.custom_call_targets(exp)
  assert exp.out_avals[0].shape == (N, M)


@pytest.mark.parametrize("name,E,K,M,offset_bits", [
    ("v4_gate_up", 256, 4096, 2048, 32), ("v4_down", 256, 2048, 4096, 32),     # 2^31 elements: 32-bit offsets
    ("v41_gate_up", 384, 5120, 2304, 64), ("v41_down", 384, 2304, 5120, 64)])   # 4.5e9 elements: 64-bit offsets
def test_grouped_dot_lowers_for_cuda(name, E, K, M, offset_bits, capsys):
  """The grouped expert matmul over V4-Flash's 256 experts and V4.1-Flash's 384, 640 blocks of 32 rows (2048 tokens
  x top-6), and how the Triton module addresses the weights: JAX's lowering switches to 64-bit element offsets for
  an array over 2^32 bytes, so V4.1-Flash's 9 GB of bf16 experts are reached past element 2^31, and V4-Flash's
  (exactly 2^31 elements, last offset 2^31 - 1) keep 32-bit ones."""
  from pallas_kernels import grouped_dot as gd
  exp = export_for_cuda(gd.grouped_dot_pallas, S((640, 32, K), jnp.bfloat16), S((640,), jnp.int32),
                        S((), jnp.int32), S((E, K, M), jnp.bfloat16), tuning=gd.GroupedDotTuning(debug=True))
  assert TRITON in lowering.custom_call_targets(exp)
  assert exp.out_avals[0].shape == (640, 32, M)
  # the weight tile's pointers: [block_k, block_cols] bf16 pointers advanced by the offsets of the tile's elements
  t = gd.GroupedDotTuning()
  tile = f"tensor<{t.block_k}x{t.block_cols}x!tt.ptr<bf16>>"
  w_ptrs = [ln for ln in capsys.readouterr().out.splitlines() if "tt.addptr" in ln and tile in ln]
  assert w_ptrs, "no weight-tile pointers in the Triton module"
  assert all(f"tensor<{t.block_k}x{t.block_cols}xi{offset_bits}>" in ln for ln in w_ptrs), w_ptrs
