"""KV precision x tiers, on one device and on a mesh. The checks live here so that tests/dsv4/test_tiers_precision.py
runs them in the pytest process (one device) and in a child with 8 host devices (a mesh; the host device count is
fixed when JAX starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.dsv4.tiers_precision_worker raw fp8 DIR
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.dsv4.tiers_precision_worker engine fp32 DIR

Exits non-zero on any mismatch; prints one line per check and OK at the end.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import jax
import numpy as np

from cache.hashing import ExtraKeys
from dsv4 import caches, mesh_context, model, sharding
from dsv4.config import ModelConfig, v4_tiny
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.tiering_config import TieringConfig

MESH = (2, 2, 2)
KV = {"fp32": caches.KV_DTYPES["fp32"], "bf16": caches.KV_DTYPES["bf16"], "fp8": caches.FP8}


def widen(cfg: ModelConfig, mesh: bool) -> ModelConfig:
  """FP8-capable widths (the FP8 record quantizes the non-RoPE channels in blocks of 64); on a mesh also enough
  heads / groups / experts to split (as tests/dsv4/sharding_worker.py)."""
  cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, head_dim=128, rope_head_dim=64),
                            indexer=dataclasses.replace(cfg.indexer, head_dim=64))
  if mesh:
    cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, num_heads=8, o_groups=8),
                              moe=dataclasses.replace(cfg.moe, n_routed_experts=16))
  return cfg


def config(mesh: bool) -> ModelConfig:
  """v4_tiny, `widen`ed."""
  return widen(v4_tiny(), mesh)


def _bytes(x: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(x).view(np.uint8)


# ------------------------------------------------------------------------------------------ raw round trip

def check_raw(kv: str, tmp: str, mesh=None) -> str:
  """Random raw bits in every pool array (every e4m3 / bf16 bit pattern, NaNs included), blocks spread over the data
  shards, demoted through the tier glue to a host and a disk tier, reloaded into a fresh pool at other blocks (other
  shards) from each tier: every record component equals the pool rows it came from, and the reloaded pool rows
  equal them, byte for byte. Returns a summary line."""
  cfg = config(mesh is not None)
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  layout = caches.CacheLayout(kv_dtype=KV[kv])
  disk = os.path.join(tmp, f"raw_{kv}")
  ec = EngineConfig(max_num_seqs=2, max_model_len=512, num_full_blocks=8, num_swa_blocks=16, layout=layout)

  def engine(tiers):
    tc = TieringConfig(tiers=tiers, disk_dir=disk, policy="load", model_digest="raw", write_queue=0)
    return Engine(params, cfg, dataclasses.replace(ec, tiering=tc), mesh=mesh)

  A = engine(("host", "disk"))
  t = A.tiering
  D = t.num_shards
  if mesh is not None and D != MESH[0]:
    sys.exit(f"FAIL raw {kv}: {D} data shards, want {MESH[0]}")
  rng = np.random.default_rng(0)

  def noise(x):
    b = rng.integers(0, 256, size=(*x.shape, x.dtype.itemsize), dtype=np.uint8)
    return jax.device_put(b.view(np.dtype(x.dtype)).reshape(x.shape), x.sharding)

  A.runner.cache = jax.tree_util.tree_map(noise, A.runner.cache)
  host_pool = jax.tree_util.tree_map(np.asarray, A.runner.cache)
  toks = [int(x) for x in rng.integers(2, cfg.vocab_size, 256)]
  h, fp = t._hasher(ExtraKeys(), toks), t._fingerprint(ExtraKeys())
  blocks = {caches.FULL: 2, caches.SWA: 8}
  ident = {g: [t._ident_of(h, fp, toks, g, j) for j in range(n)] for g, n in blocks.items()}
  src = {g: [(j % D, 1 + j // D) for j in range(n)] for g, n in blocks.items()}
  dst = {g: [((j + 1) % D, t.shard_blocks[g] - 1 - j // D) for j in range(n)] for g, n in blocks.items()}

  def pool_rows(pool, g, locs):
    """Host rows of (shard, local id) blocks per record component, from a host copy of the whole pool."""
    out = []
    for l, n, p in t.names[g]:
      x = pool.layers[l][n] if p < 0 else pool.layers[l][n][p]
      out.append(np.stack([x[s * t.shard_blocks[g] + b] for s, b in locs]))
    return out

  want = {g: pool_rows(host_pool, g, src[g]) for g in blocks}
  t._demote([(s, g, b, i) for g in blocks for (s, b), i in zip(src[g], ident[g])])
  t.store.drain()
  for e in t.manifest[caches.SWA] + t.manifest[caches.FULL]:
    if "V" in e.dtype:
      sys.exit(f"FAIL raw {kv}: manifest dtype {e.dtype!r} of {e.name} is raw bytes")

  def reload(eng, tier):
    tt = eng.tiering
    eng.runner.cache = jax.tree_util.tree_map(jax.numpy.zeros_like, eng.runner.cache)
    plan = [i for g in blocks for i in ident[g]]
    locs = dict(zip([i.key for i in plan], tt.store.locate([i.key for i in plan])))
    arrays, got_from = tt._fetch_verified(plan, locs, time.monotonic() + 30)
    names = [x.name for x in tt.store.tiers]
    if len(arrays) != len(plan) or {names[v] for v in got_from.values()} != {tier}:
      sys.exit(f"FAIL raw {kv} {tier}: got {len(arrays)} of {len(plan)} records from {got_from}")
    for g in blocks:
      for j, i in enumerate(ident[g]):
        for c, (a, w) in enumerate(zip(arrays[i.key], want[g])):
          if a.dtype != w.dtype or not np.array_equal(_bytes(a), _bytes(w[j])):
            sys.exit(f"FAIL raw {kv} {tier}: record {g} {j} component {tt.manifest[g][c].name} differs")
    tt._write({g: [(s, b, arrays[i.key]) for (s, b), i in zip(dst[g], ident[g])] for g in blocks})
    pool = jax.tree_util.tree_map(np.asarray, eng.runner.cache)
    for g in blocks:
      for c, (a, w) in enumerate(zip(pool_rows(pool, g, dst[g]), want[g])):
        if not np.array_equal(_bytes(a), _bytes(w)):
          sys.exit(f"FAIL raw {kv} {tier}: reloaded pool rows of {g} {tt.manifest[g][c].name} differ")
      # the other blocks stayed zero (no write went to another block or shard)
      others = [(s, b) for s in range(D) for b in range(tt.shard_blocks[g]) if (s, b) not in dst[g]]
      for a in pool_rows(pool, g, others):
        if _bytes(a).any():
          sys.exit(f"FAIL raw {kv} {tier}: a write reached a block outside the load")

  reload(A, "host")
  B = engine(("disk",))
  reload(B, "disk")
  comps = sorted({f"{e.name.split('/')[-1]}:{e.dtype}" for e in t.manifest[caches.SWA] + t.manifest[caches.FULL]})
  for eng in (A, B):
    eng.tiering.close()
  return f"raw {kv} shards={D}: {sum(blocks.values())} records host and disk bit for bit ({', '.join(comps)})"


# ------------------------------------------------------------------------------------------ engine reload

def check_engine(kv: str, tmp: str, mesh=None) -> str:
  """Turn 1 (150-token prompt, 4 answer tokens: end-of-request checkpoint at 128), then two other requests that
  need every full block of a (data shard's) small pool (3 full blocks), so turn 1's blocks are evicted and demoted;
  turn 2 = turn 1 + answer + 20 tokens resumes from the tiers (host, disk). Its greedy tokens equal a cold
  one-device engine's at the same precision, and its tier hit is > 0."""
  from dsv4.engine.api import generate
  from dsv4.engine.sampling import SamplingParams
  cfg = config(mesh is not None)
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  layout = caches.CacheLayout(kv_dtype=KV[kv])
  D = mesh_context.axis_size(mesh, "data") if mesh is not None else 1
  ec = EngineConfig(max_num_seqs=2, max_num_batched_tokens=128, chunk_size=64, max_model_len=512,
                    num_full_blocks=3 * D, num_swa_blocks=16 * D, layout=layout, record_logits=True)
  tc = TieringConfig(tiers=("host", "disk"), disk_dir=os.path.join(tmp, f"engine_{kv}_{D}"), policy="load")
  rng = np.random.default_rng(7)
  V = cfg.vocab_size
  p1 = [int(x) for x in rng.integers(2, V, 150)]
  others = [[int(x) for x in rng.integers(2, V, 330)] for _ in range(2)]
  sp1, sp2 = SamplingParams(max_tokens=4, ignore_eos=True), SamplingParams(max_tokens=6, ignore_eos=True)
  A = Engine(params, cfg, dataclasses.replace(ec, tiering=tc), mesh=mesh)
  (o1,) = generate(params, cfg, [p1], sp1, engine=A)
  generate(params, cfg, others, SamplingParams(max_tokens=2, ignore_eos=True), engine=A)
  p2 = p1 + o1.output + [int(x) for x in rng.integers(2, V, 20)]
  (o2,) = generate(params, cfg, [p2], sp2, engine=A)
  st = A.tiering.stats
  cold = Engine(params, cfg, dataclasses.replace(ec, num_full_blocks=3, num_swa_blocks=16))   # same step shapes
  (c2,) = generate(params, cfg, [p2], sp2, engine=cold)
  line = (f"engine {kv} shards={D}: turn 2 tokens {o2.output} (cold {c2.output}), tier hit {o2.tier_hit_tokens}, "
          f"device hit {o2.hit_tokens - o2.tier_hit_tokens}, demoted {st['demoted_blocks']}, loaded "
          f"{st['loaded_records']}, rejected {st['rejected_records']}")
  print(line, flush=True)
  if o2.output != c2.output or o2.error or c2.error:
    sys.exit(f"FAIL {line}")
  if not (o2.tier_hit_tokens > 0 and st["tier_hit_tokens"] > 0 and st["demoted_blocks"] > 0
          and st["rejected_records"] == 0):
    sys.exit(f"FAIL {line}: {A.tiering.summary()}")
  A.tiering.close()
  return line


if __name__ == "__main__":
  what, kvs, tmp = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
  if jax.device_count() < 8:
    sys.exit(f"needs 8 devices, got {jax.device_count()} (set XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  mesh = sharding.make_mesh(MESH)
  for kv in kvs:
    t0 = time.time()
    line = (check_raw if what == "raw" else check_engine)(kv, tmp, mesh)
    print(f"{line} ({time.time() - t0:.0f} s)", flush=True)
  print("OK")
