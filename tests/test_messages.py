"""One message model (request/messages.py) every door maps onto: a turn's role, text, images,
tool calls, a tool result's id and name. Each door parses its own shapes into it; what a
conversation may hold is checked once, and images are refused in one place, with one
message, whichever door they come through."""
from __future__ import annotations

import json

import pytest

from edgepaged.request.messages import Image, Message, MessageError, ToolCall, from_map, template_maps

from test_http import afetch, serving

PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


def test_a_message_checks_itself_and_renders_for_a_template():
    m = from_map({"role": "assistant", "content": None,
                  "tool_calls": [{"function": {"name": "lights", "arguments": '{"on": true}'}}]}, 2)
    assert m.tool_calls == (ToolCall("call_2_0", "lights", '{"on": true}'),)
    assert m.template() == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_2_0", "type": "function", "function": {"name": "lights", "arguments": '{"on": true}'}}]}
    tool = from_map({"role": "tool", "content": "done", "tool_call_id": "call_2_0", "tool_name": "lights"}, 3)
    assert tool.template() == {"role": "tool", "content": "done", "tool_call_id": "call_2_0", "name": "lights"}
    with pytest.raises(MessageError, match=r"messages\[1\]\.tool_calls must be a list, on an assistant"):
        from_map({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "a"}}]}, 1)
    with pytest.raises(MessageError, match=r"messages\[0\]\.tool_calls\[0\] must have function.name"):
        from_map({"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}, 0)
    with pytest.raises(MessageError, match=r"messages\[4\]\.tool_call_id must be a string"):
        from_map({"role": "tool", "content": "x", "tool_call_id": 5}, 4)
    with pytest.raises(MessageError, match="role must be a string"):
        Message("", "x")
    assert template_maps([Message("user", "hi")]) == [{"role": "user", "content": "hi"}]
    assert template_maps([Message("user", "b", (Image(b64=PNG),))]) == [
        {"role": "user", "content": "b", "images": (Image(b64=PNG),)}]     # for the front end to check


async def test_every_door_maps_images_onto_the_model_and_refuses_them_alike(embedded_runner):
    """OpenAI's image_url part, Ollama's chat and generate `images`, the Responses API's
    input_image: the same refusal, from the same place (the front end, once the model is known:
    it names the model, as Ollama does), in each door's error shape; a text part beside them
    was parsed (the refusal names images, not the part)."""

    model = "SmolLM2-135M-Instruct.Q4_1"
    async with serving(embedded_runner) as http:
        cases = [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}]}]},
             lambda b: b["error"]["message"]),
            ("/api/chat", {"model": model, "stream": False, "messages": [{"role": "user", "content": "What is this?",
                                                                          "images": [PNG]}]}, lambda b: b["error"]),
            ("/api/generate", {"model": model, "stream": False, "prompt": "What is this?", "images": [PNG]},
             lambda b: b["error"]),
            ("/v1/responses", {"input": [{"role": "user", "content": [
                {"type": "input_text", "text": "What is this?"},
                {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"}]}]},
             lambda b: b["error"]["message"]),
        ]
        for path, body, error in cases:
            status, _, raw = await afetch(http.base + path, body)
            assert status == 400, (path, raw)
            msg = error(json.loads(raw))
            assert f"{model} does not take images: it is a text-only model" in msg, (path, raw)
        # a part that is neither text nor an image is the door's own refusal
        status, _, raw = await afetch(http.base + "/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]})
        assert status == 400 and "only text parts" in json.loads(raw)["error"]["message"]
