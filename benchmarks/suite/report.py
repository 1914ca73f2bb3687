"""The suite's output: OUT_DIR/results.jsonl gets each row as soon as its item ends (a run cut short keeps every
finished row) and OUT_DIR/suite.md, the markdown tables by section, is rewritten after every row.

A row is a flat dict with at least `section` (a..e), `item`, `status` (ok | mismatch | error | skipped) and, for a
failure or a skip, `error` (one line). Other keys are the item's measurements; the table shows each section's keys
in the order its rows first used them.
"""

from __future__ import annotations

import json
import math
import os

SECTIONS = {
    "a": "Versions, measured ceilings, a row's bits across row counts",
    "b": "Kernels at V4-Flash shapes: fused top-k diagnosis, correctness, time (same executable)",
    "c": "Main job on this device (experiments.serve, shipped model)",
    "d": "Engine at V4-Flash attention widths",
    "e": "Kernel tuning rows",
}
STATUSES = ("ok", "mismatch", "error", "skipped")
HIDDEN = ("section", "table", "arrays")     # in results.jsonl only


def one_line(text: str, limit: int = 400) -> str:
  lines = [ln.strip() for ln in str(text or "").splitlines() if ln.strip()]
  return (lines[-1] if lines else "")[:limit]


def error_line(e: BaseException) -> str:
  """An exception as one line: its type and the last line of its message (XLA's and Triton's messages end with
  the cause)."""
  return f"{type(e).__name__}: {one_line(str(e))}"


def _jsonable(x):
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (str, int, bool)) or x is None:
    return x
  try:
    f = float(x)
    return f if math.isfinite(f) else None
  except (TypeError, ValueError):
    return str(x)


def _cell(v) -> str:
  if v is None:
    return ""
  if isinstance(v, float):
    return f"{v:.4g}"
  if isinstance(v, (dict, list)):
    return json.dumps(v, separators=(",", ":"))[:160]
  return str(v).replace("|", "/").replace("\n", " ")


class Report:
  def __init__(self, out_dir: str, header: dict):
    self.out_dir = out_dir
    os.makedirs(out_dir, exist_ok=True)
    self.results = os.path.join(out_dir, "results.jsonl")
    self.md = os.path.join(out_dir, "suite.md")
    self.header = dict(header)
    self.rows: list[dict] = []
    open(self.results, "w").close()
    self.write_md()

  def add(self, row: dict) -> dict:
    row = _jsonable(row)
    self.rows.append(row)
    with open(self.results, "a") as f:
      f.write(json.dumps(row) + "\n")
    self.write_md()
    return row

  def counts(self) -> dict:
    return {s: sum(r.get("status") == s for r in self.rows) for s in STATUSES}

  def render(self) -> str:
    h = self.header
    lines = [f"# GPU suite ({h.get('mode', '?')})", ""]
    lines += [f"{k}: {_cell(v)}" for k, v in h.items() if k != "mode"]
    lines += ["", "rows: " + ", ".join(f"{k} {v}" for k, v in self.counts().items() if v), ""]
    for sec, title in SECTIONS.items():
      rows = [r for r in self.rows if r.get("section") == sec]
      if not rows:
        continue
      lines += [f"## {sec}. {title}", ""]
      tables = []
      for r in rows:                  # a section's rows by their `table`, in the order tables first appear
        if r.get("table", "") not in tables:
          tables.append(r.get("table", ""))
      for t in tables:
        trows = [r for r in rows if r.get("table", "") == t]
        keys = []
        for r in trows:
          keys += [k for k in r if k not in keys and k not in HIDDEN]
        keys = ([k for k in ("item", "status") if k in keys]
                + [k for k in keys if k not in ("item", "status", "error")])
        keys += ["error"] if any("error" in r for r in trows) else []
        lines += [f"### {t}", ""] if t else []
        lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in trows]
        lines.append("")
    return "\n".join(lines)

  def write_md(self) -> None:
    tmp = self.md + ".tmp"
    with open(tmp, "w") as f:
      f.write(self.render())
    os.replace(tmp, self.md)
