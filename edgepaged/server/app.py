"""`edgepaged serve`: the engine, the TCP server, the HTTP server (OpenAI-compatible API,
metrics, chat page) and the mDNS record, tied to the signals.

SIGINT/SIGTERM: stop accepting TCP connections, withdraw the mDNS record (goodbye), let
running requests finish within the grace period (meanwhile HTTP stays up and answers new
requests and `/health` with 503), cancel the rest with reason `shutdown`, deliver the last
answers, close the HTTP port, return. A second signal cuts the grace period short.
"""
from __future__ import annotations

import gc
import logging
import signal
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import trio

from ..engine import Engine, EngineConfig
from ..frontend import FrontEnd, FrontEndConfig
from ..protocol import PROTOCOL_VERSION
from . import mdns, systemd
from .httpd import HttpConfig, HttpServer
from .tcp import Server, ServerConfig

log = logging.getLogger("edgepaged.server")


@dataclass
class AppConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    front: FrontEndConfig = field(default_factory=FrontEndConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    http: HttpConfig | None = field(default_factory=HttpConfig)   # None: no HTTP server
    mdns: bool = True
    mdns_interface: str | None = None
    mdns_refresh_s: float = 5.0      # the load in the TXT record is refreshed at most this often
    grace_s: float = 10.0


def http_url(http: HttpServer) -> str:
    """Where a browser on the local network finds the chat page."""
    host = http.host
    if host in ("0.0.0.0", "::", ""):
        try:
            host = mdns.local_addresses()[0]
        except Exception:  # ifaddr missing or failing: say the bind address
            pass
    return f"http://[{host}]:{http.port}/" if ":" in host else f"http://{host}:{http.port}/"


def banner(server: Server, adv: mdns.Advertiser | None, cfg: AppConfig,
           http: HttpServer | None = None) -> str:
    e, sc, front = server.engine, server.config, server.front
    host = sc.host or "0.0.0.0"
    where = (f"{host}:{server.port} (all interfaces: reachable from the local network)"
             if host in ("0.0.0.0", "::") else f"{host}:{server.port}")
    models = getattr(front, "modelset", None)
    if models is not None:
        parts = [f"edgepaged ready on {where}", f"models {', '.join(models.slots)} (default {models.default}; "
                 f"loaded on first use, unloaded after {models.slots[models.default].keep_alive_s:g} s idle)",
                 f"model memory {models.budget_bytes >> 20} MiB (weights + KV)",
                 f"HTTP (OpenAI API, chat page) {http_url(http)}" if http else "HTTP off",
                 f"mDNS {adv.name!r}" if adv else "mDNS off"]
    else:
        capacity = e.kv_capacity_blocks * e.block_size
        parts = [f"edgepaged ready on {where}", f"model {front.model}",
                 f"products {getattr(e.runner, 'products', '?')}", f"context {e.max_model_len} tokens"
                 + (f" (window policy: {e.config.window_sink} sink + {e.config.window_tokens} window tokens)"
                    if e.config.context_policy == "window" else ""),
                 f"KV capacity {capacity} tokens ({e.kv_capacity_blocks} blocks of {e.block_size}, "
                 f"{getattr(e.runner, 'kv_dtype_name', '?')})",
                 memory_line(e.memory()),
                 f"HTTP (OpenAI API, chat page) {http_url(http)}" if http else "HTTP off",
                 f"mDNS {adv.name!r}" if adv else "mDNS off"]
    fc = front.config
    access = (f"per-user tokens ({len(fc.users)} users)" if fc.users else "token required" if fc.token is not None
              else "no --token: open to anyone on the local network")
    return ", ".join(parts) + f"; {access}"


def memory_line(m: dict) -> str:
    mib = lambda n: f"{(n or 0) / 2**20:.0f} MiB"  # noqa: E731
    return (f"memory: weights {mib(m.get('weights_bytes'))}, KV {mib(m.get('kv_reserved_bytes'))} reserved "
            f"(committed as it fills), process {mib(m.get('rss_bytes'))}")


async def _watchdog(engine, every_s: float) -> None:
    """Pet systemd's watchdog while the engine loop is alive: no model step has run for
    longer than the watchdog's whole period (twice `every_s`)."""
    while True:
        if engine.alive(2 * every_s):
            systemd.notify("WATCHDOG=1")
        await trio.sleep(every_s)


async def _next_signal(signals) -> int:
    async for signum in signals:
        return signum


async def _refresh_load(adv: mdns.Advertiser, server: Server, every_s: float) -> None:
    while True:
        await trio.sleep(every_s)
        try:
            await adv.update(mdns.load_properties(server.engine.stats()))
        except Exception as e:  # a hiccup of the network must not take the server down
            log.warning("mDNS load update failed: %s", e)


@asynccontextmanager
async def _front_end(runner, cfg: AppConfig):
    """The front end of one model (a runner: its engine runs while the block does), or of a
    model set (models.ModelSet: its models load and unload on their own)."""
    from ..models import ModelSet, MultiFront
    if isinstance(runner, ModelSet):
        async with trio.open_nursery() as nursery:
            await nursery.start(runner.run)
            yield MultiFront(runner)
            nursery.cancel_scope.cancel()
        return
    async with Engine(runner, cfg.engine) as engine:
        yield FrontEnd(engine, cfg.front)


async def run(runner, cfg: AppConfig, *, say: Callable[[str], None] = print,
              task_status=trio.TASK_STATUS_IGNORED) -> int:
    """Serve until SIGINT/SIGTERM; returns the number of requests cancelled at shutdown.
    `runner`: a loaded model, or a models.ModelSet (several, loaded on demand)."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with _front_end(runner, cfg) as front:
            engine = front.engine
            server = Server(front, cfg.server)
            async with trio.open_nursery() as nursery:
                await nursery.start(server.serve)
                http = None
                if cfg.http is not None:   # the same engine over HTTP: OpenAI API, metrics, chat page
                    if cfg.http.host is None:
                        cfg.http.host = cfg.server.host
                    http = HttpServer(front, cfg.http, stats=server.stats)
                    await nursery.start(http.serve)
                server.http = http    # the msgpack port names it to an HTTP client that knocks there
                async with AsyncExitStack() as stack:
                    adv = None
                    if cfg.mdns:
                        props = mdns.txt_properties(version=PROTOCOL_VERSION, model=front.model,
                                                    context_length=engine.max_model_len, auth=front.auth_required,
                                                    http_port=http.port if http else None)
                        if getattr(front, "modelset", None) is not None:   # every model of the box
                            props["models"] = ",".join(front.modelset.slots)[:200]
                        try:
                            addresses = await trio.to_thread.run_sync(
                                mdns.advertised_addresses, cfg.server.host, cfg.mdns_interface)
                            adv = await stack.enter_async_context(mdns.Advertiser(
                                port=server.port, properties=props, addresses=addresses,
                                interface=cfg.mdns_interface))
                        except Exception as e:  # no mDNS is no reason not to serve
                            say(f"warning: mDNS is off, advertising failed: {type(e).__name__}: {e}")
                        else:
                            refresh = trio.CancelScope()
                            stack.callback(refresh.cancel)

                            async def refresher():
                                with refresh:
                                    await _refresh_load(adv, server, cfg.mdns_refresh_s)
                            nursery.start_soon(refresher)
                    # what the load made lives as long as the server: out of the cyclic collector's
                    # sight (a full collection over it took ~0.1 s with the GIL held, a stall of
                    # every door), and the grammar tokenizer built now, while nobody waits (its
                    # constructor holds the GIL ~0.2-0.3 s: it stalled the first format's neighbours)
                    gc.freeze()
                    if getattr(front, "modelset", None) is None:
                        nursery.start_soon(partial(trio.to_thread.run_sync, front.warm_grammars))
                    say(banner(server, adv, cfg, http))
                    systemd.notify(f"READY=1\nSTATUS=serving {front.model}")
                    pet = systemd.watchdog_interval_s()
                    if pet is not None:
                        nursery.start_soon(_watchdog, engine, pet)
                    task_status.started(server)
                    signum = await _next_signal(signals)
                    systemd.notify("STOPPING=1\nSTATUS=draining")
                    server.stop_accepting()
                    say(f"{signal.Signals(signum).name}: stopping (no new connections, "
                        + ("withdrawing the mDNS record, " if adv else "")
                        + f"up to {cfg.grace_s:g} s for running requests; signal again to stop now)")
                # the mDNS goodbye has gone out: browsers drop the record now

                async def hurry():
                    await _next_signal(signals)
                    server.hurry()
                nursery.start_soon(hurry)
                cancelled = await server.shutdown(cfg.grace_s)
                if http:   # the drain ended every HTTP answer too: close the port, let the last ones go out
                    http.stop_accepting()
                    await http.wait_closed(cfg.server.flush_s)
                say(f"stopped ({cancelled} request(s) cancelled)" if cancelled else "stopped")
                nursery.cancel_scope.cancel()
    return cancelled


def tame_malloc() -> None:
    """Keep a long-running server's memory flat (glibc only). Model steps run in worker
    threads, and glibc gives threads arenas of their own and raises its mmap threshold after
    large frees, so freed activation buffers stay resident and RSS creeps up. Two arenas and
    a fixed mmap threshold hand big buffers back to the system when they are freed."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-8, 2)            # M_ARENA_MAX
        libc.mallopt(-3, 1 << 20)      # M_MMAP_THRESHOLD: 1 MiB, and no dynamic raising
    except (OSError, AttributeError):
        pass

