"""`edgepaged serve`: the engine, the TCP server, the HTTP server (OpenAI-compatible API,
metrics, chat page) and the mDNS record, tied to the signals.

SIGINT/SIGTERM: stop accepting TCP connections, withdraw the mDNS record (goodbye), let
running requests finish within the grace period (meanwhile HTTP stays up and answers new
requests and `/health` with 503), cancel the rest with reason `shutdown`, deliver the last
answers, close the HTTP port, return. A second signal cuts the grace period short.

The assembly of what it serves is here too (`resolve_model`, `load_runner` with its draft
model, `model_set` for several models); the CLI parses flags and calls them.
"""
from __future__ import annotations

import gc
import logging
import os
import re
import signal
import sys
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import trio

from ..engine import Engine, EngineConfig
from ..request.frontend import FrontEnd, FrontEndConfig
from ..request.protocol import PROTOCOL_VERSION
from . import mdns, systemd
from .httpd import HttpConfig, HttpServer
from .manage import loopback
from .settings import ServeSettings
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

    @classmethod
    def assemble(cls, s: ServeSettings, *, users=None, prefix_cache_disk: int = 0, speculation: str = "lookup",
                 server_sock=None, http_sock=None) -> "AppConfig":
        """Each part's config from serve's settings (`s`, read once) and what the command
        resolved from them (users read from their file, the disk tier's bytes, the
        speculation mode, the listening sockets)."""
        from ..constrain.grammar import GrammarLimits
        http = None
        if not s.no_http:
            http = HttpConfig(port=s.http_port, allowed_hosts=s.allowed_host, cors_origins=s.cors_origin,
                              admin_from=s.admin_from, max_inflight_per_caller=s.max_http_per_caller)
            http.sock = http_sock
        return cls(
            server=ServerConfig(host=s.host, port=s.port, max_connections=s.max_connections,
                                max_inflight=s.max_inflight, max_unauthenticated=s.max_unauthenticated,
                                max_unauthenticated_per_address=s.max_unauthenticated_per_address, sock=server_sock),
            front=FrontEndConfig(token=s.token or None, users=users, max_prompt_tokens=s.max_prompt_tokens,
                                 max_prompt_bytes=s.max_prompt_bytes, max_tokens=s.max_tokens,
                                 max_request_tokens=s.max_request_tokens, max_identity_tokens=s.max_identity_tokens,
                                 grammar=GrammarLimits(max_depth=s.grammar_max_depth, max_bytes=s.grammar_max_bytes,
                                                       compile_timeout_s=s.grammar_timeout)),
            engine=EngineConfig(max_num_batched_tokens=s.max_batched_tokens, contiguous=s.contiguous,
                                context_policy=s.context_policy, window_tokens=s.window, window_sink=s.sink,
                                step_time_target_s=s.step_time or None, speculation=speculation,
                                spec_tokens=s.spec_tokens, spec_max_running=s.spec_max_running,
                                prefix_cache_disk=prefix_cache_disk),
            http=http, mdns=not s.no_mdns, mdns_interface=s.mdns_interface, mdns_refresh_s=s.mdns_refresh,
            grace_s=s.grace)


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
    models = front.modelset
    if models is not None:
        parts = [f"edgepaged ready on {where}", f"models {', '.join(models.slots)} (default {models.default}; "
                 f"loaded on first use, unloaded after {models.slots[models.default].keep_alive_s:g} s idle)",
                 f"model memory {models.budget_bytes >> 20} MiB (weights + KV)",
                 f"HTTP (OpenAI API, chat page) {http_url(http)}" if http else "HTTP off",
                 mdns_part(adv)]
    else:
        capacity = e.kv_capacity_blocks * e.block_size
        parts = [f"edgepaged ready on {where}", f"model {front.model}",
                 f"products {e.runner.products}", f"context {e.max_model_len} tokens"
                 + (f" (window policy: {e.config.window_sink} sink + {e.config.window_tokens} window tokens)"
                    if e.config.context_policy == "window" else ""),
                 f"KV capacity {capacity} tokens ({e.kv_capacity_blocks} blocks of {e.block_size}, "
                 f"{e.runner.kv_dtype_name})",
                 memory_line(e.memory()),
                 f"HTTP (OpenAI API, chat page) {http_url(http)}" if http else "HTTP off",
                 mdns_part(adv)]
    fc = front.config
    access = (f"per-user tokens ({len(fc.users)} users)" if fc.users else "token required" if fc.token is not None
              else "no --token: open to anyone on this box" if loopback(host)
              else "no --token: open to anyone on the local network")
    return ", ".join(parts) + f"; {access}"


def mdns_part(adv: mdns.Advertiser | None) -> str:
    if adv is None:
        return "mDNS off"
    return f"mDNS {adv.name!r}" + (f" (announced on {adv.interface} only)" if adv.interface else "")


def memory_line(m: dict) -> str:
    mib = lambda n: f"{(n or 0) / 2**20:.0f} MiB"  # noqa: E731
    mapped = " (mapped from the weights cache: resident as they are read)" if m.get("weights_mapped") else ""
    return (f"memory: weights {mib(m.get('weights_bytes'))}{mapped}, KV {mib(m.get('kv_reserved_bytes'))} reserved "
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
    from ..box.models import ModelSet, MultiFront
    if isinstance(runner, ModelSet):
        runner.front_config, runner.engine_config = cfg.front, cfg.engine   # every model gets the box's settings
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
                        if front.modelset is not None:   # every model of the box
                            props["models"] = ",".join(front.modelset.slots)[:200]
                        try:
                            one = await trio.to_thread.run_sync(
                                mdns.advertising_interface, cfg.server.host, cfg.mdns_interface)
                            addresses = [one] if one else await trio.to_thread.run_sync(mdns.local_addresses)
                            adv = await stack.enter_async_context(mdns.Advertiser(
                                port=server.port, properties=props, addresses=addresses, interface=one))
                        except Exception as e:  # no mDNS is no reason not to serve
                            say(f"warning: mDNS is off, advertising failed: {type(e).__name__}: {e}")
                        else:
                            refresh = trio.CancelScope()
                            stack.callback(refresh.cancel)

                            async def refresher():
                                with refresh:
                                    await _refresh_load(adv, server, cfg.mdns_refresh_s)
                            nursery.start_soon(refresher)
                    # the grammar tokenizer built before the banner says ready (its constructor
                    # holds the GIL ~0.2-0.3 s: built after, it stalled the first format's
                    # neighbours, and a command with tools sent at "ready" waited for it: 0.33 s
                    # of Home Assistant's first command), then what the load made lives as long as
                    # the server: out of the cyclic collector's sight (a full collection over it
                    # took ~0.1 s with the GIL held, a stall of every door)
                    if front.modelset is None:
                        await trio.to_thread.run_sync(front.warm_grammars)
                    gc.freeze()
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

# ---------------------------------------------------------------- assembly: the models a box serves

class AssemblyError(ValueError):
    """What `serve` cannot assemble, said in one line (`code`: the exit status it asks for)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def resolve_model(spec: str | None) -> tuple[str | None, str | None]:
    """serve --model: (the file, the name it is served under). A path as it is (its file's
    name); else what the store finds by that name; a hub repository not on the box is pulled
    first."""
    if spec is None or os.path.exists(spec):
        return spec, None
    from ..box import store
    try:
        entry = store.find(spec)
    except store.StoreError as e:
        if not re.fullmatch(r"[\w.-]+/[\w.-]+(:.+)?", spec):
            raise AssemblyError(str(e)) from None
        try:
            entry = store.pull_hub(spec)
        except store.StoreError as e2:
            raise AssemblyError(str(e2)) from None
    return entry.path, entry.name


def model_set(specs, keep_s, budget, kv_bytes, device, block_size, max_batched_tokens, kv_dtype, grace,
              settings=None):
    """serve --model A --model B ...: a models.ModelSet (nothing loaded yet). keep_s: the
    keep-alive in seconds; budget: the memory budget in bytes (None: 70 % of the available
    memory); settings: the runtime's (CpuConfig), read once by serve."""
    from ..box import store
    from ..box.models import ModelSet, ModelSpec
    from ..model.runtime import CPU_KV_MAX_BYTES, available_ram
    if budget is None:
        budget = int(0.7 * available_ram())
    if specs == ("all",):
        entries = [e for e in store.entries() if not e.problem]
        if not entries:
            raise AssemblyError(f"--model all: no models here (the store is {store.store_dir()}); `edgepaged pull` "
                                "fetches one")
    else:
        entries = []
        for spec in specs:
            path, name = resolve_model(spec)
            entry = store.Entry(name=name or store.default_name(Path(path).name), path=path,
                                size_bytes=Path(path).stat().st_size, architecture=None, quantization=None,
                                context=None, source="path")
            entries.append(entry)
    models = []
    for e in entries:
        try:
            info = store.inspect(Path(e.path))
        except store.StoreError as err:
            raise AssemblyError(str(err)) from None
        models.append(ModelSpec(e.name, e.path, info["size_bytes"], info["context"], info["architecture"],
                                info["quantization"], e.system, e.parameters))

    def load(spec, kv):
        return load_runner(spec.path, device, kv, block_size, max_batched_tokens, kv_dtype, settings,
                           served_name=spec.name)
    from ..engine import EngineConfig
    try:
        return ModelSet(models, load, budget_bytes=budget, kv_bytes=kv_bytes or min(CPU_KV_MAX_BYTES, budget // 4),
                        keep_alive_s=keep_s, grace_s=grace,
                        engine_config=EngineConfig(max_num_batched_tokens=max_batched_tokens))
    except ValueError as e:
        raise AssemblyError(str(e)) from None


def projector_for(model_path, mmproj: str | None = None) -> Path | None:
    """The vision projector to attach: `mmproj` (a path; "none": no projector), else the model
    file itself when its tower is inside (Ollama's layout), else the one mmproj*.gguf beside a
    model file (two or more: none, say which with --mmproj)."""
    if mmproj is not None:
        if mmproj.lower() == "none":
            return None
        p = Path(mmproj).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"--mmproj {mmproj}: no such file")
        return p
    if model_path is None or not Path(model_path).is_file():
        return None
    from ..model.vision import has_vision
    if has_vision(model_path):           # Ollama's single file: the tower inside the model's GGUF
        return Path(model_path)
    own = Path(model_path).with_suffix(".mmproj.gguf")
    if own.is_file():                    # a pulled llava's projector layer, kept beside it by the store
        return own
    found = sorted(Path(model_path).parent.glob("mmproj*.gguf"))
    return found[0] if len(found) == 1 else None


def load_runner(model_path, device, kv_bytes, block_size, max_batched_tokens, kv_dtype=None, settings=None,
                draft=None, say=None, served_name=None, mmproj: str | None = None):
    """The served model's runner; with `draft` (a path), its draft model attached (`runner.draft`),
    the KV budget shared between the two caches block for block. `settings`: the runtime's
    (CpuConfig: the runtime, the quantized math, the kernels' bounds), read once by serve
    (None: from the environment, here). `say`: where the progress lines go (default:
    stderr). Raises what the load raises (ValueError, KvBudgetError, ...)."""
    from ..model.open import choose_runtime, open_runner, resolve_device
    from ..model.settings import CpuConfig
    say = say or _stderr
    settings = settings or CpuConfig.from_env()
    device = resolve_device(device)
    kind = choose_runtime(None, device, model_path, settings)
    if kv_dtype is None and kind == "cpu":
        kv_dtype, why = auto_kv_dtype(model_path, kv_bytes, draft)
        if kv_dtype:
            say(f"KV cache {kv_dtype}: {why} (--kv-dtype f16 keeps f16)")
    t0 = time.monotonic()
    say(f"loading {model_path or 'the embedded model (SmolLM2-135M-Instruct)'} on {device} "
        f"({'numpy + Rust' if kind == 'cpu' else 'torch'})...")
    share = None
    if draft is not None:
        share = draft_share(model_path, draft, kv_dtype)
        if kv_bytes is None:
            from ..model.runtime import cpu_kv_default_bytes
            kv_bytes = cpu_kv_default_bytes() if device == "cpu" else None
        if kv_bytes is not None:
            kv_bytes = int(kv_bytes * share)
    runner = open_runner(model_path, device, kv_bytes, block_size, max_num_batched_tokens=max_batched_tokens,
                         kv_dtype=kv_dtype, settings=settings, runtime=kind, served_name=served_name)
    how = {"hit": "; weights laid out already, from the weights cache",
           "writing": "; writing its laid-out weights to the weights cache in the background, for a faster next load"
           }.get(runner.weights_cache, "")
    say(f"loaded {runner.model_path.name} in {time.monotonic() - t0:.1f} s ({runner.products} products{how})")
    projector = projector_for(model_path, mmproj)
    if projector is not None:
        try:
            runner.attach_vision(projector)
            say(f"images: {projector.name} ({runner.vision.describe()})")
        except (ValueError, KeyError) as e:
            if mmproj is not None:         # asked for: its failure is the load's
                raise ValueError(f"--mmproj {mmproj}: {e}") from None
            say(f"text only: {projector.name} beside the model is not its projector ({e})")
    if draft is not None:
        from ..engine.draft import check_pair
        t0 = time.monotonic()
        say(f"loading the draft model {draft}...")
        drafter = open_runner(draft, device, None, block_size, max_num_batched_tokens=max_batched_tokens,
                              kv_dtype=kv_dtype, settings=settings, runtime=choose_runtime(None, device, draft, settings),
                              num_blocks=runner.num_blocks)
        check_pair(runner, drafter)
        runner.attach_draft(drafter)
        say(f"loaded the draft model {runner.draft.model_path.name} in {time.monotonic() - t0:.1f} s "
            f"({runner.num_blocks} blocks shared: {share:.0%} of the KV memory is the model's, the rest the draft's)")
    return runner


# --kv-dtype auto on the CPU runtime: q8_0 when an f16 cache would hold fewer tokens than this
# in the KV memory (a household's few long prompts and chats at once), f16 otherwise. q8_0 holds
# 1.88 times the tokens at a measured perplexity cost of 0.03 % (KL divergence 1.6e-4 from f16,
# bench/RESULTS.md), its decode attention as fast as f16's.
AUTO_Q8_BELOW_TOKENS = 32768


def auto_kv_dtype(model_path, kv_bytes, draft=None) -> tuple[str | None, str]:
    """What `--kv-dtype auto` picks on the CPU runtime: ("q8_0", why) when the KV memory is
    what limits and every model's heads split into q8_0's blocks, else (None, why): f16."""
    from ..model.cpu.runner import kv_bytes_per_value
    from ..model.cpu.encoder import is_encoder
    from ..model.loader import ModelFiles
    from ..model.runtime import cpu_kv_default_bytes
    if model_path is not None and is_encoder(model_path):
        return None, "an embedding model keeps no KV cache"
    cfgs = [ModelFiles(p).config for p in [model_path] + ([draft] if draft is not None else [])]
    if any(c.head_dim % 32 for c in cfgs):
        return None, "heads that do not split into blocks of 32"
    budget = kv_bytes if kv_bytes is not None else cpu_kv_default_bytes()
    per_token = sum(2 * c.num_layers * c.num_kv_heads * c.head_dim for c in cfgs) * kv_bytes_per_value("f16")
    tokens = int(budget // per_token)
    if tokens >= AUTO_Q8_BELOW_TOKENS:
        return None, f"f16 holds {tokens} tokens"
    return "q8_0", (f"the KV memory ({budget >> 20} MiB) would hold {tokens} tokens in f16, "
                    f"{int(budget // (per_token * kv_bytes_per_value('q8_0') / 2))} in q8_0")


def draft_share(model_path, draft_path, kv_dtype=None) -> float:
    """The served model's share of the KV memory beside a draft model: each block of the pool
    holds its K/V in both caches, so the budget splits as their bytes per token do."""
    from ..model.loader import ModelFiles

    def per_token(path) -> int:
        cfg = ModelFiles(path).config
        return cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    from ..model.cpu.runner import kv_bytes_per_value
    width = kv_bytes_per_value(kv_dtype)
    t, d = per_token(model_path) * width, per_token(draft_path) * width
    return t / (t + d)
