"""Where the fused top-k goes wrong on a GPU: one short script for the next device run (about 2-4 min on an H200,
mostly Triton compiles). Each row: err/tol of `dispatch._topk_err` (as in the GPU check) for one variant of the
failing decode case (B=64, M=32768, k=512, bf16 keys), plus whether two runs on the same inputs agree.

  python -m benchmarks.probes.topk_gpu_diag            # on the GPU
  python -m benchmarks.probes.topk_gpu_diag --dry      # CPU plumbing (interpret mode, B=2)

Reading it: `repeat_differs` on the default row = the kernel is nondeterministic (a race); `chunk512` passing while
`default` fails = the selection / compaction at select_chunk > k (radix cut, cumsum scatter), not the scores;
`one_chunk` (the first 4096 entries as a one-chunk problem, ids only, like prefill) failing = not the merge;
`warps1` passing = something across warps (cross-warp scan or store ordering).
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kernels_bench as kb
from pallas_kernels import dispatch
from pallas_kernels import indexer_topk as itk


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--dry", action="store_true")
  ap.add_argument("--only", default="")
  a = ap.parse_args()
  B, H, C, M, k = (2, 64, 128, 8192, 512) if a.dry else (64, 64, 128, 32768, 512)
  q, w, pool, rows, nv = jax.jit(lambda key: kb.indexer_case(key, B=B, T=1, H=H, C=C, M=M, prefill=False, ctx=4 * M,
                                                             fp8=False))(jax.random.PRNGKey(0))
  nk = jnp.full((B,), M, jnp.int32)
  static = dict(k=k, block_size=8)
  full = dispatch.IndexerArgs(q, w, pool, rows, nv, num_keys_B=nk)
  scores = np.asarray(jax.jit(lambda x: dispatch._topk_check_scores(x, static))(full))
  T = itk.IndexerTopkTuning
  variants = {
      "default": (T(), M),
      "chunk512": (T(select_chunk=512), M),          # k == chunk: every lane picked, slots = lane order
      "one_chunk": (T(), 4096),                      # the first 4096 entries alone: ids only, no merge
      "warps4": (T(num_warps=4), M),
      "warps1": (T(num_warps=1), M),
      "stages1": (T(num_stages=1), M),
  }
  for name, (tun, m) in variants.items():
    if a.only and name not in a.only.split(","):
      continue
    t0 = time.time()
    try:
      args = full if m == M else dispatch.IndexerArgs(q, w, pool, rows[:, :m], jnp.minimum(nv, m),
                                                      num_keys_B=jnp.full((B,), m, jnp.int32))
      sc = scores if m == M else scores[..., :m]
      f = jax.jit(lambda x, tun=tun: itk.indexer_topk_kernel(
          x.q_BxTxHxC, x.w_BxTxH, x.key_pool_PxC, x.key_rows_BxM, x.num_visible_BxT, k, num_keys_B=x.num_keys_B,
          interpret=a.dry, tuning=tun))
      g1 = np.asarray(f(args))
      g2 = np.asarray(f(args))
      err = float(dispatch._topk_err(g1, sc, args, static))
      neg = int((g1 < 0).sum())
      differs = not np.array_equal(np.sort(g1, -1), np.sort(g2, -1))
      bad_rows = int(sum(dispatch._topk_err(g1[b:b + 1], sc[b:b + 1], args, static) > 1 for b in range(B)))
      print(f"{name:10s} err/tol={err:<10.4g} neg_ids={neg:<6d} bad_rows={bad_rows}/{B} repeat_differs={differs} "
            f"({time.time() - t0:.1f} s)", flush=True)
    except Exception as e:  # a variant that does not compile is a row, not the end
      print(f"{name:10s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
