#!/usr/bin/env python3
"""How long a restarted server takes to answer: `edgepaged serve` with the weights cache (a
restart: the laid-out weights mapped), without it (`EDGEPAGED_WEIGHTS_CACHE=0`: the file read
and laid out again) and llama.cpp's `llama-server` on the same file, the three alternated run
by run, every run on a warm page cache, loopback only.

    python bench/ready_bench.py [--json] [--shape 1b|3b|8b | --model FILE] [--reps 3] [--llama-server PATH]

A run's time: from starting the process to the first HTTP answer of its /health (polled every
20 ms; both servers' /health answers once the model is loaded). The last line with --json:
{"cpu", "file", "file_mb", "reps", "ready_s": {"edgepaged": median, "edgepaged_uncached": …,
"llama_cpp": … or null}, "runs": {name: [seconds, …]}, "ready_line_s": {"edgepaged": median,
"edgepaged_uncached": …} (to the server's own "edgepaged ready on" line, which waits for the
grammar tokenizer too), "ready_line_runs", "llama_cpp_note"}.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from bench.family_bench import cpu_flags, synthetic
from bench.soak import free_port


def ready_after(cmd: list[str], port: int, env: dict | None = None, wait_s: float = 300.0,
                banner: str | None = None) -> tuple[float | None, float | None]:
    """Seconds from starting `cmd` to its first answer on http://127.0.0.1:port/health (None:
    it ended first or never answered), and, with `banner`, to the output line holding it (the
    server's own "ready": for edgepaged, after the grammar tokenizer too); the process is
    stopped after."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE if banner else subprocess.DEVNULL,
                            stderr=subprocess.STDOUT if banner else subprocess.DEVNULL, env=env, text=True)
    said: list[float] = []

    def watch():
        for line in proc.stdout:
            if banner in line and not said:
                said.append(time.monotonic() - t0)
    if banner:
        threading.Thread(target=watch, daemon=True).start()
    health = None
    try:
        while time.monotonic() - t0 < wait_s and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        health = time.monotonic() - t0
                        break
            except OSError:
                time.sleep(0.02)
        while banner and not said and time.monotonic() - t0 < wait_s and proc.poll() is None:
            time.sleep(0.02)
        return health, (said[0] if said else None)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    ap.add_argument("--shape", choices=("1b", "3b", "8b"), default="8b")
    ap.add_argument("--model", default=None, help="a GGUF file instead of the synthetic shape")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server (default: on the PATH)")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "edgepaged" / "bench")
    args = ap.parse_args()
    # synthetic() (or prepare, for --model) lays the weights out once: what a restart finds
    path = Path(args.model) if args.model else synthetic("q4_k_m", args.cache_dir, args.shape)
    from edgepaged.model import weights_cache
    state = weights_cache.prepare(path)
    with open(path, "rb") as f:          # the page cache warm for everyone
        while f.read(1 << 24):
            pass
    exe = args.llama_server or shutil.which("llama-server")
    note = None
    if exe and not os.access(exe, os.X_OK):
        exe, note = None, f"{args.llama_server}: not an executable file"
    elif not exe:
        note = "llama-server not found (it builds from llama.cpp's source: --llama-server PATH)"
    variants = {"edgepaged": dict(os.environ), "edgepaged_uncached": dict(os.environ, EDGEPAGED_WEIGHTS_CACHE="0")}
    if exe:
        variants["llama_cpp"] = None
    runs: dict[str, list[float]] = {k: [] for k in variants}
    banners: dict[str, list[float]] = {k: [] for k in variants if k != "llama_cpp"}
    for r in range(args.reps):
        for name, env in variants.items():
            port = free_port()
            if name == "llama_cpp":
                cmd = [exe, "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-c", "4096"]
            else:
                cmd = [sys.executable, "-m", "edgepaged.cli", "serve", "--model", str(path), "--host", "127.0.0.1",
                       "--port", str(free_port()), "--http-port", str(port), "--no-mdns"]
            s, said = ready_after(cmd, port, env, banner=None if name == "llama_cpp" else "edgepaged ready on")
            if s is not None:
                runs[name].append(round(s, 3))
            if said is not None:
                banners[name].append(round(said, 3))
            print(f"run {r + 1}: {name} {s if s is None else round(s, 2)} s"
                  + (f" (its ready line {said:.2f} s)" if said is not None else ""), flush=True)
    out = {"cpu": cpu_flags(), "file": path.name, "file_mb": round(path.stat().st_size / 2**20, 1), "reps": args.reps,
           "weights_cache": state,
           "ready_s": {k: (round(statistics.median(v), 3) if v else None) for k, v in runs.items()}, "runs": runs,
           "ready_line_s": {k: (round(statistics.median(v), 3) if v else None) for k, v in banners.items()},
           "ready_line_runs": banners, "llama_cpp_note": note}
    out["ready_s"].setdefault("llama_cpp", None)
    print(f"ready (median of {args.reps}): " + ", ".join(f"{k} {v} s" for k, v in out["ready_s"].items()), flush=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
