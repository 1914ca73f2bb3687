"""One call from a checkpoint directory to (config, params, tokenizer).

    pre = load_pretrained("ckpt_dir")     # config.json (or text_config.json) + *.safetensors (+ index) + tokenizer
    generate_text(pre.params, pre.config, pre.tokenizer, ["Hello"])

dtype="auto" (the default) loads the weights in the checkpoint's own float dtype (`safetensors_io.storage_dtype`):
bfloat16 for the released checkpoints (FP8 / FP4 tensors are dequantized into it), float32 for an fp32 save;
`pre.dtype` records the choice. Tensors are streamed shard by shard onto the device (see
safetensors_io.load_checkpoint). The FP8 block edge comes from config.json's quantization_config when it states
one. A NeMo-format V4.1 checkpoint runs with NeMo's fake-quantized cache unless quantized_cache=False (NeMo always
quantizes it; config_json.config_from_dict). For V4.1 with Engram, the normalised-vocabulary token map is derived
from the tokenizer (NeMo's `_compressed_token_map`; dsv4.layers.engram.compressed_token_map).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np

from dsv4.config import ConfigError, ModelConfig
from dsv4.layers.engram import compressed_token_map
from dsv4.loading.checkpoint_naming import stored_mtp_blocks
from dsv4.loading.config_json import CheckpointInfo, read_config, with_draft
from dsv4.loading.safetensors_file import CheckpointError
from dsv4.loading.safetensors_io import load_checkpoint, resolve_dtype
from dsv4.loading.tokenizer import TOKENIZER_FILE, Tokenizer

GENERATION_CONFIG_FILE = "generation_config.json"


@dataclasses.dataclass
class Pretrained:
  config: ModelConfig
  params: dict
  tokenizer: Tokenizer | None
  info: CheckpointInfo
  dtype: np.dtype = np.dtype(np.float32)    # the float dtype the weights were loaded in
  # every id that ends a generation: config.json's eos_token_id (all of a list; config.eos_token_id is the first),
  # generation_config.json's, the tokenizer's eos_token. Pass as SamplingParams(stop_token_ids=...) when > 1.
  eos_token_ids: tuple[int, ...] = ()


def _generation_eos(path: str) -> tuple[int, ...]:
  fp = os.path.join(path, GENERATION_CONFIG_FILE)
  if not os.path.isfile(fp):
    return ()
  try:
    with open(fp) as f:
      v = json.load(f).get("eos_token_id")
  except (OSError, ValueError, AttributeError) as e:
    raise CheckpointError(f"{fp}: malformed JSON ({e})") from e
  ids = [v] if isinstance(v, int) else v if isinstance(v, list) else []
  return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0)


def declared_mtp_blocks_stored(path: str, config: ModelConfig, info: CheckpointInfo) -> int:
  """The MTP blocks config.json declares that the directory also stores (headers only, no tensor is read)."""
  return min(info.mtp_layers, stored_mtp_blocks(path, config.num_layers)) if info.mtp_layers else 0


def load_pretrained(path: str, *, dtype="auto", strict: bool = True, device=None, fp8_block: int | None = None,
                    tokenizer: bool = True, keep_quantized: bool = False,
                    quantized_cache: bool | None = None, mtp: bool | None = None) -> Pretrained:
  """Read a checkpoint directory. Errors: ConfigError (config.json), CheckpointError (tensors, shards),
  TokenizerError (tokenizer files); each names the file and the field / tensor.

  dtype: "auto" (the checkpoint's own float dtype: bfloat16 or float32; see safetensors_io.storage_dtype),
  np.float32 or ml_dtypes.bfloat16 (also "fp32" / "bf16"). quantized_cache: None = the checkpoint's default (on for
  NeMo-format V4.1, off otherwise), True / False to force it. keep_quantized: FP4 routed experts stay packed on the
  device and are dequantized inside the MoE step (dsv4/layers/expert_quant.py).

  mtp: the draft config.json declares (`num_nextn_predict_layers`, `n_mtp_layers`). None = load those the
  directory stores (a transformers save_pretrained drops them: then the model has none, `pre.config.num_mtp_layers`
  says so); True = every declared block, a CheckpointError naming the first missing tensor otherwise; False = none.
  V4.1's DSpark draft (`mtp.0` .. `mtp.{K-1}`, docs/model.md, DSpark) loads whole or not at all (its first and last
  stages hold unique parts): None loads it when every declared stage is stored."""
  if not os.path.isdir(path):
    raise CheckpointError(f"{path}: not a checkpoint directory")
  config, info = read_config(path, strict=strict, quantized_cache=quantized_cache)
  if mtp or (mtp is None and info.mtp_layers):
    if mtp and not info.mtp_layers:
      raise CheckpointError(f"{path}: mtp=True but config.json declares no MTP block (num_nextn_predict_layers)")
    n = info.mtp_layers if mtp else declared_mtp_blocks_stored(path, config, info)
    if config.variant == "v4":
      config = dataclasses.replace(config, num_mtp_layers=n)
    elif n == info.mtp_layers:   # DSpark: the whole draft, with its dspark_* fields
      try:
        config = with_draft(config, info)
      except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e
  dt = resolve_dtype(dtype, path)
  tok = Tokenizer.from_dir(path) if tokenizer and os.path.isfile(os.path.join(path, TOKENIZER_FILE)) else None
  if tok is not None and len(tok) > config.vocab_size:
    raise CheckpointError(f"{path}: the tokenizer has {len(tok)} tokens but config.json vocab_size is "
                          f"{config.vocab_size}")
  params = load_checkpoint(path, config, fp8_block=fp8_block or info.fp8_block, dtype=dt, strict=strict,
                           device=device, keep_quantized=keep_quantized)
  if config.engram.layer_ids and tok is not None:
    tm, n = compressed_token_map(tok)
    if n != config.engram.compressed_vocab_size:
      raise CheckpointError(f"{path}: the tokenizer's normalised vocabulary has {n} entries but config.json "
                            f"engram_compressed_vocab_size is {config.engram.compressed_vocab_size}")
    full = np.arange(config.vocab_size, dtype=np.int32)
    full[: len(tm)] = tm
    params["engram_token_map"] = jnp.asarray(full)
  eos = list(info.eos_token_ids or (config.eos_token_id,)) + list(_generation_eos(path))
  if tok is not None and tok.eos_token_id is not None:
    eos.append(tok.eos_token_id)
  return Pretrained(config, params, tok, info, dt, tuple(dict.fromkeys(eos)))
