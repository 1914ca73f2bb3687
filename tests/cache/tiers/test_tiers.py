"""cache/tiers without a model: record integrity and identity checks, tier policy (capacity / LRU / TTL / tenant
quota), disk and Redis backends with real failures (server down at start, killed mid-run, load past the budget,
unwritable directory, file size limit), write-behind backpressure, the cost model."""

import os
import resource
import shutil
import signal
import threading
import time

import numpy as np
import pytest

from cache.tiers import record
from cache.tiers.backends import DiskBackend, HostBackend, RedisBackend, TierError
from cache.tiers.cost import CostModel
from cache.tiers.servers import RedisServer, free_port
from cache.tiers.store import TieredStore
from cache.tiers.tier import Tier, TierPolicy
from cache.tiers.writeback import WriteBehind
from tests.isolation import run_in_child
from tests.store_servers import require_server

FP = record.Fingerprint("model-a", "tok-1", "layout-1", "tenant-x", "")
MAN = (record.ArrayEntry("L0/window_kv", "<f4", (4, 3)), record.ArrayEntry("L0/token_ids", "<i4", (4,)))


def _record(fp=FP, digest=b"d" * 16, seed=0):
  rng = np.random.default_rng(seed)
  arrs = [rng.standard_normal((4, 3)).astype(np.float32), np.arange(4, dtype=np.int32) + seed]
  hdr = record.RecordHeader(fp, "swa", digest, b"p" * 16, 32, (5, 6, 7, 8), MAN)
  return record.encode(hdr, arrs), arrs, record.Expect(fp, "swa", digest, b"p" * 16, 32, (5, 6, 7, 8), MAN)


def test_record_roundtrip_and_every_corruption_is_rejected():
  data, arrs, exp = _record()
  out = record.decode(data, exp)
  assert all(np.array_equal(a, b) for a, b in zip(arrs, out))
  for cut in (0, 5, len(data) // 2, len(data) - 1):
    with pytest.raises(record.RecordError):
      record.decode(data[:cut], exp)
  rng = np.random.default_rng(1)
  for pos in rng.choice(len(data), 40, replace=False).tolist() + [len(data) - 1, 0, 20]:
    flipped = bytearray(data)
    flipped[pos] ^= 1 << int(rng.integers(8))
    with pytest.raises(record.RecordError):
      record.decode(bytes(flipped), exp)


@pytest.mark.parametrize("field", ["model", "tokenizer", "layout", "tenant", "adapter"])
def test_other_fingerprint_is_rejected_and_keyed_apart(field):
  import dataclasses
  data, _, exp = _record()
  other = dataclasses.replace(FP, **{field: getattr(FP, field) + "-other"})
  with pytest.raises(record.RecordError, match=field):
    record.decode(data, dataclasses.replace(exp, fingerprint=other))
  assert record.record_key(FP, "swa", b"d" * 16) != record.record_key(other, "swa", b"d" * 16)
  # forced collision: same (truncated) key, still rejected by the header check
  assert record.record_key(FP, "swa", b"d" * 16, key_bits=0) == record.record_key(other, "swa", b"d" * 16, key_bits=0)


def test_other_prefix_under_colliding_key_is_rejected():
  import dataclasses
  data, _, exp = _record()
  for f, v in [("digest", b"e" * 16), ("parent", b"q" * 16), ("start", 64), ("tokens", (5, 6, 7, 9)),
               ("kind", "full"), ("arrays", MAN[:1])]:
    with pytest.raises(record.RecordError):
      record.decode(data, dataclasses.replace(exp, **{f: v}))


def test_tier_capacity_lru_ttl_and_tenant_quota():
  clock = [0.0]
  t = Tier(HostBackend(), TierPolicy(capacity_bytes=300, ttl_s=10, tenant_quota_bytes=200), clock=lambda: clock[0])
  for i in range(3):
    assert t.put(f"k{i}", b"x" * 100, tenant="a" if i < 2 else "b")
  assert t.get_many(["k0"]) == [b"x" * 100]          # k0 now most recently used
  assert t.put("k3", b"y" * 100, tenant="b")         # capacity: evicts the LRU record (k1)
  assert t.contains_many(["k0", "k1", "k2", "k3"]) == [True, False, True, True]
  assert t.put("k4", b"z" * 100, tenant="b")         # quota of b (200): b's own oldest (k2) goes
  assert t.contains_many(["k2", "k3", "k4", "k0"]) == [False, True, True, True]
  assert not t.put("big", b"w" * 301)                # larger than the tier: refused, nothing evicted
  assert t.contains_many(["k0", "k3", "k4"]) == [True, True, True]
  clock[0] = 11.0                                     # TTL
  assert t.contains_many(["k0"]) == [False] and t.get_many(["k3"]) == [None]
  assert t.metrics["expired"] >= 1 and t.metrics["evicted"] == 2
  assert {e.what for e in t.take_events()} >= {"stored", "removed", "expired"}


def test_disk_tier_atomic_files_reload_and_unwritable(tmp_path):
  d = tmp_path / "kv"
  t = Tier(DiskBackend(str(d)), TierPolicy(capacity_bytes=10_000))
  data, _, _ = _record()
  assert t.put("dsv4kv:ab", data)
  assert not [n for n in os.listdir(d) if n.startswith(".tmp-")]
  t2 = Tier(DiskBackend(str(d)))                       # a restarted engine finds the record
  assert t2.contains_many(["dsv4kv:ab"]) == [True] and t2.get_many(["dsv4kv:ab"]) == [data]
  blocker = tmp_path / "file"
  blocker.write_text("not a dir")
  with pytest.raises(TierError):
    DiskBackend(str(blocker / "kv"))
  # directory removed under a live tier: the write fails, is counted, nothing raises
  shutil.rmtree(d)
  assert not t.put("dsv4kv:cd", data) and t.metrics["failures"] == 1 and not t.available()


def test_disk_full_is_a_dropped_write_not_a_crash(tmp_path):
  t = Tier(DiskBackend(str(tmp_path)), TierPolicy(retry_after_s=0))
  data, _, _ = _record()
  old = resource.getrlimit(resource.RLIMIT_FSIZE)
  old_sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  try:
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, old[1]))   # the kernel refuses writes past 64 bytes (EFBIG)
    assert not t.put("dsv4kv:full", data)
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, old)
    signal.signal(signal.SIGXFSZ, old_sig)
  assert t.metrics["failures"] == 1 and "put" in t.last_error
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]   # the partial temp file is gone
  assert t.get_many(["dsv4kv:full"]) == [None]
  assert t.put("dsv4kv:ok", data)                                     # and the tier works again afterwards


@pytest.fixture
def redis_server():
  require_server("redis")
  s = RedisServer()
  yield s
  s.stop()


def test_redis_tier_roundtrip_directory_and_ttl(redis_server):
  # TTL long enough that a loaded 2-core box reaches the first checks before it expires
  ttl_s = 1.5
  t = Tier(RedisBackend(redis_server.url), TierPolicy(ttl_s=ttl_s))
  store = TieredStore([t], engine_id="e1", write_behind=None)
  data, _, _ = _record()
  store.put("dsv4kv:r1", data, tenant="tenant-x")
  put_at = time.monotonic()     # the server starts each TTL when its command arrives: the last before put returns
  assert store.locate(["dsv4kv:r1", "dsv4kv:none"]) == [[0], []]
  got = store.fetch({0: ["dsv4kv:r1"]}, time.monotonic() + 2)
  assert got["dsv4kv:r1"] == (data, 0)
  entry = store.directory.lookup_many(["dsv4kv:r1"])[0]
  assert entry["tenant"] == "tenant-x" and "redis" in entry["tiers"] and entry["bytes"] == len(data)
  time.sleep(max(0.0, put_at + ttl_s + 0.2 - time.monotonic()))   # server-side TTL on the record and its entry
  assert store.locate(["dsv4kv:r1"]) == [[]] and t.get_many(["dsv4kv:r1"]) == [None]
  store.close()


def test_redis_down_at_start_and_killed_mid_run(request):
  t = Tier(RedisBackend(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2), TierPolicy(retry_after_s=0.2))
  store = TieredStore([t], write_behind=None)
  data, _, _ = _record()
  store.put("dsv4kv:a", data)                        # nothing listening: dropped, counted
  assert store.locate(["dsv4kv:a"]) == [[]] and t.metrics["failures"] >= 1
  require_server("redis", also="the server-down half passed")
  s = RedisServer()
  request.addfinalizer(s.stop)                       # a failing assertion must not leave it running
  t2 = Tier(RedisBackend(s.url, timeout_s=0.2), TierPolicy(retry_after_s=0.2))
  store2 = TieredStore([t2], write_behind=WriteBehind(8))
  store2.put("dsv4kv:a", data)
  store2.drain()
  assert store2.fetch({0: ["dsv4kv:a"]}, time.monotonic() + 1)["dsv4kv:a"][0] == data
  s.stop()                                           # killed mid-run
  assert store2.fetch({0: ["dsv4kv:a"]}, time.monotonic() + 1) == {}
  store2.put("dsv4kv:b", data)
  store2.drain()
  assert t2.metrics["failures"] >= 1 and not t2.available()
  assert store2.locate(["dsv4kv:a"]) == [[]]         # skipped while down: no timeout paid per block
  store.close()
  store2.close()


def test_load_past_the_budget_is_abandoned(redis_server):
  t = Tier(RedisBackend(redis_server.url, timeout_s=5.0))
  store = TieredStore([t], write_behind=None)
  data, _, _ = _record()
  store.put("dsv4kv:slow", data)
  import redis
  blocker = threading.Thread(target=lambda: redis.Redis.from_url(redis_server.url).execute_command("DEBUG", "SLEEP",
                                                                                                   "3"))
  blocker.start()
  # wait until the server is really blocked (a loaded box may start the thread late): a quick ping times out
  probe = redis.Redis.from_url(redis_server.url, socket_timeout=0.05)
  deadline = time.monotonic() + 2.5
  while time.monotonic() < deadline:
    try:
      probe.ping()
      time.sleep(0.02)
    except redis.TimeoutError:
      break
  probe.close()
  t0 = time.monotonic()
  got = store.fetch({0: ["dsv4kv:slow"]}, time.monotonic() + 0.3)
  took = time.monotonic() - t0
  blocker.join()
  assert got == {} and store.stats["timeouts"] == 1 and t.metrics["timeouts"] == 1
  assert took < 2.0, took                            # the budget (0.3 s) bounded it, not the 5 s socket timeout
  store.close()


def test_write_behind_backpressure_drops_and_counts():
  gate = threading.Event()
  wb = WriteBehind(max_items=2, put_timeout_s=0.01)
  done = []
  assert wb.submit(lambda: (gate.wait(), done.append(0)), "disk", 10)
  time.sleep(0.05)                                   # the worker now holds item 0, blocked
  assert wb.submit(lambda: done.append(1), "disk", 10) and wb.submit(lambda: done.append(2), "disk", 10)
  assert not wb.submit(lambda: done.append(3), "disk", 10)   # queue full: dropped after the put timeout
  assert wb.stats["dropped"] == 1 and wb.pending_bytes["disk"] == 30
  gate.set()
  wb.drain()
  assert done == [0, 1, 2] and wb.pending_bytes["disk"] == 0
  wb.close()


def test_cost_model_picks_the_cheaper_path():
  cm = CostModel(prefill_tokens_per_s=1000.0)
  cm.calibrate("host", 1e-5, 10e9)
  cm.calibrate("redis", 5e-3, 100e6)
  plan = {"redis": (1, 50_000_000)}                  # 0.5 s of transfer
  assert not cm.decide(plan, 256).load               # 0.256 s to recompute: recompute
  assert cm.decide(plan, 4096).load                  # 4.1 s to recompute: load
  assert cm.decide({"host": (1, 50_000_000)}, 256).load
  d = cm.decide(plan, 4096, backlog_bytes={"redis": 500_000_000})  # queued writes share the bandwidth
  assert not d.load and d.budget_s <= cm.max_load_s
  cm.observe_prefill(100, 1.0)
  assert cm.prefill_tps == 100.0 and cm.recompute_seconds(100) == pytest.approx(1.0)


def test_mooncake_tier_roundtrip_and_server_gone(request):
  require_server("mooncake")
  if run_in_child(request):                          # Mooncake's client never loads into a pytest worker
    return
  from cache.tiers.backends import MooncakeBackend
  from cache.tiers.servers import MooncakeServer
  with MooncakeServer(segment="64MB") as s:
    t = Tier(MooncakeBackend(s.url), TierPolicy(retry_after_s=0.2))
    store = TieredStore([t], write_behind=WriteBehind(8))
    data, arrs, exp = _record()
    store.put("dsv4kv:m1", data, tenant="tenant-x")
    store.drain()
    assert t.metrics["stored"] == 1 and store.locate(["dsv4kv:m1", "dsv4kv:none"]) == [[0], []]
    got = store.fetch({0: ["dsv4kv:m1", "dsv4kv:none"]}, time.monotonic() + 5)
    assert list(got) == ["dsv4kv:m1"] and got["dsv4kv:m1"][1] == 0
    assert all(np.array_equal(a, b) for a, b in zip(record.decode(got["dsv4kv:m1"][0], exp), arrs))
    t2 = Tier(MooncakeBackend(s.url))                 # a second client (another engine) sees the record
    assert t2.get_many(["dsv4kv:m1"]) == [data]
    t2.close()
    store.close()
