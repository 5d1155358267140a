"""A door defined only here, over the declared interfaces (server/doors/base.py: `Door`,
`Shaper`, `Generation`, `ApiError`; the request schema's `parse`): the HTTP server serves it
beside the built-in doors, with the same auth, fairness, front end and answer stream, as the
tiny-family test does for families. Nothing of the built-in doors is used."""
from __future__ import annotations

import json

from edgepaged.request import schema
from edgepaged.server.doors.base import ApiError, Door, Generation, Shaper
from edgepaged.server.httpd import HttpConfig
from edgepaged.testing.serving import serving

from test_takedown import FRANCE, afetch


class DoorError(ApiError):
    """This door's errors: {"error": message}."""

    def body(self) -> dict:
        return {"error": self.message}

    @classmethod
    def of(cls, e: ApiError) -> "DoorError":
        return e if isinstance(e, cls) else cls(e.status, e.message, e.code, e.param)


def parse(body: dict, rid: str) -> Generation:
    """{"ask": TEXT, "most": N, "stream": BOOL} -> one greedy chat request."""
    ask = body.get("ask")
    if not isinstance(ask, str) or not ask:
        raise DoorError(400, "ask must be a non-empty string", "bad_request", "ask")
    try:
        item = schema.parse({"max_tokens": body.get("most", 12), "temperature": 0}, rid, "chat",
                            messages=[{"role": "user", "content": ask}])
    except schema.FieldError as e:
        raise DoorError(400, str(e), e.code, e.field) from None
    return Generation(item, chat=True, stream=bool(body.get("stream")))


class LineShaper:
    """Answers as {"said", "why"}, or streamed as NDJSON lines {"piece"} ... {"why"}."""
    media_type = "application/x-ndjson"
    trailer = b""
    shapes_logprobs = False
    streams_calls = False
    splits_thinking = False

    def __init__(self, gen: Generation, model: str, ticket=None):
        self.model = model

    def frame(self, obj) -> bytes:
        return json.dumps(obj).encode() + b"\n"

    def full(self, text, done, calls=None, logprobs=None, thinking="") -> dict:
        return {"model": self.model, "said": text, "why": done.finish_reason, "tokens": done.usage["completion_tokens"]}

    def first_chunk(self):
        return None

    def text_chunk(self, text, thinking="", logprobs=None):
        return {"piece": text} if text else None

    def call_chunk(self, k, part):
        return None

    def last_chunks(self, done, calls=None) -> list:
        return [{"why": done.finish_reason}]

    def error_chunk(self, err: ApiError):
        return {"error": err.message}

    def error_body(self, err: ApiError) -> dict:
        return {"error": err.message}


DOOR = Door("/door/ask", parse, LineShaper, error=DoorError.of)


def test_the_test_shaper_is_a_shaper():
    """It has every attribute and method the Shaper protocol declares (and nothing else of
    the built-in doors' shapers)."""
    missing = [n for n in Shaper.__annotations__ if not hasattr(LineShaper, n)]
    missing += [n for n, v in vars(Shaper).items() if callable(v) and not n.startswith("_") and not hasattr(LineShaper, n)]
    assert not missing, missing


async def test_a_door_defined_in_a_test_serves_a_generation(embedded_runner):
    async with serving(embedded_runner, http=HttpConfig(port=0, doors=(DOOR,))) as server:
        base = server.http_base
        question = FRANCE[-1]["content"]
        # the same request through the OpenAI door, for the answer to compare
        status, raw = await afetch(base + "/v1/chat/completions", {
            "messages": [{"role": "user", "content": question}], "max_tokens": 12, "temperature": 0})
        assert status == 200, raw
        expected = json.loads(raw)["choices"][0]["message"]["content"]
        status, raw = await afetch(base + "/door/ask", {"ask": question})
        assert status == 200, raw
        got = json.loads(raw)
        assert got["said"] == expected and got["why"] in ("stop", "length") and 1 <= got["tokens"] <= 12
        assert got["model"] == server.front.model
        status, raw = await afetch(base + "/door/ask", {"ask": question, "stream": True})
        assert status == 200, raw
        lines = [json.loads(x) for x in raw.decode().splitlines()]
        assert "".join(x.get("piece", "") for x in lines) == expected and lines[-1] == {"why": got["why"]}
        # its own errors in its own shape; the schema's rules hold at this door too
        status, raw = await afetch(base + "/door/ask", {"ask": ""})
        assert status == 400 and json.loads(raw) == {"error": "ask must be a non-empty string"}
        status, raw = await afetch(base + "/door/ask", {"ask": question, "most": 0})
        assert status == 400 and json.loads(raw)["error"].startswith("max_tokens must be")
        # a refusal of the front end (past the server's limit), in the door's shape too
        status, raw = await afetch(base + "/door/ask", {"ask": question, "most": 10 ** 6})
        assert status == 400 and "max_tokens" in json.loads(raw)["error"], raw
        assert server.front.engine.allocator.num_used_blocks == 0
