"""The engine's path through the cache: the queued work handed to a step program (`plan`, run by
`cache.step.step_packed` inside a jitted program, results read back with `read_results`, possibly a step late)
leaves exactly the device state (pools AND block tables) of the same operations applied by the manager's own
calls; every request's device table agrees with the host's counts; and the pools satisfy the plain reference's
invariants after every step. Random admissions with shared prefixes (hits, claims), allocations, commits with
checkpoints and releases, frees (evictions follow), and preemption-like free + re-admission."""

import functools

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from cache.device_state import DeviceState
from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from cache.reference import RefPool
from cache.specs import FULL_HISTORY, SLIDING_WINDOW, CacheSpecs, GroupSpec
from cache.step import step_packed

SPECS = CacheSpecs((GroupSpec("full", FULL_HISTORY, 16, 1, 0), GroupSpec("swa", SLIDING_WINDOW, 8, 1, 11)))
SLOTS, MAX_TOKENS = 4, 256


@functools.partial(jax.jit, static_argnames=("statics",), donate_argnums=(0,))
def program(state, buf, statics):
  """What the engine's step program does with the cache (the model part left out)."""
  pools, tables, res = step_packed(state.pools, state.tables, buf, **dict(statics))
  return DeviceState(pools, tables), res


def make(num_blocks):
  m = KVCacheManager(SPECS, num_blocks={"full": num_blocks, "swa": num_blocks}, num_slots=SLOTS,
                     max_tokens=MAX_TOKENS, enable_events=False)
  m.set_step_capacity(32, SLOTS)
  return m


def run_step(m, late, pending):
  """One step program on manager m; its results are read now, or (late) at the next step."""
  plan = m.plan()
  res = m.device.advance(program, plan.buf, plan.statics)
  if pending:
    pm, pp, pr = pending.pop()
    pm.read_results(pp, np.asarray(pr))
  if late:
    pending.append((m, plan, res))
  else:
    m.read_results(plan, np.asarray(res))


def same_state(a, b):
  for g in a.groups:
    for x, y in zip(jax.tree_util.tree_leaves(a.pools[g]), jax.tree_util.tree_leaves(b.pools[g])):
      assert np.array_equal(np.asarray(x), np.asarray(y)), g
    assert np.array_equal(np.asarray(a.device_tables[g]), np.asarray(b.device_tables[g])), g
    RefPool.from_state(a.pools[g]).check_invariants()


def advance(d, live, fused, plain):
  """Every live request (rid -> [tokens, done]) advances by a drawn chunk if the pools allow, the same decision on
  both managers (exact counts); one out of blocks is preempted (freed; re-admitted later under a new id)."""
  for rid, (toks, done) in list(live.items()):
    if done >= len(toks):
      continue
    n = min(len(toks) - done, d.draw(st.integers(1, 20)))
    a, b = fused.allocate_to(rid, done + n), plain.allocate_to(rid, done + n)
    assert bool(a) == bool(b)
    if not a:
      for m in (fused, plain):
        m.free(rid)
      del live[rid]
      continue
    live[rid][1] = done + n


def two_managers(d):
  """A trace's random source, two managers on equal pools (one driven through step plans, one through its own
  calls) and two shared prefixes the prompts draw from."""
  rng = np.random.default_rng(d.draw(st.integers(0, 1 << 20)))
  nb = d.draw(st.sampled_from([12, 40]))
  return rng, make(nb), make(nb), [rng.integers(2, 60, 48) for _ in range(2)]


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.booleans())
def test_step_plans_match_the_managers_own_calls(d, late):
  rng, fused, plain, prefixes = two_managers(d)
  live, pending = {}, []
  for step in range(d.draw(st.integers(3, 10))):
    # admissions (one batched call on each manager)
    new = []
    for k in range(d.draw(st.integers(0, 2))):
      if len(live) + len(new) >= SLOTS:
        break
      toks = np.concatenate([prefixes[d.draw(st.integers(0, 1))][:d.draw(st.integers(0, 48))],
                             rng.integers(2, 60, d.draw(st.integers(1, 60)))])
      new.append((f"r{step}.{k}", toks))
    for m in (fused, plain):
      hits = m.add_requests([(rid, t, ExtraKeys()) for rid, t in new])
      for (rid, t), h in zip(new, hits):
        live[rid] = [t, h.num_tokens]
    advance(d, live, fused, plain)
    run_step(fused, late, pending)
    plain.flush()
    check(fused, plain, live)
    commit_and_finish(d, live, (fused, plain))
  run_step(fused, late, pending)        # the last commits and frees, through a step plan too
  plain.flush()
  check(fused, plain, live)


def commit_and_finish(d, live, managers):
  """Both managers commit what every live request computed; finished ones are freed at random."""
  for rid, (toks, done) in live.items():
    for m in managers:
      if done > m.num_committed(rid):
        m.commit(rid, done)
  for rid in [r for r, (t, dn) in live.items() if dn >= len(t) and d.draw(st.booleans())]:
    for m in managers:
      m.free(rid)
    del live[rid]


def check(fused, plain, live):
  """(Both queues are empty here: the commits and frees that follow go into the next step plan.)"""
  for g in fused.groups:
    assert fused.free_blocks_estimate(g) <= fused.num_free_blocks(g)
    assert fused.num_free_blocks(g) == plain.num_free_blocks(g)
  for rid in live:                    # device tables agree with the host's counts (raises otherwise)
    assert {g: list(x) for g, x in fused.block_tables(rid).tables.items()} == \
        {g: list(x) for g, x in plain.block_tables(rid).tables.items()}
  same_state(fused, plain)


def test_cpu_compiler_options_of_the_cache_programs():
  """Level 0 everywhere on the CPU; the elemental emitter only on the jaxlib line where the flag was checked (XLA
  refuses an option it does not know)."""
  import importlib.metadata
  from cache import step
  opts = step._cpu_compiler_options()
  assert opts["xla_backend_optimization_level"] == 0
  assert ("xla_cpu_use_fusion_emitters" in opts) == importlib.metadata.version("jaxlib").startswith("0.10.")
