"""The DeepSeek-V4 / V4.1 text model as pure functions over explicit pytrees.

    params = init_params(config, key)
    cache, logits = forward(params, config, tokens_BxT, cache, index)

`forward` serves full prefill, chunked prefill (any chunk length) and decode (T = 1) for a batch of sequences at
different positions: `index.start_pos_B` says where each row's chunk starts and `index.num_tokens_B` how many of its
T tokens are real. The cache is the paged pytree of `dsv4.caches`; `forward_full` wraps a contiguous one.

Parameters are plain nested dicts of arrays, kernels stored [in, out]; names follow the original checkpoint
spelling (wq_a, wkv, wo_a, ...), see `dsv4.loading` for the HF <-> project mapping.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import caches, mesh_context
from dsv4.config import LayerPlan, ModelConfig
from dsv4.layers import engram as engram_mod
from dsv4.layers import mhc, moe, row_invariant
from dsv4.layers.attention import attention_layer, attention_layer_shared
from dsv4.layers.compressor import StepContext
from dsv4.layers.norms import rms_norm
from pallas_kernels import dispatch


# ----------------------------------------------------------------------------------------------------------
# Parameters

class ParamSpec(NamedTuple):
  """One parameter as declared by `param_shapes`: its shape, dtype, init rule (see `init_params`) and the logical
  name of each dimension (MaxText style; `dsv4.sharding.Rules` maps the names to mesh axes, None = never split)."""
  shape: tuple[int, ...]
  dtype: Any
  init: str
  axes: tuple[str | None, ...]


def _spec(shape: tuple[int, ...], init: str, axes: tuple[str | None, ...], dtype=jnp.float32) -> ParamSpec:
  if len(axes) != len(shape):
    raise ValueError(f"param_shapes: shape {shape} has {len(shape)} dims but axes {axes} name {len(axes)}")
  return ParamSpec(tuple(shape), dtype, init, tuple(axes))


def param_shapes(config: ModelConfig) -> dict:
  """Nested dict of `ParamSpec` leaves; the single source of truth for the parameter tree: names (the checkpoint
  spelling), shapes, dtypes, init rules and the logical axes sharding reads."""
  a, ix, mo, D = config.attention, config.indexer, config.moe, config.hidden_size
  n = config.mhc.hc_mult

  def hc(rows):
    return {"fn": _spec((n * D, rows), "normal", ("hc_in", "hc_out")),
            "base": _spec((rows,), "normal", ("hc_out",)),
            "scale": _spec((3 if rows > n else 1,), "normal", (None,))}

  def compressor(width, ratio, overlap, gated, bias):
    # Compressors feed the compressed pools and the index keys; small (D x 2d), replicated.
    c = 2 if overlap else 1
    out = {"wkv": _spec((D, c * width), "dense", ("embed", "comp_proj")),
           "norm": _spec((width,), "ones", ("comp_latent",))}
    if gated:
      out["wgate"] = _spec((D, c * width), "dense", ("embed", "comp_proj"))
    if bias:
      out["ape"] = _spec((ratio, c * width), "normal", (None, "comp_proj"))
    return out

  def block(plan, mo=mo):
    attn = {
        "wq_a": _spec((D, a.q_lora_rank), "dense", ("embed", "q_lora")),
        "q_norm": _spec((a.q_lora_rank,), "ones", ("q_lora",)),
        "wq_b": _spec((a.q_lora_rank, a.num_heads * a.head_dim), "dense", ("q_lora", "heads_x_dim")),
        "wkv": _spec((D, a.head_dim), "dense", ("embed", "kv_latent")),
        "kv_norm": _spec((a.head_dim,), "ones", ("kv_latent",)),
        "wo_a": _spec((a.o_groups, a.num_heads * a.head_dim // a.o_groups, a.o_lora_rank), "dense",
                      ("o_groups", "o_group_in", "o_lora")),
        "wo_b": _spec((a.o_groups * a.o_lora_rank, D), "dense", ("o_groups_x_lora", "embed")),
        "sink": _spec((a.num_heads,), "normal", ("heads",)),
    }
    v4 = config.variant == "v4"
    if plan.has_compressor:
      attn["compressor"] = compressor(a.head_dim, plan.ratio, plan.overlap, plan.ratio > 1, v4)
    if plan.has_index_query:
      attn["indexer"] = {
          "wq_b": _spec((a.q_lora_rank, ix.num_heads * ix.head_dim), "dense", ("q_lora", "index_heads_x_dim")),
          "weights_proj": _spec((D, ix.num_heads), "dense", ("embed", "index_heads"))}
      if plan.kind == "csa":
        attn["indexer"]["compressor"] = compressor(ix.head_dim, plan.ratio, True, True, True)
      elif plan.has_index_keys:
        attn["indexer"].update(wk=_spec((a.head_dim, ix.head_dim), "dense", ("comp_latent", "index_dim")),
                               k_norm=_spec((ix.head_dim,), "ones", ("index_dim",)))
    inter, experts = mo.intermediate_size, mo.n_routed_experts
    shared_inter = inter * mo.n_shared_experts
    ffn = {"gate": _spec((D, experts), "dense", ("embed", "router")),
           "experts": {"w1": _spec((experts, D, inter), "dense", ("experts", "embed", "expert_mlp")),
                       "w3": _spec((experts, D, inter), "dense", ("experts", "embed", "expert_mlp")),
                       "w2": _spec((experts, inter, D), "dense", ("experts", "expert_mlp", "embed"))},
           "shared": {"w1": _spec((D, shared_inter), "dense", ("embed", "mlp")),
                      "w3": _spec((D, shared_inter), "dense", ("embed", "mlp")),
                      "w2": _spec((shared_inter, D), "dense", ("mlp", "embed"))}}
    if plan.hash_moe:
      ffn["tid2eid"] = _spec((config.vocab_size, mo.num_experts_per_tok), "tid2eid", ("vocab_table", None),
                             jnp.int32)
    else:
      ffn["bias"] = _spec((experts,), "normal", ("router",))
    if not v4:
      # V4.1 routing bias of vision tokens (unused by the text model)
      ffn["bias_vl"] = _spec((experts,), "normal", ("router",))
    layer = {"attn": attn, "ffn": ffn, "attn_norm": _spec((D,), "ones", ("embed",)),
             "ffn_norm": _spec((D,), "ones", ("embed",)), "hc_attn": hc((2 + n) * n), "hc_ffn": hc((2 + n) * n)}
    if plan.engram:
      e = config.engram
      rows = e.num_embeddings[e.layer_ids.index(plan.index)]
      layer["engram"] = {"embed": _spec((rows, e.head_dim), "embed", ("engram_rows", "engram_dim")),
                         "wkv": _spec((e.hash_heads * e.head_dim, D * (n + 1)), "dense", ("engram_in", "engram_out")),
                         "q_weight": _spec((n, D), "ones_param", ("hc", "embed")),
                         "k_weight": _spec((n, D), "ones_param", ("hc", "embed"))}
    return layer

  layers = [block(plan) for plan in config.layer_plan()]
  out = {"embed": _spec((config.vocab_size, D), "embed", ("vocab", "embed")), "layers": layers,
         "norm": _spec((D,), "ones", ("embed",)), "lm_head": _spec((D, config.vocab_size), "dense", ("embed", "vocab"))}
  if config.num_mtp_layers and config.variant == "v4":
    # an MTP block: a whole block plus its input fusion (e_proj, h_proj and their norms) and its own final collapse
    # and norm; the embedding and the LM head are the backbone's. The fusion is two D x D matrices: replicated.
    out["mtp"] = [{**block(plan), "e_proj": _spec((D, D), "dense", ("embed", None)),
                   "h_proj": _spec((D, D), "dense", ("embed", None)), "enorm": _spec((D,), "ones", ("embed",)),
                   "hnorm": _spec((D,), "ones", ("embed",)), "norm": _spec((D,), "ones", ("embed",)),
                   "hc_head": hc(n)} for plan in config.mtp_plans()]
  elif config.num_mtp_layers:
    # DSpark stages (dsv4/dspark.py): window-only blocks with the draft's own MoE; stage 0 also projects the target
    # features, the last one holds the final norm, the Markov transition head and the acceptance-confidence head.
    ds = config.dspark
    stages = [block(plan, config.dspark_moe) for plan in config.mtp_plans()]
    stages[0].update(main_proj=_spec((D * len(ds.target_layer_ids), D), "dense", ("dspark_features", "embed")),
                     main_norm=_spec((D,), "ones", ("embed",)))
    stages[-1].update(norm=_spec((D,), "ones", ("embed",)),
                      markov_head={"embed": _spec((config.vocab_size, ds.markov_rank), "embed",
                                                  ("vocab", "markov_rank")),
                                   "head": _spec((ds.markov_rank, config.vocab_size), "dense",
                                                 ("markov_rank", "vocab"))},
                      confidence_head={"proj": _spec((D + ds.markov_rank, 1), "dense", ("embed_x_rank", None))})
    out["mtp"] = stages
  if not config.single_pass_mhc:
    out["hc_head"] = hc(n)
  if config.engram.layer_ids:
    # Normalised-vocabulary map of the tokenizer (not in the checkpoint; identity until set from the tokenizer
    # with dsv4.layers.engram.compressed_token_map).
    out["engram_token_map"] = _spec((config.vocab_size,), "token_map", ("vocab_table",), jnp.int32)
  return out


def is_param_spec(x) -> bool:
  """`is_leaf` for trees of `param_shapes` (a ParamSpec is a NamedTuple, which JAX would otherwise descend into)."""
  return isinstance(x, ParamSpec)



def draw_normal(key: jax.Array, shape: tuple, dtype) -> jax.Array:
  """`jax.random.normal(key, shape, dtype)`, the same bits, drawn as a flat vector of the next power of two and cut
  to size: with JAX's partitionable threefry (its default) element i of a draw depends on the key and i only, so
  the prefix of a longer draw is the shorter one. One compiled sampler per size bucket instead of per parameter
  shape (an eager init compiles a program per distinct shape; at XLA's default level that was most of a tiny
  model's init on the CPU)."""
  size = math.prod(shape)
  if not getattr(jax.config, "jax_threefry_partitionable", True) or size <= 1:     # the flag may retire as default
    return jax.random.normal(key, shape, dtype)
  return jax.random.normal(key, (1 << (size - 1).bit_length(),), dtype)[:size].reshape(shape)


def init_params(config: ModelConfig, key: jax.Array, scale: float = 1.0) -> dict:
  """Random parameters (for tests, training from scratch and benchmarks)."""
  specs, treedef = jax.tree_util.tree_flatten(param_shapes(config), is_leaf=is_param_spec)
  keys = jax.random.split(key, len(specs))
  out = []
  for k, spec in zip(keys, specs):
    shape, dtype, kind = spec.shape, spec.dtype, spec.init
    if kind == "ones":
      out.append(jnp.ones(shape, dtype))
    elif kind == "ones_param":
      out.append(1.0 + 0.1 * scale * draw_normal(k, shape, dtype))
    elif kind == "token_map":
      out.append(jnp.arange(shape[0], dtype=dtype))
    elif kind == "dense":
      fan_in = shape[-2]
      out.append(draw_normal(k, shape, dtype) * (scale / np.sqrt(fan_in)))
    elif kind == "embed":
      out.append(draw_normal(k, shape, dtype))
    elif kind == "tid2eid":
      num_experts = config.moe.n_routed_experts
      # distinct experts per token: a random permutation prefix per row
      perm = jax.vmap(lambda kk: jax.random.permutation(kk, num_experts)[: shape[1]])(jax.random.split(k, shape[0]))
      out.append(perm.astype(dtype))
    else:
      out.append(draw_normal(k, shape, dtype) * 0.1 * scale)
  return jax.tree_util.tree_unflatten(treedef, out)


def abstract_params(config: ModelConfig) -> dict:
  """ShapeDtypeStructs of the parameters, without allocating (works at full Flash size)."""
  return jax.tree_util.tree_map(lambda spec: jax.ShapeDtypeStruct(spec.shape, spec.dtype), param_shapes(config),
                                is_leaf=is_param_spec)


def param_spec_at(config: ModelConfig, path: Sequence) -> ParamSpec | dict:
  """The `param_shapes` entry at `path` (dict keys; list positions as ints or digit strings, e.g. the NNX module
  path ("layers", "3", "attn", "wq_a"))."""
  node = param_shapes(config)
  for key in path:
    node = node[int(key)] if isinstance(node, list) else node[key]
  return node


def count_params(tree) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))


# ----------------------------------------------------------------------------------------------------------
# Forward

def _engram_hashes(params, config: ModelConfig, tokens_N, ctx: StepContext, cache_layers):
  """Writes this step's token ids into the SWA-group `token_ids` rows, reads each token's previous max_ngram-1
  ids back through its row's block table, and hashes. Returns (updated cache layer dict, hashes [N, L, heads])."""
  e = config.engram
  owner = e.layer_ids[0]
  cl = dict(cache_layers[owner])
  cl["token_ids"] = caches.write_rows(cl["token_ids"], ctx.token_slots(), tokens_N)
  P = e.max_ngram_size - 1
  prev_pos = ctx.pos_N[:, None] - P + jnp.arange(P)[None, :]
  slots = ctx.swa_slots(ctx.row_N[:, None], prev_pos, ctx.valid_N[:, None] & (prev_pos >= 0))
  prev, ok = caches.read_rows(cl["token_ids"], slots)
  ext = jnp.concatenate([jnp.where(ok, prev, -1), tokens_N[:, None]], axis=1)
  return cl, engram_mod.hash_ids(params["engram_token_map"], ext, e, 1)[:, 0]


class Sublayers(NamedTuple):
  """One layer's parts as the block wiring (`block_forward`) calls them. The functional model builds them from a
  layer's param dict (`layer_sublayers`); `nnx_model.Block` hands over its own sub-modules, so the wiring exists
  once and whatever a sub-module computes is what the block runs. `attn` and `ffn` take a `tail`
  (`row_invariant.RowFn`): the block's row-local work on their output rows, which they run in their last row-block
  loop and whose outputs ([N, ...]) they return in place of y. `attn`'s input x comes as a `RowFn` too (`token_fn`:
  made in its projection loop, its carry handed to the tail); a sublayer with no row loop of its own wraps its core
  in `rows_around`."""
  hc_attn: Callable       # X_BxTxNxD -> (pre, post, comb)      (mhc.hc_coefficients)
  attn_norm: jax.Array    # [D]
  attn: Callable          # (x, ctx, cache_l, kernel_cfg, collect_aux[, shared], tail=) -> (cache_l, y, aux[, shared])
  hc_ffn: Callable        # X_BxTxNxD -> (pre, post, comb)
  ffn_norm: jax.Array     # [D]
  ffn: Callable           # (x_BxTxD, tokens_BxT, live, kernel_cfg, tail=) -> y_BxTxD     (moe.moe)
  engram: Callable | None = None   # V4.1: (X_BxTxNxD, hash_BxTxH) -> X_BxTxNxD (engram.engram); None = no Engram


def layer_sublayers(params_l, config: ModelConfig, plan: LayerPlan) -> Sublayers:
  """The sublayer functions of `dsv4.layers` bound to one layer's params, config and plan."""
  eps = config.rms_norm_eps
  attn = attention_layer_shared if config.single_pass_mhc else attention_layer
  return Sublayers(
      hc_attn=functools.partial(_hc, params_l["hc_attn"], config),
      attn_norm=params_l["attn_norm"],
      attn=functools.partial(attn, params_l["attn"], config, plan),
      hc_ffn=functools.partial(_hc, params_l["hc_ffn"], config),
      ffn_norm=params_l["ffn_norm"],
      ffn=lambda x, tokens, live=None, kernel_cfg=None, tail=None: moe.moe(params_l["ffn"], x, tokens, config.moe,
                                                                           plan.hash_moe, live, kernel_cfg, tail),
      engram=(lambda X, h: engram_mod.engram(params_l["engram"], X, h, eps)) if plan.engram else None)


def _hc(p, config: ModelConfig, X):
  return mhc.hc_coefficients(p, X, config.mhc, config.rms_norm_eps)


def block_forward(s: Sublayers, config: ModelConfig, X, tokens, ctx, cache_l, kernel_cfg, collect_aux, *,
                  pre_prev=None, shared=None, engram_hash=None, tap_stream=False):
  """One block's wiring around its sublayers `s`: the attention and MoE sublayers with mHC.

  V4: returns (cache_l, X, aux). V4.1 (`single_pass_mhc`, docs/model.md): Engram first, then single-pass mHC, where
  each sublayer collapses with the previous one's `pre` (`pre_prev` in, the FFN's `pre` out) and the CSA2 state
  `shared` goes from layer to layer: returns (cache_l, X, pre, aux, shared). tap_stream (V4.1): aux["stream_mean"]
  is the mean over streams of the block's input after Engram [N, D] (a DSpark target feature, dsv4/dspark.py)."""
  eps = config.rms_norm_eps
  live = None if ctx is None else ctx.live      # no step context: DSpark's draft block (its own fixed rows)
  # The mHC work around each sublayer rides in the sublayer's own row-block loops: the attention's input is made in
  # its projection loop (`token_fn`: never stored), and the work after each sublayer is its tail,
  # run in its last loop. hc_attn's post / comb reach the attention's tail as its input's carry.
  if not config.single_pass_mhc:
    def pre_attn(X):
      pre, post, comb = s.hc_attn(X)
      return rms_norm(mhc.collapse(pre, X), s.attn_norm, eps), (post, comb)

    def pre_ffn(y, X, carry):
      X = mhc.expand(y, X, *carry)
      pre, post, comb = s.hc_ffn(X)
      return X, rms_norm(mhc.collapse(pre, X), s.ffn_norm, eps), post, comb
    cache_l, got, aux = s.attn(token_fn(pre_attn, X), ctx, cache_l, kernel_cfg, collect_aux,
                               tail=token_fn(pre_ffn, X))
    X, u, post, comb = _batch_of_one(got)
    X = _batch_of_one(s.ffn(u, tokens, live, kernel_cfg, tail=token_fn(mhc.expand, X, post, comb)))
    return cache_l, X, aux

  def pre_attn_single_pass(X, pre_prev, engram_hash):
    if s.engram is not None:
      X = s.engram(X, engram_hash)
    stream_mean = jnp.mean(X.astype(jnp.float32), axis=2).astype(X.dtype) if tap_stream else None
    pre, post, comb = s.hc_attn(X)
    # the stream after Engram goes on to the tail (without Engram it is the block's input, which the tail reads)
    return rms_norm(mhc.collapse(pre_prev, X), s.attn_norm, eps), (
        X if s.engram is not None else None, stream_mean, pre, post, comb)

  def pre_ffn_single_pass(y, X_in, carry):
    X, stream_mean, pre, post, comb = carry
    X = mhc.expand(y, X_in if X is None else X, post, comb)
    pre2, post2, comb2 = s.hc_ffn(X)
    return X, rms_norm(mhc.collapse(pre, X), s.ffn_norm, eps), pre2, post2, comb2, stream_mean
  cache_l, got, aux, shared = s.attn(token_fn(pre_attn_single_pass, X, pre_prev, engram_hash), ctx, cache_l,
                                     kernel_cfg, collect_aux, shared, tail=token_fn(pre_ffn_single_pass, X))
  X, u, pre2, post2, comb2, stream_mean = _batch_of_one(got)
  if tap_stream:
    aux = dict(aux, stream_mean=stream_mean[0])
  X = _batch_of_one(s.ffn(u, tokens, live, kernel_cfg, tail=token_fn(mhc.expand, X, post2, comb2)))
  return cache_l, X, pre2, aux, shared


def token_fn(fn, *xs) -> row_invariant.RowFn:
  """`fn` as a `row_invariant.RowFn` over xs ([1, N, ...] arrays; None leaves pass through): like `token_rows`, fn
  runs on [1, rows, ...] blocks. As a sublayer's input (made in its first loop, never stored) fn returns (the input
  rows, carry), and carry's rows go on to the sublayer's tail as its last argument; as a tail its first argument is
  the sublayer's output rows. The sublayer returns the tail's outputs over the flat tokens ([N, ...];
  `_batch_of_one` puts the batch axis back)."""
  def on_block(*blocks):
    got = fn(*jax.tree_util.tree_map(lambda a: a[None], blocks))
    return jax.tree_util.tree_map(lambda a: a[0], got)
  return row_invariant.RowFn(on_block, tuple(jax.tree_util.tree_map(lambda a: a[0], xs)))


def rows_around(core, x, tail, live):
  """A sublayer with no row loop of its own (core: [N, D] -> [N, D] at once) between the block's input rows `x` (an
  array, or a `RowFn` as `token_fn` describes) and its `tail`: the input made in one loop, core, then the tail
  (with the input's carry) in another."""
  head = x if isinstance(x, row_invariant.RowFn) else row_invariant.RowFn(lambda x: (x, None), (x,))
  rows, carry = row_invariant.run_rows(head, live)
  y = core(rows)
  if tail is None:
    return y
  return row_invariant.run_rows(row_invariant.RowFn(tail.fn, (y, *tail.args) + (() if carry is None else (carry,))),
                                live)


def _batch_of_one(tree):
  return jax.tree_util.tree_map(lambda a: a[None], tree)


def token_rows(fn, live, *xs):
  """`row_invariant.map_row_blocks` for the per-token parts of a block, whose arrays carry the flat tokens as T of
  a batch of one ([1, N, ...]; None leaves pass through): fn runs on [1, rows, ...] blocks of the live tokens."""
  return _batch_of_one(row_invariant.run_rows(token_fn(fn, *xs), live))


def _block(params_l, config: ModelConfig, plan: LayerPlan, X, tokens, ctx, cache_l, kernel_cfg, collect_aux):
  """V4 block on a layer's param dict: `block_forward` of its `layer_sublayers`."""
  return block_forward(layer_sublayers(params_l, config, plan), config, X, tokens, ctx, cache_l, kernel_cfg,
                       collect_aux)


def _block_single_pass(params_l, config: ModelConfig, plan: LayerPlan, X, pre_prev, tokens, ctx, cache_l, kernel_cfg,
                       collect_aux, shared, engram_hash):
  """V4.1 block on a layer's param dict (docs/model.md): `block_forward` of its `layer_sublayers`."""
  return block_forward(layer_sublayers(params_l, config, plan), config, X, tokens, ctx, cache_l, kernel_cfg,
                       collect_aux, pre_prev=pre_prev, shared=shared, engram_hash=engram_hash)


def forward_ragged_aux(params, config: ModelConfig, tokens_N, cache: caches.ModelCache, step: caches.StepIndex, *,
                       layout: caches.CacheLayout = caches.CacheLayout(),
                       kernel_cfg: dispatch.KernelConfig = dispatch.KernelConfig(), collect_aux: bool = False,
                       blocks: Sequence[Callable] | None = None, hc_head: Callable | None = None,
                       return_stream: bool = False, tap_states: bool = False, dspark_taps: bool = False):
  """`forward_ragged` plus a per-layer aux list (indexer picks [N,k], scores [N,M] when collect_aux).
  return_stream (V4): also the last block's streams X_1xNxnxD (what an MTP block reads), as a 4th result.
  dspark_taps (V4.1): the aux of each layer in `dspark.target_layer_ids` holds "stream_mean" (its DSpark feature).
  tap_states: each pooling layer's aux also holds every token's compressor state rows (`store_states` writes the
  ones a speculative step accepted).

  blocks: one callable per layer, `block(X, tokens, ctx, cache_l, kernel_cfg, collect_aux)` (V4) or with the
  keywords `pre_prev`, `shared`, `engram_hash` (V4.1), returning what `block_forward` returns; hc_head (V4): the
  final mHC collapse, X -> h. None (the default) = `block_forward` of each layer's params, `mhc.hc_head` of
  params["hc_head"]. The NNX model (`dsv4.nnx_model.Model`) passes its own modules here; params then needs only
  the top-level arrays (embed, norm, engram_token_map)."""
  ctx = StepContext.from_step(step, layout, tap_state=tap_states, invariant=step.invariant)
  tokens = jnp.clip(tokens_N.astype(jnp.int32), 0, config.vocab_size - 1)[None]  # range is checked by the callers
  # Host (numpy) params, as an eager call from a notebook passes them: the row-invariant ops index them with
  # traced values inside their loops. Under jit (the engine) the leaves are tracers already: nothing happens.
  params = jax.tree_util.tree_map(jnp.asarray, params)
  plans = config.layer_plan()
  if blocks is None:
    blocks = [functools.partial(block_forward, layer_sublayers(params_l, config, plan), config)
              for plan, params_l in zip(plans, params["layers"])]
  if len(blocks) != len(plans):
    raise ValueError(f"forward_ragged_aux: {len(blocks)} blocks for {len(plans)} layers")
  # The flat axis rides as T of a batch of one through the per-token layers (mHC, MoE, Engram).
  # the embedding rows of the live tokens only (a row-block loop), not of the whole token budget
  h = token_rows(lambda t: params["embed"][t], ctx.live, tokens)
  h = mesh_context.constrain_batch(h)  # no-op without a mesh (dsv4/mesh_context.py)
  X = jnp.broadcast_to(h[:, :, None, :], (*h.shape[:2], config.mhc.hc_mult, h.shape[-1]))
  new_layers, auxes = [], []
  if config.single_pass_mhc:
    layers_in = list(cache.layers)
    hashes = None
    if config.engram.layer_ids:
      layers_in[config.engram.layer_ids[0]], hashes = _engram_hashes(params, config, tokens[0], ctx, layers_in)
    pre = jnp.zeros((*h.shape[:2], config.mhc.hc_mult), jnp.float32).at[..., 0].set(1.0)
    shared = None
    for plan, block, cache_l in zip(plans, blocks, layers_in):
      eh = hashes[None, :, config.engram.layer_ids.index(plan.index)] if plan.engram else None
      tap = {"tap_stream": True} if dspark_taps and plan.index in config.dspark.target_layer_ids else {}
      cache_l, X, pre, aux, shared = block(X, tokens, ctx, cache_l, kernel_cfg, collect_aux, pre_prev=pre,
                                           shared=shared, engram_hash=eh, **tap)
      new_layers.append(cache_l)
      auxes.append(aux)
    h = token_rows(mhc.collapse, ctx.live, pre, X)
  else:
    for block, cache_l in zip(blocks, cache.layers):
      cache_l, X, aux = block(X, tokens, ctx, cache_l, kernel_cfg, collect_aux)
      new_layers.append(cache_l)
      auxes.append(aux)
    h = token_rows(hc_head if hc_head is not None
                   else lambda X: mhc.hc_head(params["hc_head"], X, config.mhc, config.rms_norm_eps), ctx.live, X)
  h = token_rows(lambda h: rms_norm(h, params["norm"], config.rms_norm_eps), ctx.live, h)[0]
  # the MTP blocks' cache layers (after the backbone's) pass through untouched: `mtp_forward` writes them
  new_cache = caches.ModelCache(tuple(new_layers) + tuple(cache.layers[len(new_layers):]))
  if return_stream:
    if config.single_pass_mhc:
      raise ValueError("return_stream: V4 only (V4.1 drafts with DSpark: dspark_taps)")
    return new_cache, h, auxes, X
  return new_cache, h, auxes


# The running-pool state pools of a layer and the aux keys their per-token rows are tapped under.
_STATE_TAPS = (("comp_state", "comp_state_rows"), ("index_state", "index_state_rows"))
STATE_TAP_KEYS = tuple(key for _, key in _STATE_TAPS)


def store_states(cache: caches.ModelCache, auxes, step: caches.StepIndex, keep_N, *,
                 layout: caches.CacheLayout = caches.CacheLayout()) -> caches.ModelCache:
  """Writes the compressor state rows of the tokens in keep_N (from a `tap_states` forward of the same step) into
  their swa blocks' state rows: after a speculative verification, the state at each row's last accepted position
  replaces the one the forward left there (the state after the row's last token, maybe a rejected draft)."""
  ctx = StepContext.from_step(step, layout)
  slots = ctx.state_slots(ctx.pos_N, ctx.valid_N & keep_N)[:, None]
  layers = list(cache.layers)
  for l, aux in enumerate(auxes):
    for pool, key in _STATE_TAPS:
      if key in aux and pool in layers[l]:
        layers[l] = dict(layers[l], **{pool: caches.write_rows(layers[l][pool], slots, aux[key][:, None])})
  return caches.ModelCache(tuple(layers))


def mtp_forward(params, config: ModelConfig, depth: int, X_1xNxnxD, next_tokens_N, cache: caches.ModelCache,
                step: caches.StepIndex, *, layout: caches.CacheLayout = caches.CacheLayout(),
                kernel_cfg: dispatch.KernelConfig = dispatch.KernelConfig()):
  """MTP block `depth` on one ragged step: at each position t it fuses the previous stream (the backbone's last
  block, or depth - 1's output) with the embedding of the token at t + 1 and runs its window-only block, writing
  its own window KV at t (cache layer num_layers + depth). Returns (cache, X_1xNxnxD for the next depth,
  final-norm hidden_NxD whose `lm_logits` predict the token at t + 1 + depth + 1)."""
  if not 0 <= depth < config.num_mtp_layers:
    raise ValueError(f"mtp_forward: depth {depth} but the config has {config.num_mtp_layers} MTP block(s) "
                     f"(num_mtp_layers)")
  pm = params["mtp"][depth]
  plan = config.mtp_plans()[depth]
  parts = MTPParts(pm["e_proj"], pm["h_proj"], pm["enorm"], pm["hnorm"], layer_sublayers(pm, config, plan),
                   functools.partial(mhc.hc_head, pm["hc_head"], cfg=config.mhc, norm_eps=config.rms_norm_eps),
                   pm["norm"])
  return mtp_block_forward(parts, config, plan, params["embed"], X_1xNxnxD, next_tokens_N, cache, step,
                           layout=layout, kernel_cfg=kernel_cfg)


class MTPParts(NamedTuple):
  """One MTP block's parts as `mtp_block_forward` calls them (the functional model binds its params;
  `nnx_model.MTPBlock` hands over its own modules)."""
  e_proj: jax.Array       # [D, D]
  h_proj: jax.Array       # [D, D]
  enorm: jax.Array        # [D]
  hnorm: jax.Array        # [D]
  block: Sublayers        # the window-only block
  hc_head: Callable       # X_BxTxNxD -> h_BxTxD (the block's own final collapse)
  norm: jax.Array         # [D]


def mtp_block_forward(parts: MTPParts, config: ModelConfig, plan: LayerPlan, embed_VxD, X_1xNxnxD, next_tokens_N,
                      cache: caches.ModelCache, step: caches.StepIndex, *,
                      layout: caches.CacheLayout = caches.CacheLayout(),
                      kernel_cfg: dispatch.KernelConfig = dispatch.KernelConfig()):
  """The MTP wiring (see `mtp_forward`): e_proj(enorm(embed[next])) + h_proj(hnorm(X)) per stream, the block, the
  block's own hc_head and norm."""
  eps = config.rms_norm_eps
  ctx = StepContext.from_step(step, layout)
  tokens = jnp.clip(next_tokens_N.astype(jnp.int32), 0, config.vocab_size - 1)[None]

  def fuse(emb, X):
    e = jnp.dot(rms_norm(emb, parts.enorm, eps), parts.e_proj)
    return e[:, :, None, :] + jnp.dot(rms_norm(X, parts.hnorm, eps), parts.h_proj)
  X = token_rows(fuse, ctx.live, embed_VxD[tokens], X_1xNxnxD)
  layers = list(cache.layers)
  layers[plan.index], X, _ = block_forward(parts.block, config, X, tokens, ctx, layers[plan.index], kernel_cfg,
                                           False)
  h = token_rows(lambda X: rms_norm(parts.hc_head(X), parts.norm, eps), ctx.live, X)[0]
  return caches.ModelCache(tuple(layers)), X, h


def forward_ragged(params, config: ModelConfig, tokens_N, cache: caches.ModelCache, step: caches.StepIndex, *,
                   layout: caches.CacheLayout = caches.CacheLayout(),
                   kernel_cfg: dispatch.KernelConfig = dispatch.KernelConfig()):
  """One ragged serving step (see `caches.StepIndex`): returns (new cache, final-norm hidden_NxD).

  Logits of chosen tokens: `lm_logits(params, hidden[idx])` (a server needs only each row's last token)."""
  cache, h, _ = forward_ragged_aux(params, config, tokens_N, cache, step, layout=layout, kernel_cfg=kernel_cfg)
  return cache, h


def lm_logits(params, h_Nx_D):
  """fp32 logits whatever the compute dtype (fp32 accumulation)."""
  return jnp.dot(h_Nx_D, params["lm_head"], precision=jax.lax.Precision.HIGHEST,
                 preferred_element_type=jnp.float32)


def cast_params(params, dtype):
  """Parameters in a compute dtype (e.g. jnp.bfloat16): the model then runs its activations in that dtype (the
  embedding's), with fp32 norms, softmaxes (attention, compressor pooling, mHC Sinkhorn, router) and fp32 logits;
  matmuls take bf16 operands and accumulate in fp32 (XLA's CPU and GPU dots do). Integer leaves are unchanged.
  `cast_params(params, jnp.float32)` of fp32 params is the identity (today's results bit for bit)."""
  return jax.tree_util.tree_map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


@functools.partial(jax.jit, static_argnames=("config", "layout", "kernel_cfg"), donate_argnames=("cache",))
def forward_ragged_jit(params, config, tokens_N, cache, step, layout=caches.CacheLayout(),
                       kernel_cfg=dispatch.KernelConfig()):
  return forward_ragged(params, config, tokens_N, cache, step, layout=layout, kernel_cfg=kernel_cfg)


def forward_aux(params, config: ModelConfig, tokens_BxT, cache: caches.ModelCache, index: caches.BatchIndex, *,
                layout: caches.CacheLayout = caches.CacheLayout(),
                kernel_cfg: dispatch.KernelConfig = dispatch.KernelConfig(), collect_aux: bool = False,
                return_hidden: bool = False, blocks: Sequence[Callable] | None = None,
                hc_head: Callable | None = None):
  """Like `forward`, plus a per-layer aux list (indexer picks [B,T,k] and scores [B,T,M] when collect_aux).
  blocks / hc_head: as `forward_ragged_aux` (None = the functional blocks on params).

  The padded [B, T] layout is a ragged step whose flat token b*T + t is row b's token t (padding: t >= num)."""
  B, T = tokens_BxT.shape
  step = caches.step_index_from_batch(index, T)
  cache, h, auxes = forward_ragged_aux(params, config, tokens_BxT.reshape(B * T), cache, step, layout=layout,
                                       kernel_cfg=kernel_cfg, collect_aux=collect_aux, blocks=blocks,
                                       hc_head=hc_head)
  h = h.reshape(B, T, -1)
  auxes = [{k: v.reshape(B, T, *v.shape[1:]) for k, v in aux.items()} for aux in auxes]
  if return_hidden:
    return cache, h, auxes
  return cache, lm_logits(params, h), auxes


def forward(params, config: ModelConfig, tokens_BxT, cache: caches.ModelCache, index: caches.BatchIndex, *,
            layout: caches.CacheLayout = caches.CacheLayout(),
            kernel_cfg: dispatch.KernelConfig = dispatch.KernelConfig()):
  """One step: returns (new cache, logits_BxTxV)."""
  cache, logits, _ = forward_aux(params, config, tokens_BxT, cache, index, layout=layout, kernel_cfg=kernel_cfg)
  return cache, logits


@functools.partial(jax.jit, static_argnames=("config", "layout", "kernel_cfg"), donate_argnames=("cache",))
def forward_jit(params, config, tokens_BxT, cache, index, layout=caches.CacheLayout(),
                kernel_cfg=dispatch.KernelConfig()):
  return forward(params, config, tokens_BxT, cache, index, layout=layout, kernel_cfg=kernel_cfg)


def check_tokens(tokens_BxT, config: ModelConfig) -> np.ndarray:
  """Host-side validation for concrete inputs (the jitted step clips ids, so bad ids must be caught before it)."""
  toks = np.asarray(tokens_BxT)
  if toks.ndim != 2:
    raise ValueError(f"tokens: expected shape [batch, seq], got {toks.shape}")
  if not np.issubdtype(toks.dtype, np.integer):
    raise ValueError(f"tokens: expected integer token ids, got dtype {toks.dtype}")
  bad = (toks < 0) | (toks >= config.vocab_size)
  if bad.any():
    b, t = np.argwhere(bad)[0]
    raise ValueError(f"tokens: id {int(toks[b, t])} at [{b}, {t}] is out of range [0, {config.vocab_size})")
  if toks.shape[1] > config.max_position_embeddings:
    raise ValueError(f"tokens: {toks.shape[1]} positions exceed max_position_embeddings "
                     f"({config.max_position_embeddings})")
  return toks


def forward_full(params, config: ModelConfig, tokens_BxT, lengths_B=None, *,
                 layout: caches.CacheLayout = caches.CacheLayout(),
                 kernel_cfg: dispatch.KernelConfig = dispatch.KernelConfig()):
  """No-cache convenience: prefill whole sequences into a fresh contiguous cache; returns (cache, logits)."""
  tokens_BxT = jnp.asarray(check_tokens(tokens_BxT, config), jnp.int32)
  B, T = tokens_BxT.shape
  cache, swa, full = caches.init_contiguous(config, B, T, layout)
  lengths = jnp.full((B,), T, jnp.int32) if lengths_B is None else jnp.asarray(lengths_B, jnp.int32)
  index = caches.BatchIndex(jnp.zeros((B,), jnp.int32), lengths, jnp.asarray(swa), jnp.asarray(full))
  return forward_jit(params, config, tokens_BxT, cache, index, layout, kernel_cfg)
