"""Sparse MLA kernel (interpret mode) vs the XLA reference on fresh random inputs."""


import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import sparse_attention as sa

# derandomize comes from the suite's hypothesis profile (tests/conftest.py): fixed examples in CI, fresh ones with
# DSV4_HYPOTHESIS=fresh; only the slowness checks are off (interpret-mode kernels are slow by nature)
SETTINGS = dict(max_examples=4, deadline=None,
                suppress_health_check=[hypothesis.HealthCheck.too_slow, hypothesis.HealthCheck.data_too_large])


def assert_close(got, want, atol, rtol, what=""):
  got = np.asarray(jnp.asarray(got, jnp.float32))
  want = np.asarray(jnp.asarray(want, jnp.float32))
  assert got.shape == want.shape, (got.shape, want.shape)
  assert not np.isnan(got).any(), f"{what}: NaN leaked into the kernel output"
  inf_w, inf_g = np.isinf(want), np.isinf(got)
  np.testing.assert_array_equal(inf_g, inf_w, err_msg=f"{what}: inf pattern differs")
  np.testing.assert_array_equal(got[inf_w], want[inf_w], err_msg=f"{what}: inf sign differs")
  g, w = got[~inf_w], want[~inf_w]
  bad = np.abs(g - w) > atol + rtol * np.abs(w)
  assert not bad.any(), f"{what}: {bad.sum()} / {bad.size} beyond tol; max abs err {np.abs(g - w).max()}"


def make_case(seed, N, H, D, P, Q, W, K, dtype, *, sink_kind="normal"):
  """Ragged -1 padding, ids >= pool size, one all-invalid row, one row with only out-of-range ids."""
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((N, H, D)).astype(np.float32)
  q /= np.linalg.norm(q, axis=-1, keepdims=True) / np.sqrt(D) * 0.3  # bounded logits, still peaky
  wp = rng.standard_normal((P, D)).astype(np.float32)
  cp = rng.standard_normal((Q, D)).astype(np.float32)
  wi = rng.integers(0, P, (N, W))
  ci = rng.integers(0, Q, (N, K)) if K else np.zeros((N, 0), np.int64)
  for n in range(N):  # ragged: a random-length valid prefix, -1 after it
    wi[n, rng.integers(0, W + 1):] = -1
    if K:
      ci[n, rng.integers(0, K + 1):] = -1
  wi[rng.random((N, W)) < 0.1] = P + rng.integers(0, 5)  # out of range: must be masked like -1
  if K:
    ci[rng.random((N, K)) < 0.1] = Q + 7
  wi[0], ci[0] = -1, -1  # all-invalid row
  if N > 2:
    wi[2], ci[2] = P, Q + 100  # only out-of-range ids
  sink = rng.standard_normal(H).astype(np.float32)
  if sink_kind == "large":
    sink[::3] = 300.0  # far above every logit: out -> ~0, lse unchanged
    sink[1::5] = -300.0
  elif sink_kind == "inf":
    sink[::2] = np.inf
    sink[1::4] = -np.inf
  j = lambda x, dt: jnp.asarray(x, dt)
  return (j(q, dtype), j(wp, dtype), j(wi, jnp.int32), j(cp, dtype), j(ci, jnp.int32), j(sink, jnp.float32))


TOL = {jnp.float32: (3e-5, 3e-5), jnp.bfloat16: (1.5e-2, 2e-2)}


def check(args, D, tuning, dtype, lse_tol=3e-4):
  ro, rl = sa.sparse_attention_reference(*args, scale=D ** -0.5)
  ko, kl = sa.sparse_attention_pallas(*args, scale=D ** -0.5, interpret=True, tuning=tuning)
  assert ko.dtype == ro.dtype and kl.dtype == jnp.float32
  atol, rtol = TOL[dtype]
  assert_close(ko, ro, atol, rtol, "out")
  assert_close(kl, rl, lse_tol, lse_tol, "lse")
  # All-invalid rows: out = 0, lse = -inf (rows 0 and 2 by construction).
  for n in (0, 2):
    if n < args[0].shape[0]:
      assert np.all(np.asarray(kl[n]) == -np.inf)
      assert np.all(np.asarray(ko[n], np.float32) == 0.0)
  return ko, kl


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@hypothesis.settings(**SETTINGS)
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_window_plus_topk(seed, splits, dtype):
  N, H, D, P, Q, W, K = 6, 16, 64, 40, 90, 12, 20  # W, K not multiples of block_k: ragged tails
  args = make_case(seed, N, H, D, P, Q, W, K, dtype)
  check(args, D, sa.SparseAttentionTuning(block_h=16, block_k=8, num_splits=splits), dtype)


@pytest.mark.parametrize("sink_kind", ["large", "inf"])
@hypothesis.settings(**SETTINGS)
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_large_and_infinite_sinks(seed, sink_kind):
  N, H, D, P, Q, W, K = 5, 16, 64, 30, 50, 8, 16
  args = make_case(seed, N, H, D, P, Q, W, K, jnp.float32, sink_kind=sink_kind)
  for splits in (1, 2):
    check(args, D, sa.SparseAttentionTuning(block_h=16, block_k=8, num_splits=splits), jnp.float32)


def test_window_only_and_few_heads():
  # No compressed pool (SWA-only layer) and H = 4 (< 16: padded to one head block of 16).
  args = make_case(1, 4, 4, 32, 20, 1, 8, 0, jnp.float32)
  q, wp, wi, _, _, sink = args
  ro, rl = sa.sparse_attention_reference(q, wp, wi, None, None, sink, scale=0.2)
  ko, kl = sa.sparse_attention_pallas(q, wp, wi, None, None, sink, scale=0.2, interpret=True,
                                      tuning=sa.SparseAttentionTuning(block_k=8))
  assert_close(ko, ro, 3e-5, 3e-5, "out")
  assert_close(kl, rl, 3e-4, 3e-4, "lse")


def test_hca_all_visible_entries():
  """HCA: the same kernel over every visible compressed entry (per-query visibility as -1 tail)."""
  rng = np.random.default_rng(7)
  N, H, D, P, Q, W = 6, 16, 64, 40, 33, 8
  args = list(make_case(3, N, H, D, P, Q, W, 0, jnp.float32))
  visible = rng.integers(0, Q + 1, N)
  visible[[0, 2]] = 0  # keep rows 0 and 2 all-invalid
  ci = np.where(np.arange(Q)[None, :] < visible[:, None], np.arange(Q)[None, :], -1)
  args[3] = jnp.asarray(rng.standard_normal((Q, D)), jnp.float32)
  args[4] = jnp.asarray(ci, jnp.int32)
  check(tuple(args), D, sa.SparseAttentionTuning(block_h=16, block_k=16, num_splits=2), jnp.float32)


@pytest.mark.parametrize("splits", [1, 2])
@hypothesis.settings(**SETTINGS)
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_fp8_pools_match_dequant_then_reference(seed, splits):
  N, H, D, P, Q, W, K = 5, 16, 128, 30, 60, 8, 24
  q, wp, wi, cp, ci, sink = make_case(seed, N, H, D, P, Q, W, K, jnp.bfloat16)
  wq, cq = sa.quantize_kv_fp8(wp, rope_dim=64), sa.quantize_kv_fp8(cp, rope_dim=64)
  assert wq.nope.dtype == jnp.float8_e4m3fn and wq.scale.shape == (P, 1)
  wd, cd = sa.dequantize_kv_fp8(wq, jnp.bfloat16), sa.dequantize_kv_fp8(cq, jnp.bfloat16)
  want_o, want_l = sa.sparse_attention_reference(q, wd, wi, cd, ci, sink, scale=D ** -0.5)
  tuning = sa.SparseAttentionTuning(block_h=16, block_k=8, num_splits=splits)
  got_o, got_l = sa.sparse_attention_pallas(q, wq, wi, cq, ci, sink, scale=D ** -0.5, interpret=True, tuning=tuning)
  assert_close(got_o, want_o, *TOL[jnp.bfloat16], "out")
  assert_close(got_l, want_l, 3e-4, 3e-4, "lse")
  # The reference also accepts FP8 pools directly, and a mixed (bf16 window, fp8 compressed) call works.
  ref_o, _ = sa.sparse_attention_reference(q, wq, wi, cq, ci, sink, scale=D ** -0.5)
  assert_close(ref_o, want_o, *TOL[jnp.bfloat16], "ref fp8")
  mo, ml = sa.sparse_attention_pallas(q, wd, wi, cq, ci, sink, scale=D ** -0.5, interpret=True, tuning=tuning)
  assert_close(mo, want_o, *TOL[jnp.bfloat16], "mixed out")


def test_fp8_quantize_record():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((16, 512)) * np.exp(rng.uniform(-6, 6, (16, 1))), jnp.bfloat16)
  x = x.at[3, :64].set(0.0)  # an all-zero block
  p = sa.quantize_kv_fp8(x, rope_dim=64)
  assert p.nope.shape == (16, 448) and p.rope.shape == (16, 64) and p.scale.shape == (16, 8)
  assert p.bytes_per_row == 584  # V4 record: 448 e4m3 + 7 UE8M0 + 1 pad + 64 bf16
  np.testing.assert_array_equal(np.asarray(p.rope), np.asarray(x[:, 448:]))
  np.testing.assert_array_equal(np.asarray(p.scale[:, 7]), 0)  # pad byte
  d = np.asarray(sa.dequantize_kv_fp8(p), np.float32)
  xf = np.asarray(x, np.float32)
  blk = np.abs(xf[:, :448]).reshape(16, 7, 64).max(-1, keepdims=True)
  err = np.abs(d[:, :448] - xf[:, :448]).reshape(16, 7, 64)
  assert np.all(err <= blk * 2 ** -3 + 1e-30)  # e4m3: 3 mantissa bits; power-of-two scale keeps amax <= 448
  assert np.all(d[3, :64] == 0)
  sc = np.exp2(np.asarray(p.scale[:, :7], np.float32) - 127)
  assert np.all(blk[..., 0] / sc <= 448)


def test_unwritten_outputs_are_poisoned():
  """Meta-test: in interpret mode an output region a kernel does not write comes back NaN, so the no-NaN checks
  above really catch a kernel that skips part of its output."""
  def k(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = x_ref[...]
  out = pl.pallas_call(k, grid=(2,), in_specs=[pl.BlockSpec((8,), lambda i: (i,))],
                       out_specs=pl.BlockSpec((8,), lambda i: (i,)),
                       out_shape=jax.ShapeDtypeStruct((16,), jnp.float32), interpret=True)(jnp.ones(16))
  assert np.all(np.asarray(out[:8]) == 1) and np.all(np.isnan(np.asarray(out[8:])))


def test_tuning_validation():
  with pytest.raises(ValueError):
    sa.SparseAttentionTuning(block_k=24)
  with pytest.raises(ValueError):
    sa.SparseAttentionTuning(block_h=0)
  with pytest.raises(ValueError):
    sa.SparseAttentionTuning(num_splits=sa.MAX_SPLITS + 1)
  sa.SparseAttentionTuning(num_splits=sa.MAX_SPLITS)


def test_auto_splits_fill_whole_waves():
  """The split rule: the fewest splits whose programs fill their last wave of 132 SMs to >= 90%, else the best
  filled; capped by the byte rule and two key blocks a split."""
  assert sa.MAX_SPLITS == 32
  assert sa.auto_num_splits(128, 40, 32, 132) == 1  # 128 / 132: already 97%
  assert sa.auto_num_splits(64, 40, 32, 132) == 2  # 128 programs
  assert sa.auto_num_splits(96, 40, 32, 132) == 4  # 1, 2 or 3 splits leave the last wave 73% busy; 4: 384 / 396
  assert sa.auto_num_splits(16, 40, 32, 132) == 8
  assert sa.auto_num_splits(1, 40, 10, 132) == 10  # batch 1 cannot fill the GPU: the cap decides
  assert sa.auto_num_splits(1, 40, 32, 132) == 20  # and at most one split per two key blocks
  assert sa.auto_num_splits(1, 1, 32, 132) == 1  # a single key block cannot split
  assert sa.auto_num_splits(1, 7, 32, 264) == 3
  # Window 128 + top-512 at block_k 16 (40 blocks); the byte cap at batch 1: 640 rows x 1 KB / 64 KB partials = 10.
  assert [sa.chosen_num_splits(b, 64, [128, 512]) for b in (1, 8, 16, 32, 64, 96, 128, 256)] == [10, 10, 8, 4, 2, 4, 1, 1]
  # FP8 pools: two head blocks of 32 per token (FP8_TUNING), 584-byte rows.
  fp8 = [sa.chosen_num_splits(b, 64, [128, 512], sa.FP8_TUNING, row_bytes=584) for b in (1, 16, 64, 128)]
  assert fp8 == [10, 4, 1, 1]
  # chosen_num_splits drops splits that would get no block: 40 blocks in 14 splits are 14 splits of 3 (no empty).
  assert sa.chosen_num_splits(8, 64, [128, 2048]) == 14
  assert sa.chosen_num_splits(3, 64, [128, 512], sa.SparseAttentionTuning(num_splits=16)) == 14  # 40 / 3-block splits


def test_default_tuning_by_pool_format():
  bf16 = jnp.zeros((8, 64), jnp.bfloat16)
  fp8 = sa.quantize_kv_fp8(jnp.zeros((8, 128), jnp.float32), 64)
  assert sa.default_tuning([bf16, None]) == sa.BF16_TUNING
  assert sa.default_tuning([bf16, fp8]) == sa.FP8_TUNING
  assert (sa.BF16_TUNING.block_h, sa.BF16_TUNING.block_k, sa.FP8_TUNING.block_h) == (64, 16, 32)


@pytest.mark.parametrize("id_row", ["registers", "per_step"])
@pytest.mark.parametrize("splits", [1, 4, 16])
def test_lengths_at_block_boundaries_with_many_splits(splits, id_row):
  """Per-row valid lengths at 0, 1, block_k - 1, block_k, block_k + 1, the full width and past it, on both pools,
  with up to 16 key splits (most of them empty for the short rows) and both id-row paths (loaded once per program
  and picked from registers, or read one block per step). Ids past a row's length hold valid-looking rows: a
  kernel that read them would differ from the reference."""
  N, H, D, P, Q, W, K, bk = 8, 16, 64, 40, 90, 20, 40, 8
  q, wp, wi, cp, ci, sink = make_case(17, N, H, D, P, Q, W, K, jnp.float32)
  rng = np.random.default_rng(17)
  wi = jnp.asarray(rng.integers(0, P, (N, W)), jnp.int32)  # every id valid: only the lengths cut rows short
  ci = jnp.asarray(rng.integers(0, Q, (N, K)), jnp.int32)
  wl = jnp.asarray([0, 1, bk - 1, bk, bk + 1, W, W + 5, 3], jnp.int32)
  cl = jnp.asarray([0, bk + 1, K, 1, bk, bk - 1, 0, K + 9], jnp.int32)
  tun = sa.SparseAttentionTuning(block_h=16, block_k=bk, num_splits=splits,
                                 id_row_max=2048 if id_row == "registers" else 0)
  ko, kl = sa.sparse_attention_pallas(q, wp, wi, cp, ci, sink, wl, cl, scale=D ** -0.5, interpret=True, tuning=tun)
  ro, rl = sa.sparse_attention_reference(q, wp, wi, cp, ci, sink, scale=D ** -0.5, window_len_N=wl, comp_len_N=cl)
  assert_close(ko, ro, *TOL[jnp.float32], "out")
  assert_close(kl, rl, 3e-4, 3e-4, "lse")
  assert np.all(np.asarray(kl[0]) == -np.inf) and np.all(np.asarray(ko[0]) == 0.0)  # both lengths 0
  full, _ = sa.sparse_attention_reference(q, wp, wi, cp, ci, sink, scale=D ** -0.5)
  assert np.abs(np.asarray(full[1]) - np.asarray(ro[1])).max() > 1e-2  # the lengths change the answer


@pytest.mark.parametrize("live", [0, 5, 12])
def test_live_bound_keeps_the_live_queries_bits(live):
  """With `live`, the programs of queries at or past it return without writing (the engine's dead tokens); the
  queries below it give the same bits as with every query live, with one key split and with several. (Both calls
  are one compiled program: in interpret mode XLA compiles the kernel's maths, and a different program may round a
  transcendental differently.)"""
  args = make_case(3, 12, 8, 64, 96, 160, 40, 24, jnp.bfloat16)
  for splits in (1, 3):
    tuning = sa.SparseAttentionTuning(num_splits=splits)
    full_o, full_l = sa.sparse_attention_pallas(*args, scale=64 ** -0.5, live=jnp.int32(12), interpret=True,
                                                tuning=tuning)
    o, l = sa.sparse_attention_pallas(*args, scale=64 ** -0.5, live=jnp.int32(live), interpret=True, tuning=tuning)
    np.testing.assert_array_equal(np.asarray(o)[:live].view(np.uint16), np.asarray(full_o)[:live].view(np.uint16))
    np.testing.assert_array_equal(np.asarray(l)[:live], np.asarray(full_l)[:live])
