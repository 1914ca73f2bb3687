"""Hybrid prefix-hit search: jitted batched search vs the plain reference on random traces, incl. forced hash-key
collisions (exactness) and external evictions that punch holes in full chains and swa tails."""

import numpy as np
import jax.numpy as jnp
from hypothesis import HealthCheck, given, settings, strategies as st

from dsv4.caches import group_specs
from dsv4.config import v4_flash
from cache import pool
from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from cache.reference import RefPool, ref_hybrid_hit

CFG = v4_flash()
NF, NS = 128, 128
SEGMENTS = np.random.default_rng(0).integers(2, 50, (4, 96))   # shared pieces so prompts overlap


def make_tokens(d):
  parts = d.draw(st.lists(st.integers(0, 3), min_size=1, max_size=10))
  toks = np.concatenate([SEGMENTS[p] for p in parts])
  if d.draw(st.booleans()):   # perturb one token: a near-miss prefix
    i = d.draw(st.integers(0, len(toks) - 1))
    toks = toks.copy()
    toks[i] = 1
  return toks


def check_against_reference(m, toks, extra):
  hit = m.lookup(toks, extra)
  h = m._hasher(np.asarray(toks, np.int32), extra)
  u = len(toks) // m.specs.hash_tokens
  key, par = h.arrays(u)
  tok = np.asarray(toks[:u * 32], np.int32).reshape(u, 32)
  refs = [RefPool.from_state(m.pools[n]) for n in m.groups]
  want, ids = ref_hybrid_hit(m._searches, refs, key, par, tok, len(toks) - 1, m.specs.align_tokens, 32)
  assert hit.num_tokens == want, (hit.num_tokens, want)
  for name, rid in zip(m.groups, ids):
    got = hit.block_ids[name]
    np.testing.assert_array_equal(got, rid[:len(got)])
    bt = m.specs.group(name).block_tokens
    stored = np.asarray(m.pools[name].tokens_NxT)
    for j, b in enumerate(got):   # exactness: every returned block holds exactly the request's tokens
      if b >= 0:
        np.testing.assert_array_equal(stored[b], toks[j * bt:(j + 1) * bt])
  return hit


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_hybrid_search_matches_reference(d):
  key_bits = d.draw(st.sampled_from([64, 3]))    # 3 bits: almost every key collides
  m = KVCacheManager(group_specs(CFG), num_full_blocks=NF, num_swa_blocks=NS, key_bits=key_bits,
                     retention_interval=d.draw(st.sampled_from([0, 128, 256])))
  tenants = [ExtraKeys(), ExtraKeys(tenant="t")]
  for i in range(d.draw(st.integers(1, 4))):
    toks = make_tokens(d)
    extra = d.draw(st.sampled_from(tenants))
    check_against_reference(m, toks, extra)
    out = d.draw(st.integers(1, 40))
    full = np.concatenate([toks, np.full(out, 5)])
    hit = m.add_request(f"r{i}", toks, extra)
    n = hit.num_tokens
    chunk = d.draw(st.sampled_from([64, 128, 256, 512]))
    while n < len(toks):
      c = min(chunk, len(toks) - n)
      assert m.allocate_for(f"r{i}", c)
      n += c
      m.commit(f"r{i}", n)
    for k in range(out - 1):
      m.append_tokens(f"r{i}", [5])
      assert m.allocate_for(f"r{i}", 1)
      n += 1
      m.commit(f"r{i}", n)
    m.free(f"r{i}")
    if d.draw(st.booleans()):   # external eviction of a few cached free blocks
      name = d.draw(st.sampled_from(m.groups))
      cached = np.flatnonzero(np.asarray(m.pools[name].cached_N))
      if len(cached):
        drop = d.draw(st.lists(st.sampled_from(list(cached)), max_size=3))
        m.update_pool(name, pool.evict, jnp.asarray(drop + [-1] * (16 - len(drop)), jnp.int32))
    check_against_reference(m, full, extra)
    check_against_reference(m, toks, d.draw(st.sampled_from(tenants)))
  for name in m.groups:
    assert m.num_free_blocks(name) == m.pools[name].num_blocks


def test_batched_lookup_equals_single():
  m = KVCacheManager(group_specs(CFG), num_full_blocks=NF, num_swa_blocks=NS)
  toks = np.concatenate([SEGMENTS[0], SEGMENTS[1], SEGMENTS[2], SEGMENTS[3]] * 3)
  m.add_request("r", toks)
  assert m.allocate_for("r", len(toks))
  m.commit("r", len(toks))
  m.free("r")
  qs = [(toks, ExtraKeys()), (toks[:700], ExtraKeys()), (toks, ExtraKeys(tenant="x")), (toks[:50], ExtraKeys())]
  batch = m.lookup_batch(qs)
  single = [m.lookup(t, e) for t, e in qs]
  # 700 tokens: dense-start checkpoint at 512
  assert [h.num_tokens for h in batch] == [h.num_tokens for h in single] == [1024, 512, 0, 0]


def test_collision_never_aliases():
  """key_bits=0: every block of every prefix has the same device key; hits must still be exact."""
  m = KVCacheManager(group_specs(CFG), num_full_blocks=NF, num_swa_blocks=NS, key_bits=0, dense_start=False,
                     rerender_tokens=0)   # few checkpoints: 16-slot probe chains hold both requests' blocks
  rng = np.random.default_rng(1)
  a, b = rng.integers(2, 99, 700), rng.integers(2, 99, 700)
  for rid, t in (("a", a), ("b", b)):
    m.add_request(rid, t)
    assert m.allocate_for(rid, 700)
    m.commit(rid, 700)
    m.free(rid)
  assert m.lookup(a).num_tokens == 640 and m.lookup(b).num_tokens == 640
  mixed = np.concatenate([b[:128], a[128:]])
  assert m.lookup(mixed).num_tokens == 128 or m.lookup(mixed).num_tokens == 0
  check_against_reference(m, mixed, ExtraKeys())
  check_against_reference(m, a, ExtraKeys())


def test_search_in_row_chunks_equals_one_batch():
  """The admission's search (`search_rows`: chunks of rows, up to the last row that can hit) returns exactly what one
  batched search returns, with padding rows and rows too short to hit between and after the live ones."""
  import jax
  from cache.prefix import search, search_rows
  m = KVCacheManager(group_specs(CFG), num_full_blocks=NF, num_swa_blocks=NS)
  toks = np.concatenate([SEGMENTS[0], SEGMENTS[1], SEGMENTS[2], SEGMENTS[3]] * 3)
  m.add_request("r", toks)
  assert m.allocate_for("r", len(toks))
  m.commit("r", len(toks))
  m.free("r")
  qs = [toks, toks[:700], toks[:50], toks[:1000], toks[:1], toks[:300]] + [toks[:129], toks[:640]] * 4
  hashers = [m._hasher(np.asarray(t, np.int32), ExtraKeys()) for t in qs]
  plan = m.queue.pack_admissions([np.asarray(t, np.int32) for t in qs], hashers)
  max_len = np.asarray(plan.max_len_B).copy()
  max_len[[6, 9]] = 0                        # padding rows between live ones (rows 14, 15 are padding already)
  pools = tuple(m.pools[g] for g in m.groups)
  arrays = tuple(jnp.asarray(x) for x in (plan.key_BxUx2, plan.par_BxUx4, plan.tok_BxUxG, max_len))
  statics = (m._searches, m.specs.align_tokens, m.specs.hash_tokens)
  assert plan.key_BxUx2.shape[0] == 16
  want = jax.jit(lambda p, *a: search(p, *a, *statics))(pools, *arrays)
  for chunks in (2, 4, 8):
    got = jax.jit(lambda p, *a: search_rows(p, *a, *statics, chunks=chunks))(pools, *arrays)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert list(np.asarray(want[0])[:6]) == [1024, 512, 0, 512, 0, 256]   # live rows hit (dense-start checkpoints)
