"""Markdown tables on stdout: what every maintained benchmark prints (BUILD_NOTES.md quotes them as they are)."""

from __future__ import annotations

import math


def fmt(v, digits: int = 3) -> str:
  """A cell: floats to `digits` significant decimals (large ones as integers), None as empty, the rest as str."""
  if v is None:
    return ""
  if isinstance(v, bool):
    return "yes" if v else "no"
  if isinstance(v, float):
    if math.isnan(v):
      return "nan"
    if abs(v) >= 1000:
      return f"{v:.0f}"
    return f"{v:.{digits}g}" if abs(v) < 1 else f"{v:.{digits}f}".rstrip("0").rstrip(".")
  if isinstance(v, (list, tuple)):
    return " / ".join(fmt(x, digits) for x in v)
  return str(v)


def print_table(headers: list[str], rows: list[list], title: str | None = None) -> None:
  """One markdown table (optionally preceded by a title line), flushed at once."""
  lines = [] if title is None else ["", title]
  lines.append("| " + " | ".join(headers) + " |")
  lines.append("|" + " --- |" * len(headers))
  lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
  print("\n".join(lines), flush=True)
