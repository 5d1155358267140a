"""One request schema (edgepaged/request/schema.py): every door maps its names onto it and answers a
field that breaks a rule with the same code and the same rule; the docs' field tables list
its fields."""
import re
from pathlib import Path

import pytest

from edgepaged.request import schema
from edgepaged.request.protocol import ProtocolError, parse
from edgepaged.server.doors import ollama as ollama_api, openai as openai_api

ROOT = Path(__file__).resolve().parents[1]
HI = [{"role": "user", "content": "hi"}]

# (the schema's field, a value, the code every door answers with)
BAD = [
    ("temperature", "hot", "bad_request"), ("temperature", -1, "invalid_params"),
    ("temperature", True, "bad_request"), ("top_p", 0, "invalid_params"), ("top_k", 1.5, "bad_request"),
    ("top_k", -1, "invalid_params"), ("min_p", 2, "invalid_params"), ("seed", -3, "invalid_params"),
    ("repetition_penalty", 1000, "invalid_params"), ("presence_penalty", 3, "invalid_params"),
    ("frequency_penalty", "x", "bad_request"), ("stop", [""], "invalid_params"), ("stop", [1], "bad_request"),
    ("stop", ["x"] * 17, "bad_request"), ("stop_token_ids", [-1], "invalid_params"),
    ("stop_token_ids", ["a"], "bad_request"), ("logit_bias", {"5": 101}, "invalid_params"),
    ("logit_bias", {"a": 1}, "bad_request"), ("max_tokens", 0, "invalid_params"), ("max_tokens", 1.5, "bad_request"),
    ("n", 9, "invalid_params"), ("n", 0, "invalid_params"), ("priority", "urgent", "bad_request"),
    ("speculative", "yes", "bad_request"), ("share_prefix_cache", 1, "bad_request"),
    ("truncate", "sometimes", "bad_request"), ("context_policy", "all", "bad_request"),
    ("ignore_eos", "no", "bad_request"),
]
# the same field under each door's name: None where the door has no such field
OLLAMA_OPTIONS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
                  "repetition_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
                  "frequency_penalty": "frequency_penalty", "stop": "stop", "max_tokens": "num_predict"}
OLLAMA_TOP = {"speculative", "truncate", "context_policy"}


def _msgpack(field, value):
    try:
        parse({"type": "chat", "id": 1, "messages": HI, field: value})
    except ProtocolError as e:
        return e.code, e.message
    return None


def _openai(field, value):
    try:
        openai_api.parse_chat({"messages": HI, field: value}, "chatcmpl-x")
    except openai_api.ApiError as e:
        return e.code, e.message
    return None


def _ollama(field, value):
    body = {"model": "m", "messages": HI}
    if field in OLLAMA_OPTIONS:
        body["options"] = {OLLAMA_OPTIONS[field]: value}
    elif field in OLLAMA_TOP:
        body[field] = value
    else:
        return "absent"
    try:
        ollama_api.parse_chat(body, "x")
    except ollama_api.OllamaError as e:
        return e.code, e.message
    return None


@pytest.mark.parametrize("field, value, code", BAD, ids=[f"{f}={v!r}"[:40] for f, v, _ in BAD])
def test_every_door_answers_a_broken_rule_alike(field, value, code):
    """The msgpack frame, the OpenAI body and the Ollama body (where the door has the field):
    the same code, and the same rule named in the message."""
    want = _msgpack(field, value)
    assert want is not None and want[0] == code, want
    rule = want[1].split(" must ", 1)[1]
    got = _openai(field, value)
    assert got is not None and got[0] == code and got[1].endswith(rule), got
    got = _ollama(field, value)
    if got == "absent":
        return
    if field == "max_tokens" and isinstance(value, (int, float)) and value <= 0:
        assert got is None            # Ollama's num_predict <= 0: up to the context
        return
    assert got is not None and got[0] == code and got[1].endswith(rule), got


def test_an_empty_stop_string_is_the_same_error_on_every_door():
    """The issue's example: it was invalid_params on msgpack and bad_request on OpenAI."""
    assert _msgpack("stop", [""])[0] == _openai("stop", [""])[0] == _ollama("stop", [""])[0] == "invalid_params"


def test_sampling_params_built_in_code_meet_the_same_rules():
    from edgepaged.model.params import SamplingParams
    for field, value, _ in BAD:
        if field in schema.SAMPLING_FIELDS or field == "max_tokens":
            if field == "logit_bias":
                value = {int(k) if k.isdigit() else k: v for k, v in value.items()}
            with pytest.raises(ValueError, match=f"^{field} must"):
                SamplingParams(**{field: value})


def _table_fields(text: str, header: str) -> set:
    """The backticked names in the first column of the table after `header`."""
    start = text.index(header)
    names = set()
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        names |= set(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
    return names


def test_the_protocol_doc_lists_the_schema_s_fields():
    text = (ROOT / "docs" / "PROTOCOL.md").read_text()
    documented = _table_fields(text, "| field | type | default | |")
    fields = set(schema.FIELDS) - {"context_limit"}     # Ollama's num_ctx: not a frame field
    assert fields - documented == set(), "schema fields missing from docs/PROTOCOL.md"
    assert documented - fields - {"suffix"} == set(), "docs/PROTOCOL.md lists fields the schema lacks"


def test_the_http_doc_names_every_field_the_doors_take():
    text = (ROOT / "docs" / "HTTP.md").read_text()
    chat = text[text.index("## Chat and completions"):text.index("## Embeddings")]
    openai_names = {*openai_api.SAME_NAMES, "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
                    "response_format", "chat_template_kwargs", "model"}
    missing = sorted(n for n in openai_names if f"`{n}`" not in chat)
    assert not missing, f"docs/HTTP.md's chat section does not name {missing}"
    ollama = text[text.index("## The Ollama API"):]
    missing = sorted(n for n in (*OLLAMA_OPTIONS.values(), "num_ctx") if f"`{n}`" not in ollama)
    assert not missing, f"docs/HTTP.md's Ollama section does not name the options {missing}"


HOSTILE = [("logit_bias", {"1": 10**400}, "invalid_params"), ("logit_bias", {"1": float("nan")}, "invalid_params"),
           ("temperature", 10**400, "invalid_params"), ("temperature", float("nan"), "invalid_params"),
           ("n", -(10**400), "invalid_params"), ("keep_alive", "nan", "bad_request"),
           ("keep_alive", float("nan"), "bad_request"), ("stop", ["x"] * 10_000, "bad_request"),
           ("logit_bias", {str(i): 1 for i in range(301)}, "bad_request"), ("model", "m" * 10_000, "invalid_params")]


@pytest.mark.parametrize("field, value, code", HOSTILE, ids=[f for f, _, _ in HOSTILE])
def test_the_largest_and_the_not_a_number_are_refused_alike(field, value, code):
    """Ints past any float (JSON carries them), NaN, huge lists and names: a 4xx code on
    every door that has the field, never an exception of the parser's own; the message quotes
    at most 80 characters of the value."""
    if field != "keep_alive":       # (the OpenAI door has no keep_alive)
        got = _openai(field, value)
        assert got is not None and got[0] == code and len(got[1]) < 300, got
    try:
        parse({"type": "chat", "id": 1, "messages": HI, field: value})
    except ProtocolError as e:
        assert e.code == code and len(e.message) < 300
    else:
        raise AssertionError("taken")
    if field in OLLAMA_OPTIONS or field in OLLAMA_TOP | {"keep_alive"}:
        body = {"model": "m", "messages": HI}
        if field in OLLAMA_OPTIONS:
            body["options"] = {OLLAMA_OPTIONS[field]: value}
        else:
            body[field] = value
        with pytest.raises(ollama_api.OllamaError) as e:
            ollama_api.parse_chat(body, "x")
        assert e.value.code == code, e.value.message


def test_keep_alive_s_forever_and_its_numbers():
    assert schema.parse_keep_alive(10**400) == schema.parse_keep_alive("inf") == schema.parse_keep_alive(-1) == -1.0
    assert schema.parse_keep_alive("1h30m") == 5400.0 and schema.parse_keep_alive(" 30 ") == 30.0
