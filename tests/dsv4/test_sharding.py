"""The model on a mesh (dsv4/sharding.py). One-device checks run here; the 8-device checks run in a subprocess
(tests/dsv4/sharding_worker.py) with XLA_FLAGS=--xla_force_host_platform_device_count=8, because the rest of the
suite runs with one device and JAX fixes the host device count at start-up."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from dsv4 import caches, config, model, sharding
from dsv4.layers import moe, row_invariant
from tests import xla_test_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_worker(*args, timeout=1500, module="tests.dsv4.sharding_worker", default_xla_opt=False):
  """Runs a worker module in a child process with 8 host devices; it must print OK last. default_xla_opt: XLA's
  default optimisation level (`tests/xla_test_flags.py`), for checks whose claim is about the code users run."""
  env = dict(xla_test_flags.child_env("--xla_force_host_platform_device_count=8", default_xla_opt=default_xla_opt),
             PYTHONPATH=ROOT)
  r = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=timeout)
  print(r.stdout)
  assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout[-4000:] + r.stderr[-4000:]
  return r.stdout


@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_sharded_forward_matches_one_device(variant):
  """Prefill + decode on a mesh == one device, fp32, <= 1e-5 relative, V4 and V4.1 on meshes (8,1,1), (1,1,8),
  (2,2,2), (1,8,1) (one compile per mesh: the suite's slowest test)."""
  run_worker("forward", variant)


def test_kv_latent_split_by_feature_matches_one_device():
  run_worker("forward_feature", "v4")


def test_experts_per_expert_shard_keep_row_bits_on_kernel_and_loop():
  """Inside a data-manual region (the per-shard-pool step), the routed experts per expert shard on (2,1,2), (2,2,2)
  and (1,2,4): the grouped expert kernel (interpret) and the loop, each near a float64 reference, rows alone ==
  batched bit for bit (about 20 s: the default tier's check of the mesh's expert path)."""
  out = run_worker("expert_shards")
  assert out.count("kernel,") == 3 and out.count("loop,") == 3


def test_engine_on_mesh_same_tokens_with_prefix_hits():
  out = run_worker("engine")
  assert "same tokens" in out


@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_engine_with_one_kv_pool_per_data_shard(variant):
  """Pools split over `data` on (2, 2, 2), one cache manager per shard: same tokens as one device on a 3-session
  chat trace whose hits need prefix affinity (asserted request by request), per-device pool bytes = total / 2,
  preemption inside a shard under a small pool, and no pool-sized collective in the compiled step (fewer
  gathers than with the replicated pool)."""
  out = run_worker("pools", variant)
  assert "same tokens" in out and "preemptions" in out


# ------------------------------------------------------------------------------------------ one device

def test_pools_over_data_need_divisible_block_counts():
  mesh = jax.sharding.AbstractMesh((2, 2, 2), sharding.AXES)
  cfg = config.v4_tiny()
  with pytest.raises(ValueError, match="num_swa_blocks=15 is not divisible by the data axis size 2"):
    sharding.cache_shardings(cfg, caches.CacheLayout(), mesh, num_swa_blocks=15, num_full_blocks=8,
                             pools_over_data=True)
  with pytest.raises(ValueError, match="max_num_seqs"):
    sharding.check_pools_over_data(mesh, 16, 8, batch=3)
  specs = sharding.cache_shardings(cfg, caches.CacheLayout(), mesh, num_swa_blocks=16, num_full_blocks=8,
                                   pools_over_data=True)
  assert all(s.spec[0] == "data" for s in jax.tree_util.tree_leaves(specs))
  rep = sharding.cache_shardings(cfg, caches.CacheLayout(), mesh, num_swa_blocks=16, num_full_blocks=8)
  assert all(s.spec[0] is None for s in jax.tree_util.tree_leaves(rep))
  # Under the per-shard-pool rules only rows and pools use `data` (Engram tables split over tensor x expert).
  r = sharding.pools_over_data_rules(sharding.Rules())
  assert r.mesh_axes("engram_rows") == ("tensor", "expert") and r.mesh_axes("batch") == ("data",)


def test_mesh_step_tables_travel_device_to_device():
  run_worker("tables", timeout=600)


def test_engine_table_rows_are_per_data_shard():
  """Each data shard's cache manager owns max_num_seqs / D table rows (shard-local slots); on one device the one
  manager owns them all, and the runner reads the tables from it."""
  from dsv4.engine.config import EngineConfig
  from dsv4.engine.engine import Engine
  cfg = config.v4_tiny(num_layers=2)
  eng = Engine(model.init_params(cfg, jax.random.PRNGKey(0)), cfg,
               EngineConfig(max_num_seqs=4, max_model_len=256, num_full_blocks=4, num_swa_blocks=8))
  assert eng.num_shards == 1 and eng.managers[0].num_slots == 4 and eng.runner.managers is eng.managers
  assert eng.managers[0].device_tables["swa"].shape == (4, 256 // caches.CacheLayout().swa_block_tokens)


@pytest.mark.parametrize("preset", ["v4_tiny", "v41_tiny", "v4_flash", "v41_flash"])
def test_every_parameter_and_cache_array_has_logical_axes(preset):
  cfg = config.get_preset(preset)
  axes = sharding.param_logical_axes(cfg)
  shapes = model.abstract_params(cfg)
  flat_axes = jax.tree_util.tree_leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
  flat_shapes = jax.tree_util.tree_leaves(shapes)
  assert len(flat_axes) == len(flat_shapes)
  for a, s in zip(flat_axes, flat_shapes):
    assert len(a) == len(s.shape)
  for spec in caches.cache_array_specs(cfg, caches.CacheLayout()):
    assert len(sharding.cache_logical_axes(spec)) == 1 + len(spec.block_shape)


# Names no default rule splits (replicated on purpose); a name outside these and `Rules.table` is a typo that would
# silently replicate its dimension.
_UNSPLIT_AXES = {None, "embed", "q_lora", "o_group_in", "o_lora", "hc_in", "hc_out", "hc", "comp_proj",
                 "comp_latent", "index_dim", "router", "vocab_table", "engram_dim", "engram_in", "cache_blocks",
                 "block_rows", "kv_latent"}


@pytest.mark.parametrize("preset", ["v4_tiny", "v41_tiny", "v4_flash", "v41_flash"])
def test_declared_axis_names_are_known(preset):
  cfg = config.get_preset(preset)
  known = _UNSPLIT_AXES | {name for name, _ in sharding.Rules().table}
  param_names = {a for spec in jax.tree_util.tree_leaves(model.param_shapes(cfg), is_leaf=model.is_param_spec)
                 for a in spec.axes}
  cache_names = {a for spec in caches.cache_array_specs(cfg, caches.CacheLayout())
                 for a in sharding.cache_logical_axes(spec)}
  assert (param_names | cache_names) <= known, (param_names | cache_names) - known


def test_axes_must_name_every_dimension():
  with pytest.raises(ValueError, match="has 2 dims but axes"):
    model._spec((4, 8), "dense", ("embed",))
  with pytest.raises(ValueError, match="block shape"):
    caches.ArraySpec(0, "window_kv", caches.SWA, (16, 8), jnp.float32, block_axes=("block_rows",))


def test_mtp_cache_layers_get_shardings():
  """The MTP blocks own cache layers after the backbone's (caches.init_cache): the shardings cover them too."""
  cfg = dataclasses.replace(config.v4_tiny(), num_mtp_layers=1)
  mesh = jax.sharding.AbstractMesh((2, 2, 2), sharding.AXES)
  shard = sharding.cache_shardings(cfg, caches.CacheLayout(), mesh, num_swa_blocks=16, num_full_blocks=8)
  assert len(shard.layers) == len(cfg.cache_plans()) == cfg.num_layers + 1
  assert "window_kv" in shard.layers[-1]


def test_flash_rules_split_what_the_plan_says():
  """On the abstract 8-way meshes of the real models: heads over tensor, experts over expert, nothing replicated
  by accident."""
  cfg = config.v4_flash()
  mesh = jax.sharding.AbstractMesh((1, 2, 4), sharding.AXES)
  specs = sharding.param_specs(cfg, mesh)
  layer = specs["layers"][3]
  assert layer["attn"]["wq_b"] == PartitionSpec(None, "tensor")
  assert layer["attn"]["wkv"] == PartitionSpec(None, None)  # K=V latent replicated (default rule)
  assert layer["ffn"]["experts"]["w1"] == PartitionSpec("expert", None, "tensor")
  assert layer["ffn"]["experts"]["w2"] == PartitionSpec("expert", "tensor", None)
  assert specs["embed"] == PartitionSpec("tensor", None)
  assert sharding.explain_fallbacks(cfg, mesh) == []
  feat = sharding.param_specs(cfg, mesh, sharding.Rules(kv_latent="feature"))
  assert feat["layers"][3]["attn"]["wkv"] == PartitionSpec(None, "tensor")


def test_indivisible_dims_stay_replicated_and_are_reported():
  mesh = jax.sharding.AbstractMesh((1, 8, 1), sharding.AXES)
  cfg = config.v4_tiny()           # 4 heads, 2 output groups: cannot split 8 ways
  fallbacks = sharding.explain_fallbacks(cfg, mesh)
  assert any("attn/wq_b" in f for f in fallbacks)
  assert sharding.param_specs(cfg, mesh)["layers"][0]["attn"]["wq_b"] == PartitionSpec(None, None)


def test_mesh_spec_errors_are_clear():
  assert sharding.parse_mesh_spec("data:2,tensor:2,expert:2") == {"data": 2, "tensor": 2, "expert": 2}
  assert sharding.parse_mesh_spec("expert:4") == {"data": 1, "tensor": 1, "expert": 4}
  with pytest.raises(ValueError, match="unknown axis 'model'"):
    sharding.parse_mesh_spec("model:2")
  with pytest.raises(ValueError, match="integer size"):
    sharding.parse_mesh_spec("data:x")
  with pytest.raises(ValueError, match="needs 64 devices"):
    sharding.make_mesh("data:4,tensor:4,expert:4")
  with pytest.raises(ValueError, match="kv_latent"):
    sharding.Rules(kv_latent="heads")


def test_moe_without_mesh_is_the_unsharded_path():
  """No active mesh: `moe` is exactly routed_experts + shared_expert (bit for bit)."""
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))["layers"][1]["ffn"]
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, cfg.hidden_size))
  toks = jnp.arange(10).reshape(2, 5)
  got = jax.jit(lambda p, x: moe.moe(p, x, toks, cfg.moe, False))(params, x)

  def unsharded(p, x):   # the body of `moe` before the expert-parallel branch existed
    flat = x.reshape(10, -1)
    # the router and the shared expert in `moe`'s row blocks: XLA's CPU dot rounds by its row count
    ids, w = row_invariant.map_row_blocks(lambda xb, tb: moe.route(p, xb, tb, cfg.moe, False), None, flat,
                                          toks.reshape(-1))
    shared = row_invariant.map_row_blocks(lambda xb: moe.shared_expert(p["shared"], xb, cfg.moe), None, flat)
    out = moe.routed_experts(p["experts"], flat, ids, w, cfg.moe) + shared
    return out.reshape(2, 5, -1)

  np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(unsharded)(params, x)))


def test_scanned_layer_groups_step_matches_the_unrolled_step():
  """benchmarks/sizing.py compiles the full-depth V4 step as a scan over its repeating layer groups: same logits
  and cache as the engine's unrolled step."""
  from benchmarks import sizing
  from pallas_kernels import dispatch
  cfg = config.v4_tiny(num_layers=8)
  s, g, n = sizing.layer_groups(cfg)
  assert (g, n) == (2, 3) and s + g * n <= cfg.num_layers
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  layout = caches.CacheLayout()
  B, T = 2, 24
  cache, swa, full = caches.init_contiguous(cfg, B, T, layout)
  index = caches.BatchIndex(jnp.zeros(B, jnp.int32), jnp.asarray([T, T - 5], jnp.int32), jnp.asarray(swa),
                            jnp.asarray(full))
  toks = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, cfg.vocab_size)
  kc = dispatch.KernelConfig()
  want_cache, want = jax.jit(lambda p, c: sizing._last_token_step(p, cfg, layout, kc, toks, c, index))(params, cache)
  stack = lambda xs: jnp.stack(xs)  # noqa: E731
  p2 = dict(params, layers=sizing.stack_groups(list(params["layers"]), s, g, n, stack))
  c2 = caches.ModelCache(sizing.stack_groups(list(cache.layers), s, g, n, stack))
  got_cache, got = jax.jit(lambda p, c: sizing.scanned_step(p, cfg, layout, kc, toks, c, index))(p2, c2)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  head, groups, tail = got_cache.layers
  np.testing.assert_allclose(np.asarray(groups[1]["comp_kv"][2]),
                             np.asarray(want_cache.layers[s + 2 * 2 + 1]["comp_kv"]), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(tail[-1]["window_kv"]), np.asarray(want_cache.layers[-1]["window_kv"]),
                             rtol=1e-5, atol=1e-5)


def test_put_rejects_a_tree_the_rules_do_not_describe():
  mesh = sharding.make_mesh("data:1")
  cfg = config.v4_tiny()
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  sh = sharding.param_shardings(cfg, mesh)
  params["layers"][0]["ffn"]["experts"]["w1"] = {"packed": np.zeros(3), "scale": np.zeros(1)}
  with pytest.raises(ValueError, match="structure"):
    sharding.put(params, sh)
