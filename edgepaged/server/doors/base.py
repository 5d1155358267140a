"""What every door shares: the error a door answers with (an HTTP status and an OpenAI-style
body; each door may shape its own from it) and a parsed generation request (`Generation`).
The doors (openai.py, ollama.py, responses.py) import this, never each other, but for the
Responses API, which is validated by the chat door's parser (one set of rules)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from ...request.protocol import GenerateRequest

# protocol error code -> HTTP status (the code itself goes to the client as error.code)
STATUS = {
    "bad_request": 400, "invalid_params": 400, "empty_prompt": 400, "prompt_too_long": 400,
    "context_exceeded": 400, "kv_capacity": 400, "bad_token": 400,
    "too_many_requests": 429, "shutdown": 503, "internal_error": 500, "model_not_found": 404,
    "model_unavailable": 503, "busy": 503, "image_too_large": 413, "unsupported_image": 415,
}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error"}

class ApiError(Exception):
    """An error to answer with an OpenAI-style body and an HTTP status."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    @classmethod
    def from_rejected(cls, e) -> "ApiError":
        """From a `RequestRejected` of the front end or the engine."""
        return cls(STATUS.get(e.code, 400), str(e), e.code)

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code, self.param)


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str = "bad_request") -> ApiError:
    return ApiError(400, message, code, param)


@dataclass
class Generation:
    """A parsed generation request: what to run and how to answer."""
    item: GenerateRequest
    chat: bool
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    reasoning: bool = False        # llama.cpp's reasoning_format: a thinking model's thinking in reasoning_content
    warnings: list = field(default_factory=list)   # what was accepted and ignored (X-Edgepaged-Warning headers)




class Shaper(Protocol):
    """What the HTTP server (httpd.GenerationResponse) asks of a door's answer shapes: a whole
    answer (`full`; `full_n` for n samples), or a stream of frames: `first_chunk`, then
    `text_chunk` / `call_chunk` as the answer comes (None: nothing to send yet), then
    `last_chunks` at the end, each made bytes by `frame`, and `trailer` after the last. A door
    is this and a parser onto the request schema (tests/test_door.py builds one in a test)."""

    media_type: str               # a stream's Content-Type
    splits_thinking: bool         # a thinking model's thinking apart from its answer (else in the text)
    trailer: bytes                # sent after the last frame
    shapes_logprobs: bool         # it shapes OpenAI's logprobs objects (others take none)
    streams_calls: bool           # a tool call goes out as it is written (call_chunk), else whole at the end

    def frame(self, obj) -> bytes: ...

    def full(self, text: str, done, calls=None, logprobs=None, thinking: str = "") -> dict: ...

    def first_chunk(self): ...

    def text_chunk(self, text: str, thinking: str = "", logprobs=None): ...

    def call_chunk(self, k: int, part: dict): ...

    def last_chunks(self, done, calls=None) -> list: ...

    def error_chunk(self, err: ApiError): ...

    def error_body(self, err: ApiError) -> dict: ...


class SamplesShaper(Shaper, Protocol):
    """A door that takes n > 1 samples of one prompt (OpenAI's `n`): their answers in one body
    (`full_n`), and the usage chunk that closes their stream (`usage_chunk`)."""

    def full_n(self, answers: list) -> dict: ...

    def usage_chunk(self, usage: dict): ...


@dataclass(frozen=True)
class Door:
    """A door the HTTP server serves at `path` (POST): `parse(body, request_id)` maps a JSON
    body onto the request schema (a `Generation`; ApiError naming what is wrong), and
    `shaper(gen, model, ticket)` shapes the answer (a `Shaper`). The built-in doors are made
    in httpd.py; `HttpConfig.doors` adds others (tests/test_door.py defines one)."""
    path: str
    parse: Callable[[dict, str], Generation]
    shaper: Callable[..., Shaper]
    chat: bool = True             # ids as chat completions' (chatcmpl-) or completions' (cmpl-)
    # its errors in its own shape: an ApiError (of any door, the front end's refusals
    # included) -> the door's (an ApiError whose `body()` is the door's); None: OpenAI's shape
    error: Callable[[ApiError], ApiError] | None = None
