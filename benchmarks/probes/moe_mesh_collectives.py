"""What does the engine's mesh step do with the routed experts' weights? The collectives XLA puts in the compiled
step program of an engine on a mesh of host devices (tiny V4), by kind and result shape, and whether each sits in a
loop body (a `while` body runs it once per trip: for the grouped expert loop, once per block of pairs).

Two meshes, each the engine's default placement there:

* (1, 1, E) = data x tensor x expert: one KV pool, `data` not manual: the MoE takes its expert-parallel path
  (`moe.routed_experts_ep`: tokens to their experts' owners and back);
* (2, 1, 2): one KV pool per data shard, the step manual over `data` (`jax.shard_map`), the experts split over
  `expert`: the MoE runs each expert shard's own experts in a region manual over `expert` (and `tensor` on the
  kernel where it slices them), on the grouped expert kernel (`--kernels=interpret`: the kernel's interpret mode,
  as a GPU runs it by default) or in the grouped loop (`--kernels=xla`), then a psum per live row block.

Read: an all-gather whose result is [E, D, I] or [E, I, D] (every expert's weights) inside a loop body moves every
routed expert's weights to every device once per block of pairs. At V4-Flash (256 experts of 3 x 4096 x 2048, bf16
as the engine holds them) that is 12.9 GB per block per layer.

    python -m benchmarks.probes.moe_mesh_collectives [--meshes=1,1,4;2,1,2] [--kernels=xla|interpret]
"""

from __future__ import annotations

import collections
import re

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("meshes", "1,1,4;2,1,2", "data,tensor,expert meshes, ';'-separated (host devices: the largest "
                      "product)")
  flags.DEFINE_enum("kernels", "xla", ["xla", "interpret"], "the engine's kernel backend (`KernelConfig.backend`): "
                    "interpret runs the routed experts on the grouped expert kernel's interpret mode")


def collectives(hlo: str) -> collections.Counter:
  """(kind, result shape, in a loop body?) -> count, from an optimized HLO module's text."""
  bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
  out, comp = collections.Counter(), None
  for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
    if m and line.rstrip().endswith("{"):
      comp = m.group(1)
    m = re.search(r"= (.+?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(",
                  line)
    if m:
      shape = re.sub(r"\{[^}]*\}", "", m.group(1))        # layouts dropped
      out[(m.group(2), shape, comp in bodies)] += 1
  return out


def step_hlo(mesh_shape: tuple[int, int, int], kernels: str = "xla") -> str:
  """The optimized HLO of the mesh step program an engine compiled for a short request on `mesh_shape`."""
  import jax

  from dsv4 import config, model, sharding
  from dsv4.engine import runner as runner_mod
  from dsv4.engine.config import EngineConfig
  from dsv4.engine.engine import Engine
  from dsv4.engine.sampling import SamplingParams
  from pallas_kernels import dispatch
  from pallas_kernels.grouped_dot import GroupedDotTuning

  seen = {}
  mesh_step = runner_mod.ModelRunner._mesh_step

  def spy(self, shape):
    fn = mesh_step(self, shape)

    def call(*args):
      seen.setdefault("call", (fn, args))
      return fn(*args)
    return call

  cfg = config.v4_tiny(num_layers=3)
  params = model.init_params(cfg, jax.random.PRNGKey(0))
  mesh = sharding.make_mesh(mesh_shape)
  D = mesh_shape[0]
  ec = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, chunk_size=32, max_model_len=384,
                    num_full_blocks=12 * D, num_swa_blocks=40 * D,
                    kernel=dispatch.KernelConfig(kernels, grouped_dot_tuning=GroupedDotTuning(block_k=16,
                                                                                              block_cols=16)))
  runner_mod.ModelRunner._mesh_step = spy
  try:
    eng = Engine(params, cfg, ec, mesh=mesh)
    eng.add_request("a", list(range(2, 40)), SamplingParams(max_tokens=2, ignore_eos=True))
    while eng.has_work():
      eng.step()
  finally:
    runner_mod.ModelRunner._mesh_step = mesh_step
  fn, args = seen["call"]
  with jax.set_mesh(mesh):
    return fn.lower(*args).compile().as_text()


def main(argv):
  del argv
  from benchmarks import sizing
  from dsv4 import config
  meshes = [tuple(int(x) for x in m.split(",")) for m in FLAGS.meshes.split(";")]
  sizing.force_host_devices(max(a * b * c for a, b, c in meshes))
  cfg = config.v4_tiny(num_layers=3)
  E, Dm, I = cfg.moe.n_routed_experts, cfg.hidden_size, cfg.moe.intermediate_size
  print(f"tiny V4: {E} routed experts of {Dm} x {I}, 3 layers; every expert's weights: [{E},{Dm},{I}] / "
        f"[{E},{I},{Dm}]")
  for m in meshes:
    got = collectives(step_hlo(m, FLAGS.kernels))
    print(f"\nmesh (data, tensor, expert) = {m}, kernels {FLAGS.kernels}: {sum(got.values())} collectives in the "
          f"step program")
    print(f"  {'count':>5}  {'kind':<18} {'result':<22} in a loop body")
    for (kind, shape, in_loop), n in sorted(got.items(), key=lambda kv: (-kv[1], kv[0])):
      print(f"  {n:>5}  {kind:<18} {shape:<22} {'yes' if in_loop else 'no'}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
