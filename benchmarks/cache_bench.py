"""Ops/s of the jitted block pool and prefix search vs the plain-Python reference (CPU unless a GPU is present).

Usage: python -m benchmarks.cache_bench [--blocks 4096] [--width 16]
Each op moves `width` blocks (allocate n, free n, register n, lookup n); the prefix search is one batched call for
`batch` requests of 2048 tokens (V4-Flash groups). Numbers include dispatch but not compilation.
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
  a = ap.parse_args()
  n, w, bt = a.blocks, a.width, 32
  rng = np.random.default_rng(0)
  print(f"device={jax.devices()[0].platform} blocks={n} width={w}")

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


if __name__ == "__main__":
  main()
