"""Dispatcher: the interpret-mode kernels, called through dispatch, agree with the plain-JAX references (called
directly, never through dispatch's own XLA path); kernels are registered; auto picks XLA on CPU and validates on a
GPU (simulated with the interpret kernels, run by the validation's child process)."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels import indexer as ix
from pallas_kernels import sparse_attention as sa
from tests.pallas_kernels import validation_kernels as vk


@pytest.fixture(autouse=True)
def _fresh_verdicts():
  """Each test starts and ends with no cached validation verdicts."""
  dispatch.clear_validations()
  yield
  dispatch.clear_validations()


def test_kernels_registered_and_auto_is_xla_on_cpu():
  assert {"sparse_attention", "indexer_scores"} <= set(dispatch._KERNELS)
  assert jax.default_backend() == "cpu"
  assert dispatch._resolve(dispatch.KernelConfig(), "sparse_attention") is None  # XLA reference
  assert dispatch._resolve(dispatch.KernelConfig("interpret"), "sparse_attention") == {"interpret": True}
  assert dispatch._resolve(dispatch.KernelConfig("pallas"), "indexer_scores") == {"interpret": False}


@pytest.mark.parametrize("fp8", [False, True])
def test_sparse_attention_backends_agree(fp8):
  rng = np.random.default_rng(0)
  N, H, D, P, Q = 3, 8, 128, 20, 30
  q = jnp.asarray(rng.standard_normal((N, H, D)) * 0.1, jnp.bfloat16)
  wp = jnp.asarray(rng.standard_normal((P, D)), jnp.bfloat16)
  cp = jnp.asarray(rng.standard_normal((Q, D)), jnp.bfloat16)
  if fp8:
    cp = dispatch.quantize_kv_fp8(cp)
  wi = jnp.asarray(rng.integers(-1, P, (N, 6)), jnp.int32)
  ci = jnp.asarray(rng.integers(-1, Q + 2, (N, 10)), jnp.int32)
  sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
  # the Pallas kernel (interpret mode) through dispatch vs the plain reference
  kernel = dispatch.KernelConfig("interpret", sparse_tuning=sa.SparseAttentionTuning(block_k=8, num_splits=2))
  got = dispatch.sparse_attention(q, wp, wi, cp, ci, sink, scale=D ** -0.5, cfg=kernel)
  want = sa.sparse_attention_reference(q, wp, wi, cp, ci, sink, scale=D ** -0.5)
  np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), atol=1.5e-2, rtol=2e-2)
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=3e-4, rtol=3e-4)


def test_indexer_backends_agree_and_topk():
  rng = np.random.default_rng(1)
  B, T, H, C, P, M = 2, 3, 4, 16, 50, 20
  q = jnp.asarray(rng.standard_normal((B, T, H, C)), jnp.float32)
  w = jnp.asarray(rng.random((B, T, H)) + 0.1, jnp.float32)
  kp = jnp.asarray(rng.standard_normal((P, C)), jnp.float32)
  rows = jnp.asarray(rng.integers(-1, P, (B, M)), jnp.int32)
  nv = jnp.asarray(rng.integers(0, M + 1, (B, T)), jnp.int32)
  allowed = ix.candidate_blocks_to_allowed(jnp.asarray(rng.integers(-1, 3, (B, T, 2)), jnp.int32), M, 8)
  a = ix.indexer_scores_reference(q, w, kp, rows, nv, allowed)
  b = dispatch.indexer_scores(q, w, kp, rows, nv, allowed,
                              cfg=dispatch.KernelConfig("interpret", indexer_tuning=ix.IndexerTuning(block_m=8)))
  np.testing.assert_array_equal(np.isinf(np.asarray(a)), np.isinf(np.asarray(b)))
  f = np.isfinite(np.asarray(a))
  np.testing.assert_allclose(np.asarray(b)[f], np.asarray(a)[f], rtol=2e-5, atol=2e-5)
  ids, vals = dispatch.topk_from_scores(b, 5)
  assert ids.shape == (B, T, 5)
  assert np.all((np.asarray(ids) == -1) == ~np.isfinite(np.asarray(vals)))


def test_jit_through_dispatch():
  rng = np.random.default_rng(2)
  q = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.float32)
  pool = jnp.asarray(rng.standard_normal((10, 64)), jnp.float32)
  idx = jnp.asarray([[0, 1, -1, 3], [4, -1, -1, 12]], jnp.int32)
  sink = jnp.zeros(16, jnp.float32)
  f = jax.jit(lambda *a: dispatch.sparse_attention(*a, scale=0.125, cfg=dispatch.KernelConfig("interpret")))
  o, l = f(q, pool, idx, None, None, sink)
  ro, rl = sa.sparse_attention_reference(q, pool, idx, None, None, sink, scale=0.125)
  np.testing.assert_allclose(np.asarray(o), np.asarray(ro), atol=3e-5, rtol=3e-5)
  np.testing.assert_allclose(np.asarray(l), np.asarray(rl), atol=3e-5, rtol=3e-5)


def test_sparse_attention_per_query_lengths():
  """Ids past window_len_N / comp_len_N are ignored even when they are valid rows (here rows full of NaN): the
  kernel through dispatch gives the reference's answer for the same ids cut to -1 by hand."""
  rng = np.random.default_rng(3)
  N, H, D, P, Q, W, K = 4, 16, 64, 24, 40, 8, 16
  q = jnp.asarray(rng.standard_normal((N, H, D)) * 0.2, jnp.float32)
  wp = rng.standard_normal((P, D)).astype(np.float32)
  cp = rng.standard_normal((Q, D)).astype(np.float32)
  wp[P - 1] = np.nan  # only ever referenced past the valid length
  cp[Q - 1] = np.inf
  wi = rng.integers(0, P - 1, (N, W))
  ci = rng.integers(0, Q - 1, (N, K))
  wl = np.array([0, 3, W, 5], np.int32)
  cl = np.array([K, 0, 7, 1], np.int32)
  for n in range(N):
    wi[n, wl[n]:] = P - 1
    ci[n, cl[n]:] = Q - 1
  cut_w = np.where(np.arange(W)[None] < wl[:, None], wi, -1)
  cut_c = np.where(np.arange(K)[None] < cl[:, None], ci, -1)
  sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
  cfg = dispatch.KernelConfig("interpret", sparse_tuning=sa.SparseAttentionTuning(block_k=4, num_splits=2))
  o, l = dispatch.sparse_attention(q, jnp.asarray(wp), jnp.asarray(wi, jnp.int32), jnp.asarray(cp),
                                   jnp.asarray(ci, jnp.int32), sink, scale=D ** -0.5, cfg=cfg,
                                   window_len_N=jnp.asarray(wl), comp_len_N=jnp.asarray(cl))
  ro, rl = sa.sparse_attention_reference(q, jnp.asarray(np.nan_to_num(wp)), jnp.asarray(cut_w, jnp.int32),
                                         jnp.asarray(np.nan_to_num(cp)), jnp.asarray(cut_c, jnp.int32), sink,
                                         scale=D ** -0.5)
  assert not np.isnan(np.asarray(o)).any()
  np.testing.assert_allclose(np.asarray(o), np.asarray(ro), atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(l), np.asarray(rl), atol=2e-5, rtol=2e-5)
  with pytest.raises(ValueError, match="window_len_N"):
    dispatch.sparse_attention(q, jnp.asarray(wp), jnp.asarray(wi, jnp.int32), None, None, sink, scale=1.0,
                              cfg=cfg, window_len_N=jnp.zeros((N + 1,), jnp.int32))


def test_indexer_num_keys():
  """num_keys_B cuts each sequence's entries: the kernels through dispatch match the reference with the visible
  counts cut by hand."""
  rng = np.random.default_rng(4)
  B, T, H, C, P, M = 2, 3, 4, 16, 50, 24
  q = jnp.asarray(rng.standard_normal((B, T, H, C)), jnp.float32)
  w = jnp.asarray(rng.random((B, T, H)) + 0.1, jnp.float32)
  kp = jnp.asarray(rng.standard_normal((P, C)), jnp.float32)
  rows = jnp.asarray(rng.integers(0, P, (B, M)), jnp.int32)
  nv = jnp.asarray(rng.integers(0, M + 1, (B, T)), jnp.int32)
  nk = jnp.asarray([5, 17], jnp.int32)
  cfg = dispatch.KernelConfig("interpret", indexer_tuning=ix.IndexerTuning(block_m=8))
  got = np.asarray(dispatch.indexer_scores(q, w, kp, rows, nv, cfg=cfg, num_keys_B=nk))
  want = np.asarray(ix.indexer_scores_reference(q, w, kp, rows, jnp.minimum(nv, nk[:, None])))
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  f = np.isfinite(want)
  np.testing.assert_allclose(got[f], want[f], rtol=2e-5, atol=2e-5)
  assert np.all(np.isinf(got[0, :, 5:])) and np.all(np.isinf(got[1, :, 17:]))
  ids = np.asarray(dispatch.indexer_topk(q, w, kp, rows, nv, 6, cfg=cfg, num_keys_B=nk))
  assert ids.shape == (B, T, 6) and ids[0].max() < 5 and ids[1].max() < 17


def _interpret_as_pallas(monkeypatch, broken=None):
  """A CPU stand-in for a GPU: `auto` sees a GPU, and each op's kernel is its interpret-mode twin in
  validation_kernels (importable by name, so the validation child runs it too). `broken`: op -> the name of a
  kernel there replacing it (wrong, raising, hanging, crashing). Returns the per-op call counts of this process."""
  monkeypatch.setattr(dispatch, "_on_gpu", lambda: True)
  dispatch.clear_validations()
  vk.CALLS.clear()
  names = {"sparse_attention": "sparse", "indexer_scores": "scores", "indexer_topk": "topk", **(broken or {})}
  for op, name in names.items():
    monkeypatch.setitem(dispatch._KERNELS, op, getattr(vk, name))
  return vk.CALLS


def _sparse_case(fp8=False, N=3, D=128):
  rng = np.random.default_rng(5)
  H, P, Q = 16, 24, 40
  cp = jnp.asarray(rng.standard_normal((Q, D)), jnp.bfloat16)
  return (jnp.asarray(rng.standard_normal((N, H, D)), jnp.bfloat16), jnp.asarray(rng.standard_normal((P, D)),
                                                                                  jnp.bfloat16),
          jnp.asarray(rng.integers(-1, P, (N, 8)), jnp.int32), dispatch.quantize_kv_fp8(cp) if fp8 else cp,
          jnp.asarray(rng.integers(-1, Q, (N, 16)), jnp.int32), jnp.asarray(rng.standard_normal(H), jnp.float32))


@pytest.mark.parametrize("fp8", [False, True])
def test_auto_validates_each_kernel_once_at_its_shapes(monkeypatch, recwarn, fp8):
  """'auto' on a GPU: the first dispatch of a kernel configuration validates it in a child process on a small case
  with the same tiling (inside a jit trace: only shapes are read), then the kernel serves the call; the verdict is
  cached per configuration: a new batch size or pool size is not validated again, a new head dim is."""
  calls = _interpret_as_pallas(monkeypatch)
  args = _sparse_case(fp8)
  lens = jnp.asarray([8, 3, 0], jnp.int32), jnp.asarray([16, 0, 5], jnp.int32)
  f = jax.jit(lambda *a: dispatch.sparse_attention(*a[:6], scale=128 ** -0.5, window_len_N=a[6], comp_len_N=a[7]))
  got = f(*args, *lens)
  assert calls["sparse_attention"] == 1  # the traced call here; the validation ran in the child
  assert list(dispatch.validation_verdicts().values()) == [True]
  want = sa.sparse_attention_reference(*args, scale=128 ** -0.5, window_len_N=lens[0], comp_len_N=lens[1])
  np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), atol=2e-2, rtol=2e-2)
  bigger = _sparse_case(fp8, N=5)  # another batch: the same configuration, no new validation
  g = jax.jit(lambda *a: dispatch.sparse_attention(*a[:6], scale=128 ** -0.5, window_len_N=a[6], comp_len_N=a[7]))
  g(*bigger, jnp.full((5,), 8, jnp.int32), jnp.full((5,), 16, jnp.int32))
  assert calls["sparse_attention"] == 2 and len(dispatch.validation_verdicts()) == 1
  if not fp8:  # (the slow-tier variant: one more child run)
    dispatch.sparse_attention(*_sparse_case(False, D=64), scale=0.1)  # another head dim, no lengths: validated
    assert calls["sparse_attention"] == 3 and len(dispatch.validation_verdicts()) == 2
  assert all(dispatch.validation_verdicts().values())
  assert not [w for w in recwarn if "dispatch" in str(w.message)]


def test_auto_validates_the_fused_topk_with_fp8_keys_and_candidates(monkeypatch, recwarn):
  calls = _interpret_as_pallas(monkeypatch)
  rng = np.random.default_rng(6)
  B, T, H, C, P, M = 2, 3, 4, 32, 60, 40
  q = jnp.asarray(rng.standard_normal((B, T, H, C)), jnp.float32)
  w = jnp.asarray(rng.random((B, T, H)) + 0.1, jnp.float32)
  keys = dispatch._indexer_topk.quantize_index_keys(jnp.asarray(rng.standard_normal((P, C)), jnp.float32))
  rows = jnp.asarray(rng.integers(-1, P, (B, M)), jnp.int32)
  nv = jnp.asarray(rng.integers(0, M + 1, (B, T)), jnp.int32)
  cand = jnp.asarray(rng.integers(-1, 5, (B, T, 2)), jnp.int32)
  got = dispatch.indexer_topk(q, w, keys, rows, nv, 6, candidate_blocks_BxTxC=cand)
  assert calls["indexer_topk"] == 1 and list(dispatch.validation_verdicts().values()) == [True]
  args = dispatch.IndexerArgs(q, w, keys, rows, nv, candidate_blocks_BxTxC=cand)
  scores = dispatch._topk_check_scores(args, dict(k=6, block_size=8))
  assert dispatch._topk_err(np.asarray(got), np.asarray(scores), None, dict(k=6)) <= 1.0
  assert not [w for w in recwarn if "dispatch" in str(w.message)]


@pytest.mark.parametrize("op,broken,why,timeout_s", [
    ("sparse_attention", "wrong_sparse", "max error / tolerance", None),
    ("sparse_attention", "nondeterministic_sparse", "nondeterministic: two runs on the same inputs differ", None),
    ("indexer_topk", "raising_topk", "RuntimeError: lowering failed", None),
    ("sparse_attention", "hanging_sparse", "timed out after 5 s", 5),
    ("sparse_attention", "crashing_sparse", "child exited with status", None),
])
def test_auto_falls_back_to_xla_once_with_one_warning(monkeypatch, op, broken, why, timeout_s):
  """A kernel that gives a wrong answer (sparse MLA scaled by 1.5), another answer each run (within tolerance), cannot run (the top-k raises), hangs (killed at
  the timeout) or kills its process (a GPU fault's stand-in) fails its validation in the child: the caller survives,
  that call site gets the plain reference's answer, bit for bit, and one one-line warning however often it is
  dispatched; the kernel never runs in this process."""
  calls = _interpret_as_pallas(monkeypatch, broken={op: broken})
  cfg = dispatch.KernelConfig() if timeout_s is None else dispatch.KernelConfig(validation_timeout_s=timeout_s)
  if op == "sparse_attention":
    args = _sparse_case()
    run = lambda cfg: dispatch.sparse_attention(*args, scale=0.1, cfg=cfg)
    reference = lambda: sa.sparse_attention_reference(*args, scale=0.1)
  else:
    rng = np.random.default_rng(7)
    args = (jnp.asarray(rng.standard_normal((2, 3, 4, 16)), jnp.float32), jnp.ones((2, 3, 4), jnp.float32),
            jnp.asarray(rng.standard_normal((30, 16)), jnp.float32), jnp.asarray(rng.integers(-1, 30, (2, 20)),
                                                                                 jnp.int32),
            jnp.asarray(rng.integers(0, 21, (2, 3)), jnp.int32))
    run = lambda cfg: dispatch.indexer_topk(*args, 5, cfg=cfg)
    reference = lambda: dispatch._indexer_topk.indexer_topk_reference(*args, 5)
  t0 = time.perf_counter()
  with pytest.warns(RuntimeWarning, match=f"the '{op}' Pallas kernel .* failed validation") as rec:
    first = jax.jit(lambda: run(cfg))()
    again = run(cfg)
  if broken == "hanging_sparse":
    assert time.perf_counter() - t0 < 30  # killed at the timeout, not waited out
  msgs = [str(w.message) for w in rec if "dispatch" in str(w.message)]
  assert len(msgs) == 1 and why in msgs[0] and "\n" not in msgs[0], msgs
  assert calls.get(op, 0) == 0
  assert list(dispatch.validation_verdicts().values()) == [False]
  # the plain reference, called directly: jitted and eager, each like for like
  for g, want in ((first, jax.jit(reference)()), (again, reference())):
    for x, y in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(want)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_small_case_keeps_the_compiled_tiling():
  """The validation case of a V4-Flash decode: 2 queries and 64 pool rows, but the same heads, head dim, tuning,
  id-row paths (window in registers; a top-2048 row read a block per step) and split mode; batch sizes that compile
  the same code share one key, a batch that turns splitting off does not."""
  S = jax.ShapeDtypeStruct

  def args(N, K):
    return dispatch.SparseArgs(S((N, 64, 512), jnp.bfloat16), S((32768, 512), jnp.bfloat16), S((N, 128), jnp.int32),
                               S((2 ** 21, 512), jnp.bfloat16), S((N, K), jnp.int32), S((64,), jnp.float32),
                               S((N,), jnp.int32), S((N,), jnp.int32))

  small = dispatch._sparse_small(args(64, 2048), {"scale": 0.1}, None)
  shapes = [tuple(x.shape) for x in jax.tree_util.tree_leaves(small.args)]
  assert shapes == [(2, 64, 512), (64, 512), (2, 32), (64, 512), (2, 64), (64,), (2,), (2,)]
  assert small.tuning == dataclasses.replace(sa.BF16_TUNING, id_row_max=32, num_splits=2)
  assert small.tiling == (64, 512, (True, False), True, False)
  cfg, st = dispatch.KernelConfig(), {"scale": 0.1}
  key = lambda N, K=512: dispatch.validation_key(cfg, "sparse_attention", args(N, K), st)
  assert key(1) == key(64) != key(128)  # 128 programs fill a wave unsplit: the unsplit kernel is another build
  assert key(64) != key(64, 2048)
  # a record pool past 2^31 e4m3 elements is read as uint16 words: the small case is forced onto that path
  big = dispatch.Fp8KVPool(S((2 ** 31 // 448 + 1, 448), jnp.float8_e4m3fn), S((2 ** 31 // 448 + 1, 8), jnp.uint8),
                           S((2 ** 31 // 448 + 1, 64), jnp.bfloat16))
  a = args(64, 512)._replace(comp_pool_QxD=big)
  small = dispatch._sparse_small(a, st, None)
  assert small.tuning.fp8_u16_min_elems == 0 and small.tiling[-1] is True
  assert small.args.comp_pool_QxD.nope.shape == (64, 448)


def test_auto_never_validates_off_a_gpu(monkeypatch):
  dispatch.clear_validations()
  monkeypatch.setattr(dispatch, "validate", lambda *a: pytest.fail("validated on a CPU"))
  args = _sparse_case()
  dispatch.sparse_attention(*args, scale=0.1)
  assert not dispatch.uses_kernel(dispatch.KernelConfig(), "sparse_attention", *args, scale=0.1)
  assert dispatch.uses_kernel(dispatch.KernelConfig("interpret"), "sparse_attention", *args, scale=0.1)
