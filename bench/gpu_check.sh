#!/usr/bin/env bash
# Check the GPU path on a CUDA GPU in one go (about 3 minutes on an H200, most of it loading):
#   1. tests/test_kernels.py and tests/test_gpu_quant.py compiled on the GPU (EDGEPAGED_GPU_TESTS=1; needs
#      torch, triton, pytest, numpy and gguf)
#   2. bench/kernel_bench.py --json --sweep --prefill: decode bandwidth against the device copy and SDPA,
#      a few decode launch configs, prefill against SDPA's causal (flash) attention
#   3. bench/gpu_model_check.py --json --speed: the engine on the GPU gives the CPU's greedy tokens
#      (tiny llama, float32; alone, together, under preemption; every block back), and a 1 B
#      llama-shaped model's decode tok/s beside transformers' generate. It needs the runtime's
#      Python dependencies (trio, pydantic, ...): where they are missing and a folder .whl holds
#      wheels of them (`bash bench/gpu_wheels.sh` fetches them), they are installed from there
#      into a scratch folder; else step 3 is skipped. It also needs the Rust extension
#      (edgepaged/_native.abi3.so, built by ./run.sh; ignored by git: carry it along).
#   4. bench/gpu_bench.py --json: synthetic Llama-3.2-1B- and 3.1-8B-shaped Q4_K_M files written there,
#      their weights kept as GGUF blocks on the GPU (kernels/quant.py): tok_s_b1, tok_s_b32, prefill_tok_s,
#      vram_weights_mb against file_mb, b1_hbm_frac, prefill_tflops_frac, step_gpu_busy_frac (issue 67), and
#      llama.cpp's CUDA llama-bench on the same files where .llama-cuda/llama-bench.xz was carried
#      (bash bench/llama_cuda.sh builds it on the CPU machine) or $LLAMA_BENCH names one
# Outputs go to $OUT (or bench/out). Uses the python found on PATH, not a venv.
# Carried from the CPU machine (ignored by git; 31 MiB): .whl (bench/gpu_wheels.sh), .llama-cuda/llama-bench.xz
# (bench/llama_cuda.sh) and edgepaged/_native.abi3.so (./run.sh).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
PY=$(command -v python3 || command -v python)
export EDGEPAGED_GPU_TESTS=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)'
} 2>&1 | tee "$OUT/env.txt"

timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_gpu_quant.py 2>&1 | tee "$OUT/tests.txt"
tests_rc=${PIPESTATUS[0]}

timeout 240 "$PY" bench/kernel_bench.py --json --sweep --prefill 2>&1 | tee "$OUT/bench.txt"
bench_rc=${PIPESTATUS[0]}
tail -n 1 "$OUT/bench.txt" > "$OUT/bench.json"

if ! "$PY" -c 'import trio, pydantic, gguf, tokenizers' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/edgepaged-site .whl/*.whl \
    && export PYTHONPATH="/tmp/edgepaged-site:$PYTHONPATH"
fi
if "$PY" -c 'import trio, pydantic' 2>/dev/null; then
  timeout 300 "$PY" bench/gpu_model_check.py --json --speed 2>&1 | tee "$OUT/model.txt"
  model_rc=${PIPESTATUS[0]}
else
  echo "step 3 skipped: the runtime's dependencies (trio, pydantic) are missing here" | tee "$OUT/model.txt"
  model_rc=0
fi

# llama.cpp's CUDA llama-bench for step 4's baseline, built on the CPU machine by bench/llama_cuda.sh and
# carried as .llama-cuda/llama-bench.xz; the CUDA runtime and cuBLAS it needs are torch's nvidia wheels'
if [ -z "${LLAMA_BENCH:-}" ] && [ -f .llama-cuda/llama-bench.xz ]; then
  "$PY" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
    .llama-cuda/llama-bench.xz /tmp/edgepaged-llama-bench && chmod +x /tmp/edgepaged-llama-bench \
    && export LLAMA_BENCH=/tmp/edgepaged-llama-bench
fi
if [ -n "${LLAMA_BENCH:-}" ]; then
  libs=$("$PY" - <<'PY'
import pathlib
try:
    import nvidia
    roots = [pathlib.Path(p) for p in nvidia.__path__]
except ImportError:
    roots = []
print(":".join(sorted({str(f.parent) for r in roots for f in r.rglob("lib*.so.*")
                       if f.name.startswith(("libcublas", "libcudart"))})))
PY
)
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  { echo "llama-bench: $LLAMA_BENCH, libraries from: ${libs:-(none found)}"; "$LLAMA_BENCH" --list-devices 2>&1 | tail -n 4; } \
    | tee "$OUT/llama_cpp.txt"
fi

if "$PY" -c 'import trio, pydantic, gguf, tokenizers' 2>/dev/null; then
  timeout 360 "$PY" -m bench.gpu_bench --json --sweep 2>&1 | tee "$OUT/gpu_bench.txt"
  gpu_rc=${PIPESTATUS[0]}
  tail -n 1 "$OUT/gpu_bench.txt" > "$OUT/gpu_bench.json"
else
  echo "step 4 skipped: the runtime's dependencies (gguf, tokenizers) are missing here" | tee "$OUT/gpu_bench.txt"
  gpu_rc=0
fi

echo "tests rc=$tests_rc bench rc=$bench_rc model rc=$model_rc gpu_bench rc=$gpu_rc" | tee "$OUT/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$model_rc" -eq 0 ] && [ "$gpu_rc" -eq 0 ]
