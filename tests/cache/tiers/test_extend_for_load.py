"""KVCacheManager.extend_for_load: the one manager hook the tiers use (blocks for a prefix loaded from below)."""

import numpy as np
import pytest

from cache.api_types import CacheError, OutOfBlocks
from cache.manager import KVCacheManager
from dsv4.caches import CacheLayout, group_specs
from dsv4.config import v4_flash

CFG = v4_flash()
SPECS = group_specs(CFG, CacheLayout())


def test_extend_for_load_allocates_full_blocks_and_only_the_swa_tails():
  m = KVCacheManager(SPECS, num_full_blocks=16, num_swa_blocks=32)
  toks = np.arange(700) % 1000 + 3
  assert m.add_request("r", toks).num_tokens == 0
  need = m.policies["swa"].need_blocks
  tail = set(m.policies["swa"].tail_blocks(512))
  bt = m.extend_for_load("r", 512, tail)
  assert len(bt.full) == 4 and (bt.full >= 0).all() and len(set(bt.full.tolist())) == 4
  assert len(bt.swa) == 16 and sorted(j for j in range(16) if bt.swa[j] >= 0) == sorted(tail) and len(tail) == need
  assert m.num_free_blocks("full") == 12 and m.num_free_blocks("swa") == 32 - need
  m.commit("r", 512)                       # the loaded prefix is registered (full blocks + checkpoint tail)
  m.free("r")
  assert m.lookup(np.concatenate([toks[:512], [1, 2]])).num_tokens == 512
  m.add_request("q", toks)
  with pytest.raises(CacheError):
    m.extend_for_load("q", 500, set())     # not aligned
  small = KVCacheManager(SPECS, num_full_blocks=2, num_swa_blocks=32)
  small.add_request("r", toks)
  out = small.extend_for_load("r", 512, tail)
  assert isinstance(out, OutOfBlocks) and out.group == "full"
  assert small.num_free_blocks("full") == 2 and len(small.block_tables("r").full) == 0   # nothing changed
