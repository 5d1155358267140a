"""The wire protocol: framing, the frame schema, validation, error codes (docs/PROTOCOL.md).

A frame is a 4-byte big-endian length N, then N bytes holding one msgpack map with string
keys. The length is checked before the body is read or decoded. This module knows no
engine and no sockets beyond a Trio receive stream: both the server and the client use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from . import schema
from ..common.brief import names
from .schema import (CONTEXT_POLICIES, MAX_NAME_LEN, MAX_STOP, PRIORITIES, FieldError,  # noqa: F401 (re-exported)
                     GenerateRequest, parse_context_policy, parse_keep_alive, parse_truncate)

PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MAX_FRAME_BYTES = 1 << 20
HEADER_BYTES = 4
MAX_ID_LEN = 64
MAX_MESSAGES = 1024

# Error codes. Fatal ones close the connection after the error frame; the others leave it usable.
FATAL_CODES = {
    "frame_too_large": "the frame's length prefix is 0 or over the limit",
    "bad_frame": "the frame's body is not decodable msgpack (or has extension types, non-string keys)",
    "unsupported_version": "hello asked for a protocol version this server does not speak",
    "auth_failed": "hello carried no token or a wrong one",
    "hello_timeout": "no hello within the time allowed",
    "idle_timeout": "nothing in flight and no frame for the idle time (or half a frame stalled)",
    "server_busy": "the server has its maximum number of connections",
    "wrong_port": "the peer speaks HTTP: an HTTP client at the msgpack port, or this protocol at the HTTP port",
}
# the first bytes of HTTP: a request (a browser at the msgpack port) or a response (a
# protocol client at the HTTP port)
HTTP_STARTS = (b"GET ", b"POST", b"HEAD", b"PUT ", b"OPTI", b"DELE", b"PATC", b"CONN", b"HTTP")
CODES = {
    **FATAL_CODES,
    "bad_request": "a well-formed frame whose content is wrong (missing or unknown field, wrong type)",
    "unknown_type": "a frame type this server does not know",
    "hello_required": "a request before hello",
    "duplicate_id": "a request id already in flight on this connection",
    "too_many_requests": "this connection has its maximum of requests in flight",
    "unknown_request": "cancel of an id that is not in flight (it may have just finished)",
    "invalid_params": "a sampling parameter out of range, or a format past the server's limits",
    "busy": "the server cannot take this now (e.g. the grammar compiler is full); try again shortly",
    "empty_prompt": "the prompt has no tokens",
    "prompt_too_long": "the prompt does not fit this server's limits",
    "context_exceeded": "prompt + max_tokens exceed the context length",
    "kv_capacity": "prompt + max_tokens could never fit in the KV cache",
    "bad_token": "a token id outside the vocabulary",
    "image_too_large": "an image past the server's bounds (its bytes, its pixels, images per request)",
    "unsupported_image": "an image in a format the server does not take, or not an image",
    "shutdown": "the server is shutting down",
    "model_not_found": "the request names a model this box does not serve",
    "model_unavailable": "the model cannot be loaded now: the box's model memory is held by models in use",
    "internal_error": "a bug or a failed model step on the server",
}

# a request frame's fields: the schema's (schema.py), but Ollama's num_ctx (context_limit)
REQUEST_FIELDS = {"type", "id", *(set(schema.FIELDS) - {"context_limit"})}


class ProtocolError(Exception):
    """Something to answer with an error frame; `fatal` closes the connection after it."""

    def __init__(self, code: str, message: str, id: Any = None):
        assert code in CODES, code
        super().__init__(message)
        self.code, self.message, self.id = code, message, id

    @property
    def fatal(self) -> bool:
        return self.code in FATAL_CODES

    def frame(self) -> dict:
        return error_frame(self.code, self.message, self.id)


class ConnectionClosed(Exception):
    """The peer closed the connection (between frames or in the middle of one)."""


# ---------------------------------------------------------------- framing

def encode(msg: dict) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    return len(body).to_bytes(HEADER_BYTES, "big") + body


def _no_ext(code, data):
    raise ValueError(f"extension type {code} is not allowed")


def decode_body(body: bytes) -> dict:
    """Decode one frame body; ProtocolError(bad_frame) if undecodable, bad_request if not a map."""
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_no_ext, timestamp=0,
                              use_list=True)
    except Exception as e:  # FormatError, StackError, ExtraData, UnicodeDecodeError, ValueError...
        raise ProtocolError("bad_frame", f"undecodable frame: {type(e).__name__}: {e}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("bad_request", f"a frame must be a map, got {type(msg).__name__}")
    return msg


class FrameReader:
    """Reads frames from a Trio receive stream, checking each length before reading the body."""

    def __init__(self, stream, max_frame_bytes: int = MAX_FRAME_BYTES):
        self.stream, self.max_frame_bytes = stream, max_frame_bytes
        self.buf = bytearray()

    async def _fill(self, n: int) -> bool:
        while len(self.buf) < n:
            data = await self.stream.receive_some(max(65536, n - len(self.buf)))
            if not data:
                return False
            self.buf += data
        return True

    async def read(self) -> dict:
        """The next frame as a dict. Raises ConnectionClosed at EOF, ProtocolError for a bad frame
        (after a fatal one the stream is out of sync: close it)."""
        if not await self._fill(HEADER_BYTES):
            raise ConnectionClosed("the peer closed the connection")
        n = int.from_bytes(self.buf[:HEADER_BYTES], "big")
        if bytes(self.buf[:4]) in HTTP_STARTS:
            side = "the server answered in HTTP: this is its HTTP port (the OpenAI API, the chat page); " \
                "edgepaged's protocol is on the other port its banner names (7878 by default)" \
                if self.buf.startswith(b"HTTP") else "this port speaks edgepaged's msgpack protocol, not HTTP"
            raise ProtocolError("wrong_port", side)
        if n == 0 or n > self.max_frame_bytes:
            raise ProtocolError("frame_too_large", f"frame length {n} is not in 1..{self.max_frame_bytes}")
        if not await self._fill(HEADER_BYTES + n):
            raise ConnectionClosed("the peer closed the connection in the middle of a frame")
        body = bytes(self.buf[HEADER_BYTES:HEADER_BYTES + n])
        del self.buf[:HEADER_BYTES + n]
        return decode_body(body)


# ---------------------------------------------------------------- frames the server sends

def error_frame(code: str, message: str, id: Any = None) -> dict:
    frame = {"type": "error", "code": code, "message": message}
    if id is not None:
        frame["id"] = id
    return frame


def with_id(frame: dict, id: Any) -> dict:
    if id is not None:
        frame["id"] = id
    return frame


# ---------------------------------------------------------------- validation of client frames

@dataclass
class Hello:
    version: int
    token: str | None = None
    client: str | None = None
    id: Any = None


@dataclass
class Simple:
    """cancel (id = the request to cancel), stats, models."""
    kind: str
    id: Any = None


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_id(msg: dict, required: bool) -> Any:
    if "id" not in msg:
        if required:
            raise ProtocolError("bad_request", f"a {msg.get('type')} frame needs an id")
        return None
    rid = msg["id"]
    if _is_int(rid) and -2**63 <= rid < 2**64 or isinstance(rid, str) and 0 < len(rid) <= MAX_ID_LEN:
        return rid
    raise ProtocolError("bad_request", f"id must be an integer or a string of 1..{MAX_ID_LEN} characters")


def _check_fields(msg: dict, allowed: set, rid: Any) -> None:
    extra = sorted(set(msg) - allowed)
    if extra:
        raise ProtocolError("bad_request", f"unknown field(s) in {msg['type']}: {names(extra)}", rid)


def _type_check(name: str, value, types: tuple, rid: Any) -> None:
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        want = " or ".join(t.__name__ for t in types)
        raise ProtocolError("bad_request", f"{name} must be {want}, got {type(value).__name__}", rid)


def _parse_hello(msg: dict):
    rid = _check_id(msg, False)
    _check_fields(msg, {"type", "id", "version", "token", "client"}, rid)
    version = msg.get("version")
    if not _is_int(version):
        raise ProtocolError("bad_request", "hello needs an integer version", rid)
    for name in ("token", "client"):
        if msg.get(name) is not None:
            _type_check(name, msg[name], (str,), rid)
    client = msg.get("client")
    if client is not None and len(client) > MAX_NAME_LEN:
        raise ProtocolError("bad_request", f"client name is longer than {MAX_NAME_LEN} characters", rid)
    return Hello(version, msg.get("token"), client, rid)


def _parse_messages(value, rid) -> list[dict]:
    if not isinstance(value, list) or not 0 < len(value) <= MAX_MESSAGES:
        raise ProtocolError("bad_request", f"messages must be a list of 1..{MAX_MESSAGES} maps", rid)
    from .messages import from_map
    out = []
    from .messages import Image
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) - {"role", "content", "tool_calls", "tool_call_id", "name", "images"} \
                or not isinstance(m.get("role"), str) or not 0 < len(m["role"]) <= 32 \
                or not isinstance(m.get("content"), str) and not (m.get("tool_calls") and m.get("content") is None):
            raise ProtocolError("bad_request", f"messages[{i}] must be a map with a string role and a string "
                                "content (an assistant's tool_calls, a tool result's tool_call_id and name, a "
                                "user's images; nothing else)", rid)
        images = m.get("images") or []
        if not isinstance(images, list) or not all(isinstance(x, bytes) for x in images):
            raise ProtocolError("bad_request", f"messages[{i}].images must be a list of binary values (the "
                                "image files' bytes)", rid)
        try:
            out.append(from_map(m, i, images=tuple(Image(data=x) for x in images)).template())
        except ValueError as e:
            raise ProtocolError("bad_request", str(e), rid) from None
    return out


def _parse_generate(msg: dict) -> GenerateRequest:
    kind = msg["type"]
    rid = _check_id(msg, True)
    body = "messages" if kind == "chat" else "prompt"
    _check_fields(msg, REQUEST_FIELDS | ({"messages"} if kind == "chat" else {"prompt", "suffix"}), rid)
    if body not in msg:
        raise ProtocolError("bad_request", f"{kind} needs {body}", rid)
    messages = prompt = suffix = None
    if kind == "chat":
        messages = _parse_messages(msg["messages"], rid)
    else:
        _type_check("prompt", msg["prompt"], (str,), rid)
        prompt = msg["prompt"]
        if msg.get("suffix") is not None:
            _type_check("suffix", msg["suffix"], (str,), rid)
            suffix = msg["suffix"]
    # the frame's names are the schema's: every field checked by its one rule
    fields = {name: msg.get(name) for name in REQUEST_FIELDS - {"type", "id"}}
    try:
        return schema.parse(fields, rid, kind, messages=messages, prompt=prompt, suffix=suffix)
    except FieldError as e:
        raise ProtocolError(e.code, e.message, rid) from None


def _parse_simple(msg: dict) -> Simple:
    kind = msg["type"]
    rid = _check_id(msg, kind == "cancel")
    _check_fields(msg, {"type", "id"}, rid)
    return Simple(kind, rid)


PARSERS = {"hello": _parse_hello, "chat": _parse_generate, "generate": _parse_generate,
           "cancel": _parse_simple, "stats": _parse_simple, "models": _parse_simple}


def parse(msg: dict) -> Hello | GenerateRequest | Simple:
    """Validate a decoded client frame; ProtocolError (never fatal) when its content is wrong."""
    kind = msg.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("bad_request", "a frame needs a string type", _safe_id(msg))
    parser = PARSERS.get(kind)
    if parser is None:
        raise ProtocolError("unknown_type", f"unknown frame type {kind[:40]!r}; known: {', '.join(PARSERS)}",
                            _safe_id(msg))
    return parser(msg)


def _safe_id(msg: dict) -> Any:
    try:
        return _check_id(msg, False)
    except ProtocolError:
        return None
