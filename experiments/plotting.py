"""Helpers shared by the experiment scripts: output directories, table writers, and matplotlib (Agg) plots that read.

Plots: a swept knob goes on a numeric axis (`knob_axis`: log2 for a geometric sweep, ticks at the swept values);
series on one axes differ in colour, marker and line style, and earlier series are drawn larger and underneath so a
series that coincides with another still shows around it (`series_style`); legends sit outside the data area and
no text is placed at data points. `plot_problems` checks a figure for the ways a plot stops reading (texts printed
over each other, a series hidden under another or under a legend, text at data points, a swept knob on a categorical
axis); the tests run it on every ablation plot.
"""

from __future__ import annotations

import csv
import json
import os
from typing import NamedTuple

from absl import app, flags
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

# The flags `define_output_flags` defines belong to the script that calls it, so that script's --help lists them.
flags.disclaim_key_flags()

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ------------------------------------------------------------------------------------------ output directory
def define_output_flags(script: str, what: str, results_subdir: str = "") -> None:
  """--out_dir (default out/<script>, untracked) and --refresh_results (the committed experiments/results/)."""
  committed = os.path.join("experiments", "results", results_subdir).rstrip("/")
  flags.DEFINE_string("out_dir", os.path.join("out", script),
                      f"Where {what} go (relative to the working directory; the default, out/{script}, is "
                      "untracked, so a run never overwrites the committed results).")
  flags.DEFINE_bool("refresh_results", False,
                    f"Write to the committed {committed}/ instead of --out_dir: refresh the committed results "
                    "(a full run: not with --small or --out_dir).")


def output_dir(results_subdir: str = "", flag_values=flags.FLAGS) -> str:
  """The directory a run writes to: --out_dir, or the committed results with --refresh_results."""
  f = flag_values
  if not f.refresh_results:
    return f.out_dir
  if f["out_dir"].present:
    raise app.UsageError("--refresh_results writes to the committed results directory: drop --out_dir")
  if "small" in f and f.small:
    raise app.UsageError("--refresh_results refreshes the committed full-run results: not with --small")
  return os.path.join(RESULTS_DIR, results_subdir) if results_subdir else RESULTS_DIR


def read_table(out_dir: str, stem: str) -> tuple[list[dict], dict]:
  """(rows, meta) of a <stem>.json that `write_table` wrote."""
  with open(os.path.join(out_dir, f"{stem}.json")) as f:
    d = json.load(f)
  return d["rows"], d.get("meta", {})


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


# ------------------------------------------------------------------------------------------ figures
def new_figure(ncols: int, width: float = 5.0, height: float = 4.0):
  fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height))
  return fig, (list(axes) if ncols > 1 else [axes])


def layout(fig) -> list:
  """tight_layout, then each `legend_below` legend anchored just under its axes' tick and axis labels (outside the
  layout, so the axes keep their height). Returns those legends (savefig must be told to keep them)."""
  fig.tight_layout()
  fig.canvas.draw()
  r = fig.canvas.get_renderer()
  below = []
  for ax in fig.axes:
    lg = ax.get_legend()
    if lg is None or not getattr(lg, "_below", False):
      continue
    box = ax.get_position()
    bottom = ax.xaxis.get_tightbbox(r).y0 - 6                 # display px, under the x tick / axis labels
    _, y = fig.transFigure.inverted().transform((0, bottom))
    lg.set_bbox_to_anchor((box.x0 + box.width / 2, y), transform=fig.transFigure)
    below.append(lg)
  return below


def save_figure(fig, out_dir: str, stem: str) -> str:
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"{stem}.png")
  below = layout(fig)
  fig.savefig(path, dpi=110, bbox_inches="tight", bbox_extra_artists=below)
  plt.close(fig)
  return path


def replot(plot, out_dir: str, stem: str) -> str:
  """`--replot`: the figure drawn again from the table a run already wrote (`plot(rows, meta)`), no sweep."""
  return save_figure(plot(*read_table(out_dir, stem)), out_dir, stem)


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "h")
_LINESTYLES = ("-", "--", "-.", ":", (0, (6, 2, 1, 2, 1, 2)), (0, (1, 1)))


def series_style(i: int, n: int, linestyle=None, hollow: bool = False) -> dict:
  """Plot kwargs of series i of n on one axes. Colour, marker and line style differ per series; earlier series are
  drawn larger and underneath (zorder), so where series coincide each one still shows as a ring / band around the
  next (equal accuracies at two context lengths, two policies with the same hit rate)."""
  under = n - 1 - i
  return dict(color=f"C{i % 10}", marker=_MARKERS[i % len(_MARKERS)],
              linestyle=_LINESTYLES[i % len(_LINESTYLES)] if linestyle is None else linestyle,
              markersize=4.0 + 2.2 * under, linewidth=1.0 + 0.6 * under, alpha=0.85, zorder=3 + i,
              markerfacecolor="none" if hollow else f"C{i % 10}")


def _fmt(v) -> str:
  return f"{v:g}" if isinstance(v, float) and not float(v).is_integer() else str(int(v))


def _geometric(vals: list[float]) -> bool:
  """A sweep that reads on a log axis: >= 2 values > 0 (besides 0 itself) that are all powers of two or span a
  factor >= 4."""
  pos = [v for v in vals if v > 0]
  if len(pos) < 2 or vals[0] < 0:
    return False
  return pos[-1] / pos[0] >= 4 or all(float(v).is_integer() and int(v) & (int(v) - 1) == 0 for v in pos)


class _KnobAxis(NamedTuple):
  """What `knob_axis` put on an axes (kept on it for `knob_values` / `plot_problems`)."""
  axis: str            # "x" or "y"
  values: list[float]  # the swept values, sorted


def knob_axis(ax, values, label: str, axis: str = "x") -> None:
  """A numeric axis for a swept knob. Geometric sweeps (powers of two, or a span >= 4x) get a log2 scale; a sweep
  that also holds 0 (retention interval 0) gets symlog, its linear part [0, smallest positive value] one log2
  step wide. Ticks at the swept values, labelled with the values themselves (no 2^k / 10^k tick labels)."""
  vals = sorted({float(v) for v in values})
  scale = getattr(ax, f"set_{axis}scale")
  if _geometric(vals):
    if vals[0] == 0:
      scale("symlog", base=2, linthresh=vals[1], linscale=0.5)   # symlog widens the linear part by 1/(1 - 1/base)
    else:
      scale("log", base=2)
  a = ax.xaxis if axis == "x" else ax.yaxis
  a.set_major_locator(ticker.FixedLocator(vals))
  a.set_major_formatter(ticker.FixedFormatter([_fmt(v) for v in vals]))
  a.set_minor_locator(ticker.NullLocator())
  ax._knob_values = _KnobAxis(axis, vals)
  if axis == "x" and (len(vals) > 8 or max(len(_fmt(v)) for v in vals) * len(vals) > 40):
    ax.tick_params(axis="x", labelrotation=45)    # many or long labels: rotated so neighbours cannot touch
  getattr(ax, f"set_{axis}label")(label)


def legend_below(ax, handles=None, labels=None, ncol: int | None = None, **kw):
  """A legend under the axes, outside the data area (so it can hide no series); `layout` places it."""
  if handles is None:
    handles, labels = ax.get_legend_handles_labels()
  lg = ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=ncol or min(len(handles), 2),
                 fontsize=8, frameon=False, **kw)
  lg.set_in_layout(False)
  lg._below = True
  return lg


def proxy(label: str, **kw) -> tuple[Line2D, str]:
  """A legend-only handle (e.g. 'dashed = window only'), no data."""
  return Line2D([], [], **kw), label


# ------------------------------------------------------------------------------------------ checks
def _texts(fig):
  out = [t for t in fig.texts]
  if fig._suptitle is not None:
    out.append(fig._suptitle)
  for ax in fig.axes:
    out += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
    for a in (ax.xaxis, ax.yaxis):
      lo, hi = sorted(a.get_view_interval())
      eps = 1e-9 * max(abs(lo), abs(hi), 1.0)
      for ticks in (a.get_major_ticks(), a.get_minor_ticks()):   # log axes label minor ticks too (3x10^2)
        out += [t.label1 for t in ticks if t.label1.get_visible() and lo - eps <= t.get_loc() <= hi + eps]
    lg = ax.get_legend()
    if lg is not None:
      out += list(lg.get_texts()) + [lg.get_title()]
  return [t for t in out if t.get_visible() and t.get_text().strip()]


def text_overlaps(fig) -> list[tuple[str, str]]:
  """Pairs of visible texts (tick labels, axis labels, titles, legend entries, annotations) whose drawn boxes
  intersect, i.e. labels printed over each other (after the `layout` that `save_figure` applies)."""
  layout(fig)
  r = fig.canvas.get_renderer()
  texts = _texts(fig)
  boxes = [t.get_window_extent(r).shrunk(0.96, 0.9) for t in texts]   # touching is not overlapping
  out = []
  for i in range(len(texts)):
    for j in range(i + 1, len(texts)):
      if boxes[i].overlaps(boxes[j]) and boxes[i].width > 0 and boxes[j].width > 0:
        out.append((texts[i].get_text(), texts[j].get_text()))
  return out


def _has_marker(line) -> bool:
  return line.get_marker() not in ("None", None, "", " ")


def _has_line(line) -> bool:
  return line.get_linestyle() not in ("None", "", " ")


def hidden_series(fig) -> list[tuple[str, str]]:
  """Pairs of data series on one axes that could hide one another: they share a point (markers) or a segment
  (lines) and the one drawn underneath is not larger than the one on top, or they are drawn identically."""
  out = []
  for ax in fig.axes:
    lines = [ln for ln in ax.get_lines() if ln.get_visible() and len(ln.get_xdata()) >= 1]
    order = sorted(range(len(lines)), key=lambda k: (lines[k].get_zorder(), k))
    for a_i, a in enumerate(order):
      for b in order[a_i + 1:]:
        lo, hi = lines[a], lines[b]                    # lo drawn first (underneath)
        x0, y0 = np.asarray(lo.get_xdata(), float), np.asarray(lo.get_ydata(), float)
        x1, y1 = np.asarray(hi.get_xdata(), float), np.asarray(hi.get_ydata(), float)
        shared = np.isclose(x0[:, None], x1[None, :]) & np.isclose(y0[:, None], y1[None, :], rtol=1e-3, atol=1e-9)
        if not shared.any():
          continue
        same_look = (lo.get_color() == hi.get_color() and lo.get_marker() == hi.get_marker()
                     and lo.get_linestyle() == hi.get_linestyle())
        covered = (_has_marker(lo) and _has_marker(hi) and lo.get_markersize() <= hi.get_markersize()
                   and hi.get_markerfacecolor() != "none")          # a filled marker on top, as large or larger
        covered |= (_has_line(lo) and _has_line(hi) and not _has_marker(lo) and shared.sum() >= 2
                    and lo.get_linewidth() <= hi.get_linewidth() and lo.get_linestyle() == hi.get_linestyle())
        if same_look or covered:
          out.append((lo.get_label(), hi.get_label()))
  return out


def legend_over_data(fig) -> list[str]:
  """Labels of data series with a point under a legend box (a legend inside the axes can hide a series)."""
  layout(fig)
  r = fig.canvas.get_renderer()
  out = []
  for ax in fig.axes:
    boxes = [lg.get_window_extent(r) for lg in [ax.get_legend()] if lg is not None]
    for line in ax.get_lines():
      if not (line.get_visible() and _has_marker(line) and len(line.get_xdata())):
        continue
      pts = line.get_transform().transform(np.column_stack([line.get_xdata(), line.get_ydata()]).astype(float))
      if any(b.contains(x, y) for b in boxes for x, y in pts):
        out.append(line.get_label())
  return out


def knob_values(fig) -> list[list[float] | None]:
  """Per axes: the swept values `knob_axis` put on it (None for an axes without a knob axis)."""
  return [knob.values if (knob := getattr(ax, "_knob_values", None)) else None for ax in fig.axes]


def plot_problems(fig) -> list[str]:
  """Everything that keeps a figure from reading; [] for a good one."""
  out = [f"texts printed over each other: {a!r} / {b!r}" for a, b in text_overlaps(fig)]
  out += [f"series {a!r} hidden under {b!r}" for a, b in hidden_series(fig)]
  out += [f"series {a!r} has points under the legend" for a in legend_over_data(fig)]
  for i, ax in enumerate(fig.axes):
    if ax.texts:
      out.append(f"axes {i}: text at data points {[t.get_text() for t in ax.texts]}")
    knob = getattr(ax, "_knob_values", None)
    if knob is None:
      continue
    axis, vals = knob.axis, knob.values
    a = ax.xaxis if axis == "x" else ax.yaxis
    if _geometric(vals) and a.get_scale() not in ("log", "symlog"):
      out.append(f"axes {i}: a geometric sweep {vals} on a {a.get_scale()} axis")
    if a.get_scale() == "log" and getattr(a.get_transform(), "base", 2) != 2:
      out.append(f"axes {i}: log axis not in base 2")
    locs = [float(x) for x in a.get_majorticklocs()]
    if not np.allclose(sorted(locs), vals):
      out.append(f"axes {i}: ticks {locs} are not the swept values {vals}")
  return out
