"""The tiny V4 model through the dispatcher: Pallas kernels (interpret mode) == XLA references, end to end."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import config as C
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
  _compare_backends(C.v4_tiny(num_layers=3), 2, 40, 29)


@pytest.mark.slow   # ~45 s CPU: every layer's kernels compiled in interpret mode
def test_tiny_model_logits_match_between_backends():
  _compare_backends(C.v4_tiny(), 2, 40, 29)
