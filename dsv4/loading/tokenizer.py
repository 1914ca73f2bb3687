"""Tokenizer and chat template of a checkpoint directory.

    tok = Tokenizer.from_dir("ckpt_dir")          # tokenizer.json (+ tokenizer_config.json, chat_template.jinja)
    ids = tok.encode("hello")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    tok.decode(ids)

`tokenizer.json` is read by the `tokenizers` library (the same Rust code transformers' fast tokenizers wrap), so
special tokens written in a prompt (e.g. a template's BOS) are recognised by `encode`. The chat template is the
Jinja source from `chat_template.jinja` (transformers >= 4.50 writes it there) or `tokenizer_config.json`'s
`chat_template` (a string, or a list of {name, template} where "default" is used), rendered in a sandboxed Jinja
environment with the helpers chat templates expect (`raise_exception`, `tojson`, `strftime_now`).
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Sequence

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class TokenizerError(ValueError):
  """A missing / malformed tokenizer file or a chat template that cannot render; names the file or the cause."""


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
               pad_token: str | None = None, chat_template: str | None = None, add_bos_token: bool = False,
               source: str = "<memory>"):
    self.backend_tokenizer = backend  # attribute name as on transformers fast tokenizers (used by Engram)
    self.source = source
    self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
    self.chat_template = chat_template
    self.add_bos_token = add_bos_token
    for name in ("bos_token", "eos_token", "pad_token"):
      t = getattr(self, name)
      if t is not None and backend.token_to_id(t) is None:
        raise TokenizerError(f"{source}: {name} {t!r} is not in the vocabulary")
    self._template = None

  # --------------------------------------------------------------------------------------------- loading
  @classmethod
  def from_dir(cls, path: str) -> "Tokenizer":
    from tokenizers import Tokenizer as _Backend
    tj = os.path.join(path, TOKENIZER_FILE)
    if not os.path.isfile(tj):
      raise TokenizerError(f"{tj}: no such file (a checkpoint's fast tokenizer is required)")
    try:
      backend = _Backend.from_file(tj)
    except Exception as e:  # the Rust parser raises plain Exception subclasses
      raise TokenizerError(f"{tj}: cannot parse tokenizer ({e})") from e
    cfg: dict[str, Any] = {}
    tc = os.path.join(path, TOKENIZER_CONFIG_FILE)
    if os.path.isfile(tc):
      try:
        with open(tc) as f:
          cfg = json.load(f)
        if not isinstance(cfg, dict):
          raise ValueError("not a JSON object")
      except (OSError, ValueError) as e:
        raise TokenizerError(f"{tc}: malformed JSON ({e})") from e
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
    try:
      return cls(backend, bos_token=_token_str(cfg.get("bos_token")), eos_token=_token_str(cfg.get("eos_token")),
                 pad_token=_token_str(cfg.get("pad_token")), chat_template=template,
                 add_bos_token=bool(cfg.get("add_bos_token", False)), source=path)
    except TokenizerError as e:
      raise TokenizerError(f"{tc}: {e}") from e

  def save(self, path: str) -> None:
    """Write tokenizer.json + tokenizer_config.json (for tests and small exports)."""
    os.makedirs(path, exist_ok=True)
    self.backend_tokenizer.save(os.path.join(path, TOKENIZER_FILE))
    cfg = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token,
           "add_bos_token": self.add_bos_token, "tokenizer_class": "PreTrainedTokenizerFast"}
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

  def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
    """Text -> ids. Special tokens written in the text are recognised; BOS is prepended when `add_bos` (default:
    tokenizer_config's add_bos_token) and the text does not already start with it."""
    if not isinstance(text, str):
      raise TokenizerError(f"encode expects a string, got {type(text).__name__}")
    ids = self.backend_tokenizer.encode(text, add_special_tokens=False).ids
    add = self.add_bos_token if add_bos is None else add_bos
    if add and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
      ids = [self.bos_token_id] + ids
    return list(ids)

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    return self.backend_tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  # -------------------------------------------------------------------------------------- chat template
  def _compiled(self):
    if self._template is None:
      if self.chat_template is None:
        raise TokenizerError(f"{self.source}: the tokenizer has no chat template (tokenizer_config.json "
                             f"'chat_template' or {CHAT_TEMPLATE_FILE})")
      import jinja2
      from jinja2.sandbox import ImmutableSandboxedEnvironment

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
    import jinja2
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and "role" in m for m in messages):
      raise TokenizerError("chat messages must be a list of dicts with a 'role' (and usually 'content')")
    try:
      text = self._compiled().render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                     pad_token=self.pad_token or "", **kwargs)
    except jinja2.TemplateError as e:
      raise TokenizerError(f"{self.source}: chat template failed to render ({e})") from e
    return self.encode(text, add_bos=False) if tokenize else text
