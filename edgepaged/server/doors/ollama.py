"""The Ollama API, as plain data: request bodies in, response bodies out (httpd.py serves them).

`/api/chat` and `/api/generate` bodies become the protocol's `GenerateRequest`, built by the
front end as every other door's (same auth, limits, fairness); engine events become Ollama's
objects, streamed as NDJSON (one JSON object per line) unless `"stream": false`. Errors are
Ollama's shape, `{"error": "..."}`. `options` map onto the sampling parameters
(`num_predict` -> max_tokens, `repeat_penalty` -> repetition_penalty, `num_ctx` limits the
prompt and answer, ...); runtime options (threads, GPU layers, mmap, batch) are ignored, as
they are the server's to choose; sampling options this server cannot honour (mirostat,
typical_p) are refused naming them.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timezone

from ...request import jsontext, schema
from ...request.protocol import MAX_MESSAGES, GenerateRequest
from ...request.schema import FieldError
from ...request.thinking import thinks
from ...request.messages import Image, Message, from_map, template_maps
from .base import ApiError, Generation

ROLES = ("system", "user", "assistant", "tool")
# options that are the server's business (threads, GPU layers, memory mapping, batch size):
# accepted and ignored, as a shared box sets them once for everyone
RUNTIME_OPTIONS = {"num_thread", "num_gpu", "main_gpu", "use_mmap", "use_mlock", "num_batch", "low_vram", "f16_kv",
                   "vocab_only", "numa", "num_keep", "repeat_last_n", "penalize_newline", "tfs_z"}
# sampling options without an equivalent here: accepted and ignored, with a warning header
# (clients copy whole option sets from Ollama's docs; a refusal broke them)
UNSUPPORTED = {"mirostat": (0,), "mirostat_eta": (), "mirostat_tau": (), "typical_p": (1, 1.0)}
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty"}


class OllamaError(ApiError):
    """An error in Ollama's shape: {"error": message}."""

    def body(self) -> dict:
        return {"error": self.message}

    @classmethod
    def of(cls, e: ApiError) -> "OllamaError":
        return cls(e.status, e.message, e.code, e.param)


def bad(message: str) -> OllamaError:
    return OllamaError(400, message, "bad_request")


@dataclass
class OllamaGeneration(Generation):
    model: str = ""
    item_id: str = ""     # the request's id (its item is built once the door's fields are read)


def _integral(value):
    """Ollama's clients send integers as JSON numbers (40.0): as ints; anything else as it is,
    for the schema to judge."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _options(body: dict, f: dict, gen: OllamaGeneration) -> dict:
    """`options` onto the schema's names in `f`; -> schema name -> the option's name."""
    opts = body.get("options")
    if opts is None:
        return {}
    if not isinstance(opts, dict):
        raise bad("options must be an object")
    names = {}
    for name, value in opts.items():
        if value is None or name in RUNTIME_OPTIONS or name == "speculative":
            continue
        if name in UNSUPPORTED:
            if value not in UNSUPPORTED[name]:
                gen.warnings.append(f"option {name} is not supported by this server: ignored")
            continue
        ours = SAMPLING.get(name) or {"num_predict": "max_tokens", "num_ctx": "context_limit", "stop": "stop"}.get(name)
        if ours is None:
            continue            # other names: ignored, as Ollama ignores options it does not know
        value = _integral(value) if name in ("top_k", "seed", "num_predict", "num_ctx") else value
        if name == "num_predict" and isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
            value = None        # -1, -2: up to the context
        elif name == "stop":
            value = value or None
        f[ours] = value
        names[ours] = f"option {name}"
    return names


def _format(body: dict):
    fmt = body.get("format")
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "schema": fmt}
    raise bad('format must be "json" or a JSON schema (an object)')


def _request(body: dict, gen: OllamaGeneration, kind: str, fields: dict | None = None, **text) -> GenerateRequest:
    """The body's generation fields onto the schema's names, checked by its rules; the
    door's own (model required, stream) here."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required")
    gen.model = model
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean")
    gen.stream = stream
    f = {"model": model, "truncate": body.get("truncate"), "context_policy": body.get("context_policy"),
         "keep_alive": body.get("keep_alive"), "format": _format(body), **(fields or {})}
    opts = body.get("options")
    f["speculative"] = body.get("speculative", opts.get("speculative") if isinstance(opts, dict) else None)
    think = body.get("think")
    if think is not None:    # Ollama's levels are for models that take them; here they mean "think"
        if not isinstance(think, bool) and think not in ("low", "medium", "high"):
            raise bad('think must be true, false or "low", "medium", "high"')
        f["think"] = think is not False
    names = _options(body, f, gen)
    try:
        return schema.parse(f, gen.item_id, kind, **text)
    except FieldError as e:
        message = e.message
        if e.field in names:     # name the option as the client sent it
            message = message.replace(e.field, names[e.field], 1)
        raise OllamaError(400, message, e.code, e.field) from None


def _text(i: int, m: dict) -> str:
    content = m.get("content", "")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise bad(f"messages[{i}].content must be a string")
    return content


def parse_chat(body: dict, rid: str) -> OllamaGeneration:
    messages = body.get("messages")
    if messages is None:
        messages = []
    if not isinstance(messages, list) or len(messages) > MAX_MESSAGES:
        raise bad(f"messages must be a list of at most {MAX_MESSAGES} messages")
    msgs = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}")
        images = m.get("images") or []
        if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
            raise bad(f"messages[{i}].images must be a list of base64 strings")
        try:
            msgs.append(from_map(m, i, _text(i, m), tuple(Image(b64=x) for x in images)))
        except ValueError as e:
            raise bad(str(e)) from None
    out = template_maps(msgs)
    gen = OllamaGeneration(None, chat=True, item_id=rid)
    # Ollama's way: a conversation past num_ctx loses its oldest turns (the system message
    # stays), and X-Edgepaged-Truncated-Messages says how many; Ollama has no tool_choice:
    # the model decides
    tools = body.get("tools") or None
    gen.item = _request(body, gen, "chat", {"truncate": "auto" if body.get("truncate") is None else body["truncate"],
                                            "tools": tools, "tool_choice": "auto" if tools else None}, messages=out)
    return gen


def parse_generate(body: dict, rid: str, template: str | None = None) -> OllamaGeneration:
    """`raw`: the prompt as it is; else the model's chat template around `system` and the prompt."""
    prompt = body.get("prompt", "")
    if prompt is None:
        prompt = ""
    if not isinstance(prompt, str):
        raise bad("prompt must be a string")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise bad("system must be a string")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise bad("suffix must be a string")
    if body.get("template"):
        raise bad("template is not supported: the model's own chat template is used (or send raw: true)")
    if body.get("context"):
        raise bad("context (the token list of an earlier answer) is not supported: send the conversation to "
                  "/api/chat instead")
    images = body.get("images") or []
    if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
        raise bad("images must be a list of base64 strings")
    gen = OllamaGeneration(None, chat=False, item_id=rid)
    turn = [Message("system", system, where="system")] if system else []
    turn.append(Message("user", prompt, tuple(Image(b64=x) for x in images), where="prompt"))
    if images and (suffix or body.get("raw")):
        raise bad("images go into the model's chat template: not with raw: true or a suffix")
    messages = template_maps(turn)
    # as Ollama: a prompt past num_ctx loses its middle (the first tokens and the last stay)
    cut = {"truncate": "auto" if body.get("truncate") is None else body["truncate"]}
    if suffix:      # fill in the middle (Continue's autocomplete): the model's FIM tokens around the two
        gen.item = _request(body, gen, "generate", cut, prompt=prompt, suffix=suffix)
    elif body.get("raw"):
        gen.item = _request(body, gen, "generate", cut, prompt=prompt)
    else:
        gen.item = _request(body, gen, "chat", cut, messages=messages)
    return gen


# ---------------------------------------------------------------- responses

def now_iso() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _ns(seconds: float) -> int:
    return int(max(0.0, seconds) * 1e9)


class OllamaShaper:
    """One request's Ollama objects; streamed as NDJSON."""

    media_type = "application/x-ndjson"
    trailer = b""
    splits_thinking = True      # a thinking model's answer: its thinking in `thinking`, as Ollama gives it
    shapes_logprobs = False

    def __init__(self, gen: OllamaGeneration, model: str, ticket=None):
        self.gen, self.model = gen, model
        self.load_s = ticket.load_s if ticket is not None else 0.0   # its wait for the model's load
        self._calls: dict = {}      # calls being written: index -> [name, arguments so far]
        self.sent_calls = 0         # calls that went out whole already

    @staticmethod
    def frame(obj: dict) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"

    def _obj(self, text: str, done: bool, thinking: str = "") -> dict:
        out = {"model": self.gen.model, "created_at": now_iso()}
        if self.gen.chat:
            out["message"] = {"role": "assistant", "content": text}
            if thinking:
                out["message"]["thinking"] = thinking
        else:
            out["response"] = text
            if thinking:
                out["thinking"] = thinking
        out["done"] = done
        return out

    def _final(self, text: str, done, thinking: str = "") -> dict:
        out = self._obj(text, True, thinking)
        t, u = done.timings, done.usage
        out.update(done_reason=done.finish_reason if done.finish_reason in ("stop", "length") else "stop",
                   total_duration=_ns(t["e2e_s"] + self.load_s), load_duration=_ns(self.load_s),
                   prompt_eval_count=u["prompt_tokens"], prompt_eval_duration=_ns(t["ttft_s"] - t["queue_s"]),
                   eval_count=u["completion_tokens"], eval_duration=_ns(t["decode_s"]))
        return out

    def full(self, text: str, done, calls=None, logprobs=None, thinking: str = "") -> dict:
        out = self._final(text, done, thinking)
        if calls:
            out["message"]["tool_calls"] = ollama_calls(calls)
        return out

    def first_chunk(self):
        return None

    def text_chunk(self, text: str, thinking: str = "", logprobs=None) -> dict | None:
        """A piece of the answer (None: nothing to give out)."""
        return self._obj(text, False, thinking) if thinking or text else None

    streams_calls = True      # each tool call goes out as soon as it is complete (call_chunk)

    def call_chunk(self, k: int, part: dict) -> dict | None:
        """Ollama's streams carry whole calls: one chunk as soon as a call's arguments close."""
        if "name" in part:
            self._calls[k] = [part["name"], ""]
            return None
        if "arguments" in part:
            self._calls[k][1] += part["arguments"]
            return None
        name, args = self._calls[k]
        try:
            value = jsontext.loads(args)
        except ValueError:
            return None
        self.sent_calls = max(self.sent_calls, k + 1)
        chunk = self._obj("", False)
        chunk["message"]["tool_calls"] = [{"function": {"name": name, "arguments": value}}]
        return chunk

    def last_chunks(self, done, calls=None) -> list[dict]:
        out = []
        rest = (calls or [])[self.sent_calls:]
        if rest:
            chunk = self._obj("", False)
            chunk["message"]["tool_calls"] = ollama_calls(rest)
            out.append(chunk)
        return out + [self._final("", done)]

    @staticmethod
    def error_chunk(err: ApiError) -> dict:
        return {"error": err.message}

    @staticmethod
    def error_body(err: ApiError) -> dict:
        return {"error": err.message}


def ollama_calls(calls: list[dict]) -> list[dict]:
    """Ollama's tool calls: arguments as an object."""
    return [{"function": {"name": c["name"], "arguments": jsontext.loads(c["arguments"])}} for c in calls]


# ---------------------------------------------------------------- model lists

def _size_label(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def model_entry(name: str, runner, running: bool = False, context: int | None = None) -> dict:
    info = runner.file_info or {"format": "gguf", "size": 0, "modified": 0.0,
                                                  "quantization": "unknown"}
    cfg = runner.config
    digest = hashlib.sha256(f"{name}:{info['size']}:{info['modified']}".encode()).hexdigest()
    entry = {"name": name, "model": name,
             "modified_at": datetime.fromtimestamp(info["modified"], timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
             "size": info["size"], "digest": digest,
             "details": {"parent_model": "", "format": info["format"], "family": cfg.arch, "families": [cfg.arch],
                         "parameter_size": _size_label(cfg.num_params), "quantization_level": info["quantization"]}}
    if running:    # always loaded (keep_alive -1 in Ollama's terms): it never expires
        entry.update(expires_at=NEVER, size_vram=0, context_length=context)
    return entry


def listed_entry(m: dict, running: bool = False) -> dict:
    """An Ollama list entry for a model of the set that may not be loaded (ModelSet.listing)."""
    name = m["name"] if ":" in m["name"] else f"{m['name']}:latest"
    digest = hashlib.sha256(f"{name}:{m['size_bytes']}".encode()).hexdigest()
    modified = datetime.fromtimestamp(m.get("modified") or 0.0, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    params = m.get("parameters")
    entry = {"name": name, "model": name, "modified_at": modified, "size": m["size_bytes"],
             "digest": digest, "details": {"parent_model": "", "format": "gguf", "family": m["architecture"] or "",
                                           "families": [m["architecture"] or ""],
                                           "parameter_size": _size_label(params) if params else "",
                                           "quantization_level": m["quantization"] or ""}}
    if running:
        expires = m.get("expires_in_s")
        entry.update(expires_at=NEVER if expires is None else datetime.fromtimestamp(
            datetime.now(timezone.utc).timestamp() + expires, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            size_vram=0, context_length=m["context_length"])
    return entry


def _parameter_lines(params: dict | None) -> str:
    """Ollama's show `parameters`: one `name value` line each (a list: one line per value)."""
    lines = []
    for k, v in (params or {}).items():
        for one in v if isinstance(v, list) else [v]:
            lines.append(f"{k:<30} {json.dumps(one) if isinstance(one, str) else one}")
    return "\n".join(lines)


def show(name: str, runner, context: int, spec=None) -> dict:
    """`spec`: the models.ModelSpec of a several-model box (its system prompt and parameters)."""
    cfg = runner.config
    entry = model_entry(name, runner)
    template = runner.tokenizer.chat_template or ""
    # an embedding model embeds only (as Ollama says of one); tools on every other model (a template
    # without them: the generic syntax); thinking where the template has it
    caps = ["embedding"] if runner.embedding_only else \
        ["completion", "tools"] + (["thinking"] if thinks(template) else []) + \
        (["vision"] if runner.vision is not None else [])
    system, params = getattr(spec, "system", None), getattr(spec, "parameters", None)
    modelfile = f"# served by edgepaged\nFROM {name}\n" + (f'SYSTEM """{system}"""\n' if system else "") + \
        "".join(f"PARAMETER {line}\n" for line in _parameter_lines(params).splitlines())
    out = {"modelfile": modelfile, "parameters": _parameter_lines(params), "template": template,
            "details": entry["details"], "modified_at": entry["modified_at"], "capabilities": caps,
            "model_info": {"general.architecture": cfg.arch, "general.parameter_count": cfg.num_params,
                           f"{cfg.arch}.context_length": context, f"{cfg.arch}.embedding_length": cfg.hidden_size,
                           f"{cfg.arch}.block_count": cfg.num_layers,
                           f"{cfg.arch}.attention.head_count": cfg.num_heads,
                           f"{cfg.arch}.attention.head_count_kv": cfg.num_kv_heads,
                           "tokenizer.ggml.vocab_size": cfg.vocab_size}}
    if system:
        out["system"] = system
    return out


def names_of(model: str) -> set[str]:
    """The names a client may use for the served model: its name and name:latest."""
    return {model, f"{model}:latest"}


def model_field(body: dict, *keys: str) -> str:
    """The model an Ollama call names (the first of `keys` present; "" for none); a 400 for
    anything but a string."""
    for key in keys or ("model",):
        value = body.get(key)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise OllamaError(400, f"{key} must be a string (a model's name)", "bad_request")
        return value
    return ""


def check_model(asked: str, model: str) -> None:
    if asked not in names_of(model):
        raise OllamaError(404, f"model '{asked}' not found; this server has '{model}:latest'", "model_not_found")


OLLAMA_VERSION = "0.12.0"   # the Ollama API this door speaks: clients check for a version this recent
NEVER = "2318-01-01T00:00:00Z"   # expires_at of a model that stays loaded (Ollama's keep_alive -1)


def version() -> dict:
    """Ollama's version answer (clients compare it with the version a feature needs: tools,
    thinking, structured output), and edgepaged's own beside it."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version
    try:
        own = dist_version("edgepaged")
    except PackageNotFoundError:
        own = "0.0.0"
    return {"version": OLLAMA_VERSION, "edgepaged": own}
