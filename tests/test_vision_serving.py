"""A vision model served (issue 68): a tiny SmolVLM (transformers' Idefics3 classes, written
as a GGUF repository ships it: model + mmproj) on the CPU runtime, the real clients sending
a camera frame (a 1280 x 720 JPEG) through every door, the second turn of a conversation
about the photo found in the prefix cache, and the bounds."""
import base64
import io
import json

import numpy as np
import pytest
import trio
from PIL import Image

from edgepaged.testing import serving as box

from test_http import afetch


def _jpeg(w=1280, h=720, seed=0) -> bytes:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 255, (h // 40 + 1, w // 40 + 1, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR)
    out = io.BytesIO()
    img.save(out, "JPEG", quality=85)
    return out.getvalue()


@pytest.fixture(scope="module")
def vision_runner(tmp_path_factory):
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.testing.vision_models import make_smolvlm
    _, model, mmproj = make_smolvlm(tmp_path_factory.mktemp("smolvlm-served"))
    runner = CpuRunner(model, num_blocks=256)
    runner.attach_vision(mmproj)
    return runner


async def test_the_real_clients_send_a_camera_frame_through_every_door(vision_runner, tmp_path):
    """openai (a data-URL image_url part), ollama.chat(images=[path]), ollama.generate
    (Frigate's call), LangChain's ChatOllama with an image content block, the Responses API's
    input_image: each answers about the photo, and the doors that render the same
    conversation give the same greedy answer (one encoder run: the image found again)."""
    import ollama
    import openai
    from langchain_core.messages import HumanMessage
    from langchain_ollama import ChatOllama
    photo = _jpeg()
    path = tmp_path / "frigate-event.jpg"
    path.write_bytes(photo)
    url = "data:image/jpeg;base64," + base64.b64encode(photo).decode()
    q = "What is in the picture?"
    table = vision_runner.images
    before = table.stats()["images_encoded"]
    async with box.serving(vision_runner, http=True) as server:
        base, model = server.http_base, server.front.model

        def scenario():
            out = {}
            c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
            r = c.chat.completions.create(model=model, temperature=0, max_tokens=8, messages=[{"role": "user", "content": [
                {"type": "text", "text": q}, {"type": "image_url", "image_url": {"url": url}}]}])
            out["openai"] = (r.choices[0].message.content, r.usage.prompt_tokens)
            o = ollama.Client(host=base, timeout=120)
            r = o.chat(model=model, messages=[{"role": "user", "content": q, "images": [str(path)]}],
                       options={"temperature": 0, "num_predict": 8})
            out["ollama_chat"] = (r.message.content, r.prompt_eval_count)
            r = o.generate(model=model, prompt=q, images=[str(path)], options={"temperature": 0, "num_predict": 8})
            out["ollama_generate"] = (r.response, r.prompt_eval_count)
            lc = ChatOllama(model=model, base_url=base, temperature=0, num_predict=8)
            r = lc.invoke([HumanMessage(content=[{"type": "text", "text": q},
                                                 {"type": "image_url", "image_url": url}])])
            out["langchain"] = (r.content, r.response_metadata.get("prompt_eval_count"))
            r = c.responses.create(model=model, temperature=0, max_output_tokens=8, input=[{"role": "user", "content": [
                {"type": "input_text", "text": q}, {"type": "input_image", "image_url": url}]}])
            out["responses"] = (r.output_text, r.usage.input_tokens)
            return out

        out = await trio.to_thread.run_sync(scenario)
    assert all(isinstance(a, str) and a for a, _ in out.values()), out
    # LangChain's ChatOllama sends its text parts each after a newline: its own prompt
    lc = out.pop("langchain")
    assert len({a for a, _ in out.values()}) == 1, out       # one conversation, one greedy answer
    prompts = {n for _, n in out.values()}
    assert len(prompts) == 1 and prompts.pop() > 20 + 10     # the image's 20 rows and its wrapping, the question
    assert lc[1] > 30
    assert table.stats()["images_encoded"] - before == 1      # encoded once, found again by every other door


async def test_the_second_turn_about_a_photo_runs_no_encoder_and_hits_the_prefix_cache(vision_runner):
    """Open WebUI's way: the whole conversation resent, image included. The second turn
    encodes nothing and its cached_tokens cover the image's tokens (the prefix cache keys
    them by the image's content); a different photo in the same place is computed anew."""
    photo, other = _jpeg(seed=1), _jpeg(seed=2)
    table = vision_runner.images

    def turn(img, history=()):
        url = "data:image/jpeg;base64," + base64.b64encode(img).decode()
        first = {"role": "user", "content": [{"type": "text", "text": "Describe it."},
                                             {"type": "image_url", "image_url": {"url": url}}]}
        return {"messages": [first, *history], "temperature": 0, "max_tokens": 6}

    async with box.serving(vision_runner, http=True) as server:
        chat = server.http_base + "/v1/chat/completions"
        enc0 = table.stats()["images_encoded"]
        status, _, raw = await afetch(chat, turn(photo))
        assert status == 200, raw
        one = json.loads(raw)
        assert table.stats()["images_encoded"] == enc0 + 1
        answer = one["choices"][0]["message"]["content"]
        status, _, raw = await afetch(chat, turn(photo, [{"role": "assistant", "content": answer},
                                                         {"role": "user", "content": "And the colours?"}]))
        assert status == 200, raw
        two = json.loads(raw)
        assert table.stats()["images_encoded"] == enc0 + 1            # no encoder work
        cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
        first_len = one["usage"]["prompt_tokens"]
        assert cached >= (first_len - 1) // 16 * 16 and cached > 20     # the first turn's blocks, image included
        status, _, raw = await afetch(chat, turn(other))
        three = json.loads(raw)
        assert status == 200 and table.stats()["images_encoded"] == enc0 + 2
        # the same text before it, but another image: only the blocks before the image are shared
        # (the template's "<|im_start|>User:", the tile's wrapping: text here, a block of it)
        vocab = vision_runner.config.vocab_size
        ids = vision_runner.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}])
        before = ids.index(vision_runner.tokenizer.tok.token_to_id("<image>")) + 2   # + <fake><row_1_col_1>
        assert before < 32 and all(t < vocab for t in ids)
        assert three["usage"]["prompt_tokens_details"]["cached_tokens"] == before // 16 * 16
        await trio.sleep(0.1)
        a = server.front.engine.allocator.stats()
        assert a["used_blocks"] == 0 and a["num_sequences"] == 0


async def test_image_bounds_are_refused_before_any_decoding_and_name_the_image(vision_runner):
    """A decompression bomb's header, a file past the byte cap, a text file as an image, a
    truncated JPEG, a remote URL, too many images: each a 4xx naming the image, nothing
    encoded, and the box answers the next request."""
    table = vision_runner.images
    bomb = io.BytesIO()
    Image.new("L", (12000, 12000)).save(bomb, "PNG")     # 144 MP: refused at its header
    good = _jpeg(320, 240, seed=5)

    def body(*images, text="What is it?"):
        parts = [{"type": "text", "text": text}]
        parts += [{"type": "image_url", "image_url": {"url": u}} for u in images]
        return {"messages": [{"role": "user", "content": parts}], "max_tokens": 4}

    def data(b: bytes, mime="image/png") -> str:
        return f"data:{mime};base64," + base64.b64encode(b).decode()

    async with box.serving(vision_runner, http=True) as server:
        chat = server.http_base + "/v1/chat/completions"
        enc0 = table.stats()["images_encoded"]
        cases = [
            (body(data(bomb.getvalue())), 413, "pixels"),
            (body(data(b"not an image at all" * 10)), 415, "not an image"),
            (body(data(good[: len(good) // 2], "image/jpeg")), 400, "truncated"),
            (body("https://camera.invalid/snapshot.jpg"), 400, "remote image URLs are not fetched"),
            (body(*[data(good, "image/jpeg")] * 9), 413, "at most 8"),
            (body(data(good, "text/plain")), 415, "not an image type"),
        ]
        for b, status, words in cases:
            got, _, raw = await afetch(chat, b)
            assert got == status and words in json.loads(raw)["error"]["message"], (status, raw[:300])
        assert table.stats()["images_encoded"] == enc0
        got, _, raw = await afetch(chat, body(data(good, "image/jpeg")))
        assert got == 200, raw


async def test_one_caller_s_images_waiting_for_the_encoder_are_bounded(vision_runner):
    """A caller with 16 images waiting for the encoder (two requests of 8, the encoder held
    busy) gets a 429 for a third request before any of its images is read, naming the bound;
    the first two are answered, and the caller's next photo is taken again."""
    from edgepaged.request import vision_prompt as vp

    def body(seed0):
        urls = ["data:image/jpeg;base64," + base64.b64encode(_jpeg(64, 48, seed=seed0 + k)).decode()
                for k in range(8)]
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}] + [
            {"type": "image_url", "image_url": {"url": u}} for u in urls]}], "max_tokens": 2}

    async with box.serving(vision_runner, http=True) as server:
        chat = server.http_base + "/v1/chat/completions"
        got = {}

        async def send(name, b):
            got[name] = await afetch(chat, b)
        async with trio.open_nursery() as nursery:
            async with vp.ENCODER.turn("test"):        # the encoder busy: the callers' images wait
                nursery.start_soon(send, "a", body(300))
                nursery.start_soon(send, "b", body(400))
                with trio.fail_after(30):
                    while sum(vp._WAITING.values()) < 16:
                        await trio.sleep(0.01)
                encoded = vision_runner.images.stats()["images_encoded"]
                status, _, raw = await afetch(chat, body(500))
                assert status == 429 and b"waiting for the image encoder" in raw, raw
                assert vision_runner.images.stats()["images_encoded"] == encoded
        assert got["a"][0] == 200 and got["b"][0] == 200, (got["a"][2][:200], got["b"][2][:200])
        assert not vp._WAITING
        status, _, raw = await afetch(chat, body(600))
        assert status == 200, raw


async def test_the_encoder_takes_callers_images_in_turn(vision_runner):
    """One caller's burst of 4 photos waiting for the encoder, then another caller's one: the
    second caller's photo is encoded second, not fifth (callers in turn, each caller's own in
    order); a waiter cancelled in the queue leaves it; every image held comes back."""
    from edgepaged.request import vision_prompt as vp
    from edgepaged.request.messages import Image as Img

    def msgs(seed):
        url = "data:image/jpeg;base64," + base64.b64encode(_jpeg(64, 48, seed=seed)).decode()
        return [{"role": "user", "content": "What is it?", "images": (Img(url=url),)}]
    done = []

    async def one(name, seed, scope=None):
        with scope or trio.CancelScope():
            held = await vp.prepare_images(msgs(seed), vision_runner, vp.ImageLimits(), who=name[0])
            done.append(name)
            held.release()
    gone = trio.CancelScope()                              # a waiter that leaves before its turn
    async with trio.open_nursery() as nursery:
        async with vp.ENCODER.turn("test"):
            for k, (name, seed) in enumerate((("a0", 700), ("a1", 701), ("a2", 702), ("a3", 703), ("c0", 799),
                                              ("b0", 800))):
                nursery.start_soon(one, name, seed, gone if name == "c0" else None)
                with trio.fail_after(30):          # (queued in this order)
                    while vp.ENCODER.waiting() < k + 1:
                        await trio.sleep(0.01)
            gone.cancel()
            with trio.fail_after(30):
                while vp.ENCODER.waiting() > 5:
                    await trio.sleep(0.01)
    assert done == ["a0", "b0", "a1", "a2", "a3"], done
    assert vp.ENCODER.waiting() == 0 and not vp._WAITING


def test_serve_pairs_the_projector_beside_the_model_and_the_cli_sends_photos(tmp_path):
    """`edgepaged serve --model model.gguf` finds mmproj-model.gguf beside it (as a Hugging
    Face GGUF repository ships them) and says so; /api/show lists the vision capability; a
    3 MB photo goes through HTTP (the body bound grows for a vision model); `edgepaged ask
    --image FILE` and `/image FILE` in `edgepaged chat` send a photo over the msgpack protocol
    (a large one re-encoded to fit a frame)."""
    import os
    import re
    import subprocess
    import sys
    import urllib.request

    from edgepaged.client import SyncClient
    from edgepaged.client.chat import ChatSession
    from edgepaged.testing.vision_models import make_smolvlm
    from test_cli import CLI, ServeProcess, SERVE_ARGS, cli
    _, model, mmproj = make_smolvlm(tmp_path / "repo")
    env = {**os.environ}
    env.pop("EDGEPAGED_TOKEN", None)
    s = ServeProcess([sys.executable, "-m", "edgepaged.cli", "serve", "--model", str(model), *SERVE_ARGS], env)
    try:
        m = s.wait_for(r"ready on ([\d.]+):(\d+)", timeout=180)
        address = f"{m.group(1)}:{m.group(2)}"
        assert any("images: mmproj-model.gguf (idefics3" in line for line in s.lines), "".join(s.lines)
        http = re.search(r"(http://127\.0\.0\.1:\d+/)", next(x for x in s.lines if "ready on" in x)).group(1)
        req = urllib.request.Request(http + "api/show", data=json.dumps({"model": "model"}).encode())
        with urllib.request.urlopen(req, timeout=30) as r:
            assert "vision" in json.loads(r.read())["capabilities"]
        rng = np.random.default_rng(7)
        big = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (900, 1200, 3), dtype=np.uint8)).save(big, "PNG")
        assert big.tell() > 3 << 20                       # past the text-only body bound (1 MiB) as base64
        body = {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is it?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(big.getvalue()).decode()}}]}],
            "max_tokens": 4}
        req = urllib.request.Request(http + "v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200 and json.loads(r.read())["usage"]["prompt_tokens"] > 20
        photo = tmp_path / "photo.png"
        photo.write_bytes(big.getvalue())                  # over a frame: re-encoded by the client
        r = cli("ask", "--server", address, "--image", str(photo), "--json", "--max-tokens", "4", "What is it?")
        out = json.loads(r.stdout)
        assert r.returncode == 0 and out["text"] and out["usage"]["prompt_tokens"] > 20, r.stdout + r.stderr
        r = cli("ask", "--server", address, "--image", str(tmp_path / "repo" / "config.json"), "What is it?")
        assert r.returncode == 2 and "not an image" in r.stderr
        said = io.StringIO()
        with SyncClient(address) as c:
            chat = ChatSession(c, max_tokens=4, out=said, err=said)
            assert chat.command(f"/image {photo}")
            chat.turn("What is it?")
            chat.turn("And the colours?")                 # the conversation resent, its image with it
        assert len(chat.history) == 4 and chat.history[0]["images"] and chat.history[1]["content"]
        assert "[error]" not in said.getvalue(), said.getvalue()
    finally:
        s.proc.kill()
        s.proc.wait()


def _payloads() -> list[bytes]:
    """Image files as a fuzzer sends them: good ones of each format and size, and the bad:
    truncated, a decompression bomb's header, a corrupt body, not an image, an EXIF-rotated one."""
    import struct
    import zlib
    rng = np.random.default_rng(11)
    out = []
    for fmt, size in (("JPEG", (64, 48)), ("PNG", (300, 20)), ("WEBP", (90, 90)), ("GIF", (33, 77)),
                      ("PNG", (1, 1)), ("JPEG", (700, 500))):
        b = io.BytesIO()
        img = Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
        if fmt == "GIF":
            img.save(b, "GIF", save_all=True, append_images=[img.rotate(90)])
        else:
            img.save(b, fmt)
        out.append(b.getvalue())
    ex = Image.new("RGB", (40, 20))
    exif = ex.getexif()
    exif[0x0112] = 6                       # rotated: EXIF orientation applied
    b = io.BytesIO()
    ex.save(b, "JPEG", exif=exif)
    out.append(b.getvalue())
    out += [out[0][: len(out[0]) // 3], out[1][:40], b"\x89PNG\r\n\x1a\n" + b"\0" * 64, b"GIF89a" + bytes(200),
            b"BM" + bytes(100), b"<svg xmlns='http://www.w3.org/2000/svg'/>", bytes(rng.integers(0, 255, 500,
                                                                                             dtype=np.uint8))]
    ihdr = struct.pack(">IIBBBBB", 60000, 60000, 8, 2, 0, 0, 0)       # 3.6 G pixels, in 60 bytes
    chunk = b"IHDR" + ihdr
    out.append(b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk))
               + struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND")))
    return out


async def test_image_inputs_fuzzed_through_every_door_beside_a_canary(vision_runner, caplog):
    """Hypothesis draws images (good ones of each format, truncated, bombs, corrupt, not an
    image, wrong media types, remote URLs, too many, not base64) into every door's image
    field while a greedy canary asks about one photo: the canary's answer never changes,
    every answer is 2xx or a 4xx (400/413/415) in the door's shape, no traceback is logged,
    and every KV block and image hold comes back."""
    import gc
    import logging

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from test_fuzz_doors import check_http, http, msgpack_request
    caplog.set_level(logging.INFO)
    files = _payloads()
    canary_photo = _jpeg(200, 150, seed=9)
    b64 = st.one_of(st.sampled_from(files).map(lambda b: base64.b64encode(b).decode()), st.just("not base64 !"),
                    st.just(""), st.text(max_size=12))
    url = st.one_of(b64.map(lambda t: "data:image/jpeg;base64," + t),
                    st.sampled_from(files).map(lambda b: "data:text/plain;base64," + base64.b64encode(b).decode()),
                    st.sampled_from(["https://camera.invalid/a.jpg", "http://camera.invalid/snap.png", "file:///etc/passwd",
                                     "data:image/png,raw", "data:;base64,AAAA", "ftp://x/y.gif"]))
    many = st.integers(0, 10)

    def openai_body(urls, q):
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": q}] + [
            {"type": "image_url", "image_url": {"url": u}} for u in urls]}], "max_tokens": 3}

    async with box.serving(vision_runner, http=True, max_tokens=32, max_inflight=32) as server:
        base, port = server.http_base, server.port
        from edgepaged.client import open_client
        canary_msgs = [{"role": "user", "content": "What is it?", "images": [canary_photo]}]
        async with open_client(server.address, name="canary") as c:
            alone = await c.chat(canary_msgs, max_tokens=8, temperature=0).collect()

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(door=st.sampled_from(["openai", "ollama_chat", "ollama_generate", "responses", "msgpack"]),
               urls=st.lists(url, max_size=10), b64s=st.lists(b64, max_size=10), raws=st.lists(
                   st.sampled_from(files), max_size=10), n=many)
        def one(door, urls, b64s, raws, n):
            if door == "openai":
                status, raw = http(base, "/v1/chat/completions", openai_body(urls, "Hi?"))
                check_http("/v1/chat/completions", status, raw)
            elif door == "responses":
                body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi?"}] + [
                    {"type": "input_image", "image_url": u} for u in urls]}], "max_output_tokens": 3}
                status, raw = http(base, "/v1/responses", body)
                check_http("/v1/responses", status, raw)
            elif door == "ollama_chat":
                status, raw = http(base, "/api/chat", {"messages": [{"role": "user", "content": "Hi?", "images": b64s}],
                                                       "stream": False, "options": {"num_predict": 3}})
                check_http("/api/chat", status, raw)
            elif door == "ollama_generate":
                status, raw = http(base, "/api/generate", {"prompt": "Hi?", "images": b64s, "stream": False,
                                                           "raw": n == 7, "options": {"num_predict": 3}})
                check_http("/api/generate", status, raw)
            else:
                frames = msgpack_request(port, "chat", {"messages": [{"role": "user", "content": "Hi?",
                                                                      "images": raws}], "max_tokens": 3})
                assert frames and frames[-1]["type"] in ("done", "error"), frames
                if frames[-1]["type"] == "error":
                    assert frames[-1]["code"] in ("bad_request", "image_too_large", "unsupported_image",
                                                  "frame_too_large"), frames[-1]
            assert status in (200, 400, 413, 415) if door != "msgpack" else True

        async def canary_loop(done):
            answers = []
            async with open_client(server.address, name="canary") as c:
                while not done.is_set():
                    answers.append(await c.chat(canary_msgs, max_tokens=8, temperature=0).collect())
            return answers

        done = trio.Event()
        got = []

        async def run_canary():
            got.extend(await canary_loop(done))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_canary)
            await trio.to_thread.run_sync(one)
            done.set()
        assert got and all(a[0] == alone[0] for a in got), (alone[0], [a[0] for a in got])
        await trio.sleep(0.2)
        a = server.front.engine.allocator.stats()
        assert a["used_blocks"] == 0 and a["num_sequences"] == 0
    gc.collect()
    assert vision_runner.images.stats()["images_held"] == 0
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()], \
        [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR][:5]


async def _greedy(engine, ids, held, n: int) -> list[int]:
    """`n` greedy tokens after the prompt `ids` whose images `held` holds, straight from the engine."""
    from edgepaged.engine import Request, TokenEvent
    from edgepaged.model import SamplingParams
    req = Request(prompt_ids=list(ids), params=SamplingParams(temperature=0, ignore_eos=True, max_tokens=n))
    req.images.held = held
    got = []
    async with engine.stream(req) as events:
        async for ev in events:
            if isinstance(ev, TokenEvent):
                got += ev.token_ids
    return got


async def test_gemma3_from_ollamas_single_file_answers_as_transformers_however_the_prompt_is_cut(tmp_path):
    """Gemma 3 as `ollama pull gemma3:4b` brings it (the tower inside the model's GGUF), found
    by `serve` itself: a photo and a question through the OpenAI door give transformers'
    greedy answer (its image tokens attending both ways), whether the prompt runs in one step
    or in chunks of 8 tokens (the scheduler never cuts an image: its 16 tokens go in one step)."""
    import torch

    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.model.vision import IMAGE
    from edgepaged.request import vision_prompt as vp
    from edgepaged.request.messages import Image as Img
    from edgepaged.server.app import projector_for
    from edgepaged.testing.vision_models import make_gemma3_vlm
    hf, model, mmproj, ollama = make_gemma3_vlm(tmp_path / "g")
    assert projector_for(ollama) == ollama and projector_for(model) == mmproj
    runner = CpuRunner(ollama, num_blocks=256, kv_dtype="f32")
    runner.attach_vision(projector_for(ollama), math="exact")
    photo = _jpeg(320, 240, seed=12)
    url = "data:image/jpeg;base64," + base64.b64encode(photo).decode()
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                      {"type": "image_url", "image_url": {"url": url}}]}],
            "temperature": 0, "max_tokens": 6, "ignore_eos": True}
    messages = [{"role": "user", "content": "What is it?", "images": (Img(url=url),)}]
    held = await vp.prepare_images(messages, runner, vp.ImageLimits())
    ids = vp.render(runner.tokenizer, messages, held, runner.vision)     # (the front end's rendering)
    answers, tokens = [], []
    for budget in (512, 8):
        async with box.serving(runner, http=True, engine={"max_num_batched_tokens": budget}) as server:
            status, _, raw = await afetch(server.http_base + "/v1/chat/completions", body)
            assert status == 200, raw
            answers.append(json.loads(raw)["choices"][0]["message"]["content"])
            tokens.append(await _greedy(server.front.engine, ids, held, 6))
    assert answers[0] == answers[1] and tokens[0] == tokens[1] and len(tokens[0]) == 6
    # transformers on the same ids, the image's rows its image token, teacher-forced with our
    # answer: each of our tokens is its greedy choice (within a near tie's 1e-4)
    first = runner.images.first
    full = [hf.config.image_token_index if t >= first else t for t in ids] + tokens[0]
    types = [int(t >= first) for t in ids] + [0] * len(tokens[0])
    pixels, _ = runner.vision.pixels(Image.open(io.BytesIO(photo)).convert("RGB"))
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([full]), pixel_values=torch.from_numpy(pixels),
                    token_type_ids=torch.tensor([types])).logits[0].numpy()
    for i, t in enumerate(tokens[0]):
        row = logits[len(ids) - 1 + i]
        assert row[t] >= row.max() - 1e-4 * max(1.0, np.abs(row).max()), (i, t, int(row.argmax()))
    assert sum(t == IMAGE for t in runner.vision.prompt_tokens((0, 0), runner.tokenizer)) == 16


async def test_qwen25vl_from_ollamas_single_file_answers_as_transformers_with_its_image_positions(tmp_path):
    """Qwen2.5-VL as `ollama pull qwen2.5vl` brings it (the tower inside the model's GGUF,
    architecture qwen25vl), found by `serve` itself: a photo through Ollama's /api/chat gives
    transformers' greedy answer — the image's rows at their (t, h, w) rotary positions, every
    token after it (the prompt's text and the answer) shifted past the image — whether the
    prompt runs in one step or in chunks of 8 tokens (chunks that end inside the image); the
    conversation resent with the photo runs no encoder and finds the image in the prefix
    cache; every block comes back."""
    import torch

    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.request import vision_prompt as vp
    from edgepaged.request.messages import Image as Img
    from edgepaged.server.app import projector_for
    from edgepaged.testing.vision_models import make_qwen25vl
    hf, model, mmproj, ollama = make_qwen25vl(tmp_path / "q")
    assert projector_for(ollama) == ollama and projector_for(model) == mmproj
    runner = CpuRunner(ollama, num_blocks=256, kv_dtype="f32")
    runner.attach_vision(projector_for(ollama), math="exact")
    photo = _jpeg(300, 200, seed=13)
    b64 = base64.b64encode(photo).decode()
    body = {"model": "ollama-qwen25vl", "stream": False, "options": {"temperature": 0, "num_predict": 8},
            "messages": [{"role": "user", "content": "What is it?", "images": [b64]}]}
    messages = [{"role": "user", "content": "What is it?", "images": (Img(url="data:image/jpeg;base64," + b64),)}]
    held = await vp.prepare_images(messages, runner, vp.ImageLimits())
    ids = vp.render(runner.tokenizer, messages, held, runner.vision)     # (the front end's rendering)
    first = runner.images.first
    assert sum(t >= first for t in ids) == 7 * 11           # 196 x 308 px: 7 x 11 feature rows
    answers, tokens = [], []
    for budget in (512, 8):
        async with box.serving(runner, http=True, engine={"max_num_batched_tokens": budget}) as server:
            status, _, raw = await afetch(server.http_base + "/api/chat", body)
            assert status == 200, raw
            answers.append(json.loads(raw)["message"]["content"])
            tokens.append(await _greedy(server.front.engine, ids, held, 8))
            if budget == 512:        # a photo 200 times as long as wide: a 400 naming it, nothing run
                strip = io.BytesIO()
                Image.new("RGB", (2100, 10), (90, 90, 90)).save(strip, "PNG")
                bad = {**body, "messages": [{"role": "user", "content": "And this?",
                                             "images": [base64.b64encode(strip.getvalue()).decode()]}]}
                status, _, raw = await afetch(server.http_base + "/api/chat", bad)
                assert status == 400 and b"210 times as long as it is wide" in raw, raw
                # the second turn: the conversation resent, photo included
                encoded = runner.images.stats()["images_encoded"]
                again = {**body, "messages": body["messages"] + [
                    {"role": "assistant", "content": answers[0]}, {"role": "user", "content": "And the colours?"}]}
                status, _, raw = await afetch(server.http_base + "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": [
                        {"type": "text", "text": "What is it?"},
                        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + b64}}]},
                        *again["messages"][1:]], "temperature": 0, "max_tokens": 4})
                assert status == 200, raw
                assert runner.images.stats()["images_encoded"] == encoded
                assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] >= \
                    (len(ids) - 1) // 16 * 16
            await trio.sleep(0.1)
            a = server.front.engine.allocator.stats()
            assert a["used_blocks"] == 0 and a["num_sequences"] == 0
    assert answers[0] == answers[1] and tokens[0] == tokens[1] and len(tokens[0]) == 8
    # transformers on the same ids (the image's rows its image token) teacher-forced with our
    # answer: each of our tokens is its greedy choice (within a near tie's 1e-4)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    full = [hf.config.image_token_id if t >= first else t for t in ids] + tokens[0]
    px = Qwen2VLImageProcessorPil()(images=[Image.open(io.BytesIO(photo)).convert("RGB")], return_tensors="np")
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([full]), pixel_values=torch.from_numpy(px["pixel_values"]),
                    image_grid_thw=torch.from_numpy(px["image_grid_thw"]),
                    mm_token_type_ids=torch.tensor([[int(t >= first) for t in ids] + [0] * len(tokens[0])])
                    ).logits[0].numpy()
    for i, t in enumerate(tokens[0]):
        row = logits[len(ids) - 1 + i]
        assert row[t] >= row.max() - 1e-4 * max(1.0, np.abs(row).max()), (i, t, int(row.argmax()))
