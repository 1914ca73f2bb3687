"""The one entry point the model uses for attention, indexer and batch-invariant matmul math.

backend: "auto" (the default), "xla", "pallas", "interpret" (the Pallas kernel in interpret mode, for CPU tests).
"auto" is the XLA reference off a GPU. On a GPU it validates a kernel the first time an op is dispatched with a new
kernel configuration (`validation_key`: op, kernel, tuning, input structure and dtypes, the dimensions that set the
compiled tiling, static arguments; not the batch or pool sizes): a child process (`validate_child.py`, its own CUDA
context, memory grown on demand, so neither a GPU fault nor the serving pools' memory is shared) runs the kernel and
its XLA reference on random inputs of a small case with the same compiled tiling (`small_case`) under a timeout
(`KernelConfig.validation_timeout_s`), and compares them within the op's tolerance; the verdict is cached per
process (`validation_verdicts`, `clear_validations`). A kernel that fails (wrong answer, raises, crashes the child or
hangs past the timeout) is reported in one `RuntimeWarning` line per configuration and that call site uses the XLA
reference. Kernels register themselves in `_KERNELS`: each kernel module exports a `KERNELS` dict that this module
registers at import; an op without a kernel falls back to the XLA reference on every backend. A kernel is handed to
the child by its importable name (module and qualified name).

The kernels target the Pallas-Triton GPU backend (explicit `triton.CompilerParams`); see docs/kernels.md. Pools may
be plain arrays or FP8 pools (`Fp8KVPool`, `Fp8PagedPool`; FP8 index keys `Fp8IndexKeys`) on every backend, and a
narrow float pool (or an FP8 pool's part) may be a `WordPool`, held as its unsigned words (the CPU's caches): the
XLA references convert the rows they read, a kernel gets the pool converted whole (`word_pool.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import grouped_dot as _grouped_dot
from pallas_kernels import hca_attention as _hca
from pallas_kernels import indexer as _indexer
from pallas_kernels import indexer_paged as _indexer_paged
from pallas_kernels import indexer_topk as _indexer_topk
from pallas_kernels import row_dot as _row_dot
from pallas_kernels import sparse_attention as _sparse
from pallas_kernels import word_pool as _word_pool

Backend = Literal["auto", "xla", "pallas", "interpret"]
BACKENDS = ("auto", "xla", "pallas", "interpret")


Fp8KVPool = _sparse.Fp8KVPool
quantize_kv_fp8 = _sparse.quantize_kv_fp8
dequantize_kv_fp8 = _sparse.dequantize_kv_fp8
SparseAttentionTuning = _sparse.SparseAttentionTuning
IndexerTuning = _indexer.IndexerTuning
IndexerTopkTuning = _indexer_topk.IndexerTopkTuning
Fp8PagedPool = _sparse.Fp8PagedPool
Fp8IndexKeys = _indexer_topk.Fp8IndexKeys
PagedRows = _indexer.PagedRows
HcaAttentionTuning = _hca.HcaAttentionTuning
RowDotTuning = _row_dot.RowDotTuning
GroupedDotTuning = _grouped_dot.GroupedDotTuning
WordPool = _word_pool.WordPool


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  backend: Backend = "auto"
  sparse_tuning: SparseAttentionTuning | None = None  # None = kernel defaults
  indexer_tuning: IndexerTuning | None = None
  topk_tuning: IndexerTopkTuning | None = None  # the fused indexer top-k kernel
  # auto: seconds a kernel's validation (a child process: JAX start, two compiles, one run) may take before the
  # kernel counts as hung and the XLA reference is used
  validation_timeout_s: float = 180.0
  hca_tuning: HcaAttentionTuning | None = None  # the invariant step's HCA kernel
  row_dot_tuning: RowDotTuning | None = None  # the row-invariant matmul
  grouped_dot_tuning: GroupedDotTuning | None = None  # the block-invariant grouped expert matmul


def check_backend(cfg: KernelConfig, *, on_device: bool = True) -> None:
  """ValueError (one line) for a backend that cannot serve here: not one of BACKENDS, or (on_device: asks JAX for
  its backend) "pallas" off a GPU, where the compiled Triton kernels cannot run ("interpret" runs them on any
  device; "auto" serves the XLA reference there)."""
  if cfg.backend not in BACKENDS:
    raise ValueError(f"kernel backend {cfg.backend!r}: one of {', '.join(BACKENDS)}")
  if on_device and cfg.backend == "pallas" and not _on_gpu():
    raise ValueError(f"kernel backend 'pallas' needs a GPU (JAX's backend here is {jax.default_backend()}); 'auto' "
                     "serves the XLA reference off a GPU, 'interpret' runs the kernels in interpret mode")


# op name -> callable(*args, interpret: bool, tuning=..., **kw). Filled by kernel modules.
_KERNELS: dict[str, Callable] = {}


def register_kernel(op: str, fn: Callable) -> None:
  _KERNELS[op] = fn


for _mod in (_sparse, _indexer, _indexer_topk, _hca, _row_dot, _grouped_dot):
  for _op, _fn in getattr(_mod, "KERNELS", {}).items():
    register_kernel(_op, _fn)


# ----------------------------------------------------------------------------------------------------------------
# "auto": validate each kernel configuration once per process, in a child process, on a small case
# ----------------------------------------------------------------------------------------------------------------

# validation_key(...) -> verdict (True: the kernel matched its reference). Filled the first time `auto` meets a key
# on a GPU; `clear_validations` empties it.
_VERDICTS: dict[tuple, bool] = {}
_WARNED: set[tuple] = set()
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RESULT_MARK = "dsv4-validation-result:"


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
  live: Any = None          # queries at or past it: outputs unspecified (a kernel skips them)


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
  live: Any = None          # top-k: sequences at or past it: outputs unspecified (a kernel skips them)


class HcaArgs(NamedTuple):
  """The array arguments of one `hca_attention` call, by name. Static arguments (`scale`, `entries_per_block`)
  travel beside it in a dict."""
  q_NxHxD: Any
  window_pool_PxD: Any
  window_idx_NxW: Any
  window_len_N: Any
  comp_pool_QxD: Any
  table_SxF: Any
  num_visible_N: Any
  sink_H: Any
  table_rows_N: Any = None
  live: Any = None          # queries at or past it: outputs unspecified (a kernel skips them)


class RowDotArgs(NamedTuple):
  """The array arguments of one `row_dot` call, by name. Its static argument (`out_dtype`, a dtype name) travels
  beside it in a dict."""
  x_NxK: Any
  w_KxM: Any
  live: Any = None


class GroupedDotArgs(NamedTuple):
  """The array arguments of one `grouped_dot` call, by name. Its static argument (`out_dtype`, a dtype name)
  travels beside it in a dict."""
  x_BxRxK: Any
  block_expert_B: Any
  live_blocks: Any
  w_ExKxM: Any


class _OpCheck(NamedTuple):
  """How `auto` validates one op's kernel (see `validate`)."""
  random_inputs: Callable   # (abstract args, static, key) -> random args of that structure, shapes and dtypes
  reference: Callable       # (args, static) -> what the kernel's output is compared against
  err_over_tol: Callable    # (kernel output, reference output, args, static) -> max error / tolerance
  small_case: Callable      # (abstract args, static, tuning) -> SmallCase


class SmallCase(NamedTuple):
  """A validation case that compiles to the same kernel code as a real call: `args` (abstract, small), `tuning`
  (the real call's, with the shape-derived choices pinned so the small shapes take the same path) and `tiling`
  (what of the real shapes the compiled code depends on; part of the validation key)."""
  args: Any
  tuning: Any
  tiling: tuple


_CHECKS: dict[str, _OpCheck] = {}   # op -> its check; filled below the ops


def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def clear_validations() -> None:
  """Forget every verdict (and which failures were reported): the next `auto` dispatch validates again."""
  _VERDICTS.clear()
  _WARNED.clear()


def validation_verdicts() -> dict[tuple, bool]:
  """A copy of this process's verdicts: `validation_key` -> kernel used."""
  return dict(_VERDICTS)


def _abstract(x):
  return (tuple(x.shape), jnp.dtype(x.dtype).name)


def _tuning(cfg: KernelConfig, op: str):
  return {"sparse_attention": cfg.sparse_tuning, "indexer_scores": cfg.indexer_tuning,
          "indexer_topk": cfg.topk_tuning, "hca_attention": cfg.hca_tuning, "row_dot": cfg.row_dot_tuning,
          "grouped_dot": cfg.grouped_dot_tuning}.get(op)


def _kernel_name(fn: Callable) -> str:
  return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def validation_key(cfg: KernelConfig, op: str, args: tuple, static: dict) -> tuple:
  """(op, kernel, tuning, input structure, leaf dtypes and ranks, tiling, static arguments): one validation per
  compiled kernel configuration, whatever the batch or pool sizes."""
  leaves, tree = jax.tree_util.tree_flatten(args)
  tiling = _CHECKS[op].small_case(args, static, _tuning(cfg, op)).tiling
  return (op, _kernel_name(_KERNELS[op]), _tuning(cfg, op), tree,
          tuple((len(x.shape), jnp.dtype(x.dtype).name) for x in leaves), tiling, tuple(sorted(static.items())))


def _spec_tree(args):
  """Abstract args as a picklable tree: each array leaf becomes ("__array__", shape, dtype name)."""
  return jax.tree_util.tree_map(lambda x: ("__array__", tuple(x.shape), jnp.dtype(x.dtype).name), args)


def _from_spec_tree(tree):
  is_spec = lambda x: isinstance(x, tuple) and len(x) == 3 and x[0] == "__array__"
  return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x[1], jnp.dtype(x[2])) if is_spec(x) else x, tree,
                                is_leaf=is_spec)


def child_check(payload: dict) -> float:
  """The child's side: random inputs of the small case, kernel and reference, max error / tolerance."""
  op, static = payload["op"], payload["static"]
  op_check = _CHECKS[op]
  abstract = _from_spec_tree(payload["args"])
  # One compiled program each for the inputs and the reference (eager, every op would compile on its own).
  inputs = jax.jit(lambda key: op_check.random_inputs(abstract, static, key))(jax.random.PRNGKey(payload["seed"]))
  kw = dict(interpret=False)
  if payload["tuning"] is not None:
    kw["tuning"] = payload["tuning"]
  got = jax.device_get(_RUN[op](payload["kernel"], inputs, static, kw))
  # Run twice: a kernel whose answer changes on the same inputs (a race between its threads: the H200 check saw one)
  # can be within tolerance once and wrong the next time, and breaks batch invariance either way.
  again = jax.device_get(_RUN[op](payload["kernel"], inputs, static, kw))
  if any(np.asarray(a).tobytes() != np.asarray(b).tobytes()
         for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(again))):
    raise RuntimeError("nondeterministic: two runs on the same inputs differ")
  want = jax.jit(lambda x: op_check.reference(x, static))(inputs)
  return float(op_check.err_over_tol(got, jax.device_get(want), inputs, static))


def _run_child(payload: bytes, timeout_s: float) -> tuple[float | None, str]:
  """(max error / tolerance, "") or (None, why). The child is its own process group, killed whole on timeout."""
  env = dict(os.environ)
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # a few MB, grown on demand: never a share of the pools' memory
  cache_dir = getattr(jax.config, "jax_compilation_cache_dir", None)  # the parent's persistent cache, if any
  if cache_dir and "JAX_COMPILATION_CACHE_DIR" not in env:
    env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
  env["PYTHONPATH"] = os.pathsep.join([_ROOT] + [p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
  proc = subprocess.Popen([sys.executable, "-m", "pallas_kernels.validate_child"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=_ROOT, env=env, start_new_session=True)
  try:
    out, err = proc.communicate(payload, timeout=timeout_s)
  except subprocess.TimeoutExpired:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    proc.communicate()
    return None, f"timed out after {timeout_s:g} s"
  for line in reversed(out.decode(errors="replace").splitlines()):
    if line.startswith(_RESULT_MARK):
      res = json.loads(line[len(_RESULT_MARK):])
      return (res["err"], "") if "err" in res else (None, res["error"])
  tail = [ln for ln in err.decode(errors="replace").splitlines() if ln.strip()]
  return None, f"child exited with status {proc.returncode}" + (f": {tail[-1][:200]}" if tail else "")


def validate(cfg: KernelConfig, op: str, args: tuple, static: dict) -> bool:
  """Whether `op`'s kernel may serve calls like this one (shapes are read, values never: tracers are fine). The
  first call per `validation_key` runs the kernel and its XLA reference in a child process on `small_case`, under
  `cfg.validation_timeout_s`; the verdict is cached per process. A failure is one RuntimeWarning line and means XLA."""
  key = validation_key(cfg, op, args, static)
  if key in _VERDICTS:
    return _VERDICTS[key]
  t0 = time.perf_counter()
  small = _CHECKS[op].small_case(args, static, _tuning(cfg, op))
  try:
    payload = pickle.dumps(dict(op=op, kernel=_KERNELS[op], tuning=small.tuning, args=_spec_tree(small.args),
                                static=dict(static), seed=0))
  except (pickle.PicklingError, AttributeError, TypeError) as e:
    err, why = None, f"the kernel cannot be handed to a child process by name ({type(e).__name__}: {e})"
  else:
    err, why = _run_child(payload, cfg.validation_timeout_s)
  ok = err is not None and err <= 1.0  # NaN is not <= 1
  if err is not None and not ok:
    why = f"max error / tolerance {err:.3g}"
  _VERDICTS[key] = ok
  if not ok and key not in _WARNED:
    _WARNED.add(key)
    shapes = ", ".join("x".join(map(str, s)) + f" {d}" for s, d in
                       (_abstract(x) for x in jax.tree_util.tree_leaves(small.args)))
    why = " ".join(why.split())
    warnings.warn(f"dispatch: the {op!r} Pallas kernel ({_kernel_name(_KERNELS[op])}) failed validation on "
                  f"{jax.devices()[0].device_kind} ({why}; small case {shapes}, tiling {small.tiling}, "
                  f"{time.perf_counter() - t0:.1f} s); serving this configuration on the XLA reference",
                  RuntimeWarning, stacklevel=3)
  return ok


def _resolve(cfg: KernelConfig, op: str, args: tuple | None = None, static: dict | None = None):
  """None = the XLA reference; else the kernel's keyword arguments (interpret, tuning).

  `auto`: XLA off a GPU; on a GPU the kernel once it has matched its reference at these shapes (validated here the
  first time; without `args` nothing can be validated and the answer is XLA)."""
  if not may_use_kernel(cfg, op):
    return None
  backend = cfg.backend
  if backend == "auto":
    if args is None or not validate(cfg, op, args, static or {}):
      return None
    backend = "pallas"
  kw = dict(interpret=(backend == "interpret"))
  if _tuning(cfg, op) is not None:
    kw["tuning"] = _tuning(cfg, op)
  return kw


def may_use_kernel(cfg: KernelConfig, op: str) -> bool:
  """Whether `cfg` can send `op` to a kernel here at all (no arguments, nothing validated): False where the op always
  runs its XLA reference (backend "xla", "auto" off a GPU, an op without a kernel). A caller that lays its inputs
  out for the kernel asks this first; `auto` on a GPU may still serve the reference after validation."""
  if op not in _KERNELS or cfg.backend == "xla":
    return False
  return cfg.backend != "auto" or _on_gpu()


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
                 window_len_N=None, comp_len_N=None, live=None):
  return (SparseArgs(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H,
                     window_len_N=window_len_N, comp_len_N=comp_len_N, live=live), dict(scale=float(scale)))


def sparse_attention(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H, *,
                     scale: float, cfg: KernelConfig = KernelConfig(), window_len_N=None, comp_len_N=None,
                     live=None):
  """Sparse MLA over a window pool and a compressed pool with a per-head sink -> (out_NxHxD, lse_NxH).

  sparse_attention(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD | None, comp_idx_NxK | None, sink_H, *,
                   scale, cfg=KernelConfig(), window_len_N=None, comp_len_N=None, live=None)

  window_len_N / comp_len_N: optional int32 [N], the number of valid *leading* ids of each query's window /
  compressed id row (like FlashMLA's topk_length). Ids at positions >= len are ignored exactly like -1, whatever
  they hold, and kernels stop their loops there (cost O(live ids), not O(W + K)). None = the whole row counts
  (ids < 0 or >= pool rows are always invalid). live: optional int scalar; queries at or past it may hold anything
  (the kernel's programs for them return without writing). See `sparse_attention.py` for the full contract.
  """
  args, static = _sparse_args(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H,
                              scale=scale, window_len_N=window_len_N, comp_len_N=comp_len_N, live=live)
  kw = _resolve(cfg, "sparse_attention", args, static)
  if kw is None:
    return _sparse_reference(args, static)
  return _RUN["sparse_attention"](_KERNELS["sparse_attention"], args, static, kw)


def _hca_args(q_NxHxD, window_pool_PxD, window_idx_NxW, window_len_N, comp_pool_QxD, table_SxF, num_visible_N,
              sink_H, *, scale: float, entries_per_block: int, table_rows_N=None, live=None):
  return (HcaArgs(q_NxHxD, window_pool_PxD, window_idx_NxW, window_len_N, comp_pool_QxD, table_SxF, num_visible_N,
                  sink_H, table_rows_N, live), dict(scale=float(scale), entries_per_block=int(entries_per_block)))


def hca_attention(q_NxHxD, window_pool_PxD, window_idx_NxW, window_len_N, comp_pool_QxD, table_SxF, num_visible_N,
                  sink_H, *, scale: float, entries_per_block: int, cfg: KernelConfig = KernelConfig(),
                  table_rows_N=None, live=None):
  """HCA attention in the invariant step's order (the window, then every visible entry in position order, blocks
  of 64 entries) -> out_NxHxD in q's dtype.

  hca_attention(q_NxHxD, window_pool_PxD, window_idx_NxW, window_len_N, comp_pool_QxD, table_SxF, num_visible_N,
                sink_H, *, scale, entries_per_block, cfg=KernelConfig(), table_rows_N=None)

  Entry e of query n's row lives at pool row table_SxF[r, e // E] * E + e % E (E = entries_per_block, r =
  table_rows_N[n]; None = n, the table then having one row per query); entries 0 .. num_visible_N[n] - 1 are
  visible. The table is passed as it is (e.g. the engine's [slots, max_model_len / block] table): the kernel reads
  each query's row in place, only the words of its visible entries. A query's bits depend only on its own
  arguments (see `hca_attention.py` for the contract). live: optional int scalar; queries at or past it may hold
  anything (the kernel's programs for them return without writing). Without a kernel, its XLA reference
  `hca_attention_reference`: the model's XLA path."""
  args, static = _hca_args(q_NxHxD, window_pool_PxD, window_idx_NxW, window_len_N, comp_pool_QxD, table_SxF,
                           num_visible_N, sink_H, scale=scale, entries_per_block=entries_per_block,
                           table_rows_N=table_rows_N, live=live)
  kw = _resolve(cfg, "hca_attention", args, static)
  if kw is None:
    return _hca_reference(args, static)
  return _RUN["hca_attention"](_KERNELS["hca_attention"], args, static, kw)


def _row_dot_args(x_NxK, w_KxM, live=None, *, out_dtype=None):
  return (RowDotArgs(x_NxK, w_KxM, None if live is None else jnp.asarray(live, jnp.int32)),
          dict(out_dtype=jnp.dtype(out_dtype or x_NxK.dtype).name))


def row_dot(x_NxK, w_KxM, live=None, *, out_dtype=None, cfg: KernelConfig = KernelConfig()):
  """y_NxM = x_NxK @ w_KxM (fp32 accumulation, out_dtype: None = x's), rows >= live (None = N) exact zeros.

  row_dot(x_NxK, w_KxM, live=None, *, out_dtype=None, cfg=KernelConfig())

  The kernel ("row_dot", `row_dot.py`) gives a row the same bits whatever the number of rows, `live` or the other
  rows (fixed tiles, K reduced in fixed block_k steps, no split-K) and does no work for row blocks past `live`; K
  and M must be multiples of its block_k and block_cols. Without a kernel, its XLA reference `row_dot_reference`
  (jnp.dot: the same numbers within rounding, not row invariant on a GPU)."""
  args, static = _row_dot_args(x_NxK, w_KxM, live, out_dtype=out_dtype)
  kw = _resolve(cfg, "row_dot", args, static)
  if kw is None:
    return _row_dot_reference(args, static)
  return _RUN["row_dot"](_KERNELS["row_dot"], args, static, kw)


def _grouped_dot_args(x_BxRxK, block_expert_B, live_blocks, w_ExKxM, *, out_dtype=None):
  return (GroupedDotArgs(x_BxRxK, jnp.asarray(block_expert_B, jnp.int32), jnp.asarray(live_blocks, jnp.int32),
                         w_ExKxM), dict(out_dtype=jnp.dtype(out_dtype or x_BxRxK.dtype).name))


def grouped_dot(x_BxRxK, block_expert_B, live_blocks, w_ExKxM, *, out_dtype=None,
                cfg: KernelConfig = KernelConfig()):
  """y_BxRxM: y[b] = x_BxRxK[b] @ w_ExKxM[block_expert_B[b]] (fp32 accumulation, out_dtype: None = x's); blocks
  >= live_blocks, or whose expert id is outside [0, E), exact zeros.

  grouped_dot(x_BxRxK, block_expert_B, live_blocks, w_ExKxM, *, out_dtype=None, cfg=KernelConfig())

  The kernel ("grouped_dot", `grouped_dot.py`): one program per (block, column block), the expert's weights read in
  place, K reduced in fixed block_k steps; a block's bits depend only on its rows and its expert, and blocks past
  live_blocks cost nothing. Without a kernel, its XLA reference `grouped_dot_reference` (a loop over the live
  blocks, one einsum each)."""
  args, static = _grouped_dot_args(x_BxRxK, block_expert_B, live_blocks, w_ExKxM, out_dtype=out_dtype)
  kw = _resolve(cfg, "grouped_dot", args, static)
  if kw is None:
    return _grouped_dot_reference(args, static)
  return _RUN["grouped_dot"](_KERNELS["grouped_dot"], args, static, kw)


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
  key_rows_BxM may be a `PagedRows` (a block table [S, F] as the caller keeps it, each sequence's row of it and the
  entries per block; M = F * E): the kernel then reads each sequence's table row in place, a block of words per
  step, and no [B, M] entry list is built (the scores themselves are [B, T, M]).
  """
  args, static = _scores_args(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM,
                              num_keys_B=num_keys_B)
  kw = _resolve(cfg, "indexer_scores", args, static)
  if kw is None:
    return _scores_reference(args, static)
  return _RUN["indexer_scores"](_KERNELS["indexer_scores"], args, static, kw)


def _topk_args(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, k: int, allowed_BxTxM=None, *,
               num_keys_B=None, candidate_blocks_BxTxC=None, block_size: int = 8, live=None):
  return (IndexerArgs(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, allowed_BxTxM,
                      num_keys_B=num_keys_B, candidate_blocks_BxTxC=candidate_blocks_BxTxC,
                      live=None if live is None else jnp.asarray(live, jnp.int32)),
          dict(k=int(k), block_size=int(block_size)))


def indexer_topk(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, k: int, allowed_BxTxM=None, *,
                 cfg: KernelConfig = KernelConfig(), num_keys_B=None, candidate_blocks_BxTxC=None,
                 block_size: int = 8, live=None):
  """Top-k entry ids [B, T, min(k, M)] int32 (-1 for picks that are not visible; only the set matters).

  indexer_topk(q_BxTxHxC, w_BxTxH, key_pool_PxC | Fp8IndexKeys, key_rows_BxM, num_visible_BxT, k,
               allowed_BxTxM=None, *, cfg=KernelConfig(), num_keys_B=None, candidate_blocks_BxTxC=None,
               block_size=8, live=None)

  Same arguments as `indexer_scores` plus k; the pool may be FP8 (`Fp8IndexKeys`); V4.1 candidate blocks
  (`candidate_blocks_BxTxC`, block ids of `block_size` entries, -1 = none) restrict the picks to those blocks. The
  fused kernel ("indexer_topk", `indexer_topk.py`) keeps scores on chip and writes only the k ids (per chunk of
  IndexerTopkTuning.select_chunk entries) and scores only the candidate blocks' entries when given; the XLA
  reference is the reference scores (FP8 keys dequantized, candidates as a mask) and `topk_from_scores`. With
  key_rows_BxM a `PagedRows` the kernel reads each sequence's row of the table in place, only up to the visible
  entries, so nothing is built or read at the table's width. live: optional int scalar; sequences b >= live may
  hold anything (the kernel's programs of those rows return at once: the engine's dead tokens, one per row)."""
  args, static = _topk_args(q_BxTxHxC, w_BxTxH, key_pool_PxC, key_rows_BxM, num_visible_BxT, k, allowed_BxTxM,
                            num_keys_B=num_keys_B, candidate_blocks_BxTxC=candidate_blocks_BxTxC,
                            block_size=block_size, live=live)
  kw = _resolve(cfg, "indexer_topk", args, static)
  if kw is None:
    return _topk_reference(args, static)
  return _RUN["indexer_topk"](_KERNELS["indexer_topk"], args, static, kw)


def _row_dot_reference(a: RowDotArgs, static: dict):
  return _row_dot.row_dot_reference(a.x_NxK, a.w_KxM, a.live, out_dtype=static["out_dtype"])


def _grouped_dot_reference(a: GroupedDotArgs, static: dict):
  return _grouped_dot.grouped_dot_reference(a.x_BxRxK, a.block_expert_B, a.live_blocks, a.w_ExKxM,
                                            out_dtype=static["out_dtype"])


def _hca_reference(a: HcaArgs, static: dict):
  return _hca.hca_attention_reference(*a, **static)


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
                scale=static["scale"], window_len_N=a.window_len_N, comp_len_N=a.comp_len_N, live=a.live, **kw)


def _run_hca_kernel(kernel: Callable, a: HcaArgs, static: dict, kw: dict):
  return kernel(*a, **static, **kw)


def _run_row_dot_kernel(kernel: Callable, a: RowDotArgs, static: dict, kw: dict):
  return kernel(a.x_NxK, a.w_KxM, a.live, out_dtype=static["out_dtype"], **kw)


def _run_grouped_dot_kernel(kernel: Callable, a: GroupedDotArgs, static: dict, kw: dict):
  return kernel(a.x_BxRxK, a.block_expert_B, a.live_blocks, a.w_ExKxM, out_dtype=static["out_dtype"], **kw)


def _run_scores_kernel(kernel: Callable, a: IndexerArgs, static: dict, kw: dict):
  return kernel(a.q_BxTxHxC, a.w_BxTxH, a.key_pool_PxC, a.key_rows_BxM, a.num_visible_BxT, a.allowed_BxTxM,
                num_keys_B=a.num_keys_B, **kw)


def _run_topk_kernel(kernel: Callable, a: IndexerArgs, static: dict, kw: dict):
  return kernel(a.q_BxTxHxC, a.w_BxTxH, a.key_pool_PxC, a.key_rows_BxM, a.num_visible_BxT, static["k"],
                a.allowed_BxTxM, num_keys_B=a.num_keys_B, candidate_blocks_BxTxC=a.candidate_blocks_BxTxC,
                block_size=static["block_size"], live=a.live, **kw)


_OP_ARGS = {"sparse_attention": _sparse_args, "indexer_scores": _scores_args, "indexer_topk": _topk_args,
            "hca_attention": _hca_args, "row_dot": _row_dot_args, "grouped_dot": _grouped_dot_args}


def _on_floats(run: Callable) -> Callable:
  """A kernel runner whose kernel gets every `WordPool` of its arguments as its float array."""
  return lambda kernel, a, static, kw: run(kernel, _word_pool.floats(a), static, kw)


_RUN = {op: _on_floats(run) for op, run in (
    ("sparse_attention", _run_sparse_kernel), ("indexer_scores", _run_scores_kernel),
    ("indexer_topk", _run_topk_kernel), ("hca_attention", _run_hca_kernel), ("row_dot", _run_row_dot_kernel),
    ("grouped_dot", _run_grouped_dot_kernel))}


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


def _hca_inputs(a: HcaArgs, static: dict, key) -> HcaArgs:
  keys = jax.random.split(key, 8)
  W, (S, F) = a.window_idx_NxW.shape[1], a.table_SxF.shape
  E = static["entries_per_block"]
  return HcaArgs(
      q_NxHxD=_normal(keys[0], a.q_NxHxD),
      window_pool_PxD=_random_pool(keys[1], a.window_pool_PxD),
      window_idx_NxW=_ints(keys[2], a.window_idx_NxW, -1, a.window_pool_PxD.shape[0] + 1),
      window_len_N=_ints(keys[3], a.window_len_N, 0, W + 1),
      comp_pool_QxD=_random_pool(keys[4], a.comp_pool_QxD),
      table_SxF=_ints(keys[5], a.table_SxF, -1, -(-a.comp_pool_QxD.shape[0] // E) + 1),
      num_visible_N=_ints(keys[6], a.num_visible_N, 0, F * E + 1),
      sink_H=_normal(keys[7], a.sink_H),
      table_rows_N=None if a.table_rows_N is None else _ints(jax.random.fold_in(keys[5], 1), a.table_rows_N, 0, S))


def _row_dot_inputs(a: RowDotArgs, static: dict, key) -> RowDotArgs:
  keys = jax.random.split(key, 3)
  K = a.x_NxK.shape[1]
  return RowDotArgs(x_NxK=_normal(keys[0], a.x_NxK), w_KxM=_normal(keys[1], a.w_KxM, K ** -0.5),
                    live=None if a.live is None else _ints(keys[2], a.live, 0, a.x_NxK.shape[0] + 1))


def _grouped_dot_inputs(a: GroupedDotArgs, static: dict, key) -> GroupedDotArgs:
  keys = jax.random.split(key, 4)
  E, K, _ = a.w_ExKxM.shape
  return GroupedDotArgs(x_BxRxK=_normal(keys[0], a.x_BxRxK),
                        block_expert_B=_ints(keys[1], a.block_expert_B, -1, E + 1),
                        live_blocks=_ints(keys[2], a.live_blocks, 0, a.x_BxRxK.shape[0] + 1),
                        w_ExKxM=_normal(keys[3], a.w_ExKxM, K ** -0.5))


def _indexer_inputs(a: IndexerArgs, static: dict, key) -> IndexerArgs:
  keys = jax.random.split(key, 8)
  entries, pool_rows = a.key_rows_BxM.shape[1], a.key_pool_PxC.shape[0]
  cand = a.candidate_blocks_BxTxC  # top-k only, with static block_size
  kr = a.key_rows_BxM
  if isinstance(kr, PagedRows):  # random blocks of the pool, each sequence on a random row of the table
    E = kr.entries_per_block
    key_rows = PagedRows(_ints(keys[3], kr.table_SxF, -1, -(-pool_rows // E)),
                         _ints(jax.random.fold_in(keys[3], 1), kr.rows_B, 0, kr.table_SxF.shape[0]), E)
  else:
    key_rows = _ints(keys[3], kr, -1, pool_rows)
  return IndexerArgs(
      q_BxTxHxC=_normal(keys[0], a.q_BxTxHxC),
      w_BxTxH=(jax.random.uniform(keys[1], a.w_BxTxH.shape, jnp.float32) + 0.1).astype(a.w_BxTxH.dtype),
      key_pool_PxC=_random_pool(keys[2], a.key_pool_PxC),
      key_rows_BxM=key_rows,
      num_visible_BxT=_ints(keys[4], a.num_visible_BxT, 0, entries + 1),
      allowed_BxTxM=None if a.allowed_BxTxM is None else (
          jax.random.bernoulli(keys[5], 0.7, a.allowed_BxTxM.shape).astype(a.allowed_BxTxM.dtype)),
      num_keys_B=None if a.num_keys_B is None else _ints(keys[6], a.num_keys_B, 0, entries + 1),
      candidate_blocks_BxTxC=None if cand is None else _ints(keys[7], cand, -1, -(-entries // static["block_size"])))


# Small cases with the real call's compiled tiling (`SmallCase`).

_SMALL_ROWS = 64  # pool rows of a validation case (pages: enough to hold them)


def _shrink_rows(x, rows):
  return jax.ShapeDtypeStruct((min(x.shape[0], rows),) + tuple(x.shape[1:]), x.dtype)


def _small_pool(pool):
  if pool is None:
    return None
  if isinstance(pool, Fp8PagedPool):
    return dataclasses.replace(pool, pages=_shrink_rows(pool.pages, max(1, -(-_SMALL_ROWS // pool.page_size))))
  if isinstance(pool, (Fp8KVPool, Fp8IndexKeys)):
    return type(pool)(*(_shrink_rows(x, _SMALL_ROWS) for x in pool))
  return _shrink_rows(pool, _SMALL_ROWS)


def _cols(x, n):
  return None if x is None else jax.ShapeDtypeStruct(tuple(x.shape[:-1]) + (n,), x.dtype)


def _lead(x, n):
  return None if x is None else jax.ShapeDtypeStruct((min(x.shape[0], n),) + tuple(x.shape[1:]), x.dtype)


def _sparse_small(a: SparseArgs, static: dict, tuning) -> SmallCase:
  """Sparse MLA: the compiled code depends on H, D, the dtypes and pool formats, the tuning, each id row's path
  (held in registers or read a block per step, by its padded width against id_row_max), whether keys are split,
  and the FP8 record's uint16 view (pools of >= fp8_u16_min_elems e4m3 elements), not on N, the pool rows or the
  id widths otherwise. The small case: 2 queries, 64 pool rows, id rows of 2 blocks (4 when read per step), with
  id_row_max, num_splits and fp8_u16_min_elems pinned so it takes the real call's paths."""
  has_comp = a.comp_pool_QxD is not None and a.comp_idx_NxK is not None and a.comp_idx_NxK.shape[-1] > 0
  pools = [a.window_pool_PxD] + ([a.comp_pool_QxD] if has_comp else [])
  t = tuning or _sparse.default_tuning(pools)
  N, H, D = a.q_NxHxD.shape
  bk = t.block_k
  widths = [a.window_idx_NxW.shape[1]] + ([a.comp_idx_NxK.shape[1]] if has_comp else [])
  padded = lambda w: _sparse._next_pow2(max(1, -(-w // bk))) * bk
  in_regs = [padded(w) <= t.id_row_max for w in widths]
  small_w = [min(w, 2 * bk) if r else min(w, 4 * bk) for w, r in zip(widths, in_regs)]
  id_max = max([padded(w) for w, r in zip(small_w, in_regs) if r], default=0)
  small_w = [sw if r or padded(sw) > id_max else w for sw, w, r in zip(small_w, widths, in_regs)]
  S = _sparse.chosen_num_splits(N, H, widths, t, row_bytes=max(_sparse.pool_row_bytes(p) for p in pools),
                                out_bytes=jnp.dtype(a.q_NxHxD.dtype).itemsize, D=D)
  u16 = any(isinstance(p, Fp8KVPool) and p.nope.size >= t.fp8_u16_min_elems for p in pools)
  small_total = sum(max(1, -(-w // bk)) for w in small_w)
  tun = dataclasses.replace(t, id_row_max=id_max, num_splits=1 if S == 1 else max(2, min(S, small_total)),
                            fp8_u16_min_elems=0 if u16 else t.fp8_u16_min_elems)
  n = min(N, 2)
  args = SparseArgs(
      q_NxHxD=_lead(a.q_NxHxD, n), window_pool_PxD=_small_pool(a.window_pool_PxD),
      window_idx_NxW=_lead(_cols(a.window_idx_NxW, small_w[0]), n),
      comp_pool_QxD=_small_pool(a.comp_pool_QxD),
      comp_idx_NxK=_lead(_cols(a.comp_idx_NxK, small_w[1]), n) if has_comp else _lead(a.comp_idx_NxK, n),
      sink_H=a.sink_H, window_len_N=_lead(a.window_len_N, n), comp_len_N=_lead(a.comp_len_N, n))
  tiling = (H, D, tuple(in_regs), S > 1, u16)
  return SmallCase(args, tun, tiling)


def _hca_small(a: HcaArgs, static: dict, tuning) -> SmallCase:
  """HCA: the compiled code depends on H, D, the dtypes and pool formats, the tuning and entries_per_block (static),
  not on N, W, the table's rows and width or the pool rows (every id row and table row is read a block per step).
  The small case: 2 queries, 64 pool rows, a window of two steps and a table of two 64-entry blocks' worth of
  entries (at most 2 rows when the call names each query's row)."""
  t = tuning or _hca.default_tuning([a.window_pool_PxD, a.comp_pool_QxD])
  N, H, D = a.q_NxHxD.shape
  E = static["entries_per_block"]
  n = min(N, 2)
  f = min(a.table_SxF.shape[1], max(1, -(-2 * _hca.DENSE_BLOCK_ENTRIES // E)))
  args = HcaArgs(
      q_NxHxD=_lead(a.q_NxHxD, n), window_pool_PxD=_small_pool(a.window_pool_PxD),
      window_idx_NxW=_lead(_cols(a.window_idx_NxW, min(a.window_idx_NxW.shape[1], 2 * t.block_k)), n),
      window_len_N=_lead(a.window_len_N, n), comp_pool_QxD=_small_pool(a.comp_pool_QxD),
      table_SxF=_lead(_cols(a.table_SxF, f), n), num_visible_N=_lead(a.num_visible_N, n), sink_H=a.sink_H,
      table_rows_N=_lead(a.table_rows_N, n))
  return SmallCase(args, t, (H, D))


def _hca_err(got, want, a: HcaArgs, static: dict):
  atol, rtol = _tols(a.q_NxHxD.dtype)
  return _close(got, want, atol, rtol)


def _shrink_to_blocks(n: int, block: int) -> int:
  """n cut to at most two blocks (kept as it is when not a multiple of the block: the call then fails as it would)."""
  return n if n % block or n < block else block * min(n // block, 2)


def _row_dot_small(a: RowDotArgs, static: dict, tuning) -> SmallCase:
  """Row-invariant matmul: the compiled code depends on the dtypes, the tuning and whether `live` is given; N, K
  and M set only the grid and the K loop's trip count. The small case: one row block and three rows, two K steps
  per K split (all of the tuning's k_splits kept: they set the partials' sum), two column blocks."""
  t = tuning or RowDotTuning()
  (N, K), M = a.x_NxK.shape, a.w_KxM.shape[1]
  k, m = _shrink_to_blocks(K, t.block_k * t.k_splits), _shrink_to_blocks(M, t.block_cols)
  args = RowDotArgs(jax.ShapeDtypeStruct((min(N, t.block_rows + 3), k), a.x_NxK.dtype),
                    jax.ShapeDtypeStruct((k, m), a.w_KxM.dtype), a.live)
  return SmallCase(args, t, ())


def _grouped_dot_small(a: GroupedDotArgs, static: dict, tuning) -> SmallCase:
  """Grouped expert matmul: the compiled code depends on the dtypes, the tuning and the row tile (R padded to a
  power of two >= 16); B, E, K and M set only the grid, the weights' strides and the K loop's trip count. The small
  case: 3 blocks of R rows, 4 experts, two K steps, two column blocks."""
  t = tuning or GroupedDotTuning()
  B, R, K = a.x_BxRxK.shape
  E, _, M = a.w_ExKxM.shape
  k, m, b = _shrink_to_blocks(K, t.block_k), _shrink_to_blocks(M, t.block_cols), min(B, 3)
  args = GroupedDotArgs(jax.ShapeDtypeStruct((b, R, k), a.x_BxRxK.dtype), _lead(a.block_expert_B, b),
                        a.live_blocks, jax.ShapeDtypeStruct((min(E, 4), k, m), a.w_ExKxM.dtype))
  return SmallCase(args, t, (_grouped_dot.row_block(R),))


def _dot_err(got, want, a, static: dict):
  atol, rtol = _tols(static["out_dtype"])
  return _close(got, want, atol, rtol)


def _indexer_small(a: IndexerArgs, static: dict, tuning, *, topk: bool) -> SmallCase:
  """Indexer scores / fused top-k: the compiled code depends on H, C, the dtypes and key format, the tuning, k, the
  candidate count and (top-k) whether the entries span more than one on-chip chunk, not on B, T, the pool rows or
  M otherwise. The small case: 2 sequences x 2 queries, 64 pool rows, M kept up to 2 chunks (top-k: one chunk's
  entries when they fit in one, else two chunks; scores: 4 entry blocks)."""
  B, T, H, C = a.q_BxTxHxC.shape
  M = a.key_rows_BxM.shape[1]
  if topk:
    chunk = (tuning or IndexerTopkTuning()).select_chunk
    m = M if M <= chunk else 2 * chunk
    tiling = (H, C, M > chunk)
  else:
    m = min(M, 4 * (tuning or IndexerTuning()).block_m)
    tiling = (H, C)
  b, tt = min(B, 2), min(T, 2)
  bt = lambda x: None if x is None else jax.ShapeDtypeStruct((b, tt) + tuple(x.shape[2:]), x.dtype)
  kr = a.key_rows_BxM
  if isinstance(kr, PagedRows):  # a table of at most b rows, wide enough for m entries
    E = kr.entries_per_block
    key_rows = PagedRows(_lead(_cols(kr.table_SxF, -(-m // E)), b), _lead(kr.rows_B, b), E)
    m = key_rows.shape[1]
  else:
    key_rows = jax.ShapeDtypeStruct((b, m), kr.dtype)
  args = IndexerArgs(
      q_BxTxHxC=bt(a.q_BxTxHxC), w_BxTxH=bt(a.w_BxTxH), key_pool_PxC=_small_pool(a.key_pool_PxC),
      key_rows_BxM=key_rows, num_visible_BxT=bt(a.num_visible_BxT),
      allowed_BxTxM=None if a.allowed_BxTxM is None else jax.ShapeDtypeStruct((b, tt, m), a.allowed_BxTxM.dtype),
      num_keys_B=_lead(a.num_keys_B, b), candidate_blocks_BxTxC=bt(a.candidate_blocks_BxTxC))
  return SmallCase(args, tuning, tiling)


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
    "sparse_attention": _OpCheck(_sparse_inputs, _sparse_reference, _sparse_err, _sparse_small),
    "hca_attention": _OpCheck(_hca_inputs, _hca_reference, _hca_err, _hca_small),
    "row_dot": _OpCheck(_row_dot_inputs, _row_dot_reference, _dot_err, _row_dot_small),
    "grouped_dot": _OpCheck(_grouped_dot_inputs, _grouped_dot_reference, _dot_err, _grouped_dot_small),
    "indexer_scores": _OpCheck(_indexer_inputs, _scores_reference, _scores_err,
                               lambda a, s, t: _indexer_small(a, s, t, topk=False)),
    "indexer_topk": _OpCheck(_indexer_inputs, _topk_check_scores, _topk_err,
                             lambda a, s, t: _indexer_small(a, s, t, topk=True)),
})


topk_from_scores = _indexer.topk_from_scores

# Plain-XLA paged indexer (pallas_kernels/indexer_paged.py): block reads through the table, chunked running top-k,
# V4.1 candidates as block ids. The model's path when no indexer kernel is selected.
indexer_topk_paged = _indexer_paged.indexer_topk_paged
indexer_topk_candidates = _indexer_paged.indexer_topk_candidates
candidate_blocks = _indexer_paged.candidate_blocks
candidate_blocks_to_allowed = _indexer.candidate_blocks_to_allowed
