"""Run one test in a child pytest process, so that the pytest worker itself never loads what the test loads, or so
that the test compiles under other XLA flags than the suite's.

Uses: Mooncake's client library (`mooncake.store`, native code) keeps state and threads in the process that loaded
it after `close()` and after its servers stop, so its tests run in children (it was the first suspect for the
worker crashes that turned out to be `vm.max_map_count`, see tests/conftest.py; keeping it out of the workers is
still right). Batch-invariance checks run in children at XLA's default optimisation level (tests/xla_test_flags.py).

Usage, first line of a test that takes pytest's `request` fixture:

    if run_in_child(request):
      return
"""

import os
import subprocess
import sys

from tests import xla_test_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENV = "DSV4_TEST_CHILD"


def run_in_child(request, timeout_s: float = 1500, default_xla_opt: bool = False) -> bool:
  """True once the test ran (and passed) in a child process; False inside that child (run the body).

  default_xla_opt: the child compiles at XLA's default optimisation level, as users run, instead of the suite's
  fast-compile level (tests/xla_test_flags.py)."""
  nodeid = request.node.nodeid
  if os.environ.get(_ENV) == nodeid:
    return False
  env = {k: v for k, v in xla_test_flags.child_env(default_xla_opt=default_xla_opt).items()
         if not k.startswith("PYTEST_XDIST")}
  env[_ENV] = nodeid
  # -m: the child runs this test whatever its tier (the default addopts deselect slow tests)
  # (xdist stays loaded, unused without -n: the suite's addopts name its --dist mode)
  proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                         "-m", "slow or not slow", nodeid],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
  out = proc.stdout[-6000:] + proc.stderr[-3000:]
  assert proc.returncode == 0, f"{nodeid} failed in its child process (exit {proc.returncode}):\n{out}"
  assert "1 passed" in proc.stdout, out  # the child really ran the test (not 0 tests, not a skip)
  return True
