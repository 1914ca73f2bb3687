"""A roofline cost model of one engine step at real width (V4-Flash, V4.1-Flash) on a described GPU.

Five step designs, each costed from the bytes it must move and the FLOPs it must do:

* `tiled`: the invariant step the engine ran before its row-invariant ops (BUILD_NOTES, Tried and dropped): the
  step's flat token axis in tiles of 64 tokens, each tile a pass of its own through the whole model, so every tile
  reads every weight it touches again, and the KV a row's queries share (index keys, HCA entries, a prefill's
  compressed rows) once per tile.
* `blocked`: the step the engine runs on a GPU today (dsv4/layers/row_invariant.py as built): every token through
  each layer once, but each dense projection in fixed blocks of `Tiling.row_block` rows one after another (a
  fixed-shape dot per block: its split, if any, is the same every step), so a projection's weights are read once
  per block of live rows, and the per-token work around them (the mHC streams) runs on whole blocks, padding rows
  included; the routed experts once per step on the grouped expert kernel (fixed 16-row blocks, no split-K);
  attention and the indexer as `invariant`.
* `invariant_splitk` and `invariant`: a row-invariant step: every token through each layer once (weights read
  once per step) with kernels whose per-row reduction order does not depend on the row count: matmuls with one
  tiling per weight, a grouped expert matmul with fixed 16-row blocks (each expert's rows padded up to the block:
  padded FLOPs counted), attention split into fixed 64-key pieces and the indexer into fixed 256-entry chunks (a
  token's pieces and their merge order follow its keys, not the batch), compressors reduced per entry in parallel.
  `invariant_splitk` cuts each matmul's reduction into fixed 256-wide pieces summed in a fixed order: whether the
  pieces of one output tile run in parallel CTAs or one after another in one CTA does not change a bit, so that
  choice may follow the batch. `invariant` never splits the reduction (few rows then leave SMs idle).
* `plain`: a non-invariant step: the same single pass with free split-K / split-KV chosen per call, no padding.

Every op's time is max(bytes / (HBM x occupancy), FLOPs / (peak x efficiency x occupancy)), occupancy =
min(1, programs / SMs): a kernel with fewer output tiles (times parallel K pieces) than SMs reaches that fraction
of the machine (pessimistic for one-CTA-per-SM streaming, which can pull more than its share of HBM). Where split
pieces run in parallel their fp32 partials are written and read back (counted in HBM bytes when they exceed half
the L2; smaller ones are taken to stay in it); the model picks the number of parallel pieces that minimises the
op's time. A step's time is the sum over its ops (per layer: the dense projections, the grouped experts, attention,
the indexer, the compressor and cache traffic, the mHC streams), plus the LM head at each row's last token.

Inputs, all expected values: routing is uniform (a tile of T tokens x top-k over E experts touches
E * (1 - (1 - k/E)^T) of them; the row counts per expert are binomial), decode rows are all at the same context,
a prefill chunk of C tokens is one row whose last token sits at the stated context. Weights are the stored
checkpoint formats (`benchmarks.sizing.stored_bytes_per_param` over `dsv4.model.param_shapes`: MXFP4 experts, FP8
projections, bf16 / fp32 rest), computed at the bf16 (or FP8) tensor-core rate. What is left out: kernel launch and
host gaps, communication, the sampler, and the compressors' dependent fold steps (reported on their own,
`StepCost.scan_steps`, as they are latency, not bytes).

docs/engine.md (Cost at real width) has the table and how to read it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import numpy as np

from benchmarks.sizing import stored_bytes_per_param
from dsv4 import model
from dsv4.config import LayerPlan, ModelConfig
from dsv4.layers import row_invariant
from pallas_kernels.grouped_dot import GroupedDotTuning

Design = Literal["tiled", "blocked", "invariant", "invariant_splitk", "plain"]
DESIGNS: tuple[Design, ...] = ("tiled", "blocked", "invariant", "invariant_splitk", "plain")


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """One GPU as the roofline sees it. `matmul_efficiency` scales the dense spec peak to what a well-tuned kernel
  reaches (0.8 x 989 = 791 TFLOP/s bf16 on an H100 / H200 SXM)."""
  name: str
  hbm_bytes_per_s: float
  bf16_flops: float            # dense tensor-core peak, spec sheet
  fp8_flops: float
  num_sms: int
  l2_bytes: float
  matmul_efficiency: float = 0.8
  dependent_step_s: float = 5e-6   # assumed: one iteration of a device loop of small ops (the tiled step's scans)

  def peak(self, compute: str) -> float:
    return (self.fp8_flops if compute == "fp8" else self.bf16_flops) * self.matmul_efficiency


H200 = DeviceSpec("H200 SXM", hbm_bytes_per_s=4.8e12, bf16_flops=989e12, fp8_flops=1979e12, num_sms=132,
                  l2_bytes=50e6)
H100 = DeviceSpec("H100 SXM", hbm_bytes_per_s=3.35e12, bf16_flops=989e12, fp8_flops=1979e12, num_sms=132,
                  l2_bytes=50e6)
DEVICES = {"h200": H200, "h100": H100}


@dataclasses.dataclass(frozen=True)
class Formats:
  """Storage formats: routed experts ("mxfp4" as released, "fp8", "bf16"), KV pools ("bf16" rows of 2 x d bytes or
  "fp8" records of 584 bytes: 448 e4m3 + 64 bf16 RoPE channels + scales), index keys (bf16 or FP8 + fp32 scale),
  the tensor-core rate the matmuls run at ("bf16" or "fp8"), and the dense projections ("fp8" as released, "bf16"
  as the loader holds them today: it dequantizes FP8 tensors at load)."""
  experts: str = "mxfp4"
  kv: str = "bf16"
  compute: str = "bf16"
  projections: str = "fp8"

  def expert_bytes_per_param(self) -> float:
    return {"mxfp4": 0.5 + 1.0 / 32, "fp8": 1.0 + 1.0 / (128 * 128), "bf16": 2.0}[self.experts]

  def kv_row_bytes(self, head_dim: int) -> int:
    return 584 if self.kv == "fp8" else 2 * head_dim

  def index_row_bytes(self, index_dim: int) -> int:
    return index_dim + 4 if self.kv == "fp8" else 2 * index_dim


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Kernel shapes the occupancy and padding follow. `block_m` x `block_n`: one output tile of a matmul program
  (also the grouped experts' fixed row block); `plain_block_k`: the finest reduction piece a plain split-K uses;
  `fixed_k_split`: the invariant split-K's fixed piece; `key_split` / `plain_key_block`: keys per attention piece
  (invariant: fixed by position; plain: the finest split-KV); `index_chunk` / `plain_index_chunk`: index keys per
  indexer piece; `tile_tokens`: the tiled step's tile; `row_block`: the blocked step's rows per projection call
  (`row_invariant.GPU_BLOCKING.rows`, sized for the bf16 projections the engine holds; `row_block_for` gives the
  block for a projection format); `expert_kernel`: whether the blocked step may run the routed experts on the
  grouped expert kernel (False: the loop of `loop_expert_rows`-pair blocks, as on a mesh that splits the experts)."""
  block_m: int = 64
  block_n: int = 128
  expert_block_m: int = 16
  plain_block_k: int = 128
  fixed_k_split: int = 256
  key_split: int = 64
  plain_key_block: int = 16
  index_chunk: int = 256
  plain_index_chunk: int = 128
  tile_tokens: int = 64
  row_block: int = row_invariant.GPU_BLOCKING.rows
  loop_expert_rows: int = row_invariant.GPU_BLOCKING.expert_rows
  expert_kernel: bool = True


# The blocked step's rows per block for FP8 projection weights (a block of R rows does 2R FLOPs a byte: an H200's
# ridge is about 82): what FP8 projection matmuls would take; the engine holds bf16 projections and takes
# `row_invariant.GPU_BLOCKING`.
FP8_ROW_BLOCK = 80


def row_block_for(fmt: "Formats") -> int:
  """The blocked step's rows per block for `fmt`'s projection weights."""
  return FP8_ROW_BLOCK if fmt.projections == "fp8" else row_invariant.GPU_BLOCKING.rows


@dataclasses.dataclass(frozen=True)
class Point:
  """One step: `decode` of `batch` rows each at `context` tokens, or `prefill` of one chunk of `batch` tokens
  whose last token is at `context` (the chunk covers positions context - batch .. context - 1)."""
  kind: Literal["decode", "prefill"]
  batch: int
  context: int

  @property
  def label(self) -> str:
    k = f"{self.context // 1024}k" if self.context % 1024 == 0 else str(self.context)
    return f"decode b{self.batch} @ {k}" if self.kind == "decode" else f"prefill {self.batch} @ {k}"

  @property
  def logit_rows(self) -> int:
    return self.batch if self.kind == "decode" else 1


DECODE_BATCHES = (1, 8, 64, 128, 256)
CONTEXTS = (8192, 65536)
PREFILL_CHUNKS = (512, 2048, 8192)


def default_points() -> list[Point]:
  pts = [Point("decode", b, c) for c in CONTEXTS for b in DECODE_BATCHES]
  return pts + [Point("prefill", n, c) for c in CONTEXTS for n in PREFILL_CHUNKS if n <= c]


# ----------------------------------------------------------------------------------------------------------------
# Weights: every parameter of `dsv4.model.param_shapes` as stored, sorted by how a pass reads it.

@dataclasses.dataclass(frozen=True)
class Matmul:
  """x[M, K] @ W[K, N] (times `groups` independent weights of that shape, e.g. the grouped output projection)."""
  name: str
  K: int
  N: int
  groups: int
  bytes: float


@dataclasses.dataclass(frozen=True)
class LayerWeights:
  plan: LayerPlan
  matmuls: tuple[Matmul, ...]     # dense projections: read once per pass
  expert_bytes: float             # one routed expert (w1 + w3 + w2)
  shared_bytes: float             # the shared expert(s)
  n_experts: int
  top_k: int
  inter: int                      # expert width
  n_shared: int                   # shared experts (each `inter` wide)
  other_bytes: float              # norms, biases, sink, ape, ...: read once per pass
  lookup_row_bytes: float         # per token: rows read from lookup tables (tid2eid, Engram)


@dataclasses.dataclass(frozen=True)
class ModelWeights:
  layers: tuple[LayerWeights, ...]
  lm_head: Matmul
  top_matmuls: tuple[Matmul, ...]   # over every token of a pass (hc_head)
  embed_row_bytes: float
  total_bytes: float                # everything as stored (the checkpoint's size, without MTP)


_NOT_MATMUL = {"ape", "tid2eid", "q_weight", "k_weight", "embed", "bias", "bias_vl"}


def model_weights(cfg: ModelConfig, fmt: Formats = Formats()) -> ModelWeights:
  """The stored weight inventory of `cfg` (MTP / draft blocks left out), from the model's own parameter tree."""
  def stored(names, spec) -> float:
    per = (fmt.expert_bytes_per_param() if len(names) > 1 and names[-2] == "experts"
           else stored_bytes_per_param(names, cfg.variant, spec.dtype))
    if fmt.projections == "bf16" and 1.0 <= per < 1.01:        # an FP8 e4m3 tensor (+ block scales) held as bf16
      per = 2.0
    return float(np.prod(spec.shape)) * per

  def leaves(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=model.is_param_spec)[0]
    return [([str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)], spec) for path, spec in flat]

  shapes = model.param_shapes(dataclasses.replace(cfg, num_mtp_layers=0))
  total = sum(stored(n, s) for n, s in leaves(shapes))
  layers = []
  for plan, tree in zip(cfg.layer_plan(), shapes["layers"]):
    matmuls, other, lookup = [], 0.0, 0.0
    expert = shared = 0.0
    for names, spec in leaves(tree):
      b = stored(names, spec)
      if "experts" in names:
        expert += b / cfg.moe.n_routed_experts
      elif "shared" in names:
        shared += b
      elif names[-1] == "tid2eid":
        lookup += b / spec.shape[0]
      elif names[-2:] == ["engram", "embed"]:
        lookup += cfg.engram.hash_heads * b / spec.shape[0]
      elif len(spec.shape) >= 2 and names[-1] not in _NOT_MATMUL:
        groups = spec.shape[0] if len(spec.shape) == 3 else 1
        matmuls.append(Matmul("/".join(names), spec.shape[-2], spec.shape[-1], groups, b))
      else:
        other += b
    layers.append(LayerWeights(plan, tuple(matmuls), expert, shared, cfg.moe.n_routed_experts,
                               cfg.moe.num_experts_per_tok, cfg.moe.intermediate_size,
                               cfg.moe.n_shared_experts, other, lookup))
  D, V = cfg.hidden_size, cfg.vocab_size
  lm = shapes["lm_head"]
  lm_head = Matmul("lm_head", D, V, 1, stored(["lm_head"], lm))
  top = []
  if "hc_head" in shapes:
    fn = shapes["hc_head"]["fn"]
    top.append(Matmul("hc_head/fn", fn.shape[0], fn.shape[1], 1, stored(["hc_head", "fn"], fn)))
  embed = shapes["embed"]
  return ModelWeights(tuple(layers), lm_head, tuple(top), stored(["embed"], embed) / embed.shape[0], total)


# ----------------------------------------------------------------------------------------------------------------
# Ops and their time

@dataclasses.dataclass
class Tally:
  """Running totals of one step: bytes by kind, FLOPs, time (and the part of it spent in memory-bound ops)."""
  weight_bytes: float = 0.0
  kv_bytes: float = 0.0
  act_bytes: float = 0.0
  flops: float = 0.0
  time_s: float = 0.0
  mem_bound_s: float = 0.0
  parts: dict = dataclasses.field(default_factory=dict)   # seconds per op kind (matmul, experts, attention, ...)

  def times(self, k: float) -> "Tally":
    """k calls of the op this tally counts."""
    return Tally(*(getattr(self, f.name) * k for f in dataclasses.fields(self) if f.name != "parts"),
                 parts={p: v * k for p, v in self.parts.items()})

  def add(self, t: "Tally", part: str | None = None) -> None:
    for f in dataclasses.fields(self):
      if f.name != "parts":
        setattr(self, f.name, getattr(self, f.name) + getattr(t, f.name))
    for k, v in (t.parts.items() if part is None else [(part, t.time_s)]):
      self.parts[k] = self.parts.get(k, 0.0) + v


def op_time(dev: DeviceSpec, compute: str, bytes_: float, flops: float, programs: float,
            max_pieces: int = 1, partial_bytes_per_piece: float = 0.0) -> tuple[float, float, bool]:
  """(seconds, bytes moved, memory-bound?) of one kernel with `programs` independent output programs whose
  reduction may run as up to `max_pieces` parallel pieces, each piece writing and reading `partial_bytes_per_piece`
  of fp32 partials (through HBM only when they are more than half the L2). The piece count that minimises the time
  is taken."""
  best = None
  peak = dev.peak(compute)
  candidates = sorted({1, max_pieces} | {p for p in (2, 4, 8, 16, 32, 64, 128) if p < max_pieces}
                      | {max(1, min(max_pieces, math.ceil(dev.num_sms / max(programs, 1))))})
  for p in candidates:
    occ = min(1.0, programs * p / dev.num_sms) if programs > 0 else 1.0
    partials = p * partial_bytes_per_piece if p > 1 else 0.0
    moved = bytes_ + (partials if partials > dev.l2_bytes / 2 else 0.0)    # small partials stay in L2
    t_mem, t_mma = moved / (dev.hbm_bytes_per_s * occ), flops / (peak * occ)
    cand = (max(t_mem, t_mma), moved, t_mem >= t_mma)
    if best is None or cand[0] < best[0]:
      best = cand
  return best


def _matmul(dev, fmt, tiling, design, m: Matmul, M: int) -> Tally:
  """One dense projection over M rows."""
  tiles = math.ceil(M / tiling.block_m) * math.ceil(m.N / tiling.block_n) * m.groups
  if design == "invariant":
    pieces = 1
  elif design == "invariant_splitk":
    pieces = max(1, m.K // tiling.fixed_k_split)
  else:
    pieces = max(1, m.K // tiling.plain_block_k)
  act = 2.0 * M * (m.K + m.N) * m.groups
  flops = 2.0 * M * m.K * m.N * m.groups
  t, moved, mem = op_time(dev, fmt.compute, m.bytes + act, flops, tiles, pieces, 8.0 * M * m.N * m.groups)
  return Tally(weight_bytes=m.bytes, act_bytes=moved - m.bytes, flops=flops, time_s=t, mem_bound_s=t if mem else 0)


def expected_touched(n_experts: int, top_k: int, tokens: int) -> float:
  """Expected distinct experts a pass of `tokens` tokens x top_k uniform distinct picks touches."""
  return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


@functools.lru_cache(maxsize=None)
def expected_row_blocks(n_experts: int, top_k: int, tokens: int, block: int) -> float:
  """E[sum over experts of ceil(rows_e / block)], rows_e ~ Binomial(tokens, top_k / n_experts)."""
  p = top_k / n_experts
  r = np.arange(tokens + 1)
  lg = np.cumsum(np.log(np.maximum(np.arange(tokens + 1), 1)))       # log k!
  logpmf = lg[tokens] - lg - lg[::-1] + r * math.log(p) + (tokens - r) * (math.log1p(-p) if p < 1 else 0.0)
  return n_experts * float(np.sum(np.exp(logpmf) * np.ceil(r / block)))


def shared_matmuls(lw: LayerWeights, D: int) -> tuple[Matmul, Matmul]:
  """The shared expert(s) as the blocked step runs them: two dense projections (w1 | w3, then w2) in its loop."""
  I = lw.inter * lw.n_shared
  return (Matmul("shared/w1w3", D, 2 * I, 1, lw.shared_bytes * 2 / 3),
          Matmul("shared/w2", I, D, 1, lw.shared_bytes / 3))


def _experts(dev, fmt, tiling, design, lw: LayerWeights, tokens: int, D: int, shared: bool = True) -> Tally:
  """The routed experts plus (shared) the shared one as one grouped SwiGLU matmul over this pass's tokens."""
  touched = expected_touched(lw.n_experts, lw.top_k, tokens)
  routes = tokens * lw.top_k
  bm = tiling.expert_block_m
  row_blocks = expected_row_blocks(lw.n_experts, lw.top_k, tokens, bm) + (math.ceil(tokens / bm) if shared else 0)
  rows = routes + (tokens if shared else 0)                   # the shared expert: every token
  padded_rows = row_blocks * bm if design in ("invariant", "invariant_splitk") else rows
  wbytes = touched * lw.expert_bytes + (lw.shared_bytes if shared else 0.0)
  out = Tally(weight_bytes=wbytes)
  I = lw.inter
  for K, N, share in ((D, 2 * I, 2 / 3), (I, D, 1 / 3)):     # w1|w3 fused, then w2
    tiles = row_blocks * math.ceil(N / tiling.block_n)
    pieces = (1 if design == "invariant" else
              max(1, K // (tiling.fixed_k_split if design == "invariant_splitk" else tiling.plain_block_k)))
    act = 2.0 * rows * (K + N)
    flops = 2.0 * padded_rows * K * N
    t, moved, mem = op_time(dev, fmt.compute, wbytes * share + act, flops, tiles, pieces, 8.0 * rows * N)
    out.add(Tally(act_bytes=moved - wbytes * share, flops=flops, time_s=t, mem_bound_s=t if mem else 0))
  return out


def _looped_experts(dev, fmt, tiling, lw: LayerWeights, tokens: int, D: int) -> Tally:
  """The routed experts as the blocked step runs them where the grouped expert kernel cannot take them: a loop of
  one [rows, D] x [D, I] product per live block of `Tiling.loop_expert_rows` pairs of one expert, each call reading
  its expert's weights."""
  bm = tiling.loop_expert_rows
  blocks = expected_row_blocks(lw.n_experts, lw.top_k, tokens, bm)
  out = Tally(weight_bytes=blocks * lw.expert_bytes)
  I = lw.inter
  for K, N, share in ((D, 2 * I, 2 / 3), (I, D, 1 / 3)):
    t, moved, mem = op_time(dev, fmt.compute, lw.expert_bytes * share + 2.0 * bm * (K + N), 2.0 * bm * K * N,
                            math.ceil(N / tiling.block_n), max(1, K // tiling.plain_block_k), 8.0 * bm * N)
    out.add(Tally(act_bytes=blocks * (moved - lw.expert_bytes * share), flops=blocks * 2.0 * bm * K * N,
                  time_s=blocks * t, mem_bound_s=blocks * t if mem else 0))
  return out


# ----------------------------------------------------------------------------------------------------------------
# Attention, indexer, compressors and cache traffic of one layer for one row's queries.

def visible(pos: np.ndarray, ratio: int) -> np.ndarray:
  """Compressed entries query `pos` may use: floor((pos + 1) / ratio) (docs/model.md)."""
  return (pos + 1) // ratio


def _attention_layer(dev, fmt, tiling, design, cfg: ModelConfig, plan: LayerPlan, rows: int,
                     pos: np.ndarray) -> Tally:
  """`rows` rows, each with queries at positions `pos` (the same for every row: decode rows share their context),
  through one layer's attention, indexer, compressor and cache writes."""
  a, ix = cfg.attention, cfg.indexer
  H, d, W = a.num_heads, a.head_dim, a.window
  kv_row = fmt.kv_row_bytes(d)
  nq = len(pos)
  p0, p1 = int(pos[0]), int(pos[-1])
  win_q = np.minimum(W, pos + 1)
  comp_q = np.zeros_like(pos)
  index_q = np.zeros_like(pos)
  uniq_comp = uniq_index = 0
  if plan.ratio > 0:
    vis = visible(pos, plan.ratio)
    comp_q = vis if plan.dense_compressed else np.minimum(ix.topk, vis)
    uniq_comp = int(vis[-1]) if plan.dense_compressed else int(min(vis[-1], ix.topk * nq))
    if plan.has_index_query:
      cap = ix.candidate_topk_blocks * ix.candidate_block_size if plan.uses_candidates else None
      index_q = vis if cap is None else np.minimum(vis, cap)
      uniq_index = int(vis[-1] if cap is None else min(vis[-1], cap * nq))
  out = Tally()
  # attention: window + compressed rows read once per row and pass; 2 H keys (d + d) FLOPs per query key
  uniq_win = min(p1 + 1, nq + W - 1)
  keys_last = int(win_q[-1] + comp_q[-1])
  att_bytes = rows * (uniq_win + uniq_comp) * kv_row
  att_act = rows * nq * H * d * 2 * 2                         # q in, o out (bf16)
  att_flops = rows * float(np.sum(win_q + comp_q)) * 2 * H * 2 * d
  split = tiling.key_split if design in ("invariant", "invariant_splitk") else tiling.plain_key_block
  t, moved, mem = op_time(dev, fmt.compute, att_bytes + att_act, att_flops, rows * nq,
                          max(1, math.ceil(keys_last / split)), rows * nq * 2 * 4.0 * H * (d + 2))
  out.add(Tally(kv_bytes=att_bytes, act_bytes=moved - att_bytes, flops=att_flops, time_s=t,
                mem_bound_s=t if mem else 0), "attention")
  # indexer: every (visible or candidate) index key of the row once per pass; scores 2 H_I c per key and query
  if plan.has_index_query:
    idx_row = fmt.index_row_bytes(ix.head_dim)
    ib = rows * uniq_index * idx_row
    iact = rows * nq * (ix.num_heads * ix.head_dim * 2 + ix.num_heads * 4)   # q and head weights in
    iflops = rows * float(np.sum(index_q)) * 2 * ix.num_heads * ix.head_dim
    chunk = tiling.index_chunk if design in ("invariant", "invariant_splitk") else tiling.plain_index_chunk
    t, moved, mem = op_time(dev, fmt.compute, ib + iact, iflops, rows * nq,
                            max(1, math.ceil(int(index_q[-1]) / chunk)),
                            rows * nq * 2 * 8.0 * min(chunk, ix.topk))
    out.add(Tally(kv_bytes=ib, act_bytes=moved - ib, flops=iflops, time_s=t, mem_bound_s=t if mem else 0), "indexer")
  # cache writes and compressor state: each token's window row; each closed entry (and index key); a pooling
  # compressor's fp32 state (kv and score, 2 x width) read and written per token
  writes = nq * kv_row
  if plan.has_compressor:
    new_entries = int(visible(np.array([p1]), plan.ratio)[0] - visible(np.array([p0 - 1]), plan.ratio)[0])
    writes += new_entries * kv_row
    if plan.has_index_keys:
      writes += new_entries * fmt.index_row_bytes(ix.head_dim)
    if plan.ratio > 1:
      writes += nq * 2 * 2 * cfg.compressor_width(plan) * 4
      if plan.kind == "csa":
        writes += nq * 2 * 2 * cfg.index_compressor_width(plan) * 4
  t, _, _ = op_time(dev, fmt.compute, rows * writes, 0.0, dev.num_sms)   # spread over the machine
  out.add(Tally(kv_bytes=rows * writes, time_s=t, mem_bound_s=t), "cache writes")
  return out


def fold_chain_steps(cfg: ModelConfig, tokens_per_row: int, doubling: bool = False) -> int:
  """Dependent steps of the compressors' running-pool folds in one pass over rows of `tokens_per_row` tokens.
  Invariant steps (`compressor.window_pool_scan`: segments in parallel, each folded in position order): a pass's
  chain is its longest segment, min(ratio, tokens) - 1 per fold. A plain step (`doubling`,
  `compressor.segmented_pool_scan`): ceil(log2(min(ratio, tokens))) per fold. An overlapping compressor folds twice,
  one after the other; V4 CSA folds the main and the indexer compressor. 0 for decode rows."""
  n = 0
  for plan in cfg.layer_plan():
    if plan.has_compressor and plan.ratio > 1:
      folds = (2 if plan.overlap else 1) * (2 if plan.kind == "csa" and plan.has_index_keys else 1)
      seg = min(plan.ratio, tokens_per_row)
      n += folds * (math.ceil(math.log2(seg)) if doubling else seg - 1)
  return n


# ----------------------------------------------------------------------------------------------------------------
# A pass (every token once through the model) and a step

def pass_cost(cfg: ModelConfig, w: ModelWeights, dev: DeviceSpec, fmt: Formats, tiling: Tiling, design: Design,
              rows: int, pos: np.ndarray, matmul_rows: int | None = None) -> Tally:
  """One pass of `rows` rows x queries at `pos` through every layer (no LM head). `matmul_rows`: the rows the
  dense matmuls run at (the tiled step's fixed tile; default the live tokens)."""
  tokens = rows * len(pos)
  M = matmul_rows or tokens
  D = cfg.hidden_size
  n = cfg.mhc.hc_mult
  out = Tally(act_bytes=tokens * w.embed_row_bytes)
  stream_rows = -(-tokens // tiling.row_block) * tiling.row_block if design == "blocked" else tokens

  def projection(m):
    if design == "blocked":    # one fixed-shape call per block of live rows, each reading the weights
      return _matmul(dev, fmt, tiling, "plain", m, tiling.row_block).times(math.ceil(M / tiling.row_block))
    return _matmul(dev, fmt, tiling, design, m, M)

  inner = "invariant" if design == "blocked" else design
  for lw in w.layers:
    for m in lw.matmuls:
      out.add(projection(m), "projections")
    if design == "blocked":    # the shared expert in the MoE's loop; the routed experts on the kernel if it fits
      for m in shared_matmuls(lw, D):
        out.add(projection(m), "projections")
      kernel = tiling.expert_kernel and row_invariant.grouped_kernel_fits(D, lw.inter, GroupedDotTuning())
      out.add(_experts(dev, fmt, tiling, inner, lw, tokens, D, shared=False) if kernel
              else _looped_experts(dev, fmt, tiling, lw, tokens, D), "experts")
    else:
      out.add(_experts(dev, fmt, tiling, inner, lw, tokens, D), "experts")
    out.add(_attention_layer(dev, fmt, tiling, inner, cfg, lw.plan, rows, pos))
    # norms, biases etc. once per pass; lookups per token; the mHC streams (fp32) read and written per sublayer,
    # by every row of the blocks that hold live rows in the blocked step
    misc = lw.other_bytes + tokens * lw.lookup_row_bytes
    act = stream_rows * 2 * 2 * n * D * 4
    t, _, _ = op_time(dev, fmt.compute, misc + act, 0.0, dev.num_sms)     # elementwise: spread over the machine
    out.add(Tally(weight_bytes=misc, act_bytes=act, time_s=t, mem_bound_s=t), "streams")
  for m in w.top_matmuls:
    out.add(projection(m), "projections")
  return out


@dataclasses.dataclass
class StepCost:
  design: Design
  point: Point
  tally: Tally
  passes: int            # passes through the model (tiles for the tiled step)
  scan_steps: int        # dependent compressor fold steps over the step's passes (latency, not in time_s)

  @property
  def time_s(self) -> float:
    return self.tally.time_s

  @property
  def bound(self) -> str:
    return "HBM" if self.tally.mem_bound_s >= 0.5 * self.tally.time_s else "TC"


def step_cost(cfg: ModelConfig, point: Point, design: Design, dev: DeviceSpec = H200, fmt: Formats = Formats(),
              tiling: Tiling = Tiling(), weights: ModelWeights | None = None) -> StepCost:
  """The roofline cost of one step of `design` at `point`."""
  w = weights or model_weights(cfg, fmt)
  T = tiling.tile_tokens
  total = Tally()
  if point.kind == "decode":
    pos = np.array([point.context])
    if design == "tiled":
      full, rest = divmod(point.batch, T)
      passes = [(T, 1)] * full + ([(rest, 1)] if rest else [])    # (rows, tokens per row)
      for rows, _ in passes:
        total.add(pass_cost(cfg, w, dev, fmt, tiling, design, rows, pos, matmul_rows=T))
    else:
      passes = [(point.batch, 1)]
      total.add(pass_cost(cfg, w, dev, fmt, tiling, design, point.batch, pos))
  else:
    start = point.context - point.batch
    if design == "tiled":
      passes = []
      for o in range(start, point.context, T):
        tile_pos = np.arange(o, min(o + T, point.context))
        passes.append((1, len(tile_pos)))
        total.add(pass_cost(cfg, w, dev, fmt, tiling, design, 1, tile_pos, matmul_rows=T))
    else:
      passes = [(1, point.batch)]
      total.add(pass_cost(cfg, w, dev, fmt, tiling, design, 1, np.arange(start, point.context)))
  # logits once per step at each row's last token (the fixed [rows, D] shape in every design)
  total.add(_matmul(dev, fmt, tiling, "plain" if design in ("tiled", "blocked") else design, w.lm_head,
                    point.logit_rows),
            "lm head")
  scan = sum(fold_chain_steps(cfg, tokens, doubling=design == "plain") for _, tokens in passes)
  return StepCost(design, point, total, len(passes), scan)


# ----------------------------------------------------------------------------------------------------------------
# The GPU check's measured kernel rows (BUILD_NOTES.md, section "GPU check", timing table: one H200, L2 flushed,
# median ms per call), with the layer kind, step and part of this model each one is one layer's op of.

@dataclasses.dataclass(frozen=True)
class MeasuredRow:
  case: str
  layer_kind: str          # the V4-Flash layer kind whose op the kernel is
  point: Point
  part: str                # "attention" or "indexer"
  kv: str                  # pool format
  design: Design           # which design's op the kernel implements
  measured_ms: float


MEASURED_H200 = (
    MeasuredRow("sparse decode CSA bf16 b64, ctx 8k", "csa", Point("decode", 64, 8192), "attention", "bf16", "plain",
                0.0431),
    MeasuredRow("sparse decode CSA FP8 paged b64", "csa", Point("decode", 64, 8192), "attention", "fp8", "plain",
                0.1914),
    MeasuredRow("sparse decode CSA bf16 b128", "csa", Point("decode", 128, 8192), "attention", "bf16", "plain",
                0.0994),
    MeasuredRow("sparse decode CSA FP8 paged b128", "csa", Point("decode", 128, 8192), "attention", "fp8", "plain",
                0.3557),
    MeasuredRow("sparse prefill CSA bf16, 4096 q at 32k", "csa", Point("prefill", 4096, 32768), "attention", "bf16",
                "plain", 2.960),
    MeasuredRow("sparse prefill CSA FP8 paged, 4096 q at 32k", "csa", Point("prefill", 4096, 32768), "attention",
                "fp8", "plain", 10.69),
    MeasuredRow("sparse decode HCA bf16 b64, ctx 128k", "hca", Point("decode", 64, 131072), "attention", "bf16",
                "plain", 0.1065),
    MeasuredRow("sparse decode HCA FP8 paged b64, ctx 128k", "hca", Point("decode", 64, 131072), "attention", "fp8",
                "plain", 0.3010),
    MeasuredRow("invariant HCA decode (fixed position blocks) bf16 b64, ctx 128k", "hca", Point("decode", 64, 131072),
                "attention", "bf16", "invariant_splitk", 0.1959),
    MeasuredRow("invariant HCA decode FP8 paged b64, ctx 128k", "hca", Point("decode", 64, 131072), "attention", "fp8",
                "invariant_splitk", 0.1932),
    MeasuredRow("indexer scores decode bf16 b64, ctx 128k", "csa", Point("decode", 64, 131072), "indexer", "bf16",
                "plain", 0.2422),
)


def layer_op_seconds(cfg: ModelConfig, layer_kind: str, point: Point, part: str, design: Design,
                     dev: DeviceSpec = H200, fmt: Formats = Formats(), tiling: Tiling = Tiling()) -> float:
  """The modelled time of one layer's `part` ("attention" / "indexer") at `point`, for the first layer of
  `layer_kind`: what a measured kernel row compares with."""
  plan = next(p for p in cfg.layer_plan() if p.kind == layer_kind)
  if point.kind == "decode":
    rows, pos = point.batch, np.array([point.context])
  else:
    rows, pos = 1, np.arange(point.context - point.batch, point.context)
  return _attention_layer(dev, fmt, tiling, design, cfg, plan, rows, pos).parts[part]
