"""(b, e) The Pallas kernels at V4-Flash shapes: each case's inputs are made on the device from a fresh seed, its
kernel and its XLA reference are lowered, then compiled once (in threads: XLA compiles outside the GIL), and the
one compiled kernel executable is both checked against the reference and timed.

Kernel inputs are the named argument records of `pallas_kernels.dispatch` (`SparseArgs`, `HcaArgs`,
`IndexerArgs`), so every kernel, reference and check picks its arrays by name.

Timing (`time_executable`): the compiled executable called back to back `iters` times with one sync at the end,
best of `repeats` (hot); with an L2 flush (a compiled `b + 1` over `flush_mb`, more than the H200's 50 MB L2)
before every call, minus the flush alone (flushed: each call reads its KV from HBM). Python's dispatch of a
compiled executable (tens of microseconds) overlaps the device's work whenever the kernel takes longer.

Counting: sparse attention FLOPs = 2 H attended (d_qk + d_v), bytes = Q + O + unique KV rows x row bytes; the
indexer FLOPs = 2 H_I C visible pairs, bytes = q + w + unique key rows + output (benchmarks/kernels_bench.py).
Each timed row has `pct_hbm` / `pct_tc` against the datasheet (--hbm_gbps, --peak_tflops) and `pct_copy` /
`pct_matmul` against the ceilings section (a) measured on this device.

The dry run (CPU) uses the same cases at small shapes, the kernels in interpret mode and no flush.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kernels_bench as kb
from pallas_kernels import dispatch, hca_attention as hk, indexer as ix, indexer_topk as itk, sparse_attention as sa

V4_SPARSE = dict(H=64, D=512, W=128, K=512, page_size=64, lens=False)
DRY_SPARSE = dict(H=16, D=128, W=16, K=32, page_size=4)
V4_INDEXER = dict(HI=64, C=128, k=512, cand=0, block_size=8)
DRY_INDEXER = dict(HI=16, C=32, k=16)


@dataclasses.dataclass(frozen=True)
class KernelCase:
  name: str
  op: str            # sparse_attention | hca_attention | indexer_scores | indexer_topk
  params: dict       # V4-Flash shapes
  dry: dict          # what the CPU dry run changes
  tuning: object = None   # None = the kernel's default tuning at these shapes (the dry run: a small tiling)
  predicted: bool = False  # a sparse decode row: the design's predicted % of HBM beside it

  def shapes(self, dry: bool) -> dict:
    return {**self.params, **self.dry} if dry else dict(self.params)


def _sparse(name, *, mode, layer, fmt, N, ctx, op="sparse_attention", tuning=None, dry=None, **kw):
  p = dict(V4_SPARSE, mode=mode, layer=layer, fmt=fmt, N=N, ctx=ctx, **kw)
  d = dict(DRY_SPARSE, N=2 if mode == "decode" else 16, ctx=512 if layer == "csa" else 2048)
  if layer == "hca":
    p["K"], d["K"] = ctx // 128, d["ctx"] // 128
  d.update(dry or {})
  return KernelCase(name, op, p, d, tuning, predicted=mode == "decode" and op == "sparse_attention")


def _indexer(name, *, op, mode, keys, B, T, ctx, tuning=None, **kw):
  p = dict(V4_INDEXER, mode=mode, keys=keys, B=B, T=T, ctx=ctx, **kw)
  d = dict(DRY_INDEXER, B=2, T=1 if mode == "decode" else 16, ctx=512)
  if p.get("cand"):
    d["cand"] = 4
  return KernelCase(name, op, p, d, tuning)


def plan() -> list[KernelCase]:
  """Section (b): every kernel and pool layout the model serves, at V4-Flash shapes, most telling first (the
  decode rows the step spends its time in, then prefill, then the rarer layouts). Each is checked, then timed."""
  S, I = _sparse, _indexer
  return [
      S("sparse.decode_csa.bf16.b64.8k", mode="decode", layer="csa", fmt="bf16", N=64, ctx=8192),
      S("sparse.decode_csa.fp8_paged.b64.8k", mode="decode", layer="csa", fmt="fp8_paged", N=64, ctx=8192),
      I("topk.decode.fp8_keys.b64.128k", op="indexer_topk", mode="decode", keys="fp8", B=64, T=1, ctx=131072),
      I("topk.decode.bf16_keys.b64.128k", op="indexer_topk", mode="decode", keys="bf16", B=64, T=1, ctx=131072),
      S("hca.decode_invariant.bf16.b64.128k", mode="decode", layer="hca", fmt="bf16", N=64, ctx=131072, lens=True,
        dry=dict(lens=True), op="hca_attention"),
      S("hca.decode_invariant.fp8_paged.b64.128k", mode="decode", layer="hca", fmt="fp8_paged", N=64, ctx=131072,
        lens=True, dry=dict(lens=True), op="hca_attention"),
      S("sparse.prefill_csa.bf16.q4096.32k", mode="prefill", layer="csa", fmt="bf16", N=4096, ctx=32768),
      I("topk.prefill.bf16.q4096.32k", op="indexer_topk", mode="prefill", keys="bf16", B=1, T=4096, ctx=32768),
      I("scores.decode.bf16.b64.128k", op="indexer_scores", mode="decode", keys="bf16", B=64, T=1, ctx=131072),
      S("sparse.decode_hca.bf16.b64.128k.lens", mode="decode", layer="hca", fmt="bf16", N=64, ctx=131072,
        lens=True, dry=dict(lens=True)),
      S("sparse.decode_csa.bf16.b128.8k", mode="decode", layer="csa", fmt="bf16", N=128, ctx=8192),
      S("sparse.decode_csa.fp8_paged.b128.8k", mode="decode", layer="csa", fmt="fp8_paged", N=128, ctx=8192),
      S("sparse.prefill_csa.fp8_paged.q4096.32k", mode="prefill", layer="csa", fmt="fp8_paged", N=4096, ctx=32768),
      S("sparse.decode_hca.fp8_paged.b64.128k", mode="decode", layer="hca", fmt="fp8_paged", N=64, ctx=131072),
      I("topk.decode.v41_candidates.b64.128k", op="indexer_topk", mode="decode", keys="bf16", B=64, T=1,
        ctx=131072, cand=64),
      S("sparse.decode_csa.fp8_record.b64.8k", mode="decode", layer="csa", fmt="fp8_record", N=64, ctx=8192),
      S("sparse.decode_csa.f32.b8.8k", mode="decode", layer="csa", fmt="f32", N=8, ctx=8192),
  ]


def tuning_plan() -> list[KernelCase]:
  """Section (e): other tilings of the decode rows the step spends its time in (block_k, pipelining depth,
  warps), as many as the time left allows."""
  rows = []
  for fmt, base in (("bf16", sa.BF16_TUNING), ("fp8_paged", sa.FP8_TUNING)):
    for change in (dict(block_k=32), dict(block_k=64), dict(num_stages=2), dict(num_stages=4), dict(num_warps=4),
                   dict(block_h=32)):
      if all(getattr(base, k, None) == v for k, v in change.items()) or any(not hasattr(base, k) for k in change):
        continue
      tag = ",".join(f"{k}={v}" for k, v in change.items())
      rows.append(_sparse(f"tune.sparse.decode_csa.{fmt}.b64.8k[{tag}]", mode="decode", layer="csa", fmt=fmt, N=64,
                          ctx=8192, tuning=dataclasses.replace(base, **change)))
  return rows


# ------------------------------------------------------------------------------------------------ inputs


def _sparse_inputs(p, key):
  N, H, D, W, K, ctx = p["N"], p["H"], p["D"], p["W"], p["K"], p["ctx"]
  hca, prefill = p["layer"] == "hca", p["mode"] == "prefill"
  E = ctx // (128 if hca else 4)  # compressed entries per sequence
  k1, k2, k3, k4, k5, k6 = jax.random.split(key, 6)
  q = jax.random.normal(k1, (N, H, D), jnp.float32) * 0.05
  win_pool, win_idx, comp_pool, comp_idx = kb.synthetic_rows(k2, k3, k4, N=N, D=D, W=W, K=K, E=E,
                                                             seqs=1 if prefill else N, hca=hca, prefill=prefill,
                                                             ctx=ctx, dtype=jnp.float32, ratio=128 if hca else 4)
  sink = jax.random.normal(k5, (H,), jnp.float32)
  fmt = p["fmt"]
  dt = jnp.float32 if fmt == "f32" else jnp.bfloat16
  q, win_pool, comp_pool = q.astype(dt), win_pool.astype(dt), comp_pool.astype(dt)
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


def _hca_inputs(p, key):
  """The invariant step's HCA call: each sequence's entries through its own table (one entry per table block:
  ratio 128), visible count = the live compressed length."""
  a = _sparse_inputs(p, key)
  N, K = a.comp_idx_NxK.shape
  nv = jnp.full((N,), K, jnp.int32) if a.comp_len_N is None else a.comp_len_N
  wl = jnp.full((N,), p["W"], jnp.int32) if a.window_len_N is None else a.window_len_N
  return dispatch.HcaArgs(a.q_NxHxD, a.window_pool_PxD, a.window_idx_NxW, wl, a.comp_pool_QxD, a.comp_idx_NxK, nv,
                          a.sink_H)


def _indexer_inputs(p, key):
  B, T, ctx = p["B"], p["T"], p["ctx"]
  M = ctx // 4
  k1, k2 = jax.random.split(key)
  q, w, pool, rows, nv = kb.indexer_case(k1, B=B, T=T, H=p["HI"], C=p["C"], M=M, prefill=p["mode"] == "prefill",
                                         ctx=ctx, fp8=p["keys"] == "fp8")
  cand = None
  if p.get("cand"):
    cand = jax.random.randint(k2, (B, T, p["cand"]), -1, -(-M // p["block_size"])).astype(jnp.int32)
  return dispatch.IndexerArgs(q, w, pool, rows, nv, num_keys_B=jnp.full((B,), M, jnp.int32),
                              candidate_blocks_BxTxC=cand)


# ------------------------------------------------------------------------------------------------ one case


@dataclasses.dataclass
class Prepared:
  """One case's inputs (on the device), its lowered kernel and reference, and (once compiled) their executables."""
  case: KernelCase
  shapes: dict
  inputs: object
  static: dict
  tuning: object
  kernel_lowered: object
  ref_lowered: object
  seed: int
  kernel_exe: object = None
  ref_exe: object = None
  compile_s: float = 0.0


def _on_record(record_type, fn):
  return lambda *arrays: fn(record_type(*arrays))


def make_inputs(case: KernelCase, p: dict, key):
  """The case's argument record (a pytree of arrays) from `key`; jit it, or eval_shape it for abstract inputs."""
  fn = {"sparse_attention": _sparse_inputs, "hca_attention": _hca_inputs}.get(case.op, _indexer_inputs)
  return fn(p, key)


def programs(case: KernelCase, dry: bool, inputs) -> tuple:
  """(kernel fn, reference fn, static args, tuning) of the case, each fn taking the record's fields in order: the
  kernel as the model's dispatch calls it (`dispatch._run_*_kernel`, compiled Pallas-Triton, or interpret mode in the
  dry run); for the top-k and the indexer scores the reference gives the scores the check reads (ties make id sets
  ambiguous). `inputs` may be abstract (the tuning reads only types and shapes)."""
  p = case.shapes(dry)
  if case.op == "sparse_attention":
    static = dict(scale=p["D"] ** -0.5)
    tuning = case.tuning or (sa.SparseAttentionTuning(block_h=16, block_k=16) if dry else
                             sa.default_tuning([inputs.window_pool_PxD, inputs.comp_pool_QxD]))
    kernel, run_kernel, ref = sa.sparse_attention_kernel, dispatch._run_sparse_kernel, dispatch._sparse_reference
    record = dispatch.SparseArgs
  elif case.op == "hca_attention":
    static = dict(scale=p["D"] ** -0.5, entries_per_block=1)
    tuning = case.tuning or (hk.HcaAttentionTuning(block_h=16, block_k=16) if dry else
                             hk.default_tuning([inputs.window_pool_PxD, inputs.comp_pool_QxD]))
    kernel, run_kernel, ref = hk.hca_attention_kernel, dispatch._run_hca_kernel, dispatch._hca_reference
    record = dispatch.HcaArgs
  else:
    static = dict(k=p["k"], block_size=p["block_size"])
    record, ref = dispatch.IndexerArgs, dispatch._topk_check_scores
    if case.op == "indexer_topk":
      tuning = case.tuning or (itk.IndexerTopkTuning(block_m=32, select_chunk=64) if dry else
                               itk.IndexerTopkTuning())
      kernel, run_kernel = itk.indexer_topk_kernel, dispatch._run_topk_kernel
    else:
      tuning = case.tuning or (ix.IndexerTuning(block_m=32) if dry else ix.IndexerTuning())
      kernel, run_kernel = ix.indexer_scores_kernel, dispatch._run_scores_kernel
  kernel_kw = dict(interpret=dry, tuning=tuning)
  kern = _on_record(record, lambda a: run_kernel(kernel, a, static, kernel_kw))
  reference = _on_record(record, lambda a: ref(a, static))
  return kern, reference, static, tuning


def prepare(case: KernelCase, dry: bool, seed: int) -> Prepared:
  """Inputs from `seed` on the device, then the kernel and its reference lowered (Python tracing: serial)."""
  p = case.shapes(dry)
  inputs = jax.jit(lambda k: make_inputs(case, p, k))(jax.random.PRNGKey(seed))
  kern, reference, static, tuning = programs(case, dry, inputs)
  return Prepared(case, p, inputs, static, tuning, jax.jit(kern).lower(*inputs), jax.jit(reference).lower(*inputs),
                  seed)


def compile_all(prepared: list[Prepared], threads: int) -> dict:
  """Start compiling every case's kernel and reference in a thread pool; name -> future (of the Prepared, its
  executables filled in). XLA's compile releases the GIL, so the Triton and XLA compiles run side by side."""
  def one(pr: Prepared) -> Prepared:
    t0 = time.perf_counter()
    pr.kernel_exe = pr.kernel_lowered.compile()
    pr.ref_exe = pr.ref_lowered.compile()
    pr.compile_s = time.perf_counter() - t0
    return pr
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="compile")
  futures = {pr.case.name: pool.submit(one, pr) for pr in prepared}
  pool.shutdown(wait=False)
  return futures


def _arrays(record) -> dict:
  out = {}
  for name, value in record._asdict().items():
    for path, leaf in jax.tree_util.tree_leaves_with_path(value):
      out[name + jax.tree_util.keystr(path)] = "x".join(map(str, leaf.shape)) + " " + str(leaf.dtype)
  return out


def shape_text(case: KernelCase, p: dict) -> str:
  if case.op in ("sparse_attention", "hca_attention"):
    s = f"{p['mode']} {p['layer']} {p['fmt']} N={p['N']} H={p['H']} D={p['D']} W={p['W']} K={p['K']} ctx={p['ctx']}"
    return s + (" +lens" if p.get("lens") else "")
  s = f"{p['mode']} {p['keys']} keys B={p['B']} T={p['T']} H={p['HI']} C={p['C']} M={p['ctx'] // 4}"
  s += f" k={p['k']}" if case.op == "indexer_topk" else ""
  return s + (f" cand={p['cand']}x{p['block_size']}" if p.get("cand") else "")


def check(pr: Prepared) -> float:
  """max error / tolerance of the compiled kernel against the compiled reference (<= 1 passes)."""
  got = pr.kernel_exe(*pr.inputs)
  want = pr.ref_exe(*pr.inputs)
  if pr.case.op == "indexer_topk":
    return float(dispatch._topk_err(np.asarray(got), np.asarray(want), pr.inputs, pr.static))
  if pr.case.op == "indexer_scores":
    return float(dispatch._scores_err(np.asarray(got), np.asarray(want), pr.inputs, pr.static))
  tol = (1e-4, 1e-4) if pr.shapes["fmt"] == "f32" else (1.5e-2, 2e-2)
  if pr.case.op == "hca_attention":
    return kb.tol_ratio(got, want, *tol)
  (out, lse), (want_out, want_lse) = got, want
  return max(kb.tol_ratio(out, want_out, *tol), kb.tol_ratio(lse, want_lse, 1e-3, 1e-3))


class Flusher:
  """An L2 flush: one compiled `b + 1` over `mb` MB (0 = none: the CPU)."""

  def __init__(self, mb: float):
    self.buf = None
    if mb > 0:
      self.buf = jnp.zeros((int(mb * 2 ** 20 / 4),), jnp.float32)
      self.exe = jax.jit(lambda b: b + 1.0, donate_argnums=0).lower(self.buf).compile()

  def __call__(self):
    self.buf = self.exe(self.buf)


def time_executable(exe, args, *, iters: int, repeats: int, flush: Flusher | None) -> dict:
  """{hot_ms, kernel_ms (L2 flushed; = hot without a flush), flush_ms} per call of the compiled `exe`."""
  def best(with_kernel: bool, with_flush: bool) -> float:
    t = float("inf")
    for _ in range(repeats):
      jax.block_until_ready(exe(*args))
      t0 = time.perf_counter()
      out = None
      for _ in range(iters):
        if with_flush:
          flush()
        if with_kernel:
          out = exe(*args)
      jax.block_until_ready(out if with_kernel else flush.buf)
      t = min(t, (time.perf_counter() - t0) / iters)
    return t * 1e3

  hot = best(True, False)
  if flush is None or flush.buf is None:
    return dict(hot_ms=hot, kernel_ms=hot, flush_ms=0.0)
  both, alone = best(True, True), best(False, True)
  return dict(hot_ms=hot, kernel_ms=both - alone if both > alone else None, flush_ms=alone)


def counts(pr: Prepared) -> tuple[float, float]:
  """(FLOPs, bytes) of the case as run (module docstring)."""
  a, p = pr.inputs, pr.shapes
  if pr.case.op in ("sparse_attention", "hca_attention"):
    D = p["D"]
    window_idx = sa.apply_len(a.window_idx_NxW, a.window_len_N)
    if pr.case.op == "hca_attention":
      comp_idx, extra = sa.apply_len(a.table_SxF, a.num_visible_N), a.table_SxF.size * 4
    else:
      comp_idx, extra = sa.apply_len(a.comp_idx_NxK, a.comp_len_N), 0
    uw, aw = kb.unique_valid(window_idx, sa.pool_rows(a.window_pool_PxD))
    uc, ac = kb.unique_valid(comp_idx, sa.pool_rows(a.comp_pool_QxD))
    q = a.q_NxHxD
    nbytes = (q.size * q.dtype.itemsize * 2 + uw * sa.pool_row_bytes(a.window_pool_PxD)
              + uc * sa.pool_row_bytes(a.comp_pool_QxD) + extra)
    return 2.0 * p["H"] * (aw + ac) * (D + D), float(nbytes)
  B, T = p["B"], p["T"]
  M = p["ctx"] // 4
  pairs = float(np.minimum(np.asarray(a.num_visible_BxT), M).sum())
  uk, _ = kb.unique_valid(a.key_rows_BxM, a.key_pool_PxC.shape[0])
  row_bytes = a.key_pool_PxC.bytes_per_row if isinstance(a.key_pool_PxC, itk.Fp8IndexKeys) else p["C"] * 2
  out_bytes = B * T * min(p["k"], M) * 4 if pr.case.op == "indexer_topk" else B * T * M * 4
  nbytes = a.q_BxTxHxC.size * 2 + a.w_BxTxH.size * 4 + uk * row_bytes + out_bytes
  return 2.0 * p["HI"] * p["C"] * pairs, float(nbytes)


def predicted_pct(pr: Prepared) -> float | None:
  """The design's predicted % of HBM for a sparse decode row (docs/kernels.md, Roofline per configuration)."""
  p = pr.shapes
  if not pr.case.predicted:
    return None
  fmt = "bf16" if p["fmt"] in ("bf16", "f32") else "fp8"
  return kb.predicted_decode(p["N"], p["W"] + p["K"], fmt, H=p["H"], D=p["D"], window=p["W"])["pct_hbm"]


def run_case(pr: Prepared, *, iters: int, repeats: int, flush: Flusher | None, ceilings: dict, hbm_gbps: float,
             peak_tflops: float) -> dict:
  """The case's row: checked with the compiled kernel, then (if it matched) timed with that same executable."""
  row = dict(kernel=pr.case.op, shapes=shape_text(pr.case, pr.shapes), seed=pr.seed,
             tuning=dataclasses.asdict(pr.tuning), compile_s=round(pr.compile_s, 2), arrays=_arrays(pr.inputs))
  err = check(pr)
  row["err_over_tol"] = err
  if not err <= 1.0:
    return dict(row, status="mismatch", error=f"max |kernel - reference| / tol = {err:.3g} (> 1)")
  row.update(time_executable(pr.kernel_exe, pr.inputs, iters=iters, repeats=repeats, flush=flush))
  flops, nbytes = counts(pr)
  row.update(flops=flops, bytes=nbytes, predicted_pct_hbm=predicted_pct(pr))
  ms = row["kernel_ms"]
  if ms:
    s = ms * 1e-3
    row.update(tflops=flops / s / 1e12, gbps=nbytes / s / 1e9, pct_hbm=100 * nbytes / s / (hbm_gbps * 1e9),
               pct_tc=100 * flops / s / (peak_tflops * 1e12))
    if ceilings.get("copy_gbps"):
      row["pct_copy"] = 100 * row["gbps"] / ceilings["copy_gbps"]
    if ceilings.get("matmul_tflops"):
      row["pct_matmul"] = 100 * row["tflops"] / ceilings["matmul_tflops"]
  return dict(row, status="ok")


# ------------------------------------------------------------------------------------------------ top-k diagnosis


def topk_variants(dry: bool) -> dict:
  """name -> (tuning, entries M) of the fused top-k's failing decode case (B=64, M=32768, k=512, bf16 keys) and
  its variants. Reading: `repeat_differs` on `default` = a race; `chunk512` passing while `default` fails = the
  selection / compaction at select_chunk > k, not the scores; `one_chunk` (the first 4096 entries: ids only, no
  merge) failing = not the merge; `warps1` passing = something across warps."""
  T = itk.IndexerTopkTuning
  M = 8192 if dry else 32768
  return {"default": (T(), M), "chunk512": (T(select_chunk=512), M), "one_chunk": (T(), 4096),
          "warps4": (T(num_warps=4), M), "warps1": (T(num_warps=1), M), "stages1": (T(num_stages=1), M)}


SENTINEL = 0x7EADBEEF


class TopkDiagnosis:
  """The fused top-k diagnosis: one input set, each variant compiled once (`compile`, threads), then run
  (`run_variant`) on the same inputs twice (repeat_differs), after a sentinel-filled buffer of the output's size
  was freed (so the allocator likely hands that memory to the output: `sentinel_ids` counts slots the kernel never
  wrote; 0 proves nothing), with the count of selected lanes per row against the visible entries."""

  def __init__(self, dry: bool, seed: int):
    self.dry, self.seed = dry, seed
    self.B, self.M, self.k = self.shape(dry)
    self.static = dict(k=self.k, block_size=8)
    self.full = jax.jit(lambda key: self.inputs(dry, key))(jax.random.PRNGKey(seed))
    self.scores = np.asarray(jax.jit(lambda x: dispatch._topk_check_scores(x, self.static))(self.full))
    self.variants = topk_variants(dry)

  @staticmethod
  def shape(dry: bool) -> tuple[int, int, int]:
    """(B, M, k) of the diagnosed decode case."""
    return (2, 8192, 512) if dry else (64, 32768, 512)

  @staticmethod
  def inputs(dry: bool, key):
    """The decode case's record (64 heads x 128, bf16 keys), from `key`."""
    B, M, _ = TopkDiagnosis.shape(dry)
    q, w, pool, rows, nv = kb.indexer_case(key, B=B, T=1, H=64, C=128, M=M, prefill=False, ctx=4 * M, fp8=False)
    return dispatch.IndexerArgs(q, w, pool, rows, nv, num_keys_B=jnp.full((B,), M, jnp.int32))

  @staticmethod
  def restrict(full, m: int):
    """The record with only the first `m` entries of every row (the `one_chunk` variant)."""
    B, M = full.key_rows_BxM.shape
    if m == M:
      return full
    return dispatch.IndexerArgs(full.q_BxTxHxC, full.w_BxTxH, full.key_pool_PxC, full.key_rows_BxM[:, :m],
                                jnp.minimum(full.num_visible_BxT, m), num_keys_B=jnp.full((B,), m, jnp.int32))

  @staticmethod
  def variant_fn(tuning, k: int, dry: bool):
    """The fused top-k of one variant as a function of the record."""
    return lambda x: itk.indexer_topk_kernel(x.q_BxTxHxC, x.w_BxTxH, x.key_pool_PxC, x.key_rows_BxM,
                                             x.num_visible_BxT, k, num_keys_B=x.num_keys_B, interpret=dry,
                                             tuning=tuning)

  def args_for(self, m: int):
    return self.restrict(self.full, m)

  def compile(self, threads: int) -> dict:
    """name -> future of (executable, compile seconds)."""
    lowered = {}
    for name, (tun, m) in self.variants.items():
      fn = jax.jit(self.variant_fn(tun, self.k, self.dry))
      try:
        lowered[name] = fn.lower(self.args_for(m))
      except Exception as e:  # noqa: BLE001 - a variant that does not lower is its row's error
        lowered[name] = e

    def one(lw):
      if isinstance(lw, Exception):
        raise lw
      t0 = time.perf_counter()
      exe = lw.compile()
      return exe, time.perf_counter() - t0
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="topk")
    futures = {name: pool.submit(one, lw) for name, lw in lowered.items()}
    pool.shutdown(wait=False)
    return futures

  def run_variant(self, name: str, exe, compile_s: float) -> dict:
    tun, m = self.variants[name]
    args = self.args_for(m)
    sc = self.scores if m == self.M else self.scores[..., :m]
    out_elems = self.B * min(self.k, m)
    fill = jnp.full((out_elems,), SENTINEL, jnp.int32)
    jax.block_until_ready(fill)
    del fill
    g1 = np.asarray(exe(args))
    g2 = np.asarray(exe(args))
    err = float(dispatch._topk_err(g1, sc, args, self.static))
    visible = np.minimum(np.asarray(args.num_visible_BxT), m).reshape(self.B)
    selected = (g1.reshape(self.B, -1) >= 0).sum(-1)
    bad_rows = int(sum(dispatch._topk_err(g1[b:b + 1], sc[b:b + 1], args, self.static) > 1
                       for b in range(self.B)))
    row = dict(variant=name, tuning=dataclasses.asdict(tun), entries=m, k=self.k, seed=self.seed,
               compile_s=round(compile_s, 2), err_over_tol=err, bad_rows=f"{bad_rows}/{self.B}",
               neg_ids=int((g1 < 0).sum()), sentinel_ids=int((g1 == SENTINEL).sum()),
               lanes_selected_min=int(selected.min()), lanes_expected=int(np.minimum(visible, self.k).min()),
               rows_short=int((selected < np.minimum(visible, self.k)).sum()),
               repeat_differs=not np.array_equal(np.sort(g1, -1), np.sort(g2, -1)))
    row["status"] = "ok" if err <= 1.0 and not row["repeat_differs"] else "mismatch"
    if row["status"] != "ok":
      row["error"] = f"err/tol {err:.3g}, {row['bad_rows']} rows wrong, repeat differs: {row['repeat_differs']}"
    return row
