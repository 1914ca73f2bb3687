"""Sizing of V4-Flash / V4.1-Flash on a device mesh, without weights: per-device bytes of parameters (as stored:
FP4 routed experts, FP8 projections, bf16 / fp32 rest), of the KV block pools for a stated batch and context, and of
the step's activations (XLA's memory analysis of the ahead-of-time compiled sharded step), against the device
memory. A configuration that does not fit is reported as such, with its numbers.

    python -m benchmarks.sizing                                   # V4-Flash and V4.1-Flash, 8 x H200, defaults
    python -m benchmarks.sizing --models=v4_flash --meshes=data:1,tensor:1,expert:8 --batch=32 --context=131072
    python -m benchmarks.sizing --aot_layers=0                    # AOT-compile at full depth (slow on the CPU)

The AOT compile runs on this machine's backend over an abstract mesh of host devices (on the CPU:
--xla_force_host_platform_device_count, set here): the compile time and memory analysis are XLA CPU's, not the GPU
compiler's (no GPU compiler is installed here); the parameter and pool bytes are exact for any backend.
`--aot_layers=a,b` compiles the first a and b layers (0: all) and extrapolates the temp bytes linearly to the full
depth (act GB); decode (T = 1) and one prefill chunk are compiled, the larger is reported. It is XLA CPU's temp
for the XLA reference path (bf16 weights upcast to fp32 for the precision=HIGHEST matmuls, fp32 gathers of the
window + top-k rows per query): an upper bound, not what the GPU kernels (FP8/FP4 weights, Pallas attention) need,
so "fits?" is judged on params + KV, and separately with that bound (BUILD_NOTES.md records a measured table;
docs/sharding.md describes the meshes and rules).

Two KV placements are reported: "KV GB" with the pools replicated over `data` (one pool for all data shards), and
"KV/D GB" with the pools split over `data` (one pool per data shard, the engine's default on a mesh: D x fewer
blocks per device); "params* GB" and "fits/D?" are the parameters and the verdict under that
placement's rules (nothing but rows and pools split over `data`, so V4.1's Engram tables split over tensor x expert
only). The AOT compile is of the replicated-pool step.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.sharding import NamedSharding, PartitionSpec

from dsv4 import caches, mesh_context, model, sharding
from dsv4.config import get_preset
from dsv4.layers import mhc
from dsv4.layers.compressor import StepContext
from dsv4.layers.norms import rms_norm
from pallas_kernels import dispatch

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("models", "v4_flash,v41_flash", "presets to size")
  flags.DEFINE_string("meshes", "data:1,tensor:1,expert:8;data:1,tensor:2,expert:4;data:2,tensor:1,expert:4;"
                      "data:1,tensor:8,expert:1", "meshes (data, tensor, expert sizes), ';'-separated")
  flags.DEFINE_integer("batch", 32, "sequences resident at once")
  flags.DEFINE_integer("context", 131072, "tokens per sequence")
  flags.DEFINE_integer("chunk", 512, "prefill chunk (tokens per row) compiled for activations")
  flags.DEFINE_float("device_gb", 141.0, "memory per device (H200: 141 GB)")
  flags.DEFINE_float("reserve_gb", 8.0, "kept free per device (runtime, fragmentation)")
  flags.DEFINE_string("kv_dtype", "bfloat16", "dtype of the KV pools (bfloat16, float8_e4m3fn)")
  flags.DEFINE_enum("kv_latent", "replicated", ["replicated", "feature"], "the shared K = V latent: replicated over "
                    "tensor, or its feature dimension split over it")
  flags.DEFINE_string("aot_layers", "2,4", "depths to AOT-compile: one (0 = full depth) or two, extrapolated "
                      "linearly to full depth; -1 = skip")
  flags.DEFINE_integer("aot_meshes", 1, "AOT-compile on the first N meshes only")
  flags.DEFINE_integer("devices", 8, "host devices on the CPU (--xla_force_host_platform_device_count)")
  flags.DEFINE_bool("scan", False, "also AOT-compile the full-depth V4 step with a scan over the repeating layer "
                    "groups (first mesh)")


GB = 1e9


def stored_bytes_per_param(names: list[str], variant: str, dtype) -> float:
  """Bytes per parameter as the released checkpoints store them (FP4 e2m1 routed experts with an e8m0 scale per
  32, FP8 e4m3 projections with one scale per block, bf16 embeddings / compressor / gates, the rest as `dtype`)."""
  last, parent = names[-1], (names[-2] if len(names) > 1 else "")
  fp8_block = 128 if variant == "v4" else 32
  fp8 = 1.0 + 1.0 / (fp8_block * fp8_block)          # e4m3 + one e8m0 scale per block
  if parent == "experts":
    return 0.5 + 1.0 / 32                            # e2m1 packed two per byte + one e8m0 scale per 32
  if names in (["embed"], ["lm_head"]):
    return 2.0
  if parent == "compressor" or last in ("weights_proj", "gate"):
    return 2.0                                       # bf16 without scales
  if last in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "wk") or parent == "shared":
    return fp8
  if parent == "engram" and last in ("embed", "wkv"):
    return fp8
  return float(np.dtype(dtype).itemsize)             # norms, hc, sink, ape, bias (fp32), tid2eid / maps (int32)


def param_table(cfg, mesh, rules):
  """(total stored bytes, per-device stored bytes, bytes per category per device)."""
  shapes = model.param_shapes(cfg)
  specs = sharding.param_specs(cfg, mesh, rules)
  total = per_dev = 0.0
  cats: dict[str, float] = {}
  leaves = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=model.is_param_spec)[0]
  spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  for (path, param), spec in zip(leaves, spec_leaves):
    names = [str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey)]  # list positions dropped
    b = float(np.prod(param.shape)) * stored_bytes_per_param(names, cfg.variant, param.dtype)
    div = 1
    for entry in spec:
      for a in ((entry,) if isinstance(entry, str) else (entry or ())):
        div *= mesh_context.axis_size(mesh, a)
    if names[-2:] == ["engram", "embed"] and div == 1:
      # A table whose row count does not divide the devices is padded to a multiple (padding rows are never
      # hashed to), then split like the others.
      div = mesh.size
    total += b
    per_dev += b / div
    cat = ("routed experts" if "experts" in names else "engram" if "engram" in names else
           "embed+head" if names in (["embed"], ["lm_head"]) else "attention" if "attn" in names else "other")
    cats[cat] = cats.get(cat, 0.0) + b / div
  return total, per_dev, cats


def pool_blocks(cfg, layout, batch: int, context: int, chunk: int) -> tuple[int, int]:
  """Blocks resident for `batch` sequences of `context` tokens: every full-group block, and the SWA blocks of the
  window / compressor-state tail plus one chunk (older SWA blocks are freed as the window moves, docs/kv_cache.md)."""
  full = batch * caches.blocks_for(context, layout.full_block_tokens)
  tail = caches.state_tail_tokens(cfg) + chunk
  swa = batch * (caches.blocks_for(tail, layout.swa_block_tokens) + 1)
  return swa, full


def handoff_state_bytes(cfg, layout, num_tokens: int) -> int:
  """Bytes of the state a prefill replica hands to a decode replica for a request with `num_tokens` known tokens
  (prompt + first token), which resumes at L = num_tokens - 1: every full-history block up to L (the last one
  partially filled), the sliding-window tail of the aligned point P <= L and every swa block from P up to L (window
  rows, compressor state rows, Engram ids), as the pools store them (a partially filled block travels whole).
  Record headers and checksums come on top (docs/cluster.md)."""
  specs = caches.group_specs(cfg, layout)
  L = num_tokens - 1
  P = L // specs.align_tokens * specs.align_tokens
  full = -(-L // specs.full.block_tokens) * specs.full.bytes_per_block if caches.FULL in specs.names else 0
  sb = specs.swa.block_tokens
  swa_blocks = min(specs.swa.need_blocks, P // sb) + -(-L // sb) - P // sb
  return full + swa_blocks * specs.swa.bytes_per_block


def pool_bytes(cfg, layout, mesh, rules, n_swa: int, n_full: int, over_data: bool = False) -> tuple[float, float]:
  """(total pool bytes, per-device pool bytes) under the rules: pools replicated over `data`, or with over_data
  split over it by their block axis (block counts rounded up to a multiple of the data size)."""
  if over_data:
    d = mesh_context.axis_size(mesh, "data")
    n_swa, n_full = -(-n_swa // d) * d, -(-n_full // d) * d
    rules = sharding.pools_over_data_rules(rules)
  total = per_dev = 0.0
  for s in caches.cache_array_specs(cfg, layout):
    n = n_swa if s.group == caches.SWA else n_full
    b = float(n) * s.bytes_per_block
    spec = sharding.spec_for(sharding.cache_logical_axes(s), (n, *s.block_shape), mesh, rules)
    div = np.prod([mesh_context.axis_size(mesh, a) for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))])
    total += b
    per_dev += b / div
  return total, per_dev


def reduced_depth(cfg, n: int):
  """The first n layers of a preset (the schedules are prefix-closed); V4.1 keeps its source lists' prefix."""
  if n <= 0 or n >= cfg.num_layers:
    return cfg
  kw = dict(num_layers=n, compress_ratios=cfg.compress_ratios[:n])
  if cfg.variant == "v4":
    kw["moe"] = dataclasses.replace(cfg.moe, num_hash_layers=min(cfg.moe.num_hash_layers, n))
  else:
    kw["kv_source_layer_ids"] = tuple(i for i in cfg.kv_source_layer_ids if i < n)
    kw["index_source_layer_ids"] = tuple(i for i in cfg.index_source_layer_ids if i < n)
    kw["candidate_source_layer_id"] = cfg.candidate_source_layer_id if cfg.candidate_source_layer_id < n else -1
    e = cfg.engram
    keep = [k for k, i in enumerate(e.layer_ids) if i < n]
    kw["engram"] = dataclasses.replace(e, layer_ids=tuple(e.layer_ids[k] for k in keep),
                                       num_embeddings=tuple(e.num_embeddings[k] for k in keep))
  return dataclasses.replace(cfg, **kw)


def aot_step(cfg, mesh, rules, layout, batch: int, T: int, context: int):
  """Lower + compile the sharded step on abstract inputs. Returns (compile seconds, memory analysis or None)."""
  n_swa, n_full = pool_blocks(cfg, layout, batch, context, T)
  call, sh = sharding.jit_forward(cfg, mesh, rules, layout=layout, batch=batch, num_swa_blocks=n_swa,
                                  num_full_blocks=n_full, logits_replicated=True,
                                  step_fn=_last_token_step)
  bf = jnp.bfloat16

  def abstract(tree, shard_tree, dtype=None):
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype if (dtype and x.dtype == jnp.float32) else x.dtype,
                                          sharding=s), tree, shard_tree)

  params = abstract(model.abstract_params(cfg), sh["params"], bf)
  cache = abstract(jax.eval_shape(lambda: caches.init_cache(cfg, layout, n_swa, n_full)), sh["cache"])
  nS, nF = caches.blocks_for(context, layout.swa_block_tokens), caches.blocks_for(context, layout.full_block_tokens)
  i32 = jnp.int32
  index = caches.BatchIndex(jax.ShapeDtypeStruct((batch,), i32, sharding=sh["index"].start_pos_B),
                            jax.ShapeDtypeStruct((batch,), i32, sharding=sh["index"].num_tokens_B),
                            jax.ShapeDtypeStruct((batch, nS), i32, sharding=sh["index"].swa_table_BxS),
                            jax.ShapeDtypeStruct((batch, nF), i32, sharding=sh["index"].full_table_BxF))
  tokens = jax.ShapeDtypeStruct((batch, T), i32, sharding=sh["tokens"])
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = call.jitted.lower(params, tokens, cache, index).compile()
  secs = time.perf_counter() - t0
  try:
    mem = compiled.memory_analysis()
  except Exception:  # not every backend reports it
    mem = None
  return secs, mem


# ----------------------------------------------------------------------------------------------------------
# Scan over the repeating layer groups (V4: the learned-routing CSA/HCA pairs), so the compiled program holds one
# group body instead of every layer: compile time stops growing with depth.

def layer_groups(cfg) -> tuple[int, int, int]:
  """(first grouped layer s, group size g, number of groups n): layers [s, s + g*n) repeat every g layers with the
  same plan up to the layer index; the rest run unrolled."""
  plans = cfg.layer_plan()
  g = 2

  def same(a, b):
    return dataclasses.replace(a, index=0, kv_source=0, index_source=0) == dataclasses.replace(
        b, index=0, kv_source=0, index_source=0)

  for s in range(cfg.num_layers):
    n = 0
    while s + g * (n + 1) <= cfg.num_layers and all(same(plans[s + k], plans[s + g * n + k]) for k in range(g)):
      n += 1
    if n >= 2:
      return s, g, n
  return cfg.num_layers, g, 0


def stack_groups(layers: list, s: int, g: int, n: int, stack):
  """Per-layer list -> (head list, group tuple of g stacked trees with leading axis n, tail list)."""
  groups = tuple(jax_tree_map_stack([layers[s + g * i + k] for i in range(n)], stack) for k in range(g))
  return layers[:s], groups, layers[s + g * n:]


def jax_tree_map_stack(trees, stack):
  return jax.tree_util.tree_map(lambda *xs: stack(xs), *trees)


def scanned_step(params, config, layout, kernel_cfg, tokens_BxT, cache, index):
  """The engine's last-token step for a V4 model whose params / cache layers come as (head, groups, tail)."""
  assert config.variant == "v4", "the scanned step covers V4 (V4.1 hands CSA2 state from layer to layer)"
  s, g, n = layer_groups(config)
  plans = config.layer_plan()
  B, T = tokens_BxT.shape
  # As model.forward_aux: the padded [B, T] step is a ragged step of B*T tokens riding as a batch of one.
  ctx = StepContext.from_step(caches.step_index_from_batch(index, T), layout)
  toks = jnp.clip(tokens_BxT.reshape(B * T).astype(jnp.int32), 0, config.vocab_size - 1)[None]
  h = params["embed"][toks]
  X = jnp.broadcast_to(h[:, :, None, :], (*h.shape[:2], config.mhc.hc_mult, h.shape[-1]))
  p_head, p_groups, p_tail = params["layers"]
  c_head, c_groups, c_tail = cache.layers
  new_head, new_tail = [], []
  for i, (pl, cl) in enumerate(zip(p_head, c_head)):
    cl, X, _ = model._block(pl, config, plans[i], X, toks, ctx, cl, kernel_cfg, False)
    new_head.append(cl)

  def body(X, xs):
    pg, cg = xs
    outs = []
    for k in range(g):
      cl, X, _ = model._block(pg[k], config, plans[s + k], X, toks, ctx, cg[k], kernel_cfg, False)
      outs.append(cl)
    return X, tuple(outs)

  X, new_groups = jax.lax.scan(body, X, (p_groups, c_groups))
  for j, (pl, cl) in enumerate(zip(p_tail, c_tail)):
    cl, X, _ = model._block(pl, config, plans[s + g * n + j], X, toks, ctx, cl, kernel_cfg, False)
    new_tail.append(cl)
  h = rms_norm(mhc.hc_head(params["hc_head"], X, config.mhc, config.rms_norm_eps), params["norm"],
               config.rms_norm_eps)[0].reshape(B, T, -1)
  last = jnp.maximum(index.num_tokens_B - 1, 0)
  h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
  logits = model.lm_logits(params, h_last)
  return caches.ModelCache((new_head, new_groups, new_tail)), logits


def aot_scanned(cfg, mesh, rules, layout, batch: int, T: int, context: int):
  """AOT compile of `scanned_step` at full depth on abstract inputs: (compile seconds, memory analysis, groups)."""
  s, g, n = layer_groups(cfg)
  n_swa, n_full = pool_blocks(cfg, layout, batch, context, T)
  psh = sharding.param_shardings(cfg, mesh, rules)
  csh = sharding.cache_shardings(cfg, layout, mesh, rules, n_swa, n_full)
  bf = jnp.bfloat16

  def sds(x, sh, dtype=None):
    return jax.ShapeDtypeStruct(x.shape, dtype if (dtype and x.dtype == jnp.float32) else x.dtype, sharding=sh)

  def stacked(xs):   # ShapeDtypeStructs of one leaf over the n groups: leading axis n, replicated
    x = xs[0]
    return jax.ShapeDtypeStruct((len(xs), *x.shape), x.dtype,
                                sharding=NamedSharding(mesh, PartitionSpec(None, *x.sharding.spec)))

  params = jax.tree_util.tree_map(lambda x, sh: sds(x, sh, bf), model.abstract_params(cfg), psh)
  params = dict(params, layers=stack_groups(list(params["layers"]), s, g, n, stacked))
  cache = jax.tree_util.tree_map(sds, jax.eval_shape(lambda: caches.init_cache(cfg, layout, n_swa, n_full)), csh)
  cache = caches.ModelCache(stack_groups(list(cache.layers), s, g, n, stacked))
  shard_of = lambda t: jax.tree_util.tree_map(lambda x: x.sharding, t)  # noqa: E731
  ish = sharding.index_shardings(mesh, batch, rules)
  nS, nF = caches.blocks_for(context, layout.swa_block_tokens), caches.blocks_for(context, layout.full_block_tokens)
  i32 = jnp.int32
  index = caches.BatchIndex(jax.ShapeDtypeStruct((batch,), i32, sharding=ish.start_pos_B),
                            jax.ShapeDtypeStruct((batch,), i32, sharding=ish.num_tokens_B),
                            jax.ShapeDtypeStruct((batch, nS), i32, sharding=ish.swa_table_BxS),
                            jax.ShapeDtypeStruct((batch, nF), i32, sharding=ish.full_table_BxF))
  tokens = jax.ShapeDtypeStruct((batch, T), i32, sharding=sharding.batch_sharding(mesh, batch, 2, rules))
  fn = jax.jit(lambda p, t, c, i: scanned_step(p, cfg, layout, dispatch.KernelConfig(), t, c, i),
               out_shardings=(shard_of(cache), sharding.replicated(mesh)), donate_argnums=(2,))
  t0 = time.perf_counter()
  with jax.set_mesh(mesh):
    compiled = fn.lower(params, tokens, cache, index).compile()
  secs = time.perf_counter() - t0
  try:
    mem = compiled.memory_analysis()
  except Exception:
    mem = None
  return secs, mem, (s, g, n)


def _last_token_step(params, config, layout, kernel_cfg, tokens_BxT, cache, index):
  """A [B, T] step with logits at each row's last computed token (the padded layout `model.forward_aux` turns into
  a ragged step of B * T flat tokens): what the sizing compiles at Flash shapes."""
  cache, h_BxTxD, _ = model.forward_aux(params, config, tokens_BxT, cache, index, layout=layout,
                                        kernel_cfg=kernel_cfg, return_hidden=True)
  last = jnp.maximum(index.num_tokens_B - 1, 0)
  h_last = jnp.take_along_axis(h_BxTxD, last[:, None, None], axis=1)[:, 0]
  return cache, model.lm_logits(params, h_last)


def force_host_devices(n: int) -> None:
  """n host devices on the CPU (XLA reads XLA_FLAGS when JAX makes its backend, so call it before the first
  device use); a device count already in XLA_FLAGS is kept."""
  xla_flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in xla_flags:
    os.environ["XLA_FLAGS"] = f"{xla_flags} --xla_force_host_platform_device_count={n}".strip()


def main(argv):
  del argv
  args = FLAGS
  force_host_devices(args.devices)
  rules = sharding.Rules(kv_latent=args.kv_latent)
  layout = caches.CacheLayout(kv_dtype=jnp.dtype(args.kv_dtype))
  budget = args.device_gb - args.reserve_gb
  print(f"backend {jax.default_backend()} x {jax.device_count()} devices; batch {args.batch} x context "
        f"{args.context}; KV {args.kv_dtype}; kv_latent {args.kv_latent}; per device {args.device_gb} GB "
        f"({args.reserve_gb} GB reserved)")
  for name in args.models.split(","):
    cfg = get_preset(name)
    n_swa, n_full = pool_blocks(cfg, layout, args.batch, args.context, args.chunk)
    print(f"\n== {name}: {cfg.num_layers} layers; pools {n_swa} swa + {n_full} full blocks")
    print(f"{'mesh (data,tensor,expert)':<26} {'params GB':>10} {'experts':>8} {'engram':>8} {'KV GB':>8} "
          f"{'params+KV GB':>13} {'act GB':>8} {'params* GB':>11} {'KV/D GB':>8} {'params*+KV/D':>13}  "
          f"fits? / fits/D? (budget {budget:.0f} GB)")
    for mi, mspec in enumerate(args.meshes.split(";")):
      mesh = sharding.make_mesh(mspec)
      shape = tuple(mesh_context.axis_size(mesh, a) for a in sharding.AXES)
      total_p, dev_p, cats = param_table(cfg, mesh, rules)
      total_kv, dev_kv = pool_bytes(cfg, layout, mesh, rules, n_swa, n_full)
      _, dev_p_d, _ = param_table(cfg, mesh, sharding.pools_over_data_rules(rules))
      _, dev_kv_d = pool_bytes(cfg, layout, mesh, rules, n_swa, n_full, over_data=True)
      act = float("nan")
      note = ""
      depths = [int(d) for d in args.aot_layers.split(",")]
      if depths[0] >= 0 and mi < args.aot_meshes:
        temps = {}
        for T in (1, args.chunk):
          for d in depths:
            try:
              small = reduced_depth(cfg, d)
              secs, mem = aot_step(small, mesh, rules, layout, args.batch, T, args.context)
            except Exception as e:  # report, do not crash
              note += f"\n     T={T} {d} layers: compile failed: {type(e).__name__}: " \
                      f"{str(e).splitlines()[0][:160]}"
              continue
            line = f"\n     T={T:<5} {small.num_layers:>2} layers: compile {secs:6.1f} s"
            if mem is not None:
              temps.setdefault(T, []).append((small.num_layers, mem.temp_size_in_bytes))
              line += (f"; args {mem.argument_size_in_bytes / GB:.2f} GB, out {mem.output_size_in_bytes / GB:.2f} GB, "
                       f"aliased {mem.alias_size_in_bytes / GB:.2f} GB, temp {mem.temp_size_in_bytes / GB:.2f} GB")
            note += line
        full = []
        for T, pts in temps.items():
          if len(pts) >= 2:
            (l0, t0), (l1, t1) = pts[0], pts[-1]
            full.append(t0 + (t1 - t0) / max(l1 - l0, 1) * (cfg.num_layers - l0))
          else:
            (_, temp_bytes), = pts
            full.append(temp_bytes)
        if full:
          act = max(full) / GB
      if args.scan and mi == 0 and cfg.variant == "v4":
        for T in (1, args.chunk):
          try:
            secs, mem, (s0, g0, n0) = aot_scanned(cfg, mesh, rules, layout, args.batch, T, args.context)
          except Exception as e:
            note += f"\n     scan T={T}: compile failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            continue
          note += (f"\n     T={T:<5} all {cfg.num_layers} layers, scan over {n0} groups of {g0} (layers {s0}.."
                   f"{s0 + g0 * n0 - 1}): compile {secs:6.1f} s")
          if mem is not None:
            note += f"; temp {mem.temp_size_in_bytes / GB:.2f} GB, aliased {mem.alias_size_in_bytes / GB:.2f} GB"
      tot = dev_p / GB + dev_kv / GB
      fits = "yes" if tot <= budget else f"NO (over by {tot - budget:.1f} GB)"
      if not math.isnan(act):
        fits += "; with AOT temp " + ("yes" if tot + act <= budget else f"NO (over by {tot + act - budget:.1f} GB)")
      tot_d = dev_p_d / GB + dev_kv_d / GB
      fits += " / " + ("yes" if tot_d <= budget else f"NO (over by {tot_d - budget:.1f} GB)")
      print(f"{str(shape):<26} {dev_p / GB:>10.2f} {cats.get('routed experts', 0) / GB:>8.2f} "
            f"{cats.get('engram', 0) / GB:>8.2f} {dev_kv / GB:>8.2f} {tot:>13.2f} {act:>8.2f} {dev_p_d / GB:>11.2f} "
            f"{dev_kv_d / GB:>8.2f} {tot_d:>13.2f}  {fits}{note}", flush=True)
    print(f"   model total as stored {total_p / GB:.1f} GB; KV pools total {total_kv / GB:.1f} GB")


if __name__ == "__main__":
  define_flags()
  app.run(main)
