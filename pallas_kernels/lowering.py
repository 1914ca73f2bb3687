"""Check that a kernel lowers for a GPU without having one: jax.export(..., platforms=("cuda",)) runs the real
Pallas -> Triton (or Mosaic GPU) lowering in-process. PTX compilation and execution are not covered."""

from __future__ import annotations

import re

import jax
from jax import export

GPU_CUSTOM_CALLS = ("__gpu$xla.gpu.triton", "mosaic_gpu_v2", "mosaic_gpu", "triton_kernel_call")


def export_for_cuda(fn, *arg_specs, **static_kw):
  """Export `fn(*arg_specs, **static_kw)` for CUDA; returns the jax.export.Exported (raises if lowering fails)."""
  checks = [export.DisabledSafetyCheck.custom_call(t) for t in GPU_CUSTOM_CALLS]
  f = jax.jit(lambda *a: fn(*a, **static_kw))
  return export.export(f, platforms=("cuda",), disabled_checks=checks)(*arg_specs)


def custom_call_targets(exported) -> set[str]:
  text = exported.mlir_module()
  return set(re.findall(r"stablehlo\.custom_call @([^\s(]+)\(", text)) | set(
      re.findall(r'call_target_name = "([^"]+)"', text))
