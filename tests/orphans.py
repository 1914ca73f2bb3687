"""Orphan check: no process a test run starts may outlive the run (a pytest plugin, registered by tests/conftest.py).

The controller (a plain run, or xdist's controller) marks the run in pytest_configure, before any worker or child
starts: it appends a unique id to DSV4_TEST_RUN in its environment, so every process started since inherits it
(xdist workers, the servers and subprocesses tests start, child pytest runs and theirs). A nested run appends its own
id, so an outer run still recognises what an inner one leaves behind. When the session ends, after xdist has stopped
its workers, the controller looks in /proc/*/environ for processes still carrying the id; servers whose owner just
exited get a moment to go (their parent-death signal, cache/tiers/servers.py), then what remains is killed, named
one line each, and the run fails.

A process started with an environment of its own (env= without os.environ's entries) carries no mark: the check
cannot see it. Linux only (/proc); elsewhere it does nothing."""

import os
import signal
import time
import uuid

import pytest

ENV = "DSV4_TEST_RUN"
_GRACE_S = 3.0                 # how long processes found at the end get to exit by themselves
_EXEC_SETTLE_S = 0.3
_run_id_key = pytest.StashKey[str]()


def pytest_configure(config):
  if hasattr(config, "workerinput"):   # an xdist worker: it inherited the controller's mark
    return
  run_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
  os.environ[ENV] = ":".join(filter(None, (os.environ.get(ENV), run_id)))
  config.stash[_run_id_key] = run_id


@pytest.hookimpl(trylast=True)   # after xdist's own pytest_sessionfinish, which stops (and waits for) the workers
def pytest_sessionfinish(session, exitstatus):
  run_id = session.config.stash.get(_run_id_key, None)
  if run_id is None or not os.path.isdir("/proc"):
    return
  # A process caught between exec and its first instruction shows an empty environment (the kernel sets it after
  # the exec is already visible to its parent): wait that out before the first look.
  time.sleep(_EXEC_SETTLE_S)
  orphans = marked_processes(run_id)
  deadline = time.monotonic() + _GRACE_S
  while orphans and time.monotonic() < deadline:
    time.sleep(0.05)
    orphans = marked_processes(run_id)
  if not orphans:
    return
  report = session.config.pluginmanager.get_plugin("terminalreporter")
  if report is not None:
    report.write("\n")           # xdist's progress line does not end with one
    report.write_sep("=", "orphan processes", red=True)
  for pid, cmdline in orphans.items():
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    line = f"orphan process left by the test run (killed): pid {pid}: {cmdline}"
    if report is not None:
      report.write_line(line, red=True, bold=True)
    else:
      print(line, flush=True)
  if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def marked_processes(run_id: str) -> dict[int, str]:
  """pid -> command line of the live processes whose environment carries run_id, other than this process and its
  ancestors (zombies have no environment left: they are gone)."""
  exclude, prefix = _self_and_ancestors(), f"{ENV}=".encode()
  found = {}
  for name in os.listdir("/proc"):
    if not name.isdigit() or int(name) in exclude:
      continue
    try:
      with open(f"/proc/{name}/environ", "rb") as f:
        environ = f.read().split(b"\0")
      with open(f"/proc/{name}/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:                # exited meanwhile, or not ours to read
      continue
    marks = next((e[len(prefix):].decode(errors="replace") for e in environ if e.startswith(prefix)), "")
    if run_id in marks.split(":"):
      found[int(name)] = cmdline
  return found


def _self_and_ancestors() -> set[int]:
  pids, pid = set(), os.getpid()
  while pid > 0 and pid not in pids:
    pids.add(pid)
    try:
      with open(f"/proc/{pid}/stat") as f:
        pid = int(f.read().rsplit(")", 1)[1].split()[1])   # the field after the (command name) is the state, then ppid
    except (OSError, IndexError, ValueError):
      break
  return pids


def running(pid: int) -> bool:
  """Alive and not a zombie (a killed process whose new parent has not reaped it yet is gone for our purposes)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
  except (OSError, IndexError):
    return False
