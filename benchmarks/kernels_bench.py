"""Check, then time, the Pallas kernels against the XLA references; report TFLOP/s, GB/s and the split count.

  python benchmarks/kernels_bench.py --jsonl out.jsonl          # GPU: the default case list (below)
  python benchmarks/kernels_bench.py --small --jsonl out.jsonl  # CPU interpret-mode smoke run (CI)

Defaults: decode batch 64 and 256 at 8k and 128k (csa: 128 window + top-512; hca: 128 + ctx/128), bf16 and FP8
(paged layout) rows, prefill 4096 queries at 32k, the indexer (scores; fused top-512 with bf16 and FP8 keys); the
All cases run in this one process. benchmarks/gpu_suite.sh is what runs on a GPU (its kernel rows use this module's
inputs and counting).

Order per case: build inputs, run kernel and reference once and compare (correctness first: a failing case is
recorded and not timed), then time. Each result is appended to the JSONL file as soon as it exists.

Timing is device-side: one jitted `lax.fori_loop` runs `iters` iterations of [flush L2, kernel]; a second jitted
loop runs the flush alone; time per call = (loop - flush loop) / iters, best of `repeats`. The flush rewrites a
buffer of `--flush_mb` (default 256 MB, > the H200's 50 MB L2) so every iteration reads its KV from HBM (batch-64
decode would otherwise sit in L2 and read > 100% of HBM bandwidth). Iterations are chained through the sink /
weights (a scalar carried from the previous output, times 0), so XLA can neither hoist nor overlap them; Python
dispatch is paid once per loop. `hot_ms` is the same loop without the flush.

Counting (BUILD_NOTES.md, Kernels has the roofline; docs/kernels.md the reasoning):
  sparse attention FLOPs = 2 * H * attended * (d_qk + d_v) (attended = valid ids); bytes = Q + unique KV rows x row
    bytes (1024 bf16, 584 FP8 paged incl. its scale tail) + O.
  indexer FLOPs = 2 * H_I * C * visible pairs; bytes = q + w + unique key rows x (C x 2 bf16 | C + 4 FP8) + output
    (f32 scores for indexer_scores, k int32 ids for indexer_topk).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from pallas_kernels import indexer as ix  # noqa: E402
from pallas_kernels import indexer_topk as itk  # noqa: E402
from pallas_kernels import sparse_attention as sa  # noqa: E402

FLAGS = flags.FLAGS


@dataclasses.dataclass
class Result:
  op: str
  case: str
  ok: bool
  max_err: float  # max |err| / tol (<= 1 passes)
  kernel_ms: float  # device time per call, L2 flushed (nan when not timed)
  hot_ms: float  # same, without the flush
  flush_ms: float  # the flush alone, per iteration (subtracted from the flushed loop)
  xla_ms: float  # the XLA reference, L2 flushed
  tflops: float
  gbps: float
  pct_hbm: float
  pct_tc: float
  num_splits: int  # sparse attention: the split count the kernel chose (0 = n/a)
  flops: float
  bytes: float


# ------------------------------------------------------------------------------------------------ roofline model


@dataclasses.dataclass(frozen=True)
class DecodeModel:
  """The sparse decode's predicted time on an H200 (docs/kernels.md, Roofline per configuration), from its bytes,
  FLOPs and tiling. The numbers marked `assumed` are estimates, not measurements: the GPU run tests them.

  time = max(bytes / min(HBM, Little's-law bandwidth), MMA FLOPs / (peak x MMA efficiency x wave fill)) + fixed.
  Little's law: the resident programs (one per SM at the shipped tilings) keep (num_stages - 1) steps of block_k
  gathered rows in flight, cp.async into shared memory; bandwidth = SMs busy x bytes in flight / loaded latency."""
  hbm_bps: float = 4.8e12
  peak_flops: float = 989e12
  num_sms: int = 132
  latency_s: float = 1.0e-6  # assumed: a gather's loaded HBM latency
  wgmma_eff: float = 0.7  # assumed: fraction of peak for m64 x n16 x k16 wgmma tiles (bf16 tiling)
  mma_sync_eff: float = 0.45  # assumed: mma.sync on sm_90 (FP8 tiling: 32 heads a program)
  fixed_s: float = 2.0e-6  # assumed: first gathers' latency, the last wave's drain, the split merge's launch


def predicted_decode(N: int, keys: int, fmt: str, *, H: int = 64, D: int = 512, window: int = 128,
                     model: DecodeModel = DecodeModel()) -> dict:
  """Predicted decode cost of N query tokens over `keys` rows each (window + top-k / HCA entries), fmt "bf16" |
  "fp8" (584-byte rows), at the shipped tiling; returns bytes, FLOPs, times (us) and the predicted % of HBM."""
  fp8 = fmt == "fp8"
  tun = sa.FP8_TUNING if fp8 else sa.BF16_TUNING
  row_bytes = 584 if fp8 else 2 * D
  widths = [min(window, keys), max(0, keys - window)]
  S = sa.chosen_num_splits(N, H, [w for w in widths if w], tun, row_bytes=row_bytes, out_bytes=2, D=D)
  head_blocks = -(-H // min(tun.block_h, max(16, 1 << (H - 1).bit_length())))
  qo = N * H * D * 2  # q in, out written (bf16)
  ideal_bytes = N * keys * row_bytes + 2 * qo  # what the GPU check counts: rows once, q, out
  split_bytes = 2 * N * S * H * D * 2 if S > 1 else 0  # partials written, then read by the merge
  flops = 2.0 * H * keys * 2 * D * N
  programs = N * head_blocks * S
  waves = -(-programs // model.num_sms)
  fill = programs / (waves * model.num_sms)
  busy = min(programs, model.num_sms)
  in_flight = (tun.num_stages - 1) * tun.block_k * row_bytes
  bw = min(model.hbm_bps, busy * in_flight / model.latency_s)
  t_mem = (ideal_bytes + split_bytes) / bw
  # bf16: the QK^T dot (N = 16 keys) is computed by both warpgroups (Triton's layout repeats it): 1.5x the MMAs.
  mma_flops = flops * (1.0 if fp8 else 1.5)
  t_mma = mma_flops / (model.peak_flops * (model.mma_sync_eff if fp8 else model.wgmma_eff) * fill)
  t = max(t_mem, t_mma) + model.fixed_s
  t_hbm, t_tc = ideal_bytes / model.hbm_bps, flops / model.peak_flops
  return dict(N=N, keys=keys, fmt=fmt, splits=S, programs=programs, bytes=ideal_bytes, flops=flops,
              intensity=flops / ideal_bytes, t_hbm_us=t_hbm * 1e6, t_tc_us=t_tc * 1e6, bw_tbps=bw / 1e12,
              t_mem_us=t_mem * 1e6, t_mma_us=t_mma * 1e6, t_us=t * 1e6, pct_hbm=100 * t_hbm / t,
              limit="memory" if t_mem >= t_mma else "MMA")


def roofline_table(batches=(1, 8, 16, 32, 64, 96, 128), configs=(("csa", 640), ("top2048", 2176), ("hca128k", 1152))):
  """Markdown rows of `predicted_decode` for bf16 and FP8 pools (docs/kernels.md)."""
  lines = ["| layer (keys) | pool | batch | splits | programs | MB | GFLOP | FLOP/B | HBM us | TC us | "
           "bandwidth TB/s | predicted us | limit | predicted % HBM |", "|" + "---|" * 14]
  for name, keys in configs:
    for fmt in ("bf16", "fp8"):
      for b in batches:
        r = predicted_decode(b, keys, fmt)
        lines.append(f"| {name} ({keys}) | {fmt} | {b} | {r['splits']} | {r['programs']} | {r['bytes'] / 1e6:.1f} | "
                     f"{r['flops'] / 1e9:.2f} | {r['intensity']:.0f} | {r['t_hbm_us']:.2f} | {r['t_tc_us']:.2f} | "
                     f"{r['bw_tbps']:.2f} | {r['t_us']:.2f} | {r['limit']} | {r['pct_hbm']:.0f} |")
  return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ timing


def _chain(args, carry, slot):
  """args with args[slot] += carry * 0 (a float scalar from the previous iteration): serializes iterations."""
  a = list(args)
  a[slot] = (a[slot].astype(jnp.float32) + carry * 0.0).astype(a[slot].dtype)
  return tuple(a)


def _first_scalar(out):
  leaf = jax.tree_util.tree_leaves(out)[0]
  return leaf.reshape(-1)[0].astype(jnp.float32)


def device_time_ms(fn, args, slot, *, iters, repeats, flush_elems):
  """(flushed ms, hot ms, flush-only ms) per call of fn(*args), measured as loops inside one jit (see module
  docstring). flush_elems=0 measures no flush (the CPU dry run: nothing to evict, and a single noisy difference of
  two loops could come out negative): the flushed time is then the hot time."""

  def loop(flush: bool, with_fn: bool):
    def run(args, buf):
      def body(i, c):
        carry, buf = c
        if flush:
          buf = buf + carry * 0.0 + 1.0  # rewrite the whole buffer: evicts L2
          carry = carry + buf[0] * 0.0
        if with_fn:
          carry = carry + _first_scalar(fn(*_chain(args, carry, slot))) * 0.0
        return carry, buf
      carry, buf = jax.lax.fori_loop(0, iters, body, (jnp.float32(0), buf))
      return carry, buf
    return jax.jit(run)

  buf = jnp.zeros((flush_elems,), jnp.float32)

  def best(f):
    jax.block_until_ready(f(args, buf))  # compile + warm up
    t = float("inf")
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(f(args, buf))
      t = min(t, time.perf_counter() - t0)
    return t

  if flush_elems == 0:
    t_hot = best(loop(False, True))
    return t_hot / iters * 1e3, t_hot / iters * 1e3, 0.0
  t_flush_fn = best(loop(True, True))
  t_flush = best(loop(True, False))
  t_hot = best(loop(False, True))
  # A non-positive difference means the flush's jitter swamped the kernel: report nan, not a fake 0.
  diff = t_flush_fn - t_flush
  return (diff / iters * 1e3 if diff > 0 else float("nan")), t_hot / iters * 1e3, t_flush / iters * 1e3


def tol_ratio(got, want, atol, rtol):
  """max |got - want| / (atol + rtol |want|) over finite entries (<= 1 passes); inf if the inf/NaN pattern differs."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  fin = np.isfinite(want)
  if np.isnan(got).any() or not np.array_equal(np.isfinite(got), fin) or not np.array_equal(got[~fin], want[~fin]):
    return float("inf")
  if not fin.any():
    return 0.0
  return float(np.max(np.abs(got[fin] - want[fin]) / (atol + rtol * np.abs(want[fin]))))


def unique_valid(idx, rows):
  idx = np.asarray(idx).ravel()
  v = (idx >= 0) & (idx < rows)
  return np.unique(idx[v]).size, int(v.sum())


# ------------------------------------------------------------------------------------------------ sparse attention


def synthetic_rows(k2, k3, k4, *, N, D, W, K, E, seqs, hca, prefill, ctx, dtype, ratio):
  """Window and compressed pools with their index rows. Prefill: one sequence, N queries at the last N positions
  of ctx (window rows before each, the compressed entries visible at its position, `ratio` tokens per entry, top-K
  of random scores). Decode: `seqs` sequences with their own window rows and E compressed entries each (all of
  them for HCA, K distinct ones for CSA)."""
  if prefill:
    pos = ctx - N + jnp.arange(N)
    win_pool = jax.random.normal(k2, (ctx, D), dtype)
    win_idx = pos[:, None] - (W - 1) + jnp.arange(W)[None, :]
    win_idx = jnp.where(win_idx >= 0, win_idx, -1)
    comp_pool = jax.random.normal(k3, (E, D), dtype)
    vis = (pos + 1) // ratio
    r = jnp.where(jnp.arange(E)[None, :] < vis[:, None], jax.random.uniform(k4, (N, E)), -1.0)
    vals, comp_idx = jax.lax.top_k(r, K)
    comp_idx = jnp.where(vals >= 0, comp_idx, -1)
  else:
    win_pool = jax.random.normal(k2, (seqs * W, D), dtype)
    win_idx = jnp.arange(seqs)[:, None] * W + jnp.arange(W)[None, :]
    comp_pool = jax.random.normal(k3, (seqs * E, D), dtype)
    if hca:
      comp_idx = jnp.arange(seqs)[:, None] * E + jnp.arange(E)[None, :]
    else:
      _, pick = jax.lax.top_k(jax.random.uniform(k4, (seqs, E)), K)  # K distinct entries per sequence
      comp_idx = jnp.arange(seqs)[:, None] * E + pick
  return win_pool, win_idx, comp_pool, comp_idx


def sparse_case(key, *, N, H, D, W, K, comp_rows_per_seq, seqs, hca, fmt, prefill, ctx, page_size):
  """Decode: N = seqs sequences, one query each, own window rows and compressed region. Prefill: one sequence,
  N queries at the last N positions of a ctx-token context."""
  k1, k2, k3, k4, k5 = jax.random.split(key, 5)
  q = (jax.random.normal(k1, (N, H, D), jnp.float32) * 0.05).astype(jnp.bfloat16)
  E = comp_rows_per_seq
  win_pool, win_idx, comp_pool, comp_idx = synthetic_rows(k2, k3, k4, N=N, D=D, W=W, K=K, E=E, seqs=seqs, hca=hca,
                                                          prefill=prefill, ctx=ctx, dtype=jnp.bfloat16, ratio=4)
  sink = jax.random.normal(k5, (H,), jnp.float32)
  if fmt == "fp8":
    win_pool = sa.record_to_paged(sa.quantize_kv_fp8(win_pool), page_size)
    comp_pool = sa.record_to_paged(sa.quantize_kv_fp8(comp_pool), page_size)
  return q, win_pool, win_idx.astype(jnp.int32), comp_pool, comp_idx.astype(jnp.int32), sink


def bench_sparse(name, args, *, interpret, tuning, timing, hbm, peak, D):
  q, wp, wi, cp, ci, sink = args
  N, H, _ = q.shape
  scale = D ** -0.5
  kern = jax.jit(lambda *a: sa.sparse_attention_pallas(*a, scale=scale, interpret=interpret, tuning=tuning))
  ref = jax.jit(lambda *a: sa.sparse_attention_reference(*a, scale=scale))
  ko, kl = kern(*args)
  ro, rl = ref(*args)
  err = max(tol_ratio(ko, ro, 1.5e-2, 2e-2), tol_ratio(kl, rl, 1e-3, 1e-3))  # bf16 out, f32 lse
  del ko, kl, ro, rl
  uw, aw = unique_valid(wi, sa.pool_rows(wp))
  uc, ac = unique_valid(ci, sa.pool_rows(cp))
  flops = 2.0 * H * (aw + ac) * (D + D)
  nbytes = N * H * D * 2 * 2 + uw * sa.pool_row_bytes(wp) + uc * sa.pool_row_bytes(cp)
  splits = sa.chosen_num_splits(N, H, [wi.shape[1], ci.shape[1]], tuning or sa.default_tuning([wp, cp]),
                                row_bytes=max(sa.pool_row_bytes(wp), sa.pool_row_bytes(cp)), out_bytes=2, D=D)
  return finish("sparse_attention", name, err, kern, ref, args, 5, timing, flops, nbytes, hbm, peak, splits)


def finish(op, name, err, kern, ref, args, slot, timing, flops, nbytes, hbm, peak, splits):
  ok = err <= 1.0
  k_ms = hot = x_ms = fl_ms = float("nan")
  if ok and timing is not None:  # correctness first: a wrong kernel is not timed
    k_ms, hot, fl_ms = device_time_ms(kern, args, slot, **{k: v for k, v in timing.items() if k != "time_xla"})
    if timing.get("time_xla"):
      x_ms, _, _ = device_time_ms(ref, args, slot, **{k: v for k, v in timing.items() if k != "time_xla"})
  s = k_ms * 1e-3
  tf = flops / s / 1e12 if s > 0 else float("nan")  # nan propagates from an untimed / unresolved case
  gb = nbytes / s / 1e9 if s > 0 else float("nan")
  return Result(op, name, ok, err, k_ms, hot, fl_ms, x_ms, tf, gb, 100 * gb * 1e9 / hbm, 100 * tf * 1e12 / peak, splits,
                flops, nbytes)


# ------------------------------------------------------------------------------------------------ indexer


def indexer_case(key, *, B, T, H, C, M, prefill, ctx, fp8):
  k1, k2, k3 = jax.random.split(key, 3)
  q = jax.random.normal(k1, (B, T, H, C), jnp.bfloat16)
  w = jax.random.uniform(k2, (B, T, H), jnp.float32) * (C * H) ** -0.5
  pool = jax.random.normal(k3, (B * M, C), jnp.bfloat16)
  if fp8:
    pool = itk.quantize_index_keys(pool)
  rows = (jnp.arange(B)[:, None] * M + jnp.arange(M)[None, :]).astype(jnp.int32)
  if prefill:
    pos = ctx - T + jnp.arange(T)
    nv = jnp.broadcast_to(((pos + 1) // 4)[None, :], (B, T))
  else:
    nv = jnp.full((B, T), M)
  return q, w, pool, rows, nv.astype(jnp.int32)


def _ref_pool(pool):
  return itk.dequantize_index_keys(pool, jnp.bfloat16) if isinstance(pool, itk.Fp8IndexKeys) else pool


def bench_indexer(name, args, *, interpret, tuning, timing, hbm, peak, topk, k):
  q, w, pool, rows, nv = args
  B, T, H, C = q.shape
  M = rows.shape[1]
  pairs = float(np.minimum(np.asarray(nv), M).sum())
  flops = 2.0 * H * C * pairs
  uk, _ = unique_valid(rows, pool.shape[0])
  row_bytes = pool.bytes_per_row if isinstance(pool, itk.Fp8IndexKeys) else C * 2
  want = jax.jit(lambda q, w, p, r, n: ix.indexer_scores_reference(q, w, _ref_pool(p), r, n))(*args)
  if topk:
    kern = jax.jit(lambda *a: itk.indexer_topk_pallas(*a, k=k, interpret=interpret, tuning=tuning))
    ref = jax.jit(lambda q, w, p, r, n: ix.topk_from_scores(ix.indexer_scores_reference(q, w, _ref_pool(p), r, n),
                                                             k)[0])
    got = np.asarray(kern(*args))
    # Set comparison with ties at the k-th score tolerated: every pick must score >= the k-th reference score
    # (minus a bf16-sized tolerance) and the count of valid picks must match.
    ws = np.asarray(want)
    kk = min(k, M)
    kth = -np.sort(-ws, axis=-1)[..., kk - 1]
    tol = 1e-2 * np.maximum(1.0, np.abs(kth))
    picked = np.take_along_axis(ws, np.maximum(got, 0), axis=-1)
    good = np.where(got >= 0, picked >= (kth - tol)[..., None], True)
    n_ok = (got >= 0).sum(-1) == np.isfinite(ws).sum(-1).clip(max=kk)
    uniq = all(len(set(r[r >= 0].tolist())) == (r >= 0).sum() for r in got.reshape(-1, got.shape[-1]))
    err = 0.0 if (good.all() and n_ok.all() and uniq) else float("inf")
    nbytes = q.size * 2 + w.size * 4 + uk * row_bytes + B * T * kk * 4
    op = "indexer_topk"
  else:
    kern = jax.jit(lambda *a: ix.indexer_scores_pallas(*a, interpret=interpret, tuning=tuning))
    ref = jax.jit(ix.indexer_scores_reference)
    err = tol_ratio(kern(*args), want, 1e-2, 1e-2)
    nbytes = q.size * 2 + w.size * 4 + uk * row_bytes + B * T * M * 4
    op = "indexer_scores"
  del want
  return finish(op, name, err, kern, ref, args, 1, timing, flops, nbytes, hbm, peak, 0)


# ------------------------------------------------------------------------------------------------ driver


def define_flags():
  flags.DEFINE_bool("small", False, "tiny shapes, interpret mode on CPU (CI smoke run)")
  flags.DEFINE_string("batches", "64,256", "decode batch sizes")
  flags.DEFINE_string("contexts", "8192,131072", "decode contexts (tokens)")
  flags.DEFINE_integer("prefill_queries", 4096, "prefill queries per case")
  flags.DEFINE_string("prefill_contexts", "32768", "prefill contexts (tokens)")
  flags.DEFINE_string("formats", "bf16,fp8", "KV pool formats")
  flags.DEFINE_string("ops", "sparse_decode,sparse_prefill,indexer_decode,indexer_prefill", "kernels to run")
  flags.DEFINE_string("kinds", "csa,hca", "decode layer kinds: csa (128 + top-512), hca (128 + ctx/128)")
  flags.DEFINE_integer("iters", 20, "timed iterations per repeat")
  flags.DEFINE_integer("repeats", 3, "timed repeats (best reported)")
  flags.DEFINE_float("flush_mb", 256.0, "L2 flush buffer (MB) between iterations")
  flags.DEFINE_float("hbm_gbps", 4800.0, "H200 HBM3e")
  flags.DEFINE_float("peak_tflops", 989.0, "H100/H200 dense bf16")
  flags.DEFINE_integer("page_size", 64, "paged pool: tokens per page")
  flags.DEFINE_integer("block_h", 0, "0: the pool format's shipped tuning (default_tuning)")
  flags.DEFINE_integer("block_k", 0, "0: the pool format's shipped tuning")
  flags.DEFINE_bool("roofline", False, "print the predicted decode roofline table and exit")
  flags.DEFINE_integer("num_splits", 0, "split-K partitions of the decode kernel")
  flags.DEFINE_integer("num_warps", 8, "Triton warps")
  flags.DEFINE_integer("num_stages", 3, "Triton pipeline stages")
  flags.DEFINE_bool("no_time", False, "correctness only")
  flags.DEFINE_bool("time_xla", False, "also time the XLA references (3 more compiles per case; off in the GPU "
                    "check's budget)")
  flags.DEFINE_string("jsonl", "", "append each result here as soon as it exists")
  flags.DEFINE_string("json", "", "also write all results as one JSON list at the end")


def main(argv):
  del argv
  a = FLAGS
  if a.roofline:
    print(roofline_table())
    return
  on_gpu = jax.default_backend() == "gpu"
  interpret = not on_gpu
  ints = lambda s: [int(x) for x in s.split(",") if x]
  ops = set(a.ops.split(","))
  if a.small:
    H, D, W, K, HI, C, TOPK = 16, 128, 16, 32, 16, 32, 16
    batches, contexts, pf_ctx, pf_q, iters, repeats, page = [2], [512], [512], 16, 2, 1, 4
    tuning = sa.SparseAttentionTuning(block_h=16, block_k=16)
    ituning = ix.IndexerTuning(block_m=32)
    ttuning = itk.IndexerTopkTuning(block_m=32, select_chunk=64)
    flush_elems = 1024
  else:
    H, D, W, K, HI, C, TOPK = 64, 512, 128, 512, 64, 128, 512
    batches, contexts, pf_ctx, pf_q = ints(a.batches), ints(a.contexts), ints(a.prefill_contexts), a.prefill_queries
    iters, repeats, page = a.iters, a.repeats, a.page_size
    tuning = None  # each pool format's shipped tuning
    if a.block_h or a.block_k or a.num_splits or a.num_warps != 8 or a.num_stages != 3:
      tuning = sa.SparseAttentionTuning(block_h=a.block_h or 64, block_k=a.block_k or 16, num_splits=a.num_splits,
                                        num_warps=a.num_warps, num_stages=a.num_stages)
    ituning = ix.IndexerTuning()
    ttuning = itk.IndexerTopkTuning()
    flush_elems = int(a.flush_mb * 2 ** 20 / 4)
  timing = None if a.no_time else dict(iters=iters, repeats=repeats, flush_elems=flush_elems,
                                       time_xla=a.time_xla or a.small)
  hbm, peak = a.hbm_gbps * 1e9, a.peak_tflops * 1e12
  common = dict(interpret=interpret, timing=timing, hbm=hbm, peak=peak)
  env = dict(backend=jax.default_backend(), devices=[d.device_kind for d in jax.devices()], jax=jax.__version__,
             interpret=interpret, small=a.small)
  print(f"# {json.dumps(env)}", flush=True)
  if interpret and not a.small:
    print("# WARNING: no GPU: kernels run in interpret mode; timings are meaningless", flush=True)
  key = jax.random.PRNGKey(0)
  results = []
  jsonl = open(a.jsonl, "a") if a.jsonl else None

  def emit(r):
    results.append(r)
    if jsonl:
      jsonl.write(json.dumps(dict(dataclasses.asdict(r), env=env)) + "\n")
      jsonl.flush()
    print(f"{r.op:16s} {r.case:34s} {'ok  ' if r.ok else 'FAIL'} err/tol {r.max_err:6.2f}  kernel {r.kernel_ms:8.3f} ms"
          f" (hot {r.hot_ms:8.3f})  xla {r.xla_ms:8.3f} ms  {r.tflops:7.2f} TFLOP/s  {r.gbps:8.1f} GB/s "
          f"({r.pct_hbm:5.1f}% HBM, {r.pct_tc:5.1f}% TC)  splits {r.num_splits}", flush=True)

  formats, kinds = a.formats.split(","), a.kinds.split(",")
  decode_cfgs = [(k, f) for f in formats for k in kinds]
  prefill_fmts = formats
  if a.small:  # one case per code path keeps the CPU run short: bf16 + fp8 pools, csa + hca, decode + prefill
    decode_cfgs, prefill_fmts = [("csa", "bf16"), ("hca", "fp8")], ["fp8"]
  if "sparse_decode" in ops:
    for kind, fmt in decode_cfgs:
      for ctx in contexts:
        for b in batches:
          E = ctx // (128 if kind == "hca" else 4)
          args = sparse_case(key, N=b, H=H, D=D, W=W, K=E if kind == "hca" else K, comp_rows_per_seq=E,
                             seqs=b, hca=kind == "hca", fmt=fmt, prefill=False, ctx=ctx, page_size=page)
          emit(bench_sparse(f"decode {kind} {fmt} b{b} ctx{ctx}", args, tuning=tuning, D=D, **common))
          del args
  if "sparse_prefill" in ops:
    for fmt in prefill_fmts:
      for ctx in pf_ctx:
        args = sparse_case(key, N=pf_q, H=H, D=D, W=W, K=K, comp_rows_per_seq=ctx // 4, seqs=1, hca=False,
                           fmt=fmt, prefill=True, ctx=ctx, page_size=page)
        emit(bench_sparse(f"prefill csa {fmt} q{pf_q} ctx{ctx}", args, tuning=tuning, D=D, **common))
        del args
  key_fmts = ["bf16", "fp8"] if not a.small else ["fp8"]
  if "indexer_decode" in ops:
    for ctx in contexts:
      for b in batches:
        args = indexer_case(key, B=b, T=1, H=HI, C=C, M=ctx // 4, prefill=False, ctx=ctx, fp8=False)
        emit(bench_indexer(f"decode bf16 b{b} ctx{ctx}", args, tuning=ituning, topk=False, k=TOPK, **common))
        for kf in key_fmts:
          args = indexer_case(key, B=b, T=1, H=HI, C=C, M=ctx // 4, prefill=False, ctx=ctx, fp8=kf == "fp8")
          emit(bench_indexer(f"decode {kf} b{b} ctx{ctx} k{TOPK}", args, tuning=ttuning, topk=True, k=TOPK,
                             **common))
        del args
  if "indexer_prefill" in ops:
    for ctx in pf_ctx:
      args = indexer_case(key, B=1, T=pf_q, H=HI, C=C, M=ctx // 4, prefill=True, ctx=ctx, fp8=False)
      emit(bench_indexer(f"prefill bf16 q{pf_q} ctx{ctx}", args, tuning=ituning, topk=False, k=TOPK, **common))
      emit(bench_indexer(f"prefill bf16 q{pf_q} ctx{ctx} k{TOPK}", args, tuning=ttuning, topk=True, k=TOPK,
                         **common))
      del args
  if jsonl:
    jsonl.close()
  if a.json:
    with open(a.json, "w") as f:
      json.dump(dict(env=env, results=[dataclasses.asdict(r) for r in results]), f, indent=1)
  bad = [r for r in results if not r.ok]
  if bad:
    print(f"# {len(bad)} check(s) FAILED", flush=True)
  return 1 if bad else 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
