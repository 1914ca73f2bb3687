"""(a) Which of the model's per-token ops keep a row's bits at any row count on this device.

The probe `benchmarks/probes/dot_row_bits.py` (`v4_flash`) at V4-Flash widths: elementwise maths, RMSNorm at 4096
and 16384, row softmax at 64 and 1024 columns, top-k, mHC's coefficients (its mixing dot, Sinkhorn), collapse and
expansion over 4 streams, the router (256 experts, top-6) and its logits dot, RoPE, and the Pallas `row_dot`
beside the XLA dot it replaces (4096 x 4096 bf16). Row 0 against itself alone at 2, 7, 64, 256 and 2048 rows and at
three places of 2048 shuffled rows. One row per op (the row counts and places where row 0 differs), then the
verdict: whether the step can run each per-token op once over a width that follows the live rows, its matmuls on
`row_dot`, instead of in fixed 32-row blocks (docs/engine.md, the invariant step).

Every (op, row count) program is compiled first in a thread pool. The dry run (CPU): D = 256, up to 64 rows,
row_dot in interpret mode.
"""

from __future__ import annotations

import time

from benchmarks.probes import dot_row_bits as probe

TABLE = "A row's bits across row counts and places: the model's per-token ops at V4-Flash widths"
VERDICT_TABLE = "What the row bits decide"


def case_rows(rows: list[dict]) -> list[dict]:
  """The probe's two rows per op (by row count, by place) as one suite row each."""
  by_case: dict[str, dict] = {}
  for r in rows:
    row = by_case.setdefault(r["case"], dict(table=TABLE, item=f"a.row_bits.{r['case']}", op=r["op"],
                                             dtype=r["dtype"], width=r["width"], role=r["role"]))
    key = "rows" if r["varied"] == "by row count" else "places"
    row[f"{key}_tried"], row[f"{key}_differ"] = r["tried"], r["differs"]
    if "error" in r:
      row["error"] = r["error"]
  for row in by_case.values():
    if "error" in row:
      row.update(invariant=None, status="error")
    else:
      row.update(invariant=not row["rows_differ"] and not row["places_differ"], status="ok")
  return list(by_case.values())


def run(dry: bool, seed: int, threads: int):
  """The op rows, then the verdict (with the probe's seconds: the op rows all come when the probe ends)."""
  t0 = time.perf_counter()
  rows = probe.v4_flash(small=dry, seed=seed, threads=threads)
  probe_s = time.perf_counter() - t0
  yield from case_rows(rows)
  v = probe.verdict(rows)
  yield dict(v, table=VERDICT_TABLE, item="a.row_bits.verdict", probe_s=probe_s,
             status="error" if v["did_not_run"] else "ok")
