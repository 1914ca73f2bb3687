"""Sparse MLA decode/prefill on Mosaic GPU (`plgpu`), with FlashMLA's producer/consumer structure (Hopper).

Same contract as `sparse_attention_reference` for plain bf16 pools (window + compressed ids, per-query valid lengths,
per-head sink; returns out and lse); H = 64 heads, d = 512 (V4-Flash). FP8 pools are not handled here yet (the
Triton kernel handles them).

One CTA per query token, 3 warpgroups (`plgpu.kernel(num_threads=3)`):
  * producer (wg 2, 40 registers): copies the token's id rows into SMEM, then per block of 64 ids issues one TMA per
    row (2 boxes of 256 columns: TMA boxes are <= 256 elements per dimension; Hopper has no TMA gather) into an
    untiled staging buffer; ids that are invalid or past the valid length are sent one row past the end of the pool,
    which TMA fills with zeros without reading memory (zero-filled masked loads). When the rows have landed and the
    consumers have released the previous block, it repacks the block (64 x 64 register tiles) into the tiled,
    128-byte swizzled layout wgmma reads and signals the consumers. So the TMA gather of block i + 1 overlaps the
    consumers' math on block i.
  * two consumers (wg 0, 1; 232 registers): each loads half of q's heads into the shared q buffer with its own
    barrier (one arrival per barrier: a copy is an arrival, so a shared single-arrival barrier would complete
    early and run its phases out of step) and waits for both halves; each holds a [64 heads, 256] f32 accumulator for
    its half of d_v (a full 64 x 512 f32 accumulator does not fit one warpgroup's registers). QK^T is split by keys:
    consumer wg computes S = q K^T for keys [32 wg, 32 wg + 32) of the block with wgmma (N = 32) and masks invalid
    ids to -inf; the two consumers exchange their half-block row maxima through SMEM (so both run the online
    softmax, base 2, with the same running max), then their P halves (bf16), and each accumulates P V over the whole
    block (contraction 64) for its half of the columns. Each keeps the row sum of its own keys; the two are added
    through SMEM after the loop. So each consumer does half of the QK^T MMA work it used to (both computed the full
    [64, 64] S), at the price of two consumer-to-consumer barrier meetings per block.
Known gaps vs FlashMLA (BUILD_NOTES.md, Kernels): the repack costs an SMEM round trip per row, and there is one
staging + one tiled buffer (SMEM: 64 KB q + 2 x 64 KB + 12 KB of exchange buffers), not a deeper ring. Mosaic GPU's CPU interpreter (JAX 0.10.2) does not run
these primitives (plgpu.load, run_state, transposed / register wgmma operands), so on a CPU this kernel is checked
by CUDA lowering and by a static check of its barrier protocol (`barrier_check.py`: arrivals per phase ==
num_arrivals for every barrier); against the reference only by benchmarks/gpu_check.sh --mosaic on a GPU.

Barriers: q (1 arrival, one per consumer), ids (one arrival per 128-id copy), land (one per row box copy: 128 per
block), kv ready (the producer, once per block), kv free (both consumers, once per block), consumer exchanges (both
consumers: [0] maxima and [1] P once per block, [2] row sums once).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:
  import jax.experimental.pallas.mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

H_MGPU, D_MGPU, BLOCK_K = 64, 512, 64
_CONSUMERS = 2  # consumer warpgroups (wg 0, 1); the producer is wg 2
_KH = BLOCK_K // _CONSUMERS  # keys of a block each consumer scores (the QK^T split)
_XW = 8  # width of a per-head value in the exchange buffers (the narrowest WGMMA-layout tile)
_BOX = 256  # TMA box limit per dimension (elements)
_IDS_CHUNK = 128
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _ids_layout(window_idx_NxW, comp_idx_NxK, window_len_N, comp_len_N, P_w: int, P_c: int):
  """One int32 row per query: window ids padded to whole blocks (-1), then compressed ids likewise, then a tail of
  _IDS_CHUNK ints whose first two are the live block counts (window, compressed). Ids past the valid length or out
  of range become -1 here, so the kernel only tests id >= 0."""
  def prep(idx, ln, P):
    N, K = idx.shape
    Kp = -(-max(K, 1) // BLOCK_K) * BLOCK_K
    pos = jnp.arange(K)[None, :]
    live = jnp.full((N,), K, jnp.int32) if ln is None else jnp.clip(ln.astype(jnp.int32), 0, K)
    ok = (idx >= 0) & (idx < P) & (pos < live[:, None])
    idx = jnp.pad(jnp.where(ok, idx, -1).astype(jnp.int32), ((0, 0), (0, Kp - K)), constant_values=-1)
    # Live blocks: up to the last valid id (ids are usually a valid prefix; holes inside are masked anyway).
    last = jnp.max(jnp.where(ok, pos + 1, 0), axis=1)
    return idx, (last + BLOCK_K - 1) // BLOCK_K
  wi, nbw = prep(window_idx_NxW, window_len_N, P_w)
  parts, nbc = [wi], jnp.zeros_like(nbw)
  if comp_idx_NxK is not None:
    ci, nbc = prep(comp_idx_NxK, comp_len_N, P_c)
    parts.append(ci)
  N = wi.shape[0]
  body = jnp.concatenate(parts, axis=1)
  pad = (-body.shape[1]) % _IDS_CHUNK
  tail = jnp.zeros((N, _IDS_CHUNK), jnp.int32).at[:, 0].set(nbw).at[:, 1].set(nbc)
  return jnp.concatenate([jnp.pad(body, ((0, 0), (0, pad)), constant_values=-1), tail], axis=1), wi.shape[1]


def sparse_attention_mgpu(q_NxHxD, window_pool_PxD, window_idx_NxW, comp_pool_QxD, comp_idx_NxK, sink_H,
                          window_len_N=None, comp_len_N=None, *, scale: float):
  """Mosaic GPU kernel (GPU only; see module docstring). bf16 q and pools, H = 64, d = 512."""
  if plgpu is None:  # pragma: no cover
    raise NotImplementedError("this JAX has no Pallas Mosaic GPU backend")
  N, H, D = q_NxHxD.shape
  if (H, D) != (H_MGPU, D_MGPU) or q_NxHxD.dtype != jnp.bfloat16:
    raise ValueError(f"sparse_attention_mgpu handles bf16 q with {H_MGPU} heads x d {D_MGPU}, got "
                     f"{q_NxHxD.dtype}{q_NxHxD.shape}")
  has_comp = comp_pool_QxD is not None and comp_idx_NxK is not None and comp_idx_NxK.shape[-1] > 0
  pools = [window_pool_PxD] + ([comp_pool_QxD] if has_comp else [])
  for p in pools:
    if not hasattr(p, "dtype") or p.dtype != jnp.bfloat16 or p.shape[1] != D:
      raise ValueError("sparse_attention_mgpu takes plain bf16 [P, 512] pools")
  P_w = window_pool_PxD.shape[0]
  P_c = comp_pool_QxD.shape[0] if has_comp else 1
  ids, w_width = _ids_layout(window_idx_NxW, comp_idx_NxK if has_comp else None, window_len_N,
                             comp_len_N if has_comp else None, P_w, P_c)
  KI = ids.shape[1]
  tail0 = KI - _IDS_CHUNK
  c_off = w_width  # compressed ids start here
  comp_pool = comp_pool_QxD if has_comp else window_pool_PxD
  half = D // 2
  transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
  qk2 = float(scale) * _LOG2E

  def body(q_ref, wpool_ref, cpool_ref, ids_ref, sink_ref, o_ref, lse_ref, scoped):
    ((q_smem, kv_smem, stage_smem, ids_smem, m_xchg, p_xchg), (q_bar, ids_bar, land_bar), kv_bar, kv_free,
     xchg_bar) = scoped
    n = lax.axis_index("n")
    wg = lax.axis_index("wg")

    def load_ids():
      for c in range(KI // _IDS_CHUNK):
        plgpu.copy_gmem_to_smem(ids_ref.at[n, pl.ds(c * _IDS_CHUNK, _IDS_CHUNK)],
                                ids_smem.at[pl.ds(c * _IDS_CHUNK, _IDS_CHUNK)], ids_bar.at[0])
      plgpu.barrier_wait(ids_bar.at[0])

    @pl.when(wg < 2)
    def _consumer():
      plgpu.set_max_registers(232, action="increase")
      # q is shared (one 64 KB copy in SMEM): consumer wg loads half of the heads (rows: a contiguous half of the
      # tiled buffer) with its own barrier (one arrival each), then waits for both halves. A copy arrives on its
      # barrier, so two consumers copying with one single-arrival barrier would complete it twice (or early) and
      # desynchronise its phases.
      rows = pl.ds(wg * (H // _CONSUMERS), H // _CONSUMERS)
      plgpu.copy_gmem_to_smem(q_ref.at[n, rows], q_smem.at[rows], q_bar.at[wg])
      plgpu.barrier_wait(ids_bar.at[0])
      nbw, nbc = ids_smem[tail0], ids_smem[tail0 + 1]
      plgpu.barrier_wait(q_bar.at[0])
      plgpu.barrier_wait(q_bar.at[1])
      m = plgpu.layout_cast(jnp.full((H,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      l = plgpu.layout_cast(jnp.full((H,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      acc = plgpu.layout_cast(jnp.full((H, half), 0.0, jnp.float32), plgpu.Layout.WGMMA)

      def exchange(smem, bar, x):
        """Write this consumer's [H, w] tile into its column half of `smem`, meet the other consumer at `bar`
        (2 arrivals: one per consumer; each waits once per phase) and return the whole [H, 2w] tile. Reuse is
        safe: a consumer rewrites a buffer only after the next exchange on another barrier, which the other
        consumer reaches after its reads of this one."""
        for w in range(_CONSUMERS):  # static column offsets: one branch per consumer
          @pl.when(wg == w)
          def _():
            smem.at[:, pl.ds(w * x.shape[1], x.shape[1])][...] = x
        plgpu.commit_smem()
        plgpu.barrier_arrive(bar)
        plgpu.barrier_wait(bar)
        return plgpu.load(smem, (), layout=plgpu.Layout.WGMMA, optimized=False)

      def rows(v):  # a per-head vector as an [H, _XW] tile (the exchange buffers' element)
        return lax.broadcast_in_dim(v, (H, _XW), [0])

      def step(i, carry):
        acc, m, l = carry
        start = jnp.where(i < nbw, i * BLOCK_K, c_off + (i - nbw) * BLOCK_K)
        # QK^T split by keys: consumer wg scores keys [wg * KH, (wg + 1) * KH) of the block for all heads.
        blk_ids = plgpu.load(ids_smem.at[pl.ds(start + wg * _KH, _KH)], (), layout=plgpu.Layout.WGMMA.reduce(0),
                             optimized=False)
        plgpu.barrier_wait(kv_bar.at[0])

        def qk(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(kv_smem.at[0, pl.ds(wg * _KH, _KH)], (1, 0)))
          return acc_ref[...]
        s = pl.run_scoped(qk, plgpu.ACC((H, _KH), jnp.float32))
        valid = lax.broadcast_in_dim(blk_ids >= 0, s.shape, [1])
        s = jnp.where(valid, s * qk2, -jnp.inf)
        # Both consumers need the same running max: exchange the half-block maxima.
        m_blk = exchange(m_xchg, xchg_bar.at[0], rows(s.max(axis=1))).max(axis=1)
        m_new = jnp.maximum(m, m_blk)
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)  # this consumer's keys only; the two halves are added at the end
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        # P of the whole block (both halves, through SMEM) times V for this consumer's half of d_v.
        p_all = exchange(p_xchg, xchg_bar.at[1], p.astype(jnp.bfloat16))

        def pv(acc_ref):
          plgpu.wgmma(acc_ref, p_all, kv_smem.at[0, :, pl.ds(wg * half, half)])
        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(kv_free.at[0])
        return acc, m_new, l

      acc, m, l = lax.fori_loop(0, nbw + nbc, step, (acc, m, l))
      # Both halves' sums (each repeated _XW times); a barrier of its own (one phase, outside the loop).
      l = exchange(m_xchg, xchg_bar.at[2], rows(l)).sum(axis=1) / _XW
      m_safe = jnp.where(m == -jnp.inf, 0.0, m)
      sink2 = plgpu.load(sink_ref, (), layout=plgpu.Layout.WGMMA.reduce(1), optimized=False) * _LOG2E
      denom = l + jnp.exp2(sink2 - m_safe)
      ok = (denom > 0) & (denom < jnp.inf)
      inv = jnp.where(ok, 1.0 / jnp.where(ok, denom, 1.0), 0.0)
      acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
      o_ref[n, :, pl.ds(wg * half, half)] = acc.astype(jnp.bfloat16)

      @pl.when(wg == 0)
      def _():
        lse_ref[n, :] = jnp.where(l > 0, (m_safe + jnp.log2(jnp.maximum(l, 1e-37))) * _LN2, -jnp.inf)

    @pl.when(wg == 2)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")
      load_ids()
      nbw, nbc = ids_smem[tail0], ids_smem[tail0 + 1]

      @pl.loop(0, nbw + nbc)
      def _(i):
        in_w = i < nbw
        start = jnp.where(in_w, i * BLOCK_K, c_off + (i - nbw) * BLOCK_K)

        @pl.loop(0, BLOCK_K)
        def _(j):
          r = ids_smem[start + j]

          def gather(pool_ref, P):
            rr = jnp.where(r >= 0, r, P)  # invalid -> one past the end: TMA zero-fills, reads nothing
            for c in range(D // _BOX):
              plgpu.copy_gmem_to_smem(pool_ref.at[pl.ds(rr, 1), pl.ds(c * _BOX, _BOX)],
                                      stage_smem.at[pl.ds(j, 1), pl.ds(c * _BOX, _BOX)], land_bar.at[0])
          pl.when(in_w)(lambda: gather(wpool_ref, P_w))
          pl.when(jnp.logical_not(in_w))(lambda: gather(cpool_ref, P_c))

        plgpu.barrier_wait(land_bar.at[0])

        @pl.when(i >= 1)
        def _():
          plgpu.barrier_wait(kv_free.at[0])  # both consumers are done with the previous block
        for c in range(D // 64):  # repack into the tiled + swizzled layout wgmma reads
          cols = pl.ds(c * 64, 64)
          kv_smem.at[0, :, cols][...] = plgpu.load(stage_smem.at[:, cols], (), layout=plgpu.Layout.WGMMA,
                                                   optimized=False)
        plgpu.commit_smem()
        plgpu.barrier_arrive(kv_bar.at[0])

  def entry(q_ref, wpool_ref, cpool_ref, ids_ref, sink_ref, o_ref, lse_ref):
    pl.run_scoped(
        lambda *a: body(q_ref, wpool_ref, cpool_ref, ids_ref, sink_ref, o_ref, lse_ref, a),
        (plgpu.SMEM((H, D), jnp.bfloat16, transforms=transforms),
         plgpu.SMEM((1, BLOCK_K, D), jnp.bfloat16, transforms=transforms),
         plgpu.SMEM((BLOCK_K, D), jnp.bfloat16),
         plgpu.SMEM((KI,), jnp.int32),
         plgpu.SMEM((H, _CONSUMERS * _XW), jnp.float32),  # row maxima (and at the end the row sums), one half each
         plgpu.SMEM((H, BLOCK_K), jnp.bfloat16)),  # P of the block: consumer wg writes columns of its keys
        (plgpu.Barrier(num_arrivals=1, num_barriers=_CONSUMERS),  # q: one barrier per consumer (its half)
         plgpu.Barrier(num_arrivals=KI // _IDS_CHUNK, num_barriers=1),
         plgpu.Barrier(num_arrivals=BLOCK_K * (D // _BOX), num_barriers=1)),
        plgpu.Barrier(num_arrivals=1, num_barriers=1),  # kv ready: the producer arrives once per block
        plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=1),  # kv free: each consumer arrives once per block
        # Exchanges between the consumers, both arriving: [0] block maxima and [1] P, once per block; [2] the final
        # row sums, once.
        plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=3),
        collective_axes="wg")

  out, lse = plgpu.kernel(
      entry, out_type=(jax.ShapeDtypeStruct((N, H, D), jnp.bfloat16), jax.ShapeDtypeStruct((N, H), jnp.float32)),
      grid=(N,), grid_names=("n",), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=False))(
          q_NxHxD, window_pool_PxD, comp_pool, ids, sink_H.astype(jnp.float32))
  return out, lse


sparse_attention_mgpu_jit = jax.jit(sparse_attention_mgpu, static_argnames=("scale",))
