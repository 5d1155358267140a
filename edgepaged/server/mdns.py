"""Zero-config discovery: advertise `_edgepaged._tcp.local.` and browse for it (zeroconf).

zeroconf's blocking calls (register, update, unregister, close, resolve) run in worker
threads; its browser callbacks run in zeroconf's own thread and are handed to Trio with the
Trio token into a channel. TXT records carry the protocol version, the model, the context
length, whether a token is required (never the token) and the load, which the advertiser
refreshes with `update` (at most every few seconds; see app.py).

mDNS says where a server is, not whether it is alive: a server killed hard stays in caches
for minutes. Liveness comes from the TCP connection.
"""
from __future__ import annotations

import ipaddress
import logging
import math
import re
import socket
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from functools import partial

import trio
from zeroconf import InterfaceChoice, IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

log = logging.getLogger("edgepaged.mdns")
SERVICE_TYPE = "_edgepaged._tcp.local."


def make_zeroconf(interface: str | None) -> Zeroconf:
    """IPv4 multicast on one interface address (tests, pinned servers) or on all of them."""
    return Zeroconf(interfaces=[interface] if interface else InterfaceChoice.All, ip_version=IPVersion.V4Only)


def local_addresses() -> list[str]:
    """This host's IPv4 addresses other than loopback (loopback alone when there is nothing else)."""
    import ifaddr
    found = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str) and not ipaddress.ip_address(ip.ip).is_loopback and ip.ip not in found:
                found.append(ip.ip)
    return found or ["127.0.0.1"]


def advertising_interface(bind_host: str, interface: str | None) -> str | None:
    """The one interface address a server announces itself on: `interface` when given; for a
    server bound to one address, that address (a server on 127.0.0.1 is announced on loopback,
    to clients on the box, never to a local network that could not reach it); None (every
    interface) for a server bound to all of them."""
    if interface:
        return interface
    if bind_host in ("", "0.0.0.0", "::"):
        return None
    return socket.gethostbyname(bind_host)


def _label(text: str, limit: int = 63) -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", text)[:limit].strip("-") or "edgepaged"


def instance_name(port: int) -> str:
    """Stable across restarts on one host (a restart replaces its stale record); zeroconf's
    probing renames it if another server already holds the name."""
    return _label(f"edgepaged-{socket.gethostname().split('.')[0]}-{port}")


def txt_properties(*, version: int, model: str, context_length: int, auth: bool, running: int = 0,
                   waiting: int = 0, kv_usage: float = 0.0, http_port: int | None = None) -> dict[str, str]:
    props = {"proto": str(version), "model": model[:200], "ctx": str(context_length), "auth": "1" if auth else "0",
             "running": str(running), "waiting": str(waiting), "kv": f"{kv_usage:.3f}"}
    if http_port:
        props["http"] = str(http_port)   # the HTTP port (OpenAI API, chat page) on the same addresses
    return props


def load_properties(stats: dict) -> dict[str, str]:
    """The load part of the TXT record, from an engine stats snapshot."""
    return {"running": str(stats["num_requests_running"]), "waiting": str(stats["num_requests_waiting"]),
            "kv": f"{stats['kv_cache_usage_perc']:.3f}"}


@dataclass
class ServerRecord:
    """One server found on the network."""
    name: str                      # instance name, without the service type
    addresses: list[str]
    port: int
    version: int = 0
    model: str = ""
    context_length: int = 0
    auth: bool = False
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    http_port: int = 0             # 0: no HTTP server advertised
    extra: dict = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"{self.addresses[0]}:{self.port}" if self.addresses else f"?:{self.port}"

    def load_key(self) -> tuple:
        """Least loaded first: fewest waiting, then running, then KV in use."""
        return (self.waiting, self.running, self.kv_usage)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["address"] = self.address
        return d

    @classmethod
    def from_info(cls, info: ServiceInfo) -> "ServerRecord":
        props = {(k.decode() if isinstance(k, bytes) else k): (v.decode(errors="replace") if isinstance(v, bytes)
                                                               else v or "")
                 for k, v in (info.properties or {}).items()}

        def num(key, kind, default):
            try:
                return kind(props.get(key, default))
            except ValueError:
                return default
        name = info.name[:-len(SERVICE_TYPE) - 1] if info.name.endswith("." + SERVICE_TYPE) else info.name
        known = {"proto", "model", "ctx", "auth", "running", "waiting", "kv", "http"}
        return cls(name=name, addresses=info.parsed_addresses(IPVersion.V4Only), port=info.port or 0,
                   version=num("proto", int, 0), model=props.get("model", ""), context_length=num("ctx", int, 0),
                   auth=props.get("auth") == "1", running=num("running", int, 0), waiting=num("waiting", int, 0),
                   kv_usage=num("kv", float, 0.0), http_port=num("http", int, 0),
                   extra={k: v for k, v in props.items() if k not in known})


class Advertiser:
    """Registers the service on enter, refreshes its TXT with `update`, says goodbye on exit."""

    def __init__(self, *, port: int, properties: dict[str, str], addresses: list[str],
                 interface: str | None = None, instance: str | None = None):
        self.port, self.properties, self.addresses = port, dict(properties), addresses
        self.interface = interface
        self.name = f"{instance or instance_name(port)}.{SERVICE_TYPE}"
        self.zc: Zeroconf | None = None
        self.info: ServiceInfo | None = None
        self._lock = trio.Lock()   # one zeroconf call at a time: no update can follow the goodbye

    def _info(self) -> ServiceInfo:
        host = _label(socket.gethostname().split(".")[0])
        return ServiceInfo(SERVICE_TYPE, self.name, port=self.port, properties=self.properties,
                           server=f"{host}.local.", parsed_addresses=self.addresses)

    async def __aenter__(self) -> "Advertiser":
        self.zc = await trio.to_thread.run_sync(make_zeroconf, self.interface)
        self.info = self._info()
        try:
            await trio.to_thread.run_sync(partial(self.zc.register_service, self.info, allow_name_change=True))
        except BaseException:
            await trio.to_thread.run_sync(self.zc.close)
            raise
        self.name = self.info.name
        return self

    @property
    def instance(self) -> str:
        return self.name[:-len(SERVICE_TYPE) - 1]

    async def update(self, properties: dict[str, str]) -> bool:
        """Re-announce with new TXT values when they changed. Returns whether it announced."""
        async with self._lock:
            new = {**self.properties, **properties}
            if self.zc is None or new == self.properties:
                return False
            self.properties = new
            self.info = self._info()
            await trio.to_thread.run_sync(self.zc.update_service, self.info)
            return True

    async def __aexit__(self, *exc) -> None:
        with trio.CancelScope(shield=True):   # the goodbye is sent even when we are cancelled
            async with self._lock:
                zc, info = self.zc, self.info
                self.zc = None
                if zc is None:
                    return

                def goodbye():
                    try:
                        zc.unregister_service(info)
                    finally:
                        zc.close()
                await trio.to_thread.run_sync(goodbye)


class Browser:
    """What `open_browser` yields: `records` (name -> ServerRecord) stays current, and
    `changed` is a fresh Event set at each change."""

    def __init__(self, zc: Zeroconf, resolve_timeout_ms: int):
        self.zc, self.resolve_timeout_ms = zc, resolve_timeout_ms
        self.records: dict[str, ServerRecord] = {}
        self.changed = trio.Event()

    async def _consume(self, recv) -> None:
        async for name, change in recv:
            if change is ServiceStateChange.Removed:
                self.records.pop(name, None)
            else:
                info = await trio.to_thread.run_sync(self.zc.get_service_info, SERVICE_TYPE, name,
                                                     self.resolve_timeout_ms, abandon_on_cancel=True)
                if info is None or not info.port:
                    continue
                self.records[name] = ServerRecord.from_info(info)
            self.changed.set()
            self.changed = trio.Event()

    async def wait_for(self, predicate, timeout_s: float) -> bool:
        """Wait until predicate(list of records) holds; False on timeout."""
        with trio.move_on_after(timeout_s):
            while not predicate(list(self.records.values())):
                await self.changed.wait()
            return True
        return False


@asynccontextmanager
async def open_browser(interface: str | None = None, resolve_timeout_ms: int = 1500):
    """Watch the network for servers:

        async with open_browser() as b:
            await b.wait_for(bool, timeout_s=3)    # until at least one answers
            b.records
    """
    zc = await trio.to_thread.run_sync(make_zeroconf, interface)
    browser = None
    send, recv = trio.open_memory_channel(math.inf)
    token = trio.lowlevel.current_trio_token()

    def deliver(item):  # in Trio
        try:
            send.send_nowait(item)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def on_change(zeroconf, service_type, name, state_change):  # in zeroconf's thread
        try:
            token.run_sync_soon(deliver, (name, state_change))
        except trio.RunFinishedError:
            pass

    def close():
        if browser is not None:
            browser.cancel()
        zc.close()
    try:
        b = Browser(zc, resolve_timeout_ms)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(b._consume, recv)
            browser = await trio.to_thread.run_sync(partial(ServiceBrowser, zc, SERVICE_TYPE, handlers=[on_change]))
            try:
                yield b
            finally:
                send.close()
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(close)


async def discover(timeout_s: float = 2.0, interface: str | None = None, *, first: bool = False,
                   settle_s: float = 0.4) -> list[ServerRecord]:
    """Servers on the network. With `first`, return shortly (`settle_s`) after the first one
    answers instead of waiting the whole timeout. Least loaded first."""
    async with open_browser(interface) as b:
        if first:
            if await b.wait_for(bool, timeout_s):
                await trio.sleep(settle_s)
        else:
            await trio.sleep(timeout_s)
        return sorted(b.records.values(), key=ServerRecord.load_key)
