"""The one entry point the model uses for attention and indexer math.

backend: "auto" (GPU -> Pallas kernel, otherwise the XLA reference), "xla", "pallas", "interpret" (the Pallas kernel
in interpret mode, for CPU tests). Kernels register themselves in `_KERNELS`; until a kernel exists for an op, every
backend falls back to the XLA reference (the fallback always exists).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import jax

from pallas_kernels import indexer as _indexer
from pallas_kernels import sparse_attention as _sparse

Backend = Literal["auto", "xla", "pallas", "interpret"]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  backend: Backend = "auto"


# op name -> callable(*args, interpret: bool, **kw). Filled by kernel modules.
_KERNELS: dict[str, Callable] = {}


def register_kernel(op: str, fn: Callable) -> None:
  _KERNELS[op] = fn


def _resolve(cfg: KernelConfig, op: str):
  backend = cfg.backend
  if backend == "auto":
    backend = "pallas" if jax.default_backend() == "gpu" else "xla"
  if backend == "xla" or op not in _KERNELS:
    return None
  return dict(interpret=(backend == "interpret"))


def sparse_attention(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H, *,
                     scale: float, cfg: KernelConfig = KernelConfig()):
  kw = _resolve(cfg, "sparse_attention")
  if kw is None:
    return _sparse.sparse_attention_reference(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD,
                                              comp_idx_NxK, sink_H, scale=scale)
  return _KERNELS["sparse_attention"](q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK,
                                      sink_H, scale=scale, **kw)


def indexer_scores(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM=None, *,
                   cfg: KernelConfig = KernelConfig()):
  kw = _resolve(cfg, "indexer_scores")
  if kw is None:
    return _indexer.indexer_scores_reference(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT,
                                             allowed_BxTxM)
  return _KERNELS["indexer_scores"](q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT,
                                    allowed_BxTxM, **kw)


topk_from_scores = _indexer.topk_from_scores
