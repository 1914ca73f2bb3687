"""The one entry point the model uses for attention and indexer math.

backend: "auto" (GPU *and* a recorded validation of that kernel on this JAX version and device kind -> Pallas
kernel, otherwise the XLA reference), "xla", "pallas", "interpret" (the Pallas kernel in interpret mode, for CPU
tests). Validations live in `pallas_kernels/validations.json`, written by `benchmarks/gpu_check.sh` after the kernel
matched its reference at V4 shapes on that machine; a new JAX version or GPU needs a new check. Kernels register
themselves in `_KERNELS`: each kernel module exports a `KERNELS` dict that this module registers at import; until a
kernel exists for an op, every backend falls back to the XLA reference (the fallback always exists).

The kernels target the Pallas-Triton GPU backend (explicit `triton.CompilerParams`); see BUILD_NOTES.md, Kernels for
why and for the Mosaic GPU plan. Pools may be plain arrays or `Fp8KVPool` (V4 FP8 record) on every backend.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Callable, Literal

import jax

from pallas_kernels import indexer as _indexer
from pallas_kernels import indexer_paged as _indexer_paged
from pallas_kernels import indexer_topk as _indexer_topk
from pallas_kernels import sparse_attention as _sparse

Backend = Literal["auto", "xla", "pallas", "interpret"]


Fp8KVPool = _sparse.Fp8KVPool
quantize_kv_fp8 = _sparse.quantize_kv_fp8
dequantize_kv_fp8 = _sparse.dequantize_kv_fp8
SparseAttentionTuning = _sparse.SparseAttentionTuning
IndexerTuning = _indexer.IndexerTuning
IndexerTopkTuning = _indexer_topk.IndexerTopkTuning
Fp8PagedPool = _sparse.Fp8PagedPool
Fp8IndexKeys = _indexer_topk.Fp8IndexKeys


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  backend: Backend = "auto"
  sparse_tuning: SparseAttentionTuning | None = None  # None = kernel defaults
  indexer_tuning: IndexerTuning | None = None
  topk_tuning: IndexerTopkTuning | None = None  # the fused indexer top-k kernel


# op name -> callable(*args, interpret: bool, tuning=..., **kw). Filled by kernel modules.
_KERNELS: dict[str, Callable] = {}


def register_kernel(op: str, fn: Callable) -> None:
  _KERNELS[op] = fn


for _mod in (_sparse, _indexer, _indexer_topk):
  for _op, _fn in getattr(_mod, "KERNELS", {}).items():
    register_kernel(_op, _fn)


VALIDATIONS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "validations.json")


def _device_kind() -> str:
  return jax.devices()[0].device_kind


def load_validations(path: str = VALIDATIONS_PATH) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return json.load(f).get("validations", [])


@functools.lru_cache(maxsize=None)
def _validated(op: str, jax_version: str, device_kind: str, path: str) -> bool:
  return any(v.get("op") == op and v.get("jax") == jax_version and v.get("device") == device_kind and v.get("ok")
             for v in load_validations(path))


def is_validated(op: str, path: str = VALIDATIONS_PATH) -> bool:
  """Whether a GPU check recorded `op`'s kernel as correct on this JAX version and device kind."""
  return _validated(op, jax.__version__, _device_kind(), path)


def record_validation(op: str, ok: bool, details: dict, path: str = VALIDATIONS_PATH) -> dict:
  """Append (or replace) the record for (op, JAX version, device kind); used by benchmarks/gpu_check.sh."""
  entry = dict(op=op, jax=jax.__version__, device=_device_kind(), ok=bool(ok), **details)
  keep = [v for v in load_validations(path)
          if not (v.get("op") == op and v.get("jax") == entry["jax"] and v.get("device") == entry["device"])]
  with open(path, "w") as f:
    json.dump({"validations": keep + [entry]}, f, indent=1, sort_keys=True)
    f.write("\n")
  _validated.cache_clear()
  return entry


def _resolve(cfg: KernelConfig, op: str):
  backend = cfg.backend
  if backend == "auto":
    # A kernel nobody has run on this GPU/JAX yet stays off the default path (docs/kernels.md, Dispatch).
    backend = "pallas" if jax.default_backend() == "gpu" and op in _KERNELS and is_validated(op) else "xla"
  if backend == "xla" or op not in _KERNELS:
    return None
  return dict(interpret=(backend == "interpret"))


def uses_kernel(cfg: KernelConfig, op: str) -> bool:
  """Whether `cfg` sends `op` to a Pallas kernel (or its interpret mode) rather than the XLA reference."""
  return _resolve(cfg, op) is not None


def sparse_attention(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H, *,
                     scale: float, cfg: KernelConfig = KernelConfig(), window_len_N=None, comp_len_N=None):
  """Sparse MLA over a window pool and a compressed pool with a per-head sink -> (out_NxHxD, lse_NxH).

  sparse_attention(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD | None, comp_idx_NxK | None, sink_H, *,
                   scale, cfg=KernelConfig(), window_len_N=None, comp_len_N=None)

  window_len_N / comp_len_N: optional int32 [N], the number of valid *leading* ids of each query's window /
  compressed id row (like FlashMLA's topk_length). Ids at positions >= len are ignored exactly like -1, whatever
  they hold, and kernels stop their loops there (cost O(live ids), not O(W + K)). None = the whole row counts
  (ids < 0 or >= pool rows are always invalid). See `sparse_attention.py` for the full contract.
  """
  kw = _resolve(cfg, "sparse_attention")
  if kw is None:
    return _sparse.sparse_attention_reference(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD,
                                              comp_idx_NxK, sink_H, scale=scale, window_len_N=window_len_N,
                                              comp_len_N=comp_len_N)
  if cfg.sparse_tuning is not None:
    kw["tuning"] = cfg.sparse_tuning
  return _KERNELS["sparse_attention"](q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK,
                                      sink_H, scale=scale, window_len_N=window_len_N, comp_len_N=comp_len_N, **kw)


def indexer_scores(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM=None, *,
                   cfg: KernelConfig = KernelConfig(), num_keys_B=None):
  """Lightning-indexer scores [B, T, M] (-inf where not visible).

  indexer_scores(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM=None, *,
                 cfg=KernelConfig(), num_keys_B=None)

  num_visible_BxT: entries 0..n-1 are visible to query (b, t) (causality). num_keys_B: optional int32 [B], the
  live length of sequence b's entry list (entries >= num_keys_B[b] are invisible and never read, so kernels cost
  O(live entries)); None = all M. Visible = entry < min(num_visible, num_keys), row valid, and allowed (if given).
  """
  kw = _resolve(cfg, "indexer_scores")
  if kw is None:
    return _indexer.indexer_scores_reference(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT,
                                             allowed_BxTxM, num_keys_B)
  if cfg.indexer_tuning is not None:
    kw["tuning"] = cfg.indexer_tuning
  return _KERNELS["indexer_scores"](q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT,
                                    allowed_BxTxM, num_keys_B=num_keys_B, **kw)


def indexer_topk(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, k: int, allowed_BxTxM=None, *,
                 cfg: KernelConfig = KernelConfig(), num_keys_B=None):
  """Top-k entry ids [B, T, min(k, M)] int32 (-1 for picks that are not visible; only the set matters).

  indexer_topk(q_BxTxHxC, w_BxTxH, key_pool_PxC | Fp8IndexKeys, key_rows_BxM, num_visible_BxT, k,
               allowed_BxTxM=None, *, cfg=KernelConfig(), num_keys_B=None)

  Same arguments as `indexer_scores` plus k; the pool may be FP8 (`Fp8IndexKeys`). The fused kernel
  ("indexer_topk", `indexer_topk.py`) keeps scores on chip and writes only the k ids (per chunk of
  IndexerTopkTuning.select_chunk entries); V4.1 candidate blocks: call `indexer_topk.indexer_topk_pallas` with
  candidate_blocks_BxTxC to score only those blocks."""
  kw = _resolve(cfg, "indexer_topk")
  if kw is None:
    if isinstance(key_pool_PxC, Fp8IndexKeys):
      key_pool_PxC = _indexer_topk.dequantize_index_keys(key_pool_PxC)
    scores = indexer_scores(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM,
                            cfg=cfg, num_keys_B=num_keys_B)
    return topk_from_scores(scores, k)[0]
  if cfg.topk_tuning is not None:
    kw["tuning"] = cfg.topk_tuning
  return _KERNELS["indexer_topk"](q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, k,
                                  allowed_BxTxM, num_keys_B=num_keys_B, **kw)


topk_from_scores = _indexer.topk_from_scores

# Plain-XLA paged indexer (pallas_kernels/indexer_paged.py): block reads through the table, chunked running top-k,
# V4.1 candidates as block ids. The model's path when no indexer kernel is selected.
indexer_topk_paged = _indexer_paged.indexer_topk_paged
indexer_topk_candidates = _indexer_paged.indexer_topk_candidates
candidate_blocks = _indexer_paged.candidate_blocks
candidate_blocks_to_allowed = _indexer.candidate_blocks_to_allowed
