"""dsv4.loading: every checkpoint naming (original, transformers-converted, transformers save_pretrained, NeMo),
detected from the names; shard-by-shard streaming into bf16; clear errors."""

import dataclasses
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest

from dsv4 import config
from dsv4.loading import checkpoint_naming, safetensors_file, safetensors_io, safetensors_write
from dsv4.loading.safetensors_file import CheckpointError
from dsv4.loading.safetensors_io import load_checkpoint
from dsv4.loading.safetensors_write import Quant
from tests.dsv4.test_loading import _fake_quant_params, _max_diff, _random_params, _v41_tiny


def _leaves(t):
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(t)]


def _read_single_file(directory):
  return {k: safetensors_file.read_tensor(e)
          for k, e in safetensors_file.read_header(os.path.join(directory, safetensors_file.SINGLE_FILE)).items()}


def test_transformers_save_pretrained_loads_like_the_parity_checkpoint(tmp_path):
  """A tiny DeepseekV4ForCausalLM written by transformers' own save_pretrained (reversed renames:
  model.layers.N.attn.wq_a.weight, head.weight, model.hc_head.hc_fn, attn.norm = KV norm, per-expert w1/w2/w3)
  loads to exactly the params the HF parity test reads from the converted state_dict, so parity carries over."""
  from tests.dsv4 import oracle_util
  hf = oracle_util.build_oracle(seed=0)
  hf.save_pretrained(str(tmp_path / "saved"))
  oracle_util.save_oracle_weights(hf, str(tmp_path / "conv"))
  names = safetensors_file.read_header(str(tmp_path / "saved" / "model.safetensors"))
  assert {"head.weight", "model.hc_head.hc_fn", "model.layers.1.attn.norm.weight",
          "model.layers.0.attn.wq_a.weight"} <= set(names)
  assert checkpoint_naming.detect_naming(names) == "saved"
  conv_header = safetensors_file.read_header(str(tmp_path / "conv" / "model.safetensors"))
  assert checkpoint_naming.detect_naming(conv_header) == "hf"
  cfg = config.v4_tiny()
  got = load_checkpoint(str(tmp_path / "saved"), cfg, as_jax=False)
  want = load_checkpoint(str(tmp_path / "conv"), cfg, as_jax=False)
  assert _max_diff(got, want) == 0.0
  # and the config.json save_pretrained wrote describes the same model
  from dsv4.loading.config_json import load_config
  assert load_config(str(tmp_path / "saved")).layer_plan() == cfg.layer_plan()


@pytest.mark.parametrize("naming", ["original", "hf", "saved"])
def test_every_naming_round_trips_sharded_and_quantized(tmp_path, naming):
  cfg = config.v4_tiny()
  params = _random_params(cfg, 1)
  safetensors_write.save_checkpoint(params, cfg, str(tmp_path), naming=naming, shard_bytes=60_000,
                                    quant=Quant(fp8_block=128))
  assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) >= 4
  got = load_checkpoint(str(tmp_path), cfg, as_jax=False)
  assert _max_diff(_fake_quant_params(params, cfg, 128), got) == 0.0


def test_nemo_naming_round_trip(tmp_path):
  cfg = _v41_tiny()
  params = _random_params(cfg, 2)
  safetensors_write.save_checkpoint(params, cfg, str(tmp_path), naming="nemo", shard_bytes=200_000)
  assert checkpoint_naming.detect_naming(safetensors_file.read_entries(str(tmp_path))) == "nemo"
  assert _max_diff(params, load_checkpoint(str(tmp_path), cfg, as_jax=False)) == 0.0


def test_bf16_streaming_load_equals_cast_of_f32_load(tmp_path):
  cfg = config.v4_tiny()
  params = _random_params(cfg, 3)
  safetensors_write.save_checkpoint(params, cfg, str(tmp_path), naming="saved", shard_bytes=80_000,
                                    dtype=ml_dtypes.bfloat16)
  f32 = load_checkpoint(str(tmp_path), cfg, as_jax=False)
  bf = load_checkpoint(str(tmp_path), cfg, dtype=ml_dtypes.bfloat16)  # jax arrays
  for a, b in zip(_leaves(f32), _leaves(bf)):
    if np.issubdtype(a.dtype, np.integer):
      assert b.dtype == np.int32 and np.array_equal(a, b)
    else:
      assert b.dtype == ml_dtypes.bfloat16 and np.array_equal(a.astype(ml_dtypes.bfloat16), b)


def test_saved_naming_errors_name_the_stored_tensor(tmp_path):
  cfg = config.v4_tiny()
  params = _random_params(cfg, 4)
  d = str(tmp_path / "a")
  safetensors_write.save_checkpoint(params, cfg, d, naming="saved")
  t = _read_single_file(d)
  t["model.layers.2.attn.wkv.weight"] = t["model.layers.2.attn.wkv.weight"][:, :32]
  safetensors_file.write_file(t, os.path.join(d, safetensors_file.SINGLE_FILE))
  with pytest.raises(CheckpointError,
                     match=r"'model\.layers\.2\.attn\.wkv\.weight'.*shape \[64, 32\], expected \[64, 64\]"):
    load_checkpoint(d, cfg)
  # mixing save_pretrained names with converted HF names is refused
  t = _read_single_file(d)
  t["model.layers.0.mlp.experts.down_proj"] = np.zeros((8, 64, 32), np.float32)
  safetensors_file.write_file(t, os.path.join(d, safetensors_file.SINGLE_FILE))
  with pytest.raises(CheckpointError, match="mixes transformers save_pretrained names"):
    load_checkpoint(d, cfg)


def test_missing_shard_is_named(tmp_path):
  cfg = config.v4_tiny()
  files = safetensors_write.save_checkpoint(_random_params(cfg, 5), cfg, str(tmp_path), naming="saved",
                                            shard_bytes=80_000)
  os.remove(files[1])
  with pytest.raises(CheckpointError, match=f"shard '{os.path.basename(files[1])}'.*does not exist"):
    load_checkpoint(str(tmp_path), cfg)
  with open(tmp_path / safetensors_file.INDEX_FILE) as f:
    assert os.path.basename(files[1]) in json.load(f)["weight_map"].values()


@pytest.mark.parametrize("naming", ["saved", "hf"])
def test_fp4_experts_kept_quantized(tmp_path, naming):
  """keep_quantized: routed experts stay packed FP4 + e8m0 scales (about 4x fewer bytes than bf16); the MoE step
  dequantizes them to exactly the weights a dequantizing load gives, so the MoE output is identical."""
  import jax.numpy as jnp
  from dsv4.layers import expert_quant, moe
  cfg = config.v4_tiny()
  safetensors_write.save_checkpoint(_random_params(cfg, 6), cfg, str(tmp_path), naming=naming,
                                    shard_bytes=60_000, quant=Quant(fp8_block=128))
  dense = load_checkpoint(str(tmp_path), cfg)
  kept = load_checkpoint(str(tmp_path), cfg, keep_quantized=True)
  for i in range(cfg.num_layers):
    e_d, e_q = dense["layers"][i]["ffn"]["experts"], kept["layers"][i]["ffn"]["experts"]
    for k in ("w1", "w2", "w3"):
      assert expert_quant.is_quantized(e_q[k]) and e_q[k]["fp4"].dtype == jnp.uint8
      assert e_q[k]["fp4"].nbytes + e_q[k]["scale"].nbytes < e_d[k].nbytes / 6   # vs float32 here
      np.testing.assert_array_equal(np.asarray(expert_quant.dequant_fp4_kernel(e_q[k], jnp.float32)),
                                    np.asarray(e_d[k]))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 12, cfg.hidden_size)), jnp.float32)
  toks = jnp.arange(12, dtype=jnp.int32)[None]
  for i, plan in enumerate(cfg.layer_plan()):
    a = moe.moe(dense["layers"][i]["ffn"], x, toks, cfg.moe, plan.hash_moe)
    b = jax.jit(moe.moe, static_argnums=(3, 4))(kept["layers"][i]["ffn"], x, toks, cfg.moe, plan.hash_moe)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)


MTP = dataclasses.replace(config.v4_tiny(num_layers=2), num_mtp_layers=1)


@pytest.mark.parametrize("naming", checkpoint_naming.NAMINGS)
def test_mtp_blocks_round_trip_in_every_naming(tmp_path, naming):
  """An MTP block saves and loads in every naming (FP8 / FP4 like a layer where the naming is quantized; HF writes
  it as layer N + K in DeepSeek's spelling); a config without MTP ignores it, one that wants it and finds none
  names the missing tensor."""
  params = _random_params(MTP, 9)
  quant = None if naming == "nemo" else Quant(fp8_block=128)
  ck = str(tmp_path / "ck")
  safetensors_write.save_checkpoint(params, MTP, ck, naming=naming, shard_bytes=60_000, quant=quant)
  hdr = safetensors_file.read_entries(ck)
  e_proj = {"original": "mtp.0.e_proj.weight", "hf": "layers.2.e_proj.weight", "saved": "model.mtp.0.e_proj.weight",
            "nemo": "mtp.layers.0.e_proj.weight"}[naming]
  assert e_proj in hdr and safetensors_io.storage_dtype(ck) == np.float32
  if naming == "hf":
    assert hdr["model.layers.2.attn.wq_a.weight"].dtype == "F8_E4M3" and "model.layers.2.attn.wq_a.scale" in hdr
    assert hdr["model.layers.2.ffn.experts.3.w1.weight"].dtype == "I8" and "layers.2.hc_head_fn" in hdr
  want = params if quant is None else _fake_quant_params(params, MTP, 128)
  got = load_checkpoint(ck, MTP, as_jax=False)
  assert _max_diff(want, got) == 0.0
  if quant is not None:  # FP4 kept for every routed expert, the block's too; the MoE dequantizes them exactly
    import jax.numpy as jnp
    from dsv4.layers import expert_quant
    kept = load_checkpoint(ck, MTP, as_jax=False, keep_quantized=True)
    for ffn_d, ffn_q in ((got["layers"][1]["ffn"], kept["layers"][1]["ffn"]),
                         (got["mtp"][0]["ffn"], kept["mtp"][0]["ffn"])):
      for k in ("w1", "w2", "w3"):
        assert set(ffn_q["experts"][k]) == {"fp4", "scale"}
        np.testing.assert_array_equal(np.asarray(expert_quant.dequant_fp4_kernel(ffn_q["experts"][k], jnp.float32)),
                                      ffn_d["experts"][k])
  base = dataclasses.replace(MTP, num_mtp_layers=0)
  plain = load_checkpoint(ck, base, as_jax=False)
  assert "mtp" not in plain and _max_diff({k: v for k, v in want.items() if k != "mtp"}, plain) == 0.0
  safetensors_write.save_checkpoint(_random_params(base, 9), base, str(tmp_path / "no"), naming=naming)
  with pytest.raises(CheckpointError, match=r"tensor 'mtp\.(layers\.)?0\.[^']*' is missing"):
    load_checkpoint(str(tmp_path / "no"), MTP)


def test_hf_directory_with_deepseek_spelled_mtp(tmp_path):
  """A hub directory: HF-named backbone next to the block as DeepSeek ships it (`mtp.0.*` with `.scale`
  companions) loads like the layer N + K form; a block stored both ways at once is refused."""
  params = _random_params(MTP, 10)
  quant = Quant(fp8_block=128)
  safetensors_write.save_checkpoint(params, MTP, str(tmp_path / "hf"), naming="hf", quant=quant)
  safetensors_write.save_checkpoint(params, MTP, str(tmp_path / "orig"), naming="original", quant=quant)
  hf = {k: safetensors_file.read_tensor(e) for k, e in safetensors_file.read_entries(str(tmp_path / "hf")).items()}
  t = {k: v for k, v in hf.items() if ".layers.2." not in "." + k}
  t.update({k: safetensors_file.read_tensor(e) for k, e in safetensors_file.read_entries(str(tmp_path / "orig")).items()
            if k.startswith("mtp.")})
  assert "mtp.0.attn.wq_a.scale" in t and "mtp.0.ffn.experts.0.w2.scale" in t
  os.makedirs(tmp_path / "hub")
  safetensors_file.write_file(t, str(tmp_path / "hub" / safetensors_file.SINGLE_FILE))
  assert checkpoint_naming.detect_naming(t) == "hf"
  got = load_checkpoint(str(tmp_path / "hub"), MTP, as_jax=False)
  assert _max_diff(_fake_quant_params(params, MTP, 128), got) == 0.0
  t["model.layers.2.attn.wq_a.weight"] = hf["model.layers.2.attn.wq_a.weight"]
  t["layers.2.e_proj.weight"] = hf["layers.2.e_proj.weight"]
  safetensors_file.write_file(t, str(tmp_path / "hub" / safetensors_file.SINGLE_FILE))
  with pytest.raises(CheckpointError, match=r"both MTP tensor 'mtp\.0\.(attn\.wq_a|e_proj)\.weight'"):
    load_checkpoint(str(tmp_path / "hub"), MTP)
