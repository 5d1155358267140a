"""The front end: the one transport-neutral place between every door and the engine.

A door (a msgpack connection, the OpenAI API, later the Ollama API) parses its transport's
shape into a `GenerateRequest` (edgepaged/protocol.py) and hands it here with the caller:

    front = FrontEnd(engine, FrontEndConfig(token=..., users=...))
    user = front.authenticate(token)                 # AuthFailed, or the user's name (None: no users)
    caller = front.caller(user, client_name, peer)   # fairness identity + prefix-cache identity
    req = await front.build(item, caller)            # RequestRejected(code, message), or an engine Request
    async with engine.stream(req) as events: ...

The front end checks who is asking, validates every field against the model (sampling
fields, the vocabulary, the context), renders the chat template, tokenizes in a worker
thread, applies the limits, and picks the request's prefix-cache salt. It knows no
sockets, frames or HTTP: errors are values with a code from the protocol's list
(`RequestRejected`), and each door answers them in its own shape.
"""
from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio

from .engine.request import PRIORITIES, Request, RequestRejected
from .model.params import SamplingParams
from .protocol import GenerateRequest


class AuthFailed(Exception):
    """A wrong or missing token."""


@dataclass
class FrontEndConfig:
    token: str | None = None             # shared secret; None = open to the network
    users: dict[str, str] | None = None  # per-user tokens (token -> name): each user's own prefix cache
    max_prompt_tokens: int | None = None  # default: the context length - 1
    max_tokens: int | None = None        # cap on a request's max_tokens; default: the context length


@dataclass(frozen=True)
class Caller:
    """Who is asking: `client` is the fairness identity (clients share the engine fairly),
    `identity` whose prefix cache the request uses (the authenticated user, else the client)."""
    client: str
    identity: str


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


class FrontEnd:
    def __init__(self, engine, config: FrontEndConfig | None = None):
        self.engine = engine
        self.config = cfg = config or FrontEndConfig()
        self.tokenizer = engine.tokenizer
        ctx = engine.max_model_len
        self.max_prompt_tokens = min(cfg.max_prompt_tokens or ctx - 1, ctx - 1)
        self.max_tokens = min(cfg.max_tokens or ctx, ctx)
        self.model = model_display_name(engine)

    # -- who is asking --------------------------------------------------------------------------
    @property
    def auth_required(self) -> bool:
        return self.config.token is not None or bool(self.config.users)

    def authenticate(self, token: str | None) -> str | None:
        """Check a token (constant-time compares against every known one). Returns the
        user's name with per-user tokens, None when no users are configured; raises
        AuthFailed for a wrong or missing token where one is required."""
        cfg = self.config
        if not self.auth_required:
            return None
        given = (token or "").encode("utf-8", "surrogateescape")
        if cfg.users:
            matches = [name for t, name in cfg.users.items() if hmac.compare_digest(given, t.encode())]
            if token and matches:
                return matches[0]
        elif token and hmac.compare_digest(given, cfg.token.encode()):
            return None
        raise AuthFailed("a wrong or missing token")

    @staticmethod
    def caller(user: str | None, client_name: str | None, peer: str) -> Caller:
        """The caller of a connection or HTTP request: `client_name` is what the client calls
        itself (hello's `client`, OpenAI's `user`), `peer` its address."""
        client = client_name or peer
        if user is None:
            return Caller(client, client)
        return Caller(f"{user}/{client_name}" if client_name else user, user)

    # -- requests -------------------------------------------------------------------------------
    async def build(self, item: GenerateRequest, caller: Caller) -> Request:
        """Validate, render and tokenize one request into an engine Request; RequestRejected
        with the protocol's code when something is wrong with it."""
        if item.priority not in PRIORITIES:
            raise RequestRejected("bad_request", f"priority must be one of {', '.join(PRIORITIES)}")
        try:
            params = SamplingParams(**item.sampling)
            params.check_model(self.tokenizer.vocab_size)
        except (ValueError, TypeError) as e:
            raise RequestRejected("invalid_params", str(e)) from None
        tok = self.tokenizer
        job = partial(tok.apply_chat_template, item.messages) if item.messages is not None else \
            partial(tok.encode, item.prompt)
        try:
            ids = await trio.to_thread.run_sync(job)
        except Exception as e:  # a chat template may refuse a conversation (e.g. roles out of order)
            raise RequestRejected("bad_request", f"cannot render the prompt: {e}") from None
        if len(ids) > self.max_prompt_tokens:
            raise RequestRejected("prompt_too_long", f"the prompt has {len(ids)} tokens; this server takes at most "
                                  f"{self.max_prompt_tokens}")
        max_tokens = item.max_tokens
        if max_tokens is None:   # none sent: up to the context, as chat clients expect
            max_tokens = max(1, min(self.max_tokens, self.engine.max_model_len - len(ids)))
        elif not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= self.max_tokens:
            raise RequestRejected("invalid_params", f"max_tokens must be in 1..{self.max_tokens} on this server, "
                                  f"got {max_tokens}")
        params.max_tokens = max_tokens
        return Request(prompt_ids=ids, params=params, priority=item.priority, client=caller.client,
                       salt=cache_salt(caller.identity, item.share_prefix_cache))

    # -- what the box says about itself ---------------------------------------------------------
    def models(self) -> list[dict]:
        return [{"name": self.model, "context_length": self.engine.max_model_len, "default": True}]
