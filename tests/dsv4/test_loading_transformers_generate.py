"""Acceptance: a checkpoint as transformers writes it (tiny DeepseekV4ForCausalLM.save_pretrained in fp32, a
byte-level BPE tokenizer saved by PreTrainedTokenizerFast, BOS in its post-processor, a chat template) loads with
load_pretrained (dtype "auto" = fp32 here) and greedy text through generate_text gives transformers' own
`generate(do_sample=False)` tokens, for a plain string and for a chat, from the same prompt ids."""

import jax
import numpy as np
import pytest

from dsv4.engine.api import generate_text
from dsv4.engine.config import EngineConfig
from dsv4.engine.sampling import SamplingParams
from dsv4.loading.pretrained import load_pretrained
from tests.dsv4 import oracle_util
from tests.dsv4.test_tokenizer import save_hf_bpe_tokenizer

NEW_TOKENS = 6
# Long enough to cross the 16-token window and fill CSA (m=4) and HCA (m=16) entries of the tiny config.
TEXT = ("the quick brown fox jumps over the lazy dog; a tiny model reads the words and writes them back, every "
        "sentence plain text")
CHAT = [{"role": "system", "content": "a tiny model reads the words"},
        {"role": "user", "content": "the quick brown fox jumps over the lazy dog and writes them back"}]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("hf_saved"))
  hf = oracle_util.build_oracle(seed=3)
  hf.save_pretrained(d)
  hf_tok = save_hf_bpe_tokenizer(d, vocab_size=hf.config.vocab_size)
  return d, hf, hf_tok


def test_fp32_save_loads_as_fp32(saved):
  d, _, _ = saved
  auto, f32 = load_pretrained(d), load_pretrained(d, dtype=np.float32)
  assert auto.dtype == f32.dtype == np.float32 and auto.info.format == "transformers"
  for a, b in zip(jax.tree_util.tree_leaves(auto.params), jax.tree_util.tree_leaves(f32.params)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
  dtypes = {np.asarray(x).dtype for x in jax.tree_util.tree_leaves(auto.params)}
  assert dtypes == {np.dtype(np.float32), np.dtype(np.int32)}
  assert load_pretrained(d, dtype="bf16").dtype == np.dtype("bfloat16")
  with pytest.raises(ValueError, match="dtype must be"):
    load_pretrained(d, dtype=np.float16)


def test_greedy_text_and_chat_match_transformers_generate(saved):
  import torch
  d, hf, hf_tok = saved
  text_ids = hf_tok(TEXT)["input_ids"]
  chat_ids = hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
  assert text_ids[0] == chat_ids[0] == hf_tok.bos_token_id and chat_ids[1] != hf_tok.bos_token_id
  assert len(text_ids) > 20 and len(chat_ids) > 20
  want = []
  with torch.no_grad():
    for ids in (text_ids, chat_ids):
      out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                        attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=hf_tok.pad_token_id)
      want.append(out[0, len(ids):].tolist())
  pre = load_pretrained(d)
  ec = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, chunk_size=32, max_model_len=256, num_full_blocks=8,
                    num_swa_blocks=32)
  outs = generate_text(pre.params, pre.config, pre.tokenizer, [TEXT, CHAT], SamplingParams(max_tokens=NEW_TOKENS),
                       engine_config=ec)
  assert [o.prompt_ids for o in outs] == [text_ids, chat_ids]     # BOS from the post-processor; one BOS in the chat
  assert [o.token_ids for o in outs] == want
  assert outs[0].text == hf_tok.decode(want[0], skip_special_tokens=True)
