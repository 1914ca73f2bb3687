"""Per-engine-step bookkeeping of the KV cache manager: lookup + claim + allocate + register + free.

One step = admit B warm requests of L tokens (their prompt minus the last 128 tokens was served before, so each
hits L - 128 and claims its blocks, then allocates blocks up to L) and retire the B requests admitted in the
previous step (commit L tokens: register full blocks + checkpoints, release; free). With cache v2 the whole step
is ONE jitted `apply_step` call (`add_requests(..., allocate_tokens=...)` applies the previous step's queued
registrations and frees too) plus host work (table bookkeeping, packing). Hashing is reported separately
(blake2b of the prompts; an engine hashes incrementally as tokens arrive).

Matrix: B x L in {256 x 2k, 64 x 8k, 8 x 32k}, pools of {4k, 65k, 262k} blocks per group (V4-Flash geometry:
128-token full blocks, 32-token swa blocks, 4-block tail). vLLM 0.33's KVCacheManager is timed when
`import vllm.v1.core.kv_cache_manager` works (not a project dependency); otherwise the reason is printed.

    python -m benchmarks.cache_bench            # full matrix
    python -m benchmarks.cache_bench --small    # 4k and 65k pools, B x L = 8 x 2k and 8 x 32k
"""

from __future__ import annotations

import argparse
import copy
import time

import numpy as np

from cache.hashing import ExtraKeys
from cache.manager import KVCacheManager
from dsv4.caches import group_specs
from dsv4.config import v4_flash


def _vllm_status() -> str:
  try:
    import vllm.v1.core.kv_cache_manager  # noqa: F401
    return "importable (driver not implemented in this version: see BUILD_NOTES)"
  except Exception as e:  # any import failure: report it, never fail the benchmark
    return f"not importable ({type(e).__name__}: {e})"


def bench(B: int, L: int, pool: int, steps: int, seed: int = 0):
  specs = group_specs(v4_flash())
  m = KVCacheManager(specs, num_blocks={"full": pool, "swa": pool}, enable_events=False)
  rng = np.random.default_rng(seed)
  # each step's batch: B prompts of L tokens; warm = served before without the last 128 tokens
  prompts = [[rng.integers(2, 1000, L).astype(np.int32) for _ in range(B)] for _ in range(steps + 2)]
  t0 = time.perf_counter()
  hashers = {}
  for s, batch in enumerate(prompts):
    for i, p in enumerate(batch):
      hashers[(s, i)] = m._hasher(p, ExtraKeys())
  hash_ms = (time.perf_counter() - t0) / len(prompts) * 1e3
  orig = m._hasher
  lookup_of = {}
  for s, batch in enumerate(prompts):
    for i, p in enumerate(batch):
      lookup_of[p.ctypes.data] = hashers[(s, i)]

  def cached_hasher(tokens, extra):
    h = lookup_of.get(tokens.ctypes.data)
    if h is None or len(tokens) != L:
      return orig(tokens, extra)
    c = copy.copy(h)
    c.digests = list(h.digests)
    return c

  # warm-up pass: serve each batch's prompts minus the last 128 tokens (fills the cache), batch by batch
  for s, batch in enumerate(prompts):
    warm = [p[:L - 128] for p in batch]
    m.add_requests([(f"w{s}.{i}", w, ExtraKeys()) for i, w in enumerate(warm)])
    for i, w in enumerate(warm):      # chunked prefill: sliding blocks are released as the window moves on
      n = 0
      while n < len(w):
        c = min(2048, len(w) - n)
        assert m.allocate_for(f"w{s}.{i}", c)
        n += c
        m.commit(f"w{s}.{i}", n)
      m.free(f"w{s}.{i}")
  m.flush()
  m._hasher = cached_hasher
  times, hits = [], []
  prev = []
  for s, batch in enumerate(prompts):
    t = time.perf_counter()
    hs = m.add_requests([(f"r{s}.{i}", p, ExtraKeys()) for i, p in enumerate(batch)],
                        allocate_tokens=[L] * B)
    for rid in prev:
      m.commit(rid, L)
      m.free(rid)
    m.flush()   # this step's retirements: applied here so the timing covers them (an engine defers them)
    times.append(time.perf_counter() - t)
    hits.append(sum(h.num_tokens for h in hs))
    prev = [f"r{s}.{i}" for i in range(B)]
  return {"ms": float(np.median(times[2:]) * 1e3), "hit": hits[-1] // B, "hash_ms": hash_ms,
          "calls_per_step": 2}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--small", action="store_true")
  ap.add_argument("--steps", type=int, default=5)
  a = ap.parse_args()
  shapes = [(8, 2048), (8, 32768)] if a.small else [(256, 2048), (64, 8192), (8, 32768)]
  pools = [4096, 65536] if a.small else [4096, 65536, 262144]
  print(f"vLLM 0.33 KVCacheManager: {_vllm_status()}")
  print("| B | L | pool blocks | ours ms/step | hit/request | hashing ms/step (separate) |")
  print("| --- | --- | --- | --- | --- | --- |")
  res = {}
  for B, L in shapes:
    for pool in pools:
      if B * L // 128 + B > pool:
        print(f"| {B} | {L} | {pool} | (pool too small for the batch) | | |")
        continue
      r = bench(B, L, pool, a.steps)
      res[(B, L, pool)] = r["ms"]
      print(f"| {B} | {L} | {pool} | {r['ms']:.1f} | {r['hit']} | {r['hash_ms']:.1f} |", flush=True)
  for B, L in shapes:
    row = [res[(B, L, p)] for p in pools if (B, L, p) in res]
    if len(row) > 1:
      print(f"flatness {B}x{L}: largest / smallest pool = {row[-1] / row[0]:.2f}x")


if __name__ == "__main__":
  main()
