"""Tiers a user can reach: a disk directory shared by engines that run at the same time (records written after a
tier indexed the directory are found by key), Redis URLs checked at start-up (syntax, one ping, a missing client
package), and `python -m cache.tiers.servers` starting a store, printing its URL and stopping it on a signal; no
server outlives the process that started it."""

import os
import signal
import subprocess
import sys
import time

import pytest

from cache.tiers import record
from cache.tiers.backends import DiskBackend, HostBackend, RedisBackend, parse_redis_url
from cache.tiers.servers import RedisServer, free_port
from cache.tiers.tier import Tier, TierPolicy
from tests.orphans import running
from tests.store_servers import require_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _record(seed=0):
  import numpy as np
  fp = record.Fingerprint("model-a", "tok-1", "layout-1", "", "")
  man = (record.ArrayEntry("L0/window_kv", "<f4", (4, 3)),)
  hdr = record.RecordHeader(fp, "swa", bytes([seed]) * 16, b"p" * 16, 32, (5, 6, 7, 8), man)
  return record.encode(hdr, [np.full((4, 3), seed, np.float32)])


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
  require_server("redis", also="the unreachable half passed, the reachable half is not checked")
  with RedisServer() as srv:
    t = Tier(RedisBackend(srv.url, timeout_s=0.5))
    assert t.check() and t.summary()["failures"] == 0 and t.ok
    t.close()


def test_missing_redis_client_is_a_clear_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "redis", None)     # `import redis` raises ImportError
  with pytest.raises(ImportError, match=r"pip install redis"):
    RedisBackend("redis://127.0.0.1:6379/0")


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds server processes through /proc (Linux)")


def with_sigint(disposition: str) -> list[str]:
  """A prefix that execs the command with SIGINT set to SIG_DFL or SIG_IGN: whatever the test runner's own, the CLI
  inherits that one (a non-interactive shell starts its background jobs with SIGINT ignored; exec keeps it)."""
  return [sys.executable, "-c", (f"import os, signal, sys; signal.signal(signal.SIGINT, signal.{disposition}); "
                                 "os.execv(sys.argv[1], sys.argv[1:])")]


def children(pid: int) -> list[int]:
  found = []
  for name in os.listdir("/proc"):
    try:
      with open(f"/proc/{name}/stat") as f:
        if name.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:   # ppid follows the state
          found.append(int(name))
    except (OSError, IndexError, ValueError):
      pass
  return found


def gone_within(pids, timeout_s: float = 10.0) -> bool:
  deadline = time.monotonic() + timeout_s
  while any(running(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.05)
  return not any(running(p) for p in pids)


class ServersCli:
  """`python -m cache.tiers.servers` in a session of its own; on exit kills it and its servers whatever happened, so a
  failing test leaves nothing behind either."""

  def __init__(self, *args: str, prefix: tuple = ()):
    self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "cache.tiers.servers", *args], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    self.server_pids: list[int] = []

  def __enter__(self):
    return self

  def read_url(self) -> str:
    url = self.proc.stdout.readline().strip()
    self.server_pids = children(self.proc.pid)        # started before the URL is printed
    return url

  def __exit__(self, *exc):
    if self.proc.returncode is None:                # once reaped, its pid may belong to another process
      self.server_pids += [c for c in children(self.proc.pid) if c not in self.server_pids]
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
    self.proc.wait()
    for pid in self.server_pids:
      if running(pid):
        os.kill(pid, signal.SIGKILL)
    self.proc.stdout.close()
    self.proc.stderr.close()


@needs_proc
@pytest.mark.parametrize("sig,inherited", [("SIGINT", "SIG_DFL"), ("SIGTERM", "SIG_DFL"), ("SIGINT", "SIG_IGN")])
def test_servers_cli_starts_redis_prints_its_url_and_stops_it_on_a_signal(sig, inherited):
  require_server("redis")
  import redis
  port = free_port()
  with ServersCli("redis", "--port", str(port), prefix=with_sigint(inherited)) as cli:
    url = cli.read_url()
    assert url == f"redis://127.0.0.1:{port}/0", cli.proc.stderr.read() if cli.proc.poll() is not None else url
    assert len(cli.server_pids) == 1 and running(cli.server_pids[0])
    c = redis.Redis.from_url(url, socket_timeout=2)
    assert c.ping()
    c.close()
    cli.proc.send_signal(getattr(signal, sig))        # Ctrl-C or a supervisor: stops the server, exits 0
    assert cli.proc.wait(timeout=20) == 0
    assert not running(cli.server_pids[0])            # stopped and reaped by the CLI
    with pytest.raises(redis.ConnectionError):
      redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()


@needs_proc
def test_servers_cli_killed_leaves_no_server_behind():
  require_server("redis")
  with ServersCli("redis") as cli:
    assert cli.read_url().startswith("redis://127.0.0.1:")
    assert len(cli.server_pids) == 1 and running(cli.server_pids[0])
    cli.proc.kill()                                   # no chance to clean up: the server's parent-death signal does
    cli.proc.wait()
    assert gone_within(cli.server_pids)


OWNER = """
import sys
from cache.tiers.servers import MooncakeServer, RedisServer
s = RedisServer() if sys.argv[1] == "redis" else MooncakeServer(segment="16MB")
print(s.url, flush=True)
sys.stdin.read()
"""


@needs_proc
@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_a_server_dies_with_the_process_that_started_it(kind):
  require_server(kind)
  exes = ["redis-server"] if kind == "redis" else ["mooncake_master", "mooncake_client"]
  owner = subprocess.Popen([sys.executable, "-c", OWNER, kind], cwd=ROOT, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
  servers = []
  try:
    url = owner.stdout.readline().strip()
    servers = children(owner.pid)
    assert url.startswith(f"{kind}://") and len(servers) == len(exes), owner.stderr.read()
    owner.kill()                                      # a crashed test worker, say
    owner.wait()
    assert gone_within(servers)
  finally:
    if owner.returncode is None:                      # once reaped, its pid may belong to another process
      servers += [c for c in children(owner.pid) if c not in servers]
    if owner.poll() is None:
      os.killpg(owner.pid, signal.SIGKILL)
      owner.wait()
    for pid in servers:
      if running(pid):
        os.kill(pid, signal.SIGKILL)
    for f in (owner.stdin, owner.stdout, owner.stderr):
      f.close()
