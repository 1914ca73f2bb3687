"""dsv4.loading.tokenizer + text generation: a small word-level tokenizer and chat template built here (nothing is
downloaded), encode / decode / template, text and chat prompts through the engine, stop strings, clear errors."""

import json

import jax
import pytest

from dsv4 import config, model
from dsv4.engine.api import chat, generate_text
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams
from dsv4.loading.tokenizer import Tokenizer, TokenizerError

SPECIALS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
TEMPLATE = ("{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
            "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
            "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tokenizer(vocab_size: int = 512, template: str | None = TEMPLATE) -> Tokenizer:
  """Word-level tokenizer: the specials above (ids 0-6; </s> = 1 = the config's EOS), then words w7 ... so every
  id of a `vocab_size` model decodes to a word."""
  from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers
  vocab = {t: i for i, t in enumerate(SPECIALS)}
  vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
  b = Backend(models.WordLevel(vocab, unk_token="<pad>"))
  b.pre_tokenizer = pre_tokenizers.Whitespace()
  b.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
  b.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
  return Tokenizer(b, bos_token="<s>", eos_token="</s>", pad_token="<pad>", chat_template=template)


CORPUS = ("the quick brown fox jumps over the lazy dog. a tiny model reads the words and writes them back; "
          "every sentence here is plain text for a byte-level BPE with a few hundred merges.")


def save_hf_bpe_tokenizer(path, vocab_size: int = 400, template: str | None = TEMPLATE, **kwargs):
  """A byte-level BPE trained here (specials first: <s> = 0, </s> = 1, ...), saved by transformers'
  PreTrainedTokenizerFast with BOS insertion: transformers 5.x writes that into tokenizer.json's post-processor and
  no add_bos_token into tokenizer_config.json. Returns the transformers tokenizer."""
  from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast
  b = Backend(models.BPE())
  b.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  b.decoder = decoders.ByteLevel()
  b.train_from_iterator([CORPUS] * 20, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  kw = dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", add_bos_token=True, chat_template=template)
  hf = PreTrainedTokenizerFast(tokenizer_object=b, **{**kw, **kwargs})
  hf.save_pretrained(str(path))
  return hf


def test_bos_from_the_post_processor_matches_transformers(tmp_path):
  """transformers 5.x puts BOS insertion in tokenizer.json's post-processor: plain text gets it exactly as
  `tokenizer(text)["input_ids"]` (also a second one when the text starts with <s>); a chat template that writes
  its own BOS gets one, as `apply_chat_template(tokenize=True)`; add_bos_token in tokenizer_config.json is ignored
  as transformers ignores it; an explicit add_bos_token / add_eos_token rebuilds the post-processor as
  `from_pretrained(..., add_bos_token=)` does."""
  from transformers import AutoTokenizer
  save_hf_bpe_tokenizer(tmp_path)
  assert "add_bos_token" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
  tok, hf = Tokenizer.from_dir(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
  assert tok.add_bos_token and len(tok) == len(hf) <= 400
  for text in ["the quick brown fox", "", "<s>the fox", "a dog</s>", "é unseen ✓ text"]:
    assert tok.encode(text) == hf(text)["input_ids"], text
    assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"], text
  assert tok.encode("the fox")[0] == 0
  msgs = [{"role": "system", "content": "the lazy dog"}, {"role": "user", "content": "jumps over"}]
  want = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
  got = tok.apply_chat_template(msgs, tokenize=True)
  assert got == want and got[0] == 0 and got[1] != 0  # one BOS, from the template
  for kw in ({"add_bos_token": False}, {"add_eos_token": True}, {"add_bos_token": True, "add_eos_token": True}):
    assert Tokenizer.from_dir(str(tmp_path), **kw).encode("the fox") == \
        AutoTokenizer.from_pretrained(str(tmp_path), **kw)("the fox")["input_ids"], kw
  # a flag in tokenizer_config.json does not override tokenizer.json (transformers drops it)
  cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": False}))
  assert Tokenizer.from_dir(str(tmp_path)).encode("the fox") == \
      AutoTokenizer.from_pretrained(str(tmp_path))("the fox")["input_ids"] == tok.encode("the fox")
  # and a tokenizer.json without BOS in its post-processor adds none, whatever tokenizer_config.json says
  save_hf_bpe_tokenizer(tmp_path / "nobos", add_bos_token=False)
  cfg = json.loads((tmp_path / "nobos" / "tokenizer_config.json").read_text())
  (tmp_path / "nobos" / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
  t2 = Tokenizer.from_dir(str(tmp_path / "nobos"))
  assert not t2.add_bos_token
  assert t2.encode("the fox") == AutoTokenizer.from_pretrained(str(tmp_path / "nobos"))("the fox")["input_ids"]
  assert t2.encode("the fox", add_bos=True)[0] == 0  # the explicit override still prepends one


def test_save_load_encode_decode_template(tmp_path):
  tok = make_tokenizer()
  tok.save(str(tmp_path))
  t2 = Tokenizer.from_dir(str(tmp_path))
  assert len(t2) == 512 and t2.bos_token_id == 0 and t2.eos_token_id == 1
  ids = t2.encode("w10 w11 w300")
  assert ids == [10, 11, 300] and t2.decode(ids) == "w10 w11 w300"
  msgs = [{"role": "system", "content": "w20"}, {"role": "user", "content": "w21 w22"}]
  text = t2.apply_chat_template(msgs)
  assert text == "<s><|system|>w20<|end|><|user|>w21 w22<|end|><|assistant|>"
  assert t2.apply_chat_template(msgs, tokenize=True) == [0, 5, 20, 6, 3, 21, 22, 6, 4]  # specials recognised
  assert t2.apply_chat_template(msgs, add_generation_prompt=False).endswith("<|end|>")
  assert t2.decode([0, 5, 20, 6], skip_special_tokens=True) == "w20"


def test_template_from_jinja_file_and_named_list(tmp_path):
  tok = make_tokenizer(template=None)
  tok.save(str(tmp_path))
  with pytest.raises(TokenizerError, match="no chat template"):
    Tokenizer.from_dir(str(tmp_path)).apply_chat_template([{"role": "user", "content": "w9"}])
  cfg_path = tmp_path / "tokenizer_config.json"
  cfg = json.loads(cfg_path.read_text())
  cfg["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATE}]
  cfg_path.write_text(json.dumps(cfg))
  assert Tokenizer.from_dir(str(tmp_path)).apply_chat_template([{"role": "user", "content": "w9"}]).startswith("<s>")
  (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] | tojson }}")
  assert Tokenizer.from_dir(str(tmp_path)).apply_chat_template([{"role": "user", "content": "é"}]) == '"é"'


def test_tokenizer_errors(tmp_path):
  with pytest.raises(TokenizerError, match="tokenizer.json: no such file"):
    Tokenizer.from_dir(str(tmp_path))
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(TokenizerError, match="tokenizer.json: cannot parse"):
    Tokenizer.from_dir(str(tmp_path))
  make_tokenizer().save(str(tmp_path))
  (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<never>"}')
  with pytest.raises(TokenizerError, match="tokenizer_config.json.*eos_token '<never>' is not in the vocabulary"):
    Tokenizer.from_dir(str(tmp_path))
  tok = make_tokenizer()
  with pytest.raises(TokenizerError, match="unknown role tool"):
    tok.apply_chat_template([{"role": "tool", "content": "w9"}])
  with pytest.raises(TokenizerError, match="does not compile"):
    make_tokenizer(template="{% for %}").apply_chat_template([{"role": "user", "content": "w9"}])
  # a word-level vocabulary without <unk>: an unknown word is a TokenizerError naming the text, not a Rust panic
  from tokenizers import Tokenizer as Backend, models, pre_tokenizers
  b = Backend(models.WordLevel({"<s>": 0, "a": 1}, unk_token=None))
  b.pre_tokenizer = pre_tokenizers.Whitespace()
  with pytest.raises(TokenizerError, match="cannot encode 'a zz'"):
    Tokenizer(b, bos_token="<s>").encode("a zz")


@pytest.fixture(scope="module")
def engine():
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  ec = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, chunk_size=32, max_model_len=256,
                    num_full_blocks=8, num_swa_blocks=32)
  return cfg, params, Engine(params, cfg, ec)


def test_generate_text_chat_and_stop_strings(engine):
  cfg, params, eng = engine
  tok = make_tokenizer(cfg.vocab_size)
  sp = SamplingParams(max_tokens=10, ignore_eos=True)
  plain = generate_text(params, cfg, tok, ["w10 w11 w12", [{"role": "user", "content": "w40 w41"}]], sp, engine=eng)
  assert [o.finish_reason for o in plain] == ["length", "length"]
  assert plain[0].prompt_ids == [10, 11, 12]
  assert plain[1].prompt_ids == [0, 3, 40, 41, 6, 4]
  for o in plain:
    assert len(o.token_ids) == 10 and o.text == tok.decode(o.token_ids)
  # stop at the 4th generated word: the request ends as soon as its text contains it, the text stops before it
  o = plain[0]
  words = o.text.split(" ")
  stop = words[3]
  k = next(k for k in range(1, 11) if stop in tok.decode(o.token_ids[:k]))
  got = generate_text(params, cfg, tok, ["w10 w11 w12"], sp, stop=[stop, "never-there"], engine=eng)[0]
  assert got.finish_reason == "stop" and got.stop == stop
  assert got.token_ids == o.token_ids[:k]
  assert got.text == o.text[: o.text.find(stop)]
  # chat() is generate_text over conversations; same greedy answer as above
  again = chat(params, cfg, tok, [[{"role": "user", "content": "w40 w41"}]], sampling_params=sp, engine=eng)[0]
  assert again.token_ids == plain[1].token_ids


def test_generate_text_bad_input_is_a_per_request_error(engine):
  cfg, params, eng = engine
  tok = make_tokenizer(cfg.vocab_size)
  outs = generate_text(params, cfg, tok, ["", "w10"], SamplingParams(max_tokens=2, ignore_eos=True), engine=eng)
  assert outs[0].error is not None and outs[0].finish_reason == "error"
  assert outs[1].error is None and len(outs[1].token_ids) == 2
  with pytest.raises(TokenizerError, match="chat messages"):
    generate_text(params, cfg, tok, [[("user", "w10")]], engine=eng)
