"""The model on a JAX device mesh: logical axis names for every parameter and cache array, and rules that map them
to the mesh axes `data`, `tensor`, `expert` (MaxText-style: arrays name what their dimensions *are*; a rule table
says which mesh axes, if any, split each kind of dimension).

    mesh = sharding.make_mesh("data:2,tensor:2,expert:2")
    rules = sharding.Rules()                           # or Rules(kv_latent="feature")
    params = sharding.put(params, sharding.param_shardings(config, mesh, rules))
    with jax.set_mesh(mesh):                           # activates the expert-parallel MoE path (dsv4.layers.moe)
      cache, logits = jitted_forward(params, ...)

Logical axes are declared beside the shapes, in the single sources of truth: `model.param_shapes` (each
`ParamSpec.axes`) and `caches.cache_array_specs` (each `ArraySpec.block_axes`). A dimension whose size is not
divisible by its mesh axes (or whose unit count, e.g. heads, is not) stays replicated instead of failing: tiny test
configs and odd meshes still run, and `explain_fallbacks` lists what was replicated so sizing reports show it.

Decisions (overview in docs/sharding.md, measurements in BUILD_NOTES.md):
* attention heads, the indexer heads, the grouped output projection, the shared expert's and routed experts'
  intermediate dimension and the vocabulary are split over `tensor`;
* routed experts are split over `expert`, tokens reach them through `shard_map` + all-to-all (moe.py);
* batch rows are split over `data`; the KV block pools are either replicated over `data` (one pool for all
  shards, `pools_over_data=False`) or split over `data` by their block axis (`pools_over_data=True`, the engine's
  default on a mesh): data shard s holds global blocks [s*n, (s+1)*n), addressed by shard-local ids 0..n-1, and
  the step runs manual over `data` (`jax.shard_map`, the other axes stay automatic) so every read and write of a
  pool stays on the device that holds it;
* the shared K = V latent (one head) and its pools are replicated over `tensor` by default (`Rules.kv_latent`
  = "replicated"); "feature" splits its feature dimension over `tensor` instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dsv4 import caches, model
from dsv4.config import ModelConfig
from dsv4.mesh_context import axis_size
from pallas_kernels import dispatch

AXES = ("data", "tensor", "expert")


# ----------------------------------------------------------------------------------------------------------
# Mesh

def parse_mesh_spec(spec: str) -> dict[str, int]:
  """'data:2,tensor:2,expert:2' -> {'data': 2, 'tensor': 2, 'expert': 2} (missing axes are 1)."""
  out = {a: 1 for a in AXES}
  if not spec:
    return out
  for part in spec.split(","):
    name, _, size = part.strip().partition(":")
    if name not in AXES:
      raise ValueError(f"mesh: unknown axis {name!r} in {spec!r}; axes are {AXES}")
    try:
      out[name] = int(size)
    except ValueError:
      raise ValueError(f"mesh: axis {name!r} needs an integer size, got {size!r} in {spec!r}") from None
    if out[name] < 1:
      raise ValueError(f"mesh: axis {name!r} must be >= 1, got {out[name]}")
  return out


def make_mesh(spec: str | dict[str, int] | tuple[int, int, int], devices=None) -> jax.sharding.Mesh:
  """A (data, tensor, expert) mesh with Auto axes (GSPMD propagation outside the explicit shard_map regions)."""
  if isinstance(spec, str):
    spec = parse_mesh_spec(spec)
  if isinstance(spec, tuple):
    spec = dict(zip(AXES, spec))
  shape = tuple(int(spec.get(a, 1)) for a in AXES)
  devices = jax.devices() if devices is None else list(devices)
  need = math.prod(shape)
  if need > len(devices):
    raise ValueError(f"mesh: {dict(zip(AXES, shape))} needs {need} devices, only {len(devices)} available "
                     f"(on the CPU set XLA_FLAGS=--xla_force_host_platform_device_count={need})")
  return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES), devices=devices[:need])


# ----------------------------------------------------------------------------------------------------------
# Rules

@dataclasses.dataclass(frozen=True)
class Rules:
  """Logical axis -> mesh axes. `kv_latent`: the shared K = V latent is one head, so it cannot follow the heads;
  "replicated" keeps it whole on every tensor shard, "feature" splits its feature dimension over `tensor`."""
  kv_latent: str = "replicated"
  table: tuple[tuple[str, tuple[str, ...]], ...] = (
      ("batch", ("data",)),
      ("vocab", ("tensor",)),
      ("heads", ("tensor",)),
      ("heads_x_dim", ("tensor",)),
      ("o_groups", ("tensor",)),
      ("o_groups_x_lora", ("tensor",)),
      ("index_heads", ("tensor",)),
      ("index_heads_x_dim", ("tensor",)),
      ("experts", ("expert",)),
      ("expert_mlp", ("tensor",)),
      ("mlp", ("tensor",)),
      # Engram tables are the largest arrays of V4.1-Flash (2 x 384M rows): split over every device.
      ("engram_rows", ("tensor", "expert", "data")),
      ("engram_out", ("tensor",)),
  )

  def __post_init__(self):
    if self.kv_latent not in ("replicated", "feature"):
      raise ValueError(f"Rules.kv_latent: 'replicated' or 'feature', got {self.kv_latent!r}")

  def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
    if logical is None:
      return ()
    if logical == "kv_latent":
      return ("tensor",) if self.kv_latent == "feature" else ()
    return dict(self.table).get(logical, ())


def _units(config: ModelConfig) -> dict[str, int]:
  """How many indivisible units a logical dimension holds (a split must not cut a head in two)."""
  a, ix = config.attention, config.indexer
  return {"heads_x_dim": a.num_heads, "index_heads_x_dim": ix.num_heads, "o_groups_x_lora": a.o_groups}


def spec_for(logical_axes: tuple, shape: tuple[int, ...], mesh, rules: Rules, units: dict | None = None,
             fallbacks: list | None = None, what: str = "") -> PartitionSpec:
  """PartitionSpec for one array; dims that do not divide stay replicated (and are recorded in `fallbacks`)."""
  assert len(logical_axes) == len(shape), (what, logical_axes, shape)
  used: set[str] = set()
  out = []
  for name, size in zip(logical_axes, shape):
    axes = tuple(m for m in rules.mesh_axes(name) if axis_size(mesh, m) > 1 and m not in used)
    n = math.prod(axis_size(mesh, m) for m in axes)
    unit = (units or {}).get(name, size)
    if axes and (size % n or unit % n):
      if fallbacks is not None:
        fallbacks.append(f"{what}: {name}={size} not divisible by {'x'.join(axes)}={n}; replicated")
      axes = ()
    used.update(axes)
    out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
  return PartitionSpec(*out)


# ----------------------------------------------------------------------------------------------------------
# Logical axes of the parameters: declared beside each shape in model.param_shapes (ParamSpec.axes)

def param_logical_axes(config: ModelConfig) -> dict:
  """The parameter tree with each leaf's logical axes (a tuple of names, None = never split)."""
  return jax.tree_util.tree_map(lambda spec: spec.axes, model.param_shapes(config), is_leaf=model.is_param_spec)


def param_specs(config: ModelConfig, mesh, rules: Rules = Rules(), fallbacks: list | None = None) -> dict:
  units = _units(config)
  return jax.tree_util.tree_map_with_path(
      lambda path, spec: spec_for(spec.axes, spec.shape, mesh, rules, units, fallbacks,
                                  "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)),
      model.param_shapes(config), is_leaf=model.is_param_spec)


def param_shardings(config: ModelConfig, mesh, rules: Rules = Rules(), fallbacks: list | None = None) -> dict:
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), param_specs(config, mesh, rules, fallbacks),
                                is_leaf=lambda x: isinstance(x, PartitionSpec))


# ----------------------------------------------------------------------------------------------------------
# Cache arrays and step inputs

def cache_logical_axes(spec: caches.ArraySpec) -> tuple:
  """The block axis, then the axes `caches` declares beside the array's block shape."""
  return ("cache_blocks",) + spec.block_axes


def check_pools_over_data(mesh, num_swa_blocks: int, num_full_blocks: int, batch: int | None = None) -> int:
  """Pools split over `data` need every pool's block count (and the step's rows) divisible by the data size: a
  clear error instead of the silent replication `spec_for` falls back to. Returns the data size D."""
  d = axis_size(mesh, "data")
  for what, n in (("num_swa_blocks", num_swa_blocks), ("num_full_blocks", num_full_blocks),
                  ("max_num_seqs (rows of a step)", batch)):
    if n is not None and n % d:
      raise ValueError(f"KV pools over data: {what}={n} is not divisible by the data axis size {d} (each data "
                       "shard holds an equal slice of blocks and rows)")
  return d


def pools_over_data_rules(rules: Rules) -> Rules:
  """`rules` for the per-shard-pool step: cache blocks over `data`, and nothing else over `data` but the batch (a
  parameter split over `data` would be all-gathered at the entry of the data-manual step; the Engram tables then
  split over tensor x expert only)."""
  table = tuple((k, tuple(a for a in v if a != "data") if k != "batch" else v) for k, v in rules.table)
  return dataclasses.replace(rules, table=table + (("cache_blocks", ("data",)),))


def cache_shardings(config: ModelConfig, layout: caches.CacheLayout, mesh, rules: Rules = Rules(),
                    num_swa_blocks: int = 1, num_full_blocks: int = 1, fallbacks: list | None = None,
                    pools_over_data: bool = False):
  """A ModelCache of NamedShardings matching `caches.init_cache(config, layout, num_swa, num_full)`.
  pools_over_data: the block axis split over `data` (block counts must divide)."""
  if pools_over_data:
    check_pools_over_data(mesh, num_swa_blocks, num_full_blocks)
    rules = pools_over_data_rules(rules)
  layers = [dict() for _ in config.cache_plans()]  # the backbone, then the MTP blocks (as caches.init_cache)
  for s in caches.cache_array_specs(config, layout):
    n = num_swa_blocks if s.group == caches.SWA else num_full_blocks
    spec = spec_for(cache_logical_axes(s), (n, *s.block_shape), mesh, rules, None, fallbacks,
                    f"cache/{s.layer}/{s.name}")
    layers[s.layer][s.name] = NamedSharding(mesh, spec)
  return caches.ModelCache(tuple(layers))


def batch_sharding(mesh, batch: int, rank: int, rules: Rules = Rules()) -> NamedSharding:
  """Rows over `data` (replicated when the batch does not divide)."""
  return NamedSharding(mesh, spec_for(("batch",) + (None,) * (rank - 1), (batch,) + (1,) * (rank - 1), mesh, rules))


def index_shardings(mesh, batch: int, rules: Rules = Rules()) -> caches.BatchIndex:
  return caches.BatchIndex(batch_sharding(mesh, batch, 1, rules), batch_sharding(mesh, batch, 1, rules),
                           batch_sharding(mesh, batch, 2, rules), batch_sharding(mesh, batch, 2, rules))


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def put(tree, shardings):
  """Places host values onto (possibly multi-process) shardings. Every process passes the same full value; each
  keeps only its addressable shards, so this works under `jax.distributed` as well as in one process."""
  want, got = jax.tree_util.tree_structure(shardings), jax.tree_util.tree_structure(tree)
  if want != got:
    # e.g. routed experts kept packed (FP4 + scales) by the loader: the rules describe dense parameters only.
    raise ValueError("sharding.put: the tree does not have the structure the shardings were made for "
                     f"(expected {want}, got {got}); quantized (packed) experts are not supported on a mesh yet")

  def one(x, s):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])
  return jax.tree_util.tree_map(one, tree, shardings)


def explain_fallbacks(config: ModelConfig, mesh, rules: Rules = Rules()) -> list[str]:
  out: list[str] = []
  param_specs(config, mesh, rules, out)
  return out


def per_device_bytes(tree_shapes, tree_specs, mesh, itemsize_of=None) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs under PartitionSpecs."""
  total = 0
  for x, s in zip(jax.tree_util.tree_leaves(tree_shapes), jax.tree_util.tree_leaves(
      tree_specs, is_leaf=lambda v: isinstance(v, PartitionSpec))):
    n = int(np.prod(x.shape))
    for entry in s:
      for a in ((entry,) if isinstance(entry, str) else (entry or ())):
        n //= axis_size(mesh, a)
    total += n * (itemsize_of(x) if itemsize_of else np.dtype(x.dtype).itemsize)
  return total


def names(axes: Iterable) -> str:
  return ",".join("-" if a is None else str(a) for a in axes)


# ----------------------------------------------------------------------------------------------------------
# A sharded model step

def jit_forward(config: ModelConfig, mesh, rules: Rules = Rules(), *, layout: caches.CacheLayout = caches.CacheLayout(),
                batch: int, num_swa_blocks: int, num_full_blocks: int, kernel_cfg=None, logits_replicated=True,
                step_fn=None, pools_over_data: bool = False):
  """`model.forward` jitted for `mesh`: params, cache and step inputs carry the rule shardings, the cache keeps
  its sharding from step to step (donated), logits come back replicated (readable by every process).
  `step_fn(params, config, layout, kernel_cfg, tokens, cache, index) -> (cache, logits)` replaces the full-logits
  forward (the engine passes its last-token step). Returns (call(params, tokens, cache, index) -> (cache, logits),
  shardings dict).

  pools_over_data: the pools' block axis is split over `data` and the step runs inside a `jax.shard_map` manual
  over `data` only (tensor / expert stay automatic; the MoE then takes its GSPMD path, see moe.py): data shard
  s sees rows [s*B/D, (s+1)*B/D) and its own n = num_blocks / D blocks, so the index's block ids are SHARD-LOCAL
  (0..n-1) and no pool byte crosses devices."""
  kernel_cfg = kernel_cfg or dispatch.KernelConfig()
  local = pools_over_data and axis_size(mesh, "data") > 1
  if local:
    check_pools_over_data(mesh, num_swa_blocks, num_full_blocks, batch)
    rules = pools_over_data_rules(rules)
  sh = dict(params=param_shardings(config, mesh, rules),
            cache=cache_shardings(config, layout, mesh, rules, num_swa_blocks, num_full_blocks),
            tokens=batch_sharding(mesh, batch, 2, rules), index=index_shardings(mesh, batch, rules))
  logits_sh = replicated(mesh) if logits_replicated else batch_sharding(mesh, batch, 3, rules)

  def step(params, tokens_BxT, cache, index):
    if step_fn is not None:
      return step_fn(params, config, layout, kernel_cfg, tokens_BxT, cache, index)
    return model.forward(params, config, tokens_BxT, cache, index, layout=layout, kernel_cfg=kernel_cfg)

  if local:
    whole = step
    # Params: replicated over `data` (prefix PartitionSpec()); rows, pools (block axis first) and the index: split
    # over it.
    over_data = PartitionSpec("data")
    step = jax.shard_map(whole, mesh=mesh, in_specs=(PartitionSpec(), over_data, over_data, over_data),
                         out_specs=(over_data, over_data), axis_names={"data"}, check_vma=False)

  jitted = jax.jit(step, in_shardings=(sh["params"], sh["tokens"], sh["cache"], sh["index"]),
                   out_shardings=(sh["cache"], logits_sh), donate_argnums=(2,))

  def call(params, tokens_BxT, cache, index):
    with jax.set_mesh(mesh):
      return jitted(params, tokens_BxT, cache, index)

  call.jitted = jitted
  return call, sh
