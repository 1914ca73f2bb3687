"""`model.init_params` draws its random leaves with `model.draw_normal`: the bits `jax.random.normal` gives at the
leaf's shape, drawn flat at a power-of-two size and cut (one compiled sampler per size bucket, not per shape)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import config, model


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_bucketed_draw_has_the_bits_of_the_shapes_draw(dtype):
  rng = np.random.default_rng()
  shapes = [(1,), (2,), (3, 5), (64,), (65,), (8, 16, 4), (127, 3), tuple(int(n) for n in rng.integers(1, 40, 3))]
  for shape in shapes:
    key = jax.random.PRNGKey(int(rng.integers(2 ** 31)))
    want = np.asarray(jax.random.normal(key, shape, dtype))
    got = np.asarray(model.draw_normal(key, shape, dtype))
    assert got.shape == shape and got.dtype == want.dtype
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), shape


def test_init_params_leaves_are_the_shapes_draws():
  """A whole tiny model: every random leaf as `jax.random.normal` at its shape would give it, scaled as its kind."""
  cfg = config.v4_tiny(num_layers=2)
  key = jax.random.PRNGKey(int(np.random.default_rng().integers(2 ** 31)))
  specs, _ = jax.tree_util.tree_flatten(model.param_shapes(cfg), is_leaf=model.is_param_spec)
  leaves = jax.tree_util.tree_leaves(model.init_params(cfg, key, scale=0.5))
  compared = 0
  for k, spec, got in zip(jax.random.split(key, len(specs)), specs, leaves, strict=True):
    if spec.init == "dense":
      want = jax.random.normal(k, spec.shape, spec.dtype) * (0.5 / np.sqrt(spec.shape[-2]))
    elif spec.init == "embed":
      want = jax.random.normal(k, spec.shape, spec.dtype)
    else:
      continue
    assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8)), spec
    compared += 1
  assert compared >= 10, compared
