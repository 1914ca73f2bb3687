"""The speculative part of the step program (EngineConfig.num_speculative_tokens = k > 0): each decode row carries
the k drafts the model's drafter proposed last step; one backbone pass verifies them and the drafter proposes k more
(`verify_and_draft`). V4's drafter is MTP block 0, which catches up on the positions that became final and then runs
on its own output k - 1 times; V4.1's is DSpark (dsv4/dspark.py), whose context KV the verification pass writes
from the target's features and which drafts its whole block in one pass from the decided token. With async scheduling a row may continue a step the host
has not read yet: the device fills it from that step's results and shifts it by the drafts accepted there
(`continue_rows`). Both run inside `step_program.step_body` (one device, the functional model)."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from dsv4 import caches, dspark, model
from dsv4.layers import row_invariant
from dsv4.layers.compressor import StepContext
from dsv4.engine.sampling import verify_drafts
from dsv4.engine.step_plan import RaggedShape, invariant_step_index, live_rows


def draft_lookahead(config, k: int) -> int:
  """Positions past a drafting row's frontier its drafter writes KV at: V4's MTP recursion writes its k - 1 drafts'
  window KV there; DSpark writes none (its block's own KV is never cached)."""
  return k - 1 if k and not dspark.is_dspark(config) else 0


def continue_rows(p, prev_RxW, shape: RaggedShape):
  """Async scheduling with drafts: a row with prev_row = j >= 0 continues row j of the previous step, whose results
  (`prev_RxW`, [rows, out_width]) are still on the device: its first token is j's decided token and the rest are
  j's drafts, and everything the host planned assuming no draft of j was accepted (positions, start, the sampler's
  output index) moves by the number j accepted."""
  K = shape.spec
  j = jnp.maximum(p["prev_row"], 0)
  cont = p["prev_row"] >= 0
  acc = jnp.where(cont, prev_RxW[j, 0] - 1, 0)
  decided = jnp.take_along_axis(prev_RxW[j], (1 + jnp.maximum(acc, 0))[:, None], axis=1)[:, 0]
  row_N = jnp.maximum(p["row"], 0)
  off_N = jnp.arange(p["tokens"].shape[0]) - (p["last"] - p["num"] + 1)[row_N]
  draft_N = prev_RxW[j[row_N], 2 + K + jnp.clip(off_N - 1, 0, K - 1)]
  tok_N = jnp.where(off_N == 0, decided[row_N], draft_N)
  real_cont = cont[row_N] & (p["row"] >= 0)
  p = dict(p)
  p["tokens"] = jnp.where(real_cont, tok_N, p["tokens"])
  p["pos"] = p["pos"] + jnp.where(real_cont, acc[row_N], 0)
  p["start"], p["step"] = p["start"] + acc, p["step"] + acc
  return p


def verify_and_draft(params, config, layout, kernel_cfg, shape: RaggedShape, p, rows, cache):
  """The step with MTP drafts (shape.spec = k). A row's tokens end with its drafts (p["ndraft"] of them: a decode
  row is [last decided token, drafts...]). One backbone pass scores every draft; `verify_drafts` accepts a prefix
  and decides one more token (exactly greedy; distribution-preserving when sampled). Then:
  * the compressors' state rows are rewritten at each row's last accepted position (the forward left the state
    after the row's last token there, which may be a rejected draft);
  * MTP block 0 catches up on the positions that just became final (its input at position t is the token at
    t + 1: the next token in the row, the decided one at the frontier, or p["next_tok"] for a row that stops
    mid-prompt), writing its window KV there; its output at the frontier is the first next draft;
  * k - 1 more one-position runs of the block on its own output stream give the remaining drafts.
  KV written past the frontier (rejected drafts, the recursion's positions) is overwritten before anything reads
  it: every step writes its positions before attending, and reads stop at each query's position.
  Returns (cache, results [R, out_width], logits [R, k + 1, V]: column j scored the row's j-th new token)."""
  K, R, N = shape.spec, shape.rows, shape.tokens
  step = invariant_step_index(p, rows)
  ds = dspark.is_dspark(config)
  if ds:    # the backbone taps its DSpark features and writes the stages' context KV at the step's positions
    fwd_ds = functools.partial(model.forward_ragged_aux, params, config, layout=layout, kernel_cfg=kernel_cfg,
                               tap_states=True, dspark_taps=True)

    def fwd(toks, cache, st):
      cache, h, auxes = fwd_ds(toks, cache, st)
      feats = dspark.features([auxes[l]["stream_mean"] for l in config.dspark.target_layer_ids])
      cache = dspark.write_context(params, config, feats, cache, StepContext.from_step(st, layout))
      return cache, h, auxes, None
  else:
    fwd = functools.partial(model.forward_ragged_aux, params, config, layout=layout, kernel_cfg=kernel_cfg,
                            return_stream=True, tap_states=True)
  # one pass of row-invariant ops: every position's bits as without drafts
  cache, h_NxD, auxes, X = fwd(p["tokens"], cache, step)
  last = jnp.maximum(p["last"], 0)
  ndraft = jnp.where(p["num"] > 0, jnp.minimum(p["ndraft"], K), 0)
  base = last - ndraft                                  # flat index of the input whose logits score draft 1
  j = jnp.arange(K + 1)[None, :]
  scored = jnp.minimum(base[:, None] + j, last[:, None])
  # one [R, D] matmul per scored column, the shape of the step without drafts: a position's logits have the bits
  # they have there (a greedy row's tokens and logits equal the engine's without drafts, bit for bit); verified
  # and sampled in row blocks over the live rows
  live = live_rows(p)
  logits_RxJxV = jnp.stack([model.lm_logits(params, h_NxD[scored[:, j]]) for j in range(K + 1)], axis=1)
  drafts_RxK = p["tokens"][jnp.minimum(base[:, None] + 1 + j[:, :K], N - 1)]
  accepted, new_RxJ = row_invariant.map_row_blocks(verify_drafts, live, logits_RxJxV, drafts_RxK, ndraft,
                                                   p["temperature"], p["top_k"], p["top_p"], p["seed"], p["step"])
  # rows past the live blocks come back unspecified: zeros, as the positions below index with them
  in_step = (jnp.arange(R) < live)[:, None]
  accepted, new_RxJ = jnp.where(in_step[:, 0], accepted, 0), jnp.where(in_step, new_RxJ, 0)
  decided = jnp.take_along_axis(new_RxJ, accepted[:, None], axis=1)[:, 0]
  frontier = base + accepted                            # flat index of each row's last final position
  n = jnp.arange(N)
  row_N = jnp.maximum(p["row"], 0)
  real = p["row"] >= 0
  at_frontier = real & (n == frontier[row_N])
  cache = model.store_states(cache, auxes, step, at_frontier & (ndraft[row_N] > 0), layout=layout)
  samples = p["next_tok"] < 0
  drafting = samples & (p["num"] > 0) & (p["slot"] >= 0)
  if ds:
    # DSpark: one pass from each drafting row's decided token at its frontier + 1 over its stages' context KV (all
    # positions up to the frontier are final and were written by this pass or earlier ones)
    anchor_pos = p["pos"][frontier] + 1
    got = dspark.serve_drafts(params, config, cache, StepContext.from_step(step, layout), jnp.arange(R), decided,
                              anchor_pos, drafting)
    drafts_RxK = jnp.where(drafting[:, None], got[:, :K], 0)
    return _results(cache, accepted, new_RxJ, drafts_RxK, logits_RxJxV)

  # MTP block 0 over the same positions: the token after each position, the decided / next prompt token at the
  # frontier (a mid-prompt row: the host's next_tok).
  after_frontier = jnp.where(samples, decided, p["next_tok"])
  shifted = jnp.concatenate([p["tokens"][1:], jnp.zeros((1,), p["tokens"].dtype)])
  nxt_N = jnp.where(at_frontier, after_frontier[row_N], shifted)
  mtp = functools.partial(model.mtp_forward, params, config, 0, layout=layout, kernel_cfg=kernel_cfg)
  cache, Xm, hm = mtp(X, nxt_N, cache, step)
  draft = jnp.argmax(model.lm_logits(params, hm[frontier]), axis=-1).astype(jnp.int32)
  drafts = [draft]
  # The recursion: position frontier + i, the block's own stream, the previous draft. Only rows that sampled draft.
  pos = p["pos"][frontier] + 1
  Xr = Xm[:, frontier]
  for _ in range(K - 1):
    rstep = caches.StepIndex(jnp.where(drafting, jnp.arange(R), -1), pos, pos, drafting.astype(jnp.int32), rows,
                             swa_base_R=p["swa_base"], full_row_R=p.get("full_row"))
    cache, Xr, hr = model.mtp_forward(params, config, 0, Xr, drafts[-1], cache, rstep, layout=layout,
                                      kernel_cfg=kernel_cfg)
    drafts.append(jnp.argmax(model.lm_logits(params, hr), axis=-1).astype(jnp.int32))
    pos = pos + 1
  drafts_RxK = jnp.where(drafting[:, None], jnp.stack(drafts, axis=1), 0)
  return _results(cache, accepted, new_RxJ, drafts_RxK, logits_RxJxV)


def _results(cache, accepted, new_RxJ, drafts_RxK, logits_RxJxV):
  res = jnp.concatenate([(accepted + 1)[:, None], new_RxJ, drafts_RxK], axis=1)
  return cache, res.astype(jnp.int32), logits_RxJxV
