"""The suite's orphan check (tests/orphans.py): a run whose test leaves a process behind fails, names it and kills
it; a run that stops what it starts passes. Each case is a tiny inner pytest run with only that plugin loaded."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.orphans import running

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

INNER_TEST = '''
import subprocess

def test_starts_a_process():
  p = subprocess.Popen(["sleep", "60"], start_new_session=True)
  with open({pid_file!r}, "w") as f:
    f.write(str(p.pid))
  if {stop}:
    p.kill()
    p.wait()
'''


def _inner_run(tmp_path, stop: bool):
  pid_file = tmp_path / "pid"
  (tmp_path / "test_inner.py").write_text(INNER_TEST.format(pid_file=str(pid_file), stop=stop))
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
  env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"          # only our plugin: a fast inner run
  env["PYTHONPATH"] = os.pathsep.join(filter(None, (ROOT, env.get("PYTHONPATH"))))
  cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.orphans", "-q", "test_inner.py"]
  proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
  pid = int(pid_file.read_text()) if pid_file.exists() else None
  return proc, pid


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the orphan check reads /proc (Linux)")
def test_a_run_that_leaves_a_process_behind_fails_names_it_and_kills_it(tmp_path):
  proc, pid = None, None
  try:
    proc, pid = _inner_run(tmp_path, stop=False)
    out = proc.stdout + proc.stderr
    assert pid is not None, out
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, out
    assert "1 passed" in out and f"orphan process left by the test run (killed): pid {pid}: sleep 60" in out, out
    deadline = time.monotonic() + 5
    while running(pid) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not running(pid)
  finally:
    if pid is not None and running(pid):               # the check failed: do not leave the sleep behind ourselves
      os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="the orphan check reads /proc (Linux)")
def test_a_run_that_stops_what_it_starts_passes(tmp_path):
  proc, pid = _inner_run(tmp_path, stop=True)
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0 and "orphan" not in out, out
  assert pid is not None and not running(pid)
