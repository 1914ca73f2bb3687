"""The ablation plots read. Drawn from the committed full-run tables (experiments/results/), every plot keeps its
swept knob on a numeric axis with the swept values as ticks, prints no text over other text, hides no series under
another and puts no labels at data points (`plotting.plot_problems`); and those checks catch the failures they are
for (the old retention plot's "R=0" / "R=512" labels at one point, two series drawn alike on the same values).
`checked_outputs` applies the same checks to a --small run's files (test_experiments.py, test_ablate_cache.py)."""

import csv
import importlib
import os

import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pytest

from experiments import plotting


def checked_outputs(out_dir, script, stem, knob, swept):
  """The rows of a run's <stem>.json, once its CSV holds the same rows, its PNG is a real picture (size, many
  colours) and its figure, drawn again from the table, reads with the swept values on the knob axes."""
  rows, meta = plotting.read_table(str(out_dir), stem)
  with open(os.path.join(out_dir, f"{stem}.csv")) as f:
    assert [r[knob] for r in csv.DictReader(f)] == [str(r[knob]) for r in rows]
  png = os.path.join(out_dir, f"{stem}.png")
  img = matplotlib.image.imread(png)
  colours = np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
  assert os.path.getsize(png) > 20_000 and img.shape[0] > 300 and img.shape[1] > 600 and len(colours) > 50
  fig = importlib.import_module(f"experiments.{script}").plot(rows, meta)
  assert plotting.plot_problems(fig) == []
  knobs = [v for v in plotting.knob_values(fig) if v is not None]
  assert knobs and all(v == sorted(swept) for v in knobs), knobs
  plt.close(fig)
  return rows

COMMITTED = [("ablate_topk", "topk", "k"), ("ablate_topk", "topk_v4_count", "k"),
             ("ablate_topk", "topk_v41_retrieval", "k"), ("ablate_window", "window", "window"),
             ("ablate_retention", "retention", "retention_interval"),
             ("ablate_eviction", "eviction", "num_full_blocks"), ("ablate_spec", "spec", "k")]


@pytest.mark.parametrize("script,stem,knob", COMMITTED)
def test_committed_results_plot_reads(tmp_path, script, stem, knob):
  rows, meta = plotting.read_table(plotting.RESULTS_DIR, stem)
  fig = importlib.import_module(f"experiments.{script}").plot(rows, meta)
  assert plotting.plot_problems(fig) == []
  swept = sorted({float(r[knob]) for r in rows if r.get("path", "topk") == "topk"})
  on_axes = [v for v in plotting.knob_values(fig) if v is not None]
  assert on_axes and all(v == swept for v in on_axes), (on_axes, swept)
  assert os.path.getsize(plotting.save_figure(fig, str(tmp_path), stem)) > 20_000


def test_tiers_plot_reads():
  from experiments import tiers_workload
  rows, _ = plotting.read_table(os.path.join(plotting.RESULTS_DIR, "tiers"), "tiers_workload")
  fig = tiers_workload.plot(rows)
  assert plotting.plot_problems(fig) == []
  labels = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
  # the committed run has no device hits: the legend says so instead of showing a colour with no bar
  assert all(r["device_hit_tokens"] == 0 for r in rows) and "device hit (0 in every configuration)" in labels
  plt.close(fig)


def test_checks_catch_labels_printed_over_each_other():
  fig, (ax,) = plotting.new_figure(1)
  ax.plot([186, 259], [21616, 3224], "o-")
  for text in ("R=0", "R=512"):             # two intervals that land on one point, labelled at the point
    ax.annotate(text, (259, 3224), textcoords="offset points", xytext=(3, 3), fontsize=7)
  problems = plotting.plot_problems(fig)
  assert any("'R=0' / 'R=512'" in p for p in problems) and any("text at data points" in p for p in problems)
  plt.close(fig)
  fig, (ax,) = plotting.new_figure(1, width=4.5)   # the old eviction axis: log10 minor labels 3x10^2 / 4x10^2 collide
  ax.plot([48, 64, 96, 128, 192, 256, 384, 512], np.linspace(20, 85, 8), "o-")
  ax.set_xscale("log")
  assert plotting.text_overlaps(fig)
  plt.close(fig)


def test_checks_catch_a_hidden_series():
  fig, (ax,) = plotting.new_figure(1)
  for T in (256, 512):                          # equal accuracies drawn the same size: the first one disappears
    ax.plot([1, 2, 4], [1.0, 1.0, 1.0], "o-", label=f"T={T}")
  assert plotting.hidden_series(fig) == [("T=256", "T=512")]
  plt.close(fig)
  fig, (ax,) = plotting.new_figure(1)
  for i, T in enumerate((256, 512)):
    ax.plot([1, 2, 4], [1.0, 1.0, 1.0], label=f"T={T}", **plotting.series_style(i, 2))
  assert plotting.hidden_series(fig) == []
  plt.close(fig)
  fig, (ax,) = plotting.new_figure(1)
  ax.plot([1, 2, 4], [1.0, 0.5, 0.0], "o-", label="lru")
  ax.legend(loc="upper left")                   # inside the axes, over the first point
  assert plotting.legend_over_data(fig) == ["lru"] and plotting.plot_problems(fig)
  plt.close(fig)


def test_knob_axis_is_numeric():
  fig, (k, r, lin) = plotting.new_figure(3)
  plotting.knob_axis(k, [1, 2, 4, 8, 16], "k")
  plotting.knob_axis(r, [0, 128, 256, 512], "R")
  plotting.knob_axis(lin, [10, 20, 30], "x")
  assert (k.get_xscale(), r.get_xscale(), lin.get_xscale()) == ("log", "symlog", "linear")
  assert k.xaxis.get_transform().base == 2
  assert [t.get_text() for t in k.get_xticklabels()] == ["1", "2", "4", "8", "16"]
  # symlog: R = 0 sits one log2 step left of 128, as 128 sits left of 256
  x = r.transData.transform([(0, 0), (128, 0), (256, 0), (512, 0)])[:, 0]
  np.testing.assert_allclose(np.diff(x), np.diff(x)[0], rtol=1e-6)
  assert plotting.knob_values(fig) == [[1, 2, 4, 8, 16], [0, 128, 256, 512], [10, 20, 30]]
  plt.close(fig)
