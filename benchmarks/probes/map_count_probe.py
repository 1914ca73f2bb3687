"""Memory mappings held by live XLA CPU executables, and what happens at the kernel's `vm.max_map_count`.

Compiles distinct small jitted programs, keeps them alive, and prints the process's map count as it grows; then
drops JAX's caches and prints it again. With `--to_limit` it keeps compiling in a child process until the map count
reaches `vm.max_map_count` and reports how the child ended (on jax 0.10.2 / Linux: "LLVM compilation error: Cannot
allocate memory", then SIGSEGV, exit -11). This is why the test suite drops JAX's caches when a worker's map count
gets high (tests/conftest.py).

    python -m benchmarks.probes.map_count_probe [--programs=200] [--to_limit]
"""

import gc
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags

flags.DEFINE_integer("programs", 200, "programs compiled and kept alive in the measuring run")
flags.DEFINE_bool("to_limit", False, "also compile in a child process until vm.max_map_count (expects a crash)")
flags.DEFINE_bool("child", False, "internal: run the to-the-limit loop in this process")
FLAGS = flags.FLAGS


def map_count() -> int:
  with open("/proc/self/maps", "rb") as f:
    return sum(1 for _ in f)


def max_map_count() -> int:
  with open("/proc/sys/vm/max_map_count") as f:
    return int(f.read())


def _compile_distinct(i: int):
  fn = jax.jit(lambda x: jnp.sin(x * i) + jnp.cumsum(x) * i)
  fn(jnp.ones(16 + i)).block_until_ready()  # a new shape and constant per i: a new executable
  return fn


def _to_limit_child():
  limit = max_map_count()
  keep, t0 = [], time.time()
  for i in range(10 * limit):
    keep.append(_compile_distinct(i))
    if i % 500 == 0:
      print(f"child: {i} programs alive, {map_count()} maps of {limit}, {time.time() - t0:.0f} s", flush=True)
  print("child: never reached the limit", flush=True)


def main(_):
  if FLAGS.child:
    _to_limit_child()
    return
  base = map_count()
  print(f"vm.max_map_count = {max_map_count()}; maps at start (after importing jax) = {base}")
  keep = []
  for i in range(FLAGS.programs):
    keep.append(_compile_distinct(i))
  grown = map_count() - base
  per = grown / FLAGS.programs
  print(f"{FLAGS.programs} live executables: +{grown} maps, {per:.1f} per executable; "
        f"the limit is reached near {int((max_map_count() - base) / per)} live executables")
  del keep
  gc.collect()
  jax.clear_caches()
  gc.collect()
  print(f"after jax.clear_caches(): +{map_count() - base} maps")
  if FLAGS.to_limit:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.probes.map_count_probe", "--child"], capture_output=True,
                          text=True)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    progress = [l for l in lines if l.startswith("child:")][-1:]
    errors = [l for l in lines if "LLVM" in l or "Fatal" in l]
    print("\n".join(progress + errors[:1] + errors[-1:]))
    print(f"child exit code: {proc.returncode}")


if __name__ == "__main__":
  app.run(main)
