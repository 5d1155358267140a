"""The HTTP side (OpenAI-compatible API, metrics, health, the chat page) with the real embedded
model on loopback, in process: the official `openai` package and plain urllib as clients."""
import json
import re
import urllib.error
import urllib.request
from contextlib import asynccontextmanager

import pytest
import trio

from edgepaged.server.httpd import HttpConfig
from edgepaged.server.tcp import ServerConfig
from edgepaged.testing import serving as box

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a very long story about a dragon who learns to cook."}]


@asynccontextmanager
async def serving(runner, http_config=None, **config):
    """The box with its HTTP port; yields the HttpServer (`.base` is its URL)."""
    async with box.serving(runner, http=http_config or True, **config) as server:
        server.http.msgpack_port = server.port
        yield server.http


def fetch(url, body=None, headers=None, method=None, timeout=60):
    """(status, headers, body bytes), errors included."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


async def afetch(*args, **kwargs):
    return await trio.to_thread.run_sync(lambda: fetch(*args, **kwargs))


async def until_idle(engine, timeout=10) -> dict:
    with trio.fail_after(timeout):
        while True:
            s = engine.stats()
            if s["num_requests_running"] == s["num_requests_waiting"] == s["kv_blocks_used"] == 0:
                return s
            await trio.sleep(0.02)


async def test_the_openai_package_streams_paris_and_counts_usage(embedded_runner):
    import openai

    async with serving(embedded_runner) as http:
        tok = http.engine.tokenizer
        prompt_tokens = len(tok.apply_chat_template(FRANCE))

        def scenario():
            client = openai.OpenAI(base_url=http.base + "/v1", api_key="unused", max_retries=0, timeout=60)
            models = client.models.list()
            model = models.data[0].id
            stream = client.chat.completions.create(model=model, messages=FRANCE, stream=True, max_tokens=16,
                                                    temperature=0, stream_options={"include_usage": True})
            chunks = list(stream)
            full = client.chat.completions.create(model=model, messages=FRANCE, max_tokens=5, temperature=0)
            seeded = [client.chat.completions.create(model=model, messages=FRANCE, max_tokens=6, temperature=1.0,
                                                     seed=7).choices[0].message.content for _ in range(2)]
            stopped = client.chat.completions.create(model=model, messages=FRANCE, max_tokens=16, temperature=0,
                                                     stop=["Paris"])
            text = client.completions.create(model=model, prompt="The capital of Italy is", max_tokens=4,
                                             temperature=0)
            try:
                client.chat.completions.create(model=model, messages=FRANCE, n=9)
                refused = None
            except openai.BadRequestError as e:
                refused = e
            return model, chunks, full, seeded, stopped, text, refused

        model, chunks, full, seeded, stopped, text, refused = await trio.to_thread.run_sync(scenario)

    assert model == "SmolLM2-135M-Instruct.Q4_1"
    # streamed: role first, text deltas, a finish reason, then the usage chunk
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in streamed, streamed
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 3   # it really streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == prompt_tokens
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    # not streamed: exact usage
    assert full.object == "chat.completion" and full.model == model
    assert full.choices[0].finish_reason == "length" and full.choices[0].message.role == "assistant"
    assert full.usage.prompt_tokens == prompt_tokens and full.usage.completion_tokens == 5
    assert full.usage.total_tokens == prompt_tokens + 5
    assert full.choices[0].message.content and streamed.startswith(full.choices[0].message.content)
    assert seeded[0] == seeded[1]
    assert stopped.choices[0].finish_reason == "stop" and "Paris" not in stopped.choices[0].message.content
    assert text.object == "text_completion" and text.usage.completion_tokens == 4 and text.choices[0].text
    assert refused is not None and refused.status_code == 400
    assert refused.body["param"] == "n" and refused.body["type"] == "invalid_request_error"


async def test_metrics_health_stats_and_error_bodies(embedded_runner):
    from prometheus_client.parser import text_string_to_metric_families

    async with serving(embedded_runner, max_tokens=64) as http:
        base = http.base
        status, _, body = await afetch(base + "/v1/chat/completions", {"messages": FRANCE, "max_tokens": 3})
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3

        status, headers, body = await afetch(base + "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        families = {f.name: f for f in text_string_to_metric_families(body.decode())}
        assert "edgepaged:kv_blocks_used" in families and "edgepaged:time_to_first_token_seconds" in families
        gen = next(s for s in families["edgepaged:generation_tokens"].samples if s.name.endswith("_total"))
        assert gen.value >= 3 and gen.labels["model_name"]
        used = families["edgepaged:kv_blocks_used"].samples[0]
        assert used.value == 0

        status, _, body = await afetch(base + "/health")
        assert status == 200 and json.loads(body)["status"] == "ok"
        status, _, body = await afetch(base + "/stats")
        stats = json.loads(body)
        assert status == 200 and stats["kv_blocks_used"] == 0 and stats["finished"]["length"] >= 1
        assert stats["http"]["requests_inflight"] == 0

        async def error(path, body=None, method=None, want=400):
            status, headers, raw = await afetch(base + path, body, method=method)
            assert status == want, (path, status, raw)
            assert headers["Content-Type"] == "application/json"
            err = json.loads(raw)["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
            return err

        assert (await error("/v1/chat/completions", b"{not json"))["code"] == "bad_request"
        assert (await error("/v1/chat/completions", {"messages": "hi"}))["param"] == "messages"
        assert (await error("/v1/chat/completions", {"messages": [{"role": "function", "content": "x"}]}))["param"] \
            == "messages[0].role"
        assert (await error("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 100}))["code"] \
            == "invalid_params"
        assert (await error("/v1/chat/completions", {"messages": FRANCE, "temperature": -1}))["code"] \
            == "invalid_params"
        assert (await error("/v1/chat/completions", {"messages": FRANCE, "tools": [{"type": "function"}]}))["param"] \
            == "tools"
        assert (await error("/v1/completions", {"prompt": ["a", "b"]}))["param"] == "prompt"
        # a body over the limit is refused from its Content-Length, never kept (here it never comes)
        s = await trio.open_tcp_stream("127.0.0.1", http.port)
        await s.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 2000000\r\n\r\n")
        reply = b""
        with trio.fail_after(10):
            while b"}}" not in reply:
                reply += await s.receive_some(65536)
        await s.aclose()
        assert reply.startswith(b"HTTP/1.1 413") and b'"frame_too_large"' in reply
        # a client that sends the whole body before it reads (urllib, requests) hears the 413
        # too: the server reads and drops the rest (it closed the connection unread, and the
        # client saw only a broken pipe); past DROP_BYTES it still closes
        for size in (1_100_000, 12_000_000):
            assert (await error("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * size}]},
                                want=413))["code"] == "frame_too_large"
        assert (await error("/v1/nothing", want=404))["type"] == "not_found_error"
        assert (await error("/v1/chat/completions", method="GET", want=405))["code"] == "method_not_allowed"
        assert (await error("/v1/models/gpt-4", want=404))["code"] == "model_not_found"
        await until_idle(http.engine)


async def test_bearer_token(embedded_runner):
    async with serving(embedded_runner, token="s3cret") as http:
        base = http.base
        ask = {"messages": FRANCE, "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            for path, body in (("/v1/chat/completions", ask), ("/v1/models", None), ("/metrics", None),
                               ("/stats", None)):
                status, h, raw = await afetch(base + path, body, headers=headers)
                assert status == 401 and h["WWW-Authenticate"] == "Bearer", (path, headers)
                assert json.loads(raw)["error"]["type"] == "authentication_error"
        good = {"Authorization": "Bearer s3cret"}
        assert (await afetch(base + "/v1/chat/completions", ask, headers=good))[0] == 200
        assert (await afetch(base + "/metrics", headers=good))[0] == 200
        assert (await afetch(base + "/health"))[0] == 200     # liveness and the page stay open
        assert (await afetch(base + "/"))[0] == 200


async def test_a_client_that_disconnects_mid_answer_frees_its_blocks(embedded_runner):
    async with serving(embedded_runner, http_config=HttpConfig(port=0, max_inflight=1)) as http:
        engine = http.engine

        async def post(body: dict) -> trio.SocketStream:
            s = await trio.open_tcp_stream("127.0.0.1", http.port)
            data = json.dumps(body).encode()
            await s.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(data) + data)
            return s

        # streamed: read a few events, then hang up
        s = await post({"messages": STORY, "max_tokens": 400, "temperature": 0, "stream": True})
        seen = b""
        with trio.fail_after(60):
            while seen.count(b"data: ") < 4:
                seen += await s.receive_some(65536)
        assert seen.startswith(b"HTTP/1.1 200") and b"text/event-stream" in seen
        assert engine.stats()["kv_blocks_used"] > 0
        status, _, raw = await afetch(http.base + "/v1/chat/completions", {"messages": FRANCE, "max_tokens": 2})
        assert status == 429 and json.loads(raw)["error"]["type"] == "rate_limit_error"   # max_inflight=1
        await s.aclose()
        stats = await until_idle(engine)
        assert stats["finished"]["cancelled"] == 1

        # not streamed: hang up while it is generating
        s = await post({"messages": STORY, "max_tokens": 400, "temperature": 0})
        with trio.fail_after(30):
            while engine.stats()["num_requests_running"] == 0:
                await trio.sleep(0.01)
        await trio.sleep(0.3)
        await s.aclose()
        stats = await until_idle(engine)
        assert stats["finished"]["cancelled"] == 2 and stats["generation_tokens"] < 2 * 400
        assert http.inflight == 0


async def test_the_chat_page_loads_nothing_from_outside(embedded_runner):
    async with serving(embedded_runner) as http:
        status, headers, raw = await afetch(http.base + "/")
    page = raw.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    csp = headers["Content-Security-Policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    # no URL with a scheme or protocol-relative URL anywhere: no CDN, no font, no image from elsewhere
    assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", page, re.I), re.findall(r"\S*//\S+", page)
    assert 'name="viewport"' in page and "v1/chat/completions" in page and '"stats"' in page
    assert len(raw) < 32_000


async def test_without_the_page(embedded_runner):
    async with serving(embedded_runner, http_config=HttpConfig(port=0, page=False)) as http:
        status, _, raw = await afetch(http.base + "/")
    assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
     "only text parts"),
    ({"messages": FRANCE, "presence_penalty": "high"}, "presence_penalty must be a number"),
    ({"messages": FRANCE, "stream": "yes"}, "stream must be a boolean"),
    ({"messages": FRANCE, "logprobs": 3}, "logprobs must be a boolean"),
    ({"messages": FRANCE, "n": 9}, "n must be an integer in 1..8"),
])
def test_refused_fields_name_themselves(body, message):
    from edgepaged.server.doors.openai import ApiError, parse_chat
    with pytest.raises(ApiError) as e:
        parse_chat(body, "chatcmpl-x")
    assert message in e.value.message and e.value.status == 400


def test_chat_body_becomes_a_protocol_request():
    from edgepaged.server.doors.openai import parse_chat, parse_completion
    gen = parse_chat({"model": "anything", "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
        "max_completion_tokens": 9, "max_tokens": 100, "stop": "\n", "seed": 3, "top_p": 0.5, "user": "kitchen",
        "stream": True, "stream_options": {"include_usage": True}, "response_format": {"type": "text"},
        "some_future_field": 1}, "chatcmpl-1")
    assert gen.item.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
    assert gen.item.max_tokens == 9 and gen.item.sampling == {"stop": ["\n"], "seed": 3, "top_p": 0.5}
    assert gen.stream and gen.include_usage and gen.user == "kitchen" and gen.chat
    gen = parse_completion({"prompt": ["Once"]}, "cmpl-1")
    assert gen.item.prompt == "Once" and gen.item.max_tokens == 16 and not gen.stream and not gen.chat


async def test_serve_runs_http_beside_tcp_and_ends_its_answers_at_shutdown(embedded_runner):
    """app.run (what `edgepaged serve` runs): HTTP on its own port; SIGTERM ends a streaming
    answer with a `shutdown` error event, then [DONE]; while the server drains, /health says
    503 and new requests get 503; then the HTTP port closes."""
    import os
    import signal

    from edgepaged.server.app import AppConfig, run

    lines = []
    cfg = AppConfig(server=ServerConfig(host="127.0.0.1", port=0), http=HttpConfig(port=0), mdns=False, grace_s=1.5)
    async with trio.open_nursery() as nursery:
        result = {}

        async def serve():
            result["cancelled"] = await run(embedded_runner, cfg, say=lines.append)
        nursery.start_soon(serve)
        with trio.fail_after(30):
            while not any("ready on" in x for x in lines):
                await trio.sleep(0.01)
        base = re.search(r"HTTP \(OpenAI API, chat page\) (http://127\.0\.0\.1:\d+)/", lines[0]).group(1)
        started = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def stream_story():
            req = urllib.request.Request(base + "/v1/chat/completions", method="POST", data=json.dumps(
                {"messages": STORY, "max_tokens": 400, "temperature": 0, "stream": True}).encode(),
                headers={"Content-Type": "application/json"})
            events = []
            with urllib.request.urlopen(req, timeout=60) as r:
                for line in r:
                    if line.startswith(b"data: "):
                        events.append(line[6:].strip())
                        if len(events) == 3:
                            token.run_sync_soon(started.set)
            return events

        async def client():
            result["events"] = await trio.to_thread.run_sync(stream_story)
        nursery.start_soon(client)
        with trio.fail_after(60):
            await started.wait()
        os.kill(os.getpid(), signal.SIGTERM)
        with trio.fail_after(10):
            while not any("SIGTERM: stopping" in x for x in lines):
                await trio.sleep(0.01)
        status, _, body = await afetch(base + "/health")      # draining: still answering, with 503
        assert status == 503 and json.loads(body)["status"] == "shutting_down"
        status, _, body = await afetch(base + "/v1/chat/completions", {"messages": FRANCE, "max_tokens": 2})
        assert status == 503 and json.loads(body)["error"]["code"] == "shutdown"
    events = result["events"]
    assert events[-1] == b"[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "shutdown", events[-3:]
    assert result["cancelled"] == 1 and any("SIGTERM: stopping" in x for x in lines)
    with pytest.raises(urllib.error.URLError, match="refused"):   # the HTTP port is closed
        await afetch(base + "/health")


async def test_per_user_tokens_share_one_identity_across_tcp_and_http(embedded_runner):
    from edgepaged.client import open_client

    letter = ("Dear neighbours, the garden party moves to Sunday because of the rain. " * 40).strip()
    async with serving(embedded_runner, users={"tok-anna": "anna", "tok-jonas": "jonas"}) as http:
        async with open_client(f"127.0.0.1:{http.msgpack_port}", token="tok-anna") as c:   # msgpack first
            await c.generate(letter, max_tokens=1).collect()

        async def cached(token):
            status, _, raw = await afetch(http.base + "/v1/completions", {"prompt": letter, "max_tokens": 1},
                                          headers={"Authorization": f"Bearer {token}"})
            assert status == 200, raw
            return json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert await cached("tok-anna") > 500      # anna's own cache, whichever door she came in by
        assert await cached("tok-jonas") == 0      # not jonas's
        status, _, _ = await afetch(http.base + "/v1/models", headers={"Authorization": "Bearer tok-nobody"})
        assert status == 401
