"""Every knob of `edgepaged serve` in one typed object, `ServeSettings`, declared once here:
a field is the setting, its name the config file's key, and its metadata the command-line
flag (`--name-with-dashes`), its environment variable where it has one, and its help. The
command line's options are generated from the fields (`options`), the config file's keys
are the fields' names, and the knobs of the model runtime read from the environment
(`model/settings.py`'s `CpuConfig`: threads, quantized math, kernel bounds) ride in the same
object (`cpu`), read once when `serve` assembles the box and passed down from there.

    s = ServeSettings.read(values)       # serve's parsed flags (and config file), the environment
    s.port, s.cpu.quant_math, ...

`table()` is the one list of them all (`edgepaged config --table` prints it; docs/SETTINGS.md
is its copy, and a test keeps the two the same).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import click

from ..common.ports import HTTP_PORT, PORT
from ..model.settings import ENV_KNOBS, CpuConfig, EnvKnob


@dataclass(frozen=True)
class Flag:
    """How a field appears on the command line (and in the config file: the field's name)."""
    help: str
    type: Any = None                   # a click type; None: the default's type
    metavar: str | None = None
    multiple: bool = False
    is_flag: bool = False
    env: str | None = None             # an environment variable that sets its default
    show_default: bool = True
    hidden: bool = False
    name: str | None = None            # the flag when it is not --the-field-name


def knob(default, help: str, **how) -> Any:
    """A field of ServeSettings: its default and how it is set (`Flag`)."""
    return field(default=default, metadata={"flag": Flag(help, **how)})


def _range(lo=None, hi=None, float_=False):
    return (click.FloatRange if float_ else click.IntRange)(lo, hi)


@dataclass(frozen=True)
class ServeSettings:
    # -- the models
    model: tuple[str, ...] = knob(
        (), "A GGUF file, a Hugging Face folder, a name from `edgepaged models` (the store, the Hugging "
        "Face cache, Ollama's store: llama3.2:3b), or a hub repository OWNER/NAME[:FILE] (pulled "
        "into the store first). Repeat it to serve several models (the first is the default; each "
        "loads on its first request and unloads when idle); `all`: every model `edgepaged models` "
        "lists. Default: the embedded SmolLM2-135M-Instruct.", metavar="MODEL", multiple=True, show_default=False)
    keep_alive: str = knob(
        "5m", "Several models: how long an idle model stays loaded (30s, 5m, 1h; -1: always). A request's "
        "keep_alive sets it for its model, as Ollama's does.", metavar="DURATION")
    memory_budget: str | None = knob(
        None, "Several models: memory for all loaded models' weights and KV caches together, e.g. 6G "
        "(default: 70% of the RAM available at start). A model that does not fit unloads the least "
        "recently used idle ones first.", metavar="BYTES")
    device: str = knob("auto", "cpu, cuda, cuda:N or auto.")
    # -- where it listens
    host: str = knob("0.0.0.0", "Address to listen on; 0.0.0.0 makes the server reachable from the local network.")
    port: int = knob(PORT, "TCP port (0: any free port).")
    # -- the KV cache and the steps
    kv_memory: str | None = knob(
        None, "KV cache budget, e.g. 512M or 4G; auto (the default): min(1 GiB, 25% of free RAM) on CPU, "
        "90% of what the GPU has left after the weights.", metavar="BYTES")
    prefix_cache_disk: str = knob(
        "auto", "The prefix cache's disk tier: the computed prompts' full KV blocks kept on disk (under the "
        "model store's kvcache/), found again after they leave RAM and after a restart (Home "
        "Assistant's long prompt answered at once). At most SIZE (e.g. 4G); auto: 5% of the free "
        "space, at most 8 GiB; 0: off.", metavar="SIZE")
    block_size: int = knob(16, "Tokens per KV block.")
    kv_dtype: str = knob(
        "auto", "The KV cache's element type. q8_0 (CPU runtime) holds 1.88 times f16's tokens in the same "
        "memory (blocks of 32 values with one scale, read by the attention kernels as they are; "
        "perplexity +0.03 %). auto: on the CPU runtime f16, or q8_0 when f16 would hold fewer than "
        "32,768 tokens in the KV memory (a 3-8 B model, or a small --kv-memory); the model's dtype on "
        "a GPU. f32: twice f16's bytes.", type=click.Choice(["auto", "f16", "q8_0", "f32"]))
    max_batched_tokens: int = knob(512, "Token budget of one step.")
    # -- who may ask
    token: str | None = knob(
        None, "Shared token clients must send (env EDGEPAGED_TOKEN); none: open to the local network.",
        env="EDGEPAGED_TOKEN", show_default=False)
    http_port: int = knob(
        HTTP_PORT, "HTTP port: the OpenAI-compatible API, /metrics and the chat page for phones (0: any free port).")
    no_http: bool = knob(False, "Do not serve HTTP (the msgpack port only).", is_flag=True, show_default=False)
    no_mdns: bool = knob(False, "Do not advertise on the local network.", is_flag=True, show_default=False)
    mdns_interface: str | None = knob(None, "Advertise on this interface address only.", metavar="ADDR")
    max_connections: int = knob(
        64, "Most msgpack connections past hello. Connections still before hello have an allowance of their "
        "own (--max-unauthenticated), so clients without a token cannot take these places.")
    max_unauthenticated: int = knob(16, "Most msgpack connections that have not finished hello, from all addresses together.")
    max_unauthenticated_per_address: int = knob(4, "Most msgpack connections before hello from one address.")
    allowed_host: tuple[str, ...] = knob(
        (), "A name the HTTP port may be reached by besides its addresses, its host name, localhost and "
        ".local names (repeatable; '*.example.org' for a domain). Other Host headers get 421.",
        metavar="NAME", multiple=True, show_default=False)
    cors_origin: tuple[str, ...] = knob(
        (), "A web origin whose pages may call the HTTP API, e.g. http://tools.local:8080 (repeatable; "
        "'*' for any). None by default.", metavar="ORIGIN", multiple=True, show_default=False)
    admin_from: tuple[str, ...] = knob(
        (), "A network whose callers may manage models (Ollama's /api/pull, delete, copy, create, blobs) on a "
        "box without tokens, e.g. 192.168.1.0/24 (repeatable). Default: only the box itself (loopback); "
        "with tokens, admins only.", metavar="CIDR", multiple=True, show_default=False)
    # -- what one request, caller or connection may take
    max_inflight: int = knob(16, "Requests in flight per connection.")
    max_prompt_tokens: int | None = knob(None, "Longest prompt taken (default: the context).", type=int)
    max_tokens: int | None = knob(None, "Cap on a request's max_tokens (default: the context).", type=int)
    max_http_per_caller: int | None = knob(
        None, "Most HTTP generations one user (with tokens) or address may have in flight at once; past it a "
        "429 (default: half of the box's 64).", type=_range(1))
    max_prompt_bytes: int | None = knob(
        None, "Most bytes of text one request's prompt may have (its messages, prompt and suffix, as UTF-8), "
        "checked before it is tokenized; past it a 400 (default: 16 x the context, at least 256 KiB).",
        type=_range(1))
    max_request_tokens: int = knob(
        65536, "Most tokens one request may ask for: max_tokens x n (its parallel samples). Past it: a 400.",
        type=_range(1))
    max_identity_tokens: int = knob(
        262144, "Most tokens one user, client name or address may have asked for at once (max_tokens x n "
        "of its unfinished requests). Past it: a 429 until one ends.", type=_range(1))
    grammar_max_depth: int = knob(
        128, "Output formats (JSON schemas, Lark grammars, regexes, tool schemas): most levels of nesting, "
        "rule chains and $ref chains counted together. Deeper: a 400 before anything compiles.",
        type=_range(1, 4096))
    grammar_max_bytes: int = knob(256 << 10, "Output formats: the largest schema, grammar or pattern taken (bytes).",
                                  type=_range(1))
    grammar_timeout: float = knob(
        10.0, "Output formats: seconds a format may take to compile (with its matchers); past it a 400, "
        "and the same format is refused at once from then on.", type=_range(0.1, float_=True))
    grace: float = knob(10.0, "Seconds running requests get to finish at shutdown.")
    users: str | None = knob(
        None, "Per-user tokens, one 'name token' per line ('name token admin' for a user who may see "
        "everyone's figures in /stats and /metrics): each user gets a prefix cache of their own.",
        metavar="FILE", type=click.Path(exists=True, dir_okay=False))
    # -- how the model runs
    contiguous: bool = knob(False, "Reserve prompt + max_tokens of KV up front (the naive scheme, for benchmarks).",
                            is_flag=True, show_default=False)
    quant_math: str | None = knob(
        None, "How quantized weights multiply on CPU: int8 (activations quantized per block of 32, 256 for "
        "K-quants, 8-bit dot products: llama.cpp's math, 2-3x faster), exact (fp32 activations), auto (int8 "
        "from 0.7 B parameters on). Default: $EDGEPAGED_QUANT_MATH or auto.",
        type=click.Choice(["auto", "int8", "exact"]))
    runtime: str | None = knob(
        None, "What runs the model: cpu (numpy + the Rust kernels; GGUF files on the CPU, no torch needed), "
        "torch (a GPU, safetensors checkpoints), auto (cpu where it applies). Default: "
        "$EDGEPAGED_RUNTIME or auto.", type=click.Choice(["auto", "cpu", "torch"]))
    step_time: float = knob(
        0.5, "Under load (more than one request in), a step takes about this long at most (seconds; its "
        "token budget follows the measured speed): a question that arrives waits for a short step. "
        "0: every step takes --max-batched-tokens.", type=_range(0, float_=True))
    speculate: str | None = knob(
        None, "Speculative decoding: a few next tokens guessed, checked in one forward of the model: the same "
        "answer, faster for one or a few streams. lookup: guessed from the request's own text (a summary "
        "quoting its document, an edit, a tool call echoing the prompt); draft: by the --draft model. "
        "It drafts only while few requests run (--spec-max-running) and backs off when guesses miss; a "
        "request may say speculative: false. Default: draft with --draft, else lookup.",
        type=click.Choice(["lookup", "draft", "off"]))
    draft: str | None = knob(
        None, "A small model with the same tokenizer that guesses the next tokens for the served model to "
        "check (e.g. SmolLM2-135M for a SmolLM2-1.7B, a 0.5 B Qwen for a larger Qwen): a path or a "
        "name in the store. Its KV cache shares the pool's blocks (--kv-memory covers both).", metavar="MODEL")
    mmproj: str | None = knob(
        None, "A vision model's projector (llama.cpp's mmproj GGUF, as Hugging Face GGUF repositories ship it "
        "beside the model): the model then takes images. Default: the one mmproj*.gguf beside the model "
        "file, if there is exactly one; none: text only.", metavar="FILE")
    spec_tokens: int | None = knob(
        None, "The most tokens one request drafts per step. Default: 8 by lookup, 4 by a draft model (each "
        "of its guesses costs a forward of the draft).", type=_range(1, 32))
    spec_max_running: int = knob(
        4, "Requests draft only while at most this many run (a full batch already reads the weights once "
        "for many tokens).", type=_range(1))
    context_policy: str = knob(
        "full", "Attention of requests that do not choose one (their context_policy field): full (the whole "
        "context) or window (the first --sink tokens and the last --window: KV blocks between are "
        "given back as a sequence grows, and an answer may run past the context).",
        type=click.Choice(["full", "window"]))
    window: int = knob(1024, "The window policy: tokens a query attends before it (itself included), at least "
                       "this many.", type=_range(1))
    sink: int = knob(4, "The window policy: first tokens every query keeps attending (attention sinks).",
                     type=_range(0))
    mdns_refresh: float = knob(5.0, "Seconds between the mDNS record's load refreshes.", hidden=True)
    # -- the model runtime's knobs, from the environment (ENV_KNOBS); --quant-math and --runtime win
    cpu: CpuConfig = field(default_factory=CpuConfig)

    @classmethod
    def read(cls, values: Mapping[str, Any], env: Mapping[str, str] | None = None) -> "ServeSettings":
        """The settings from serve's parsed options (`values`: field name -> value; missing
        ones keep their defaults) and the environment, read once here."""
        cpu = CpuConfig.from_env(os.environ if env is None else env)
        changes = {}
        if values.get("quant_math"):
            changes["quant_math"] = values["quant_math"]
        if values.get("runtime"):
            changes["runtime"] = values["runtime"]
        if changes:
            cpu = dataclasses.replace(cpu, **changes)
        known = {f.name for f in flag_fields()}
        unknown = set(values) - known
        if unknown:
            raise TypeError(f"not settings of serve: {', '.join(sorted(unknown))}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}, cpu=cpu)


# the environment's other variables: where things are, and the clients' own
OTHER_ENV: tuple[EnvKnob, ...] = (
    EnvKnob("EDGEPAGED_CONFIG", "", "the config file of `serve` (`--config`)"),
    EnvKnob("EDGEPAGED_STORE", "see README, Models", "the model store's folder"),
    EnvKnob("EDGEPAGED_WEIGHTS_CACHE", "the store's `weights/`",
            "where large models' laid-out weights are kept between loads; 0: off"),
    EnvKnob("EDGEPAGED_OLLAMA_REGISTRY", "Ollama's public registry", "where Ollama names are pulled from"),
    EnvKnob("EDGEPAGED_MDNS_INTERFACE", "", "the clients' `--mdns-interface`: browse mDNS on this address only"),
    EnvKnob("EDGEPAGED_SERVER_CACHE", "1", "0: clients never try the last server first (`--no-cache`)"),
)


def flag_fields() -> list[dataclasses.Field]:
    """The fields set from the command line and the config file, in their order."""
    return [f for f in dataclasses.fields(ServeSettings) if "flag" in f.metadata]


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata["flag"].name or "--" + f.name.replace("_", "-")


def options(command: Callable) -> Callable:
    """Click options for every flag field, in the fields' order (the help lists them so)."""
    for f in reversed(flag_fields()):
        how: Flag = f.metadata["flag"]
        kw = dict(help=how.help, hidden=how.hidden, multiple=how.multiple)
        if how.is_flag:
            kw["is_flag"] = True
        else:
            kw.update(default=f.default, show_default=how.show_default and f.default is not None)
            if how.type is not None:
                kw["type"] = how.type
        if how.metavar:
            kw["metavar"] = how.metavar
        if how.env:
            kw["envvar"] = how.env
        command = click.option(flag_of(f), f.name, **kw)(command)
    return command


def _shown(value) -> str:
    if value is None or value == ():
        return ""
    if isinstance(value, bool):
        return "off" if not value else "on"
    return str(value)


def table() -> str:
    """Every knob as one Markdown table: the flag, its config file key, its environment
    variable, its default and what it does; then the runtime's knobs read from the
    environment only."""
    rows = ["| flag | config key | environment | default | what |", "|---|---|---|---|---|"]
    for f in flag_fields():
        how: Flag = f.metadata["flag"]
        if how.hidden:
            continue
        env = f"`{how.env}`" if how.env else ""
        if f.name in ("quant_math", "runtime"):
            env = f"`EDGEPAGED_{f.name.upper()}`"
        default = _shown(f.default)
        rows.append(f"| `{flag_of(f)}` | `{f.name}` | {env} | {default and f'`{default}`'} | "
                    f"{how.help.replace('|', '/')} |")
    rows += ["", "The model runtime's knobs, read from the environment when `serve` starts (and by a runner "
             "made without settings):", "", "| environment | default | what |", "|---|---|---|"]
    for k in ENV_KNOBS + OTHER_ENV:
        rows.append(f"| `{k.name}` | {k.default} | {k.what.replace('|', '/')} |")
    return "\n".join(rows) + "\n"
