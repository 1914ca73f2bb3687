"""The model's cache pytree: paged pools addressed by block tables.

Two cache groups share the block tables of a step (docs/kv_cache.md):

* ``swa`` group, blocks of `CacheLayout.swa_block_tokens` tokens, one row per token:
  - ``window_kv``: post-norm, post-RoPE K=V latent of every layer (the sliding window reads the last W rows);
  - ``comp_state`` / ``index_state``: ONE fp32 running-pool row per block (dsv4/layers/compressor.py) on layers
    that pool (ratio > 1), for the KV compressor and the V4 Lightning indexer's own compressor: the pooled state
    after the last token written into the block. A step reads the row of position start - 1 only, so a tail of
    swa blocks covering the window is an exact resume point (no separate per-request state to save or restore).
  - ``token_ids`` (V4.1 Engram, int32, on the first Engram layer only): the raw token ids, so the n-gram hash of a
    chunk reads the previous max_ngram_size - 1 ids back through the block table like the window.
* ``full`` group, blocks of `CacheLayout.full_block_tokens` tokens (a multiple of every ratio), one row per
  compressed entry: ``comp_kv`` (compressed KV) and ``index_keys``. In V4.1 only the KV-source ("full") layers own
  them; reindex / reuse layers read their source's pools within the same step.

Contiguous use (notebooks, tests) is the same code with an identity block table: `init_contiguous`.
A paged pool (cache/ and the engine) allocates blocks and hands the model block tables.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cache.specs import FULL_HISTORY, SLIDING_WINDOW, CacheSpecs, GroupSpec
from dsv4.config import LayerPlan, ModelConfig
from pallas_kernels import dispatch, word_pool

SWA = "swa"
FULL = "full"
# `CacheLayout.kv_dtype` value selecting the V4 FP8 KV record (pallas_kernels' Fp8KVPool: e4m3 nope channels with
# a UE8M0 scale per 64, bf16 RoPE channels; 584 bytes per 512-wide row). Window and compressed KV use it; index
# keys are kept in bf16 (the cache has no FP8 index-key format; the fused top-k kernel could read `Fp8IndexKeys`).
FP8 = "fp8_v4"
KV_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp8": FP8}


@dataclasses.dataclass(frozen=True)
class CacheLayout:
  """How cache rows are grouped into blocks. Independent of the model weights."""
  swa_block_tokens: int = 32
  full_block_tokens: int = 128
  kv_dtype: Any = jnp.float32     # jnp.float32, jnp.bfloat16 or FP8 (window and compressed KV pools)

  @property
  def index_dtype(self):
    return jnp.bfloat16 if self.kv_dtype == FP8 else self.kv_dtype

  def validate(self, config: ModelConfig) -> None:
    if self.kv_dtype == FP8:
      a = config.attention
      if (a.head_dim - a.rope_head_dim) % 64:
        raise ValueError(f"CacheLayout.kv_dtype: the V4 FP8 record quantizes the non-RoPE channels in blocks of 64; "
                         f"head_dim - rope_head_dim = {a.head_dim - a.rope_head_dim} is not a multiple of 64")
    elif jnp.dtype(self.kv_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
      raise ValueError(f"CacheLayout.kv_dtype: {self.kv_dtype} is not one of float32, bfloat16, {FP8!r}")
    align = config.full_block_alignment
    if self.full_block_tokens % align:
      raise ValueError(f"CacheLayout.full_block_tokens: {self.full_block_tokens} must be a multiple of every "
                       f"compress ratio (lcm = {align})")
    if self.swa_block_tokens <= 0:
      raise ValueError("CacheLayout.swa_block_tokens: must be positive")


@dataclasses.dataclass(frozen=True)
class ArraySpec:
  """One per-layer cache array: its group, the shape of one block (without the block axis) and the logical name of
  each of those dimensions (MaxText style, mapped to mesh axes by `dsv4.sharding`; the block axis is
  "cache_blocks")."""
  layer: int
  name: str
  group: str
  block_shape: tuple[int, ...]
  dtype: Any
  rope_dim: int = 0   # FP8 record only: trailing channels kept in bf16
  block_axes: tuple[str | None, ...] = dataclasses.field(kw_only=True)

  def __post_init__(self):
    if len(self.block_axes) != len(self.block_shape):
      raise ValueError(f"cache array {self.name}: block shape {self.block_shape} but axes {self.block_axes}")

  @property
  def fp8_parts(self) -> tuple[tuple[int, ...], ...]:
    """Block shapes of the FP8 record's (nope e4m3, scale uint8, rope bf16) arrays."""
    rows, D = self.block_shape
    dn = D - self.rope_dim
    cols = 1 << max(0, (dn // 64 - 1).bit_length())
    return (rows, dn), (rows, cols), (rows, self.rope_dim)

  @property
  def bytes_per_block(self) -> int:
    if self.dtype == FP8:
      (r, dn), (_, c), (_, rd) = self.fp8_parts
      return r * (dn + c + 2 * rd)
    return int(np.prod(self.block_shape)) * jnp.dtype(self.dtype).itemsize


def compressor_state_width(width: int, overlap: bool) -> int:
  """Floats in one running-pool state row of a compressor with output width `width`: (lse, mean) of the entry
  being pooled, plus (overlapping CSA) (lse, mean) of the A halves of the open window (the next entry's base)."""
  return (4 if overlap else 2) * width


def layer_array_specs(config: ModelConfig, layout: CacheLayout, plan: LayerPlan) -> list[ArraySpec]:
  a, ix = config.attention, config.indexer
  sb, fb = layout.swa_block_tokens, layout.full_block_tokens
  rd = a.rope_head_dim
  out = [ArraySpec(plan.index, "window_kv", SWA, (sb, a.head_dim), layout.kv_dtype, rd,
                   block_axes=("block_rows", "kv_latent"))]
  # Compressor state: ONE fp32 row per swa block (the running pool after the last token written into that block),
  # not one row per token: a step reads the row of position start - 1 only, so a decode step is O(1) rows of work
  # and a checkpoint carries one state row per pooling layer per block.
  if plan.has_compressor and plan.ratio > 1:
    out.append(ArraySpec(plan.index, "comp_state", SWA, (1, compressor_state_width(a.head_dim, plan.overlap)),
                         jnp.float32, block_axes=("block_rows", "comp_proj")))
  if plan.kind == "csa":  # V4 indexer has its own compressor
    out.append(ArraySpec(plan.index, "index_state", SWA, (1, compressor_state_width(ix.head_dim, plan.overlap)),
                         jnp.float32, block_axes=("block_rows", "comp_proj")))
  if config.engram.layer_ids and plan.index == config.engram.layer_ids[0]:
    # V4.1 Engram hashes the previous max_ngram_size - 1 token ids: kept as SWA-group rows (one copy, on the first
    # Engram layer), read back through the block table like the window.
    out.append(ArraySpec(plan.index, "token_ids", SWA, (sb,), jnp.int32, block_axes=("block_rows",)))
  if plan.has_compressor:
    out.append(ArraySpec(plan.index, "comp_kv", FULL, (fb // plan.ratio, a.head_dim), layout.kv_dtype, rd,
                         block_axes=("block_rows", "kv_latent")))
  if plan.has_index_keys:
    out.append(ArraySpec(plan.index, "index_keys", FULL, (fb // plan.ratio, ix.head_dim), layout.index_dtype,
                         block_axes=("block_rows", "index_dim")))
  return out


def cache_array_specs(config: ModelConfig, layout: CacheLayout) -> list[ArraySpec]:
  layout.validate(config)
  return [s for p in config.cache_plans() for s in layer_array_specs(config, layout, p)]


def state_tail_tokens(config: ModelConfig) -> int:
  """Tokens before a resume point whose SWA-group rows the next step reads: the window (W - 1 rows), Engram's
  previous ids, and the compressor state row of the block holding position start - 1 (1 token)."""
  need = config.attention.window - 1
  if config.engram.layer_ids:
    need = max(need, config.engram.max_ngram_size - 1)
  if any(p.has_compressor and p.ratio > 1 for p in config.layer_plan()):
    need = max(need, 1)
  return need


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelCache:
  """Per layer a dict of paged arrays [num_blocks, *block_shape]. Goes in and comes out of the step."""
  layers: tuple[dict[str, jax.Array], ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BatchIndex:
  """Where each sequence of a step stands and which blocks back it.

  start_pos_B: position of the first token of this step's chunk; num_tokens_B: valid tokens in the chunk (the
  rest of the T axis is padding, never written). Block tables list block ids (-1 = none) per sequence.
  """
  start_pos_B: jax.Array
  num_tokens_B: jax.Array
  swa_table_BxS: jax.Array
  full_table_BxF: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepIndex:
  """A ragged step: every row's tokens packed on one flat axis N (prefill chunks and decode tokens together).

  token_row_N:      int32 [N] row (sequence slot, 0..R-1) of each flat token; -1 = padding (never written, its
                    output is garbage to be ignored). A row's tokens are CONTIGUOUS on the flat axis and in
                    increasing position order (row_start, row_start + 1, ...); padding may sit anywhere.
  token_pos_N:      int32 [N] absolute position of each flat token (= row_start[row] + its offset in the row).
  row_start_R:      int32 [R] first position computed this step (= tokens already in the cache for that row).
  row_num_tokens_R: int32 [R] tokens of this row in the step; 0 = idle row.
  tables:           per cache group name ("swa", "full"): int32 [R, S_g] block ids, -1 = none. S_g is whatever
                    the caller buckets (the live length of the batch, not max_model_len): attention, indexer and
                    compressed-id lists are sized by S_full * (full_block_tokens / ratio) entries. A table must
                    cover every block the row's step touches (window rows back to start - window + 1, and the
                    block of start - 1 whose compressor state row is read).
  swa_base_R:       int32 [R] or None (= 0): the swa block index that column 0 of the "swa" table holds. A serving
                    step passes only the blocks its rows can touch, from block (start - state_tail_tokens) //
                    swa_block_tokens on, so that table's width follows the window + chunk, not the context.

  full_row_R:       int32 [R] or None: see the field.

  Shapes are static per compile: N (the engine's token budget), R and each S_g. `make_step_index` builds one on
  the host.
  """
  token_row_N: jax.Array
  token_pos_N: jax.Array
  row_start_R: jax.Array
  row_num_tokens_R: jax.Array
  tables: dict[str, jax.Array]
  swa_base_R: jax.Array | None = None
  # int32 [R] or None (= row r itself): the row of tables["full"] that holds row r's full table. The invariant step
  # passes the engine's device table [slots, W] with each row's slot here, so no per-row copy of a table spanning
  # max_model_len is made: a table lookup reads only the blocks it needs.
  full_row_R: jax.Array | None = None
  # int32 scalar or None (= all N): the count of leading flat tokens that may be real (the engine packs every row's
  # tokens first); the row-invariant ops loop over the row blocks holding them only (dsv4/layers/row_invariant.py).
  live_tokens: jax.Array | None = None
  # The engine's invariant step: compressor pools fold in position order (`compressor.window_pool_scan`) and dense
  # compressed attention runs over fixed entry blocks, so neither a chunk boundary nor the table width changes a
  # token's bits.
  invariant: bool = dataclasses.field(default=False, metadata=dict(static=True))


def bucket(n: int, minimum: int = 1) -> int:
  """Next power of two >= max(n, minimum): the few static sizes a serving step compiles for."""
  n = max(int(n), int(minimum), 1)
  return 1 << (n - 1).bit_length()


def make_step_index(rows, num_rows: int, *, num_tokens: int | None = None,
                    min_tokens: int = 8, table_widths: dict[str, int] | None = None,
                    min_table_blocks: int = 1) -> tuple[np.ndarray, StepIndex]:
  """Host helper: pack rows into a StepIndex of numpy arrays.

  rows: list (length <= num_rows; row r = slot r) of None (idle) or (token ids to compute, start position,
  {group: block-id list}). Returns (tokens_N int32, StepIndex). N = num_tokens or bucket(total, min_tokens);
  table widths = table_widths or bucket(longest table) per group (at least min_table_blocks).
  """
  assert len(rows) <= num_rows
  live = [(r, x) for r, x in enumerate(rows) if x is not None]
  total = sum(len(x[0]) for _, x in live)
  N = num_tokens if num_tokens is not None else bucket(total, min_tokens)
  if total > N:
    raise ValueError(f"make_step_index: {total} tokens do not fit the flat axis of {N}")
  groups = sorted({g for _, x in live for g in x[2]} | set(table_widths or {}))
  widths = dict(table_widths or {})
  for g in groups:
    if g not in widths:
      widths[g] = bucket(max([len(x[2].get(g, ())) for _, x in live] + [1]), min_table_blocks)
  tokens = np.zeros(N, np.int32)
  row_N = np.full(N, -1, np.int32)
  pos_N = np.zeros(N, np.int32)
  start = np.zeros(num_rows, np.int32)
  num = np.zeros(num_rows, np.int32)
  tables = {g: np.full((num_rows, widths[g]), -1, np.int32) for g in groups}
  o = 0
  for r, (toks, pos, tabs) in live:
    n = len(toks)
    tokens[o:o + n] = toks
    row_N[o:o + n] = r
    pos_N[o:o + n] = pos + np.arange(n)
    start[r], num[r] = pos, n
    for g, t in tabs.items():
      if len(t) > widths[g]:
        raise ValueError(f"make_step_index: row {r} group {g!r} table of {len(t)} blocks exceeds width {widths[g]}")
      tables[g][r, :len(t)] = t
    o += n
  return tokens, StepIndex(row_N, pos_N, start, num, tables)


def step_index_from_batch(index: "BatchIndex", T: int) -> StepIndex:
  """The [B, T] padded layout as a ragged step (in jit): flat token b*T + t is row b's token t; t >= num is pad."""
  B = index.start_pos_B.shape[0]
  start = index.start_pos_B.astype(jnp.int32)
  num = index.num_tokens_B.astype(jnp.int32)
  t = jnp.arange(T, dtype=jnp.int32)[None, :]
  row = jnp.where(t < num[:, None], jnp.arange(B, dtype=jnp.int32)[:, None], -1).reshape(-1)
  pos = (start[:, None] + t).reshape(-1)
  return StepIndex(row, pos, start, num, {SWA: index.swa_table_BxS.astype(jnp.int32),
                                          FULL: index.full_table_BxF.astype(jnp.int32)})


def init_cache(config: ModelConfig, layout: CacheLayout, num_swa_blocks: int, num_full_blocks: int) -> ModelCache:
  layers = [dict() for _ in config.cache_plans()]
  for s in cache_array_specs(config, layout):
    n = num_swa_blocks if s.group == SWA else num_full_blocks
    if s.dtype == FP8:
      nope, scale, rope = s.fp8_parts
      layers[s.layer][s.name] = dispatch.Fp8KVPool(jnp.zeros((n, *nope), stored_dtype(jnp.float8_e4m3fn)),
                                                   jnp.zeros((n, *scale), jnp.uint8),
                                                   jnp.zeros((n, *rope), stored_dtype(jnp.bfloat16)))
    else:
      layers[s.layer][s.name] = jnp.zeros((n, *s.block_shape), stored_dtype(s.dtype))
  return ModelCache(tuple(layers))


def init_cache_on_device(config: ModelConfig, layout: CacheLayout, num_swa_blocks: int,
                         num_full_blocks: int) -> ModelCache:
  """`init_cache` without compiling anything: each array's zeros built on the host (numpy's zeros are lazily mapped
  pages) and put in one transfer. Eager `jnp.zeros` compiles one small program per distinct array shape, a dozen
  before an engine's first step."""
  shapes = jax.eval_shape(lambda: init_cache(config, layout, num_swa_blocks, num_full_blocks))
  return jax.device_put(jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype), shapes))


def blocks_for(tokens: int, block_tokens: int) -> int:
  return max(1, math.ceil(tokens / block_tokens))


def contiguous_tables(batch: int, max_len: int, layout: CacheLayout) -> tuple[np.ndarray, np.ndarray]:
  """Identity block tables: sequence b owns blocks [b*n, (b+1)*n)."""
  ns, nf = blocks_for(max_len, layout.swa_block_tokens), blocks_for(max_len, layout.full_block_tokens)
  swa = np.arange(batch * ns, dtype=np.int32).reshape(batch, ns)
  full = np.arange(batch * nf, dtype=np.int32).reshape(batch, nf)
  return swa, full


def init_contiguous(config: ModelConfig, batch: int, max_len: int,
                    layout: CacheLayout = CacheLayout()) -> tuple[ModelCache, np.ndarray, np.ndarray]:
  """A cache for `batch` sequences of up to `max_len` tokens, plus its identity block tables."""
  swa, full = contiguous_tables(batch, max_len, layout)
  return init_cache(config, layout, swa.size, full.size), swa, full


def whole_sequences(config: ModelConfig, batch: int, length: int):
  """(contiguous cache, ragged StepIndex) for `batch` whole sequences of `length` tokens each, computed from position
  0 in one step: training, reference and acceptance runs over whole sequences (no cache reuse)."""
  cache, swa, full = init_contiguous(config, batch, length)
  idx = BatchIndex(jnp.zeros(batch, jnp.int32), jnp.full((batch,), length, jnp.int32), jnp.asarray(swa),
                   jnp.asarray(full))
  return cache, step_index_from_batch(idx, length)


# ----------------------------------------------------------------------------------------------------------
# How a step addresses the pools. A "slot" is a flat row index into a pool reshaped to [num_blocks * rows, ...];
# -1 means "no row" (padding, negative position, unallocated block). Writes to -1 are dropped; reads of -1 are
# masked by the caller.

def slots_for(table_BxS, index_BxT, rows_per_block: int, valid_BxT):
  """Flat pool rows for row `index` (token position or entry id) of each sequence, via its block table."""
  S = table_BxS.shape[1]
  blk = index_BxT // rows_per_block
  in_table = (index_BxT >= 0) & (blk < S)
  block_id = jnp.take_along_axis(table_BxS, jnp.clip(blk, 0, S - 1), axis=1)
  ok = valid_BxT & in_table & (block_id >= 0)
  return jnp.where(ok, block_id * rows_per_block + index_BxT % rows_per_block, -1).astype(jnp.int32)


def row_slots(table_RxS, row_N_, index_N_, rows_per_block: int, valid_N_, base_R=None):
  """Like `slots_for` but for flat tokens: `row` (broadcast against `index`) picks each one's block table.
  base_R: per row, the block index that table column 0 holds (None = 0); blocks before it are outside the table."""
  S = table_RxS.shape[1]
  shape = jnp.broadcast_shapes(jnp.shape(row_N_), jnp.shape(index_N_), jnp.shape(valid_N_))
  index_N_ = jnp.broadcast_to(index_N_, shape)
  row = jnp.broadcast_to(row_N_, shape)
  if base_R is not None:
    index_N_ = index_N_ - base_R[jnp.maximum(row, 0)] * rows_per_block
  blk = index_N_ // rows_per_block
  in_table = (index_N_ >= 0) & (blk < S) & (row >= 0)
  block_id = table_RxS[jnp.maximum(row, 0), jnp.clip(blk, 0, S - 1)]
  ok = valid_N_ & in_table & (block_id >= 0)
  return jnp.where(ok, block_id * rows_per_block + index_N_ % rows_per_block, -1).astype(jnp.int32)


UINT_OF_SIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}   # itemsize -> same-width unsigned


def as_bits(a):
  """A float array as same-width unsigned integers (a bitcast); other arrays as they are."""
  if jnp.issubdtype(a.dtype, jnp.floating):
    return jax.lax.bitcast_convert_type(a, UINT_OF_SIZE[a.dtype.itemsize])
  return a


def from_bits(b, dtype):
  """`as_bits` undone."""
  return b if b.dtype == dtype else jax.lax.bitcast_convert_type(b, dtype)


def updates_through_bits(dtype) -> bool:
  """Whether an in-place update of a `dtype` array goes through its bit pattern: XLA's CPU updates a slice of a
  float array narrower than 32 bits through fp32 over the WHOLE array (work that follows the array's size, not the
  rows written), while an unsigned word array is updated in place; GPUs update narrow floats in place, where the
  bitcasts would only add passes over the array."""
  dtype = jnp.dtype(dtype)
  return jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4 and jax.default_backend() == "cpu"


def stored_dtype(dtype):
  """The dtype a cache array of float `dtype` is held in: its unsigned words where in-place updates of it go
  through its bits (`updates_through_bits`: narrow floats on the CPU), so that a write updates the words in place
  and a read converts only the rows it takes (`pool_view`); else `dtype` itself."""
  return UINT_OF_SIZE[jnp.dtype(dtype).itemsize] if updates_through_bits(dtype) else dtype


# What a plain pool held as words stands for: bf16 is the one 16-bit float the caches hold (KV and index keys).
# An FP8 pool's parts say theirs by position (nope e4m3, rope bf16).
_WORD_FLOATS = {jnp.dtype(jnp.uint16): jnp.dtype(jnp.bfloat16)}


def _words_as(a, dtype):
  """`a` as a `WordPool` of `dtype` where it holds `dtype`'s words; else as it is."""
  if isinstance(a, dispatch.WordPool) or a.dtype == dtype:
    return a
  if jnp.issubdtype(a.dtype, jnp.unsignedinteger) and a.dtype.itemsize == jnp.dtype(dtype).itemsize:
    return dispatch.WordPool(a, dtype)
  return a


def pool_view(pool):
  """A cache pool as the ops read it (`pallas_kernels.word_pool`): a pool held as words (`stored_dtype`) as a
  `WordPool` of its floats, an FP8 pool's parts likewise; any other pool as it is. No pass over the pool: a read
  converts the rows it takes."""
  if isinstance(pool, dispatch.Fp8KVPool):
    return dispatch.Fp8KVPool(_words_as(pool.nope, jnp.float8_e4m3fn), pool.scale,
                              _words_as(pool.rope, jnp.bfloat16))
  if isinstance(pool, dispatch.WordPool):
    return pool
  return _words_as(pool, _WORD_FLOATS.get(jnp.dtype(pool.dtype), pool.dtype))


def stored_rows(pool_NBxRx_, rows_Nx_):
  """Rows [N, ...] as `pool` stores them: cast to its float dtype, or for an FP8 pool quantized to its records (per
  row scales, so a row's bytes never depend on other rows). Row-local: the loop that makes the rows calls it on its
  row blocks, so the conversion follows the live tokens, not the token budget (`write_rows` takes the result)."""
  if isinstance(pool_NBxRx_, dispatch.Fp8KVPool):
    D = rows_Nx_.shape[-1]
    return dispatch.quantize_kv_fp8(rows_Nx_.reshape(-1, D).astype(jnp.float32), pool_NBxRx_.rope.shape[-1])
  return rows_Nx_.astype(pool_view(pool_NBxRx_).dtype)


def write_rows(pool_NBxRx_, slots_BxT, rows_BxTx_):
  """Scatter rows into a paged pool; slots of -1 are dropped (mapped out of bounds). Rows not yet as the pool
  stores them are converted here (`stored_rows`), over every row given. A pool held as words takes the rows' bits,
  in place."""
  if isinstance(pool_NBxRx_, dispatch.Fp8KVPool):
    q = rows_BxTx_ if isinstance(rows_BxTx_, dispatch.Fp8KVPool) else stored_rows(pool_NBxRx_, rows_BxTx_)
    return dispatch.Fp8KVPool(*(write_rows(p, slots_BxT, r) for p, r in zip(pool_NBxRx_, q)))
  nb, r = pool_NBxRx_.shape[:2]
  flat = pool_NBxRx_.reshape(nb * r, *pool_NBxRx_.shape[2:])
  idx = jnp.where(slots_BxT >= 0, slots_BxT, nb * r).reshape(-1)
  rows = rows_BxTx_.reshape(-1, *pool_NBxRx_.shape[2:])
  if jnp.issubdtype(flat.dtype, jnp.unsignedinteger) and jnp.issubdtype(rows.dtype, jnp.floating):
    if rows.dtype.itemsize != flat.dtype.itemsize:
      rows = rows.astype(_WORD_FLOATS[jnp.dtype(flat.dtype)])
    flat = flat.at[idx].set(as_bits(rows), mode="drop")
  elif updates_through_bits(flat.dtype):
    flat = from_bits(as_bits(flat).at[idx].set(as_bits(rows.astype(flat.dtype)), mode="drop"), flat.dtype)
  else:
    flat = flat.at[idx].set(rows.astype(flat.dtype), mode="drop")
  return flat.reshape(pool_NBxRx_.shape)


def read_rows(pool_NBxRx_, slots_BxT):
  nb, r = pool_NBxRx_.shape[:2]
  flat = pool_view(pool_NBxRx_).reshape(nb * r, *pool_NBxRx_.shape[2:])
  return word_pool.take(flat, jnp.clip(slots_BxT, 0, nb * r - 1)), slots_BxT >= 0


def _rows_flat(a):
  return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def flat_pool(pool_NBxRx_):
  """A paged pool as [blocks x rows, ...] rows, as the ops read it (`pool_view`)."""
  if isinstance(pool_NBxRx_, dispatch.Fp8KVPool):
    return pool_view(dispatch.Fp8KVPool(*(_rows_flat(p) for p in pool_NBxRx_)))
  return pool_view(_rows_flat(pool_NBxRx_))


def gather_flat(flat_PxD, rows_N_):
  """Rows of a flat pool (dequantized to fp32 for an FP8 pool); rows < 0 read row 0 (mask them)."""
  if isinstance(flat_PxD, dispatch.Fp8KVPool):
    return dispatch.dequantize_kv_fp8(dispatch.Fp8KVPool(*(gather_flat(p, rows_N_) for p in pool_view(flat_PxD))))
  return word_pool.take(pool_view(flat_PxD), jnp.clip(rows_N_, 0, flat_PxD.shape[0] - 1))

# ---------------------------------------------------------------------------------------------------------------
# Group specs for the block allocator (cache/ works from these plain specs and never imports the model).

def _layout_fingerprint(config: ModelConfig, layout: CacheLayout, arrays: list[ArraySpec]) -> str:
  # Blocks are only interchangeable between engines whose arrays mean the same thing: hash the config and the
  # exact array shapes (not the weights; a different checkpoint must use a different `model` extra key).
  h = hashlib.blake2b(digest_size=8)
  h.update(repr(config).encode())
  h.update(repr((layout.swa_block_tokens, layout.full_block_tokens, str(layout.kv_dtype))).encode())
  h.update(repr([(a.layer, a.name, a.group, a.block_shape, str(a.dtype)) for a in arrays]).encode())
  return h.hexdigest()


@functools.cache
def group_specs(config: ModelConfig, layout: CacheLayout = CacheLayout()) -> CacheSpecs:
  """The model's paged groups as plain `cache.specs.CacheSpecs`: "full" (full history: compressed KV, indexer
  keys) and "swa" (sliding window: window rows + one compressor-state row per block; resume tail = state_tail_tokens)."""
  arrays = cache_array_specs(config, layout)
  full = [a for a in arrays if a.group == FULL]
  swa = [a for a in arrays if a.group == SWA]
  groups = []
  if full:  # a window-only model has no full-history group
    groups.append(GroupSpec(FULL, FULL_HISTORY, layout.full_block_tokens, sum(a.bytes_per_block for a in full), 0,
                            note=",".join(sorted({a.name for a in full}))))
  groups.append(GroupSpec(SWA, SLIDING_WINDOW, layout.swa_block_tokens, sum(a.bytes_per_block for a in swa),
                          state_tail_tokens(config), note=",".join(sorted({a.name for a in swa}))))
  return CacheSpecs(tuple(groups), _layout_fingerprint(config, layout, arrays))
