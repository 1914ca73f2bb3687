"""Group specs from model configs, and the host hash chain."""

import numpy as np
import pytest

from dsv4.caches import CacheLayout, cache_array_specs, group_specs, init_cache, state_tail_tokens
from dsv4.config import v4_flash, v41_flash, v4_tiny
from cache.checkpoints import CheckpointPolicy
from cache.hashing import ExtraKeys, RequestHasher, device_key, key_int, keys_from_words
from cache.specs import FULL_HISTORY, SLIDING_WINDOW, CacheSpecs, GroupSpec


def test_v4_flash_specs():
  s = group_specs(v4_flash())
  arrays = cache_array_specs(v4_flash(), CacheLayout())
  assert (s.hash_tokens, s.align_tokens) == (32, 128)
  assert [(g.name, g.kind, g.block_tokens) for g in s.groups] == [("full", FULL_HISTORY, 128),
                                                                   ("swa", SLIDING_WINDOW, 32)]
  assert s.swa.tail_tokens == state_tail_tokens(v4_flash()) == 127 and s.swa.need_blocks == 4
  assert {a.name for a in arrays if a.group == "full"} == {"comp_kv", "index_keys"}
  assert s.full.bytes_per_block == sum(a.bytes_per_block for a in arrays if a.group == "full")
  assert s.swa.bytes_per_block == sum(a.bytes_per_block for a in arrays if a.group == "swa")


def test_v41_only_kv_sources_own_global_state():
  c = v41_flash()
  arrays = cache_array_specs(c, CacheLayout())
  assert {a.layer for a in arrays if a.group == "full"} == set(c.kv_source_layer_ids)
  assert {a.layer for a in arrays if a.group == "swa"} == set(range(c.num_layers))
  assert group_specs(c).fingerprint != group_specs(v4_flash()).fingerprint


def test_model_arrays_shaped_from_specs():
  c, layout = v4_tiny(), CacheLayout()
  cache = init_cache(c, layout, num_swa_blocks=3, num_full_blocks=2)
  for a in cache_array_specs(c, layout):
    n = {"swa": 3, "full": 2}[a.group]
    assert cache.layers[a.layer][a.name].shape == (n, *a.block_shape)


def test_plain_specs_generic_groups():
  """cache.specs is plain data: any number of groups, alignment from block sizes, bad specs refused."""
  s = CacheSpecs((GroupSpec("win", SLIDING_WINDOW, 64, 10, 127), GroupSpec("st", SLIDING_WINDOW, 16, 2, 7),
                  GroupSpec("hist", FULL_HISTORY, 128, 5)), "fp")
  assert s.names == ("hist", "win", "st") and (s.hash_tokens, s.align_tokens) == (16, 128)
  assert [g.need_blocks for g in s.groups] == [0, 2, 1] and s.checkpoint_bytes == 2 * 10 + 2
  assert s.full.name == "hist" and s.swa.name == "win"
  import pytest
  with pytest.raises(ValueError):
    GroupSpec("x", "bogus", 32, 1)
  with pytest.raises(ValueError):
    CacheSpecs((GroupSpec("a", FULL_HISTORY, 32, 1), GroupSpec("a", SLIDING_WINDOW, 32, 1, 3)))


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


@pytest.mark.parametrize("key_bits", [64, 63, 40, 32, 31, 3, 0])
def test_keys_from_words_is_device_key_per_digest(key_bits):
  """The host packs keys from the digests' words in one numpy pass: each row is the digest's own device_key."""
  h = RequestHasher(ExtraKeys(), 32)
  h.update(np.random.default_rng(key_bits).integers(0, 1000, 32 * 20).astype(np.int32))
  words = np.frombuffer(b"".join(h.digests), "<u4").reshape(-1, 4)
  want = np.stack([device_key(d, key_bits) for d in h.digests])
  assert np.array_equal(keys_from_words(words, key_bits), want)


def test_checkpoint_policy():
  p = CheckpointPolicy(align_tokens=128, block_tokens=32, tail_tokens=127, retention_interval=256,
                       dense_start=False, rerender_tokens=0)
  assert p.prompt_boundary(1000) == 896 and p.prompt_boundary(1025) == 1024 and p.prompt_boundary(128) == 0
  assert p.boundaries(0, 1000, 1000) == [256, 512, 768, 896]
  assert list(p.tail_blocks(896)) == [24, 25, 26, 27] and list(p.tail_blocks(64)) == [0, 1]
  # at 1059 computed, keep rows from min(1059-127, 1024-128) = 896 -> 28 leading blocks releasable
  assert p.releasable_blocks(1059) == 28 and p.releasable_blocks(100) == 0


def test_checkpoint_placement_v2():
  """Dense start (128 * 2^k inside the prompt), prompt boundary, re-render boundary, junctions."""
  p = CheckpointPolicy(align_tokens=128, block_tokens=32, tail_tokens=127)
  assert p.boundaries(0, 1000, 1000) == [128, 256, 512, 896]          # 999 - 64 = 935 -> 896 as well
  # 1029 - 64 = 965 -> 896: re-render; the prompt boundary 1024 is merged into it, and the dense schedule stops at
  # the largest prompt boundary kept (it no longer adds 1024 back)
  assert p.boundaries(0, 1030, 1030) == [128, 256, 512, 896]
  assert p.boundaries(0, 1030, 1030, dense=False) == [896]           # a request that hit: no dense start
  assert p.dense_points(1030, after=256) == (512,) and p.dense_points(1030, after=512) == ()   # ... but past its run
  assert p.boundaries(0, 2000, 1030, extra=(1152,)) == [128, 256, 512, 896, 1152]
  assert p.boundaries(300, 600, 1030) == [512]


@pytest.mark.parametrize("key_bits", [64, 3])
def test_hasher_rows_equal_per_block_keys(key_bits):
  """The vectorised rows the manager registers equal the per-block device_key / digest_words of the same units."""
  from cache.hashing import ExtraKeys, RequestHasher, device_key, digest_words
  h = RequestHasher(ExtraKeys(tenant="t"), 32, key_bits)
  h.update(np.arange(700, dtype=np.int32) % 97)
  upb = 4
  js = [0, 1, 3, 4]          # 700 tokens = 21 units: blocks 0..4 complete
  key, par = h.rows([(j + 1) * upb - 1 for j in js], [j * upb for j in js])
  for i, j in enumerate(js):
    assert (key[i] == device_key(h.digests[(j + 1) * upb - 1], key_bits)).all()
    assert (par[i] == digest_words(h.parent(j * upb))).all()
  assert key.dtype == np.int32 and par.dtype == np.int32 and par.flags.writeable
