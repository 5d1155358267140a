"""No request can take the box down (docs/SECURITY.md, "Attacks and the tests that cover
them"): grammars deep or large enough to overflow the compiler's stack or to freeze the event
loop are refused or compiled out of harm's way; a fault raised on behalf of one request ends
that request only; a model is held by the requests it accepted; the msgpack reader keeps
reading while a request is built; cache identities cannot be borrowed; /health tells nobody
else's figures; what one request may cost is bounded; and the small ones. Each test failed
on the code before these fixes (most by killing or freezing the server)."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import trio

from edgepaged.engine import Engine, EngineConfig, Request
from edgepaged.model import SamplingParams
from edgepaged.constrain.grammar import COMPILER, GrammarLimits, GrammarRefused, Grammars, check_limits
from edgepaged.testing.serving import serving

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
JSON = {"Content-Type": "application/json"}


async def afetch(url, body=None, headers=None, method=None, timeout=120):
    def go():
        data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
        req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"),
                                     headers={**JSON, **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
    return await trio.to_thread.run_sync(go)


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "$defs": defs}


def rule_chain(n: int) -> str:
    return "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(n)) + f'r{n}: "x"\n'


def nested(key: str, n: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(n):
        s = {key: [s]} if key in ("anyOf", "allOf", "oneOf") else {key: s}
    return s


async def alive(server) -> None:
    """The box still answers a plain question, on both ports."""
    status, raw = await afetch(server.http_base + "/v1/chat/completions",
                               {"messages": FRANCE, "max_tokens": 12, "temperature": 0})
    assert status == 200 and "Paris" in json.loads(raw)["choices"][0]["message"]["content"]
    from edgepaged.client import open_client
    async with open_client(server.address) as c:
        text, done = await c.chat(FRANCE, max_tokens=12, temperature=0).collect()
    assert "Paris" in text


# ---------------------------------------------------------------- 1: deep grammars

def test_every_deep_shape_is_measured_and_refused_before_it_compiles():
    limits = GrammarLimits(max_depth=128)
    deep = [{"type": "json_schema", "schema": ref_chain(3000)},
            {"type": "lark", "grammar": rule_chain(4000)},
            {"type": "lark", "grammar": "start: r0\n" + "".join(f'r{i}: "a" | r{i + 1}\n' for i in range(500))
             + 'r500: "x"\n'},                                                    # alternations that chain
            {"type": "lark", "grammar": "start: " + "(" * 300 + '"x"' + ")" * 300 + "\n"},
            {"type": "lark", "grammar": "start: X\nX: /" + "(" * 300 + "a" + ")" * 300 + "/\n"},
            {"type": "lark", "grammar": "start: j\nj: %json " + json.dumps(ref_chain(400)) + "\n"},
            {"type": "regex", "pattern": "(" * 300 + "a" + ")" * 300}]
    deep += [{"type": "json_schema", "schema": nested(k, 200)} for k in ("anyOf", "allOf", "oneOf", "items", "not")]
    for spec in deep:
        with pytest.raises(GrammarRefused, match="depth limit"):
            check_limits(spec, limits)
    # what real software sends passes
    for spec in [{"type": "json_schema", "schema": ref_chain(20)}, {"type": "lark", "grammar": rule_chain(50)},
                 {"type": "regex", "pattern": r"\d{3}-(\d{4}|x)"}, {"type": "json_object"},
                 {"type": "json_schema", "schema": nested("anyOf", 20)}]:
        check_limits(spec, limits)
    with pytest.raises(GrammarRefused, match="size limit"):
        check_limits({"type": "lark", "grammar": 'start: "' + "x" * 300_000 + '"'}, limits)


def test_the_compiler_runs_on_a_stack_an_overflow_would_need_far_more_of(embedded_runner):
    """With the depth check off, a 6,000-rule chain (which overflows a default 8 MiB thread
    stack and kills the process) compiles on the compiler's thread: the stack is sized so the
    allowed depth is a small fraction of what it holds. A subprocess shows the default stack
    dying on the same grammar."""
    from llguidance import LLMatcher
    g = Grammars(embedded_runner.tokenizer, embedded_runner.config.vocab_size, GrammarLimits(max_depth=10**9))
    assert g.compile({"type": "lark", "grammar": rule_chain(6000)})
    assert COMPILER.STACK_BYTES >= 32 * (8 << 20)
    code = ("import threading, sys; from llguidance import LLMatcher\n"
            f"g = LLMatcher.grammar_from_lark({rule_chain(6000)!r})\n"
            "t = threading.Thread(target=lambda: LLMatcher.validate_grammar_with_warnings(g)); t.start(); t.join()\n"
            "print('survived')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "survived" not in out.stdout     # what the server no longer risks
    assert LLMatcher   # (imported here: the same library the server uses)


async def test_deep_grammars_on_every_door_are_a_400_and_the_box_lives(embedded_runner):
    async with serving(embedded_runner, http=True) as server:
        base = server.http_base
        bodies = [
            ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 4, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(3000)}}}),
            ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 4, "guided_json": ref_chain(3000)}),
            ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 4, "guided_grammar": rule_chain(4000)}),
            ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 4, "guided_regex": "(" * 400 + "a" + ")" * 400}),
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "guided_grammar": rule_chain(4000)}),
            ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 4, "tool_choice": "required", "tools": [
                {"type": "function", "function": {"name": "f", "parameters": ref_chain(3000)}}]}),
            ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 4, "tools": [
                {"type": "function", "function": {"name": "f", "parameters": ref_chain(3000)}}]}),
            ("/api/chat", {"model": server.front.model, "messages": FRANCE, "stream": False,
                           "format": ref_chain(3000)}),
            ("/api/generate", {"model": server.front.model, "prompt": "Hi", "stream": False,
                               "format": ref_chain(3000)}),
        ]
        for path, body in bodies:
            assert len(json.dumps(body)) > 800 if "guided_regex" in body else len(json.dumps(body)) > 40_000
            status, raw = await afetch(base + path, body)
            assert status == 400, (path, raw[:300])
            assert b"depth limit" in raw, (path, raw[:300])
        from test_server import Raw
        raw = await Raw.open(server)
        reply = await raw.ask({"type": "chat", "id": 1, "messages": FRANCE, "max_tokens": 4,
                               "format": {"type": "lark", "grammar": rule_chain(4000)}})
        assert reply["type"] == "error" and reply["code"] == "invalid_params" and "depth limit" in reply["message"]
        await alive(server)
        assert server.engine.stats()["kv_blocks_used"] == 0


# ---------------------------------------------------------------- 2: large grammars, never on the event loop

def wide_schema(n: int) -> dict:
    return {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(n)}}


async def test_a_large_grammar_with_n_8_never_stalls_health(embedded_runner):
    """A schema of 3,000 optional properties with n=8: every matcher is built off the event
    loop (it took ~35 s on the loop before), /health answers throughout, the second request
    with the same schema comes from the cache, and a plain request answers beside it."""
    async with serving(embedded_runner, http=True) as server:
        base = server.http_base
        body = {"messages": FRANCE, "max_tokens": 3, "n": 8, "temperature": 0.7, "response_format": {
            "type": "json_schema", "json_schema": {"name": "wide", "schema": wide_schema(3000)}}}
        worst, done = [0.0], trio.Event()

        async def poll():
            while not done.is_set():
                t = time.monotonic()
                status, _ = await afetch(base + "/health")
                worst[0] = max(worst[0], time.monotonic() - t)
                assert status == 200
                await trio.sleep(0.02)

        async with trio.open_nursery() as n:
            n.start_soon(poll)
            t0 = time.monotonic()
            status, raw = await afetch(base + "/v1/chat/completions", body)
            first = time.monotonic() - t0
            assert status in (200, 400), raw[:300]
            t0 = time.monotonic()
            status2, _ = await afetch(base + "/v1/chat/completions", body)
            second = time.monotonic() - t0
            assert status2 == status
            done.set()
        assert worst[0] < 1.0, worst       # (the benchmark measures it: bench/RESULTS.md)
        if status == 200:
            assert len(json.loads(raw)["choices"]) == 8
        assert second < first + 1.0
        assert any(k.startswith("{") for k in server.front.grammars._cache)      # cached by its text
        await alive(server)


async def test_the_compile_time_budget_is_a_400_and_remembered(embedded_runner):
    async with serving(embedded_runner, http=True, grammar=GrammarLimits(compile_timeout_s=0.2)) as server:
        body = {"messages": FRANCE, "max_tokens": 3, "guided_json": wide_schema(5000)}
        status, raw = await afetch(server.http_base + "/v1/chat/completions", body)
        assert status == 400 and b"compile-time limit" in raw, raw[:300]
        await trio.sleep(3)                      # the compile finishes in its thread; it is remembered
        t0 = time.monotonic()
        status, raw = await afetch(server.http_base + "/v1/chat/completions", body)
        assert status == 400 and b"compile-time limit" in raw and time.monotonic() - t0 < 1.0
        await alive(server)


# (a full compiler's "busy" and a stranger's large formats: tests/test_starvation.py, item 3)


# ---------------------------------------------------------------- 3: faults outside the forward

async def test_contiguous_parallel_samples_across_block_boundaries():
    """--contiguous with n > 1 on a tight pool: forked samples share the parent's reserved
    blocks, so every block a sample writes into is shared until it copies it. The scheduler
    asks the allocator what a write needs (its own arithmetic counted the last block only,
    so the plan underestimated at a block boundary and NoFreeBlocksError killed the engine)."""
    from edgepaged.model import ModelRunner
    runner = ModelRunner(num_blocks=9)          # 9 blocks of 16: the reservation takes 5, the tails' copies 3
    async with Engine(runner, EngineConfig(contiguous=True, max_num_seqs=8)) as eng:
        ids = runner.tokenizer.apply_chat_template(FRANCE)
        assert 32 < len(ids) < 48
        params = dict(temperature=1.0, max_tokens=40, ignore_eos=True)
        parent = Request(prompt_ids=ids, params=SamplingParams(seed=1, **params))
        parent.children = [Request(prompt_ids=ids, params=SamplingParams(seed=1 + k, **params), fork_of=parent)
                           for k in range(1, 4)]
        reasons = {}
        with trio.fail_after(120):
            async with eng.stream_samples(parent) as events:
                async for k, ev in events:
                    if hasattr(ev, "finish_reason"):
                        reasons[k] = (ev.finish_reason, ev.usage["completion_tokens"])
        assert reasons == {k: ("length", 40) for k in range(4)}, reasons
        assert eng.allocator.num_used_blocks == 0
        eng.allocator.check_invariants()


async def test_a_fault_raised_for_one_request_ends_that_request_only(embedded_runner, caplog):
    """Faults outside the model step: a token's processing (here the lazy tool grammar) and
    the step's planning (the allocator refusing a plan) end the requests concerned with an
    error frame, every block comes back, and the engine goes on serving."""
    from edgepaged.engine import scheduler as sch

    class Exploding:
        def feed(self, token):
            raise RuntimeError("boom in the lazy grammar")

    async with Engine(embedded_runner, EngineConfig()) as eng:
        tok = embedded_runner.tokenizer
        ids = tok.apply_chat_template(FRANCE)

        async def run(req):
            async with eng.stream(req) as events:
                async for ev in events:
                    if hasattr(ev, "finish_reason"):
                        return ev

        bad = Request(prompt_ids=ids, params=SamplingParams(temperature=0, max_tokens=8))
        bad.constraint.lazy = Exploding()
        good = Request(prompt_ids=ids, params=SamplingParams(temperature=0, max_tokens=8))
        results = {}

        async def keep(name, req):
            results[name] = await run(req)
        async with trio.open_nursery() as n:
            n.start_soon(keep, "bad", bad)
            n.start_soon(keep, "good", good)
        assert results["bad"].finish_reason == "error" and "boom" not in results["bad"].error["message"]
        assert results["good"].finish_reason in ("stop", "length")
        # the planning: the allocator refuses one step's plan
        real = sch.Scheduler._build
        calls = [0]

        def once(self, step):
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("the allocator said no")
            return real(self, step)
        sch.Scheduler._build = once
        try:
            victim = await run(Request(prompt_ids=ids, params=SamplingParams(temperature=0, max_tokens=4)))
        finally:
            sch.Scheduler._build = real
        assert victim.finish_reason == "error" and victim.error["code"] == "internal_error"
        after = await run(Request(prompt_ids=ids, params=SamplingParams(temperature=0, max_tokens=4)))
        assert after.finish_reason in ("stop", "length")
        assert eng.allocator.num_used_blocks == 0
    assert not any(r.exc_info for r in caplog.records if r.levelno >= logging.INFO)   # one line each, no traceback


async def test_a_tool_schema_the_grammar_library_rejects_is_refused_before_it_runs(tmp_path):
    """Auto tool choice on a template that takes tools: the call grammar is compiled with the
    request (it was compiled inside the engine loop when the model started a call, where a
    rejected schema killed the engine)."""
    from edgepaged.model import ModelRunner
    from edgepaged.testing.families import make_family_model, write_family_gguf
    hf = make_family_model(tmp_path / "q", "qwen3", seed=2)
    runner = ModelRunner(write_family_gguf(tmp_path / "q", tmp_path / "q.gguf", hf, qtype=8), num_blocks=64)
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}]
    async with serving(runner, http=True) as server:
        status, raw = await afetch(server.http_base + "/v1/chat/completions",
                                   {"messages": FRANCE, "max_tokens": 8, "tools": bad_tool})
        assert status == 400 and json.loads(raw)["error"]["code"] == "invalid_params", raw[:300]
        status, raw = await afetch(server.http_base + "/v1/chat/completions",
                                   {"messages": FRANCE, "max_tokens": 8, "temperature": 0})
        assert status == 200
        assert server.engine.stats()["kv_blocks_used"] == 0


# ---------------------------------------------------------------- 4: a model held while its request is built

async def test_a_request_holds_its_model_while_it_is_built(embedded_runner):
    from edgepaged.request.frontend import FrontEnd
    from edgepaged.model import ModelRunner
    from edgepaged.model.loader import default_model_path
    from edgepaged.box.models import ModelSet, ModelSpec, MultiFront
    from edgepaged.request.protocol import GenerateRequest
    path = default_model_path()
    size = path.stat().st_size
    specs = [ModelSpec(n, str(path), size, 8192, "llama", "Q4_1") for n in ("house", "kitchen")]
    models = ModelSet(specs, lambda spec, kv: ModelRunner(spec.path, num_blocks=64), budget_bytes=size + (96 << 20),
                      kv_bytes=64 << 20)       # room for one model at a time
    release = trio.Event()
    real_build = FrontEnd.build

    async def slow_build(self, item, caller):
        if item.model == "house":
            await release.wait()
        return await real_build(self, item, caller)

    front = MultiFront(models)
    caller = front.caller(None, None, "127.0.0.1")
    FrontEnd.build = slow_build
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(models.run)
            out = {}

            async def ask(name):
                item = GenerateRequest(id=1, kind="chat", messages=FRANCE, max_tokens=8, sampling={"temperature": 0},
                                       model=name)
                try:
                    req = (await front.build(item, caller)).req
                    async with front.engine.stream(req) as events:
                        async for ev in events:
                            if hasattr(ev, "finish_reason"):
                                out[name] = ev.finish_reason
                except Exception as e:
                    out[name] = getattr(e, "code", repr(e))
            async with trio.open_nursery() as n:
                n.start_soon(ask, "house")
                await trio.sleep(0.5)              # house is loaded, its request still being built
                await ask("kitchen")               # needs house's memory
                release.set()
            await models.drain(1)
            nursery.cancel_scope.cancel()
    finally:
        FrontEnd.build = real_build
    assert out == {"house": "stop", "kitchen": "model_unavailable"}, out


# ---------------------------------------------------------------- 5: the reader reads while a request is built

async def test_a_slow_build_does_not_hold_up_the_connections_cancels(embedded_runner):
    from edgepaged.request.frontend import FrontEnd
    from test_server import Raw
    release = trio.Event()
    real_build = FrontEnd.build

    async def slow_build(self, item, caller):
        if item.id == "slow":
            await release.wait()
        return await real_build(self, item, caller)

    FrontEnd.build = slow_build
    try:
        async with serving(embedded_runner) as server:
            raw = await Raw.open(server)
            await raw.send({"type": "chat", "id": "long", "messages": STORY, "max_tokens": 200, "ignore_eos": True})
            while (await raw.read())["type"] != "token":
                pass
            await raw.send({"type": "chat", "id": "slow", "messages": FRANCE, "max_tokens": 4})
            await raw.send({"type": "cancel", "id": "long"})
            with trio.fail_after(10):
                while True:
                    m = await raw.read()
                    if m["type"] == "done" and m["id"] == "long":
                        break
            assert m["finish_reason"] == "cancelled" and m["usage"]["completion_tokens"] < 200
            await raw.send({"type": "cancel", "id": "slow"})      # cancelled while it is built
            m = await raw.read()
            assert m["type"] == "done" and m["id"] == "slow" and m["finish_reason"] == "cancelled", m
            release.set()
            await trio.sleep(0.5)                          # (blocks come back after the step in flight)
            assert server.engine.stats()["kv_blocks_used"] == 0
    finally:
        FrontEnd.build = real_build


# ---------------------------------------------------------------- 6, 7: identities, /health

async def test_a_client_name_cannot_borrow_an_address_cache(embedded_runner):
    async with serving(embedded_runner, http=True) as server:
        url = server.http_base + "/v1/chat/completions"
        secret = [{"role": "user", "content": "My bank PIN is 4921 and my door code is 7788. " * 4}]
        status, raw = await afetch(url, {"messages": secret, "max_tokens": 1})
        assert status == 200
        status, raw = await afetch(url, {"messages": secret, "max_tokens": 1})        # the victim itself: a hit
        assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        status, raw = await afetch(url, {"messages": secret, "max_tokens": 1, "user": "127.0.0.1"})
        assert json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_health_tells_figures_only_to_those_who_may_see_them(embedded_runner, tmp_path):
    from edgepaged.request.frontend import load_users
    (tmp_path / "users").write_text("anna tok-anna admin\njonas tok-jonas\n")
    async with serving(embedded_runner, http=True, users=load_users(tmp_path / "users")) as server:
        base = server.http_base
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer tok-jonas"}):
            status, raw = await afetch(base + "/health", headers=headers)
            body = json.loads(raw)
            assert status == 200 and body["status"] == "ok" and "memory" not in body, (headers, body)
            assert "rss" not in raw.decode() and "kv_used" not in raw.decode()
        status, raw = await afetch(base + "/health", headers={"Authorization": "Bearer tok-anna"})
        assert "kv_used_bytes" in json.loads(raw)["memory"]
    async with serving(embedded_runner, http=True, token="s3cret") as server:
        status, raw = await afetch(server.http_base + "/health")
        assert status == 200 and "memory" not in json.loads(raw)


# ---------------------------------------------------------------- 8: bounded cost per request and identity

async def test_what_one_request_and_one_identity_may_cost_is_bounded(embedded_runner):
    async with serving(embedded_runner, http=True, max_request_tokens=4096, max_identity_tokens=600,
                       engine={"context_policy": "window"}) as server:
        url = server.http_base + "/v1/chat/completions"
        status, raw = await afetch(url, {"messages": FRANCE, "max_tokens": 1 << 20})
        assert status == 400 and b"max_tokens" in raw
        status, raw = await afetch(url, {"messages": FRANCE, "max_tokens": 1000, "n": 8})
        assert status == 400 and b"--max-request-tokens" in raw
        from edgepaged.client import ServerError, open_client
        async with open_client(server.address) as c:
            long = c.chat(STORY, max_tokens=500, ignore_eos=True)
            await long.__anext__()                   # in flight: 500 of this address's 600
            with pytest.raises(ServerError) as e:
                await c.chat(FRANCE, max_tokens=200).collect()
            assert e.value.code == "too_many_requests" and "--max-identity-tokens" in str(e.value)
            status, raw = await afetch(url, {"messages": FRANCE, "max_tokens": 200, "user": "someone-else"})
            assert status == 200                     # another identity is not held back
            await long.cancel()
    rope_cap = 65536 + 8192
    assert server.front.max_tokens <= rope_cap


# ---------------------------------------------------------------- 9, 10, 11: the small ones

async def test_tiny_temperatures_are_greedy_and_penalties_are_bounded(embedded_runner):
    async with serving(embedded_runner, http=True) as server:
        url = server.http_base + "/v1/chat/completions"
        answers = []
        for t in (0, 5e-324, 1e-40):
            status, raw = await afetch(url, {"messages": FRANCE, "max_tokens": 12, "temperature": t})
            assert status == 200
            answers.append(json.loads(raw)["choices"][0]["message"]["content"])
        assert answers[0] and answers == [answers[0]] * 3, answers
        for pen in (1e-300, 1e300):
            status, raw = await afetch(url, {"messages": FRANCE, "max_tokens": 4, "repetition_penalty": pen})
            assert status == 400 and b"repetition_penalty" in raw


async def test_odd_values_are_4xx_and_no_500_echoes_an_exception(embedded_runner, caplog):
    async with serving(embedded_runner, http=True) as server:
        base = server.http_base
        status, raw = await afetch(base + "/v1/chat/completions",
                                   {"messages": FRANCE, "max_tokens": 4, "seed": 2**63 - 1, "n": 2})
        assert status == 200 and len(json.loads(raw)["choices"]) == 2
        for path in ("/api/chat", "/api/generate", "/api/show"):
            for model in (["x"], {"a": 1}, 7):
                status, raw = await afetch(base + path, {"model": model, "name": model, "messages": FRANCE,
                                                         "prompt": "hi", "stream": False})
                assert 400 <= status < 500, (path, model, raw)
        for role in ({"a": 1}, ["user"]):       # the door fuzzer found these: a 500 (unhashable role)
            status, raw = await afetch(base + "/v1/chat/completions",
                                       {"messages": [{"role": role, "content": "hi"}], "max_tokens": 2})
            assert status == 400 and b"role" in raw, raw
        deep = ("{\"a\":" * 100_000 + "1" + "}" * 100_000).encode()
        status, raw = await afetch(base + "/v1/chat/completions", deep)
        assert status == 400 and b"Recursion" not in raw
        deep_list = ("[" * 100_000 + "]" * 100_000).encode()
        status, raw = await afetch(base + "/api/chat", deep_list)
        assert status == 400
        # a failure on the server's side: a 500 that says nothing of the exception
        runner = server.engine.runner
        real = runner.step

        def broken(*a, **k):
            raise ValueError("secret-internal-detail /home/someone/path")
        runner.step = broken
        try:
            status, raw = await afetch(base + "/v1/chat/completions", {"messages": FRANCE, "max_tokens": 4})
        finally:
            runner.step = real
        assert status == 500 and b"secret-internal-detail" not in raw and b"ValueError" not in raw
    logged = [r for r in caplog.records if "secret-internal-detail" in r.getMessage()]
    assert logged and all(r.exc_info is None for r in logged if r.levelno > logging.DEBUG)


async def test_a_grammar_failing_on_the_parsers_limits_is_a_short_400(embedded_runner):
    """A format past llguidance's per-token limits: refused at build when its first token is
    (a short 400), else ended when it fails (a short 400; streamed, an error event): never a
    500 carrying the parser's state, never an empty answer."""
    async with serving(embedded_runner, http=True) as server:
        url = server.http_base + "/v1/chat/completions"
        # 1,000 optional properties: greedy, the model opens the object and the next mask fails
        body = {"messages": FRANCE, "max_tokens": 16, "temperature": 0, "guided_json": wide_schema(1000)}
        status, raw = await afetch(url, body)
        assert status == 400, raw[:500]
        message = json.loads(raw)["error"]["message"]
        assert "limits" in message and "Earley" not in message and "ff_tokens" not in message and len(message) < 300
        status, raw = await afetch(url, {**body, "stream": True})
        assert status == 200 and b"limits" in raw and b"ff_tokens" not in raw
        assert server.engine.stats()["kv_blocks_used"] == 0
    async with serving(embedded_runner, http=True, grammar=GrammarLimits(step_max_items=20)) as server:
        body = {"messages": FRANCE, "max_tokens": 16, "guided_json": wide_schema(30)}   # fails at once
        status, raw = await afetch(server.http_base + "/v1/chat/completions", body)
        message = json.loads(raw)["error"]["message"]
        assert status == 400 and "limits" in message and "ff_tokens" not in message, raw[:300]


def test_a_wrong_type_in_the_config_file_is_one_line(tmp_path):
    cfg = tmp_path / "edgepaged.toml"
    for text, key in (("users = 5\n", "users"), ('port = "eighty"\n', "port"), ("max_tokens = [1]\n", "max_tokens")):
        cfg.write_text(text)
        out = subprocess.run([sys.executable, "-m", "edgepaged.cli", "serve", "--config", str(cfg), "--no-mdns",
                              "--port", "0", "--http-port", "0"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert key in out.stderr and len(out.stderr.strip().splitlines()) <= 4, out.stderr
