"""`edgepaged serve`: the engine, the TCP server and the mDNS record, tied to the signals.

SIGINT/SIGTERM: stop accepting, withdraw the mDNS record (goodbye), let running requests
finish within the grace period, cancel the rest with reason `shutdown`, return. A second
signal cuts the grace period short.
"""
from __future__ import annotations

import logging
import signal
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Callable

import trio

from ..engine import Engine, EngineConfig
from . import mdns
from .protocol import PROTOCOL_VERSION
from .tcp import Server, ServerConfig

log = logging.getLogger("edgepaged.server")


@dataclass
class AppConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    mdns: bool = True
    mdns_interface: str | None = None
    mdns_refresh_s: float = 5.0      # the load in the TXT record is refreshed at most this often
    grace_s: float = 10.0


def banner(server: Server, adv: mdns.Advertiser | None, cfg: AppConfig) -> str:
    e, sc = server.engine, server.config
    host = sc.host or "0.0.0.0"
    where = (f"{host}:{server.port} (all interfaces: reachable from the local network)"
             if host in ("0.0.0.0", "::") else f"{host}:{server.port}")
    capacity = e.allocator.num_blocks * e.block_size
    parts = [f"edgepaged ready on {where}", f"model {server.model}", f"context {e.max_model_len} tokens",
             f"KV capacity {capacity} tokens ({e.allocator.num_blocks} blocks of {e.block_size})",
             f"mDNS {adv.name!r}" if adv else "mDNS off"]
    access = ("token required" if sc.token is not None
              else "no --token: open to anyone on the local network")
    return ", ".join(parts) + f"; {access}"


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


async def run(runner, cfg: AppConfig, *, say: Callable[[str], None] = print,
              task_status=trio.TASK_STATUS_IGNORED) -> int:
    """Serve until SIGINT/SIGTERM; returns the number of requests cancelled at shutdown."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with Engine(runner, cfg.engine) as engine:
            server = Server(engine, cfg.server)
            async with trio.open_nursery() as nursery:
                await nursery.start(server.serve)
                async with AsyncExitStack() as stack:
                    adv = None
                    if cfg.mdns:
                        props = mdns.txt_properties(version=PROTOCOL_VERSION, model=server.model,
                                                    context_length=engine.max_model_len,
                                                    auth=cfg.server.token is not None)
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
                    say(banner(server, adv, cfg))
                    task_status.started(server)
                    signum = await _next_signal(signals)
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
                say(f"stopped ({cancelled} request(s) cancelled)" if cancelled else "stopped")
                nursery.cancel_scope.cancel()
    return cancelled
