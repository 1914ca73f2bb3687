"""The one entry point the model uses for attention and indexer math.

backend: "auto" (the default), "xla", "pallas", "interpret" (the Pallas kernel in interpret mode, for CPU tests).
"auto" is the XLA reference off a GPU. On a GPU it validates a kernel the first time an op is dispatched with a given
input structure (shapes, dtypes, pool layout), tuning and static arguments: the kernel and its XLA reference run
eagerly (outside the trace that asked) on random inputs of exactly those shapes and are compared within the op's
tolerance; the verdict is cached per process (`validation_verdicts`, `clear_validations`). A kernel that fails (wrong
answer, or an error while lowering or running) is reported once per key with a `RuntimeWarning` and that call site
uses the XLA reference. Kernels register themselves in `_KERNELS`: each kernel module exports a `KERNELS` dict that
this module registers at import; an op without a kernel falls back to the XLA reference on every backend.

The kernels target the Pallas-Triton GPU backend (explicit `triton.CompilerParams`); see BUILD_NOTES.md, Kernels for
why and for the Mosaic GPU plan. Pools may be plain arrays or FP8 pools (`Fp8KVPool`, `Fp8PagedPool`; FP8 index keys
`Fp8IndexKeys`) on every backend.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import warnings
from typing import Any, Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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


# ----------------------------------------------------------------------------------------------------------------
# "auto": validate each kernel once per process at the shapes it is called with
# ----------------------------------------------------------------------------------------------------------------

# (op, tuning, input structure and shapes / dtypes, static arguments) -> verdict (True: the kernel matched its
# reference). Filled the first time `auto` meets a key on a GPU; `clear_validations` empties it.
_VERDICTS: dict[tuple, bool] = {}
_WARNED: set[tuple] = set()


class SparseArgs(NamedTuple):
  """The array arguments of one `sparse_attention` call, by name (a pytree; pools may be FP8 pools). Its static
  argument (`scale`) travels beside it in a dict."""
  q_NxHxD: Any
  window_pool_PxD: Any
  window_idx_NxW: Any
  comp_pool_QxD: Any
  comp_idx_NxK: Any
  sink_H: Any
  window_len_N: Any = None
  comp_len_N: Any = None


class IndexerArgs(NamedTuple):
  """The array arguments of one `indexer_scores` / `indexer_topk` call, by name (candidate blocks: top-k only).
  Static arguments (`k`, `block_size`) travel beside it in a dict."""
  q_BxTxHxC: Any
  w_BxTxH: Any
  key_pool_PxC: Any
  key_rows_BxM: Any
  num_visible_BxT: Any
  allowed_BxTxM: Any = None
  num_keys_B: Any = None
  candidate_blocks_BxTxC: Any = None


class _OpCheck(NamedTuple):
  """How `auto` validates one op's kernel (see `_validate`)."""
  random_inputs: Callable   # (abstract args, static, key) -> random args of that structure, shapes and dtypes
  reference: Callable       # (args, static) -> what the kernel's output is compared against
  err_over_tol: Callable    # (kernel output, reference output, args, static) -> max error / tolerance


_CHECKS: dict[str, _OpCheck] = {}   # op -> its check; filled below the ops


def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def clear_validations() -> None:
  """Forget every verdict (and which failures were reported): the next `auto` dispatch validates again."""
  _VERDICTS.clear()
  _WARNED.clear()


def validation_verdicts() -> dict[tuple, bool]:
  """A copy of this process's verdicts: key (op, tuning, input structure, static arguments) -> kernel used."""
  return dict(_VERDICTS)


def _abstract(x):
  return (tuple(x.shape), jnp.dtype(x.dtype).name)


def _key(cfg: KernelConfig, op: str, args: tuple, static: dict) -> tuple:
  leaves, tree = jax.tree_util.tree_flatten(args)
  return (op, _tuning(cfg, op), tree, tuple(_abstract(x) for x in leaves), tuple(sorted(static.items())))


def _tuning(cfg: KernelConfig, op: str):
  return {"sparse_attention": cfg.sparse_tuning, "indexer_scores": cfg.indexer_tuning,
          "indexer_topk": cfg.topk_tuning}.get(op)


def _validate(cfg: KernelConfig, op: str, args: tuple, static: dict) -> bool:
  """Run `op`'s kernel and its XLA reference on random inputs with exactly the structure, shapes and dtypes of
  `args` (tracers are fine: only their shapes are read), eagerly, outside any trace; cache the verdict per process.
  A failure (wrong answer, or an error while lowering / running) is reported once per key and means XLA."""
  key = _key(cfg, op, args, static)
  if key in _VERDICTS:
    return _VERDICTS[key]
  op_check = _CHECKS[op]
  abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)

  def check():
    with jax.transfer_guard("allow"):
      inputs = op_check.random_inputs(abstract, static, jax.random.PRNGKey(0))
      got = _call_kernel(cfg, op, inputs, static, interpret=False)
      want = op_check.reference(inputs, static)
      return float(op_check.err_over_tol(jax.device_get(got), jax.device_get(want), inputs, static))

  why = ""
  t0 = time.perf_counter()
  try:
    # A fresh thread has no enclosing trace (JAX's trace state is per thread): everything there runs eagerly.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      err = pool.submit(check).result()
    ok = err <= 1.0  # NaN is not <= 1
    if not ok:
      why = f"max error / tolerance {err:.3g}"
  except Exception as e:  # noqa: BLE001 - a kernel that cannot lower or run at these shapes falls back too
    ok, why = False, f"{type(e).__name__}: {str(e)[:300]}"
  _VERDICTS[key] = ok
  if not ok and key not in _WARNED:
    _WARNED.add(key)
    shapes = ", ".join("x".join(map(str, s)) + f" {d}" for s, d in key[3])
    warnings.warn(f"dispatch: the {op!r} Pallas kernel did not match its XLA reference at ({shapes}) "
                  f"{dict(static)} on {jax.devices()[0].device_kind} ({why}); using the XLA reference for it "
                  f"(validated in {time.perf_counter() - t0:.1f} s)", RuntimeWarning, stacklevel=3)
  return ok


def _resolve(cfg: KernelConfig, op: str, args: tuple | None = None, static: dict | None = None):
  """None = the XLA reference; else the kernel's keyword arguments (interpret, tuning).

  `auto`: XLA off a GPU; on a GPU the kernel once it has matched its reference at these shapes (validated here the
  first time; without `args` nothing can be validated and the answer is XLA)."""
  backend = cfg.backend
  if op not in _KERNELS or backend == "xla":
    return None
  if backend == "auto":
    if not _on_gpu() or args is None or not _validate(cfg, op, args, static or {}):
      return None
    backend = "pallas"
  kw = dict(interpret=(backend == "interpret"))
  if _tuning(cfg, op) is not None:
    kw["tuning"] = _tuning(cfg, op)
  return kw


def uses_kernel(cfg: KernelConfig, op: str, *args, **static) -> bool:
  """Whether `cfg` sends `op` called with these arguments (the op's own signature, without cfg) to a Pallas
  kernel (or its interpret mode) rather than the XLA reference. `auto` on a GPU validates the kernel at these
  shapes first (once per process); without arguments `auto` answers False."""
  if args:
    args, static = _OP_ARGS[op](*args, **static)
  return _resolve(cfg, op, args or None, static) is not None


def _call_kernel(cfg, op, inputs, static, interpret):
  kw = dict(interpret=interpret)
  if _tuning(cfg, op) is not None:
    kw["tuning"] = _tuning(cfg, op)
  return _RUN[op](_KERNELS[op], inputs, static, kw)


def _sparse_args(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H, *, scale: float,
                 window_len_N=None, comp_len_N=None):
  return (SparseArgs(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H,
                     window_len_N=window_len_N, comp_len_N=comp_len_N), dict(scale=float(scale)))


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
  args, static = _sparse_args(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H,
                              scale=scale, window_len_N=window_len_N, comp_len_N=comp_len_N)
  kw = _resolve(cfg, "sparse_attention", args, static)
  if kw is None:
    return _sparse_reference(args, static)
  return _RUN["sparse_attention"](_KERNELS["sparse_attention"], args, static, kw)


def _scores_args(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM=None, *,
                 num_keys_B=None):
  return IndexerArgs(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM,
                     num_keys_B=num_keys_B), {}


def indexer_scores(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM=None, *,
                   cfg: KernelConfig = KernelConfig(), num_keys_B=None):
  """Lightning-indexer scores [B, T, M] (-inf where not visible).

  indexer_scores(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM=None, *,
                 cfg=KernelConfig(), num_keys_B=None)

  num_visible_BxT: entries 0..n-1 are visible to query (b, t) (causality). num_keys_B: optional int32 [B], the
  live length of sequence b's entry list (entries >= num_keys_B[b] are invisible and never read, so kernels cost
  O(live entries)); None = all M. Visible = entry < min(num_visible, num_keys), row valid, and allowed (if given).
  """
  args, static = _scores_args(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM,
                              num_keys_B=num_keys_B)
  kw = _resolve(cfg, "indexer_scores", args, static)
  if kw is None:
    return _scores_reference(args, static)
  return _RUN["indexer_scores"](_KERNELS["indexer_scores"], args, static, kw)


def _topk_args(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, k: int, allowed_BxTxM=None, *,
               num_keys_B=None, candidate_blocks_BxTxC=None, block_size: int = 8):
  return (IndexerArgs(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM,
                      num_keys_B=num_keys_B, candidate_blocks_BxTxC=candidate_blocks_BxTxC),
          dict(k=int(k), block_size=int(block_size)))


def indexer_topk(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, k: int, allowed_BxTxM=None, *,
                 cfg: KernelConfig = KernelConfig(), num_keys_B=None, candidate_blocks_BxTxC=None,
                 block_size: int = 8):
  """Top-k entry ids [B, T, min(k, M)] int32 (-1 for picks that are not visible; only the set matters).

  indexer_topk(q_BxTxHxC, w_BxTxH, key_pool_PxC | Fp8IndexKeys, key_rows_BxM, num_visible_BxT, k,
               allowed_BxTxM=None, *, cfg=KernelConfig(), num_keys_B=None, candidate_blocks_BxTxC=None,
               block_size=8)

  Same arguments as `indexer_scores` plus k; the pool may be FP8 (`Fp8IndexKeys`); V4.1 candidate blocks
  (`candidate_blocks_BxTxC`, block ids of `block_size` entries, -1 = none) restrict the picks to those blocks. The
  fused kernel ("indexer_topk", `indexer_topk.py`) keeps scores on chip and writes only the k ids (per chunk of
  IndexerTopkTuning.select_chunk entries) and scores only the candidate blocks' entries when given; the XLA
  reference is the reference scores (FP8 keys dequantized, candidates as a mask) and `topk_from_scores`."""
  args, static = _topk_args(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, k, allowed_BxTxM,
                            num_keys_B=num_keys_B, candidate_blocks_BxTxC=candidate_blocks_BxTxC,
                            block_size=block_size)
  kw = _resolve(cfg, "indexer_topk", args, static)
  if kw is None:
    return _topk_reference(args, static)
  return _RUN["indexer_topk"](_KERNELS["indexer_topk"], args, static, kw)


def _sparse_reference(a: SparseArgs, static: dict):
  return _sparse.sparse_attention_reference(a.q_NxHxD, a.window_pool_PxD, a.window_idx_NxW, a.comp_pool_QxD,
                                            a.comp_idx_NxK, a.sink_H, scale=static["scale"],
                                            window_len_N=a.window_len_N, comp_len_N=a.comp_len_N)


def _scores_reference(a: IndexerArgs, static: dict):
  return _indexer.indexer_scores_reference(a.q_BxTxHxC, a.w_BxTxH, a.key_pool_PxC, a.key_rows_BxM, a.num_visible_BxT,
                                           a.allowed_BxTxM, a.num_keys_B)


def _topk_reference(a: IndexerArgs, static: dict):
  return _indexer_topk.indexer_topk_reference(a.q_BxTxHxC, a.w_BxTxH, a.key_pool_PxC, a.key_rows_BxM,
                                              a.num_visible_BxT, static["k"], a.allowed_BxTxM, a.num_keys_B,
                                              a.candidate_blocks_BxTxC, static["block_size"])


def _topk_check_scores(a: IndexerArgs, static: dict):
  """The reference scores the top-k is checked against (FP8 keys dequantized, candidates as a mask)."""
  pool, allowed = a.key_pool_PxC, a.allowed_BxTxM
  if isinstance(pool, Fp8IndexKeys):
    pool = _indexer_topk.dequantize_index_keys(pool)
  if a.candidate_blocks_BxTxC is not None:
    mask = _indexer.candidate_blocks_to_allowed(a.candidate_blocks_BxTxC, a.key_rows_BxM.shape[1],
                                                static["block_size"])
    allowed = mask if allowed is None else allowed & mask
  return _indexer.indexer_scores_reference(a.q_BxTxHxC, a.w_BxTxH, pool, a.key_rows_BxM, a.num_visible_BxT, allowed,
                                           a.num_keys_B)


# How each op calls its registered kernel (the entry points' signatures: the op's own, without cfg).

def _run_sparse_kernel(kernel: Callable, a: SparseArgs, static: dict, kw: dict):
  return kernel(a.q_NxHxD, a.window_pool_PxD, a.window_idx_NxW, a.comp_pool_QxD, a.comp_idx_NxK, a.sink_H,
                scale=static["scale"], window_len_N=a.window_len_N, comp_len_N=a.comp_len_N, **kw)


def _run_scores_kernel(kernel: Callable, a: IndexerArgs, static: dict, kw: dict):
  return kernel(a.q_BxTxHxC, a.w_BxTxH, a.key_pool_PxC, a.key_rows_BxM, a.num_visible_BxT, a.allowed_BxTxM,
                num_keys_B=a.num_keys_B, **kw)


def _run_topk_kernel(kernel: Callable, a: IndexerArgs, static: dict, kw: dict):
  return kernel(a.q_BxTxHxC, a.w_BxTxH, a.key_pool_PxC, a.key_rows_BxM, a.num_visible_BxT, static["k"],
                a.allowed_BxTxM, num_keys_B=a.num_keys_B, candidate_blocks_BxTxC=a.candidate_blocks_BxTxC,
                block_size=static["block_size"], **kw)


_OP_ARGS = {"sparse_attention": _sparse_args, "indexer_scores": _scores_args, "indexer_topk": _topk_args}
_RUN = {"sparse_attention": _run_sparse_kernel, "indexer_scores": _run_scores_kernel,
        "indexer_topk": _run_topk_kernel}


# Random inputs with the structure, shapes and dtypes of the call (values inside each argument's contract).

def _normal(key, a, scale=1.0):
  return (jax.random.normal(key, a.shape, jnp.float32) * scale).astype(a.dtype)


def _ints(key, a, lo, hi):
  return jax.random.randint(key, a.shape, lo, max(hi, lo + 1), jnp.int32).astype(a.dtype)


def _random_pool(key, pool):
  if isinstance(pool, Fp8KVPool):
    P, R = pool.nope.shape[0], pool.rope.shape[1]
    out = quantize_kv_fp8(jax.random.normal(key, (P, pool.nope.shape[1] + R), jnp.float32), R)
  elif isinstance(pool, Fp8PagedPool):
    rows = pool.pages.shape[0] * pool.page_size
    rec = quantize_kv_fp8(jax.random.normal(key, (rows, pool.nope_dim + pool.rope_dim), jnp.float32), pool.rope_dim)
    out = _sparse.record_to_paged(rec, pool.page_size)
  elif isinstance(pool, Fp8IndexKeys):
    out = _indexer_topk.quantize_index_keys(jax.random.normal(key, pool.keys.shape, jnp.float32))
  else:
    return _normal(key, pool)
  got, want = jax.tree_util.tree_structure(out), jax.tree_util.tree_structure(pool)
  if got != want or [_abstract(x) for x in jax.tree_util.tree_leaves(out)] != [
      _abstract(x) for x in jax.tree_util.tree_leaves(pool)]:
    raise ValueError(f"cannot build a random pool like {type(pool).__name__} {want}")
  return out


def _sparse_inputs(a: SparseArgs, static: dict, key) -> SparseArgs:
  keys = jax.random.split(key, 8)
  window_rows = a.window_pool_PxD.shape[0]
  comp_rows = None if a.comp_pool_QxD is None else a.comp_pool_QxD.shape[0]
  return SparseArgs(
      q_NxHxD=_normal(keys[0], a.q_NxHxD),
      window_pool_PxD=_random_pool(keys[1], a.window_pool_PxD),
      window_idx_NxW=_ints(keys[2], a.window_idx_NxW, -1, window_rows),
      comp_pool_QxD=None if a.comp_pool_QxD is None else _random_pool(keys[3], a.comp_pool_QxD),
      comp_idx_NxK=None if a.comp_idx_NxK is None else _ints(keys[4], a.comp_idx_NxK, -1, comp_rows or 1),
      sink_H=_normal(keys[5], a.sink_H),
      window_len_N=None if a.window_len_N is None else _ints(keys[6], a.window_len_N, 0,
                                                             a.window_idx_NxW.shape[1] + 1),
      comp_len_N=None if a.comp_len_N is None else _ints(keys[7], a.comp_len_N, 0, a.comp_idx_NxK.shape[1] + 1))


def _indexer_inputs(a: IndexerArgs, static: dict, key) -> IndexerArgs:
  keys = jax.random.split(key, 8)
  entries, pool_rows = a.key_rows_BxM.shape[1], a.key_pool_PxC.shape[0]
  cand = a.candidate_blocks_BxTxC  # top-k only, with static block_size
  return IndexerArgs(
      q_BxTxHxC=_normal(keys[0], a.q_BxTxHxC),
      w_BxTxH=(jax.random.uniform(keys[1], a.w_BxTxH.shape, jnp.float32) + 0.1).astype(a.w_BxTxH.dtype),
      key_pool_PxC=_random_pool(keys[2], a.key_pool_PxC),
      key_rows_BxM=_ints(keys[3], a.key_rows_BxM, -1, pool_rows),
      num_visible_BxT=_ints(keys[4], a.num_visible_BxT, 0, entries + 1),
      allowed_BxTxM=None if a.allowed_BxTxM is None else (
          jax.random.bernoulli(keys[5], 0.7, a.allowed_BxTxM.shape).astype(a.allowed_BxTxM.dtype)),
      num_keys_B=None if a.num_keys_B is None else _ints(keys[6], a.num_keys_B, 0, entries + 1),
      candidate_blocks_BxTxC=None if cand is None else _ints(keys[7], cand, -1, -(-entries // static["block_size"])))


def _tols(dtype):
  return (1e-4, 1e-4) if jnp.dtype(dtype) == jnp.float32 else (2e-2, 2e-2)


def _close(got, want, atol, rtol):
  """max |got - want| / (atol + rtol |want|) over finite `want`; inf when the non-finite patterns differ."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if got.shape != want.shape or (np.isfinite(want) != np.isfinite(got)).any() or (
      np.isinf(want) & (got != want)).any():
    return np.inf
  f = np.isfinite(want)
  if not f.any():
    return 0.0
  return float(np.max(np.abs(got[f] - want[f]) / (atol + rtol * np.abs(want[f]))))


def _sparse_err(got, want, a: SparseArgs, static: dict):
  atol, rtol = _tols(a.q_NxHxD.dtype)
  return max(_close(got[0], want[0], atol, rtol), _close(got[1], want[1], 1e-3, 1e-3))


def _scores_err(got, want, args: IndexerArgs, static: dict):
  scale = max(1.0, float(np.max(np.abs(np.where(np.isfinite(want), want, 0.0)), initial=0.0)))
  return _close(got, want, 1e-3 * scale, 1e-3)


def _topk_err(got, scores, args: IndexerArgs, static: dict):
  """The picks are a top-k of the reference scores: as many as min(k, visible), distinct, visible, none scored
  below the k-th largest score (ties within 1e-4 relative may be broken either way)."""
  M = scores.shape[-1]
  ids = np.asarray(got).reshape(-1, np.shape(got)[-1])
  sc = np.asarray(scores, np.float64).reshape(-1, M)
  kk = min(static["k"], M)
  if ids.shape[1] != kk or ((ids < -1) | (ids >= M)).any():
    return np.inf
  valid = ids >= 0
  n_want = np.minimum(kk, np.isfinite(sc).sum(1))
  srt = np.sort(np.where(valid, ids, M + np.arange(kk)[None, :]), axis=1)
  if (valid.sum(1) != n_want).any() or (srt[:, 1:] == srt[:, :-1]).any():
    return np.inf
  picked = np.take_along_axis(sc, np.maximum(ids, 0), axis=1)
  if not np.isfinite(picked[valid]).all():
    return np.inf
  kth = np.take_along_axis(-np.sort(-sc, axis=1), np.maximum(n_want - 1, 0)[:, None], axis=1)
  short = np.where(valid, (kth - picked) / (1e-4 * np.maximum(1.0, np.abs(kth))), 0.0)
  return float(max(0.0, np.max(short, initial=0.0)))


_CHECKS.update({
    "sparse_attention": _OpCheck(_sparse_inputs, _sparse_reference, _sparse_err),
    "indexer_scores": _OpCheck(_indexer_inputs, _scores_reference, _scores_err),
    "indexer_topk": _OpCheck(_indexer_inputs, _topk_check_scores, _topk_err),
})


topk_from_scores = _indexer.topk_from_scores

# Plain-XLA paged indexer (pallas_kernels/indexer_paged.py): block reads through the table, chunked running top-k,
# V4.1 candidates as block ids. The model's path when no indexer kernel is selected.
indexer_topk_paged = _indexer_paged.indexer_topk_paged
indexer_topk_candidates = _indexer_paged.indexer_topk_candidates
candidate_blocks = _indexer_paged.candidate_blocks
candidate_blocks_to_allowed = _indexer.candidate_blocks_to_allowed
