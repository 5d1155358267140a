"""The OpenAI-compatible API, as plain data: request bodies in, response bodies out.

Bodies of `POST /v1/chat/completions` and `POST /v1/completions` become the protocol's
`GenerateRequest` (so the front end builds engine requests from them exactly as from the
msgpack protocol's frames), and engine events become OpenAI's response objects and
stream chunks. No HTTP here: `httpd.py` does the serving.

Fields this server cannot honour (`best_of`, the deprecated `functions`, ...) are refused
with a 400 naming them, never silently ignored; fields it does not know are ignored, as
OpenAI-compatible servers do, since clients send many (docs/HTTP.md lists them).
`response_format` (json_object, json_schema) and vLLM's `guided_json`, `guided_regex` and
`guided_grammar` (Lark) constrain the output (constrain/grammar.py).
"""
from __future__ import annotations

import json
import time
import uuid

from ...request import jsontext, schema
from ...request.protocol import MAX_MESSAGES, MAX_NAME_LEN, GenerateRequest
from ...request.schema import FieldError
from ...request.messages import Image, from_map, template_maps
from .base import ERROR_TYPES, STATUS, ApiError, Generation, bad, error_body  # noqa: F401 (the doors' shared shapes)

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions (chat: up to the context)


# ---------------------------------------------------------------- requests

def _refuse_unsupported(body: dict) -> None:
    """Features whose non-default values this server cannot honour."""
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise bad("best_of is not supported", "best_of", "invalid_params")
    if body.get("functions") or body.get("function_call"):
        raise bad("functions (the deprecated form) are not supported: send tools", "functions", "invalid_params")
    if body.get("echo"):
        raise bad("echo is not supported", "echo", "invalid_params")
    if body.get("suffix") is not None and not isinstance(body["suffix"], str):
        raise bad("suffix must be a string (fill in the middle)", "suffix", "invalid_params")


# the schema's fields this door takes under the same names (schema.py has their rules)
SAME_NAMES = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "top_k",
              "seed", "ignore_eos", "stop", "logit_bias", "stop_token_ids", "n", "share_prefix_cache", "speculative",
              "priority", "truncate", "context_policy", "parallel_tool_calls", "tools", "tool_choice")


def _fields(body: dict, default_max_tokens: int | None) -> dict:
    """The body's generation fields under the schema's names (None: not given)."""
    f = {name: body.get(name) for name in SAME_NAMES}
    f["model"] = body.get("model") or None
    if f["stop"] == [] or f["logit_bias"] == {}:      # empty: none
        f["stop"] = f["stop"] or None
        f["logit_bias"] = f["logit_bias"] or None
    f["tools"] = body.get("tools") or None
    f["format"] = output_format(body)
    for name in ("max_completion_tokens", "max_tokens"):   # the newer name wins
        if body.get(name) is not None:
            f["max_tokens"] = body[name]
            break
    else:
        f["max_tokens"] = default_max_tokens
    return f


def _request(body: dict, fields: dict, rid: str, kind: str, **text) -> GenerateRequest:
    """The schema's request, its FieldError as a 400 naming this door's field."""
    try:
        return schema.parse(fields, rid, kind, **text)
    except FieldError as e:
        raise ApiError(400, e.message, e.code, _param(body, e.field)) from None


def _param(body: dict, name: str | None) -> str | None:
    """The schema's field `name` as this door calls it (an error's `param`)."""
    if name == "max_tokens" and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    if name == "logprobs" and body.get("top_logprobs") is not None:
        return "top_logprobs"
    return {"format": "response_format", "think": "chat_template_kwargs"}.get(name, name)


def output_format(body: dict) -> dict | None:
    """The output constraint of an OpenAI body (response_format, or vLLM's guided_* fields)
    as the neutral format spec, or None."""
    given = [name for name in ("response_format", "guided_json", "guided_regex", "guided_grammar")
             if body.get(name) is not None and not (name == "response_format" and isinstance(body[name], dict)
                                                    and body[name].get("type") == "text")]
    if len(given) > 1:
        raise bad(f"give one output format, not {' and '.join(given)}", given[1], "invalid_params")
    if not given:
        return None
    name, value = given[0], body[given[0]]
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = jsontext.loads(value, "guided_json")
            except jsontext.TooDeep as e:
                raise bad(str(e), name, "invalid_params") from None
            except ValueError as e:
                raise bad(f"guided_json is not valid JSON: {e}", name, "invalid_params") from None
        if not isinstance(value, dict):
            raise bad("guided_json must be a JSON schema (an object)", name, "invalid_params")
        return {"type": "json_schema", "schema": value}
    if name in ("guided_regex", "guided_grammar"):
        if not isinstance(value, str) or not value:
            raise bad(f"{name} must be a non-empty string", name, "invalid_params")
        return {"type": "regex", "pattern": value} if name == "guided_regex" else {"type": "lark", "grammar": value}
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad("response_format json_schema needs json_schema.schema (an object)", name, "invalid_params")
        return {"type": "json_schema", "schema": schema}
    raise bad("response_format type must be text, json_object or json_schema", name, "invalid_params")


def _answer(body: dict, gen: Generation) -> None:
    """How to answer: streamed, usage, the fairness identity."""
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream")
    gen.stream = bool(stream)
    gen.item.stream_calls = gen.stream and gen.chat
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
            raise bad("stream_options must be an object like {\"include_usage\": true}", "stream_options")
        gen.include_usage = gen.stream and opts.get("include_usage", False)
    user = body.get("user")
    if isinstance(user, str) and 0 < len(user) <= MAX_NAME_LEN:
        gen.user = user


def _content(content, i: int) -> tuple[str, tuple[Image, ...]]:
    """OpenAI's content: a string, or parts (text; image_url) -> (text, images)."""
    if isinstance(content, str):
        return content, ()
    if content is None:
        return "", ()
    if isinstance(content, list):
        parts, images = [], []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind == "image_url" and isinstance(part.get("image_url"), dict) and \
                    isinstance(part["image_url"].get("url"), str):
                images.append(Image(url=part["image_url"]["url"]))
            else:
                raise bad(f"messages[{i}].content: only text parts are supported (and image_url parts, for a "
                          "model that takes images)", f"messages[{i}].content")
        return "\n".join(parts), tuple(images)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def parse_chat(body: dict, rid: str) -> Generation:
    if body.get("suffix"):
        raise bad("suffix (fill in the middle) is for /v1/completions", "suffix", "invalid_params")
    messages = body.get("messages")
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        raise bad(f"messages must be a list of 1..{MAX_MESSAGES} messages", "messages")
    msgs = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}", f"messages[{i}].role")
        text, images = _content(m.get("content"), i)
        try:
            msgs.append(from_map({**m, "role": ROLES[m["role"]]}, i, text, images))
        except ValueError as e:
            raise bad(str(e), f"messages[{i}]") from None
    out = template_maps(msgs)
    _refuse_unsupported(body)
    fields = _fields(body, None)
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp not in (None, False):
        if lp is not True:
            raise bad("logprobs must be a boolean (top_logprobs: how many alternatives)", "logprobs")
        fields["logprobs"] = 0 if top is None else top
    elif top:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    kw = body.get("chat_template_kwargs")    # vLLM's: only the thinking switch is taken
    if kw is not None:
        if not isinstance(kw, dict):
            raise bad("chat_template_kwargs must be an object", "chat_template_kwargs")
        fields["think"] = kw.get("enable_thinking")
    item = _request(body, fields, rid, "chat", messages=out)
    gen = Generation(item, chat=True)
    _answer(body, gen)
    fmt = body.get("reasoning_format", "none")   # llama.cpp's: "none" keeps <think>…</think> in content
    if fmt not in ("none", "auto", "deepseek"):
        raise bad('reasoning_format must be "none", "auto" or "deepseek"', "reasoning_format")
    gen.reasoning = fmt != "none"
    return gen


def parse_completion(body: dict, rid: str) -> Generation:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad("prompt must be a string (one prompt per request)", "prompt")
    _refuse_unsupported(body)
    fields = _fields(body, COMPLETIONS_DEFAULT_MAX_TOKENS)
    fields["logprobs"] = body.get("logprobs")
    item = _request(body, fields, rid, "generate", prompt=prompt, suffix=body.get("suffix") or None)
    gen = Generation(item, chat=False)
    _answer(body, gen)
    return gen


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


# ---------------------------------------------------------------- responses

def usage(u: dict) -> dict:
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)}}


def _token_text(tokenizer, tid: int) -> str:
    return tokenizer.decode([tid], skip_special_tokens=False)


class Logprobs:
    """A request's logprobs in OpenAI's shapes (chat: `content` entries; completions: the
    legacy parallel lists), from the engine's per-token infos."""

    def __init__(self, tokenizer, chat: bool):
        self.tok, self.chat = tokenizer, chat
        self.offset = 0

    def entry(self, tid: int, info: dict) -> dict:
        text = _token_text(self.tok, tid)
        return {"token": text, "logprob": info["logprob"], "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := _token_text(self.tok, i)), "logprob": lp, "bytes": list(t.encode())}
                                 for i, lp in info["top"]]}

    def of(self, ids: list[int], infos: list[dict]) -> dict:
        entries = [self.entry(i, info) for i, info in zip(ids, infos)]
        if self.chat:
            return {"content": entries}
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}


class Shaper:
    """Builds one request's response objects (same id, creation time and model throughout);
    streamed as server-sent events ending in [DONE]."""

    media_type = "text/event-stream; charset=utf-8"
    trailer = b"data: [DONE]\n\n"

    @staticmethod
    def frame(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

    @staticmethod
    def error_chunk(err: ApiError) -> dict:
        return {"error": err.body()["error"]}

    @staticmethod
    def error_body(err: ApiError) -> dict:
        return err.body()

    streams_calls = True      # tool calls go out as they are written (call_chunk)
    shapes_logprobs = True    # OpenAI's logprobs objects (Logprobs)

    def __init__(self, gen: Generation, model: str, ticket=None):
        self.gen, self.model = gen, model
        self.sent_calls = 0   # calls whose name went out already (their arguments follow as written)
        self.id = gen.item.id
        self.created = int(time.time())
        # reasoning_format asked and a thinking model's answer: its thinking in reasoning_content
        # (one answer: parallel samples keep it in content)
        self.splits_thinking = gen.reasoning and ticket is not None and not ticket.req.children

    def _envelope(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice_end(self, done, calls=None) -> dict:
        c = {"finish_reason": "tool_calls" if calls or self.sent_calls else
             done.finish_reason if done.finish_reason in ("stop", "length") else "stop"}
        if done.stop is not None:
            c["stop_reason"] = done.stop   # which stop string / token ended it (a vLLM extension)
        return c

    def full_n(self, answers: list) -> dict:
        """The non-streamed answer of parallel samples: answers[k] = (text, done, logprobs, calls)."""
        bodies = [self.full(text, done, calls, lp) for text, done, lp, calls in answers]
        choices = []
        for k, b in enumerate(bodies):
            choices.append({**b["choices"][0], "index": k})
        prompt = answers[0][1].usage["prompt_tokens"]
        completion = sum(a[1].usage["completion_tokens"] for a in answers)
        return {**bodies[0], "choices": choices, "usage": {
            "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": answers[0][1].usage.get("cached_tokens", 0)}}}

    def full(self, text: str, done, calls=None, logprobs=None, thinking: str = "") -> dict:
        """The non-streamed answer (`calls`: the tool calls parsed out of it; `logprobs`: the
        shaped logprobs, or None; `thinking`: a thinking model's, apart)."""
        if self.gen.chat:
            message = {"role": "assistant", "content": text if text or not calls else None}
            if thinking:
                message["reasoning_content"] = thinking
            if calls:
                message["tool_calls"] = openai_calls(calls)
            choice = {"index": 0, "message": message, "logprobs": logprobs}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs}
            obj = "text_completion"
        choice.update(self._choice_end(done, calls))
        return {**self._envelope(obj), "choices": [choice], "usage": usage(done.usage)}

    def _chunk(self, choice: dict | None, usage_value=None) -> dict:
        obj = "chat.completion.chunk" if self.gen.chat else "text_completion"
        out = {**self._envelope(obj), "choices": [choice] if choice is not None else []}
        if self.gen.include_usage:
            out["usage"] = usage_value
        return out

    def usage_chunk(self, u: dict) -> dict:
        """The chunk that closes n samples' stream with their usage (include_usage)."""
        return self._chunk(None, usage(u))

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant role."""
        if not self.gen.chat:
            return None
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def text_chunk(self, text: str, thinking: str = "", logprobs=None) -> dict | None:
        """A piece of the answer (None: nothing to give out)."""
        if not text and not thinking and logprobs is None:
            return None
        if self.gen.chat:
            delta = {"content": text}
            if thinking:
                delta["reasoning_content"] = thinking
            return self._chunk({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None})
        return self._chunk({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None})

    def call_chunk(self, k: int, part: dict) -> dict | None:
        """A tool call as it is written (`ToolStream.deltas`): its id, type and name first, then
        pieces of its arguments (OpenAI's client joins them by index)."""
        if "name" in part:
            self.sent_calls = max(self.sent_calls, k + 1)
            tc = {"index": k, "id": part["id"], "type": "function", "function": {"name": part["name"], "arguments": ""}}
        elif part.get("arguments"):
            tc = {"index": k, "function": {"arguments": part["arguments"]}}
        else:
            return None
        return self._chunk({"index": 0, "delta": {"tool_calls": [tc]}, "logprobs": None, "finish_reason": None})

    def last_chunks(self, done, calls=None) -> list[dict]:
        out = []
        rest = (calls or [])[self.sent_calls:]
        if rest:    # calls not streamed already: each whole in one delta (the client joins deltas by index)
            out.append(self._chunk({"index": 0, "delta": {"tool_calls": [
                {"index": self.sent_calls + k, **c} for k, c in enumerate(openai_calls(rest))]}, "logprobs": None,
                "finish_reason": None}))
        choice = {"index": 0, "delta": {}, "logprobs": None} if self.gen.chat else \
            {"index": 0, "text": "", "logprobs": None}
        choice.update(self._choice_end(done, calls))
        out.append(self._chunk(choice))
        if self.gen.include_usage:
            out.append(self._chunk(None, usage(done.usage)))
        return out


def openai_calls(calls: list[dict]) -> list[dict]:
    return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls]


def done_error(done) -> ApiError | None:
    """The error a finished request reports instead of an answer (shutdown, failed step)."""
    if done.finish_reason in ("stop", "length"):
        return None
    err = done.error or {"code": "shutdown" if done.finish_reason == "cancelled" else "internal_error",
                         "message": f"the request ended: {done.finish_reason}"}
    return ApiError(STATUS.get(err["code"], 500), err["message"], err["code"])


def models_list(name: str, context_length: int, created: int, others: list[dict] = ()) -> dict:
    """The served model, or (`others`: the model set's listing) every model of the box."""
    if others:
        return {"object": "list", "data": [{**model_card(m["name"], m["context_length"], created),
                                            "loaded": m["loaded"]} for m in others]}
    return {"object": "list", "data": [model_card(name, context_length, created)]}


def model_card(name: str, context_length: int, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "edgepaged",
            "max_model_len": context_length}
