"""The command line: `edgepaged serve | chat | ask | ls | top | stats`.

The client commands import neither torch nor the engine: they start fast.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
from functools import partial
from pathlib import Path

import click

from .client.markdown import ThinkingView, writer_for
from .client import CACHE_ENV, ServerError, SyncClient
from .common.ports import HTTP_PORT
from .server import settings as serve_settings

DEFAULT_HTTP_PORT = HTTP_PORT

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

TOKEN_ENV = "EDGEPAGED_TOKEN"
MDNS_ENV = "EDGEPAGED_MDNS_INTERFACE"


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '1G', '1.5GiB' -> bytes; ValueError for anything else."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m:
        raise ValueError("not a size (e.g. 512M, 4G, 1.5G or a number of bytes)")
    return int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2) or " "))


def kv_budget(text: str | None) -> int | None:
    """--kv-memory: bytes, or None for auto (min(1 GiB, 25 % of free RAM) on a CPU, 90 % of what
    a GPU has left after the weights); ValueError for anything else."""
    if text is None or text.strip().lower() == "auto":
        return None
    return parse_bytes(text)


def fail(message: str, code: int = 1):
    click.echo(f"edgepaged: {message}", err=True)
    sys.exit(code)


def server_options(f):
    """--server, --token, --mdns-interface, --timeout: where and how to connect."""
    f = click.option("--timeout", "discover_timeout", type=float, default=3.0, show_default=True,
                     help="Seconds to look for a server by mDNS when --server is not given.")(f)
    f = click.option("--mdns-interface", envvar=MDNS_ENV, default=None, metavar="ADDR",
                     help=f"Browse mDNS on this interface address only (env {MDNS_ENV}).")(f)
    f = click.option("--token", envvar=TOKEN_ENV, default=None, help=f"Shared token (env {TOKEN_ENV}).")(f)
    f = click.option("--server", default=None, metavar="HOST:PORT",
                     help="The server; by default the last one that answered (if it still does), else the least "
                          "loaded one found by mDNS.")(f)
    f = click.option("--no-cache", is_flag=True, expose_value=False, is_eager=True,
                     callback=lambda ctx, param, value: os.environ.__setitem__(CACHE_ENV, "0") if value else None,
                     help=f"Ask the network (mDNS) instead of trying the last server first (env {CACHE_ENV}=0).")(f)
    return f


def client_name() -> str:
    """Who is asking, for fair scheduling: user@host (not one name shared by every CLI user)."""
    import getpass
    import socket
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "user"
    return f"{user}@{socket.gethostname()}"[:128]


def connect(server, token, mdns_interface, discover_timeout) -> SyncClient:
    name = client_name()
    try:
        return SyncClient(server, token=token or None, name=name, mdns_interface=mdns_interface,
                          discover_timeout_s=discover_timeout)
    except ServerError as e:
        fail(e.message if e.code in ("no_server", "connection_failed", "bad_address") else str(e))


# answers that end: a small model at temperature 0 repeats itself until the context is full
# (minutes); 1024 tokens is a long answer, and a mild repetition penalty breaks loops
DEFAULT_MAX_TOKENS = 1024
DEFAULT_REPEAT_PENALTY = 1.1


def sampling_options(f):
    f = click.option("--hide-thinking", is_flag=True,
                     help="A thinking model's thinking is not shown (it is shown dim before the answer, or on "
                     "stderr when stdout is no terminal).")(f)
    f = click.option("--think/--no-think", default=None,
                     help="A thinking model (Qwen3, ...) thinks before answering, or answers at once "
                     "(default: the model's own).")(f)
    f = click.option("--model", default=None, metavar="NAME",
                     help="Which of the server's models answers (default: its default; `edgepaged ls`).")(f)
    f = click.option("--seed", type=int, default=None, help="Same seed, same sampled answer.")(f)
    f = click.option("--top-p", type=float, default=1.0, show_default=True,
                     help="Sample from the likeliest tokens that make up this much probability.")(f)
    f = click.option("--repeat-penalty", type=float, default=DEFAULT_REPEAT_PENALTY, show_default=True,
                     help="Above 1 discourages repeating tokens already in the conversation (1: off).")(f)
    f = click.option("--temperature", type=float, default=0.0, show_default=True,
                     help="0 picks the most likely token (deterministic).")(f)
    f = click.option("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, show_default=True,
                     help="Most tokens per answer; 0: up to the server's limit (the rest of the context).")(f)
    return f


def sampling_params(max_tokens, temperature, repeat_penalty, top_p, seed, info=None, model=None,
                    think=None) -> dict:
    """The request's sampling fields; max_tokens within what the server takes (its hello)."""
    if max_tokens and info:
        cap = (info.get("limits") or {}).get("max_tokens") or max_tokens
        room = (info.get("context_length") or max_tokens + 1) - 1
        # more than the server could ever give: ask for "up to its limit", which the server
        # fits to the prompt (a number it would refuse when prompt + max_tokens pass the context)
        max_tokens = None if max_tokens >= min(cap, room) else max(1, max_tokens)
    params = {"max_tokens": max_tokens or None, "temperature": temperature, "repetition_penalty": repeat_penalty,
              "top_p": top_p}
    if seed is not None:
        params["seed"] = seed
    if model:
        params["model"] = model
    if think is not None:
        params["think"] = think
    return params


def _version() -> str:
    import importlib.metadata
    try:
        return importlib.metadata.version("edgepaged")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


@click.group()
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.version_option(_version(), "--version", prog_name="edgepaged", message="%(prog)s %(version)s")
def main(verbose):
    """edgepaged: a local LLM runtime for a home server."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if sys.stdin.isatty() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        # On a terminal, Ctrl-C stops an answer (chat, ask) or leaves (top), even when the
        # launcher handed us SIGINT ignored (a background job of a script, some session
        # managers): Python then leaves it ignored and Ctrl-C would do nothing.
        signal.signal(signal.SIGINT, signal.default_int_handler)


# ---------------------------------------------------------------- serve

@main.command()
@serve_settings.options
@click.option("--config", "config_file", default=None, metavar="FILE", envvar="EDGEPAGED_CONFIG", is_eager=True,
              expose_value=False, callback=lambda ctx, param, value: _load_config(ctx, value),
              help="A TOML file of serve's settings, one key per flag (`edgepaged config --example` writes one); "
                   "flags given here win over it. Env EDGEPAGED_CONFIG.")
def serve(**values):
    """Serve a model on the network (msgpack over TCP and HTTP, advertised by mDNS)."""
    try:
        s = serve_settings.ServeSettings.read(values)     # every knob, the environment's too: read once, here
    except ValueError as e:
        fail(str(e), 2)
    if s.context_policy == "window" and s.contiguous:
        fail("--context-policy window needs the paged pool: not with --contiguous", 2)
    # the ports first: a port in use is said at once, not after imports and the model's load
    from .server.manage import parse_networks
    try:
        parse_networks(s.admin_from)
    except ValueError as e:
        fail(str(e), 2)
    server_sock = _bind(s.host, s.port, "--port")
    http_sock = None if s.no_http else _bind(s.host, s.http_port, "HTTP, --http-port")
    import trio

    from .server.app import tame_malloc
    tame_malloc()

    from .server.app import AppConfig, run
    from .request.frontend import load_users
    try:
        users = load_users(s.users) if s.users else None
    except (OSError, ValueError) as e:
        fail(f"--users: {e}")
    try:
        kv_bytes = kv_budget(s.kv_memory)
    except ValueError as e:
        fail(f"--kv-memory {s.kv_memory}: {e}", 2)
    from .model.runtime import KvBudgetError
    kv_kind = None if s.kv_dtype == "auto" else s.kv_dtype
    try:
        if s.prefix_cache_disk == "auto":
            from .box import store
            from .engine.disk_cache import default_limit
            disk_bytes = default_limit(store.store_dir() / "kvcache")
        else:
            disk_bytes = parse_bytes(s.prefix_cache_disk) if s.prefix_cache_disk not in ("0", "off") else 0
    except ValueError as e:
        fail(f"--prefix-cache-disk {s.prefix_cache_disk}: {e}", 2)
    speculation = s.speculate or ("draft" if s.draft else "lookup")
    if speculation == "draft" and not s.draft:
        fail("--speculate draft needs a draft model: --draft MODEL", 2)
    several = len(s.model) > 1 or s.model == ("all",)
    if s.draft and (several or s.contiguous or speculation == "off"):
        fail("--draft drafts for one served model with speculation on and the paged pool "
             f"(not with {'several models' if several else '--contiguous' if s.contiguous else '--speculate off'})", 2)
    from .server.app import AssemblyError, load_runner, model_set, resolve_model
    if several:
        from .request.protocol import parse_keep_alive
        try:
            keep_s = parse_keep_alive(s.keep_alive)
        except ValueError as e:
            fail(f"--keep-alive {s.keep_alive}: {e}", 2)
        try:
            budget = parse_bytes(s.memory_budget) if s.memory_budget else None
        except ValueError as e:
            fail(f"--memory-budget {s.memory_budget}: {e}", 2)
        try:
            runner = model_set(s.model, keep_s, budget, kv_bytes, s.device, s.block_size, s.max_batched_tokens,
                               kv_kind, s.grace, s.cpu)
        except AssemblyError as e:
            fail(str(e), e.code)
    else:
        try:
            model_path, served_name = resolve_model(s.model[0] if s.model else None)
            draft = resolve_model(s.draft)[0] if s.draft else None
            runner = load_runner(model_path, s.device, kv_bytes, s.block_size, s.max_batched_tokens, kv_kind, s.cpu,
                                 draft=draft, served_name=served_name, mmproj=s.mmproj)
        except AssemblyError as e:
            fail(str(e), e.code)
        except KvBudgetError as e:
            fail(f"--kv-memory {s.kv_memory}: {e}" if s.kv_memory else str(e))
        except (FileNotFoundError, ValueError) as e:
            fail(str(e))
        except KeyboardInterrupt:
            fail("interrupted while loading the model", 130)
    cfg = AppConfig.assemble(s, users=users, prefix_cache_disk=disk_bytes, speculation=speculation,
                             server_sock=server_sock, http_sock=http_sock)
    try:
        trio.run(partial(run, runner, cfg, say=lambda line: click.echo(line) or sys.stdout.flush()))
    except BaseExceptionGroup as group:   # e.g. the port is taken: say so without a traceback
        bind_errors, rest = group.split(OSError)
        if bind_errors is None or rest is not None:
            raise
        e = _leaves(bind_errors)[0]
        fail(f"cannot serve on {e.filename or f'{s.host}:{s.port}'}: {e.strerror or e}")


def _bind(host: str, port: int, what: str):
    """A listening socket on host:port, or the command's one-line failure (in use, no such
    address) before anything else happens."""
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        fail(f"cannot serve on {where} ({what}): {e.strerror or e}")
    return sock


def _leaves(group) -> list[BaseException]:
    return [x for e in group.exceptions for x in (_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])]


# ---------------------------------------------------------------- the config file

def config_keys(command: click.Command) -> dict[str, click.Option]:
    """serve's settings by their key in the config file: the flag's long name with - as _
    (`--http-port` is `http_port`, `--no-mdns` is `no_mdns`)."""
    keys = {}
    for p in command.params:
        if isinstance(p, click.Option) and not p.hidden and p.expose_value:
            longest = max(p.opts, key=len)
            keys[longest.lstrip("-").replace("-", "_")] = p
    return keys


def _read_toml(path: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:      # Python 3.10
        import tomli as tomllib
    with open(path, "rb") as f:
        return tomllib.load(f)


def _load_config(ctx: click.Context, path: str | None) -> None:
    """--config FILE: its keys become the defaults of serve's flags (a flag given wins)."""
    if not path:
        return
    try:
        data = _read_toml(path)
    except OSError as e:
        raise click.BadParameter(f"cannot read {path}: {e.strerror or e}", param_hint="--config") from None
    except ValueError as e:          # tomllib.TOMLDecodeError
        raise click.BadParameter(f"{path} is not valid TOML: {e}", param_hint="--config") from None
    data = data.get("serve", data) if isinstance(data.get("serve"), dict) else data
    keys = config_keys(ctx.command)
    out = {}
    for key, value in data.items():
        option = keys.get(key.replace("-", "_"))
        if option is None:
            raise click.BadParameter(f"{path}: unknown key {key!r}; the keys are: {', '.join(sorted(keys))}",
                                     param_hint="--config")
        if option.multiple and not isinstance(value, list):
            value = [value]
        try:   # the value as the flag would take it: a wrong type is one line, not a traceback
            if isinstance(option.type, click.Path):    # (whether the file exists is checked when serve starts)
                if not all(isinstance(v, str) for v in (value if option.multiple else [value])):
                    raise TypeError
            else:
                option.type_cast_value(ctx, value)
        except click.BadParameter as e:
            raise click.BadParameter(f"{path}: {key} = {value!r}: {e.message}", param_hint="--config") from None
        except (TypeError, ValueError):
            want = getattr(option.type, "name", "a value")
            raise click.BadParameter(f"{path}: {key} = {value!r}: expected a {want}", param_hint="--config") from None
        out[option.name] = value
    ctx.default_map = {**(ctx.default_map or {}), **out}


EXAMPLE_VALUES = {"model": ["llama3.2:3b"], "kv_memory": "1G", "memory_budget": "6G", "token": "a-long-secret",
                  "mdns_interface": "192.0.2.10", "max_prompt_tokens": 4096, "max_tokens": 2048,
                  "max_prompt_bytes": 262144, "max_http_per_caller": 32,
                  "users": "/etc/edgepaged/users", "allowed_host": ["box.example.org"],
                  "cors_origin": ["http://tools.local:8080"], "admin_from": ["192.168.1.0/24"], "quant_math": "auto",
                  "runtime": "auto", "speculate": "lookup", "draft": "smollm2:135m",
                  "mmproj": "mmproj-model.gguf", "spec_tokens": 8,
                  "prefix_cache_disk": "4G"}


def _toml_value(value) -> str:
    return json.dumps(value) if not isinstance(value, bool) else ("true" if value else "false")


@main.command(name="config")
@click.option("--example", is_flag=True, help="Print a commented config file with every setting of serve.")
@click.option("--table", is_flag=True, help="Print every setting of serve (flag, config key, environment variable, "
              "default) and the runtime's environment variables as Markdown tables (docs/SETTINGS.md).")
def config_cmd(example, table):
    """The config file of `serve --config FILE`: TOML, one key per flag of serve."""
    if table:
        click.echo(serve_settings.table(), nl=False)
        return
    if not example:
        click.echo("edgepaged config --example prints a commented config file (serve --config FILE reads it); "
                   "--table lists every setting", err=True)
        sys.exit(2)
    import textwrap
    lines = ["# edgepaged serve's settings: `edgepaged serve --config FILE` (or EDGEPAGED_CONFIG=FILE).",
             "# One key per flag of `edgepaged serve --help` (--http-port is http_port). A key left",
             "# commented keeps its default (shown); a flag given on the command line wins over the file.",
             "# Environment: EDGEPAGED_TOKEN (token), EDGEPAGED_MDNS_INTERFACE (mdns_interface),",
             "# EDGEPAGED_STORE (the model store), EDGEPAGED_NUM_THREADS and the kernel settings of README.", ""]
    ctx = click.Context(serve)
    for key, option in config_keys(serve).items():
        lines += ["# " + x for x in textwrap.wrap(option.help or "", 94)]
        default = option.get_default(ctx)
        if key in EXAMPLE_VALUES:
            lines.append(f"#{key} = {_toml_value(EXAMPLE_VALUES[key])}")
        elif default is None or default == () or (option.multiple and not default):
            lines.append(f"#{key} = ")
        else:
            lines.append(f"#{key} = {_toml_value(list(default) if option.multiple else default)}")
        lines.append("")
    click.echo("\n".join(lines).rstrip())


# ---------------------------------------------------------------- the model store

@main.command()
@click.argument("spec", metavar="NAME[:TAG] | REPO[:FILE] | FILE")
@click.option("--name", default=None, help="The name in the store (default: from the file's name).")
@click.option("--json", "as_json", is_flag=True, help="Print the new entry as one JSON object (last line).")
def pull(spec, name, as_json):
    """Bring a GGUF model into the store: an Ollama name (llama3.2:3b, qwen2.5:0.5b; or
    ollama:USER/MODEL:TAG) from Ollama's registry (EDGEPAGED_OLLAMA_REGISTRY to use another),
    resumed when the connection breaks and checked against its digest; a repository on the
    Hugging Face hub (REPO, or REPO:FILE; the Q4_K_M file when it holds several); or a local
    FILE. A model the runtime cannot serve (a vision projector, an unsupported architecture, a
    truncated or non-GGUF file) is refused here, before its weights are fetched where it can.
    A file of 512 MiB or more then has its weights laid out for the CPU runtime (the weights
    cache, README), so its first serve maps them."""
    from .box import pulls, store
    shown = {}

    def progress(status, digest=None, total=None, completed=None):
        if not total:
            click.echo(status, err=True)
            return
        pct = 100 * (completed or 0) / total
        tty = sys.stderr.isatty()
        step = int(pct // 10)                  # a log file gets a line per tenth, a terminal one line
        if not tty and shown.get(status) == step:
            return
        shown[status] = step
        click.echo(f"{status}: {pct:5.1f}% of {_size(total)}", err=True, nl=not tty or completed == total)
        if tty and completed != total:
            click.echo("\r", err=True, nl=False)
    try:
        entry = pulls.pull(spec, name, progress=progress)
    except store.StoreError as e:
        fail(str(e))
    except KeyboardInterrupt:
        fail("interrupted; pull again to retry", 130)
    _lay_out(Path(entry.path))
    if as_json:
        click.echo(json.dumps(entry.to_dict()))


def _lay_out(path: Path) -> None:
    """A large model's weights laid out for the CPU runtime now, once (model/weights_cache.py),
    so its first `serve` maps them instead of repacking the file: ready in about a second."""
    import time

    from .model import weights_cache
    from .model.settings import CpuConfig
    try:
        cfg = CpuConfig.from_env()
        if (weights_cache.cache_dir() is None or cfg.runtime == "torch"
                or path.stat().st_size < cfg.weights_cache_min_bytes):
            return
    except ValueError as e:      # a knob with a wrong value: serve would refuse it too
        click.echo(f"its weights were not laid out: {e}", err=True)
        return
    except OSError:
        return
    click.echo(f"laying out {path.name}'s weights for fast loads (once; EDGEPAGED_WEIGHTS_CACHE=0 skips it)...",
               err=True)
    t = time.perf_counter()
    try:
        state = weights_cache.prepare(path)
    except KeyboardInterrupt:
        fail("interrupted: the model is pulled; its first serve lays its weights out instead", 130)
    if state == "off":
        click.echo("  not laid out: the CPU runtime does not load this file (serve says why)", err=True)
    else:
        click.echo(f"  {'laid out already' if state == 'hit' else 'laid out'} in {time.perf_counter() - t:.1f} s: "
                   "serve maps them", err=True)


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / 2**20:.0f} MB"


def _loaded_models(server: str | None) -> set[str] | None:
    """The models a running server has loaded (its /api/ps), or None when none answers."""
    import urllib.request
    target = server or f"127.0.0.1:{DEFAULT_HTTP_PORT}"
    if "://" not in target:
        target = "http://" + target
    try:
        with urllib.request.urlopen(target.rstrip("/") + "/api/ps", timeout=0.5) as r:
            return {m.get("name", "").removesuffix(":latest") for m in json.load(r).get("models", [])}
    except (OSError, ValueError):
        return None


@main.command(name="models")
@click.option("--json", "as_json", is_flag=True, help="One JSON array as the last line.")
@click.option("--server", default=None, metavar="HOST:PORT",
              help="The HTTP port of the server to ask which models are loaded (default: this box's).")
def models_cmd(as_json, server):
    """The models on this box: the store, the Hugging Face cache and Ollama's store."""
    from .box import store
    found = store.entries()
    loaded = _loaded_models(server) or set()
    for e in found:
        e.loaded = e.name in loaded
    if as_json:
        click.echo(json.dumps([e.to_dict() for e in found]))
        return
    if not found:
        click.echo(f"no models yet (the store is {store.store_dir()}); `edgepaged pull REPO` fetches one, "
                   "`edgepaged pull ./file.gguf` imports one", err=True)
        return
    rows = [("NAME", "SIZE", "QUANT", "ARCH", "CONTEXT", "SOURCE", "")] + [
        (e.name, _size(e.size_bytes), e.quantization or "?", e.architecture or "?", str(e.context or "?"), e.source,
         "loaded" if e.loaded else (f"cannot serve: {e.problem}" if e.problem else "")) for e in found]
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r[:6], widths)) + ("  " + r[6] if r[6] else ""))


main.add_command(models_cmd, name="list")


@main.command(name="rm")
@click.argument("name")
def rm(name):
    """Remove a model from the store (files found in the Hugging Face cache or Ollama's store
    are left to the tools that keep them)."""
    from .box import store
    try:
        e = store.remove(name)
    except store.StoreError as err:
        fail(str(err))
    click.echo(f"removed {e.name} ({_size(e.size_bytes)})")


# ---------------------------------------------------------------- ask

@main.command()
@server_options
@sampling_options
@click.option("--system", default=None, help="A system prompt.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: text, usage, timings.")
@click.option("--plain", is_flag=True, help="Print the answer as the model wrote it, not rendered as Markdown "
              "(it is plain anyway when stdout is not a terminal).")
@click.option("--image", "images", multiple=True, metavar="FILE", type=click.Path(exists=True, dir_okay=False),
              help="An image for a vision model (JPEG, PNG, WebP, GIF); repeat it for several. A large photo is "
              "sent at 2048 pixels at most.")
@click.argument("prompt", nargs=-1)
def ask(server, token, mdns_interface, discover_timeout, temperature, max_tokens, repeat_penalty, top_p, seed, model,
        think, hide_thinking, system, as_json, plain, images, prompt):
    """Ask one question (PROMPT, or stdin when none) and stream the answer. An answer cut at
    --max-tokens says so on stderr (--json: finish_reason "length"); errors exit 1 (--json:
    one JSON object with "error": {"code", "message"})."""
    def failed(code: str, message: str, exit_code: int = 1):
        if as_json:
            click.echo(json.dumps({"text": None, "finish_reason": "error", "error": {"code": code,
                                                                                     "message": message}}))
            sys.exit(exit_code)
        fail(message, exit_code)
    text = " ".join(prompt) if prompt else sys.stdin.read()
    if not text.strip():
        failed("empty_prompt", "nothing to ask: give a PROMPT or pipe one on stdin", 2)
    user = {"role": "user", "content": text}
    if images:
        from .client.images import image_for_frame
        try:
            user["images"] = [image_for_frame(p) for p in images]
        except (OSError, ValueError) as e:
            failed("bad_image", str(e), 2)
    messages = ([{"role": "system", "content": system}] if system else []) + [user]
    try:
        c = SyncClient(server, token=token or None, name=client_name(), mdns_interface=mdns_interface,
                       discover_timeout_s=discover_timeout)
    except ServerError as e:
        failed(e.code, e.message if e.code in ("no_server", "connection_failed", "bad_address") else str(e))
    with c:
        answer = None
        writer = None if as_json else writer_for(sys.stdout, plain)
        view = ThinkingView(sys.stdout, plain, hide_thinking or as_json)
        try:
            answer = c.chat(messages, **sampling_params(max_tokens, temperature, repeat_penalty, top_p, seed, c.info,
                                                        model, think))
            for piece in answer:
                view.pass_on(answer.last_thinking, piece, writer)
            view.close()
        except ServerError as e:
            view.close()
            if writer is not None:
                writer.close()
            failed(e.code, str(e))
        except KeyboardInterrupt:
            if answer is not None:
                answer.cancel()
            view.close()
            if writer is not None:
                writer.close()
            sys.exit(130)
        done = answer.done or {}
        if as_json:
            click.echo(json.dumps({"text": answer.text, "thinking": answer.thinking or None,
                                   "finish_reason": done.get("finish_reason"),
                                   "usage": done.get("usage"), "timings": done.get("timings"),
                                   "model": done.get("model") or c.info.get("model"), "server": c.address,
                                   "error": done.get("error")}))
        else:
            writer.close()
            if done.get("finish_reason") == "length":
                click.echo(f"[the answer stopped at the length limit ({(done.get('usage') or {}).get('completion_tokens')}"
                           " tokens); --max-tokens allows more]", err=True)
        if done.get("finish_reason") in ("error", "cancelled"):
            fail((done.get("error") or {}).get("message", "the request did not finish"))


# ---------------------------------------------------------------- chat

@main.command()
@server_options
@sampling_options
@click.option("--system", default=None, help="A system prompt (also /system TEXT in the chat).")
@click.option("--plain", is_flag=True, help="Show answers as the model wrote them, not rendered as Markdown "
              "(they are plain anyway when stdout is not a terminal).")
def chat(server, token, mdns_interface, discover_timeout, temperature, max_tokens, repeat_penalty, top_p, seed, model,
         think, hide_thinking, system, plain):
    """Chat with a server: /reset, /system TEXT, Ctrl-C stops an answer, Ctrl-D leaves."""
    from .client.chat import ChatSession
    with connect(server, token, mdns_interface, discover_timeout) as c:
        session = ChatSession(c, system=system, plain=plain, hide_thinking=hide_thinking)
        session.params = sampling_params(max_tokens, temperature, repeat_penalty, top_p, seed, c.info, model, think)
        session.run()


# ---------------------------------------------------------------- ls / stats / top

@main.command(name="ls")
@click.option("--timeout", type=float, default=2.0, show_default=True, help="Seconds to listen for answers.")
@click.option("--json", "as_json", is_flag=True)
@click.option("--mdns-interface", envvar=MDNS_ENV, default=None, metavar="ADDR",
              help=f"Browse on this interface address only (env {MDNS_ENV}).")
def ls(timeout, as_json, mdns_interface):
    """The servers on the local network, least loaded first."""
    import trio

    from .server.mdns import discover
    records = trio.run(discover, timeout, mdns_interface)
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in records]))
        return
    if not records:
        click.echo(f"no edgepaged server answered within {timeout:g} s", err=True)
        return
    def http(r):
        if not r.http_port or not r.addresses:
            return "-"
        host = r.addresses[0]
        return f"http://{f'[{host}]' if ':' in host else host}:{r.http_port}/"
    rows = [("NAME", "ADDRESS", "HTTP", "MODEL", "CONTEXT", "AUTH", "RUNNING", "WAITING", "KV")]
    rows += [(r.name, r.address, http(r), r.extra.get("models") or r.model, str(r.context_length),
              "token" if r.auth else "open",
              str(r.running), str(r.waiting), f"{100 * r.kv_usage:.0f}%") for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


@main.command()
@server_options
@click.option("--json", "as_json", is_flag=True, help="One JSON snapshot.")
def stats(server, token, mdns_interface, discover_timeout, as_json):
    """One snapshot of the server's metrics."""
    with connect(server, token, mdns_interface, discover_timeout) as c:
        s = c.stats()
    if as_json:
        click.echo(json.dumps(s))
    else:
        for key, value in s.items():
            click.echo(f"{key}: {json.dumps(value) if isinstance(value, dict) else value}")


@main.command()
@server_options
@click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds between refreshes.")
@click.option("--count", type=int, default=0, help="Stop after this many refreshes (0: until Ctrl-C).")
def top(server, token, mdns_interface, discover_timeout, interval, count):
    """A live view of the server: requests, KV blocks, prefix cache, preemptions, tokens/s."""
    from .client.top import keys, render
    tty = sys.stdout.isatty()
    with connect(server, token, mdns_interface, discover_timeout) as c, keys(sys.stdin) as pressed:
        n = 0
        try:
            while True:
                view = render(c.stats(), c.address, c.info)
                hint = "\nq quits" if pressed.live else ""
                click.echo(("\x1b[H\x1b[2J" if tty else "") + view + hint)
                sys.stdout.flush()
                n += 1
                if count and n >= count:
                    break
                if pressed.wait(interval) in ("q", "Q"):
                    break
        except KeyboardInterrupt:
            pass
        except ServerError as e:
            fail(str(e))


if __name__ == "__main__":
    main(prog_name="edgepaged")
