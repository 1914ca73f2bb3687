"""Compile every Pallas-Triton kernel for sm_90a on the CPU and report registers, spills, shared memory and occupancy.

  python -m benchmarks.sm90_compile                      # every case, markdown table on stdout
  python -m benchmarks.sm90_compile --only sparse --json out.json
  python -m benchmarks.sm90_compile --list

Needs pip `triton` (the `sm90` extra: 3.8.0, the release nearest the Triton that jaxlib 0.11's XLA bundles; see
docs/kernels.md) and CUDA's `ptxas` on PATH (or --ptxas). No GPU: the kernels are lowered by JAX for CUDA under an
abstract H200 (`pallas_kernels/lowering.py`), the Triton IR module that JAX's Pallas-Triton lowering builds is taken
as it is handed to the custom call, compiled by Triton's own pipeline (TTIR passes -> TTGIR -> LLVM -> PTX, the
passes XLA's Triton pipeline runs on it on a GPU) for target cuda:90, and the PTX is assembled by `ptxas -v --gpu-name sm_90a`, whose report gives registers, spill bytes and
stack. Shared memory is Triton's dynamic allocation (`metadata.shared`) plus any static shared memory ptxas reports.

CTAs per SM come from those numbers against the H200's limits (`Sm90Limits`): 65536 registers (allocated per warp
in units of 256), 228 KB of shared memory (1 KB reserved per CTA, at most 227 KB per CTA), 2048 threads, 32 CTAs.
`waves` = programs / (CTAs per SM x 132 SMs), rounded up.

Cases are the V4-Flash shapes (64 heads, d 512 with 64 RoPE channels, window 128, top-k 512 and 2048, bf16, FP8
record and FP8 paged pools; HCA at 128k; prefill 4096) and the indexer at V4 (64 heads) and V4.1 (32 heads,
candidate blocks) sizes, and the batch-invariant matmuls at V4-Flash's projection and expert shapes (hidden 4096,
q LoRA 1024, grouped output 8192, 256 experts of 4096 -> 2048 and back, expert blocks of 32 rows). Identical Triton
modules are compiled once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from pallas_kernels import grouped_dot as gd
from pallas_kernels import hca_attention as hk, indexer as ix, indexer_topk as it, lowering, sparse_attention as sa
from pallas_kernels import row_dot as rd

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS

TRITON_VERSION = "3.8.0"  # pinned in pyproject's `sm90` extra


@dataclasses.dataclass(frozen=True)
class Sm90Limits:
  """Per-SM resources of an H200 (compute capability 9.0)."""
  num_sms: int = 132
  regs_per_sm: int = 65536
  reg_unit_per_warp: int = 256  # registers are allocated per warp in units of 256 (8 per thread)
  max_regs_per_thread: int = 255
  smem_per_sm: int = 228 * 1024
  smem_per_cta_max: int = 227 * 1024
  smem_reserved_per_cta: int = 1024  # the driver keeps 1 KB per resident CTA
  threads_per_sm: int = 2048
  ctas_per_sm_max: int = 32


H200 = Sm90Limits()


def ctas_per_sm(regs: int, smem: int, threads: int, lim: Sm90Limits = H200) -> tuple[int, str]:
  """(resident CTAs per SM, the limiting resource) for a kernel using `regs` registers a thread, `smem` bytes of
  shared memory and `threads` threads per CTA. 0 CTAs when it cannot launch (smem above the per-CTA maximum)."""
  warps = -(-threads // 32)
  regs_per_warp = -(-max(regs, 1) * 32 // lim.reg_unit_per_warp) * lim.reg_unit_per_warp
  limits = {
      "regs": lim.regs_per_sm // (regs_per_warp * warps),
      "threads": lim.threads_per_sm // threads,
      "ctas": lim.ctas_per_sm_max,
      "smem": (lim.smem_per_sm // (smem + lim.smem_reserved_per_cta)) if smem else 1 << 30,
  }
  if smem > lim.smem_per_cta_max:
    return 0, "smem"
  n = min(limits.values())
  return n, "+".join(k for k in ("regs", "smem", "threads", "ctas") if limits[k] == n)


# ------------------------------------------------------------------------------------------------ ptxas report

_FUNC = re.compile(r"Compiling entry function '([^']+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


@dataclasses.dataclass(frozen=True)
class PtxasReport:
  function: str
  registers: int
  stack_bytes: int
  spill_store_bytes: int
  spill_load_bytes: int
  static_smem_bytes: int


def parse_ptxas(text: str) -> PtxasReport:
  """The entry function's numbers from `ptxas -v` output (one kernel per PTX file)."""
  fn = _FUNC.search(text)
  spill = _SPILL.search(text)
  used = _USED.search(text)
  if not (fn and spill and used):
    raise ValueError(f"unrecognised ptxas -v output:\n{text}")
  used_line = text[used.start():].splitlines()[0]
  smem = _SMEM.search(used_line)
  return PtxasReport(fn.group(1), int(used.group(1)), int(spill.group(1)), int(spill.group(2)), int(spill.group(3)),
                     int(smem.group(1)) if smem else 0)


# ------------------------------------------------------------------------------------------------ capture


@dataclasses.dataclass(frozen=True)
class TritonModule:
  """One Pallas-Triton kernel as JAX hands it to the GPU custom call."""
  name: str
  ttir: str  # the Triton-dialect MLIR module, as text
  num_warps: int
  num_stages: int
  grid: tuple[int, ...]

  @property
  def programs(self) -> int:
    n = 1
    for g in self.grid:
      n *= int(g)
    return n

  @property
  def digest(self) -> str:
    return hashlib.sha256(f"{self.num_warps}/{self.num_stages}\n{self.ttir}".encode()).hexdigest()[:16]


def capture_triton_modules(fn, *arg_specs, **static_kw) -> list[TritonModule]:
  """Lower `fn(*arg_specs, **static_kw)` for CUDA (pallas_kernels.lowering.export_for_cuda) and return every
  Pallas-Triton module built on the way.

  JAX's Triton lowering (`jax._src.pallas.triton.pallas_call_registration.pallas_call_lowering`) builds the module
  with `lowering.lower_jaxpr_to_triton_module` and then serializes it into the custom call (jaxlib 0.10: bytecode in
  the backend config; 0.11: compiled by a registered handler). Wrapping that one function sees the module on both;
  num_warps / num_stages / the kernel name are the caller's locals at that point (the same names in 0.10 and 0.11),
  read from its frame because neither is an argument."""
  from jax._src.pallas.triton import lowering as triton_lowering  # local: JAX's private Triton lowering, only here

  found: list[TritonModule] = []
  original = triton_lowering.lower_jaxpr_to_triton_module

  def capture(*a, **k):
    caller = sys._getframe(1).f_locals
    missing = [n for n in ("num_warps", "num_stages", "name") if n not in caller]
    if missing:
      raise RuntimeError(f"this JAX's Triton lowering has no local(s) {missing} at the module build: update "
                         "benchmarks/sm90_compile.capture_triton_modules")
    result = original(*a, **k)
    found.append(TritonModule(str(caller["name"]), result.module.operation.get_asm(), int(caller["num_warps"]),
                              int(caller["num_stages"]), tuple(int(g) for g in result.grid)))
    return result

  triton_lowering.lower_jaxpr_to_triton_module = capture
  try:
    lowering.export_for_cuda(fn, *arg_specs, **static_kw)
  finally:
    triton_lowering.lower_jaxpr_to_triton_module = original
  return found


# ------------------------------------------------------------------------------------------------ compile


class ToolMissing(RuntimeError):
  """triton or ptxas is not installed here."""


def find_tools(ptxas: str | None = None) -> tuple[str, str]:
  """(triton version, ptxas path); raises ToolMissing with the reason."""
  try:
    import triton  # local: the optional [sm90] extra
  except ImportError as e:
    raise ToolMissing(f"pip triton is not installed (pip install -e '.[sm90]'): {e}") from e
  path = ptxas or shutil.which("ptxas")
  if not path or not os.path.exists(path):
    raise ToolMissing("CUDA's ptxas is not on PATH (CUDA >= 12.0 for sm_90a; or pass --ptxas)")
  return triton.__version__, path


@dataclasses.dataclass(frozen=True)
class Compiled:
  registers: int
  spill_store_bytes: int
  spill_load_bytes: int
  stack_bytes: int
  smem_bytes: int
  threads: int
  ctas_per_sm: int
  limiter: str
  ptx_target: str
  mma: str  # tensor-core instruction in the PTX: "wgmma" (Hopper), "mma.sync" (Ampere-style) or "none"


def compile_sm90(module: TritonModule, workdir: str, ptxas: str, lim: Sm90Limits = H200) -> Compiled:
  """TTIR -> PTX with pip triton for cuda:90, then `ptxas -v --gpu-name sm_90a` on that PTX.

  Triton skips the TTIR passes for a source given as a .ttir file (they are the step that makes TTIR from Python),
  but XLA's Triton pipeline, which compiles JAX's module on a GPU, starts with them (inliner, canonicalize, combine,
  reorder-broadcast, CSE, loop unroll). They matter: the combine pass folds `acc * alpha + dot(p, v)` into a dot
  that accumulates in place; without it the PV product lands in a second [64, 512] fp32 tile (128 more registers a
  thread at 8 warps). So they run here first (`make_ttir`), and the compile continues from their output."""
  os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(workdir, "triton_cache"))
  import triton  # local: the optional [sm90] extra (after TRITON_CACHE_DIR is set)
  from triton._C.libtriton import ir
  from triton.backends.compiler import GPUTarget
  from triton.compiler.compiler import make_backend

  target_gpu = GPUTarget("cuda", 90, 32)
  options = {"num_warps": module.num_warps, "num_stages": module.num_stages, "num_ctas": 1}
  raw = os.path.join(workdir, f"{module.name}_{module.digest}.jax.ttir")
  with open(raw, "w") as f:
    f.write(module.ttir)
  backend = make_backend(target_gpu)
  ctx = ir.context()
  ir.load_dialects(ctx)
  backend.load_dialects(ctx)
  mod = ir.parse_mlir_module(raw, ctx)
  mod.context = ctx
  backend.make_ttir(mod, {}, backend.parse_options(dict(options)), target_gpu.arch)
  src = raw[:-len(".jax.ttir")] + ".ttir"
  with open(src, "w") as f:
    f.write(str(mod))
  kernel = triton.compile(src, target=target_gpu, options=options)
  ptx = kernel.asm["ptx"]
  target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
  ptx_path = src[:-len(".ttir")] + ".ptx"
  with open(ptx_path, "w") as f:
    f.write(ptx)
  run = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx_path, "-o", ptx_path[:-4] + ".cubin"],
                       capture_output=True, text=True, timeout=600)
  if run.returncode:
    raise RuntimeError(f"ptxas failed ({run.returncode}): {(run.stderr or run.stdout).strip()[-2000:]}")
  rep = parse_ptxas(run.stdout + run.stderr)
  smem = int(kernel.metadata.shared) + rep.static_smem_bytes
  threads = module.num_warps * 32
  ctas, limiter = ctas_per_sm(rep.registers, smem, threads, lim)
  mma = "wgmma" if "wgmma.mma_async" in ptx else ("mma.sync" if "mma.sync" in ptx else "none")
  return Compiled(rep.registers, rep.spill_store_bytes, rep.spill_load_bytes, rep.stack_bytes, smem, threads, ctas,
                  limiter, target.group(1) if target else "?", mma)


# ------------------------------------------------------------------------------------------------ the cases

H, D, ROPE, W = 64, 512, 64, 128  # V4-Flash attention: 64 heads, d 512 (64 RoPE), window 128
HI, CI = 64, 128  # indexer: 64 heads x 128 (V4.1: 32 heads)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  family: str  # "sparse" (the attention kernels, sparse MLA and HCA: spills fail the test) | "indexer_scores" |
  #               "indexer_topk" | "row_dot" | "grouped_dot" (the batch-invariant matmuls: spills fail the test)
  params: dict

  def build(self):
    """(fn, arg specs, static kwargs) to lower."""
    return _BUILDERS[self.family](**self.params)


def _sparse(N, K, fmt, ctx=131072, lens=True, tuning=None, hca_table=0):
  """Sparse MLA over window W + K ids; with hca_table = F, the invariant step's HCA kernel instead (window W, then
  the visible entries through [N, F] block tables, one entry per table block: ratio 128)."""
  S = jax.ShapeDtypeStruct

  def pool(rows):
    if fmt == "fp8_paged":
      return sa.Fp8PagedPool(S((rows // 64, 64 * 292), jnp.uint16), 64)
    if fmt == "fp8_record":
      return sa.Fp8KVPool(S((rows, D - ROPE), jnp.float8_e4m3fn), S((rows, 8), jnp.uint8),
                          S((rows, ROPE), jnp.bfloat16))
    return S((rows, D), jnp.bfloat16)

  # A serving pool: 256 sequences' windows and 64 sequences' compressed rows at `ctx` (2M rows at 128k), whatever
  # the batch; pool sizes change the code only through 32- vs 64-bit offsets.
  window_rows, comp_rows = 256 * W, 64 * ctx // 4
  if hca_table:
    specs = (S((N, H, D), jnp.bfloat16), pool(window_rows), S((N, W), jnp.int32), S((N,), jnp.int32),
             pool(64 * hca_table), S((N, hca_table), jnp.int32), S((N,), jnp.int32), S((H,), jnp.float32))
    return hk.hca_attention_pallas, specs, dict(scale=D ** -0.5, entries_per_block=1, tuning=tuning)
  comp = (pool(comp_rows), S((N, K), jnp.int32)) if K else (None, None)
  ln = S((N,), jnp.int32) if lens else None
  specs = (S((N, H, D), jnp.bfloat16), pool(window_rows), S((N, W), jnp.int32), comp[0], comp[1],
           S((H,), jnp.float32), ln, ln if K else None)
  return sa.sparse_attention_pallas, specs, dict(scale=D ** -0.5, tuning=tuning)


def _indexer_scores(B, T, M, heads=HI, allowed=False):
  S = jax.ShapeDtypeStruct
  specs = (S((B, T, heads, CI), jnp.bfloat16), S((B, T, heads), jnp.float32), S((B * M, CI), jnp.bfloat16),
           S((B, M), jnp.int32), S((B, T), jnp.int32), S((B, T, M), jnp.bool_) if allowed else None)
  return ix.indexer_scores_pallas, specs, {}


def _indexer_topk(B, T, M, keys="bf16", heads=HI, cand=0, fp8_query=False, k=512):
  S = jax.ShapeDtypeStruct
  P = B * M
  pool = (it.Fp8IndexKeys(S((P, CI), jnp.float8_e4m3fn), S((P,), jnp.float32)) if keys == "fp8"
          else S((P, CI), jnp.bfloat16))
  specs = (S((B, T, heads, CI), jnp.bfloat16), S((B, T, heads), jnp.float32), pool, S((B, M), jnp.int32),
           S((B, T), jnp.int32), None, S((B,), jnp.int32), S((B, T, cand), jnp.int32) if cand else None)
  return it.indexer_topk_pallas, specs, dict(k=k, tuning=it.IndexerTopkTuning(fp8_query=fp8_query))


def _row_dot(N, K, M, dtype=jnp.bfloat16, tuning=None):
  S = jax.ShapeDtypeStruct
  specs = (S((N, K), dtype), S((K, M), dtype), S((), jnp.int32))
  return rd.row_dot_pallas, specs, dict(tuning=tuning or rd.RowDotTuning())


def _grouped_dot(B, R, E, K, M, dtype=jnp.bfloat16, tuning=None):
  S = jax.ShapeDtypeStruct
  specs = (S((B, R, K), dtype), S((B,), jnp.int32), S((), jnp.int32), S((E, K, M), dtype))
  return gd.grouped_dot_pallas, specs, dict(tuning=tuning or gd.GroupedDotTuning())


_BUILDERS = {"sparse": _sparse, "indexer_scores": _indexer_scores, "indexer_topk": _indexer_topk,
             "row_dot": _row_dot, "grouped_dot": _grouped_dot}

# Families whose register spills fail the slow test and the command's exit status.
SPILL_FAILS = ("sparse", "row_dot", "grouped_dot")


def _cases() -> list[Case]:
  out = []
  for fmt in ("bf16", "fp8_record", "fp8_paged"):
    for N in (1, 8, 64, 128):
      out.append(Case(f"sparse_decode_b{N}_csa_top512_{fmt}", "sparse", dict(N=N, K=512, fmt=fmt)))
    out.append(Case(f"sparse_decode_b64_top2048_{fmt}", "sparse", dict(N=64, K=2048, fmt=fmt)))
    out.append(Case(f"sparse_prefill_4k_csa_{fmt}", "sparse", dict(N=4096, K=512, fmt=fmt)))
  out.append(Case("sparse_decode_b64_hca_128k_bf16", "sparse", dict(N=64, K=1024, fmt="bf16")))
  out.append(Case("sparse_decode_b64_hca_128k_fp8_paged", "sparse", dict(N=64, K=1024, fmt="fp8_paged")))
  out.append(Case("sparse_decode_b64_window_only_bf16", "sparse", dict(N=64, K=0, fmt="bf16")))
  # The invariant step's HCA kernel (family "sparse": the same rows and dots, so a spill fails the test too);
  # tables at 1M tokens (8192 blocks), any live context.
  for fmt in ("bf16", "fp8_record", "fp8_paged"):
    out.append(Case(f"hca_invariant_decode_b64_{fmt}", "sparse", dict(N=64, K=0, fmt=fmt, hca_table=8192)))
  out.append(Case("indexer_scores_decode_b64_128k", "indexer_scores", dict(B=64, T=1, M=131072 // 4)))
  out.append(Case("indexer_scores_prefill_4k", "indexer_scores", dict(B=1, T=4096, M=16384 // 4)))
  out.append(Case("indexer_scores_decode_b64_128k_v41", "indexer_scores",
                  dict(B=64, T=1, M=131072 // 4, heads=32, allowed=True)))
  for keys in ("bf16", "fp8"):
    out.append(Case(f"indexer_topk_decode_b64_128k_{keys}", "indexer_topk", dict(B=64, T=1, M=131072 // 4, keys=keys)))
    out.append(Case(f"indexer_topk_prefill_4k_{keys}", "indexer_topk", dict(B=1, T=4096, M=16384 // 4, keys=keys)))
  out.append(Case("indexer_topk_decode_b64_128k_fp8_query", "indexer_topk",
                  dict(B=64, T=1, M=131072 // 4, keys="fp8", fp8_query=True)))
  out.append(Case("indexer_topk_decode_b64_128k_v41_candidates", "indexer_topk",
                  dict(B=64, T=1, M=131072 // 4, heads=32, cand=64)))
  out.append(Case("indexer_topk_decode_b64_128k_v41_fp8", "indexer_topk",
                  dict(B=64, T=1, M=131072 // 4, keys="fp8", heads=32)))
  # The batch-invariant matmuls at V4-Flash shapes: hidden 4096 -> q LoRA 1024 and -> 4096 (a square projection),
  # the grouped output's 8192 -> 4096, the shared expert's 2048 -> 4096; prefill (2048 rows) and decode (64 rows)
  # compile to the same code (nothing is chosen from N), only the grid differs.
  for name, N, K, M in (("q_a_4096x1024_n2048", 2048, 4096, 1024), ("square_4096x4096_n2048", 2048, 4096, 4096),
                        ("o_b_8192x4096_n2048", 2048, 8192, 4096), ("shared_down_2048x4096_n64", 64, 2048, 4096)):
    out.append(Case(f"row_dot_{name}_bf16", "row_dot", dict(N=N, K=K, M=M)))
  out.append(Case("row_dot_square_4096x4096_n64_fp32", "row_dot", dict(N=64, K=4096, M=4096, dtype=jnp.float32)))
  # decode with the fixed split of K: 32 column blocks x 8 splits = 256 programs instead of 32
  out.append(Case("row_dot_square_4096x4096_n64_ksplit8_bf16", "row_dot",
                  dict(N=64, K=4096, M=4096, tuning=rd.RowDotTuning(k_splits=8))))
  # 2048 tokens x top-6 over 256 experts in blocks of 32 rows: 12288 pairs, at most 12288 / 32 + 256 = 640 blocks.
  out.append(Case("grouped_dot_gate_up_e256_4096x2048_r32", "grouped_dot", dict(B=640, R=32, E=256, K=4096, M=2048)))
  out.append(Case("grouped_dot_down_e256_2048x4096_r32", "grouped_dot", dict(B=640, R=32, E=256, K=2048, M=4096)))
  out.append(Case("grouped_dot_gate_up_e256_4096x2048_r16", "grouped_dot", dict(B=1024, R=16, E=256, K=4096,
                                                                                M=2048)))
  return out


CASES = _cases()


@dataclasses.dataclass(frozen=True)
class Row:
  case: str
  family: str
  kernel: str
  num_warps: int
  num_stages: int
  programs: int
  compiled: Compiled | None
  error: str | None = None
  seconds: float = 0.0

  @property
  def waves(self) -> float:
    c = self.compiled
    if c is None or not c.ctas_per_sm:
      return float("nan")
    return -(-self.programs // (c.ctas_per_sm * H200.num_sms))

  @property
  def spills(self) -> bool:
    c = self.compiled
    return c is not None and (c.spill_store_bytes > 0 or c.spill_load_bytes > 0)


def run_case(case: Case, workdir: str, ptxas: str, seen: dict | None = None) -> list[Row]:
  """One row per Triton kernel the case lowers to (an error while lowering or compiling is a row with `error`)."""
  t0 = time.perf_counter()
  try:
    fn, specs, kw = case.build()
    modules = capture_triton_modules(fn, *specs, **kw)
    if not modules:
      raise RuntimeError("no Pallas-Triton kernel in this case's lowering")
  except Exception as e:  # noqa: BLE001 - a case that fails is a row
    return [Row(case.name, case.family, "?", 0, 0, 0, None, f"lowering: {type(e).__name__}: {_last_line(e)}",
                time.perf_counter() - t0)]
  rows = []
  for m in modules:
    try:
      if seen is not None and m.digest in seen:
        compiled = seen[m.digest]
      else:
        compiled = compile_sm90(m, workdir, ptxas)
        if seen is not None:
          seen[m.digest] = compiled
      rows.append(Row(case.name, case.family, m.name, m.num_warps, m.num_stages, m.programs, compiled,
                      seconds=time.perf_counter() - t0))
    except Exception as e:  # noqa: BLE001
      rows.append(Row(case.name, case.family, m.name, m.num_warps, m.num_stages, m.programs, None,
                      f"compile: {type(e).__name__}: {_last_line(e)}", time.perf_counter() - t0))
  return rows


def _last_line(e: Exception) -> str:
  lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
  return lines[-1][:300] if lines else ""


def run(cases: list[Case], ptxas: str | None = None, workdir: str | None = None, log=None) -> list[Row]:
  _, ptxas = find_tools(ptxas)
  own = workdir is None
  workdir = workdir or tempfile.mkdtemp(prefix="sm90_")
  seen: dict = {}
  rows = []
  try:
    for c in cases:
      got = run_case(c, workdir, ptxas, seen)
      rows += got
      if log:
        for r in got:
          log(format_row(r))
  finally:
    if own:
      shutil.rmtree(workdir, ignore_errors=True)
  return rows


HEADER = ("| case | warps / stages | programs | regs | spill st / ld (B) | smem (KB) | CTAs/SM (limit) | waves | MMA |\n"
          "|---|---|---|---|---|---|---|---|---|")


def format_row(r: Row) -> str:
  c = r.compiled
  if c is None:
    return f"| {r.case} | {r.num_warps} / {r.num_stages} | {r.programs} | error: {r.error} | | | | | |"
  return (f"| {r.case} | {r.num_warps} / {r.num_stages} | {r.programs} | {c.registers} | "
          f"{c.spill_store_bytes} / {c.spill_load_bytes} | {c.smem_bytes / 1024:.1f} | {c.ctas_per_sm} ({c.limiter}) | "
          f"{r.waves:g} | {c.mma} |")


def define_flags():
  flags.DEFINE_string("only", "", "comma-separated substrings of case names")
  flags.DEFINE_string("json", "", "write the rows here as JSON")
  flags.DEFINE_string("ptxas", None, "ptxas binary (default: the one on PATH)")
  flags.DEFINE_bool("list", False, "print the case names and exit")


def main(argv) -> int:
  del argv
  args = FLAGS
  subs = [s for s in args.only.split(",") if s]
  cases = [c for c in CASES if not subs or any(s in c.name for s in subs)]
  if args.list:
    print("\n".join(c.name for c in cases))
    return 0
  try:
    version, ptxas = find_tools(args.ptxas)
  except ToolMissing as e:
    print(f"sm90_compile: {e}", file=sys.stderr)
    return 2
  ptxas_version = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()
  print(f"jax {jax.__version__}, triton {version}, {ptxas_version[-1] if ptxas_version else ptxas}; "
        f"target sm_90a, H200 limits {dataclasses.asdict(H200)}\n")
  print(HEADER)
  rows = run(cases, ptxas, log=print)
  if args.json:
    with open(args.json, "w") as f:
      json.dump([dict(dataclasses.asdict(r), waves=r.waves) for r in rows], f, indent=1)
  bad = [r for r in rows if r.error or (r.family in SPILL_FAILS and r.spills)]
  for r in bad:
    print(f"FAIL {r.case}: {r.error or 'spills'}", file=sys.stderr)
  return 1 if bad else 0


if __name__ == "__main__":
  define_flags()
  app.run(main)
