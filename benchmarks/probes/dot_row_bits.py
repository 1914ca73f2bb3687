"""Which XLA formulations keep a row's bits whatever the other rows of the call are? (Why the invariant step's ops
are row-invariant: docs/engine.md, the invariant step; the ops: dsv4/layers/row_invariant.py.)

    python -m benchmarks.probes.dot_row_bits

Prints one line per formulation and dtype: the row counts (or batch mixes) at which row 0 has other bits than
alone / at its first place, "[]" = invariant at every case tried. The cases:
* dot by row count: `x[:m] @ W` for m rows (XLA picks its blocking from the shape: not invariant);
* dot by place: the same row at every place of a fixed 16-row and 200-row call (one shape: invariant);
* rows_dot: fixed row blocks in a loop over the live blocks (dynamic trip count), m live rows of 1..N, the other
  rows permuted;
* batched einsum with the token axis as a batch dimension (attention's per-token products) by row count;
* row reductions (RMSNorm, softmax, top-k) and transcendentals (exp, log1p) by row count and by place;
* the routed experts: `lax.ragged_dot` (its result for a token moves with the other tokens' expert counts) and
  the grouped block formulation `grouped_experts`, by batch mix (random other tokens, other counts).
"""

import jax
import jax.numpy as jnp
import numpy as np

from dsv4.layers import row_invariant

ROW_COUNTS = (2, 3, 7, 8, 16, 33, 64, 128, 512)


def _row0_differs(f, x, counts=ROW_COUNTS):
  alone = np.asarray(f(x[:1]))[0]
  return [m for m in counts if not np.array_equal(np.asarray(f(x[:m]))[0], alone)]


def _by_place(f, x, rows):
  at0 = np.asarray(f(x[100:100 + rows].at[0].set(x[0])))[0]
  return [p for p in range(rows) if not np.array_equal(np.asarray(f(x[100:100 + rows].at[p].set(x[0])))[p], at0)]


def dots(dt, keys):
  w = jax.random.normal(keys[0], (256, 1024)).astype(dt)
  x = jax.random.normal(keys[1], (512, 256)).astype(dt)
  dot = jax.jit(lambda x: jnp.dot(x, w, preferred_element_type=jnp.float32))
  print(f"{jnp.dtype(dt).name} dot: by row count {_row0_differs(dot, x)}; by place in 16 rows "
        f"{_by_place(dot, x, 16)}; in 200 rows {_by_place(dot, x, 200)[:8]}")
  # rows_dot over a fixed 256-row buffer: row 0 with live counts 1..256 and the other rows shuffled
  rd = jax.jit(lambda x, live: row_invariant.rows_dot(x, w, live, preferred_element_type=jnp.float32))
  buf = x[:256]
  alone = np.asarray(rd(buf.at[1:].set(0), 1))[0]
  rng = np.random.default_rng(0)
  bad = []
  for m in (1, 2, 3, 7, 31, 32, 33, 64, 100, 256):
    shuffled = buf.at[1:].set(buf[1:][rng.permutation(255)])
    if not np.array_equal(np.asarray(rd(shuffled, m))[0], alone):
      bad.append(m)
  moved = [p for p in (1, 5, 31, 32, 77, 255)
           if not np.array_equal(np.asarray(rd(buf.at[p].set(buf[0]), 256))[p], alone)]
  print(f"{jnp.dtype(dt).name} rows_dot: by live count {bad}; by place {moved}")


def batched_einsum(dt, keys):
  q = jax.random.normal(keys[0], (512, 8, 64)).astype(dt)
  k = jax.random.normal(keys[1], (512, 96, 64)).astype(dt)
  f = jax.jit(lambda qk: jnp.einsum("nhd,nkd->nhk", qk[0], qk[1], preferred_element_type=jnp.float32))
  alone = np.asarray(f((q[:1], k[:1])))[0]
  bad = [m for m in ROW_COUNTS if not np.array_equal(np.asarray(f((q[:m], k[:m])))[0], alone)]
  print(f"{jnp.dtype(dt).name} einsum nhd,nkd->nhk (tokens as batch): by row count {bad}")


def reductions(keys):
  x = jax.random.normal(keys[0], (512, 1024), jnp.float32) * 3
  ops = {"rms_norm": lambda x: x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6),
         "softmax": lambda x: jax.nn.softmax(x, axis=-1),
         "top_k": lambda x: jax.lax.top_k(x, 8)[0],
         "exp": jnp.exp, "log1p": lambda x: jnp.log1p(jnp.abs(x))}
  for name, f in ops.items():
    f = jax.jit(f)
    print(f"float32 {name}: by row count {_row0_differs(f, x)}; by place in 64 rows {_by_place(f, x, 64)}")


def experts(keys):
  E, D, I, K, N = 16, 128, 64, 4, 256
  w1 = jax.random.normal(keys[0], (E, D, I), jnp.float32) / 11
  w2 = jax.random.normal(keys[1], (E, I, D), jnp.float32) / 8
  x = jax.random.normal(keys[2], (N, D), jnp.float32)
  ids = jnp.stack([jax.random.permutation(k, E)[:K] for k in jax.random.split(keys[3], N)])
  wts = jax.random.uniform(keys[4], (N, K))

  def ragged(x, ids, wts):
    order = jnp.argsort(ids.reshape(-1), stable=True)
    sizes = jnp.bincount(ids.reshape(-1), length=E).astype(jnp.int32)
    h = jax.lax.ragged_dot(x[order // K], w1, sizes, precision=jax.lax.Precision.HIGHEST)
    h = jax.lax.ragged_dot(jax.nn.silu(h), w2, sizes, precision=jax.lax.Precision.HIGHEST)
    return jnp.zeros_like(x).at[order // K].add(h * wts.reshape(-1)[order][:, None])

  def expert_fn(e, xb):
    return jnp.dot(jax.nn.silu(jnp.dot(xb, w1[e], precision=jax.lax.Precision.HIGHEST)), w2[e],
                   precision=jax.lax.Precision.HIGHEST)

  def grouped(x, ids, wts, live):
    return row_invariant.grouped_experts(x, ids, wts, expert_fn, E, live)

  forms = {"ragged_dot": jax.jit(lambda x, i, w, live: ragged(x[:live], i[:live], w[:live]), static_argnums=3),
           "grouped_experts": jax.jit(grouped)}
  rng = np.random.default_rng(1)
  for name, f in forms.items():
    alone = np.asarray(f(x, ids, wts, 1))[0]
    bad = []
    for m in (2, 5, 17, 64, 256):
      perm = np.concatenate([[0], 1 + rng.permutation(N - 1)])
      if not np.array_equal(np.asarray(f(x[perm], ids[perm], wts[perm], m))[0], alone):
        bad.append(m)
    print(f"float32 {name}: token 0 by batch mix (tokens, others shuffled) {bad}")


def main():
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  for dt in (jnp.bfloat16, jnp.float32):
    dots(dt, keys)
    batched_einsum(dt, keys)
  reductions(keys)
  experts(keys)


if __name__ == "__main__":
  main()
