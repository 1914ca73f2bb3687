"""The one entry point the model uses for attention and indexer math.

backend: "auto" (GPU -> Pallas kernel, otherwise the XLA reference), "xla", "pallas", "interpret" (the Pallas kernel
in interpret mode, for CPU tests). Kernels register themselves in `_KERNELS`: each kernel module exports a `KERNELS`
dict that this module registers at import; until a kernel exists for an op, every backend falls back to the XLA
reference (the fallback always exists).

The kernels target the Pallas-Triton GPU backend (explicit `triton.CompilerParams`); see NOTES.md for why and for
the Mosaic GPU plan. Pools may be plain arrays or `Fp8KVPool` (V4 FP8 record) on every backend.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import jax

from pallas_kernels import indexer as _indexer
from pallas_kernels import sparse_attention as _sparse

Backend = Literal["auto", "xla", "pallas", "interpret"]


Fp8KVPool = _sparse.Fp8KVPool
quantize_kv_fp8 = _sparse.quantize_kv_fp8
dequantize_kv_fp8 = _sparse.dequantize_kv_fp8
SparseAttentionTuning = _sparse.SparseAttentionTuning
IndexerTuning = _indexer.IndexerTuning


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  backend: Backend = "auto"
  sparse_tuning: SparseAttentionTuning | None = None  # None = kernel defaults
  indexer_tuning: IndexerTuning | None = None


# op name -> callable(*args, interpret: bool, tuning=..., **kw). Filled by kernel modules.
_KERNELS: dict[str, Callable] = {}


def register_kernel(op: str, fn: Callable) -> None:
  _KERNELS[op] = fn


for _mod in (_sparse, _indexer):
  for _op, _fn in getattr(_mod, "KERNELS", {}).items():
    register_kernel(_op, _fn)


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
  if cfg.sparse_tuning is not None:
    kw["tuning"] = cfg.sparse_tuning
  return _KERNELS["sparse_attention"](q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK,
                                      sink_H, scale=scale, **kw)


def indexer_scores(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM=None, *,
                   cfg: KernelConfig = KernelConfig()):
  kw = _resolve(cfg, "indexer_scores")
  if kw is None:
    return _indexer.indexer_scores_reference(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT,
                                             allowed_BxTxM)
  if cfg.indexer_tuning is not None:
    kw["tuning"] = cfg.indexer_tuning
  return _KERNELS["indexer_scores"](q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT,
                                    allowed_BxTxM, **kw)


topk_from_scores = _indexer.topk_from_scores
