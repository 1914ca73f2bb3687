"""XLA flags of the test suite: LLVM's optimisation level 0 for XLA's CPU code generation.

Why: XLA's CPU compile dominates the suite's wall time (the tiny models run in microseconds), and most of that
compile is LLVM optimising generated loops. At level 0 the suite compiles about a third faster (an engine test:
124 -> 84 CPU s) and checks the same program semantics; without fast-math, LLVM's level does not change IEEE results
beyond FMA contraction, which every tolerance in the suite covers. Checks whose claim depends on the code generator
itself (batch invariance: bitwise-equal logits whatever shares the step) run in a child process at XLA's default
level, as users run (`tests/isolation.py`, `default_xla_opt=True`). DSV4_TEST_XLA_O0=0 keeps XLA's default level
everywhere.

The suite also turns off XLA's MLIR fusion emitters on CPU (`--xla_cpu_use_fusion_emitters=false`: the older
elemental emitter): a 4-layer tiny forward compiles in 5.5 instead of 7.4 CPU seconds at level 0 (BUILD_NOTES.md,
Test suite), the same program semantics.
Only on the jaxlib line where that flag was checked (0.10.x): XLA aborts on a flag it does not know.
"""

import importlib.metadata
import os

FLAG = "--xla_backend_optimization_level=0"
_ENV = "DSV4_TEST_XLA_O0"


def _suite_flags() -> list[str]:
  flags = [FLAG]
  try:
    if importlib.metadata.version("jaxlib").startswith("0.10."):
      flags.append("--xla_cpu_use_fusion_emitters=false")
  except importlib.metadata.PackageNotFoundError:
    pass
  return flags


FLAGS = _suite_flags()


def enabled() -> bool:
  return os.environ.get(_ENV, "1") != "0"


def install() -> None:
  """Called by tests/conftest.py before JAX creates its backend (XLA reads XLA_FLAGS then)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if enabled() and "xla_backend_optimization_level" not in flags:
    os.environ["XLA_FLAGS"] = " ".join([flags] + FLAGS).strip()


def child_env(extra_flags: str = "", default_xla_opt: bool = False) -> dict:
  """Environment for a child process: the suite's flags (or XLA's default level) plus `extra_flags`."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if f not in FLAGS]
  if default_xla_opt:
    env[_ENV] = "0"
  elif enabled():
    flags += FLAGS
  flags += extra_flags.split()
  env["XLA_FLAGS"] = " ".join(flags)
  return env
