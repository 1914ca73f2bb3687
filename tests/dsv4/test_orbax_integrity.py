"""Orbax checkpoint integrity: a truncated data file, corrupted data under intact metadata (a NaN-making flip, and a
single bit), a saved value off by one ulp (only the digest sees it), and a tree of the wrong shape all fail with a
`CheckpointError` that names the checkpoint; nothing damaged is returned."""

import glob
import os

import jax
import numpy as np
import pytest

from dsv4 import config, model
from dsv4.loading import orbax_io
from dsv4.loading.orbax_io import restore_params, save_params
from dsv4.loading.safetensors_file import CheckpointError


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  cfg = config.v4_tiny(num_layers=2, vocab_size=64)
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  d = str(tmp_path_factory.mktemp("ck") / "params")
  save_params(params, d)
  return cfg, params, d


def _data_file(d):
  files = [f for f in glob.glob(os.path.join(d, "**", "d", "*"), recursive=True) if os.path.isfile(f)]
  return max(files, key=os.path.getsize)


def _damaged_copy(src, tmp_path, damage):
  import shutil
  dst = str(tmp_path / "params")
  shutil.copytree(src, dst)
  f = _data_file(dst)
  blob = bytearray(open(f, "rb").read())
  open(f, "wb").write(bytes(damage(blob)))
  return dst


def test_round_trip_is_exact_and_writes_digests(saved):
  cfg, params, d = saved
  got = restore_params(d, cfg)
  assert os.path.exists(os.path.join(d, orbax_io.DIGEST_FILE))
  for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_truncated_data_file(saved, tmp_path):
  cfg, _, d = saved
  bad = _damaged_copy(d, tmp_path, lambda b: b[: len(b) // 2])
  with pytest.raises(CheckpointError, match="cannot read the param data") as e:
    restore_params(bad, cfg)
  assert bad in str(e.value)


def test_corrupted_data_with_intact_metadata(saved, tmp_path):
  cfg, _, d = saved

  def flip_exponents(b):
    for i in range(len(b) // 2, len(b) // 2 + 64):
      b[i] ^= 0x7F
    return b

  # Orbax writes the arrays into the data file in an order of its own; where the flip lands in a compressed chunk
  # the read itself fails (a decompression error), which is as much a detection as the value checks.
  bad = _damaged_copy(d, tmp_path / "a", flip_exponents)
  os.remove(os.path.join(bad, orbax_io.DIGEST_FILE))      # without digests: caught by the value checks
  with pytest.raises(CheckpointError, match=r"non-finite|magnitude|cannot read the param data") as e:
    restore_params(bad, cfg)
  assert bad in str(e.value)

  def flip_one_bit(b):
    b[len(b) // 2] ^= 0x01
    return b

  bad = _damaged_copy(d, tmp_path / "b", flip_one_bit)
  with pytest.raises(CheckpointError, match=r"non-finite|magnitude|does not match its digest|cannot read the param data") as e:
    restore_params(bad, cfg)
  assert bad in str(e.value)


def test_digest_catches_plausible_values(saved, tmp_path):
  """Data that differs from what was saved by one ulp of one value (finite, small): only the digest sees it."""
  import shutil
  cfg, params, d = saved
  bad = str(tmp_path / "params")
  shutil.copytree(d, bad)
  leaves, tree = jax.tree_util.tree_flatten(params)
  i = next(i for i, x in enumerate(leaves) if np.issubdtype(x.dtype, np.floating))
  x = np.array(leaves[i])
  x.flat[0] = np.nextafter(x.flat[0], np.float32(np.inf), dtype=x.dtype)
  orbax_io.write_digests(jax.tree_util.tree_unflatten(tree, leaves[:i] + [x] + leaves[i + 1:]), bad)
  with pytest.raises(CheckpointError, match="does not match its digest") as e:
    restore_params(bad, cfg)
  assert bad in str(e.value)


def test_check_params_shape_dtype_finite(saved):
  cfg, params, _ = saved
  orbax_io.check_params(params, cfg, "here")
  leaves, tree = jax.tree_util.tree_flatten(params)
  i = next(i for i, x in enumerate(leaves) if x.ndim == 2 and np.issubdtype(x.dtype, np.floating))
  for bad, msg in ((leaves[i][:1], "restored as"), (leaves[i].astype(np.float16), "restored as"),
                   (leaves[i].at[0, 0].set(np.inf), "non-finite"), (leaves[i].at[0, 0].set(3e7), "magnitude")):
    broken = jax.tree_util.tree_unflatten(tree, leaves[:i] + [bad] + leaves[i + 1:])
    with pytest.raises(CheckpointError, match=msg):
      orbax_io.check_params(broken, cfg, "here")
