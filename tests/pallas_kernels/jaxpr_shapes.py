"""What a traced call builds: the shapes of every intermediate in its jaxpr (nested jaxprs included), used to show
that a kernel path builds no per-query copy of a block table."""

import jax
import jax.numpy as jnp


def _shapes_in(jaxpr):
  out = []
  for eqn in jaxpr.eqns:
    out += [(tuple(v.aval.shape), v.aval.dtype) for v in eqn.outvars if hasattr(v.aval, "shape")]
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (tuple, list)) else (p,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          out += _shapes_in(inner)
  return out


def per_query_table_shapes(fn, *args, n: int, widths, ints_only: bool = False):
  """Shapes in `fn(*args)`'s jaxpr (pjit, loops and the kernel body included) with both an `n` dimension and one
  of `widths` (the table's width in blocks or in entries): a per-query copy of the table or of its entry list.
  ints_only: only integer arrays (block ids, entry rows), for an op whose output itself is at the table's width."""
  return [s for s, dt in _shapes_in(jax.make_jaxpr(fn)(*args).jaxpr)
          if n in s and any(f in s for f in widths) and (not ints_only or jnp.issubdtype(dt, jnp.integer))]
