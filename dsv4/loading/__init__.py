"""Checkpoint loading and saving: HF / original safetensors (FP8 and FP4 dequantized on load), orbax for the
project's own params. See BUILD_NOTES.md, Checkpoint loading, and docs/model.md."""

from dsv4.loading.safetensors_file import CheckpointError
from dsv4.loading.safetensors_io import load_checkpoint, storage_dtype
from dsv4.loading.safetensors_write import Quant, save_checkpoint, save_hf_safetensors, save_original_safetensors
from dsv4.loading.orbax_io import restore_params, save_params
from dsv4.loading.config_json import config_to_dict, load_config, read_config, with_draft
from dsv4.loading.tokenizer import Tokenizer, TokenizerError
from dsv4.loading.pretrained import Pretrained, load_pretrained

__all__ = ["CheckpointError", "Quant", "load_checkpoint", "save_checkpoint", "save_hf_safetensors",
           "save_original_safetensors", "storage_dtype", "save_params", "restore_params", "config_to_dict",
           "load_config", "read_config", "with_draft", "Tokenizer", "TokenizerError", "Pretrained", "load_pretrained"]
