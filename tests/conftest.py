"""Suite-wide settings.

XLA's CPU compile of the tiny model's programs dominates the suite's wall time, and many tests compile the very same
programs (same config, same shapes) in different modules and in both xdist workers. A persistent compilation cache
shared by the workers of one run compiles each of them once. The directory is fresh for every run (made by the
controller, inherited by the workers), so no state leaks between runs and CI starts from nothing, as a user
would. Tests that count compilations create their own engines and count backend compiles; a cache hit is not a
compile, so their upper bounds still hold. Set DSV4_TEST_JAX_CACHE=0 to compile everything afresh.
"""

import os
import shutil
import tempfile

import jax
import pytest


_MAP_SOFT_LIMIT = 30000  # half of the usual vm.max_map_count: a single test adds at most a few thousand
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
