"""Group specs from model configs, and the host hash chain."""

import numpy as np

from dsv4.caches import CacheLayout, init_cache, state_tail_tokens
from dsv4.config import v4_flash, v41_flash, v4_tiny
from cache.checkpoints import CheckpointPolicy
from cache.hashing import ExtraKeys, RequestHasher, device_key, key_int
from cache.specs import FULL_HISTORY, SLIDING_WINDOW, cache_specs


def test_v4_flash_specs():
  s = cache_specs(v4_flash())
  assert (s.hash_tokens, s.align_tokens) == (32, 128)
  assert [(g.name, g.kind, g.block_tokens) for g in s.groups] == [("full", FULL_HISTORY, 128),
                                                                   ("swa", SLIDING_WINDOW, 32)]
  assert s.swa.tail_tokens == state_tail_tokens(v4_flash()) == 127 and s.swa.need_blocks == 4
  assert s.compressor_state.stored_in == "swa" and s.compressor_state.tokens == 128
  assert {a.name for a in s.full.arrays} == {"comp_kv", "index_keys"}
  assert s.full.bytes_per_block == sum(a.bytes_per_block for a in s.full.arrays)


def test_v41_only_kv_sources_own_global_state():
  c = v41_flash()
  s = cache_specs(c)
  assert {a.layer for a in s.full.arrays} == set(c.kv_source_layer_ids)
  assert {a.layer for a in s.swa.arrays} == set(range(c.num_layers))


def test_model_arrays_shaped_from_specs():
  c, layout = v4_tiny(), CacheLayout()
  s = cache_specs(c, layout)
  cache = init_cache(c, layout, num_swa_blocks=3, num_full_blocks=2)
  for g, n in ((s.swa, 3), (s.full, 2)):
    for a in g.arrays:
      assert cache.layers[a.layer][a.name].shape == (n, *a.block_shape)


def test_hash_chain():
  toks = np.arange(100, dtype=np.int32)
  h1 = RequestHasher(ExtraKeys(), 32)
  h1.update(toks)
  assert len(h1.digests) == 3
  h2 = RequestHasher(ExtraKeys(), 32)
  h2.update(toks[:40])
  h2.update(toks)             # incremental == one shot
  assert h1.digests == h2.digests
  t2 = toks.copy()
  t2[0] = 7                   # a change in block 0 changes every later hash (parent chaining)
  h3 = RequestHasher(ExtraKeys(), 32)
  h3.update(t2)
  assert all(a != b for a, b in zip(h1.digests, h3.digests))
  h4 = RequestHasher(ExtraKeys(tenant="s"), 32)
  h4.update(toks)
  assert all(a != b for a, b in zip(h1.digests, h4.digests))
  k = device_key(h1.digests[0])
  assert k.dtype == np.int32 and key_int(k) == int.from_bytes(h1.digests[0][:8], "little", signed=True)
  assert key_int(device_key(h1.digests[0], key_bits=3)) in range(8)


def test_checkpoint_policy():
  p = CheckpointPolicy(align_tokens=128, block_tokens=32, tail_tokens=127, retention_interval=256)
  assert p.prompt_boundary(1000) == 896 and p.prompt_boundary(1025) == 1024 and p.prompt_boundary(128) == 0
  assert p.boundaries(0, 1000, 1000) == [256, 512, 768, 896]
  assert list(p.tail_blocks(896)) == [24, 25, 26, 27] and list(p.tail_blocks(64)) == [0, 1]
  # at 1059 computed, keep rows from min(1059-127, 1024-128) = 896 -> 28 leading blocks releasable
  assert p.releasable_blocks(1059) == 28 and p.releasable_blocks(100) == 0
