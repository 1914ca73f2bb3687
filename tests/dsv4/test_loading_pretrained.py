"""load_pretrained + `python -m experiments.serve --checkpoint=DIR` on tiny synthetic checkpoint directories
(config.json + safetensors shards + tokenizer) in every naming, and the errors a broken directory gives."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

from dsv4 import config
from dsv4.config import ConfigError
from dsv4.loading import quant
from dsv4.loading import checkpoint_naming, safetensors_file, safetensors_io, safetensors_write
from dsv4.loading.pretrained import load_pretrained
from dsv4.loading.safetensors_file import CheckpointError
from dsv4.loading.safetensors_write import Quant
from tests.dsv4 import oracle_util
from tests.dsv4 import v41_oracle
from tests.dsv4.test_loading import _max_diff, _random_params, _v41_tiny
from tests.dsv4.test_tokenizer import make_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_checkpoint_dir(path, naming: str, seed: int = 0, *, shard_bytes: int = 80_000, mtp: int = 0,
                        mtp_declared: bool = False):
  """A tiny checkpoint directory as a user would download it: bf16 shards + index, config.json, tokenizer. V4:
  `mtp` MTP blocks stored; config.json declares them (num_nextn_predict_layers), or one when mtp_declared."""
  if naming == "nemo" and not mtp:
    cfg = _v41_tiny()
    conf = {"model_type": "deepseek_v41_text", **v41_oracle.nemo_text_kwargs(cfg)}
  else:
    cfg = dataclasses.replace(config.v4_tiny(), num_mtp_layers=mtp)
    conf = {"model_type": "deepseek_v4", **oracle_util.HF_TINY_KWARGS,
            "num_nextn_predict_layers": max(mtp, int(mtp_declared))}
  params = _random_params(cfg, seed)
  os.makedirs(path, exist_ok=True)
  safetensors_write.save_checkpoint(params, cfg, str(path), naming=naming, shard_bytes=shard_bytes,
                                    dtype=ml_dtypes.bfloat16)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(conf, f)
  make_tokenizer(cfg.vocab_size).save(str(path))
  return cfg, params


@pytest.mark.parametrize("naming", ["original", "hf", "saved", "nemo"])
def test_load_pretrained_every_naming(tmp_path, naming):
  cfg, params = make_checkpoint_dir(tmp_path, naming)
  pre = load_pretrained(str(tmp_path))
  assert pre.config.layer_plan() == cfg.layer_plan()
  assert pre.dtype == ml_dtypes.bfloat16  # dtype "auto" of a bf16 save
  assert pre.tokenizer is not None and pre.tokenizer.eos_token_id == pre.config.eos_token_id
  leaves = jax.tree_util.tree_leaves(pre.params)
  assert all(x.dtype in (np.int32, ml_dtypes.bfloat16) for x in leaves)
  want = jax.tree_util.tree_map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16)
                                if np.issubdtype(np.asarray(x).dtype, np.floating) else np.asarray(x), params)
  assert _max_diff(want, jax.tree_util.tree_map(np.asarray, pre.params)) == 0.0


@pytest.mark.parametrize("naming", ["original", "hf", "nemo"])
def test_the_mtp_block_config_json_declares(tmp_path, naming):
  """config.json's num_nextn_predict_layers: the stored block loads by default (mtp=None), mtp=False skips it; a
  directory that declares a block it does not store (a transformers export) loads without it, unless mtp=True."""
  cfg, params = make_checkpoint_dir(tmp_path / "with", naming, mtp=1)
  pre = load_pretrained(str(tmp_path / "with"))
  assert pre.config.num_mtp_layers == 1 and pre.info.mtp_layers == 1
  want = jax.tree_util.tree_map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16)
                                if np.issubdtype(np.asarray(x).dtype, np.floating) else np.asarray(x), params["mtp"])
  assert _max_diff(want, jax.tree_util.tree_map(np.asarray, pre.params["mtp"])) == 0.0
  skipped = load_pretrained(str(tmp_path / "with"), mtp=False)
  assert skipped.config.num_mtp_layers == 0 and "mtp" not in skipped.params
  if naming != "original":
    return
  make_checkpoint_dir(tmp_path / "without", naming, mtp_declared=True)
  assert checkpoint_naming.stored_mtp_blocks(str(tmp_path / "without"), cfg.num_layers) == 0
  assert load_pretrained(str(tmp_path / "without")).config.num_mtp_layers == 0
  with pytest.raises(CheckpointError, match="mtp.0"):
    load_pretrained(str(tmp_path / "without"), mtp=True)


@pytest.mark.parametrize("stored,quant,want", [
    (np.float32, None, np.float32), (ml_dtypes.bfloat16, None, ml_dtypes.bfloat16),
    (np.float32, Quant(fp8_block=128), np.float32), (ml_dtypes.bfloat16, Quant(fp8_block=128), ml_dtypes.bfloat16)])
def test_dtype_auto_is_the_checkpoint_storage_dtype(tmp_path, stored, quant, want):
  """dtype="auto": the dtype of the checkpoint's plain float tensors; FP8 / FP4 tensors (and their F32 / E8M0
  scales) do not count and dequantize into it."""
  cfg = config.v4_tiny()
  safetensors_write.save_checkpoint(_random_params(cfg, 7), cfg, str(tmp_path), naming="hf", dtype=stored, quant=quant)
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", **oracle_util.HF_TINY_KWARGS}))
  assert safetensors_io.storage_dtype(str(tmp_path)) == want
  pre = load_pretrained(str(tmp_path), tokenizer=False)
  assert pre.dtype == want
  assert {np.asarray(x).dtype for x in jax.tree_util.tree_leaves(pre.params)} == {np.dtype(want), np.dtype(np.int32)}
  other = np.float32 if want == ml_dtypes.bfloat16 else ml_dtypes.bfloat16
  assert load_pretrained(str(tmp_path), dtype=other, tokenizer=False).dtype == other


def test_dtype_auto_counts_elements_and_refuses_other_dtypes(tmp_path):
  cfg = config.v4_tiny()
  safetensors_write.save_checkpoint(_random_params(cfg, 8), cfg, str(tmp_path), naming="hf", dtype=ml_dtypes.bfloat16)
  fp = os.path.join(tmp_path, safetensors_file.SINGLE_FILE)
  t = {k: safetensors_file.read_tensor(e) for k, e in safetensors_file.read_header(fp).items()}
  for k in t:  # released checkpoints keep a few small tensors (norms, router biases) in F32: still bf16
    if k.endswith(("norm.weight", "e_score_correction_bias")):
      t[k] = t[k].astype(np.float32)
  safetensors_file.write_file(t, fp)
  assert {e.dtype for e in safetensors_file.read_header(fp).values()} >= {"F32", "BF16"}
  assert safetensors_io.storage_dtype(str(tmp_path)) == ml_dtypes.bfloat16
  # nothing but quantized tensors and scales: bfloat16
  q = tmp_path / "q"
  q.mkdir()
  w, sc = quant.quantize_fp8_block(np.ones((128, 128), np.float32), 128)
  safetensors_file.write_file({"layers.0.attn.wq_a.weight": w, "layers.0.attn.wq_a.scale": sc},
                            str(q / safetensors_file.SINGLE_FILE))
  assert safetensors_io.storage_dtype(str(q)) == ml_dtypes.bfloat16
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", **oracle_util.HF_TINY_KWARGS}))
  for bad in (np.float16, "fp16", np.int32):
    with pytest.raises(ValueError, match="dtype must be 'auto', float32 or bfloat16"):
      load_pretrained(str(tmp_path), dtype=bad)
  assert load_pretrained(str(tmp_path), dtype="fp32", tokenizer=False).dtype == np.float32


def test_nemo_export_with_only_text_config_json(tmp_path):
  """A NeMo Automodel export holding text_config.json and no config.json loads; like NeMo, its cache is
  fake-quantized unless quantized_cache=False. generation_config.json's EOS ids join config.json's."""
  cfg, params = make_checkpoint_dir(tmp_path, "nemo")
  os.rename(tmp_path / "config.json", tmp_path / "text_config.json")
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
  pre = load_pretrained(str(tmp_path))
  assert pre.info.format == "nemo" and pre.config.quantized_cache and pre.config.layer_plan() == cfg.layer_plan()
  assert pre.eos_token_ids == (1, 5)
  assert not load_pretrained(str(tmp_path), quantized_cache=False, tokenizer=False).config.quantized_cache
  os.remove(tmp_path / "text_config.json")
  with pytest.raises(ConfigError, match=r"config\.json: no such config file \(nor text_config\.json\)"):
    load_pretrained(str(tmp_path))


def test_broken_directories_fail_clearly(tmp_path):
  make_checkpoint_dir(tmp_path, "saved")
  conf = (tmp_path / "config.json").read_text()
  (tmp_path / "config.json").write_text(conf[:-5])
  with pytest.raises(ConfigError, match=r"config\.json: malformed JSON"):
    load_pretrained(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps({**json.loads(conf), "hidden_size": 96}))
  with pytest.raises(CheckpointError, match=r"shape \[\d+(, \d+)*\], expected \[.*96"):
    load_pretrained(str(tmp_path))
  (tmp_path / "config.json").write_text(conf)
  shard = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))[2]
  os.remove(tmp_path / shard)
  with pytest.raises(CheckpointError, match=f"shard '{shard}'.*does not exist"):
    load_pretrained(str(tmp_path))


def test_serve_main_job_on_a_checkpoint_dir(tmp_path):
  """The main job `python -m experiments.serve --checkpoint=DIR` on a synthetic dir (transformers save_pretrained
  naming): text, chat and stop strings."""
  ckpt = tmp_path / "ckpt"
  make_checkpoint_dir(ckpt, "saved")
  reqs = tmp_path / "reqs.jsonl"
  reqs.write_text("\n".join(json.dumps(d) for d in [
      {"id": "text", "prompt": "w10 w11 w12", "max_tokens": 6, "ignore_eos": True},
      {"id": "chat", "messages": [{"role": "user", "content": "w40 w41"}], "max_tokens": 6, "ignore_eos": True,
       "stop": ["never-there"]},
      {"id": "ids", "prompt": [10, 11, 12], "max_tokens": 6, "ignore_eos": True},
  ]) + "\n")
  out = tmp_path / "out"
  cmd = [sys.executable, "-m", "experiments.serve", f"--checkpoint={ckpt}", f"--requests={reqs}",
         f"--out_dir={out}", "--max_num_seqs=2", "--max_num_batched_tokens=64", "--chunk_size=32",
         "--max_model_len=256", "--num_full_blocks=8", "--num_swa_blocks=32", "--compilation_cache_dir="]
  r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = {d["id"]: d for d in map(json.loads, (out / "outputs.jsonl").read_text().splitlines())}
  assert all(rows[k]["error"] is None and len(rows[k]["output"]) == 6 for k in rows)
  assert rows["text"]["output"] == rows["ids"]["output"]  # text prompt == the same ids
  tok = make_tokenizer(512)
  assert rows["text"]["text"] == tok.decode(rows["text"]["output"]) and rows["text"]["text"]
  assert rows["chat"]["prompt_len"] == 6  # <s> <|user|> w40 w41 <|end|> <|assistant|>
  # a bad directory: clear error, non-zero exit
  (ckpt / "config.json").write_text("{")
  r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
  assert r.returncode != 0 and "config.json: malformed JSON" in r.stderr


@pytest.mark.slow
def test_serve_drafts_with_a_release_directorys_mtp_block(tmp_path):
  """`serve --checkpoint=DIR --num_speculative_tokens=2` on an HF-named directory whose MTP block is stored as
  layer N + K: the block loads, drafts, and the answers equal serving without drafts (greedy); metrics.json reports
  the drafts' acceptance."""
  ckpt = tmp_path / "ckpt"
  make_checkpoint_dir(ckpt, "hf", mtp=1)
  reqs = tmp_path / "reqs.jsonl"
  reqs.write_text("\n".join(json.dumps({"id": f"r{i}", "prompt": [10 + i, 11, 12, 13 + i] * (i + 1),
                                         "max_tokens": 12, "ignore_eos": True}) for i in range(3)) + "\n")
  runs = {}
  for k in (0, 2):
    out = tmp_path / f"out{k}"
    r = subprocess.run([sys.executable, "-m", "experiments.serve", f"--checkpoint={ckpt}", f"--requests={reqs}",
                        f"--out_dir={out}", f"--num_speculative_tokens={k}", "--max_num_seqs=2",
                        "--max_num_batched_tokens=64", "--chunk_size=32", "--max_model_len=256",
                        "--num_full_blocks=8", "--num_swa_blocks=48", "--compilation_cache_dir="],
                       cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {d["id"]: d for d in map(json.loads, (out / "outputs.jsonl").read_text().splitlines())}
    runs[k] = ({i: (d["error"], d["output"]) for i, d in rows.items()},
               json.loads((out / "metrics.json").read_text())["summary"])
  assert all(e is None and len(o) == 12 for e, o in runs[0][0].values())
  assert runs[2][0] == runs[0][0]
  s = runs[2][1]
  assert s["draft_tokens"] > 0 and 0 <= s["accepted_draft_tokens"] <= s["draft_tokens"]
  assert "draft_tokens" not in runs[0][1]


def test_v41_engram_token_map_comes_from_the_tokenizer(tmp_path):
  """A NeMo V4.1 dir with Engram: the normalised-vocabulary token map is derived from the dir's tokenizer.json
  and equals the map computed from the transformers tokenizer it was saved from."""
  from dsv4 import model
  from dsv4.layers import engram
  cfg = config.v41_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  safetensors_write.save_checkpoint(params, cfg, str(tmp_path), naming="nemo", shard_bytes=300_000)
  with open(tmp_path / "config.json", "w") as f:
    json.dump({"model_type": "deepseek_v41_text", **v41_oracle.nemo_text_kwargs(cfg)}, f)
  hf_tok = v41_oracle.tiny_tokenizer(cfg.vocab_size)
  hf_tok.save_pretrained(str(tmp_path))
  pre = load_pretrained(str(tmp_path), dtype=np.float32)
  want, n = engram.compressed_token_map(hf_tok)
  assert n == cfg.engram.compressed_vocab_size
  np.testing.assert_array_equal(np.asarray(pre.params["engram_token_map"]), want)
  assert not np.array_equal(want, np.arange(cfg.vocab_size))  # the map is not the identity
  # a tokenizer whose normalised vocabulary does not match config.json is refused by name
  with open(tmp_path / "config.json", "w") as f:
    json.dump({"model_type": "deepseek_v41_text", **v41_oracle.nemo_text_kwargs(cfg),
               "engram_compressed_vocab_size": cfg.engram.compressed_vocab_size + 1}, f)
  with pytest.raises(CheckpointError, match="engram_compressed_vocab_size"):
    load_pretrained(str(tmp_path))
