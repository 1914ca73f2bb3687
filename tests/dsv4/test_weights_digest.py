"""The weights digest behind the KV tiers' record fingerprint hashes every byte, once, while loading."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cache.hashing import ExtraKeys
from dsv4 import config
from dsv4 import model
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.tiering_config import TieringConfig
from dsv4.loading import orbax_io
from dsv4.loading import safetensors_io, safetensors_write
from dsv4.loading import weights_digest


def _bump_middle(tree):
  """A copy of `tree` whose largest leaf differs in exactly one element, in the middle of its bytes."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  i = max(range(len(leaves)), key=lambda j: leaves[j].size)
  x = np.array(leaves[i])
  flat = x.reshape(-1)
  flat[flat.size // 2] = flat[flat.size // 2] + np.asarray(1, x.dtype)
  return jax.tree_util.tree_unflatten(treedef, leaves[:i] + [jnp.asarray(x)] + leaves[i + 1:])


def test_one_middle_element_of_a_large_leaf_changes_the_digest():
  # 12 MiB leaf: larger than any "hash the ends only" shortcut would cover
  big = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((3 << 20,), np.float32)), "b": jnp.zeros(4)}
  assert weights_digest.params_digest(big) != weights_digest.params_digest(_bump_middle(big))
  same_values = {"w": jnp.array(big["w"]), "b": jnp.zeros(4)}
  assert weights_digest.params_digest(big) == weights_digest.params_digest(same_values)


def test_tier_fingerprints_differ_for_weights_differing_in_one_middle_element():
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  ec = EngineConfig(max_model_len=256, num_full_blocks=8, num_swa_blocks=16,
                    tiering=TieringConfig(tiers=("host",)))
  fps = []
  for p in (params, _bump_middle(params)):
    tiering = Engine(p, cfg, ec).tiering
    fps.append(tiering._fingerprint(ExtraKeys()))
  assert fps[0] != fps[1]
  assert fps[0].model != fps[1].model


def test_leaf_hasher_accepts_slabs_out_of_order():
  a = np.random.default_rng(1).standard_normal((5, 3, 4)).astype(np.float32)
  h = weights_digest.LeafHasher(np.float32, a.shape)
  for i in (3, 0, 4, 1, 2):
    h.add(i, a[i])
  assert h.hexdigest() == weights_digest.leaf_digest(a)
  h = weights_digest.LeafHasher(np.float32, a.shape)
  h.add(0, a[0])
  with pytest.raises(ValueError):
    h.hexdigest()


@pytest.mark.parametrize("naming", ["original", "hf"])
def test_loading_streams_the_digest_of_every_leaf(tmp_path, naming):
  """The loader remembers a digest per leaf, computed from the bytes it had in hand; each equals a fresh full hash
  of the loaded leaf, so params_digest re-reads nothing and still covers every byte."""
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(2))
  safetensors_write.save_checkpoint(params, cfg, str(tmp_path / "ckpt"), naming=naming)
  loaded = safetensors_io.load_checkpoint(str(tmp_path / "ckpt"), cfg)
  flat = weights_digest.flat(loaded)
  known = {k: weights_digest.known_digest(v) for k, v in flat.items()}
  streamed = [k for k, d in known.items() if d is not None]
  assert len(streamed) >= len(flat) // 2, (len(streamed), len(flat))   # derived leaves may be hashed later
  for k in streamed:
    assert known[k] == weights_digest.leaf_digest(flat[k]), k
  assert weights_digest.params_digest(loaded) == weights_digest.params_digest(jax.tree_util.tree_map(jnp.array, loaded))


def test_orbax_restore_keeps_its_verified_digests(tmp_path):
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(3))
  orbax_io.save_params(params, str(tmp_path / "p"))
  restored = orbax_io.restore_params(str(tmp_path / "p"), cfg)
  flat = weights_digest.flat(restored)
  assert all(weights_digest.known_digest(v) == weights_digest.leaf_digest(v) for v in flat.values())
  assert weights_digest.params_digest(restored) == weights_digest.params_digest(params)
