"""Check that a kernel lowers for a GPU without having one: jax.export(..., platforms=("cuda",)) runs the real
Pallas -> Triton (or Mosaic GPU) lowering in-process. PTX compilation and execution are not covered.

Off a GPU the lowering needs a target GPU. JAX 0.10 falls back to compute capability 9.0 by itself; JAX 0.11 reads
the target from the abstract mesh's `AbstractDevice` (jax._src.pallas.triton.gpu_info: "please specify an abstract
GPU device using AbstractDevice") and raises without one, so `export_for_cuda` lowers under
`jax.sharding.use_abstract_mesh` with an H200 abstract device (compute capability 9.0 on both versions; Mosaic GPU
infers 9.0 from an abstract device either way). A JAX where neither works raises `NoGpuTarget`; tests skip on it.
"""

from __future__ import annotations

import contextlib
import re

import jax
from jax import export

GPU_CUSTOM_CALLS = ("__gpu$xla.gpu.triton", "mosaic_gpu_v2", "mosaic_gpu", "triton_kernel_call")
TARGET_DEVICE_KIND = "NVIDIA H200"  # the GPU the kernels are tuned for (132 SMs, compute capability 9.0)


class NoGpuTarget(RuntimeError):
  """This JAX cannot lower a GPU kernel here: no GPU and no usable abstract GPU device."""


def abstract_gpu_target(device_kind: str = TARGET_DEVICE_KIND, num_cores: int = 132):
  """A context in which lowering targets `device_kind` without the device (a 1-device abstract mesh carrying an
  AbstractDevice); a no-op on a GPU backend, or where this JAX has no AbstractDevice."""
  sh = jax.sharding
  if jax.default_backend() == "gpu" or not all(
      hasattr(sh, n) for n in ("AbstractDevice", "AbstractMesh", "use_abstract_mesh", "AxisType")):
    return contextlib.nullcontext()
  device = sh.AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="gpu")
  mesh = sh.AbstractMesh((1,), ("_gpu_target",), (sh.AxisType.Auto,), abstract_device=device)
  return sh.use_abstract_mesh(mesh)


def export_for_cuda(fn, *arg_specs, **static_kw):
  """Export `fn(*arg_specs, **static_kw)` for CUDA; returns the jax.export.Exported (raises if lowering fails;
  `NoGpuTarget` if this JAX cannot target a GPU without one)."""
  checks = [export.DisabledSafetyCheck.custom_call(t) for t in GPU_CUSTOM_CALLS]
  f = jax.jit(lambda *a: fn(*a, **static_kw))
  try:
    with abstract_gpu_target():
      return export.export(f, platforms=("cuda",), disabled_checks=checks)(*arg_specs)
  except RuntimeError as e:
    if "No supported GPU devices found" in str(e) or "abstract GPU" in str(e):
      raise NoGpuTarget(f"jax {jax.__version__} cannot lower for a GPU without one here: {e}") from e
    raise


def custom_call_targets(exported) -> set[str]:
  text = exported.mlir_module()
  return set(re.findall(r"stablehlo\.custom_call @([^\s(]+)\(", text)) | set(
      re.findall(r'call_target_name = "([^"]+)"', text))
