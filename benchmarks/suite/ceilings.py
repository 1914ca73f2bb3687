"""(a) What this device is and what it can do at best: versions, the device-to-device copy bandwidth and a bf16
matmul rate. Every later percentage is taken against these measured ceilings (beside the datasheet's)."""

from __future__ import annotations

import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.suite import jax_compat


def versions() -> dict:
  dev = jax.devices()[0]
  row = dict(python=sys.version.split()[0], jax=jax.__version__, jaxlib=jax_compat.version("jaxlib"),
             jax_cuda_plugin=jax_compat.version("jax-cuda12-plugin") or jax_compat.version("jax-cuda13-plugin"),
             triton=jax_compat.version("triton"), backend=jax.default_backend(), device=dev.device_kind,
             num_devices=jax.device_count(), compute_capability=getattr(dev, "compute_capability", None))
  row["memory_gib"] = round(jax_compat.memory_stats(dev).get("bytes_limit", 0) / 2 ** 30, 1) or None
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    row["nvidia_smi"] = out or None
  except (OSError, subprocess.SubprocessError):
    row["nvidia_smi"] = None
  return row


def _best_s(fn, args, repeats: int, inner: int) -> float:
  """Seconds per call: best over `repeats` of `inner` back-to-back calls (one sync at the end)."""
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - t0) / inner)
  return best


def copy_bandwidth(mib: int, repeats: int = 5, inner: int = 10) -> dict:
  """Device-to-device copy: read + write of a `mib` MiB buffer; GB/s = 2 x bytes / time."""
  n = mib * 2 ** 20 // 4
  x = jnp.arange(n, dtype=jnp.float32)
  copy = jax.jit(lambda a: a + 1.0).lower(x).compile()       # a copy XLA cannot elide (one read, one write)
  s = _best_s(copy, (x,), repeats, inner)
  return dict(copy_mib=mib, copy_ms=s * 1e3, copy_gbps=2 * n * 4 / s / 1e9)


def matmul_rate(n: int, repeats: int = 5, inner: int = 10) -> dict:
  """bf16 n x n x n matmul (f32 accumulate, bf16 out): TFLOP/s = 2 n^3 / time."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  a = jax.random.normal(k1, (n, n), jnp.bfloat16)
  b = jax.random.normal(k2, (n, n), jnp.bfloat16)
  mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
  s = _best_s(mm.lower(a, b).compile(), (a, b), repeats, inner)
  return dict(matmul_n=n, matmul_ms=s * 1e3, matmul_tflops=2 * n ** 3 / s / 1e12)
