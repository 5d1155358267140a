"""HTTP on the same process and the same engine: the OpenAI-compatible API, the metrics,
the health check and the web chat page, as a Starlette app served by hypercorn's Trio worker.

    http = HttpServer(front, HttpConfig(port=0))    # front: the FrontEnd (auth, limits, requests)
    async with trio.open_nursery() as n:
        await n.start(http.serve)        # listening; http.port is the bound port
        ...
        http.stop_accepting()            # at shutdown: no new connections, idle ones close
        await http.wait_closed(2.0)      # after the engine drained: the last answers go out

Requests are built by the front end, as for the msgpack door (same auth, same limits, same
fairness identity: the OpenAI `user` field, else the peer's address). Each generation runs inside
`engine.stream(req)` in the ASGI task, beside a watcher of the client's `http.disconnect`:
a client that goes away cancels the scope, leaving the stream aborts the request and its
KV blocks return to the pool at once.
"""
from __future__ import annotations

import importlib.resources
import base64
import json
import logging
import re
import socket
import time
from functools import partial

import numpy as np
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..common import brief
from ..common.ports import HTTP_PORT
from ..request import jsontext
from ..common.lanes import PREPARE
from ..request.answer import Answer, Call, End, Piece, answer_events
from ..engine import DoneEvent, EmbeddingEvent, EngineClosed, RequestRejected
from ..request.protocol import parse_keep_alive
from ..request.frontend import AuthFailed, FrontEnd, model_display_name
from .guard import Guard
from .manage import ModelAdmin
from .doors import ollama as ollama_api
from .doors.base import Door
from .doors.ollama import OllamaError, OllamaShaper
from .doors.responses import ResponseStore, ResponsesGeneration, ResponsesShaper, parse_responses
from .doors.openai import (ApiError, Generation, Logprobs, Shaper, done_error, error_body, model_card, models_list,
                         new_id, parse_chat, parse_completion, usage)

log = logging.getLogger("edgepaged.http")
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
DEFAULT_HTTP_PORT = HTTP_PORT
# A body over the limit is refused (413) without being kept; what the client goes on sending
# of it is read and dropped, at most DROP_BYTES and while it keeps coming (DROP_IDLE_S without
# a byte, DROP_S in all), so a client still sending hears the 413 instead of a broken pipe
# (the server closing a connection whose body it did not read).
DROP_BYTES = 16 << 20
BIG_BODY = 64 << 10
DROP_IDLE_S = 0.5
DROP_S = 5.0
# The chat page loads nothing from outside the box: the browser enforces it.
PAGE_CSP = ("default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
            "img-src 'self' data:; manifest-src 'self'; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'")


# the request body's bound when a served model takes images: one phone photo (a 12 MP JPEG is
# 3-6 MB, 4-8 MB as base64) or a camera burst's few snapshots (request/images.py bounds each image)
IMAGE_BODY_BYTES = 32 << 20


class HttpConfig:
    """Settings of the HTTP side (the token and the request limits are the front end's)."""

    def __init__(self, host: str | None = None, port: int = DEFAULT_HTTP_PORT, max_body_bytes: int = 1 << 20,
                 max_inflight: int = 64, keep_alive_s: float = 5.0, page: bool = True,
                 allowed_hosts: tuple[str, ...] = (), cors_origins: tuple[str, ...] = (),
                 admin_from: tuple[str, ...] = (), max_inflight_per_caller: int | None = None,
                 unread_timeout_s: float = 30.0, body_timeout_s: float = 30.0, send_buffer_bytes: int = 256 << 10,
                 doors: tuple = ()):
        self.doors = tuple(doors)           # more doors (doors.base.Door), beside the built-in ones
        self.host = host                    # None: every interface (0.0.0.0)
        self.allowed_hosts = tuple(allowed_hosts)   # names besides the box's own (guard.py)
        self.cors_origins = tuple(cors_origins)     # origins whose pages may call the API ("*": any)
        self.admin_from = tuple(admin_from)         # networks that may manage models on an open box (manage.py)
        self.store_root = None                      # the model store (None: store.store_dir())
        self.sock = None                    # a socket already bound (serve binds before loading the model)
        self.port = port
        self.max_body_bytes = max_body_bytes
        # ... and when a served model takes images (a phone's photo, base64 in the JSON)
        self.image_body_bytes = IMAGE_BODY_BYTES
        self.max_inflight = max_inflight    # generations in flight over HTTP, all clients together
        # ... and of one caller (a user, else an address): half of them by default
        self.max_inflight_per_caller = max_inflight_per_caller or max(1, max_inflight // 2)
        self.unread_timeout_s = unread_timeout_s   # an answer the client takes nothing of for this long is cut
        self.body_timeout_s = body_timeout_s       # a request body must have arrived within this
        # each connection's kernel send buffer (fixed, not grown to megabytes): an answer its client
        # does not read fills it and then waits, so the unread timeout can see it
        self.send_buffer_bytes = send_buffer_bytes
        self.keep_alive_s = keep_alive_s
        self.page = page                    # serve the chat page at GET /
        self.box_name: str | None = None    # the name the page shows (default: the host's name)


# the libraries the page loads, served by the box itself (web/vendor/README.md): only these names
STATIC = {"marked.min.js": "text/javascript; charset=utf-8", "purify.min.js": "text/javascript; charset=utf-8"}


def box_name() -> str:
    """The box's own name, as the household knows it (the host name, without a domain)."""
    return socket.gethostname().split(".")[0] or "edgepaged"


def _page() -> bytes:
    return importlib.resources.files("edgepaged.server").joinpath("web/chat.html").read_bytes()


def _static(name: str) -> bytes:
    return importlib.resources.files("edgepaged.server").joinpath("web/vendor", name).read_bytes()


class _OneLine:
    """Starlette answers an exception with `_internal_error` (a 500 and one line in the log) and
    then raises it again for the server, which logged its whole traceback (~65 lines a request):
    here it ends, as one line when nothing logged it yet (it came after the answer began)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.app(scope, receive, send)
        except Exception as e:   # noqa: BLE001
            if scope.get("type") != "http":
                raise
            if not getattr(e, "logged", False):
                log.error("HTTP %s %s failed: %s", scope.get("method"), scope.get("path"), brief.of(e))
            log.debug("HTTP %s %s failed", scope.get("method"), scope.get("path"), exc_info=e)


def unread_timeout(sock: socket.socket, seconds: float, send_buffer: int = 0) -> bool:
    """Connections accepted on `sock` (they inherit both settings) are cut by the kernel when
    what was sent to them stays unread for `seconds` (TCP_USER_TIMEOUT: also while the client's
    window is closed); their send buffer is fixed at `send_buffer` bytes rather than grown to
    megabytes, so an answer nobody reads waits for them soon. The server's writes cannot be
    interrupted otherwise (hypercorn shields them from cancellation): a client that never read
    held its generation slot forever. The cut connection's answer sees a disconnect: its
    request is cancelled and its blocks go back. False where the system has no such option."""
    if send_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    if not seconds or not hasattr(socket, "TCP_USER_TIMEOUT"):
        return False
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(seconds * 1000))
    return True


def api_error_response(e: ApiError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class HttpServer:
    def __init__(self, front: FrontEnd, config: HttpConfig | None = None, stats=None):
        """stats: what /stats shows (default: the engine's stats)."""
        self.front, self.engine = front, front.engine
        self.modelset = front.modelset      # several models (models.py), else None
        self.config = config or HttpConfig()
        self.host = self.config.host or "0.0.0.0"
        self._stats = stats or self.engine.stats
        self.port: int | None = None      # the bound port, once serving
        self.inflight = 0
        self.inflight_by: dict[str, int] = {}      # per caller (Caller.quota_key)
        self.response_store = ResponseStore()      # /v1/responses' previous_response_id, per identity
        self.admin = ModelAdmin(self, self.config.admin_from, self.config.store_root)
        self.created = int(time.time())
        self._stop = trio.Event()
        self._page = _page() if self.config.page else None
        self._static: dict[str, bytes] = {}
        self.app = Guard(_OneLine(self._build_app()), self.config.allowed_hosts, self.config.cors_origins)

    @property
    def base(self) -> str:
        """The base URL clients use, without a trailing slash ("http://127.0.0.1:PORT")."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else "::1" if self.host == "::" else self.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    # -- lifecycle ----------------------------------------------------------------------------
    def _listen(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind((self.host, self.config.port))
        except OSError as e:
            sock.close()
            where = f"[{self.host}]:{self.config.port}" if family == socket.AF_INET6 else \
                f"{self.host}:{self.config.port}"
            raise OSError(e.errno, e.strerror, f"{where} (HTTP, --http-port)") from None
        return sock

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        sock = self.config.sock if self.config.sock is not None else self._listen()
        unread_timeout(sock, self.config.unread_timeout_s, self.config.send_buffer_bytes)
        self.port = sock.getsockname()[1]
        hc = HypercornConfig()
        hc.bind = [f"fd://{sock.detach()}"]   # bound here: a clear error, and the port of port 0 at once
        hc.accesslog = None
        hc.errorlog = log
        hc.keep_alive_timeout = self.config.keep_alive_s
        hc.graceful_timeout = 3600.0          # app.run decides when to stop waiting (wait_closed)
        hc.include_server_header = False
        await hypercorn_serve(self.app, hc, shutdown_trigger=self._stop.wait, task_status=task_status)

    def stop_accepting(self) -> None:
        """Stop listening; idle keep-alive connections close, running answers go on."""
        self._stop.set()

    async def wait_closed(self, timeout_s: float) -> bool:
        """After stop_accepting and the engine's drain: wait for the last answers to go out."""
        with trio.move_on_after(timeout_s):
            while self.inflight:
                await trio.sleep(0.02)
            return True
        return False

    # -- generation slots ---------------------------------------------------------------------
    def _take_slot(self, caller) -> str:
        """One of the box's HTTP generation slots for `caller`: 429 when all `max_inflight` are
        taken, or `max_inflight_per_caller` by this caller (a user, else an address: a client's
        chosen name would not bound anyone). Give it back with `_give_slot`."""
        key = caller.quota_key or caller.identity
        cfg = self.config
        if self.inflight >= cfg.max_inflight:
            raise ApiError(429, f"the server has {cfg.max_inflight} HTTP requests in flight; try again "
                           "shortly", "too_many_requests")
        if self.inflight_by.get(key, 0) >= cfg.max_inflight_per_caller:
            raise ApiError(429, f"you have {cfg.max_inflight_per_caller} HTTP requests in flight, the most one "
                           "user or address may have at once; wait for one to end", "too_many_requests")
        self.inflight += 1
        self.inflight_by[key] = self.inflight_by.get(key, 0) + 1
        return key

    def _give_slot(self, key: str) -> None:
        self.inflight -= 1
        left = self.inflight_by.get(key, 1) - 1
        if left > 0:
            self.inflight_by[key] = left
        else:
            self.inflight_by.pop(key, None)

    # -- the app ------------------------------------------------------------------------------
    def _build_app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/stats", self.stats, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/embeddings", self.openai_embeddings, methods=["POST"]),
            Route("/api/embed", self.ollama_embed, methods=["POST"]),
            Route("/api/embeddings", self.ollama_embeddings, methods=["POST"]),
            # the Ollama API (server/doors/ollama.py)
            Route("/api/chat", self.ollama_chat, methods=["POST"]),
            Route("/api/generate", self.ollama_generate, methods=["POST"]),
            Route("/api/tags", self.ollama_tags, methods=["GET"]),
            Route("/api/show", self.ollama_show, methods=["POST"]),
            Route("/api/ps", self.ollama_ps, methods=["GET"]),
            Route("/api/version", self.ollama_version, methods=["GET"]),
            # models managed over the Ollama API (manage.py)
            Route("/api/pull", self.admin.pull, methods=["POST"]),
            Route("/api/delete", self.admin.delete, methods=["DELETE"]),
            Route("/api/copy", self.admin.copy, methods=["POST"]),
            Route("/api/create", self.admin.create, methods=["POST"]),
            Route("/api/blobs/{digest}", self.admin.blob_head, methods=["HEAD"]),
            Route("/api/blobs/{digest}", self.admin.blob_post, methods=["POST"]),
        ]
        for door in self.config.doors:
            routes.append(Route(door.path, partial(self._door, door), methods=["POST"]))
        if self._page is not None:
            routes.append(Route("/", self.page, methods=["GET"]))
            routes.append(Route("/static/{name}", self.static, methods=["GET"]))
        return Starlette(routes=routes, exception_handlers={
            ApiError: self._api_error,
            HTTPException: self._http_error,
            ClientDisconnect: self._client_gone,
            Exception: self._internal_error,
        })

    @staticmethod
    async def _api_error(request, e: ApiError) -> Response:
        return api_error_response(e)

    @staticmethod
    async def _http_error(request, e: HTTPException) -> Response:
        if request.url.path.startswith("/api/"):   # Ollama's error shape
            return JSONResponse({"error": f"{request.method} {request.url.path}: {e.detail}"},
                                status_code=e.status_code, headers=e.headers)
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return JSONResponse(error_body(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code),
                            status_code=e.status_code, headers=e.headers)

    @staticmethod
    async def _client_gone(request, e: ClientDisconnect) -> Response:
        """A client that leaves while sending its body: expected, one line at info."""
        log.info("%s left while sending its request to %s", request.client.host if request.client else "a client",
                 request.url.path)
        return Response(status_code=400)

    @staticmethod
    async def _internal_error(request, e: Exception) -> Response:
        # one line in the log (the traceback at debug level); the client never sees the exception
        e.logged = True
        log.error("HTTP %s %s failed: %s", request.method, request.url.path, brief.of(e))
        log.debug("HTTP %s %s failed", request.method, request.url.path, exc_info=e)
        return JSONResponse(error_body(500, "the server failed on this request (see its log)", "internal_error"),
                            status_code=500)

    @staticmethod
    def _peer(request: HttpRequest) -> str:
        return request.client.host if request.client else "http"

    async def _authorize(self, request: HttpRequest) -> str | None:
        """Check the bearer token through the front end; returns the authenticated user's
        name with per-user tokens, else None."""
        if not self.front.auth_required:
            return None
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        try:
            return await self.front.authenticate(given.strip() if scheme.lower() == "bearer" else None,
                                                 self._peer(request))
        except AuthFailed:
            raise ApiError(401, "a wrong or missing token: send Authorization: Bearer <token>", "auth_failed") from None

    @staticmethod
    async def _drop_body(chunks) -> None:
        """Read and drop the rest of a body over the limit while the client keeps sending it
        (see DROP_BYTES)."""
        seen = 0
        with trio.move_on_after(DROP_S):
            while seen <= DROP_BYTES:
                with trio.move_on_after(DROP_IDLE_S) as idle:
                    try:
                        seen += len(await chunks.__anext__())
                    except (StopAsyncIteration, ClientDisconnect):
                        return
                if idle.cancelled_caught:
                    return

    def _takes_images(self) -> bool:
        """A served model takes images (of several models: one loaded now)."""
        engine = self.front.engine
        engines = engine._engines() if hasattr(engine, "_engines") else [engine]
        return any(getattr(e.runner, "vision", None) is not None for e in engines if e is not None)

    async def _json_body(self, request: HttpRequest) -> dict:
        limit = self.config.max_body_bytes
        if self._takes_images():
            limit = max(limit, self.config.image_body_bytes)
        length = request.headers.get("content-length")
        too_large = ApiError(413, f"the request body is over {limit} bytes", "frame_too_large")
        if length is not None and length.isdigit() and int(length) > limit:
            if int(length) <= DROP_BYTES:
                await self._drop_body(request.stream())
            raise too_large
        body = bytearray()
        chunks = request.stream()
        with trio.move_on_after(self.config.body_timeout_s) as waited:   # a body trickled a byte at a time
            async for chunk in chunks:
                body += chunk
                if len(body) > limit:
                    await self._drop_body(chunks)
                    raise too_large
        if waited.cancelled_caught:
            raise ApiError(408, f"the request body did not arrive within {self.config.body_timeout_s:g} s",
                           "request_timeout")
        try:   # (a large body is measured and parsed in a worker thread: ~30 ms a MiB of brackets)
            data = jsontext.loads(body, "the body's JSON") if len(body) < BIG_BODY else \
                await trio.to_thread.run_sync(jsontext.loads, bytes(body), "the body's JSON", limiter=PREPARE)
        except jsontext.TooDeep as e:
            raise ApiError(400, str(e), "bad_request") from None
        except ValueError as e:
            raise ApiError(400, f"the body is not valid JSON: {e}", "bad_request") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object", "bad_request")
        if SURROGATE_ESCAPE.search(body):   # "\ud800" alone parses, but is no text: no answer could echo it
            try:
                json.dumps(data, ensure_ascii=False).encode()
            except UnicodeEncodeError:
                raise ApiError(400, "the body has a lone surrogate (a \\ud800-\\udfff escape without its pair): "
                               "not valid Unicode", "bad_request") from None
        return data

    # -- endpoints ----------------------------------------------------------------------------
    async def page(self, request: HttpRequest) -> Response:
        return Response(self._page, media_type="text/html; charset=utf-8",
                        headers={"Content-Security-Policy": PAGE_CSP, "Cache-Control": "no-cache",
                                 "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"})

    async def static(self, request: HttpRequest) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            raise HTTPException(404)
        if name not in self._static:
            self._static[name] = _static(name)
        return Response(self._static[name], media_type=STATIC[name],
                        headers={"Cache-Control": "public, max-age=86400", "X-Content-Type-Options": "nosniff"})

    async def health(self, request: HttpRequest) -> Response:
        """Whether the box is up, for anyone; its memory figures only for a caller who may see
        every caller's (a box without tokens, the token, or an admin's): the KV bytes in use
        move with other users' prompts. A wrong token here is no error, just no figures."""
        ok = self.engine.accepting
        body = {"status": "ok" if ok else "shutting_down", "model": self.front.model}
        if await self._sees_all(request):
            body["memory"] = self.engine.memory()
        else:
            s = self.engine.stats()
            body["load"] = {"num_requests_running": s["num_requests_running"],
                            "num_requests_waiting": s["num_requests_waiting"],
                            "kv_cache_usage_perc": round(s["kv_cache_usage_perc"], 1)}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def _sees_all(self, request: HttpRequest) -> bool:
        if not self.front.auth_required:
            return True
        if not request.headers.get("authorization"):
            return False
        try:
            user = await self._authorize(request)
        except ApiError:
            return False
        return self.front.caller(user, None, self._peer(request)).sees_all

    async def metrics(self, request: HttpRequest) -> Response:
        caller = self.front.caller(await self._authorize(request), None, self._peer(request))
        if not caller.sees_all:   # per-user tokens, not an admin: the box's load, coarsely
            return Response(coarse_prometheus_text(self.front.stats(caller, self.engine.stats())),
                            media_type=CONTENT_TYPE_LATEST)
        return Response(self.engine.prometheus_text(), media_type=CONTENT_TYPE_LATEST)

    async def stats(self, request: HttpRequest) -> Response:
        caller = self.front.caller(await self._authorize(request), None, self._peer(request))
        s = self._stats()
        s["http"] = {"requests_inflight": self.inflight}
        s["model"] = self.front.model
        s["box"] = self.config.box_name or box_name()
        return JSONResponse(self.front.stats(caller, s))

    async def models(self, request: HttpRequest) -> Response:
        await self._authorize(request)
        others = self.modelset.listing() if self.modelset is not None else ()
        return JSONResponse(models_list(self.front.model, self.engine.max_model_len, self.created, others))

    async def model(self, request: HttpRequest) -> Response:
        await self._authorize(request)
        name = request.path_params["model"]
        if self.modelset is not None:
            try:
                slot = self.modelset.slot(name)
            except RequestRejected as e:
                raise ApiError(404, str(e), "model_not_found") from None
            m = next(m for m in self.modelset.listing() if m["name"] == slot.spec.name)
            return JSONResponse({**model_card(m["name"], m["context_length"], self.created), "loaded": m["loaded"]})
        if name != self.front.model:
            raise ApiError(404, f"no model {name!r} here; this server has {self.front.model!r}", "model_not_found")
        return JSONResponse(model_card(name, self.engine.max_model_len, self.created))

    async def chat_completions(self, request: HttpRequest) -> Response:
        return await self._generation(request, parse_chat, chat=True)

    async def responses(self, request: HttpRequest) -> Response:
        """OpenAI's Responses API over the chat path (server/doors/responses.py)."""
        user = await self._authorize(request)
        body = await self._json_body(request)
        name = body.get("user") if isinstance(body.get("user"), str) else None
        caller = self.front.caller(user, name, self._peer(request))
        history = None
        prev = body.get("previous_response_id")
        if prev is not None:
            if not isinstance(prev, str):
                raise ApiError(400, "previous_response_id must be a string", "bad_request", "previous_response_id")
            history = self.response_store.get((caller.namespace, caller.identity), prev)
            if history is None:
                raise ApiError(404, f"previous_response_id {prev!r} is not known here: it was not stored "
                               "(store: false), it expired, or it is another caller's", "not_found",
                               "previous_response_id")
        return await self._generation(request, lambda b, rid: parse_responses(b, rid, history), chat=True, body=body)

    # -- embeddings (every door: OpenAI's /v1/embeddings, Ollama's /api/embed and /api/embeddings) ----
    async def _embed(self, request: HttpRequest, inputs, model, truncate: bool, name, ollama: bool):
        """Each input's embedding through the engine (its prompt's final hidden state, last
        token), and the prompt tokens they took."""
        user = await self._authorize(request)
        if not isinstance(truncate, bool):
            raise ApiError(400, "truncate must be a boolean", "bad_request", "truncate")
        if not self.engine.accepting:
            raise ApiError(503, "the server is shutting down", "shutdown")
        caller = self.front.caller(user, name if isinstance(name, str) else None, self._peer(request))
        if isinstance(inputs, str):
            inputs = [inputs]
        slot = self._take_slot(caller)
        try:
            if self.modelset is not None:
                reqs = await self.front.build_embeds(inputs, caller, truncate, model or None)
            else:
                if ollama:
                    ollama_api.check_model(ollama_api.model_field({"model": model}), self.front.model)
                reqs = await self.front.build_embeds(inputs, caller, truncate)
            vectors: list = [None] * len(reqs)
            failed: list = []

            async def one(i, req):
                async with self.engine.stream(req) as events:
                    async for ev in events:
                        if isinstance(ev, EmbeddingEvent):
                            vectors[i] = ev.embedding
                        elif isinstance(ev, DoneEvent) and ev.finish_reason != "stop":
                            failed.append(done_error(ev))
            async with trio.open_nursery() as n:
                for i, req in enumerate(reqs):
                    n.start_soon(one, i, req)
        except RequestRejected as e:
            raise ApiError.from_rejected(e) from None
        except EngineClosed:
            raise ApiError(503, "the server is shutting down", "shutdown") from None
        finally:
            self._give_slot(slot)
        if failed or any(v is None for v in vectors):
            raise failed[0] if failed and failed[0] is not None else ApiError(
                503, "the server stopped before the embeddings were done", "shutdown")
        # the model that answered: the engine each request went to (several models: the one named)
        model = model_display_name(reqs[0].engine) if reqs[0].engine is not None else self.front.model
        return vectors, sum(len(r.prompt_ids) for r in reqs), model

    @staticmethod
    def _shaped(vectors, dimensions, normalize: bool = True):
        if dimensions is not None:
            if not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1:
                raise ApiError(400, "dimensions must be a positive integer", "invalid_params", "dimensions")
            vectors = [v[:dimensions] for v in vectors]      # Matryoshka-style: the leading ones, renormed
        if normalize:
            vectors = [v / max(float(np.linalg.norm(v)), 1e-12) for v in vectors]
        return vectors

    async def openai_embeddings(self, request: HttpRequest) -> Response:
        body = await self._json_body(request)
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise ApiError(400, 'encoding_format must be "float" or "base64"', "invalid_params", "encoding_format")
        inputs = body.get("input")
        if isinstance(inputs, list) and inputs and all(isinstance(t, int) and not isinstance(t, bool) for t in inputs):
            inputs = [inputs]                   # one input given as token ids
        if inputs is None:
            raise ApiError(400, "input is required", "bad_request", "input")
        vectors, used, model = await self._embed(request, inputs, body.get("model"), True, body.get("user"), False)
        vectors = self._shaped(vectors, body.get("dimensions"))
        data = [{"object": "embedding", "index": i, "embedding": (
            base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() if fmt == "base64"
            else [float(x) for x in v])} for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": model,
                             "usage": {"prompt_tokens": used, "total_tokens": used}})

    async def ollama_embed(self, request: HttpRequest) -> Response:
        body = await self._ollama(request)
        t0 = time.perf_counter()
        try:
            inputs = body.get("input")
            if inputs is None:
                raise ApiError(400, "input is required", "bad_request")
            vectors, used, _ = await self._embed(request, inputs, ollama_api.model_field(body), body.get(
                "truncate", True), None, True)
            vectors = self._shaped(vectors, body.get("dimensions"))
        except ApiError as e:
            raise e if isinstance(e, OllamaError) else OllamaError.of(e) from None
        return JSONResponse({"model": body.get("model"), "embeddings": [[float(x) for x in v] for v in vectors],
                             "total_duration": int((time.perf_counter() - t0) * 1e9), "load_duration": 0,
                             "prompt_eval_count": used})

    async def ollama_embeddings(self, request: HttpRequest) -> Response:
        """The older Ollama endpoint: one `prompt`, its embedding as the model gives it (not normalized)."""
        body = await self._ollama(request)
        prompt = body.get("prompt")
        try:
            if not isinstance(prompt, str) or not prompt:
                raise ApiError(400, "prompt must be a non-empty string", "bad_request")
            vectors, _, _ = await self._embed(request, [prompt], ollama_api.model_field(body), True, None, True)
        except ApiError as e:
            raise e if isinstance(e, OllamaError) else OllamaError.of(e) from None
        return JSONResponse({"embedding": [float(x) for x in vectors[0]]})

    async def completions(self, request: HttpRequest) -> Response:
        return await self._generation(request, parse_completion, chat=False)

    async def _door(self, door: Door, request: HttpRequest) -> Response:
        """A door of `HttpConfig.doors`: its parser and its shaper over the same path as the
        built-in ones (auth, fairness slots, the front end, the answer stream)."""
        try:
            return await self._generation_inner(request, door.parse, door.chat, False, None, door.shaper)
        except ApiError as e:
            raise e if door.error is None else door.error(e) from None

    # -- the Ollama API ------------------------------------------------------------------------
    async def _ollama(self, request: HttpRequest, with_body: bool = True) -> dict:
        """Auth and body of an Ollama call, its errors in Ollama's shape."""
        try:
            await self._authorize(request)
            return await self._json_body(request) if with_body else {}
        except ApiError as e:
            raise OllamaError.of(e) from None

    def _runner(self):
        return self.engine.runner

    async def ollama_chat(self, request: HttpRequest) -> Response:
        body = await self._ollama(request)
        if body.get("messages") in (None, []):     # Ollama's "load (or unload) the model" call
            return await self._ollama_load(body)
        return await self._generation(request, ollama_api.parse_chat, chat=True, ollama=True, body=body)

    async def _ollama_slot_front(self, name: str, keep_alive=None):
        """The FrontEnd of the model an Ollama call names, loaded (several models), in Ollama's errors."""
        try:
            return await self.modelset.get(name, keep_alive)
        except RequestRejected as e:
            raise OllamaError.of(ApiError.from_rejected(e)) from None

    async def ollama_generate(self, request: HttpRequest) -> Response:
        body = await self._ollama(request)
        if not body.get("prompt") and not body.get("raw"):   # Ollama's "load (or unload) the model" call
            return await self._ollama_load(body, chat=False)
        return await self._generation(request, ollama_api.parse_generate, chat=False, ollama=True, body=body)

    async def _ollama_load(self, body: dict, chat: bool = True) -> Response:
        """Ollama's load call (no prompt, no messages): the model loaded, or with keep_alive 0
        unloaded (`done_reason` "load" / "unload"). The only model of a one-model box stays."""
        name = ollama_api.model_field(body)
        try:
            keep = parse_keep_alive(body["keep_alive"]) if body.get("keep_alive") is not None else None
        except ValueError as e:
            raise OllamaError(400, str(e), "bad_request") from None
        reason = "unload" if keep == 0 else "load"
        headers = None
        if self.modelset is None:
            ollama_api.check_model(name, self.front.model)
            if keep == 0:     # the only model stays: said so, not "unload" with the model still in /api/ps
                reason = "load"
                headers = {"X-Edgepaged-Warning": "this box serves one model, which stays loaded; serve several "
                                                  "(--model A --model B) to unload idle ones"}
        elif keep == 0:
            try:
                await self.modelset.unload(name)
            except RequestRejected as e:
                raise OllamaError.of(ApiError.from_rejected(e)) from None
        else:
            await self._ollama_slot_front(name, keep)
        out = {"model": body.get("model"), "created_at": ollama_api.now_iso(), "done": True, "done_reason": reason}
        out.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
        return JSONResponse(out, headers=headers)

    async def ollama_tags(self, request: HttpRequest) -> Response:
        await self._ollama(request, with_body=False)
        if self.modelset is not None:
            return JSONResponse({"models": [ollama_api.listed_entry(m) for m in self.modelset.listing()]})
        return JSONResponse({"models": [ollama_api.model_entry(f"{self.front.model}:latest", self._runner())]})

    async def ollama_ps(self, request: HttpRequest) -> Response:
        await self._ollama(request, with_body=False)
        if self.modelset is not None:
            return JSONResponse({"models": [ollama_api.listed_entry(m, running=True)
                                            for m in self.modelset.listing() if m["loaded"]]})
        return JSONResponse({"models": [ollama_api.model_entry(f"{self.front.model}:latest", self._runner(),
                                                               running=True, context=self.engine.max_model_len)]})

    async def ollama_show(self, request: HttpRequest) -> Response:
        body = await self._ollama(request)
        name = ollama_api.model_field(body, "model", "name")
        if self.modelset is not None:
            front = await self._ollama_slot_front(name)
            return JSONResponse(ollama_api.show(name, front.engine.runner, front.engine.max_model_len,
                                                self.modelset.slot(name).spec))
        ollama_api.check_model(name, self.front.model)
        return JSONResponse(ollama_api.show(name, self._runner(), self.engine.max_model_len))

    async def ollama_version(self, request: HttpRequest) -> Response:
        return JSONResponse(ollama_api.version())

    async def _generation(self, request: HttpRequest, parse, chat: bool, ollama: bool = False,
                          body: dict | None = None) -> Response:
        if ollama:
            try:
                return await self._generation_inner(request, parse, chat, True, body)
            except ApiError as e:
                raise e if isinstance(e, OllamaError) else OllamaError.of(e) from None
        return await self._generation_inner(request, parse, chat, False, body)

    def _with_model_defaults(self, body: dict, ollama: bool) -> dict:
        """What a model's store entry adds to a request for it (Ollama's SYSTEM and PARAMETER,
        /api/create's system and parameters): its system prompt where the request has none,
        and on the Ollama door its options where the request does not set them."""
        if self.modelset is None or not isinstance(body.get("model", None), (str, type(None))):
            return body
        try:
            spec = self.modelset.slot(body.get("model")).spec
        except RequestRejected:
            return body
        if not spec.system and not spec.parameters:
            return body
        body = dict(body)
        msgs = body.get("messages")
        if spec.system and isinstance(msgs, list) and msgs and \
                not any(isinstance(m, dict) and m.get("role") in ("system", "developer") for m in msgs):
            body["messages"] = [{"role": "system", "content": spec.system}] + msgs
        elif spec.system and ollama and "prompt" in body and body.get("system") is None and not body.get("raw"):
            body["system"] = spec.system
        if ollama and isinstance(spec.parameters, dict) and isinstance(body.get("options", {}), (dict, type(None))):
            body["options"] = {**spec.parameters, **(body.get("options") or {})}
        return body

    async def _generation_inner(self, request: HttpRequest, parse, chat: bool, ollama: bool,
                                body: dict | None, make_shaper=None) -> Response:
        user = await self._authorize(request)
        body = self._with_model_defaults(body if body is not None else await self._json_body(request), ollama)
        gen = parse(body, new_id(chat))
        if ollama and self.modelset is None:
            ollama_api.check_model(gen.model, self.front.model)
        if not self.engine.accepting:
            raise ApiError(503, "the server is shutting down", "shutdown")
        # the fairness identity: the OpenAI `user` field, else the peer's address (as over TCP)
        caller = self.front.caller(user, gen.user, self._peer(request))
        slot = self._take_slot(caller)   # held from here; the response gives it back when it ends
        try:
            ticket = await self.front.build(gen.item, caller)
        except BaseException as e:
            self._give_slot(slot)
            if isinstance(e, RequestRejected):
                raise ApiError.from_rejected(e) from None
            raise
        model = ticket.model or self.front.model
        if ollama and self.modelset is None:
            model = self.front.model
        if make_shaper is not None:
            shaper = make_shaper(gen, model, ticket)
        elif isinstance(gen, ResponsesGeneration):
            who = (caller.namespace, caller.identity)
            shaper = ResponsesShaper(gen, model, ticket, remember=lambda rid, msgs: self.response_store.put(who, rid,
                                                                                                           msgs))
        else:
            shaper = OllamaShaper(gen, model, ticket) if ollama else Shaper(gen, model, ticket)
        return GenerationResponse(self, gen, ticket, shaper, slot)


def coarse_prometheus_text(s: dict) -> bytes:
    """The load gauges an ordinary user may see (FrontEnd.stats), in the exposition format."""
    lines = []
    for name, doc in (("num_requests_running", "Requests holding KV blocks"),
                      ("num_requests_waiting", "Requests waiting for admission"),
                      ("kv_cache_usage_perc", "Fraction of KV blocks in use (0..1), to a tenth")):
        lines += [f"# HELP edgepaged:{name} {doc}", f"# TYPE edgepaged:{name} gauge", f"edgepaged:{name} {s[name]}"]
    return ("\n".join(lines) + "\n").encode()


class GenerationResponse:
    """An ASGI response that runs one request on the engine: a JSON answer, or server-sent
    events as the tokens come. The client's disconnect ends it (and the request) at once."""

    def __init__(self, http: HttpServer, gen: Generation, ticket, shaper=None, slot: str = ""):
        self.http, self.gen, self.ticket, self.slot = http, gen, ticket, slot
        self.req = req = ticket.req
        self.shaper = shaper or Shaper(gen, ticket.model or http.front.model, ticket)
        self.tokenizer = req.engine.tokenizer if req.engine is not None else http.front.tokenizer
        self.n = len(ticket.calls)            # parallel samples (the parent's children empty as they fork)

    async def __call__(self, scope, receive, send) -> None:
        extra = [(b"x-edgepaged-warning", w.encode("utf-8", "replace")) for w in self.gen.warnings]
        if self.ticket.truncated:   # truncate "auto" (Ollama's num_ctx): how many old messages were dropped
            extra.append((b"x-edgepaged-truncated-messages", str(self.ticket.truncated).encode()))
        if self.ticket.truncated_tokens:   # ... and how many tokens from the middle of what was left
            extra.append((b"x-edgepaged-truncated-tokens", str(self.ticket.truncated_tokens).encode()))
        if extra:
            plain_send = send

            async def send(message):
                if message["type"] == "http.response.start":
                    message = {**message, "headers": list(message.get("headers", [])) + extra}
                await plain_send(message)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, receive, nursery.cancel_scope)
                await self._run(send)
                nursery.cancel_scope.cancel()
        finally:
            self.http._give_slot(self.slot)

    @staticmethod
    async def _watch_disconnect(receive, scope: trio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                scope.cancel()
                return

    async def _run(self, send) -> None:
        engine = self.req.engine or self.http.engine
        sh = self.shaper
        answer = Answer(self.ticket, thinking=sh.splits_thinking,
                        stream_calls=self.gen.stream and self.n == 1 and sh.streams_calls)
        try:
            async with answer_events(engine, self.req) as events:
                await (self._stream if self.gen.stream else self._answer)(answer, events, send)
        except EngineClosed:   # entering the stream: nothing was sent yet
            err = ApiError(503, "the server is shutting down", "shutdown")
            await self._send_json(send, 503, sh.error_body(err))
        except RequestRejected as e:
            err = ApiError.from_rejected(e)
            await self._send_json(send, err.status, sh.error_body(err))

    def _logprobs(self):
        """Per sample: the shaper of OpenAI's logprobs, when asked (None otherwise)."""
        asked = self.req.params.logprobs is not None and self.shaper.shapes_logprobs
        return [Logprobs(self.tokenizer, self.gen.chat) if asked else None for _ in range(self.n)]

    async def _answer(self, answer: Answer, events, send) -> None:
        """One JSON body once every sample has ended."""
        n = self.n
        texts, thinks = [[] for _ in range(n)], [[] for _ in range(n)]
        lps, ends = [([], []) for _ in range(n)], [None] * n
        async for k, ev in events:
            for item in answer.feed(k, ev):
                if isinstance(item, Piece):
                    texts[k].append(item.text)
                    thinks[k].append(item.thinking)
                    if item.logprobs:
                        lps[k][0].extend(item.token_ids)
                        lps[k][1].extend(item.logprobs)
                elif isinstance(item, End):
                    ends[k] = item
        err = next((e for e in (done_error(x.done) for x in ends if x is not None) if e is not None), None)
        if err is not None or any(x is None for x in ends):
            err = err or ApiError(500, "a sample ended without an answer", "internal_error")
            return await self._send_json(send, err.status, self.shaper.error_body(err))
        shapers = self._logprobs()
        lp = [None if shapers[k] is None else shapers[k].of(*lps[k]) for k in range(n)]
        if n > 1:
            body = self.shaper.full_n([("".join(texts[k]), ends[k].done, lp[k], ends[k].calls) for k in range(n)])
        else:
            body = self.shaper.full("".join(texts[0]), ends[0].done, ends[0].calls, lp[0], "".join(thinks[0]))
            self._say_truncated(body)
        await self._send_json(send, 200, body)

    async def _stream(self, answer: Answer, events, send) -> None:
        """The items as the door's chunks as they come (what is already queued goes in one
        write); n > 1: each chunk's choice carries its sample's index, the usage chunk (if
        asked) comes once, at the end."""
        sh, n = self.shaper, self.n
        lps = self._logprobs()

        def at(chunk, k):
            if n > 1:
                for c in chunk["choices"]:
                    c["index"] = k
            return sh.frame(chunk)
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", sh.media_type.encode()), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no")]})
        first = [sh.first_chunk() for _ in range(n)]
        if first[0] is not None:
            await send({"type": "http.response.body", "body": b"".join(at(c, k) for k, c in enumerate(first)),
                        "more_body": True})
        ended, err = [], None
        while err is None and len(ended) < n:
            try:
                batch = [await events.receive()]
            except trio.EndOfChannel:
                break
            while True:   # what else is already queued goes in the same write
                try:
                    batch.append(events.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            out = []
            for k, ev in batch:
                items = answer.feed(k, ev)
                if isinstance(items[-1], End) and (err := done_error(items[-1].done)) is not None:
                    break
                for item in items:
                    if isinstance(item, Piece):
                        lp = lps[k].of(item.token_ids, item.logprobs) if item.logprobs and lps[k] is not None \
                            else None
                        if (item.text or item.thinking or lp is not None) and \
                                (chunk := sh.text_chunk(item.text, item.thinking, lp)) is not None:
                            out.append(at(chunk, k))
                    elif isinstance(item, Call):
                        if (chunk := sh.call_chunk(item.k, item.part)) is not None:
                            out.append(at(chunk, k))
                    else:
                        chunks = sh.last_chunks(item.done, item.calls)
                        if n > 1:
                            chunks = [c for c in chunks if c["choices"]]
                        else:
                            for c in chunks:
                                self._say_truncated(c)
                        out += [at(c, k) for c in chunks]
                        ended.append(item)
            finished = err is not None or len(ended) == n
            if err is not None:
                out.append(sh.frame(sh.error_chunk(err)))
            elif finished and n > 1 and self.gen.include_usage:
                dones = [e.done for e in ended]
                u = {"prompt_tokens": dones[0].usage["prompt_tokens"],
                     "completion_tokens": sum(d.usage["completion_tokens"] for d in dones), "cached_tokens": 0}
                out.append(sh.frame(sh.usage_chunk(u)))
            if finished:
                out.append(sh.trailer)
            if out or finished:
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": not finished})
        if err is None and len(ended) < n:    # the events ended before every sample did
            err = ApiError(500, "a sample ended without an answer", "internal_error")
            await send({"type": "http.response.body", "body": sh.frame(sh.error_chunk(err)) + sh.trailer,
                        "more_body": False})

    def _say_truncated(self, obj: dict) -> None:
        """truncate "auto": the last object says what was dropped (old messages, middle tokens)."""
        if self.ticket.truncated:
            obj["truncated_messages"] = self.ticket.truncated
        if self.ticket.truncated_tokens:
            obj["truncated_tokens"] = self.ticket.truncated_tokens

    @staticmethod
    async def _send_json(send, status: int, body: dict) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data, "more_body": False})
