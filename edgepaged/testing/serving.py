"""A whole box in process for tests: engine, front end, the msgpack port and (optionally) the
HTTP port, all on loopback with ports the system picks."""
from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import fields

import trio

from ..engine import Engine, EngineConfig
from ..request.frontend import FrontEnd, FrontEndConfig
from ..server.httpd import HttpConfig, HttpServer
from ..server.tcp import Server, ServerConfig

_FRONT = {f.name for f in fields(FrontEndConfig)}


@asynccontextmanager
async def serving(runner, *, http: HttpConfig | bool = False, max_num_seqs: int = 32, engine: dict | None = None,
                  **config):
    """Serve `runner` until the block ends. `config` holds ServerConfig and FrontEndConfig
    fields (token, users, max_tokens, idle_timeout_s, ...), `engine` EngineConfig fields.
    Yields the msgpack Server, with `.address` ("127.0.0.1:PORT"), `.http` (the HttpServer
    or None) and `.http_base`."""
    front_cfg = FrontEndConfig(**{k: config.pop(k) for k in list(config) if k in _FRONT})
    async with Engine(runner, EngineConfig(max_num_seqs=max_num_seqs, **(engine or {}))) as engine:
        server = Server(FrontEnd(engine, front_cfg), ServerConfig(host="127.0.0.1", port=0, **config))
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            if http:
                hc = http if isinstance(http, HttpConfig) else HttpConfig(port=0)
                hc.host = hc.host or "127.0.0.1"
                server.http = HttpServer(server.front, hc, stats=server.stats)
                await nursery.start(server.http.serve)
            # as the real server does before it says ready (server/app.py): the grammar
            # tokenizer built (made once per loaded tokenizer), not at the first format
            await trio.to_thread.run_sync(server.front.warm_grammars)
            yield server
            nursery.cancel_scope.cancel()
