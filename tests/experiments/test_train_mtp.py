"""The MTP draft trainer (experiments/mtp_lib.py, experiments/train_mtp.py): distillation moves the block toward the
backbone and never touches the backbone; acceptance counts exactly the weighted positions; the CLI's --small path
writes a checkpoint that loads with its block."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dsv4 import config
from dsv4 import model
from experiments import mtp_lib
from experiments import train_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_distillation_trains_the_block_and_leaves_the_backbone():
  base = config.v4_tiny(num_layers=1, vocab_size=64, window=8)   # window-only backbone: a short compile
  params = model.init_params(base, jax.random.PRNGKey(0))
  cfg, params = mtp_lib.add_mtp(base, params)
  assert cfg.num_mtp_layers == 1 and set(params) == set(model.param_shapes(cfg))
  toks = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 32)), jnp.int32)
  backbone = {k: v for k, v in params.items() if k != "mtp"}
  before = jax.tree_util.tree_map(np.asarray, backbone)
  opt = optax.adam(1e-2)
  step = mtp_lib.make_train_step(cfg, opt)
  mtp, state = params["mtp"], opt.init(params["mtp"])
  losses = []
  for _ in range(12):
    mtp, state, loss, _ = step(mtp, backbone, state, toks)
    losses.append(float(loss))
  assert losses[-1] < 0.7 * losses[0], losses
  for x, y in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(backbone)):
    np.testing.assert_array_equal(x, np.asarray(y))
  # acceptance: the weighted mean of argmax(mtp_t) == argmax(backbone_{t+1}), computed here by hand
  trained = {**backbone, "mtp": mtp}
  bb, mt = (np.asarray(x) for x in mtp_lib.forward_with_mtp(trained, cfg, toks))
  ok = np.argmax(mt[:, :-1], -1) == np.argmax(bb[:, 1:], -1)
  w = np.zeros(toks.shape, np.float32)
  w[:, 5:20] = 1
  assert mtp_lib.acceptance(trained, cfg, toks, w) == pytest.approx(ok[:, 5:20].mean())
  assert mtp_lib.acceptance(trained, cfg, toks) == pytest.approx(ok.mean())


@pytest.mark.slow
def test_train_mtp_small_cli(tmp_path):
  out = tmp_path / "ck"
  r = subprocess.run([sys.executable, "-m", "experiments.train_mtp", "--small", f"--out_dir={out}"], cwd=REPO,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  info = json.load(open(out / "config.json"))
  assert info["small"] and set(info["acceptance_after"]) == {"task", "free_generation", "free_k2_by_depth",
                                                             "free_k2_acceptance_length"}
  assert len(info["acceptance_after"]["free_k2_by_depth"]) == 2 and info["recursion_depth"] == 1
  config, params = train_lib.load_trained(str(out))
  shipped_config, shipped = train_lib.load_trained("v4_retrieval")
  assert config.num_mtp_layers == 1 and "mtp" in params
  for x, y in zip(jax.tree_util.tree_leaves(shipped), jax.tree_util.tree_leaves({k: v for k, v in params.items()
                                                                                 if k != "mtp"})):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_recursive_passes_are_the_engines_recursion():
  """mtp_lib's whole-sequence recursion (one frontier per row) gives the drafts of a literal recursion as
  dsv4/engine/speculative_step.py runs it: a catch-up pass, then k - 1 one-position runs of the block on its own
  output stream and previous draft, each writing its window KV at the next position."""
  from dsv4 import caches
  base = config.v4_tiny(num_layers=1, vocab_size=64, window=8)
  params = model.init_params(base, jax.random.PRNGKey(1))
  cfg, params = mtp_lib.add_mtp(base, params, seed=3)
  B, T, k = 3, 24, 4
  toks = jnp.asarray(np.random.default_rng(1).integers(3, 64, (B, T)), jnp.int32)
  fr = jnp.asarray([5, 11, 17], jnp.int32)
  want, drafts = mtp_lib._engine_drafts(params, cfg, toks, fr, k)
  # the literal recursion
  cache, swa, full = caches.init_contiguous(cfg, B, T)
  idx = caches.BatchIndex(jnp.zeros(B, jnp.int32), jnp.full((B,), T, jnp.int32), jnp.asarray(swa), jnp.asarray(full))
  step = caches.step_index_from_batch(idx, T)
  cache, h, _, X = model.forward_ragged_aux(params, cfg, toks.reshape(-1), cache, step, return_stream=True)
  nxt = jnp.concatenate([toks[:, 1:], jnp.zeros((B, 1), toks.dtype)], axis=1).reshape(-1)
  cache, Xm, hm = model.mtp_forward(params, cfg, 0, X, nxt, cache, step)
  flat = jnp.arange(B) * T + fr
  got = [jnp.argmax(model.lm_logits(params, hm[flat]), -1)]
  Xr = Xm[:, flat]
  for i in range(1, k):
    pos = fr + i
    rstep = caches.StepIndex(jnp.arange(B, dtype=jnp.int32), pos, pos, jnp.ones(B, jnp.int32), step.tables)
    cache, Xr, hr = model.mtp_forward(params, cfg, 0, Xr, got[-1], cache, rstep)
    got.append(jnp.argmax(model.lm_logits(params, hr), -1))
  np.testing.assert_array_equal(np.asarray(drafts), np.stack([np.asarray(g) for g in got], axis=1))
  bb = np.argmax(np.asarray(model.lm_logits(params, h)).reshape(B, T, -1), -1)
  np.testing.assert_array_equal(np.asarray(want), bb[np.arange(B)[:, None], np.asarray(fr)[:, None] + np.arange(1, k + 1)])


@pytest.mark.slow
def test_train_dspark_small_cli(tmp_path):
  """V4.1's DSpark drafter on a frozen shipped backbone: the checkpoint holds the draft, the backbone is unchanged,
  the engine-like acceptance is reported by depth; a bad flag is one line before anything loads."""
  out = tmp_path / "ck"
  r = subprocess.run([sys.executable, "-m", "experiments.train_dspark", "--small", "--model=v41_motif",
                      f"--out_dir={out}"], cwd=REPO, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  info = json.load(open(out / "config.json"))
  assert info["small"] and len(info["acceptance_after"]["free_k2_by_depth"]) == 2
  config, params = train_lib.load_trained(str(out))
  _, shipped = train_lib.load_trained("v41_motif")
  assert config.num_mtp_layers == 3 and config.dspark.block_size == 7
  for x, y in zip(jax.tree_util.tree_leaves(shipped), jax.tree_util.tree_leaves({k: v for k, v in params.items()
                                                                                 if k != "mtp"})):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  bad = subprocess.run([sys.executable, "-m", "experiments.train_dspark", "--small", "--experts_per_tok=9"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
  assert bad.returncode != 0 and "--experts_per_tok=9" in bad.stderr
