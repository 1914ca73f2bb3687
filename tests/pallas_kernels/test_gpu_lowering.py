"""The real GPU lowering (jax.export(..., platforms=("cuda",))) of every kernel at V4-Flash shapes, on CPU.

Only lowers (Pallas -> Triton IR inside an XLA custom call); nothing executes, so these shapes cost no memory.
A kernel that cannot be lowered for a GPU fails here."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import indexer as ix
from pallas_kernels import lowering
from pallas_kernels import sparse_attention as sa

S = jax.ShapeDtypeStruct
H, D, W, TOPK, ROPE = 64, 512, 128, 512, 64  # V4-Flash: 64 heads, d 512 (64 RoPE), window 128, top-k 512
TRITON = "__gpu$xla.gpu.triton"


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
  exp = lowering.export_for_cuda(
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
  exp = lowering.export_for_cuda(
      ix.indexer_scores_pallas, S((B, T, HI, C), jnp.bfloat16), S((B, T, HI), jnp.float32), S((B * M, C), jnp.bfloat16),
      S((B, M), jnp.int32), S((B, T), jnp.int32), S((B, T, M), jnp.bool_) if allowed else None)
  assert TRITON in lowering.custom_call_targets(exp)
  assert exp.out_avals[0].shape == (B, T, M)


def test_lowering_check_has_teeth():
  """A non-power-of-two head dim (V3.2's 576) cannot lower on Triton: the export check must fail."""
  with pytest.raises(Exception, match="power of 2"):
    lowering.export_for_cuda(
        sa.sparse_attention_pallas, S((4, H, 576), jnp.bfloat16), S((1024, 576), jnp.bfloat16), S((4, W), jnp.int32),
        S((1024, 576), jnp.bfloat16), S((4, TOPK), jnp.int32), S((H,), jnp.float32), scale=576 ** -0.5)
