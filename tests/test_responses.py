"""OpenAI's Responses API (issue 37, section 2) with the `openai` package's
`responses.create`: plain and streamed (the event sequence), instructions, text.format
json_schema, max_output_tokens (incomplete), a function-tool round trip (function_call out,
function_call_output in), previous_response_id per caller (store: false keeps nothing; another
caller cannot continue it), and the errors."""
from __future__ import annotations

import json

import trio

from test_http import afetch, serving
from test_structured import WEATHER

FLAT = [{"type": "function", **t["function"]} for t in WEATHER]


async def test_responses_with_the_openai_package(embedded_runner):
    import openai
    async with serving(embedded_runner) as http:
        def scenario():
            c = openai.OpenAI(base_url=http.base + "/v1", api_key="none", timeout=120)
            out = {"plain": c.responses.create(model="x", input="What is the capital of France?", temperature=0,
                                               max_output_tokens=24)}
            out["events"] = list(c.responses.create(model="x", input="What is the capital of France?",
                                                    temperature=0, max_output_tokens=24, stream=True))
            out["short"] = c.responses.create(model="x", input="Tell me a long story.", temperature=0,
                                              max_output_tokens=5)   # (sampled, it could end first)
            out["short_events"] = list(c.responses.create(model="x", input="Tell me a long story.", temperature=0,
                                                          max_output_tokens=5, stream=True))
            out["json"] = c.responses.create(
                model="x", input="Describe Paris as JSON.", temperature=0, max_output_tokens=120,
                instructions="You answer in JSON.",
                text={"format": {"type": "json_schema", "name": "city", "schema": {
                    "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                     "country": {"type": "string", "maxLength": 20}},
                    "required": ["name", "country"]}}})
            call = c.responses.create(model="x", input="What is the weather in Paris?", tools=FLAT,
                                      tool_choice="required", temperature=0, max_output_tokens=80)
            out["call"] = call
            fc = [o for o in call.output if o.type == "function_call"][0]
            out["after"] = c.responses.create(model="x", previous_response_id=call.id, temperature=0,
                                              max_output_tokens=40, tools=FLAT, input=[
                                                  {"type": "function_call_output", "call_id": fc.call_id,
                                                   "output": "21 degrees and sunny"}])
            out["streamed_call"] = list(c.responses.create(model="x", input="Turn on the kitchen light.", tools=FLAT,
                                                           tool_choice="required", temperature=0,
                                                           max_output_tokens=80, stream=True))
            out["unstored"] = c.responses.create(model="x", input="Hi", store=False, max_output_tokens=4)
            try:
                c.responses.create(model="x", previous_response_id=out["unstored"].id, input="again",
                                   max_output_tokens=4)
            except openai.NotFoundError as e:
                out["missing"] = e
            return out
        out = await trio.to_thread.run_sync(scenario)
        # another caller (another client name) cannot continue the first one's response
        status, _, raw = await afetch(http.base + "/v1/responses", {
            "input": "and?", "previous_response_id": out["plain"].id, "user": "someone-else", "max_output_tokens": 4})
        assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"
        for bad in ({"input": 5}, {"input": [{"type": "input_image"}]}, {"input": "x", "text": {"format": "x"}},
                    {"input": "x", "tools": [{"type": "web_search"}]}, {"instructions": 3, "input": "x"}, {}):
            status, _, raw = await afetch(http.base + "/v1/responses", bad)
            assert status == 400 and json.loads(raw)["error"]["message"], (bad, raw)
    plain = out["plain"]
    assert plain.object == "response" and plain.status == "completed" and "Paris" in plain.output_text
    assert plain.usage.input_tokens > 0 and plain.usage.output_tokens > 0 and plain.id.startswith("resp_")
    types = [e.type for e in out["events"]]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = "".join(e.delta for e in out["events"] if e.type == "response.output_text.delta")
    assert deltas == out["events"][-1].response.output_text == plain.output_text
    assert [e.sequence_number for e in out["events"]] == list(range(len(types)))
    assert out["short"].status == "incomplete" and out["short"].incomplete_details.reason == "max_output_tokens"
    assert out["short"].output[0].status == "incomplete"         # the cut message item too, as OpenAI marks it
    done_item = [e for e in out["short_events"] if e.type == "response.output_item.done"][0].item
    assert done_item.status == "incomplete" and out["short_events"][-1].type == "response.incomplete"
    assert out["short_events"][-1].response.output[0].status == "incomplete"
    assert plain.output[0].status == "completed"
    city = json.loads(out["json"].output_text)
    assert set(city) == {"name", "country"}
    call = out["call"]
    calls = [o for o in call.output if o.type == "function_call"]
    assert calls and calls[0].name in ("get_weather", "set_light") and json.loads(calls[0].arguments)
    assert out["after"].status == "completed" and out["after"].previous_response_id == call.id
    stypes = [e.type for e in out["streamed_call"]]
    assert "response.function_call_arguments.delta" in stypes and stypes[-1] == "response.completed"
    done = out["streamed_call"][-1].response
    assert any(o.type == "function_call" for o in done.output)
    assert out["missing"].status_code == 404


async def test_a_lone_surrogate_is_a_400_on_every_door(embedded_runner):
    """The fuzzer's find: `metadata` holding "\\ud800" (an escape JSON parses, but no text) was
    echoed into the Responses answer, whose encoding then failed: a 500, or a stream cut
    short. Every HTTP door now refuses such a body with a 400; an escaped pair (an emoji, as
    Python's json writes it) is text and works."""
    bad = "\ud800" * 3
    async with serving(embedded_runner) as http:
        for path, body in (("/v1/responses", {"input": "hi", "metadata": bad, "max_output_tokens": 2}),
                           ("/v1/responses", {"input": "hi", "metadata": bad, "stream": True}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": bad}]}),
                           ("/api/chat", {"model": "x", "messages": [{"role": "user", "content": bad}]})):
            status, _, raw = await afetch(http.base + path, body)
            assert status == 400 and "surrogate" in raw.decode(), (path, status, raw[:200])
        status, _, raw = await afetch(http.base + "/v1/responses", {"input": "hi \U0001F600", "max_output_tokens": 2})
        assert status == 200, raw
