"""dsv4.loading.config_json: ModelConfig from transformers / original / inference / NeMo config.json."""

import dataclasses
import json
import sys

import pytest

from dsv4 import config
from dsv4.config import ConfigError
from dsv4.loading.config_json import config_from_dict, load_config, read_config
from tests.dsv4 import oracle_util


def _same_model(got: config.ModelConfig, want: config.ModelConfig):
  """Equal up to the name and the explicit (config-read) kind / hash lists, and with the same layer plan."""
  strip = dict(name=want.name, layer_kinds=(), hash_layer_ids=None)
  assert dataclasses.replace(got, **strip) == dataclasses.replace(want, **strip)
  assert got.layer_plan() == want.layer_plan()


def test_transformers_config_json_is_v4_tiny(tmp_path):
  hf = oracle_util.hf_config()
  (tmp_path / "config.json").write_text(hf.to_json_string())
  cfg, info = read_config(str(tmp_path))
  assert info.format == "transformers" and info.eos_token_ids == (1,)
  _same_model(cfg, config.v4_tiny())
  assert cfg.layer_kinds == ("swa", "csa", "hca", "csa") and cfg.hash_layer_ids == (0,)


def _flash_original() -> dict:
  """The official V4-Flash config.json, written out key for key (legacy keys, MTP ratio entry)."""
  ratios = list(config.v4_schedule(43)) + [0]
  return {
      "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
      "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1,
      "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
      "sliding_window": 128, "compress_ratios": ratios, "compress_rope_theta": 160000, "rope_theta": 10000,
      "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                       "beta_slow": 1},
      "max_position_embeddings": 1048576, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
      "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "n_routed_experts": 256,
      "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "scoring_func": "sqrtsoftplus",
      "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
      "num_hash_layers": 3, "hidden_act": "silu", "tie_word_embeddings": False, "expert_dtype": "fp4",
      "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                              "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
      "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"}


def test_original_flash_config():
  cfg, info = config_from_dict(_flash_original())
  assert info.format == "original" and info.fp8_block == 128 and info.expert_dtype == "fp4"
  assert info.mtp_layers == 1 and cfg.num_mtp_layers == 0   # declared; load_pretrained decides what loads
  _same_model(cfg, config.v4_flash())


def test_inference_model_args():
  d = dict(vocab_size=129280, dim=4096, moe_inter_dim=2048, n_layers=43, n_hash_layers=3, n_mtp_layers=1, n_heads=64,
           n_routed_experts=256, n_shared_experts=1, n_activated_experts=6, score_func="sqrtsoftplus", route_scale=1.5,
           swiglu_limit=10.0, q_lora_rank=1024, head_dim=512, rope_head_dim=64, norm_eps=1e-6, o_groups=8,
           o_lora_rank=1024, window_size=128, compress_ratios=list(config.v4_schedule(43)) + [0],
           compress_rope_theta=160000.0, original_seq_len=65536, rope_theta=10000.0, rope_factor=16, beta_fast=32,
           beta_slow=1, index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4, hc_sinkhorn_iters=20,
           hc_eps=1e-6, dtype="fp8", scale_fmt="ue8m0", expert_dtype="fp4", max_batch_size=4, max_seq_len=4096)
  cfg, info = config_from_dict(d)
  assert info.format == "inference" and info.mtp_layers == 1
  _same_model(cfg, config.v4_flash())
  del d["index_topk"]
  with pytest.raises(ConfigError, match="'index_topk' is required"):
    config_from_dict(d)


def test_kinds_and_hash_layers_come_from_the_config():
  """A ratio-4 layer declared HCA stays HCA; hash layers need not be the first ones."""
  hf = oracle_util.HF_TINY_KWARGS
  d = {**json.loads(oracle_util.hf_config().to_json_string()),
       "layer_types": ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention",
                       "heavily_compressed_attention"],
       "compress_rates": {"compressed_sparse_attention": 8, "heavily_compressed_attention": 4},
       "mlp_layer_types": ["moe", "hash_moe", "moe", "hash_moe"]}
  assert hf["num_hidden_layers"] == 4
  cfg, _ = config_from_dict(d)
  plans = cfg.layer_plan()
  assert [p.kind for p in plans] == ["swa", "hca", "csa", "hca"]
  assert [p.ratio for p in plans] == [0, 4, 8, 4]
  assert [p.hash_moe for p in plans] == [False, True, False, True]
  assert plans[1].dense_compressed and not plans[1].overlap and plans[2].overlap and plans[2].has_index_query


def test_nemo_v41_configs():
  from tests.dsv4 import v41_oracle
  root = v41_oracle.ensure_nemo()
  if root is None:
    pytest.skip("NeMo Automodel 0.7.0 wheel not available")
  sys.path.insert(0, root)
  from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
  tiny = config.v41_tiny()
  nested = json.loads(json.dumps(DeepseekV41Config(text_config=v41_oracle.nemo_text_kwargs(tiny)).to_dict()))
  cfg, info = config_from_dict(nested)
  assert info.format == "nemo" and info.pad_token_id == 2
  # NeMo always fake-quantizes its cache, so a NeMo config turns the quantized cache on unless told otherwise
  assert cfg.quantized_cache
  _same_model(cfg, dataclasses.replace(tiny, quantized_cache=True))
  _same_model(config_from_dict(nested, quantized_cache=False)[0], tiny)
  released = json.loads(json.dumps(DeepseekV41Config().to_dict()))
  _same_model(config_from_dict(released, quantized_cache=False)[0], config.v41_flash())
  # a text config that omits everything takes NeMo's defaults (the released Flash text configuration)
  _same_model(config_from_dict({"model_type": "deepseek_v41_text"}, quantized_cache=False)[0], config.v41_flash())


def test_nemo_text_config_json_only_and_the_quantized_cache_switch(tmp_path):
  """A NeMo Automodel export may hold only text_config.json: read_config takes it (model_type may be left out,
  the file name says what it is); quantized_cache defaults on for NeMo, off for V4, and can be forced."""
  from tests.dsv4 import v41_oracle
  tiny = config.v41_tiny()
  (tmp_path / "text_config.json").write_text(json.dumps(v41_oracle.nemo_text_kwargs(tiny)))
  cfg, info = read_config(str(tmp_path))
  assert info.format == "nemo" and cfg.quantized_cache
  _same_model(cfg, dataclasses.replace(tiny, quantized_cache=True))
  assert not load_config(str(tmp_path), quantized_cache=False).quantized_cache
  # config.json wins when both are present
  (tmp_path / "config.json").write_text(oracle_util.hf_config().to_json_string())
  cfg, info = read_config(str(tmp_path))
  assert info.format == "transformers" and not cfg.quantized_cache
  with pytest.raises(ConfigError, match="config.json.*quantized_cache.*V4.1-only"):
    read_config(str(tmp_path), quantized_cache=True)
  (tmp_path / "config.json").unlink()
  (tmp_path / "text_config.json").unlink()
  with pytest.raises(ConfigError, match=r"config\.json: no such config file \(nor text_config\.json\)"):
    read_config(str(tmp_path))


@pytest.mark.parametrize("which", ["v4_tiny", "v4_retrieval", "v41_tiny", "v41_no_engram"])
def test_config_to_dict_reads_back(which):
  """config_to_dict writes what config_from_dict reads back as the same model (V4: transformers' format, which
  transformers itself parses to the same model; V4.1: NeMo's text config)."""
  from dsv4.loading.config_json import config_to_dict
  cfg = {"v4_tiny": config.v4_tiny(),
         "v4_retrieval": config.v4_tiny(num_layers=2, window=16, vocab_size=64, index_topk=8),
         "v41_tiny": config.v41_tiny(), "v41_no_engram": config.v41_tiny(engram=False)}[which]
  d = json.loads(json.dumps(config_to_dict(cfg, dtype="float32")))
  got, info = config_from_dict(d, quantized_cache=False)
  _same_model(got, cfg)
  if cfg.variant == "v4":
    from transformers import DeepseekV4Config
    hf = DeepseekV4Config(**{k: v for k, v in d.items() if k != "model_type"})
    assert oracle_util.config_mismatches(hf, cfg) == []
    _same_model(config_from_dict(json.loads(hf.to_json_string()))[0], cfg)
    with_mtp = config_to_dict(dataclasses.replace(cfg, num_mtp_layers=1))
    assert with_mtp["num_nextn_predict_layers"] == 1 and config_from_dict(with_mtp)[1].mtp_layers == 1
    # two HCA rates: transformers' config has one rate per kind, so it is refused rather than written wrong
    with pytest.raises(ConfigError, match="one rate per layer kind"):
      config_to_dict(dataclasses.replace(config.v4_tiny(), compress_ratios=(0, 4, 16, 8)))
  else:
    with pytest.raises(ConfigError, match="quantized_cache"):
      config_to_dict(dataclasses.replace(cfg, quantized_cache=True))


@pytest.mark.parametrize("patch,match", [
    ({"scoring_func": "softmax"}, "'scoring_func' = 'softmax' is not supported"),
    ({"num_key_value_heads": 8}, "'num_key_value_heads'"),
    ({"hidden_size": "64"}, "'hidden_size' must be an integer"),
    ({"some_new_field": 3}, "'some_new_field' is not understood"),
    ({"layer_types": None, "compress_ratios": None}, "V4-Pro schedule"),
    ({"layer_types": ["sliding_attention"] * 3}, "'layer_types' must list at least"),
    ({"mlp_layer_types": ["moe", "dense", "moe", "moe"]}, "'mlp_layer_types'"),
    ({"rope_parameters": {"main": {"rope_type": "default"}, "compress": {"rope_type": "linear"}}},
     "rope_type' = 'linear'"),
    ({"o_groups": 3}, "o_groups"),
    ({"model_type": "llama"}, "'model_type' = 'llama'"),
])
def test_bad_fields_name_the_field(patch, match):
  d = {**json.loads(oracle_util.hf_config().to_json_string()), **patch}
  d = {k: v for k, v in d.items() if not (v is None and k in patch)}
  with pytest.raises(ConfigError, match=match):
    config_from_dict(d)


def test_unknown_fields_tolerated_when_not_strict():
  d = {**json.loads(oracle_util.hf_config().to_json_string()), "some_new_field": 3}
  cfg, info = config_from_dict(d, strict=False)
  assert info.ignored == ("some_new_field",)
  _same_model(cfg, config.v4_tiny())


def test_malformed_and_missing_files(tmp_path):
  with pytest.raises(ConfigError, match="no such config file"):
    load_config(str(tmp_path))
  (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4", ')
  with pytest.raises(ConfigError, match=r"config.json: malformed JSON"):
    load_config(str(tmp_path))
  (tmp_path / "config.json").write_text('[1, 2]')
  with pytest.raises(ConfigError, match="expected a JSON object"):
    load_config(str(tmp_path))
