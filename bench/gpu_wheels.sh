#!/usr/bin/env bash
# Wheels of the runtime's Python dependencies that a bare CUDA image lacks (trio, pydantic and
# what they need), for Python 3.12 on x86-64 Linux, into .whl/ (ignored by git): gpu_check.sh
# installs them from there when the engine check (step 3) and gpu_bench (step 4) need them. Versions: the ones this
# project's own venv (.venv, made by ./run.sh) holds, so the GPU runs what the tests ran.
#   bash bench/gpu_wheels.sh [PYTHON_VERSION]      # default 3.12
set -eu
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
PY=.venv/bin/python
[ -x "$PY" ] || { echo "no .venv: run ./run.sh test first (it makes the venv)" >&2; exit 1; }
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pins=$("$PY" - <<'PY'
from importlib.metadata import version
names = ["trio", "outcome", "sniffio", "pydantic", "pydantic_core", "annotated_types", "typing_inspection",
         "typing_extensions",
         # step 4 (gpu_bench: files written and read there): GGUF, the tokenizer, the chat template
         "gguf", "tokenizers", "jinja2", "MarkupSafe", "PyYAML", "tqdm"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
rm -rf .whl && mkdir .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl $pins
ls .whl
