"""The multi-key task, exact restore vs bounded replay, indexer recall under quantized keys, and the multi-turn
retention traces (docs/ablations.md): task invariants, library checks, and each script's --small run with the
columns its table promises and a plot that reads."""

import dataclasses
import os

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import pytest

from experiments import plotting
from experiments import recall_lib
from experiments import tasks
from tests.experiments.test_ablation_plots import checked_outputs


def test_multikey_task_answers_the_fraction_of_slots_holding_the_key():
  spec = tasks.MultiKeySpec(seq_len=192, ms=(1, 4, 16))
  a, b = tasks.make_batch(spec, 5, 64), tasks.make_batch(spec, 5, 64)
  assert all(np.array_equal(a[k], b[k]) for k in a)                        # deterministic
  T = spec.seq_len
  for i in range(64):
    m, c = int(a["m"][i]), int(a["count"][i])
    pos = a["src_pos"][i, T - 2][:m]
    assert (a["src_pos"][i, T - 2][m:] == -1).all() and (pos >= 1).all()
    assert np.all(np.diff(pos) >= 8)                                       # one slot per overlapping entry pair
    assert pos.max() < T - 3 - spec.min_gap + 1                             # beyond the window of the query
    keys = a["tokens"][i, pos]
    assert int((keys == spec.key_lo).sum()) == c and len(set(keys[keys != spec.key_lo])) == m - c
    assert a["targets"][i, T - 2] == spec.count_lo + spec.levels * c // m
    store = a["tokens"][i, 1:T - 3]
    assert int(((store >= spec.key_lo) & (store < spec.key_hi)).sum()) == m    # no other key tokens
  assert set(a["m"].tolist()) == {1, 4, 16}
  assert tasks.spec_from_dict(dataclasses.asdict(spec)) == spec
  with pytest.raises(ValueError):
    tasks.MultiKeySpec(seq_len=96, ms=(16,)).validate()


def test_key_formats_lose_in_order_and_fp32_recall_is_one():
  q, w, k = recall_lib.random_indexer(16, 64, 2048, 4, seed=1)
  ref = recall_lib.index_scores(q, w, k)
  rec = {f: recall_lib.recall_at_k(ref, recall_lib.index_scores(q, w, recall_lib.quantize_keys(k, f)), 128)
         for f in recall_lib.FORMATS}
  assert rec["fp32"] == 1.0
  assert 1.0 >= rec["bf16"] >= rec["fp8"] >= rec["fp4"] > 0.5, rec
  e8 = np.abs(np.asarray(recall_lib.quantize_keys(k, "fp8") - k)).max()
  e4 = np.abs(np.asarray(recall_lib.quantize_keys(k, "fp4") - k)).max()
  assert 0 < e8 < e4
  assert recall_lib.recall_at_k(np.array([[3., 2., -np.inf]]), np.array([[2., 3., 9.]]), 2) == 1.0  # invisible


def test_full_replay_is_exact_and_a_short_one_is_not():
  """Replaying the whole prefix rebuilds the state a straight run holds; replaying one window of a 2-layer model
  misses the layer-0 context of the replayed rows, two windows cover it (receptive field 2 x window)."""
  from dsv4.config import v4_tiny
  from experiments import replay_lib, train_lib
  cfg = dataclasses.replace(v4_tiny(num_layers=2, vocab_size=64), name="t")
  params = train_lib.init(cfg, 0)
  toks = np.random.default_rng(0).integers(3, 64, size=(2, 80)).astype(np.int32)
  out = replay_lib.resume_logits(params, cfg, toks, 64, [16, 32, 64])
  d = {R: np.abs(out[R] - out["exact"]).max() for R in (16, 32, 64)}
  assert d[64] < 1e-5 and d[32] < 1e-5 and d[16] > 1e-3, d
  st = replay_lib.drift_stats(out["exact"], out["exact"])
  assert st["max_abs_logit_diff"] == 0 and st["first_divergence"] == 16
  lay = replay_lib.layout_for("fp32")
  assert replay_lib.swa_state_bytes(cfg, lay) > 0 and replay_lib.compressed_bytes(cfg, lay, 64) > 0


def test_multiturn_traces_resume_where_they_say():
  from experiments import ablate_retention as ar
  tr = ar.edit_last(64, sessions=2, turns=3, edits=2, system_len=128, seed=0)
  edits = [s for s in tr if s.kind == "branch"]
  assert len(edits) == 4 and all(s.cut is not None and s.src for s in edits)
  tr = ar.agent_loop(64, agents=2, steps=4, task_len=128, tool_len=(32, 64), short=2, retry_p=1.0, seed=0)
  assert sum(s.rid.startswith("short") for s in tr) == 2 * 4 * 2
  assert any(s.kind == "branch" for s in tr)
  tr = ar.alternate(64, pairs=1, turns=2, system_len=64)
  assert [s.session for s in tr] == ["p0a", "p0b", "p0a", "p0b"]


def test_resume_small(tmp_path):
  from experiments import ablate_resume
  out = ablate_resume.run(ablate_resume.subjects([], [2], False), ["fp32"], [1, 2], 8, 2, 1, str(tmp_path), P=64)
  rows = checked_outputs(tmp_path, "ablate_resume", "resume", "replay_windows", [1, 2])
  assert {"model", "dtype", "method", "replay_tokens", "max_abs_logit_diff", "mean_kl", "first_divergence",
          "accuracy", "resume_bytes", "resume_wall_ms", "flash_resume_bytes_fp8", "flash_resume_gflop"} <= set(rows[0])
  rep = {r["replay_tokens"]: r for r in out["rows"] if r["method"] == "replay"}
  assert rep[32]["max_abs_logit_diff"] < 1e-4 < rep[16]["max_abs_logit_diff"]


def test_indexer_recall_small(tmp_path):
  from experiments import ablate_indexer_recall as air
  out = air.run(str(tmp_path), contexts=[8192, 16384], ks=[64, 512], queries=2, checkpoints=[], trained_contexts=[],
                acc_ks=[], ms=[], eval_batches=0, batch=0)
  rows, meta = plotting.read_table(str(tmp_path), "indexer_recall")
  assert {"part", "model", "key_format", "context", "entries", "k", "recall", "key_bytes_per_entry"} <= set(rows[0])
  assert {r["key_format"] for r in rows} == {"bf16", "fp8", "fp4"} and len(rows) == len(out["rows"]) == 2 * 2 * 3 * 2
  fig = air.plot(rows, meta)
  assert plotting.plot_problems(fig) == []
  plt.close(fig)
  assert os.path.getsize(os.path.join(tmp_path, "indexer_recall.png")) > 20_000


def test_retention_multiturn_small(tmp_path):
  from experiments import ablate_retention as ar
  ar.run("v4_flash", [0, 128, 512], True, str(tmp_path), stem="retention_multiturn",
         names=("edit_last", "alternate", "agent_loop"))
  rows, meta = plotting.read_table(str(tmp_path), "retention_multiturn")
  assert {r["workload"] for r in rows} == {"edit_last", "alternate", "agent_loop"}
  assert {"hit_tokens", "hit_pct", "swa_blocks_cached", "swa_mb_cached", "branch_recomputed_tokens"} <= set(rows[0])
  fig = ar.plot_hits(rows, meta)
  assert plotting.plot_problems(fig) == []
  plt.close(fig)


@pytest.mark.parametrize("name", ["v4_multikey", "v41_multikey"])
def test_shipped_multikey_checkpoint_loads_and_is_small(name):
  from experiments import train_lib
  d = os.path.join(train_lib.CHECKPOINT_ROOT, name)
  size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
  assert size < 1_200_000, size
  config, params, info = train_lib.load_checkpoint_dir(d)
  spec = train_lib.task_spec_from_info(info)
  assert isinstance(spec, tasks.MultiKeySpec) and spec.ms == (1, 2, 4, 8, 16) and config.indexer.topk == 32
  assert info["final_eval"]["192"]["full_topk"]["accuracy"] > 0.9


def test_multikey_small(tmp_path):
  from experiments import ablate_multikey
  out = ablate_multikey.run(["v4_multikey"], [2, 32], [16, 64], [1, 4], 1, 4, str(tmp_path))
  for stem, fn, cols, knob, swept in (
      ("multikey_topk", ablate_multikey.plot_topk, {"model", "m", "k", "accuracy", "index_hit", "chance"}, "k",
       [2, 32]),
      ("multikey_window", ablate_multikey.plot_window,
       {"model", "m", "window", "accuracy", "accuracy_no_compressed"}, "window", [16, 64])):
    rows, meta = plotting.read_table(str(tmp_path), stem)
    assert cols <= set(rows[0])
    fig = fn(rows, meta)
    assert plotting.plot_problems(fig) == []
    assert [v for v in plotting.knob_values(fig) if v is not None] == [swept]
    plt.close(fig)
    assert os.path.getsize(os.path.join(tmp_path, f"{stem}.png")) > 20_000
  assert len(out["multikey_topk"]["rows"]) == 2 * 2
