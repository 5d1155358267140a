"""Install requirements in stages, so a small disk holds at most one large wheel beside what
is already installed (pip keeps every wheel of one command until it is done: torch's CUDA
libraries alone are ~3 GB of wheels on top of ~4 GB installed).

    python packaging/install.py CONSTRAINTS REQUIREMENT ...

Resolves the whole set once (`pip install --dry-run --report`, metadata only), then installs
each package of 100 MB or more (by its wheel's name: torch, triton, nvidia-*, ...) alone and
the rest in one command, all with --no-deps (the resolution was done) and no pip cache.
"""
import json
import os
import subprocess
import sys
import tempfile

LARGE = ("torch", "triton", "nvidia-", "cuda-")


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir", "--disable-pip-version-check",
                    *args], check=True)


def main() -> None:
    constraints, reqs = sys.argv[1], sys.argv[2:]
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        pip("--dry-run", "--ignore-installed", "--report", report, "-c", constraints, *reqs)
        with open(report) as f:
            items = json.load(f)["install"]
    pins = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items]
    large = [p for p in pins if p.lower().startswith(LARGE)]
    small = [p for p in pins if p not in large]
    for p in sorted(large, key=lambda p: not p.lower().startswith("nvidia")):   # torch's libraries first
        pip("--no-deps", p)
    if small:
        pip("--no-deps", *small)


if __name__ == "__main__":
    main()
