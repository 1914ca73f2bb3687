"""Flax NNX modules of the model (dsv4/nnx_model.py): the module state is today's param dict, `apply` is
`model.forward` bit for bit, and the shardings from the modules' metadata are the ones `dsv4.sharding` computes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from dsv4 import caches, config, model, nnx_model, sharding
from dsv4.layers import engram as engram_mod
from dsv4.layers import mhc, moe, row_invariant
from pallas_kernels import dispatch

CONFIGS = {"v4": config.v4_tiny, "v41": config.v41_tiny}
_is_p = lambda x: isinstance(x, PartitionSpec)


def _paths(tree):
  return [(jax.tree_util.keystr(p), tuple(x.shape), jnp.dtype(x.dtype))
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _assert_same_arrays(got, want):
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  assert _paths(got) == _paths(want)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_module_state_is_the_param_dict(variant):
  """Model.init == model.init_params (paths, shapes, dtypes, values); nnx.split's state as a pure dict is the
  same tree (lists as int-keyed dicts); every Param carries the logical axes of sharding.param_logical_axes."""
  cfg = CONFIGS[variant]()
  key = jax.random.PRNGKey(3)
  want = model.init_params(cfg, key)
  net = nnx_model.Model.init(cfg, key)
  got = nnx_model.params_of(net)
  _assert_same_arrays(got, want)
  shapes = model.param_shapes(cfg)
  assert [(p, s, d) for p, s, d in _paths(got)] == [
      (jax.tree_util.keystr(p), spec.shape, jnp.dtype(spec.dtype))
      for p, spec in jax.tree_util.tree_flatten_with_path(shapes, is_leaf=model.is_param_spec)[0]]

  graphdef, state = nnx.split(net)
  pure = nnx.to_pure_dict(state)
  assert sorted(pure) == sorted(want) and sorted(pure["layers"]) == list(range(cfg.num_layers))
  for i, layer in enumerate(want["layers"]):
    _assert_same_arrays(nnx_model._int_dicts_to_lists(pure["layers"][i]), layer)

  axes = sharding.param_logical_axes(cfg)
  meta = nnx_model.params_of(jax.tree_util.tree_map(
      lambda v: v.replace(tuple(v.get_metadata()["out_sharding"])), state,
      is_leaf=lambda x: isinstance(x, nnx.Variable)))
  is_axes = lambda x: isinstance(x, tuple)
  assert jax.tree_util.tree_leaves(meta, is_leaf=is_axes) == jax.tree_util.tree_leaves(axes, is_leaf=is_axes)
  # merge of the split gives back a module with the same arrays
  _assert_same_arrays(nnx_model.params_of(nnx.merge(graphdef, state)), want)


@pytest.mark.parametrize("name", ["v4_count", "v41_retrieval"])
def test_shipped_checkpoint_round_trips_through_the_module(name):
  """Checkpoint loaded by the existing loader -> merged into the module -> split again = identical arrays."""
  from experiments import train_lib
  cfg, params = train_lib.load_trained(name)
  net = nnx_model.merge(cfg, params)
  _, state = nnx.split(net)
  _assert_same_arrays(nnx_model._int_dicts_to_lists(nnx.to_pure_dict(state)), params)
  _assert_same_arrays(nnx_model.params_of(net), params)


def _prefill_then_decode(step, params, cfg):
  """A ragged prefill (lengths 8 and 5) then one decode token per row. Both steps have T = 8 (the decode rows
  carry 1 real token each), so each path compiles once: XLA compile time dominates these tests."""
  B, T = 2, 8
  layout = caches.CacheLayout()
  cache, swa, full = caches.init_contiguous(cfg, B, 2 * T, layout)
  toks = jax.random.randint(jax.random.PRNGKey(7), (B, T), 0, cfg.vocab_size, jnp.int32)
  lengths = jnp.asarray([8, 5], jnp.int32)
  idx = caches.BatchIndex(jnp.zeros(B, jnp.int32), lengths, jnp.asarray(swa), jnp.asarray(full))
  cache1, logits1 = step(params, toks, cache, idx)
  nxt = jnp.argmax(logits1[jnp.arange(B), lengths - 1], -1).astype(jnp.int32)
  toks2 = jnp.zeros((B, T), jnp.int32).at[:, 0].set(nxt)
  idx2 = caches.BatchIndex(lengths, jnp.ones(B, jnp.int32), jnp.asarray(swa), jnp.asarray(full))
  cache2, logits2 = step(params, toks2, cache1, idx2)
  return cache2, logits1, logits2[:, 0]


@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_apply_equals_forward_bit_for_bit(variant):
  cfg = CONFIGS[variant]()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  ref = _prefill_then_decode(lambda p, t, c, i: model.forward_jit(p, cfg, t, c, i), params, cfg)
  got = _prefill_then_decode(lambda p, t, c, i: nnx_model.apply_jit(p, t, c, i, config=cfg), params, cfg)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert float(jnp.max(jnp.abs(ref[1]))) > 0  # the comparison is of real logits


def test_layer_module_calls_are_the_layer_functions():
  """MoE, mHC and Engram modules run the functions of dsv4.layers on their own params (V4.1 tiny has all three;
  V4 tiny has the hc_head)."""
  cfg = config.v41_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(1))
  net = nnx_model.merge(cfg, params)
  e = cfg.engram.layer_ids[0]
  blk, p = net.layers[e], params["layers"][e]
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(2), 3)
  X = jax.random.normal(k1, (1, 5, cfg.mhc.hc_mult, cfg.hidden_size), jnp.float32)
  tok = jax.random.randint(k2, (1, 5), 0, cfg.vocab_size, jnp.int32)
  x = X[:, :, 0]
  np.testing.assert_array_equal(blk.ffn(x, tok), moe.moe(p["ffn"], x, tok, cfg.moe, blk.plan.hash_moe))
  for a, b in zip(blk.hc_attn(X), mhc.hc_coefficients(p["hc_attn"], X, cfg.mhc, cfg.rms_norm_eps)):
    np.testing.assert_array_equal(a, b)
  v4 = config.v4_tiny()
  p4 = model.init_params(v4, jax.random.PRNGKey(1))
  X4 = jax.random.normal(k1, (1, 5, v4.mhc.hc_mult, v4.hidden_size), jnp.float32)
  np.testing.assert_array_equal(nnx_model.merge(v4, p4).hc_head(X4),
                                mhc.hc_head(p4["hc_head"], X4, v4.mhc, v4.rms_norm_eps))
  h = jax.random.randint(k3, (1, 5, cfg.engram.hash_heads), 0, p["engram"]["embed"].shape[0], jnp.int32)
  np.testing.assert_array_equal(blk.engram(X, h), engram_mod.engram(p["engram"], X, h, cfg.rms_norm_eps))


@pytest.mark.parametrize("preset", sorted(config.PRESETS))
def test_partition_specs_from_module_metadata_match_sharding(preset):
  """nnx.get_partition_spec on the abstract state (no weights) + the same Rules == sharding.param_specs, for
  every parameter, on meshes where heads / experts / vocab split and where some dims must fall back."""
  cfg = config.get_preset(preset)
  _, state = nnx_model.abstract_model(cfg)
  assert all(isinstance(v.get_value(), jax.ShapeDtypeStruct) for v in jax.tree_util.tree_leaves(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable)))
  for shape in [(2, 2, 2), (1, 8, 1), (1, 2, 4)]:
    mesh = jax.sharding.AbstractMesh(shape, sharding.AXES)
    for rules in [sharding.Rules(), sharding.Rules(kv_latent="feature")]:
      fb_got, fb_want = [], []
      got = nnx_model.partition_specs(state, cfg, mesh, rules, fb_got)
      want = sharding.param_specs(cfg, mesh, rules, fb_want)
      assert jax.tree_util.tree_structure(got, is_leaf=_is_p) == jax.tree_util.tree_structure(want, is_leaf=_is_p)
      assert jax.tree_util.tree_leaves(got, is_leaf=_is_p) == jax.tree_util.tree_leaves(want, is_leaf=_is_p)
      assert len(fb_got) == len(fb_want)
  # something is actually split (the comparison is not of all-replicated trees)
  assert any(any(e is not None for e in s) for s in jax.tree_util.tree_leaves(want, is_leaf=_is_p))


def test_a_tree_that_is_not_param_shapes_is_refused_clearly():
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  bad = dict(params, lm_head=params["lm_head"][:, :-1])
  with pytest.raises(ValueError, match=r"lm_head.*expected float32\[\d+, \d+\]"):
    nnx_model.merge(cfg, bad)
  missing = dict(params)
  del missing["norm"]
  with pytest.raises(ValueError, match="not the one of model.param_shapes"):
    nnx_model.Model(cfg, missing)


def test_engine_through_the_modules_gives_the_same_tokens():
  """EngineConfig(model_api="nnx") (what `experiments.serve --model_api=nnx` sets) runs the ragged step through
  nnx_model.apply_ragged: same tokens and bit-identical logits as the default path, prefix hits included."""
  import dataclasses

  from dsv4.engine import workloads
  from dsv4.engine.api import run_workload
  from dsv4.engine.config import EngineConfig
  from dsv4.engine.engine import Engine
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  # 8-token chunks and budget: every step is one token bucket, so each path compiles one step program.
  ec = EngineConfig(max_num_seqs=4, max_num_batched_tokens=8, chunk_size=8, max_model_len=512,
                    num_full_blocks=16, num_swa_blocks=64, record_logits=True)
  wl = workloads.chat(cfg.vocab_size, sessions=2, turns=2, system_len=140, seed=0)
  runs = {}
  for api in ("functional", "nnx"):
    eng = Engine(params, cfg, dataclasses.replace(ec, model_api=api))
    runs[api] = (eng, run_workload(eng, wl))
  (ef, rf), (en, rn) = runs["functional"], runs["nnx"]
  assert rf.summary()["prefix_hit_tokens"] > 0
  assert rn.summary()["prefix_hit_tokens"] == rf.summary()["prefix_hit_tokens"]
  for a, b in zip(rf.outputs, rn.outputs):
    assert a.rid == b.rid and a.error is None and b.error is None and a.output == b.output
    np.testing.assert_array_equal(np.stack(a.token_logits), np.stack(b.token_logits))
  with pytest.raises(ValueError, match="model_api"):
    Engine(params, cfg, dataclasses.replace(ec, model_api="flax"))
  with pytest.raises(ValueError, match="runs on one device"):
    Engine(params, cfg, dataclasses.replace(ec, model_api="nnx"), mesh=sharding.make_mesh("data:1"))


def test_serve_refuses_nnx_on_a_mesh_before_loading_anything():
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  r = subprocess.run([sys.executable, "-m", "experiments.serve", "--model_api=nnx", "--mesh=tensor:2"], cwd=root,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode != 0 and "--model_api=nnx runs on one device" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_apply_traces_to_the_same_program_as_forward(variant):
  """Tracing only (no compile): `apply` adds nothing to the program, so XLA compiles what it compiles today."""
  cfg = CONFIGS[variant]()
  params = model.abstract_params(cfg)
  cache = jax.eval_shape(lambda: caches.init_contiguous(cfg, 2, 16, caches.CacheLayout())[0])
  toks = jax.ShapeDtypeStruct((2, 16), jnp.int32)
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  sw, fu = caches.contiguous_tables(2, 16, caches.CacheLayout())
  idx = caches.BatchIndex(i32(2), i32(2), i32(*sw.shape), i32(*fu.shape))
  a = jax.make_jaxpr(lambda p, t, c, i: model.forward(p, cfg, t, c, i))(params, toks, cache, idx)
  b = jax.make_jaxpr(lambda p, t, c, i: nnx_model.apply(p, t, c, i, config=cfg))(params, toks, cache, idx)
  assert str(a) == str(b)


@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_block_and_attention_modules_are_the_block_functions(variant):
  """Block.__call__ (and Attention.__call__ inside it) == model._block / _block_single_pass on a layer
  with a compressor and an indexer (V4 CSA; V4.1 CSA2 with Engram), caches included; one jitted program."""
  from dsv4.layers.compressor import StepContext
  cfg = CONFIGS[variant]()
  params = model.init_params(cfg, jax.random.PRNGKey(4))
  plan = next(p for p in cfg.layer_plan() if p.has_compressor and p.has_index_query)
  B, T, layout = 2, 8, caches.CacheLayout()
  cache, swa, full = caches.init_contiguous(cfg, B, T, layout)
  idx = caches.BatchIndex(jnp.zeros(B, jnp.int32), jnp.asarray([8, 5], jnp.int32), jnp.asarray(swa),
                          jnp.asarray(full))
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(5), 4)
  X = jax.random.normal(k1, (1, B * T, cfg.mhc.hc_mult, cfg.hidden_size), jnp.float32)
  tok = jax.random.randint(k2, (1, B * T), 0, cfg.vocab_size, jnp.int32)
  pre = jax.nn.softmax(jax.random.normal(k3, (1, B * T, cfg.mhc.hc_mult)), -1)
  eh = None
  if plan.engram:
    rows = params["layers"][plan.index]["engram"]["embed"].shape[0]
    eh = jax.random.randint(k4, (1, B * T, cfg.engram.hash_heads), 0, rows, jnp.int32)

  @jax.jit
  def both(params, cache_l, idx):
    ctx = StepContext.from_step(caches.step_index_from_batch(idx, T), layout)
    blk = nnx_model.merge(cfg, params).layers[plan.index]
    p_l, kc = params["layers"][plan.index], dispatch.KernelConfig()
    if cfg.single_pass_mhc:
      got = blk(X, tok, ctx, cache_l, pre_prev=pre, engram_hash=eh)
      want = model._block_single_pass(p_l, cfg, plan, X, pre, tok, ctx, cache_l, kc, False, None, eh)
    else:
      got = blk(X, tok, ctx, cache_l)
      want = model._block(p_l, cfg, plan, X, tok, ctx, cache_l, kc, False)
    return got, want

  got, want = both(params, cache.layers[plan.index], idx)
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_params_merge_and_keep_their_dtype():
  """The engine's bf16 compute dtype (model.cast_params): floats may change dtype, integer tables may not."""
  cfg = config.v4_tiny()
  params = model.cast_params(model.init_params(cfg, jax.random.PRNGKey(0)), jnp.bfloat16)
  _assert_same_arrays(nnx_model.params_of(nnx_model.merge(cfg, params)), params)
  bad = jax.tree_util.tree_map(lambda x: x, params)
  bad["layers"][0]["ffn"]["tid2eid"] = bad["layers"][0]["ffn"]["tid2eid"].astype(jnp.float32)
  with pytest.raises(ValueError, match=r"tid2eid.*expected int32"):
    nnx_model.merge(cfg, bad)


def _smaller_topk(attn: nnx_model.Attention, topk: int) -> nnx_model.Attention:
  import dataclasses
  cfg = attn.config
  return attn.with_config(dataclasses.replace(cfg, indexer=dataclasses.replace(cfg.indexer, topk=topk)))


class _ScaledAttention(nnx_model.Attention):
  """An Attention whose output rows are scaled (before the block's tail): a module edit the engine can only see if
  it runs the modules."""

  def __call__(self, *args, tail=None, **kwargs):
    return super().__call__(*args, tail=row_invariant.tail_after(lambda y: 2.0 * y, tail), **kwargs)


def test_engine_runs_the_modules_so_edits_change_its_output():
  """The engine (model_api="nnx") holds the Model it is given and runs its modules at every step: a layer's
  attention replaced by one with a smaller indexer top-k, or by a subclass scaling its output, changes the logits
  of the same engine's next request; putting the original module back restores them bit for bit. (As built, the
  step is the functional one: test_module_ragged_step_traces_to_the_functional_program, and the slow tier's
  test_engine_through_the_modules_gives_the_same_tokens.) One 32-token prefill per run (max_tokens=1): one step
  program per module graph."""
  import dataclasses

  from dsv4.engine.api import generate
  from dsv4.engine.config import EngineConfig
  from dsv4.engine.engine import Engine
  from dsv4.engine.sampling import SamplingParams
  cfg = config.v4_tiny(num_layers=2)            # a window layer and a CSA layer: half the compile of v4_tiny
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  ec = EngineConfig(max_num_seqs=2, max_num_batched_tokens=32, chunk_size=32, max_model_len=128,
                    num_full_blocks=8, num_swa_blocks=32, record_logits=True)
  prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, 32).tolist()

  def logits(eng):
    (out,) = generate(None, cfg, [prompt], SamplingParams(max_tokens=1), engine=eng)
    assert out.error is None and eng.stats["prefix_hit_tokens"] == 0   # every run computes the whole prompt
    return np.asarray(out.token_logits[0])

  net = nnx_model.merge(cfg, params)
  eng = Engine(net, cfg, dataclasses.replace(ec, model_api="nnx"))
  base = logits(eng)

  li = max(p.index for p in cfg.layer_plan() if p.has_index_query)   # a CSA layer: 8 entries visible, top-k 8
  orig = net.layers[li].attn
  net.layers[li].attn = _smaller_topk(orig, 2)
  assert net.layers[li].attn.config.indexer.topk == 2 and net.config.indexer.topk == cfg.indexer.topk
  small = logits(eng)                           # the same engine: the edit takes effect at its next step
  assert np.max(np.abs(small - base)) > 1e-3
  net.layers[li].attn = orig
  np.testing.assert_array_equal(logits(eng), base)

  net.layers[li].attn = _ScaledAttention(cfg, orig.plan, orig.param_dict(), orig.path)
  assert np.max(np.abs(logits(eng) - base)) > 1e-3
  net.layers[li].attn = orig

  with pytest.raises(ValueError, match="model_api='nnx'"):
    Engine(net, cfg, ec)


@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_module_ragged_step_traces_to_the_functional_program(variant):
  """Tracing only: the engine's nnx step body (nnx.merge of graphdef + state, `Model.ragged`, `Model.logits`) is
  the program of `model.forward_ragged` + `lm_logits` (so equal bit for bit); with one layer's attention at a
  smaller top-k it is another program, and the top-k picks of that layer have the smaller width."""
  from flax import nnx
  cfg = CONFIGS[variant]()
  graphdef, abstract = nnx_model.abstract_model(cfg)
  params = model.abstract_params(cfg)
  cache = jax.eval_shape(lambda: caches.init_contiguous(cfg, 2, 16, caches.CacheLayout())[0])
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  sw, fu = caches.contiguous_tables(2, 16, caches.CacheLayout())
  idx = caches.BatchIndex(i32(2), i32(2), i32(*sw.shape), i32(*fu.shape))
  toks = i32(32)

  def functional(p, t, c, i):
    c, h = model.forward_ragged(p, cfg, t, c, caches.step_index_from_batch(i, 16))
    return c, model.lm_logits(p, h)

  def modules(graphdef):
    def run(state, t, c, i):
      net = nnx.merge(graphdef, state)
      c, h = net.ragged(t, c, caches.step_index_from_batch(i, 16))
      return c, net.logits(h)
    return run

  a = jax.make_jaxpr(functional)(params, toks, cache, idx)
  b = jax.make_jaxpr(modules(graphdef))(abstract, toks, cache, idx)
  assert str(a) == str(b)

  net = nnx.merge(graphdef, abstract)
  li = max(p.index for p in cfg.layer_plan() if p.has_index_query)
  net.layers[li].attn = _smaller_topk(net.layers[li].attn, 4)
  g2, s2 = nnx.split(net)
  assert g2 != graphdef
  assert str(jax.make_jaxpr(modules(g2))(s2, toks, cache, idx)) != str(a)
  aux = jax.eval_shape(lambda s, t, c, i: nnx.merge(g2, s).ragged(t, c, caches.step_index_from_batch(i, 16),
                                                                   collect_aux=True)[2], s2, toks, cache, idx)
  assert aux[li]["topk_ids"].shape == (32, 4)
  other = next(p.index for p in cfg.layer_plan() if p.has_index_query and p.index != li)
  assert aux[other]["topk_ids"].shape == (32, cfg.indexer.topk)
