"""Checks that need several devices, run in a subprocess by tests/dsv4/test_sharding*.py (the rest of the suite
runs on one device, and the host device count is fixed when JAX starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.dsv4.sharding_worker forward v4
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.dsv4.sharding_worker engine
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.dsv4.sharding_worker pools v4
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.dsv4.sharding_worker expert_shards

Exits non-zero (with the failing numbers) on any mismatch; prints one line per check.
"""

from __future__ import annotations

import dataclasses
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from dsv4 import caches, mesh_context, model, sharding
from dsv4 import config

MESHES = [(8, 1, 1), (1, 1, 8), (2, 2, 2), (1, 8, 1)]   # (data, tensor, expert)
RTOL = 1e-5


def wide(cfg: config.ModelConfig) -> config.ModelConfig:
  """Tiny config with enough heads, output groups and experts to split 8 ways."""
  return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, num_heads=8, o_groups=8),
                             moe=dataclasses.replace(cfg.moe, n_routed_experts=16))


def config_for(variant: str) -> config.ModelConfig:
  return wide(config.v4_tiny() if variant == "v4" else config.v41_tiny())


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def check_forward(variant: str, meshes=MESHES, kv_latent="replicated") -> None:
  """Prefill of 40 tokens (lengths differ per row) then one decode step, sharded vs one device."""
  cfg = config_for(variant)
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  B, T = 8, 40
  layout = caches.CacheLayout()
  toks = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (B, T + 1), 0, cfg.vocab_size), np.int32)
  lengths = np.asarray([T - 3 * (b % 4) for b in range(B)], np.int32)
  _, swa, full = caches.init_contiguous(cfg, B, T + 8, layout)

  def idx(start, num):
    return caches.BatchIndex(np.asarray(start, np.int32), np.asarray(num, np.int32), swa, full)

  prefill = (toks[:, :T], idx(np.zeros(B), lengths))
  decode = (toks[np.arange(B), lengths][:, None], idx(lengths, np.ones(B)))
  cache = caches.init_cache(cfg, layout, swa.size, full.size)
  cache, ref_a = model.forward_jit(params, cfg, jnp.asarray(prefill[0]), cache, prefill[1], layout)
  cache, ref_b = model.forward_jit(params, cfg, jnp.asarray(decode[0]), cache, decode[1], layout)
  valid = np.arange(T)[None, :] < lengths[:, None]
  ref_a = np.where(valid[..., None], np.asarray(ref_a), 0)
  for shape in meshes:
    mesh = sharding.make_mesh(shape)
    rules = sharding.Rules(kv_latent=kv_latent)
    call, sh = sharding.jit_forward(cfg, mesh, rules, layout=layout, batch=B, num_swa_blocks=swa.size,
                                    num_full_blocks=full.size)
    p = sharding.put(params, sh["params"])
    c = sharding.put(caches.init_cache(cfg, layout, swa.size, full.size), sh["cache"])
    c, out_a = call(p, sharding.put(prefill[0], sh["tokens"]), c, sharding.put(prefill[1], sh["index"]))
    c, out_b = call(p, sharding.put(decode[0], sh["tokens"]), c, sharding.put(decode[1], sh["index"]))
    ea = rel_err(np.where(valid[..., None], np.asarray(out_a), 0), ref_a)
    eb = rel_err(out_b, ref_b)
    n_split = sum(1 for s in jax.tree_util.tree_leaves(sh["params"]) if not s.is_fully_replicated)
    print(f"forward {variant} mesh(data,tensor,expert)={shape} kv_latent={kv_latent} prefill rel {ea:.2e} "
          f"decode rel {eb:.2e} split params {n_split}", flush=True)
    if not (ea <= RTOL and eb <= RTOL):
      sys.exit(f"FAIL forward {variant} {shape}: rel errors {ea}, {eb} > {RTOL}")
    if n_split == 0 and shape != (8, 1, 1):
      sys.exit(f"FAIL forward {variant} {shape}: nothing was sharded")


def chat_workload(vocab: int):
  from dsv4.engine import workloads
  return workloads.chat(vocab, sessions=2, turns=2, system_len=140, seed=0)


def engine_config():
  from dsv4.engine.config import EngineConfig
  return EngineConfig(max_num_seqs=4, max_num_batched_tokens=96, chunk_size=32, max_model_len=1024,
                      num_full_blocks=48, num_swa_blocks=160, record_logits=True)


def check_engine(shape=(2, 2, 2)) -> None:
  """Engine on a mesh gives the same tokens as on one device, prefix hits included."""
  from dsv4.engine.api import run_workload
  from dsv4.engine.engine import Engine
  cfg = wide(config.v4_tiny())
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  wl = chat_workload(cfg.vocab_size)
  e1 = Engine(params, cfg, engine_config())
  r1 = run_workload(e1, wl)
  e2 = Engine(params, cfg, engine_config(), mesh=sharding.make_mesh(shape))
  r2 = run_workload(e2, wl)
  hits = r2.summary()["prefix_hit_tokens"]
  worst = 0.0
  for a, b in zip(r1.outputs, r2.outputs):
    if a.output != b.output or a.error or b.error:
      sys.exit(f"FAIL engine {shape}: {a.rid} one device {a.output} vs mesh {b.output} ({a.error}, {b.error})")
    worst = max(worst, rel_err(np.stack(b.token_logits), np.stack(a.token_logits)))
  print(f"engine mesh={shape} requests {len(r1.outputs)} same tokens; prefix hit tokens {hits} "
        f"(one device {r1.summary()['prefix_hit_tokens']}); worst logit rel {worst:.2e}", flush=True)
  if hits == 0 or hits != r1.summary()["prefix_hit_tokens"]:
    sys.exit(f"FAIL engine {shape}: prefix hits {hits} vs {r1.summary()['prefix_hit_tokens']}")
  if worst > RTOL:
    sys.exit(f"FAIL engine {shape}: logits rel {worst}")


# ------------------------------------------------------------------------------------------ pools over data

def affinity_workload(vocab: int):
  """Three sessions, three waves (a wave starts when the previous one has finished). A and B share a system prompt;
  B starts after A's first turn, so on one device B's first turn hits A's system prompt: on the mesh only prefix
  affinity (B placed on A's shard) keeps that hit. C has its own system prompt. Later turns extend their history."""
  from dsv4.engine.sampling import SamplingParams
  from dsv4.engine.workloads import Turn, Workload
  rng = np.random.default_rng(5)
  toks = lambda n: tuple(int(t) for t in rng.integers(3, vocab, n))  # noqa: E731
  sp = lambda n: SamplingParams(max_tokens=n, ignore_eos=True)  # noqa: E731
  sys_ab, sys_c = toks(150), toks(140)
  waves = ((Turn("A", sys_ab + toks(12), sp(6)),),
           (Turn("B", sys_ab + toks(20), sp(5)), Turn("C", sys_c + toks(9), sp(7))),
           (Turn("A", toks(17), sp(4)), Turn("B", toks(11), sp(6)), Turn("C", toks(23), sp(5))))
  return Workload("affinity", waves)


def same_tokens(r1, r2, e1, e2, what):
  worst = 0.0
  for a, b in zip(r1.outputs, r2.outputs):
    if a.output != b.output or a.error or b.error:
      sys.exit(f"FAIL {what}: {a.rid} one device {a.output} vs mesh {b.output} ({a.error}, {b.error})")
    worst = max(worst, rel_err(np.stack(b.token_logits), np.stack(a.token_logits)))
  if worst > RTOL:
    sys.exit(f"FAIL {what}: logits rel {worst}")
  return worst


def _groups(attrs: str):
  """Device groups of one collective from its HLO attributes (explicit {{..},..} or iota [G,S]<=[dims]T(perm)
  replica groups, or a permute's source_target_pairs); None if absent."""
  import re
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
  if m:
    dims = [int(x) for x in m.group(3).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(4):
      ids = ids.transpose([int(x) for x in m.group(4).split(",")])
    return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
  m = re.search(r"(?:replica_groups|source_target_pairs)=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", attrs)
  if m:
    return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  return None


def collectives(hlo: str, data_of=None) -> list[tuple[str, str, int, bool]]:
  """(kind, result shape, bytes, crosses data shards) of every cross-device collective of a compiled module's
  text. data_of(partition id) -> data coordinate; a collective crosses data shards when one of its device groups
  holds partitions of two data coordinates (no groups = all devices)."""
  import re
  size = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "u8": 1, "s8": 1, "f8e4m3fn": 1}
  out = []
  for shp, kind, attrs in re.findall(r"= ([^ ]+) (all-gather|all-to-all|all-reduce|collective-permute|"
                                     r"reduce-scatter)(?:-start)?\((.*)", hlo):
    nbytes = 0
    for dt, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", shp):
      nbytes += size.get(dt, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    groups = _groups(attrs)
    cross = True if groups is None or data_of is None else any(len({data_of(i) for i in g}) > 1 for g in groups)
    out.append((kind, shp, nbytes, cross))
  return out


def step_collectives(engine):
  """Collectives of the engine's compiled step program (its one shape; compiled from abstract plan values, no pool
  needed on the host)."""
  r = engine.runner
  shape = r.step_shape
  tables, plan = r.mesh_inputs([np.zeros(shape.size, np.int32) for _ in range(r.num_shards)])
  with jax.set_mesh(r.mesh):
    hlo = r._mesh_step(shape).lower(r.params, r.cache, tables, r.prev_tokens, plan).compile().as_text()
  # Partition i runs on the mesh's i-th device (row-major over data, tensor, expert).
  per_data = r.mesh.devices.size // mesh_context.axis_size(r.mesh, "data")
  return collectives(hlo, lambda i: i // per_data)


def check_pools(variant: str, shape=(2, 2, 2)) -> None:
  """Engine with one KV pool per data shard (pools split over `data`): same tokens as one device, prefix hits kept
  by affinity, per-device pool bytes = total / D, preemption inside a shard, no pool-sized collective."""
  from dsv4.engine.api import run_workload
  from dsv4.engine.engine import Engine
  cfg = config_for(variant)
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  mesh = sharding.make_mesh(shape)
  D = shape[0]
  wl = affinity_workload(cfg.vocab_size)
  e1 = Engine(params, cfg, engine_config())
  r1 = run_workload(e1, wl)
  e2 = Engine(params, cfg, engine_config(), mesh=mesh)
  r2 = run_workload(e2, wl)
  worst = same_tokens(r1, r2, e1, e2, f"pools {variant} {shape}")
  hits1 = {o.rid: o.hit_tokens for o in r1.outputs}
  hits2 = {o.rid: o.hit_tokens for o in r2.outputs}
  shard = {rid: e2.requests[rid].shard for rid in hits2}
  print(f"pools {variant} mesh={shape} same tokens (worst logit rel {worst:.2e}); hits one device {hits1}, "
        f"mesh {hits2}; shards {shard}", flush=True)
  # By hand: A.t0 and C.t0 miss; B.t0 hits the shared system prompt (affinity put B on A's shard); every later
  # turn hits its own history; C (no common prefix) went to the other shard; the hits are the one-device hits.
  want_zero, want_hit = ("A.t0", "C.t1"), ("B.t1", "A.t2", "B.t2", "C.t2")
  if any(hits2[r] for r in want_zero) or not all(hits2[r] > 0 for r in want_hit) or hits2 != hits1:
    sys.exit(f"FAIL pools {variant}: hits {hits2} (one device {hits1})")
  if not (shard["A.t0"] == shard["B.t1"] == shard["A.t2"] == shard["B.t2"] != shard["C.t1"] == shard["C.t2"]):
    sys.exit(f"FAIL pools {variant}: placement {shard}")
  if e2.num_shards != D or [m.num_blocks for m in e2.managers] != [{"full": 48 // D, "swa": 160 // D}] * D:
    sys.exit(f"FAIL pools {variant}: managers {[m.num_blocks for m in e2.managers]}")
  # The mesh runs the engine's one step program: every step shape went through the shard_map-wrapped ragged step.
  from dsv4.engine.step_plan import RaggedShape
  shapes = e2.runner.shapes_run
  if not shapes or set(e2.runner._mesh_steps) != shapes or not all(isinstance(s, RaggedShape) for s in shapes):
    sys.exit(f"FAIL pools {variant}: step shapes {shapes} vs mesh programs {set(e2.runner._mesh_steps)}")

  # Per-device pool bytes = total / D: each pool's block axis is split over data (and nothing else splits it).
  total = local = 0
  for leaf in jax.tree_util.tree_leaves(e2.runner.cache):
    shapes = {tuple(sh.data.shape) for sh in leaf.addressable_shards}
    want = (leaf.shape[0] // D, *leaf.shape[1:])     # default rules: nothing but `data` splits a pool
    if shapes != {want}:
      sys.exit(f"FAIL pools {variant}: pool {leaf.shape} shards {shapes}, want {want}")
    total += leaf.nbytes
    local += max(sh.data.nbytes for sh in leaf.addressable_shards)
  if local * D != total:
    sys.exit(f"FAIL pools {variant}: per-device pool bytes {local} x {D} != {total}")
  print(f"pools {variant}: per-device pool bytes {local} = total {total} / {D}", flush=True)

  # No collective moves a pool: no collective has a pool array's shape (local or whole, ignoring unit dims) or
  # reaches the largest local pool array's bytes; and across data shards only the sampled tokens (and recorded
  # logits) move, gathered so every process reads them. The replicated-pool engine on the same mesh is printed
  # beside it. (Shapes, not element counts: an activation [1, N, D] may hold as many elements as a small pool.)
  leaves = jax.tree_util.tree_leaves(e2.runner.cache)

  def dims(shape) -> tuple:
    return tuple(int(d) for d in shape if int(d) != 1)

  pool_shapes = {dims(l.shape) for l in leaves} | {dims(l.addressable_shards[0].data.shape) for l in leaves}
  largest = max(max(sh.data.nbytes for sh in l.addressable_shards) for l in leaves)
  logits_bytes = e2.ec.max_num_seqs * cfg.vocab_size * 4
  e3 = Engine(params, cfg, engine_config(), mesh=mesh, pools_over_data=False)
  for T in (e2.runner.step_shape.tokens,):
    got, rep = step_collectives(e2), step_collectives(e3)
    bad = [c for c in got if c[2] >= largest or any(dims(d.split(",")) in pool_shapes
                                                      for d in re.findall(r"\[([0-9,]+)\]", c[1]))]
    cross = [c for c in got if c[3]]
    cross_rep = [c for c in rep if c[3]]
    print(f"pools {variant} step T={T}: {len(got)} collectives, {len(cross)} across data shards "
          f"({sorted({c[1] for c in cross})}), largest {max([c[2] for c in got] + [0])} B; replicated pools: "
          f"{len(rep)} collectives, {len(cross_rep)} across data shards; largest local pool array {largest} B",
          flush=True)
    if bad:
      sys.exit(f"FAIL pools {variant}: pool-sized collectives {bad[:5]}")
    if any(c[2] > logits_bytes or c[0] != "all-gather" for c in cross):
      sys.exit(f"FAIL pools {variant}: collectives across data shards {cross[:8]}")
  del e3

  # Preemption inside a shard: 2 full + 8 swa blocks per shard for 6 concurrent requests (2 rows per shard).
  from dsv4.engine import workloads
  wl = workloads.random_prompts(cfg.vocab_size, requests=6, prompt_len=(100, 200), answer_len=(8, 16), seed=3)
  small = dataclasses.replace(engine_config(), num_full_blocks=2 * D, num_swa_blocks=8 * D)
  e4 = Engine(params, cfg, engine_config())
  r4 = run_workload(e4, wl)
  e5 = Engine(params, cfg, small, mesh=mesh)
  r5 = run_workload(e5, wl)
  worst = same_tokens(r4, r5, e4, e5, f"pools preemption {variant}")
  pre = e5.stats["preemptions"]
  per_shard = sorted({e5.requests[o.rid].shard for o in r5.outputs if o.num_preemptions})
  print(f"pools {variant} small pool: {pre} preemptions (shards {per_shard}), recomputed "
        f"{e5.stats['recomputed_tokens']} tokens, same tokens as one device (worst logit rel {worst:.2e})", flush=True)
  if pre == 0:
    sys.exit(f"FAIL pools {variant}: the small pool did not preempt")


def check_tables(shape=(2, 2, 2)) -> None:
  """A mesh step's block tables reach the mesh device to device: building them reads nothing back to the host, and
  each data shard's devices hold its manager's table."""
  from cache.hashing import ExtraKeys
  from dsv4.engine.engine import Engine
  cfg = config_for("v4")
  e = Engine(model.init_params(cfg, jax.random.PRNGKey(0)), cfg, engine_config(), mesh=sharding.make_mesh(shape))
  D = shape[0]
  for k, m in enumerate(e.managers):     # different rows per shard: a shard mix-up shows
    m.add_requests([(f"r{k}", np.arange(100 + 130 * k, dtype=np.int32) % 50 + 3, ExtraKeys())],
                   allocate_tokens=[100 + 130 * k])
  bufs = [np.zeros(8, np.int32) for _ in range(D)]
  # On the CPU JAX's transfer guard does not see device->host reads (host memory either way): refuse them here.
  from jax._src import array as jax_array

  def refuse(*a, **k):
    raise AssertionError("mesh_inputs read a device array back to the host")
  saved = jax.device_get, jax_array.ArrayImpl.__array__
  jax.device_get, jax_array.ArrayImpl.__array__ = refuse, refuse
  try:
    tables, _ = e.runner.mesh_inputs(bufs)
  finally:
    jax.device_get, jax_array.ArrayImpl.__array__ = saved
  for g, t in tables.items():
    assert t.sharding == e.runner.shardings["plan"], (g, t.sharding)
    got = np.asarray(t)
    for k, m in enumerate(e.managers):
      want = np.asarray(m.device_tables[g])
      assert (got[k] == want).all(), (g, k)
      assert (want >= 0).any(), (g, k)
  print(f"tables on the mesh: {sorted(tables)} device to device, per shard equal to its manager's", flush=True)


def check_expert_shards() -> None:
  """The routed experts inside the per-shard-pool step (a region manual over `data`) on meshes that split the
  experts over `expert`, and their intermediate dimension over `tensor` or not: on the grouped expert kernel
  (interpret mode: a pallas_call in the program) and in the grouped loop (XLA), each within 1e-5 of a float64
  per-token reference, and each token's bits the same alone as in any batch of other tokens."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  from dsv4.config import MoEConfig
  from dsv4.layers import moe
  from pallas_kernels import dispatch
  from pallas_kernels.grouped_dot import GroupedDotTuning

  E, K, D, I, N = 8, 2, 32, 32, 12
  cfg = MoEConfig(n_routed_experts=E, num_experts_per_tok=K, intermediate_size=I)
  ks = jax.random.split(jax.random.PRNGKey(7), 5)
  p = {"w1": jax.random.normal(ks[0], (E, D, I)) / 5, "w3": jax.random.normal(ks[1], (E, D, I)) / 5,
       "w2": jax.random.normal(ks[2], (E, I, D)) / 4}
  x = np.asarray(jax.random.normal(ks[3], (N, D)), np.float32)
  rng = np.random.default_rng(7)
  ids = np.stack([rng.choice(E, K, replace=False) for _ in range(N)]).astype(np.int32)
  w = np.asarray(jax.random.uniform(ks[4], (N, K)), np.float32)
  x64, w1, w3, w2 = (np.asarray(a, np.float64) for a in (x, p["w1"], p["w3"], p["w2"]))
  want = np.zeros((N, D))
  for n in range(N):
    for k in range(K):
      e = ids[n, k]
      g, u = np.minimum(x64[n] @ w1[e], cfg.swiglu_limit), np.clip(x64[n] @ w3[e], -cfg.swiglu_limit,
                                                                     cfg.swiglu_limit)
      want[n] += w[n, k] * ((g / (1 + np.exp(-g)) * u) @ w2[e])
  tiles = GroupedDotTuning(block_k=16, block_cols=16)
  for shape in ((2, 1, 2), (2, 2, 2), (1, 2, 4)):
    mesh = sharding.make_mesh(shape)
    Dd = shape[0]
    up, down = (NamedSharding(mesh, P("expert", None, "tensor")), NamedSharding(mesh, P("expert", "tensor", None)))
    params = {"w1": jax.device_put(p["w1"], up), "w3": jax.device_put(p["w3"], up),
              "w2": jax.device_put(p["w2"], down)}
    for backend in ("interpret", "xla"):
      kcfg = dispatch.KernelConfig(backend, grouped_dot_tuning=tiles)

      def step(params, x, ids, w, live):        # one data shard's rows, as the engine's step holds them
        return moe.routed_experts(params, x[0], ids[0], w[0], cfg, live[0], kcfg)[None]

      by_data = P("data")
      f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), by_data, by_data, by_data, by_data),
                                out_specs=by_data, axis_names={"data"}, check_vma=False))

      def run(rows: list[int], width: int):
        """The rows' results when each data shard holds `rows` first (then padding) in a step of `width`."""
        xs, is_, ws = np.zeros((Dd, width, D), np.float32), np.zeros((Dd, width, K), np.int32), \
            np.zeros((Dd, width, K), np.float32)
        for d in range(Dd):
          xs[d, :len(rows)], is_[d, :len(rows)], ws[d, :len(rows)] = x[rows], ids[rows], w[rows]
        with jax.set_mesh(mesh):
          out = f(params, xs, is_, ws, np.full((Dd,), len(rows), np.int32))
        return np.asarray(out)[:, :len(rows)]

      with jax.set_mesh(mesh):
        jaxpr = str(jax.make_jaxpr(f)(params, np.zeros((Dd, N, D), np.float32), np.zeros((Dd, N, K), np.int32),
                                      np.zeros((Dd, N, K), np.float32), np.full((Dd,), N, np.int32)))
      on_kernel = "pallas_call" in jaxpr
      if on_kernel != (backend == "interpret"):
        sys.exit(f"FAIL expert shards {shape} {backend}: pallas_call in the program: {on_kernel}")
      every = run(list(range(N)), N)
      err = float(np.max(np.abs(every - want[None])))
      if err > 1e-5 * max(1.0, float(np.max(np.abs(want)))):
        sys.exit(f"FAIL expert shards {shape} {backend}: {err:.2e} from the reference")
      bits = every.view(np.uint32)
      for rows, width in (([5], N), ([5], 2 * N), ([11, 5, 0], N), (list(range(N - 1, -1, -1)), 2 * N)):
        got = run(rows, width).view(np.uint32)
        if not np.array_equal(got, bits[:, rows]):
          sys.exit(f"FAIL expert shards {shape} {backend}: rows {rows} in a step of {width} changed their bits")
      print(f"expert shards mesh={shape} {backend}: {'kernel' if on_kernel else 'loop'}, {err:.1e} from the "
            f"reference, rows alone == batched bit for bit", flush=True)


if __name__ == "__main__":
  what = sys.argv[1]
  if jax.device_count() < 8:
    sys.exit(f"needs 8 devices, got {jax.device_count()} (set XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  if what == "forward":
    check_forward(sys.argv[2], meshes=MESHES,
                  kv_latent=sys.argv[3] if len(sys.argv) > 3 else "replicated")
  elif what == "forward_feature":
    check_forward(sys.argv[2], meshes=[(2, 2, 2)], kv_latent="feature")
  elif what == "engine":
    check_engine()
  elif what == "pools":
    check_pools(sys.argv[2])
  elif what == "expert_shards":
    check_expert_shards()
  elif what == "tables":
    check_tables()
  else:
    sys.exit(f"unknown check {what!r}")
  print("OK")
