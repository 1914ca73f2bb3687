"""The tiny V4 model through the dispatcher: Pallas kernels (interpret mode) == XLA references, end to end."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

C = pytest.importorskip("dsv4.config")
model = pytest.importorskip("dsv4.model")

from pallas_kernels import dispatch  # noqa: E402


@pytest.mark.skipif(not os.environ.get("PALLAS_KERNELS_SLOW"),
                    reason="~45 s CPU (every layer's kernels compiled in interpret mode); set PALLAS_KERNELS_SLOW=1")
def test_tiny_model_logits_match_between_backends():
  cfg = C.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  B, L = 2, 40
  tokens = jax.random.randint(jax.random.PRNGKey(1), (B, L), 0, cfg.vocab_size)
  lengths = jnp.asarray([L, 29], jnp.int32)
  _, ref = model.forward_full(params, cfg, tokens, lengths, kernel_cfg=dispatch.KernelConfig("xla"))
  _, got = model.forward_full(params, cfg, tokens, lengths, kernel_cfg=dispatch.KernelConfig("interpret"))
  ref, got = np.asarray(ref), np.asarray(got)
  valid = np.arange(L)[None, :] < np.asarray(lengths)[:, None]
  assert not np.isnan(got[valid]).any()
  np.testing.assert_allclose(got[valid], ref[valid], atol=2e-3, rtol=2e-3)
