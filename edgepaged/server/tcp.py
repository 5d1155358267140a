"""The TCP server: `trio.serve_tcp`, one task per connection (connection.py), one task per
request, all under nurseries; connection limits and shutdown. Who may ask and what a
request becomes is the front end's (edgepaged/request/frontend.py).

    server = Server(FrontEnd(engine), ServerConfig(port=0))
    async with trio.open_nursery() as n:
        await n.start(server.serve)          # listening; server.port is the bound port
        ...
        await server.shutdown(grace_s=10)    # stop accepting, drain, close connections
"""
from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import trio

from ..common.ports import PORT
from ..request.frontend import FrontEnd
from ..request.protocol import MAX_FRAME_BYTES, PROTOCOL_VERSION, ProtocolError, encode
from .connection import Connection, close_gracefully

if TYPE_CHECKING:
    from .httpd import HttpServer

log = logging.getLogger("edgepaged.server")
try:
    VERSION = importlib.metadata.version("edgepaged")
except importlib.metadata.PackageNotFoundError:
    VERSION = "0+unknown"


@dataclass
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = PORT
    max_connections: int = 64            # connections past hello (authenticated ones, with a token)
    # connections that have not finished hello, from all addresses and from one: past these
    # the one waiting longest for its hello gives its place up; they never take the places above
    max_unauthenticated: int = 16
    max_unauthenticated_per_address: int = 4
    max_inflight: int = 16               # requests in flight per connection
    max_frame_bytes: int = MAX_FRAME_BYTES
    max_pending_frames: int = 256        # per connection: frames waiting for the socket
    unread_timeout_s: float = 30.0       # a connection that takes none of its output this long is closed
    hello_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0        # no request in flight and no whole frame this long: close
    flush_s: float = 2.0                 # at shutdown: time to deliver the last frames
    sock: object = None                  # a socket already bound and listening (serve binds before loading)


class Server:
    def __init__(self, front: FrontEnd, config: ServerConfig | None = None):
        self.front, self.engine = front, front.engine
        self.config = config or ServerConfig()
        self.connections: set[Connection] = set()
        self.greeted = 0                               # connections past hello
        self.pending: dict[Connection, str] = {}       # connections before hello -> peer, oldest first
        self.listeners: list = []
        self._accept_scope = trio.CancelScope()
        self._grace_scope = trio.CancelScope()
        self._conns: trio.Nursery | None = None
        self.http: HttpServer | None = None   # the HttpServer beside it, if any (named to HTTP clients here)

    @property
    def port(self) -> int:
        return self.listeners[0].socket.getsockname()[1]

    @property
    def address(self) -> str:
        """host:port of the first listener, as a client dials it ("127.0.0.1:PORT")."""
        host = self.listeners[0].socket.getsockname()[0]
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    @property
    def http_base(self) -> str | None:
        """The HTTP server's base URL (no trailing slash), or None without one."""
        return self.http.base if self.http is not None else None

    def info(self) -> dict:
        """The hello reply."""
        e, f = self.engine, self.front
        return {"type": "hello", "version": PROTOCOL_VERSION, "server": f"edgepaged {VERSION}",
                "model": f.model, "context_length": e.max_model_len, "block_size": e.block_size,
                "kv_capacity_tokens": e.kv_capacity_blocks * e.block_size, "auth_required": f.auth_required,
                "limits": {"max_frame_bytes": self.config.max_frame_bytes, "max_inflight": self.config.max_inflight,
                           "max_prompt_tokens": f.max_prompt_tokens, "max_tokens": f.max_tokens},
                "models": [m["name"] for m in f.models()]}

    def stats(self) -> dict:
        s = self.engine.stats()
        s["server"] = {"connections": len(self.connections), "connections_before_hello": len(self.pending),
                       "requests_inflight": sum(len(c.inflight) for c in self.connections),
                       "tasks_living": trio.lowlevel.current_statistics().tasks_living}
        return s

    # -- lifecycle ----------------------------------------------------------------------------
    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        async with trio.open_nursery() as conns:
            self._conns = conns
            with self._accept_scope:
                async with trio.open_nursery() as accept:
                    if cfg.sock is not None:
                        listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(cfg.sock))]
                        self.listeners = await accept.start(partial(
                            trio.serve_listeners, self._handle, listeners, handler_nursery=conns))
                    else:
                        self.listeners = await accept.start(partial(
                            trio.serve_tcp, self._handle, cfg.port, host=cfg.host, handler_nursery=conns))
                    task_status.started(self.listeners)

    async def shutdown(self, grace_s: float) -> int:
        """Stop accepting, let running requests finish within `grace_s` (the rest end with
        reason `shutdown`), deliver the last frames, close every connection. Returns the
        number of requests cancelled."""
        self._accept_scope.cancel()
        with self._grace_scope:
            cancelled = await self.engine.drain(grace_s)
        if self._grace_scope.cancelled_caught:
            cancelled = await self.engine.drain(0)
        for conn in list(self.connections):
            conn.read_scope.cancel()
        with trio.move_on_after(self.config.flush_s):
            while self.connections:
                await trio.sleep(0.02)
        if self._conns is not None:
            self._conns.cancel_scope.cancel()
        return cancelled

    def stop_accepting(self) -> None:
        self._accept_scope.cancel()

    def hurry(self) -> None:
        """Cut the shutdown's grace period short."""
        self._grace_scope.cancel()

    def admit(self, conn: Connection) -> None:
        """After a successful hello: the connection moves from the allowance of connections
        before hello to the authenticated ones (ProtocolError server_busy when they are all
        taken). Connections still before hello never compete with these."""
        if self.greeted >= self.config.max_connections:
            raise ProtocolError("server_busy", f"the server has its {self.config.max_connections} connections; try "
                                "later")
        self.pending.pop(conn, None)
        conn.greeted = True
        self.greeted += 1

    EVICT_AFTER_S = 0.5   # a connection still without hello after this long may give its place up

    def _make_room(self, peer: str) -> bool:
        """Room for one more connection before hello from `peer`: past the per-address
        allowance, that address's connection waiting longest for its hello gives its place
        up; past the total allowance, the longest waiting one of the address holding the
        most. Only connections that waited `EVICT_AFTER_S` without a hello frame give way (a
        client's hello follows its connect at once). False when none can."""
        cfg = self.config
        mine = [c for c, p in self.pending.items() if p == peer]
        if len(mine) >= cfg.max_unauthenticated_per_address:
            candidates = mine
        elif len(self.pending) >= cfg.max_unauthenticated:
            by_peer: dict[str, list] = {}
            for c, p in self.pending.items():
                by_peer.setdefault(p, []).append(c)
            candidates = max(by_peer.values(), key=len)
        else:
            return True
        old = trio.current_time() - self.EVICT_AFTER_S
        for c in candidates:          # oldest first
            if c.opened <= old and c.evict():
                del self.pending[c]
                return True
        return False

    async def _refuse(self, stream, message: str) -> None:
        try:
            await stream.send_all(encode(ProtocolError("server_busy", message).frame()))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        await close_gracefully(stream)

    async def _handle(self, stream) -> None:
        try:
            peer = str(stream.socket.getpeername()[0])
        except OSError:
            peer = "?"
        if not self._make_room(peer):
            return await self._refuse(stream, "too many connections are saying hello right now; try again")
        conn = Connection(self, stream, peer)
        self.pending[conn] = peer
        self.connections.add(conn)
        try:
            await conn.run()
        except Exception:  # a bug in one connection must not take the server down
            log.exception("connection from %s failed", conn.peer)
        finally:
            self.connections.discard(conn)
            if conn.greeted:
                self.greeted -= 1
            self.pending.pop(conn, None)
