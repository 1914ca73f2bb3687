"""The case side of the GPU check (benchmarks/gpu_check.py): runs one planned case in its own process
(`python -m benchmarks.gpu_check --child NAME`) and writes its result row. This module imports JAX (inside its
functions); the parent that plans, times out and reports never imports it.

Kernel inputs are the named argument records of `pallas_kernels.dispatch` (`SparseArgs`, `IndexerArgs`), so
every kernel, reference and check below picks its arrays by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from benchmarks.gpu_check import Case, last_line, plan, shapes_of, write_atomic


def child_main(args) -> int:
  """Run one case; write its result row (JSON) to --result. Never raises: failures become rows."""
  if args.child_inject == "raise":  # before any import: the parent must report it from the log alone
    raise RuntimeError("injected failure (--inject raise)")
  if args.child_inject == "hang":
    print("injected hang (--inject hang)", flush=True)
    while True:
      time.sleep(3600)
  if args.child_inject == "crash":
    print("injected crash (--inject crash)", flush=True)
    os.abort()
  if args.env_only:
    _child_write(args.result, _jax_env())
    return 0
  cases = {c.name: c for c in plan()}
  case = cases[args.child]
  try:
    row = run_case(case, args)
  except Exception as e:  # noqa: BLE001 - a lowering / compile / launch failure is a row, not a crash
    import traceback
    traceback.print_exc()
    row = dict(status="error", error=last_line(f"{type(e).__name__}: {e}"))
  _child_write(args.result, row)
  return 0


def _child_write(path, row):
  write_atomic(path, json.dumps(row, default=_json_default))


def _json_default(x):
  try:
    return float(x)
  except (TypeError, ValueError):
    return str(x)


def _jax_env() -> dict:
  import jax
  env = dict(jax=jax.__version__, backend=jax.default_backend(), devices=[d.device_kind for d in jax.devices()])
  try:
    import jaxlib
    env["jaxlib"] = jaxlib.__version__
  except Exception:  # noqa: BLE001
    pass
  return env


def _arrays(args) -> dict:
  """Every input array's [shape, dtype], keyed by its field name in the argument record (and its path in a pool)."""
  import jax
  out = {}
  for name, value in args._asdict().items():
    for path, leaf in jax.tree_util.tree_leaves_with_path(value):
      out[name + jax.tree_util.keystr(path)] = [list(leaf.shape), str(leaf.dtype)]
  return out


def _on_record(record_type, fn):
  """`fn(record)` as a function of the record's fields in order: kernels_bench times fn(*args) (and chains one of
  them from call to call), the kernels and references here read the record by name."""
  return lambda *arrays: fn(record_type(*arrays))


def _chained_slot(record, field: str) -> int:
  """The position kernels_bench.device_time_ms chains from call to call: the named field's."""
  return record._fields.index(field)


def run_case(case: Case, args) -> dict:
  import jax
  if args.jax_cache and not args.dry_run:
    try:
      jax.config.update("jax_compilation_cache_dir", args.jax_cache)
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    except Exception:  # noqa: BLE001 - an optional speed-up
      pass
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not args.dry_run:
    raise RuntimeError(f"no GPU (backend {jax.default_backend()}): use --dry-run on a CPU")
  p = shapes_of(case, args.dry_run)
  # A timing case writes its checked row before timing: a timeout then still records the check.
  partial = lambda row: _child_write(args.result, dict(row, error="timing not finished"))
  ctx = dict(args=args, p=p, case=case, dry=args.dry_run, inject=args.child_inject, partial=partial)
  if case.op == "sparse_attention":
    return _run_sparse(**ctx)
  if case.op == "hca_attention":
    return _run_hca(**ctx)
  return _run_indexer(**ctx)


def _timing(args, dry):
  if dry:
    return dict(iters=1, repeats=1, flush_elems=0)  # no L2 to flush on a CPU: the hot time
  return dict(iters=args.iters, repeats=args.repeats, flush_elems=int(args.flush_mb * 2 ** 20 / 4))


def _roofline(row, flops, nbytes, ms, args):
  row.update(flops=flops, bytes=nbytes, kernel_ms=ms)
  s = ms * 1e-3 if ms is not None else float("nan")
  if not s > 0:
    return row
  t_hbm = nbytes / (args.hbm_gbps * 1e9)
  t_tc = flops / (args.peak_tflops * 1e12)
  row.update(tflops=flops / s / 1e12, gbps=nbytes / s / 1e9, pct_hbm=100 * t_hbm / s, pct_tc=100 * t_tc / s,
             roofline_pct=100 * max(t_hbm, t_tc) / s, bound="HBM" if t_hbm >= t_tc else "TC")
  return row


def _judged(row, err, case, partial, what) -> bool:
  """Record the correctness verdict; True when the case goes on to its timing (a timing case that matched; the
  row so far is written first, so a timeout in the timing keeps it)."""
  row["err_over_tol"] = err
  if not err <= 1.0:
    row.update(status="mismatch", error=f"{what} = {err:.3g} (> 1)")
    return False
  row["status"] = "ok"
  if case.kind != "timing":
    return False
  partial(row)
  return True


def _sparse_inputs(p, key):
  import jax
  import jax.numpy as jnp
  from benchmarks import kernels_bench as kb
  from pallas_kernels import dispatch
  from pallas_kernels import sparse_attention as sa
  N, H, D, W, K, ctx = p["N"], p["H"], p["D"], p["W"], p["K"], p["ctx"]
  hca, prefill = p["layer"] == "hca", p["mode"] == "prefill"
  E = ctx // (128 if hca else 4)  # compressed entries per sequence
  seqs = 1 if prefill else N
  k1, k2, k3, k4, k5, k6 = jax.random.split(key, 6)
  q = (jax.random.normal(k1, (N, H, D), jnp.float32) * 0.05)
  win_pool, win_idx, comp_pool, comp_idx = kb.synthetic_rows(k2, k3, k4, N=N, D=D, W=W, K=K, E=E, seqs=seqs,
                                                             hca=hca, prefill=prefill, ctx=ctx, dtype=jnp.float32,
                                                             ratio=128 if hca else 4)
  sink = jax.random.normal(k5, (H,), jnp.float32)
  fmt = p["fmt"]
  dt = jnp.float32 if fmt == "f32" else jnp.bfloat16
  q = q.astype(dt)
  win_pool, comp_pool = win_pool.astype(dt), comp_pool.astype(dt)
  if fmt in ("fp8_paged", "fp8_record"):
    win_pool, comp_pool = sa.quantize_kv_fp8(win_pool), sa.quantize_kv_fp8(comp_pool)
    if fmt == "fp8_paged":
      win_pool = sa.record_to_paged(win_pool, p["page_size"])
      comp_pool = sa.record_to_paged(comp_pool, p["page_size"])
  wl = cl = None
  if p.get("lens"):  # the model passes per-query live lengths: ragged, some rows empty
    kw, kc = jax.random.split(k6)
    wl = jax.random.randint(kw, (N,), 0, W + 1).astype(jnp.int32)
    cl = jax.random.randint(kc, (N,), 0, K + 1).astype(jnp.int32)
  return dispatch.SparseArgs(q, win_pool, win_idx.astype(jnp.int32), comp_pool, comp_idx.astype(jnp.int32), sink,
                             window_len_N=wl, comp_len_N=cl)


def _run_sparse(args, p, case, dry, inject, partial):
  import jax
  from benchmarks import kernels_bench as kb
  from pallas_kernels import dispatch
  from pallas_kernels import sparse_attention as sa
  row = {}
  inputs = jax.jit(lambda key: _sparse_inputs(p, key))(jax.random.PRNGKey(0))  # one compile, not one per op
  row["arrays"] = _arrays(inputs)
  D = p["D"]
  static = dict(scale=D ** -0.5)
  ref = jax.jit(_on_record(dispatch.SparseArgs, lambda a: dispatch._sparse_reference(a, static)))
  tuning = (sa.SparseAttentionTuning(block_h=16, block_k=16) if dry
            else sa.default_tuning([inputs.window_pool_PxD, inputs.comp_pool_QxD]))
  row["tuning"] = dataclasses.asdict(tuning)
  row["num_splits"] = sa.chosen_num_splits(
      inputs.q_NxHxD.shape[0], inputs.q_NxHxD.shape[1], [inputs.window_idx_NxW.shape[1], inputs.comp_idx_NxK.shape[1]],
      tuning, row_bytes=max(sa.pool_row_bytes(inputs.window_pool_PxD), sa.pool_row_bytes(inputs.comp_pool_QxD)),
      out_bytes=inputs.q_NxHxD.dtype.itemsize, D=D)
  kernel_kw = dict(interpret=dry, tuning=tuning)
  kern = jax.jit(_on_record(dispatch.SparseArgs,
                            lambda a: dispatch._run_sparse_kernel(sa.sparse_attention_kernel, a, static, kernel_kw)))
  if dry and case.kind == "timing":
    row["kernel"] = case.kernel + " [dry run: interpret mode on the CPU]"
  out, lse = kern(*inputs)
  want_out, want_lse = ref(*inputs)
  if inject == "mismatch":
    out = out * 1.5
  tol = (1e-4, 1e-4) if p["fmt"] == "f32" else (1.5e-2, 2e-2)
  err = max(kb.tol_ratio(out, want_out, *tol), kb.tol_ratio(lse, want_lse, 1e-3, 1e-3))
  del out, lse, want_out, want_lse
  if not _judged(row, err, case, partial, "max |kernel - reference| / tol"):
    return row
  H = p["H"]
  window_pool, comp_pool = inputs.window_pool_PxD, inputs.comp_pool_QxD
  window_idx = sa.apply_len(inputs.window_idx_NxW, inputs.window_len_N)
  comp_idx = sa.apply_len(inputs.comp_idx_NxK, inputs.comp_len_N)
  uw, aw = kb.unique_valid(window_idx, sa.pool_rows(window_pool))
  uc, ac = kb.unique_valid(comp_idx, sa.pool_rows(comp_pool))
  flops = 2.0 * H * (aw + ac) * (D + D)
  q = inputs.q_NxHxD
  nbytes = (q.size * q.dtype.itemsize * 2 + uw * sa.pool_row_bytes(window_pool) + uc * sa.pool_row_bytes(comp_pool))
  ms, hot, flush = kb.device_time_ms(kern, inputs, _chained_slot(inputs, "sink_H"), **_timing(args, dry))
  row.update(hot_ms=hot, flush_ms=flush, predicted_pct=_predicted(p))
  if dry:  # the reference beside the interpret-mode kernel (on the GPU the budget goes to the kernels)
    row["xla_ms"] = kb.device_time_ms(ref, inputs, _chained_slot(inputs, "sink_H"), **_timing(args, dry))[0]
  return _roofline(row, flops, nbytes, ms, args)


def _hca_inputs(p, key):
  """The HCA decode case's rows as the invariant step's HCA call: each sequence's entries through its own table
  (one entry per table block: ratio 128), visible count = the live compressed length."""
  import jax.numpy as jnp
  from pallas_kernels import dispatch
  a = _sparse_inputs(p, key)
  N, K = a.comp_idx_NxK.shape
  nv = jnp.full((N,), K, jnp.int32) if a.comp_len_N is None else a.comp_len_N
  wl = jnp.full((N,), p["W"], jnp.int32) if a.window_len_N is None else a.window_len_N
  return dispatch.HcaArgs(a.q_NxHxD, a.window_pool_PxD, a.window_idx_NxW, wl, a.comp_pool_QxD, a.comp_idx_NxK, nv,
                          a.sink_H)


def _run_hca(args, p, case, dry, inject, partial):
  import jax
  from benchmarks import kernels_bench as kb
  from pallas_kernels import dispatch
  from pallas_kernels import hca_attention as hk
  from pallas_kernels import sparse_attention as sa
  row = {}
  inputs = jax.jit(lambda key: _hca_inputs(p, key))(jax.random.PRNGKey(0))
  row["arrays"] = _arrays(inputs)
  D = p["D"]
  static = dict(scale=D ** -0.5, entries_per_block=1)
  ref = jax.jit(_on_record(dispatch.HcaArgs, lambda a: dispatch._hca_reference(a, static)))
  tuning = (hk.HcaAttentionTuning(block_h=16, block_k=16) if dry
            else hk.default_tuning([inputs.window_pool_PxD, inputs.comp_pool_QxD]))
  row["tuning"] = dataclasses.asdict(tuning)
  kernel_kw = dict(interpret=dry, tuning=tuning)
  kern = jax.jit(_on_record(dispatch.HcaArgs,
                            lambda a: dispatch._run_hca_kernel(hk.hca_attention_kernel, a, static, kernel_kw)))
  if dry and case.kind == "timing":
    row["kernel"] = case.kernel + " [dry run: interpret mode on the CPU]"
  out = kern(*inputs)
  want = ref(*inputs)
  if inject == "mismatch":
    out = out * 1.5
  tol = (1e-4, 1e-4) if p["fmt"] == "f32" else (1.5e-2, 2e-2)
  err = kb.tol_ratio(out, want, *tol)
  del out, want
  if not _judged(row, err, case, partial, "max |kernel - reference| / tol"):
    return row
  H = p["H"]
  window_pool, comp_pool = inputs.window_pool_PxD, inputs.comp_pool_QxD
  window_idx = sa.apply_len(inputs.window_idx_NxW, inputs.window_len_N)
  comp_idx = sa.apply_len(inputs.table_SxF, inputs.num_visible_N)
  uw, aw = kb.unique_valid(window_idx, sa.pool_rows(window_pool))
  uc, ac = kb.unique_valid(comp_idx, sa.pool_rows(comp_pool))
  flops = 2.0 * H * (aw + ac) * (D + D)
  q = inputs.q_NxHxD
  nbytes = (q.size * q.dtype.itemsize * 2 + uw * sa.pool_row_bytes(window_pool) + uc * sa.pool_row_bytes(comp_pool)
            + inputs.table_SxF.size * 4)
  ms, hot, flush = kb.device_time_ms(kern, inputs, _chained_slot(inputs, "sink_H"), **_timing(args, dry))
  row.update(hot_ms=hot, flush_ms=flush)
  if dry:
    row["xla_ms"] = kb.device_time_ms(ref, inputs, _chained_slot(inputs, "sink_H"), **_timing(args, dry))[0]
  return _roofline(row, flops, nbytes, ms, args)


def _predicted(p) -> float | None:
  """The design's predicted % of HBM for a sparse timing case (docs/kernels.md, Roofline per configuration)."""
  from benchmarks import kernels_bench as kb
  if p.get("mode") != "decode":
    return None
  fmt = "bf16" if p["fmt"] in ("bf16", "f32") else "fp8"
  keys = p["W"] + p["K"]
  return kb.predicted_decode(p["N"], keys, fmt, H=p["H"], D=p["D"], window=p["W"])["pct_hbm"]


def _run_indexer(args, p, case, dry, inject, partial):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from benchmarks import kernels_bench as kb
  from pallas_kernels import dispatch
  from pallas_kernels import indexer as ix
  from pallas_kernels import indexer_topk as itk
  row = {}
  B, T, H, C, ctx = p["B"], p["T"], p["HI"], p["C"], p["ctx"]
  M = ctx // 4
  q, w, pool, rows, nv = jax.jit(lambda key: kb.indexer_case(key, B=B, T=T, H=H, C=C, M=M,
                                                             prefill=p["mode"] == "prefill", ctx=ctx,
                                                             fp8=p["keys"] == "fp8"))(jax.random.PRNGKey(0))
  cand = None
  if p.get("cand"):
    nb = -(-M // p["block_size"])
    cand = jax.random.randint(jax.random.PRNGKey(1), (B, T, p["cand"]), -1, nb).astype(jnp.int32)
  inputs = dispatch.IndexerArgs(q, w, pool, rows, nv, num_keys_B=jnp.full((B,), M, jnp.int32),
                                candidate_blocks_BxTxC=cand)
  row["arrays"] = _arrays(inputs)
  k = p["k"]
  static = dict(k=k, block_size=p["block_size"])
  check_scores = jax.jit(_on_record(dispatch.IndexerArgs, lambda a: dispatch._topk_check_scores(a, static)))
  if case.op == "indexer_topk":
    tuning = itk.IndexerTopkTuning(block_m=32, select_chunk=64) if dry else itk.IndexerTopkTuning()
    reference, run_kernel, kernel = dispatch._topk_reference, dispatch._run_topk_kernel, itk.indexer_topk_kernel
  else:
    tuning = ix.IndexerTuning(block_m=32) if dry else ix.IndexerTuning()
    reference, run_kernel, kernel = dispatch._scores_reference, dispatch._run_scores_kernel, ix.indexer_scores_kernel
  kernel_kw = dict(interpret=dry, tuning=tuning)
  ref = jax.jit(_on_record(dispatch.IndexerArgs, lambda a: reference(a, static)))
  kern = jax.jit(_on_record(dispatch.IndexerArgs, lambda a: run_kernel(kernel, a, static, kernel_kw)))
  row["tuning"] = dataclasses.asdict(tuning)
  if dry and case.kind == "timing":
    row["kernel"] = case.kernel + " [dry run: interpret mode on the CPU]"
  got = np.asarray(kern(*inputs))
  scores = np.asarray(check_scores(*inputs))
  if inject == "mismatch":
    got = np.where(got >= 0, (got + 1) % M, got) if case.op == "indexer_topk" else got * 1.5
  if case.op == "indexer_topk":
    err = float(dispatch._topk_err(got, scores, inputs, static))
  else:
    err = float(dispatch._scores_err(got, scores, inputs, static))
  del got, scores
  if not _judged(row, err, case, partial, "max error / tol"):
    return row
  pairs = float(np.minimum(np.asarray(nv), M).sum())
  flops = 2.0 * H * C * pairs
  uk, _ = kb.unique_valid(rows, pool.shape[0])
  row_bytes = pool.bytes_per_row if isinstance(pool, itk.Fp8IndexKeys) else C * 2
  out_bytes = B * T * min(k, M) * 4 if case.op == "indexer_topk" else B * T * M * 4
  nbytes = q.size * 2 + w.size * 4 + uk * row_bytes + out_bytes
  ms, hot, flush = kb.device_time_ms(kern, inputs, _chained_slot(inputs, "w_BxTxH"), **_timing(args, dry))
  row.update(hot_ms=hot, flush_ms=flush)
  if dry:
    row["xla_ms"] = kb.device_time_ms(ref, inputs, _chained_slot(inputs, "w_BxTxH"), **_timing(args, dry))[0]
  return _roofline(row, flops, nbytes, ms, args)
