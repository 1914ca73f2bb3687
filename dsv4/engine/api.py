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
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.request import RequestOutput, Status
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.workloads import Workload


def _with_kernels(engine_config: EngineConfig, engine: Engine | None, kernels: str | None) -> EngineConfig:
  """engine_config with kernel.backend = kernels (None: unchanged); a given engine must already serve with them."""
  if kernels is None:
    return engine_config
  if engine is not None and engine.ec.kernel.backend != kernels:
    raise ValueError(f"kernels={kernels!r} but the engine given serves with {engine.ec.kernel.backend!r} (kernels "
                     "are fixed when an engine is built)")
  return dataclasses.replace(engine_config, kernel=dataclasses.replace(engine_config.kernel, backend=kernels))


def generate(params, config: ModelConfig, prompts: Sequence[Sequence[int]],
             sampling_params: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
             engine_config: EngineConfig = EngineConfig(), engine: Engine | None = None,
             kernels: str | None = None) -> list[RequestOutput]:
  """Runs a batch of prompts to completion. `kernels` ("auto", "xla", "pallas"; None = engine_config's) sets
  `engine_config.kernel.backend` for the engine made here (with `engine`, it must agree with that engine's). Every
  prompt and sampling params is checked by the one request schema
  (dsv4/engine/schema.py) at `Engine.add_request`: a bad one comes back with `RequestOutput.error` and never reaches
  the model; the rest of the batch, and later batches on the same engine, are served."""
  engine_config = _with_kernels(engine_config, engine, kernels)
  engine = engine or Engine(params, config, engine_config)
  sps = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
  if len(sps) != len(prompts):
    raise ValueError(f"generate: {len(prompts)} prompts but {len(sps)} sampling params")
  base = engine.next_request_index()
  rids = [f"req{base + i}" for i in range(len(prompts))]
  outs = {}
  for rid, prompt, sp in zip(rids, prompts, sps):
    r = engine.add_request(rid, prompt, sp)
    if r.status is Status.REJECTED and engine.requests.get(rid) is not r:   # an id in use: refused, not tracked
      outs[rid] = RequestOutput.of(r)
  while engine.has_work():
    engine.step()
  # the engine forgets what it returns: a long job's host memory stays flat
  outs.update(zip((r for r in rids if r not in outs), engine.take_outputs([r for r in rids if r not in outs])))
  return [outs[r] for r in rids]


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
  # Per output: whether a compilation ran while it waited for its first token (such a TTFT measures XLA, not the
  # engine). Empty = unknown (every TTFT counts).
  waited_on_compile: list[bool] = dataclasses.field(default_factory=list)

  def correct(self) -> list[bool | None]:
    exp = self.expected or [None] * len(self.outputs)
    return [None if e is None or o.error is not None else grade(o.output, e) for o, e in zip(self.outputs, exp)]

  def summary(self) -> dict:
    """Totals and percentiles. `ttft_p50_s` / `ttft_p99_s` leave out the requests that waited on a compilation
    (counted in `ttft_compiling_requests`; `compile_s` of the engine's compile report is that time): NaN when every
    request did, e.g. a single wave on a cold compile cache."""
    outs = [o for o in self.outputs if o.error is None]
    prompt = sum(len(o.prompt) for o in outs)
    gen = sum(len(o.output) for o in outs)
    hit = sum(o.hit_tokens for o in outs)
    compiled = self.waited_on_compile or [False] * len(self.outputs)
    ttft_all = [(o.ttft_s, c) for o, c in zip(self.outputs, compiled) if o.error is None and o.ttft_s is not None]
    ttft = np.array([t for t, c in ttft_all if not c])
    tpot = np.array([o.tpot_s for o in outs if o.tpot_s is not None])
    # Accuracy over every request that expects an answer; a request that failed counts as wrong.
    graded = [(c is True) for c, e in zip(self.correct(), self.expected or []) if e is not None]

    def pct(a, q):
      return float(np.percentile(a, q)) if a.size else float("nan")

    acc = {"graded": len(graded), "accuracy": sum(graded) / len(graded)} if graded else {}
    spec = {}
    if self.stats.get("spec_rows"):   # speculative decoding: how much of the drafting paid
      drafted, accepted = int(self.stats["spec_draft_tokens"]), int(self.stats["spec_accepted_tokens"])
      spec = {"draft_tokens": drafted, "accepted_draft_tokens": accepted,
              "draft_acceptance": accepted / max(drafted, 1),
              "tokens_per_drafting_row": 1 + accepted / int(self.stats["spec_rows"])}
    return {
        "requests": len(self.outputs), "errors": len(self.outputs) - len(outs), **acc,
        "prompt_tokens": prompt, "generated_tokens": gen,
        "prefix_hit_tokens": hit, "prefix_hit_pct": 100.0 * hit / max(prompt, 1),
        "computed_tokens": int(self.stats.get("computed_tokens", 0)),
        "recomputed_tokens": int(self.stats.get("recomputed_tokens", 0)),
        "preemptions": int(self.stats.get("preemptions", 0)),
        **spec,
        **{f"peak_blocks_{g}": v for g, v in self.peak_blocks.items()},
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "ttft_compiling_requests": len(ttft_all) - int(ttft.size),
        "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
        "wall_s": self.wall_s, "generated_tok_per_s": gen / max(self.wall_s, 1e-9),
        "total_tok_per_s": (prompt - hit + gen) / max(self.wall_s, 1e-9),
    }


def run_workload(engine: Engine, workload: Workload, progress: Callable[[int], None] | None = None, *,
                 on_step: Callable[[Engine], None] | None = None,
                 on_finish: Callable[[RequestOutput, tuple[int, ...] | None], None] | None = None) -> WorkloadReport:
  """Submits the workload wave by wave; a turn's prompt is its session's history plus the turn's new tokens.

  Sessions are per tenant (a tenant's session never continues another tenant's history; a turn with session "" has
  no history), and each turn's tenant salts its cache keys. `progress(n)` is told about every request that ends,
  rejected ones included; `on_finish(output, expected)` gets each of them once, in the order they end (to stream
  results out); `on_step(engine)` runs after every engine step (e.g. `StopStrings`, which may finish requests)."""
  history: dict[tuple[str, str], list[int]] = {}
  reqs = []                                    # the Request objects add_request returned, in workload order
  expected: list[tuple[int, ...] | None] = []
  arrival: list[float] = []
  log = getattr(engine, "compile_log", None)
  spans: list[tuple[float, float]] = []        # (start, end) of engine calls that compiled something

  def timed(fn):
    c0, s0 = (log.seconds() if log is not None else 0.0), time.perf_counter()
    out = fn()
    if log is not None and log.seconds() > c0:
      spans.append((s0, time.perf_counter()))
    return out

  t0 = time.perf_counter()
  for w, wave in enumerate(workload.waves):
    now = time.perf_counter()
    left, wave_keys = [], []
    for turn in wave:
      key = (turn.tenant, turn.session) if turn.session else None     # no session: an independent request
      prompt = history.get(key, []) + list(turn.new_tokens)
      rid = turn.rid or f"{turn.session}.t{w}"
      # the returned request, not engine.requests[rid]: a refused duplicate id is not tracked under its id
      req = timed(lambda: engine.add_request(rid, prompt, turn.params, extra_keys=ExtraKeys(tenant=turn.tenant),
                                             arrival=now))
      left.append((req, turn.expected))
      wave_keys.append((key, req))
      reqs.append(req)
      expected.append(turn.expected)
      arrival.append(now)
    while True:
      still = []
      for req, exp in left:
        if req.status in (Status.FINISHED, Status.REJECTED):
          if on_finish is not None:
            on_finish(RequestOutput.of(req), exp)
        else:
          still.append((req, exp))
      if progress is not None and len(still) < len(left):
        progress(len(left) - len(still))
      left = still
      if not engine.has_work():
        break
      timed(engine.step)
      if on_step is not None:
        on_step(engine)
    for key, req in wave_keys:
      if key is not None:
        history[key] = req.all_tokens if req.error is None else history.get(key, [])
  wall = time.perf_counter() - t0
  outs = [RequestOutput.of(r) for r in reqs]
  waited = [o.ttft_s is not None and any(s0 < a + o.ttft_s and s1 > a for s0, s1 in spans)
            for o, a in zip(outs, arrival)]
  return WorkloadReport(outs, wall, dict(engine.stats), dict(engine.peak_blocks), expected, waited)


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


class StopStrings:
  """Per-step hook (`run_workload(on_step=...)`): finishes a request as soon as its decoded output contains one of
  its stop strings, so no tokens are generated past it. A step adds at most one token per request, so the output
  ends with the token that completed the stop string; `text()` cuts the text before it.

      stops = StopStrings(tokenizer, {"a": ["###"], "b": ["</answer>", "Q:"]})
      run_workload(engine, workload, on_step=stops)
      text, stop = stops.text("a", output_ids)

  Each check decodes the request's whole output (tokenizers merge across tokens, so a tail alone can decode
  differently); only requests whose output grew since the last check are decoded."""

  def __init__(self, tokenizer, stops: dict[str, Sequence[str]]):
    self.tokenizer = tokenizer
    self.stops = {rid: tuple(x for x in ss if x) for rid, ss in stops.items()}
    self.hit: dict[str, str] = {}             # rid -> the stop string that ended it
    self._checked: dict[str, int] = {}        # rid -> output length at the last check

  def __call__(self, engine: Engine) -> None:
    for req in list(engine.running):
      ss = self.stops.get(req.rid)
      if not ss or req.rid in self.hit or len(req.output) == self._checked.get(req.rid, 0):
        continue
      self._checked[req.rid] = len(req.output)
      found = _find_stop(self.tokenizer.decode(req.output), ss)
      if found is not None:
        self.hit[req.rid] = found[1]
        engine.stop_request(req.rid, "stop")  # frees its blocks now, like an EOS

  def text(self, rid: str, output: Sequence[int]) -> tuple[str, str | None]:
    """(decoded output cut before the first stop string, that string or None). Also catches a stop string
    completed by the step that ended the request for length or EOS."""
    text = self.tokenizer.decode(list(output))
    found = _find_stop(text, self.stops.get(rid, ()))
    return (text, None) if found is None else (text[:found[0]], found[1])


def generate_text(params, config: ModelConfig, tokenizer, prompts: Sequence,
                  sampling_params: SamplingParams | Sequence[SamplingParams] = SamplingParams(), *,
                  stop: Sequence[str] = (), engine_config: EngineConfig = EngineConfig(),
                  engine: Engine | None = None, add_generation_prompt: bool = True,
                  chat_template_kwargs: dict | None = None, kernels: str | None = None) -> list[TextOutput]:
  """Like `generate`, with text: each prompt is a string (encoded as is) or a list of chat messages
  ([{"role", "content"}], rendered with the tokenizer's chat template). Returns decoded text. A request stops as
  soon as its decoded output contains one of `stop` (checked after every engine step, so no tokens are generated
  past it); the returned text ends before the stop string."""
  engine_config = _with_kernels(engine_config, engine, kernels)
  engine = engine or Engine(params, config, engine_config)
  sps = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
  if len(sps) != len(prompts):
    raise ValueError(f"generate_text: {len(prompts)} prompts but {len(sps)} sampling params")
  stop = tuple(stop)
  base = engine.next_request_index()
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
  hook = StopStrings(tokenizer, {rid: stop for rid in rids})
  while engine.has_work():
    engine.step()
    if stop:
      hook(engine)
  outs = []
  for rid, toks in zip(rids, ids):
    r = engine.requests[rid]
    text, s = hook.text(rid, r.output) if r.error is None else ("", None)
    outs.append(TextOutput(rid, list(toks), text, list(r.output), "stop" if s else r.finish_reason, s, r.error))
  return outs


def chat(params, config: ModelConfig, tokenizer, conversations: Sequence[Sequence[dict]], **kwargs) -> list[TextOutput]:
  """`generate_text` for a batch of chat conversations."""
  return generate_text(params, config, tokenizer, [list(c) for c in conversations], **kwargs)
