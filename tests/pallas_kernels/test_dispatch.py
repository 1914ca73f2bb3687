"""Dispatcher: the interpret-mode kernels agree with the XLA references through dispatch; kernels are registered;
auto picks XLA on CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels import indexer as ix
from pallas_kernels import sparse_attention as sa


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
  # the Pallas kernel (interpret mode) through dispatch vs dispatch's XLA reference ('auto' is XLA on CPU: the
  # first test checks that resolution, so comparing it here would compare XLA with itself)
  kernel = dispatch.KernelConfig("interpret", sparse_tuning=sa.SparseAttentionTuning(block_k=8, num_splits=2))
  got = dispatch.sparse_attention(q, wp, wi, cp, ci, sink, scale=D ** -0.5, cfg=kernel)
  want = dispatch.sparse_attention(q, wp, wi, cp, ci, sink, scale=D ** -0.5, cfg=dispatch.KernelConfig("xla"))
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
  a = dispatch.indexer_scores(q, w, kp, rows, nv, allowed, cfg=dispatch.KernelConfig("xla"))   # the reference
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


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_sparse_attention_per_query_lengths(backend):
  """Ids past window_len_N / comp_len_N are ignored even when they are valid rows (here rows full of NaN): same
  answer as the same ids cut to -1 by hand."""
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
  cfg = dispatch.KernelConfig(backend, sparse_tuning=sa.SparseAttentionTuning(block_k=4, num_splits=2))
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


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_indexer_num_keys(backend):
  rng = np.random.default_rng(4)
  B, T, H, C, P, M = 2, 3, 4, 16, 50, 24
  q = jnp.asarray(rng.standard_normal((B, T, H, C)), jnp.float32)
  w = jnp.asarray(rng.random((B, T, H)) + 0.1, jnp.float32)
  kp = jnp.asarray(rng.standard_normal((P, C)), jnp.float32)
  rows = jnp.asarray(rng.integers(0, P, (B, M)), jnp.int32)
  nv = jnp.asarray(rng.integers(0, M + 1, (B, T)), jnp.int32)
  nk = jnp.asarray([5, 17], jnp.int32)
  cfg = dispatch.KernelConfig(backend, indexer_tuning=ix.IndexerTuning(block_m=8))
  got = np.asarray(dispatch.indexer_scores(q, w, kp, rows, nv, cfg=cfg, num_keys_B=nk))
  want = np.asarray(ix.indexer_scores_reference(q, w, kp, rows, jnp.minimum(nv, nk[:, None])))
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  f = np.isfinite(want)
  np.testing.assert_allclose(got[f], want[f], rtol=2e-5, atol=2e-5)
  assert np.all(np.isinf(got[0, :, 5:])) and np.all(np.isinf(got[1, :, 17:]))
  ids = np.asarray(dispatch.indexer_topk(q, w, kp, rows, nv, 6, cfg=cfg, num_keys_B=nk))
  assert ids.shape == (B, T, 6) and ids[0].max() < 5 and ids[1].max() < 17


def test_auto_needs_a_recorded_validation(tmp_path, monkeypatch):
  """'auto' on a GPU uses a kernel only after the GPU check recorded it for this JAX version + device kind."""
  path = str(tmp_path / "validations.json")
  monkeypatch.setattr(dispatch, "VALIDATIONS_PATH", path)
  monkeypatch.setattr(dispatch, "is_validated", lambda op, path=path: dispatch._validated(
      op, jax.__version__, dispatch._device_kind(), path))
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  auto = dispatch.KernelConfig()
  assert dispatch._resolve(auto, "sparse_attention") is None  # no record: XLA
  dispatch.record_validation("sparse_attention", False, {"err_over_tol": 3.0}, path=path)
  assert dispatch._resolve(auto, "sparse_attention") is None  # failed check: XLA
  dispatch.record_validation("sparse_attention", True, {"err_over_tol": 0.2}, path=path)
  assert dispatch._resolve(auto, "sparse_attention") == {"interpret": False}
  assert dispatch._resolve(auto, "indexer_scores") is None  # validated per op
  assert len(dispatch.load_validations(path)) == 1  # the record was replaced, not duplicated
  with open(path) as f:
    text = f.read().replace(jax.__version__, "0.0.1")
  with open(path, "w") as f:
    f.write(text)
  dispatch._validated.cache_clear()
  assert dispatch._resolve(auto, "sparse_attention") is None  # another JAX version: check again
  assert dispatch._resolve(dispatch.KernelConfig("pallas"), "sparse_attention") == {"interpret": False}
