"""Constrained output (llguidance) and the Ollama API, with the real embedded model on
loopback, in process: the official `openai` and `ollama` packages as clients, every
constrained answer validated with `jsonschema`."""
import json

import jsonschema
import pytest
import trio

from edgepaged.engine import Engine, EngineConfig, RequestRejected
from edgepaged.frontend import FrontEnd
from edgepaged.protocol import GenerateRequest

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
        from edgepaged.frontend import Caller

        async def run(item):
            req = await front.build(item, Caller("c", "c"))
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
            try:
                c.chat(model=name, messages=[{"role": "user", "content": "hi"}], options={"mirostat": 2})
            except ollama.ResponseError as e:
                out["mirostat"] = e
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
    assert out["mirostat"].status_code == 400 and "mirostat" in out["mirostat"].error


async def test_ollama_raw_shapes(embedded_runner):
    """What other Ollama clients see without the package: NDJSON lines, `stream` true by
    default, the error shape, num_ctx limiting the prompt, the load call, version."""
    async with serving(embedded_runner) as http:
        status, headers, body = await afetch(http.base + "/api/chat", {
            "model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Say hi."}],
            "options": {"num_predict": 5}})
        assert status == 200 and headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(x) for x in body.decode().splitlines()]
        assert len(lines) >= 2 and lines[-1]["done"] and lines[-1]["done_reason"] == "length"
        assert lines[-1]["eval_count"] == 5
        status, _, body = await afetch(http.base + "/api/chat", {
            "model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Say hi. " * 20}],
            "options": {"num_ctx": 16}, "stream": False})
        assert status == 400 and "num_ctx" in json.loads(body)["error"]
        status, _, body = await afetch(http.base + "/api/generate", {"model": "SmolLM2-135M-Instruct.Q4_1"})
        assert status == 200 and json.loads(body)["done_reason"] == "load"
        status, _, body = await afetch(http.base + "/api/version")
        assert status == 200 and json.loads(body)["version"]
        status, _, body = await afetch(http.base + "/api/pull", {"model": "x"})
        assert status in (404, 405) and "error" in json.loads(body)
