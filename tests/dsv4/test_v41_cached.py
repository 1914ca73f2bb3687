"""V4.1 (CSA2) cached path == full forward: chunked prefill (ragged, odd prefixes that leave a pending ratio-2 row,
chunks that end inside a candidate block) then token-by-token decode, batch rows at different positions, shuffled
paged block tables. Reuse / reindex layers read their source's pools written earlier in the same step; Engram reads
its previous token ids back from the SWA-group `token_ids` rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv4 import caches, config, model
from tests.dsv4.test_model_cached import check_cached_matches_full

TOL = 1e-5


@pytest.fixture(scope="module")
def setup():
  cfg = config.v41_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  # a non-identity Engram token map (case folding), as a tokenizer would give
  params["engram_token_map"] = jnp.asarray(np.arange(cfg.vocab_size) // 2, jnp.int32)
  return cfg, params


# All chunk sizes in (32, 64]: one compiled chunk shape (64) plus T = 1 for decode.
SCHEDULES = {
    "odd_prefixes": [[37, 61, 33], [63, 35, 3], [41, 1, 9]],
    "aligned_then_odd": [[64, 33, 17], [33, 64, 1]],
}


@pytest.mark.parametrize("schedule_name", list(SCHEDULES))
def test_v41_chunked_and_decode_match_full(setup, schedule_name):
  cfg, params = setup
  check_cached_matches_full(cfg, params, [161, 97, 45], SCHEDULES[schedule_name], tol=TOL)


def test_v41_cache_arrays_per_role(setup):
  """Cache arrays per V4.1 role (docs/kv_cache.md): window for every layer; compressed KV + index keys only on KV
  sources; compressor rows only on the ratio-2 sources; Engram token ids once; reuse / reindex own nothing else."""
  cfg, _ = setup
  specs = caches.cache_array_specs(cfg, caches.CacheLayout())
  by_layer = {}
  for s in specs:
    by_layer.setdefault(s.layer, set()).add(s.name)
  for p in cfg.layer_plan():
    names = by_layer[p.index]
    assert "window_kv" in names
    assert ("comp_kv" in names) == ("index_keys" in names) == (p.index in cfg.kv_source_layer_ids)
    assert ("comp_state" in names) == (p.index in cfg.kv_source_layer_ids and p.ratio == 2)
    assert ("token_ids" in names) == (p.index == cfg.engram.layer_ids[0])
    if p.kind in ("reuse", "reindex", "swa"):
      assert names <= {"window_kv", "token_ids"}
