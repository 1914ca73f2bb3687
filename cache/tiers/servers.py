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
