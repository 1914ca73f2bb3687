"""experiments.export_checkpoint: a shipped trained model written as a release-format directory (transformers
config.json, transformers-named float32 safetensors, a task-vocabulary tokenizer with a chat template) loads back
bit for bit and answers recall questions asked as text and as a chat through generate_text."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from dsv4.engine.api import generate_text
from dsv4.engine.config import EngineConfig
from dsv4.engine.sampling import SamplingParams
from dsv4.loading import checkpoint_naming, safetensors_file
from dsv4.loading.pretrained import load_pretrained
from experiments import export_checkpoint
from experiments import tasks, train_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("v4_retrieval_hf"))
  export_checkpoint.export("v4_retrieval", out, force=True)
  return out, load_pretrained(out)


def test_round_trip_is_bit_for_bit(exported):
  out, pre = exported
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
  assert checkpoint_naming.detect_naming(safetensors_file.read_entries(out)) == "hf"
  assert pre.info.format == "transformers" and pre.dtype == np.float32  # dtype "auto" of an fp32 save
  cfg, params = train_lib.load_trained("v4_retrieval")
  assert pre.config.layer_plan() == cfg.layer_plan() and not pre.config.quantized_cache
  assert jax.tree_util.tree_structure(pre.params) == jax.tree_util.tree_structure(params)
  for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(pre.params)):
    want, got = np.asarray(want), np.asarray(got)
    assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8)), path
  tok = pre.tokenizer
  assert len(tok) == 64 and tok.bos_token_id == 0 and tok.eos_token_id == pre.config.eos_token_id == 1
  assert tok.decode(list(range(10)), skip_special_tokens=False) == "<bos> <eos> <sep> f3 f4 f5 f6 f7 k8 k9"
  assert tok.decode([40, 63]) == "v40 v63"


def _questions(tok, spec, row):
  """(text prompt, chat, answer ids) of one held-out recall sequence: the text asks the first query key; the chat
  holds the document as the system message and the first query answered, then asks the second."""
  b = tasks.make_kv_batch(spec, tasks.EVAL_SEED_BASE, row + 1)
  t = b["tokens"][row].tolist()
  q0 = spec.seq_len - spec.query_len
  words = tok.decode(t, skip_special_tokens=False).split(" ")
  text = " ".join(words[1: q0 + 2])            # "f7 f4 k24 v61 ... <sep> k39" (the post-processor adds <bos>)
  chat = [{"role": "system", "content": " ".join(words[1:q0])}, {"role": "user", "content": words[q0 + 1]},
          {"role": "assistant", "content": words[q0 + 2]}, {"role": "user", "content": words[q0 + 3]}]
  assert tok.encode(text) == t[: q0 + 2]
  assert tok.apply_chat_template(chat, tokenize=True) == t[: q0 + 4]
  return text, chat, (t[q0 + 2], t[q0 + 4])


def test_text_and_chat_prompts_answer_through_generate_text(exported):
  _, pre = exported
  _, _, info = train_lib.load_checkpoint_dir(os.path.join(train_lib.CHECKPOINT_ROOT, "v4_retrieval"))
  spec = train_lib.task_spec_from_info(info)
  text0, chat0, ans0 = _questions(pre.tokenizer, spec, 0)
  text1, _, ans1 = _questions(pre.tokenizer, spec, 1)
  ec = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, chunk_size=32, max_model_len=256, num_full_blocks=8,
                    num_swa_blocks=32)
  outs = generate_text(pre.params, pre.config, pre.tokenizer, [text0, chat0, text1], SamplingParams(max_tokens=1),
                       engine_config=ec)
  assert [o.error for o in outs] == [None] * 3
  assert [o.token_ids for o in outs] == [[ans0[0]], [ans0[1]], [ans1[0]]]
  assert outs[0].text == f"v{ans0[0]}" and outs[1].text == f"v{ans0[1]}"


def test_cli_writes_and_refuses_to_overwrite(tmp_path):
  out = tmp_path / "ckpt"
  cmd = [sys.executable, "-m", "experiments.export_checkpoint", "--model=v4_count", f"--out={out}"]
  r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and r.stdout.strip() == f"wrote {out}", r.stderr[-2000:]
  assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
  r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert r.returncode != 0 and "not empty" in r.stderr


def test_v41_exports_as_nemo_and_loads_with_the_quantized_cache_switch(tmp_path):
  """V4.1 has no transformers model: it is written as NeMo's text config + NeMo-named tensors, so it loads with
  NeMo's quantized cache on; quantized_cache=False gives back exactly the shipped model."""
  import dataclasses
  export_checkpoint.export("v41_retrieval", str(tmp_path))
  cfg, params = train_lib.load_trained("v41_retrieval")
  assert checkpoint_naming.detect_naming(safetensors_file.read_entries(str(tmp_path))) == "nemo"
  pre = load_pretrained(str(tmp_path))
  assert pre.info.format == "nemo" and pre.config.quantized_cache and pre.dtype == np.float32
  exact = load_pretrained(str(tmp_path), quantized_cache=False)
  assert dataclasses.replace(exact.config, name=cfg.name) == cfg
  for want, got in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(exact.params)):
    assert np.asarray(got).dtype == np.asarray(want).dtype and np.array_equal(np.asarray(got), np.asarray(want))


def test_transformers_reads_the_export(exported):
  """The directory is a transformers checkpoint too: DeepseekV4ForCausalLM.from_pretrained finds every tensor,
  AutoTokenizer encodes text and chat exactly as ours, and its greedy answer is the task's."""
  import torch
  from transformers import AutoTokenizer, DeepseekV4ForCausalLM
  out, pre = exported
  model, info = DeepseekV4ForCausalLM.from_pretrained(out, output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"] and model.dtype == torch.float32
  hf_tok = AutoTokenizer.from_pretrained(out)
  _, _, ckpt = train_lib.load_checkpoint_dir(os.path.join(train_lib.CHECKPOINT_ROOT, "v4_retrieval"))
  text, chat, ans = _questions(pre.tokenizer, train_lib.task_spec_from_info(ckpt), 0)
  ids = hf_tok(text)["input_ids"]
  assert ids == pre.tokenizer.encode(text)
  assert hf_tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"] == \
      pre.tokenizer.apply_chat_template(chat, tokenize=True)
  with torch.no_grad():
    got = model.eval().generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=1, do_sample=False)
  assert got[0, -1].item() == ans[0]
