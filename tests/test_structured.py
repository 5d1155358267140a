"""Constrained output (llguidance) and the Ollama API, with the real embedded model on
loopback, in process: the official `openai` and `ollama` packages as clients, every
constrained answer validated with `jsonschema`."""
import json
import subprocess
import sys

import jsonschema
import pytest
import trio

from edgepaged.engine import Engine, EngineConfig, RequestRejected
from edgepaged.request.frontend import FrontEnd
from edgepaged.request.protocol import GenerateRequest

from test_http import afetch, serving

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "Berlin", "Rome", "Madrid"]},
        "pets": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"kind": {"enum": ["cat", "dog", "fish"]},
                                             "name": {"type": "string", "maxLength": 20}},
            "required": ["kind", "name"], "additionalProperties": False}},
        "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 40},
                                                     "number": {"type": "integer", "minimum": 1, "maximum": 9999}},
                    "required": ["street"], "additionalProperties": False},
    },
    "required": ["name", "age", "city", "pets", "address"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Invent a person who lives in Europe and describe them as JSON."}]


async def test_fifty_json_schema_answers_all_validate(embedded_runner):
    """response_format json_schema with a nested schema (objects, arrays, enums, required):
    50 sampled requests at once through the openai package; every answer parses and
    validates, and each ends because its format was complete (or at a stop token)."""
    import openai
    async with serving(embedded_runner) as http:
        def scenario():
            client = openai.OpenAI(base_url=http.base + "/v1", api_key="unused", max_retries=0, timeout=300)
            fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

            def one(i):
                r = client.chat.completions.create(model="m", messages=ASK, response_format=fmt, temperature=0.8,
                                                   seed=i, max_tokens=400)
                return r.choices[0].message.content, r.choices[0].finish_reason
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(16) as pool:
                return list(pool.map(one, range(50)))
        answers = await trio.to_thread.run_sync(scenario)
    for text, finish in answers:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len({t for t, _ in answers}) > 10        # sampled: not one answer fifty times


async def test_json_object_regex_and_bad_schemas(embedded_runner):
    async with serving(embedded_runner) as http:
        url = http.base + "/v1/chat/completions"
        base = {"model": "m", "messages": ASK, "max_tokens": 200, "temperature": 0}
        short = [{"role": "user", "content": "Alice is 30. Reply with a JSON object with her name and age."}]
        status, _, body = await afetch(url, {**base, "messages": short, "response_format": {"type": "json_object"}})
        assert status == 200
        text = json.loads(body)["choices"][0]["message"]["content"]   # the toy model rambles: a JSON prefix
        assert text.startswith("{") and '"name": "Alice"' in text, text
        status, _, body = await afetch(url, {**base, "guided_regex": r"(yes|no), because [a-z ]{5,30}\."})
        assert status == 200
        text = json.loads(body)["choices"][0]["message"]["content"]
        import re
        assert re.fullmatch(r"(yes|no), because [a-z ]{5,30}\.", text), text
        status, _, body = await afetch(url, {**base, "guided_grammar": 'start: "A" | "B" "C"'})
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] in ("A", "BC")
        # a schema llguidance cannot compile: a 400 naming the problem
        status, _, body = await afetch(url, {**base, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strnig"}}}}}})
        err = json.loads(body)["error"]
        assert status == 400 and "format" in err["message"] and "strnig" in err["message"], err
        status, _, body = await afetch(url, {**base, "response_format": {"type": "xml"}})
        assert status == 400 and json.loads(body)["error"]["param"] == "response_format"


async def test_unconstrained_rows_are_untouched_beside_a_constrained_one(embedded_runner):
    """A batch with a constrained request and free ones: the free ones' greedy answers are the
    same as when they run alone."""
    async with Engine(embedded_runner, EngineConfig(max_num_seqs=8)) as engine:
        front = FrontEnd(engine)
        from edgepaged.request.frontend import Caller

        async def run(item):
            req = (await front.build(item, Caller("c", "c"))).req
            text = []
            async with engine.stream(req) as events:
                async for ev in events:
                    if hasattr(ev, "text"):
                        text.append(ev.text)
            return "".join(text)

        def free(i):
            return GenerateRequest(f"f{i}", "chat", messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                                   max_tokens=24, sampling={"temperature": 0})
        alone = [await run(free(i)) for i in range(3)]
        results = {}
        async with trio.open_nursery() as n:
            async def keep(key, item):
                results[key] = await run(item)
            n.start_soon(keep, "json", GenerateRequest("j", "chat", messages=ASK, max_tokens=200,
                                                       sampling={"temperature": 0},
                                                       format={"type": "json_schema", "schema": PERSON}))
            for i in range(3):
                n.start_soon(keep, i, free(i))
        assert [results[i] for i in range(3)] == alone
        jsonschema.validate(json.loads(results["json"]), PERSON)
        with pytest.raises(RequestRejected, match="format"):
            await front.build(GenerateRequest("x", "chat", messages=ASK, format={"type": "regex", "pattern": "("}),
                              Caller("c", "c"))


# ---------------------------------------------------------------- the Ollama API

async def test_the_ollama_package(embedded_runner):
    import ollama
    from pydantic import BaseModel, Field

    class City(BaseModel):   # bounded, so a small model's answer cannot run on digit after digit
        name: str = Field(max_length=30)
        country: str = Field(max_length=30)
        population_millions: int = Field(ge=0, le=100)

    async with serving(embedded_runner) as http:
        def scenario():
            c = ollama.Client(host=http.base, timeout=120)
            out = {"list": c.list(), "ps": c.ps()}
            name = out["list"].models[0].model
            out["show"] = c.show(name)
            out["chat"] = c.chat(model=name, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                 options={"temperature": 0, "num_ctx": 4096})
            out["stream"] = list(c.chat(model=name, messages=[{"role": "user", "content": "What is the capital of "
                                                                                           "France?"}],
                                        stream=True, options={"temperature": 0}))
            out["generate"] = c.generate(model=name, prompt="What is the capital of France?",
                                         options={"temperature": 0, "num_predict": 20})
            out["format"] = c.chat(model=name, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                                   format=City.model_json_schema(), options={"temperature": 0, "num_predict": 200})
            try:
                c.chat(model="nope:latest", messages=[{"role": "user", "content": "hi"}])
            except ollama.ResponseError as e:
                out["missing"] = e
            out["mirostat"] = c.chat(model=name, messages=[{"role": "user", "content": "hi"}],
                                     options={"mirostat": 2, "mirostat_tau": 5.0, "num_predict": 4})
            return name, out
        name, out = await trio.to_thread.run_sync(scenario)
    m = out["list"].models[0]
    assert name.endswith(":latest") and m.size > 0 and m.details.family == "llama"
    assert m.details.quantization_level == "Q4_1" and m.details.format == "gguf"
    assert out["ps"].models[0].model == name
    assert "im_start" in out["show"].template and out["show"].modelinfo["general.architecture"] == "llama"
    chat = out["chat"]
    assert "Paris" in chat.message.content and chat.done and chat.done_reason == "stop"
    assert chat.prompt_eval_count > 0 and chat.eval_count > 0 and chat.eval_duration > 0
    parts = out["stream"]
    assert len(parts) > 2 and parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == chat.message.content
    gen = out["generate"]
    assert "Paris" in gen.response and gen.eval_count <= 20
    City.model_validate_json(out["format"].message.content)
    assert out["missing"].status_code == 404 and "nope" in out["missing"].error
    assert out["mirostat"].done      # accepted and ignored (a warning header says so: test_ollama_raw_shapes)


async def test_ollama_raw_shapes(embedded_runner):
    """What other Ollama clients see without the package: NDJSON lines, `stream` true by
    default, the error shape, num_ctx limiting the prompt, the load call, version."""
    async with serving(embedded_runner) as http:
        status, headers, body = await afetch(http.base + "/api/chat", {
            "model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Say hi."}],
            "options": {"num_predict": 5, "temperature": 0}})   # sampled, 1 in 60 ended in 4 tokens
        assert status == 200 and headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(x) for x in body.decode().splitlines()]
        assert len(lines) >= 2 and lines[-1]["done"] and lines[-1]["done_reason"] == "length"
        assert lines[-1]["eval_count"] == 5
        # past num_ctx: cut in its middle by default, as Ollama's runner does (its first 4
        # tokens and its last; half the context left for the answer); a 400 with truncate off
        long = {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Say hi. " * 20}],
                "options": {"num_ctx": 16}, "stream": False}
        status, headers, body = await afetch(http.base + "/api/chat", long)
        answer = json.loads(body)
        assert status == 200, answer
        assert answer["prompt_eval_count"] == 8 and int(headers["x-edgepaged-truncated-tokens"]) > 40
        assert 1 <= answer["eval_count"] <= 8
        status, _, body = await afetch(http.base + "/api/chat", {**long, "truncate": False})
        assert status == 400 and "num_ctx" in json.loads(body)["error"]
        status, _, body = await afetch(http.base + "/api/generate", {"model": "SmolLM2-135M-Instruct.Q4_1"})
        assert status == 200 and json.loads(body)["done_reason"] == "load"
        status, _, body = await afetch(http.base + "/api/version")
        assert status == 200 and json.loads(body)["version"]
        status, _, body = await afetch(http.base + "/api/push", {"model": "x"})
        assert status in (404, 405) and "error" in json.loads(body)


# ---------------------------------------------------------------- tool calls

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "set_light", "description": "Turn a light on or off",
        "parameters": {"type": "object", "properties": {"room": {"type": "string", "maxLength": 20},
                                                        "on": {"type": "boolean"}},
                       "required": ["room", "on"], "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER}
Q = [{"role": "user", "content": "What is the weather in Paris?"}]


async def test_tool_calls_with_the_openai_package(embedded_runner):
    """tool_choice required (streamed and not) and a named function: the calls parse and
    validate against their schemas; then the tool's result goes back and is answered."""
    import openai
    async with serving(embedded_runner) as http:
        def scenario():
            c = openai.OpenAI(base_url=http.base + "/v1", api_key="unused", max_retries=0, timeout=120)
            out = {}
            r = c.chat.completions.create(model="m", messages=Q, tools=WEATHER, tool_choice="required",
                                          temperature=0, max_tokens=200)
            out["plain"] = r.choices[0]
            calls = {}
            for chunk in c.chat.completions.create(model="m", messages=Q, tools=WEATHER, tool_choice="required",
                                                   temperature=0, max_tokens=200, stream=True):
                if not chunk.choices:
                    continue
                ch = chunk.choices[0]
                for tc in ch.delta.tool_calls or []:
                    d = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    d["name"] += tc.function.name or ""
                    d["arguments"] += tc.function.arguments or ""
                if ch.finish_reason:
                    out["stream_finish"] = ch.finish_reason
            out["stream"] = calls
            r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Lights off in the "
                                                                                              "kitchen."}],
                                          tools=WEATHER, temperature=0, max_tokens=200,
                                          tool_choice={"type": "function", "function": {"name": "set_light"}})
            out["named"] = r.choices[0]
            call = out["plain"].message.tool_calls[0]
            history = Q + [{"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                                 "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
            r = c.chat.completions.create(model="m", messages=history, tools=WEATHER, temperature=0, max_tokens=60)
            out["answer"] = r.choices[0]
            return out
        out = await trio.to_thread.run_sync(scenario)
    plain = out["plain"]
    assert plain.finish_reason == "tool_calls" and plain.message.tool_calls
    for tc in plain.message.tool_calls:
        jsonschema.validate(json.loads(tc.function.arguments), SCHEMAS[tc.function.name])
    assert out["stream_finish"] == "tool_calls" and out["stream"]
    for d in out["stream"].values():
        jsonschema.validate(json.loads(d["arguments"]), SCHEMAS[d["name"]])
    named = out["named"].message.tool_calls
    assert [t.function.name for t in named] == ["set_light"] * len(named)
    jsonschema.validate(json.loads(named[0].function.arguments), SCHEMAS["set_light"])
    assert out["answer"].finish_reason in ("stop", "length") and out["answer"].message.content


async def test_tool_calls_stream_as_they_are_written(embedded_runner):
    """A streamed call goes out while the model writes it (OpenAI's shape: id, type and name
    in the call's first chunk, then pieces of its arguments, joined by index), long before the
    answer ends; the pieces join into the constrained, valid arguments. Ollama's stream gives
    each call whole in a chunk of its own as soon as it closes, before the final chunk."""
    import openai
    ask = [{"role": "user", "content": "Lights off in the kitchen, and the weather in Paris please."}]
    async with serving(embedded_runner) as http:
        def scenario():
            c = openai.OpenAI(base_url=http.base + "/v1", api_key="unused", max_retries=0, timeout=120)
            return [ch for ch in c.chat.completions.create(model="m", messages=ask, tools=WEATHER,
                                                           tool_choice="required", parallel_tool_calls=True,
                                                           temperature=0, max_tokens=200, stream=True)
                    if ch.choices]
        chunks = await trio.to_thread.run_sync(scenario)
        status, _, raw = await afetch(http.base + "/api/chat", {
            "model": "SmolLM2-135M-Instruct.Q4_1", "messages": ask, "tools": WEATHER,
            "options": {"temperature": 0, "num_predict": 200}})
    calls, pieces, first_at = {}, {}, {}
    for i, ch in enumerate(chunks):
        for tc in ch.choices[0].delta.tool_calls or []:
            d = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            if tc.function.name:
                assert not d["name"] and tc.id and tc.type == "function"     # the name whole, once, first
                d["name"], d["id"], first_at[tc.index] = tc.function.name, tc.id, i
            if tc.function.arguments:
                assert d["name"], "arguments before the name"
                d["arguments"] += tc.function.arguments
                pieces[tc.index] = pieces.get(tc.index, 0) + 1
    assert calls and chunks[-1].choices[0].finish_reason == "tool_calls"
    for k, d in calls.items():
        jsonschema.validate(json.loads(d["arguments"]), SCHEMAS[d["name"]])
        assert pieces[k] >= 2, pieces                     # the arguments came in pieces, as written
    assert first_at[0] < len(chunks) - 3                  # the first call's name long before the end
    assert len({d["id"] for d in calls.values()}) == len(calls)
    # Ollama: a call's chunk, then the final one (done) with no call repeated
    assert status == 200, raw
    lines = [json.loads(x) for x in raw.splitlines() if x.strip()]
    got = [c for x in lines for c in x["message"].get("tool_calls") or []]
    assert got and lines[-1]["done"] and not lines[-1]["message"].get("tool_calls"), lines
    for c in got:
        jsonschema.validate(c["function"]["arguments"], SCHEMAS[c["function"]["name"]])


async def test_tokens_a_format_forces_come_with_the_token_before_them(embedded_runner):
    """A token after which the format forces the next ones (a schema's property names, a
    call's `", "arguments": `) comes with them as `ahead`: certain, so the tokens that follow
    in the answer begin with them every time; a call's name they complete is given out with
    that token (`Answer`), a step before the forced tokens themselves are generated."""
    from edgepaged.request.answer import Answer, Call
    from edgepaged.engine.request import TokenEvent
    from edgepaged.request.frontend import Caller
    from edgepaged.request.tools import ToolStream, syntax_for
    async with Engine(embedded_runner, EngineConfig(max_num_seqs=4)) as engine:
        front = FrontEnd(engine)
        events = []
        item = GenerateRequest("j", "chat", messages=ASK, max_tokens=120, sampling={"temperature": 0},
                               format={"type": "json_schema", "schema": PERSON})
        async with engine.stream((await front.build(item, Caller("c", "c"))).req) as stream:
            async for ev in stream:
                if isinstance(ev, TokenEvent):
                    events.append(ev)
        assert engine.stats()["kv_blocks_used"] == 0
    ids = [t for ev in events for t in ev.token_ids]
    at, told = 0, 0
    for ev in events:
        at += len(ev.token_ids)
        if ev.ahead:
            told += 1
            assert ids[at:at + len(ev.ahead)] == ev.ahead or at + len(ev.ahead) > len(ids), (ids[at:], ev.ahead)
    assert told >= 3, events
    json.loads(embedded_runner.tokenizer.decode(ids))
    # a call's name: given out with the token that decides it, when what follows is forced
    tok = embedded_runner.tokenizer
    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}]}'
    cut = call.index('_weather') + len('_weather')
    head = tok.encode(call[:cut], add_special_tokens=False)
    forced = tok.encode(call[:call.index("{\"city")], add_special_tokens=False)[len(head):]
    assert tok.decode(head + forced) == call[:call.index("{\"city")]

    class Ticket:
        calls = [ToolStream(syntax_for(tok.chat_template, tok), tok)]
        req = None                # (no engine request behind it)
    answer = Answer(Ticket(), thinking=False, stream_calls=True)
    names = []
    for i, t in enumerate(head):
        out = answer.feed(0, TokenEvent([t], "", None, forced if i == len(head) - 1 else None))
        names += [(i, c.part["name"]) for c in out if isinstance(c, Call) and "name" in c.part]
    assert names == [(len(head) - 1, "get_weather")], names           # with the name's last token
    args = ""
    for t in tok.encode(call, add_special_tokens=False)[len(head):]:
        for c in answer.feed(0, TokenEvent([t], "")):
            if isinstance(c, Call):
                assert "name" not in c.part                            # once
                args += c.part.get("arguments", "")
    assert json.loads(args) == {"city": "Rome"}
    content, calls = Ticket.calls[0].finish()
    assert content == "" and calls[0]["name"] == "get_weather" and calls[0]["id"]


async def test_parallel_samples_with_tools(embedded_runner):
    """n = 3 with tool_choice required: every choice carries its own calls, each valid for
    its tool's schema, streamed (deltas by choice index) and not; over the msgpack protocol
    each sample's done frame carries its calls. Every block goes back."""
    import openai

    from test_server import Raw
    async with serving(embedded_runner) as http:
        def scenario():
            c = openai.OpenAI(base_url=http.base + "/v1", api_key="unused", max_retries=0, timeout=120)
            r = c.chat.completions.create(model="m", messages=Q, tools=WEATHER, tool_choice="required", n=3,
                                          temperature=1.0, seed=3, max_tokens=200)
            calls, ends = {}, {}
            for chunk in c.chat.completions.create(model="m", messages=Q, tools=WEATHER, tool_choice="required",
                                                   n=3, temperature=1.0, seed=3, max_tokens=200, stream=True):
                for ch in chunk.choices:
                    for tc in ch.delta.tool_calls or []:
                        d = calls.setdefault((ch.index, tc.index), {"name": "", "arguments": ""})
                        d["name"] += tc.function.name or ""
                        d["arguments"] += tc.function.arguments or ""
                    if ch.finish_reason:
                        ends[ch.index] = ch.finish_reason
            return r, calls, ends
        r, streamed, ends = await trio.to_thread.run_sync(scenario)
        raw = Raw(await trio.open_tcp_stream("127.0.0.1", http.msgpack_port))
        assert (await raw.ask({"type": "hello", "version": 1}))["type"] == "hello"
        await raw.send({"type": "chat", "id": 1, "messages": Q, "tools": WEATHER, "tool_choice": "required",
                        "n": 2, "max_tokens": 200, "temperature": 1.0, "seed": 5})
        dones = {}
        while len(dones) < 2:
            m = await raw.read()
            if m["type"] == "done":
                dones[m["index"]] = m
        with trio.fail_after(5):
            while http.engine.stats()["kv_blocks_used"]:
                await trio.sleep(0.05)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        for tc in c.message.tool_calls:
            jsonschema.validate(json.loads(tc.function.arguments), SCHEMAS[tc.function.name])
    assert ends == {0: "tool_calls", 1: "tool_calls", 2: "tool_calls"}
    assert {k for k, _ in streamed} == {0, 1, 2}
    for d in streamed.values():
        jsonschema.validate(json.loads(d["arguments"]), SCHEMAS[d["name"]])
    for d in dones.values():
        assert d["finish_reason"] == "tool_calls" and d["tool_calls"], d
        for tc in d["tool_calls"]:
            jsonschema.validate(json.loads(tc["function"]["arguments"]), SCHEMAS[tc["function"]["name"]])


HOME_ASSISTANT = {   # the shape Home Assistant's Ollama integration sends
    "model": "SmolLM2-135M-Instruct.Q4_1:latest", "stream": False, "keep_alive": "5m",
    "options": {"num_ctx": 8192, "top_p": 0.9, "temperature": 0.5},
    "messages": [
        {"role": "system", "content": "You are a voice assistant for Home Assistant.\nAnswer questions about the "
                                      "world truthfully.\nAn overview of the areas and the devices in this smart "
                                      "home:\n- names: Kitchen Light\n  domain: light\n  state: 'on'\n  areas: "
                                      "Kitchen\n- names: Living Room Lamp\n  domain: light\n  state: 'off'\n"},
        {"role": "user", "content": "turn off the kitchen light"}],
    "tools": [{"type": "function", "function": {
        "name": "HassTurnOff", "description": "Turns off/closes a device or entity",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}, "area": {"type": "string"},
                                                        "domain": {"type": "array", "items": {"type": "string"}}},
                       "required": []}}},
        {"type": "function", "function": {
            "name": "HassTurnOn", "description": "Turns on/opens a device or entity",
            "parameters": {"type": "object", "properties": {"name": {"type": "string"}, "area": {"type": "string"}},
                           "required": []}}}],
}


async def test_ollama_tools_and_home_assistant(embedded_runner):
    """The embedded model (its template knows no tools: the generic syntax, JSON answers held
    to a call or a reply) gets the Home Assistant body right: a valid HassTurnOff call, with
    the sampling HA sends (seeded here; the toy model, 17 seeds of 20 measured, sometimes runs
    a string argument past the token limit instead); the ollama package gets its call too."""
    import ollama
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in HOME_ASSISTANT["tools"]}
    async with serving(embedded_runner) as http:
        answers = []
        for seed in (7, 8, 9):
            status, _, body = await afetch(http.base + "/api/chat", {**HOME_ASSISTANT, "options": {
                **HOME_ASSISTANT["options"], "seed": seed, "num_predict": 128}})
            assert status == 200
            answers.append(json.loads(body))

        def scenario():
            c = ollama.Client(host=http.base, timeout=120)
            name = c.list().models[0].model
            return c.chat(model=name, messages=Q, tools=WEATHER, options={"temperature": 0, "num_predict": 64})
        r = await trio.to_thread.run_sync(scenario)
    called = 0
    for ha in answers:
        assert ha["done"] and ha["message"]["role"] == "assistant", ha
        for call in ha["message"].get("tool_calls") or []:
            assert call["function"]["name"] == "HassTurnOff", ha      # the kitchen light is on: turn it off
            jsonschema.validate(call["function"]["arguments"], schemas[call["function"]["name"]])
        called += bool(ha["message"].get("tool_calls"))
    assert called >= 2, answers
    assert r.done and r.message.tool_calls, r
    for call in r.message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(call.function.arguments, SCHEMAS[call.function.name])


def test_tool_stream_holds_calls_back_and_parses_them(embedded_runner):
    """The text given out stops where a call starts (and holds a tail that may become one);
    the calls come out parsed at the end; Llama 3's bare JSON and Mistral's [TOOL_CALLS]
    parse too."""
    from edgepaged.request.tools import ToolStream, ToolSyntax, check_tools, syntax_for
    tok = embedded_runner.tokenizer
    assert syntax_for(tok.chat_template).name == "generic"     # SmolLM2's template knows no tools
    hermes = ToolSyntax("hermes")
    text = 'Sure, checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": ' \
           '"celsius"}}\n</tool_call>'
    ids = tok.encode(text, add_special_tokens=False)
    s, out = ToolStream(hermes, tok), ""
    for i in ids:
        out += s.push([i], "")
        assert "<tool_call>"[:2] not in out.replace("Sure, checking. ", "")
    rest, calls = s.finish()
    assert (out + rest).strip() == "Sure, checking." and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris",
                                                                                        "unit": "celsius"}
    plain = ToolStream(hermes, tok)
    said = "".join(plain.push([i], "") for i in tok.encode("No call < here.", add_special_tokens=False))
    assert said + plain.finish()[0] == "No call < here." and plain.finish()[1] == []
    content, calls = ToolSyntax("llama3").parse('{"name": "set_light", "parameters": {"room": "hall", "on": true}}')
    assert content == "" and calls[0]["name"] == "set_light"
    content, calls = ToolSyntax("mistral").parse('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}]')
    assert calls[0]["name"] == "f" and json.loads(calls[0]["arguments"]) == {"a": 1}
    with pytest.raises(ValueError, match="tools\\[0\\].function.name"):
        check_tools([{"type": "function", "function": {"name": "bad name!"}}])


def test_generic_syntax_streams_the_reply_and_parses_calls(embedded_runner):
    """A template that knows no tools (SmolLM2's): the answer is JSON all through. A reply's
    text streams out decoded from its JSON string, an escape or a character cut between
    tokens waiting for its end; a call list parses; a call cut short is no content; the
    auto grammar takes exactly the two shapes, each call's arguments following its schema."""
    from edgepaged.constrain.grammar import Grammars
    from edgepaged.request.tools import ToolStream, check_tools, prepare_messages, syntax_for
    tok = embedded_runner.tokenizer
    generic = syntax_for(tok.chat_template, tok)
    reply = 'Hi "there",\nnaïve été \U0001F600 \\ end'
    text = '{"response": ' + json.dumps(reply, ensure_ascii=True) + '}'
    s, out, pieces = ToolStream(generic, tok), "", []
    for i in tok.encode(text, add_special_tokens=False):
        piece = s.push([i], "")
        pieces.append(piece)
        out += piece
        assert reply.startswith(out)           # never a half escape, never the JSON around it
    rest, calls = s.finish()
    assert out + rest == reply and calls == [] and sum(1 for p in pieces if p) > 5   # it streamed
    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}]}'
    s = ToolStream(generic, tok)
    said = "".join(s.push([i], "") for i in tok.encode(call, add_special_tokens=False))
    rest, calls = s.finish()
    assert said + rest == "" and [c["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Rome", "unit": "celsius"}
    s = ToolStream(generic, tok)
    said = "".join(s.push([i], "") for i in tok.encode(call[:40], add_special_tokens=False))
    assert said + s.finish()[0] == "" and s.finish()[1] == []
    g = Grammars(tok, embedded_runner.config.vocab_size)
    tools = check_tools(WEATHER)
    grammar = g.compile({"type": "lark", "grammar": generic.auto_grammar(tools)})
    plain = '{"response": ' + json.dumps(reply, ensure_ascii=False) + '}'   # the escapes the grammar takes
    for answer, ok in [(call, True), (plain, True), ('{"response": 3}', False), ('{"tool_calls": []}', False),
                       ('{"tool_calls": [{"name": "get_weather", "arguments": {"town": "Rome"}}]}', False),
                       ("Sure!", False), (call[:-2] + ', ' + call[16:-1] + "}", False)]:   # auto: one call
        m = g.matcher(grammar)
        assert (m.consume_tokens(g.lltok.tokenize_str(answer)) and m.is_accepting()) == ok, answer
    # the history as the model is held to write it; the tool list in the system message
    history = prepare_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
                                {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                                {"role": "tool", "content": "21 C"}], tools, tok.chat_template, tok)
    assert history[0]["role"] == "system" and '"get_weather"' in history[0]["content"]
    assert history[2]["content"] == '{"response": "Hello!"}'
    assert json.loads(history[3]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}]}


def test_a_started_call_is_constrained(embedded_runner):
    """Auto tool choice: once the answer has written <tool_call>, the rest must be a call of
    one of the tools with arguments following its schema (fed mid-token too)."""
    from edgepaged.constrain.grammar import Grammars
    from edgepaged.request.tools import LazyCall, ToolSyntax, check_tools
    tok = embedded_runner.tokenizer
    g = Grammars(tok, embedded_runner.config.vocab_size)
    tools = check_tools(WEATHER)
    syntax = ToolSyntax("hermes")
    good = '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>'
    for head in ("Let me look. <tool_call>\n", "<tool_call>\n{"):
        lazy, m = LazyCall(syntax.marker, syntax.continuation(tools), g, tok), None
        for t in tok.encode(head, add_special_tokens=False):
            m = lazy.feed(t) or m
        assert m, head
        rest = good if head.endswith("\n") else good[1:]
        assert m.consume_tokens(g.lltok.tokenize_str(rest)) and m.is_accepting()
        lazy, m = LazyCall(syntax.marker, syntax.continuation(tools), g, tok), None
        for t in tok.encode(head, add_special_tokens=False):
            m = lazy.feed(t) or m
        bad = '{"name": "get_weather", "arguments": {"town": "Rome"}}'[0 if head.endswith("\n") else 1:]
        assert not m.consume_tokens(g.lltok.tokenize_str(bad))


async def test_format_and_tools_over_the_msgpack_protocol(embedded_runner):
    from edgepaged.client import open_client
    from edgepaged.testing.serving import serving as box
    async with box(embedded_runner) as server:
        async with open_client(server.address, name="t") as c:
            text, done = await c.chat(ASK, format={"type": "json_schema", "schema": PERSON}, temperature=0,
                                      max_tokens=400).collect()
            jsonschema.validate(json.loads(text), PERSON)
            assert done["finish_reason"] == "stop" and done["stop"] == "format"
            text, done = await c.chat(Q, tools=WEATHER, tool_choice="required", temperature=0,
                                      max_tokens=200).collect()
            assert done["finish_reason"] == "tool_calls" and "<tool_call>" not in text, (text, done)
            for call in done["tool_calls"]:
                jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


# ---------------------------------------------------------------- logprobs, penalties, logit_bias

async def test_logprobs_are_the_models_and_penalties_and_bias_apply(embedded_runner):
    """logprobs: per token, the sampled token's log-probability under the same logits (one
    prefill of prompt + answer gives the same values; their sum too), top_logprobs sorted
    with the sampled one first when greedy; streamed too. logit_bias bans a token;
    frequency_penalty changes a greedy answer that repeats itself."""
    import openai
    import torch
    from test_model import Paged
    tok = embedded_runner.tokenizer
    async with serving(embedded_runner) as http:
        def scenario():
            c = openai.OpenAI(base_url=http.base + "/v1", api_key="unused", max_retries=0, timeout=120)
            out = {}
            out["lp"] = c.chat.completions.create(model="m", messages=Q, temperature=0, max_tokens=12,
                                                  logprobs=True, top_logprobs=5).choices[0]
            out["stream"] = [ch.choices[0].logprobs for ch in c.chat.completions.create(
                model="m", messages=Q, temperature=0, max_tokens=12, logprobs=True, top_logprobs=2, stream=True)
                if ch.choices and ch.choices[0].logprobs]
            out["cmpl"] = c.completions.create(model="m", prompt="The capital of France is", max_tokens=5,
                                               temperature=0, logprobs=3).choices[0]
            first = out["lp"].logprobs.content[0].token
            banned = tok.encode(first, add_special_tokens=False)[0]
            out["banned"] = (banned, c.chat.completions.create(
                model="m", messages=Q, temperature=0, max_tokens=12, logit_bias={str(banned): -100},
                logprobs=True).choices[0])
            story = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]
            out["plain"] = c.chat.completions.create(model="m", messages=story, temperature=0,
                                                     max_tokens=60).choices[0].message.content
            out["penalized"] = c.chat.completions.create(model="m", messages=story, temperature=0, max_tokens=60,
                                                         frequency_penalty=2.0).choices[0].message.content
            return out
        out = await trio.to_thread.run_sync(scenario)
    content = out["lp"].logprobs.content
    assert len(content) > 0
    for e in content:
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6) and len(e.top_logprobs) == 5
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    # the same logits: a prefill of prompt + answer
    prompt = tok.apply_chat_template(Q)
    answer = tok.encode(out["lp"].message.content, add_special_tokens=False)
    ids, pos, meta = Paged(embedded_runner.num_blocks).batch([(0, prompt + answer)])
    with torch.inference_mode():
        logits = embedded_runner.execute(ids, pos, meta, list(range(len(prompt) - 1, len(prompt) + len(answer) - 1)))
        want = torch.log_softmax(torch.as_tensor(logits), -1)[torch.arange(len(answer)), torch.tensor(answer)]
    got = [e.logprob for e in content][:len(answer)]
    assert len(got) == len(answer)
    assert abs(sum(got) - float(want.sum())) < 1e-2 and max(abs(a - b) for a, b in zip(got, want.tolist())) < 5e-3
    assert sum(len(x.content) for x in out["stream"]) == len(content)
    c = out["cmpl"].logprobs
    assert len(c.tokens) == len(c.token_logprobs) == len(c.top_logprobs) == 5 and c.text_offset[0] == 0
    banned, r = out["banned"]
    assert banned not in tok.encode(r.message.content, add_special_tokens=False)
    assert out["penalized"] != out["plain"]


def test_openai_penalties_by_their_definition():
    import torch

    from edgepaged.model.params import SamplingParams
    from edgepaged.model.sampler import prepare
    logits = torch.zeros(2, 6)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={5: -100.0}), SamplingParams()]
    got = prepare(logits, params, None, [[1, 1, 2], []])
    assert got[0].tolist() == [0, -1.0, -0.75, 0, 0, -100.0] and got[1].tolist() == [0] * 6
    assert logits.abs().sum() == 0      # the caller's logits untouched
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=3)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 500})


# ---------------------------------------------------------------- parallel samples

async def test_n_samples_share_the_prompt_blocks(embedded_runner):
    """n=3: three choices, the prompt prefilled once and forked: while the samples run, the
    prompt's full blocks are held by all three (refcount 3) and the pool holds far fewer
    blocks than three separate requests would."""
    import openai
    seen = []
    async with serving(embedded_runner) as http:
        engine = http.front.engine
        alloc = engine.allocator

        def hook(batch):
            if len(batch.requests) == 3 and all(r.output_ids for r in batch.requests):
                first = {alloc.block_table(r.id)[0] for r in batch.requests}
                seen.append((len(first), alloc.refcount(next(iter(first))), alloc.num_used_blocks))
        engine.step_hook = hook
        prompt = [{"role": "user", "content": "Write a long story about a dragon who learns to cook. " * 3}]

        def scenario():
            c = openai.OpenAI(base_url=http.base + "/v1", api_key="unused", max_retries=0, timeout=120)
            plain = c.chat.completions.create(model="m", messages=prompt, n=3, temperature=0.9, seed=5,
                                              max_tokens=20)
            streamed = {}
            for ch in c.chat.completions.create(model="m", messages=prompt, n=3, temperature=0.9, seed=5,
                                                max_tokens=20, stream=True):
                for choice in ch.choices:
                    d = streamed.setdefault(choice.index, {"text": "", "finish": None})
                    d["text"] += choice.delta.content or ""
                    d["finish"] = choice.finish_reason or d["finish"]
            return plain, streamed
        plain, streamed = await trio.to_thread.run_sync(scenario)
        engine.step_hook = None
        assert alloc.num_used_blocks == 0 or engine.scheduler.num_running == 0
    assert [c.index for c in plain.choices] == [0, 1, 2]
    texts = [c.message.content for c in plain.choices]
    assert len(set(texts)) > 1 and all(texts)
    assert plain.usage.completion_tokens == sum(len(embedded_runner.tokenizer.encode(t, add_special_tokens=False))
                                                for t in texts) or plain.usage.completion_tokens <= 60
    assert sorted(streamed) == [0, 1, 2] and [streamed[k]["text"] for k in range(3)] == texts
    assert all(streamed[k]["finish"] in ("stop", "length") for k in range(3))
    bs = embedded_runner.block_size
    n_prompt = len(embedded_runner.tokenizer.apply_chat_template(prompt))
    assert seen and all(n_first == 1 and ref == 3 for n_first, ref, _ in seen), seen
    alone = 3 * -(-(n_prompt + 20) // bs)       # three separate requests, each prompt and answer
    assert max(used for _, _, used in seen) <= n_prompt // bs + 3 * 2 < alone, (seen, n_prompt)


async def test_samples_end_with_their_parent_and_give_every_block_back(embedded_runner):
    """Parallel samples through the engine alone: all three finish and every block returns;
    a request whose client leaves before its prompt ends takes its unforked samples along."""
    from edgepaged.request.frontend import Caller
    async with Engine(embedded_runner, EngineConfig(max_num_seqs=8)) as engine:
        front = FrontEnd(engine)
        item = GenerateRequest("n", "chat", messages=ASK, max_tokens=12, sampling={"temperature": 1.0, "seed": 3})
        item.n = 3
        req = (await front.build(item, Caller("c", "c"))).req
        samples = [req, *req.children]
        done = {}
        async with engine.stream_samples(req) as events:
            async for k, ev in events:
                if not hasattr(ev, "text"):
                    done[k] = ev.finish_reason
        assert done == {0: "length", 1: "length", 2: "length"}
        assert [len(s.output_ids) for s in samples] == [12, 12, 12] and len({tuple(s.output_ids) for s in samples}) > 1
        req = (await front.build(item, Caller("c", "c"))).req
        samples = [req, *req.children]
        async with engine.stream_samples(req) as events:
            pass                                   # the client leaves at once
        assert all(s.finished for s in samples)
        await trio.sleep(0.5)
        assert engine.allocator.num_used_blocks == 0 and engine.scheduler.num_running == 0


async def test_home_assistant_body_gets_a_valid_tool_call_from_a_model_that_calls(tmp_path):
    """The Home Assistant body against a tiny Qwen3 (its real template, which takes tools)
    whose weights make it open a <tool_call> on its own: the call it starts is constrained
    to the tools' schemas (auto choice), so a valid call comes back over the Ollama API, and
    through the ollama package."""
    import ollama

    from edgepaged.model import ModelRunner
    from edgepaged.testing.families import make_family_model, write_family_gguf
    ha_tools = HOME_ASSISTANT["tools"]
    hf = make_family_model(tmp_path / "q", "qwen3", seed=2, stop_prompt=HOME_ASSISTANT["messages"],
                           rig_token="<tool_call>", tools=ha_tools, context=4096,
                           rig_also=('"', "]", "}"))    # closing what it opens, where the call's grammar lets it
    path = write_family_gguf(tmp_path / "q", tmp_path / "tiny-qwen3.gguf", hf)
    runner = ModelRunner(path, num_blocks=128)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in ha_tools}
    async with serving(runner) as http:
        body = {**HOME_ASSISTANT, "model": "tiny-qwen3", "options": {**HOME_ASSISTANT["options"], "temperature": 0,
                                                                     "num_predict": 160}}
        status, _, raw = await afetch(http.base + "/api/chat", body)

        def scenario():
            c = ollama.Client(host=http.base, timeout=120)
            return c.chat(model="tiny-qwen3", messages=HOME_ASSISTANT["messages"], tools=ha_tools,
                          options={"temperature": 0, "num_predict": 160})
        r = await trio.to_thread.run_sync(scenario)
    msg = json.loads(raw)["message"]
    assert status == 200 and msg.get("tool_calls"), msg
    for call in msg["tool_calls"]:
        assert call["function"]["name"] in schemas
        jsonschema.validate(call["function"]["arguments"], schemas[call["function"]["name"]])
    assert "<tool_call>" not in msg["content"]
    assert r.message.tool_calls
    for call in r.message.tool_calls:
        jsonschema.validate(call.function.arguments, schemas[call.function.name])


async def test_n_samples_over_the_msgpack_protocol(embedded_runner):
    from test_server import Raw

    from edgepaged.testing.serving import serving as box
    async with box(embedded_runner) as server:
        raw = await Raw.open(server)
        await raw.send({"type": "chat", "id": 1, "messages": Q, "n": 3, "max_tokens": 8, "temperature": 1.0,
                        "seed": 4, "logprobs": 1})
        texts, dones = {}, {}
        while len(dones) < 3:
            m = await raw.read()
            assert m["id"] == 1 and m["type"] in ("token", "done"), m
            if m["type"] == "token":
                texts[m["index"]] = texts.get(m["index"], "") + m["text"]
                assert len(m["logprobs"]) == len(m["token_ids"])
            else:
                dones[m["index"]] = m
        assert sorted(dones) == [0, 1, 2] and all(d["finish_reason"] == "length" for d in dones.values())
        assert len(set(texts.values())) > 1
        reply = await raw.ask({"type": "chat", "id": 2, "messages": Q, "n": 20})
        assert reply["type"] == "error" and "n must be" in reply["message"]
        # the Python client: one stream, every sample's pieces, ended when all three are done
        from edgepaged.client import open_client
        async with open_client(server.address) as client:
            async with client.chat(Q, n=3, max_tokens=8, temperature=1.0, seed=4) as stream:
                seen = set()
                async for _ in stream:
                    seen.add(stream.last_index)
            assert seen == {0, 1, 2} and len(stream.texts) == 3 and len(set(stream.texts)) > 1
            assert [d["finish_reason"] for d in stream.dones] == ["length"] * 3
            assert stream.text == stream.texts[0] and stream.done is stream.dones[0]
            assert sorted(stream.texts) == sorted(texts.values())           # the same seed: the same samples
        with trio.fail_after(5):
            while server.engine.stats()["kv_blocks_used"]:
                await trio.sleep(0.05)


# ---------------------------------------------------------------- thinking models

def test_think_split_streams_thinking_apart_from_the_answer():
    """<think>…</think> before the answer: the thinking and the answer come apart however the
    text is cut into pieces (a marker cut between pieces waits); an answer that does not open
    with the marker is all content; a block the prompt opened starts inside."""
    from edgepaged.request.thinking import ThinkSplit
    text = "\n<think>\nThe user wants 2+2. <b>four</b>\n</think>\n\nIt is 4. </think> stays"
    for size in (1, 2, 3, 5, 7, 100):
        s, thinking, content = ThinkSplit(), "", ""
        for i in range(0, len(text), size):
            t, c = s.feed(text[i:i + size])
            thinking, content = thinking + t, content + c
            assert "<think" not in thinking + content and not content.startswith("\n")
        t, c = s.flush()
        assert (thinking + t, content + c) == ("The user wants 2+2. <b>four</b>", "It is 4. </think> stays"), size
    for plain in ("<thing> is not a marker", "Hello <think> later", "<thi"):
        s = ThinkSplit()
        t1, c1 = s.feed(plain)
        t2, c2 = s.flush()
        assert t1 + t2 == "" and c1 + c2 == plain
    s = ThinkSplit(inside=True)
    assert s.feed("step one</thi") == ("step one", "") and s.feed("nk>answer") == ("", "answer")
    s = ThinkSplit()
    assert s.feed("<think>cut short by the limit") == ("cut short by the limit", "") and s.flush() == ("", "")


async def test_think_reaches_the_template_and_ollama_gives_thinking_apart(tmp_path, embedded_runner):
    """`think` on every door reaches a thinking template (Qwen3's enable_thinking: false puts
    the empty block in the prompt); Ollama's answer keeps <think> out of `content`; `think:
    true` for a model that does not think is a 400 naming it."""
    import ollama

    from edgepaged.request.frontend import Caller
    from edgepaged.model import ModelRunner
    from edgepaged.testing import families
    from edgepaged.testing.families import make_family_model, write_family_gguf
    hf = make_family_model(tmp_path / "q", "qwen3", seed=3)
    runner = ModelRunner(write_family_gguf(tmp_path / "q", tmp_path / "tiny-qwen3.gguf", hf), num_blocks=64)
    async with serving(runner) as http:
        front, tok = http.front, runner.tokenizer
        caller = Caller("t", "t", True)
        texts = {}
        for think in (None, True, False):
            t = await front.build(GenerateRequest(1, "chat", messages=Q, max_tokens=4, think=think), caller)
            texts[think] = tok.decode(t.req.prompt_ids, skip_special_tokens=False)
            assert t.thinking == (think is not False) and not t.think_open
        assert texts[None] == texts[True] and "<think>" not in texts[None]
        assert texts[False].rstrip().endswith("</think>") and texts[False].startswith(texts[None])

        def scenario():
            c = ollama.Client(host=http.base, timeout=120)
            out = [c.chat(model="tiny-qwen3", messages=Q, think=t, options={"temperature": 0, "num_predict": 24})
                   for t in (True, False)]
            out.append(list(c.chat(model="tiny-qwen3", messages=Q, think=True, stream=True,
                                   options={"temperature": 0, "num_predict": 24})))
            return out
        on, off, streamed = await trio.to_thread.run_sync(scenario)
        status, _, body = await afetch(http.base + "/v1/chat/completions", {
            "messages": Q, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
        assert status == 200, body
        shown = json.loads((await afetch(http.base + "/api/show", {"model": "tiny-qwen3"}))[2])
        assert {"completion", "tools", "thinking"} <= set(shown["capabilities"])
    for r in (on, off):
        assert "<think>" not in r.message.content and "</think>" not in r.message.content
    joined = "".join(p.message.content for p in streamed)
    assert joined == on.message.content and "".join(p.message.thinking or "" for p in streamed) == \
        (on.message.thinking or "")
    # a model whose weights make it open <think> at once (and never close it): all thinking
    thinker = ModelRunner(families.make_thinker(tmp_path / "t", tmp_path / "thinker.gguf"), num_blocks=64)
    async with serving(thinker) as http:
        status, _, body = await afetch(http.base + "/api/chat", {"model": "thinker", "messages": Q, "stream": False,
                                                                 "options": {"temperature": 0, "num_predict": 6}})
        status2, _, body2 = await afetch(http.base + "/api/chat", {"model": "thinker", "messages": Q, "think": True,
                                                                   "options": {"temperature": 0, "num_predict": 6}})
        # the msgpack protocol (the Python client) and the CLI on it
        from edgepaged.client import open_client
        address = f"127.0.0.1:{http.msgpack_port}"
        async with open_client(address) as c:
            async with c.chat(Q, max_tokens=6, temperature=0) as s:
                pieces = [(p, s.last_thinking) async for p in s]
        cli = [sys.executable, "-m", "edgepaged.cli", "ask", "--server", address, "--max-tokens", "6", "Hi"]

        def run(*extra):
            return subprocess.run([*cli, *extra], capture_output=True, text=True, timeout=60)
        as_json, piped, hidden = [await trio.to_thread.run_sync(run, *x) for x in
                                  (("--json",), (), ("--hide-thinking",))]

        def openai_scenario():     # llama.cpp's reasoning_format: the thinking in reasoning_content
            import openai
            c = openai.OpenAI(base_url=http.base + "/v1", api_key="unused", max_retries=0, timeout=60)
            kw = dict(model="thinker", messages=Q, max_tokens=6, temperature=0)
            plain = c.chat.completions.create(**kw).choices[0].message
            split = c.chat.completions.create(**kw, extra_body={"reasoning_format": "auto"}).choices[0].message
            deltas = [ch.choices[0].delta for ch in c.chat.completions.create(
                **kw, stream=True, extra_body={"reasoning_format": "auto"}) if ch.choices]
            return plain, split, deltas
        plain, split, deltas = await trio.to_thread.run_sync(openai_scenario)
        status3, _, body3 = await afetch(http.base + "/v1/chat/completions", {"messages": Q,
                                                                             "reasoning_format": "xml"})
    msg = json.loads(body)["message"]
    assert status == 200 and msg["content"] == "" and msg["thinking"] == "<think>" * 5, msg
    lines = [json.loads(x)["message"] for x in body2.decode().splitlines()]
    assert status2 == 200 and "".join(p.get("thinking", "") for p in lines) == "<think>" * 5
    assert all("<think>" not in p["content"] for p in lines)
    assert "".join(p for p, _ in pieces) == "" and "".join(t for _, t in pieces) == "<think>" * 5
    assert as_json.returncode == 0, as_json.stderr
    answer = json.loads(as_json.stdout)
    assert answer["text"] == "" and answer["thinking"] == "<think>" * 5
    assert piped.returncode == 0 and piped.stdout.strip() == "" and "Thinking..." in piped.stderr
    assert "<think>" * 5 in piped.stderr and "done thinking" in piped.stderr
    assert hidden.returncode == 0 and "Thinking" not in hidden.stderr + hidden.stdout
    assert plain.content == "<think>" * 6                     # reasoning_format "none": as the model wrote it
    assert split.content == "" and split.model_extra["reasoning_content"] == "<think>" * 5
    assert "".join(d.content or "" for d in deltas) == ""
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == "<think>" * 5
    assert status3 == 400 and "reasoning_format" in json.loads(body3)["error"]["message"]
    async with serving(embedded_runner) as http:
        status, _, body = await afetch(http.base + "/api/chat", {"model": HOME_ASSISTANT["model"], "messages": Q, "think": True,
                                                                 "stream": False})
        status2, _, body2 = await afetch(http.base + "/api/chat", {"model": HOME_ASSISTANT["model"], "messages": Q,
                                                                  "think": "maybe"})
        shown = json.loads((await afetch(http.base + "/api/show", {"model": HOME_ASSISTANT["model"]}))[2])
    assert shown["capabilities"] == ["completion", "tools"]      # tools: the generic syntax; no thinking
    assert status == 400 and "does not think" in json.loads(body)["error"], body
    assert status2 == 400 and "think must be" in json.loads(body2)["error"]
