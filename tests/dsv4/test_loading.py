"""dsv4.loading: FP8 / FP4 dequantization, name mapping, safetensors round trips (HF and original names, plain and
quantized, single file and sharded), malformed checkpoints, orbax round trip."""

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest

from dsv4 import config
from dsv4 import model
from dsv4.loading import names
from dsv4.loading import quant
from dsv4.loading import safetensors_file, safetensors_write
from dsv4.loading import safetensors_write
from dsv4.loading.orbax_io import restore_params, save_params
from dsv4.loading.safetensors_file import CheckpointError
from dsv4.loading.safetensors_io import load_checkpoint
from dsv4.loading.safetensors_write import Quant, save_hf_safetensors


def _v41_tiny():
  return config.ModelConfig(
      name="v41_tiny", variant="v41", vocab_size=128, hidden_size=64, num_layers=6,
      compress_ratios=(0, 2, 2, 1, 1, 1),
      attention=config.AttentionConfig(num_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=32, o_groups=2,
                                  o_lora_rank=16, window=16),
      indexer=config.IndexerConfig(num_heads=8, head_dim=32, topk=8),
      moe=config.MoEConfig(n_routed_experts=8, num_experts_per_tok=2, intermediate_size=32, num_hash_layers=0),
      kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 2, 3, 5), candidate_source_layer_id=3)


def _random_params(cfg, seed):
  """Random numpy params of the right tree / shapes / dtypes (cheaper than model.init_params, same role)."""
  rng = np.random.default_rng(seed)

  def leaf(a):
    if np.issubdtype(a.dtype, np.integer):  # tid2eid: distinct experts per token
      E = cfg.moe.n_routed_experts
      return np.stack([rng.permutation(E)[: a.shape[1]] for _ in range(a.shape[0])]).astype(a.dtype)
    return (rng.standard_normal(a.shape) / np.sqrt(a.shape[-2] if len(a.shape) > 1 else 10)).astype(a.dtype)

  return jax.tree_util.tree_map(leaf, model.abstract_params(cfg))


@pytest.fixture(scope="module")
def tiny():
  cfg = config.v4_tiny()
  return cfg, _random_params(cfg, 0)


def _max_diff(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  assert all(np.shape(x) == np.shape(y) and np.asarray(x).dtype == np.asarray(y).dtype for x, y in zip(la, lb))
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in zip(la, lb))


# ----------------------------------------------------------------------------------------------------------
# Quantization formats

def test_e8m0_decoding():
  b = np.array([127, 130, 120, 0, 254], np.uint8)
  np.testing.assert_array_equal(quant.e8m0_to_float(b), np.float32([1, 8, 2.0 ** -7, 2.0 ** -127, 2.0 ** 127]))
  np.testing.assert_array_equal(quant.e8m0_to_float(b.view(ml_dtypes.float8_e8m0fnu)), quant.e8m0_to_float(b))


def test_fp4_nibble_order_low_first():
  # byte 0x21: low nibble 1 (0.5) is column 0, high nibble 2 (1.0) is column 1; 0xF9: -0.5 then -6.
  packed = np.array([[0x21, 0xF9 - 256]], np.int8)
  np.testing.assert_array_equal(quant.unpack_fp4(packed), np.float32([[0.5, 1.0, -0.5, -6.0]]))


@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("shape", [(256, 384), (100, 70), (3, 40, 72)])
def test_fp8_block_round_trip(block, shape):
  rng = np.random.default_rng(0)
  w = (rng.standard_normal(shape) * np.exp(rng.uniform(-6, 3, shape))).astype(np.float32)
  q, s = quant.quantize_fp8_block(w, block)
  assert q.dtype == ml_dtypes.float8_e4m3fn and s.dtype == ml_dtypes.float8_e8m0fnu
  assert s.shape == (*shape[:-2], -(-shape[-2] // block), -(-shape[-1] // block))
  d = quant.dequant_fp8_block(q, s, block)
  scale = quant._expand_blocks(quant.e8m0_to_float(s), shape[-2], shape[-1], block, block)
  # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals, absolute <= 2^-10 * scale for subnormals
  assert np.all(np.abs(d - w) <= np.maximum(np.abs(w) * 2.0 ** -4, scale * 2.0 ** -10) * 1.0001)
  # idempotent: the dequantized grid re-quantizes to the same values (the scale may drop by 2x when rounding
  # brought a block's max down onto the next power of two)
  np.testing.assert_array_equal(quant.dequant_fp8_block(*quant.quantize_fp8_block(d, block), block), d)
  np.testing.assert_array_equal(quant.dequant_fp8_block(q.view(np.uint8), s.view(np.uint8), block), d)


def test_fp4_round_trip_exact_and_bounded():
  rng = np.random.default_rng(1)
  R, C = 24, 128
  codes = rng.integers(0, 16, (R, C)).astype(np.uint8)
  codes[:, ::32] = 7  # every 32-group holds +6, so requantization picks the same scale
  exps = rng.integers(100, 140, (R, C // 32)).astype(np.uint8)
  packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.int8)
  vals = quant.dequant_fp4(packed, exps)
  np.testing.assert_array_equal(vals, quant.FP4_E2M1_VALUES[codes] * np.repeat(quant.e8m0_to_float(exps), 32, axis=1))
  p2, s2 = quant.quantize_fp4(vals)
  np.testing.assert_array_equal(quant.dequant_fp4(p2, s2), vals)
  np.testing.assert_array_equal(s2.view(np.uint8), exps)
  # arbitrary floats: error at most half the widest e2m1 gap (1.0 between 4 and 6) times the group scale
  w = rng.standard_normal((5, 16, 64)).astype(np.float32)
  p, s = quant.quantize_fp4(w)
  assert p.shape == (5, 16, 32) and s.shape == (5, 16, 2)
  err = np.abs(quant.dequant_fp4(p, s) - w)
  assert np.all(err <= np.repeat(quant.e8m0_to_float(s), 32, axis=-1) * 1.0 + 1e-7)


def test_quant_errors():
  q, s = quant.quantize_fp8_block(np.ones((64, 64), np.float32), 32)
  with pytest.raises(quant.QuantError, match="scale shape"):
    quant.dequant_fp8_block(q, s, 128)
  p, s = quant.quantize_fp4(np.ones((4, 64), np.float32))
  with pytest.raises(quant.QuantError, match="scale shape"):
    quant.dequant_fp4(p, s[:, :1])


# ----------------------------------------------------------------------------------------------------------
# Names

def test_original_names_and_renames(tiny):
  cfg, _ = tiny
  orig = {s.name: s.shape for s in names.original_specs(cfg)}
  for name, shape in {
      "embed.weight": (512, 64), "head.weight": (512, 64), "norm.weight": (64,), "hc_head_fn": (4, 256),
      "hc_head_scale": (1,), "layers.0.hc_attn_fn": (24, 256), "layers.3.hc_ffn_base": (24,),
      "layers.0.attn.attn_sink": (4,), "layers.0.attn.wo_a.weight": (32, 128), "layers.0.attn.q_norm.weight": (32,),
      "layers.0.ffn.gate.tid2eid": (512, 2), "layers.1.ffn.gate.bias": (8,),
      "layers.2.ffn.experts.7.w2.weight": (64, 32), "layers.2.ffn.experts.0.w1.weight": (32, 64),
      "layers.1.ffn.shared_experts.w3.weight": (32, 64), "layers.1.attn.compressor.ape": (4, 128),
      "layers.2.attn.compressor.ape": (16, 64), "layers.1.attn.indexer.compressor.norm.weight": (32,),
      "layers.3.attn.indexer.wq_b.weight": (256, 32), "layers.3.attn.indexer.weights_proj.weight": (8, 64),
  }.items():
    assert orig[name] == shape, name
  assert "layers.0.attn.compressor.wkv.weight" not in orig and "layers.2.attn.indexer.wq_b.weight" not in orig
  ren = names.original_to_hf_name
  assert ren("layers.1.attn.indexer.compressor.ape") == "model.layers.1.self_attn.compressor.indexer.position_bias"
  assert ren("layers.1.attn.indexer.weights_proj.weight") == \
      "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight"
  assert ren("layers.1.attn.compressor.norm.weight") == "model.layers.1.self_attn.compressor.kv_norm.weight"
  assert ren("layers.1.attn.kv_norm.weight") == "model.layers.1.self_attn.kv_norm.weight"
  assert ren("hc_head_base") == "model.hc_head.hc_base" and ren("head.weight") == "lm_head.weight"
  assert names.expert_target("layers.2.ffn.experts.5.w3.weight") == ("model.layers.2.mlp.experts.gate_up_proj", 5, "w3")
  hf = names.hf_specs(cfg)
  assert len(hf) == 122  # the state_dict size of the tiny HF oracle (tests/dsv4/oracle_util.py)
  assert hf["model.layers.2.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
  assert hf["model.layers.2.mlp.experts.down_proj"].shape == (8, 64, 32)
  # every param leaf is covered exactly once
  paths = {s.path for s in names.original_specs(cfg)}
  leaves = jax.tree_util.tree_leaves_with_path(model.abstract_params(cfg))
  assert len(paths) == len(leaves)


def test_v41_names():
  cfg = _v41_tiny()
  tensor_names = {s.name for s in names.original_specs(cfg)}
  assert {"layers.1.attn.indexer.wk.weight", "layers.1.attn.indexer.k_norm.weight",
          "layers.2.attn.indexer.wq_b.weight", "layers.1.attn.compressor.wgate.weight"} <= tensor_names
  assert "layers.3.attn.compressor.wgate.weight" not in tensor_names  # ratio 1: no gate
  assert not any(n.endswith(".ape") or "tid2eid" in n for n in tensor_names)


# ----------------------------------------------------------------------------------------------------------
# Round trips

def test_hf_round_trip_single_file(tiny, tmp_path):
  cfg, params = tiny
  files = save_hf_safetensors(params, cfg, str(tmp_path))
  assert [os.path.basename(f) for f in files] == ["model.safetensors"]
  got = load_checkpoint(str(tmp_path), cfg, as_jax=False)
  assert _max_diff(params, got) == 0.0
  got2 = load_checkpoint(files[0], cfg)  # a file path works too, and as_jax gives jax arrays
  assert isinstance(got2["embed"], jax.Array) and _max_diff(params, got2) == 0.0


def test_original_round_trip_sharded(tiny, tmp_path):
  cfg, params = tiny
  files = safetensors_write.save_original_safetensors(params, cfg, str(tmp_path), shard_bytes=60_000)
  assert len(files) > 3 and os.path.exists(tmp_path / safetensors_file.INDEX_FILE)
  wmap = json.load(open(tmp_path / safetensors_file.INDEX_FILE))["weight_map"]
  assert "layers.2.ffn.experts.3.w1.weight" in wmap
  got = load_checkpoint(str(tmp_path), cfg, as_jax=False)
  assert _max_diff(params, got) == 0.0


def _fake_quant_params(params, cfg, block):
  """What a quantized checkpoint must load to: dequant(quant(x)) per stored tensor, computed independently of the
  writer (same formats, per original tensor)."""
  t = names.params_to_original(params, cfg)
  for name in list(t):
    if safetensors_write._FP8_ORIG.match(name):
      t[name] = quant.dequant_fp8_block(*quant.quantize_fp8_block(t[name], block), block)
    elif safetensors_write._FP4_ORIG.match(name):
      t[name] = quant.dequant_fp4(*quant.quantize_fp4(t[name]))
  return names.original_to_params(t, cfg)


@pytest.mark.parametrize("naming", ["original", "hf"])
def test_quantized_round_trip(tiny, tmp_path, naming):
  cfg, params = tiny
  save = safetensors_write.save_original_safetensors if naming == "original" else save_hf_safetensors
  save(params, cfg, str(tmp_path), quant=Quant(fp8_block=128, fp4_experts=True), shard_bytes=40_000)
  hdr = {}
  for f in os.listdir(tmp_path):
    if f.endswith(".safetensors"):
      hdr.update(safetensors_file.read_header(str(tmp_path / f)))
  if naming == "original":
    assert hdr["layers.1.attn.wq_a.weight"].dtype == "F8_E4M3"
    assert hdr["layers.1.attn.wq_a.scale"].dtype == "F8_E8M0" and hdr["layers.1.attn.wq_a.scale"].shape == (1, 1)
    assert hdr["layers.1.ffn.experts.2.w2.weight"].dtype == "I8"
    assert hdr["layers.1.ffn.experts.2.w2.weight"].shape == (64, 16)
    assert hdr["layers.1.ffn.experts.2.w2.scale"].shape == (64, 1)
    assert hdr["layers.1.attn.compressor.wkv.weight"].dtype == "F32"
  else:
    assert hdr["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 32)
    assert hdr["model.layers.1.mlp.experts.gate_up_proj_scale_inv"].shape == (8, 64, 2)
    assert hdr["model.layers.1.self_attn.o_a_proj.weight_scale_inv"].dtype == "F8_E8M0"
  got = load_checkpoint(str(tmp_path), cfg, as_jax=False)
  assert _max_diff(_fake_quant_params(params, cfg, 128), got) == 0.0
  assert _max_diff(params, got) < 0.2  # FP4 is coarse; the exact check is the line above


def test_v41_quantized_round_trip_32x32_blocks(tmp_path):
  cfg = _v41_tiny()
  params = _random_params(cfg, 3)
  safetensors_write.save_original_safetensors(params, cfg, str(tmp_path / "o"), quant=Quant(fp8_block=32))
  h = safetensors_file.read_header(str(tmp_path / "o" / safetensors_file.SINGLE_FILE))
  assert h["layers.1.attn.wq_b.scale"].shape == (8, 1)  # stored [256, 32] in 32x32 blocks
  got = load_checkpoint(str(tmp_path / "o"), cfg, as_jax=False)  # default block for v41 is 32
  assert _max_diff(_fake_quant_params(params, cfg, 32), got) == 0.0
  with pytest.raises(CheckpointError, match=r"layers\.\d+\.attn\.wq_a\.weight.*128x128"):
    load_checkpoint(str(tmp_path / "o"), cfg, fp8_block=128)
  save_hf_safetensors(params, cfg, str(tmp_path / "h"))
  assert _max_diff(params, load_checkpoint(str(tmp_path / "h"), cfg, as_jax=False)) == 0.0


# ----------------------------------------------------------------------------------------------------------
# Malformed checkpoints

def _write(tmp_path, tensors, name="bad.safetensors"):
  p = str(tmp_path / name)
  safetensors_file.write_file(tensors, p)
  return p


def test_missing_unexpected_shape_dtype(tiny, tmp_path):
  cfg, params = tiny
  sd = safetensors_write.hf_state_dict(params, cfg)
  t = dict(sd)
  del t["model.layers.2.self_attn.compressor.position_bias"]
  with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.compressor\.position_bias.*missing"):
    load_checkpoint(_write(tmp_path, t), cfg)
  t = dict(sd, **{"model.layers.0.self_attn.compressor.kv_proj.weight": np.zeros((64, 64), np.float32)})
  with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.compressor\.kv_proj\.weight.*not a"):
    load_checkpoint(_write(tmp_path, t), cfg)
  load_checkpoint(_write(tmp_path, t), cfg, strict=False)  # tolerated when asked
  t = dict(sd, **{"model.layers.3.self_attn.o_a_proj.weight": np.zeros((32, 64), np.float32)})
  with pytest.raises(CheckpointError, match=r"o_a_proj\.weight.*shape \[32, 64\], expected \[32, 128\]"):
    load_checkpoint(_write(tmp_path, t), cfg)
  t = dict(sd, **{"model.layers.1.self_attn.sinks": np.zeros((4,), np.int64)})
  with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.sinks.*dtype I64, expected a floating"):
    load_checkpoint(_write(tmp_path, t), cfg)
  t = dict(sd, **{"model.layers.0.mlp.gate.tid2eid": sd["model.layers.0.mlp.gate.tid2eid"].astype(np.float32)})
  with pytest.raises(CheckpointError, match=r"tid2eid.*dtype F32, expected an integer"):
    load_checkpoint(_write(tmp_path, t), cfg)
  t = dict(sd, **{"model.layers.0.mlp.gate.tid2eid": sd["model.layers.0.mlp.gate.tid2eid"] + 8})
  with pytest.raises(CheckpointError, match=r"tid2eid.*expert ids must lie in \[0, 8\)"):
    load_checkpoint(_write(tmp_path, t), cfg)
  # bf16 is accepted and upcast
  t = dict(sd, **{"model.norm.weight": sd["model.norm.weight"].astype(ml_dtypes.bfloat16)})
  assert load_checkpoint(_write(tmp_path, t), cfg, as_jax=False)["norm"].dtype == np.float32


def test_original_naming_errors_name_the_original_tensor(tiny, tmp_path):
  cfg, params = tiny
  t = names.params_to_original(params, cfg)
  del t["layers.3.ffn.experts.6.w3.weight"]
  with pytest.raises(CheckpointError, match=r"layers\.3\.ffn\.experts\.6\.w3\.weight.*missing"):
    load_checkpoint(_write(tmp_path, t), cfg)
  t = names.params_to_original(params, cfg)
  t["layers.3.ffn.experts.6.w3.weight"] = t["layers.3.ffn.experts.6.w3.weight"][:, :32]
  with pytest.raises(CheckpointError, match=r"layers\.3\.ffn\.experts\.6\.w3\.weight.*gate_up_proj.*shape \[32, 32\]"):
    load_checkpoint(_write(tmp_path, t), cfg)
  # FP8 weight without its scale; scale of the wrong grid
  t = names.params_to_original(params, cfg)
  q, s = quant.quantize_fp8_block(t["layers.0.attn.wq_b.weight"], 128)
  t["layers.0.attn.wq_b.weight"] = q
  with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_b\.weight.*F8_E4M3 needs a block-scale"):
    load_checkpoint(_write(tmp_path, t), cfg)
  t["layers.0.attn.wq_b.scale"] = np.concatenate([s, s], axis=0)
  with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wq_b\.weight.*scale shape \[4, 1\].*expected \[2, 1\]"):
    load_checkpoint(_write(tmp_path, t), cfg)
  t["layers.0.attn.wq_b.scale"] = s
  load_checkpoint(_write(tmp_path, t), cfg)
  # mixed naming
  t["model.norm.weight"] = t.pop("norm.weight")
  with pytest.raises(CheckpointError, match="mixes HF names"):
    load_checkpoint(_write(tmp_path, t), cfg)


def test_truncated_and_garbage_files(tiny, tmp_path):
  cfg, params = tiny
  (f,) = save_hf_safetensors(params, cfg, str(tmp_path / "ok"))
  data = open(f, "rb").read()
  hdr = safetensors_file.read_header(f)
  last = max(hdr.values(), key=lambda e: e.start)
  cut = tmp_path / "cut.safetensors"
  cut.write_bytes(data[: last.start + 10])
  with pytest.raises(CheckpointError, match=rf"{last.name.replace('.', '[.]')}.*truncated"):
    load_checkpoint(str(cut), cfg)
  bad = tmp_path / "garbage.safetensors"
  bad.write_bytes(os.urandom(4096))
  with pytest.raises(CheckpointError, match="garbage.safetensors: not a safetensors file"):
    load_checkpoint(str(bad), cfg)
  bad.write_bytes((20).to_bytes(8, "little") + b"{not json at all....}" + b"\0" * 100)
  with pytest.raises(CheckpointError, match="corrupt safetensors header"):
    load_checkpoint(str(bad), cfg)
  bad.write_bytes(b"abc")
  with pytest.raises(CheckpointError, match="not a safetensors file"):
    load_checkpoint(str(bad), cfg)
  with pytest.raises(CheckpointError, match="no such checkpoint"):
    load_checkpoint(str(tmp_path / "nope"), cfg)


def test_sharded_index_inconsistencies(tiny, tmp_path):
  cfg, params = tiny
  files = save_hf_safetensors(params, cfg, str(tmp_path), shard_bytes=50_000)
  idx = tmp_path / safetensors_file.INDEX_FILE
  good = json.load(open(idx))
  bad = json.loads(json.dumps(good))
  name = "model.layers.3.self_attn.compressor.indexer.q_b_proj.weight"
  other = next(os.path.basename(f) for f in files if os.path.basename(f) != good["weight_map"][name])
  bad["weight_map"][name] = other
  json.dump(bad, open(idx, "w"))
  with pytest.raises(CheckpointError, match=rf"{name.replace('.', '[.]')}.*index maps it to"):
    load_checkpoint(str(tmp_path), cfg)
  bad = json.loads(json.dumps(good))
  bad["weight_map"][name] = "model-99999-of-99999.safetensors"
  json.dump(bad, open(idx, "w"))
  with pytest.raises(CheckpointError, match="does not exist"):
    load_checkpoint(str(tmp_path), cfg)
  bad = json.loads(json.dumps(good))
  del bad["weight_map"][name]
  json.dump(bad, open(idx, "w"))
  with pytest.raises(CheckpointError, match=rf"{name.replace('.', '[.]')}.*not listed in the index"):
    load_checkpoint(str(tmp_path), cfg)
  json.dump(good, open(idx, "w"))
  assert _max_diff(params, load_checkpoint(str(tmp_path), cfg, as_jax=False)) == 0.0


# ----------------------------------------------------------------------------------------------------------
# Orbax

def test_orbax_round_trip_and_validation(tiny, tmp_path):
  cfg, params = tiny
  save_params(params, str(tmp_path / "ck"))
  got = restore_params(str(tmp_path / "ck"), cfg)
  assert _max_diff(params, jax.tree_util.tree_map(np.asarray, got)) == 0.0
  with pytest.raises(CheckpointError,
                     match=r"param 'layers/2/attn/compressor/ape'.*shape \[16, 64\], expected \[32, 64\]"):
    restore_params(str(tmp_path / "ck"), config.v4_tiny(hca_ratio=32))
  with pytest.raises(CheckpointError, match=r"param 'layers/4/.*missing"):
    restore_params(str(tmp_path / "ck"), config.v4_tiny(num_layers=5))
  with pytest.raises(CheckpointError, match="no such orbax"):
    restore_params(str(tmp_path / "nothing"), cfg)
