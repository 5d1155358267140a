"""The TCP server with the real embedded model on loopback, in process."""
import random
import socket

import msgpack
import pytest
import trio

from edgepaged.client import ServerError, open_client
from edgepaged.request.protocol import ConnectionClosed, FrameReader, encode
from edgepaged.testing.serving import serving

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a very long story about a dragon who learns to cook."}]


class Raw:
    """A bare connection: frames in and out, nothing checked."""

    def __init__(self, stream):
        self.stream, self.reader = stream, FrameReader(stream, 1 << 24)

    @classmethod
    async def open(cls, server, hello=True, **hello_fields):
        raw = cls(await trio.open_tcp_stream("127.0.0.1", server.port))
        if hello:
            reply = await raw.ask({"type": "hello", "version": 1, **hello_fields})
            assert reply["type"] == "hello", reply
        return raw

    async def send(self, frame) -> None:
        await self.stream.send_all(encode(frame) if isinstance(frame, dict) else frame)

    async def read(self, timeout=30) -> dict:
        with trio.fail_after(timeout):
            return await self.reader.read()

    async def ask(self, frame) -> dict:
        await self.send(frame)
        return await self.read()

    async def until_done(self, rid) -> tuple[str, dict]:
        text = []
        while True:
            m = await self.read()
            if m.get("id") != rid:
                continue
            if m["type"] == "token":
                text.append(m["text"])
            else:
                return "".join(text), m

    async def closed(self, timeout=5) -> bool:
        """True when the server closed the connection (EOF or reset), after any frames."""
        with trio.fail_after(timeout):
            try:
                while True:
                    await self.reader.read()
            except (ConnectionClosed, trio.BrokenResourceError):
                return True


async def idle(server, timeout=10) -> dict:
    """Wait until nothing runs and no block is held; returns the stats seen through a client."""
    async with open_client(server.address) as c:
        with trio.fail_after(timeout):
            while True:
                s = await c.stats()
                if s["num_requests_running"] == s["num_requests_waiting"] == s["kv_blocks_used"] == 0:
                    return s
                await trio.sleep(0.05)


async def test_chat_streams_tokens_then_done(embedded_runner):
    async with serving(embedded_runner) as server:
        async with open_client(server.address, name="test") as c:
            info = c.info
            assert info["version"] == 1 and info["model"] == "SmolLM2-135M-Instruct.Q4_1"
            assert info["auth_required"] is False and info["limits"]["max_inflight"] == 16
            assert info["kv_capacity_tokens"] == 256 * 16
            pieces = []
            async with c.chat(FRANCE, max_tokens=16, temperature=0) as answer:
                async for text in answer:
                    pieces.append(text)
            assert len(pieces) >= 3 and "Paris" in "".join(pieces)
            done = answer.done
            assert done["type"] == "done" and done["finish_reason"] == "stop"
            assert done["usage"]["completion_tokens"] >= 3 and done["usage"]["prompt_tokens"] > 20
            assert done["timings"]["ttft_s"] > 0 and done["timings"]["decode_s"] > 0

            text, done = await c.generate("The capital of Italy is", max_tokens=4, temperature=0).collect()
            assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 4
            assert (await c.models())[0]["context_length"] == info["context_length"]
            stats = await c.stats()
            assert stats["kv_blocks_used"] == 0 and stats["finished"]["stop"] >= 1
            assert stats["server"]["connections"] == 1


async def test_ten_concurrent_clients(embedded_runner):
    questions = ["What is 2 + 2?", "Name a color.", "Say hello.", "What is the capital of Spain?",
                 "Name a fruit.", "What is water?", "Count to three.", "Name an animal.", "Say yes.", "Say no."]
    results = {}

    async def one(i, server):
        async with open_client(server.address, name=f"client-{i}") as c:
            text, done = await c.chat([{"role": "user", "content": questions[i]}], max_tokens=8,
                                      temperature=0).collect()
            results[i] = (text, done)

    async with serving(embedded_runner) as server:
        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                for i in range(10):
                    n.start_soon(one, i, server)
        stats = await idle(server)
    assert sorted(results) == list(range(10))
    for text, done in results.values():
        assert done["finish_reason"] in ("stop", "length") and text
    assert stats["max_requests_running"] >= 5   # they really ran together


async def test_cancel_frees_blocks(embedded_runner):
    async with serving(embedded_runner) as server:
        async with open_client(server.address) as c:
            async with c.chat(STORY, max_tokens=300, temperature=0, ignore_eos=True) as answer:
                async for _ in answer:
                    if len(answer.token_ids) >= 3:
                        break
                assert (await c.stats())["kv_blocks_used"] > 0
                done = await answer.cancel()
            assert done["finish_reason"] == "cancelled" and done["usage"]["completion_tokens"] < 300
            # its blocks go back once the step that was using them ends
            stats = await idle(server, timeout=2)
            assert stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0
            # leaving the stream early cancels too
            async with c.chat(STORY, max_tokens=300, ignore_eos=True) as answer:
                async for _ in answer:
                    break
            assert answer.done["finish_reason"] == "cancelled"
        await idle(server)


async def test_disconnect_frees_blocks(embedded_runner):
    async with serving(embedded_runner) as server:
        raw = await Raw.open(server)
        for rid in range(3):
            await raw.send({"type": "chat", "id": rid, "messages": STORY, "max_tokens": 300, "ignore_eos": True})
        assert (await raw.read())["type"] == "token"
        await raw.stream.aclose()
        stats = await idle(server)
        assert stats["finished"]["cancelled"] == 3


async def test_each_bad_frame_gets_its_code_and_the_server_keeps_serving(embedded_runner):
    async with serving(embedded_runner, max_prompt_tokens=200, max_tokens=64, max_inflight=2) as server:
        raw = await Raw.open(server, hello=False)
        assert (await raw.ask({"type": "chat", "id": 1, "messages": FRANCE}))["code"] == "hello_required"
        assert (await raw.ask({"type": "hello", "version": 1}))["type"] == "hello"
        usable = [
            ({"type": "hello", "version": 1}, "bad_request"),
            ({"type": "launch", "id": 1}, "unknown_type"),
            ({"type": "chat", "id": 1}, "bad_request"),
            ({"type": "chat", "id": 1, "messages": FRANCE, "temprature": 1}, "bad_request"),
            ({"type": "chat", "id": 1, "messages": FRANCE, "temperature": "hot"}, "bad_request"),
            ({"type": "chat", "id": 1, "messages": FRANCE, "priority": "urgent"}, "bad_request"),
            ({"type": "chat", "id": 1, "messages": FRANCE, "temperature": -1}, "invalid_params"),
            ({"type": "chat", "id": 1, "messages": FRANCE, "top_p": 0}, "invalid_params"),
            ({"type": "chat", "id": 1, "messages": FRANCE, "max_tokens": 65}, "invalid_params"),
            ({"type": "chat", "id": 1, "messages": FRANCE, "max_tokens": 0}, "invalid_params"),
            ({"type": "chat", "id": 1, "messages": [{"role": "user", "content": "word " * 300}]}, "prompt_too_long"),
            ({"type": "generate", "id": 1, "prompt": ""}, "empty_prompt"),
            ({"type": "cancel", "id": 99}, "unknown_request"),
            ((3).to_bytes(4, "big") + msgpack.packb([1, 2]), "bad_request"),   # not a map
        ]
        for frame, code in usable:
            reply = await raw.ask(frame)
            assert reply["type"] == "error" and reply["code"] == code, (frame, reply)
            assert reply["message"]
            if isinstance(frame, dict) and "id" in frame and frame["type"] != "hello":
                assert reply["id"] == frame["id"]
        # in-flight limits
        await raw.send({"type": "chat", "id": "a", "messages": STORY, "max_tokens": 64, "ignore_eos": True})
        await raw.send({"type": "chat", "id": "a", "messages": STORY, "max_tokens": 64, "ignore_eos": True})
        await raw.send({"type": "chat", "id": "b", "messages": STORY, "max_tokens": 64, "ignore_eos": True})
        await raw.send({"type": "chat", "id": "c", "messages": STORY, "max_tokens": 64, "ignore_eos": True})
        await raw.send({"type": "cancel", "id": "a"})
        await raw.send({"type": "cancel", "id": "b"})
        errors, done = {}, {}
        while len(done) < 2:
            m = await raw.read()
            if m["type"] == "error":
                errors[m["id"]] = m["code"]
            elif m["type"] == "done":
                done[m["id"]] = m["finish_reason"]
        assert errors == {"a": "duplicate_id", "c": "too_many_requests"}
        assert done == {"a": "cancelled", "b": "cancelled"}
        # still usable
        await raw.send({"type": "chat", "id": 5, "messages": FRANCE, "temperature": 0, "max_tokens": 16})
        text, d = await raw.until_done(5)
        assert "Paris" in text and d["finish_reason"] == "stop"

        fatal = [
            ((1 << 20 + 1).to_bytes(4, "big"), "frame_too_large"),
            ((0).to_bytes(4, "big"), "frame_too_large"),
            ((1).to_bytes(4, "big") + b"\xc1", "bad_frame"),
            ((3).to_bytes(4, "big") + b"\xd4\x05\x00", "bad_frame"),
            ((4).to_bytes(4, "big") + b"\x81\xa1\xff\x01", "bad_frame"),
        ]
        for frame, code in fatal:
            bad = await Raw.open(server)
            await bad.send({"type": "chat", "id": 1, "messages": STORY, "max_tokens": 64})
            await bad.send(frame + b"more bytes the server will never read" * 100)
            while (reply := await bad.read())["type"] != "error":
                pass
            assert reply["code"] == code and "id" not in reply
            assert await bad.closed()
        bad = await Raw.open(server, hello=False)
        assert (await bad.ask({"type": "hello", "version": 99}))["code"] == "unsupported_version"
        assert await bad.closed()
        async with open_client(server.address) as c:
            _, d = await c.chat(FRANCE, max_tokens=4).collect()
            assert d["finish_reason"] == "length"
        await idle(server)


async def test_token_auth(embedded_runner):
    async with serving(embedded_runner, token="s3cret") as server:
        for token in (None, "wrong", "s3cret-and-more"):
            with pytest.raises(ServerError) as e:
                async with open_client(server.address, token=token):
                    pass
            assert e.value.code == "auth_failed"
        async with open_client(server.address, token="s3cret") as c:
            assert c.info["auth_required"] is True
            _, done = await c.chat(FRANCE, max_tokens=2).collect()
            assert done["finish_reason"] == "length"


async def test_hello_timeout_and_max_connections(embedded_runner):
    async with serving(embedded_runner, hello_timeout_s=0.3, max_connections=2) as server:
        quiet = await Raw.open(server, hello=False)
        assert (await quiet.read())["code"] == "hello_timeout"
        assert await quiet.closed()
        await quiet.stream.aclose()
        with trio.fail_after(5):
            while server.connections:
                await trio.sleep(0.01)
        a, b = await Raw.open(server), await Raw.open(server)
        third = await Raw.open(server, hello=False)      # before hello: an allowance of its own
        assert (await third.ask({"type": "hello", "version": 1}))["code"] == "server_busy"
        assert await third.closed()
        await a.stream.aclose()
        with trio.fail_after(5):
            while len(server.connections) > 1:
                await trio.sleep(0.01)
        await Raw.open(server)
        await b.stream.aclose()


async def test_a_client_that_stops_reading_is_cut_off(embedded_runner, caplog):
    async with serving(embedded_runner, unread_timeout_s=1.0, max_pending_frames=4) as server:
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect(("127.0.0.1", server.port))
        slow = Raw(trio.SocketStream(sock))
        assert (await slow.ask({"type": "hello", "version": 1}))["type"] == "hello"
        await slow.send({"type": "chat", "id": 0, "messages": STORY, "max_tokens": 500, "ignore_eos": True})

        async def flood():   # many stats replies nobody reads
            try:
                for i in range(1, 200_000):
                    await slow.send({"type": "stats", "id": i})
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        async with trio.open_nursery() as n:
            n.start_soon(flood)
            # meanwhile another client is served normally
            async with open_client(server.address) as c:
                text, done = await c.chat(FRANCE, max_tokens=16, temperature=0).collect()
                assert "Paris" in text
                with trio.fail_after(20):
                    while len(server.connections) > 1:
                        await trio.sleep(0.05)
            n.cancel_scope.cancel()
        stats = await idle(server)
        assert stats["finished"]["cancelled"] == 1
    assert "it read nothing for 1 s" in caplog.text


async def test_shutdown_lets_short_requests_finish_and_cancels_the_rest(embedded_runner):
    async with serving(embedded_runner) as server:
        async with open_client(server.address) as c:
            short = c.chat(FRANCE, max_tokens=8, temperature=0)
            # ignore_eos and more tokens than the grace period can make: the long one cannot
            # end on its own inside the 5 s (it once did, on a fast machine, with 500 sampled tokens)
            long = c.chat(STORY, max_tokens=4000, ignore_eos=True)
            await short.start()
            await long.start()
            async for _ in long:
                break
            with trio.fail_after(30):
                cancelled = await server.shutdown(grace_s=5)
            assert cancelled == 1
            _, done = await short.collect()
            assert done["finish_reason"] in ("stop", "length")
            _, done = await long.collect()
            assert done["finish_reason"] == "cancelled" and done["error"]["code"] == "shutdown"
        with pytest.raises(OSError):
            await trio.open_tcp_stream("127.0.0.1", server.port)


def _mutations(rng: random.Random):
    """Frames that are almost right: valid ones with a field dropped, retyped or added."""
    values = [None, True, -1, 0, 3, 2**70, 1.5, float("nan"), "", "x" * 300, b"\x00", [], [1, "a"], {}, {"a": 1},
              [{"role": "user", "content": "hi"}], [{"role": 1}]]
    base = [{"type": "chat", "id": 1, "messages": FRANCE, "max_tokens": 2},
            {"type": "generate", "id": 2, "prompt": "Hello", "max_tokens": 2, "stop": ["."]},
            {"type": "cancel", "id": 1}, {"type": "stats"}, {"type": "models"}, {"type": "hello", "version": 1}]
    for _ in range(300):
        frame = dict(rng.choice(base))
        op = rng.random()
        key = rng.choice(list(frame) + ["temperature", "top_k", "seed", "priority", "stop_token_ids", "zzz"])
        if op < 0.3:
            frame.pop(key, None)
        else:
            frame[key] = rng.choice(values)
        yield frame


async def test_fuzzed_frames_never_crash_the_server_or_leak_blocks(embedded_runner):
    rng = random.Random(0)
    async with serving(embedded_runner, max_tokens=4) as server:
        raw = await Raw.open(server)
        for frame in _mutations(rng):
            try:
                body = msgpack.packb(frame)
            except (TypeError, ValueError, OverflowError):
                continue
            await raw.send(len(body).to_bytes(4, "big") + body)
            if frame.get("type") in ("stats", "models", "hello", "chat", "generate", "cancel"):
                await trio.sleep(0)
        for _ in range(20):   # random bytes, each on a fresh connection
            junk = await Raw.open(server)
            body = rng.randbytes(rng.randrange(1, 64))
            await junk.send(len(body).to_bytes(4, "big") + body)
            await junk.send({"type": "stats", "id": 1})
            with trio.fail_after(5):
                m = await junk.read()
            assert m["type"] in ("error", "stats")
        await raw.stream.aclose()
        await idle(server)
        async with open_client(server.address) as c:
            text, done = await c.chat(FRANCE, max_tokens=4, temperature=0).collect()
            assert done["finish_reason"] == "length" and text


def _plain_socket_chat(port: int) -> tuple[str, dict]:
    """The MicroPython-sized client of docs/PROTOCOL.md: blocking socket, struct, msgpack."""
    import struct

    def send(s, m):
        b = msgpack.packb(m)
        s.sendall(struct.pack(">I", len(b)) + b)

    def recv(s):
        def exact(n):
            b = b""
            while len(b) < n:
                b += s.recv(n - len(b))
            return b
        return msgpack.unpackb(exact(struct.unpack(">I", exact(4))[0]))

    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        send(s, {"type": "hello", "version": 1, "client": "hub"})
        assert recv(s)["type"] == "hello"
        send(s, {"type": "chat", "id": 1, "max_tokens": 16, "temperature": 0, "messages": FRANCE})
        text = ""
        while True:
            m = recv(s)
            if m["type"] == "token":
                text += m["text"]
            elif m["type"] in ("done", "error"):
                return text, m


async def test_a_plain_blocking_socket_client_is_enough(embedded_runner):
    async with serving(embedded_runner) as server:
        text, last = await trio.to_thread.run_sync(_plain_socket_chat, server.port)
    assert last["type"] == "done" and "Paris" in text


async def test_client_goes_past_an_address_that_refuses():
    """A discovered record whose server is gone (dead port) must not stop the client: the
    next candidate is tried, and when every one refuses the last error says why."""
    from edgepaged.client import _connect
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()                                   # nothing listens there now
    live = trio.socket.socket()
    await live.bind(("127.0.0.1", 0))
    live.listen()
    live_port = live.getsockname()[1]
    with live:
        tried: set = set()
        stream, host, port, last = await _connect([("127.0.0.1", dead_port), ("127.0.0.1", live_port)], tried, None)
        assert stream is not None and (host, port) == ("127.0.0.1", live_port)
        assert isinstance(last, ServerError) and f"127.0.0.1:{dead_port}" in str(last)
        await stream.aclose()
        # already tried: not again; nothing left -> no stream, the error kept
        stream, host, port, last2 = await _connect([("127.0.0.1", dead_port)], tried, last)
        assert stream is None and last2 is last
