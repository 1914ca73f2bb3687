"""Save / restore the project's own param tree with orbax-checkpoint.

    save_params(params, "/ckpt/step_100")
    params = restore_params("/ckpt/step_100", config)

`restore_params` reads the checkpoint's metadata first and compares its tree, shapes and dtypes with
`dsv4.model.abstract_params(config)`, so a checkpoint of another config fails with a `CheckpointError` that names
the param path instead of an orbax/tensorstore error.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from dsv4.config import ModelConfig
from dsv4.loading.safetensors_io import CheckpointError
from dsv4.model import abstract_params


def _path_str(path) -> str:
  out = []
  for p in path:
    key = getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))
    out.append(str(key))
  return "/".join(out)


def save_params(params, directory: str, *, force: bool = False) -> None:
  """Write `params` to `directory` (must not exist unless force=True). Blocks until written."""
  directory = os.path.abspath(directory)
  ck = ocp.StandardCheckpointer()
  ck.save(directory, params, force=force)
  ck.wait_until_finished()


def _flat(tree):
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {_path_str(p): v for p, v in leaves}


def restore_params(directory: str, config: ModelConfig):
  """Restore params saved by `save_params`, validated against `abstract_params(config)`."""
  directory = os.path.abspath(directory)
  if not os.path.isdir(directory):
    raise CheckpointError(f"{directory}: no such orbax checkpoint directory")
  ck = ocp.StandardCheckpointer()
  try:
    meta = ck.metadata(directory)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
  except Exception as e:  # orbax raises several types for unreadable directories
    raise CheckpointError(f"{directory}: unreadable orbax checkpoint ({type(e).__name__}: {e})") from e
  want = _flat(abstract_params(config))
  have = _flat(tree)
  missing = sorted(set(want) - set(have))
  if missing:
    raise CheckpointError(f"param {missing[0]!r} is missing from {directory} ({len(missing)} missing)")
  extra = sorted(set(have) - set(want))
  if extra:
    raise CheckpointError(f"param {extra[0]!r} in {directory} is not a param of config {config.name!r} "
                          f"({len(extra)} unexpected)")
  for k, w in want.items():
    h = have[k]
    if tuple(h.shape) != tuple(w.shape):
      raise CheckpointError(f"param {k!r} in {directory}: shape {list(h.shape)}, expected {list(w.shape)}")
    if np.dtype(h.dtype) != np.dtype(w.dtype):
      raise CheckpointError(f"param {k!r} in {directory}: dtype {np.dtype(h.dtype)}, expected {np.dtype(w.dtype)}")
  return ck.restore(directory, abstract_params(config))
