"""Ollama's semantics where edgepaged differed (issue 37, section 4), each a test that failed
before: schemas without `additionalProperties` are closed objects; a conversation past
`num_ctx` loses its oldest turns on the Ollama door (and says how many); `curl -d` bodies
(form-urlencoded) are read as JSON when no browser sent them, and the refusals on `/api/`
are in Ollama's shape; a required tool call without `parallel_tool_calls` is bounded and ends
when its list closes, and complete calls survive a length cut; `/api/ps`, the load and unload
calls and `/api/version` answer as Ollama's; `mirostat` is accepted and ignored with a
warning header."""
from __future__ import annotations

import json
from datetime import datetime, timezone

import trio

from test_http import afetch, serving

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def test_a_schema_without_additional_properties_is_a_closed_object(embedded_runner):
    from edgepaged.constrain.grammar import Grammars
    g = Grammars(embedded_runner.tokenizer, embedded_runner.config.vocab_size)
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "where": {"type": "object", "properties": {"city": {"type": "string"}}}},
              "required": ["name"]}                       # as pydantic writes it: no additionalProperties
    grammar = g.compile({"type": "json_schema", "schema": schema})
    for text, ok in [('{"name": "Ann"}', True), ('{"name": "Ann", "where": {"city": "Rome"}}', True),
                     ('{"name": "Ann", "age": 3}', False), ('{"name": "Ann", "where": {"city": "Rome", "zip": 1}}',
                                                            False)]:
        m = g.matcher(grammar)
        assert (m.consume_tokens(g.lltok.tokenize_str(text)) and m.is_accepting()) == ok, text
    explicit = {**schema, "additionalProperties": True}      # said open: stays open
    m = g.matcher(g.compile({"type": "json_schema", "schema": explicit}))
    assert m.consume_tokens(g.lltok.tokenize_str('{"name": "Ann", "age": 3}')) and m.is_accepting()


async def test_num_ctx_drops_the_oldest_turns_on_the_ollama_door(embedded_runner):
    turns = [{"role": "system", "content": "You are a terse assistant."}]
    for i in range(6):
        turns += [{"role": "user", "content": f"Tell me fact number {i} about lighthouses, in detail."},
                  {"role": "assistant", "content": f"Fact {i}: lighthouses guide ships with light. " * 3}]
    turns.append({"role": "user", "content": "What is the capital of France?"})
    async with serving(embedded_runner) as http:
        for stream in (False, True):
            status, headers, body = await afetch(http.base + "/api/chat", {
                "model": MODEL, "messages": turns, "stream": stream,
                "options": {"num_ctx": 256, "num_predict": 16, "temperature": 0}})
            assert status == 200, body
            dropped = int(headers["x-edgepaged-truncated-messages"])
            last = json.loads(body.decode().splitlines()[-1])
            assert dropped >= 2 and last["truncated_messages"] == dropped and last["done"]
            assert last["prompt_eval_count"] + 16 <= 256
        status, _, body = await afetch(http.base + "/api/chat", {
            "model": MODEL, "messages": turns, "stream": False, "truncate": "none", "options": {"num_ctx": 256}})
        assert status == 400 and "num_ctx" in json.loads(body)["error"]     # asked not to: refused


async def test_curl_bodies_are_json_and_api_refusals_are_ollamas_shape(embedded_runner):
    async with serving(embedded_runner) as http:
        body = json.dumps({"model": MODEL, "prompt": "Say hi.", "stream": False, "options": {"num_predict": 3}})
        status, _, raw = await afetch(http.base + "/api/generate", body.encode(),
                                      headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert status == 200 and json.loads(raw)["done"], raw
        status, _, raw = await afetch(http.base + "/api/generate", body.encode(), headers={
            "Content-Type": "application/x-www-form-urlencoded", "Origin": "http://evil.example.com"})
        assert status == 415 and isinstance(json.loads(raw)["error"], str)
        status, _, raw = await afetch(http.base + "/api/generate", body.encode(), headers={"Host": "evil.example.com"})
        assert status == 421 and isinstance(json.loads(raw)["error"], str)


def test_complete_calls_survive_a_length_cut():
    from edgepaged.request.tools import ToolSyntax
    a = '{"name": "set_light", "arguments": {"room": "hall", "on": true}}'
    cut = '{"tool_calls": [' + a + ', ' + a + ', {"name": "set_li'
    content, calls = ToolSyntax("generic").parse(cut)
    assert [c["name"] for c in calls] == ["set_light", "set_light"] and content == ""
    content, calls = ToolSyntax("mistral").parse("[TOOL_CALLS] [" + a + ', {"name": "x", "argu')
    assert [c["name"] for c in calls] == ["set_light"]


async def test_a_required_call_without_parallel_tool_calls_ends_when_its_list_closes(embedded_runner):
    """The embedded model (the generic JSON syntax) asked for several things with a required
    call and parallel_tool_calls unset: unbounded it wrote calls to the length limit (400
    tokens, 15-16 calls) and the cut list was dropped whole (no tool_calls, content "")."""
    from edgepaged.request.tools import MAX_DEFAULT_CALLS
    from test_structured import WEATHER
    ask = [{"role": "user", "content": "Turn on the lights in the hall, the kitchen, the bedroom and the garage, "
                                       "and tell me the weather in Rome."}]
    async with serving(embedded_runner) as http:
        outs = []
        for seed in range(4):
            status, _, raw = await afetch(http.base + "/v1/chat/completions", {
                "messages": ask, "tools": WEATHER, "tool_choice": "required", "max_tokens": 400,
                "temperature": 0.8, "seed": seed})
            assert status == 200, raw
            out = json.loads(raw)
            choice = out["choices"][0]
            outs.append((choice["finish_reason"], len(choice["message"].get("tool_calls") or []),
                         out["usage"]["completion_tokens"]))
        status, _, raw = await afetch(http.base + "/v1/chat/completions", {
            "messages": ask, "tools": WEATHER, "tool_choice": "required", "parallel_tool_calls": False,
            "max_tokens": 400, "temperature": 0.8, "seed": 0})
        one = json.loads(raw)["choices"][0]
    assert all(reason == "tool_calls" and 1 <= n <= MAX_DEFAULT_CALLS and used < 400 for reason, n, used in outs), outs
    assert one["finish_reason"] == "tool_calls" and len(one["message"]["tool_calls"]) == 1


async def test_ps_load_unload_version_and_mirostat_as_ollama(embedded_runner):
    async with serving(embedded_runner) as http:
        status, _, raw = await afetch(http.base + "/api/ps")
        expires = json.loads(raw)["models"][0]["expires_at"]
        assert datetime.strptime(expires, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc).year \
            > datetime.now(timezone.utc).year + 50           # stays loaded: far in the future, not year 1
        for path, body in (("/api/chat", {"model": MODEL, "messages": []}), ("/api/chat", {"model": MODEL}),
                           ("/api/generate", {"model": MODEL})):
            status, _, raw = await afetch(http.base + path, body)
            assert status == 200 and json.loads(raw)["done_reason"] == "load", (path, raw)
        # keep_alive 0 on a box of one model: the model stays (it said "unload" and /api/ps still listed it)
        status, headers, raw = await afetch(http.base + "/api/generate", {"model": MODEL, "keep_alive": 0})
        assert json.loads(raw)["done_reason"] == "load" and "stays loaded" in headers["x-edgepaged-warning"]
        status, _, raw = await afetch(http.base + "/api/chat", {"model": MODEL, "messages": [], "keep_alive": 0})
        assert json.loads(raw)["done_reason"] == "load"
        status, _, raw = await afetch(http.base + "/api/ps")
        assert [m["name"] for m in json.loads(raw)["models"]] == [f"{MODEL}:latest"]

        def with_ollama():
            import ollama
            c = ollama.Client(host=http.base, timeout=60)
            return c.generate(model=MODEL, keep_alive=0).done_reason, [m.model for m in c.ps().models]
        assert await trio.to_thread.run_sync(with_ollama) == ("load", [f"{MODEL}:latest"])
        status, _, raw = await afetch(http.base + "/api/version")
        major, minor, *_ = (int(x) for x in json.loads(raw)["version"].split("."))
        assert (major, minor) >= (0, 9)                       # tools, thinking, structured output
        status, headers, raw = await afetch(http.base + "/api/chat", {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": False,
            "options": {"mirostat": 2, "num_predict": 3}})
        assert status == 200 and "mirostat" in headers["x-edgepaged-warning"]
    await trio.sleep(0)


async def test_a_number_the_format_leaves_open_stays_one_a_client_can_parse(embedded_runner):
    """An Ollama `format` with an unbounded integer let the embedded model write `"count":
    8321222231231231231…` until its length limit (JSON no client parses, a number no integer
    type holds). Integers and numbers a schema leaves open now get at most 16 digits before
    the point and 10 after (llama.cpp's schema grammars: 1-16), so every answer parses."""
    import ollama
    count = {"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}
    share = {"type": "object", "properties": {"share": {"type": "number"}}, "required": ["share"]}
    async with serving(embedded_runner) as http:
        def scenario():
            c = ollama.Client(host=http.base, timeout=120)
            return [(c.chat(model=MODEL, messages=[{"role": "user", "content": q}], format=f,
                            options={"temperature": t, "num_predict": 80, "seed": 1}).message.content, f is count)
                    for q in ("What is the population of the world? Answer in JSON.",
                              "How many stars are in the sky? Answer in JSON.") for t in (0, 0.8) for f in (count, share)]
        answers = await trio.to_thread.run_sync(scenario)
    for text, is_count in answers:
        value = json.loads(text)                  # (the unbounded integer: never closed, not JSON)
        if is_count:
            assert isinstance(value["count"], int) and len(str(value["count"]).lstrip("-")) <= 16, text
        else:
            whole, _, frac = text.split(":", 1)[1].strip(" }").partition(".")
            assert len(whole.lstrip("-")) <= 16 and len(frac.split("e")[0]) <= 10, text


async def test_an_exact_repeat_of_a_call_ends_the_list(embedded_runner):
    """With a required call and parallel_tool_calls unset (or true) a small model repeats the
    same call until the list's bound: "Make the garage brighter." four times, which Home
    Assistant would run four times. A call equal to one before it (the same name and the same
    arguments) ends the list, unstreamed and streamed (a call named as an earlier one is held
    until its arguments close), and the model stops there (it wrote on to the bound). Here every call of the tool is the same call (its arguments
    are constants), so each answer with more than one call's worth of tokens repeated one."""
    import openai
    garage = [{"type": "function", "function": {"name": "HassLightSet", "description": "Set a light's brightness",
                                                "parameters": {"type": "object", "properties": {
                                                    "name": {"const": "garage"}, "brightness": {"const": 100}},
                                                    "required": ["name", "brightness"]}}}]
    ask = [{"role": "user", "content": "Make the garage brighter."}]
    async with serving(embedded_runner) as http:
        def scenario():
            c = openai.OpenAI(base_url=http.base + "/v1", api_key="none", timeout=120, max_retries=0)
            out = []
            for seed, parallel in [(k, None) for k in range(6)] + [(k, True) for k in range(3)]:
                kw = {} if parallel is None else {"parallel_tool_calls": parallel}
                r = c.chat.completions.create(model="m", messages=ask, tools=garage, tool_choice="required",
                                              temperature=0.8, seed=seed, max_tokens=400, **kw)
                streamed = {}
                for chunk in c.chat.completions.create(model="m", messages=ask, tools=garage, tool_choice="required",
                                                       temperature=0.8, seed=seed, max_tokens=400, stream=True, **kw):
                    for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                        streamed.setdefault(d.index, "")
                        streamed[d.index] += d.function.arguments or ""
                out.append((r.choices[0].finish_reason, r.choices[0].message.tool_calls, r.usage.completion_tokens,
                            streamed))
            return out
        answers = await trio.to_thread.run_sync(scenario)
    one_call = min(used for _, _, used, _ in answers)
    assert any(used > 1.5 * one_call for _, _, used, _ in answers), answers    # (the model did repeat)
    for reason, calls, used, streamed in answers:
        assert reason == "tool_calls" and len(calls) == 1, (used, calls)
        assert used < 3 * one_call, answers   # the model stops at the repeat (a step may take a forced call whole)
        assert json.loads(calls[0].function.arguments) == {"name": "garage", "brightness": 100}
        assert list(streamed) == [0] and json.loads(streamed[0]) == {"name": "garage", "brightness": 100}, streamed


async def test_a_prompt_past_num_ctx_loses_its_middle_as_ollama_cuts_it(embedded_runner):
    """One message (or a /api/generate prompt) longer than `num_ctx` was a 400 here; Ollama
    cuts it and answers. As Ollama's runner: the first tokens and the last stay, the middle
    goes, and X-Edgepaged-Truncated-Tokens (and the last object's `truncated_tokens`) says
    how many; `truncate: "none"` still refuses it."""
    import ollama
    long = "The lighthouse keeper wrote in his log every night. " * 60 + "What is the capital of France?"
    async with serving(embedded_runner) as http:
        def scenario():
            c = ollama.Client(host=http.base, timeout=120)
            opts = {"num_ctx": 128, "num_predict": 8, "temperature": 0}
            chat = c.chat(model=MODEL, messages=[{"role": "user", "content": long}], options=opts)
            gen = c.generate(model=MODEL, prompt=long, options=opts)
            raw = c.generate(model=MODEL, prompt=long, raw=True, options=opts)
            streamed = list(c.chat(model=MODEL, messages=[{"role": "user", "content": long}], options=opts,
                                   stream=True))
            return chat, gen, raw, streamed
        chat, gen, raw, streamed = await trio.to_thread.run_sync(scenario)
        status, headers, body = await afetch(http.base + "/api/chat", {
            "model": MODEL, "messages": [{"role": "user", "content": long}], "stream": False,
            "options": {"num_ctx": 128, "num_predict": 8}})
        assert status == 200 and int(headers["x-edgepaged-truncated-tokens"]) > 100, headers
        assert json.loads(body)["truncated_tokens"] == int(headers["x-edgepaged-truncated-tokens"])
        status, _, body = await afetch(http.base + "/api/generate", {
            "model": MODEL, "prompt": long, "stream": False, "truncate": "none", "options": {"num_ctx": 128}})
        assert status == 400, body
    for answer in (chat, gen, raw):
        assert answer.done and answer.prompt_eval_count + 8 <= 128, answer
    assert streamed[-1].done and streamed[-1].prompt_eval_count + 8 <= 128
