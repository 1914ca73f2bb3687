"""The composition matrix on tiny V4 and V4.1: {one device, mesh (2, 2, 2) on 8 host devices} x {fp32, bf16, FP8
KV} x {no tiers, host + disk tiers with a small pool that forces demotion and reload} x {XLA, interpret kernels}.
Every row: greedy tokens equal to a cold one-device engine at the same KV precision, logits within a stated
tolerance of `forward_full` on the row's kernels, prefix hits, tier hits where tiers are on, and a batched request's
logits bitwise equal to its run alone (the checks: tests/dsv4/composition_worker.py).

The all-pairs covering set has 6 rows (every pair of factor values in some row). CI's slow tier (tests/slow_tier.py)
runs V4's mesh rows (one child process) and two of its one-device rows (each in a child at XLA's default level); the
sixth, one device with fp32 KV on XLA, and V4.1's rows run on demand with the full product (24 rows per variant,
30-100 s a row), marked `matrix` (`pytest -n 2 -m matrix tests`): in CI they would take longer than its budget. Mesh
rows split the pools over data (the engine's default on a mesh)."""

import dataclasses
import itertools

import pytest

from tests.dsv4 import composition_worker
from tests.dsv4.test_sharding import run_worker
from tests.isolation import run_in_child


def run_mesh_worker(variant, combos, tmp, timeout=3000):
  """At XLA's default optimisation level, as the one-device rows: every row checks alone == batched bit for bit, a
  claim about the code users run. Under the suite's two fast-compile flags together (`tests/xla_test_flags.py`)
  the V4 fp32 interpret row's B differs from its run alone by 1e-6 (its compressor pools are fp32 exp / log1p
  merges); with either flag alone, or at the default level, it keeps its bits."""
  return run_worker(variant, ",".join(c.name for c in combos), str(tmp), timeout=timeout,
                    module="tests.dsv4.composition_worker", default_xla_opt=True)


@pytest.fixture(scope="module")
def cold_v4():
  return composition_worker.Cold("v4", mesh=False)


@pytest.fixture(scope="module")
def cold_v41():
  return composition_worker.Cold("v41", mesh=False)


def test_all_pairs_rows_cover_every_pair_of_factor_values():
  names = list(composition_worker.FACTORS)
  assert names == [f.name for f in dataclasses.fields(composition_worker.Combo)]
  rows = [dataclasses.astuple(c) for c in composition_worker.ALL_PAIRS]     # fields in FACTORS order
  for (i, a), (j, b) in itertools.combinations(enumerate(names), 2):
    for va, vb in itertools.product(composition_worker.FACTORS[a], composition_worker.FACTORS[b]):
      assert any(r[i] == va and r[j] == vb for r in rows), (a, va, b, vb)
  assert len(composition_worker.FULL) == 24 and len(set(composition_worker.FULL)) == 24
  assert all(c in composition_worker.FULL for c in composition_worker.ALL_PAIRS)
  assert all(composition_worker.Combo.parse(c.name) == c for c in composition_worker.FULL)


ONE_PAIRS = [c for c in composition_worker.ALL_PAIRS if not c.mesh and c.name not in composition_worker.REFUSED]
MESH_PAIRS = [c for c in composition_worker.ALL_PAIRS if c.mesh and c.name not in composition_worker.REFUSED]


@pytest.mark.parametrize("combo", ONE_PAIRS, ids=lambda c: c.name)
def test_all_pairs_one_device_v4(combo, tmp_path, request):
  """In a child at XLA's default optimisation level: the row's bitwise check (alone == batched) is about the code
  users run (at the suite's fast-compile level XLA's CPU code keeps no such property)."""
  if run_in_child(request, default_xla_opt=True):
    return
  print(composition_worker.check(combo, request.getfixturevalue("cold_v4"), str(tmp_path)))


@pytest.mark.parametrize("combo", ONE_PAIRS, ids=lambda c: c.name)
def test_all_pairs_one_device_v41(combo, tmp_path, request):
  if run_in_child(request, default_xla_opt=True):
    return
  print(composition_worker.check(combo, request.getfixturevalue("cold_v41"), str(tmp_path)))


@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_all_pairs_mesh(variant, tmp_path):
  """The all-pairs set's mesh rows, in one child process with 8 host devices."""
  out = run_mesh_worker(variant, MESH_PAIRS, tmp_path)
  assert out.count("tokens == cold") == len(MESH_PAIRS)


FULL_ONE = [c for c in composition_worker.FULL if not c.mesh and c.name not in composition_worker.REFUSED]
FULL_MESH = [c for c in composition_worker.FULL if c.mesh and c.name not in composition_worker.REFUSED]


@pytest.mark.matrix
@pytest.mark.parametrize("combo", FULL_ONE, ids=lambda c: c.name)
@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_full_product_one_device(variant, combo, tmp_path, request):
  cold = request.getfixturevalue(f"cold_{variant}")
  print(composition_worker.check(combo, cold, str(tmp_path)))


@pytest.mark.matrix
@pytest.mark.parametrize("variant", ["v4", "v41"])
def test_full_product_mesh(variant, tmp_path):
  """All 24 mesh rows of a variant in one child process (long: one engine per row)."""
  out = run_mesh_worker(variant, FULL_MESH, tmp_path, timeout=6 * 3600)
  assert out.count("tokens == cold") == len(FULL_MESH)
