"""One generation request, whichever door it comes through: its fields, their types and their
rules, defined once (pydantic v2, strict: no "1" taken for 1, no true for 1).

Each door maps its own names onto these (OpenAI's `max_completion_tokens`, Ollama's
`options.num_predict` and `repeat_penalty`, the Responses API's `max_output_tokens`, ...)
and calls `parse`, which gives the protocol's `GenerateRequest` or raises `FieldError`
naming the field, with the code every door answers it with: a wrong type or shape is
`bad_request`, a value out of its range `invalid_params`. `SamplingParams` checks its own
values with the same rules (`check_sampling`), so a request built in code meets them too.
docs/PROTOCOL.md's request table and docs/HTTP.md list these fields (tests/test_schema.py
checks both against `FIELDS`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, StrictBool, StrictInt, StrictStr

from ..common.brief import first_line, names
from ..common.fields import (MAX_LOGIT_BIAS, MAX_PENALTY, MAX_STOP, MAX_TEMPERATURE, MAX_TOP_LOGPROBS,  # noqa: F401
                     MIN_PENALTY, MIN_TEMPERATURE, SAMPLING_FIELDS, FieldError, Sampling, _rule,
                     check_sampling)
from ..common.fields import validate as _validate

MAX_SAMPLES = 8          # n: parallel samples of one prompt
MAX_NAME_LEN = 128
PRIORITIES = ("interactive", "background")


class Request(Sampling):
    """One generation request: the sampling fields, and what to run and how."""
    max_tokens: StrictInt | None = _rule("an integer", "an integer >= 1", ge=1)
    n: StrictInt | None = _rule("an integer", f"an integer in 1..{MAX_SAMPLES}", ge=1, le=MAX_SAMPLES)
    priority: Literal["interactive", "background"] | None = _rule(f"one of {', '.join(PRIORITIES)}",
                                                                  f"one of {', '.join(PRIORITIES)}")
    share_prefix_cache: StrictBool | None = _rule("a boolean", "a boolean")
    speculative: StrictBool | None = _rule("a boolean", "a boolean")
    think: StrictBool | None = _rule("a boolean", "a boolean")
    parallel_tool_calls: StrictBool | None = _rule("a boolean", "a boolean")
    model: StrictStr | None = _rule("a string", f"a name of 1..{MAX_NAME_LEN} characters", min_length=1,
                                    max_length=MAX_NAME_LEN)
    context_limit: StrictInt | None = _rule("an integer", "an integer >= 1", ge=1)
    format: dict | None = _rule("a map with a type (json_object, json_schema, regex, lark)",
                                "a map with a type (json_object, json_schema, regex, lark)")
    tools: list | None = _rule("a list of tools", "a list of tools")
    tool_choice: StrictStr | dict | None = _rule("a string or a map", "auto, none, required or a function")
    truncate: Any = _rule("a string", '"auto" or "none"')
    context_policy: Any = _rule("a string", '"full" or "window"')
    keep_alive: Any = _rule("a number of seconds or a duration", 'a number of seconds or a duration ("5m")')


# every field of a generation request, by the schema's (the msgpack protocol's) names
FIELDS = tuple(Request.model_fields)


def validate(data: dict, model: type[BaseModel] | None = None) -> BaseModel:
    """`data` (the schema's names; None values are absent) checked against the rules of
    `model` (default: the whole request) -> the validated model; FieldError for the first
    field that breaks one."""
    return _validate(data, model or Request)


# ---------------------------------------------------------------- the request the front end takes

@dataclass
class GenerateRequest:
    """A `chat` (messages) or `generate` (prompt) request, its fields checked by `parse`
    (the ranges that depend on the model or the server: by the front end)."""
    id: Any
    kind: str
    messages: list[dict] | None = None
    prompt: str | None = None
    max_tokens: int | None = None
    priority: str = "interactive"
    share_prefix_cache: bool = False               # opt in to the household-wide prefix cache
    sampling: dict = field(default_factory=dict)   # SamplingParams keyword arguments (no max_tokens)
    format: dict | None = None    # constrained output: {"type": json_object|json_schema|regex|lark, ...}
    context_limit: int | None = None  # prompt + answer at most this many tokens (Ollama's num_ctx)
    tools: list | None = None      # checked by tools.check_tools (OpenAI's function tools)
    tool_choice: str = "none"      # auto | none | required | a function's name
    parallel_tool_calls: bool | None = None   # None: unset (a few calls at most, tools.MAX_DEFAULT_CALLS)
    n: int = 1                     # parallel samples of the prompt (copy-on-write forks)
    model: str | None = None       # which of the box's models (None: its default)
    keep_alive_s: float | None = None  # how long the model stays loaded after this (-1: always)
    truncate: str | None = None    # "auto": drop the oldest turns (after the system message) to fit
    context_policy: str | None = None  # "full" | "window" (None: the server's)
    think: bool | None = None      # a thinking model thinks (True), or not (False); None: its default
    suffix: str | None = None      # generate: fill in the middle between prompt and suffix (FIM models)
    speculative: bool | None = None    # False: no speculative decoding for it (None: the server's)
    # set by a door, not a field on the wire: the door streams a tool call's name as soon as it is
    # complete (OpenAI's chunks), so the prompt's step drafts no further than the name
    stream_calls: bool = False


def parse(fields: dict, rid: Any, kind: str, *, messages: list | None = None, prompt: str | None = None,
          suffix: str | None = None) -> GenerateRequest:
    """A door's request, its names mapped onto the schema's (`fields`; None: not given),
    checked -> GenerateRequest; FieldError naming the first field that breaks its rule."""
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise FieldError(first_line(str(unknown[0]), 40), f"unknown field(s): {names(unknown)}")
    v = validate(fields)
    req = GenerateRequest(rid, kind, messages=messages, prompt=prompt, suffix=suffix)
    req.sampling = {k: getattr(v, k) for k in SAMPLING_FIELDS if getattr(v, k) is not None}
    for name in ("max_tokens", "format", "context_limit", "model", "think", "speculative", "parallel_tool_calls"):
        setattr(req, name, getattr(v, name))
    req.n = v.n or 1
    req.priority = v.priority or "interactive"
    req.share_prefix_cache = bool(v.share_prefix_cache)
    if v.truncate is not None:
        req.truncate = parse_truncate(v.truncate, kind)
    if v.context_policy is not None:
        req.context_policy = parse_context_policy(v.context_policy)
    if v.keep_alive is not None:
        req.keep_alive_s = parse_keep_alive(v.keep_alive)
    if v.tools is not None or v.tool_choice is not None:
        from .tools import check_choice, check_tools
        try:
            req.tools = check_tools(v.tools) if v.tools is not None else None
        except ValueError as e:
            raise FieldError("tools", str(e)) from None
        try:
            req.tool_choice = check_choice(v.tool_choice, req.tools)
        except ValueError as e:
            raise FieldError("tool_choice", str(e)) from None
    return req


def parse_truncate(value, kind: str = "chat") -> str | None:
    """`truncate`: "auto" or "none"/false; FieldError otherwise. "auto" drops a chat's oldest
    turns, then, if one message or a prompt is still too long, its middle (as Ollama's runner:
    the first tokens and the last stay)."""
    if value in (None, False, "none", "disabled"):
        return None
    if value != "auto":
        raise FieldError("truncate", 'truncate must be "auto" or "none"')
    return "auto"


CONTEXT_POLICIES = ("full", "window")


def parse_context_policy(value) -> str:
    """`context_policy`: "full" (attention over the whole context) or "window" (the server's
    sink + window: out-of-window KV blocks given back, generation past the context)."""
    if value not in CONTEXT_POLICIES:
        raise FieldError("context_policy", 'context_policy must be "full" or "window"')
    return value


def parse_keep_alive(value) -> float:
    """Ollama's keep_alive: seconds (a number), a duration ("30s", "5m", "1h", "1h30m"), or
    negative for always. FieldError (a ValueError) saying what it takes."""
    if isinstance(value, bool):
        raise FieldError("keep_alive", "keep_alive must be a duration (\"5m\") or a number of seconds")
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            pass
    if isinstance(value, int):
        value = float(value) if abs(value) < 2 ** 1000 else (math.inf if value > 0 else -math.inf)
    if isinstance(value, float):
        if math.isnan(value):
            raise FieldError("keep_alive", "keep_alive must be a number of seconds, not NaN")
        return -1.0 if value < 0 or math.isinf(value) else float(value)   # forever: -1
    if isinstance(value, str):
        text = value.strip()
        parts = re.fullmatch(r"(-)?(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?", text)
        if parts and text and any(parts.group(i) for i in (2, 3, 4)):
            if parts.group(1):
                return -1.0
            h, m, sec = (float(parts.group(i) or 0) for i in (2, 3, 4))
            return h * 3600 + m * 60 + sec
    raise FieldError("keep_alive", "keep_alive must be a duration (\"5m\", \"30s\", \"1h\") or a number of seconds; "
                     "negative keeps the model loaded")
