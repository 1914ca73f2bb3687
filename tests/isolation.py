"""Run one test in a child pytest process, so that the pytest worker itself never loads what the test loads.

Why: Mooncake's client library (`mooncake.store`, native code) keeps state and threads in the process that loaded
it after `close()` and after its servers stop. xdist workers died of segmentation faults in unrelated tests that
pass alone; Mooncake was the first suspect, so each Mooncake test now runs in its own child process. A later full
run still lost a worker (in a Pallas interpret-mode test), so Mooncake is not the whole cause (BUILD_NOTES,
"Session 3"); keeping its native client out of the workers still removes one suspect.

Usage, first line of a test that takes pytest's `request` fixture:

    if run_in_child(request):
      return
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENV = "DSV4_TEST_CHILD"


def run_in_child(request, timeout_s: float = 1500) -> bool:
  """True once the test ran (and passed) in a child process; False inside that child (run the body)."""
  nodeid = request.node.nodeid
  if os.environ.get(_ENV) == nodeid:
    return False
  env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
  env[_ENV] = nodeid
  proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", nodeid],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
  out = proc.stdout[-6000:] + proc.stderr[-3000:]
  assert proc.returncode == 0, f"{nodeid} failed in its child process (exit {proc.returncode}):\n{out}"
  assert "1 passed" in proc.stdout, out  # the child really ran the test (not 0 tests, not a skip)
  return True
