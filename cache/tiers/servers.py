"""Start and stop real store servers on 127.0.0.1 and a free port (tests, benchmarks, local runs)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class RedisServer:
  """`redis-server` bound to 127.0.0.1, no persistence; `maxmemory` with allkeys-lru is the server-side capacity."""

  def __init__(self, port: int | None = None, maxmemory: str = "0", debug: bool = True):
    exe = shutil.which("redis-server")
    if exe is None:
      raise RuntimeError("redis-server not installed (apt-get install redis-server)")
    self.port = port or free_port()
    self.dir = tempfile.mkdtemp(prefix="dsv4-redis-")
    args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", self.dir, "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]
    if debug:
      args += ["--enable-debug-command", "local"]
    self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    self.url = f"redis://127.0.0.1:{self.port}/0"
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10:
      try:
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
          s.sendall(b"PING\r\n")
          if s.recv(16).startswith(b"+PONG"):
            return
      except OSError:
        time.sleep(0.02)
    self.stop()
    raise RuntimeError(f"redis-server did not come up on port {self.port}")

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait(timeout=10)
    shutil.rmtree(self.dir, ignore_errors=True)

  def __enter__(self):
    return self

  def __exit__(self, *a):
    self.stop()


def env_with_loopback() -> dict:
  env = dict(os.environ)
  env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
  return env


class MooncakeServer:
  """`mooncake_master` (with its HTTP metadata server) plus one memory-holding `mooncake_client`, all on
  127.0.0.1 (MC_TCP_BIND_ADDRESS). `url` is what `MooncakeBackend` takes."""

  def __init__(self, segment: str = "256MB"):
    for exe in ("mooncake_master", "mooncake_client"):
      if shutil.which(exe) is None:
        raise RuntimeError(f"{exe} not found (pip install mooncake-transfer-engine-non-cuda; apt libibverbs1)")
    env = env_with_loopback()
    self.rpc, self.http, cport = free_port(), free_port(), free_port()
    self.log = tempfile.mkdtemp(prefix="dsv4-mooncake-")
    self.meta = f"http://127.0.0.1:{self.http}/metadata"
    self.master = subprocess.Popen(
        ["mooncake_master", f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1",
         "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
         f"--http_metadata_server_port={self.http}"], env=env,
        stdout=open(os.path.join(self.log, "master.log"), "w"), stderr=subprocess.STDOUT)
    self.client = None
    try:
      _wait_port(self.rpc)
      _wait_port(self.http)
      self.client = subprocess.Popen(
          ["mooncake_client", "--host=127.0.0.1", f"--port={cport}", f"--master_server_address=127.0.0.1:{self.rpc}",
           f"--metadata_server={self.meta}", f"--global_segment_size={segment}", "--local_buffer_size=16MB",
           "--protocol=tcp"], env=env, stdout=open(os.path.join(self.log, "client.log"), "w"),
          stderr=subprocess.STDOUT)
      _wait_port(cport)
    except Exception:
      self.stop()
      raise
    self.url = f"mooncake://127.0.0.1:{self.rpc}?metadata={self.meta}"

  def stop(self) -> None:
    for p in (self.client, self.master):
      if p is not None and p.poll() is None:
        p.kill()
        p.wait(timeout=10)
    shutil.rmtree(self.log, ignore_errors=True)

  def __enter__(self):
    return self

  def __exit__(self, *a):
    self.stop()


def _wait_port(port: int, timeout_s: float = 15.0) -> None:
  t0 = time.monotonic()
  while time.monotonic() - t0 < timeout_s:
    try:
      with socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return
    except OSError:
      time.sleep(0.05)
  raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout_s} s")
