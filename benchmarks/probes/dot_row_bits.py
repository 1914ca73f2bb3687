"""Does a row of `x @ W` keep its bits when the number of rows changes, or when its place among a fixed number of
rows changes? (Why the invariant step runs fixed-shape tiles: docs/engine.md, the invariant step.)

    python -m benchmarks.probes.dot_row_bits

Prints, per dtype, the row counts at which row 0 has other bits than alone, and the positions in a 16-row tile at
which the same row has other bits than at position 0."""

import jax
import jax.numpy as jnp
import numpy as np


def main():
  w_key, x_key = jax.random.split(jax.random.PRNGKey(0))
  dot = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
  for dt in (jnp.bfloat16, jnp.float32):
    w = jax.random.normal(w_key, (256, 1024)).astype(dt)
    x = jax.random.normal(x_key, (512, 256)).astype(dt)
    alone = np.asarray(dot(x[:1], w))[0]
    by_rows = [m for m in (2, 3, 7, 8, 16, 33, 64, 128, 512) if not np.array_equal(np.asarray(dot(x[:m], w))[0], alone)]
    tile = 16
    at0 = np.asarray(dot(x[100:100 + tile].at[0].set(x[0]), w))[0]
    by_place = [p for p in range(tile)
                if not np.array_equal(np.asarray(dot(x[100:100 + tile].at[p].set(x[0]), w))[p], at0)]
    print(f"{jnp.dtype(dt).name}: row 0 differs at row counts {by_rows}; differs at tile positions {by_place}")


if __name__ == "__main__":
  main()
