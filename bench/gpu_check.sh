#!/usr/bin/env bash
# Check the Triton kernels on a CUDA GPU in one go (about 5 minutes on an H200):
#   1. tests/test_kernels.py compiled on the GPU (EDGEPAGED_GPU_TESTS=1; needs only torch, triton, pytest)
#   2. bench/kernel_bench.py --json --sweep: decode bandwidth, SDPA baseline, a few launch configs
# Outputs go to $OUT (or bench/out). Uses the python found on PATH, not a venv.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
PY=$(command -v python3 || command -v python)
export EDGEPAGED_GPU_TESTS=1
unset TRITON_INTERPRET

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'
} 2>&1 | tee "$OUT/env.txt"

timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tee "$OUT/tests.txt"
tests_rc=${PIPESTATUS[0]}

timeout 240 "$PY" bench/kernel_bench.py --json --sweep 2>&1 | tee "$OUT/bench.txt"
bench_rc=${PIPESTATUS[0]}
tail -n 1 "$OUT/bench.txt" > "$OUT/bench.json"

echo "tests rc=$tests_rc bench rc=$bench_rc" | tee "$OUT/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
