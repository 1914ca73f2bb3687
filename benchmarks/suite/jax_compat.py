"""What differs between the jax lines the suite meets: 0.10.x on the CPU boxes, 0.11.x on the GPU image (0.11.2).

Read from jax's own change log (CHANGELOG.md and docs/pallas/CHANGELOG.md at 0.11.1's source), what changed from
0.10.2 to 0.11 that touches the suite, the engine or the kernels, and its guard:
* Python 3.11 is no longer supported (0.11 wheels need >= 3.12): nothing here needs more than 3.11, so the CPU box
  (3.11, jax 0.10.2) cannot run 0.11 at all; the suite is written to both.
* Removed from `jax.core`: `concrete_or_error`, `is_concrete`, `DebugInfo`, `new_jaxpr_eqn` and about thirty more;
  from `jax.interpreters.pxla`: `MeshExecutable`, `Index`, ...: the suite, the engine, the cache and the kernels
  reach no `jax.core`, `jax.interpreters` or `jax._src` name (`REMOVED_MODULES`; tests/test_gpu_suite.py scans
  every module the suite runs, imports and attribute chains).
* `jax.numpy.empty` / `empty_like` now return uninitialized memory (zeros before): none of that code calls them
  (`UNINITIALIZED`, the same scan).
* Pallas-Triton is deprecated (still shipped) and its lowering reads the target GPU from the device: the kernel
  modules guard the import (dispatch falls back to XLA); a kernel that fails to lower or compile is an `error` row,
  never a crash. `pallas.kernel` now aliases only refs it writes: no kernel here uses `pallas.kernel`.
* The options the suite sets (`jax_compilation_cache_dir`, `jax_persistent_cache_min_compile_time_secs`,
  `jax_persistent_cache_min_entry_size_bytes`) exist in both lines; `set_config` still applies an option only where
  this jax has it and the report names any that did not apply, instead of raising.
* XLA aborts on a flag it does not know: the CPU dry run's `--xla_cpu_use_fusion_emitters=false` is passed only on
  jaxlib 0.10.x (`cpu_dry_run_xla_flags`), as the test suite does.
* `Compiled.cost_analysis()` returns a dict on newer lines and a one-element list on older ones
  (benchmarks/support/timing.py, `xla_cost`); `Device.memory_stats()` may return None (`memory_stats`).
"""

from __future__ import annotations

import importlib.metadata
import os

import jax

# Modules whose names the suite's code must not reach (imports and attribute chains): `jax.core` (helpers removed in
# 0.11), jax's internals and the interpreters (no compatibility promise across lines).
REMOVED_MODULES = ("jax.core.", "jax._src.", "jax.interpreters.")
# Calls whose meaning changed in 0.11 (zeros before, uninitialized memory now).
UNINITIALIZED = ("jnp.empty", "jnp.empty_like", "jax.numpy.empty", "jax.numpy.empty_like")


def version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def cpu_dry_run_xla_flags(existing: str = "") -> str:
  """XLA_FLAGS for the CPU dry run: LLVM level 0 (compile time is most of a CPU run; same semantics) and, on jaxlib
  0.10.x only, the older CPU emitter. Leaves a level already given alone."""
  if "xla_backend_optimization_level" in existing:
    return existing
  flags = [existing, "--xla_backend_optimization_level=0"]
  if (version("jaxlib") or "").startswith("0.10."):
    flags.append("--xla_cpu_use_fusion_emitters=false")
  return " ".join(f for f in flags if f).strip()


def set_config(name: str, value) -> bool:
  """jax.config.update(name, value) when this jax knows the option; False (nothing raised) when it does not."""
  try:
    jax.config.update(name, value)
    return True
  except (AttributeError, KeyError, ValueError, TypeError):
    return False


def enable_persistent_cache(cache_dir: str) -> dict:
  """The persistent compilation cache in `cache_dir`, every program cached (no minimum compile time or size).
  Returns which options applied."""
  os.makedirs(cache_dir, exist_ok=True)
  applied = {}
  for name, value in (("jax_compilation_cache_dir", cache_dir), ("jax_persistent_cache_min_compile_time_secs", 0.0),
                      ("jax_persistent_cache_min_entry_size_bytes", -1)):
    applied[name] = set_config(name, value)
  return applied


def memory_stats(device) -> dict:
  try:
    return dict(device.memory_stats() or {})
  except Exception:  # noqa: BLE001 - not every backend reports memory
    return {}
