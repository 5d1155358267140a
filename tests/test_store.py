"""Models as a household keeps them (issue 27, the store): `pull` from a loopback server laid out
as the hub's file URLs (huggingface_hub's own download code: HF_ENDPOINT points it there),
resumed after a cut connection, a checksum mismatch refused; local files imported; bad files
refused at pull time; GGUF files found in place in the Hugging Face cache and in an Ollama
store the test builds (manifests and blobs), listed by `models --json` and served by name."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgepaged.testing.hub import COMMIT, FakeHub

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CLI = [str(BIN / "edgepaged")] if (BIN / "edgepaged").exists() else [sys.executable, "-m", "edgepaged.cli"]
FIELDS = {"name", "path", "size_bytes", "architecture", "quantization", "context", "source", "loaded"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """Two tiny GGUF models (llama, qwen2), written as llama.cpp writes them."""
    from edgepaged.testing.families import make_family_model, write_family_gguf
    d = tmp_path_factory.mktemp("tiny")
    out = {}
    for name, seed in (("llama", 1), ("qwen2", 2)):
        model = make_family_model(d / name, name, seed=seed)
        out[name] = write_family_gguf(d / name, d / f"tiny-{name}-Q8_0.gguf", model, qtype=8)
    return out


@pytest.fixture
def env(tmp_path):
    """A home of its own: the store, the HF cache and Ollama's store under tmp_path; no
    server of the host's is asked which models are loaded."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "OLLAMA_", "EDGEPAGED_STORE"))}
    e.update(HOME=str(tmp_path / "home"), EDGEPAGED_STORE=str(tmp_path / "store"),
             HF_HUB_CACHE=str(tmp_path / "hf"), OLLAMA_MODELS=str(tmp_path / "ollama"),
             HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1", HF_HUB_ETAG_TIMEOUT="5",
             HF_HUB_DOWNLOAD_TIMEOUT="5", EDGEPAGED_VENV=sys.prefix)
    return e


def cli(env, *args, timeout=120):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def models(env) -> list[dict]:
    r = cli(env, "models", "--json", "--server", "127.0.0.1:1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(FIELDS <= set(e) for e in out), out
    return out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_pull_from_the_hub_picks_q4_k_m_resumes_and_checks(tiny, env, tmp_path):
    """The embedded model's file (94 MiB) as the repository's Q4_K_M: huggingface_hub writes in
    chunks of 10 MiB, so a cut at 25 MB resumes from the last whole chunk it kept."""
    from edgepaged.model.loader import default_model_path
    llama = default_model_path().read_bytes()
    files = {"model-Q8_0.gguf": tiny["qwen2"], "sub/model-Q4_K_M.gguf": llama, "README.md": b"# a repo\n"}
    with FakeHub({"house/tiny-GGUF": files}, cut_after=25_000_000) as hub:
        env = {**env, "HF_ENDPOINT": hub.url}
        r = cli(env, "pull", "house/tiny-GGUF", "--json")
        gets = [(p, rng) for m, p, rng in hub.requests if m == "GET" and p.endswith(".gguf")]
        again = cli(env, "pull", "house/tiny-GGUF")                   # the name is taken: said, nothing lost
        missing = cli(env, "pull", "nobody/nothing")
    assert r.returncode == 0, r.stderr
    assert "taking sub/model-Q4_K_M.gguf" in r.stderr and "model-Q8_0.gguf" in r.stderr   # says so
    entry = json.loads(r.stdout.strip().splitlines()[-1])
    assert entry["name"] == "model-q4_k_m" and entry["source"] == "store"
    assert entry["architecture"] == "llama" and entry["quantization"] == "Q4_1" and entry["context"] == 8192
    assert entry["origin"] == "house/tiny-GGUF:sub/model-Q4_K_M.gguf"
    # the transfer was cut after 25 MB and resumed from what was kept, by huggingface_hub
    assert len(gets) == 2 and gets[0][1] is None, gets
    resumed_at = int(gets[1][1].removeprefix("bytes=").removesuffix("-"))
    assert 0 < resumed_at <= 25_000_000, gets
    stored = Path(entry["path"])
    assert stored.read_bytes() == llama and entry["sha256"] == sha(stored)
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["model-q4_k_m.gguf", "model-q4_k_m.json"]

    listed = models(env)
    assert [(e["name"], e["source"], e["loaded"]) for e in listed] == [("model-q4_k_m", "store", False)]
    assert missing.returncode == 1 and "no repository nobody/nothing" in missing.stderr, missing.stderr
    assert again.returncode == 1 and "already has a model named 'model-q4_k_m'" in again.stderr
    r = cli(env, "rm", "model-q4_k_m")
    assert r.returncode == 0 and "removed model-q4_k_m" in r.stdout
    assert models(env) == [] and not stored.exists()


def test_a_checksum_mismatch_is_refused(tiny, env, tmp_path):
    with FakeHub({"house/bad": {"bad-Q4_K_M.gguf": tiny["llama"]}}, lie_sha={"bad-Q4_K_M.gguf"}) as hub:
        r = cli({**env, "HF_ENDPOINT": hub.url}, "pull", "house/bad:bad-Q4_K_M.gguf")
    assert r.returncode == 1 and "checksum mismatch" in r.stderr, r.stderr
    assert models(env) == []
    left = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert left == [], left                                           # no partial file kept


def test_bad_files_are_refused_at_pull(tiny, env, tmp_path):
    data = tiny["llama"].read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) * 2 // 3])
    text = tmp_path / "notes.gguf"
    text.write_text("this is not a model\n" * 10)
    r = cli(env, "pull", str(truncated))
    assert r.returncode == 1 and "truncated" in r.stderr, r.stderr
    r = cli(env, "pull", str(text))
    assert r.returncode == 1 and "is not a GGUF file (it starts with b'this'" in r.stderr, r.stderr
    with FakeHub({"house/cut": {"cut-Q4_K_M.gguf": truncated.read_bytes()}}) as hub:
        r = cli({**env, "HF_ENDPOINT": hub.url}, "pull", "house/cut")
    assert r.returncode == 1 and "truncated" in r.stderr, r.stderr
    assert models(env) == []

    r = cli(env, "pull", str(tiny["qwen2"]), "--name", "kitchen", "--json")     # a good local file
    assert r.returncode == 0, r.stderr
    entry = json.loads(r.stdout.strip().splitlines()[-1])
    assert entry["name"] == "kitchen" and entry["architecture"] == "qwen2" and entry["sha256"] == sha(tiny["qwen2"])
    assert tiny["qwen2"].exists()                                    # imported, not moved


def ollama_store(root: Path, name: str, tag: str, gguf: Path, namespace: str = "library") -> Path:
    """An Ollama store as Ollama lays it out: a manifest naming its layers, blobs by digest."""
    digest = sha(gguf)
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(gguf, root / "blobs" / f"sha256-{digest}")
    config = json.dumps({"model_format": "gguf"}).encode()
    cdigest = hashlib.sha256(config).hexdigest()
    (root / "blobs" / f"sha256-{cdigest}").write_bytes(config)
    manifest = root / "manifests" / "registry.example" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": f"sha256:{cdigest}",
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
                    "size": gguf.stat().st_size},
                   {"mediaType": "application/vnd.ollama.image.template", "digest": f"sha256:{cdigest}",
                    "size": len(config)}]}))
    return manifest


def hf_cache(root: Path, repo: str, filename: str, gguf: Path) -> Path:
    """A file in the Hugging Face cache as huggingface_hub lays it out (blob + snapshot link)."""
    d = root / f"models--{repo.replace('/', '--')}"
    (d / "blobs").mkdir(parents=True, exist_ok=True)
    (d / "refs").mkdir(exist_ok=True)
    blob = d / "blobs" / sha(gguf)
    shutil.copyfile(gguf, blob)
    (d / "refs" / "main").write_text(COMMIT)
    link = d / "snapshots" / COMMIT / filename
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
    return blob


def test_found_in_place_listed_and_served_by_name(tiny, env, tmp_path):
    ollama = tmp_path / "ollama"
    ollama_store(ollama, "tiny", "1b", tiny["llama"])
    ollama_store(ollama, "other", "latest", tiny["qwen2"], namespace="someone")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(tiny["llama"].read_bytes()[:5000])
    ollama_store(ollama, "broken", "latest", broken)
    blob = hf_cache(tmp_path / "hf", "house/tiny-GGUF", "tiny-Q4_K_M.gguf", tiny["qwen2"])
    listed = {e["name"]: e for e in models(env)}
    assert set(listed) == {"tiny:1b", "someone/other:latest", "broken:latest", "house/tiny-GGUF:tiny-Q4_K_M.gguf"}
    t = listed["tiny:1b"]
    assert t["source"] == "ollama" and t["architecture"] == "llama" and t["path"].startswith(str(ollama / "blobs"))
    assert t["size_bytes"] == tiny["llama"].stat().st_size and t["problem"] is None
    assert listed["someone/other:latest"]["architecture"] == "qwen2"
    assert "truncated" in listed["broken:latest"]["problem"]
    h = listed["house/tiny-GGUF:tiny-Q4_K_M.gguf"]
    assert h["source"] == "hf-cache" and h["path"] == str(blob) and h["quantization"] == "Q8_0"
    table = cli(env, "models", "--server", "127.0.0.1:1")
    assert table.returncode == 0 and "tiny:1b" in table.stdout and "cannot serve: " in table.stdout
    r = cli(env, "rm", "tiny:1b")
    assert r.returncode == 1 and "lives in ollama" in r.stderr and Path(t["path"]).exists()

    # served by its Ollama name: the banner names the file it found, an answer comes
    for spec, name in (("tiny:1b", "tiny:1b"), ("someone/other", "someone/other:latest"),
                       ("house/tiny-GGUF", "house/tiny-GGUF:tiny-Q4_K_M.gguf")):
        r = serve_and_ask(env, spec)
        assert r["rc"] == 0 and r["model"] == name and r["text"] is not None, (spec, r)
    r = cli(env, "serve", "--model", "broken", "--port", "0", "--no-http", "--no-mdns", "--host", "127.0.0.1")
    assert r.returncode == 1 and "cannot be served" in r.stderr and "truncated" in r.stderr, r.stderr
    r = cli(env, "serve", "--model", "nothing-like-it", "--port", "0", "--no-http", "--no-mdns", "--host", "127.0.0.1")
    assert r.returncode == 1 and "no model 'nothing-like-it'" in r.stderr and "tiny:1b" in r.stderr, r.stderr


def serve_and_ask(env, spec: str) -> dict:
    """Start `serve --model spec` on loopback, ask one question, stop it."""
    import re
    import signal
    proc = subprocess.Popen([*CLI, "serve", "--model", spec, "--port", "0", "--no-http", "--no-mdns",
                             "--host", "127.0.0.1", "--kv-memory", "16M", "--grace", "1"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"ready on ([\d.]+):(\d+)", line)
            if m:
                break
        else:
            return {"rc": proc.wait(), "log": "".join(lines), "model": None}
        r = cli(env, "ask", "--server", f"{m.group(1)}:{m.group(2)}", "--max-tokens", "4", "--json", "hello")
        answer = json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {}
        return {"rc": r.returncode, "log": "".join(lines) + r.stderr, "model": answer.get("model"),
                "text": answer.get("text")}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
