"""dsv4.loading with V4.1's DSpark draft (`mtp.0` .. `mtp.2`; docs/model.md, DSpark): every naming round-trips
bitwise (FP8 / FP4 like the released checkpoint where the naming is quantized), a config without the draft ignores
it, config.json declares it and `load_pretrained` opts in like V4's MTP blocks. NeMo's own adapter checks the names in tests/dsv4/test_dspark_parity.py."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

from dsv4 import config
from dsv4.config import ConfigError, DSparkConfig
from dsv4.loading import checkpoint_naming, safetensors_file, safetensors_write
from dsv4.loading.config_json import config_from_dict, config_to_dict, with_draft
from dsv4.loading.pretrained import load_pretrained
from dsv4.loading.safetensors_file import CheckpointError
from dsv4.loading.safetensors_io import load_checkpoint
from dsv4.loading.safetensors_write import Quant
from tests.dsv4.test_loading import _fake_quant_params, _max_diff, _random_params

# 4 backbone layers (window, ratio 2, ratio 1 ...) with a three-stage draft on features of layers 1-3
BASE = config.ModelConfig(
    name="v41_dspark_tiny", variant="v41", vocab_size=128, hidden_size=64, num_layers=4, compress_ratios=(0, 2, 1, 1),
    attention=config.AttentionConfig(num_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=32, o_groups=2,
                                     o_lora_rank=16, window=16),
    indexer=config.IndexerConfig(num_heads=8, head_dim=32, topk=8),
    moe=config.MoEConfig(n_routed_experts=8, num_experts_per_tok=2, intermediate_size=32, num_hash_layers=0),
    kv_source_layer_ids=(1, 2), index_source_layer_ids=(1, 2, 3), candidate_source_layer_id=2)
DS = DSparkConfig(block_size=4, target_layer_ids=(1, 2, 3), markov_rank=8, noise_token_id=3, n_routed_experts=4,
                  num_experts_per_tok=2)
CFG = dataclasses.replace(BASE, num_mtp_layers=3, dspark=DS)
FP8_BLOCK = 32   # V4.1's 32 x 32 weight blocks

# The released spelling of every DSpark-only tensor, and what each naming makes of a few of them.
NAMES = {
    "original": ["mtp.0.main_proj.weight", "mtp.0.main_proj.scale", "mtp.0.main_norm.weight", "mtp.2.norm.weight",
                 "mtp.2.markov_head.embed.weight", "mtp.2.markov_head.head.weight",
                 "mtp.2.confidence_head.proj.weight", "mtp.1.attn.wq_a.scale", "mtp.1.attn.attn_sink",
                 "mtp.1.ffn.gate.bias", "mtp.1.ffn.gate.bias_vl", "mtp.1.ffn.experts.3.w2.scale", "mtp.1.hc_attn_fn",
                 "mtp.2.ffn.shared_experts.w1.scale"],
    "saved": ["model.mtp.0.main_proj.weight", "model.mtp.0.main_proj.scale", "model.mtp.2.markov_head.head.weight",
              "model.mtp.1.attn.kv_norm.weight", "model.mtp.1.ffn.experts.3.w2.scale", "model.mtp.1.hc_ffn_base"],
    "nemo": ["mtp.0.main_proj.weight", "mtp.0.main_norm.weight", "mtp.2.markov_head.embed.weight",
             "mtp.2.confidence_head.proj.weight", "mtp.1.attn.sinks_param.weight", "mtp.1.attn_hc.fn",
             "mtp.1.ffn.gate.e_score_correction_bias", "mtp.1.ffn.gate.bias_vl", "mtp.1.ffn.experts.gate_and_up_projs",
             "mtp.1.ffn.experts.down_projs", "mtp.2.ffn.shared_experts.gate_proj.weight"],
}
NAMES["hf"] = NAMES["original"]   # transformers has no V4.1: the HF writers keep the draft as DeepSeek ships it


@pytest.fixture(scope="module")
def params():
  return _random_params(CFG, 21)


@pytest.mark.parametrize("naming", checkpoint_naming.NAMINGS)
def test_dspark_round_trips_in_every_naming(params, tmp_path, naming):
  """The draft saves and loads bitwise in every naming (FP8 projections incl. main_proj, FP4 routed experts, scale
  companions spelled `.scale` as in the released checkpoint; NeMo's names unquantized); a config without the draft
  reads the backbone alone; one that wants it and finds none names the missing tensor."""
  quant = None if naming == "nemo" else Quant(fp8_block=FP8_BLOCK)
  ck = str(tmp_path / "ck")
  safetensors_write.save_checkpoint(params, CFG, ck, naming=naming, shard_bytes=80_000, quant=quant)
  hdr = safetensors_file.read_entries(ck)
  assert set(NAMES[naming]) <= set(hdr), sorted(set(NAMES[naming]) - set(hdr))
  assert not any(n.startswith(("mtp.layers.", "layers.4.", "model.layers.4.")) for n in hdr)
  if quant is not None:
    main = [n for n in hdr if n.endswith("mtp.0.main_proj.weight")][0]
    assert hdr[main].dtype == "F8_E4M3" and tuple(hdr[main.replace(".weight", ".scale")].shape) == (2, 6)
    expert = [n for n in hdr if n.endswith("mtp.1.ffn.experts.3.w2.weight")][0]
    assert hdr[expert].dtype == "I8" and tuple(hdr[expert].shape) == (64, 16)
  assert checkpoint_naming.stored_mtp_blocks(ck, CFG.num_layers) == 3
  want = params if quant is None else _fake_quant_params(params, CFG, FP8_BLOCK)
  got = load_checkpoint(ck, CFG, as_jax=False)
  assert _max_diff(want, got) == 0.0
  if quant is not None:  # the draft's FP4 experts stay packed too, and dequantize exactly
    import jax.numpy as jnp
    from dsv4.layers import expert_quant
    kept = load_checkpoint(ck, CFG, as_jax=False, keep_quantized=True)
    for k in ("w1", "w2", "w3"):
      q = kept["mtp"][2]["ffn"]["experts"][k]
      assert set(q) == {"fp4", "scale"}
      np.testing.assert_array_equal(np.asarray(expert_quant.dequant_fp4_kernel(q, jnp.float32)),
                                    got["mtp"][2]["ffn"]["experts"][k])
  plain = load_checkpoint(ck, BASE, as_jax=False)
  assert "mtp" not in plain and _max_diff({k: v for k, v in want.items() if k != "mtp"}, plain) == 0.0
  no = str(tmp_path / "no")
  safetensors_write.save_checkpoint({k: v for k, v in params.items() if k != "mtp"}, BASE, no, naming=naming)
  assert checkpoint_naming.stored_mtp_blocks(no, CFG.num_layers) == 0
  with pytest.raises(CheckpointError, match=r"tensor '(model\.)?mtp\.0\.[^']*' is missing"):
    load_checkpoint(no, CFG)


def test_stage_parts_on_the_wrong_stage_fail(params, tmp_path):
  """Stage 0 owns main_proj / main_norm, the last stage the norm and heads: a draft with them elsewhere names the
  missing tensor."""
  ck = str(tmp_path / "orig")
  safetensors_write.save_checkpoint(params, CFG, ck, naming="original")
  t = {k: safetensors_file.read_tensor(e) for k, e in safetensors_file.read_entries(ck).items()}
  t["mtp.1.main_proj.weight"] = t.pop("mtp.0.main_proj.weight")
  bad = str(tmp_path / "bad")
  os.makedirs(bad)
  safetensors_file.write_file(t, os.path.join(bad, safetensors_file.SINGLE_FILE))
  with pytest.raises(CheckpointError, match=r"tensor 'mtp\.0\.main_proj\.weight' is missing"):
    load_checkpoint(bad, CFG)


def test_config_declares_the_draft_and_load_pretrained_opts_in(params, tmp_path):
  """config.json's `num_nextn_predict_layers` + `dspark_*` keys (NeMo's defaults when absent) declare the draft:
  `info.mtp_layers` / `info.dspark`, the config itself without it; `with_draft` adds it whole; `load_pretrained`
  opts in like V4's MTP (None: the draft when the directory stores it, True: required, False: never)."""
  d = json.loads(json.dumps(config_to_dict(CFG, dtype="float32")))
  assert d["num_nextn_predict_layers"] == 3 and d["dspark_target_layer_ids"] == [1, 2, 3]
  assert d["compress_ratios"] == [0, 2, 1, 1, 0, 0, 0]
  cfg, info = config_from_dict(d, quantized_cache=False)
  assert cfg == dataclasses.replace(BASE, name=cfg.name) and info.mtp_layers == 3 and info.dspark == DS
  assert with_draft(cfg, info) == dataclasses.replace(CFG, name=cfg.name)
  with pytest.raises(ConfigError, match="loads whole"):
    with_draft(cfg, info, 2)
  # NeMo's defaults: the released three-stage draft on layers 37-39
  cfg, info = config_from_dict({"model_type": "deepseek_v41_text"}, quantized_cache=False)
  assert with_draft(cfg, info) == dataclasses.replace(config.v41_flash(dspark=True), name=cfg.name)
  # no draft declared (what the writers say for a config without one)
  cfg, info = config_from_dict(config_to_dict(BASE), quantized_cache=False)
  assert info.mtp_layers == 0 and info.dspark is None
  with pytest.raises(ConfigError, match="declares no draft"):
    with_draft(cfg, info)
  # draft layers are window-only (checked when the draft is wanted: a backbone-only read does not need them)
  cfg, info = config_from_dict({**d, "compress_ratios": [0, 2, 1, 1, 0, 4, 0]})
  with pytest.raises(ConfigError, match="window-only"):
    with_draft(cfg, info)

  ck = str(tmp_path / "pre")
  safetensors_write.save_checkpoint(params, CFG, ck, naming="original", quant=Quant(fp8_block=FP8_BLOCK))
  with open(os.path.join(ck, "config.json"), "w") as f:
    json.dump(d, f)
  want = _fake_quant_params(params, CFG, FP8_BLOCK)
  pre = load_pretrained(ck, dtype="fp32", tokenizer=False, mtp=False)
  assert pre.config.num_mtp_layers == 0 and "mtp" not in pre.params
  for mtp in (None, True):   # None: the stored draft, as for V4's MTP blocks
    pre = load_pretrained(ck, dtype="fp32", tokenizer=False, mtp=mtp)
    assert pre.config.num_mtp_layers == 3 and pre.config.dspark == DS
    assert _max_diff(want, jax.tree_util.tree_map(np.asarray, pre.params)) == 0.0
  # a directory storing the backbone only (declared draft, no stage stored): None reads the backbone, True refuses
  no = str(tmp_path / "backbone_only")
  safetensors_write.save_checkpoint({k: v for k, v in params.items() if k != "mtp"}, BASE, no, naming="original")
  with open(os.path.join(no, "config.json"), "w") as f:
    json.dump(d, f)
  pre = load_pretrained(no, dtype="fp32", tokenizer=False)
  assert pre.config.num_mtp_layers == 0 and "mtp" not in pre.params
  with pytest.raises(CheckpointError, match=r"tensor 'mtp\.0\.[^']*' is missing"):
    load_pretrained(no, dtype="fp32", tokenizer=False, mtp=True)
  with open(os.path.join(ck, "config.json"), "w") as f:   # the draft's fields do not fit this backbone
    json.dump({**d, "dspark_target_layer_ids": [2, 4]}, f)
  with pytest.raises(ConfigError, match="dspark.target_layer_ids"):
    load_pretrained(ck, dtype="fp32", tokenizer=False, mtp=True)
