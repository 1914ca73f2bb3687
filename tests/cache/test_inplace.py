"""Per-call cost independent of pool size: the compiled pool operations and the whole `apply_step` update the
donated state in place. A pool-sized `copy` in the compiled module (outside fusion bodies, where `copy` is only a
layout change of values being computed anyway) means XLA copies a whole state array per call, i.e. O(pool) per step.
Compaction branches (rare, O(N) by design) are also checked: they write in place, so their skip branch is free.
Checked on the compiled HLO text, not by timing (benchmarks/cache_bench.py measures the time)."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

from cache import device_state, pool
from cache import step as cache_step
from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from cache.specs import FULL_HISTORY, SLIDING_WINDOW, CacheSpecs, GroupSpec

N = 5000          # not a power of two, so that pool-sized arrays are easy to tell from table-sized ones (8192+)
M = 16


def pool_sized_copies(hlo: str, n: int) -> list[str]:
  out, comp = [], ""
  for line in hlo.splitlines():
    if line and not line.startswith(" ") and "{" in line:
      comp = line.split("(")[0].strip()
    m = re.search(r"= \w+\[([\d,]+)\]\S* copy\(", line)
    if m and not comp.startswith(("%fused", "%wrapped")):
      if int(np.prod([int(x) for x in m.group(1).split(",")])) >= n:
        out.append(f"{comp}: {line.strip()[:120]}")
  return out


def test_pool_sized_copy_detector_can_fail():
  """The detector sees the copy XLA inserts when a donated array is read after it is written."""
  import functools
  import jax

  @functools.partial(jax.jit, donate_argnums=0)
  def bad(a, i):
    return a.at[i].add(1), a[i]     # the old values are read after the in-place write would have happened

  hlo = bad.lower(jnp.zeros(N, jnp.int32), jnp.arange(M)).compile().as_text()
  assert pool_sized_copies(hlo, N)


def test_single_ops_update_in_place():
  st = pool.init_pool(N, 32)
  ids = jnp.full(M, -1, jnp.int32)
  k2, p4, t = jnp.zeros((M, 2), jnp.int32), jnp.zeros((M, 4), jnp.int32), jnp.zeros((M, 32), jnp.int32)
  for name, lowered in [("allocate", pool.allocate.lower(st, 4, max_n=M)), ("free", pool.free.lower(st, ids)),
                        ("free legacy", pool.free.lower(st, ids, prepend_uncached=False)),
                        ("touch", pool.touch.lower(st, ids)), ("register", pool.register.lower(st, ids, k2, p4, t)),
                        ("evict", pool.evict.lower(st, ids))]:
    assert pool_sized_copies(lowered.compile().as_text(), N) == [], name


def test_apply_step_updates_in_place(monkeypatch):
  specs = CacheSpecs((GroupSpec("full", FULL_HISTORY, 128, 1, 0), GroupSpec("swa", SLIDING_WINDOW, 32, 1, 127)))
  seen = []
  real = device_state.apply     # what the manager calls: one buffer in, one out

  def spy(state, plan, buf=None):
    seen.append(cache_step.jitted_step_packed().lower(state.pools, state.tables, plan.buf, **plan.kwargs())
                .compile().as_text())
    return real(state, plan, buf)

  monkeypatch.setattr(device_state, "apply", spy)
  # block tables larger than the pool (64 rows x 128 / 512 entries), so a copy of them would be caught too
  m = KVCacheManager(specs, num_blocks={"full": N, "swa": N}, enable_events=False, num_slots=64,
                     max_tokens=128 * 128)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(2, 1000, 700) for _ in range(3)]
  m.add_requests([(f"a{i}", p, ExtraKeys()) for i, p in enumerate(prompts)], allocate_tokens=[700] * 3)   # admit path
  for i in range(3):
    m.commit(f"a{i}", 700)
    m.free(f"a{i}")
  m.flush()                                                                                   # register + free
  # hits + claims
  m.add_requests([(f"b{i}", p, ExtraKeys()) for i, p in enumerate(prompts)], allocate_tokens=[700] * 3)
  assert len(seen) == 3
  for hlo in seen:
    assert pool_sized_copies(hlo, N) == []


@pytest.mark.parametrize("n", [64, 4096])
def test_detector_threshold_matches_pool(n):
  """Pools of other sizes compile without pool-sized copies too (the check is not tuned to one size)."""
  st = pool.init_pool(n, 8)
  ids = jnp.full(M, -1, jnp.int32)
  assert pool_sized_copies(pool.allocate.lower(st, 4, max_n=M).compile().as_text(), n) == []
  assert pool_sized_copies(pool.free.lower(st, ids).compile().as_text(), n) == []
