"""The DeepSeek-V4 / V4.1 model as Flax NNX modules that own the parameters and their logical axes and execute:
each block calls its own sub-modules, so replacing or editing a module changes what the model (and the engine)
computes.

    net = nnx_model.Model.init(config, jax.random.PRNGKey(0))      # == model.init_params(config, key), as modules
    net = nnx_model.merge(config, params)                          # or around a loaded checkpoint's dict
    cache, logits = net(tokens_BxT, cache, index)                  # == model.forward, bit for bit
    net.layers[3].attn = net.layers[3].attn.with_config(small_topk_config)   # this layer now selects fewer entries
    engine = Engine(net, config, EngineConfig(model_api="nnx"))    # the engine runs `net` (edits count next step)

Why NNX: it is Flax's main API, MaxText's DeepSeek-V4 code is NNX, and its
modules are plain Python objects whose state splits into a pytree, so the explicit-cache style of `dsv4.model`
carries over unchanged. Linen would keep caches in mutable collections, which is exactly what we avoid: the caches
stay explicit pytrees passed in and returned (`(new_cache, out)`), never nnx Variables.

What the modules are, and are not:
* One module per layer kind (`Attention` with its `Compressor` / `Indexer` sub-modules as the param dict nests
  them, `MoE` with `RoutedExperts` / `SharedExpert`, `HyperConnection` (mHC; `HeadConnection` for V4's `hc_head`),
  `Engram`, `Block`, `Model` with its `nnx.List` of blocks). Attribute names are exactly the keys of
  `model.param_shapes(config)`, so `nnx.to_pure_dict(nnx.split(net)[1])` is today's dict (the layer list
  appears as an int-keyed dict there; `params_of` turns it back into a list). RMSNorm weights stay `nnx.Param`s
  on their parent (`attn_norm`, `q_norm`, ...): a norm module would add a level (`attn_norm/weight`) and change
  the checkpoint spelling.
* Every `nnx.Param` carries its logical axes as Flax's `out_sharding` metadata: the `axes` its `ParamSpec` in
  `model.param_shapes` declares beside its shape (one declaration). `eager_sharding=False`: placement is done by
  `sharding.Rules` (with its divisibility fallbacks), see `partition_specs`.
* Values (shapes, dtypes, init) come from `model.init_params` / a loaded checkpoint: a module is built from a param
  dict, never re-initialised by its own rule, so `Model.init(config, key)` equals `model.init_params(config, key)`.
* Each module keeps its own `config` and `plan` (static, part of the graphdef): `with_config` gives the same
  weights under another config (e.g. a smaller indexer top-k for one layer's `Attention`).
* One implementation of the math and of the wiring. Leaf modules (`Attention`, `MoE`, `HyperConnection`,
  `HeadConnection`, `Engram`) run the `dsv4.layers` functions on their own parameters, config and plan. `Block`
  runs `model.block_forward` (the block wiring the functional model uses too) over its own sub-modules, and
  `Model` runs `model.forward_ragged_aux`'s layer loop over its own `Block`s and `hc_head` (its `blocks` /
  `hc_head` arguments). With unedited modules the traced program is the functional model's, op for op.
  A block hands `Attention` and `MoE` its mHC work around them as row functions they run in their own loops
  (`model.Sublayers`): an edit of their output rows goes through `row_invariant.tail_after`.
* The engine's step (`dsv4.engine.runner.ragged_step`, model_api="nnx") takes the `nnx.split` of the runner's
  module: the state is the traced argument, the graphdef a static one (a changed module is a new graphdef, so
  its own compiled program), and `nnx.merge` inside the jit rebuilds the module that runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dsv4 import caches, model, sharding
from dsv4.config import LayerPlan, ModelConfig
from dsv4.layers import engram as engram_mod
from dsv4.layers import mhc, moe
from dsv4.layers.attention import attention_layer, attention_layer_shared
from pallas_kernels import dispatch


# ----------------------------------------------------------------------------------------------------------
# Plain dict <-> module state

def _int_dicts_to_lists(tree):
  if isinstance(tree, dict):
    out = {k: _int_dicts_to_lists(v) for k, v in tree.items()}
    if out and all(isinstance(k, int) for k in out):
      return [out[i] for i in range(len(out))]
    return out
  return tree


def params_of(module_or_state) -> dict:
  """The parameters of a module (or of its `nnx.state`) as the plain nested dict `dsv4.model` takes."""
  state = module_or_state if isinstance(module_or_state, nnx.State) else nnx.state(module_or_state, nnx.Param)
  return _int_dicts_to_lists(nnx.to_pure_dict(state))


# ----------------------------------------------------------------------------------------------------------
# Modules

class _ParamTree(nnx.Module):
  """Builds attributes from one subtree of the param dict: nested dicts become the sub-module classes named in
  `_children` (a key missing there is a bug: every dict of `param_shapes` has its module), arrays become
  `nnx.Param`s whose `out_sharding` metadata is the logical axes their `model.ParamSpec` declares. `specs`: the
  matching subtree of `model.param_shapes(config)` (looked up by `path` when not given)."""
  _children: dict = {}

  def __init__(self, config: ModelConfig, plan: LayerPlan | None, tree: dict, path: tuple[str, ...],
               specs: dict | None = None):
    self.config, self.plan, self.path = config, plan, tuple(path)
    specs = model.param_spec_at(config, path) if specs is None else specs
    for key, value in tree.items():
      if isinstance(value, dict):
        if key not in self._children:
          raise ValueError(f"nnx_model: {type(self).__name__} has no sub-module for {'/'.join(path + (key,))}")
        setattr(self, key, self._children[key](config, plan, value, path + (key,), specs[key]))
      else:
        axes = specs[key].axes
        if len(axes) != value.ndim:
          raise ValueError(f"nnx_model: {'/'.join(path + (key,))} has shape {value.shape} but axes {axes}")
        setattr(self, key, nnx.Param(value, out_sharding=axes, eager_sharding=False))

  def param_dict(self) -> dict:
    return params_of(self)

  def with_config(self, config: ModelConfig) -> "_ParamTree":
    """A new module of this class holding the same parameter arrays that runs with `config` (its sub-modules
    too), e.g. `attn.with_config(dataclasses.replace(cfg, indexer=dataclasses.replace(cfg.indexer, topk=4)))`.
    The parameter shapes must still be those of `config`."""
    return type(self)(config, self.plan, self.param_dict(), self.path)


class Compressor(_ParamTree):
  """KV (or index-key) compressor: wkv, norm, optional wgate / ape. Run inside `attention_layer`."""


class Indexer(_ParamTree):
  """Lightning indexer: wq_b, weights_proj, and its own compressor (CSA) or wk / k_norm (V4.1 CSA2)."""
  _children = {"compressor": Compressor}


class HyperConnection(_ParamTree):
  """mHC mixing parameters (fn, base, scale); the call gives (pre, post, comb) of `mhc.hc_coefficients`."""

  def __call__(self, X_BxTxNxD):
    return mhc.hc_coefficients(self.param_dict(), X_BxTxNxD, self.config.mhc, self.config.rms_norm_eps)


class HeadConnection(_ParamTree):
  """V4's final mHC collapse before the last norm (`hc_head`: fn, base, scale); the call is `mhc.hc_head`."""

  def __call__(self, X_BxTxNxD):
    return mhc.hc_head(self.param_dict(), X_BxTxNxD, self.config.mhc, self.config.rms_norm_eps)


class Attention(_ParamTree):
  """Sliding window / CSA / HCA / CSA2 attention of one layer (`dsv4.layers.attention`).

  Inside a block its input comes as rows to make in its projection loop and its output rows go through the block's
  `tail` in its last loop (`model.Sublayers`), so it returns the tail's outputs. An edited module changes its
  output rows by passing `row_invariant.tail_after(f, tail)` on to this call (f row-local: `lambda y: 2.0 * y`);
  work across rows takes the whole arrays through `model.rows_around`."""
  _children = {"compressor": Compressor, "indexer": Indexer}

  def __call__(self, x_NxD, ctx, cache_layer: dict, kernel_cfg=dispatch.KernelConfig(), collect_aux=False,
               shared=None, tail=None):
    """V4: (cache_layer, y, aux); V4.1 (`single_pass_mhc`): (cache_layer, y, aux, shared) as
    `attention_layer_shared` (the indexer picks shared with the next layers). tail: as `attention_layer_shared`."""
    if self.config.single_pass_mhc:
      return attention_layer_shared(self.param_dict(), self.config, self.plan, x_NxD, ctx, cache_layer, kernel_cfg,
                                    collect_aux, shared, tail=tail)
    return attention_layer(self.param_dict(), self.config, self.plan, x_NxD, ctx, cache_layer, kernel_cfg,
                           collect_aux, tail=tail)


class RoutedExperts(_ParamTree):
  """Routed experts w1 / w3 / w2 stacked over the expert axis (dense; the loader's packed FP4 form is refused)."""


class SharedExpert(_ParamTree):
  """The shared SwiGLU expert."""


class MoE(_ParamTree):
  """Router (gate + bias, or hash table tid2eid) and experts; the call is `moe.moe`. Inside a block its output rows
  go through the block's `tail` (as `Attention`'s)."""
  _children = {"experts": RoutedExperts, "shared": SharedExpert}

  def __call__(self, x_BxTxD, token_ids_BxT, live=None, kernel_cfg=None, tail=None):
    return moe.moe(self.param_dict(), x_BxTxD, token_ids_BxT, self.config.moe, self.plan.hash_moe, live, kernel_cfg,
                   tail)


class Engram(_ParamTree):
  """V4.1 Engram memory (hashed n-gram tables + gated read); the call is `engram.engram`."""

  def __call__(self, X_BxTxNxD, hash_BxTxH):
    return engram_mod.engram(self.param_dict(), X_BxTxNxD, hash_BxTxH, self.config.rms_norm_eps)


class Block(_ParamTree):
  """One transformer block: attention + MoE with mHC (+ Engram in V4.1). The call is `model.block_forward` (the
  block wiring the functional model runs too) over this block's own sub-modules: `hc_attn`, `attn`, `hc_ffn`,
  `ffn`, `engram` and the norm weights. Replacing a sub-module (`blk.attn = ...`) changes what the block runs."""
  _children = {"attn": Attention, "ffn": MoE, "hc_attn": HyperConnection, "hc_ffn": HyperConnection,
               "engram": Engram}

  def sublayers(self) -> model.Sublayers:
    return model.Sublayers(hc_attn=self.hc_attn, attn_norm=self.attn_norm[...], attn=self.attn,
                           hc_ffn=self.hc_ffn, ffn_norm=self.ffn_norm[...], ffn=self.ffn,
                           engram=getattr(self, "engram", None))

  def __call__(self, X, tokens, ctx, cache_layer, kernel_cfg=dispatch.KernelConfig(), collect_aux=False, *,
               pre_prev=None, shared=None, engram_hash=None):
    """V4: (cache_layer, X, aux); V4.1: (cache_layer, X, pre, aux, shared), as `model.block_forward`."""
    return model.block_forward(self.sublayers(), self.config, X, tokens, ctx, cache_layer, kernel_cfg, collect_aux,
                               pre_prev=pre_prev, shared=shared, engram_hash=engram_hash)


class MTPBlock(Block):
  """One MTP block (V4): a `Block` plus its input fusion (`e_proj`, `h_proj`, `enorm`, `hnorm`) and its own final
  collapse (`hc_head`) and `norm`. Its call is `model.mtp_block_forward` over these modules."""
  _children = {**Block._children, "hc_head": HeadConnection}

  def __call__(self, embed_VxD, X_1xNxnxD, next_tokens_N, cache: caches.ModelCache, step: caches.StepIndex, *,
               layout: caches.CacheLayout = caches.CacheLayout(),
               kernel_cfg: dispatch.KernelConfig = dispatch.KernelConfig()):
    parts = model.MTPParts(self.e_proj[...], self.h_proj[...], self.enorm[...], self.hnorm[...], self.sublayers(),
                           self.hc_head, self.norm[...])
    return model.mtp_block_forward(parts, self.config, self.plan, embed_VxD, X_1xNxnxD, next_tokens_N, cache, step,
                                   layout=layout, kernel_cfg=kernel_cfg)


class Model(_ParamTree):
  """The whole text model: embed, blocks, final norm, lm_head (+ hc_head for V4, engram_token_map for V4.1).
  Its calls run `model.forward_ragged_aux`'s layer loop over this model's own `Block` modules (and `hc_head`)."""
  _children = {"hc_head": HeadConnection}

  def __init__(self, config: ModelConfig, params: dict):
    _check_tree(config, params)
    specs = model.param_shapes(config)
    top = {k: v for k, v in params.items() if k not in ("layers", "mtp")}
    super().__init__(config, None, top, (), specs)
    self.layers = nnx.List([Block(config, plan, p, ("layers", str(plan.index)), specs["layers"][plan.index])
                            for plan, p in zip(config.layer_plan(), params["layers"])])
    if config.num_mtp_layers:
      self.mtp = nnx.List([MTPBlock(config, plan, p, ("mtp", str(d)), specs["mtp"][d])
                           for d, (plan, p) in enumerate(zip(config.mtp_plans(), params["mtp"]))])

  @classmethod
  def init(cls, config: ModelConfig, key: jax.Array, scale: float = 1.0) -> "Model":
    """Random parameters exactly as `model.init_params(config, key, scale)`."""
    return cls(config, model.init_params(config, key, scale))

  def with_config(self, config: ModelConfig) -> "Model":
    """A new Model of `config` holding this model's parameter arrays (every module rebuilt)."""
    return type(self)(config, self.param_dict())

  def _top(self) -> dict:
    """The model's own arrays (embed, norm, lm_head, engram_token_map), as `dsv4.model` reads them."""
    return {k: v[...] for k, v in vars(self).items() if isinstance(v, nnx.Param)}

  def _hooks(self) -> dict:
    return {"blocks": list(self.layers), "hc_head": getattr(self, "hc_head", None)}

  def __call__(self, tokens_BxT, cache: caches.ModelCache, index: caches.BatchIndex, *,
               layout: caches.CacheLayout = caches.CacheLayout(),
               kernel_cfg: dispatch.KernelConfig = dispatch.KernelConfig()):
    """(new cache, logits_BxTxV): `model.forward`'s step with this model's modules."""
    cache, logits, _ = model.forward_aux(self._top(), self.config, tokens_BxT, cache, index, layout=layout,
                                         kernel_cfg=kernel_cfg, **self._hooks())
    return cache, logits

  def ragged(self, tokens_N, cache: caches.ModelCache, step: caches.StepIndex, *,
             layout: caches.CacheLayout = caches.CacheLayout(),
             kernel_cfg: dispatch.KernelConfig = dispatch.KernelConfig(), collect_aux: bool = False):
    """(new cache, final-norm hidden_NxD) of one ragged step (the engine's step shape, `model.forward_ragged`) with
    this model's modules; with collect_aux also the per-layer aux list."""
    cache, h, auxes = model.forward_ragged_aux(self._top(), self.config, tokens_N, cache, step, layout=layout,
                                               kernel_cfg=kernel_cfg, collect_aux=collect_aux, **self._hooks())
    return (cache, h, auxes) if collect_aux else (cache, h)

  def logits(self, h_NxD):
    """fp32 logits of final-norm hidden states (`model.lm_logits` with this model's lm_head)."""
    return model.lm_logits({"lm_head": self.lm_head[...]}, h_NxD)


def _check_tree(config: ModelConfig, params: dict) -> None:
  """A clear error (before any module is built) when `params` is not the dense tree of `param_shapes(config)`."""
  want = model.param_shapes(config)
  want_def = jax.tree_util.tree_structure(want, is_leaf=model.is_param_spec)
  got_def = jax.tree_util.tree_structure(params)
  if want_def != got_def:
    raise ValueError("nnx_model: the parameter tree is not the one of model.param_shapes(config) (packed FP4 "
                     f"experts must be dequantized first, expert_quant.dense_experts); expected {want_def}, "
                     f"got {got_def}")
  for (path, spec), x in zip(jax.tree_util.tree_flatten_with_path(want, is_leaf=model.is_param_spec)[0],
                             jax.tree_util.tree_leaves(params)):
    # Floating leaves may be in another float dtype (`model.cast_params`, the engine's bf16 compute dtype).
    same_kind = jnp.dtype(x.dtype) == jnp.dtype(spec.dtype) or (jnp.issubdtype(x.dtype, jnp.floating)
                                                              and jnp.issubdtype(spec.dtype, jnp.floating))
    if tuple(x.shape) != tuple(spec.shape) or not same_kind:
      raise ValueError(f"nnx_model: {jax.tree_util.keystr(path)} is {x.dtype}{list(x.shape)}, expected "
                       f"{jnp.dtype(spec.dtype)}{list(spec.shape)}")


# ----------------------------------------------------------------------------------------------------------
# Pure application

@functools.lru_cache(maxsize=16)
def abstract_model(config: ModelConfig):
  """(graphdef, abstract state) of `Model` for `config`: shapes, dtypes and axis metadata, no weights allocated
  (works at full Flash size). Cached per config: `apply` merges it with concrete params."""
  net = nnx.eval_shape(lambda: Model.init(config, jax.random.PRNGKey(0)))
  return nnx.split(net)


def state_from_params(config: ModelConfig, params: dict) -> nnx.State:
  """An `nnx.State` (Params with their axis metadata) holding `params`' arrays, ready for `nnx.merge`."""
  _check_tree(config, params)
  _, abstract = abstract_model(config)
  def at(path):
    x = params
    for k in path:
      x = x[k]
    return x
  # Fresh Variables (`replace`), so the cached abstract state never holds the caller's arrays or tracers.
  return nnx.from_flat_state([(path, v.replace(at(path))) for path, v in nnx.to_flat_state(abstract)])


def merge(config: ModelConfig, params: dict) -> Model:
  """The `Model` holding `params` (e.g. a checkpoint loaded by `dsv4.loading`), without re-initialising."""
  graphdef, _ = abstract_model(config)
  return nnx.merge(graphdef, state_from_params(config, params))


def apply(params: dict, tokens_BxT, cache: caches.ModelCache, index: caches.BatchIndex, *, config: ModelConfig,
          layout: caches.CacheLayout = caches.CacheLayout(),
          kernel_cfg: dispatch.KernelConfig = dispatch.KernelConfig()):
  """Pure: `nnx.merge` of the cached graphdef with `params`, then `Model.__call__`. Returns (cache, logits)."""
  return merge(config, params)(tokens_BxT, cache, index, layout=layout, kernel_cfg=kernel_cfg)


def apply_ragged(params: dict, tokens_N, cache: caches.ModelCache, step: caches.StepIndex, *, config: ModelConfig,
                 layout: caches.CacheLayout = caches.CacheLayout(),
                 kernel_cfg: dispatch.KernelConfig = dispatch.KernelConfig()):
  """Pure, the engine's step shape: (cache, final-norm hidden_NxD) of `Model.ragged` of `params` merged."""
  return merge(config, params).ragged(tokens_N, cache, step, layout=layout, kernel_cfg=kernel_cfg)


@functools.partial(jax.jit, static_argnames=("config", "layout", "kernel_cfg"), donate_argnames=("cache",))
def apply_jit(params, tokens_BxT, cache, index, *, config, layout=caches.CacheLayout(),
              kernel_cfg=dispatch.KernelConfig()):
  return apply(params, tokens_BxT, cache, index, config=config, layout=layout, kernel_cfg=kernel_cfg)


# ----------------------------------------------------------------------------------------------------------
# Shardings from the module metadata

def partition_specs(state_or_module, config: ModelConfig, mesh, rules: sharding.Rules = sharding.Rules(),
                    fallbacks: list | None = None) -> dict:
  """PartitionSpecs (plain dict in checkpoint spelling) from the Params' logical-axis metadata
  (`nnx.get_partition_spec`) mapped by `rules` with the same divisibility fallbacks as `sharding.param_specs`."""
  state = state_or_module if isinstance(state_or_module, nnx.State) else nnx.state(state_or_module, nnx.Param)
  logical = nnx.get_partition_spec(state)
  units = sharding._units(config)

  def one(path, v, lv):
    what = "/".join(str(getattr(k, "key", k)) for k in path)
    return v.replace(sharding.spec_for(tuple(lv.get_value()), tuple(v.get_value().shape), mesh, rules, units,
                                       fallbacks, what))

  specs = jax.tree_util.tree_map_with_path(one, state, logical, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return params_of(specs)
