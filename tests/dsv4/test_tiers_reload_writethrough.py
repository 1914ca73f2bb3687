"""Write-through and tiers shared by running engines, V4 tiny, fp32.

With demote="store" a block's record is written when the block is registered, not when it is evicted: the first full
block is in the host tier while its request still decodes, and the end-of-request SWA checkpoint (here the only
resume point at 256: retention 0, a 230-token prompt and 30 answer tokens) is written at the finish, whether the
request ends by itself or by `stop_request`. Engine B, constructed on the same disk directory before engine A wrote
anything, then resumes turn 2 from A's records on disk; so do a fresh engine on that directory and one on Redis. Each
output reports the tier part of its hit apart from the device part. Start-up: a malformed store URL raises, an
unreachable one is reported by `Tiering.unavailable()` and counted in the tier's summary."""

import dataclasses
import sys

import jax
import numpy as np
import pytest

from cache.hashing import ExtraKeys
from cache.tiers.servers import RedisServer, free_port
from dsv4 import caches, config, model
from dsv4.engine.api import generate
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.request import Status
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.tiering_config import TieringConfig
from tests.store_servers import require_server

EC = EngineConfig(max_num_seqs=2, max_num_batched_tokens=128, chunk_size=64, max_model_len=640, num_full_blocks=6,
                  num_swa_blocks=48)
SP1 = SamplingParams(max_tokens=30, ignore_eos=True)
SP2 = SamplingParams(max_tokens=6, ignore_eos=True)
RESUME = 256


@pytest.fixture(scope="module")
def tiny():
  cfg = config.v4_tiny()
  return cfg, model.init_params(cfg, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def redis_server():
  require_server("redis")
  s = RedisServer()
  yield s
  s.stop()


def _keys(t, tokens, resume):
  """Record keys a resume at `resume` needs: the full blocks before it and the swa tail it reads."""
  h, fp = t._hasher(ExtraKeys(), tokens), t._fingerprint(ExtraKeys())
  full = [t._ident_of(h, fp, tokens, caches.FULL, j).key for j in range(resume // t.groups[caches.FULL].block_tokens)]
  swa = [t._ident_of(h, fp, tokens, caches.SWA, j).key for j in t.mgr.policies[caches.SWA].tail_blocks(resume)]
  return full, swa


def test_write_through_reaches_every_tier_and_engines_running_alongside(tiny, redis_server, tmp_path):
  cfg, params = tiny
  disk = str(tmp_path / "disk")

  def engine(tiers, **kw):
    tc = TieringConfig(tiers=tiers, disk_dir=disk, store_url=redis_server.url, policy="load", **kw)
    return Engine(params, cfg, dataclasses.replace(EC, tiering=tc))

  rng = np.random.default_rng(5)
  V = cfg.vocab_size
  p1 = [int(t) for t in rng.integers(2, V, 230)]
  B = engine(("disk",), engine_id="B")                 # up before A writes anything: it indexed an empty directory
  A = engine(("host", "disk", "redis"), demote="store", engine_id="A")
  assert A.tiering.unavailable() == {} and B.tiering.unavailable() == {}
  t = A.tiering
  host, disk_t, redis_t = t.store.tiers
  a = A.add_request("t1", p1, SP1)
  while not a.output:
    A.step()
  (first,), _ = _keys(t, p1, 128)
  assert a.status is Status.RUNNING and host.contains_many([first]) == [True]   # stored at registration
  A.run()
  t.flush()
  p2 = p1 + a.output + [int(x) for x in rng.integers(2, V, 50)]
  full, swa = _keys(t, p2, RESUME)
  for tier in (host, disk_t, redis_t):
    assert all(tier.contains_many(full + swa)), (tier.name, tier.summary())
  assert A.stats["preemptions"] == 0 and t.summary()["unavailable"] == {}

  def turn2(eng):
    rid = f"t2-{len(eng.requests)}"
    (o,) = generate(params, cfg, [p2], SP2, engine=eng)
    assert o.error is None, rid
    return o

  rb = turn2(B)
  assert (rb.hit_tokens, rb.tier_hit_tokens, rb.device_hit_tokens) == (RESUME, RESUME, 0), B.tiering.summary()
  (bt,) = B.tiering.store.tiers
  assert bt.metrics["adopted"] >= len(full + swa) and bt.metrics["hit_records"] > 0
  for tiers in (("disk",), ("redis",)):                # a restart on the directory; another engine on the store
    e = engine(tiers, engine_id=f"fresh-{tiers[0]}")
    r = turn2(e)
    assert (r.hit_tokens, r.tier_hit_tokens) == (RESUME, RESUME), (tiers, e.tiering.summary())
    assert r.output == rb.output and e.tiering.stats["rejected_records"] == 0
    e.tiering.close()
  ra = turn2(A)                                        # A still caches it on the device: no tier part
  assert (ra.hit_tokens, ra.tier_hit_tokens, ra.device_hit_tokens) == (RESUME, 0, RESUME)
  assert ra.output == rb.output

  # stopped early: its end-of-request checkpoint is written at the stop, before any further step
  p3 = [int(x) for x in rng.integers(2, V, 300)]
  s = A.add_request("s", p3, SP1)
  while len(s.output) < 2:
    A.step()
  steps = A.stats["steps"]
  assert A.stop_request("s")
  end = (len(p3) + len(s.output) - 1) // 128 * 128
  _, tail = _keys(t, p3, end)
  assert A.stats["steps"] == steps and all(host.contains_many(tail))
  t.flush()
  assert all(disk_t.contains_many(tail)) and all(redis_t.contains_many(tail))
  for eng in (A, B):
    eng.tiering.close()


def test_store_problems_show_at_start(tiny, tmp_path, monkeypatch):
  cfg, params = tiny

  def engine(**kw):
    return Engine(params, cfg, dataclasses.replace(EC, tiering=TieringConfig(**kw)))

  with pytest.raises(ValueError, match=r"TieringConfig\.store_url: bad redis URL 'redis//127\.0\.0\.1:6379'"):
    engine(tiers=("redis",), store_url="redis//127.0.0.1:6379")
  # nothing listening: one ping under the tier timeout marks it down, reported and counted (requests still run)
  dead = f"redis://127.0.0.1:{free_port()}/0"
  blocker = tmp_path / "file"
  blocker.write_text("x")
  eng = engine(tiers=("host", "disk", "redis"), disk_dir=str(blocker / "kv"), store_url=dead, tier_timeout_s=0.2)
  un = eng.tiering.unavailable()
  assert sorted(un) == ["disk", "redis"] and un["redis"].startswith("connect:") and "cannot create" in un["disk"]
  per = {x["tier"]: x for x in eng.tiering.summary()["tiers"]}
  assert per["redis"]["failures"] == 1 and per["redis"]["last_error"] == un["redis"] and per["redis"]["down"]
  assert per["disk"]["failures"] == 1 and not per["disk"]["started"] and per["host"]["failures"] == 0
  (o,) = generate(params, cfg, [[5, 6, 7] * 50], SamplingParams(max_tokens=2, ignore_eos=True), engine=eng)
  assert o.error is None and len(o.output) == 2
  eng.tiering.close()
  # no client package: a clear error, never a silently missing tier
  monkeypatch.setitem(sys.modules, "redis", None)
  with pytest.raises(ImportError, match=r"the redis tier needs the 'redis' package: pip install redis"):
    engine(tiers=("host", "redis"), store_url="redis://127.0.0.1:6379/0")
