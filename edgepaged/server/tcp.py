"""The TCP server: `trio.serve_tcp`, one task per connection (connection.py), one task per
request, all under nurseries; limits, auth, request building, shutdown.

    server = Server(engine, ServerConfig(port=0))
    async with trio.open_nursery() as n:
        await n.start(server.serve)          # listening; server.port is the bound port
        ...
        await server.shutdown(grace_s=10)    # stop accepting, drain, close connections
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio

from ..engine import RequestRejected
from ..model.sampler import SamplingParams
from .connection import Connection, close_gracefully
from .protocol import CODES, MAX_FRAME_BYTES, PROTOCOL_VERSION, GenerateRequest, ProtocolError, encode

log = logging.getLogger("edgepaged.server")
try:
    VERSION = importlib.metadata.version("edgepaged")
except importlib.metadata.PackageNotFoundError:
    VERSION = "0+unknown"
OFFLOAD_CHARS = 32_768   # tokenize longer prompts in a worker thread


@dataclass
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 7878
    token: str | None = None             # shared secret asked in hello; None = open to the network
    users: dict[str, str] | None = None  # per-user tokens (token -> name): each user's own prefix cache
    max_connections: int = 64
    max_inflight: int = 16               # requests in flight per connection
    max_prompt_tokens: int | None = None  # default: the context length - 1
    max_tokens: int | None = None        # cap on a request's max_tokens; default: the context length
    max_frame_bytes: int = MAX_FRAME_BYTES
    max_pending_frames: int = 256        # per connection: frames waiting for the socket
    unread_timeout_s: float = 30.0       # a connection that takes none of its output this long is closed
    hello_timeout_s: float = 10.0
    idle_timeout_s: float = 300.0        # no request in flight and no whole frame this long: close
    flush_s: float = 2.0                 # at shutdown: time to deliver the last frames


def cache_salt(identity: str, shared: bool = False) -> int:
    """The prefix-cache salt of a request. Each identity (the authenticated user, else the
    client's name) gets a cache of its own, so nobody can learn from time-to-first-token
    whether somebody else sent a prompt; `shared` (the request's explicit opt-in) uses the
    household-wide cache, e.g. for a common system prompt."""
    if shared:
        return 0
    digest = hashlib.blake2b(identity.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1 or 1


def load_users(path) -> dict[str, str]:
    """A users file: one `name token` per line ('#' comments). Returns token -> name."""
    users: dict[str, str] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{n}: expected 'name token'")
        name, token = parts
        if token in users:
            raise ValueError(f"{path}:{n}: the token of {name!r} is already used by {users[token]!r}")
        users[token] = name
    if not users:
        raise ValueError(f"{path}: no users")
    return users


def model_display_name(engine) -> str:
    name = Path(str(engine.model_name)).name
    return name[:-5] if name.endswith(".gguf") else name


class Server:
    def __init__(self, engine, config: ServerConfig | None = None):
        self.engine = engine
        self.config = cfg = config or ServerConfig()
        ctx = engine.max_model_len
        self.max_prompt_tokens = min(cfg.max_prompt_tokens or ctx - 1, ctx - 1)
        self.max_tokens = min(cfg.max_tokens or ctx, ctx)
        self.model = model_display_name(engine)
        self.connections: set[Connection] = set()
        self.listeners: list = []
        self._accept_scope = trio.CancelScope()
        self._grace_scope = trio.CancelScope()
        self._conns: trio.Nursery | None = None

    @property
    def port(self) -> int:
        return self.listeners[0].socket.getsockname()[1]

    def info(self) -> dict:
        """The hello reply."""
        e = self.engine
        return {"type": "hello", "version": PROTOCOL_VERSION, "server": f"edgepaged {VERSION}",
                "model": self.model, "context_length": e.max_model_len, "block_size": e.block_size,
                "kv_capacity_tokens": e.kv_capacity_blocks * e.block_size,
                "auth_required": self.config.token is not None or bool(self.config.users),
                "limits": {"max_frame_bytes": self.config.max_frame_bytes, "max_inflight": self.config.max_inflight,
                           "max_prompt_tokens": self.max_prompt_tokens, "max_tokens": self.max_tokens}}

    def stats(self) -> dict:
        s = self.engine.stats()
        s["server"] = {"connections": len(self.connections),
                       "requests_inflight": sum(len(c.inflight) for c in self.connections),
                       "tasks_living": trio.lowlevel.current_statistics().tasks_living}
        return s

    def models(self) -> list[dict]:
        return [{"name": self.model, "context_length": self.engine.max_model_len, "default": True}]

    # -- lifecycle ----------------------------------------------------------------------------
    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        async with trio.open_nursery() as conns:
            self._conns = conns
            with self._accept_scope:
                async with trio.open_nursery() as accept:
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

    async def _handle(self, stream) -> None:
        if len(self.connections) >= self.config.max_connections:
            try:
                await stream.send_all(encode(ProtocolError("server_busy", "too many connections; try later").frame()))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            await close_gracefully(stream)
            return
        conn = Connection(self, stream)
        self.connections.add(conn)
        try:
            await conn.run()
        except Exception:  # a bug in one connection must not take the server down
            log.exception("connection from %s failed", conn.peer)
        finally:
            self.connections.discard(conn)

    # -- requests -----------------------------------------------------------------------------
    async def build_request(self, item: GenerateRequest, client: str, identity: str | None = None):
        """Tokenize and validate a chat/generate request into an engine Request."""
        rid = item.id
        try:
            params = SamplingParams(**item.sampling)
        except (ValueError, TypeError) as e:
            raise ProtocolError("invalid_params", str(e), rid) from None
        tok = self.engine.tokenizer
        if item.messages is not None:
            size = sum(len(m["content"]) for m in item.messages)
            job = partial(tok.apply_chat_template, item.messages)
        else:
            size, job = len(item.prompt), partial(tok.encode, item.prompt)
        try:
            ids = await trio.to_thread.run_sync(job) if size > OFFLOAD_CHARS else job()
        except Exception as e:  # a chat template may refuse a conversation (e.g. roles out of order)
            raise ProtocolError("bad_request", f"cannot render the prompt: {e}", rid) from None
        if len(ids) > self.max_prompt_tokens:
            raise ProtocolError("prompt_too_long", f"the prompt has {len(ids)} tokens; this server takes at most "
                                f"{self.max_prompt_tokens}", rid)
        max_tokens = item.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(self.max_tokens, self.engine.max_model_len - len(ids)))
        elif not 1 <= max_tokens <= self.max_tokens:
            raise ProtocolError("invalid_params", f"max_tokens must be in 1..{self.max_tokens} on this server, "
                                f"got {max_tokens}", rid)
        try:
            return self.engine.make_request(prompt_ids=ids, params=params, max_tokens=max_tokens,
                                            priority=item.priority, client=client,
                                            salt=cache_salt(identity or client, item.share_prefix_cache))
        except RequestRejected as e:
            raise ProtocolError(e.code if e.code in CODES else "bad_request", str(e), rid) from None
        except ValueError as e:
            raise ProtocolError("invalid_params", str(e), rid) from None
