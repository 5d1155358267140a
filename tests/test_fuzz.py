"""Fuzzing the frame decoder and the request validator (hypothesis), and replaying the
regression corpus (tests/corpus, written by tests/make_corpus.py) against a real server with
a tiny real model: every input ends in response frames or a clean close within a bounded
time; nothing crashes, hangs or leaks a block."""
import pathlib

import msgpack
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgepaged.client import open_client
from edgepaged.model import ModelRunner, SamplingParams
from edgepaged.request.protocol import CODES, GenerateRequest, ProtocolError, decode_body, encode, parse
from edgepaged.testing.serving import serving

CORPUS = sorted((pathlib.Path(__file__).parent / "corpus").glob("*.bin"))
FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64), st.floats(allow_nan=True),
                    st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                             max_size=4),
                      max_leaves=20)
FIELDS = ["type", "id", "messages", "prompt", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
          "stop", "stop_token_ids", "priority", "repetition_penalty", "ignore_eos", "version", "token", "client",
          "share_prefix_cache", "zzz"]
TYPES = st.sampled_from(["hello", "chat", "generate", "cancel", "stats", "models", "nope", ""])
frames = st.fixed_dictionaries({"type": st.one_of(TYPES, values)},
                               optional={f: values for f in FIELDS[1:]})


def _validate(msg: dict) -> None:
    """What the server does with a decoded frame before it reaches the engine."""
    try:
        item = parse(msg)
    except ProtocolError as e:
        assert e.code in CODES and isinstance(str(e), str)
        return
    if isinstance(item, GenerateRequest):
        try:
            SamplingParams(**item.sampling)
        except (ValueError, TypeError):
            pass


@FAST
@given(st.binary(max_size=300))
def test_random_bytes_decode_or_fail_cleanly(body):
    try:
        msg = decode_body(body)
    except ProtocolError as e:
        assert e.code in ("bad_frame", "bad_request")
        return
    assert isinstance(msg, dict)
    _validate(msg)


@FAST
@given(frames)
def test_structured_frames_validate_or_fail_cleanly(msg):
    try:
        body = msgpack.packb(msg, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return
    _validate(decode_body(body))


@FAST
@given(frames, st.integers(1, 40))
def test_truncated_frames_never_decode_to_something_else(msg, cut):
    try:
        body = msgpack.packb(msg, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return
    if cut >= len(body):
        return
    with pytest.raises(ProtocolError):
        decode_body(body[:-cut])


def test_deep_nesting_is_refused_not_crashing():
    with pytest.raises(ProtocolError) as e:
        decode_body(b"\x91" * 100_000 + b"\x01")
    assert e.value.code in ("bad_frame", "bad_request")


@pytest.fixture(scope="module")
def tiny_runner(tiny_model_dir):
    return ModelRunner(tiny_model_dir, num_blocks=128)


async def _replay(server, data: bytes) -> list[dict]:
    """Hello, send `data` then a marker (stats with id "end"); read frames until the marker's
    reply or the server closes the connection (bounded)."""
    from edgepaged.request.protocol import ConnectionClosed, FrameReader
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    reader = FrameReader(stream, 1 << 24)
    await stream.send_all(encode({"type": "hello", "version": 1, "client": "fuzz"}))
    got = [await reader.read()]
    try:
        await stream.send_all(data + encode({"type": "stats", "id": "end"}))
        with trio.move_on_after(5):
            while got[-1].get("id") != "end":
                got.append(await reader.read())
    except (ConnectionClosed, trio.BrokenResourceError):
        pass
    await stream.aclose()
    return got


@pytest.mark.parametrize("path", CORPUS, ids=[p.stem for p in CORPUS])
async def test_corpus_replay(path, tiny_runner):
    async with serving(tiny_runner, max_tokens=64) as server:
        engine = server.engine
        with trio.fail_after(20):
            frames = await _replay(server, path.read_bytes())
        assert frames[0]["type"] == "hello"
        for f in frames[1:]:
            assert f["type"] in ("error", "token", "done", "stats", "models"), f
            if f["type"] == "error":
                assert f["code"] in CODES and f["message"]
        # the server still serves, and nothing is held
        async with open_client(f"127.0.0.1:{server.port}") as c:
            with trio.fail_after(20):
                text, done = await c.generate("hello world", max_tokens=3, ignore_eos=True).collect()
            assert done["finish_reason"] == "length"
            with trio.fail_after(10):
                while (s := await c.stats())["kv_blocks_used"] or s["num_requests_running"]:
                    await trio.sleep(0.02)
    assert engine.allocator.num_used_blocks == 0 and not engine.requests


def test_corpus_is_present():
    assert len(CORPUS) >= 30, "run tests/make_corpus.py"


async def test_idle_and_stalled_connections_are_closed(tiny_runner):
    from edgepaged.request.protocol import ConnectionClosed, FrameReader
    async with serving(tiny_runner, idle_timeout_s=0.5) as server:
        for tail in (b"", b"\x00\x00\x10\x00partial"):   # idle, then half a frame
            stream = await trio.open_tcp_stream("127.0.0.1", server.port)
            reader = FrameReader(stream)
            await stream.send_all(encode({"type": "hello", "version": 1}) + tail)
            assert (await reader.read())["type"] == "hello"
            with trio.fail_after(5):
                err = await reader.read()
                assert err["code"] == "idle_timeout"
                with pytest.raises((ConnectionClosed, trio.BrokenResourceError)):
                    await reader.read()
        # a long answer in flight is not idle: the connection stays while it streams
        async with open_client(f"127.0.0.1:{server.port}") as c:
            text, done = await c.generate("hi", max_tokens=60, ignore_eos=True).collect()
            assert done["finish_reason"] == "length"
