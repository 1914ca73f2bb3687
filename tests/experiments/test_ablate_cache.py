"""Cache ablations: the eviction policies of cache/eviction.py (free-queue discipline, no leaks, plumbing equal to
the plain manager), and the --small paths of experiments/ablate_retention.py and ablate_eviction.py."""

import os
import subprocess
import sys

import numpy as np
import pytest

from cache import pool
from cache.eviction import POLICIES, PolicyCacheManager, make_manager
from cache.manager import KVCacheManager
from dsv4.caches import group_specs
from dsv4.config import v4_flash
from experiments.ablate_eviction import multi_tenant
from experiments.ablate_retention import run_trace, synthetic_answer
from tests.experiments.test_ablation_plots import checked_outputs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = v4_flash()
SPECS = group_specs(CFG)
NF, NS = 24, 48          # one pool shape for every test here (each shape compiles the pool ops once)


def _trace():
  return multi_tenant(CFG.vocab_size, tenants=2, sessions=2, requests=14, system_len=256, u_len=(32, 200),
                      a_len=(16, 96), max_len=1500, seed=5)


def _check_queue(m, policy):
  """Pool invariants after a request ends, plus the policy's own ordering of the cached part of the queue."""
  for g in m.groups:
    st = m.pools[g]
    ref, cached = np.asarray(st.ref_N), np.asarray(st.cached_N)
    q = pool.free_queue(st)
    assert len(q) == int(st.num_free) == st.num_blocks      # nothing held between requests (no leak)
    assert sorted(q) == list(range(st.num_blocks)) and (ref == 0).all()
    if policy == "fifo":
      flags = [bool(cached[b]) for b in q]
      assert flags == sorted(flags)                         # uncached blocks first, then cached
      stamps = [m.events.stamp[(g, b)] for b in q if cached[b]]
      assert stamps == sorted(stamps)                       # oldest registration evicted first
      assert set(m.events.stamp) == {(g2, b) for g2 in m.groups for b in np.nonzero(
          np.asarray(m.pools[g2].cached_N))[0].tolist()}


@pytest.mark.parametrize("policy", POLICIES)
def test_policy_invariants(policy):
  m = make_manager(SPECS, policy, num_full_blocks=NF, num_swa_blocks=NS)
  rows = run_trace(m, _trace(), synthetic_answer(CFG.vocab_size), on_request=lambda m, r: _check_queue(m, policy))
  assert len(rows) == 14 and all(0 <= r["hit"] < r["prompt"] for r in rows)
  assert sum(r["hit"] for r in rows) > 0


def test_lru_and_legacy_plumbing_equal_plain_manager():
  """PolicyCacheManager's 'lru' / 'legacy_dense' must behave exactly as the engine's manager (hits + queue)."""
  ans = synthetic_answer(CFG.vocab_size)
  for policy, legacy in [("lru", False), ("legacy_dense", True)]:
    a = PolicyCacheManager(SPECS, policy=policy, num_full_blocks=NF, num_swa_blocks=NS)
    b = KVCacheManager(SPECS, num_full_blocks=NF, num_swa_blocks=NS, legacy_dense_swa=legacy)
    assert run_trace(a, _trace(), ans) == run_trace(b, _trace(), ans)
    for g in a.groups:
      assert pool.free_queue(a.pools[g]) == pool.free_queue(b.pools[g])


def test_release_order_head_first_vs_lru():
  """One request, then look at where its full blocks sit in the free queue: lru puts the chain's tail nearest the
  head (evicted first), head_first its head."""
  toks = np.arange(2, 2 + 700)
  for policy in ("lru", "head_first"):
    m = PolicyCacheManager(SPECS, policy=policy, num_full_blocks=NF, num_swa_blocks=NS)
    m.add_request("r", toks)
    assert m.allocate_for("r", 700)
    m.commit("r", 700)
    table = [int(x) for x in m.block_tables("r").full]
    m.free("r")
    cached = np.asarray(m.pools["full"].cached_N)
    q = [b for b in pool.free_queue(m.pools["full"]) if cached[b]]
    assert q == (table[:5][::-1] if policy == "lru" else table[:5])


def test_fifo_no_refresh_on_hit():
  """A hit refreshes a chain under lru (it moves to the tail) but not under fifo (it keeps its first place)."""
  rng = np.random.default_rng(0)
  a, b = rng.integers(2, 1000, 400), rng.integers(2, 1000, 400)
  out = {}
  for policy in ("lru", "fifo"):
    m = PolicyCacheManager(SPECS, policy=policy, num_full_blocks=NF, num_swa_blocks=NS)
    for rid, t in [("a", a), ("b", b), ("a2", a)]:
      m.add_request(rid, t)
      m.allocate_for(rid, 0 if rid == "a2" else len(t))
      if rid != "a2":
        m.commit(rid, len(t))
      m.free(rid)
    cached = np.asarray(m.pools["full"].cached_N)
    q = [bb for bb in pool.free_queue(m.pools["full"]) if cached[bb]]
    a_blocks = [int(x) for x in m.lookup(a).block_ids["full"]]
    out[policy] = q.index(a_blocks[0]) < len(q) // 2       # a's head in the first (evicted-first) half?
  assert out == {"lru": False, "fifo": True}


def test_unknown_policy():
  with pytest.raises(ValueError):
    PolicyCacheManager(SPECS, policy="mru", num_full_blocks=NF, num_swa_blocks=NS)


def _run(args, cwd=REPO, timeout=600):
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  cache = os.environ.get("DSV4_TEST_XLA_CACHE_DIR")
  if cache:  # the suite's compile cache (tests/conftest.py): pool ops the tests above compiled are reused
    env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  r = subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_ablate_retention_small(tmp_path):
  # run from an empty directory without --out_dir: the default output is out/ablate_retention/ under it
  _run(["experiments.ablate_retention", "--small"], cwd=tmp_path)
  out = tmp_path / "out" / "ablate_retention"
  rows = checked_outputs(out, "ablate_retention", "retention", "retention_interval", [0, 128, 512])
  for w in ("doc_branch", "chat_fork"):
    r = {x["retention_interval"]: x for x in rows if x["workload"] == w}
    assert set(r) == {0, 128, 512}
    # a denser interval never recomputes more on resume and never holds fewer checkpoint blocks
    assert r[128]["branch_recomputed_tokens"] <= r[512]["branch_recomputed_tokens"] <= r[0]["branch_recomputed_tokens"]
    assert r[128]["swa_blocks_cached"] >= r[0]["swa_blocks_cached"]
    # R changes only which swa tails are kept: same trace, same full-history blocks
    assert len({x["prompt_tokens"] for x in r.values()}) == 1
    assert len({x["full_blocks_cached"] for x in r.values()}) == 1
  r = {x["retention_interval"]: x for x in rows if x["workload"] == "doc_branch"}
  assert r[128]["branch_recomputed_tokens"] < r[0]["branch_recomputed_tokens"]


def test_ablate_eviction_small(tmp_path):
  _run(["experiments.ablate_eviction", "--small", f"--out_dir={tmp_path}", "--full_blocks=24,192"])
  rows = checked_outputs(tmp_path, "ablate_eviction", "eviction", "num_full_blocks", [24, 192])
  assert {r["policy"] for r in rows} == set(POLICIES) and len(rows) == 2 * len(POLICIES)
  assert len({r["prompt_tokens"] for r in rows}) == 1              # one trace for every policy and pool size
  for pol in POLICIES:
    small, big = (next(r for r in rows if r["policy"] == pol and r["num_full_blocks"] == n) for n in (24, 192))
    assert small["hit_rate"] <= big["hit_rate"] and (small["num_swa_blocks"], big["num_swa_blocks"]) == (48, 384)
