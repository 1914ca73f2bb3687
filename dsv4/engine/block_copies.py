"""Copies of whole pool blocks between the device cache and host arrays, for the KV tiers (`dsv4.engine.tiering`)
and the state handoff: read the rows of some blocks of one group, or write rows into them, on one device or on a
mesh, through jitted programs whose id arrays are bucketed (at most three compiles per group and direction).

A record component is (layer, array name, part): part -1 = a plain pool array, 0..2 = the nope / scale / rope array
of an FP8 pool (`Fp8KVPool`). Components move between pools and records as their raw stored arrays (e4m3, UE8M0
bytes, bf16, fp32), never dequantized; the copy programs move float arrays as same-width unsigned integers, so no
backend float handling (an fp8 op upcast, a NaN made canonical) can touch a bit: a reload is exactly the rows the
step wrote."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from dsv4 import caches

def component(cache, layer: int, name: str, part: int):
  """The pool array of one record component (see the module docstring)."""
  x = cache.layers[layer][name]
  return x if part < 0 else x[part]


def _gather(cache, names, ids_N):
  """Rows of the named components at block ids (clamped), as bits (`caches.as_bits`)."""
  return tuple(caches.as_bits(component(cache, *c))[ids_N] for c in names)


def _set_blocks(cache, names, ids_N, rows):
  """Scatter block rows into the named components (ids out of range are dropped)."""
  layers = [dict(d) for d in cache.layers]
  for (l, n, p), r in zip(names, rows):
    x = layers[l][n]
    a = x if p < 0 else x[p]
    r = r if r.dtype == caches.as_bits(a).dtype else caches.as_bits(r.astype(a.dtype))
    a = caches.from_bits(caches.as_bits(a).at[ids_N].set(r, mode="drop"), a.dtype)
    if p < 0:
      layers[l][n] = a
    else:
      parts = list(x)
      parts[p] = a
      layers[l][n] = type(x)(*parts)
  return caches.ModelCache(tuple(layers))


@functools.partial(jax.jit, static_argnames=("names",), donate_argnums=(0,))
def write_blocks(cache, names, ids_N, rows):
  """One device: the cache with `rows` (bits or stored dtypes) written into the named components at ids_N."""
  return _set_blocks(cache, names, ids_N, rows)


@functools.partial(jax.jit, static_argnames=("names",))
def read_blocks(cache, names, ids_N):
  """One device: the rows of the named components at ids_N (clamped), as bits."""
  return _gather(cache, names, ids_N)


class MeshBlockCopies:
  """Block copies on a mesh. Pools over `data` (D > 1): each data shard owns num_blocks / D blocks with shard-local
  ids, so a copy runs inside a `shard_map` manual over `data` (the other axes automatic, as the step runs): every
  shard reads / writes only the ids tagged with its own shard index, so no pool byte crosses devices and nothing
  but the rows copied reaches the host. Pools replicated over `data` (D = 1): a plain jit that keeps the runner's
  cache shardings."""

  def __init__(self, runner, D: int):
    self.mesh, self.D = runner.mesh, D
    self.cache_sh = runner.shardings["cache"]
    self._fns: dict = {}

  def _fn(self, kind, names):
    f = self._fns.get((kind, names))
    if f is not None:
      return f
    over_data, replicated = PartitionSpec("data"), PartitionSpec()
    if self.D == 1:
      if kind == "read":
        f = jax.jit(lambda c, s, i: _gather(c, names, i))
      else:
        f = jax.jit(lambda c, s, i, r: _set_blocks(c, names, i, r), donate_argnums=(0,), out_shardings=self.cache_sh)
    elif kind == "read":
      def local_read(c, s_N, i_N):
        mine = s_N == jax.lax.axis_index("data")
        return _gather(c, names, jnp.where(mine, i_N, 0))
      f = jax.jit(jax.shard_map(local_read, mesh=self.mesh, in_specs=(over_data, replicated, replicated),
                                out_specs=over_data, axis_names={"data"}, check_vma=False))
    else:
      def local_write(c, s_N, i_N, rows):
        nb = component(c, *names[0]).shape[0]        # this shard's blocks (every component of a group has nb)
        return _set_blocks(c, names, jnp.where(s_N == jax.lax.axis_index("data"), i_N, nb), rows)
      f = jax.jit(jax.shard_map(local_write, mesh=self.mesh, in_specs=(over_data, replicated, replicated, replicated),
                                out_specs=over_data, axis_names={"data"}, check_vma=False),
                  donate_argnums=(0,), out_shardings=self.cache_sh)
    self._fns[(kind, names)] = f
    return f

  def read(self, cache, names, shard_N, ids_N):
    n = len(ids_N)
    with jax.set_mesh(self.mesh):
      out = self._fn("read", names)(cache, jnp.asarray(shard_N), jnp.asarray(ids_N))
    out = [np.asarray(x) for x in out]
    if self.D == 1:
      return out
    # shard s's gather sits at rows [s*n, (s+1)*n): keep each id's row from its own shard
    return [x.reshape(self.D, n, *x.shape[1:])[shard_N, np.arange(n)] for x in out]

  def write(self, cache, names, shard_N, ids_N, rows):
    with jax.set_mesh(self.mesh):
      return self._fn("write", names)(cache, jnp.asarray(shard_N), jnp.asarray(ids_N), rows)


ID_BUCKETS = (8, 64, 512)   # id-array widths of the copy programs: at most three compiles per group and direction


def id_bucket(n: int) -> int:
  """The id-array width a copy of n blocks is padded to (a multiple of the largest bucket beyond it)."""
  for b in ID_BUCKETS:
    if n <= b:
      return b
  return -(-n // ID_BUCKETS[-1]) * ID_BUCKETS[-1]
