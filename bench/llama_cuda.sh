#!/usr/bin/env bash
# llama.cpp's llama-bench with its CUDA backend, built on this machine (no GPU needed) for a GPU
# machine to run beside bench/gpu_bench.py (issue 67's baseline: what Ollama runs on a GPU box).
#   bash bench/llama_cuda.sh [WORKDIR]          # default .llama-cuda/work; ~40 minutes on 2 cores
# The CUDA compiler, headers and libraries come from PyPI (nvidia-cuda-nvcc & co., CUDA
# $LLAMA_CUDA_VERSION, default 13.0: the GPU machine's torch is a cu130 build and its driver takes
# 13.0); cmake and ninja too; llama.cpp's source from llama-cpp-python's sdist (as
# ../shared/tools/build-llama-cpp.sh takes it). One GPU architecture ($LLAMA_CUDA_ARCH, default
# 90-real: H100 and H200), llama.cpp linked statically, the CUDA runtime and cuBLAS left to the
# GPU machine's own (torch's nvidia wheels; gpu_check.sh finds them), no VMM (no libcuda at link).
# Output: .llama-cuda/llama-bench.xz (ignored by git): carry `.llama-cuda/llama-bench.xz` to the GPU
# machine; bench/gpu_check.sh unpacks it and points $LLAMA_BENCH at it.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIR=${1:-.llama-cuda/work}
CUDA=${LLAMA_CUDA_VERSION:-13.0}
ARCH=${LLAMA_CUDA_ARCH:-90-real}
VER=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
mkdir -p "$DIR" .llama-cuda && DIR=$(cd "$DIR" && pwd)
grep -qx '/.llama-cuda/' .git/info/exclude 2>/dev/null || echo '/.llama-cuda/' >> .git/info/exclude

CV=${LLAMA_CUDA_VENV:-$DIR/cuda}        # the CUDA wheels' own venv (about 900 MB)
[ -x "$DIR/tools/bin/cmake" ] || { python3 -m venv "$DIR/tools" && "$DIR/tools/bin/pip" install -q cmake ninja; }
[ -x "$CV/bin/pip" ] || python3 -m venv "$CV"
"$CV/bin/pip" install -q "nvidia-cuda-nvcc==$CUDA.*" "nvidia-cuda-crt==$CUDA.*" "nvidia-nvvm==$CUDA.*" \
  "nvidia-cuda-runtime==$CUDA.*" "nvidia-cublas==$CUDA.*" "nvidia-cuda-cccl==$CUDA.*"
TK=$("$CV/bin/python" -c "import nvidia, pathlib; print(pathlib.Path(list(nvidia.__path__)[0]) / 'cu${CUDA%%.*}')")
[ -x "$TK/bin/nvcc" ] || { echo "no nvcc in $TK (the wheels' layout is CUDA 13's; set LLAMA_CUDA_VERSION=13.x)" >&2; exit 1; }
# the wheels hold only the versioned libraries: the unversioned names a link looks for, and lib64
for lib in cudart cublas cublasLt; do ln -sf "lib$lib.so.${CUDA%%.*}" "$TK/lib/lib$lib.so"; done
ln -sfn lib "$TK/lib64"

if [ ! -d "$DIR/src" ]; then
  "$DIR/tools/bin/pip" download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VER" -d "$DIR/dl"
  mkdir -p "$DIR/src"
  tar xzf "$DIR/dl/llama_cpp_python-$VER.tar.gz" -C "$DIR/src" --strip-components=3 "llama_cpp_python-$VER/vendor/llama.cpp"
fi
export PATH=$DIR/tools/bin:$TK/bin:$PATH
cmake -S "$DIR/src" -B "$DIR/build-cuda" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$ARCH" -DGGML_CUDA_NO_VMM=ON -DGGML_CUDA_NCCL=OFF -DBUILD_SHARED_LIBS=OFF \
  -DCUDAToolkit_ROOT="$TK" -DCMAKE_CUDA_COMPILER="$TK/bin/nvcc" -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
ninja -C "$DIR/build-cuda" -j"$(nproc)" llama-bench
strip -o "$ROOT/.llama-cuda/llama-bench" "$DIR/build-cuda/bin/llama-bench"
# it loads here (no GPU: it lists none) with the wheels' runtime and cuBLAS
LD_LIBRARY_PATH="$TK/lib" "$ROOT/.llama-cuda/llama-bench" --list-devices >/dev/null 2>&1 \
  || LD_LIBRARY_PATH="$TK/lib" "$ROOT/.llama-cuda/llama-bench" --help >/dev/null
xz -T0 -9e -f "$ROOT/.llama-cuda/llama-bench"
echo "built: .llama-cuda/llama-bench.xz ($(du -h "$ROOT/.llama-cuda/llama-bench.xz" | cut -f1); CUDA $CUDA, sm $ARCH, llama-cpp-python $VER's llama.cpp)"
echo "carry it: run(carry=[\".llama-cuda/llama-bench.xz\", ...]) then bash bench/gpu_check.sh"
