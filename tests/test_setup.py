"""The set-up itself: the dependency list works under Python 3.10's rules (no tomllib), and
every benchmark module imports in the environment the set-up built (README's benchmark
commands work on a fresh clone)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEPS = ROOT / "packaging" / "deps.py"
BLOCK_TOMLLIB = "import sys; sys.modules['tomllib'] = None; import runpy; " \
                "sys.argv = ['deps.py', *sys.argv[1:]]; runpy.run_path({!r}, run_name='__main__')"


def deps(*args: str, without_tomllib: bool = False) -> subprocess.CompletedProcess:
    if without_tomllib:   # Python 3.10: `import tomllib` fails
        cmd = [sys.executable, "-c", BLOCK_TOMLLIB.format(str(DEPS)), *args]
    else:
        cmd = [sys.executable, str(DEPS), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)


@pytest.mark.parametrize("extras", [(), ("test",), ("test", "bench"), ("gpu",)])
def test_deps_without_tomllib_equal_deps_with_it(extras):
    with_it = deps("pyproject.toml", *extras)
    without = deps("pyproject.toml", *extras, without_tomllib=True)
    assert with_it.returncode == without.returncode == 0, without.stderr
    lines = without.stdout.split()
    assert lines == with_it.stdout.split() and "numpy>=1.26" in lines and "trio>=0.25" in lines
    assert ("matplotlib>=3.8" in lines) == ("bench" in extras)


def test_deps_reads_a_tricky_file_without_tomllib(tmp_path):
    f = tmp_path / "pyproject.toml"
    f.write_text('[build-system]\nrequires = ["maturin>=1.7,<2"]\n\n[project]\nname = "x"\n'
                 'dependencies = [\n  "a[extra]>=1",  # a comment with ] in it\n  \'b; python_version < "3.11"\',\n]\n'
                 '\n[project.optional-dependencies]\ntest = ["c"]\n\n[tool.x]\ndependencies = ["not-this"]\n')
    out = deps(str(f), "test", without_tomllib=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["a[extra]>=1", 'b; python_version < "3.11"', "c"]
    bad = deps(str(f), "nope", without_tomllib=True)
    assert bad.returncode != 0 and "no extra 'nope'" in bad.stderr


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__"),
                         ids=lambda p: p.stem)
def test_every_benchmark_module_imports(path):
    """Importing runs nothing (each benchmark runs under `if __name__ == "__main__"`), but
    every module it imports must be installed by the set-up (the `bench` extra). The benchmarks
    are a package (`python -m bench.NAME`): a sibling is imported as `bench.NAME`, never through
    an edit of the path."""
    module = importlib.import_module(f"bench.{path.stem}")
    assert module.__doc__, f"{path.name} should say what it measures"
    assert ".".join(("sys", "path")) not in path.read_text(), f"{path.name} edits the import path"


def test_the_benchmarks_plotting_library_is_installed():
    import matplotlib  # noqa: F401  (bench/household.py plots with it)


@pytest.mark.parametrize("name", ["blocks", "quant", "ops"])
def test_the_extension_stubs_are_complete(name):
    """edgepaged/_native/*.pyi name every function, class and method the extension has, and
    nothing it lacks."""
    import ast
    import importlib
    module = importlib.import_module(f"edgepaged._native.{name}")
    tree = ast.parse((ROOT / "edgepaged" / "_native" / f"{name}.pyi").read_text())
    stubbed = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            stubbed[node.name] = None
        elif isinstance(node, ast.ClassDef) and not any(getattr(b, "id", "") == "TypedDict" for b in node.bases):
            stubbed[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    public = {k: v for k, v in vars(module).items() if not k.startswith("_")}
    assert set(stubbed) == set(public), f"stubs: {sorted(stubbed)}, module: {sorted(public)}"
    for cls, methods in stubbed.items():
        if methods is None:
            continue
        real = {m for m in vars(public[cls]) if not m.startswith("_") or m == "__init__"}
        if not isinstance(public[cls], type) or issubclass(public[cls], BaseException):
            continue
        assert methods - {"__init__"} == real - {"__init__"}, (cls, sorted(methods ^ real))


def test_the_scheduler_the_doors_and_the_front_end_import_no_torch():
    """The policy and the server are plain Python over the Rust extension: importing them
    (in a fresh interpreter) leaves torch out of sys.modules."""
    code = ("import sys, edgepaged.engine.scheduler, edgepaged.server.tcp, edgepaged.server.httpd, "
            "edgepaged.request.frontend, edgepaged.engine; print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'triton', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
