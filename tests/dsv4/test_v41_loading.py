"""V4.1 checkpoint names: original spelling with FP8 32x32 block scales, FP4 experts, FP8 Engram tables with
per-row / 32-column scales; NeMo Automodel spelling (stacked, transposed experts, sinks_param, attn_hc.*)."""

import jax
import numpy as np

from dsv4 import config
from dsv4 import model
from dsv4.loading import names
from dsv4.loading import safetensors_file
from dsv4.loading.safetensors_io import load_checkpoint
from dsv4.loading.safetensors_write import Quant, save_original_safetensors


def _params(cfg, seed=0):
  rng = np.random.default_rng(seed)

  def leaf(a):
    if np.issubdtype(a.dtype, np.integer):
      return np.arange(a.shape[0], dtype=a.dtype)
    return (rng.standard_normal(a.shape) / np.sqrt(a.shape[-2] if len(a.shape) > 1 else 10)).astype(a.dtype)

  return jax.tree_util.tree_map(leaf, model.abstract_params(cfg))


def _max_rel(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))) /
                   max(1e-12, float(np.max(np.abs(np.asarray(x, np.float64)))))) for x, y in zip(la, lb))


def test_v41_original_names_quantized_round_trip(tmp_path):
  cfg = config.v41_tiny()
  params = _params(cfg)
  save_original_safetensors(params, cfg, str(tmp_path), quant=Quant(fp8_block=32, fp4_experts=True))
  entries = safetensors_file.read_entries(str(tmp_path))
  assert entries["layers.1.attn.wq_a.weight"].dtype == "F8_E4M3"
  assert entries["layers.1.attn.wq_a.scale"].shape == (1, 2)                 # [32, 64] in 32x32 blocks
  assert entries["layers.1.engram.embed.scale"].shape == (1100, 1)           # per row / 32 columns
  assert entries["layers.1.ffn.experts.0.w1.weight"].dtype == "I8"
  assert entries["layers.1.attn.compressor.wkv.weight"].dtype == "F32"      # compressor stays float
  assert "layers.3.attn.indexer.wk.weight" not in entries                     # reindex: no keys
  assert "layers.2.attn.indexer.wq_b.weight" not in entries                   # reuse: no indexer
  back = load_checkpoint(str(tmp_path), cfg, as_jax=False)
  assert _max_rel(params, back) < 0.3            # FP4 experts dominate; exactness is checked per format elsewhere
  np.testing.assert_array_equal(back["engram_token_map"], np.arange(cfg.vocab_size))


def test_v41_nemo_names_round_trip(tmp_path):
  cfg = config.v41_tiny()
  params = _params(cfg, 1)
  nemo = names.original_to_nemo(names.params_to_original(params, cfg), cfg)
  assert nemo["model.layers.0.ffn.experts.gate_and_up_projs"].shape == (8, 64, 64)
  assert nemo["model.layers.0.ffn.experts.down_projs"].shape == (8, 32, 64)
  assert {"model.layers.4.attn.sinks_param.weight", "model.layers.4.attn_hc.fn", "model.layers.1.engram.wkv.weight",
          "model.layers.0.ffn.gate.e_score_correction_bias", "model.layers.0.ffn.gate.bias_vl",
          "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(nemo)
  safetensors_file.write_file({k: np.asarray(v, np.float32) for k, v in nemo.items()},
                              str(tmp_path / "model.safetensors"))
  back = load_checkpoint(str(tmp_path), cfg, as_jax=False)
  assert _max_rel(params, back) == 0.0
