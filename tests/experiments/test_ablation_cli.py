"""The experiment scripts' command lines: `--help` lists every flag the module docstring names, the scripts that
write results do so outside the tracked tree by default (out/<script>/, ignored), and `--refresh_results` (the
committed experiments/results/) refuses a --small run and re-draws committed plots with --replot."""

import ast
import os
import re
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = ["ablate_topk", "ablate_window", "ablate_retention", "ablate_eviction", "tiers_workload", "precision",
           "cache_bytes", "v41_quant_cache_parity", "train", "ablate_spec", "ablate_multikey", "ablate_resume",
           "ablate_indexer_recall"]
WRITERS = {"ablate_topk", "ablate_window", "ablate_retention", "ablate_eviction", "tiers_workload", "ablate_spec",
           "ablate_multikey", "ablate_resume", "ablate_indexer_recall"}


def _run(args, cwd=REPO, timeout=180):
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  r = subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
  return r.returncode, r.stdout + r.stderr


def _docstring(script):
  with open(os.path.join(REPO, "experiments", f"{script}.py")) as f:
    return ast.get_docstring(ast.parse(f.read()))


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_lists_every_flag_the_docstring_names(script):
  _, out = _run([f"experiments.{script}", "--help"])
  listed = set(re.findall(r"^\s+--(?:\[no\])?(\w+):", out, re.M))
  named = set(re.findall(r"(?<![\w-])--(\w+)", _docstring(script)))
  assert named and named <= listed, (sorted(named - listed), out[-3000:])
  if script in WRITERS:
    # the output flags are documented, not only defined, and the default is untracked
    assert {"out_dir", "refresh_results", "replot"} <= named, sorted(named)
    default = re.search(r"--out_dir:.*?\(default: '([^']*)'\)", out, re.S).group(1)
    assert default == f"out/{script}"
    with open(os.path.join(REPO, ".gitignore")) as f:
      assert "/out/" in f.read().split()


def test_importing_the_scripts_defines_no_flags():
  """Flags are defined when a script runs, so tests, the notebook and ablate_eviction can import `run` / `plot` (and
  serve's flags) in one process."""
  from absl import flags
  from experiments import (ablate_eviction, ablate_retention, ablate_spec, ablate_topk, ablate_window,  # noqa: F401
                           tiers_workload)
  assert "refresh_results" not in flags.FLAGS and "replot" not in flags.FLAGS


def test_refresh_results_refuses_a_small_run():
  committed = os.path.join(REPO, "experiments", "results", "retention.json")
  before = os.stat(committed).st_mtime_ns
  rc, out = _run(["experiments.ablate_retention", "--small", "--refresh_results"])
  assert rc != 0 and "not with --small" in out, out[-2000:]
  rc, out = _run(["experiments.ablate_eviction", "--refresh_results", "--out_dir=/tmp/x"])
  assert rc != 0 and "drop --out_dir" in out, out[-2000:]
  assert os.stat(committed).st_mtime_ns == before


def test_replot_redraws_from_the_table(tmp_path):
  """--replot draws <stem>.png from the <stem>.json in the output directory without running the sweep (here: a
  copy of the committed eviction table; --replot --refresh_results does this for the committed plot)."""
  shutil.copy(os.path.join(REPO, "experiments", "results", "eviction.json"), tmp_path / "eviction.json")
  rc, out = _run(["experiments.ablate_eviction", "--replot", f"--out_dir={tmp_path}"])
  assert rc == 0, out[-2000:]
  assert (tmp_path / "eviction.png").stat().st_size > 20_000 and not (tmp_path / "eviction.csv").exists()
