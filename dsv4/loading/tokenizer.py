"""Tokenizer and chat template of a checkpoint directory.

    tok = Tokenizer.from_dir("ckpt_dir")          # tokenizer.json (+ tokenizer_config.json, chat_template.jinja)
    ids = tok.encode("hello")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    tok.decode(ids)

`tokenizer.json` is read by the `tokenizers` library (the same Rust code transformers' fast tokenizers wrap), so
special tokens written in a prompt (e.g. a template's BOS) are recognised by `encode`.

BOS / EOS insertion follows transformers 5.x exactly: `encode(text)` is `tokenizer(text)["input_ids"]`, i.e. the
tokenizer.json `post_processor` (e.g. TemplateProcessing "<s> $A") is applied. transformers drops
tokenizer_config.json's `add_bos_token` / `add_eos_token` whenever a tokenizer.json exists (the post-processor is
the single source; 5.x no longer writes those keys), and so does `from_dir`; only an explicit
`add_bos_token=` / `add_eos_token=` argument rebuilds the post-processor (as `from_pretrained(..., add_bos_token=)`
does). A chat template writes its own BOS, so `apply_chat_template(tokenize=True)` encodes with
`add_special_tokens=False`, as transformers does: one BOS, never two. The chat template is the
Jinja source from `chat_template.jinja` (transformers >= 4.50 writes it there) or `tokenizer_config.json`'s
`chat_template` (a string, or a list of {name, template} where "default" is used), rendered in a sandboxed Jinja
environment with the helpers chat templates expect (`raise_exception`, `tojson`, `strftime_now`).
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer as _Backend, processors

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"   # legacy: special tokens missing from tokenizer_config.json
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class TokenizerError(ValueError):
  """A missing / malformed tokenizer file or a chat template that cannot render; names the file or the cause."""


def _json_object(path: str) -> dict:
  try:
    with open(path) as f:
      obj = json.load(f)
    if not isinstance(obj, dict):
      raise ValueError("not a JSON object")
  except (OSError, ValueError) as e:
    raise TokenizerError(f"{path}: malformed JSON ({e})") from e
  return obj


def _token_str(v) -> str | None:
  """tokenizer_config special-token entries are a string or an AddedToken dict with 'content'."""
  if v is None or isinstance(v, str):
    return v
  if isinstance(v, dict) and isinstance(v.get("content"), str):
    return v["content"]
  raise TokenizerError(f"special token entry {v!r} is neither a string nor a dict with 'content'")


class Tokenizer:
  """A `tokenizers.Tokenizer` plus the special tokens and chat template of its checkpoint."""

  def __init__(self, backend, *, bos_token: str | None = None, eos_token: str | None = None,
               pad_token: str | None = None, chat_template: str | None = None, add_bos_token: bool | None = None,
               add_eos_token: bool | None = None, source: str = "<memory>"):
    """add_bos_token / add_eos_token: None keeps the backend's post-processor (what tokenizer.json says); a bool
    replaces it with BOS / EOS insertion as transformers' `update_post_processor` builds it (the flag left None then
    counts as False, as in transformers). The backend is changed in place, like transformers does."""
    self.backend_tokenizer = backend  # attribute name as on transformers fast tokenizers (used by Engram)
    self.source = source
    self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
    self.chat_template = chat_template
    for name in ("bos_token", "eos_token", "pad_token"):
      t = getattr(self, name)
      if t is not None and backend.token_to_id(t) is None:
        raise TokenizerError(f"{source}: {name} {t!r} is not in the vocabulary")
    # transformers registers the named special tokens as special added tokens when tokenizer.json does not, so
    # that e.g. "<s>" written in a prompt is one token there; the same here
    added = {str(t.content) for t in backend.get_added_tokens_decoder().values()}
    missing = [t for t in dict.fromkeys((bos_token, eos_token, pad_token)) if t is not None and t not in added]
    if missing:
      backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    if add_bos_token is not None or add_eos_token is not None:
      self._set_post_processor(bool(add_bos_token), bool(add_eos_token))
    self._template = None

  def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
    """transformers' TokenizersBackend.update_post_processor: TemplateProcessing with the chosen specials (a flag
    whose token is unset is dropped)."""
    bos = self.bos_token if add_bos and self.bos_token is not None else None
    eos = self.eos_token if add_eos and self.eos_token is not None else None
    single = f"{(bos + ':0 ') if bos else ''}$A:0{(' ' + eos + ':0') if eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if bos else ''} $B:1{(' ' + eos + ':1') if eos else ''}"
    specials = [(t, self.backend_tokenizer.token_to_id(t)) for t in (bos, eos) if t]
    self.backend_tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                                          special_tokens=list(dict.fromkeys(specials)))

  # --------------------------------------------------------------------------------------------- loading
  @classmethod
  def from_dir(cls, path: str, *, add_bos_token: bool | None = None,
               add_eos_token: bool | None = None) -> "Tokenizer":
    """tokenizer.json (+ tokenizer_config.json, chat_template.jinja, special_tokens_map.json) of `path`. BOS / EOS
    insertion is tokenizer.json's post-processor unless add_bos_token / add_eos_token are given (module doc)."""
    tj = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(tj):
      raise TokenizerError(f"{tj}: no such file (a checkpoint's fast tokenizer is required)")
    try:
      backend = _Backend.from_file(tj)
    except Exception as e:  # the Rust parser raises plain Exception subclasses
      raise TokenizerError(f"{tj}: cannot parse tokenizer ({e})") from e
    tc = os.path.join(path, TOKENIZER_CONFIG_FILE)
    cfg: dict[str, Any] = _json_object(tc) if os.path.isfile(tc) else {}
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{name, template}, ...]
      named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
      template = named.get("default")
    if template is not None and not isinstance(template, str):
      raise TokenizerError(f"{tc}: field 'chat_template' must be a string or a list of named templates")
    tf = os.path.join(path, CHAT_TEMPLATE_FILE)
    if os.path.isfile(tf):
      with open(tf) as f:
        template = f.read()
    sm = os.path.join(path, SPECIAL_TOKENS_MAP_FILE)
    if os.path.isfile(sm):  # transformers merges it in for the special tokens tokenizer_config.json leaves out
      smap = _json_object(sm)
      cfg = {**cfg, **{k: smap[k] for k in ("bos_token", "eos_token", "pad_token") if not cfg.get(k) and smap.get(k)}}
    # tokenizer_config.json's add_bos_token / add_eos_token are ignored, as transformers 5.x does when a
    # tokenizer.json exists: the post-processor decides.
    try:
      return cls(backend, bos_token=_token_str(cfg.get("bos_token")), eos_token=_token_str(cfg.get("eos_token")),
                 pad_token=_token_str(cfg.get("pad_token")), chat_template=template, add_bos_token=add_bos_token,
                 add_eos_token=add_eos_token, source=path)
    except TokenizerError as e:
      raise TokenizerError(f"{tc}: {e}") from e

  def save(self, path: str) -> None:
    """Write tokenizer.json + tokenizer_config.json (for tests and small exports)."""
    os.makedirs(path, exist_ok=True)
    self.backend_tokenizer.save(os.path.join(path, TOKENIZER_FILE))
    # BOS / EOS insertion lives in tokenizer.json's post-processor (as transformers 5.x saves it)
    cfg = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token,
           "tokenizer_class": "PreTrainedTokenizerFast"}
    if self.chat_template is not None:
      cfg["chat_template"] = self.chat_template
    with open(os.path.join(path, TOKENIZER_CONFIG_FILE), "w") as f:
      json.dump(cfg, f, indent=1, ensure_ascii=False)

  # ---------------------------------------------------------------------------------------------- ids
  def __len__(self) -> int:
    return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

  def token_id(self, token: str | None) -> int | None:
    return None if token is None else self.backend_tokenizer.token_to_id(token)

  @property
  def bos_token_id(self) -> int | None:
    return self.token_id(self.bos_token)

  @property
  def eos_token_id(self) -> int | None:
    return self.token_id(self.eos_token)

  @property
  def add_bos_token(self) -> bool:
    """Whether `encode` (add_special_tokens=True) starts the ids with BOS."""
    ids = self.backend_tokenizer.encode("", add_special_tokens=True).ids
    return bool(ids) and self.bos_token_id is not None and ids[0] == self.bos_token_id

  def encode(self, text: str, *, add_special_tokens: bool = True, add_bos: bool | None = None) -> list[int]:
    """Text -> ids, exactly transformers' `tokenizer(text, add_special_tokens=...)["input_ids"]`: special tokens
    written in the text are recognised, and with add_special_tokens the post-processor adds its BOS / EOS (even
    when the text already starts with BOS, as transformers does). add_bos (True / False) overrides that: the text
    is encoded without the post-processor and BOS is prepended unless it is already there."""
    if not isinstance(text, str):
      raise TokenizerError(f"encode expects a string, got {type(text).__name__}")
    try:
      ids = list(self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens and add_bos is None).ids)
    except Exception as e:  # the Rust side raises plain Exception (e.g. a word-level vocabulary without <unk>)
      raise TokenizerError(f"{self.source}: cannot encode {text[:60]!r} ({e})") from e
    if add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
      ids = [self.bos_token_id] + ids
    return ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    return self.backend_tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  # -------------------------------------------------------------------------------------- chat template
  def _compiled(self):
    if self._template is None:
      if self.chat_template is None:
        raise TokenizerError(f"{self.source}: the tokenizer has no chat template (tokenizer_config.json "
                             f"'chat_template' or {CHAT_TEMPLATE_FILE})")

      def raise_exception(message):
        raise TokenizerError(f"chat template: {message}")

      def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # plain JSON (jinja's built-in tojson HTML-escapes, which templates do not want)
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

      env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
      env.filters["tojson"] = tojson
      env.globals["raise_exception"] = raise_exception
      env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
      try:
        self._template = env.from_string(self.chat_template)
      except jinja2.TemplateError as e:
        raise TokenizerError(f"{self.source}: chat template does not compile ({e})") from e
    return self._template

  def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                          tokenize: bool = False, **kwargs) -> str | list[int]:
    """Render `messages` ([{"role", "content"}, ...]) with the checkpoint's template; ids when `tokenize`."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and "role" in m for m in messages):
      raise TokenizerError("chat messages must be a list of dicts with a 'role' (and usually 'content')")
    try:
      text = self._compiled().render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     pad_token=self.pad_token or "", **kwargs)
    except jinja2.TemplateError as e:
      raise TokenizerError(f"{self.source}: chat template failed to render ({e})") from e
    return self.encode(text, add_special_tokens=False) if tokenize else text  # the template wrote the BOS
