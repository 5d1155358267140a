"""A request's life inside the engine: its tokens, its state, its timings, its events."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..model.params import SamplingParams
from ..constrain.grammar import Constraint
from ..model.tokenizer import IncrementalDetokenizer
from .disk_cache import DiskState
from .speculate import DraftState

if TYPE_CHECKING:
    import trio

    from .view import EngineView

INTERACTIVE, BACKGROUND = "interactive", "background"
PRIORITIES = (INTERACTIVE, BACKGROUND)

_ids = itertools.count(1)


class RequestRejected(ValueError):
    """A request refused before it runs, with a machine-readable code (the protocol's error
    codes: prompt_too_long, context_exceeded, kv_capacity, invalid_params, ...). Raised by
    the front end and by the scheduler's admission check; every door answers it in its
    transport's error shape."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Status(enum.Enum):
    WAITING = "waiting"        # not admitted yet, or preempted and requeued
    RUNNING = "running"        # holds blocks in the allocator
    FREED = "freed"            # out of the scheduler, its blocks back in the pool


@dataclass
class TokenEvent:
    """New output: the token ids sampled and the text that is now safe to show. `ahead`: the
    tokens the request's format forces right after these (its grammar allows nothing else
    there), not generated yet but certain to come unless the request ends first; a door may
    show what they complete early (a tool call's name: `Answer`)."""
    token_ids: list[int]
    text: str
    logprobs: list | None = None   # per token, when asked: {"logprob", "top": [(id, logprob)]}
    ahead: list[int] | None = None


@dataclass
class EmbeddingEvent:
    """A request for an embedding: its prompt's final hidden state (last-token pooling, after
    the final norm), float32 [hidden]; a DoneEvent follows."""
    embedding: np.ndarray


@dataclass
class Embedding:
    """A request for an embedding (no token sampled), kept on `Request.embedding`: its
    pooling, and for mean pooling the prompt's final states by position as steps compute them."""
    pool: str = "last"                    # "last" (its last token's state) or "mean"
    states: np.ndarray | None = None


@dataclass
class DoneEvent:
    """The last event of a request."""
    finish_reason: str            # stop | length | cancelled | error
    usage: dict[str, int]         # prompt_tokens, completion_tokens, cached_tokens
    timings: dict[str, float]     # queue_s, ttft_s, decode_s, tpot_s, e2e_s
    stop: str | int | None = None  # the stop string or stop token that ended it
    error: dict[str, str] | None = None  # {"code", "message"} when finish_reason == "error"


@dataclass(eq=False)
class CostHold:
    """Tokens an identity's request was allowed at the front end's cost check, held from that
    check (`Engine.hold_cost`) until its samples are streamed (each takes its max_tokens over)
    or it fails (`Engine.release`): what is checked is what is counted, with no await between."""
    owner: str
    left: int
    since: float


@dataclass
class ImageState:
    """A vision model's images in a request's prompt: `held` (request/vision_prompt.ImagesHeld:
    their features kept while the request lives; None: a prompt without images) and, for
    images whose tokens attend both ways, where they lie (`spans`: [(start, end)], the
    scheduler's, found once)."""
    held: object | None = None
    spans: list | None = None
    # Qwen2.5-VL's rotary positions ((t, h, w) of each prompt token, and the offset of the
    # tokens after it: image_table.mrope_positions), the scheduler's, found once
    rope: tuple | None = None


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    priority: str = INTERACTIVE
    client: str = ""
    salt: int = 0
    owner: str = ""                # whose request it is (the front end's cache identity): per-caller stats
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)

    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    # allocator-side progress: how many of prompt_ids + output_ids the allocator knows and
    # how many have KV slots (computed or being computed this step)
    num_known: int = 0
    num_slots: int = 0
    num_cached: int = 0            # prompt tokens found in the prefix cache (first admission)
    num_preemptions: int = 0
    admitted: bool = False         # admitted at least once
    first_scheduled: float | None = None
    first_token: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: dict[str, str] | None = None
    detok: IncrementalDetokenizer | None = None
    # parallel samples (n > 1): the parent's `children` wait, outside the scheduler, until the
    # step that ends the parent's prompt; then each is forked from it (copy-on-write blocks)
    # and samples its first token from the same logits
    children: list[Request] = field(default_factory=list)
    fork_of: Request | None = None     # the parent of a child sample
    send: trio.MemorySendChannel | None = None   # the engine's side of the event channel
    reserve_tokens: int = 0        # contiguous mode: tokens reserved at admission
    cost_hold: CostHold | None = field(default=None, repr=False)   # its tokens held from the front end's check
    # where it runs: the engine of the model the front end picked (what the doors need to
    # answer it, its model's name, tool calls, thinking, is the front end's `Ticket`'s)
    engine: EngineView | None = field(default=None, repr=False)
    # the window policy: (sink, window) tokens kept, the blocks between given back as the
    # sequence grows (it may then generate past the context); None: full attention
    context_window: tuple[int, int] | None = None
    released_upto: int = 0         # blocks before this index were checked for release
    # each feature's own part, typed and kept by its module
    constraint: Constraint = field(default_factory=Constraint)  # a constrained output (constrain/grammar.py)
    embedding: Embedding | None = None      # an embedding request: its pooling (None: a generation)
    drafting: DraftState = field(default_factory=DraftState)    # speculation (speculate.py, draft.py)
    disk_tier: DiskState = field(default_factory=DiskState)     # the prefix cache's disk tier (disk_cache.py)
    images: ImageState = field(default_factory=lambda: ImageState(), repr=False)   # a vision model's images in its prompt

    @property
    def embed(self) -> bool:
        """An embedding: the prompt's final hidden state is the answer, no token sampled."""
        return self.embedding is not None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_total(self) -> int:
        """Prompt plus the most tokens it may generate."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def is_running(self) -> bool:
        """Admitted and holding blocks (not waiting, not preempted, not ended)."""
        return self.status is Status.RUNNING

    @property
    def is_decoding(self) -> bool:
        """All known tokens but the last sampled one have KV: one token to compute."""
        return bool(self.output_ids) and self.num_slots == self.num_tokens - 1

    @property
    def finished(self) -> bool:
        """Ended for its client (stop, length, cancel, error). Its blocks may still be in use
        by the model step that is running; the engine frees them after that step."""
        return self.finish_reason is not None

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": len(self.output_ids),
                "cached_tokens": self.num_cached}

    def timings(self) -> dict[str, float]:
        end = self.finished_at or time.monotonic()
        start = self.first_scheduled or end
        first = self.first_token or end
        n = len(self.output_ids)
        return {
            "queue_s": round(start - self.arrival, 6),
            "ttft_s": round(first - self.arrival, 6),
            "decode_s": round(end - first, 6),
            "tpot_s": round((end - first) / (n - 1), 6) if n > 1 else 0.0,
            "e2e_s": round(end - self.arrival, 6),
        }
