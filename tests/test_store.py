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


def models(env, embedded: bool = False) -> list[dict]:
    """`edgepaged models --json` (the embedded default model, always there, left out unless asked)."""
    r = cli(env, "models", "--json", "--server", "127.0.0.1:1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(FIELDS <= set(e) for e in out), out
    return out if embedded else [e for e in out if e["source"] != "embedded"]


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
    assert r.returncode == 1 and "is not a GGUF file (it does not start with b'GGUF')" in r.stderr, r.stderr
    other = tmp_path / "other-arch.gguf"          # the same file, said to be of an architecture not run here
    other.write_bytes(data.replace(b"llama", b"bamba"))
    r = cli(env, "pull", str(other))
    assert r.returncode == 1 and "unsupported model architecture 'bamba'" in r.stderr, r.stderr
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
    for spec, name in (("tiny:1b", "tiny:1b"), ("house/tiny-GGUF", "house/tiny-GGUF:tiny-Q4_K_M.gguf")):
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


# ---- several models on one box -----------------------------------------------------------------------------

QUESTION = [{"role": "user", "content": "hello"}]


class Serve:
    """`edgepaged serve` with the given arguments on loopback (msgpack and HTTP ports)."""

    def __init__(self, env, *args):
        import re
        self.proc = subprocess.Popen([*CLI, "serve", "--port", "0", "--http-port", "0", "--host", "127.0.0.1",
                                      "--no-mdns", "--grace", "1", *args], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines = []
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"ready on ([\d.]+):(\d+).*HTTP \(OpenAI API, chat page\) http://([\d.]+:\d+)/", line)
            if m:
                self.address, self.http = f"{m.group(1)}:{m.group(2)}", f"http://{m.group(3)}"
                break
        else:
            raise AssertionError("serve did not start:\n" + "".join(self.lines))
        import threading
        threading.Thread(target=lambda: [self.lines.append(x) for x in self.proc.stdout], daemon=True).start()

    def stats(self) -> dict:
        import httpx
        return httpx.get(self.http + "/stats", timeout=10).json()

    def loaded(self) -> dict[str, int]:
        return {m["name"]: m["loads"] for m in self.stats()["models"] if m["loaded"]}

    def stop(self) -> None:
        import signal
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def reference_answer(path: Path) -> str:
    """The model's greedy answer, served alone (in process) through the OpenAI API."""
    import httpx
    import trio

    from edgepaged.model import ModelRunner
    from edgepaged.testing import serving as box

    async def main():
        async with box.serving(ModelRunner(path, num_blocks=64), http=True) as server:
            async with httpx.AsyncClient(timeout=60) as c:
                r = await c.post(f"http://127.0.0.1:{server.http.port}/v1/chat/completions",
                                 json={"messages": QUESTION, "max_tokens": 8, "temperature": 0})
                return r.json()["choices"][0]["message"]["content"]
    return trio.run(main)


def test_two_models_served_loaded_on_demand_and_unloaded_when_idle(tiny, env):
    """Each request is answered by the model it names, on every door (Ollama's client, OpenAI's API,
    the msgpack protocol); an idle model unloads after --keep-alive and loads again when asked."""
    import httpx
    import ollama
    import time
    want = {"tiny-llama-q8_0": reference_answer(tiny["llama"]), "tiny-qwen2-q8_0": reference_answer(tiny["qwen2"])}
    assert want["tiny-llama-q8_0"] != want["tiny-qwen2-q8_0"]          # the two can tell themselves apart
    for name, path in (("tiny-llama-q8_0", tiny["llama"]), ("tiny-qwen2-q8_0", tiny["qwen2"])):
        assert cli(env, "pull", str(path), "--name", name).returncode == 0
    s = Serve(env, "--model", "tiny-llama-q8_0", "--model", "tiny-qwen2-q8_0", "--keep-alive", "1s",
              "--kv-memory", "4M")
    try:
        assert "models tiny-llama-q8_0, tiny-qwen2-q8_0 (default tiny-llama-q8_0" in s.lines[-1]
        assert s.loaded() == {}                                         # nothing loads before it is asked for
        c = ollama.Client(host=s.http)
        assert sorted(m.model for m in c.list().models) == ["tiny-llama-q8_0:latest", "tiny-qwen2-q8_0:latest"]
        assert c.ps().models == []
        for name in want:
            r = c.chat(model=name, messages=QUESTION, options={"num_predict": 8, "temperature": 0}, keep_alive="30s")
            assert r.model == name and r.message.content == want[name], (name, r)
        assert sorted(m.model for m in c.ps().models) == ["tiny-llama-q8_0:latest", "tiny-qwen2-q8_0:latest"]
        body = {"messages": QUESTION, "max_tokens": 8, "temperature": 0}
        for name in want:                                               # OpenAI's `model` picks one too
            r = httpx.post(s.http + "/v1/chat/completions", json={**body, "model": name}, timeout=60).json()
            assert r["model"] == name and r["choices"][0]["message"]["content"] == want[name], r
        r = httpx.post(s.http + "/v1/chat/completions", json={**body, "model": "nope"}, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert [m["id"] for m in httpx.get(s.http + "/v1/models").json()["data"]] == list(want)
        for name in want:                                               # and the msgpack protocol's
            a = json.loads(cli(env, "ask", "--server", s.address, "--model", name, "--max-tokens", "8",
                               "--repeat-penalty", "1", "--json", "hello").stdout.strip().splitlines()[-1])
            assert a["model"] == name and a["text"] == want[name], a
        r = cli(env, "models", "--json", "--server", s.http.removeprefix("http://"))
        listed = {e["name"]: (e["loaded"], e["source"]) for e in json.loads(r.stdout.strip().splitlines()[-1])
                  if e["source"] != "embedded"}
        assert listed == {name: (True, "store") for name in want}, listed
        assert s.loaded() == {"tiny-llama-q8_0": 1, "tiny-qwen2-q8_0": 1}
        metrics = httpx.get(s.http + "/metrics").text                 # one exposition, the model as a label
        for name in want:
            assert f'edgepaged:generation_tokens_total{{model_name="{name}"}}' in metrics, metrics[:2000]
        assert metrics.count("# TYPE edgepaged:generation_tokens_total counter") == 1

        c.generate(model="tiny-qwen2-q8_0", prompt="", keep_alive="1s")  # back to a short keep_alive
        c.generate(model="tiny-llama-q8_0", prompt="", keep_alive="1s")
        deadline = time.monotonic() + 10
        while s.loaded() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert s.loaded() == {} and c.ps().models == []                 # idle past keep_alive: unloaded
        r = c.chat(model="tiny-qwen2-q8_0", messages=QUESTION, options={"num_predict": 8, "temperature": 0})
        assert r.message.content == want["tiny-qwen2-q8_0"]
        assert s.loaded() == {"tiny-qwen2-q8_0": 2}                     # loaded again, on the next request
        c.generate(model="tiny-qwen2-q8_0", prompt="", keep_alive=0)    # Ollama's unload call
        assert s.loaded() == {}
    finally:
        s.stop()
    assert s.proc.returncode == 0, "".join(s.lines)


def test_the_memory_budget_unloads_the_least_recently_used(tiny, env):
    """Room for one model at a time: asking for the other unloads the idle one first; while the
    one loaded is busy, the other is refused with model_unavailable (a clear 503), then served."""
    import httpx
    import ollama
    size = max(p.stat().st_size for p in tiny.values())
    budget = 2 * size + (6 << 20)          # each model takes its file + 4 MiB of KV: one fits, not two
    s = Serve(env, "--model", str(tiny["llama"]), "--model", str(tiny["qwen2"]), "--kv-memory", "4M",
              "--memory-budget", str(budget))
    try:
        c = ollama.Client(host=s.http)
        opts = {"num_predict": 4, "temperature": 0}
        c.chat(model="tiny-llama-q8_0", messages=QUESTION, options=opts)
        assert s.loaded() == {"tiny-llama-q8_0": 1}
        c.chat(model="tiny-qwen2-q8_0", messages=QUESTION, options=opts)
        assert s.loaded() == {"tiny-qwen2-q8_0": 1}                     # the idle llama made room
        assert [m.model for m in c.ps().models] == ["tiny-qwen2-q8_0:latest"]

        # a long answer keeps qwen2 busy: llama cannot come in now, and says why
        body = {"messages": QUESTION, "max_tokens": 1000, "ignore_eos": True, "temperature": 0, "stream": True,
                "model": "tiny-qwen2-q8_0"}
        with httpx.stream("POST", s.http + "/v1/chat/completions", json=body, timeout=60) as long:
            it = long.iter_lines()
            next(it)                                                    # it is streaming
            r = httpx.post(s.http + "/v1/chat/completions", timeout=60, json={
                "messages": QUESTION, "max_tokens": 4, "model": "tiny-llama-q8_0"})
            rest = list(it)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable", r.text
        assert "tiny-qwen2-q8_0" in r.json()["error"]["message"]
        assert any('"finish_reason":"length"' in x.replace(" ", "") for x in rest)   # the long one finished
        c.chat(model="tiny-llama-q8_0", messages=QUESTION, options=opts)
        assert s.loaded() == {"tiny-llama-q8_0": 2}
    finally:
        s.stop()
    assert s.proc.returncode == 0, "".join(s.lines)


def test_several_models_in_the_mdns_record_and_ls(tiny, env):
    """Inside a network namespace of its own (only `lo`): the record names every model, `ls` shows them."""
    from test_mdns import namespace_problem
    problem = namespace_problem()
    if problem:
        pytest.skip(problem)
    script = f"""
import json, subprocess, sys, time, re
cmd = {CLI!r}
p = subprocess.Popen(cmd + ["serve", "--model", {str(tiny["llama"])!r}, "--model", {str(tiny["qwen2"])!r},
                      "--port", "0", "--http-port", "0", "--mdns-interface", "127.0.0.1"],
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
for line in p.stdout:
    if "ready on" in line:
        break
try:
    deadline = time.monotonic() + 20   # a busy machine may answer a browse late: ask again
    while True:
        r = subprocess.run(cmd + ["ls", "--json", "--timeout", "1.5", "--mdns-interface", "127.0.0.1"],
                           capture_output=True, text=True)
        if json.loads(r.stdout or "[]") or time.monotonic() > deadline:
            break
    t = subprocess.run(cmd + ["ls", "--timeout", "1.5", "--mdns-interface", "127.0.0.1"], capture_output=True,
                       text=True)
    print(json.dumps({{"ls": json.loads(r.stdout), "table": t.stdout}}))
finally:
    p.terminate()
    p.wait(timeout=20)
"""
    r = subprocess.run(["unshare", "-n", "sh", "-c", f"ip link set lo up && exec {sys.executable} -c \"$S\""],
                       env={**env, "S": script}, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    (record,) = out["ls"]
    assert record["model"] == "tiny-llama-q8_0" and record["extra"]["models"] == "tiny-llama-q8_0,tiny-qwen2-q8_0"
    assert "tiny-llama-q8_0,tiny-qwen2-q8_0" in out["table"]


def test_list_is_models(env):
    a, b = cli(env, "models", "--json", "--server", "127.0.0.1:1"), cli(env, "list", "--json", "--server", "127.0.0.1:1")
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout


def test_a_vision_repository_s_projector_comes_with_its_model(env, tmp_path):
    """A Hugging Face GGUF repository of a vision model (model files and mmproj files, as
    ggml-org's SmolVLM ones are laid out): the pull takes the model (never a projector as
    the model), then the projector of the same quantization, kept beside the model where
    `serve` finds it; `rm` removes both."""
    from edgepaged.server.app import projector_for
    from edgepaged.testing.vision_models import make_smolvlm
    _, model, mmproj = make_smolvlm(tmp_path / "vlm")
    files = {"vlm-Q8_0.gguf": model.read_bytes(), "mmproj-vlm-f16.gguf": b"not this one",
             "mmproj-vlm-Q8_0.gguf": mmproj.read_bytes()}
    with FakeHub({"house/vlm-GGUF": files}) as hub:
        e = {**env, "HF_ENDPOINT": hub.url}
        r = cli(e, "pull", "house/vlm-GGUF", "--json")
    assert r.returncode == 0, r.stderr
    entry = json.loads(r.stdout.strip().splitlines()[-1])
    path = Path(entry["path"])
    assert entry["origin"] == "house/vlm-GGUF:vlm-Q8_0.gguf" and "images: " in r.stderr
    assert projector_for(path) == path.with_suffix(".mmproj.gguf")
    assert path.with_suffix(".mmproj.gguf").read_bytes() == mmproj.read_bytes()
    r = cli(e, "rm", entry["name"])
    assert r.returncode == 0 and not path.exists() and not path.with_suffix(".mmproj.gguf").exists()
