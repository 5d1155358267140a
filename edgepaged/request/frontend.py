"""The front end: the one transport-neutral place between every door and the engine.

A door (a msgpack connection, the OpenAI, Ollama and Responses APIs) maps its transport's
shape onto the one request schema (`GenerateRequest`, edgepaged/request/schema.py) and hands it
here with the caller:

    front = FrontEnd(engine, FrontEndConfig(token=..., users=...))
    user = await front.authenticate(token, peer)     # AuthFailed, or the user's name (None: no users)
    caller = front.caller(user, client_name, peer)   # fairness identity + prefix-cache identity
    ticket = await front.build(item, caller)         # RequestRejected(code, message), or a Ticket:
    async with answer_events(engine, ticket.req) as events:   # the engine's Request, and the doors' part
        answer = Answer(ticket, thinking=True)       # edgepaged/request/answer.py: the one answer stream

The front end checks who is asking, validates every field against the model (sampling
fields, the vocabulary, the context), renders the chat template, tokenizes in a worker
thread, applies the limits, and picks the request's prefix-cache salt. It knows no
sockets, frames or HTTP: errors are values with a code from the protocol's list
(`RequestRejected`), and each door answers them in its own shape.
"""
from __future__ import annotations

import abc
import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import trio

from ..common.brief import first_line
from ..constrain.grammar import Constraint
from ..engine.request import Embedding
from ..engine.speculate import DraftState
from ..engine.view import EngineView
from ..engine.request import BACKGROUND, INTERACTIVE, PRIORITIES, Request, RequestRejected
from ..model.params import SamplingParams
from .images import ImageError, ImageLimits
from .protocol import GenerateRequest
from . import vision_prompt as vp
from .schema import MAX_SAMPLES

log = logging.getLogger("edgepaged.request.frontend")
MAX_EMBED_INPUTS = 512   # texts in one embeddings request
TOKEN_IDS_REFUSED = ("input[{i}] is a list of token ids; this server embeds text (as Ollama does): token ids are "
                     "one tokenizer's, and clients send another's (LangChain's OpenAIEmbeddings sends OpenAI's "
                     "tiktoken ids unless check_embedding_ctx_length=False): send the text")
from ..common.lanes import PREPARE   # noqa: E402 - rendering and tokenizing: one request at a time


class AuthFailed(Exception):
    """A wrong or missing token."""


class Users(dict):
    """Per-user tokens: token -> name, and the names marked admin (`admins`)."""

    def __init__(self, tokens: dict[str, str] | None = None, admins=()):
        super().__init__(tokens or {})
        self.admins = frozenset(admins)


@dataclass
class FrontEndConfig:
    token: str | None = None             # shared secret; None = open to the network
    users: dict[str, str] | None = None  # per-user tokens (token -> name, a `Users` for admins): own prefix caches
    max_prompt_tokens: int | None = None  # default: the context length - 1
    max_prompt_bytes: int | None = None  # a prompt's text before tokenizing; default: prompt_bytes_default()
    max_tokens: int | None = None        # cap on a request's max_tokens; default: the context length
    max_request_tokens: int | None = 65536   # max_tokens x n of one request (None: no cap)
    max_identity_tokens: int | None = 262144  # what one user/client/address has in flight, max_tokens x n summed
    grammar: "object | None" = None      # model.grammar.GrammarLimits (None: the defaults)
    images: ImageLimits = field(default_factory=ImageLimits)   # a vision model's image bounds (images.py)


@dataclass(frozen=True)
class Caller:
    """Who is asking: `client` is the fairness identity (clients share the engine fairly),
    `identity` whose prefix cache the request uses (the authenticated user, else the client);
    `sees_all`: may see every caller's figures (no per-user tokens, or an admin)."""
    client: str
    identity: str
    sees_all: bool = True
    # where `identity` comes from: "user" (an authenticated user), "client" (a name the client
    # chose: isolates nothing on an open box, anyone may send the same name) or "peer" (its
    # address). The prefix-cache salt hashes it with the identity, so `"user": "<an address>"`
    # never reaches the cache of the client at that address.
    namespace: str = "peer"
    # who counts against per-caller quotas: the authenticated user, else the address (never a
    # name the client chose: a stranger could take a new one per request)
    quota_key: str = ""


@dataclass
class _Failures:
    count: int = 0
    last: float = 0.0
    lock: trio.Lock = field(default_factory=trio.Lock)


class AuthThrottle:
    """Failed authentication slowed per address. After `free` failures each further attempt
    from that address waits `step_s` × (failures − free) seconds (at most `max_delay_s`)
    before its token is checked, and attempts from one address are checked one at a time,
    so guessing in parallel gains nothing; a right token clears the address, and so do
    `forget_s` quiet seconds. The first failure of a burst is logged with the address."""

    def __init__(self, free: int = 3, step_s: float = 0.01, max_delay_s: float = 2.0, forget_s: float = 600.0,
                 burst_gap_s: float = 60.0, max_addresses: int = 4096):
        self.free, self.step_s, self.max_delay_s = free, step_s, max_delay_s
        self.forget_s, self.burst_gap_s, self.max_addresses = forget_s, burst_gap_s, max_addresses
        self.by_address: dict[str, _Failures] = {}

    def state(self, peer: str) -> _Failures:
        s = self.by_address.get(peer)
        now = time.monotonic()
        if s is None or (s.count and now - s.last > self.forget_s and not s.lock.locked()):
            if len(self.by_address) >= self.max_addresses:   # drop what is quiet
                for a in [a for a, f in self.by_address.items() if not f.lock.locked()][: self.max_addresses // 4]:
                    del self.by_address[a]
            s = self.by_address[peer] = _Failures()
        return s

    def delay(self, s: _Failures) -> float:
        return min(self.max_delay_s, self.step_s * max(0, s.count - self.free + 1)) if s.count >= self.free else 0.0

    def failed(self, s: _Failures, peer: str) -> None:
        now = time.monotonic()
        if not s.count or now - s.last > self.burst_gap_s:
            log.warning("failed authentication from %s (a wrong or missing token); further failures from this "
                        "address are slowed down", peer)
        s.count += 1
        s.last = now


def cache_salt(identity: str, shared: bool = False, namespace: str = "peer") -> int:
    """The prefix-cache salt of a request. Each identity (the authenticated user, else the
    client's name) gets a cache of its own, so nobody can learn from time-to-first-token
    whether somebody else sent a prompt; `shared` (the request's explicit opt-in) uses the
    household-wide cache, e.g. for a common system prompt."""
    if shared:
        return 0
    digest = hashlib.blake2b(f"{namespace}\0{identity}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1 or 1


def load_users(path) -> Users:
    """A users file: one `name token` per line, `name token admin` for a user who may see
    every user's figures ('#' comments). Returns token -> name (`Users`, with `.admins`)."""
    users: dict[str, str] = {}
    admins = set()
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (2, 3) or len(parts) == 3 and parts[2] != "admin":
            raise ValueError(f"{path}:{n}: expected 'name token' or 'name token admin'")
        name, token = parts[:2]
        if token in users:
            raise ValueError(f"{path}:{n}: the token of {name!r} is already used by {users[token]!r}")
        users[token] = name
        if len(parts) == 3:
            admins.add(name)
    if not users:
        raise ValueError(f"{path}: no users")
    return Users(users, admins)


def _short(e: Exception) -> str:
    """An exception's first line, cut short, for a client's eyes (never a traceback)."""
    return first_line(str(e), default=type(e).__name__)


def model_display_name(engine) -> str:
    served = engine.runner.served_name    # a name from the store
    if served:
        return served
    name = Path(str(engine.model_name)).name
    return name[:-5] if name.endswith(".gguf") else name


def prompt_bytes_default(context: int) -> int:
    """The default cap on a prompt's text: 16 bytes a token of the context (English runs ~4 a
    token), at least 256 KiB. A prompt is measured before it is tokenized: tokenizing 1 MiB takes
    ~0.5 s of a core."""
    return max(256 << 10, 16 * context)


def text_bytes(value, most: int) -> int:
    """The UTF-8 bytes of the strings in `value` (a prompt, messages with their parts and tool
    calls), walked without recursion; stops counting once past `most`."""
    total, stack = 0, [value]
    while stack and total <= most:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) if v.isascii() else len(v.encode("utf-8", "surrogatepass"))
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total


WINDOW_MAX_TOKENS = 1 << 16  # the window policy's cap on max_tokens when the server sets none
DEFAULT_ANSWER_ROOM = 512   # truncate "auto" keeps this much room for an answer when max_tokens is not given
NUM_KEEP = 4                # truncate "auto": a prompt cut in its middle keeps its first tokens (Ollama's num_keep)


@dataclass(eq=False)
class Ticket:
    """A built generation request: the engine's `Request` (token ids, sampling, blocks; its
    parallel samples in `req.children`) and what the doors need to answer it, which the engine
    never reads."""
    req: Request
    model: str = ""                 # the model that answers (its display name)
    truncated: int = 0              # messages truncate "auto" dropped to fit the context
    calls: list = field(default_factory=lambda: [None])   # per sample: tools.ToolStream of its calls, or None
    thinking: bool = False          # a thinking model's answer: its thinking may come apart (ThinkSplit)
    think_open: bool = False        # the prompt already opened the thinking block
    load_s: float = 0.0             # how long it waited for its model to load (Ollama's load_duration)
    truncated_tokens: int = 0       # truncate "auto": tokens cut from the prompt's middle


class Box(abc.ABC):
    """What every door talks to: the box, serving one model (`FrontEnd`) or several
    (`box.models.MultiFront`). Both say who is asking (`authenticate`, `caller`), what a
    caller may see (`stats`), and take requests (`build`, `build_embeds`, `models`).
    `modelset` is the several models' set (box.models.ModelSet), None on a box of one model."""

    engine: EngineView            # the engine as the doors see it (engine/view.py)
    model: str                    # the default model's name
    tokenizer: Any                # the default model's tokenizer (model/tokenizer.py)
    max_prompt_tokens: int
    max_tokens: int
    embedding_only: bool          # it answers embeddings only
    modelset = None

    @abc.abstractmethod
    async def build(self, item: GenerateRequest, caller: Caller) -> Ticket:
        """Validate, render and tokenize one request into a `Ticket` (RequestRejected if not)."""

    @abc.abstractmethod
    async def build_embeds(self, inputs: list, caller: Caller, truncate: bool = True) -> list:
        """The engine requests that embed `inputs` (RequestRejected if not)."""

    @abc.abstractmethod
    def models(self) -> list[dict]:
        """The models a caller may name, as the doors list them."""

    @abc.abstractmethod
    def warm_grammars(self) -> None:
        """Build what the first format needs before serving (in a worker thread)."""

    def __init__(self, config: FrontEndConfig | None = None, throttle: AuthThrottle | None = None):
        self.config = config or FrontEndConfig()
        self.throttle = throttle or AuthThrottle()

    # -- who is asking --------------------------------------------------------------------------
    @property
    def auth_required(self) -> bool:
        return self.config.token is not None or bool(self.config.users)

    async def authenticate(self, token: str | None, peer: str) -> str | None:
        """Check a token from the address `peer` (constant-time compares against every known
        one; failures slowed per address, `AuthThrottle`). Returns the user's name with
        per-user tokens, None when no users are configured; raises AuthFailed for a wrong or
        missing token where one is required."""
        if not self.auth_required:
            return None
        s = self.throttle.state(peer)
        async with s.lock:
            if delay := self.throttle.delay(s):
                await trio.sleep(delay)
            try:
                user = self._check(token)
            except AuthFailed:
                self.throttle.failed(s, peer)
                raise
            s.count = 0
            return user

    def _check(self, token: str | None) -> str | None:
        cfg = self.config
        given = (token or "").encode("utf-8", "surrogateescape")
        if cfg.users:
            matches = [name for t, name in cfg.users.items() if hmac.compare_digest(given, t.encode())]
            if token and matches:
                return matches[0]
        elif token and hmac.compare_digest(given, cfg.token.encode()):
            return None
        raise AuthFailed("a wrong or missing token")

    def caller(self, user: str | None, client_name: str | None, peer: str) -> Caller:
        """The caller of a connection or HTTP request: `client_name` is what the client calls
        itself (hello's `client`, OpenAI's `user`), `peer` its address."""
        client = client_name or peer
        if user is None:   # a name the client chose, or its address: two namespaces, never one
            return Caller(client, client, sees_all=not self.config.users,
                          namespace="client" if client_name else "peer", quota_key=f"peer:{peer}")
        admins = getattr(self.config.users, "admins", ())
        return Caller(f"{user}/{client_name}" if client_name else user, user, sees_all=user in admins,
                      namespace="user", quota_key=f"user:{user}")

    def stats(self, caller: Caller, full: dict) -> dict:
        """What `caller` may see of the box's stats (`full`, the engine's and the doors'):
        everything without per-user tokens or for an admin; else its own figures and the
        box's load at a coarse grain (nothing that moves with another user's prompt)."""
        if caller.sees_all:
            return full
        return {"model": self.model, "box": full.get("box"), "max_model_len": full.get("max_model_len"),
                "num_requests_running": full["num_requests_running"],
                "num_requests_waiting": full["num_requests_waiting"],
                "kv_cache_usage_perc": round(full["kv_cache_usage_perc"], 1), "scope": "own",
                "own": self.engine.metrics.owner_snapshot(caller.identity)}


class FrontEnd(Box):
    """The box of one model: validates, renders and tokenizes its requests for its engine."""

    def __init__(self, engine, config: FrontEndConfig | None = None, throttle: AuthThrottle | None = None):
        super().__init__(config, throttle)
        self.engine = engine
        cfg = self.config
        self.tokenizer = engine.tokenizer
        ctx = engine.max_model_len
        self.max_prompt_tokens = min(cfg.max_prompt_tokens or ctx - 1, ctx - 1)
        self.max_tokens = min(cfg.max_tokens or ctx, ctx)
        self.max_prompt_bytes = cfg.max_prompt_bytes or prompt_bytes_default(ctx)
        self.model = model_display_name(engine)
        self._grammars = None

    @property
    def grammars(self):
        """The model's constrained-decoding compiler (llguidance), made on first use."""
        if self._grammars is None:
            from ..constrain.grammar import Grammars
            vocab = self.engine.runner.config.vocab_size
            self._grammars = Grammars(self.tokenizer, vocab or self.tokenizer.vocab_size, self.config.grammar)
        return self._grammars


    def warm_grammars(self) -> None:
        """Build the llguidance tokenizer ahead of the first format (call it in a worker thread
        while nobody waits: its constructor holds the GIL ~0.2-0.3 s)."""
        if self.embedding_only:
            return
        try:
            self.grammars.lltok
        except Exception as e:   # no grammars is no reason not to serve; the first format says why
            log.warning("the grammar tokenizer could not be built: %s", e)

    @property
    def embedding_only(self) -> bool:
        """An embedding model (encoder.py): it answers embeddings only."""
        return self.engine.runner.embedding_only

    # -- requests -------------------------------------------------------------------------------
    async def build(self, item: GenerateRequest, caller: Caller) -> Ticket:
        """Validate, render and tokenize one request into an engine Request (in a `Ticket`,
        beside what the doors need to answer it); RequestRejected
        with the protocol's code when something is wrong with it."""
        if self.embedding_only:
            raise RequestRejected("invalid_params", f"{self.model} is an embedding model: it answers /api/embed and "
                                  "/v1/embeddings, not chat or generate")
        if item.priority not in PRIORITIES:
            raise RequestRejected("bad_request", f"priority must be one of {', '.join(PRIORITIES)}")
        try:
            params = SamplingParams(**item.sampling)
            params.check_model(self.tokenizer.vocab_size)
        except (ValueError, TypeError) as e:
            raise RequestRejected("invalid_params", str(e)) from None
        tok = self.tokenizer
        size = text_bytes((item.messages, item.prompt, item.suffix), self.max_prompt_bytes)
        if size > self.max_prompt_bytes:      # measured before anything renders or tokenizes it
            raise RequestRejected("prompt_too_long", f"the prompt has over {self.max_prompt_bytes} bytes of text; this "
                                  f"server takes at most {self.max_prompt_bytes} (serve --max-prompt-bytes)")
        n = item.n
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_SAMPLES:
            raise RequestRejected("invalid_params", f"n must be in 1..{MAX_SAMPLES}, got {n!r}")
        fmt, calls, job, lazy = item.format, None, None, None
        from . import tools as tl
        held = None           # a vision model's images of this prompt (vision_prompt.ImagesHeld)
        if item.messages is not None:
            offered = item.tools if item.tool_choice != "none" else None
            messages = tl.prepare_messages(item.messages, offered, tok.chat_template, tok)
            kwargs = self._template_kwargs(item, offered)
            job = partial(tok.apply_chat_template, messages, **kwargs)
            if vp.has_images(messages):
                held = await self._images(messages, caller.quota_key or None)
                job = partial(vp.render, tok, messages, held, self.engine.runner.vision, **kwargs)
            if offered:     # tool schemas are grammars too: measured before the prompt is even rendered
                await trio.to_thread.run_sync(self._check_tool_limits, offered, limiter=PREPARE)
                syntax = tl.syntax_for(tok.chat_template, tok)
                calls = tl.ToolStream(syntax, tok)
                if item.tool_choice == "auto" and syntax.name == "generic":   # JSON all through: calls or a reply
                    if fmt is not None:
                        raise RequestRejected("invalid_params", "a response format and tools cannot go together "
                                              "on this model (its chat template takes no tools: its answers with "
                                              "tools are JSON already)")
                    fmt = {"type": "lark", "grammar": syntax.auto_grammar(offered)}
                elif item.tool_choice == "auto" and fmt is None:   # a call the model starts is constrained
                    cont = syntax.continuation(offered, item.parallel_tool_calls)
                    if cont is not None:   # compiled now, with the request: never inside the engine loop
                        lazy = (syntax.marker, await self._prepare(None, n, cont, "tools", who=caller.quota_key))
                if item.tool_choice != "auto":     # required / a named function: the call must parse
                    if fmt is not None:
                        raise RequestRejected("invalid_params", "a response format and a required tool call "
                                              "cannot go together")
                    name = None if item.tool_choice == "required" else item.tool_choice
                    try:
                        fmt = {"type": "lark", "grammar": syntax.grammar(offered, item.parallel_tool_calls, name)}
                    except ValueError as e:
                        raise RequestRejected("invalid_params", str(e)) from None
        elif item.suffix is not None:     # fill in the middle: [BOS] PRE prompt SUF suffix MID
            if tok.fim is None:
                raise RequestRejected("invalid_params", f"suffix: {self.model} has no fill-in-the-middle tokens; "
                                      "use a code model that has them (Qwen2.5-Coder, StarCoder, CodeLlama)")
            job = partial(tok.fill_in_the_middle, item.prompt, item.suffix)
        else:
            job = partial(tok.encode, item.prompt)
        dropped = cut = 0
        room = min(item.max_tokens or DEFAULT_ANSWER_ROOM, self.max_tokens)
        # (a small num_ctx: half of it for the answer at most, so a cut prompt keeps its
        # first NUM_KEEP tokens and its last ones, not one token)
        room = min(room, max(1, min(self.engine.max_model_len, item.context_limit or self.engine.max_model_len) // 2))
        limit = max(1, min(self.max_prompt_tokens, self.engine.max_model_len - room,
                           (item.context_limit or self.engine.max_model_len) - room))
        try:
            if item.truncate == "auto" and item.messages is not None and held is None:
                ids, dropped = await trio.to_thread.run_sync(self._fit, item, offered, limit, limiter=PREPARE)
            else:
                ids = await trio.to_thread.run_sync(job, limiter=PREPARE)
        except ImageError as e:
            raise RequestRejected("bad_request", str(e)) from None
        except Exception as e:  # a chat template may refuse a conversation (e.g. roles out of order)
            raise RequestRejected("bad_request", f"cannot render the prompt: {_short(e)}") from None
        if held is not None and len(ids) > limit:
            raise RequestRejected("prompt_too_long", f"the prompt has {len(ids)} tokens with its images; this "
                                  f"server takes at most {limit} here (an image is not cut)")
        if item.truncate == "auto" and len(ids) > limit:
            # still too long (one message, or a prompt): as Ollama's runner, the first NUM_KEEP
            # tokens and the last ones stay, the middle goes (X-Edgepaged-Truncated-Tokens says how many)
            keep = min(NUM_KEEP, limit // 2)
            cut = len(ids) - limit
            ids = ids[:keep] + ids[keep + cut:]
        if len(ids) > self.max_prompt_tokens:
            raise RequestRejected("prompt_too_long", f"the prompt has {len(ids)} tokens; this server takes at most "
                                  f"{self.max_prompt_tokens}")
        context = self.engine.max_model_len
        if item.context_limit is not None and item.context_limit < context:   # the client's smaller context
            context = item.context_limit
            if len(ids) >= context:
                raise RequestRejected("prompt_too_long", f"the prompt has {len(ids)} tokens, the context asked for "
                                      f"(num_ctx) {context}")
        ecfg = self.engine.config
        policy = item.context_policy or ecfg.context_policy
        window = (ecfg.window_sink, ecfg.window_tokens) if policy == "window" else None
        # under the window policy an answer may run past the context (the server's --max-tokens caps it)
        cap = self.max_tokens if window is None else (self.config.max_tokens or WINDOW_MAX_TOKENS)
        max_tokens = item.max_tokens
        if max_tokens is not None and item.context_limit is not None:
            max_tokens = max(1, min(max_tokens, context - len(ids)))
        if max_tokens is None:   # none sent: up to the context, as chat clients expect
            max_tokens = max(1, min(self.max_tokens, context - len(ids)))
        elif not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= cap:
            hint = ' (context_policy "window" may run past the context)' if window is None else ""
            raise RequestRejected("invalid_params", f"max_tokens must be in 1..{cap} on this server, "
                                  f"got {max_tokens}{hint}")
        params.max_tokens = max_tokens
        hold = self._check_cost(caller, max_tokens, n)
        try:
            ticket = await self._finish(item, caller, tok, ids, params, n, fmt, calls, lazy, dropped, window, hold)
            ticket.truncated_tokens = cut
            for r in (ticket.req, *ticket.req.children):
                r.images.held = held          # (released when the last of them is gone)
            return ticket
        except BaseException:
            self.engine.release(hold)       # (refused or cancelled while its format compiled)
            raise

    async def _finish(self, item, caller, tok, ids, params, n, fmt, calls, lazy, dropped, window, hold) -> Ticket:
        """The rest of `build`, after the cost check: the format compiled, the requests made."""
        from . import tools as tl
        matchers, forced = None, None
        salt = cache_salt(caller.identity, item.share_prefix_cache, caller.namespace)
        if fmt is not None:   # compiled off the event loop, on a large stack, within the limits
            prepared = await self._prepare(fmt, n, None, "format", self._first_drafts(
                item, ids, salt, n, calls.syntax if calls is not None and item.stream_calls else None),
                who=caller.quota_key)
            matchers = prepared.matchers
            forced = (len(ids), prepared.forced, prepared.lead, prepared.certain) if prepared.forced else None
        from . import thinking as th
        thinks = item.messages is not None and item.think is not False and th.thinks(tok.chat_template)
        think_open = thinks and tok.decode(ids[-8:], skip_special_tokens=False).rstrip().endswith(th.OPEN)

        def one(k: int, parent=None) -> Request:
            seed = None if params.seed is None else (params.seed + k) % (1 << 63)
            p = params if k == 0 else replace(params, seed=seed)
            return Request(prompt_ids=ids, params=p, priority=item.priority, client=caller.client,
                           salt=salt, owner=caller.identity,
                           drafting=DraftState(allowed=item.speculative, chain=forced),
                           constraint=Constraint(
                               matcher=None if matchers is None else matchers[k],
                               lazy=None if lazy is None else tl.LazyCall(lazy[0], lazy[1].grammar, self.grammars, tok,
                                                                           matcher=lazy[1].matchers[k])),
                           fork_of=parent, engine=self.engine, context_window=window, cost_hold=hold)
        req = one(0)
        req.children = [one(k, req) for k in range(1, n)]
        return Ticket(req, self.model, dropped,
                      [None if calls is None else tl.ToolStream(calls.syntax, tok) for _ in range(n)],
                      thinks, think_open)

    async def _images(self, messages: list[dict], who: str | None = None):
        """The prompt's images read, found or encoded, and held (vision_prompt.py); a model
        without vision refuses them, naming itself. `who`: the caller (its images waiting for
        the encoder at once are bounded: ImageLimits.max_waiting)."""
        runner = self.engine.runner
        if runner.vision is None:
            raise RequestRejected("invalid_params", f"{self.model} does not take images: it is a text-only model "
                                  "(send text only, or ask a vision model: one served with its projector, "
                                  "serve --mmproj FILE)")
        try:
            return await vp.prepare_images(messages, runner, self.config.images,
                                           getattr(self.engine, "encoder_gate", None), who)
        except ImageError as e:
            code = {413: "image_too_large", 415: "unsupported_image", 429: "too_many_requests"}.get(e.status,
                                                                                                  "bad_request")
            raise RequestRejected(code, str(e)) from None

    def _first_drafts(self, item, ids: list[int], salt: int, n: int, syntax=None):
        """With prompt lookup on, how the prompt's last chunk drafts past what the format
        forces first (run by the compiler thread on a fresh matcher: `speculate.chain_drafts`
        over the prompt and this identity's earlier answers); None otherwise. With `syntax`
        (a door that streams a call's name as soon as it is complete), the drafts stop where the
        first call's name is out (`tools.name_cut`): its first byte does not wait for the rows
        of its arguments (the next step drafts those). A warm Home Assistant command on the 1 B
        file: 23 drafts -> 13, its first byte ~0.05 s sooner (bench/RESULTS.md)."""
        spec = self.engine.spec
        if not spec.on or spec.config.mode != "lookup" or n != 1 or item.speculative is False:
            return None
        from ..engine.speculate import chain_drafts
        corpus, k = spec.history.corpus(salt), spec.config.max_k
        if syntax is None:
            return lambda m: chain_drafts(m, ids, k, corpus)
        from .tools import name_cut
        tok = self.tokenizer

        def first_name(m):
            chain, lead, certain = chain_drafts(m, ids, k, corpus)
            j = name_cut(syntax, tok, chain, certain)
            return (chain, lead, certain) if j is None else (chain[:j], min(lead, j), certain[:j])
        return first_name

    async def _prepare(self, spec, n: int, grammar: str | None, what: str, drafts=None, who: str = ""):
        """A format (or a grammar a door built) compiled with n matchers, off the event loop;
        a refusal as the protocol's error (400, or busy: 503). `drafts`: see `_first_drafts`."""
        from ..constrain.grammar import GrammarRefused
        try:
            return await self.grammars.prepare(spec, n, grammar=grammar, drafts=drafts, who=who)
        except GrammarRefused as e:
            raise RequestRejected(e.code, f"{what}: {e}") from None

    def _check_tool_limits(self, tools: list) -> None:
        from ..constrain.grammar import GrammarRefused, check_limits
        for t in tools:
            schema = (t.get("function") or {}).get("parameters") if isinstance(t, dict) else None
            if isinstance(schema, dict):
                try:
                    check_limits({"type": "json_schema", "schema": schema}, self.grammars.limits)
                except GrammarRefused as e:
                    raise RequestRejected("invalid_params", f"tools: {e}") from None

    def _check_cost(self, caller: Caller, max_tokens: int, n: int):
        """What one request may cost: max_tokens x n within --max-request-tokens, and what one
        identity has in flight (every sample's max_tokens) within --max-identity-tokens, checked
        and counted at once: the engine's CostHold, which the request's samples carry (release
        it if the request is not streamed)."""
        cost, cfg = max_tokens * n, self.config
        if cfg.max_request_tokens and cost > cfg.max_request_tokens:
            raise RequestRejected("invalid_params", f"max_tokens x n is {cost}; this server allows at most "
                                  f"{cfg.max_request_tokens} per request (serve --max-request-tokens)")
        held = self.engine.hold_cost(caller.identity, cost, cfg.max_identity_tokens)
        if isinstance(held, int):
            raise RequestRejected("too_many_requests", f"your requests in flight may still generate {held} tokens "
                                  f"and this one {cost}; this server allows {cfg.max_identity_tokens} per user or "
                                  "client at once (serve --max-identity-tokens); wait for an answer to end")
        return held

    async def build_embeds(self, inputs: list, caller: Caller, truncate: bool = True) -> list[Request]:
        """Requests for the embeddings of `inputs` (texts; token id lists are refused), one per input:
        each runs its prompt through the engine like any prompt (its KV blocks only while it
        runs) and answers its final hidden state. An input past the context is cut to it
        (`truncate`, Ollama's default) or refused."""
        if not isinstance(inputs, list) or not 1 <= len(inputs) <= MAX_EMBED_INPUTS:
            raise RequestRejected("invalid_params", f"input must be a text or a list of 1..{MAX_EMBED_INPUTS} texts")
        tok = self.tokenizer
        for i, x in enumerate(inputs):
            if isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
                # token ids are a tokenizer's own, and the clients that send them send another's: LangChain's
                # OpenAIEmbeddings sends OpenAI's (tiktoken) ids, which read as this model's gave a wrong vector
                raise RequestRejected("invalid_params", TOKEN_IDS_REFUSED.format(i=i))
            if not isinstance(x, str):
                raise RequestRejected("invalid_params", f"input[{i}] must be a non-empty text")
            if isinstance(x, str) and not x:
                raise RequestRejected("empty_prompt", f"input[{i}] is empty")

        size = text_bytes(inputs, self.max_prompt_bytes)
        if size > self.max_prompt_bytes:      # measured before anything is tokenized
            raise RequestRejected("prompt_too_long", f"the inputs have over {self.max_prompt_bytes} bytes of text; this "
                                  f"server takes at most {self.max_prompt_bytes} in one request "
                                  "(serve --max-prompt-bytes): send them in parts")

        def encode():
            return [tok.encode(x) for x in inputs]
        try:
            ids = await trio.to_thread.run_sync(encode, limiter=PREPARE)
        except Exception as e:    # text the tokenizer cannot take (lone surrogates, ...)
            raise RequestRejected("bad_request", f"cannot tokenize the input: {_short(e)}") from None
        # an encoder takes its whole context (nothing is generated after it)
        most = min(self.max_prompt_tokens, self.engine.max_model_len - (0 if self.embedding_only else 1))
        total, cap = sum(min(len(x), most) for x in ids), self.config.max_identity_tokens
        if cap and total > cap:    # one request's embedding work is bounded like a user's answers
            raise RequestRejected("invalid_params", f"the inputs have {total} tokens; this server embeds at most "
                                  f"{cap} in one request (serve --max-identity-tokens): send them in parts")
        # a decoder embedding model's pooling (its file's pooling_type): mean needs every position's
        # state from this request's own steps, so it never starts from a cached prefix (a salt of its own)
        pool = "last" if self.embedding_only else self.engine.runner.config.extra.get("pooling", "last")
        out = []
        for i, x in enumerate(ids):
            if len(x) > most:
                if not truncate:
                    raise RequestRejected("prompt_too_long", f"input[{i}] has {len(x)} tokens; this model embeds at "
                                          f"most {most} (truncate: true cuts it)")
                # an encoder's input keeps its closing [SEP], as its tokenizer's truncation does
                x = x[:most - 1] + x[-1:] if self.embedding_only else x[:most]
            # background work: a household embedding its documents never holds up a question's
            # first token (the scheduler's background share and chunk cut apply)
            # (an embedding model's engine serves nothing else: there its requests take whole steps)
            out.append(Request(prompt_ids=x, params=SamplingParams(temperature=0, max_tokens=1), client=caller.client,
                               priority=INTERACTIVE if self.embedding_only else BACKGROUND,
                               salt=cache_salt(caller.identity, False, caller.namespace) if pool == "last" else
                               secrets.randbits(62) | 1, owner=caller.identity,
                               engine=self.engine, embedding=Embedding(pool)))
        return out

    def _template_kwargs(self, item: GenerateRequest, offered) -> dict:
        """What the chat template is given beside the messages: the tools (a template that
        takes them) and the thinking switch (a template that has one)."""
        from . import thinking
        from . import tools as tl
        template = self.tokenizer.chat_template
        kwargs = {"tools": offered} if offered and tl.template_takes_tools(template) else {}
        if item.think and not thinking.thinks(template):
            raise RequestRejected("invalid_params", f"think: {self.model} does not think (its chat template "
                                  "has no thinking block)")
        return {**kwargs, **thinking.template_kwargs(template, item.think)}

    def _fit(self, item: GenerateRequest, offered, limit: int) -> tuple[list[int], int]:
        """truncate "auto": the conversation's ids with its oldest turns dropped (a turn: a user
        message and what answered it) until the prompt is at most `limit` tokens; the system
        messages at its start and the last turn always stay. (ids, messages dropped)."""
        from . import tools as tl
        tok = self.tokenizer
        kwargs = self._template_kwargs(item, offered)
        messages = item.messages
        head = 0
        while head < len(messages) and messages[head]["role"] == "system":
            head += 1
        starts = [i for i in range(head, len(messages)) if messages[i]["role"] == "user"]
        cut = head                           # messages[head:cut] are dropped
        for nxt in [s for s in starts if s > head] + [None]:
            kept = messages[:head] + messages[cut:]
            ids = tok.apply_chat_template(tl.prepare_messages(kept, offered, tok.chat_template, tok), **kwargs)
            if len(ids) <= limit or nxt is None:
                return ids, cut - head
            cut = nxt
        return ids, cut - head

    # -- what the box says about itself ---------------------------------------------------------
    def models(self) -> list[dict]:
        return [{"name": self.model, "context_length": self.engine.max_model_len, "default": True}]
