"""Mixture of experts: sqrt-softplus scores, bias-corrected (or hash) choice, clamped SwiGLU experts, shared
expert. Routed experts run as one grouped formulation for every batch size (`routed_experts`: token-expert pairs
sorted by expert, fixed blocks of an expert's pairs, `dsv4.layers.row_invariant`), so a token's result never
depends on the other tokens of the step. See docs/model.md, MoE.

On a mesh with an `expert` axis (under `jax.set_mesh`), routed experts run expert-parallel instead
(`routed_experts_ep`): tokens split over (data, expert), each device ships its token-expert pairs to the expert
shard that owns the expert with one all-to-all, the owner runs its local experts as one grouped matmul (its slice of
the intermediate dimension when there is a `tensor` axis, then a psum), and a second all-to-all brings the results
back. Inside the per-shard-pool step (manual over `data`) the experts run per expert shard instead: each device
its own experts' pairs on the grouped expert kernel (`_grouped_kernel_over_expert_shards`; where the kernel cannot
take them, the grouped loop, `_grouped_over_expert_shards`), the shards' partial sums added by a psum per live row
block. Without such a mesh the single-device path below runs unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from dsv4 import mesh_context
from dsv4.layers import expert_quant, row_invariant
from dsv4.config import MoEConfig
from pallas_kernels import dispatch
from pallas_kernels.grouped_dot import GroupedDotTuning

_HI = jax.lax.Precision.HIGHEST


def swiglu(gate, up, limit: float):
  return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def route(params, x_NxD, token_ids_N, cfg: MoEConfig, hashed: bool):
  """Returns expert ids [N, k] and weights [N, k]."""
  logits = jnp.dot(x_NxD.astype(jnp.float32), params["gate"].astype(jnp.float32), precision=_HI)
  scores = jnp.sqrt(jax.nn.softplus(logits))
  if hashed:
    ids = jnp.asarray(params["tid2eid"])[token_ids_N].astype(jnp.int32)   # host params too (traced ids)
  else:
    _, ids = jax.lax.top_k(scores + params["bias"].astype(jnp.float32), cfg.num_experts_per_tok)
  w = jnp.take_along_axis(scores, ids, axis=-1)
  w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
  return ids, w


def routed_experts(params, x_NxD, ids_NxK, w_NxK, cfg: MoEConfig, live=None,
                   kernel_cfg: dispatch.KernelConfig = dispatch.KernelConfig()):
  """The [N, D] results of `routed_expert_rows` (its arguments and rows)."""
  return row_invariant.run_rows(routed_expert_rows(params, x_NxD, ids_NxK, w_NxK, cfg, live, kernel_cfg), live)


def routed_expert_rows(params, x_NxD, ids_NxK, w_NxK, cfg: MoEConfig, live=None,
                       kernel_cfg: dispatch.KernelConfig = dispatch.KernelConfig(),
                       layout: row_invariant.ExpertLayout | None = None) -> row_invariant.RowFn:
  """The routed experts of every live token (rows >= live: zeros or unspecified) as one grouped formulation for every
  batch size (`row_invariant.grouped_experts`): pairs laid out by expert, one [rows, D] x [D, I] product per live
  block of an expert's pairs with that expert's weights, so a token's result ignores how many tokens share its
  experts and each expert's weights are read once per block of its own pairs. Where `kernel_cfg` can send
  "grouped_dot" to the grouped expert kernel and the kernel can take the experts (`grouped_kernel_fits`), every
  live block runs in one kernel call per product (`row_invariant.grouped_experts_kernel`); not on a mesh that
  splits the experts outside the per-shard-pool step, where the loop runs (GSPMD cannot split a Pallas call).
  Inside the per-shard-pool step each expert shard runs its own experts: on the kernel where it can take their
  local shapes (`_grouped_kernel_over_expert_shards`), else in the loop (`_grouped_over_expert_shards`). The
  results come as rows
  (`row_invariant.RowFn`): the last per-token step (the cast of each token's sum, or its K results added) runs in
  the caller's loop. layout: the pairs' `row_invariant.ExpertLayout` where the caller made it (`moe` does, in its
  router's loop); an expert shard ranks its own pairs."""
  E = cfg.n_routed_experts
  D, I = params["w1"].shape[1], params["w1"].shape[2]
  mesh = mesh_context.active_mesh()
  ep = mesh_context.axis_size(mesh, "expert")
  tuning = kernel_cfg.grouped_dot_tuning or GroupedDotTuning()
  if _inside_data_shards() and ep > 1 and E % ep == 0:
    tp = _expert_mlp_split(mesh, I)
    if dispatch.may_use_kernel(kernel_cfg, "grouped_dot") and row_invariant.grouped_kernel_fits(D, I // tp, tuning):
      return _grouped_kernel_over_expert_shards(params, x_NxD, ids_NxK, w_NxK, cfg, live, mesh, kernel_cfg)
    return _grouped_over_expert_shards(params, x_NxD, ids_NxK, w_NxK, cfg, live, mesh)
  if (dispatch.may_use_kernel(kernel_cfg, "grouped_dot") and row_invariant.grouped_kernel_fits(D, I, tuning)
      and not _experts_split()):
    return row_invariant.grouped_expert_kernel_rows(
        x_NxD, ids_NxK, w_NxK, params["w1"], params["w3"], params["w2"],
        lambda gate, up: swiglu(gate, up, cfg.swiglu_limit), live, kernel_cfg, layout=layout)

  w1, w3, w2 = (jnp.asarray(params[k]) for k in ("w1", "w3", "w2"))   # host (numpy) params too: e is traced
  return row_invariant.grouped_expert_rows(x_NxD, ids_NxK, w_NxK, _expert_fn(w1, w3, w2, cfg), E, live,
                                           uniform_trips=_inside_data_shards(), layout=layout)


def routed_experts_reference(params, x_NxD, ids_NxK, w_NxK, cfg: MoEConfig):
  """Plain reference of `routed_experts`: each pair gathers its own expert's weights (same math, up to fp32
  summation order)."""
  def all_pairs(ids_P, xs):
    gate = jnp.einsum("pd,pdi->pi", xs, params["w1"][ids_P], precision=_HI)
    up = jnp.einsum("pd,pdi->pi", xs, params["w3"][ids_P], precision=_HI)
    return jnp.einsum("pi,pid->pd", swiglu(gate, up, cfg.swiglu_limit).astype(xs.dtype), params["w2"][ids_P],
                      precision=_HI)
  return row_invariant.grouped_experts_reference(x_NxD, ids_NxK, w_NxK, all_pairs)


def _expert_fn(w1_ExDxI, w3_ExDxI, w2_ExIxD, cfg: MoEConfig):
  """expert_fn(e, x_RxD) of the grouped loop: expert e's clamped SwiGLU on a block of rows."""
  def expert(e, xb):
    gate = jnp.dot(xb, w1_ExDxI[e], precision=_HI)
    up = jnp.dot(xb, w3_ExDxI[e], precision=_HI)
    return jnp.dot(swiglu(gate, up, cfg.swiglu_limit).astype(xb.dtype), w2_ExIxD[e], precision=_HI)
  return expert


def _grouped_over_expert_shards(params, x_NxD, ids_NxK, w_NxK, cfg: MoEConfig, live, mesh) -> row_invariant.RowFn:
  """`routed_expert_rows` inside the per-shard-pool step on a mesh with an `expert` axis: in a region manual over
  `expert` (nested in the step's `data` region), each device runs the grouped loop over its own experts' pairs only
  (`row_invariant.grouped_expert_sums`, another shard's expert is no pair), reading its local weights in place, and
  the shards' fp32 partial sums are added per live row block (a psum over `expert` in a loop over the live rows:
  the same trips on every shard). A token's result is its local experts' contributions in expert-id order on each
  shard, then the shards' partials added by the all-reduce: nothing in it depends on the other tokens. GSPMD alone
  would index the expert-split weights with the loop's traced expert id by gathering every expert's weights to every
  device once per block (`python -m benchmarks.probes.moe_mesh_collectives`)."""
  E, ep = cfg.n_routed_experts, mesh_context.axis_size(mesh, "expert")
  El = E // ep

  def local(x, ids, w, live, w1, w3, w2):
    local_ids = _local_expert_ids(ids, El)
    partial = row_invariant.grouped_expert_sums(x, local_ids, w, _expert_fn(w1, w3, w2, cfg), El, live)
    return row_invariant.map_row_blocks(lambda o: jax.lax.psum(o, "expert"), live, partial)

  rep, by_expert = PartitionSpec(), PartitionSpec("expert")
  sums = jax.shard_map(local, in_specs=(rep, rep, rep, rep, by_expert, by_expert, by_expert), out_specs=rep,
                       axis_names={"expert"}, check_vma=False)(
      x_NxD, ids_NxK, w_NxK, row_invariant.live_count(live, x_NxD.shape[0]), params["w1"], params["w3"], params["w2"])
  return row_invariant.RowFn(lambda o: o.astype(x_NxD.dtype), (sums,))


def _local_expert_ids(ids, El: int):
  """Inside a region manual over `expert`: each id as this shard's local expert, El (no pair) for another shard's."""
  local = ids - jax.lax.axis_index("expert") * El
  return jnp.where((local >= 0) & (local < El), local, El)


def _expert_mlp_split(mesh, I: int) -> int:
  """How many slices of the experts' intermediate dimension the `tensor` axis makes (the "expert_mlp" rule,
  `dsv4.sharding`): its size where it divides I, else 1."""
  tp = mesh_context.axis_size(mesh, "tensor")
  return tp if tp > 1 and I % tp == 0 else 1


def _grouped_kernel_over_expert_shards(params, x_NxD, ids_NxK, w_NxK, cfg: MoEConfig, live, mesh,
                                       kernel_cfg: dispatch.KernelConfig) -> row_invariant.RowFn:
  """`_grouped_over_expert_shards` on the grouped expert kernel: in a region manual over the axes that split the
  experts' weights (`expert`, and `tensor` where it slices their intermediate dimension), nested in the step's
  `data` region, each device lays out its own experts' pairs and runs every live block in one kernel call per
  product on its local weights (`row_invariant.grouped_expert_kernel_sums`: a Pallas call needs no GSPMD split
  there), so each expert's weights cross HBM about once per step, as on one device. With a `tensor` slice the down
  product is a partial sum over that slice, kept in fp32. Each token's local results are added in fp32 in
  expert-id order, then the shards' partials by one psum over the region's axes per live row block. A token's bits
  depend on its own routing and the mesh, never on the other tokens."""
  E, ep = cfg.n_routed_experts, mesh_context.axis_size(mesh, "expert")
  El = E // ep
  tp = _expert_mlp_split(mesh, params["w1"].shape[2])
  axes = ("expert", "tensor") if tp > 1 else ("expert",)
  act = lambda gate, up: swiglu(gate, up, cfg.swiglu_limit)

  def local(x, ids, w, live, w1, w3, w2):
    local_ids = _local_expert_ids(ids, El)
    sums = row_invariant.grouped_expert_kernel_sums(x, local_ids, w, w1, w3, w2, act, live, kernel_cfg,
                                                    down_dtype=jnp.float32 if tp > 1 else None)
    return row_invariant.map_row_blocks(lambda *b: jax.lax.psum(sums.fn(*b), axes), live, *sums.args)

  rep = PartitionSpec()
  mlp = "tensor" if tp > 1 else None
  up, down = PartitionSpec("expert", None, mlp), PartitionSpec("expert", mlp, None)
  sums = jax.shard_map(local, in_specs=(rep, rep, rep, rep, up, up, down), out_specs=rep,
                       axis_names=set(axes), check_vma=False)(
      x_NxD, ids_NxK, w_NxK, row_invariant.live_count(live, x_NxD.shape[0]), params["w1"], params["w3"], params["w2"])
  return row_invariant.RowFn(lambda o: o.astype(x_NxD.dtype), (sums,))


def _experts_split() -> bool:
  """Under a mesh whose `expert` or `tensor` axis splits the experts' weights."""
  mesh = mesh_context.active_mesh()
  return mesh is not None and (mesh_context.axis_size(mesh, "expert") > 1 or mesh_context.axis_size(mesh, "tensor") > 1)


def _inside_data_shards() -> bool:
  """Inside the per-shard-pool step (manual over `data`, every shard with the same live token count): the grouped
  loop's trip count must not follow one shard's routing, so the expert / tensor collectives inside it meet."""
  mesh = mesh_context.active_mesh()
  return mesh is not None and "data" in mesh_context.manual_axes(mesh)


def routed_experts_ep(params, x_NxD, ids_NxK, w_NxK, cfg: MoEConfig, mesh):
  """Expert-parallel `routed_experts` (same result up to fp32 summation order). Exact: the all-to-all buffers hold
  every pair a device could send to one shard (capacity n*K per destination, no token is ever dropped), which costs
  ep x the minimal buffer; a capacity factor would trade exactness for memory."""
  N, K = ids_NxK.shape
  D = x_NxD.shape[1]
  E, I = cfg.n_routed_experts, params["w1"].shape[-1]
  ep = mesh_context.axis_size(mesh, "expert")
  tp = mesh_context.axis_size(mesh, "tensor")
  tok_axes = tuple(a for a in ("data", "expert") if mesh_context.axis_size(mesh, a) > 1)
  mlp_axis = "tensor" if tp > 1 and I % tp == 0 else None
  n_shards = 1
  for a in tok_axes:
    n_shards *= mesh_context.axis_size(mesh, a)
  pad = (-N) % n_shards
  valid = jnp.arange(N + pad) < N
  if pad:
    x_NxD = jnp.pad(x_NxD, ((0, pad), (0, 0)))
    ids_NxK = jnp.pad(ids_NxK, ((0, pad), (0, 0)))
    w_NxK = jnp.pad(w_NxK, ((0, pad), (0, 0)))
  El = E // ep

  def local(x, ids, w, ok, w1, w3, w2):
    n = x.shape[0]
    C = n * K
    flat_ids = ids.reshape(-1)
    pair_ok = jnp.repeat(ok, K)
    dest = jnp.where(pair_ok, flat_ids // El, ep)              # ep = "nowhere" (padding rows)
    order = jnp.argsort(dest, stable=True)
    dest_s = dest[order]
    counts = jnp.bincount(dest, length=ep + 1)
    starts = jnp.cumsum(counts) - counts
    pos = jnp.arange(C) - starts[dest_s]
    send_x = jnp.zeros((ep, C, D), x.dtype).at[dest_s, pos].set(x[order // K], mode="drop")
    send_e = jnp.full((ep, C), El, jnp.int32).at[dest_s, pos].set(flat_ids[order] % El, mode="drop")
    recv_x = jax.lax.all_to_all(send_x, "expert", 0, 0, tiled=True).reshape(ep * C, D)
    recv_e = jax.lax.all_to_all(send_e, "expert", 0, 0, tiled=True).reshape(ep * C)
    o2 = jnp.argsort(recv_e, stable=True)
    xs = recv_x[o2]
    sizes = jnp.bincount(recv_e, length=El).astype(jnp.int32)  # the "nowhere" rows sort last, outside every group
    gate = jax.lax.ragged_dot(xs, w1, sizes, precision=_HI)
    up = jax.lax.ragged_dot(xs, w3, sizes, precision=_HI)
    h = jax.lax.ragged_dot(swiglu(gate, up, cfg.swiglu_limit).astype(x.dtype), w2, sizes, precision=_HI)
    h = jnp.where((recv_e[o2] < El)[:, None], h, 0)
    if mlp_axis is not None:
      h = jax.lax.psum(h, mlp_axis)
    back = jnp.zeros((ep * C, D), h.dtype).at[o2].set(h)
    back = jax.lax.all_to_all(back.reshape(ep, C, D), "expert", 0, 0, tiled=True)
    res = back[jnp.minimum(dest_s, ep - 1), pos]
    res = jnp.where(pair_ok[order][:, None], res, 0) * w.reshape(-1)[order][:, None].astype(h.dtype)
    return jnp.zeros_like(x).at[order // K].add(res.astype(x.dtype))

  tok = PartitionSpec(tok_axes or None, None)
  up = PartitionSpec("expert", None, mlp_axis)      # w1, w3 [E, D, I]
  down = PartitionSpec("expert", mlp_axis, None)    # w2 [E, I, D]
  out = jax.shard_map(local, mesh=mesh, in_specs=(tok, tok, tok, PartitionSpec(tok_axes or None), up, up, down),
                      out_specs=tok, check_vma=False)(x_NxD, ids_NxK, w_NxK, valid, params["w1"], params["w3"],
                                                      params["w2"])
  return out[:N]


def shared_expert(params, x_NxD, cfg: MoEConfig):
  gate = jnp.dot(x_NxD, params["w1"], precision=_HI)
  up = jnp.dot(x_NxD, params["w3"], precision=_HI)
  return jnp.dot(swiglu(gate, up, cfg.swiglu_limit), params["w2"], precision=_HI)


def moe(params, x_BxTxD, token_ids_BxT, cfg: MoEConfig, hashed: bool, live=None,
        kernel_cfg: dispatch.KernelConfig | None = None, tail: row_invariant.RowFn | None = None):
  """The MoE sublayer on the flat tokens (B * T of them). live: None, or the count of leading flat tokens that may
  be real (the rest are padding: zeros out, no work). The router and the shared expert run in fixed row blocks
  over the live rows (`row_invariant.map_row_blocks`), the routed experts grouped (`routed_experts`): a token's
  bits never depend on the other tokens of the call. tail (`row_invariant.RowFn`): the caller's row-local work on
  the output rows, in the shared expert's loop; its outputs ([B * T, ...]) are returned in place of y."""
  B, T, D = x_BxTxD.shape
  N = B * T
  x = x_BxTxD.reshape(N, D)

  def route_rows(xb, tb, live_R, seen):
    """The router on a block of rows, and its pairs' ranks in the grouped experts' layout (`seen`: each expert's
    pairs in the blocks before): the layout then needs no loop of its own."""
    ids, w = route(params, xb, tb, cfg, hashed)
    seen, rank = row_invariant.expert_ranks(seen, ids, live_R)
    return (ids, w, rank), seen
  (ids, w, rank), sizes = row_invariant.map_row_blocks(
      route_rows, live, x, token_ids_BxT.reshape(-1), jnp.arange(N) < row_invariant.live_count(live, N),
      carry=jnp.zeros((cfg.n_routed_experts,), jnp.int32))
  experts = params["experts"]
  if any(expert_quant.is_quantized(v) for v in experts.values()):  # FP4 kept from the checkpoint: dequant here
    experts = expert_quant.dense_experts(experts, params["shared"]["w1"].dtype if "shared" in params else x.dtype)
  mesh = mesh_context.active_mesh()
  # Inside the per-shard-pool step (`data` manual, sharding.jit_forward(pools_over_data=True)) a data shard's
  # tokens are on all its devices: no all-to-all, the experts run per expert shard (`routed_expert_rows`,
  # docs/sharding.md).
  if (mesh is not None and mesh_context.axis_size(mesh, "expert") > 1 and "data" not in mesh_context.manual_axes(mesh)
      and cfg.n_routed_experts % mesh_context.axis_size(mesh, "expert") == 0):
    routed = row_invariant.RowFn(lambda r: r, (routed_experts_ep(experts, x, ids, w, cfg, mesh),))
  else:
    routed = routed_expert_rows(experts, x, ids, w, cfg, live, kernel_cfg or dispatch.KernelConfig(),
                                layout=row_invariant.ExpertLayout(rank, sizes))
  # the routed rows and the add ride in the shared expert's loop: over the live rows only, not an op over the whole
  # flat axis
  out = row_invariant.map_row_blocks_then(
      lambda xb, *rb: routed.fn(*rb) + shared_expert(params["shared"], xb, cfg), tail, live, x, *routed.args)
  return out if tail is not None else out.reshape(B, T, D)
