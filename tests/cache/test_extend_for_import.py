"""KVCacheManager.extend_for_import: blocks for state another engine computed, at an unaligned point. The request
owns them like blocks it allocated for a step: complete blocks are registered at the commit, a partially filled
last block only once a later step completes it. Reference: a twin request that computes the same tokens instead;
after the import both hold and cache the same blocks at every later step and give the same hits once freed (fixed
cases and a property over import points and later step ends). All or nothing when the pools are short: it
allocates through `allocate_to`."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cache.api_types import CacheError
from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from dsv4.caches import group_specs
from dsv4.config import v4_flash

SPECS = group_specs(v4_flash())     # full blocks of 128 tokens, swa blocks of 32, a 4-block tail
NF, NS = 128, 128                   # the pool shape of tests/cache/test_manager.py: its programs are shared
TOKS = np.arange(400) % 500 + 3


def _held(tables):
  return {g: [j for j, b in enumerate(tables[g]) if b >= 0] for g in ("full", "swa")}


def _import_then_step(L, ends):
  """Both load the aligned part [0, P) as a tier reload does; then one request imports [P, L) and its twin computes
  it; both then step to each of `ends`. Same blocks held and cached throughout, same hits afterwards."""
  P = L // 128 * 128
  fb, sb = 128, 32
  imported = KVCacheManager(SPECS, num_full_blocks=NF, num_swa_blocks=NS)
  computed = KVCacheManager(SPECS, num_full_blocks=NF, num_swa_blocks=NS)
  for m in (imported, computed):
    m.add_request("r", TOKS[:L + 1])
  pol = imported.policies["swa"]
  if P:
    for m in (imported, computed):
      assert m.extend_for_load("r", P, set(pol.tail_blocks(P)))
      m.commit("r", P)
  if L > P:
    bt = imported.extend_for_import("r", L)
    held = _held(bt)
    assert held["full"] == list(range(-(-L // fb)))
    assert held["swa"] == sorted(set(pol.tail_blocks(P)) | set(range(P // sb, -(-L // sb))))
    imported.commit("r", L)
  assert computed.allocate_to("r", L)
  computed.commit("r", L)
  for m in (imported, computed):
    m.append_tokens("r", TOKS[L + 1:400])
  for n in sorted(set(e for e in ends if e > L)):
    for m in (imported, computed):
      assert m.allocate_to("r", n)
      m.commit("r", n)
    assert _held(imported.block_tables("r")) == _held(computed.block_tables("r")), n
    for j in range(-(-n // fb)):
      c = imported.is_cached("full", TOKS, ExtraKeys(), j)
      assert c == computed.is_cached("full", TOKS, ExtraKeys(), j) == ((j + 1) * fb <= n), (n, j)
  for m in (imported, computed):
    m.free("r")
  for q in (TOKS[:399], TOKS[:L + 1], TOKS[:P + 1]):
    assert imported.lookup(q).num_tokens == computed.lookup(q).num_tokens


@pytest.mark.parametrize("L", [45, 181, 300])
def test_import_at_an_unaligned_point_then_steps_as_if_computed(L):
  _import_then_step(L, (L + 1, 256, 300, 399))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 397), st.lists(st.integers(2, 399), max_size=4))
def test_import_anywhere_equals_computing(L, ends):
  _import_then_step(L, ends)


def test_import_bounds():
  m = KVCacheManager(SPECS, num_full_blocks=NF, num_swa_blocks=NS)
  m.add_request("q", TOKS[:100])
  for bad in (0, 100, 120):                # nothing to import, the last known token, past the tokens
    with pytest.raises(CacheError):
      m.extend_for_import("q", bad)
  assert _held(m.block_tables("q")) == {"full": [], "swa": []}
