"""The main job's model: a shipped trained model, random weights of a preset, or a checkpoint directory.

Any failure is a ModelLoadError naming the file (exit code 1), never random weights in place of the model that was
asked for. Defines no flags: other scripts load models through here too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv4.config import ConfigError, get_preset
from dsv4.loading import orbax_io
from dsv4.loading.pretrained import load_pretrained
from dsv4.loading.safetensors_file import CheckpointError
from dsv4.loading.tokenizer import Tokenizer, TokenizerError
from dsv4.model import cast_params, init_params
from experiments import train_lib
from experiments.serve_checks import FlagError, ServeError, config_file, is_pretrained_dir

_LOAD_DTYPES = ("auto", "fp32", "bf16")


class ModelLoadError(ServeError):
  """The requested model could not be loaded; the message names the file."""
  exit_code = 1


def quiet_closed_loop_callbacks() -> None:
  """When an orbax restore fails (a damaged checkpoint), the reads still in flight call back into its closed asyncio
  loop from tensorstore threads, and Python prints each RuntimeError as a bare traceback. They say nothing the load
  error does not; every other unraisable exception still prints."""
  default = sys.unraisablehook

  def hook(u):
    if not (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"):
      default(u)

  sys.unraisablehook = hook


def params_dtype(params) -> str:
  """The float dtype holding most of the params' elements, "bf16" or "fp32": what the engine computes in."""
  counts = {}
  for x in jax.tree_util.tree_leaves(params):
    dt = np.dtype(x.dtype)
    if np.issubdtype(dt, np.floating) or dt == np.dtype(ml_dtypes.bfloat16):
      counts[dt] = counts.get(dt, 0) + int(np.prod(x.shape))
  if not counts:
    return "fp32"
  return "bf16" if max(counts, key=counts.get) == np.dtype(ml_dtypes.bfloat16) else "fp32"


def load_model(model: str, checkpoint: str = "", preset: str = "v4_tiny", seed: int = 0, dtype: str = "auto",
               quantized_cache: bool | None = None, mtp: bool | None = None):
  """(config, params, task spec or None). Any failure is a ModelLoadError naming the file: never random weights
  in place of a model that was asked for. dtype: "auto" (as stored), "fp32" or "bf16"; quantized_cache: None = the
  checkpoint's default; mtp: a release directory's MTP blocks (`load_pretrained`; None = those it stores)."""
  if dtype not in _LOAD_DTYPES:
    raise ValueError(f"load_model: dtype {dtype!r}, expected one of {_LOAD_DTYPES}")

  def finish(cfg, params, spec):
    if quantized_cache is not None and cfg.quantized_cache != quantized_cache:
      try:
        cfg = dataclasses.replace(cfg, quantized_cache=quantized_cache)
      except ConfigError as e:
        raise FlagError(f"--quantized_cache={'on' if quantized_cache else 'off'}: {e} (model {cfg.name})") from None
    if dtype != "auto":       # the trained and random models store fp32
      params = cast_params(params, jnp.float32 if dtype == "fp32" else jnp.bfloat16)
    return cfg, params, spec

  if not checkpoint and model == "random":
    cfg = get_preset(preset)
    return finish(cfg, init_params(cfg, jax.random.PRNGKey(seed)), None)
  directory = checkpoint or os.path.join(train_lib.CHECKPOINT_ROOT, model)
  info_path = os.path.join(directory, "config.json")
  try:
    if checkpoint and is_pretrained_dir(checkpoint):       # a config + safetensors (any naming) + tokenizer
      try:
        pre = load_pretrained(checkpoint, dtype={"auto": "auto", "fp32": np.float32, "bf16": ml_dtypes.bfloat16}[dtype],
                              quantized_cache=quantized_cache, mtp=mtp)
      except (ConfigError, TokenizerError) as e:
        raise ModelLoadError(str(e)) from e
      return pre.config, pre.params, None
    if checkpoint and config_file(checkpoint) is None and any(
        f.endswith((".safetensors", ".safetensors.index.json")) for f in os.listdir(checkpoint)):
      raise ModelLoadError(f"{os.path.join(checkpoint, 'config.json')}: no such file (a release checkpoint has it "
                           "beside its *.safetensors shards)")
    if checkpoint and not os.path.isdir(os.path.join(checkpoint, "params")):   # a bare orbax params directory
      return finish(get_preset(preset), orbax_io.restore_params(checkpoint, get_preset(preset)), None)
    if not os.path.isdir(directory):
      raise ModelLoadError(f"{directory}: no such checkpoint directory")
    try:
      with open(info_path) as f:
        info = json.load(f)
      cfg = train_lib.config_from_dict(info["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise ModelLoadError(f"{info_path}: unreadable checkpoint config ({type(e).__name__}: {e})") from e
    params = orbax_io.restore_params(os.path.join(directory, "params"), cfg)
    spec = train_lib.task_spec_from_info(info) if "task" in info else None
    return finish(cfg, params, spec)
  except CheckpointError as e:
    raise ModelLoadError(str(e)) from e


def load_tokenizer(checkpoint: str):
  """The checkpoint dir's tokenizer (tokenizer.json + tokenizer_config.json chat template), or None."""
  if not checkpoint or not os.path.isfile(os.path.join(checkpoint, "tokenizer.json")):
    return None
  return Tokenizer.from_dir(checkpoint)
