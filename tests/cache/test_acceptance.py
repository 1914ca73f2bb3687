"""The session-switch scenario's requirements, checked exactly (BUILD_NOTES.md, Cache bookkeeping, "Measured").

1. A1 -> A2 -> B -> A3 session switch on V4-Flash geometry: A2 and A3 resume at the last 128-aligned boundary of
   the previous turn's computed tokens, in every group, and strictly beyond the previous prompt's boundary.
2. Churn: blocks released without a cache key never push a cached block closer to eviction.
3. Hybrid cases: full group further than the SWA group and the reverse; jitted == reference == hand value.
4. Isolation: identical tokens under two tenants never share a block, also with every device key colliding.

Pool shapes (128 full / 128 swa blocks, 16-wide ids, 64/256-unit searches) are those of test_manager.py and
test_prefix.py, so the jitted ops are compiled once per worker.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from dsv4.caches import group_specs
from dsv4.config import v4_flash
from cache import pool
from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from cache.reference import RefPool, ref_hybrid_hit

CFG = v4_flash()
NF, NS = 128, 128
# Checkpoint placement of cache v1 (prompt boundary, end of request, retention multiples only): the hybrid and
# isolation tests below check search logic against hand values computed for that placement.
V1 = dict(dense_start=False, rerender_tokens=0, junction_checkpoints=False)
ALIGN, FULL_BT, SWA_BT, NEED = 128, 128, 32, 4     # V4-Flash, default CacheLayout (asserted below)


def _geometry(m):
  assert (m.specs.align_tokens, m.specs.full.block_tokens, m.specs.swa.block_tokens, m.specs.swa.need_blocks) == \
      (ALIGN, FULL_BT, SWA_BT, NEED)


def floor_align(n):
  return n // ALIGN * ALIGN


def check_reference(m, toks, extra=ExtraKeys()):
  """Jitted hit == ref_hybrid_hit on a copy of the pools; returned blocks hold exactly the request's tokens."""
  toks = np.asarray(toks, np.int32)
  hit = m.lookup(toks, extra)
  h = m._hasher(toks, extra)
  u = len(toks) // m.specs.hash_tokens
  key, par = h.arrays(u)
  tok = toks[:u * 32].reshape(u, 32)
  refs = [RefPool.from_state(m.pools[n]) for n in m.groups]
  want, ids = ref_hybrid_hit(m._searches, refs, key, par, tok, len(toks) - 1, ALIGN, 32)
  assert hit.num_tokens == want, (hit.num_tokens, want)
  for name, rid in zip(m.groups, ids):
    got = hit.block_ids[name]
    np.testing.assert_array_equal(got, rid[:len(got)])
    bt = m.specs.group(name).block_tokens
    stored = np.asarray(m.pools[name].tokens_NxT)
    for j, b in enumerate(got):
      if b >= 0:
        np.testing.assert_array_equal(stored[b], toks[j * bt:(j + 1) * bt])
  return hit


def check_cover(hit, n, prev=None):
  """The hit covers [0, n) in every group: full blocks for all of it, the swa tail for the window before n;
  if `prev` (the previous turn's block tables at free) is given, they are exactly that turn's blocks."""
  assert hit.num_tokens == n
  full, swa = hit.block_ids["full"], hit.block_ids["swa"]
  assert len(full) == n // FULL_BT and np.all(full >= 0)
  assert len(swa) == n // SWA_BT
  assert np.all(swa[:-NEED] == -1) and np.all(swa[-NEED:] >= 0)
  if prev is not None:
    np.testing.assert_array_equal(full, prev.full[:n // FULL_BT])
    np.testing.assert_array_equal(swa[-NEED:], prev.swa[n // SWA_BT - NEED:n // SWA_BT])


def free_queue_split(m, group):
  """(free queue head..tail, cached flags): for the churn invariant."""
  q = pool.free_queue(m.pools[group])
  cached = np.asarray(m.pools[group].cached_N)
  return q, [bool(cached[b]) for b in q]


def serve(m, rid, toks, prompt_len, n_out, chunk, extra=ExtraKeys(), on_step=None):
  """Chunked prefill, token-by-token decode, free. Returns (admission hit, block tables just before free)."""
  hit = m.add_request(rid, toks[:prompt_len], extra)
  n = hit.num_tokens
  while n < prompt_len:
    c = min(chunk, prompt_len - n)
    assert m.allocate_for(rid, c)
    if on_step:
      on_step(rid)
    n += c
    m.commit(rid, n)
    if on_step:
      on_step(rid)
  for i in range(n_out):
    m.append_tokens(rid, [int(toks[prompt_len + i])])
    if i < n_out - 1:          # the last sampled token is never fed back: its KV is never computed
      assert m.allocate_for(rid, 1)
      n += 1
      m.commit(rid, n)
  tables = m.block_tables(rid)
  m.free(rid)
  return hit, tables


# ------------------------------------------------------------------------------------------------------------
# 1. Session switch (seed report): A1 -> A2 -> B -> A3.

SYS = 256                                   # common chat-template/system prompt of A and B
A1_PROMPT, A1_ANS = 1950, 150               # computed 2099: answer crosses 2048 (prompt boundary 1920)
A2_NEW, A2_ANS = 200, 200                   # A2 prompt 2300, computed 2499: crosses 2432 (prompt boundary 2176)
A3_NEW = 150
B_PROMPT, B_CHUNK = 6000, 512


@pytest.mark.parametrize("legacy", [False, True])
def test_session_switch_a1_a2_b_a3(legacy):
  rng = np.random.default_rng(11)
  sys = rng.integers(2, 1000, SYS)
  a = np.concatenate([sys, rng.integers(2, 1000, 4000)])            # A's conversation, turn by turn
  b = np.concatenate([sys, rng.integers(2, 1000, B_PROMPT - SYS + 2)])
  m = KVCacheManager(group_specs(CFG), num_full_blocks=NF, num_swa_blocks=NS, legacy_dense_swa=legacy)
  _geometry(m)

  # A1: cold.
  hit, t1 = serve(m, "a1", a, A1_PROMPT, A1_ANS, 512)
  assert hit.num_tokens == 0
  a1_computed = A1_PROMPT + A1_ANS - 1

  # A2 = A1 + answer + new turn: resumes at the end of A1's computed tokens, not at A1's prompt boundary.
  a2_prompt = A1_PROMPT + A1_ANS + A2_NEW
  want2 = floor_align(min(a1_computed, a2_prompt - 1))
  assert want2 == 2048 and want2 > floor_align(A1_PROMPT - 1) == 1920
  check_cover(check_reference(m, a[:a2_prompt]), want2, t1)
  hit, t2 = serve(m, "a2", a, a2_prompt, A2_ANS, 512)
  check_cover(hit, want2, t1)
  a2_computed = a2_prompt + A2_ANS - 1

  a3_prompt = a2_prompt + A2_ANS + A3_NEW
  want3 = floor_align(min(a2_computed, a3_prompt - 1))
  assert want3 == 2432 and want3 > floor_align(a2_prompt - 1) == 2176
  check_cover(m.lookup(a[:a3_prompt]), want3, t2)

  # B: shares the system prompt; allocates more swa blocks than the pool holds, never holds half of it.
  ckpt = [int(x) for x in t2.swa[want3 // SWA_BT - NEED:want3 // SWA_BT]]   # A2's end-of-request checkpoint
  q0, c0 = free_queue_split(m, "swa")
  # cached free blocks evicted before x, less those B's own hit will claim (its system-prompt checkpoint)
  b_hit = {int(y) for y in m.lookup(b[:B_PROMPT]).block_ids["swa"] if y >= 0}
  rank0 = {x: sum(c0[:q0.index(x)]) - len(b_hit & set(q0[:q0.index(x)])) for x in ckpt}
  peak = [0]

  def on_step(rid):
    held = int((m.block_tables(rid).swa >= 0).sum())
    peak[0] = max(peak[0], held)
    if legacy:
      return
    q, c = free_queue_split(m, "swa")
    assert c == sorted(c), "an uncached free block sits behind a cached one"   # [uncached | cached]
    for x in ckpt:           # A's checkpoint is still cached, and no closer to eviction among cached blocks
      assert x in q and c[q.index(x)]
      assert sum(c[:q.index(x)]) >= rank0[x]

  hit_b, tb = serve(m, "b", b, B_PROMPT, 2, B_CHUNK, on_step=on_step)
  # Only the system prompt is shared: A1's dense-start checkpoints (128, 256, ...) give B all 256 tokens (cache
  # v1 gave 0 here); legacy dense hashing has every swa block, so it resumes B there too.
  assert hit_b.num_tokens == SYS
  assert len(tb.swa) > NS, "B must allocate more swa blocks over its life than the pool has"
  assert peak[0] < NS // 2
  assert m.num_free_blocks("swa") == NS and m.num_free_blocks("full") == NF

  # A3 = A2 + answer + new turn, after the switch.
  hit3 = check_reference(m, a[:a3_prompt])
  if legacy:
    assert hit3.num_tokens == 0          # vLLM <= 0.22: B's hashed, appended swa blocks flushed A's tails
    return
  check_cover(hit3, want3, t2)
  assert m.is_cached("full", a, ExtraKeys(), 0)
  hit, _ = serve(m, "a3", a, a3_prompt, 3, 512)   # the hit is claimable and the turn completes
  check_cover(hit, want3, t2)
  assert m.num_free_blocks("swa") == NS and m.num_free_blocks("full") == NF


# ------------------------------------------------------------------------------------------------------------
# 2. Churn on the pool directly.

def _pad(ids, m=16):
  return jnp.asarray(list(ids) + [-1] * (m - len(ids)), jnp.int32)


def test_churn_never_pushes_cached_blocks_toward_eviction():
  rng = np.random.default_rng(5)
  st = pool.init_pool(NS, SWA_BT)
  ref = RefPool(NS, SWA_BT)
  # A request holds 16 blocks, 4 of them become cached (a checkpoint), then it finishes (tail first).
  st, ids, _, ok = pool.allocate(st, 16, max_n=16)
  ids = [int(x) for x in np.asarray(ids)]
  ref.allocate(16)
  cached = ids[8:12]
  key = rng.integers(-2**31, 2**31 - 1, (16, 2)).astype(np.int32)
  par = rng.integers(-2**31, 2**31 - 1, (16, 4)).astype(np.int32)
  tok = rng.integers(0, 1000, (16, SWA_BT)).astype(np.int32)
  reg = [-1] * 8 + cached + [-1] * 4
  st, status = pool.register(st, jnp.asarray(reg, jnp.int32), jnp.asarray(key), jnp.asarray(par), jnp.asarray(tok))
  assert list(np.asarray(status)[8:12]) == [pool.STORED] * 4
  ref.register(reg, key, par, tok)
  st, ok = pool.free(st, _pad(ids[::-1]))
  ref.free(ids[::-1])
  q0 = pool.free_queue(st)
  pos0 = {c: q0.index(c) for c in cached}
  assert sorted(pos0.values()) == list(range(NS - 4, NS))     # cached blocks are the last 4 to go

  # Another request churns: allocates and releases uncached blocks, holding at most 48 at a time.
  held, total = [], 0
  for _ in range(60):
    k = int(rng.integers(1, 17))
    if len(held) + k <= 48:
      st, new, ev, ok = pool.allocate(st, k, max_n=16)
      new = [int(x) for x in np.asarray(new)[:k]]
      assert bool(ok) and not np.asarray(ev).any()          # never evicts while uncached blocks remain
      assert ref.allocate(k, 16)[0] == new
      held += new
      total += k
    r = int(rng.integers(0, len(held) + 1))
    rel = [held.pop(int(rng.integers(0, len(held)))) for _ in range(min(r, 16))]
    st, ok = pool.free(st, _pad(rel))
    ref.free(rel)
    q = pool.free_queue(st)
    for c in cached:   # only the blocks held right now can stand between c and the head
      assert q.index(c) >= pos0[c] - len(held)
    assert bool(np.asarray(st.cached_N)[cached].all())
  for lo in range(0, len(held), 16):
    st, ok = pool.free(st, _pad(held[lo:lo + 16]))
    ref.free(held[lo:lo + 16])
  assert total > 2 * NS
  q = pool.free_queue(st)
  assert {c: q.index(c) for c in cached} == pos0               # churn left the eviction order untouched
  ref.assert_matches(st)

  # Allocations that consume only uncached blocks leave every cached block findable ...
  look = lambda: [int(x) for x in np.asarray(pool.lookup(st, jnp.asarray(key[8:12]), jnp.asarray(par[8:12]),
                                                                jnp.asarray(tok[8:12])))]
  assert look() == cached
  taken, left = [], NS - 4
  while left:
    k = min(16, left)
    st, new, ev, ok = pool.allocate(st, k, max_n=16)
    assert not np.asarray(ev).any()
    taken += [int(x) for x in np.asarray(new)[:k]]
    left -= k
  assert not set(taken) & set(cached) and look() == cached
  # ... and the next allocation evicts the least recently freed cached block, and only it.
  st, new, ev, ok = pool.allocate(st, 1, max_n=16)
  first = min(cached, key=pos0.get)
  assert int(np.asarray(new)[0]) == first and bool(np.asarray(ev)[0])
  assert look() == [-1 if c == first else c for c in cached]


# ------------------------------------------------------------------------------------------------------------
# 3. Hybrid cases: which group limits the resume point.

def _base(retention, seed=21):
  """A: 1000-token prompt + 4 outputs (computed 1003) then freed. Full blocks 0..6 cached (896); swa
  checkpoints: retention 0 -> {896}; 256 -> {256, 512, 768, 896}."""
  rng = np.random.default_rng(seed)
  a = rng.integers(2, 1000, 1200)
  m = KVCacheManager(group_specs(CFG), num_full_blocks=NF, num_swa_blocks=NS, retention_interval=retention, **V1)
  serve(m, "a", a, 1000, 4, 512)
  query = a[:1104]                                   # prompt + answer + 100 new tokens: cap 1103 -> 1024
  assert check_reference(m, query).num_tokens == 896
  return m, a, query


def _evict(m, group, ids):
  ev = m.update_pool(group, pool.evict, _pad(ids))
  assert np.asarray(ev)[:len(ids)].all()


# (retention, group, block index to evict, hand-computed resume point)
HYBRID = [
    # full group reaches 896, the swa tail before 896 is gone: fall back to the previous swa checkpoint
    (256, "swa", 27, 768),
    (0, "swa", 24, 0),          # ... there is none under retention 0
    # reverse: swa tail at 896 present, a full block missing: the full run ends before it
    (256, "full", 5, 512),      # full run 640, no swa tail at 640 -> 512
    (256, "full", 6, 768),      # full run 768, swa checkpoint at 768
    (0, "full", 6, 0),          # full run 768, swa only at 896 -> 0
    (256, "full", 0, 0),
]


@pytest.mark.parametrize("retention,group,block,want", HYBRID)
def test_hybrid_limiting_group(retention, group, block, want):
  m, a, query = _base(retention)
  ids = m.lookup(query).block_ids[group]
  _evict(m, group, [int(ids[block])])
  hit = check_reference(m, query)
  assert hit.num_tokens == want
  if want:
    check_cover(hit, want)


@pytest.mark.parametrize("retention,want_running,want_done", [(0, 896, 1280), (256, 1280, 1280)])
def test_hybrid_full_ahead_of_swa_while_running(retention, want_running, want_done):
  """A sibling looks up a running request's tokens: its full blocks are registered up to 1280 on commit, but
  under retention 0 its only swa checkpoint so far is the prompt boundary (896); at free, the end checkpoint."""
  rng = np.random.default_rng(22)
  a = rng.integers(2, 1000, 1400)
  m = KVCacheManager(group_specs(CFG), num_full_blocks=NF, num_swa_blocks=NS, retention_interval=retention, **V1)
  m.add_request("r", a[:1000])
  assert m.allocate_for("r", 1000)
  m.commit("r", 1000)
  m.append_tokens("r", a[1000:1300])
  assert m.allocate_for("r", 300)
  m.commit("r", 1300)
  q = a[:1350]
  assert len(m.lookup(q).block_ids["full"]) == want_running // FULL_BT
  assert all(m.is_cached("full", q, ExtraKeys(), j) for j in range(10))   # the full group alone supports 1280
  hit = check_reference(m, q)
  assert hit.num_tokens == want_running
  check_cover(hit, want_running)
  m.free("r")
  hit = check_reference(m, q)
  assert hit.num_tokens == want_done
  check_cover(hit, want_done)


# ------------------------------------------------------------------------------------------------------------
# 4. Isolation (also: test_manager.test_tenants_and_extra_keys_isolate, test_prefix.test_collision_never_aliases).

@pytest.mark.parametrize("key_bits", [64, 0])
def test_identical_tokens_two_tenants_never_share(key_bits):
  """key_bits=0: every block of every tenant has device key 0 (one probe chain); still no wrong hit."""
  a = np.random.default_rng(23).integers(2, 1000, 701)
  m = KVCacheManager(group_specs(CFG), num_full_blocks=NF, num_swa_blocks=NS, key_bits=key_bits, **V1)
  tenants = [ExtraKeys(tenant="x"), ExtraKeys(tenant="y"), ExtraKeys()]
  tables = {}
  for e in tenants:
    hit, tables[e] = serve(m, e.tenant or "-", a, 700, 1, 512, e)
    assert hit.num_tokens == 0                        # the same tokens cached under another salt never hit
  owned = {}
  for e in tenants:
    hit = check_reference(m, a[:700], e)
    check_cover(hit, 640, tables[e])                  # each tenant gets exactly its own blocks back
    owned[e] = {(g, int(b)) for g in m.groups for b in hit.block_ids[g] if b >= 0}
  assert not owned[tenants[0]] & owned[tenants[1]] and not owned[tenants[0]] & owned[tenants[2]]
  assert not owned[tenants[1]] & owned[tenants[2]]
  assert check_reference(m, a[:700], ExtraKeys(tenant="z")).num_tokens == 0
  assert check_reference(m, a[:700], ExtraKeys(tenant="x", adapter="l")).num_tokens == 0
