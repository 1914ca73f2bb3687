"""Full forward == chunked prefill (ragged, unaligned chunks) + token-by-token decode, for a batch whose rows sit
at different positions. One model code path; the cache is paged through block tables (contiguous and shuffled)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import caches, config, model

TOL = 1e-5


@pytest.fixture(scope="module")
def setup():
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  return cfg, params


def _assert_no_topk_ties(auxes, valid_BxT, k, margin=1e-5):
  """A near-tie at the k-th score would let rounding pick a different set; fail loudly instead of flakily."""
  for aux in auxes:
    if "index_scores" not in aux:
      continue
    s = np.asarray(aux["index_scores"])
    top = -np.sort(-s, axis=-1)[..., : k + 1]
    kth, nxt = top[..., k - 1], top[..., k]
    finite = np.isfinite(nxt) & np.asarray(valid_BxT)
    gap = np.abs(kth[finite] - nxt[finite])
    scale = np.maximum(np.abs(kth[finite]), 1e-6)
    assert gap.size == 0 or np.min(gap / scale) > margin, "top-k tie at the k-th score: pick another seed"


def _run_schedule(cfg, params, tokens_BxL, lengths_B, chunk_schedule, swa_table, full_table, layout, num_swa,
                  num_full):
  """chunk_schedule: list of per-row chunk sizes per step; afterwards decode one token at a time."""
  B, L = tokens_BxL.shape
  cache = caches.init_cache(cfg, layout, num_swa, num_full)
  pos = np.zeros(B, np.int64)
  out = np.full((B, L, cfg.vocab_size), np.nan, np.float32)

  def step(sizes):
    nonlocal cache
    sizes = np.minimum(np.asarray(sizes), lengths_B - pos)
    T = 1 << int(np.ceil(np.log2(max(1, int(sizes.max())))))  # power-of-two buckets bound the compiles
    toks = np.zeros((B, T), np.int32)
    for b in range(B):
      toks[b, : sizes[b]] = tokens_BxL[b, pos[b]: pos[b] + sizes[b]]
    idx = caches.BatchIndex(jnp.asarray(pos, jnp.int32), jnp.asarray(sizes, jnp.int32), jnp.asarray(swa_table),
                            jnp.asarray(full_table))
    cache, logits = model.forward_jit(params, cfg, jnp.asarray(toks), cache, idx, layout)
    logits = np.asarray(logits)
    for b in range(B):
      out[b, pos[b]: pos[b] + sizes[b]] = logits[b, : sizes[b]]
    pos[:] = pos + sizes

  for sizes in chunk_schedule:
    step(sizes)
  while (pos < lengths_B).any():
    step(np.ones(B, np.int64))
  return out


def check_cached_matches_full(cfg, params, lengths, schedule, tol=TOL):
  """Full forward of a ragged batch vs `schedule` (per-step per-row chunk sizes, then decode), on shuffled
  (non-contiguous) block tables. Shared by the V4 and V4.1 tests."""
  layout = caches.CacheLayout()
  lengths = np.asarray(lengths)
  B, L = len(lengths), int(lengths.max())
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (B, L), 0, cfg.vocab_size))
  cache_full, swa, full = caches.init_contiguous(cfg, B, L, layout)
  idx = caches.BatchIndex(jnp.zeros(B, jnp.int32), jnp.asarray(lengths, jnp.int32), jnp.asarray(swa),
                          jnp.asarray(full))
  ref_fn = jax.jit(lambda p, t, c, i: model.forward_aux(p, cfg, t, c, i, layout=layout, collect_aux=True))
  _, ref, auxes = ref_fn(params, jnp.asarray(tokens), cache_full, idx)
  ref = np.asarray(ref)
  valid = np.arange(L)[None, :] < lengths[:, None]
  _assert_no_topk_ties(auxes, valid, cfg.indexer.topk)
  # Shuffle the block ids so that nothing depends on blocks being contiguous.
  rng = np.random.default_rng(0)
  perm_s, perm_f = rng.permutation(swa.size), rng.permutation(full.size)
  got = _run_schedule(cfg, params, tokens, lengths, schedule, perm_s[swa], perm_f[full], layout, swa.size,
                      full.size)
  for b in range(B):
    n = lengths[b]
    err = np.max(np.abs(got[b, :n] - ref[b, :n]))
    assert err <= tol * max(1.0, np.max(np.abs(ref[b, :n]))), (b, err)


SCHEDULES = {
    "unaligned": [[37, 5, 13], [101, 99, 7], [3, 64, 3], [139, 33, 20]],
    "aligned_then_odd": [[128, 16, 4], [17, 129, 9], [131, 45, 31]],
}


@pytest.mark.parametrize("schedule_name", list(SCHEDULES))
def test_chunked_and_decode_match_full(setup, schedule_name):
  cfg, params = setup
  check_cached_matches_full(cfg, params, [300, 211, 57], SCHEDULES[schedule_name])


def test_padded_rows_do_not_touch_other_sequences(setup):
  """A row's padding (beyond num_tokens) must never be written into the cache."""
  cfg, params = setup
  layout = caches.CacheLayout()
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(2), (2, 40), 0, cfg.vocab_size))
  cache, swa, full = caches.init_contiguous(cfg, 2, 64, layout)
  idx = caches.BatchIndex(jnp.zeros(2, jnp.int32), jnp.asarray([40, 0], jnp.int32), jnp.asarray(swa),
                          jnp.asarray(full))
  old_layers = jax.tree_util.tree_map(np.asarray, cache.layers)  # the jitted step donates the cache
  new_cache, _ = model.forward_jit(params, cfg, jnp.asarray(tokens), cache, idx, layout)
  for old_l, new_l in zip(old_layers, new_cache.layers):
    for name in old_l:
      a, b = np.asarray(old_l[name]), np.asarray(new_l[name])
      if name in ("window_kv", "comp_state", "index_state"):
        rows = swa[1]
      else:
        rows = full[1]
      np.testing.assert_array_equal(a[rows], b[rows], err_msg=name)
