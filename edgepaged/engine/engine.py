"""The Trio engine: one loop task doing continuous batching over the scheduler and the model.

    async with Engine(runner, EngineConfig()) as engine:
        req = engine.make_request(messages=[{"role": "user", "content": "Hi"}],
                                  params=SamplingParams(temperature=0, max_tokens=32))
        async with engine.stream(req) as events:
            async for event in events:      # TokenEvent ..., then one DoneEvent
                ...

The loop is the only place that touches Trio and the model at once; each step's forward
runs in a worker thread so the event loop keeps serving. Leaving `stream()` early (cancel,
disconnect, a cancelled scope) aborts the request: it leaves the batch and its blocks return
to the pool at once.
"""
from __future__ import annotations

import logging
import math
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import numpy as np
import trio

from .._rust_alloc import BlockAllocator
from ..model.sampler import SamplingParams, sample
from ..model.tokenizer import IncrementalDetokenizer
from .metrics import Metrics
from .request import INTERACTIVE, PRIORITIES, DoneEvent, Request, Status, TokenEvent
from .scheduler import Batch, RequestRejected, Scheduler, SchedulerConfig

log = logging.getLogger("edgepaged.engine")


@dataclass
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None        # default: the model's context, capped by the pool
    contiguous: bool = False                 # reserve prompt + max_tokens up front (the naive scheme)
    enable_prefix_caching: bool = True
    watermark_frac: float = 0.01
    background_share: float = 0.5            # most of max_num_seqs background work may hold
    long_prefill_tokens: int | None = None   # first cut of a prefill chunk (None: budget / 4; 0: off)
    default_max_tokens: int | None = None    # when a request sends none: up to the context
    trim_memory_when_idle: bool = True       # malloc_trim when the last request ends (glibc)


def release_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; a no-op
    elsewhere). Model steps free megabytes of activations that glibc otherwise keeps."""
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes
        import ctypes.util
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


class EngineClosed(RuntimeError):
    """The engine no longer takes requests (it is draining or stopped)."""


class Engine:
    def __init__(self, runner, config: EngineConfig | None = None):
        self.runner = runner
        self.config = cfg = config or EngineConfig()
        self.tokenizer = runner.tokenizer
        self.block_size = runner.block_size
        self.allocator = BlockAllocator(runner.num_blocks, runner.block_size,
                                        enable_prefix_caching=cfg.enable_prefix_caching, contiguous=cfg.contiguous)
        # a request must fit the pool with the watermark kept back
        usable = runner.num_blocks - (0 if cfg.contiguous else max(1, int(cfg.watermark_frac * runner.num_blocks)))
        self.max_model_len = min(cfg.max_model_len or runner.max_model_len, runner.max_model_len,
                                 usable * runner.block_size)
        self.scheduler = Scheduler(self.allocator, SchedulerConfig(
            max_model_len=self.max_model_len, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, watermark_frac=cfg.watermark_frac,
            contiguous=cfg.contiguous, background_share=cfg.background_share,
            long_prefill_tokens=cfg.long_prefill_tokens))
        path = getattr(runner, "model_path", None)
        self.model_name = getattr(runner, "model_name", None) or (path.stem if hasattr(path, "stem") else "model")
        self.metrics = Metrics(self.model_name)
        self.requests: dict[int, Request] = {}
        self.accepting = False
        self.step_hook: Callable[[Batch], None] | None = None   # called in the worker before each forward (tests)
        self._wake = trio.Event()
        self._stack: AsyncExitStack | None = None
        self._idle = trio.Event()
        self._idle.set()
        self._steps_since_trim = 0

    # -- lifecycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> "Engine":
        self._stack = AsyncExitStack()
        nursery = await self._stack.enter_async_context(trio.open_nursery())
        self._stack.callback(nursery.cancel_scope.cancel)
        nursery.start_soon(self._loop)
        self.accepting = True
        return self

    async def __aexit__(self, *exc) -> None:
        self.accepting = False
        for req in list(self.requests.values()):
            self._end(req, "cancelled", error={"code": "shutdown", "message": "the server is shutting down"})
        await self._stack.__aexit__(*exc)

    async def drain(self, grace_s: float) -> int:
        """Stop taking requests, let running ones finish within `grace_s`, then cancel the
        rest with a clear reason. Returns how many were cancelled."""
        self.accepting = False
        with trio.move_on_after(grace_s):
            await self._idle.wait()
        left = [r for r in self.requests.values() if not r.finished]
        for req in left:
            self._end(req, "cancelled", error={"code": "shutdown",
                                               "message": "the server is shutting down; request cancelled"})
        return len(left)

    # -- requests -----------------------------------------------------------------------------
    def make_request(self, *, messages: list[dict] | None = None, prompt: str | None = None,
                     prompt_ids: list[int] | None = None, params: SamplingParams | None = None,
                     max_tokens: int | None = None, priority: str = INTERACTIVE, client: str = "",
                     salt: int = 0) -> Request:
        """Build and validate a request (raises RequestRejected or ValueError with a clear
        message). Exactly one of messages (chat template), prompt (raw text), prompt_ids.
        `max_tokens` replaces params.max_tokens; None means up to the context length."""
        if sum(x is not None for x in (messages, prompt, prompt_ids)) != 1:
            raise ValueError("give exactly one of messages, prompt or prompt_ids")
        if priority not in PRIORITIES:
            raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
        if messages is not None:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        elif prompt is not None:
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt_ids]
            if any(t < 0 or t >= self.tokenizer.vocab_size for t in ids):
                raise RequestRejected("bad_token", f"token ids must be in 0..{self.tokenizer.vocab_size - 1}")
        params = params or SamplingParams()
        room = self.max_model_len - len(ids)
        if max_tokens is None:   # none sent: up to the context, as chat clients expect
            max_tokens = max(1, min(room, self.config.default_max_tokens or room))
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        params.max_tokens = max_tokens
        req = Request(prompt_ids=ids, params=params, priority=priority, client=client, salt=salt)
        self.scheduler.check(req)
        return req

    @asynccontextmanager
    async def stream(self, req: Request) -> AsyncIterator[trio.MemoryReceiveChannel]:
        """Submit `req` and yield the channel of its events. Leaving early aborts it."""
        if not self.accepting:
            raise EngineClosed("the engine is not accepting requests (shutting down)")
        if req.finished or req.send is not None:
            raise ValueError(f"request {req.id} was already submitted or has ended")
        send, recv = trio.open_memory_channel(math.inf)
        req.send = send
        req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, stop=req.params.stop)
        self.scheduler.add(req)
        self.requests[req.id] = req
        self._idle = trio.Event()
        self._wake.set()
        try:
            async with recv:
                yield recv
        finally:
            if not req.finished:
                self._end(req, "cancelled")
            self.requests.pop(req.id, None)

    async def generate(self, **kwargs) -> tuple[str, DoneEvent]:
        """Convenience: run one request to the end; returns (text, done event)."""
        req = self.make_request(**kwargs)
        parts: list[str] = []
        async with self.stream(req) as events:
            async for ev in events:
                if isinstance(ev, TokenEvent):
                    parts.append(ev.text)
                else:
                    return "".join(parts), ev
        raise RuntimeError("the event stream ended without a done event")

    @property
    def kv_capacity_blocks(self) -> int:
        return self.allocator.num_blocks

    def abort(self, req: Request) -> None:
        if not req.finished:
            self._end(req, "cancelled")

    def stats(self) -> dict:
        s = self.metrics.snapshot()
        a = self.allocator.stats()
        s.update(num_requests_running=self.scheduler.num_running, num_requests_waiting=self.scheduler.num_waiting,
                 kv_blocks_used=a["used_blocks"], kv_blocks_free=a["free_blocks"], kv_blocks_cached=a["cached_blocks"],
                 kv_blocks_total=a["num_blocks"], kv_cache_usage_perc=round(a["used_blocks"] / a["num_blocks"], 4),
                 block_size=self.block_size, evictions=a["evictions"], max_model_len=self.max_model_len,
                 mode="contiguous" if self.config.contiguous else "paged")
        return s

    # -- the loop -----------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            batch = self.scheduler.schedule() if self.scheduler.has_work() else None
            if batch is None:
                if not self.scheduler.has_work():
                    self._idle.set()
                    if self._steps_since_trim and self.config.trim_memory_when_idle:
                        # hand freed activation memory back to the system between bursts, so
                        # a server left running for months stays near its starting size
                        self._steps_since_trim = 0
                        await trio.to_thread.run_sync(release_free_memory)
                        if self.scheduler.has_work():
                            continue
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            now = time.monotonic()
            for req in batch.requests:
                if req.first_scheduled is None:
                    req.first_scheduled = now
                    self.metrics.on_admit(len(req.prompt_ids), req.num_cached, self.allocator.enable_prefix_caching)
            prev = [r.all_ids if (r.params.repetition_penalty != 1.0 or r.params.seed is not None) else []
                    for r in batch.sampled]
            params = [r.params for r in batch.sampled]
            try:
                tokens = await trio.to_thread.run_sync(self._execute, batch, params, prev)
            except Exception as e:  # a failed step fails only its own requests
                log.exception("model step failed")
                for req in batch.requests:
                    self._end(req, "error", cache=False,
                              error={"code": "internal_error", "message": f"model step failed: {type(e).__name__}: {e}"})
                continue
            self._process(batch, tokens)
            self._steps_since_trim += 1
            await trio.lowlevel.checkpoint()

    def _execute(self, batch: Batch, params, prev) -> list[int]:
        """In the worker thread: copy-on-write, the forward, sampling."""
        if self.step_hook is not None:
            self.step_hook(batch)
        if len(batch.copies):
            self.runner.copy_blocks(batch.copies)
        meta = dict(query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
                    block_tables=batch.block_tables, slot_mapping=batch.slot_mapping)
        logits = self.runner.execute(batch.input_ids, batch.positions, meta, batch.logits_indices)
        if not len(batch.sampled):
            return []
        return sample(logits, params, prev).tolist()

    def _process(self, batch: Batch, tokens: list[int]) -> None:
        now = time.monotonic()
        eos = self.tokenizer.stop_token_ids
        generated = 0
        for req, tok in zip(batch.sampled, tokens):
            if req.finished:   # aborted while the step ran
                continue
            generated += 1
            if req.first_token is None:
                req.first_token = now
            req.output_ids.append(tok)
            p = req.params
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in eos):
                req.stop_reason = tok
                self._end(req, "stop")
                continue
            self._send(req, TokenEvent([tok], req.detok.add(tok)))
            if req.finished:
                continue
            if req.detok.stopped is not None:
                req.stop_reason = req.detok.stopped
                self._end(req, "stop")
            elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                self._end(req, "length")
        blocks_used = self.allocator.num_used_blocks
        self.metrics.on_step(
            running=self.scheduler.num_running, waiting=self.scheduler.num_waiting, blocks_used=blocks_used,
            blocks_total=self.allocator.num_blocks, generated=generated, preemptions=len(batch.preempted),
            reserved_slots=blocks_used * self.block_size, unused_slots=self._unused_slots())

    def _unused_slots(self) -> int:
        """KV slots reserved but holding nothing: the empty tail of each sequence's own last
        block (shared blocks are always full), or its whole up-front reservation beyond what
        it holds in contiguous mode."""
        bs = self.block_size
        return sum(-(-max(r.num_slots, r.reserve_tokens) // bs) * bs - r.num_slots for r in self.scheduler.running)

    def _send(self, req: Request, event) -> None:
        try:
            req.send.send_nowait(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            if not req.finished:
                self._end(req, "cancelled")

    def _end(self, req: Request, reason: str, cache: bool = True, error: dict | None = None) -> None:
        """The one place a request ends: its blocks go back, its last events go out."""
        if req.finished:
            return
        if reason == "cancelled":
            self.scheduler.abort(req)
        else:
            self.scheduler.finish(req, cache=cache)
        req.finish_reason, req.error = reason, error
        req.finished_at = time.monotonic()
        tail = req.detok.finish() if req.detok is not None and reason != "error" else ""
        if tail:
            self._send_quiet(req, TokenEvent([], tail))
        timings = req.timings()
        self.metrics.on_finish(reason, len(req.prompt_ids), timings, req.first_token is not None)
        self._send_quiet(req, DoneEvent(reason, req.usage(), timings, req.stop_reason, error))
        if req.send is not None:
            req.send.close()
        if not self.scheduler.has_work():
            self._idle.set()

    @staticmethod
    def _send_quiet(req: Request, event) -> None:
        if req.send is None:
            return
        try:
            req.send.send_nowait(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
