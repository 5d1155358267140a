"""One answer stream for every door: a request's engine events become transport-neutral
items, and each door only encodes them (msgpack frames, SSE chunks, NDJSON lines, the
Responses API's events, or one JSON body).

    async with answer_events(engine, ticket.req) as events:    # (sample index, event) pairs
        answer = Answer(ticket, thinking=True, stream_calls=False)
        async for k, ev in events:
            for item in answer.feed(k, ev):                 # Piece | Call | End
                ...

- `Piece(index, text, thinking, token_ids, logprobs)`: a piece of sample `index`'s answer.
  With tools offered, text that may be a tool call is held back (`tools.ToolStream`); with
  `thinking`, a thinking model's `<think>…</think>` comes apart in `thinking`. Every engine
  token event gives one piece (its text may be empty while something is held); the end gives
  one more with what was held, when anything was.
- `Call(index, k, part)`: tool call k being written (`stream_calls`: the doors that stream
  a call's arguments as they come).
- `End(index, done, calls)`: the sample's end: the engine's `DoneEvent` and the tool calls
  its answer made (parsed; `finish_reason` says "tool_calls" then). `done.error` is set
  when it failed.

Samples (n > 1) interleave; each ends with an End of its own.
"""
from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

import trio

from ..engine.request import DoneEvent, TokenEvent
from .thinking import ThinkSplit


@dataclass
class Piece:
    index: int
    text: str = ""
    thinking: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: list | None = None      # the engine's per-token entries (when asked)


@dataclass
class Call:
    index: int
    k: int
    part: dict


@dataclass
class End:
    index: int
    done: DoneEvent
    calls: list = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        """The engine's, or "tool_calls" when the answer ended in calls."""
        if self.calls and self.done.finish_reason in ("stop", "length"):
            return "tool_calls"
        return self.done.finish_reason


class Answer:
    """The answer of one request (the front end's `Ticket`) and its parallel samples, item
    by item."""

    def __init__(self, ticket, *, thinking: bool, stream_calls: bool = False):
        self.calls = ticket.calls                # per sample
        self.n = len(self.calls)
        self.splits = [ThinkSplit.of(ticket) if thinking else None for _ in range(self.n)]
        self.stream_calls = stream_calls
        self.req = ticket.req
        self.cut = False          # (one sample) its calls repeated one: the rest was not generated

    def feed(self, k: int, ev: TokenEvent | DoneEvent) -> list:
        calls, split = self.calls[k], self.splits[k]
        if isinstance(ev, TokenEvent):
            text = calls.push(ev.token_ids, ev.text) if calls is not None else ev.text
            thinking = ""
            if split is not None:
                thinking, text = split.feed(text)
            out = [Piece(k, text, thinking, ev.token_ids, ev.logprobs)]
            if calls is not None:
                parts = calls.deltas()       # (unstreamed too: what ends the list is seen as it comes)
                if self.stream_calls:
                    out += [Call(k, i, part) for i, part in parts]
                    if ev.ahead:       # a call's name the format already forces to its end: now
                        out += [Call(k, i, part) for i, part in calls.name_ahead(ev.ahead)]
                if calls.repeated and self.n == 1 and not self.cut and self.req is not None \
                        and self.req.engine is not None:
                    self.cut = True   # an exact repeat ended the list: the model need not write on
                    self.req.engine.cancel(self.req)
            return out
        if self.cut and ev.finish_reason == "cancelled":   # (cut above: the answer ended with its calls)
            ev = replace(ev, finish_reason="stop")
        found, rest, thinking = [], "", ""
        if calls is not None:
            rest, found = calls.finish()
            if ev.error:          # a failed answer's calls are not given as made
                found = []
        if split is not None:
            thinking, rest = split.feed(rest)
            more, tail = split.flush()
            thinking, rest = thinking + more, rest + tail
        out = [Piece(k, rest, thinking)] if rest or thinking else []
        out.append(End(k, ev, found))
        return out


@asynccontextmanager
async def answer_events(engine, req):
    """The engine's events of `req` as a channel of (sample index, event) pairs, one request
    or n samples alike (`receive`, `receive_nowait`, `async for`)."""
    if req.children:
        async with engine.stream_samples(req) as events:
            yield events
        return
    async with engine.stream(req) as events:
        yield _Indexed(events)


class _Indexed:
    """One request's event channel as (0, event) pairs."""

    def __init__(self, channel):
        self.channel = channel

    async def receive(self):
        return 0, await self.channel.receive()

    def receive_nowait(self):
        return 0, self.channel.receive_nowait()

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
