"""The wire format and frame validation, without a server."""
import msgpack
import pytest
import trio
import trio.testing

from edgepaged.request.protocol import (CODES, FATAL_CODES, MAX_FRAME_BYTES, ConnectionClosed, FrameReader,
                                       GenerateRequest, Hello, ProtocolError, Simple, decode_body, encode, parse)


def chat(**kw):
    return {"type": "chat", "id": 1, "messages": [{"role": "user", "content": "hi"}], **kw}


def code_of(msg) -> str:
    with pytest.raises(ProtocolError) as e:
        parse(msg)
    return e.value.code


def test_encode_is_length_prefixed_msgpack():
    frame = encode({"type": "stats", "id": 7})
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert msgpack.unpackb(frame[4:]) == {"type": "stats", "id": 7}


def test_valid_frames_parse():
    assert parse({"type": "hello", "version": 1, "token": "t", "client": "phone"}) == Hello(1, "t", "phone")
    req = parse(chat(max_tokens=5, temperature=0, top_p=0.9, stop="\n", priority="background", seed=3))
    assert isinstance(req, GenerateRequest) and req.kind == "chat" and req.max_tokens == 5
    assert req.sampling == {"temperature": 0, "top_p": 0.9, "seed": 3, "stop": ["\n"]}
    assert req.priority == "background"
    gen = parse({"type": "generate", "id": "a", "prompt": "Once"})
    assert gen.prompt == "Once" and gen.id == "a"
    assert parse({"type": "cancel", "id": 3}) == Simple("cancel", 3)
    assert parse({"type": "stats"}) == Simple("stats", None)


@pytest.mark.parametrize("msg, code", [
    ({"id": 1}, "bad_request"),                                     # no type
    ({"type": "launch", "id": 1}, "unknown_type"),
    ({"type": "chat", "id": 1}, "bad_request"),                     # no messages
    (chat(id=None), "bad_request"),
    (chat(id=True), "bad_request"),
    (chat(id="x" * 65), "bad_request"),
    (chat(messages=[]), "bad_request"),
    (chat(messages=[{"role": "user"}]), "bad_request"),
    (chat(messages=[{"role": "user", "content": 3}]), "bad_request"),
    (chat(messages=[{"role": "user", "content": "a", "extra": 1}]), "bad_request"),
    (chat(temprature=0.5), "bad_request"),                          # a typo is named, not ignored
    (chat(temperature="hot"), "bad_request"),
    (chat(temperature=True), "bad_request"),
    (chat(max_tokens=1.5), "bad_request"),
    (chat(stop=[1]), "bad_request"),
    (chat(stop=["x"] * 17), "bad_request"),
    (chat(stop_token_ids=["a"]), "bad_request"),
    (chat(priority="urgent"), "bad_request"),
    ({"type": "generate", "id": 1, "prompt": b"bytes"}, "bad_request"),
    ({"type": "cancel"}, "bad_request"),
    ({"type": "stats", "extra": 1}, "bad_request"),
    ({"type": "hello"}, "bad_request"),
    ({"type": "hello", "version": 1, "token": 5}, "bad_request"),
])
def test_bad_content_is_a_non_fatal_error(msg, code):
    assert code_of(msg) == code
    assert code not in FATAL_CODES


def test_error_keeps_the_request_id():
    with pytest.raises(ProtocolError) as e:
        parse(chat(id=42, temperature="hot"))
    assert e.value.frame() == {"type": "error", "code": "bad_request", "id": 42,
                               "message": "temperature must be a number, got str"}


@pytest.mark.parametrize("body, code", [
    (b"\xc1", "bad_frame"),                                  # never-used msgpack byte
    (msgpack.packb({"a": 1}) + b"\x00", "bad_frame"),        # trailing data
    (b"\xd4\x05\x00", "bad_frame"),                          # extension type
    (b"\x81\xa1\xff\x01", "bad_frame"),                      # invalid UTF-8 in a key
    (msgpack.packb({1: 2}), "bad_frame"),                    # non-string key
    (b"\x91" * 5000, "bad_frame"),                           # nesting bomb
    (msgpack.packb([1, 2]), "bad_request"),                  # decodable, but not a map
])
def test_undecodable_bodies(body, code):
    with pytest.raises(ProtocolError) as e:
        decode_body(body)
    assert e.value.code == code


def test_every_code_is_documented():
    doc = open("docs/PROTOCOL.md").read()
    for code in CODES:
        assert f"`{code}`" in doc, code


async def test_reader_checks_the_length_before_reading():
    send, recv = trio.testing.memory_stream_pair()
    reader = FrameReader(recv, max_frame_bytes=100)
    await send.send_all(encode({"type": "stats"}) + encode({"type": "models", "id": 2}))
    assert await reader.read() == {"type": "stats"}
    assert await reader.read() == {"type": "models", "id": 2}
    await send.send_all((101).to_bytes(4, "big"))   # no body follows: refused on the header alone
    with pytest.raises(ProtocolError) as e:
        await reader.read()
    assert e.value.code == "frame_too_large" and e.value.fatal
    assert MAX_FRAME_BYTES == 1 << 20


async def test_reader_reports_eof_mid_frame():
    send, recv = trio.testing.memory_stream_pair()
    reader = FrameReader(recv)
    await send.send_all(encode({"type": "stats"})[:-1])
    await send.aclose()
    with pytest.raises(ConnectionClosed):
        await reader.read()
