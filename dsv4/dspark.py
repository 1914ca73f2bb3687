"""DeepSeek-V4.1's DSpark block drafter as pure functions (docs/model.md, DSpark).

The released V4.1 checkpoint stores its draft model as `mtp.0` .. `mtp.2`, but it is not V4's recursive MTP block:
it drafts a whole block of `dspark.block_size` tokens in one pass.

* Features. At every position t the target contributes the mean over mHC streams of the input of each layer in
  `dspark.target_layer_ids` (what that layer's attention mixing reads), concatenated. Stage 0 projects them to the
  hidden size (`main_proj`, `main_norm`): T_t. Every stage turns T_t into window KV with its own attention
  projections: K_s(t) = V_s(t) = RoPE(kv_norm(wkv_s T_t), t). In serving this KV lives in the stage's window cache
  layer (index num_layers + s, the SWA group), written by the step that computed the target at t.
* Drafting from an anchor (the last decided token, at position p, not yet seen by the target): the block's inputs
  are the anchor's embedding then `block_size - 1` noise-token embeddings at positions p .. p + block_size - 1. Each
  stage is a V4.1 block (single-pass mHC, window-only attention, the draft's own MoE) whose queries attend to the
  stage's context KV over [p - W, p - 1] and to all of the block's own inputs (bidirectional), plus the sink.
* Output: the last stage's collapse and norm, the LM head, plus a Markov bias from the previous token (the anchor
  for slot 0, draft i - 1 for slot i): slot i proposes the token at p + i + 1. Greedy drafting takes the argmax slot
  by slot, feeding each draft to the next slot's Markov bias.

The confidence head (a per-slot acceptance predictor) is loaded and exposed (`confidence`), but the engine drafts a
fixed number of tokens and does not use it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import caches, model
from dsv4.config import ModelConfig
from dsv4.layers import cache_quant, mhc, moe
from dsv4.layers.attention import output_projection
from dsv4.layers.norms import rms_norm
from dsv4.layers.rope import apply_rope, inv_freq_for

_HI = jax.lax.Precision.HIGHEST


def is_dspark(config: ModelConfig) -> bool:
  return config.variant == "v41" and config.num_mtp_layers > 0


def features(stream_taps) -> jax.Array:
  """[N, L * D]: the target layers' stream means (`model.forward_ragged_aux(..., dspark_taps=True)`), concatenated
  in `target_layer_ids` order."""
  return jnp.concatenate(list(stream_taps), axis=-1)


def sequence_features(params, config: ModelConfig, tokens_BxS):
  """(backbone logits [B, S, V], DSpark features [B, S, F]) of whole sequences (no cache reuse): training and
  reference drafts."""
  B, S = tokens_BxS.shape
  cache, step = caches.whole_sequences(config, B, S)
  _, h, auxes = model.forward_ragged_aux(params, config, tokens_BxS.reshape(-1), cache, step, dspark_taps=True)
  feats = features([auxes[l]["stream_mean"] for l in config.dspark.target_layer_ids])
  return model.lm_logits(params, h).reshape(B, S, -1), feats.reshape(B, S, -1)


def project_features(params, config: ModelConfig, feats_NxF):
  """Stage 0's projection of the target features: T [N, D]."""
  p0 = params["mtp"][0]
  t = jnp.dot(feats_NxF.astype(p0["main_proj"].dtype), p0["main_proj"], precision=_HI)
  return rms_norm(t, p0["main_norm"], config.rms_norm_eps)


def _kv(p_attn, config: ModelConfig, x_NxD, pos_N):
  """A stage's K = V rows for inputs x at positions pos (FP8-rounded like the backbone's window KV when the config
  quantizes its cache)."""
  inv_freq = inv_freq_for(config.attention, "main")
  kv = rms_norm(jnp.dot(x_NxD, p_attn["wkv"], precision=_HI), p_attn["kv_norm"], config.rms_norm_eps)
  kv = apply_rope(kv, pos_N, inv_freq)
  return cache_quant.fp8_window_kv(kv) if config.quantized_cache else kv


def context_kv(params, config: ModelConfig, feats_NxF, pos_N):
  """Every stage's context KV rows [N, d] for target features at positions pos."""
  t = project_features(params, config, feats_NxF)
  return [_kv(pm["attn"], config, t, pos_N) for pm in params["mtp"]]


def write_context(params, config: ModelConfig, feats_NxF, cache: caches.ModelCache, ctx) -> caches.ModelCache:
  """Writes each stage's context KV for this step's tokens into its window cache layer (the tokens' SWA slots)."""
  layers = list(cache.layers)
  slots = ctx.token_slots()
  for s, kv in enumerate(context_kv(params, config, feats_NxF, ctx.pos_N)):
    i = config.num_layers + s
    layers[i] = dict(layers[i], window_kv=caches.write_rows(layers[i]["window_kv"], slots, kv))
  return caches.ModelCache(tuple(layers))


def _stage_attention(p, config: ModelConfig, x_NxD, pos_N, ctx_kv_RxCxd, ctx_ok_RxC, block: int):
  """One stage's attention for R blocks of `block` queries (flat N = R * block): each query sees its block's
  context rows (ctx_ok) and every input of its own block, plus the per-head sink. fp32 softmax."""
  a, eps = config.attention, config.rms_norm_eps
  N = x_NxD.shape[0]
  R, H, d = N // block, a.num_heads, a.head_dim
  inv_freq = inv_freq_for(a, "main")
  cq = rms_norm(jnp.dot(x_NxD, p["wq_a"], precision=_HI), p["q_norm"], eps)
  q = apply_rope(jnp.dot(cq, p["wq_b"], precision=_HI).reshape(N, H, d), pos_N[:, None], inv_freq)
  own = _kv(p, config, x_NxD, pos_N).reshape(R, block, d)
  keys = jnp.concatenate([ctx_kv_RxCxd.astype(own.dtype), own], axis=1).astype(jnp.float32)
  ok = jnp.concatenate([ctx_ok_RxC, jnp.ones((R, block), bool)], axis=1)
  s = jnp.einsum("rbhd,rkd->rbhk", q.reshape(R, block, H, d).astype(jnp.float32), keys, precision=_HI) * d ** -0.5
  s = jnp.where(ok[:, None, None, :], s, -jnp.inf)
  sink = p["sink"].astype(jnp.float32)[None, None, :, None]
  m = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sink)
  e = jnp.exp(s - m)
  denom = jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - m)
  out = jnp.einsum("rbhk,rkd->rbhd", e / denom, keys, precision=_HI).astype(x_NxD.dtype)
  return output_projection(p, config, out.reshape(N, H, d), pos_N, inv_freq)


def draft_hidden(params, config: ModelConfig, ctx_kv, ctx_ok_RxC, anchor_tok_R, anchor_pos_R):
  """The stages over R blocks: returns the final-normed hidden states [R, block, D] (slot i predicts the token at
  anchor_pos + i + 1). ctx_kv: one [R, C, d] context per stage, ctx_ok [R, C] which of its rows are visible."""
  ds, eps, n = config.dspark, config.rms_norm_eps, config.mhc.hc_mult
  R, B = anchor_tok_R.shape[0], ds.block_size
  ids = jnp.concatenate([anchor_tok_R[:, None].astype(jnp.int32), jnp.full((R, B - 1), ds.noise_token_id, jnp.int32)],
                        axis=1).reshape(1, R * B)
  pos = (anchor_pos_R[:, None] + jnp.arange(B)[None, :]).reshape(R * B).astype(jnp.int32)
  e = params["embed"][ids]                                             # [1, N, D]
  X = jnp.broadcast_to(e[:, :, None, :], (1, R * B, n, e.shape[-1]))
  pre = jnp.zeros((1, R * B, n), jnp.float32).at[..., 0].set(1.0)
  for s, (pm, plan) in enumerate(zip(params["mtp"], config.mtp_plans())):
    attn = functools.partial(_stage_attention, pm["attn"], config, pos_N=pos, ctx_kv_RxCxd=ctx_kv[s],
                             ctx_ok_RxC=ctx_ok_RxC, block=B)
    parts = model.Sublayers(
        hc_attn=functools.partial(mhc.hc_coefficients, pm["hc_attn"], cfg=config.mhc, norm_eps=eps),
        attn_norm=pm["attn_norm"],
        # the stage has no row loop: the block's input and tail rows in loops of their own
        attn=lambda x, ctx, cache_l, kcfg, aux, shared, tail, attn=attn: (
            cache_l, model.rows_around(attn, x, tail, None), {}, shared),
        hc_ffn=functools.partial(mhc.hc_coefficients, pm["hc_ffn"], cfg=config.mhc, norm_eps=eps),
        ffn_norm=pm["ffn_norm"],
        ffn=lambda x, tokens, live=None, kernel_cfg=None, tail=None, pm=pm: moe.moe(
            pm["ffn"], x, tokens, config.dspark_moe, False, live, kernel_cfg, tail))
    _, X, pre, _, _ = model.block_forward(parts, config, X, ids, None, None, None, False, pre_prev=pre)
  h = rms_norm(mhc.collapse(pre, X), params["mtp"][-1]["norm"], eps)[0]
  return h.reshape(R, B, -1)


def markov(params, prev_tokens):
  """(transition logits [..., V] fp32, the Markov embedding [..., rank]) of the previous tokens."""
  mh = params["mtp"][-1]["markov_head"]
  emb = mh["embed"][prev_tokens]
  return jnp.dot(emb, mh["head"], precision=_HI, preferred_element_type=jnp.float32), emb


def draft_logits(params, h_xD, prev_tokens):
  """Slot logits: the LM head on the draft's hidden states (fp32) plus the Markov bias of each slot's previous token."""
  base = jnp.dot(h_xD.astype(jnp.float32), params["lm_head"].astype(jnp.float32), precision=_HI)
  return base + markov(params, prev_tokens)[0]


def confidence(params, h_xD, prev_tokens):
  """The confidence head's acceptance logits (fp32) for slots with these hidden states and previous tokens."""
  emb = markov(params, prev_tokens)[1]
  x = jnp.concatenate([h_xD.astype(jnp.float32), emb.astype(jnp.float32)], axis=-1)
  return jnp.dot(x, params["mtp"][-1]["confidence_head"]["proj"].astype(jnp.float32), precision=_HI)[..., 0]


def greedy_drafts(params, h_RxBxD, anchor_tok_R):
  """[R, block] greedy drafts: slot i's Markov bias reads draft i - 1 (the anchor for slot 0)."""
  base = jnp.dot(h_RxBxD.astype(jnp.float32), params["lm_head"].astype(jnp.float32), precision=_HI)
  prev, out = anchor_tok_R.astype(jnp.int32), []
  for i in range(h_RxBxD.shape[1]):
    prev = jnp.argmax(base[:, i] + markov(params, prev)[0], axis=-1).astype(jnp.int32)
    out.append(prev)
  return jnp.stack(out, axis=1)


def serve_drafts(params, config: ModelConfig, cache: caches.ModelCache, ctx, rows_R, anchor_tok_R, anchor_pos_R,
                 drafting_R):
  """Greedy drafts [R, block] for the rows that draft: each reads its stages' context KV over the window before its
  anchor from the cache through the step's SWA tables (`ctx`: the step's `StepContext`)."""
  W = config.attention.window
  cpos = anchor_pos_R[:, None] - W + jnp.arange(W)[None, :]                  # [R, W], oldest first
  ok = drafting_R[:, None] & (cpos >= 0)
  slots = ctx.swa_slots(jnp.broadcast_to(rows_R[:, None], cpos.shape), cpos, ok)
  ctx_kv = [caches.gather_flat(caches.flat_pool(cache.layers[config.num_layers + s]["window_kv"]), slots)
            for s in range(config.num_mtp_layers)]            # an FP8 record is dequantized as attention reads it
  h = draft_hidden(params, config, ctx_kv, ok & (slots >= 0), anchor_tok_R, anchor_pos_R)
  return greedy_drafts(params, h, anchor_tok_R)


def reference_drafts(params, config: ModelConfig, tokens_S, pad_to: int = 0):
  """Greedy drafts [block] from a whole sequence's last token as the anchor, everything recomputed (no cache): what
  the engine must propose after deciding that token. pad_to: run at this fixed length (zeros after the sequence
  change no position before them: the model is causal), so sequences of any length share one compilation."""
  S = len(tokens_S)
  toks = np.zeros((1, max(S, pad_to)), np.int32)
  toks[0, :S] = tokens_S
  return _reference_drafts(params, config, jnp.asarray(toks), jnp.int32(S - 1))


@functools.partial(jax.jit, static_argnames=("config",))
def _reference_drafts(params, config: ModelConfig, toks_1xS, anchor):
  _, feats = sequence_features(params, config, toks_1xS)
  h = hidden_at_anchors(params, config, toks_1xS, feats, anchor.reshape(1, 1))
  return greedy_drafts(params, h[0], toks_1xS[:, anchor])[0]


def hidden_at_anchors(params, config: ModelConfig, tokens_BxS, feats_BxSxF, anchors_BxA):
  """Cache-free drafting at given anchors of whole sequences: the final-normed hidden states [B, A, block, D]
  (slot i predicts the token at anchor + i + 1). Context KV from every position's features, the window before each
  anchor gathered from it."""
  B, S = tokens_BxS.shape
  A, W = anchors_BxA.shape[1], config.attention.window
  pos = jnp.broadcast_to(jnp.arange(S)[None], (B, S))
  kvs = context_kv(params, config, feats_BxSxF.reshape(B * S, -1), pos.reshape(-1))
  cpos = anchors_BxA[..., None] - W + jnp.arange(W)                              # [B, A, W], oldest first
  ok = (cpos >= 0).reshape(B * A, W)
  take = lambda kv: jnp.take_along_axis(kv.reshape(B, S, 1, -1), jnp.clip(cpos, 0, S - 1).reshape(B, A * W, 1, 1),
                                        axis=1).reshape(B * A, W, -1)
  anchor_tok = jnp.take_along_axis(tokens_BxS, anchors_BxA, axis=1).reshape(B * A)
  h = draft_hidden(params, config, [take(kv) for kv in kvs], ok, anchor_tok, anchors_BxA.reshape(B * A))
  return h.reshape(B, A, *h.shape[1:])


def train_logits(params, config: ModelConfig, tokens_BxS, feats_BxSxF, anchors_BxA):
  """Cache-free drafting at given anchors (training, teacher forcing): logits [B, A, block, V] of the tokens at
  anchor + 1 .. anchor + block, with the Markov bias of the true previous tokens. Slots past the sequence's end
  read a clipped previous token (callers mask them)."""
  B, S = tokens_BxS.shape
  A, blk = anchors_BxA.shape[1], config.dspark.block_size
  h = hidden_at_anchors(params, config, tokens_BxS, feats_BxSxF, anchors_BxA)
  prev_pos = jnp.clip(anchors_BxA[..., None] + jnp.arange(blk), 0, S - 1)       # previous token of each slot
  prev = jnp.take_along_axis(tokens_BxS, prev_pos.reshape(B, A * blk), axis=1).reshape(B, A, blk)
  return draft_logits(params, h, prev)
