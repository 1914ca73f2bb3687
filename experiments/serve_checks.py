"""Every mistake a main-job request shows before anything loads, and a round trip to its KV tiers.

A mistake is a FlagError: one `serve: ...` line on stderr and exit code 2, worded with the flag that set it (the
options are the flags' values; a notebook reads the same words). Only files, directories and config.json headers
are read here, never weights, and JAX touches no device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

from cache.tiers.backends import SHARED_KINDS, check_tier_places, make_backend
from dsv4 import sharding
from dsv4.config import ConfigError, get_preset
from dsv4.loading.config_json import read_config
from dsv4.loading.pretrained import declared_mtp_blocks_stored
from dsv4.loading.safetensors_file import CheckpointError
from experiments import train_lib
from experiments.serve_options import SHIPPED_MODELS, ServeOptions, flag_name


class ServeError(Exception):
  """A main job that cannot go on: one `serve: <message>` line on stderr and this exit code."""
  exit_code = 2


class FlagError(ServeError):
  """A mistake in the flags, found before anything loads: one line on stderr, exit code 2."""


CHECKPOINT_KINDS = ("a release checkpoint (config.json + *.safetensors), a directory written by experiments.train "
                    "(config.json + params/), or an orbax params directory")
CONFIG_FILES = ("config.json", "text_config.json")      # text_config.json: NeMo Automodel text-only exports
_ORBAX_MARKERS = ("_CHECKPOINT_METADATA", "_METADATA", "manifest.ocdbt", "checkpoint", "_sharding")


def warn(msg: str, bar=None) -> None:
  line = f"serve: warning: {msg}"
  if bar is not None:
    bar.write(line, file=sys.stderr)      # above the progress bar, not through it
  else:
    print(line, file=sys.stderr, flush=True)


def config_file(d: str) -> str | None:
  for n in CONFIG_FILES:
    if os.path.isfile(os.path.join(d, n)):
      return os.path.join(d, n)
  return None


def is_pretrained_dir(path: str) -> bool:
  """A checkpoint directory in a release layout (not one written by experiments.train): a config beside
  safetensors shards."""
  return (config_file(path) is not None and not os.path.isdir(os.path.join(path, "params"))
          and any(f.endswith(".safetensors") or f.endswith(".safetensors.index.json") for f in os.listdir(path)))


def _check_checkpoint(d: str) -> None:
  if not os.path.exists(d):
    raise FlagError(f"--checkpoint={d}: no such directory")
  if not os.path.isdir(d):
    raise FlagError(f"--checkpoint={d}: not a directory — expected {CHECKPOINT_KINDS}")
  try:
    names = set(os.listdir(d))
  except OSError as e:
    raise FlagError(f"--checkpoint={d}: cannot list it ({e.strerror})") from None
  if not names:
    raise FlagError(f"--checkpoint={d}: empty directory — expected {CHECKPOINT_KINDS}")
  shards = any(n.endswith((".safetensors", ".safetensors.index.json")) for n in names)
  if "params" in names or shards or names & set(_ORBAX_MARKERS):
    return          # a checkpoint of a known kind; a file it lacks is a load error that names the file
  if names & set(CONFIG_FILES):
    raise FlagError(f"--checkpoint={d}: a config but no *.safetensors shards and no params/ directory — expected "
                    f"{CHECKPOINT_KINDS}")
  raise FlagError(f"--checkpoint={d}: not a checkpoint directory (no config.json, no orbax metadata) — expected "
                  f"{CHECKPOINT_KINDS}")


def _check_tiers(o: ServeOptions, kinds: list[str]) -> None:
  try:   # the same rules (and words) as TieringConfig.from_flags
    check_tier_places(tuple(kinds), o.kv_disk_dir, o.kv_store_url,
                      {"tiers": "--kv_tiers", "disk_dir": "--kv_disk_dir", "store_url": "--kv_store_url"})
  except ValueError as e:
    raise FlagError(str(e)) from None
  if "disk" in kinds and os.path.exists(o.kv_disk_dir) and not os.path.isdir(o.kv_disk_dir):
    raise FlagError(f"--kv_disk_dir={o.kv_disk_dir}: not a directory")
  shared = [k for k in kinds if k in SHARED_KINDS]
  if not shared:
    return
  kind = shared[0]
  module, pkg = ("redis", "redis") if kind == "redis" else ("mooncake.store", "mooncake-transfer-engine")
  try:
    __import__(module)
  except ImportError as e:      # a setup error, never a silently missing tier
    raise FlagError(f"--kv_tiers=...{kind} needs the {module.split('.')[0]} client library: pip install {pkg} "
                    f"({e})") from None


def _check_drafts(o: ServeOptions) -> None:
  """Speculative decoding: its limits, and a model that has an MTP block (its config says, before weights load)."""
  ec, k = o.engine, o.engine.num_speculative_tokens
  if not 0 <= k <= 8:
    raise FlagError(f"--num_speculative_tokens={k}: must be in 0..8 (0 = off)")
  if not k:
    return
  for bad, why in ((o.mesh, "--mesh"), (ec.model_api != "functional", "--model_api=nnx")):
    if bad:
      raise FlagError(f"--num_speculative_tokens={k} with {why} is not supported (drafts run on one device, "
                      "through the functional model)")
  if min(ec.chunk_size, ec.max_num_batched_tokens) < 1 + k:
    raise FlagError(f"--num_speculative_tokens={k}: --chunk_size and --max_num_batched_tokens must be >= {1 + k}")
  if not o.checkpoint and o.model in SHIPPED_MODELS:
    try:
      with open(os.path.join(train_lib.CHECKPOINT_ROOT, o.model, "config.json")) as f:
        mtp = json.load(f)["config"].get("num_mtp_layers", 0)
    except (OSError, ValueError, KeyError):
      mtp = None                     # unreadable: load_model reports it
    if mtp == 0:
      raise FlagError(f"--num_speculative_tokens={k}: --model={o.model} has no MTP block (try "
                      "--model=v4_retrieval_mtp, or train one with experiments/train_mtp.py)")
  if o.checkpoint and os.path.isdir(o.checkpoint) and is_pretrained_dir(o.checkpoint):
    try:                             # config.json and the shards' headers only
      cfg, info = read_config(o.checkpoint, strict=False)
      stored = declared_mtp_blocks_stored(o.checkpoint, cfg, info)
    except (ConfigError, CheckpointError, OSError):
      stored = None                  # unreadable: load_model reports it
    if stored == 0:
      raise FlagError(f"--num_speculative_tokens={k}: {o.checkpoint} has no MTP block (config.json declares "
                      "none, or the directory stores no mtp.* / e_proj tensors, as a transformers export)")


def _check_engine(o: ServeOptions) -> None:
  ec = o.engine
  if ec.retention_interval < 0 or ec.retention_interval % 128:
    raise FlagError(f"--retention_interval={ec.retention_interval}: must be 0 or a positive multiple of 128 (the "
                    "full-attention block size)")
  if ec.model_api == "nnx" and o.mesh:
    raise FlagError("--model_api=nnx runs on one device (the module state carries no mesh shardings): drop --mesh "
                    "or use --model_api=functional")
  for name, value in [(n, getattr(ec, n)) for n in ("max_num_seqs", "max_num_batched_tokens", "chunk_size",
                                                    "max_model_len", "num_full_blocks", "num_swa_blocks")] + [
                      ("num_processes", o.num_processes)]:
    if value < 1:
      raise FlagError(f"{flag_name(name)}={value}: must be >= 1")
  _check_drafts(o)
  try:        # whatever else EngineConfig refuses, worded with the flag (the tiers are checked on their own)
    dataclasses.replace(ec, tiering=None).validate()
  except ValueError as e:
    raise FlagError(re.sub(r"EngineConfig\.(\w+)", lambda m: flag_name(m.group(1)), str(e))) from None


def check_options(o: ServeOptions) -> list[str]:
  """Every mistake the options show without loading anything (FlagError); the first thing the job does, before JAX
  touches a device. Returns the KV tiers asked for."""
  _check_engine(o)
  if not 0 <= o.process_id < o.num_processes:
    raise FlagError(f"--process_id={o.process_id}: must be in [0, --num_processes={o.num_processes})")
  if o.mesh:
    try:
      sharding.parse_mesh_spec(o.mesh)
    except ValueError as e:
      raise FlagError(f"--mesh={o.mesh}: {e}") from None
  if o.requests:
    p = o.requests
    if not os.path.exists(p):
      raise FlagError(f"--requests={p}: no such file")
    if os.path.isdir(p):
      raise FlagError(f"--requests={p}: a directory, expected a JSONL file (one request per line)")
    if not os.access(p, os.R_OK):
      raise FlagError(f"--requests={p}: not readable")
  if o.checkpoint:
    _check_checkpoint(o.checkpoint)
  if o.model == "random" or (o.checkpoint and not config_file(o.checkpoint)):
    try:
      get_preset(o.preset)             # a config only: no weights are made here
    except ConfigError as e:
      raise FlagError(f"--preset={o.preset}: {str(e).replace('unknown preset', 'unknown', 1)}") from None
  kinds = o.tier_kinds
  _check_tiers(o, kinds)
  return kinds


def probe_tiers(o: ServeOptions, kinds: list[str]) -> list[str]:
  """One cheap round trip to each tier that lives outside this process, before the model loads. A tier that does not
  answer is one warning line and is left out (fatal with --kv_tiers_strict). Returns the tiers to serve with."""
  usable = []
  for kind in kinds:
    why = None
    try:
      if kind == "disk":
        os.makedirs(o.kv_disk_dir, exist_ok=True)
        if not os.access(o.kv_disk_dir, os.W_OK | os.X_OK):
          why = f"{o.kv_disk_dir}: not writable"
      elif kind in ("redis", "mooncake"):
        b = make_backend(kind, store_url=o.kv_store_url, timeout_s=1.0)
        try:
          if hasattr(b, "ping"):
            b.ping()
          else:
            b.exists_many(["dsv4kv:serve-probe"])
        finally:
          b.close()
    except ImportError as e:     # a setup error, not an outage: never a silently missing tier
      raise FlagError(f"--kv_tiers=...{kind}: {e}") from None
    except Exception as e:  # noqa: BLE001 - whatever the client raises, the store is not reachable
      why = f"{type(e).__name__}: {' '.join(str(e).split())}"
    if why is None:
      usable.append(kind)
    elif o.kv_tiers_strict:
      raise FlagError(f"KV tier {kind} unavailable ({why}) and --kv_tiers_strict is set")
    else:
      warn(f"KV tier {kind} unavailable ({why}); continuing without it")
  return usable
