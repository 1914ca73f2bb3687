"""One call from a checkpoint directory to (config, params, tokenizer).

    pre = load_pretrained("ckpt_dir")     # config.json + *.safetensors (+ index) + tokenizer.json
    generate_text(pre.params, pre.config, pre.tokenizer, ["Hello"])

Weights default to bfloat16 (the released checkpoints' own float dtype; FP8 / FP4 tensors are dequantized into
it), streamed shard by shard onto the device (see safetensors_io.load_checkpoint). The FP8 block edge comes from
config.json's quantization_config when it states one. For V4.1 with Engram, the normalised-vocabulary token map
is derived from the tokenizer (NeMo's `_compressed_token_map`; dsv4.layers.engram.compressed_token_map).
"""

from __future__ import annotations

import dataclasses
import os

import ml_dtypes
import numpy as np

from dsv4.config import ModelConfig
from dsv4.loading.config_json import CheckpointInfo, read_config
from dsv4.loading.safetensors_io import CheckpointError, load_checkpoint
from dsv4.loading.tokenizer import TOKENIZER_FILE, Tokenizer


@dataclasses.dataclass
class Pretrained:
  config: ModelConfig
  params: dict
  tokenizer: Tokenizer | None
  info: CheckpointInfo


def load_pretrained(path: str, *, dtype=ml_dtypes.bfloat16, strict: bool = True, device=None,
                    fp8_block: int | None = None, tokenizer: bool = True, keep_quantized: bool = False) -> Pretrained:
  """Read a checkpoint directory. Errors: ConfigError (config.json), CheckpointError (tensors, shards),
  TokenizerError (tokenizer files); each names the file and the field / tensor. keep_quantized: FP4 routed experts
  stay packed on the device and are dequantized inside the MoE step (dsv4/layers/expert_quant.py)."""
  if not os.path.isdir(path):
    raise CheckpointError(f"{path}: not a checkpoint directory")
  config, info = read_config(path, strict=strict)
  tok = Tokenizer.from_dir(path) if tokenizer and os.path.isfile(os.path.join(path, TOKENIZER_FILE)) else None
  if tok is not None and len(tok) > config.vocab_size:
    raise CheckpointError(f"{path}: the tokenizer has {len(tok)} tokens but config.json vocab_size is "
                          f"{config.vocab_size}")
  params = load_checkpoint(path, config, fp8_block=fp8_block or info.fp8_block, dtype=dtype, strict=strict,
                           device=device, keep_quantized=keep_quantized)
  if config.engram.layer_ids and tok is not None:
    from dsv4.layers.engram import compressed_token_map
    tm, n = compressed_token_map(tok)
    if n != config.engram.compressed_vocab_size:
      raise CheckpointError(f"{path}: the tokenizer's normalised vocabulary has {n} entries but config.json "
                            f"engram_compressed_vocab_size is {config.engram.compressed_vocab_size}")
    full = np.arange(config.vocab_size, dtype=np.int32)
    full[: len(tm)] = tm
    import jax.numpy as jnp
    params["engram_token_map"] = jnp.asarray(full)
  return Pretrained(config, params, tok, info)
