"""Ops/s of the jitted block pool and prefix search vs the plain-Python reference (CPU unless a GPU is present).

Usage: python -m benchmarks.cache_bench [--blocks 4096] [--width 16] [--small] [--no-ops] [--budget 1.5]
Part 1 (skip with --no-ops): each op moves `width` blocks (allocate n, free n, register n, lookup n); the prefix
search is one batched call for `batch` requests of 2048 tokens (V4-Flash groups).
Part 2, per engine step: for a batch of B requests whose L-token prompts are cached (warm), the pool work one step
does to admit and retire them, exactly the calls KVCacheManager makes: lookup (one batched jitted search, host
packing included, hashing excluded) + allocate (claim the hit blocks with `touch`, allocate the 128 tokens past the
hit: 1 full + 4 swa blocks) + free (release every block, tail first). Jitted vs the Python reference (RefPool /
ref_hybrid_hit) in the same run, and the bytes of the PoolState arrays per group, pools sized to hold the batch
(full: B*L/128 + B blocks, swa: max(128, 16*B) blocks). Sweep: B in {1, 8, 64, 256} x L in {2k, 32k, 128k};
--small: B in {1, 8} x L in {2k, 8k}.
Caps (to keep the sweep to a few minutes on 2 CPU cores): each measured part runs its requests in order until
all B are done or `--budget` seconds have passed, and reports elapsed / done * B (marked `*` when extrapolated
from fewer than B requests); the jitted lookup is one call, timed once after a warm-up call. Numbers include
dispatch, not compilation. Warm caches are built directly in the reference pool and converted (no jitted
register of 262k blocks).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv4.config import v4_flash
from cache import pool as P
from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from cache.reference import RefPool, ref_hybrid_hit


def rate(fn, seconds=1.0):
  fn()
  n, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    fn()
    n += 1
  return n / (time.perf_counter() - t0)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--blocks", type=int, default=4096)
  ap.add_argument("--width", type=int, default=16)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--small", action="store_true", help="quick sweep: B in {1, 8}, L in {2k, 8k}")
  ap.add_argument("--no-ops", action="store_true", help="skip part 1 (single-op rates)")
  ap.add_argument("--budget", type=float, default=1.5, help="seconds per measured part before extrapolating")
  a = ap.parse_args()
  print(f"device={jax.devices()[0].platform}")
  if not a.no_ops:
    op_rates(a)
  step_sweep([1, 8] if a.small else [1, 8, 64, 256], [2048, 8192] if a.small else [2048, 32768, 131072],
             a.budget)


def op_rates(a):
  n, w, bt = a.blocks, a.width, 32
  rng = np.random.default_rng(0)
  print(f"blocks={n} width={w}")

  # allocate w + free w (cycle keeps the pool steady); register w + lookup w.
  state = {"s": P.init_pool(n, bt)}
  key = jnp.asarray(rng.integers(-2**31, 2**31 - 1, (w, 2)), jnp.int32)
  par = jnp.asarray(rng.integers(0, 9, (w, 4)), jnp.int32)
  tok = jnp.asarray(rng.integers(0, 9, (w, bt)), jnp.int32)

  def jit_alloc_free():
    s, ids, _, ok = P.allocate(state["s"], w, max_n=w)
    s, ok = P.free(s, ids[::-1])
    state["s"] = s
    ok.block_until_ready()

  def jit_register_cycle():
    s, ids, _, ok = P.allocate(state["s"], w, max_n=w)
    s, stat = P.register(s, ids, key, par, tok)
    s, ok = P.free(s, ids[::-1])
    state["s"] = s
    ok.block_until_ready()

  def jit_lookup():
    P.lookup(state["s"], key, par, tok).block_until_ready()

  ref = RefPool(n, bt)
  keyn, parn, tokn = np.asarray(key), np.asarray(par), np.asarray(tok)

  def ref_alloc_free():
    ids, _, _ = ref.allocate(w)
    ref.free(ids[::-1])

  def ref_register_cycle():
    ids, _, _ = ref.allocate(w)
    ref.register(ids, keyn, parn, tokn)
    ref.free(ids[::-1])

  def ref_lookup():
    ref.lookup(keyn, parn, tokn)

  rows = [("allocate+free", jit_alloc_free, ref_alloc_free),
          ("allocate+register+free", jit_register_cycle, ref_register_cycle),
          ("lookup", jit_lookup, ref_lookup)]
  for name, j, r in rows:
    rj, rr = rate(j), rate(r)
    print(f"{name:26s} jit {rj:9.0f} ops/s ({rj * w:10.0f} blocks/s)   ref {rr:9.0f} ops/s ({rr * w:10.0f} blocks/s)")

  # Hybrid prefix search: batch of 2048-token requests against a warm cache.
  m = KVCacheManager(v4_flash(), num_full_blocks=n // 4, num_swa_blocks=n)
  prompts = [rng.integers(2, 1000, 2048) for _ in range(a.batch)]
  for i, p in enumerate(prompts):
    m.add_request(f"r{i}", p)
    m.allocate_for(f"r{i}", len(p))
    m.commit(f"r{i}", len(p))
    m.free(f"r{i}")
  qs = [(p, ExtraKeys()) for p in prompts]
  hits = m.lookup_batch(qs)
  assert all(h.num_tokens == 1920 for h in hits), [h.num_tokens for h in hits]
  # device part only (hashing excluded): prebuilt arrays
  hashers = [m._hasher(np.asarray(p, np.int32), ExtraKeys()) for p in prompts]
  rj = rate(lambda: m._search([np.asarray(p, np.int32) for p in prompts], hashers))
  refs = [RefPool.from_state(m.pools[g]) for g in m.groups]
  arrs = [(h.arrays(64), np.asarray(p, np.int32).reshape(64, 32)) for h, p in zip(hashers, prompts)]

  def ref_search():
    for (k, pr), t in arrs:
      ref_hybrid_hit(m._searches, refs, k, pr, t, 2047, 128, 32)

  rr = rate(ref_search)
  hh = rate(lambda: [m._hasher(np.asarray(p, np.int32), ExtraKeys()) for p in prompts])
  print(f"{'prefix search (B=%d x 2k)' % a.batch:26s} jit {rj:9.1f} calls/s ({rj * a.batch:8.0f} req/s)   "
        f"ref {rr:9.1f} calls/s ({rr * a.batch:8.0f} req/s)   host hashing {hh * a.batch:8.0f} req/s")


# ------------------------------------------------------------------------------------------------------------
# Part 2: per engine step.

def pool_bytes(st: P.PoolState) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(st))


def to_state(r: RefPool) -> P.PoolState:
  """The jitted PoolState holding exactly a reference pool's state (inverse of RefPool.from_state)."""
  n = r.n
  nxt = np.arange(n + 1, dtype=np.int32)
  prv = np.arange(n + 1, dtype=np.int32)
  chain = [n] + r.queue + [n]
  nxt[np.asarray(chain[:-1])] = chain[1:]
  prv[np.asarray(chain[1:])] = chain[:-1]
  return P.PoolState(
      ref_N=jnp.asarray(r.ref, jnp.int32), next_P=jnp.asarray(nxt), prev_P=jnp.asarray(prv),
      num_free=jnp.asarray(len(r.queue), jnp.int32), cached_N=jnp.asarray(r.cached),
      key_Nx2=jnp.asarray(np.asarray(r.key, np.int64).astype(np.int32)),
      parent_Nx4=jnp.asarray(np.asarray(r.parent, np.int64).astype(np.int32)),
      tokens_NxT=jnp.asarray(np.asarray(r.tokens, np.int32)), slot_N=jnp.asarray(r.slot, jnp.int32),
      table_S=jnp.asarray(r.table, jnp.int32), max_probe=r.max_probe)


def warm(refs, m, prompts, hashers):
  """Cache every prompt the way a finished request leaves it (full blocks [0, hit) and the swa tail before hit),
  directly in the reference pools; return per request the hit block ids per group."""
  hit_ids = []
  nxt = {g: 0 for g in m.groups}
  tail = {g: [] for g in m.groups}
  for p, h in zip(prompts, hashers):
    hit = (len(p) - 1) // 128 * 128
    per = {}
    for g in m.groups:
      r, spec = refs[g], m.specs.group(g)
      bt, upb = spec.block_tokens, spec.block_tokens // 32
      lo = 0 if g == "full" else hit // bt - spec.need_blocks
      js = list(range(lo, hit // bt))
      ids = list(range(nxt[g], nxt[g] + len(js)))
      nxt[g] += len(js)
      key, par = h.arrays(len(p) // 32)
      for b in ids:
        r.ref[b] = 1
      st = r.register(ids, [key[(j + 1) * upb - 1] for j in js], [par[j * upb] for j in js],
                      [p[j * bt:(j + 1) * bt] for j in js])
      assert all(s == P.STORED for s in st), st
      for b in ids:
        r.ref[b] = 0
      tail[g] += ids[::-1]
      per[g] = ids
    hit_ids.append(per)
  for g in m.groups:   # free queue: never-used blocks at the head, cached ones at the tail (tail-first per request)
    refs[g].queue = list(range(nxt[g], refs[g].n)) + tail[g]
  return hit_ids


def timed(fn, items, budget):
  """Run fn over items until done or over budget; (seconds for all items, extrapolated?)."""
  t0, k = time.perf_counter(), 0
  for it in items:
    fn(it)
    k += 1
    if time.perf_counter() - t0 > budget:
      break
  return (time.perf_counter() - t0) / k * len(items), k < len(items)


def _chunks(ids, width=256):
  for lo in range(0, len(ids), width):
    part = ids[lo:lo + width]
    m = 16 if len(part) <= 16 else width
    yield part, jnp.asarray(part + [-1] * (m - len(part)), jnp.int32)


def step_sweep(batches, lengths, budget):
  cfg = v4_flash()
  print("\nPer engine step (admit + retire B warm requests of L tokens; V4-Flash groups; ms per step)")
  print(f"{'B':>4} {'L':>7} | {'jit lookup':>11} {'jit alloc':>10} {'jit free':>10} {'jit total':>10} | "
        f"{'ref lookup':>11} {'ref alloc':>10} {'ref free':>10} {'ref total':>10} | "
        f"{'full pool':>9} {'MB':>8} | {'swa pool':>8} {'MB':>6}")
  rows = []
  for L in lengths:
    for B in batches:
      rng = np.random.default_rng(B * 7 + L)
      nf, ns = B * L // 128 + B, max(128, 16 * B)
      m = KVCacheManager(cfg, num_full_blocks=nf, num_swa_blocks=ns)
      prompts = [rng.integers(2, 1000, L).astype(np.int32) for _ in range(B)]
      hashers = [m._hasher(p, ExtraKeys()) for p in prompts]
      refs = {"full": RefPool(nf, 128), "swa": RefPool(ns, 32)}
      hit_ids = warm(refs, m, prompts, hashers)
      for g in m.groups:
        m.pools[g] = to_state(refs[g])
      mem = {g: pool_bytes(m.pools[g]) for g in m.groups}
      want = (L - 1) // 128 * 128

      # lookup
      hits = m._search(prompts, hashers)          # warm-up (compiles)
      assert all(h.num_tokens == want for h in hits), [h.num_tokens for h in hits[:4]]
      t0 = time.perf_counter()
      m._search(prompts, hashers)
      j_look = time.perf_counter() - t0
      arrs = [(h.arrays(L // 32), p.reshape(-1, 32)) for h, p in zip(hashers, prompts)]
      rlist = [refs["full"], refs["swa"]]

      def ref_look(i):
        (k, pr), t = arrs[i]
        assert ref_hybrid_hit(m._searches, rlist, k, pr, t, L - 1, 128, 32)[0] == want

      r_look, r_look_x = timed(ref_look, range(B), budget)

      # allocate (claim + new blocks) and free, per request, as the manager calls the pool
      new_n = {"full": 1, "swa": 4}
      held = {}

      def j_alloc(i):
        held[i] = {}
        for g in m.groups:
          ids = hit_ids[i][g]
          for _, arr in _chunks(ids):
            m.pools[g], ok = P.touch(m.pools[g], arr)
          m.pools[g], new, _, ok = P.allocate(m.pools[g], new_n[g], max_n=16)
          held[i][g] = ids + [int(x) for x in np.asarray(new)[:new_n[g]]]

      def j_free(i):
        for g in m.groups:
          for _, arr in _chunks(held[i][g][::-1]):
            m.pools[g], ok = P.free(m.pools[g], arr)
        ok.block_until_ready()

      def r_alloc(i):
        held[i] = {}
        for g in m.groups:
          ids = hit_ids[i][g]
          for part, _ in _chunks(ids):
            refs[g].touch(part)
          new, _, _ = refs[g].allocate(new_n[g])
          held[i][g] = ids + new

      def r_free(i):
        for g in m.groups:
          for part, _ in _chunks(held[i][g][::-1]):
            refs[g].free(part)

      j_alloc(0)   # warm-up (compiles)
      j_free(0)
      items = range(B)
      j_a, j_ax = timed(lambda i: (j_alloc(i), m.pools["full"].num_free.block_until_ready()), items, budget)
      done = [i for i in items if i in held]
      j_f, j_fx = timed(j_free, done, budget)
      j_f, j_fx = j_f / len(done) * B, j_fx or len(done) < B
      held.clear()
      r_a, r_ax = timed(r_alloc, items, budget)
      done = [i for i in items if i in held]
      r_f, r_fx = timed(r_free, done, budget)
      r_f, r_fx = r_f / len(done) * B, r_fx or len(done) < B

      def f(x, ext):
        return f"{x * 1e3:10.1f}{'*' if ext else ' '}"

      row = (B, L, j_look, j_a, j_f, r_look, r_a, r_f, nf, mem["full"], ns, mem["swa"])
      rows.append(row)
      print(f"{B:4d} {L:7d} | {j_look * 1e3:10.1f}  {f(j_a, j_ax)}{f(j_f, j_fx)}{(j_look + j_a + j_f) * 1e3:10.1f}  | "
            f"{f(r_look, r_look_x)} {f(r_a, r_ax)}{f(r_f, r_fx)}{(r_look + r_a + r_f) * 1e3:10.1f}  | "
            f"{nf:9d} {mem['full'] / 2**20:8.1f} | {ns:8d} {mem['swa'] / 2**20:6.2f}", flush=True)
  return rows


if __name__ == "__main__":
  main()
