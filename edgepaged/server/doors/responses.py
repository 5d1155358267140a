"""OpenAI's Responses API (`POST /v1/responses`) as a door over the chat path.

A Responses body is mapped onto a chat-completions body and validated by that door's parser
(`openai.parse_chat`: one set of rules): `instructions` becomes the system message, `input`
(a string, or items: messages, `function_call`, `function_call_output`) the conversation,
`tools` (flat function tools) OpenAI's chat tools, `text.format` the response format,
`max_output_tokens` the answer's limit. `previous_response_id` continues a stored response of
the same caller (`ResponseStore`: in memory, per identity, bounded, expiring; `store: false`
keeps nothing). The answer is a `response` object (`output`: a message and/or
`function_call` items; `status` `incomplete` at the length limit), or, streamed, its event
sequence: `response.created`, `response.in_progress`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`…, the `.done` events,
`function_call` items with `response.function_call_arguments.delta`/`.done`, and
`response.completed` with the usage.
"""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from ...request.messages import Image, Message, MessageError, ToolCall, template_maps
from .base import ApiError, Generation, bad
from .openai import parse_chat

TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class ResponsesGeneration(Generation):
    response_id: str = ""
    body: dict = field(default_factory=dict)        # what the response object echoes
    messages: list = field(default_factory=list)    # the whole conversation it answers (stored after)
    store: bool = True
    previous_response_id: str | None = None


def _content(content, where: str) -> tuple[str, tuple[Image, ...]]:
    """An input message's content: a string, or parts (text; input_image) -> (text, images)."""
    if content is None:
        return "", ()
    if isinstance(content, str):
        return content, ()
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of parts", where)
    out, images = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            images.append(Image(url=part["image_url"]))
        else:
            raise bad(f"{where}.content[{j}] must be a text part ({', '.join(TEXT_PARTS)}) or an input_image with "
                      "an image_url; this server takes no files", where)
    return "".join(out), tuple(images)


def _as_chat(m: dict) -> dict:
    """A template map with images as the chat door's message (its image_url parts)."""
    if not m.get("images"):
        return m
    m = dict(m)
    parts = [{"type": "text", "text": m.get("content") or ""}]
    parts += [{"type": "image_url", "image_url": {"url": i.url or f"data:image/png;base64,{i.b64}"}}
              for i in m.pop("images")]
    return {**m, "content": parts}


def input_messages(items) -> list[dict]:
    """`input` -> chat messages (consecutive function calls become one assistant turn), each
    through the one message model (request/messages.py)."""
    try:
        return template_maps(_messages(items))
    except MessageError as e:
        raise bad(str(e), "input") from None


def _messages(items) -> list[Message]:
    if isinstance(items, str):
        return [Message("user", items, where="input")]
    if not isinstance(items, list):
        raise bad("input must be a string or a list of items", "input")
    out: list[Message] = []
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad(f"{where} must be an object", where)
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"{where}.role must be user, assistant, system or developer", where)
            text, images = _content(it.get("content"), where)
            out.append(Message(role, text, images, where=where))
        elif kind == "function_call":
            call_id, name, args = it.get("call_id"), it.get("name"), it.get("arguments", "{}")
            if not all(isinstance(x, str) for x in (call_id, name, args)):
                raise bad(f"{where}: a function_call needs call_id, name and arguments (strings)", where)
            call = ToolCall(call_id, name, args)
            if out and out[-1].role == "assistant" and out[-1].tool_calls and not out[-1].text:
                out[-1].tool_calls += (call,)
            else:
                out.append(Message("assistant", "", tool_calls=(call,), where=where))
        elif kind == "function_call_output":
            call_id, output = it.get("call_id"), it.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise bad(f"{where}: a function_call_output needs call_id and output (strings)", where)
            out.append(Message("tool", output, tool_call_id=call_id, where=where))
        else:
            raise bad(f"{where}.type {kind!r} is not supported (message, function_call, function_call_output)",
                      where)
    return out


def _tools(tools) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad(f"tools[{i}]: only function tools are supported", "tools")
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        out.append({"type": "function", "function": fn})
    return out


def _choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad('tool_choice must be "auto", "none", "required" or {"type": "function", "name": …}',
                      "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _format(text):
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad("text must be an object (text.format)", "text")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict):
        raise bad("text.format must be an object", "text.format")
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "answer"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    raise bad("text.format.type must be text, json_object or json_schema", "text.format")


def parse_responses(body: dict, rid: str, history: list | None = None) -> ResponsesGeneration:
    """A Responses body (and the stored conversation of `previous_response_id`) -> the chat
    door's request, validated by its parser."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions must be a string", "instructions")
    if "input" not in body:
        raise bad("input is required", "input")
    messages = [m for m in (history or []) if m["role"] != "system"]
    messages += input_messages(body["input"])
    if instructions:        # this request's instructions only: a previous one's are not carried over
        messages = [{"role": "system", "content": instructions}] + messages
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise bad("store must be a boolean", "store")
    chat = {"messages": [_as_chat(m) for m in messages], "stream": body.get("stream", False)}
    for theirs, ours in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("parallel_tool_calls", "parallel_tool_calls"), ("user", "user"), ("seed", "seed"),
                         ("top_logprobs", None), ("speculative", "speculative")):
        if body.get(theirs) is not None and ours is not None:
            chat[ours] = body[theirs]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _choice(body["tool_choice"])
    fmt = _format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    g = parse_chat(chat, rid)
    gen = ResponsesGeneration(g.item, chat=True, stream=g.stream, user=g.user, warnings=g.warnings,
                              response_id="resp_" + uuid.uuid4().hex, body=body, messages=messages, store=store,
                              previous_response_id=body.get("previous_response_id"))
    return gen


class ResponseStore:
    """Stored responses' conversations, for `previous_response_id`: per identity (a caller
    never reaches another's), at most `per_identity` each and `total` in all (the least
    recently used go), `max_bytes` of conversations in all, each for `ttl_s` after it was
    last used."""

    def __init__(self, per_identity: int = 64, total: int = 1024, ttl_s: float = 3600.0, max_bytes: int = 64 << 20):
        self.per_identity, self.total, self.ttl_s, self.max_bytes = per_identity, total, ttl_s, max_bytes
        self.items: OrderedDict = OrderedDict()     # (identity key, response id) -> (expires, messages, bytes)
        self.bytes = 0

    def _drop(self, key) -> None:
        self.bytes -= self.items.pop(key)[2]

    def _expire(self) -> None:
        now = time.monotonic()
        for k in [k for k, v in self.items.items() if v[0] < now]:
            self._drop(k)

    def get(self, who, response_id: str) -> list | None:
        self._expire()
        hit = self.items.get((who, response_id))
        if hit is None:
            return None
        self.items[(who, response_id)] = (time.monotonic() + self.ttl_s, *hit[1:])
        self.items.move_to_end((who, response_id))
        return hit[1]

    def put(self, who, response_id: str, messages: list) -> None:
        self._expire()
        size = len(json.dumps(messages, ensure_ascii=False,      # (an image counts its text)
                              default=lambda o: (o.b64 or o.url or "") if isinstance(o, Image) else str(o)))
        if size > self.max_bytes // 8:       # one conversation may take an eighth of the room at most
            return
        self.items[(who, response_id)] = (time.monotonic() + self.ttl_s, messages, size)
        self.bytes += size
        mine = [k for k in self.items if k[0] == who]
        for k in mine[: max(0, len(mine) - self.per_identity)]:
            self._drop(k)
        while len(self.items) > self.total or self.bytes > self.max_bytes:
            self._drop(next(iter(self.items)))


class ResponsesShaper:
    """One request's Responses objects; streamed as server-sent events with event names and
    sequence numbers. `remember(messages)` is called with the conversation and its answer
    once the response is complete (when the request asked to store it)."""

    media_type = "text/event-stream; charset=utf-8"
    trailer = b""
    splits_thinking = False     # the answer's text as the model wrote it
    streams_calls = False       # calls come whole at the end
    shapes_logprobs = False

    def __init__(self, gen: ResponsesGeneration, model: str, ticket=None, remember=None):
        self.gen, self.model, self.remember = gen, model, remember
        self.created = int(time.time())
        self.seq = 0
        self.text = ""
        self.msg_id = "msg_" + uuid.uuid4().hex
        self.opened = False

    # -- the response object ------------------------------------------------------------------
    def _response(self, status: str, output: list, usage=None, incomplete=None) -> dict:
        b = self.gen.body
        return {"id": self.gen.response_id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": incomplete, "instructions": b.get("instructions"),
                "max_output_tokens": b.get("max_output_tokens"), "model": self.model, "output": output,
                "parallel_tool_calls": b.get("parallel_tool_calls", True),
                "previous_response_id": self.gen.previous_response_id, "reasoning": {"effort": None,
                                                                                      "summary": None},
                "store": self.gen.store, "temperature": b.get("temperature", 1.0),
                "text": b.get("text") or {"format": {"type": "text"}}, "tool_choice": b.get("tool_choice", "auto"),
                "tools": b.get("tools") or [], "top_p": b.get("top_p", 1.0), "truncation": "disabled",
                "usage": usage, "user": b.get("user"), "metadata": b.get("metadata") or {}}

    def _message(self, text: str, status: str = "completed") -> dict:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed"
                or text else []}

    @staticmethod
    def _call(c: dict) -> dict:
        return {"type": "function_call", "id": "fc_" + c["id"].removeprefix("call_"), "call_id": c["id"],
                "name": c["name"], "arguments": c["arguments"], "status": "completed"}

    @staticmethod
    def _usage(u: dict) -> dict:
        return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": u.get("cached_tokens",
                                                                                                     0)},
                "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}

    def _final(self, text: str, done, calls) -> dict:
        length = done.finish_reason == "length"   # (OpenAI marks the cut message incomplete too)
        output = ([self._message(text, "incomplete" if length else "completed")] if text or not calls else []) \
            + [self._call(c) for c in calls or []]
        if self.remember is not None and self.gen.store:
            answer = {"role": "assistant", "content": text}
            if calls:
                answer["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                    "name": c["name"], "arguments": c["arguments"]}} for c in calls]
            self.remember(self.gen.response_id, self.gen.messages + [answer])
        return self._response("incomplete" if length else "completed", output, self._usage(done.usage),
                              {"reason": "max_output_tokens"} if length else None)

    # -- the door's interface (base.Shaper) ----------------------------------------------------
    def full(self, text: str, done, calls=None, logprobs=None, thinking: str = "") -> dict:
        return self._final(text, done, calls)

    def error_body(self, err: ApiError) -> dict:
        return err.body()

    def error_chunk(self, err: ApiError) -> dict:
        return {"type": "error", "code": err.code, "message": err.message, "param": None}

    def frame(self, obj) -> bytes:
        if isinstance(obj, list):
            return b"".join(self.frame(o) for o in obj)
        obj = {**obj, "sequence_number": self.seq}
        self.seq += 1
        return (f"event: {obj['type']}\ndata: ".encode()
                + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")

    def call_chunk(self, k: int, part: dict) -> None:
        """A call's pieces are not streamed here: each call is an output item at the end."""
        return None

    def first_chunk(self) -> list:
        r = self._response("in_progress", [])
        return [{"type": "response.created", "response": r}, {"type": "response.in_progress", "response": r}]

    def _open(self) -> list:
        self.opened = True
        return [{"type": "response.output_item.added", "output_index": 0, "item": self._message("", "in_progress")},
                {"type": "response.content_part.added", "item_id": self.msg_id, "output_index": 0,
                 "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}]

    def text_chunk(self, text: str, thinking: str = "", logprobs=None):
        if not text:
            return None
        out = [] if self.opened else self._open()
        self.text += text
        out.append({"type": "response.output_text.delta", "item_id": self.msg_id, "output_index": 0,
                    "content_index": 0, "delta": text})
        return out

    def last_chunks(self, done, calls=None) -> list:
        out = []
        if self.opened or not calls:
            if not self.opened:
                out += self._open()
            part = {"type": "output_text", "text": self.text, "annotations": []}
            out += [{"type": "response.output_text.done", "item_id": self.msg_id, "output_index": 0,
                     "content_index": 0, "text": self.text},
                    {"type": "response.content_part.done", "item_id": self.msg_id, "output_index": 0,
                     "content_index": 0, "part": part},
                    {"type": "response.output_item.done", "output_index": 0,
                     "item": self._message(self.text, "incomplete" if done.finish_reason == "length" else "completed")}]
        first = 1 if out else 0
        for k, c in enumerate(calls or []):
            item = self._call(c)
            at = first + k
            out += [{"type": "response.output_item.added", "output_index": at,
                     "item": {**item, "arguments": "", "status": "in_progress"}},
                    {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": at,
                     "delta": item["arguments"]},
                    {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": at,
                     "arguments": item["arguments"]},
                    {"type": "response.output_item.done", "output_index": at, "item": item}]
        final = self._final(self.text, done, calls)
        out.append({"type": "response.completed" if final["status"] == "completed" else "response.incomplete",
                    "response": final})
        return out
