"""`KVCacheManager.blocks_to_run` (the engine's admission rule, docs/tiers.md) against the manager itself: a request
driven alone one position per row (commits one token behind past the prompt when `lag`, as an async engine's decode
rows; rows allocating `extra` positions past them, as a drafting row's lookahead), its blocks in use measured after
every allocation from the device's free counts. The peak equals blocks_to_run in every group: the rule counts no
block the run does not hold, and misses none it does."""

import numpy as np
from hypothesis import given, settings, strategies as st

from cache.manager import KVCacheManager
from dsv4.caches import group_specs
from tests.cache.test_manager import CFG, NF, NS     # their pool shape: the manager's programs compile once

# V4-Flash's groups: full 128-token blocks, swa 32-token blocks with a 127-row tail (4 blocks), alignment 128
SPECS = group_specs(CFG)


def _peak_alone(m: KVCacheManager, prompt_len: int, total: int, extra: int, lag: int, cap: int) -> dict[str, int]:
  toks = [int(t) for t in np.arange(total + 1) % 97 + 2]
  m.add_request("r", toks[:prompt_len])
  peak = {g: 0 for g in m.groups}
  for p in range(total):
    if p >= prompt_len:
      m.append_tokens("r", [toks[p]])
    m.commit("r", p - lag if p > prompt_len else p)
    assert m.allocate_to("r", min(p + 1 + extra, cap))
    for g in m.groups:
      peak[g] = max(peak[g], m.num_blocks[g] - m.num_free_blocks(g))
  m.free("r")
  return peak


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 420), st.integers(1, 200), st.sampled_from([0, 0, 3]), st.integers(0, 1), st.booleans())
def test_blocks_to_run_is_the_peak_of_a_run_alone(prompt_len, outputs, extra, lag, capped):
  total = prompt_len + outputs - 1
  cap = total + extra - 2 if capped and extra else total + extra
  m = KVCacheManager(SPECS, num_full_blocks=NF, num_swa_blocks=NS)
  want = m.blocks_to_run(prompt_len, total, extra, lag, cap)
  assert _peak_alone(m, prompt_len, total, extra, lag, cap) == want
