"""Python API for notebooks and scripts.

    outs = generate(params, config, [prompt_ids, ...], SamplingParams(max_tokens=32))
    report = run_workload(engine, workloads.make("chat", config.vocab_size))
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from cache.hashing import ExtraKeys
from dsv4.config import ModelConfig
from dsv4.engine.engine import Engine, EngineConfig
from dsv4.engine.request import RequestOutput, Status
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.workloads import Workload


def generate(params, config: ModelConfig, prompts: Sequence[Sequence[int]],
             sampling_params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
             engine_config: EngineConfig = EngineConfig(), engine: Engine | None = None) -> list[RequestOutput]:
  """Runs a batch of prompts to completion. Every prompt and sampling params is checked by the one request schema
  (dsv4/engine/schema.py) at `Engine.add_request`: a bad one comes back with `RequestOutput.error` and never reaches
  the model; the rest of the batch, and later batches on the same engine, are served."""
  engine = engine or Engine(params, config, engine_config)
  sps = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
  if len(sps) != len(prompts):
    raise ValueError(f"generate: {len(prompts)} prompts but {len(sps)} sampling params")
  base = len(engine.requests)
  rids = [f"req{base + i}" for i in range(len(prompts))]
  for rid, prompt, sp in zip(rids, prompts, sps):
    engine.add_request(rid, prompt, sp)
  engine.run()
  return [RequestOutput.of(engine.requests[r]) for r in rids]


def grade(output: Sequence[int], expected: Sequence[int] | None) -> bool | None:
  """Whether the output starts with the expected answer (None when there is nothing to grade)."""
  if expected is None:
    return None
  return list(output[:len(expected)]) == list(expected)


@dataclasses.dataclass
class WorkloadReport:
  outputs: list[RequestOutput]
  wall_s: float
  stats: dict
  peak_blocks: dict
  expected: list[tuple[int, ...] | None] = dataclasses.field(default_factory=list)   # per output, if known

  def correct(self) -> list[bool | None]:
    exp = self.expected or [None] * len(self.outputs)
    return [None if e is None or o.error is not None else grade(o.output, e) for o, e in zip(self.outputs, exp)]

  def summary(self) -> dict:
    outs = [o for o in self.outputs if o.error is None]
    prompt = sum(len(o.prompt) for o in outs)
    gen = sum(len(o.output) for o in outs)
    hit = sum(o.hit_tokens for o in outs)
    ttft = np.array([o.ttft_s for o in outs if o.ttft_s is not None])
    tpot = np.array([o.tpot_s for o in outs if o.tpot_s is not None])
    # Accuracy over every request that expects an answer; a request that failed counts as wrong.
    graded = [(c is True) for c, e in zip(self.correct(), self.expected or []) if e is not None]

    def pct(a, q):
      return float(np.percentile(a, q)) if a.size else float("nan")

    acc = {"graded": len(graded), "accuracy": sum(graded) / len(graded)} if graded else {}
    return {
        "requests": len(self.outputs), "errors": len(self.outputs) - len(outs), **acc,
        "prompt_tokens": prompt, "generated_tokens": gen,
        "prefix_hit_tokens": hit, "prefix_hit_pct": 100.0 * hit / max(prompt, 1),
        "computed_tokens": int(self.stats.get("computed_tokens", 0)),
        "recomputed_tokens": int(self.stats.get("recomputed_tokens", 0)),
        "preemptions": int(self.stats.get("preemptions", 0)),
        **{f"peak_blocks_{g}": v for g, v in self.peak_blocks.items()},
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
        "wall_s": self.wall_s, "generated_tok_per_s": gen / max(self.wall_s, 1e-9),
        "total_tok_per_s": (prompt - hit + gen) / max(self.wall_s, 1e-9),
    }


def run_workload(engine: Engine, workload: Workload, progress: Callable[[int], None] | None = None) -> WorkloadReport:
  """Submits the workload wave by wave; a turn's prompt is its session's history plus the turn's new tokens.

  Sessions are per tenant (a tenant's session never continues another tenant's history; a turn with session "" has no history), and each turn's tenant
  salts its cache keys. `progress(n)` is told about every request that ends, rejected ones included."""
  history: dict[tuple[str, str], list[int]] = {}
  rids: list[str] = []
  expected: list[tuple[int, ...] | None] = []
  t0 = time.perf_counter()
  for w, wave in enumerate(workload.waves):
    now = time.perf_counter()
    wave_rids = []
    for turn in wave:
      key = (turn.tenant, turn.session) if turn.session else None     # no session: an independent request
      prompt = history.get(key, []) + list(turn.new_tokens)
      rid = turn.rid or f"{turn.session}.t{w}"
      engine.add_request(rid, prompt, turn.params, extra_keys=ExtraKeys(tenant=turn.tenant), arrival=now)
      wave_rids.append((rid, key))
      expected.append(turn.expected)
    reported = 0
    while True:
      ended = sum(engine.requests[r].status in (Status.FINISHED, Status.REJECTED) for r, _ in wave_rids)
      if progress is not None and ended > reported:
        progress(ended - reported)
      reported = ended
      if not engine.has_work():
        break
      engine.step()
    for rid, key in wave_rids:
      req = engine.requests[rid]
      if key is not None:
        history[key] = req.all_tokens if req.error is None else history.get(key, [])
      rids.append(rid)
  wall = time.perf_counter() - t0
  return WorkloadReport([RequestOutput.of(engine.requests[r]) for r in rids], wall, dict(engine.stats),
                        dict(engine.peak_blocks), expected)


# ----------------------------------------------------------------------------------------------------------
# Text in, text out (checkpoint tokenizer + chat template; dsv4.loading.tokenizer).

@dataclasses.dataclass(frozen=True)
class TextOutput:
  rid: str
  prompt_ids: list[int]
  text: str                      # generated text, cut before the first stop string
  token_ids: list[int]           # every generated token (the one completing a stop string included)
  finish_reason: str | None      # "stop" (EOS / stop token / stop string), "length", "error"
  stop: str | None               # the stop string that ended it, if any
  error: str | None


def _find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
  hits = [(text.find(s), s) for s in stops if s and s in text]
  return min(hits) if hits else None


def generate_text(params, config: ModelConfig, tokenizer, prompts: Sequence,
                  sampling_params: SamplingParams | Sequence[SamplingParams] = SamplingParams(), *,
                  stop: Sequence[str] = (), engine_config: EngineConfig = EngineConfig(),
                  engine: Engine | None = None, add_generation_prompt: bool = True,
                  chat_template_kwargs: dict | None = None) -> list[TextOutput]:
  """Like `generate`, with text: each prompt is a string (encoded as is) or a list of chat messages
  ([{"role", "content"}], rendered with the tokenizer's chat template). Returns decoded text. A request stops as
  soon as its decoded output contains one of `stop` (checked after every engine step, so no tokens are generated
  past it); the returned text ends before the stop string."""
  engine = engine or Engine(params, config, engine_config)
  sps = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
  if len(sps) != len(prompts):
    raise ValueError(f"generate_text: {len(prompts)} prompts but {len(sps)} sampling params")
  stop = tuple(stop)
  base = len(engine.requests)
  rids, ids = [], []
  for i, (p, sp) in enumerate(zip(prompts, sps)):
    if isinstance(p, str):
      toks = tokenizer.encode(p)
    else:
      toks = tokenizer.apply_chat_template(p, add_generation_prompt=add_generation_prompt, tokenize=True,
                                           **(chat_template_kwargs or {}))
    rid = f"req{base + i}"
    engine.add_request(rid, toks, sp)
    rids.append(rid)
    ids.append(toks)
  hit: dict[str, str] = {}
  mine = set(rids)
  while engine.has_work():
    engine.step()
    if not stop:
      continue
    for req in list(engine.running):
      if req.rid in mine and req.output and req.rid not in hit:
        found = _find_stop(tokenizer.decode(req.output), stop)
        if found is not None:
          hit[req.rid] = found[1]
          engine._finish(req, "stop")  # frees its blocks; same path as an EOS
  outs = []
  for rid, toks in zip(rids, ids):
    r = engine.requests[rid]
    text = tokenizer.decode(r.output) if r.error is None else ""
    s = hit.get(rid)
    if s is None and stop:  # the last step may have finished it for length / EOS with a stop string inside
      found = _find_stop(text, stop)
      s = found[1] if found else None
    if s is not None:
      text = text[: text.find(s)]
    outs.append(TextOutput(rid, list(toks), text, list(r.output), "stop" if s else r.finish_reason, s, r.error))
  return outs


def chat(params, config: ModelConfig, tokenizer, conversations: Sequence[Sequence[dict]], **kwargs) -> list[TextOutput]:
  """`generate_text` for a batch of chat conversations."""
  return generate_text(params, config, tokenizer, [list(c) for c in conversations], **kwargs)
