"""The Mosaic GPU kernel's barrier protocol, checked on the CPU (Mosaic GPU's interpreter in JAX 0.10.2 cannot run the
kernel itself: no plgpu.load, run_state, or transposed / register wgmma operands).

`pallas_kernels/barrier_check.py` walks the traced kernel per warpgroup and counts arrivals per phase against each
barrier's num_arrivals. Its model is tested on small kernels against Mosaic GPU's own CPU interpreter (which
simulates barriers, phases and TMA copies): the shared single-arrival barrier that the kernel used to load q with
fails there, the per-consumer barriers run and give the right numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import barrier_check as bc

plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
S = jax.ShapeDtypeStruct
H, D, W = 64, 512, 128


def _collect(fn, *args, **kw):
  try:
    return bc.collect(fn, *args, **kw)
  except bc.UnsupportedJaxpr as e:  # another JAX's jaxpr: the checker must be ported, not silently pass
    pytest.skip(f"barrier_check cannot read this JAX's Mosaic GPU jaxpr ({jax.__version__}): {e}")


@pytest.mark.parametrize("name,N,K", [("decode_b64_csa", 64, 512), ("prefill_4k_csa", 4096, 512),
                                      ("window_only", 8, 0)])
def test_sparse_attention_mgpu_barrier_protocol(name, N, K):
  from pallas_kernels import sparse_attention_mgpu as mg
  comp = (S((max(N, 64) * 1024, D), jnp.bfloat16), S((N, K), jnp.int32)) if K else (None, None)
  r = _collect(mg.sparse_attention_mgpu, S((N, H, D), jnp.bfloat16), S((256 * W, D), jnp.bfloat16),
               S((N, W), jnp.int32), comp[0], comp[1], S((H,), jnp.float32), scale=D ** -0.5)
  assert r.num_threads == 3 and r.problems == [] and r.unchecked == [], (r.problems, r.unchecked)
  # q: one barrier per consumer warpgroup, each arrived on once (by its own copy), both waited on by both.
  (q,) = [b for b in r.barriers if b.num_barriers == 2]
  assert q.num_arrivals == 1
  for wg in (0, 1):
    assert r.arrivals(q.alloc, wg) == {wg: 1}
    assert r.waiters(q.alloc, wg) == {0, 1}
  # kv free: both consumers arrive once per block (loop depth 1); only the producer waits.
  (free,) = [b for b in r.barriers
             if r.arrivals(b.alloc, 0, depth=1) == {0: 1, 1: 1} and r.waiters(b.alloc, 0) == {2}]
  assert free.num_arrivals == 2
  # The consumers' exchanges (QK^T split by keys): [0] block maxima and [1] P once per block, [2] the row sums once
  # after the loop; each arrived on and waited on by both consumers, never by the producer.
  (xchg,) = [b for b in r.barriers if b.num_barriers == 3]
  assert xchg.num_arrivals == 2
  for i, depth in ((0, 1), (1, 1), (2, 0)):
    assert r.arrivals(xchg.alloc, i, depth=depth) == {0: 1, 1: 1}, i
    assert r.waiters(xchg.alloc, i) == {0, 1}, i
  # land: the producer's 64 rows x 2 boxes per block, under either branch (window or compressed pool).
  (land,) = [b for b in r.barriers if b.num_arrivals == 128]
  assert {e.mult for e in r.events if e.alloc == land.alloc and e.arrives} == {64}


def _q_kernel(shared: bool, interpret=None):
  """Two consumer warpgroups load a [16, 128] block into one SMEM buffer, wait, and write 2x their rows. shared:
  both copy all of it with one single-arrival barrier (the old q load); else each copies its half with its own."""
  R, C = 16, 128

  def body(x_ref, o_ref, scoped):
    smem, bar = scoped
    wg = jax.lax.axis_index("wg")

    @pl.when(wg < 2)
    def _():
      rows = pl.ds(wg * (R // 2), R // 2)
      if shared:
        plgpu.copy_gmem_to_smem(x_ref, smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
      else:
        plgpu.copy_gmem_to_smem(x_ref.at[rows], smem.at[rows], bar.at[wg])
        plgpu.barrier_wait(bar.at[0])
        plgpu.barrier_wait(bar.at[1])
      o_ref[rows] = smem[rows] * 2.0

  def entry(x_ref, o_ref):
    pl.run_scoped(lambda *a: body(x_ref, o_ref, a), plgpu.SMEM((R, C), jnp.float32),
                  plgpu.Barrier(num_arrivals=1, num_barriers=1 if shared else 2), collective_axes="wg")

  return lambda x: plgpu.kernel(entry, out_type=S((R, C), jnp.float32), grid=(1,), grid_names=("n",), num_threads=3,
                                thread_name="wg", interpret=interpret)(x)


def _ring_kernel(free_arrivals: int):
  """Producer / two consumers over a dynamic number of blocks: ready (1 arrival: the producer's copy), free
  (both consumers arrive each block; free_arrivals=1 is the bug)."""
  def body(x_ref, n_ref, o_ref, scoped):
    buf, ready, free = scoped
    wg = jax.lax.axis_index("wg")
    n = n_ref[0]

    @pl.when(wg == 2)
    def _():
      @pl.loop(0, n)
      def _(i):
        pl.when(i >= 1)(lambda: plgpu.barrier_wait(free.at[0]))
        plgpu.copy_gmem_to_smem(x_ref.at[i], buf, ready.at[0])

    @pl.when(wg < 2)
    def _():
      @pl.loop(0, n)
      def _(i):
        plgpu.barrier_wait(ready.at[0])
        o_ref[i, pl.ds(wg * 8, 8)] = buf[pl.ds(wg * 8, 8)]
        plgpu.barrier_arrive(free.at[0])

  def entry(x_ref, n_ref, o_ref):
    pl.run_scoped(lambda *a: body(x_ref, n_ref, o_ref, a), plgpu.SMEM((16, 128), jnp.float32),
                  plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=free_arrivals), collective_axes="wg")

  return lambda x, n: plgpu.kernel(entry, out_type=S((4, 16, 128), jnp.float32), grid=(1,), grid_names=("b",),
                                   num_threads=3, thread_name="wg")(x, n)


def test_checker_flags_a_shared_single_arrival_barrier():
  bad = _collect(_q_kernel(True), S((16, 128), jnp.float32)).problems
  assert len(bad) == 1 and "2 arrival(s) per phase" in bad[0] and "num_arrivals=1" in bad[0], bad
  assert _collect(_q_kernel(False), S((16, 128), jnp.float32)).problems == []


def test_checker_counts_arrivals_per_loop_iteration():
  ring = (S((4, 16, 128), jnp.float32), S((1,), jnp.int32))
  assert _collect(_ring_kernel(2), *ring).problems == []
  bad = _collect(_ring_kernel(1), *ring).problems
  assert len(bad) == 1 and "2 arrival(s) per phase at loop depth 1" in bad[0], bad


def test_checker_model_agrees_with_mosaic_gpu_interpreter():
  """JAX's Mosaic GPU interpreter (CPU threads per warpgroup, barrier phases, TMA copies) runs the per-consumer
  pattern to the right answer and rejects the shared single-arrival barrier, as the checker does."""
  try:
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  except ImportError as e:
    pytest.skip(f"no Mosaic GPU interpreter in this JAX ({jax.__version__}): {e}")
  x = jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)
  out = _q_kernel(False, InterpretGPUParams())(x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(x) * 2)
  try:
    # the interpreter's words depend on which thread sees the clash first ("... phase ..." or "Barrier arrival
    # was completed again before ...")
    with pytest.raises(Exception, match="phase|[Bb]arrier arrival"):
      jax.block_until_ready(_q_kernel(True, InterpretGPUParams())(x))
  finally:
    reset_gpu_interpret_mode_state()
