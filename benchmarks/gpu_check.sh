#!/usr/bin/env bash
# The one GPU check for pallas_kernels: environment line, correctness at V4-Flash shapes, then device-side
# timings (L2 flushed) of decode batch 64 and 256 at 8k and 128k (CSA + HCA; bf16 and FP8 paged rows), prefill 4096
# queries, and the indexer (scores; fused top-512 with bf16 and FP8 keys). Writes OUT/results.jsonl (streamed),
# OUT/gpu_check.json, OUT/gpu_check.md (KernelConfig("auto") needs none of it: it validates each kernel itself at
# start-up, at the shapes it is called with). Budget: < 8 min of GPU time (the bench stops at 450 s; results so
# far are kept). --small: tiny shapes in interpret mode on the CPU (CI smoke test).
#
#   benchmarks/gpu_check.sh [--small] [OUT_DIR]       (default OUT_DIR: gpu_check_out)
set -euo pipefail
cd "$(dirname "$0")/.."
SMALL=()
if [[ "${1:-}" == "--small" ]]; then SMALL=(--small); shift; fi
OUT="${1:-gpu_check_out}"
mkdir -p "$OUT"
echo "# $(date -u +%FT%TZ) host $(hostname)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python -c "import jax, jaxlib; print('# jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
# Build check first: every kernel lowers for CUDA at V4-Flash shapes (seconds, no device memory). CI runs these
# tests anyway, so --small skips them.
if [[ ${#SMALL[@]} -eq 0 ]]; then
  python -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_gpu_lowering.py 2>&1 | tail -3
fi
status=0
timeout 450 python benchmarks/kernels_bench.py "${SMALL[@]}" --report "$OUT" || status=$?
if [[ $status -eq 124 ]]; then echo "# time budget hit: partial results in $OUT/results.jsonl"; fi
[[ -f "$OUT/gpu_check.md" ]] && cat "$OUT/gpu_check.md"
exit $status
