"""CI checks of experiments/: task determinism, the --small paths of train / ablations, the shipped checkpoint."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import tasks
from experiments import train_lib as L

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CKPT = os.path.join(REPO, "experiments", "checkpoints", "v4_retrieval")


def _run(args, timeout=300):
  r = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  return r


def test_task_deterministic_and_out_of_window():
  spec = tasks.KVRecallSpec(seq_len=128, num_pairs=4, num_queries=4, min_gap=32)
  a, b = tasks.make_batch(spec, 7, 3), tasks.make_batch(spec, 7, 3)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(a["tokens"], tasks.make_batch(spec, 8, 3)["tokens"])
  t_idx = np.nonzero(a["mask"])
  # every answer is the value stored right after the same key, and it lies >= min_gap before the query
  for bi, t in zip(*t_idx):
    src = a["src_pos"][bi, t]
    assert a["tokens"][bi, src - 1] == a["tokens"][bi, t]
    assert a["tokens"][bi, src] == a["targets"][bi, t]
    assert t - src > spec.min_gap
  assert a["mask"].sum() == 3 * spec.num_queries


def test_config_roundtrip():
  c = L.retrieval_config()
  assert L.config_from_dict(json.loads(json.dumps(L.config_to_dict(c)))) == c


def test_attention_cost_monotone_in_k():
  c = L.retrieval_config()
  costs = [L.attention_cost(L.with_topk(c, k), 256)["total_flops"] for k in (1, 4, 16, 64)]
  assert costs == sorted(costs) and costs[0] < costs[-1]


def test_train_small(tmp_path):
  out = tmp_path / "ck"
  _run(["experiments.train", "--small", f"--out_dir={out}"])
  config, params = L.load_trained(str(out))
  assert config.attention.window == 8
  info = json.load(open(out / "config.json"))
  assert info["small"] and "64" in info["final_eval"]


@pytest.mark.skipif(not os.path.isdir(CKPT), reason="shipped checkpoint missing")
@pytest.mark.parametrize("script,stem", [("experiments.ablate_topk", "topk"), ("experiments.ablate_window", "window")])
def test_ablation_small(tmp_path, script, stem):
  _run([script, "--small", f"--out_dir={tmp_path}"])
  for ext in ("csv", "json", "png"):
    assert (tmp_path / f"{stem}.{ext}").stat().st_size > 0
  rows = json.load(open(tmp_path / f"{stem}.json"))["rows"]
  assert rows and all(0.0 <= r["accuracy"] <= 1.0 for r in rows)


@pytest.mark.skipif(not os.path.isdir(CKPT), reason="shipped checkpoint missing")
def test_shipped_checkpoint_loads_and_is_small():
  config, params = L.load_trained("v4_retrieval")
  assert config.variant == "v4" and L.count_params(params) > 0 if hasattr(L, "count_params") else True
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(CKPT) for f in fs)
  assert size <= 20 * 2**20
