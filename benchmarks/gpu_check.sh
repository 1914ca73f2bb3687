#!/usr/bin/env bash
# The one GPU check (benchmarks/gpu_check.py has the details): kernel correctness at V4-Flash shapes first, then the
# decode / prefill timing tables with the roofline fraction per row; one process per case with its own timeout,
# a global budget (--budget, default 400 s), rows appended to OUT/results.jsonl and OUT/gpu_check.md rebuilt after
# every case, so a run cut short keeps every finished row. OUT = --out DIR, else $OUT, else gpu_check_out.
#
#   benchmarks/gpu_check.sh [--out DIR] [--budget 400] [--only SUBSTR,...]            # on the GPU
#   benchmarks/gpu_check.sh --dry-run --out DIR                                        # CPU plumbing run
#   benchmarks/gpu_check.sh --list                                                     # the plan
#
# No `set -e`: a failing case is a row, not the end of the run. Exit status: 0 when every case that ran is ok.
cd "$(dirname "$0")/.." || exit 2
PY="$(command -v python3 || command -v python)"
if [[ -z "$PY" ]]; then
  echo "gpu_check.sh: neither python3 nor python on PATH" >&2
  exit 2
fi
exec "$PY" -m benchmarks.gpu_check "$@"
