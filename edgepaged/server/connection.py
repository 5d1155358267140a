"""One client connection: a reader, a writer and the request tasks, under one nursery.

The reader takes frames in, validates them and dispatches; the writer sends frames out
through a bounded queue (a peer that takes no output for `unread_timeout_s` is cut off, so
it never holds up the engine or other clients); each chat/generate runs as a task around
`Engine.stream`. When the peer leaves or breaks the protocol, the request tasks are
cancelled and leaving `Engine.stream` frees their blocks at once.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from ..common import brief
from ..engine import DoneEvent, EngineClosed, RequestRejected, TokenEvent
from ..request.answer import Answer, End, Piece, answer_events
from ..request.frontend import AuthFailed, Caller
from ..request.protocol import (CODES, SUPPORTED_VERSIONS, ConnectionClosed, FrameReader, GenerateRequest, Hello,
                       ProtocolError, encode, parse, with_id)

if TYPE_CHECKING:
    from .tcp import Server

log = logging.getLogger("edgepaged.server")


INTERNAL_MESSAGE = "the server failed on this request (see its log)"


def _log_failure(what: str, e: BaseException) -> None:
    """One line in the log; the traceback at debug level only."""
    log.error("%s failed: %s", what, brief.of(e))
    log.debug("%s failed", what, exc_info=e)


def event_frame(rid, ev: TokenEvent | DoneEvent, model: str = "", truncated: int = 0) -> dict:
    if isinstance(ev, TokenEvent):
        frame = {"type": "token", "id": rid, "text": ev.text, "token_ids": ev.token_ids}
        if ev.logprobs:
            frame["logprobs"] = ev.logprobs
        return frame
    frame = {"type": "done", "id": rid, "finish_reason": ev.finish_reason, "usage": ev.usage, "timings": ev.timings}
    if ev.stop is not None:
        frame["stop"] = ev.stop
    if ev.error:
        frame["error"] = ev.error
    if model:
        frame["model"] = model       # the model that answered
    if truncated:
        frame["truncated_messages"] = truncated   # truncate "auto" dropped this many old messages
    return frame


def item_frame(rid, item: Piece | End, ticket) -> dict:
    """One answer item (answer.py) as this protocol's frame: a `token` frame (the text, a
    thinking model's thinking apart in `thinking`), or the `done` frame (the tool calls the
    answer made, finish_reason "tool_calls")."""
    if isinstance(item, Piece):
        frame = event_frame(rid, TokenEvent(item.token_ids, item.text, item.logprobs))
        if item.thinking:
            frame["thinking"] = item.thinking
        return frame
    frame = event_frame(rid, item.done, ticket.model, ticket.truncated)
    if item.calls and item.finish_reason == "tool_calls":
        frame["finish_reason"] = "tool_calls"
        frame["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
            "name": c["name"], "arguments": c["arguments"]}} for c in item.calls]
    return frame


def rejected(e: RequestRejected, rid) -> ProtocolError:
    """A refusal from the front end or the engine as the protocol's error frame."""
    return ProtocolError(e.code if e.code in CODES else "bad_request", str(e), rid)


async def close_gracefully(stream, timeout_s: float = 1.0) -> None:
    """FIN after what was sent, then discard what the peer still sends (closing with unread
    input would reset the connection and could destroy the last error frame in flight)."""
    with trio.move_on_after(timeout_s):
        try:
            await stream.send_eof()
            while await stream.receive_some(65536):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


class Connection:
    def __init__(self, server: Server, stream, peer: str):
        self.server, self.engine, self.stream = server, server.engine, stream
        cfg = self.config = server.config
        self.peer = peer
        self.greeted = False                     # counted among the server's authenticated connections
        self.hello_scope: trio.CancelScope | None = None   # set while waiting for the hello frame
        self.opened = trio.current_time()
        self.evicted = False
        self.caller: Caller | None = None        # who is asking, known after hello
        self.idle_scope: trio.CancelScope | None = None
        self.hello: Hello | None = None
        self.inflight: dict = {}                 # request id -> engine Request (None while it is built)
        self.building: dict = {}                 # request id -> the cancel scope of its build
        self.samples: dict = {}                  # request id -> its parallel samples (n > 1)
        self.out_send, self.out_recv = trio.open_memory_channel(cfg.max_pending_frames)
        self.read_scope = trio.CancelScope()     # cancelled at shutdown: read no more, finish what runs
        self._outer: trio.Nursery | None = None
        self._requests: trio.Nursery | None = None

    def evict(self) -> bool:
        """Give up this connection's place while it waits for its hello frame (it gets
        server_busy and is closed); False when it is past that point."""
        if self.hello_scope is None or self.evicted:
            return False
        self.evicted = True
        self.hello_scope.cancel()
        return True

    async def send(self, frame: dict) -> None:
        await self.out_send.send(encode(frame))

    async def run(self) -> None:
        fatal = False
        async with trio.open_nursery() as outer:
            self._outer = outer
            outer.start_soon(self._writer)
            async with trio.open_nursery() as requests:
                self._requests = requests
                with self.read_scope:
                    fatal = await self._read_loop()
                    requests.cancel_scope.cancel()   # the peer left or broke the protocol: its requests end
            await self.out_send.aclose()             # the writer delivers what is queued, then ends
        if fatal or self.read_scope.cancel_called:
            await close_gracefully(self.stream)

    async def _writer(self) -> None:
        try:
            async for data in self.out_recv:
                chunks, size = [data], len(data)
                while size < 262_144:
                    try:
                        more = self.out_recv.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    chunks.append(more)
                    size += len(more)
                with trio.fail_after(self.config.unread_timeout_s):
                    await self.stream.send_all(b"".join(chunks))
        except trio.TooSlowError:
            log.warning("closing the connection from %s: it read nothing for %.0f s", self.peer,
                        self.config.unread_timeout_s)
            self._outer.cancel_scope.cancel()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._outer.cancel_scope.cancel()

    async def _read_loop(self) -> bool:
        """Read and dispatch frames until the peer leaves (False) or a fatal error (True)."""
        reader = FrameReader(self.stream, self.config.max_frame_bytes)
        while True:
            try:
                if self.hello is None:
                    with trio.move_on_after(self.config.hello_timeout_s) as scope:
                        self.hello_scope = scope
                        msg = await reader.read()
                    self.hello_scope = None
                    if scope.cancelled_caught and self.evicted:
                        raise ProtocolError("server_busy", "too many connections are waiting to say hello; this one "
                                            "waited longest")
                    if scope.cancelled_caught:
                        raise ProtocolError("hello_timeout", f"no hello within {self.config.hello_timeout_s} s")
                else:
                    # a client waiting for its answers may stay quiet; one with nothing in
                    # flight (or stalled halfway through a frame) may not hold a slot forever
                    with trio.CancelScope() as scope:
                        self.idle_scope = scope
                        if not self.inflight:
                            scope.deadline = trio.current_time() + self.config.idle_timeout_s
                        msg = await reader.read()
                    self.idle_scope = None
                    if scope.cancelled_caught:
                        raise ProtocolError("idle_timeout", f"no request and no frame for "
                                            f"{self.config.idle_timeout_s:.0f} s")
                await self._dispatch(msg)
            except ConnectionClosed:
                return False
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return False
            except ProtocolError as e:
                if e.code == "wrong_port":     # a browser or curl: answer in its own language
                    await self._http_hint()
                    return True
                await self.send(e.frame())
                if e.fatal:
                    return True
            except Exception as e:  # never let one frame take the server down
                _log_failure(f"handling a frame from {self.peer}", e)
                await self.send(ProtocolError("internal_error", INTERNAL_MESSAGE).frame())

    async def _http_hint(self) -> None:
        """A short HTTP answer for an HTTP client at the msgpack port, naming the HTTP port."""
        http = self.server.http
        port = http.port if http is not None else None
        where = f"the HTTP port is {port} (the chat page, the OpenAI and Ollama APIs)" if port else \
            "this server has no HTTP port open"
        body = (f"This is edgepaged's msgpack protocol port, not HTTP; {where}.\n").encode()
        head = (f"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        try:
            with trio.move_on_after(2):
                await self.stream.send_all(head + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def _dispatch(self, msg: dict) -> None:
        item = parse(msg)
        if isinstance(item, Hello):
            return await self._hello(item)
        if self.hello is None:
            raise ProtocolError("hello_required", "send hello first", item.id)
        if isinstance(item, GenerateRequest):
            return await self._start(item)
        if item.kind == "cancel":
            if item.id in self.building:           # still being built: it ends before it runs
                self.building[item.id].cancel()
                return
            req = self.inflight.get(item.id)
            if req is None:
                raise ProtocolError("unknown_request", f"no request {item.id!r} in flight", item.id)
            for r in self.samples.get(item.id, [req]):   # every parallel sample of it
                self.engine.cancel(r)     # its done frame (finish_reason cancelled) follows
        elif item.kind == "stats":
            await self.send(with_id({"type": "stats", "stats": self.server.front.stats(self.caller, self.server.stats())},
                                    item.id))
        elif item.kind == "models":
            await self.send(with_id({"type": "models", "models": self.server.front.models()}, item.id))

    async def _hello(self, item: Hello) -> None:
        if self.hello is not None:
            raise ProtocolError("bad_request", "hello was already done on this connection", item.id)
        if item.version not in SUPPORTED_VERSIONS:
            raise ProtocolError("unsupported_version", f"protocol version {item.version} is not supported; this "
                                f"server speaks {', '.join(map(str, SUPPORTED_VERSIONS))}", item.id)
        try:
            user = await self.server.front.authenticate(item.token, self.peer)
        except AuthFailed as e:
            raise ProtocolError("auth_failed", str(e), item.id) from None
        self.server.admit(self)      # server_busy when the authenticated connections are all taken
        self.hello = item
        self.caller = self.server.front.caller(user, item.client, self.peer)
        await self.send(with_id(self.server.info(), item.id))

    async def _start(self, item: GenerateRequest) -> None:
        """Take a request: checked here, then built (validated, rendered, tokenized, its grammar
        compiled) and run in a task of its own, so the reader goes on reading this connection's
        frames (a cancel, another request) however long the build takes."""
        rid = item.id
        if rid in self.inflight:
            raise ProtocolError("duplicate_id", f"request {rid!r} is already in flight", rid)
        if len(self.inflight) >= self.config.max_inflight:
            raise ProtocolError("too_many_requests", f"at most {self.config.max_inflight} requests in flight "
                                "per connection", rid)
        if not self.engine.accepting:
            raise ProtocolError("shutdown", "the server is shutting down", rid)
        front = self.server.front
        if item.model and front.modelset is None and item.model not in (front.model, f"{front.model}:latest"):
            # (a box of one model answers by that model only: as the Ollama door does, a 404 there)
            raise ProtocolError("model_not_found", f"no model {item.model!r} on this box; it serves {front.model!r}",
                                rid)
        self.inflight[rid] = None              # its place, held while it is built
        self.building[rid] = trio.CancelScope()
        self._requests.start_soon(self._run, rid, item)

    async def _run(self, rid, item: GenerateRequest) -> None:
        scope = self.building[rid]
        ticket = None
        try:
            with scope:
                ticket = await self.server.front.build(item, self.caller)
            if ticket is None or scope.cancel_called:   # cancelled while it was built
                await self.send(event_frame(rid, DoneEvent("cancelled", {"prompt_tokens": 0, "completion_tokens": 0,
                                                                         "cached_tokens": 0}, {})))
                return
            self.inflight[rid] = ticket.req
            self.building.pop(rid, None)
            await self._stream(rid, ticket)
        except EngineClosed:
            await self.send(ProtocolError("shutdown", "the server is shutting down", rid).frame())
        except RequestRejected as e:
            await self.send(rejected(e, rid).frame())
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception as e:   # one request's failure is that request's, never the connection's
            _log_failure(f"request {rid!r} from {self.peer}", e)
            await self.send(ProtocolError("internal_error", INTERNAL_MESSAGE, rid).frame())
        finally:
            self.building.pop(rid, None)
            self.inflight.pop(rid, None)
            if not self.inflight and self.idle_scope is not None:   # idle again: arm the timeout
                self.idle_scope.deadline = trio.current_time() + self.config.idle_timeout_s

    async def _stream(self, rid, ticket, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The answer's items as frames; n > 1: every frame carries the sample's `index` and
        each sample ends with a done frame of its own."""
        req = ticket.req
        samples = [req, *req.children]
        if len(samples) > 1:
            self.samples[rid] = samples
        answer = Answer(ticket, thinking=True)
        try:
            async with answer_events(self.engine, req) as events:
                task_status.started()
                async for k, ev in events:
                    for item in answer.feed(k, ev):
                        frame = item_frame(rid, item, ticket)
                        if answer.n > 1:
                            frame["index"] = k
                        await self.send(frame)
        finally:
            self.samples.pop(rid, None)
            self.inflight.pop(rid, None)
            if not self.inflight and self.idle_scope is not None:   # idle again: arm the timeout
                self.idle_scope.deadline = trio.current_time() + self.config.idle_timeout_s
