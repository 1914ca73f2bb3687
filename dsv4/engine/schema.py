"""The one request schema: every request is checked here once, at the door, before anything reaches the engine.

    spec = parse_request({"id": "a", "prompt": [5, 6, 7], "max_tokens": 4}, vocab_size=64)   # JSONL line, dict
    why = check_prompt(prompt, vocab_size) or check_sampling(params, vocab_size)            # Python API

Used by the JSONL reader (`experiments/serve.py`), by `generate`, and by `Engine.add_request`. Bad input is refused,
never coerced: a string is not a prompt, "false" is not a bool, 3.0 and True are not token ids, an unknown key is an
error (so a misspelt `max_new_tokens` or an unsupported field never silently does nothing). Every check returns or
raises a message that names the field.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Sequence

import numpy as np

from dsv4.engine.sampling import SamplingParams

SEED_LIMIT = 2**32          # the sampler keys on a uint32 seed
TOP_K_LIMIT = 2**31         # the sampler holds top-k in int32
MAX_ID_CHARS = 256          # ids, tenants and sessions are names, not payloads


class RequestError(ValueError):
  """A request that does not satisfy the schema; the message names the field."""


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
  return isinstance(x, (numbers.Real, np.floating, np.integer)) and not isinstance(x, (bool, np.bool_))


def _token_list(value, field: str, vocab_size: int | None) -> tuple[int, ...]:
  if not isinstance(value, (list, tuple, str, bytes)) and hasattr(value, "__array__"):
    value = np.asarray(value)       # numpy / jax arrays of ids
  if isinstance(value, np.ndarray):
    if value.ndim != 1 or not np.issubdtype(value.dtype, np.integer):
      raise RequestError(f"{field} must be a 1-D sequence of integer token ids, got an array of shape "
                         f"{list(value.shape)} and dtype {value.dtype}")
    value = value.tolist()
  if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
    raise RequestError(f"{field} must be a list of integer token ids, got {type(value).__name__}")
  out = []
  for i, t in enumerate(value):
    if not _is_int(t):
      raise RequestError(f"{field}[{i}] must be an integer token id, got {type(t).__name__} {t!r}")
    t = int(t)
    if t < 0 or (vocab_size is not None and t >= vocab_size):
      raise RequestError(f"{field}[{i}]: token id {t} out of range [0, {vocab_size})")
    out.append(t)
  return tuple(out)


def check_prompt(prompt, vocab_size: int | None) -> tuple[int, ...]:
  """The prompt as a tuple of ints, or RequestError."""
  toks = _token_list(prompt, "prompt", vocab_size)
  if not toks:
    raise RequestError("empty prompt")
  return toks


def check_sampling(p: SamplingParams, vocab_size: int | None = None) -> None:
  """Types and ranges of every sampling field (the sampler's own limits included), or RequestError."""
  if not isinstance(p, SamplingParams):
    raise RequestError(f"sampling params must be a SamplingParams, got {type(p).__name__}")
  if not _is_int(p.max_tokens) or p.max_tokens < 1:
    raise RequestError(f"max_tokens must be >= 1 (an integer), got {p.max_tokens!r}")
  if not _is_real(p.temperature) or not math.isfinite(p.temperature) or p.temperature < 0:
    raise RequestError(f"temperature must be a finite number >= 0, got {p.temperature!r}")
  if not _is_int(p.top_k) or not 0 <= p.top_k < TOP_K_LIMIT:
    raise RequestError(f"top_k must be an integer in [0, 2^31) (0 = off), got {p.top_k!r}")
  if not _is_real(p.top_p) or not 0.0 < p.top_p <= 1.0:
    raise RequestError(f"top_p must be a number in (0, 1], got {p.top_p!r}")
  if not _is_int(p.seed) or not 0 <= p.seed < SEED_LIMIT:
    raise RequestError(f"seed must be an integer in [0, 2^32), got {p.seed!r}")
  if not isinstance(p.ignore_eos, (bool, np.bool_)):
    raise RequestError(f"ignore_eos must be true or false, got {type(p.ignore_eos).__name__} {p.ignore_eos!r}")
  _token_list(p.stop_token_ids, "stop_token_ids", vocab_size)


def check_name(value, field: str) -> str:
  if not isinstance(value, str):
    raise RequestError(f"{field} must be a string, got {type(value).__name__} {value!r}")
  if len(value) > MAX_ID_CHARS:
    raise RequestError(f"{field} longer than {MAX_ID_CHARS} characters")
  return value


@dataclasses.dataclass(frozen=True)
class RequestSpec:
  """One validated request. `session`: turns of one (tenant, session) run in order, each prompt appended to the
  session's history (previous prompt + answer); `expected`: the answer's leading tokens, to grade the output."""
  id: str
  prompt: tuple[int, ...]
  params: SamplingParams
  tenant: str = ""
  session: str = ""
  expected: tuple[int, ...] | None = None
  stop: tuple[str, ...] = ()        # stop strings (text requests; needs a tokenizer)


_SAMPLING_KEYS = {f.name for f in dataclasses.fields(SamplingParams)}
TEXT_KEYS = frozenset({"messages", "stop"})   # only with a tokenizer (a checkpoint directory that ships one)
KEYS = frozenset({"id", "prompt", "tenant", "session", "expected"} | _SAMPLING_KEYS | TEXT_KEYS)


def _text_prompt(d: dict, tokenizer) -> tuple[int, ...] | None:
  """Token ids of a text prompt ("prompt": str) or a chat ("messages": [{"role", "content"}]), or None when the
  request gives token ids. Text without a tokenizer is refused, never read as digits."""
  text = isinstance(d.get("prompt"), str)
  if not text and "messages" not in d and "stop" not in d:
    return None
  if tokenizer is None:
    if text:
      raise RequestError("prompt must be a list of integer token ids, got str (text prompts need a checkpoint "
                         "with a tokenizer: --checkpoint=DIR with tokenizer.json)")
    raise RequestError("'messages' and 'stop' strings need a checkpoint with a tokenizer (--checkpoint=DIR with "
                       "tokenizer.json)")
  if "messages" in d:
    if "prompt" in d:
      raise RequestError("give either 'prompt' or 'messages', not both")
    msgs = d["messages"]
    if (not isinstance(msgs, list) or not msgs or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs)):
      raise RequestError("messages must be a non-empty list of {\"role\": str, \"content\": str} objects")
    try:
      return tuple(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    except ValueError as e:   # TokenizerError (a word the vocabulary cannot encode, a template error): this request
      raise RequestError(f"messages: {e}") from e
  if text:
    try:
      return tuple(tokenizer.encode(d["prompt"]))
    except ValueError as e:
      raise RequestError(f"prompt: {e}") from e
  return None


def _stop_strings(d: dict) -> tuple[str, ...]:
  if "stop" not in d:
    return ()
  stop = d["stop"]
  stop = [stop] if isinstance(stop, str) else stop
  if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
    raise RequestError("stop must be a non-empty string or a list of non-empty strings")
  return tuple(stop)


def parse_request(d: Any, *, vocab_size: int | None, default_id: str, tokenizer=None) -> RequestSpec:
  """A request from its JSON object (every key optional but `prompt`), or RequestError. Nothing is coerced.
  With a tokenizer, `prompt` may also be text, `messages` a chat (rendered with its template) and `stop` strings."""
  if not isinstance(d, dict):
    raise RequestError(f"a request must be a JSON object, got {type(d).__name__}")
  unknown = sorted(set(d) - KEYS)
  if unknown:
    raise RequestError(f"unknown key(s) {', '.join(map(repr, unknown))}; known keys: {', '.join(sorted(KEYS))}")
  nulls = sorted(k for k, v in d.items() if v is None)
  if nulls:
    raise RequestError(f"{', '.join(map(repr, nulls))} must not be null (leave the key out for the default)")
  rid = check_name(d.get("id", default_id), "id")
  if not rid:
    raise RequestError("id must not be empty")
  text_ids = _text_prompt(d, tokenizer)
  if text_ids is None and "prompt" not in d:
    raise RequestError("missing key 'prompt'")
  prompt = check_prompt(d["prompt"] if text_ids is None else text_ids, vocab_size)
  kw = {}
  for k in _SAMPLING_KEYS & set(d):
    v = d[k]
    if k == "stop_token_ids":
      v = _token_list(v, k, vocab_size)
    kw[k] = v
  params = SamplingParams(**kw)
  check_sampling(params, vocab_size)
  expected = None
  if "expected" in d:
    expected = _token_list(d["expected"], "expected", vocab_size)
  return RequestSpec(rid, prompt, params, check_name(d.get("tenant", ""), "tenant"),
                     check_name(d.get("session", ""), "session"), expected, _stop_strings(d))
