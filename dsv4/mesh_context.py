"""The model's view of the device mesh: which mesh is active (none outside `jax.set_mesh`), which of its axes an
enclosing `shard_map` made manual, and the one activation constraint the model places itself. Everything here is
a no-op without a mesh. The mesh, the sharding rules and the placement of params and caches are in
`dsv4.sharding`, which builds on this module (the model imports only this one)."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec


def active_mesh():
  """The mesh of the enclosing `jax.set_mesh` (an AbstractMesh while tracing), or None."""
  m = jax.sharding.get_abstract_mesh()
  return None if m.empty else m


def manual_axes(mesh) -> tuple[str, ...]:
  """Mesh axes an enclosing `shard_map` already made manual (inside the per-shard-pool step: `data`)."""
  return tuple(getattr(mesh, "manual_axes", ())) if mesh is not None else ()


def axis_size(mesh, name: str) -> int:
  return int(dict(mesh.shape).get(name, 1)) if mesh is not None else 1


def constrain_batch(x):
  """Pins an activation's leading (batch) axis to `data`, so embedding lookups from a vocab-split table and the
  shard_map regions see rows where the step's inputs put them."""
  m = active_mesh()
  d = axis_size(m, "data")
  if m is None or d <= 1 or x.shape[0] % d or "data" in manual_axes(m):  # data-manual step: rows already local
    return x
  return jax.lax.with_sharding_constraint(x, PartitionSpec("data", *([None] * (x.ndim - 1))))
