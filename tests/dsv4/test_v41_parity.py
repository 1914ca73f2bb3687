"""V4.1 (CSA2) parity with NeMo Automodel 0.7.0 `deepseek_v41` on CPU (docs/references.md, V4.1).

The tiny config (`dsv4.config.v41_tiny`) has every role: window-only, ratio-2 full / reuse / dense reindex, ratio-1
full + candidate source, reuse, candidate-restricted reindex, reuse after it, and Engram on two layers. The
reference's random fp32 weights go through a NeMo-named safetensors file and the project's loader. The reference's
cache fake-quantization is switched off (tests/dsv4/v41_oracle.py). Positions are compared only where the reference
agrees with itself across several sequence widths (top-k tie-breaking depends on the row width); the count is
printed, and at most 3 of the 320 positions may be excluded (measured: none).
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import config, model
from dsv4.layers import engram
from dsv4.loading import safetensors_file
from dsv4.loading.safetensors_io import load_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
import v41_oracle  # noqa: E402

T = 160            # ratio-1 entries 160 -> 20 candidate blocks of 8, 4 kept: 16 dropped; ratio-2 entries 80
WIDTHS = (141, 159)
TOL = 1e-4


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
  if v41_oracle.ensure_nemo() is None:
    pytest.skip("nemo-automodel 0.7.0 wheel could not be downloaded (pip download --no-deps nemo-automodel==0.7.0)")
  cfg = config.v41_tiny()
  ref, tokenizer = v41_oracle.build(cfg, seed=0)
  path = str(tmp_path_factory.mktemp("nemo_ckpt") / "model.safetensors")
  safetensors_file.write_file(v41_oracle.state_dict_np(ref), path)
  params = load_checkpoint(path, cfg)
  token_map, n = engram.compressed_token_map(tokenizer)
  assert n == cfg.engram.compressed_vocab_size
  np.testing.assert_array_equal(token_map, ref.model.engram_hash.token_map.numpy())
  params["engram_token_map"] = jnp.asarray(token_map)
  return cfg, ref, params


def test_engram_hash_matches_reference(oracle):
  cfg, ref, params = oracle
  import torch
  toks = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 40))
  want = ref.model.engram_hash(torch.as_tensor(toks)).numpy()
  got = np.asarray(engram.hash_ids(params["engram_token_map"],
                                   jnp.concatenate([jnp.full((2, 3), -1), jnp.asarray(toks)], 1), cfg.engram, 40))
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(
      engram.hash_ids_reference(np.asarray(params["engram_token_map"]), toks, cfg.engram), want)


def test_engram_hash_flash_constants():
  """Exact uint32-limb emulation of the int64 hash at Flash size (primes ~1.6e7, multipliers ~2^46)."""
  e = config.v41_flash().engram
  tm = np.arange(129280, dtype=np.int32) % e.compressed_vocab_size
  toks = np.random.default_rng(0).integers(0, 129280, (2, 64))
  prev = np.random.default_rng(1).integers(-1, 129280, (2, 3))
  want = engram.hash_ids_reference(tm, toks, e, prev)
  got = np.asarray(engram.hash_ids(jnp.asarray(tm), jnp.asarray(np.concatenate([prev, toks], 1)), e, 64))
  np.testing.assert_array_equal(got, want)
  assert want.min() >= 0 and all(want[..., i, :].max() < e.num_embeddings[i] for i in range(2))


def test_logits_match_nemo(oracle):
  cfg, ref, params = oracle
  B = 2
  tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, (B, T))
  want = v41_oracle.logits(ref, tokens)
  stable = np.ones((B, T), bool)
  for w in WIDTHS:
    part = v41_oracle.logits(ref, tokens[:, :w])
    d = np.max(np.abs(part - want[:, :w]), axis=-1) <= 1e-5 * np.max(np.abs(want))
    stable[:, :w] &= d
  _, got, auxes = jax.jit(lambda p, t: model.forward_aux(
      p, cfg, t, *_contiguous(cfg, B, T), collect_aux=True))(params, jnp.asarray(tokens))
  got = np.asarray(got)
  err = np.max(np.abs(got - want), axis=-1) / np.max(np.abs(want))
  # candidate blocks really dropped: the candidate source keeps 4 of 20 blocks at the last position
  cand_layer = cfg.candidate_source_layer_id
  n_vis = np.sum(np.isfinite(np.asarray(auxes[cand_layer]["index_scores"])[:, -1]), -1)
  assert (n_vis == T).all()
  reindex = [p.index for p in cfg.layer_plan() if p.uses_candidates][0]
  n_cand = np.sum(np.isfinite(np.asarray(auxes[reindex]["index_scores"])[:, -1]), -1)
  assert (n_cand <= cfg.indexer.candidate_topk_blocks * cfg.indexer.candidate_block_size).all()
  assert (T // cfg.indexer.candidate_block_size - cfg.indexer.candidate_topk_blocks) >= 2
  print(f"\nV4.1 parity: {stable.sum()} of {stable.size} positions stable across widths {WIDTHS + (T,)}; "
        f"max rel err there {err[stable].max():.2e}; over all positions {err.max():.2e}")
  # Measured: the reference agrees with itself at all 320 positions (no top-k tie at this seed), so every position
  # is compared. At most 3 (1%) may drop out on another CPU, whose float kernels can straddle the 1e-5 self-agreement
  # test at a near-tie; more than that is not tie-breaking and fails here instead of being excluded silently.
  excluded = np.argwhere(~stable)
  assert len(excluded) <= 3, f"{len(excluded)} positions excluded as unstable: {excluded.tolist()[:10]}"
  assert err[stable].max() <= TOL


def _contiguous(cfg, B, L):
  from dsv4 import caches
  cache, swa, full = caches.init_contiguous(cfg, B, L)
  idx = caches.BatchIndex(jnp.zeros(B, jnp.int32), jnp.full((B,), L, jnp.int32), jnp.asarray(swa),
                          jnp.asarray(full))
  return cache, idx
