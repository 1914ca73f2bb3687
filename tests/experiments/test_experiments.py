"""CI checks of experiments/: task determinism, the --small paths of train / ablations, the shipped checkpoint."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from dsv4 import model
from experiments import tasks
from experiments import train_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CKPT = os.path.join(REPO, "experiments", "checkpoints", "v4_retrieval")
CKPT_COUNT = os.path.join(REPO, "experiments", "checkpoints", "v4_count")


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


def test_count_task_deterministic_and_out_of_window():
  spec = tasks.CountSpec(seq_len=128, max_count=8, min_gap=32)
  a, b = tasks.make_batch(spec, 7, 16), tasks.make_batch(spec, 7, 16)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(a["tokens"], tasks.make_batch(spec, 8, 16)["tokens"])
  assert a["mask"].sum() == 16
  for bi, t in zip(*np.nonzero(a["mask"])):
    key, c = a["tokens"][bi, t], a["count"][bi]
    assert a["targets"][bi, t] == spec.count_lo + c - 1 and 1 <= c <= spec.max_count
    occ = np.nonzero(a["tokens"][bi, :t - 1] == key)[0]
    src = a["src_pos"][bi, t]
    np.testing.assert_array_equal(occ, src[src >= 0])       # exactly c occurrences, all listed
    assert len(occ) == c and np.all(np.diff(occ) >= 8)      # each in its own overlapping CSA entries
    assert np.all(t - occ > spec.min_gap)                    # all beyond the window
  assert tasks.spec_from_dict(__import__("dataclasses").asdict(spec)) == spec


def test_multi_source_hit_and_supervision():
  import jax.numpy as jnp
  src = jnp.array([[[5, 21, -1]]])                   # tokens 5 and 21: entries {1,2} and {5,6}
  ids = jnp.array([[[1, 9, -1]]])
  np.testing.assert_allclose(train_lib.value_entry_hit(ids, src), [[0.5]])
  p = jnp.zeros((1, 1, 10)).at[0, 0, jnp.array([1, 2, 5, 6])].set(0.25)
  np.testing.assert_allclose(train_lib.attention_supervision({"comp_attn_target": p}, src, jnp.ones((1, 1))), 0.0,
                             atol=1e-6)


def test_motif_task_mask_and_predictable_targets():
  """Motif task: deterministic; the loss mask covers every position after the first motif period; every
  predictable target repeats the token one period back, and substitutions / segment switches make the rest."""
  spec = tasks.MotifSpec(seq_len=128)
  a, b = tasks.make_batch(spec, 3, 8), tasks.make_batch(spec, 3, 8)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  assert tasks.spec_from_dict(dataclasses.asdict(spec)) == spec
  tok, tgt, mask, pred, per = a["tokens"], a["targets"], a["mask"], a["pred_mask"], a["period"]
  np.testing.assert_array_equal(tgt[:, :-1], tok[:, 1:])
  assert np.all(tok[:, 0] == tasks.BOS) and np.all((tok[:, 1:] >= spec.tok_lo) & (tok[:, 1:] < spec.tok_hi))
  for r in range(8):
    p0 = per[r, 0]
    first = np.nonzero(mask[r])[0]
    # mask: one contiguous run from the position before token 1 + p0 to T - 2
    assert first[0] == p0 and first[-1] == spec.seq_len - 2 and len(first) == spec.seq_len - 1 - p0
    ts = np.nonzero(pred[r])[0]
    assert np.all(mask[r, ts] > 0)
    # a predictable target repeats the token one period back (unless that one was a substitution)
    assert np.mean(tgt[r, ts] == tok[r, ts + 1 - per[r, ts]]) > 0.85
  share = pred.sum() / mask.sum()
  assert 0.6 < share < 0.95, share            # not trivial: switches and substitutions are unpredictable
  with pytest.raises(ValueError):
    tasks.MotifSpec(p_lo=5, p_hi=4).validate()


def test_config_roundtrip():
  c = train_lib.retrieval_config()
  assert train_lib.config_from_dict(json.loads(json.dumps(train_lib.config_to_dict(c)))) == c


def test_attention_cost_monotone_in_k():
  c = train_lib.retrieval_config()
  costs = [train_lib.attention_cost(train_lib.with_topk(c, k), 256)["total_flops"] for k in (1, 4, 16, 64)]
  assert costs == sorted(costs) and costs[0] < costs[-1]


def test_train_small(tmp_path):
  out = tmp_path / "ck"
  _run(["experiments.train", "--small", f"--out_dir={out}"])
  config, params = train_lib.load_trained(str(out))
  assert config.attention.window == 8
  info = json.load(open(out / "config.json"))
  assert info["small"] and "64" in info["final_eval"]


def test_train_small_count(tmp_path):
  out = tmp_path / "ck"
  _run(["experiments.train", "--small", "--task=count", f"--out_dir={out}"])
  info = json.load(open(out / "config.json"))
  assert info["task"]["kind"] == "count" and "acc_by_count" in info["final_eval"]["64"]["full_topk"]
  _run(["experiments.ablate_topk", "--small", f"--checkpoint={out}", f"--out_dir={tmp_path}"])
  rows = json.load(open(tmp_path / "topk_ck.json"))["rows"]
  # --small: k in {1, 8} at T = 128, one batch of 4, plus the no-compressed-path row
  assert [(r["path"], r["k"], r["seq_len"]) for r in rows] == [("topk", 1, 128), ("topk", 8, 128),
                                                                ("no_compressed", 0, 128)]
  # the script's numbers are the library's evaluation of that checkpoint at that k (plumbing: checkpoint, task,
  # k and length all reach the model), with every answer graded and counted by its true count
  config, params, info = train_lib.load_checkpoint_dir(str(out))
  spec = dataclasses.replace(train_lib.task_spec_from_info(info), seq_len=128)
  want = train_lib.evaluate(params, train_lib.with_topk(config, 8), spec, num_batches=1, batch=4)
  got = rows[1]
  assert got["n"] == want["n"] > 0 and got["accuracy"] == want["accuracy"], (got, want)
  assert got["index_hit"] == pytest.approx(want["index_hit"]) and got["acc_by_count"] == want["acc_by_count"]


@pytest.mark.slow
def test_train_small_motif(tmp_path):
  """--task=motif: the many-position mask trains and evaluates (accuracy on every masked position and on the
  predictable ones), no attention supervision."""
  out = tmp_path / "ck"
  _run(["experiments.train", "--small", "--task=motif", "--motif_chain", f"--out_dir={out}"])
  info = json.load(open(out / "config.json"))
  assert info["task"]["kind"] == "motif" and info["task"]["chain"] and info["task"]["p_hi"] <= 4
  e = info["final_eval"]["64"]["full_topk"]
  assert e["n"] > 40 and 0.5 < e["predictable_share"] < 1 and "accuracy_predictable" in e


def test_training_steps_reduce_the_loss():
  """The train step really trains: on one fixed batch, 12 AdamW steps cut the loss (indexer KL included)."""
  config = train_lib.retrieval_config("v4", num_layers=2, window=8, vocab_size=64, index_topk=4, hidden_size=32)
  spec = tasks.KVRecallSpec(seq_len=64, num_pairs=2, num_queries=2, min_gap=16)
  b = tasks.make_batch(spec, 0, 4)
  batch = {k: jax.numpy.asarray(b[k]) for k in ("tokens", "targets", "mask", "src_pos")}
  fparams, iparams = train_lib.split_params(train_lib.init(config, 0))
  opt, _ = train_lib.make_optimizer(1e-2, 1, 12)
  opt_state = opt.init(fparams)
  step = train_lib.make_train_step(config, opt, 1.0, False)
  losses = []
  for _ in range(12):
    fparams, opt_state, m = step(fparams, iparams, opt_state, batch)
    losses.append(float(m["loss"]))
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("script,stem", [("experiments.ablate_topk", "topk"), ("experiments.ablate_window", "window")])
def test_ablation_small(tmp_path, script, stem):
  """The table holds exactly the swept values, the plot reads (checked_outputs), and the results keep the properties
  a broken sweep would lose."""
  from tests.experiments.test_ablation_plots import checked_outputs
  _run([script, "--small", f"--out_dir={tmp_path}"])
  # --small evaluates 16 held-out answers (deterministic seeds) at 128 tokens. The shipped model scores 0.98 there
  # over 512 answers with its trained top-k 8 / window 16, and chance (1/24) without the compressed path:
  # >= 0.9 allows one miss, <= 0.25 allows four lucky guesses.
  if stem == "topk":
    rows = checked_outputs(tmp_path, "ablate_topk", stem, "k", [1, 8])
    assert [(r["path"], r["k"], r["seq_len"]) for r in rows] == [("topk", 1, 128), ("topk", 8, 128),
                                                                  ("no_compressed", 0, 128)]
    k1, k8, blind = rows
    assert k8["accuracy"] >= 0.9 and blind["accuracy"] <= 0.25
    # the indexer's scores do not depend on k, so its top-8 holds its top-1: the hit can only grow with k
    assert k8["index_hit"] >= k1["index_hit"]
    assert blind["compressed_rows"] == 0 < k1["compressed_rows"] < k8["compressed_rows"]
    assert blind["total_flops"] < k1["total_flops"] < k8["total_flops"]
  else:
    rows = checked_outputs(tmp_path, "ablate_window", stem, "window", [8, 16])
    assert [(r["window"], r["seq_len"]) for r in rows] == [(8, 128), (16, 128)]
    w8, w16 = rows
    assert w16["trained_window"] == 16 and w16["accuracy"] >= 0.9
    # neither window reaches back to the stored pairs, so the window-only reading stays near chance at both
    assert all(r["min_query_to_store_distance"] > r["window"] and r["accuracy_no_compressed"] <= 0.25 for r in rows)
    assert w8["window_rows"] < w16["window_rows"] and w8["total_flops"] < w16["total_flops"]


@pytest.mark.parametrize("name", ["v4_retrieval", "v41_retrieval", "v4_count"])
def test_shipped_headline_accuracy(name):
  """The accuracies recorded in each shipped checkpoint's config.json (final_eval at 128 tokens, trained top-k, and
  with the compressed path zeroed) are reproduced on the first held-out eval batches (deterministic seeds)."""
  directory = os.path.join(REPO, "experiments", "checkpoints", name)
  config, params, info = train_lib.load_checkpoint_dir(directory)
  spec = train_lib.task_spec_from_info(info, seq_len=128)
  rec = info["final_eval"]["128"]
  full = train_lib.evaluate(params, config, spec, num_batches=2, batch=16)
  blind = train_lib.evaluate(params, config, spec, num_batches=2, batch=16, ablate="no_compressed")
  # 128 answers (32 for counting): a margin of 0.07 below the recorded 512 / 256-answer figure (0.98-1.0) is
  # ~2 standard errors at p = 0.98 with 128 answers; without the compressed path the model must stay near chance.
  assert full["accuracy"] >= rec["full_topk"]["accuracy"] - 0.07, (full, rec["full_topk"])
  assert full["accuracy"] >= 0.9 and blind["accuracy"] <= 0.25, (full, blind)


def test_shipped_checkpoint_loads_and_is_small():
  config, params = train_lib.load_trained("v4_retrieval")
  assert config.variant == "v4" and model.count_params(params) > 100_000
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(CKPT) for f in fs)
  assert size <= 20 * 2**20


def test_shipped_count_checkpoint_loads_and_is_small():
  config, params = train_lib.load_trained("v4_count")
  _, _, info = train_lib.load_checkpoint_dir(CKPT_COUNT)
  assert isinstance(train_lib.task_spec_from_info(info), tasks.CountSpec)
  assert config.indexer.topk >= info["task"]["max_count"]
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(CKPT_COUNT) for f in fs)
  assert size <= 20 * 2**20


def test_v41_config_and_ratio2_entry_mapping():
  import jax.numpy as jnp
  c = train_lib.retrieval_config("v41")
  assert [p.kind for p in c.layer_plan()] == ["swa", "full"] and c.compress_ratios == (0, 2)
  assert train_lib.dense_topk(c, 128) == 64
  assert train_lib.config_from_dict(json.loads(json.dumps(train_lib.config_to_dict(c)))) == c
  src = jnp.array([[[5, 21, -1]]])                   # ratio 2, no overlap: tokens 5 and 21 -> entries 2 and 10
  np.testing.assert_allclose(train_lib.value_entry_hit(jnp.array([[[2, 9, -1]]]), src, 2, False), [[0.5]])
  p = jnp.zeros((1, 1, 12)).at[0, 0, jnp.array([2, 10])].set(0.5)
  np.testing.assert_allclose(train_lib.attention_supervision({"comp_attn_target": p}, src, jnp.ones((1, 1)), 2, False),
                             0.0, atol=1e-6)


CKPT_V41 = os.path.join(REPO, "experiments", "checkpoints", "v41_retrieval")


def test_shipped_v41_checkpoint_loads_and_is_small():
  config, params = train_lib.load_trained("v41_retrieval")
  assert config.variant == "v41" and any(p.has_index_query for p in config.layer_plan())
  _, _, info = train_lib.load_checkpoint_dir(CKPT_V41)
  assert "command" in info and "final_eval" in info
  size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(CKPT_V41) for f in fs)
  assert size <= 20 * 2**20


@pytest.mark.slow
def test_ablate_spec_small(tmp_path):
  """experiments/ablate_spec.py --small: k = 0 and 2 of the motif MTP model through the engine, the table and plot
  read, every k gives the greedy tokens of k = 0 and the trained draft is accepted."""
  from tests.experiments.test_ablation_plots import checked_outputs
  _run(["experiments.ablate_spec", "--small", f"--out_dir={tmp_path}"])     # --small: the first checkpoint only
  rows = checked_outputs(tmp_path, "ablate_spec", "spec", "k", [0, 2])
  assert [(r["checkpoint"], r["workload"], r["k"]) for r in rows] == [("v4_motif_mtp", "free", 0),
                                                                      ("v4_motif_mtp", "free", 2)]
  assert all(r["same_tokens_as_k0"] for r in rows if r["k"] > 0)
  assert all(r["acceptance"] > 0 and r["acceptance_length"] > 1 for r in rows if r["k"] > 0)
  assert all(r["acceptance_length"] == 1 and r["accepted_by_depth"] == "" for r in rows if r["k"] == 0)


def test_ablate_spec_skips_what_cannot_draft(tmp_path):
  """A missing checkpoint and one without a drafter are skipped with their reasons; the rest is not touched."""
  from experiments import ablate_spec
  assert "no checkpoint" in ablate_spec.load_drafting(str(tmp_path / "missing"))
  assert "no drafter" in ablate_spec.load_drafting("v4_retrieval")
  config, params, spec = ablate_spec.load_drafting("v4_retrieval_mtp")
  assert config.num_mtp_layers == 1 and isinstance(spec, tasks.KVRecallSpec)
  with pytest.raises(ValueError, match="nothing to run"):
    ablate_spec.run([str(tmp_path / "missing"), "v4_retrieval"], [0, 1], 2, 4, 2, str(tmp_path))
