"""Checkpoint loading and saving: HF / original safetensors (FP8 and FP4 dequantized on load), orbax for the
project's own params. See NOTES.md."""

from dsv4.loading.safetensors_io import (CheckpointError, Quant, load_checkpoint, save_hf_safetensors,
                                         save_original_safetensors)
from dsv4.loading.orbax_io import restore_params, save_params

__all__ = ["CheckpointError", "Quant", "load_checkpoint", "save_hf_safetensors", "save_original_safetensors",
           "save_params", "restore_params"]
