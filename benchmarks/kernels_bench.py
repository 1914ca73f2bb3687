"""Check and time the Pallas kernels against the XLA references; report TFLOP/s and GB/s (FlashMLA counting).

  python benchmarks/kernels_bench.py            # GPU: full sweep (decode batch 1..256 at 8k..128k, prefill 4k q)
  python benchmarks/kernels_bench.py --small    # CPU (interpret mode) smoke run, used by CI so this cannot rot

Counting (see pallas_kernels/NOTES.md):
  sparse attention FLOPs = 2 * H * attended * (d_qk + d_v), attended = valid (id >= 0, < pool rows) keys over all
    queries (window + compressed); d_qk = d_v = 512.
  sparse attention bytes = Q (bf16) + unique KV rows fetched x row bytes (1024 bf16, 584 FP8 record) + O (bf16).
  indexer FLOPs = 2 * H_I * C * visible (query, entry) pairs; bytes = q + w + unique key rows x C x 2 + scores (f32).
Timing: jit'd call, warm-up, then `iters` back-to-back calls blocked once, best of `repeats` (includes launch overhead,
like FlashMLA's triton.testing.do_bench without L2 flush).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import indexer as ix  # noqa: E402
from pallas_kernels import sparse_attention as sa  # noqa: E402


@dataclasses.dataclass
class Result:
  op: str
  case: str
  kernel_ms: float
  xla_ms: float
  tflops: float
  gbps: float
  pct_hbm: float
  pct_tc: float
  max_err: float
  ok: bool


def time_fn(f, args, iters, repeats):
  out = f(*args)
  jax.block_until_ready(out)
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(iters):
      out = f(*args)
    jax.block_until_ready(out)
    best = min(best, (time.perf_counter() - t0) / iters)
  return best * 1e3, out


def unique_valid(idx, rows):
  idx = np.asarray(idx).ravel()
  return np.unique(idx[(idx >= 0) & (idx < rows)]).size, int(((idx >= 0) & (idx < rows)).sum())


def tol_ratio(got, want, atol, rtol):
  """max |got - want| / (atol + rtol |want|) over finite entries (<= 1 passes); inf if the inf/NaN pattern differs."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  fin = np.isfinite(want)
  if np.isnan(got).any() or not np.array_equal(np.isfinite(got), fin) or not np.array_equal(got[~fin], want[~fin]):
    return float("inf")
  if not fin.any():
    return 0.0
  return float(np.max(np.abs(got[fin] - want[fin]) / (atol + rtol * np.abs(want[fin]))))


# ------------------------------------------------------------------------------------------------ sparse attention


def sparse_case(key, *, N, H, D, W, K, comp_rows_per_seq, seqs, hca, fmt, prefill, ctx):
  """Decode: N = seqs sequences, one query each, own window rows and compressed region. Prefill: one sequence,
  N queries at the last N positions of a ctx-token context."""
  k1, k2, k3, k4, k5 = jax.random.split(key, 5)
  q = (jax.random.normal(k1, (N, H, D), jnp.float32) * 0.05).astype(jnp.bfloat16)
  if prefill:
    pos = ctx - N + jnp.arange(N)
    win_pool = jax.random.normal(k2, (ctx, D), jnp.bfloat16)
    win_idx = pos[:, None] - (W - 1) + jnp.arange(W)[None, :]
    win_idx = jnp.where(win_idx >= 0, win_idx, -1)
    E = comp_rows_per_seq
    comp_pool = jax.random.normal(k3, (E, D), jnp.bfloat16)
    vis = (pos + 1) // 4
    r = jax.random.uniform(k4, (N, E))
    r = jnp.where(jnp.arange(E)[None, :] < vis[:, None], r, -1.0)
    vals, comp_idx = jax.lax.top_k(r, K)
    comp_idx = jnp.where(vals >= 0, comp_idx, -1)
  else:
    win_pool = jax.random.normal(k2, (seqs * W, D), jnp.bfloat16)
    win_idx = jnp.arange(seqs)[:, None] * W + jnp.arange(W)[None, :]
    E = comp_rows_per_seq
    comp_pool = jax.random.normal(k3, (seqs * E, D), jnp.bfloat16)
    if hca:
      comp_idx = jnp.arange(seqs)[:, None] * E + jnp.arange(E)[None, :]
    else:
      _, pick = jax.lax.top_k(jax.random.uniform(k4, (seqs, E)), K)  # K distinct entries per sequence
      comp_idx = jnp.arange(seqs)[:, None] * E + pick
  sink = jax.random.normal(k5, (H,), jnp.float32)
  if fmt == "fp8":
    win_pool, comp_pool = sa.quantize_kv_fp8(win_pool), sa.quantize_kv_fp8(comp_pool)
  return q, win_pool, win_idx.astype(jnp.int32), comp_pool, comp_idx.astype(jnp.int32), sink


def bench_sparse(name, args, *, interpret, tuning, iters, repeats, hbm, peak, check, D):
  q, wp, wi, cp, ci, sink = args
  N, H, _ = q.shape
  scale = D ** -0.5
  kern = jax.jit(lambda *a: sa.sparse_attention_pallas(*a, scale=scale, interpret=interpret, tuning=tuning))
  ref = jax.jit(lambda *a: sa.sparse_attention_reference(*a, scale=scale))
  k_ms, (ko, kl) = time_fn(kern, args, iters, repeats)
  x_ms, (ro, rl) = time_fn(ref, args, iters, repeats)
  uw, aw = unique_valid(wi, sa.pool_rows(wp))
  uc, ac = unique_valid(ci, sa.pool_rows(cp))
  flops = 2.0 * H * (aw + ac) * (D + D)
  nbytes = N * H * D * 2 * 2 + uw * sa.pool_row_bytes(wp) + uc * sa.pool_row_bytes(cp)
  err = max(tol_ratio(ko, ro, 1.5e-2, 2e-2), tol_ratio(kl, rl, 1e-3, 1e-3))  # bf16 out, f32 lse
  ok = (not check) or err <= 1.0
  s = k_ms * 1e-3
  return Result("sparse_attention", name, k_ms, x_ms, flops / s / 1e12, nbytes / s / 1e9,
                100 * nbytes / s / hbm, 100 * flops / s / peak, err, ok)


# ------------------------------------------------------------------------------------------------ indexer


def indexer_case(key, *, B, T, H, C, M, prefill, ctx):
  k1, k2, k3 = jax.random.split(key, 3)
  q = jax.random.normal(k1, (B, T, H, C), jnp.bfloat16)
  w = jax.random.uniform(k2, (B, T, H), jnp.float32) * (C * H) ** -0.5
  pool = jax.random.normal(k3, (B * M, C), jnp.bfloat16)
  rows = (jnp.arange(B)[:, None] * M + jnp.arange(M)[None, :]).astype(jnp.int32)
  if prefill:
    pos = ctx - T + jnp.arange(T)
    nv = jnp.broadcast_to(((pos + 1) // 4)[None, :], (B, T))
  else:
    nv = jnp.full((B, T), M)
  return q, w, pool, rows, nv.astype(jnp.int32), None


def bench_indexer(name, args, *, interpret, tuning, iters, repeats, hbm, peak, check):
  q, w, pool, rows, nv, allowed = args
  B, T, H, C = q.shape
  M = rows.shape[1]
  kern = jax.jit(lambda *a: ix.indexer_scores_pallas(*a, interpret=interpret, tuning=tuning))
  ref = jax.jit(ix.indexer_scores_reference)
  k_ms, ko = time_fn(kern, args, iters, repeats)
  x_ms, ro = time_fn(ref, args, iters, repeats)
  pairs = float(np.minimum(np.asarray(nv), M).sum())
  flops = 2.0 * H * C * pairs
  uk, _ = unique_valid(rows, pool.shape[0])
  nbytes = q.size * 2 + w.size * 4 + uk * C * 2 + B * T * M * 4
  err = tol_ratio(ko, ro, 1e-3, 1e-3)
  ok = (not check) or err <= 1.0
  s = k_ms * 1e-3
  return Result("indexer_scores", name, k_ms, x_ms, flops / s / 1e12, nbytes / s / 1e9,
                100 * nbytes / s / hbm, 100 * flops / s / peak, err, ok)


# ------------------------------------------------------------------------------------------------ driver


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--small", action="store_true", help="tiny shapes, interpret mode on CPU (CI smoke run)")
  p.add_argument("--batches", default="1,16,64,128,256")
  p.add_argument("--contexts", default="8192,32768,131072")
  p.add_argument("--prefill_queries", type=int, default=4096)
  p.add_argument("--prefill_contexts", default="8192,32768")
  p.add_argument("--formats", default="bf16,fp8")
  p.add_argument("--ops", default="sparse_decode,sparse_prefill,indexer_decode,indexer_prefill")
  p.add_argument("--kinds", default="csa,hca", help="decode layer kinds: csa (128 + top-512), hca (128 + ctx/128)")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--hbm_gbps", type=float, default=4800.0, help="H200 HBM3e")
  p.add_argument("--peak_tflops", type=float, default=989.0, help="H100/H200 dense bf16")
  p.add_argument("--block_h", type=int, default=64)
  p.add_argument("--block_k", type=int, default=32)
  p.add_argument("--num_splits", type=int, default=0)
  p.add_argument("--num_warps", type=int, default=8)
  p.add_argument("--num_stages", type=int, default=2)
  p.add_argument("--no_check", action="store_true")
  p.add_argument("--json", default="", help="write results here")
  return p.parse_args(argv)


def main(argv=None):
  a = parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  interpret = not on_gpu
  ints = lambda s: [int(x) for x in s.split(",") if x]
  ops = set(a.ops.split(","))
  if a.small:
    H, D, W, K, HI, C = 16, 128, 16, 32, 16, 32
    batches, contexts, pf_ctx, pf_q, iters, repeats = [2], [512], [512], 32, 1, 1
    tuning = sa.SparseAttentionTuning(block_h=16, block_k=16)
    ituning = ix.IndexerTuning(block_m=32)
  else:
    H, D, W, K, HI, C = 64, 512, 128, 512, 64, 128
    batches, contexts, pf_ctx, pf_q = ints(a.batches), ints(a.contexts), ints(a.prefill_contexts), a.prefill_queries
    iters, repeats = a.iters, a.repeats
    tuning = sa.SparseAttentionTuning(block_h=a.block_h, block_k=a.block_k, num_splits=a.num_splits,
                                      num_warps=a.num_warps, num_stages=a.num_stages)
    ituning = ix.IndexerTuning()
  hbm, peak = a.hbm_gbps * 1e9, a.peak_tflops * 1e12
  common = dict(interpret=interpret, iters=iters, repeats=repeats, hbm=hbm, peak=peak, check=not a.no_check)
  print(f"# backend={jax.default_backend()} devices={jax.devices()} jax={jax.__version__} "
        f"interpret={interpret} small={a.small}", flush=True)
  if interpret and not a.small:
    print("# WARNING: no GPU: kernels run in interpret mode; timings are meaningless", flush=True)
  key = jax.random.PRNGKey(0)
  results = []

  def emit(r):
    results.append(r)
    print(f"{r.op:16s} {r.case:38s} kernel {r.kernel_ms:9.3f} ms  xla {r.xla_ms:9.3f} ms  "
          f"{r.tflops:7.2f} TFLOP/s  {r.gbps:8.1f} GB/s ({r.pct_hbm:5.1f}% HBM, {r.pct_tc:5.1f}% TC)  "
          f"err/tol {r.max_err:.2f} {'ok' if r.ok else 'FAIL'}", flush=True)

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
                             seqs=b, hca=kind == "hca", fmt=fmt, prefill=False, ctx=ctx)
          emit(bench_sparse(f"decode {kind} {fmt} b{b} ctx{ctx}", args, tuning=tuning, D=D, **common))
          del args
  if "sparse_prefill" in ops:
    for fmt in prefill_fmts:
      for ctx in pf_ctx:
        args = sparse_case(key, N=pf_q, H=H, D=D, W=W, K=K, comp_rows_per_seq=ctx // 4, seqs=1, hca=False,
                           fmt=fmt, prefill=True, ctx=ctx)
        emit(bench_sparse(f"prefill csa {fmt} q{pf_q} ctx{ctx}", args, tuning=tuning, D=D, **common))
        del args
  if "indexer_decode" in ops:
    for ctx in contexts:
      for b in batches:
        args = indexer_case(key, B=b, T=1, H=HI, C=C, M=ctx // 4, prefill=False, ctx=ctx)
        emit(bench_indexer(f"decode b{b} ctx{ctx}", args, tuning=ituning, **common))
  if "indexer_prefill" in ops:
    for ctx in pf_ctx:
      args = indexer_case(key, B=1, T=pf_q, H=HI, C=C, M=ctx // 4, prefill=True, ctx=ctx)
      emit(bench_indexer(f"prefill q{pf_q} ctx{ctx}", args, tuning=ituning, **common))
  if a.json:
    with open(a.json, "w") as f:
      json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
  bad = [r for r in results if not r.ok]
  if bad:
    print(f"# {len(bad)} check(s) FAILED", flush=True)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
