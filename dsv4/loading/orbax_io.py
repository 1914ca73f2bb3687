"""Save / restore the project's own param tree with orbax-checkpoint.

    save_params(params, "/ckpt/step_100")
    params = restore_params("/ckpt/step_100", config)

`restore_params` reads the checkpoint's metadata first and compares its tree, shapes and dtypes with
`dsv4.model.abstract_params(config)`, so a checkpoint of another config fails with a `CheckpointError` that names
the param path instead of an orbax/tensorstore error.

Integrity: `save_params` also writes `dsv4_digests.json` (blake2b of every leaf's bytes) into the directory, and
`restore_params` checks every restored tensor: shape and dtype as the config says, floats finite and below
`MAX_ABS` in magnitude (flipped exponent bits), and, when the digest file is there, the exact bytes. Every failure
(truncated or corrupted data files included) is a `CheckpointError` that names the directory or file.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from dsv4.config import ModelConfig
from dsv4.loading import weights_digest
from dsv4.loading.safetensors_file import CheckpointError
from dsv4.model import abstract_params


def _path_str(path) -> str:
  out = []
  for p in path:
    key = getattr(p, "key", getattr(p, "idx", getattr(p, "name", p)))
    out.append(str(key))
  return "/".join(out)


DIGEST_FILE = "dsv4_digests.json"
# No weight of a working model is near this; random bit flips in float data mostly land far above it (or on NaN).
MAX_ABS = 1e6


_leaf_digest = weights_digest.leaf_digest


def write_digests(params, directory: str) -> str:
  """Write the per-leaf digest file of `params` into the checkpoint `directory`; returns its path."""
  path = os.path.join(os.path.abspath(directory), DIGEST_FILE)
  with open(path, "w") as f:
    json.dump({k: _leaf_digest(v) for k, v in sorted(_flat(params).items())}, f, indent=0)
  return path


def save_params(params, directory: str, *, force: bool = False) -> None:
  """Write `params` to `directory` (must not exist unless force=True), plus its digest file. Blocks until written."""
  directory = os.path.abspath(directory)
  ck = ocp.StandardCheckpointer()
  ck.save(directory, params, force=force)
  ck.wait_until_finished()
  write_digests(jax.device_get(params), directory)


def check_params(params, config: ModelConfig, where: str, digests: dict | None = None) -> None:
  """Every leaf has the shape and dtype of `abstract_params(config)`, float leaves are finite and below MAX_ABS,
  and (if given) the bytes match `digests`. Raises CheckpointError naming `where` and the param."""
  want = _flat(abstract_params(config))
  have = _flat(params)
  if set(want) != set(have):
    k = sorted(set(want) ^ set(have))[0]
    raise CheckpointError(f"{where}: restored tree differs from config {config.name!r} at param {k!r}")
  for k, w in want.items():
    a = np.asarray(have[k])
    if tuple(a.shape) != tuple(w.shape) or a.dtype != np.dtype(w.dtype):
      raise CheckpointError(f"{where}: param {k!r} restored as {a.dtype}{list(a.shape)}, expected "
                            f"{np.dtype(w.dtype)}{list(w.shape)}")
    if np.issubdtype(a.dtype, np.floating) or a.dtype.name == "bfloat16":
      f = a.astype(np.float32)
      if not np.all(np.isfinite(f)):
        raise CheckpointError(f"{where}: param {k!r} has {int(np.sum(~np.isfinite(f)))} non-finite values "
                              "(corrupted data?)")
      m = float(np.max(np.abs(f))) if f.size else 0.0
      if m > MAX_ABS:
        raise CheckpointError(f"{where}: param {k!r} has a value of magnitude {m:.3g} > {MAX_ABS:g} "
                              "(corrupted data?)")
    if digests is not None:
      if k not in digests:
        raise CheckpointError(f"{where}: param {k!r} has no digest in {DIGEST_FILE}")
      if _leaf_digest(a) != digests[k]:
        raise CheckpointError(f"{where}: param {k!r} does not match its digest in {DIGEST_FILE} (corrupted data)")
      weights_digest.remember(have[k], digests[k])   # verified: the tier fingerprint reuses it (no second pass)


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
  digests = None
  digest_path = os.path.join(directory, DIGEST_FILE)
  if os.path.exists(digest_path):
    try:
      with open(digest_path) as f:
        digests = json.load(f)
    except (OSError, ValueError) as e:
      raise CheckpointError(f"{digest_path}: unreadable digest file ({e})") from e
  try:
    params = ck.restore(directory, abstract_params(config))
  except Exception as e:  # tensorstore / orbax raise many types for missing, truncated or corrupted data files
    raise CheckpointError(f"{directory}: cannot read the param data ({type(e).__name__}: {e})") from e
  check_params(params, config, directory, digests)
  return params
