"""The tiny V4 model through the dispatcher: Pallas kernels (interpret mode) == XLA references, end to end; with
kernels on, the indexer goes through the fused top-k kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import caches
from dsv4 import config
from dsv4 import model
from pallas_kernels import dispatch


def _compare_backends(cfg, B, L, valid_len):
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (B, L), 0, cfg.vocab_size)
  lengths = jnp.asarray([L, valid_len], jnp.int32)
  _, ref = model.forward_full(params, cfg, tokens, lengths, kernel_cfg=dispatch.KernelConfig("xla"))
  _, got = model.forward_full(params, cfg, tokens, lengths, kernel_cfg=dispatch.KernelConfig("interpret"))
  ref, got = np.asarray(ref), np.asarray(got)
  valid = np.arange(L)[None, :] < np.asarray(lengths)[:, None]
  assert not np.isnan(got[valid]).any()
  np.testing.assert_allclose(got[valid], ref[valid], atol=2e-3, rtol=2e-3)


def test_small_model_logits_match_between_backends():
  """Runs by default (~25 s CPU): one layer of each kind (window, CSA with the indexer top-k, HCA), 40 tokens, so
  the CSA layer's 10 visible entries exceed top-k 8 and the sparse kernels really select."""
  _compare_backends(config.v4_tiny(num_layers=3), 2, 40, 29)


@pytest.mark.slow   # ~45 s CPU: every layer's kernels compiled in interpret mode
def test_tiny_model_logits_match_between_backends():
  _compare_backends(config.v4_tiny(), 2, 40, 29)


@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_indexer_uses_the_fused_topk_kernel_when_kernels_are_on(monkeypatch, variant):
  """Traced (not run) with backend 'pallas': every V4 CSA layer and every V4.1 layer with its own top-k except the
  candidate source calls the registered fused top-k kernel; the candidate source calls the score kernel (it needs
  every score for its block maxima); every layer calls the sparse attention kernel. With 'xla' none is called."""
  calls = {}
  for op, fn in list(dispatch._KERNELS.items()):
    def spy(*a, _fn=fn, _op=op, **k):
      calls[_op] = calls.get(_op, 0) + 1
      return _fn(*a, **k)
    monkeypatch.setitem(dispatch._KERNELS, op, spy)
  cfg = config.v4_tiny() if variant == "v4" else config.v41_tiny()
  params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.PRNGKey(0)))
  B, T = 2, 40
  cache, swa, full = caches.init_contiguous(cfg, B, T, caches.CacheLayout())
  index = caches.BatchIndex(jnp.zeros((B,), jnp.int32), jnp.full((B,), T, jnp.int32), jnp.asarray(swa),
                            jnp.asarray(full))

  def trace(backend):
    jax.eval_shape(lambda p, c: model.forward(p, cfg, jnp.zeros((B, T), jnp.int32), c, index,
                                              kernel_cfg=dispatch.KernelConfig(backend)), params, cache)

  trace("xla")
  assert calls == {}
  trace("pallas")
  plans = cfg.layer_plan()
  own_topk = [p for p in plans if p.kind == "csa" or (p.has_index_query and not p.candidate_source)]
  assert calls.get("indexer_topk", 0) == len(own_topk) > 0
  assert calls.get("indexer_scores", 0) == sum(p.candidate_source for p in plans)
  assert calls.get("sparse_attention", 0) == len(plans)
