"""Data-shard placement of admissions on a mesh with the pools split over `data`: each shard has its own cache
manager (shard-local block ids), so a request runs on one shard, chosen when it is admitted."""

from __future__ import annotations

from cache.manager import KVCacheManager
from dsv4.engine.request import Request


def place_batch(reqs: list[Request], managers: list[KVCacheManager], running_rows: list[int], rows_per_shard: int,
                enable_prefix_caching: bool) -> list[int | None]:
  """Data shards for a step's admissions, in order: longest prefix hit (one batched lookup per shard for all of
  them), then most free blocks, then fewest running rows, among shards with a free row (None: no shard has one).
  running_rows: rows running per shard now (the admissions placed here count too)."""
  if len(managers) == 1:
    return [0] * len(reqs)
  salts = [r.cache_salt(enable_prefix_caching) for r in reqs]
  hits = [[h.num_tokens for h in m.lookup_batch([(r.tokens, x) for r, x in zip(reqs, salts)])] for m in managers]
  rows = list(running_rows)
  out = []
  for i in range(len(reqs)):
    best, key = None, None
    for s, m in enumerate(managers):
      if rows[s] >= rows_per_shard:
        continue
      k = (hits[s][i], sum(m.free_blocks_estimate(g) for g in m.groups), -rows[s], -s)
      if key is None or k > key:
        best, key = s, k
    if best is not None:
      rows[best] += 1
    out.append(best)
  return out
