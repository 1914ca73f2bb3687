"""Reload gate and faults for the KV tiers, V4 and V4.1 tiny, fp32.

One conversation per model: turn 1 (230-token prompt, 30 answer tokens, so the end-of-request SWA checkpoint at
256 sits in the middle of the answer and carries the CSA overlap / compressor rows the next chunk reads), then
turn 2 = turn 1 + answer + 50 new tokens, which resumes at 256. Reference = a cold engine running turn 2 alone.
Every path must give the same greedy tokens and logits within 1e-6 relative: a device (L1) hit, a reload after the
device cache is dropped from each tier in turn (host, disk, Redis; each tier's hit counter must move), after other
traffic evicted the session's blocks (demoted on eviction), and under every fault (the request recomputes)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from cache.tiers.servers import MooncakeServer, RedisServer, free_port
from dsv4 import config, model
from dsv4.engine.api import generate
from dsv4.engine.config import EngineConfig
from dsv4.engine.engine import Engine
from dsv4.engine.sampling import SamplingParams
from dsv4.engine.tiering_config import TieringConfig
from tests.isolation import run_in_child
from tests.store_servers import require_server

EC = EngineConfig(max_num_seqs=2, max_num_batched_tokens=128, chunk_size=64, max_model_len=640, num_full_blocks=6,
                  num_swa_blocks=48, record_logits=True, retention_interval=128)
SP1 = SamplingParams(max_tokens=30, ignore_eos=True)
SP2 = SamplingParams(max_tokens=6, ignore_eos=True)
RESUME = 256


@pytest.fixture(scope="module")
def redis_server():
  require_server("redis")
  s = RedisServer()
  yield s
  s.stop()


@pytest.fixture(scope="module")
def mooncake_server():
  require_server("mooncake")
  s = MooncakeServer(segment="256MB")
  yield s
  s.stop()


class World:
  """Turn 1 served by engine A with host, disk and Redis tiers; the cold reference for turn 2."""

  def __init__(self, name, redis_server, tmp):
    self.name = name
    self.cfg = config.v4_tiny() if name == "v4" else config.v41_tiny()
    self.params = model.init_params(self.cfg, jax.random.PRNGKey(0))
    self.disk = os.path.join(tmp, f"disk_{name}")
    self.url = redis_server.url.replace("/0", "/1" if name == "v4" else "/2")
    rng = np.random.default_rng(3)
    V = self.cfg.vocab_size
    self.p1 = [int(t) for t in rng.integers(2, V, 230)]
    self.A = self.engine(("host", "disk", "redis"), engine_id="A")
    (o1,) = generate(self.params, self.cfg, [self.p1], SP1, engine=self.A)
    self.p2 = self.p1 + o1.output + [int(t) for t in rng.integers(2, V, 50)]
    self.other = [int(t) for t in rng.integers(2, V, 560)]
    cold = Engine(self.params, self.cfg, EC)
    (c,) = generate(self.params, self.cfg, [self.p2], SP2, engine=cold)
    self.cold_tokens, self.cold_logits = c.output, np.stack(c.token_logits)
    # device (L1) hit, then other traffic that evicts the session's cached blocks (demoted on eviction), then the
    # device cache is dropped (everything still cached is demoted): every tier now holds the conversation.
    self.local = self.turn2(self.A)
    self.tier_hits_before_drop = self.A.tiering.stats["tier_hit_tokens"]
    generate(self.params, self.cfg, [self.other], SamplingParams(max_tokens=2, ignore_eos=True), engine=self.A)
    self.demoted_on_eviction = self.A.tiering.stats["demoted_blocks"]
    self.A.tiering.drop_device_cache()

  def engine(self, tiers, **kw):
    kw = {"disk_dir": self.disk, "store_url": self.url, "policy": "load", **kw}
    return Engine(self.params, self.cfg, dataclasses.replace(EC, tiering=TieringConfig(tiers=tiers, **kw)))

  def turn2(self, eng, tenant=""):
    from cache.hashing import ExtraKeys
    rid = f"t2-{len(eng.requests)}"
    eng.add_request(rid, self.p2, SP2, extra_keys=ExtraKeys(tenant=tenant))
    eng.run()
    r = eng.requests[rid]
    assert r.error is None
    return r

  def check_same(self, r):
    assert r.output == self.cold_tokens
    got = np.stack(r.token_logits)
    rel = np.max(np.abs(got - self.cold_logits)) / np.max(np.abs(self.cold_logits))
    assert rel <= 1e-6, rel


@pytest.fixture(scope="module", params=["v4", "v41"])
def world(request, redis_server, tmp_path_factory):
  w = World(request.param, redis_server, str(tmp_path_factory.mktemp("tiers")))
  yield w
  w.A.tiering.close()


def _hits(eng, tier_name):
  (t,) = [t for t in eng.tiering.store.tiers if t.name == tier_name]
  return t.metrics["hit_records"], t.metrics["hit_tokens"]


def test_reload_gate_every_tier(world):
  A = world.A
  # local (device) hit
  assert world.local.hit_tokens == RESUME and world.tier_hits_before_drop == 0
  world.check_same(world.local)
  assert world.demoted_on_eviction > 0
  # after the drop: reload from the host tier
  r = world.turn2(A)
  assert r.hit_tokens == RESUME
  assert _hits(A, "host")[0] > 0 and _hits(A, "host")[1] > 0
  world.check_same(r)
  # a fresh engine (empty device) per lower tier
  for tier in ("disk", "redis"):
    eng = world.engine((tier,), engine_id=f"reload-{tier}")
    r = world.turn2(eng)
    assert r.hit_tokens == RESUME, (tier, eng.tiering.summary())
    assert _hits(eng, tier)[0] > 0 and _hits(eng, tier)[1] > 0, tier
    assert eng.tiering.stats["rejected_records"] == 0
    world.check_same(r)
    eng.tiering.close()


def test_reload_gate_mooncake(world, request):
  """The second L4 backend: engine A's records (same bytes, same keys) placed in Mooncake Store, then a fresh
  engine whose only tier is Mooncake resumes the conversation from it. Runs in a child process (its own world), so
  Mooncake's client never loads into a pytest worker (tests/isolation.py)."""
  require_server("mooncake")                        # here, not in the child: a skip there reads as a failure
  if run_in_child(request):
    return
  mooncake_server = request.getfixturevalue("mooncake_server")
  import redis
  from cache.tiers.backends import MooncakeBackend
  world.A.tiering.store.drain()
  src = redis.Redis.from_url(world.url)
  mc = MooncakeBackend(mooncake_server.url)
  n = 0
  for k in src.scan_iter("dsv4kv:*"):
    mc.put(k.decode(), src.get(k))
    n += 1
  mc.close()
  assert n > 0
  for tier in ("mooncake",):
    eng = world.engine((tier,), store_url=mooncake_server.url, engine_id="reload-mooncake")
    r = world.turn2(eng)
    assert r.hit_tokens == RESUME, (tier, eng.tiering.summary())
    assert _hits(eng, tier)[0] > 0 and _hits(eng, tier)[1] > 0, tier
    assert eng.tiering.stats["rejected_records"] == 0
    world.check_same(r)
    eng.tiering.close()


def _copy_disk(world, tmp_path, mutate):
  d = str(tmp_path / "copy")
  shutil.copytree(world.disk, d)
  files = sorted(f for f in os.listdir(d) if f.endswith(".rec"))
  assert files
  mutate(d, files)
  return d


@pytest.mark.parametrize("fault", ["truncated", "flipped_bit"])
def test_corrupt_records_are_rejected_and_recomputed(world, tmp_path, fault):
  world.A.tiering.store.drain()

  def mutate(d, files):
    if fault == "truncated":
      for f in files:
        p = os.path.join(d, f)
        os.truncate(p, os.path.getsize(p) - 7)
    else:                             # one bit of the conversation's second full block
      from cache.hashing import ExtraKeys
      t = world.A.tiering
      key = t._ident_of(t._hasher(ExtraKeys(), world.p2), t._fingerprint(ExtraKeys()), world.p2, "full", 1).key
      p = os.path.join(d, key.replace(":", "_") + ".rec")
      b = bytearray(open(p, "rb").read())
      b[len(b) // 2] ^= 0x10
      open(p, "wb").write(bytes(b))

  eng = world.engine(("disk",), disk_dir=_copy_disk(world, tmp_path, mutate))
  r = world.turn2(eng)
  assert eng.tiering.stats["rejected_records"] >= 1
  # truncated: nothing verifies -> recompute all; flipped bit in full block 1 -> resume at the retention
  # checkpoint 128 (block 0 and the swa tail before 128 verify)
  assert r.hit_tokens == (0 if fault == "truncated" else 128)
  world.check_same(r)
  eng.tiering.close()


def test_other_model_layout_or_tenant_never_loads(world, tmp_path):
  world.A.tiering.store.drain()
  # keyed apart: another model digest / tokenizer / tenant simply misses
  for kw, tenant in [({"model_digest": "another-model"}, ""), ({"tokenizer_id": "another-template"}, ""),
                     ({}, "tenant-y")]:
    eng = world.engine(("disk",), **kw)
    r = world.turn2(eng, tenant=tenant)
    assert r.hit_tokens == 0 and eng.tiering.stats["loaded_records"] == 0, kw
    world.check_same(r)
    eng.tiering.close()
  # forced collision: with 0-bit keys every lookup of tenant y finds tenant ""'s record; the header check refuses it
  d = str(tmp_path / "collide")
  os.makedirs(d)
  src = sorted(f for f in os.listdir(world.disk) if f.endswith(".rec"))[0]
  shutil.copy(os.path.join(world.disk, src), os.path.join(d, "dsv4kv_" + "0" * 32 + ".rec"))
  eng = world.engine(("disk",), disk_dir=d, key_bits=0)
  r = world.turn2(eng, tenant="tenant-y")
  assert r.hit_tokens == 0 and eng.tiering.stats["rejected_records"] >= 1
  assert eng.tiering.stats["loaded_records"] == 0
  world.check_same(r)
  eng.tiering.close()


def _copy_redis(src_url, dst_url):
  import redis
  a, b = redis.Redis.from_url(src_url), redis.Redis.from_url(dst_url)
  for k in a.scan_iter():
    b.restore(k, 0, a.dump(k), replace=True)


def test_store_down_at_start_killed_mid_run_and_slow(world, request):
  if world.name != "v4":
    pytest.skip("fault paths are model-independent; run once")
  world.A.tiering.store.drain()
  # down at start
  eng = world.engine(("redis",), store_url=f"redis://127.0.0.1:{free_port()}/0", tier_timeout_s=0.2)
  r = world.turn2(eng)
  assert r.hit_tokens == 0 and eng.tiering.store.tiers[0].metrics["failures"] >= 1
  world.check_same(r)
  eng.tiering.close()
  # killed mid-run: hits, then the server dies, the device cache is dropped (demotions to a dead store are
  # dropped), and the next turn recomputes
  s2 = RedisServer()
  request.addfinalizer(s2.stop)                      # a failing assertion must not leave it running
  _copy_redis(world.url, s2.url.replace("/0", "/1" if world.name == "v4" else "/2"))
  eng = world.engine(("redis",), store_url=s2.url.replace("/0", "/1"), tier_timeout_s=0.2)
  r = world.turn2(eng)
  assert r.hit_tokens == RESUME
  world.check_same(r)
  s2.stop()
  eng.tiering.drop_device_cache()
  r = world.turn2(eng)
  assert r.hit_tokens == 0 and eng.tiering.store.tiers[0].metrics["failures"] >= 1
  world.check_same(r)
  eng.tiering.close()
  # a load past the timeout: the server stalls (DEBUG SLEEP) longer than the tier timeout, and long enough to still
  # be stalled when the admission looks up (a loaded machine takes over a second to get there)
  import redis
  eng = world.engine(("redis",), tier_timeout_s=0.3, load_timeout_s=0.5)
  blocker = threading.Thread(target=lambda: redis.Redis.from_url(world.url).execute_command("DEBUG", "SLEEP", "3"))
  blocker.start()
  time.sleep(0.1)
  r = world.turn2(eng)
  blocker.join()
  t = eng.tiering.store.tiers[0]
  assert r.hit_tokens == 0 and t.metrics["failures"] + t.metrics["timeouts"] >= 1
  world.check_same(r)
  eng.tiering.close()


def test_disk_unwritable_or_full(world, tmp_path):
  if world.name != "v4":
    pytest.skip("fault paths are model-independent; run once")
  import resource
  import signal
  blocker = tmp_path / "not_a_dir"
  blocker.write_text("x")
  eng = world.engine(("disk",), disk_dir=str(blocker / "kv"))
  assert eng.tiering.startup_errors and not eng.tiering.store.tiers
  world.check_same(world.turn2(eng))
  eng.tiering.close()
  eng = world.engine(("disk",), disk_dir=str(tmp_path / "full"))
  world.turn2(eng)
  old = resource.getrlimit(resource.RLIMIT_FSIZE)
  old_sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  try:
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, old[1]))     # every record write fails with EFBIG
    assert eng.tiering.drop_device_cache() > 0
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, old)
    signal.signal(signal.SIGXFSZ, old_sig)
  assert eng.tiering.store.tiers[0].metrics["failures"] >= 1
  r = world.turn2(eng)
  assert r.hit_tokens == 0
  world.check_same(r)
  eng.tiering.close()


def test_two_engines_in_two_processes_share_redis(world, tmp_path):
  if world.name != "v4":
    pytest.skip("one model is enough for the process boundary")
  world.A.tiering.store.drain()
  job = tmp_path / "job.json"
  job.write_text(json.dumps({"prompt": world.p2, "max_tokens": SP2.max_tokens}))
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = subprocess.run([sys.executable, "-m", "tests.dsv4.tiers_peer", world.name, world.url, str(job)], cwd=root,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads(out.stdout.strip().splitlines()[-1])
  assert res["hit"] == RESUME and res["redis_hit_records"] > 0 and res["redis_hit_tokens"] > 0
  assert res["output"] == world.cold_tokens
  r = world.turn2(world.A)                            # what engine 1 itself answers for the same turn
  assert res["output"] == r.output
  rel = np.max(np.abs(np.array(res["logits"]) - world.cold_logits)) / np.max(np.abs(world.cold_logits))
  assert rel <= 1e-6
