"""Suite-wide settings.

XLA's CPU compile of the tiny model's programs dominates the suite's wall time, and many tests compile the very same
programs (same config, same shapes) in different modules and in both xdist workers. A persistent compilation cache
shared by the workers of one run compiles each of them once. The directory is fresh for every run (made by the
controller, inherited by the workers), so no state leaks between runs and CI starts from nothing, as a user
would. Tests that count compilations create their own engines and count backend compiles; a cache hit is not a
compile, so their upper bounds still hold. Set DSV4_TEST_JAX_CACHE=0 to compile everything afresh.

Memory maps. Every live XLA CPU executable holds about 18 memory mappings (its JIT-linked code and data sections).
A test worker keeps thousands of executables alive (the jit caches of module-level functions), and when the process
reaches the kernel's `vm.max_map_count` (65530 by default) LLVM's next allocation fails ("LLVM compilation error:
Cannot allocate memory") and XLA segfaults: the worker crashes that CI saw at random tests late in a run
(`python -m benchmarks.probes.map_count_probe --to_limit` reproduces it outside pytest). So after each test, a worker whose
map count passes `_MAP_SOFT_LIMIT` drops JAX's in-memory caches (programs still referenced by live objects stay; the
next use of a dropped program recompiles it, or reloads it from the persistent cache).

XLA flags: see tests/xla_test_flags.py (LLVM optimisation level 0 for the suite's compiles).

Hypothesis: the "ci" profile (default) derandomizes, so a run is reproducible and a failure reruns the same way;
DSV4_HYPOTHESIS=fresh draws new examples each run (and prints the blob to reproduce a failure).

Orphans: a run fails if a process it started outlives it (tests/orphans.py, a plugin loaded here).

Tiers: `slow` and `matrix` (registered in pyproject.toml, --strict-markers); the default run deselects both, CI runs
`slow` after the default run, `matrix` runs on demand. Which tests are slow, which run only on demand (beyond CI's
budget), and what covers each feature in the tiers CI runs instead, is listed in tests/slow_tier.py.
"""

import gc
import os
import shutil
import tempfile

import hypothesis
import jax
import pytest

from tests import xla_test_flags
from tests.slow_tier import ON_DEMAND, SLOW

xla_test_flags.install()  # before any test touches a device: XLA reads XLA_FLAGS when JAX creates its backend

pytest_plugins = ("tests.orphans",)


hypothesis.settings.register_profile("ci", derandomize=True, print_blob=True)
hypothesis.settings.register_profile("fresh", derandomize=False, print_blob=True)
hypothesis.settings.load_profile(os.environ.get("DSV4_HYPOTHESIS", "ci"))


def _map_soft_limit(headroom: int = 20000) -> int:
  """The kernel's `vm.max_map_count` less `headroom` (a single test adds at most a few thousand maps): each drop
  costs its teardown seconds and the dropped programs' reloads, so a worker drops as late as is safe."""
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return max(int(f.read()) - headroom, headroom)
  except (OSError, ValueError):
    return 30000


_MAP_SOFT_LIMIT = _map_soft_limit()
_ENV = "DSV4_TEST_XLA_CACHE_DIR"
_made_here = False


def pytest_configure(config):
  if os.environ.get("DSV4_TEST_JAX_CACHE", "1") == "0":
    return
  global _made_here
  if not os.environ.get(_ENV):
    # the controller (or a plain run) makes the run's directory; xdist workers and child test processes
    # (tests/isolation.py) inherit it through the environment
    os.environ[_ENV] = tempfile.mkdtemp(prefix="dsv4-test-xla-cache-")
    _made_here = True
  jax.config.update("jax_compilation_cache_dir", os.environ[_ENV])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.hookimpl(tryfirst=True)   # before pytest's own -m / -k deselection
def pytest_collection_modifyitems(config, items):
  matched = set()
  for item in items:
    base = item.nodeid.split("[", 1)[0]
    for key in (item.nodeid, base, base.split("::", 1)[0]):   # a test, all its parameters, or a whole file
      if key in ON_DEMAND:
        item.add_marker(pytest.mark.matrix)
        matched.add(key)
        if item.get_closest_marker("slow") is not None:
          raise pytest.UsageError(f"{item.nodeid}: marked slow in its file and listed on demand in "
                                  "tests/slow_tier.py (CI's `-m slow` would still run it)")
        break
      if key in SLOW:
        item.add_marker(pytest.mark.slow)
        matched.add(key)
  if any("::" in str(a) for a in config.args):
    return                     # a run of chosen tests: entries of the same files need not be collected
  files = {item.nodeid.split("::", 1)[0] for item in items}
  stale = sorted(k for k in (*SLOW, *ON_DEMAND) if k.split("::", 1)[0] in files and k not in matched)
  if stale:
    raise pytest.UsageError(f"tests/slow_tier.py names tests that do not exist: {stale}")


def pytest_unconfigure(config):
  if _made_here:
    shutil.rmtree(os.environ.pop(_ENV), ignore_errors=True)


def memory_map_count() -> int:
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux: no such limit to guard
    return 0


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
  if memory_map_count() > _MAP_SOFT_LIMIT:
    gc.collect()
    jax.clear_caches()
    gc.collect()
