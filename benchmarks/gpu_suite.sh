#!/usr/bin/env bash
# The GPU suite (benchmarks/gpu_suite.py has the details): one process, the most valuable measurement first, a
# budget it keeps (default 510 s, compiles included), rows in OUT_DIR/results.jsonl and tables in OUT_DIR/suite.md
# as it goes.
#
#   benchmarks/gpu_suite.sh OUT_DIR [--budget_s=510] [--only=a,b] ...     # on the GPU
#   benchmarks/gpu_suite.sh OUT_DIR --dry_run                              # CPU: same items and files, small
#
# No `set -e`: a failing row is a row, not the end of the run.
cd "$(dirname "$0")/.." || exit 2
if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: benchmarks/gpu_suite.sh OUT_DIR [flags of benchmarks/gpu_suite.py]" >&2
  exit 2
fi
OUT_DIR="$1"
shift
PY="$(command -v python3 || command -v python)"
exec "$PY" -m benchmarks.gpu_suite --out_dir="$OUT_DIR" "$@"
