"""KVCacheManager end to end: the A -> B -> A session switch (docs/kv_cache.md, SWA checkpoints), exact hit lengths,
checkpoints, out-of-blocks, bad input, events."""

import numpy as np
import pytest

from cache.api_types import CacheError, OutOfBlocks
from cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from dsv4.caches import group_specs
from dsv4.config import v4_flash, v41_flash

CFG = v4_flash()
# one pool shape for every test: each jitted op compiles once per group. swa 32-token blocks, full 128, tail 127
# rows -> 4 swa blocks per checkpoint, align 128
NF, NS = 128, 128


def serve(m, rid, toks, prompt_len, n_out, chunk, extra=ExtraKeys()):
  """Chunked prefill then decode, like an engine would drive the manager. Returns the admission hit."""
  hit = m.add_request(rid, toks[:prompt_len], extra)
  n = hit.num_tokens
  while n < prompt_len:
    c = min(chunk, prompt_len - n)
    assert m.allocate_for(rid, c)
    n += c
    m.commit(rid, n)
  for i in range(n_out):
    m.append_tokens(rid, [int(toks[prompt_len + i])])
    if i < n_out - 1:          # the last sampled token is never fed back
      assert m.allocate_for(rid, 1)
      n += 1
      m.commit(rid, n)
  m.free(rid)
  return hit.num_tokens


def sessions(seed=0):
  rng = np.random.default_rng(seed)
  common = rng.integers(2, 1000, 256)   # chat template: the first 256 tokens of every request agree
  a = np.concatenate([common, rng.integers(2, 1000, 1400)])
  b = np.concatenate([common, rng.integers(2, 1000, 6100)])
  return a, b


@pytest.mark.parametrize("legacy", [False, True])
def test_session_switch_a_b_a(legacy):
  a, b = sessions()
  n_swa = 128
  m = KVCacheManager(group_specs(CFG), num_full_blocks=128, num_swa_blocks=n_swa, legacy_dense_swa=legacy)
  assert serve(m, "a1", a, 1000, 60, 256) == 0          # computed 1059 tokens; end checkpoint at 1024
  assert m.lookup(a[:1160]).num_tokens == 1024          # next turn: prompt + answer + 100 new tokens
  assert m.lookup(a[:1000]).num_tokens == 896           # the same prompt again: prompt boundary
  free_before = m.num_free_blocks("swa")
  # B: allocates more swa blocks over its life than the pool has, while holding few at any time.
  peak = 0
  hit_b = m.add_request("b1", b[:6000])
  n = hit_b.num_tokens
  allocs = 0
  while n < 6000:
    before = len(m.block_tables("b1").swa)
    assert m.allocate_for("b1", 512)
    allocs += len(m.block_tables("b1").swa) - before
    peak = max(peak, int((m.block_tables("b1").swa >= 0).sum()))
    n = min(n + 512, 6000)
    m.commit("b1", n)
  m.free("b1")
  assert allocs > n_swa and peak < n_swa // 2 and free_before == n_swa
  hit = m.lookup(a[:1160]).num_tokens
  assert m.is_cached("full", a, ExtraKeys(), 0)         # A's first full-attention block survives in both modes
  if legacy:
    assert hit == 0        # vLLM <= 0.22: B's hashed, appended swa blocks flushed A's swa tails
  else:
    assert hit == 1024     # transient swa blocks are reused first; A's checkpoint survives
    assert m.lookup(a[:1000]).num_tokens == 896
    # and resuming actually works: claim, extend, finish
    assert serve(m, "a2", a, 1160, 10, 256) == 1024


def test_hit_independent_of_other_allocation_count():
  a, b = sessions(1)
  m = KVCacheManager(group_specs(CFG), num_full_blocks=NF, num_swa_blocks=NS)
  serve(m, "a1", a, 1000, 60, 256)
  for i in range(3):       # B three times over: ~600 swa allocations through a 96-block pool
    serve(m, f"b{i}", b, 6000, 2, 1024)
    assert m.lookup(a[:1160]).num_tokens == 1024


@pytest.mark.parametrize("interval,dense,expect", [(0, False, 0), (256, False, 512), (128, False, 640),
                                                   (0, True, 512), (128, True, 640)])
def test_retention_interval(interval, dense, expect):
  """A 700-token divergence from a 1000-token prompt: retention multiples / the dense start schedule (128, 256,
  512) decide the largest checkpoint before it."""
  a, _ = sessions(2)
  m = KVCacheManager(group_specs(CFG), num_full_blocks=NF, num_swa_blocks=NS, retention_interval=interval,
                     dense_start=dense)
  serve(m, "a1", a, 1000, 4, 256)
  diverged = np.concatenate([a[:700], np.full(300, 7)])   # shares 700 tokens: full blocks 0..4 (640)
  assert m.lookup(diverged).num_tokens == expect


def test_bad_retention_interval():
  with pytest.raises(ValueError, match="retention_interval"):
    KVCacheManager(group_specs(CFG), num_full_blocks=NF, num_swa_blocks=NS, retention_interval=100)


def test_tenants_and_extra_keys_isolate():
  a, _ = sessions(3)
  m = KVCacheManager(group_specs(CFG), num_full_blocks=NF, num_swa_blocks=NS)
  serve(m, "a1", a, 1000, 4, 512, ExtraKeys(tenant="x"))
  assert m.lookup(a[:1000], ExtraKeys(tenant="x")).num_tokens == 896
  assert m.lookup(a[:1000], ExtraKeys(tenant="y")).num_tokens == 0
  assert m.lookup(a[:1000], ExtraKeys(tenant="x", adapter="lora1")).num_tokens == 0
  m2 = KVCacheManager(group_specs(v41_flash()), num_full_blocks=NF, num_swa_blocks=NS)
  assert m2.specs.fingerprint != m.specs.fingerprint   # layouts never share blocks


def test_hit_blocks_are_claimed_and_tables_consistent():
  a, _ = sessions(4)
  m = KVCacheManager(group_specs(CFG), num_full_blocks=NF, num_swa_blocks=NS)
  serve(m, "a1", a, 1000, 4, 512)
  hit = m.add_request("a2", a[:1000])
  assert hit.num_tokens == 896
  t = m.block_tables("a2")
  assert len(t.full) == 7 and np.all(t.full >= 0)
  assert len(t.swa) == 28 and np.all(t.swa[:24] == -1) and np.all(t.swa[24:] >= 0)
  for name, ids in (("full", t.full), ("swa", t.swa[24:])):
    assert np.all(np.asarray(m.pools[name].ref_N)[ids] == 1)
  assert m.allocate_for("a2", 104)       # to 1000: one more full block, 4 more swa blocks
  t = m.block_tables("a2")
  assert len(t.full) == 8 and len(t.swa) == 32
  m.commit("a2", 1000)
  m.free("a2")
  assert m.num_free_blocks("full") == NF and m.num_free_blocks("swa") == NS   # nothing leaks


def test_out_of_blocks_is_reported_and_changes_nothing():
  a, _ = sessions(5)
  m = KVCacheManager(group_specs(CFG), num_full_blocks=NF, num_swa_blocks=NS)
  m.add_request("r", a[:1000])
  res = m.allocate_for("r", 20000)      # needs 157 full blocks, pool has 128
  assert isinstance(res, OutOfBlocks) and not res and res.group == "full" and res.needed == 157 and res.free == NF
  assert m.num_free_blocks("full") == NF and m.num_free_blocks("swa") == NS
  assert len(m.block_tables("r").swa) == 0
  assert m.allocate_for("r", 512)       # a smaller chunk fits
  assert isinstance(m.allocate_for("r", 5000), OutOfBlocks)   # swa: 157 more blocks > 128 - 16
  m.free("r")
  assert m.num_free_blocks("full") == NF and m.num_free_blocks("swa") == NS


def test_bad_input_raises():
  m = KVCacheManager(group_specs(CFG), num_full_blocks=NF, num_swa_blocks=NS)
  with pytest.raises(CacheError, match="unknown request"):
    m.free("nope")
  m.add_request("r", np.arange(300))
  with pytest.raises(CacheError, match="already exists"):
    m.add_request("r", np.arange(300))
  with pytest.raises(CacheError, match=">= 0"):
    m.allocate_for("r", -1)
  with pytest.raises(CacheError, match="exceed the blocks"):
    m.commit("r", 100)
  assert m.allocate_for("r", 300)
  with pytest.raises(CacheError, match="only 300 tokens"):
    m.commit("r", 301)
  m.commit("r", 200)
  with pytest.raises(CacheError, match="backwards"):
    m.commit("r", 100)
  with pytest.raises(CacheError, match="non-empty"):
    m.add_request("e", [])
  assert not m.reset_prefix_cache()     # refused while a request holds blocks
  m.free("r")
  with pytest.raises(CacheError):
    m.free("r")


def test_events_stream():
  a, b = sessions(6)
  m = KVCacheManager(group_specs(CFG), num_full_blocks=NF, num_swa_blocks=NS)
  serve(m, "a1", a, 1000, 4, 512, ExtraKeys(tenant="t1"))
  ev = m.take_events()
  stored = [e for e in ev if isinstance(e, BlockStored)]
  full = [e for e in stored if e.group == "full"]
  assert [e.block_id for e in full][:7] == list(m.lookup(a[:1000], ExtraKeys(tenant="t1")).block_ids["full"])
  assert full[0].parent_hash is None and all(x.parent_hash == y.block_hash for x, y in zip(full[1:], full))
  assert {e.tenant for e in stored} == {"t1"} and any(e.group == "swa" for e in stored)
  assert m.take_events() == []
  long = np.random.default_rng(7).integers(2, 1000, 16100)
  serve(m, "b1", long, 16000, 2, 1024)  # 125 full blocks held: some of A's cached full blocks get reused
  removed = [e for e in m.take_events() if isinstance(e, BlockRemoved) and e.group == "full"]
  assert removed and {e.tenant for e in removed} == {"t1"}
  assert {e.block_hash for e in removed} <= {e.block_hash for e in full}
  assert m.reset_prefix_cache()
  assert m.take_events() == [AllBlocksCleared()]
  assert m.lookup(long[:16000]).num_tokens == 0
