"""The main job's files: the requests it reads (JSONL) and the outputs.jsonl / metrics figures it writes.

outputs.jsonl gets one line per request as it ends (flushed, refused requests first), so a run killed midway keeps
every finished answer; at the end it is rewritten in input order by one atomic rename. metrics.json is strict JSON
(`finite`: no NaN, a statistic with no sample is null).
"""

from __future__ import annotations

import json
import math
import os

from dsv4.engine import schema
from dsv4.engine.api import WorkloadReport, grade
from dsv4.engine.request import RequestOutput
from dsv4.engine.workloads import Turn, Workload


def read_requests(path: str, vocab_size: int, tokenizer=None):
  """JSONL -> (Workload of the valid requests, [(line, id, error)] of the refused ones, order, stops, lines).

  Line numbers are 1-based, as an editor shows them. Every line is checked by the one request schema; a bad line
  (malformed JSON, unknown key, wrong type or range, duplicate id, including a collision with a default `line<n>`
  id) is refused on its own and the rest are served. Turns of one (tenant, session) run in file order, one wave
  each; requests without a session are independent. `order` lists ("ok", id) / ("refused", k) per non-blank line,
  in file order; `stops` maps ids to stop strings; `lines` maps the served ids to their line."""
  refused, order, seen, stops = [], [], {}, {}
  waves: list[list[Turn]] = []
  turns_of: dict[tuple[str, str], int] = {}
  with open(path) as f:
    lines = f.read().splitlines()
  for i, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    default_id, d = f"line{i}", None
    try:
      try:
        d = json.loads(line)
      except ValueError as e:
        raise schema.RequestError(f"not valid JSON ({e})") from e
      spec = schema.parse_request(d, vocab_size=vocab_size, default_id=default_id, tokenizer=tokenizer)
      if spec.id in seen:
        how = "id" if "id" in d else "default id"
        raise schema.RequestError(f"{how} {spec.id!r} is already used by line {seen[spec.id]}; ids must be unique")
    except schema.RequestError as e:
      rid = d["id"] if isinstance(d, dict) and isinstance(d.get("id"), str) else default_id
      order.append(("refused", len(refused)))
      refused.append((i, rid, str(e)))
      continue
    seen[spec.id] = i
    if spec.session:
      key = (spec.tenant, spec.session)
      w = turns_of.get(key, 0)
      turns_of[key] = w + 1
      session = spec.session
    else:
      w, session = 0, ""
    while len(waves) <= w:
      waves.append([])
    waves[w].append(Turn(session, spec.prompt, spec.params, rid=spec.id, expected=spec.expected,
                         tenant=spec.tenant))
    if spec.stop:
      stops[spec.id] = spec.stop
    order.append(("ok", spec.id))
  return Workload(os.path.basename(path), tuple(tuple(w) for w in waves)), refused, order, stops, seen


def refused_output(rid: str, error: str):
  """The RequestOutput of a request refused before it reached the engine."""
  return RequestOutput(rid, [], [], "error", error, 0, 0, 0, 0, None, None)


class Recorder:
  """One outputs.jsonl record per finished request: its answer graded, text decoded (cut before the stop string that
  ended it) when the checkpoint has a tokenizer, tenant and session when it has them."""

  def __init__(self, tokenizer, stopper, workload):
    self.tokenizer, self.stopper = tokenizer, stopper
    self.tenant_session = {t.rid or f"{t.session}.t{w}": (t.tenant, t.session) for w, wave in enumerate(workload.waves)
                           for t in wave}

  def __call__(self, o, expected, line=None) -> dict:
    rec = {"id": o.rid, "prompt_len": len(o.prompt), "output": o.output,
           "expected": None if expected is None else list(expected),
           "correct": None if o.error is not None else grade(o.output, expected),
           "finish_reason": o.finish_reason, "error": o.error, "hit_tokens": o.hit_tokens,
           "tier_hit_tokens": o.tier_hit_tokens}
    if line is not None:
      rec["line"] = line
    if self.tokenizer is not None and o.error is None:
      if self.stopper is not None:
        text, hit = self.stopper.text(o.rid, o.output)
      else:
        text, hit = self.tokenizer.decode(o.output), None
      rec["text"] = text
      if hit is not None:
        rec["finish_reason"], rec["stop"] = "stop", hit
    if o.rid in self.tenant_session and any(self.tenant_session[o.rid]):
      rec["tenant"], rec["session"] = self.tenant_session[o.rid]
    return rec


class OutputsFile:
  """<out_dir>/outputs.jsonl: lines appended and flushed as requests end, then `rewrite` puts them in input order."""

  def __init__(self, out_dir: str):
    os.makedirs(out_dir, exist_ok=True)
    self.path = os.path.join(out_dir, "outputs.jsonl")
    self._f = open(self.path, "w")

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self._f.close()

  def emit(self, rec: dict) -> None:
    self._f.write(json.dumps(rec) + "\n")
    self._f.flush()                   # a run killed midway keeps every finished answer

  def rewrite(self, records: list[dict]) -> None:
    """The whole file at once: one atomic rename, so the file is always whole."""
    with open(self.path + ".tmp", "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(self.path + ".tmp", self.path)


def in_input_order(report, records: dict[str, dict], order, refused, refused_records):
  """(report, records) in the order of the --requests file, refused requests in their place; without a file
  (order None) the engine's order as it is."""
  rows = list(zip(report.outputs, report.expected))
  if order is None:
    return report, [records[o.rid] for o, _ in rows]
  by_id = {o.rid: (o, e) for o, e in rows}
  rows, final = [], []
  for kind, key in order:
    if kind == "ok":
      rows.append(by_id[key])
      final.append(records[key])
    else:
      _, rid, err = refused[key]
      rows.append((refused_output(rid, err), None))
      final.append(refused_records[key])
  waited = dict(zip([o.rid for o in report.outputs], report.waited_on_compile))
  return (WorkloadReport([o for o, _ in rows], report.wall_s, report.stats, report.peak_blocks, [e for _, e in rows],
                         [waited.get(o.rid, False) for o, _ in rows]), final)


def finite(x):
  """x with every non-finite float (NaN, inf) as None, numpy scalars as Python ones: strict JSON."""
  if hasattr(x, "item") and not isinstance(x, (list, tuple, dict, str)) and getattr(x, "ndim", 1) == 0:
    x = x.item()
  if isinstance(x, float):
    return x if math.isfinite(x) else None
  if isinstance(x, dict):
    return {k: finite(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [finite(v) for v in x]
  return x


def format_table(summary: dict) -> str:
  rows = [(k, "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in summary.items()]
  w = max(len(k) for k, _ in rows)
  line = "+" + "-" * (w + 2) + "+" + "-" * 14 + "+"
  return "\n".join([line] + [f"| {k:<{w}} | {v:>12} |" for k, v in rows] + [line])
