"""benchmarks/probes/dot_row_bits.py and the GPU suite's item a.row_bits: the probe's checks run at small shapes on
the CPU and say what the CPU shows (XLA's dot moves a row's bits with the row count; rows_dot, RMSNorm and the
row_dot kernel do not), the verdict weighs only the row-local ops and row_dot, and (slow) every program the item
compiles on a GPU lowers for an H200 here at V4-Flash widths."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks.probes import dot_row_bits as probe
from benchmarks.suite import row_bits
from tests.isolation import run_in_child


def _by(rows, op, varied):
  [row] = [r for r in rows if r["op"] == op and r["varied"] == varied]
  return row


def test_the_probe_shows_what_the_cpu_does(request):
  """At XLA's default optimisation level, as users run it (tests/xla_test_flags.py)."""
  if run_in_child(request, default_xla_opt=True):
    return
  rows = probe.dots(jnp.float32, small=True)
  assert not _by(rows, "dot", "by row count")["invariant"]
  assert _by(rows, "dot", "by row count")["differs"]
  assert _by(rows, "rows_dot", "by live count")["invariant"] and _by(rows, "rows_dot", "by place")["invariant"]

  flash = probe.v4_flash(small=True, groups=(probe.reduction_cases, probe.matmul_cases))
  assert len(flash) == 2 * 7 and all(set(r) >= {"op", "dtype", "varied", "tried", "differs", "invariant", "case"}
                                      for r in flash)
  by_case = {}
  for r in flash:
    by_case.setdefault(r["case"], []).append(r)
  for case in ("rms_norm.256", "rms_norm.1024", "row_dot"):
    assert [r["invariant"] for r in by_case[case]] == [True, True], by_case[case]
  assert by_case["row_dot"][0]["op"] == "dispatch.row_dot (interpret)"
  assert by_case["row_dot"][0]["tried"] == [2, 7, 64] and by_case["row_dot"][1]["tried"] == [1, 33, 63]


def _rows(case, role, invariant, error=None):
  out = []
  for varied in ("by row count", "by place in 64 rows"):
    r = dict(case=case, op=case, dtype="float32", width="[8]", role=role, varied=varied, tried=[2],
             differs=[] if invariant else [2], invariant=invariant)
    if error:
      r.update(invariant=None, differs=[], error=error)
    out.append(r)
  return out


def test_the_verdict_weighs_the_row_local_ops_and_row_dot_only():
  ok = _rows("rms_norm", "row-local", True) + _rows("row_dot", "kernel", True) + _rows("jnp.dot", "xla dot", False) \
      + _rows("moe.route", "composite", False)
  v = probe.verdict(ok)
  assert v["per_token_ops_invariant"] and v["xla_dots_not_invariant"] == ["jnp.dot"]
  assert v["composites_not_invariant"] == ["moe.route"] and "follows the live rows" in v["decision"]
  v = probe.verdict(ok + _rows("softmax.64", "row-local", False))
  assert not v["per_token_ops_invariant"] and v["not_invariant"] == ["softmax.64"]
  assert v["decision"].startswith("keep fixed row blocks: softmax.64")
  v = probe.verdict(ok + _rows("row_dot2", "kernel", None, error="ValueError: no"))
  assert not v["per_token_ops_invariant"] and v["did_not_run"] == ["row_dot2"]

  suite = list(row_bits.case_rows(ok + _rows("rope", "row-local", None, error="ValueError: no")))
  assert [r["item"] for r in suite] == ["a.row_bits.rms_norm", "a.row_bits.row_dot", "a.row_bits.jnp.dot",
                                        "a.row_bits.moe.route", "a.row_bits.rope"]
  assert [r["status"] for r in suite] == ["ok"] * 4 + ["error"]
  assert [r["invariant"] for r in suite] == [True, True, False, False, None]
  assert suite[2]["rows_differ"] == [2] and suite[2]["places_differ"] == [2]


@pytest.mark.slow
def test_every_program_of_the_item_lowers_for_a_gpu_at_v4_flash_widths():
  """Each case at 2048 and 1 rows, row_dot on its Pallas-Triton kernel, lowered for an H200 (abstract device,
  pallas_kernels/lowering.py)."""
  from pallas_kernels import lowering
  groups = [g for g in probe.FLASH_GROUPS if g is not probe.matmul_cases]
  cases = [c for g in groups for c in g(False)] + probe.matmul_cases(False, backend="pallas")
  failed = []
  for case in cases:
    for n in (1, 2048):
      rows = tuple(jax.ShapeDtypeStruct((n, *a.shape[1:]), a.dtype) for a in case.rows)
      params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), case.params)
      try:
        exported = lowering.export_for_cuda(case.fn, params, *rows)
      except lowering.NoGpuTarget as e:
        pytest.skip(str(e))
      except Exception as e:  # noqa: BLE001 - every case's failure is listed
        failed.append((case.name, n, f"{type(e).__name__}: {str(e)[:200]}"))
        continue
      if case.role == "kernel" and not lowering.custom_call_targets(exported) & set(lowering.GPU_CUSTOM_CALLS):
        failed.append((case.name, n, "no GPU kernel call in the lowered module"))
  assert not failed, failed
