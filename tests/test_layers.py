"""The package's layers (docs/INTERNALS.md, "The layers") are contracts that a tool made for
them checks: import-linter's, in pyproject.toml ([tool.importlinter]). They hold on the code
as it is, and they break when a forbidden import is added (on a copy of the package)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"


def lint(root: Path, config: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--config", str(config), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_layer_contracts_hold():
    r = lint(ROOT, ROOT / "pyproject.toml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 kept, 0 broken" in r.stdout, r.stdout


def copy_package(tmp_path: Path) -> Path:
    """The package's Python files (what the contracts read) in a folder of their own."""
    shutil.copytree(ROOT / "edgepaged", tmp_path / "edgepaged", ignore=lambda d, names: [
        n for n in names if not (n.endswith(".py") or (Path(d) / n).is_dir()) or n == "__pycache__"])
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def add_line(path: Path, line: str) -> None:
    text = path.read_text()
    head, sep, rest = text.partition("\nfrom __future__ import annotations\n")
    path.write_text(head + sep + line + "\n" + rest if sep else line + "\n" + text)


def test_a_forbidden_import_breaks_a_contract(tmp_path):
    root = copy_package(tmp_path)
    assert lint(root, root / "pyproject.toml").returncode == 0      # the copy as it is: kept
    # the engine reaching up into the HTTP server: the layers
    add_line(root / "edgepaged/engine/scheduler.py", "from ..server import httpd  # noqa")
    # one door importing another: their independence
    add_line(root / "edgepaged/server/doors/ollama.py", "from . import responses  # noqa")
    # the grammar importing torch: the CPU path without the GPU extra
    add_line(root / "edgepaged/constrain/grammar.py", "import torch  # noqa")
    r = lint(root, root / "pyproject.toml")
    out = r.stdout
    assert r.returncode != 0, out
    assert "1 kept, 3 broken" in out, out
    assert "edgepaged.engine.scheduler -> edgepaged.server.httpd" in out, out
    assert "edgepaged.server.doors.ollama -> edgepaged.server.doors.responses" in out, out
    assert "edgepaged.constrain.grammar -> torch" in out, out


def protocol_members(proto) -> set[str]:
    names = set(getattr(proto, "__annotations__", {}))
    names |= {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}
    return names


def test_the_engines_and_runners_are_what_they_declare(embedded_runner):
    """Each engine the doors see is an EngineView (engine/view.py), each runner a Runner
    (model/runtime.py), each door's shaper a Shaper (server/doors/base.py): every member the
    protocol names is there, so no caller needs to probe one."""
    from edgepaged.box.models import BoxEngine
    from edgepaged.engine import Engine
    from edgepaged.engine.view import EngineView
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.model.cpu.encoder import EncoderRunner
    from edgepaged.model.torch.runner import ModelRunner
    from edgepaged.model.runtime import Runner
    from edgepaged.server.doors.base import SamplesShaper, Shaper
    from edgepaged.server.doors.ollama import OllamaShaper
    from edgepaged.server.doors.openai import Shaper as OpenAIShaper
    from edgepaged.server.doors.responses import ResponsesShaper
    engine = Engine(embedded_runner)
    view = protocol_members(EngineView)
    assert view and not [n for n in view if not hasattr(engine, n)]
    assert not [n for n in view if not hasattr(BoxEngine, n)]       # (all of them properties or methods)
    runner = protocol_members(Runner)
    assert "served_name" in runner and "attach_draft" in runner
    assert not [n for n in runner if not hasattr(embedded_runner, n)]
    for cls in (CpuRunner, ModelRunner, EncoderRunner):       # (those set in __init__ aside)
        assert not [n for n in runner - {"config", "tokenizer", "model_path", "block_size", "num_blocks",
                                         "max_model_len", "kv_dtype_name", "products"} if not hasattr(cls, n)], cls
    for cls in (OpenAIShaper, OllamaShaper, ResponsesShaper):
        missing = [n for n in protocol_members(Shaper) if not hasattr(cls, n) and n != "splits_thinking"]
        assert not missing, (cls, missing)
    assert not [n for n in protocol_members(SamplesShaper) if not hasattr(OpenAIShaper, n) and n != "splits_thinking"]


def test_the_rust_kernels_modules_import_no_circle():
    """The kernels crate's modules (rust_alloc/cpu_kernels/src) use each other in one
    direction: isa and threads at the bottom, then quant, kv, ops, q8, attention, prefill,
    decoder (tests and their helpers aside). A `crate::` path that closes a circle fails here."""
    import re
    src = ROOT / "rust_alloc" / "cpu_kernels" / "src"
    graph: dict[str, set[str]] = {}
    for path in src.rglob("*.rs"):
        rel = path.relative_to(src).with_suffix("")
        parts = [p for p in rel.parts if p != "mod"]
        if parts[-1] in ("tests", "testing", "lib"):
            continue
        top = parts[0]
        code = "\n".join(line.split("//")[0] for line in path.read_text().splitlines())
        graph.setdefault(top, set()).update(m for m in re.findall(r"crate::([a-z0-9_]+)", code)
                                            if m not in (top, "testing"))
    assert {"isa", "quant", "q8", "kv", "ops"} <= set(graph)
    order, seen, stack = [], set(), set()

    def visit(n, path):
        if n in stack:
            raise AssertionError("a circle: " + " -> ".join(path + [n]))
        if n in seen:
            return
        stack.add(n)
        for m in sorted(graph.get(n, ())):
            visit(m, path + [n])
        stack.discard(n)
        seen.add(n)
        order.append(n)
    for n in sorted(graph):
        visit(n, [])
    assert order.index("isa") < order.index("ops") and order.index("quant") < order.index("q8")


def test_a_request_holds_its_own_state_typed():
    """The engine's request keeps the sequence (tokens, sampling, blocks, status, timing); each
    feature keeps its per-request state in a typed part of its own module (speculation:
    `speculate.DraftState`, the disk tier: `disk_cache.DiskState`, a constrained output:
    `constrain.grammar.Constraint`, an embedding's pooling: `Embedding`, a vision model's images:
    `ImageState`); no field is typed Any, and
    the scheduler says what a step's rows are with `Row`, not sentinel token values."""
    import dataclasses
    import inspect

    from edgepaged.engine import scheduler
    from edgepaged.engine.disk_cache import DiskState
    from edgepaged.engine.request import Request
    from edgepaged.engine.speculate import DraftState
    fields = {f.name: str(f.type) for f in dataclasses.fields(Request)}
    assert not [n for n, t in fields.items() if "Any" in t], fields
    assert fields["drafting"] == "DraftState" and fields["disk_tier"] == "DiskState"
    assert fields["constraint"] == "Constraint" and fields["embedding"] == "Embedding | None"
    assert fields["images"] == "ImageState"
    assert not {"drafts", "spec_k", "proposal", "forced", "disk", "loads", "disk_saved", "matcher", "lazy", "embed",
                "pool", "pooled"} & set(fields)
    assert len(fields) <= 35      # (34 before images' one typed part)
    r = Request([1, 2, 3], __import__("edgepaged.model.params", fromlist=["SamplingParams"]).SamplingParams())
    assert isinstance(r.drafting, DraftState) and isinstance(r.disk_tier, DiskState)
    assert r.drafting is not Request([1], r.params).drafting          # each request its own part
    build = inspect.getsource(scheduler.Scheduler._build)
    assert "Row.DRAFTS" in build and "== -2" not in build and "== -3" not in build
