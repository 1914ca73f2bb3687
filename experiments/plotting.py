"""Small helpers shared by the ablation scripts: table writers and matplotlib (Agg) plots."""

from __future__ import annotations

import csv
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def write_table(rows: list[dict], out_dir: str, stem: str, meta: dict | None = None) -> tuple[str, str]:
  """Writes <stem>.csv and <stem>.json (rows + meta); returns both paths."""
  os.makedirs(out_dir, exist_ok=True)
  csv_path, json_path = os.path.join(out_dir, f"{stem}.csv"), os.path.join(out_dir, f"{stem}.json")
  keys: list[str] = []
  for r in rows:
    keys += [k for k in r if k not in keys]
  with open(csv_path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=keys)
    w.writeheader()
    for r in rows:
      w.writerow(r)
  with open(json_path, "w") as f:
    json.dump(dict(meta=meta or {}, rows=rows), f, indent=1)
  return csv_path, json_path


def new_figure(ncols: int, width: float = 5.0, height: float = 4.0):
  fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height))
  return fig, (axes if ncols > 1 else [axes])


def save_figure(fig, out_dir: str, stem: str) -> str:
  path = os.path.join(out_dir, f"{stem}.png")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
