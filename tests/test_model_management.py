"""Models managed over Ollama's API and pulled by Ollama names (issue 37 §3): `edgepaged pull
NAME:TAG` and `/api/pull` speak Ollama's registry protocol against a loopback server laid out
as that registry (edgepaged.testing.registry: manifest, a 307 to the blob, Range), resumed
after a cut, digest-checked, refusing what the runtime cannot serve before the weights move;
/api/pull, /api/copy, /api/create, /api/blobs and /api/delete with the `ollama` package
against a running box; who may manage models (admins, loopback, --admin-from)."""
import hashlib
import json
from pathlib import Path

import httpx
import pytest

from edgepaged.testing.registry import FakeRegistry
from test_store import CLI, Serve, cli, env, models, tiny  # noqa: F401 - fixtures and helpers

QUESTION = [{"role": "user", "content": "hello"}]


def reg_env(env, reg) -> dict:
    return {**env, "EDGEPAGED_OLLAMA_REGISTRY": reg.url}


def test_pull_by_ollama_name_resumes_checks_and_keeps_the_manifest(tiny, env):
    """The first transfer is cut: the pull says so and keeps the bytes; the second asks for the
    rest (Range) and the file's sha256 is the manifest's digest; the manifest's system prompt
    and parameters are kept; a third pull of the same name fetches no weights again."""
    data = tiny["llama"].read_bytes()
    with FakeRegistry(cut_after=len(data) // 3) as reg:
        m = reg.add("library/tiny", "1b", data, system="You are Ada.", parameters={"temperature": 0, "stop": ["</s>"]})
        digest = m["layers"][0]["digest"]
        e = reg_env(env, reg)
        first = cli(e, "pull", "tiny:1b")
        second = cli(e, "pull", "tiny:1b", "--json")
        third = cli(e, "pull", "tiny:1b")
        missing = cli(e, "pull", "nothing:here")
        ranges = reg.gets_of(digest)
    assert first.returncode != 0 and "pull again to resume" in first.stderr, first.stderr
    assert second.returncode == 0, second.stderr
    assert ranges[:2] == [None, f"bytes={len(data) // 3}-"], ranges       # resumed, not started over
    assert len(ranges) == 2                                                 # the third pull fetched nothing
    assert third.returncode == 0, third.stderr
    entry = json.loads(second.stdout.strip().splitlines()[-1])
    assert entry["name"] == "tiny:1b" and entry["architecture"] == "llama"
    assert "sha256:" + entry["sha256"] == digest == "sha256:" + hashlib.sha256(Path(entry["path"]).read_bytes()).hexdigest()
    assert entry["system"] == "You are Ada." and entry["parameters"] == {"temperature": 0, "stop": ["</s>"]}
    assert "pulling manifest" in second.stderr and "100.0%" in second.stderr
    assert missing.returncode != 0 and "no such model" in missing.stderr
    listed = {x["name"]: x for x in models(e)}
    assert listed["tiny:1b"]["source"] == "store"


def test_what_the_runtime_cannot_serve_is_refused_before_the_weights_move(tiny, env, tmp_path):
    data = tiny["llama"].read_bytes()
    with FakeRegistry() as reg:
        vision = reg.add("library/seer", "latest", data, projector=b"\0" * 1000)
        mamba = reg.add("library/snake", "latest", data, family="mamba")
        liar = reg.add("library/liar", "latest", data + b"x")
        reg.lie.add(liar["layers"][0]["digest"])
        reg.add("library/text", "latest", b"hello, not a model" * 100)
        e = reg_env(env, reg)
        r_vision = cli(e, "pull", "seer")
        r_mamba = cli(e, "pull", "snake")
        r_liar = cli(e, "pull", "liar")
        r_text = cli(e, "pull", "text")
        r_host = cli(e, "pull", "elsewhere.example/library/tiny:1b")
        fetched = {p for m, p, _ in reg.requests if p.startswith("/cdn/")}
    assert r_vision.returncode != 0 and "vision projector" in r_vision.stderr
    assert r_mamba.returncode != 0 and "mamba" in r_mamba.stderr and "edgepaged runs" in r_mamba.stderr
    for refused in (vision, mamba):       # not a byte of their weights was asked for
        assert f"/cdn/{refused['layers'][0]['digest']}" not in fetched
    assert r_liar.returncode != 0 and "does not match its digest" in r_liar.stderr
    assert r_text.returncode != 0 and "not a GGUF file" in r_text.stderr
    assert r_host.returncode != 0 and "names the registry 'elsewhere.example'" in r_host.stderr
    store = Path(e["EDGEPAGED_STORE"])
    assert not [p for p in store.rglob("*") if p.is_file()], list(store.rglob("*"))   # nothing half-kept
    assert models(e) == []


def _lines(resp) -> list[dict]:
    return [json.loads(x) for x in resp.text.splitlines() if x.strip()]


def test_models_managed_over_the_ollama_api(tiny, env, tmp_path):
    """A several-model box: pull (as Home Assistant calls it, and streamed), then the model
    answers at once; create from it with a system prompt (greedy answers equal the same
    request with that system message), create from an uploaded blob, copy, delete."""
    import ollama
    data = tiny["llama"].read_bytes()
    with FakeRegistry() as reg:
        digest = reg.add("library/tiny", "1b", data, parameters={"temperature": 0})["layers"][0]["digest"]
        e = reg_env(env, reg)
        assert cli(e, "pull", str(tiny["qwen2"]), "--name", "base").returncode == 0
        box = Serve(e, "--model", "all", "--kv-memory", "16M")
        try:
            c = ollama.Client(host=box.http, timeout=120)
            assert "tiny:1b" not in {m.model for m in c.list().models}
            assert c.pull("tiny:1b").status == "success"                       # Home Assistant's call
            assert "tiny:1b" in {m.model for m in c.list().models}
            opts = {"temperature": 0, "num_predict": 8}
            plain = c.chat(model="tiny:1b", messages=QUESTION, options=opts).message.content
            assert plain
            streamed = _lines(httpx.post(box.http + "/api/pull", json={"model": "tiny:1b"}, timeout=60))
            assert streamed[0] == {"status": "pulling manifest"} and streamed[-1] == {"status": "success"}
            layer = next(x for x in streamed if x.get("digest") == digest)
            assert layer["total"] == len(data) == layer["completed"]

            system = "Always answer as Ada, the house's assistant."
            assert c.create(model="house", from_="tiny:1b", system=system).status == "success"
            as_house = c.chat(model="house", messages=QUESTION, options=opts).message.content
            by_hand = c.chat(model="tiny:1b", messages=[{"role": "system", "content": system}] + QUESTION,
                             options=opts).message.content
            assert as_house == by_hand != plain
            shown = c.show("house")
            assert f"SYSTEM \"\"\"{system}\"\"\"" in shown.modelfile and "temperature" in shown.parameters   # and tiny:1b's

            blob = c.create_blob(tiny["qwen2"])
            assert httpx.head(f"{box.http}/api/blobs/{blob}").status_code == 200
            assert httpx.head(f"{box.http}/api/blobs/sha256:{'0' * 64}").status_code == 404
            wrong = httpx.post(f"{box.http}/api/blobs/sha256:{'1' * 64}", content=b"other bytes")
            assert wrong.status_code == 400 and "digest mismatch" in wrong.json()["error"]
            assert c.create(model="uploaded", files={"tiny-qwen2.gguf": blob}).status == "success"
            assert c.chat(model="uploaded", messages=QUESTION, options=opts).message.content == \
                c.chat(model="base", messages=QUESTION, options=opts).message.content

            assert c.copy("tiny:1b", "tiny-copy").status == "success"
            assert c.chat(model="tiny-copy", messages=QUESTION, options=opts).message.content == plain
            assert c.delete("tiny-copy").status == "success"
            names = {m.model for m in c.list().models}
            assert "tiny-copy:latest" not in names and {"tiny:1b", "house:latest", "uploaded:latest"} <= names
            with pytest.raises(ollama.ResponseError) as gone:
                c.delete("tiny-copy")
            assert gone.value.status_code == 404
            with pytest.raises(ollama.ResponseError) as q:
                c.create(model="smaller", from_="tiny:1b", quantize="q4_K_M")
            assert q.value.status_code == 400 and "does not quantize" in q.value.error
            path = httpx.post(box.http + "/api/pull", json={"model": str(tiny["llama"]), "stream": False})
            assert path.status_code == 400 and "never a path" in path.json()["error"]
            # a name too long for a file name (the fuzzer's find: it was a 500), and the name of
            # a file in the server's folder: never read as a local file over the API
            long = httpx.post(box.http + "/api/pull", json={"model": "x" * 300, "stream": False})
            assert long.status_code == 400, long.text
            local = httpx.post(box.http + "/api/pull", json={"model": "README.md", "stream": False})
            assert local.status_code in (400, 404) and "GGUF" not in local.json()["error"], local.text
            assert box.proc.poll() is None
        finally:
            box.stop()
    listed = {x["name"] for x in models(e)}
    assert {"tiny:1b", "house", "uploaded", "base"} <= listed and "tiny-copy" not in listed


def test_who_may_manage_models(tiny, env, tmp_path):
    """With tokens: an admin's token may, another user's gets 403, none 401. An open box: the
    box itself (loopback) may, a caller from the network gets 403 naming --admin-from, unless
    --admin-from names its network."""
    import trio
    from starlette.requests import Request

    from edgepaged.server.manage import ModelAdmin
    from edgepaged.server.doors.ollama import OllamaError
    users = tmp_path / "users"
    users.write_text("ada admin-token admin\nbob bob-token\n")
    assert cli(env, "pull", str(tiny["qwen2"]), "--name", "base").returncode == 0
    box = Serve(env, "--model", "all", "--kv-memory", "16M", "--users", str(users))
    try:
        def delete(token=None):
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            return httpx.request("DELETE", box.http + "/api/delete", json={"model": "nothing"}, headers=headers)
        assert delete().status_code == 401
        bob = delete("bob-token")
        assert bob.status_code == 403 and "admin" in bob.json()["error"]
        assert delete("admin-token").status_code == 404        # allowed; there is no such model
    finally:
        box.stop()

    class Http:          # what ModelAdmin asks of its HttpServer on an open box
        class front:
            auth_required = False

        @staticmethod
        def _peer(request):
            return request.client.host

    def allowed(peer: str, admin_from=()) -> str:
        request = Request({"type": "http", "method": "POST", "path": "/api/pull", "headers": [],
                           "client": (peer, 50000)})
        try:
            trio.run(ModelAdmin(Http, admin_from).check, request)
            return "yes"
        except OllamaError as err:
            assert err.status == 403
            return str(err)
    assert allowed("127.0.0.1") == allowed("::1") == allowed("::ffff:127.0.0.1") == "yes"
    refused = allowed("192.168.1.7")
    assert "--admin-from" in refused and "192.168.1.7" in refused
    assert allowed("192.168.1.7", ("192.168.1.0/24",)) == "yes"
    assert allowed("10.0.0.9", ("192.168.1.0/24",)) != "yes"


def test_a_pull_with_no_network_fails_at_once_with_502(tiny, env, tmp_path):
    """A Hugging Face name with the hub out of reach retried for 23 s, answered 400 (HTTP.md
    promises 502) and the CLI printed each retry warning twice: now one line within seconds,
    from the CLI (a closed port; a network namespace with no network at all) and over the API
    (the `ollama` client's pull, and stream false: 502)."""
    import shutil
    import subprocess
    import time
    import ollama
    t0 = time.monotonic()
    r = cli({**env, "HF_ENDPOINT": "http://127.0.0.1:9"}, "pull", "acme/box")
    assert r.returncode == 1 and time.monotonic() - t0 < 10, r.stderr
    assert r.stderr.count("cannot reach the Hugging Face hub") == 1 and "Retry" not in r.stderr, r.stderr
    if shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"]).returncode == 0:
        t0 = time.monotonic()
        r = subprocess.run(["unshare", "-n", *CLI, "pull", "acme/box"], capture_output=True, text=True, timeout=120,
                           env={k: v for k, v in env.items() if k != "HF_ENDPOINT"})
        assert r.returncode == 1 and "cannot reach the Hugging Face hub" in r.stderr, r.stderr
        assert time.monotonic() - t0 < 10
    box = Serve({**env, "HF_ENDPOINT": "http://127.0.0.1:9"}, "--model", str(tiny["llama"]), "--kv-memory", "16M")
    try:
        t0 = time.monotonic()
        with pytest.raises(ollama.ResponseError, match="cannot reach the Hugging Face hub"):
            ollama.Client(host=box.http, timeout=60).pull("acme/box")
        assert time.monotonic() - t0 < 10
        got = httpx.post(box.http + "/api/pull", json={"model": "acme/box", "stream": False}, timeout=60)
        assert got.status_code == 502 and "cannot reach" in got.json()["error"]
    finally:
        box.stop()


async def test_the_default_model_can_be_managed_like_any_listed_model(embedded_runner, tmp_path):
    """A plain `serve` listed the embedded model in /api/tags, but /api/copy from it was a 404,
    /api/create from it went to Ollama's registry (502) and `edgepaged models` said "no models
    yet". Every model a door lists can be copied, created from and shown; a store model deleted;
    the embedded one is not the store's to delete."""
    import ollama
    import trio
    from edgepaged.box import store
    from edgepaged.server.httpd import HttpConfig
    from edgepaged.testing.serving import serving
    hc = HttpConfig(port=0)
    hc.store_root = tmp_path / "store"
    async with serving(embedded_runner, http=hc) as server:
        def scenario():
            c = ollama.Client(host=server.http_base, timeout=120)
            name = c.list().models[0].model
            out = {"name": name, "copy": c.copy(name, "house").status,
                   "create": c.create(model="kitchen", from_=name, system="You are the kitchen's assistant.").status,
                   "show": c.show(name).details.quantization_level}
            with pytest.raises(ollama.ResponseError) as e:
                c.delete(name)
            out["delete_embedded"] = e.value.status_code
            out["delete_copy"] = c.delete("house").status
            return out
        out = await trio.to_thread.run_sync(scenario)
    assert out["name"] == "SmolLM2-135M-Instruct.Q4_1:latest"
    assert out["copy"] == out["create"] == out["delete_copy"] == "success" and out["show"] == "Q4_1"
    assert 400 <= out["delete_embedded"] < 500
    kept = {e.name: e for e in store.store_entries(tmp_path / "store")}
    assert set(kept) == {"kitchen"} and kept["kitchen"].system == "You are the kitchen's assistant."
    assert kept["kitchen"].quantization == "Q4_1"
    listed = {e.name: e.source for e in store.entries(tmp_path / "store")}
    assert listed["SmolLM2-135M-Instruct.Q4_1"] == "embedded" and listed["kitchen"] == "store"


def _answers_about_a_photo(e, model: str, logged: str, size: tuple, rows: int) -> None:
    """`serve --model MODEL` logs its projector (`logged`) and answers a photo of `size` over
    Ollama's /api/chat with more than `rows` prompt tokens (the image's)."""
    import base64
    import io

    import numpy as np
    import ollama
    from PIL import Image
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(png, "PNG")
    s = Serve(e, "--model", model)
    try:
        assert any(logged in line for line in s.lines), s.lines
        c = ollama.Client(host=s.http, timeout=120)
        out = c.chat(model=model, messages=[{"role": "user", "content": "What is it?",
                                             "images": [base64.b64encode(png.getvalue()).decode()]}],
                     options={"num_predict": 4, "temperature": 0})
        assert out.message.content and out.prompt_eval_count > rows
    finally:
        s.stop()


def test_a_llava_pulled_by_its_ollama_name_keeps_its_projector_beside_it(env, tmp_path):
    """Ollama's llava: the model layer and a projector layer (llama.cpp's mmproj). The pull
    checks the projector first, keeps it beside the model as NAME.mmproj.gguf, where `serve`
    finds it (the model then takes images: an answer about a photo over /api/chat); `rm`
    removes both."""
    from edgepaged.server.app import projector_for
    from edgepaged.testing.vision_models import make_llava
    _, model, mmproj = make_llava(tmp_path / "llava")
    with FakeRegistry() as reg:
        reg.add("library/llava", "7b", model, projector=mmproj.read_bytes())
        e = reg_env(env, reg)
        r = cli(e, "pull", "llava:7b", "--json")
        assert r.returncode == 0, r.stderr
        entry = json.loads(r.stdout.strip().splitlines()[-1])
    path = Path(entry["path"])
    assert projector_for(path) == path.with_suffix(".mmproj.gguf")
    assert path.with_suffix(".mmproj.gguf").read_bytes() == mmproj.read_bytes()
    _answers_about_a_photo(e, "llava:7b", ".mmproj.gguf (mlp", (80, 60), 16)
    r = cli(e, "rm", "llava:7b")
    assert r.returncode == 0 and not path.exists() and not path.with_suffix(".mmproj.gguf").exists()


def test_a_qwen25vl_pulled_by_its_ollama_name_answers_about_a_photo(env, tmp_path):
    """Ollama's qwen2.5vl: one model layer, the vision tower inside (architecture qwen25vl).
    Pulled by its Ollama name, served as it is: `serve` finds the tower in the file, and a
    photo over /api/chat is answered (its 7 x 11 feature rows counted in the prompt)."""
    from edgepaged.server.app import projector_for
    from edgepaged.testing.vision_models import make_qwen25vl
    _, _, _, single = make_qwen25vl(tmp_path / "qwen")
    with FakeRegistry() as reg:
        reg.add("library/qwen2.5vl", "3b", single)
        e = reg_env(env, reg)
        r = cli(e, "pull", "qwen2.5vl:3b", "--json")
        assert r.returncode == 0, r.stderr
        entry = json.loads(r.stdout.strip().splitlines()[-1])
    path = Path(entry["path"])
    assert projector_for(path) == path and path.read_bytes() == single.read_bytes()
    _answers_about_a_photo(e, "qwen2.5vl:3b", "qwen2.5vl_merger", (300, 200), 7 * 11)
