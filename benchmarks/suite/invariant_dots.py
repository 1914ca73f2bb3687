"""(b) The batch-invariant matmuls on the device: time and row bits.

Timing: `row_dot` (pallas_kernels/row_dot.py) against the plain XLA dot the model would otherwise run
(jnp.dot, fp32 accumulation, cast to bf16) at N = 1, 64, 512, 2048 rows of a 4096 x 4096 bf16 projection, and at
the decode rows (N = 1, 64) also with the fixed split of K (`RowDotTuning(k_splits=8)`: 32 x 8 programs); then
`grouped_dot` (pallas_kernels/grouped_dot.py) against its XLA reference at 2048 tokens x top-6 over 256 experts
(4096 -> 2048, expert blocks of 32 rows, random routing). Each kernel is checked against the XLA result first, then
timed with `kernel_cases.time_executable` (L2 flushed before each call: a 32 MB weight would sit in the H200's
50 MB L2 otherwise). Each row gives ms, the ratio to XLA and the fraction of the datasheet HBM bandwidth and bf16
rate (bytes: x + the weights read + y once; FLOPs: 2 N K M, for the grouped matmul over the live blocks' rows).

Row blocks: the projection as the engine runs it on a GPU today, fixed [R, K] XLA dots in a device loop over the
blocks holding live rows (`row_invariant.rows_dot`, a budget of 2048 rows), at R = 32, 64, 80, 96, 128 (the
engine's, `row_invariant.GPU_BLOCKING`) and 160, with 1 live row (a decode step: one block, its padding rows
computed) and 2048 (a prefill chunk: each block reads the weights), beside the plain dot at 1 and 2048 rows: the
row-block trade that `python -m benchmarks.step_roofline` models, measured (L2 flushed before each call, so every
block after the first may find the weights in L2, which the roofline does not count).

Row bits: a fixed row's output at N = 1, 7, 64, 2048 rows (and at the last place of 2048 shuffled rows) from
row_dot, with and without the split of K, bitwise equal to the row alone; the same for the XLA dot as the contrast
(cuBLAS picks its kernel from N, so it is expected to differ).

The dry run (CPU): K = 1024 (8 splits of two 64-wide K steps), M = 256, 16 experts of 256 -> 128, interpret-mode
kernels, no flush.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kernels_bench as kb
from benchmarks.suite import kernel_cases as kc
from dsv4.layers import row_invariant
from pallas_kernels import grouped_dot as gd
from pallas_kernels import row_dot as rd

TABLE = "Batch-invariant matmuls (row_dot, grouped_dot) vs XLA, and a row's bits across row counts"


@dataclasses.dataclass(frozen=True)
class Shapes:
  K: int = 4096
  M: int = 4096
  rows: tuple = (1, 64, 512, 2048)
  split_rows: tuple = (1, 64)   # decode: few row blocks, so the split of K multiplies the programs
  k_splits: int = 8
  bit_rows: tuple = (1, 7, 64, 2048)
  tokens: int = 2048
  top_k: int = 6
  experts: int = 256
  expert_K: int = 4096
  expert_M: int = 2048
  block_rows: int = 32
  row_blocks: tuple = (32, 64, 80, 96, 128, 160)   # the engine's: row_invariant.GPU_BLOCKING (128)
  budget_rows: int = 2048

  @classmethod
  def dry(cls):
    return cls(K=1024, M=256, rows=(1, 16, 64), bit_rows=(1, 7, 64), tokens=64, top_k=2, experts=16, expert_K=256,
               expert_M=128, block_rows=16, row_blocks=(16, 24), budget_rows=64)


def xla_dot(x, w):
  return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def _rates(ms, flops, nbytes, hbm_gbps, peak_tflops) -> dict:
  if not ms:
    return {}
  s = ms * 1e-3
  return dict(pct_hbm=100 * nbytes / s / (hbm_gbps * 1e9), pct_tc=100 * flops / s / (peak_tflops * 1e12))


def _time(exe, args, iters, repeats, flush):
  t = kc.time_executable(exe, args, iters=iters, repeats=repeats, flush=flush)
  return t["kernel_ms"] or t["hot_ms"]


def routed_blocks(key, s: Shapes):
  """Random top-k routing of `tokens` over `experts`, gathered into blocks of block_rows rows (each expert's pairs
  in its own blocks, in expert order): (block_expert_B, live_blocks, capacity B), B = pairs / R + experts."""
  scores = jax.random.uniform(key, (s.tokens, s.experts))
  _, picks = jax.lax.top_k(scores, s.top_k)
  counts = np.bincount(np.asarray(picks).ravel(), minlength=s.experts)
  blocks = -(-counts // s.block_rows)
  expert_of_block = np.repeat(np.arange(s.experts, dtype=np.int32), blocks)
  capacity = s.tokens * s.top_k // s.block_rows + s.experts
  live = len(expert_of_block)
  return np.pad(expert_of_block, (0, capacity - live), constant_values=-1), live, capacity


def run(dry: bool, seed: int, *, iters: int, repeats: int, flush_mb: float, hbm_gbps: float, peak_tflops: float):
  """The item's rows: a timing row per row count, one for the grouped matmul, then the bits row."""
  s = Shapes.dry() if dry else Shapes()
  flush = kc.Flusher(0 if dry else flush_mb)
  iters, repeats = (1, 1) if dry else (iters, repeats)
  kx, kw, ke, kr = jax.random.split(jax.random.PRNGKey(seed), 4)
  n_max = max(s.rows + s.bit_rows)
  x = jax.random.normal(kx, (n_max, s.K), jnp.bfloat16)
  w = (jax.random.normal(kw, (s.K, s.M), jnp.float32) * s.K ** -0.5).astype(jnp.bfloat16)
  kernel = jax.jit(lambda x, w: rd.row_dot(x, w, interpret=dry))
  split_tuning = rd.RowDotTuning(k_splits=s.k_splits)
  split_kernel = jax.jit(lambda x, w: rd.row_dot(x, w, tuning=split_tuning, interpret=dry))
  exes = {}

  def compiled(fn, name, *args):
    if name not in exes:
      exes[name] = jax.jit(fn).lower(*args).compile()
    return exes[name]

  cases = ([("row_dot", "row_dot", kernel, rd.RowDotTuning(), n) for n in s.rows] +
           [(f"row_dot_ksplit{s.k_splits}", "ksplit", split_kernel, split_tuning, n) for n in s.split_rows])
  for name, tag, fn, tuning, n in cases:
    xn = x[:n]
    k_exe, x_exe = compiled(fn, f"{tag}{n}", xn, w), compiled(xla_dot, f"xla{n}", xn, w)
    got, want = k_exe(xn, w), x_exe(xn, w)
    err = kb.tol_ratio(got, want, 2e-2, 2e-2)
    row = dict(table=TABLE, item=f"b.invariant_dots.{name}.n{n}", kernel="row_dot",
               shapes=f"N={n} K={s.K} M={s.M} bf16", err_over_tol=err, tuning=dataclasses.asdict(tuning))
    if not err <= 1.0:
      yield dict(row, status="mismatch", error=f"max |{name} - jnp.dot| / tol = {err:.3g} (> 1)")
      continue
    k_ms, x_ms = _time(k_exe, (xn, w), iters, repeats, flush), _time(x_exe, (xn, w), iters, repeats, flush)
    flops, nbytes = 2.0 * n * s.K * s.M, 2.0 * (n * s.K + s.K * s.M + n * s.M)
    yield dict(row, kernel_ms=k_ms, xla_ms=x_ms, kernel_over_xla=k_ms / x_ms if x_ms else None,
               **_rates(k_ms, flops, nbytes, hbm_gbps, peak_tflops),
               **{f"xla_{k}": v for k, v in _rates(x_ms, flops, nbytes, hbm_gbps, peak_tflops).items()},
               status="ok")

  yield from _row_block_rows(s, x, w, compiled, iters, repeats, flush, hbm_gbps, peak_tflops)
  yield _grouped_row(s, ke, kr, dry, iters, repeats, flush, hbm_gbps, peak_tflops)
  yield _bits_row(s, x, w, kernel, split_kernel, compiled, seed)


def _row_block_rows(s: Shapes, x, w, compiled, iters, repeats, flush, hbm_gbps, peak_tflops):
  """A row per block size R: the projection in R-row blocks over a budget of `budget_rows` rows (one executable,
  `live` a runtime scalar) at 1 and budget_rows live rows, against the plain dot at those rows."""
  B = s.budget_rows
  xb = x[:B]
  plain = {n: (compiled(xla_dot, f"xla{n}", xb[:n], w), xb[:n]) for n in (1, B)}
  plain_ms = {n: _time(exe, (xn, w), iters, repeats, flush) for n, (exe, xn) in plain.items()}
  want = np.asarray(plain[B][0](xb, w)).astype(np.float32)
  for R in s.row_blocks:
    fn = lambda xs, w, live, R=R: row_invariant.rows_dot(xs, w, live, block=R,
                                                          preferred_element_type=jnp.float32).astype(xs.dtype)
    exe = jax.jit(fn).lower(xb, w, jnp.int32(B)).compile()
    err = kb.tol_ratio(exe(xb, w, jnp.int32(B)), want, 2e-2, 2e-2)
    row = dict(table=TABLE, item=f"b.invariant_dots.row_blocks.r{R}", kernel="rows_dot (XLA dots in a loop)",
               shapes=f"blocks of {R} rows over a budget of {B}, K={s.K} M={s.M} bf16", block_rows=R,
               err_over_tol=err)
    if not err <= 1.0:
      yield dict(row, status="mismatch", error=f"max |rows_dot - jnp.dot| / tol = {err:.3g} (> 1)")
      continue
    out = {}
    for n in (1, B):
      ms = _time(exe, (xb, w, jnp.int32(n)), iters, repeats, flush)
      blocks = -(-n // R)
      flops, nbytes = 2.0 * blocks * R * s.K * s.M, 2.0 * (blocks * (R * s.K + s.K * s.M + R * s.M))
      out.update({f"live{n}_ms": ms, f"live{n}_over_plain": ms / plain_ms[n] if plain_ms[n] else None,
                  f"live{n}_plain_ms": plain_ms[n],
                  **{f"live{n}_{k}": v for k, v in _rates(ms, flops, nbytes, hbm_gbps, peak_tflops).items()}})
    yield dict(row, **out, status="ok")


def _grouped_row(s: Shapes, ke, kr, dry, iters, repeats, flush, hbm_gbps, peak_tflops) -> dict:
  experts, live, B = routed_blocks(kr, s)
  kx, kw = jax.random.split(ke)
  x = jax.random.normal(kx, (B, s.block_rows, s.expert_K), jnp.bfloat16)
  # drawn in bf16: 4 GB of weights at V4-Flash shapes (an fp32 draw would hold 8 GB more for a moment)
  w = jax.random.normal(kw, (s.experts, s.expert_K, s.expert_M), jnp.bfloat16) * jnp.bfloat16(s.expert_K ** -0.5)
  args = (x, jnp.asarray(experts), jnp.int32(live), w)
  k_exe = jax.jit(lambda *a: gd.grouped_dot(*a, interpret=dry)).lower(*args).compile()
  r_exe = jax.jit(gd.grouped_dot_reference).lower(*args).compile()
  err = kb.tol_ratio(k_exe(*args), r_exe(*args), 2e-2, 2e-2)
  row = dict(table=TABLE, item="b.invariant_dots.grouped_dot", kernel="grouped_dot",
             shapes=(f"{s.tokens} tokens x top-{s.top_k} over E={s.experts}, K={s.expert_K} M={s.expert_M}, "
                     f"{live} live blocks of {s.block_rows} (capacity {B}) bf16"),
             err_over_tol=err, tuning=dataclasses.asdict(gd.GroupedDotTuning()))
  if not err <= 1.0:
    return dict(row, status="mismatch", error=f"max |grouped_dot - reference| / tol = {err:.3g} (> 1)")
  k_ms, r_ms = _time(k_exe, args, iters, repeats, flush), _time(r_exe, args, iters, repeats, flush)
  used = len(set(experts[:live].tolist()))
  rows = live * s.block_rows
  flops = 2.0 * rows * s.expert_K * s.expert_M
  nbytes = 2.0 * (rows * s.expert_K + used * s.expert_K * s.expert_M + rows * s.expert_M)
  return dict(row, kernel_ms=k_ms, xla_ms=r_ms, kernel_over_xla=k_ms / r_ms if r_ms else None,
              **_rates(k_ms, flops, nbytes, hbm_gbps, peak_tflops),
              **{f"xla_{k}": v for k, v in _rates(r_ms, flops, nbytes, hbm_gbps, peak_tflops).items()},
              status="ok")


def _bits_row(s: Shapes, x, w, kernel, split_kernel, compiled, seed) -> dict:
  """Row 0 at every row count in bit_rows (and at the last place of the largest, the other rows shuffled) against
  row 0 alone: row_dot without and with the split of K and, as the contrast, the XLA dot."""
  n_max = max(s.bit_rows)
  order = np.random.default_rng(seed).permutation(np.arange(1, n_max))
  moved = x[:n_max][np.append(order, 0)]   # row 0 last
  out = {}
  split_name = f"row_dot_ksplit{s.k_splits}"
  for name, tag, fn in (("row_dot", "row_dot", kernel), (split_name, "ksplit", split_kernel),
                        ("xla_dot", "xla", xla_dot)):
    run = lambda xs: np.asarray(compiled(fn, f"{tag}{xs.shape[0]}", xs, w)(xs, w))  # timing's executables reused
    alone = run(x[:1])[0].view(np.uint16)
    same = {}
    for n in s.bit_rows:
      same[f"n{n}"] = bool(np.array_equal(run(x[:n])[0].view(np.uint16), alone))
    y = run(moved)
    same[f"n{n_max}_last"] = bool(np.array_equal(y[-1].view(np.uint16), alone))
    out[name] = same
  ok = all(out["row_dot"].values())
  split_ok = all(out[split_name].values())
  row = dict(table=TABLE, item="b.invariant_dots.row_bits", kernel="row_dot",
             shapes=f"row 0 at N={','.join(map(str, s.bit_rows))} (+ last of {n_max}) K={s.K} M={s.M} bf16",
             row_dot_bitwise=ok, row_dot_bits=out["row_dot"],
             **{f"{split_name}_bitwise": split_ok, f"{split_name}_bits": out[split_name]},
             xla_dot_bitwise=all(out["xla_dot"].values()), xla_dot_bits=out["xla_dot"],
             status="ok" if ok and split_ok else "mismatch")
  if not (ok and split_ok):
    bad = [n for n, good in (("row_dot", ok), (split_name, split_ok)) if not good]
    row["error"] = f"{' and '.join(bad)} gave a row other bits at another row count or place"
  return row
