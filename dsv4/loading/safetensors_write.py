"""Write DeepSeek-V4 safetensors checkpoints in any naming the loader reads (original, HF, save_pretrained, NeMo),
plain or FP8/FP4-quantized like the released checkpoints.

    save_hf_safetensors(params, config, "out_dir", shard_bytes=..., quant=Quant(fp8_block=128, fp4_experts=True))
    save_original_safetensors(params, config, "out_dir", quant=...)
    save_checkpoint(params, config, "out_dir", naming="saved", dtype=ml_dtypes.bfloat16)
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np

from dsv4.config import ModelConfig
from dsv4.loading import names
from dsv4.loading.checkpoint_naming import NAMINGS
from dsv4.loading.quant import quantize_fp4, quantize_fp8_block
from dsv4.loading.safetensors_file import write_dir


@dataclasses.dataclass(frozen=True)
class Quant:
  """How the writers quantize (for round-trip tests and small exports).

  fp8_block: FP8 e4m3 + e8m0 block scales for the dense projections (None: keep float).
  fp4_experts: FP4 e2m1 + per-row/32-column e8m0 scales for the routed experts.
  """
  fp8_block: int | None = 128
  fp4_experts: bool = True


# Dense projections that ship FP8 in the released checkpoints: attention q/kv/o, the indexer query, shared experts.
# Compressor / indexer-compressor wkv, wgate, weights_proj, the router, norms, mHC, embed and head stay float. An
# MTP block is quantized like a layer, plus its e_proj / h_proj (NeMo's adapter expects scales for them); a V4.1
# DSpark stage like a layer, plus stage 0's main_proj (NeMo's `DeepseekV41DSparkStateDictAdapter`).
_FP8_ORIG = re.compile(r"^(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                       r"|ffn\.shared_experts\.w[123]|engram\.wkv|e_proj|h_proj|main_proj)\.weight$")
_FP8_ROWS_ORIG = re.compile(r"^layers\.\d+\.engram\.embed\.weight$")  # V4.1 Engram table: per-row/32-col scales
_FP4_ORIG = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")


def _quantize_dict(tensors: dict[str, np.ndarray], config: ModelConfig, quant: Quant | None, naming: str):
  if quant is None:
    return tensors
  out = {}
  to_orig = {}
  if naming == "hf":
    for s in names.original_specs(config):
      to_orig[(names.expert_target(s.name) or (names.original_to_hf_name(s.name),))[0]] = s.name
    to_orig.update({v: k for k, v in names.hf_mtp_export_names(config).items()})
  for name, x in tensors.items():
    orig = to_orig.get(name, name)
    dot_scale = naming == "original" or orig.startswith("mtp.")  # DeepSeek's spelling, DeepSeek's scale names
    if quant.fp8_block and (_FP8_ORIG.match(orig) or _FP8_ROWS_ORIG.match(orig)):
      q, s = quantize_fp8_block(x, quant.fp8_block if _FP8_ORIG.match(orig) else (1, quant.fp8_block))
      out[name] = q
      out[name[: -len(".weight")] + (".scale" if dot_scale else ".weight_scale_inv")] = s
    elif quant.fp4_experts and (_FP4_ORIG.match(orig) or (naming == "hf" and re.search(r"\.mlp\.experts\.", name))):
      q, s = quantize_fp4(x)
      out[name] = q
      out[name[: -len(".weight")] + ".scale" if dot_scale else name + "_scale_inv"] = s
    else:
      out[name] = x
  return out


def _np_params(params):
  return jax.tree_util.tree_map(lambda x: np.asarray(x), params)


def hf_state_dict(params, config: ModelConfig) -> dict[str, np.ndarray]:
  """HF-named numpy tensors (float32, tid2eid int64 as in transformers)."""
  t = names.original_to_hf(names.params_to_original(_np_params(params), config), config)
  return {k: (v.astype(np.int64) if np.issubdtype(v.dtype, np.integer) else v.astype(np.float32)) for k, v in t.items()}


def save_hf_safetensors(params, config: ModelConfig, path: str, *, shard_bytes: int | None = None,
                        quant: Quant | None = None) -> list[str]:
  """Write params with HF names into directory `path` (one file, or shards + index when shard_bytes is set)."""
  t = _quantize_dict(hf_state_dict(params, config), config, quant, "hf")
  return write_dir(t, path, shard_bytes, "pt")


def save_original_safetensors(params, config: ModelConfig, path: str, *, shard_bytes: int | None = None,
                              quant: Quant | None = None) -> list[str]:
  """Write params with the original checkpoint names (per-expert tensors, `.scale` companions)."""
  t = names.params_to_original(_np_params(params), config)
  t = {k: (v.astype(np.int32) if np.issubdtype(v.dtype, np.integer) else v.astype(np.float32)) for k, v in t.items()}
  return write_dir(_quantize_dict(t, config, quant, "original"), path, shard_bytes, "pt")


def save_checkpoint(params, config: ModelConfig, path: str, *, naming: str = "original",
                    shard_bytes: int | None = None, quant: Quant | None = None, dtype=np.float32) -> list[str]:
  """Write params in any naming the loader reads: "original", "hf" (transformers-converted; MTP blocks as layers
  N + K in DeepSeek's spelling), "saved" (transformers save_pretrained) or "nemo" (NeMo Automodel's model
  state_dict, `deepseek_v4` / `deepseek_v41`; quant must be None). Floating tensors are stored as `dtype`
  (float32, or ml_dtypes.bfloat16 like the released checkpoints)."""
  if naming not in NAMINGS:
    raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")
  t = names.params_to_original(_np_params(params), config)
  t = {k: (v.astype(np.int32) if np.issubdtype(v.dtype, np.integer) else v.astype(dtype)) for k, v in t.items()}
  if naming == "hf":
    t = {k: (v.astype(np.int64) if np.issubdtype(v.dtype, np.integer) else v) for k, v in
         names.original_to_hf(t, config).items()}
    return write_dir(_quantize_dict(t, config, quant, "hf"), path, shard_bytes, "pt")
  if naming == "nemo":
    if quant is not None:
      raise ValueError("save_checkpoint: quantized NeMo checkpoints are not written (NeMo stores them dequantized)")
    return write_dir(names.original_to_nemo(t, config), path, shard_bytes, "pt")
  t = _quantize_dict(t, config, quant, "original")
  if naming == "saved":
    t = {names.original_to_saved_name(k): v for k, v in t.items()}
  return write_dir(t, path, shard_bytes, "pt")
