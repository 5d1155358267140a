"""The client library: a Trio client and a plain synchronous wrapper.

    async with open_client("127.0.0.1:7878") as c:        # or open_client() to find one by mDNS
        async with c.chat([{"role": "user", "content": "Hi"}], max_tokens=64) as answer:
            async for text in answer:
                print(text, end="")
        print(answer.done["usage"])

    with SyncClient("127.0.0.1:7878") as c:
        for text in c.chat([{"role": "user", "content": "Hi"}]):
            print(text, end="")

Requests are multiplexed on one connection by id; leaving a stream before its `done`
cancels the request on the server.
"""
from __future__ import annotations

import itertools
import math
import os
import sys
import threading
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Iterator

import trio

from ..common.ports import PORT
from ..request.protocol import PROTOCOL_VERSION, ConnectionClosed, FrameReader, ProtocolError, encode

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

DEFAULT_PORT = PORT
CLIENT_MAX_FRAME_BYTES = 16 << 20


class ServerError(Exception):
    """An error frame from the server (`code` is machine-readable), or a lost connection
    (code `connection_lost`)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class NoServerFound(ServerError):
    def __init__(self, message: str):
        super().__init__("no_server", message)


def parse_address(address: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """'host', 'host:port', '[v6]:port', '[v6]', a bare IPv6 address, or any of them as a URL
    ('http://host:port/...', 'tcp://host') -> (host, port)."""
    address = address.strip()
    if "://" in address:            # a URL: its host and port (a path is ignored)
        address = address.split("://", 1)[1].split("/", 1)[0]
    if address.count(":") > 1 and not address.startswith("["):   # a bare IPv6 address
        address = f"[{address}]"
    host, port = address, str(default_port)
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else port
    elif address.count(":") == 1:
        host, port = address.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ServerError("bad_address", f"not a server address: {address!r} (expected HOST:PORT)")
    return host, int(port)


class Stream:
    """One chat/generate request. Iterate for text pieces; `done` holds the final frame.
    Raises ServerError if the server refuses the request.

    With `n` > 1 (parallel samples) the pieces of every sample come through the iteration
    (`last_index` says whose); `texts` and `dones` hold each sample's text and done frame,
    `text`/`done` the first sample's; the stream ends when every sample is done."""

    def __init__(self, client: "Client", frame: dict):
        self.client, self.frame, self.id = client, frame, frame["id"]
        self.send, self.recv = trio.open_memory_channel(math.inf)
        self.finished = trio.Event()
        self.done: dict | None = None
        self.error: ServerError | None = None
        self.token_ids: list[int] = []
        self.started = False
        n = frame.get("n") or 1
        self.n = n if isinstance(n, int) and n > 1 else 1
        self.parts: list[list[str]] = [[] for _ in range(self.n)]
        self.text_parts = self.parts[0]              # the first sample's pieces
        self.dones: list[dict | None] = [None] * self.n
        self.last_index = 0
        self.thinking_parts: list[str] = []          # a thinking model's thinking (the first sample's)
        self.last_thinking = ""                      # the thinking that came with the last piece

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def texts(self) -> list[str]:
        return ["".join(p) for p in self.parts]

    @property
    def thinking(self) -> str:
        """A thinking model's thinking, apart from `text` (the answer)."""
        return "".join(self.thinking_parts)

    def _index(self, msg: dict) -> int:
        k = msg.get("index", 0)
        return k if isinstance(k, int) and 0 <= k < self.n else 0

    def _on_frame(self, msg: dict) -> None:   # from the client's reader task
        if msg.get("type") == "done":
            k = self._index(msg)
            self.dones[k] = msg
            if k == 0:
                self.done = msg
            if any(d is None for d in self.dones):
                return                       # other samples still run
        elif msg.get("type") == "error":
            self.error = ServerError(msg.get("code", "?"), msg.get("message", ""))
        else:
            self.send.send_nowait(msg)
            return
        self._finish()

    def _finish(self, error: ServerError | None = None) -> None:
        if error is not None and self.error is None and self.done is None:
            self.error = error
        self.send.close()
        self.finished.set()
        self.client._streams.pop(self.id, None)

    async def start(self) -> "Stream":
        if not self.started:
            self.started = True
            self.client._streams[self.id] = self
            try:
                await self.client._send(self.frame)
            except BaseException:
                self.client._streams.pop(self.id, None)
                raise
        return self

    async def __aenter__(self) -> "Stream":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        await self.start()
        try:
            msg = await self.recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            if self.error is not None:
                raise self.error from None
            raise StopAsyncIteration from None
        k = self.last_index = self._index(msg)
        self.parts[k].append(msg.get("text", ""))
        self.last_thinking = msg.get("thinking", "") or ""
        if k == 0:
            self.token_ids += msg.get("token_ids", [])
            self.thinking_parts.append(self.last_thinking)
        return msg.get("text", "")

    async def cancel(self, timeout_s: float = 10.0) -> dict | None:
        """Ask the server to stop this request; returns its done frame (finish_reason cancelled)."""
        if self.started and not self.finished.is_set():
            try:
                await self.client._send({"type": "cancel", "id": self.id})
            except ServerError:
                pass
            with trio.move_on_after(timeout_s):
                await self.finished.wait()
        return self.done

    async def aclose(self) -> None:
        await self.cancel()
        if not self.finished.is_set():
            self._finish()

    async def collect(self) -> tuple[str, dict]:
        """Run to the end: (text, done frame)."""
        async for _ in self:
            pass
        return self.text, self.done


class Client:
    """A connection after hello; make it with `open_client`. `info` is the server's hello."""

    def __init__(self, stream, name: str | None = None, address: str = ""):
        self.stream = stream
        self.name = name
        self.address = address          # host:port it dialled
        self.info: dict = {}
        self._streams: dict[Any, Stream] = {}
        self._replies: dict[Any, trio.MemorySendChannel] = {}
        self._ids = itertools.count(1)
        self._lock = trio.Lock()
        self.closed: ServerError | None = None

    async def _send(self, frame: dict) -> None:
        if self.closed is not None:
            raise self.closed
        try:
            async with self._lock:
                await self.stream.send_all(encode(frame))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as e:
            raise ServerError("connection_lost", str(e) or "the connection is closed") from None

    async def _reader(self) -> None:
        reader = FrameReader(self.stream, CLIENT_MAX_FRAME_BYTES)
        error = ServerError("connection_lost", "the server closed the connection")
        try:
            while True:
                msg = await reader.read()
                rid = msg.get("id")
                if not isinstance(rid, (int, str)):
                    rid = None
                if rid in self._streams:
                    self._streams[rid]._on_frame(msg)
                elif rid in self._replies:
                    self._replies.pop(rid).send_nowait(msg)
                elif msg.get("type") == "error":    # about the connection itself
                    error = ServerError(msg.get("code", "?"), msg.get("message", ""))
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except ProtocolError as e:
            error = ServerError(e.code, f"from the server: {e.message}")
        self.closed = error
        for s in list(self._streams.values()):
            s._finish(error)
        for ch in list(self._replies.values()):
            ch.close()
        self._replies.clear()

    async def request(self, frame: dict) -> dict:
        """Send a frame with a fresh id and wait for its one reply (hello, stats, models)."""
        rid = frame.setdefault("id", next(self._ids))
        send, recv = trio.open_memory_channel(1)
        self._replies[rid] = send
        try:
            await self._send(frame)
            try:
                msg = await recv.receive()
            except trio.EndOfChannel:
                raise self.closed or ServerError("connection_lost", "the connection is closed") from None
        finally:
            self._replies.pop(rid, None)
        if msg.get("type") == "error":
            raise ServerError(msg.get("code", "?"), msg.get("message", ""))
        return msg

    async def hello(self, token: str | None = None) -> dict:
        frame = {"type": "hello", "version": PROTOCOL_VERSION}
        if token is not None:
            frame["token"] = token
        if self.name:
            frame["client"] = self.name
        self.info = await self.request(frame)
        return self.info

    def chat(self, messages: list[dict], **params) -> Stream:
        """A streaming chat request; params: max_tokens, temperature, top_k, top_p, min_p,
        repetition_penalty, seed, stop, stop_token_ids, ignore_eos, priority."""
        return Stream(self, {"type": "chat", "id": next(self._ids), "messages": messages, **_clean(params)})

    def generate(self, prompt: str, **params) -> Stream:
        return Stream(self, {"type": "generate", "id": next(self._ids), "prompt": prompt, **_clean(params)})

    async def stats(self) -> dict:
        return (await self.request({"type": "stats"}))["stats"]

    async def models(self) -> list[dict]:
        return (await self.request({"type": "models"}))["models"]


def _clean(params: dict) -> dict:
    return {k: v for k, v in params.items() if v is not None}


async def resolve(server: str | None, *, discover_timeout_s: float = 3.0, mdns_interface: str | None = None,
                  wait_all: bool = False) -> list[tuple[str, int]]:
    """Where to connect: the given address, or the servers found by mDNS, least loaded first
    (every address of each). Discovery returns shortly after the first server answers,
    or with `wait_all` after the whole timeout."""
    if server:
        return [parse_address(server)]
    from ..server.mdns import discover
    records = await discover(discover_timeout_s, mdns_interface, first=not wait_all)
    if not records:
        raise NoServerFound(f"no edgepaged server answered on the local network within {discover_timeout_s:g} s; "
                            "give one with --server HOST:PORT")
    return [(addr, r.port) for r in records for addr in r.addresses]


async def _connect(candidates, tried: set, last):
    """The first of `candidates` not in `tried` that accepts a connection -> (stream, host,
    port, last error)."""
    for host, port in candidates:
        if (host, port) in tried:
            continue
        tried.add((host, port))
        try:
            return await trio.open_tcp_stream(host, port), host, port, last
        except OSError as e:
            last = ServerError("connection_failed", f"cannot connect to {host}:{port}: {e.strerror or e}")
    return None, None, None, last


CACHE_ENV = "EDGEPAGED_SERVER_CACHE"    # 0: never remember the last server (also --no-cache)


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edgepaged" / "last_server"


def _cached_server(use_cache: bool) -> tuple[str, int] | None:
    if not use_cache or os.environ.get(CACHE_ENV, "1") == "0":
        return None
    try:
        return parse_address(cache_path().read_text().strip())
    except (OSError, ServerError):
        return None


def _remember(host: str, port: int, use_cache: bool) -> None:
    if not use_cache or os.environ.get(CACHE_ENV, "1") == "0":
        return
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        path = cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(address + "\n")
    except OSError:
        pass      # a read-only home: discovery every time


@asynccontextmanager
async def open_client(server: str | None = None, *, token: str | None = None, name: str | None = None,
                      discover_timeout_s: float = 3.0, mdns_interface: str | None = None, use_cache: bool = True):
    """Connect (to `server` 'HOST:PORT', or by discovery), say hello, yield a Client.

    Without `server`, the last server that answered (remembered in ~/.cache/edgepaged) is
    tried first, for half a second, before asking the network. By discovery, servers are
    tried least loaded first; when none of those that answered first accepts (a stale
    record of a server that stopped, a dead port), the network is asked again for the
    whole timeout and the others are tried."""
    tried: set = set()
    stream, host, port, last = None, None, None, None
    cached = None if server else _cached_server(use_cache)
    if cached is not None:
        with trio.move_on_after(0.5):
            stream, host, port, last = await _connect([cached], tried, None)
    if stream is None:
        found = await resolve(server, discover_timeout_s=discover_timeout_s, mdns_interface=mdns_interface)
        stream, host, port, last = await _connect(found, tried, last)
    if stream is None and not server:
        try:
            found = await resolve(None, discover_timeout_s=discover_timeout_s, mdns_interface=mdns_interface,
                                  wait_all=True)
        except NoServerFound:
            found = []
        stream, host, port, last = await _connect(found, tried, last)
    if stream is None:
        raise last
    async with stream:
        client = Client(stream, name, f"{host}:{port}")
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client._reader)    # never raises: it reports through the streams
                try:
                    await client.hello(token)
                    _remember(host, port, use_cache)
                    yield client
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:   # the caller's own exception, not wrapped in a group
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise


# ---------------------------------------------------------------- synchronous wrapper

_END = object()


class SyncStream:
    """A Stream driven from a plain thread: iterate for text; `cancel()`; `done`."""

    def __init__(self, owner: "SyncClient", stream: Stream):
        self.owner, self.stream = owner, stream

    @property
    def done(self) -> dict | None:
        return self.stream.done

    @property
    def text(self) -> str:
        return self.stream.text

    @property
    def texts(self) -> list[str]:
        """Each sample's text (n > 1)."""
        return self.stream.texts

    @property
    def dones(self) -> list[dict | None]:
        return self.stream.dones

    @property
    def last_index(self) -> int:
        return self.stream.last_index

    @property
    def thinking(self) -> str:
        return self.stream.thinking

    @property
    def last_thinking(self) -> str:
        return self.stream.last_thinking

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        async def step():
            try:
                return await self.stream.__anext__()
            except StopAsyncIteration:
                return _END
        piece = self.owner._call(step)
        if piece is _END:
            raise StopIteration
        return piece

    def cancel(self) -> dict | None:
        return self.owner._call(self.stream.cancel)

    def collect(self) -> tuple[str, dict]:
        """Run to the end: (text, done frame)."""
        return self.owner._call(self.stream.collect)

    def close(self) -> None:
        self.owner._call(self.stream.aclose)


class SyncClient:
    """The Trio client run in a background thread; every method blocks until done."""

    def __init__(self, server: str | None = None, **kwargs):
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._client: Client | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main, server, kwargs), daemon=True,
                                        name="edgepaged-client")
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    async def _main(self, server, kwargs) -> None:
        try:
            async with open_client(server, **kwargs) as client:
                self._client, self._token = client, trio.lowlevel.current_trio_token()
                self._stop = trio.Event()
                self._ready.set()
                await self._stop.wait()
        except BaseException as e:  # reported to the caller of __init__ (or lost after close)
            self._error = e
        finally:
            self._ready.set()

    def _call(self, afn, *args):
        try:
            return trio.from_thread.run(afn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise ServerError("connection_lost", "the client is closed") from None

    @property
    def info(self) -> dict:
        return self._client.info

    @property
    def address(self) -> str:
        return self._client.address

    def _open(self, make) -> SyncStream:
        async def start():   # built and sent in the Trio thread
            return await make().start()
        return SyncStream(self, self._call(start))

    def chat(self, messages: list[dict], **params) -> SyncStream:
        return self._open(lambda: self._client.chat(messages, **params))

    def generate(self, prompt: str, **params) -> SyncStream:
        return self._open(lambda: self._client.generate(prompt, **params))

    def stats(self) -> dict:
        return self._call(self._client.stats)

    def models(self) -> list[dict]:
        return self._call(self._client.models)

    def close(self) -> None:
        if self._thread.is_alive():
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
            self._thread.join()

    def __enter__(self) -> "SyncClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
