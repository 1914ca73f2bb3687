"""KV compressors: V4 CSA (ratio m, overlapping windows of 2m, stride m, position bias), V4 HCA (ratio m,
non-overlapping), V4.1 CSA2 ratio 2 (gated pooling, no bias) and ratio 1 (projection only). See docs/model.md,
Compressors.

Incremental (running-pool) form, one path for full prefill, chunked prefill and decode on a ragged step:
softmax-gated pooling per channel, sum_j softmax(z)_j a_j over a window, is kept as a running pair
(lse = logsumexp(z_j), mean = sum_j exp(z_j - lse) a_j) that merges associatively. Within a step the pairs of
each row's tokens are combined by a segmented associative scan (segments restart at every window start and at
every row's first token, which instead merges in the state row read from the cache); a token that closes a window
emits entry n = pos // m from its running pair. Overlapping CSA keeps two pairs: the entry being pooled (A halves of
the previous window + B halves of this one so far) and the A halves of the open window (the next entry's base).

The cache holds ONE state row per swa block: the running pairs after the last token written into that block.
A step reads the row of position start - 1 only: an HCA decode step does O(1) rows of work, and a resume point
needs one state row per pooling layer (none at a window boundary for non-overlapping compressors).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from dsv4 import caches
from dsv4.layers.norms import rms_norm
from dsv4.layers.row_invariant import RowFn, map_row_blocks, updated_in_place
from dsv4.layers.rope import apply_rope

_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class CompressorSpec:
  ratio: int
  width: int           # output width w (head_dim for KV, index head_dim for index keys)
  overlap: bool        # V4 CSA: width 2m windows, stride m (projections are 2w wide: A | B halves)
  gated: bool          # softmax-gated pooling (False only for V4.1 ratio 1)
  position_bias: bool  # V4 `ape`


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepContext:
  """Per-step addressing shared by all layers, for the flat token axis N of a ragged step."""
  row_N: jax.Array          # row of each token (clipped to >= 0; see valid_N)
  valid_N: jax.Array        # False for padding tokens
  pos_N: jax.Array
  first_N: jax.Array        # first token of its row in this step
  last_N: jax.Array         # last token of its row in this step
  swa_table_RxS: jax.Array
  full_table_RxF: jax.Array  # rows: full_row_N (the invariant step: the engine's device table [slots, W])
  full_row_N: jax.Array     # row of full_table_RxF holding each token's full table
  swa_base_R: jax.Array     # swa block index of swa table column 0, per row (StepIndex.swa_base_R)
  swa_block_tokens: int = dataclasses.field(metadata=dict(static=True))
  full_block_tokens: int = dataclasses.field(metadata=dict(static=True))
  # Speculative verification: the compressors also hand out every token's running-pool state row (layer aux
  # "comp_state_rows" / "index_state_rows"), so the step can store the state at the last ACCEPTED position of a
  # row once verification has decided it (the row written here is the state after the row's last, maybe
  # rejected, token).
  tap_state: bool = dataclasses.field(default=False, metadata=dict(static=True))
  # The engine's invariant step (caches.StepIndex.invariant): running pools fold in position order within each
  # window (`window_pool_scan`), so an entry's bits do not depend on where a chunk boundary fell, and dense
  # compressed attention reads fixed entry blocks (hca_attention.hca_attention_reference).
  invariant: bool = dataclasses.field(default=False, metadata=dict(static=True))
  # int32 scalar or None: leading flat tokens that may be real (caches.StepIndex.live_tokens); per-token loops stop
  # there.
  live: jax.Array | None = None

  @staticmethod
  def from_step(step: "caches.StepIndex", layout: "caches.CacheLayout", tap_state: bool = False,
                invariant: bool = False) -> "StepContext":
    row = step.token_row_N.astype(jnp.int32)
    valid = row >= 0
    r = jnp.maximum(row, 0)
    pos = jnp.where(valid, step.token_pos_N.astype(jnp.int32), 0)
    start = step.row_start_R.astype(jnp.int32)[r]
    end = start + step.row_num_tokens_R.astype(jnp.int32)[r]
    R = step.row_start_R.shape[0]
    swa = step.tables[caches.SWA].astype(jnp.int32)
    full = step.tables.get(caches.FULL)
    full = jnp.full((R, 1), -1, jnp.int32) if full is None else full.astype(jnp.int32)
    base = (jnp.zeros((R,), jnp.int32) if step.swa_base_R is None else step.swa_base_R.astype(jnp.int32))
    full_row = r if step.full_row_R is None else jnp.maximum(step.full_row_R.astype(jnp.int32), 0)[r]
    return StepContext(row_N=r, valid_N=valid, pos_N=pos, first_N=valid & (pos == start),
                       last_N=valid & (pos == end - 1), swa_table_RxS=swa, full_table_RxF=full, full_row_N=full_row,
                       swa_base_R=base,
                       swa_block_tokens=layout.swa_block_tokens, full_block_tokens=layout.full_block_tokens,
                       tap_state=tap_state, invariant=invariant, live=step.live_tokens)

  def swa_slots(self, row_N_, pos_N_, valid_N_):
    """SWA-group pool row of each (row, position); -1 where invalid or outside the step's swa table."""
    return caches.row_slots(self.swa_table_RxS, row_N_, pos_N_, self.swa_block_tokens, valid_N_, self.swa_base_R)

  def token_slots(self):
    return self.swa_slots(self.row_N, self.pos_N, self.valid_N)

  def state_slots(self, pos_N, ok_N):
    """Compressor-state pool row (one per swa block) of the block holding position pos."""
    return caches.row_slots(self.swa_table_RxS, self.row_N, pos_N // self.swa_block_tokens, 1, ok_N,
                            self.swa_base_R)


def project(p, x_NxD, spec: CompressorSpec, pos_N):
  """Raw per-token projections: a (kv) and z (score, with the position bias), fp32."""
  a = jnp.dot(x_NxD.astype(jnp.float32), p["wkv"].astype(jnp.float32), precision=_HI)
  if not spec.gated:
    return a, None
  z = jnp.dot(x_NxD.astype(jnp.float32), p["wgate"].astype(jnp.float32), precision=_HI)
  if spec.position_bias:
    z = z + p["ape"].astype(jnp.float32)[pos_N % spec.ratio]
  return a, z


def merge(l1, m1, l2, m2):
  """Combine two running pools (lse, mean) over disjoint token sets. Finite inputs only (no -inf: an empty pool
  is never merged, it is selected around), so the gradient stays finite too."""
  lse = jnp.maximum(l1, l2) + jnp.log1p(jnp.exp(-jnp.abs(l1 - l2)))
  return lse, m1 * jnp.exp(l1 - lse) + m2 * jnp.exp(l2 - lse)


def segmented_pool_scan(reset_N, lse_NxW, mean_NxW, max_segment: int):
  """Inclusive running pool along the flat axis; restarts at every token with reset set.

  A segment never spans more than `max_segment` tokens (one pooling window: every window start resets), so
  ceil(log2(max_segment)) doubling steps finish it (a segmented Hillis-Steele scan). The compiled program grows with
  log(window), not with log(N) as a general `associative_scan` over the flat axis does; that scan's strided
  up/down sweeps were most of the step's HLO and of its XLA compile time."""
  n, w = lse_NxW.shape
  done, lse, mean = reset_N, lse_NxW, mean_NxW
  d = 1
  while d < min(max_segment, n):
    # the pool d tokens back; the first d tokens see a reset (token 0 always starts a segment, so they never merge)
    prev_done = jnp.concatenate([jnp.ones((d,), bool), done[:-d]])
    prev_l = jnp.concatenate([jnp.zeros((d, w), lse.dtype), lse[:-d]])
    prev_m = jnp.concatenate([jnp.zeros((d, w), mean.dtype), mean[:-d]])
    ml, mm = merge(prev_l, prev_m, lse, mean)
    open_ = ~done[:, None]
    lse, mean = jnp.where(open_, ml, lse), jnp.where(open_, mm, mean)
    done = done | prev_done
    d *= 2
  return lse, mean


def window_pool_scan(reset_N, lse_NxW, mean_NxW):
  """`segmented_pool_scan` as a left fold in position order within each segment: pool_t = merge(pool_{t-1}, token
  t), restarting where reset is set, so every token's pool is the same chain of merges (same arguments, same order)
  however its row was split into chunks or tiles and whatever shares the step: a chunk boundary does exactly this
  too (a row's first token merges the stored fp32 state of position start - 1 into its own pair, in the same
  argument order). The doubling scan's merge tree instead depends on the token's offset from its segment start,
  which a split moves.

  A segment never spans more than one pooling window (every window start resets), so the segments run in parallel:
  step j merges every token that sits j places after its segment start with its predecessor's finished pool. The
  chain is as long as the step's longest segment (at most ratio - 1 steps: 0 for a decode step, 3 for CSA, 127 for
  HCA's full windows), not as long as the step's token axis; each step is O(N x width) elementwise work."""
  n = reset_N.shape[0]
  idx_N = jnp.arange(n, dtype=jnp.int32)
  start_N = jax.lax.cummax(jnp.where(reset_N | (idx_N == 0), idx_N, 0))
  offset_N = idx_N - start_N            # places after the segment's first token

  def step(carry):
    j, lse, mean = carry
    # a token still holds its own pair until its step (j = its offset), so the carry is both operands: the loop
    # reads no copy of its inputs
    ml, mm = merge(jnp.roll(lse, 1, axis=0), jnp.roll(mean, 1, axis=0), lse, mean)
    now = (offset_N == j)[:, None]      # the predecessor (offset j - 1) finished at the previous step
    return j + 1, jnp.where(now, ml, lse), jnp.where(now, mm, mean)

  last = jnp.max(offset_N)
  _, lse, mean = jax.lax.while_loop(lambda c: c[0] <= last, step, (jnp.int32(1), lse_NxW, mean_NxW))
  return updated_in_place(lse_NxW, lse), updated_in_place(mean_NxW, mean)


def _emit(ctx: StepContext, entry_N, emitted_N, ratio: int):
  return caches.row_slots(ctx.full_table_RxF, ctx.full_row_N, entry_N, ctx.full_block_tokens // ratio, emitted_N)


def _entry_rows(p, out_pool, spec: CompressorSpec, inv_freq, eps: float, quantize_rows):
  """finish(raw pooled rows, entry ids) -> (normed latent, the entry's rows as the pool stores them): RoPE'd at the
  entry's first position, per token (row-local)."""
  q_rows = quantize_rows or (lambda r: r)

  def finish(raw, entry):
    latent = rms_norm(raw, p["norm"], eps)
    return latent, caches.stored_rows(out_pool, q_rows(apply_rope(latent, entry * spec.ratio, inv_freq)))
  return finish


def _step_masks(spec: CompressorSpec, ctx: StepContext):
  pos = ctx.pos_N
  win_start = pos % spec.ratio == 0
  # The state row of position start - 1 (first token of each row only; a window start needs no "cur" state).
  prev_slots = ctx.state_slots(pos - 1, ctx.first_N & (pos > 0))
  mid = ctx.first_N & ~win_start                  # a row's first token inside a window: merges the cached pools
  has_base = win_start & (pos > 0)                # a window start of overlapping CSA: pools from the previous one
  return win_start, prev_slots, mid, has_base


def opening_rows(p, spec: CompressorSpec, ctx: StepContext, state_pool, out_pool, inv_freq, eps: float,
                 quantize_rows=None) -> RowFn:
  """A compressor's per-token work before its fold across a window's tokens, as rows of the layer's input
  (`row_invariant.RowFn`: fn(x_block, *arg blocks)), so the attention runs it in its projection loop and hands the
  outputs to `compress_step` (`opened`). Ratio 1: each token's finished entry (latent, stored rows); pooling: the
  token's projections merged with the cached state row where it is its row's first token."""
  m, w = spec.ratio, spec.width
  pos = ctx.pos_N
  if not spec.gated or m == 1:
    finish = _entry_rows(p, out_pool, spec, inv_freq, eps, quantize_rows)
    return RowFn(lambda x, pos: finish(project(p, x, spec, pos)[0], pos), (pos,))
  _, prev_slots, mid, has_base = _step_masks(spec, ctx)

  def opening(x, pos, slot, first, mid, has_base):
    """A token's projections and the pairs its pools start from (merged with the cached state row where it is its
    row's first token)."""
    a, z = project(p, x, spec, pos)
    prev, ok = caches.read_rows(state_pool, slot)
    prev = jnp.where(ok[:, None], prev, 0.0)
    mid = mid[:, None]
    if not spec.overlap:
      cl0, cm0 = merge(prev[:, :w], prev[:, w:], z, a)
      return jnp.where(mid, cl0, z), jnp.where(mid, cm0, a)
    aA, aB, zA, zB = a[:, :w], a[:, w:], z[:, :w], z[:, w:]
    p_cl, p_cm, p_nl, p_nm = (prev[:, i * w:(i + 1) * w] for i in range(4))
    # Next-entry pool: A halves of the open window.
    l0, m0 = merge(p_nl, p_nm, zA, aA)
    # Current-entry pool: at a window start it begins from the previous window's A halves (for a row's first token
    # the cached next-entry pool; for the others the previous token's, `middle`); entry 0 has no previous window.
    sl, sm = merge(p_nl, p_nm, zB, aB)
    cl0, cm0 = merge(p_cl, p_cm, zB, aB)
    from_cache = (first & has_base)[:, None]
    return (jnp.where(mid, l0, zA), jnp.where(mid, m0, aA), zB, aB,
            jnp.where(from_cache, sl, jnp.where(mid, cl0, zB)), jnp.where(from_cache, sm, jnp.where(mid, cm0, aB)))
  return RowFn(opening, (pos, prev_slots, ctx.first_N, mid, has_base))


class CompressorCall(NamedTuple):
  """One compressor of a layer in a step: its params, spec, state pool (None at ratio 1), out pool, the quantizer of
  its stored rows (None = as they are) and the key its state rows are tapped under."""
  p: dict
  spec: CompressorSpec
  state_pool: Any
  out_pool: Any
  quantize_rows: Callable | None = None
  tap_key: str = ""


def pool_alike(calls) -> bool:
  """Whether compressors fold the same windows (pooling, one ratio and overlap): their pools then run side by side
  in one fold (`compress_steps`)."""
  return all(c.spec.gated and c.spec.ratio > 1 and (c.spec.ratio, c.spec.overlap) ==
             (calls[0].spec.ratio, calls[0].spec.overlap) for c in calls)


def joint_opening_rows(calls, ctx: StepContext, inv_freq, eps: float) -> RowFn:
  """`opening_rows` of several compressors (one alone, or several that `pool_alike`), as rows of the same input:
  each output is theirs side by side on the channel axis, in the order of `calls`."""
  rows = [opening_rows(c.p, c.spec, ctx, c.state_pool, c.out_pool, inv_freq, eps, c.quantize_rows) for c in calls]
  if len(rows) == 1:
    return rows[0]
  if not pool_alike(calls):
    raise ValueError(f"joint_opening_rows: compressors that fold different windows: {[c.spec for c in calls]}")

  # compressors that pool alike read the same per-token arguments (positions, the state slot, the window masks)
  def opening(x, *args):
    outs = [r.fn(x, *args) for r in rows]
    return tuple(jnp.concatenate(parts, axis=-1) for parts in zip(*outs))
  return RowFn(opening, rows[0].args)


def compress_step(p, x_NxD, spec: CompressorSpec, ctx: StepContext, state_pool, out_pool, inv_freq, eps: float,
                  return_latent: bool = False, quantize_rows=None, taps: dict | None = None, tap_key: str = "",
                  opened=None):
  """Runs one ragged step through a compressor. Returns (new state pool or None, new out pool), plus, with
  `return_latent`, (pre-RoPE latent [N,w], entry ids [N], full-group slots [N] (-1: not emitted)) of the entry each
  token would close: V4.1 derives its index keys from that latent (docs/model.md, Lightning indexer).
  `quantize_rows` (V4.1 quantized cache) is applied to the post-RoPE rows before they are stored. With
  `ctx.tap_state`, every token's state row [N, state width] is put in `taps[tap_key]` (pooling compressors only).
  opened: the outputs of `opening_rows` (same arguments) where the caller ran them in its own loop (x_NxD is then
  not read); None = run here.

  Every per-token part (projections, the merges with the cached state row, the entry rows) runs in row blocks over
  the live tokens (`map_row_blocks`); only the fold across a window's tokens (`window_pool_scan`, none at decode)
  spans the flat axis."""
  call = CompressorCall(p, spec, state_pool, out_pool, quantize_rows, tap_key)
  if opened is None:
    rows = opening_rows(p, spec, ctx, state_pool, out_pool, inv_freq, eps, quantize_rows)
    opened = map_row_blocks(rows.fn, ctx.live, x_NxD, *rows.args)
  return compress_steps([call], ctx, inv_freq, eps, opened, return_latent=return_latent, taps=taps)[0]


def compress_steps(calls, ctx: StepContext, inv_freq, eps: float, opened, return_latent: bool = False,
                   taps: dict | None = None):
  """`compress_step` of each of `calls` (one, or several that `pool_alike`: a V4 CSA layer's KV and index
  compressors), from `opened`, the outputs of `joint_opening_rows`. Their pools fold side by side: one fold, one
  merge loop and one closing loop for all of them (each channel is pooled on its own, so side by side changes no
  channel's arithmetic). Returns one `compress_step` result per call."""
  spec = calls[0].spec
  m = spec.ratio
  pos = ctx.pos_N
  if len(calls) > 1 and not pool_alike(calls):
    raise ValueError(f"compress_steps: compressors that fold different windows: {[c.spec for c in calls]}")

  if not spec.gated or m == 1:
    # Ratio 1: every token is its own entry, no pooling state.
    (call,) = calls
    latent, rows = opened
    slots = _emit(ctx, pos, ctx.valid_N, m)
    new_out = caches.write_rows(call.out_pool, slots, rows)
    return [(None, new_out, (latent, pos, slots)) if return_latent else (None, new_out)]

  finishes = [_entry_rows(c.p, c.out_pool, c.spec, inv_freq, eps, c.quantize_rows) for c in calls]
  bounds = [0]
  for c in calls:
    bounds.append(bounds[-1] + c.spec.width)
  phase = pos % m
  win_start, _, _, has_base = _step_masks(spec, ctx)
  reset = ctx.first_N | win_start | ~ctx.valid_N
  if ctx.invariant:
    def scan(reset_N, l, mean, _):
      return window_pool_scan(reset_N, l, mean)
  else:
    scan = segmented_pool_scan

  if spec.overlap:
    nl0, nm0, zB, aB, el0, em0 = opened
    nl, nm = scan(reset, nl0, nm0, m)

    def middle(zB, aB, el, em, from_prev, prev_nl, prev_nm):
      sl, sm = merge(prev_nl, prev_nm, zB, aB)
      return jnp.where(from_prev[:, None], sl, el), jnp.where(from_prev[:, None], sm, em)
    el, em = map_row_blocks(middle, ctx.live, zB, aB, el0, em0, has_base & ~ctx.first_N, prev=(nl, nm))
    cl, cm = scan(reset, el, em, m)
    pools = (cl, cm, nl, nm)
  else:
    cl, cm = scan(reset, *opened, m)
    pools = (cl, cm)

  entry = pos // m

  def closing(entry, *pools):
    out = []
    for i, finish in enumerate(finishes):
      own = [pool[:, bounds[i]:bounds[i + 1]] for pool in pools]
      out.append((jnp.concatenate(own, axis=-1), *finish(own[1], entry)))
    return out
  closed = map_row_blocks(closing, ctx.live, entry, *pools)

  # Keep the state after the last token of each block touched (a later step reads the row of its start - 1).
  keep = ctx.valid_N & (ctx.last_N | (pos % ctx.swa_block_tokens == ctx.swa_block_tokens - 1))
  slots = _emit(ctx, entry, ctx.valid_N & (phase == m - 1), m)
  results = []
  for call, (state_rows, latent, rows) in zip(calls, closed):
    if ctx.tap_state and taps is not None:
      taps[call.tap_key] = state_rows
    state_pool = caches.write_rows(call.state_pool, ctx.state_slots(pos, keep)[:, None], state_rows[:, None])
    new_out = caches.write_rows(call.out_pool, slots, rows)
    results.append((state_pool, new_out, (latent, entry, slots)) if return_latent else (state_pool, new_out))
  return results
