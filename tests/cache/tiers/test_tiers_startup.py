"""Tiers a user can reach: a disk directory shared by engines that run at the same time (records written after a
tier indexed the directory are found by key), Redis URLs checked at start-up (syntax, one ping, a missing client
package), and `python -m cache.tiers.servers` starting a store and printing its URL."""

import os
import shutil
import signal
import subprocess
import sys

import pytest

from cache.tiers import record as R
from cache.tiers.backends import DiskBackend, HostBackend, RedisBackend, parse_redis_url
from cache.tiers.servers import RedisServer, free_port
from cache.tiers.tier import Tier, TierPolicy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _record(seed=0):
  import numpy as np
  fp = R.Fingerprint("model-a", "tok-1", "layout-1", "", "")
  man = (R.ArrayEntry("L0/window_kv", "<f4", (4, 3)),)
  hdr = R.RecordHeader(fp, "swa", bytes([seed]) * 16, b"p" * 16, 32, (5, 6, 7, 8), man)
  return R.encode(hdr, [np.full((4, 3), seed, np.float32)])


def test_disk_tier_finds_records_another_engine_wrote_after_it_started(tmp_path):
  d = str(tmp_path / "kv")
  reader = Tier(DiskBackend(d))                       # indexes an empty directory
  writer = Tier(DiskBackend(d))
  data = _record()
  assert reader.contains_many(["dsv4kv:a"]) == [False]
  assert writer.put("dsv4kv:a", data)
  # found by key on the next lookup (one stat), then served and accounted like its own
  assert reader.contains_many(["dsv4kv:a", "dsv4kv:b"]) == [True, False]
  assert reader.get_many(["dsv4kv:a"]) == [data]
  assert reader.metrics["adopted"] == 1 and reader.used_bytes == len(data) and reader.summary()["records"] == 1
  # a get without a lookup first adopts too
  assert writer.put("dsv4kv:c", data)
  assert reader.get_many(["dsv4kv:c"]) == [data] and reader.contains_many(["dsv4kv:c"]) == [True]
  # the other engine evicts it: a miss, and the stale index entry goes
  writer.backend.delete("dsv4kv:a")
  assert reader.get_many(["dsv4kv:a"]) == [None] and reader.contains_many(["dsv4kv:a"]) == [False]
  assert reader.used_bytes == len(data)
  # the host tier's index stays the truth: nothing to probe
  assert Tier(HostBackend())._probe is None and reader._probe is not None


def test_redis_url_syntax_is_checked():
  assert parse_redis_url("redis://127.0.0.1:6379/0") == ("127.0.0.1", 6379, 0)
  assert parse_redis_url("rediss://cache.local/3") == ("cache.local", 6379, 3)
  for url, why in [("", "required"), ("http://127.0.0.1:6379", "redis://"), ("127.0.0.1:6379", "redis://"),
                   ("redis://:6379/0", "host"), ("redis://h:port/0", "port"), ("redis://h:70000/0", "port"),
                   ("redis://h:6379/db0", "database")]:
    with pytest.raises(ValueError, match=why):
      parse_redis_url(url)
    with pytest.raises(ValueError, match=why):
      RedisBackend(url)


def test_redis_ping_at_start_marks_an_unreachable_store_down():
  t = Tier(RedisBackend(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2), TierPolicy(retry_after_s=30))
  assert not t.check()
  s = t.summary()
  assert s["failures"] == 1 and s["last_error"].startswith("connect:") and not s["ok"] and s["down"]
  assert not t.available() and t.contains_many(["k"]) == [False]      # skipped, no timeout paid per lookup
  t.close()
  with RedisServer() as srv:
    t = Tier(RedisBackend(srv.url, timeout_s=0.5))
    assert t.check() and t.summary()["failures"] == 0 and t.ok
    t.close()


def test_missing_redis_client_is_a_clear_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "redis", None)     # `import redis` raises ImportError
  with pytest.raises(ImportError, match=r"pip install redis"):
    RedisBackend("redis://127.0.0.1:6379/0")


def test_servers_cli_starts_redis_and_prints_its_url():
  if shutil.which("redis-server") is None:
    pytest.skip("redis-server not on PATH")
  import redis
  port = free_port()
  p = subprocess.Popen([sys.executable, "-m", "cache.tiers.servers", "redis", "--port", str(port)], cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    url = p.stdout.readline().strip()
    assert url == f"redis://127.0.0.1:{port}/0", p.stderr.read() if p.poll() is not None else url
    c = redis.Redis.from_url(url, socket_timeout=2)
    assert c.ping()
    c.close()
    p.send_signal(signal.SIGINT)                      # Ctrl-C: stops the server, exits 0
    assert p.wait(timeout=20) == 0
    with pytest.raises(redis.ConnectionError):
      redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
    p.stdout.close()
    p.stderr.close()
