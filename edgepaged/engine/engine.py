"""The Trio engine: one loop task doing continuous batching over the scheduler and the model.

    async with Engine(runner, EngineConfig()) as engine:
        req = Request(prompt_ids=ids, params=SamplingParams(temperature=0, max_tokens=32))
        async with engine.stream(req) as events:
            async for event in events:      # TokenEvent ..., then one DoneEvent
                ...

Requests arrive as token ids (the front end renders and tokenizes). The loop is the only
place that touches Trio and the model at once; each step runs in a worker thread
(`runner.step`: copy-on-write, forward, sampling) so the event loop keeps serving. Leaving
`stream()` early (cancel, disconnect, a cancelled scope) ends the request for its client at
once; its blocks go back to the pool then too, or, when the step running at that moment
uses them, right after that step, cached only if the step succeeded.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import numpy as np
import trio

from .._native.blocks import BlockAllocator
from ..model.tokenizer import IncrementalDetokenizer
from ..common import brief
from .metrics import Metrics
from ..common.memory import release_free_memory
from .request import INTERACTIVE, CostHold, DoneEvent, EmbeddingEvent, Request, Status, TokenEvent
from .disk_cache import DiskPrefix
from .draft import Drafter, check_pair
from .speculate import SpecConfig, Speculation
from .scheduler import Batch, ScheduleError, Scheduler, SchedulerConfig
from ..constrain.grammar import GrammarRefused, forced_run, matcher_error
from ..model.runtime import StepInterrupted

log = logging.getLogger("edgepaged.engine")
ANSWERS_FILE = "answers.bin"    # AnswerHistory's (prompt lookup's earlier answers), in the disk tier's folder
# what a client is told when the server failed on its behalf: never an exception's text (the
# log has one line, and the traceback at debug level)
INTERNAL = {"code": "internal_error", "message": "the server failed while answering this request (see its log)"}


_short = brief.of


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
    trim_memory_when_idle: bool = True       # malloc_trim when the last request ends (glibc)
    step_time_target_s: float | None = 0.5   # a step's length under load (None: full budget steps)
    # the context policy of requests that do not choose one: "full" attention over the whole
    # context, or "window": the first window_sink tokens and the last window_tokens kept, the
    # blocks between given back as a sequence grows (it may generate past the context)
    context_policy: str = "full"
    window_tokens: int = 1024
    window_sink: int = 4
    # speculative decoding (speculate.py): "lookup" (prompt lookup), "draft" (the runner's draft
    # model's guesses: draft.py) or "off"; the most drafted tokens per request and step;
    # drafting only while at most spec_max_running sequences run
    # the prefix cache's disk tier (disk_cache.py): the most bytes it holds (0: off) and its
    # folder (None: the model store's kvcache/)
    prefix_cache_disk: int = 0
    prefix_cache_dir: str | None = None
    speculation: str = "lookup"
    spec_tokens: int | None = None          # None: 8 by lookup, 4 by a draft model (each guess costs a forward)
    spec_max_running: int = 4
    # a long step (a document's prefill chunk) stops between two layers when a short
    # interactive prompt arrives while little of it has run, and is planned again with that
    # prompt first (Engine._maybe_interrupt); the runner must support it (CpuRunner)
    interrupt_long_steps: bool = True
    # the host's share of a step's output (detokenizing and streaming the plain rows' tokens)
    # done while the next step's forward runs, not between two steps (Engine._emit)
    overlap_host_work: bool = True
    # look-ahead decode (vLLM's async scheduling): while a decode step runs on the device, the
    # next one is planned and launched with its input tokens left on the device, so the GPU
    # never waits for the host between two steps (Engine._pipeline). None: where the runner's
    # steps run on a device the host does not wait for (`runner.async_steps`: torch on CUDA)
    async_decode: bool | None = None

# a step expected to take INTERRUPT_MIN_S or more may be stopped for a new short prompt, if it
# has INTERRUPT_LEFT_S or more to run and has run at most INTERRUPT_MAX_DONE of its expected
# time (the work thrown away); after a stopped step the next long one runs to its end (a burst
# of questions cannot starve a document)
INTERRUPT_MIN_S = 0.1
INTERRUPT_LEFT_S = 0.05
INTERRUPT_MAX_DONE = 0.6


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
        # an embedding model's engine serves nothing a person waits on token by token: its steps
        # take whole batches of inputs (the encoder runs once per input, at its last chunk)
        encoder = runner.embedding_only
        self.scheduler = Scheduler(self.allocator, SchedulerConfig(
            max_model_len=self.max_model_len, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=max(cfg.max_num_batched_tokens, 4096) if encoder else cfg.max_num_batched_tokens,
            watermark_frac=cfg.watermark_frac,
            contiguous=cfg.contiguous, background_share=cfg.background_share,
            long_prefill_tokens=cfg.long_prefill_tokens,
            short_prompt_tokens=256,
            step_time_target_s=None if encoder
            else cfg.step_time_target_s))
        self.drafter: Drafter | None = None
        if not runner.embedding_only and not cfg.contiguous:
            mode = cfg.speculation
            if mode == "draft" and runner.draft is None:
                raise ValueError("speculation 'draft' needs a draft model (serve --draft MODEL)")
            k = cfg.spec_tokens if cfg.spec_tokens is not None else 4 if mode == "draft" else 8
            self.spec = Speculation(SpecConfig(mode=mode, max_k=k,
                                               max_running=cfg.spec_max_running))
            self.scheduler.spec = self.spec if self.spec.on else None
            if mode == "draft" and self.spec.on:
                check_pair(runner, runner.draft)
                self.drafter = self.scheduler.drafter = Drafter(runner.draft, self.allocator, self.max_model_len)
        else:
            self.spec = Speculation(SpecConfig(mode="off"))
        # the engine's own worker threads (steps, the disk tier, drafts): never shared with a door's
        # or the model store's blocking work (41 creates from a FIFO once took trio's 40 and the
        # engine never answered again while /health said ok)
        self.threads = trio.CapacityLimiter(4)
        self.disk: DiskPrefix | None = None
        if (cfg.prefix_cache_disk and cfg.enable_prefix_caching and not cfg.contiguous
                and runner.keeps_kv):
            self.disk = DiskPrefix.open(runner, self.allocator, self.threads, cfg.prefix_cache_disk,
                                        cfg.prefix_cache_dir)
            if self.spec.on and self.spec.config.mode == "lookup":   # the answers drafts came from, as they were
                self.spec.history.load(self.disk.tier.dir / ANSWERS_FILE, runner.config.vocab_size)
        path = runner.model_path
        self.model_name = runner.model_name or (path.stem if hasattr(path, "stem") else "model")
        self.metrics = Metrics(self.model_name)
        self.requests: dict[int, Request] = {}
        images = getattr(runner, "images", None)
        if images is not None and (images.both_ways or images.mrope):
            self.scheduler.images = images
        self._vocab = getattr(getattr(runner, "config", None), "vocab_size", None) or 1 << 32   # ids past it: an image's rows (model/image_table.py)
        self.accepting = False
        self.step_hook: Callable[[Batch], None] | None = None   # called in the worker before each forward (tests)
        self._in_step: frozenset[Request] = frozenset()          # requests whose blocks the running step uses
        self._wake = trio.Event()
        self._stack: AsyncExitStack | None = None
        self._idle = trio.Event()
        self._idle.set()
        self._steps_since_trim = 0
        self.step_started: float | None = None   # trio time the running model step began (None: no step)
        self._costs: dict[Request, tuple[str, int]] = {}   # unfinished requests: (owner, max_tokens)
        self._holds: set[CostHold] = set()          # checked costs not streamed yet (hold_cost)
        self._pending: dict[Request, float] = {}   # built for this engine, not streamed yet (expect)
        self._owner_tokens: dict[str, int] = {}
        # the running step, while it may be stopped: (trio time it began, its expected seconds)
        self._stoppable: tuple[float, float] | None = None
        self._may_stop = True      # the last long step ran to its end
        self.steps_interrupted = 0
        # tokens taken (appended, counted, stop tokens and lengths checked) but not yet
        # detokenized and sent: sent while the next step's forward runs (_emit, _flush)
        self._unsent: dict[Request, list] = {}
        self.overlapped_s = 0.0     # host seconds spent sending while a step ran
        self._ahead = (cfg.async_decode if cfg.async_decode is not None
                       else bool(getattr(runner, "async_steps", False))) and hasattr(runner, "step_begin")
        self.steps_ahead = 0        # steps planned and launched before the last one's tokens were known
        self.tokens_overlapped = 0  # tokens sent while a step ran
        # a vision model's image encoders (request/vision_prompt.py) run while this is set: no
        # interactive request waits for its first token (a voice command beside a camera burst)
        self.encoder_gate = threading.Event()
        self.encoder_gate.set()
        self._awaiting_first: set[Request] = set()

    PENDING_S = 60.0   # a request built and never streamed stops holding its model after this

    def expect(self, req: Request) -> None:
        """`req` was built for this engine and its door is about to stream it: until then it
        counts as work (a model is not unloaded between the build and the stream)."""
        self._pending[req] = trio.current_time()

    def has_pending(self) -> bool:
        now = trio.current_time()
        for req, t in list(self._pending.items()):
            if now - t > self.PENDING_S:
                del self._pending[req]
        return bool(self._pending)

    def owner_tokens(self, owner: str) -> int:
        """Tokens the unfinished requests of `owner` may still ask for (their max_tokens summed,
        every parallel sample counted, those checked and not yet streamed too): the front end
        bounds it per identity."""
        now = trio.current_time()
        held = 0
        for h in list(self._holds):
            if now - h.since > self.PENDING_S:     # built and never streamed (a door that failed)
                self._holds.discard(h)
            elif h.owner == owner:
                held += h.left
        return self._owner_tokens.get(owner, 0) + held

    def hold_cost(self, owner: str, cost: int, cap: int | None) -> CostHold | int:
        """Check and count at once (no await between): `cost` more tokens for `owner` within
        `cap`. A CostHold its requests carry to `stream` (or give back with `release`), or,
        past the cap, the tokens `owner` has in flight already."""
        held = self.owner_tokens(owner)
        if cap and held + cost > cap:
            return held
        hold = CostHold(owner, cost, trio.current_time())
        self._holds.add(hold)
        return hold

    def release(self, hold: CostHold | None) -> None:
        """A hold whose request will not be streamed (it failed while it was built)."""
        if hold is not None:
            hold.left = 0
            self._holds.discard(hold)

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
        if self.disk is not None:     # every pin copied out, and what the tier was given on disk
            await self.disk.close()
            if self.disk.tier.writable and self.spec.history.corpus_count():
                try:
                    await trio.to_thread.run_sync(self.spec.history.save, self.disk.tier.dir / ANSWERS_FILE,
                                                 limiter=self.threads)
                except OSError as e:
                    log.warning("the answers prompt lookup drafts from were not saved: %s", _short(e))

    async def settle(self) -> None:
        """Wait until the engine rests: no request to run and the disk tier's copies made."""
        await self._idle.wait()

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
    @asynccontextmanager
    async def stream(self, req: Request) -> AsyncIterator[trio.MemoryReceiveChannel]:
        """Submit `req` and yield the channel of its events. Leaving early cancels it.
        Raises RequestRejected (it could never run here) or EngineClosed before anything runs."""
        if not self.accepting:
            raise EngineClosed("the engine is not accepting requests (shutting down)")
        if req.finished or req.send is not None:
            raise ValueError(f"request {req.id} was already submitted or has ended")
        if req.fork_of is None and self.disk is not None:
            await self.disk.load(req)          # (still pending meanwhile: its model stays loaded)
            if not self.accepting:
                raise EngineClosed("the engine is not accepting requests (shutting down)")
        self._pending.pop(req, None)
        if req.fork_of is None:      # a parallel sample waits for its parent's prompt instead
            self.scheduler.add(req)
        send, recv = trio.open_memory_channel(math.inf)
        req.send = send
        context = req.prompt_ids if req.images.held is None else [t for t in req.prompt_ids[-8:] if t < self._vocab]
        req.detok = IncrementalDetokenizer(self.tokenizer, context, stop=req.params.stop)
        self.requests[req.id] = req
        self._costs[req] = (req.owner, req.params.max_tokens)
        hold = req.cost_hold
        if hold is not None:          # counted from the front end's check: now here instead
            req.cost_hold = None
            hold.left = max(0, hold.left - req.params.max_tokens)
            if not hold.left:
                self._holds.discard(hold)
        self._owner_tokens[req.owner] = self._owner_tokens.get(req.owner, 0) + req.params.max_tokens
        self._idle = trio.Event()
        self._wake.set()
        if req.priority == INTERACTIVE and not req.embed and req.fork_of is None:
            self._awaiting_first.add(req)
            self.encoder_gate.clear()
        self._maybe_interrupt(req)
        try:
            async with recv:
                yield recv
        finally:
            if not req.finished:
                self._end(req, "cancelled")
            self.requests.pop(req.id, None)

    @asynccontextmanager
    async def stream_samples(self, req: Request) -> AsyncIterator[trio.MemoryReceiveChannel]:
        """`stream` for a request with parallel samples (`req.children`): one channel of
        (sample index, event), index 0 the parent. The samples are submitted before the
        parent, so each is there to be forked when the parent's prompt ends."""
        reqs = [req, *req.children]     # (forking empties req.children)
        send, recv = trio.open_memory_channel(math.inf)
        async with AsyncExitStack() as stack:
            chans = {}
            for i in range(len(reqs) - 1, -1, -1):
                chans[i] = await stack.enter_async_context(self.stream(reqs[i]))
            left = [len(reqs)]

            async def pump(i, ch):
                async for ev in ch:
                    send.send_nowait((i, ev))
                left[0] -= 1
                if not left[0]:
                    send.close()
            async with trio.open_nursery() as nursery:
                for i, ch in chans.items():
                    nursery.start_soon(pump, i, ch)
                async with recv:
                    yield recv
                nursery.cancel_scope.cancel()

    @property
    def kv_capacity_blocks(self) -> int:
        return self.allocator.num_blocks

    def memory(self) -> dict:
        """What the model holds (runner.memory) plus the KV blocks in use now."""
        m = dict(self.runner.memory())
        if "block_bytes" in m:
            m["kv_used_bytes"] = self.allocator.stats()["used_blocks"] * m.pop("block_bytes")
        return m

    def alive(self, limit_s: float) -> bool:
        """False when a model step has run for more than `limit_s` (a stuck engine: the
        service watchdog stops being petted and systemd restarts the server)."""
        return self.step_started is None or trio.current_time() - self.step_started < limit_s

    def cancel(self, req: Request) -> None:
        """End a request now (finish_reason `cancelled`); its done event follows."""
        if not req.finished:
            self._end(req, "cancelled")

    def prometheus_text(self) -> bytes:
        """The Prometheus exposition, with the load gauges made current (the engine sets them
        once per step, so a request aborted between steps would show until the next one)."""
        s, m = self.stats(), self.metrics
        m.num_requests_running.set(s["num_requests_running"])
        m.num_requests_waiting.set(s["num_requests_waiting"])
        m.kv_blocks_used.set(s["kv_blocks_used"])
        m.kv_blocks_total.set(s["kv_blocks_total"])
        m.kv_cache_usage_perc.set(s["kv_cache_usage_perc"])
        return m.prometheus_text()

    def stats(self) -> dict:
        s = self.metrics.snapshot()
        a = self.allocator.stats()
        s.update(num_requests_running=self.scheduler.num_running, num_requests_waiting=self.scheduler.num_waiting,
                 kv_blocks_used=a["used_blocks"], kv_blocks_free=a["free_blocks"], kv_blocks_cached=a["cached_blocks"],
                 kv_blocks_total=a["num_blocks"], kv_cache_usage_perc=round(a["used_blocks"] / a["num_blocks"], 4),
                 block_size=self.block_size, evictions=a["evictions"], max_model_len=self.max_model_len,
                 kv_dtype=self.runner.kv_dtype_name,
                 mode="contiguous" if self.config.contiguous else "paged", context_policy=self.config.context_policy,
                 speculation=self.spec.stats(), steps_interrupted=self.steps_interrupted,
                 tokens_sent_during_steps=self.tokens_overlapped, steps_ahead=self.steps_ahead,
                 **self.scheduler.kv_bound_stats())
        if self.drafter is not None:
            s["draft_model"] = self.drafter.stats()
        if self.disk is not None:
            s["prefix_cache_disk"] = self.disk.info()
        return s

    # -- the loop -----------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                batch = self.scheduler.schedule() if self.scheduler.has_work() else None
            except ScheduleError as e:   # the allocator refused the plan: that step fails, not the engine
                log.error("a step could not be planned (%s): its %d requests end with an error",
                          _short(e.cause), len(e.requests))
                log.debug("planning failed", exc_info=e.cause)
                for req in e.requests:
                    self._end(req, "error", error=INTERNAL)
                self._flush()
                await trio.lowlevel.checkpoint()
                continue
            if batch is None:
                self._flush()
                if not self.scheduler.has_work():
                    if self.disk is not None and self.disk.pins:   # a piece at a time; a request that arrives goes first
                        await self.disk.flush(whole=False, has_work=self.scheduler.has_work)
                        continue
                    self._idle.set()
                    if self.disk is not None:
                        self.disk.quiet.set()
                    if self._steps_since_trim and self.config.trim_memory_when_idle:
                        # hand freed activation memory back to the system between bursts, so
                        # a server left running for months stays near its starting size
                        self._steps_since_trim = 0
                        await trio.to_thread.run_sync(release_free_memory, limiter=self.threads)
                        if self.scheduler.has_work():
                            continue
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            if self.disk is not None:
                self.disk.quiet.clear()       # its writer waits while steps run
            await self._run_step(batch)
            if self.disk is not None and self.disk.due():
                await self.disk.flush(whole=True)    # a busy box, or its pool runs short
            if self.drafter is not None:
                await self._draft_round()
            self._steps_since_trim += 1
            await trio.lowlevel.checkpoint()

    async def _draft_round(self) -> None:
        """The draft model guesses the next tokens of the requests that draft (few running,
        decoding, eligible), in a worker thread; the next step checks them. Its sequences of
        requests that stopped drafting go back to the pool."""
        d, sched = self.drafter, self.scheduler
        wanted = self.spec.wanted(sched.running, self.max_model_len)
        if d.holds() and d.drop_all(keep={r for r, _ in wanted}):
            sched._free_blocks = None
        if not wanted:
            return
        try:
            # the round takes free blocks only (the scheduler takes them back before it would
            # preempt anyone: Scheduler._reclaim_drafts), the watermark and a block kept
            plan = d.begin(wanted, free_floor=sched.watermark + 1)
        except Exception as e:     # the allocator refused: no drafts this step, nothing else hurt
            log.error("the draft model's round could not be planned: %s", _short(e))
            log.debug("draft planning failed", exc_info=True)
            d.busy = False
            d.drop_all()
            sched._free_blocks = None
            return
        sched._free_blocks = None
        if not plan:
            return
        guesses = None
        self.step_started = trio.current_time()
        try:
            guesses = await trio.to_thread.run_sync(d.run, plan, trio.lowlevel.current_trio_token(),
                                                    self.tokenizer.stop_token_ids, limiter=self.threads)
        except Exception as e:     # the draft failed: the requests decode without drafts
            log.error("the draft model's round failed: %s (no drafts this step)", _short(e))
            log.debug("draft round failed", exc_info=True)
        finally:
            self.step_started = None
            d.finish(plan, guesses)
            sched._free_blocks = None

    def _plain(self, req: Request) -> bool:
        """A request whose next token changes nothing but itself: no stop strings, format,
        history (penalties, a seed), logprobs, images, window, samples or embedding; the
        look-ahead decode takes only these (`Scheduler.plan_ahead`)."""
        p = req.params
        return (not p.stop and p.logprobs is None and not p.needs_history and not p.counts_output
                and req.constraint.matcher is None and req.constraint.lazy is None and not req.embed
                and not req.children and req.context_window is None and req.images.held is None
                and not req.drafting.drafts)

    def _pipelines(self, batch: Batch) -> bool:
        """`batch` may start a look-ahead run: decode rows only, every one plain."""
        spec = self.scheduler.spec
        return (self._ahead and self.drafter is None and not batch.spec
                and (spec is None or len(self.scheduler.running) > spec.config.max_running)
                and not batch.loads and batch.rope_positions is None and len(batch.sampled) == len(batch.requests)
                and batch.num_tokens == len(batch.requests) and not (batch.prompt is not None and batch.prompt.any())
                and all(r.first_scheduled is not None and self._plain(r) for r in batch.requests))

    def _begin(self, batch: Batch, feed=None):
        """(In the worker) launch a step of plain rows (`runner.step_begin`)."""
        if self.step_hook is not None:
            self.step_hook(batch)
        return self.runner.step_begin(batch, [r.params for r in batch.sampled], feed)

    async def _pipeline(self, batch: Batch) -> None:
        """Decode steps planned one ahead (look-ahead decode; vLLM's async scheduling): while
        a step runs, the next one is planned (`Scheduler.plan_ahead`) and launched with its
        input tokens taken from the running step's on the device (`runner.step_begin`'s feed);
        then the first step's tokens come to the host and are processed as ever (`_process`),
        and so on while every running request decodes plain tokens and nothing waits. Each
        request's events are those of the step-by-step engine: a request that ended on a token
        the next step already computed drops that step's token, and its blocks go back after it."""
        sched = self.scheduler
        self._in_step = frozenset(batch.requests)
        self.step_started = trio.current_time()
        t_prev = time.monotonic()
        try:
            launched = await self._in_worker(self._begin, batch, meanwhile=self._flush)
        except Exception as e:   # noqa: BLE001 - a failed step fails only its own requests
            self._step_failed(batch, e)
            self._after_pipeline(batch.requests, cache=False)
            return
        uncached: set[Request] = set()      # requests whose fed token did not come: never cached
        while True:
            nxt = nxt_launched = None
            if self.disk is None or not self.disk.due():
                try:
                    nxt = sched.plan_ahead(batch, self._plain)
                except Exception as e:   # noqa: BLE001 - the allocator refused: step by step from here
                    log.debug("no look-ahead step: %s", _short(e))
                    sched._free_blocks = None
            if nxt is not None:
                self._in_step = frozenset(batch.requests) | frozenset(nxt.requests)
                try:
                    nxt_launched = await self._in_worker(self._begin, nxt, (launched, nxt.feed), meanwhile=self._flush)
                except Exception as e:   # noqa: BLE001 - not launched: its reservations go back
                    log.debug("a look-ahead step could not start: %s", _short(e))
                    sched.undo_step(nxt)
                    nxt = None
            ok = True
            try:
                tokens = await self._in_worker(self.runner.step_end, launched, meanwhile=self._flush)
            except Exception as e:   # noqa: BLE001
                ok = False
                self._step_failed(batch, e)
            now = time.monotonic()
            sched.observe_step(batch.num_tokens, now - t_prev)
            t_prev = now
            if ok and nxt is not None:
                self.steps_ahead += 1
                uncached.update(sched.learn_ahead(nxt, tokens))
            if ok and self.disk is not None:
                self.disk.pin(batch.requests)
            # the step's requests that ended while it ran, and that the next one does not use
            keep = frozenset(nxt.requests) if nxt is not None else frozenset()
            self._in_step = keep
            for req in batch.requests:
                if req.finished and req.status is Status.RUNNING and req not in keep:
                    sched.free(req, cache=ok and req not in uncached)
            if ok:
                self._process(batch, tokens)
            if nxt is None:
                break
            if not ok:        # the next step was fed by a failed one: let it finish, drop it
                try:
                    await self._in_worker(self.runner.step_end, nxt_launched)
                except Exception:  # noqa: BLE001 - its requests ended with the failed step
                    pass
                self._after_pipeline(nxt.requests, cache=False)
                return
            batch, launched = nxt, nxt_launched
            self._steps_since_trim += 1
            self.step_started = trio.current_time()     # (the watchdog's `alive` times each step, not the run)
        self._after_pipeline([], cache=True)

    def _step_failed(self, batch: Batch, e: BaseException) -> None:
        log.error("model step failed: %s (its %d requests end with an error)", _short(e), len(batch.requests))
        log.debug("model step failed", exc_info=True)
        for req in batch.requests:
            self._end(req, "error", error={"code": "internal_error",
                                           "message": "the model step failed (see the server's log)"})

    def _after_pipeline(self, requests, cache: bool) -> None:
        self.step_started = None
        self._in_step = frozenset()
        for req in requests:
            if req.finished and req.status is Status.RUNNING:
                self.scheduler.free(req, cache=cache)
        if not self.scheduler.has_work():
            self._flush()
            if not self._disk_busy():
                self._idle.set()

    async def _run_step(self, batch: Batch) -> None:
        if self._pipelines(batch):
            await self._pipeline(batch)
            return
        now = time.monotonic()
        for req in batch.requests:
            if req.first_scheduled is None:
                req.first_scheduled = now
                self.metrics.on_admit(len(req.prompt_ids), req.num_cached, self.allocator.enable_prefix_caching)
        # parallel samples whose parent's prompt ends this step: their rows repeat the parent's
        forks = [(j, c) for j, r in enumerate(batch.sampled) if r.children and not r.output_ids
                 for c in r.children if not c.finished and c.send is not None]
        rows = batch.sampled + [c for _, c in forks]
        if forks:
            batch.logits_indices = np.concatenate([batch.logits_indices,
                                                   batch.logits_indices[[j for j, _ in forks]]])
        # mean-pooled embeddings: every row of their chunks is a row whose final state comes back
        qsl = batch.query_start_loc
        pool = [(r, s) for j, r in enumerate(batch.requests) if r.embedding is not None and r.embedding.pool == "mean" and not r.finished
                for s in range(int(qsl[j]), int(qsl[j + 1]))]
        if pool:
            batch.logits_indices = np.concatenate([batch.logits_indices, np.array([s for _, s in pool], np.int64)])
            rows = rows + [r for r, _ in pool]
        # speculation: each drafting request's draft rows come back after every other row
        spec = {}
        if batch.spec:
            at = len(batch.logits_indices)
            for req, extra in batch.spec.items():
                spec[batch.sampled.index(req)] = (list(req.drafting.drafts), list(range(at, at + len(extra))),
                                                  req.drafting.forced, list(req.drafting.have))
                at += len(extra)
            batch.logits_indices = np.concatenate([batch.logits_indices] + [np.asarray(x, np.int64)
                                                                            for x in batch.spec.values()])
        prev = [r.all_ids if r.params.needs_history else [] for r in rows]
        params = [r.params for r in rows]
        matchers = [r.constraint.matcher for r in rows] if any(r.constraint.matcher is not None for r in rows) else None
        outputs = [r.output_ids if r.params.counts_output else [] for r in rows] \
            if any(r.params.counts_output for r in rows) else None
        embeds = [r.embed for r in rows] if any(r.embed for r in rows) else None
        tokens, ok, stopped = None, False, False
        self._in_step = frozenset(batch.requests)
        self.step_started = trio.current_time()
        stop = self.runner.interrupt if self.config.interrupt_long_steps else None
        if stop is not None:
            stop.clear()
            expected = self._stoppable_for(batch, forks, pool, embeds)
            if expected and self._may_stop:
                self._stoppable = (self.step_started, expected)
            elif expected:
                self._may_stop = True
        try:
            t0 = time.monotonic()
            tokens, grammar = await self._in_worker(self._execute, batch, params, prev, matchers, outputs,
                                                    rows, embeds, spec, meanwhile=self._flush)
            if pool:
                tokens = self._pooled(batch, pool, tokens)
            if spec:
                self.spec.settle(list(batch.spec), [tokens[batch.sampled.index(r)] for r in batch.spec],
                                 self.allocator)
            if self.disk is not None:
                self.disk.pin(batch.requests)
            self.scheduler.observe_step(batch.num_tokens, time.monotonic() - t0)
            log.debug("a step of %d tokens (%d requests) in %.3f s", batch.num_tokens, len(batch.requests),
                      time.monotonic() - t0)
            ok = True
        except StepInterrupted:
            # a short prompt arrived: nothing was sampled, the step's reservations go (its
            # requests keep what earlier steps computed) and the next plan puts that prompt first
            self._stoppable, self._may_stop = None, False
            try:
                self.scheduler.undo_step(batch)
                stopped = True
            except Exception as e:   # noqa: BLE001 - cannot happen; if it did, the step fails as any would
                log.error("a stopped step could not be undone: %s (its %d requests end with an error)", _short(e),
                          len(batch.requests))
                for req in batch.requests:
                    self._end(req, "error", error=INTERNAL)
            self.steps_interrupted += 1
            log.debug("a step of %d tokens stopped after %.3f s for a short prompt", batch.num_tokens,
                      time.monotonic() - t0)
        except Exception as e:  # a failed step fails only its own requests
            log.error("model step failed: %s (its %d requests end with an error)", _short(e), len(batch.requests))
            log.debug("model step failed", exc_info=True)
            for req in batch.requests + [c for _, c in forks]:
                self._end(req, "error", error={"code": "internal_error",
                                               "message": "the model step failed (see the server's log)"})
        finally:
            self.step_started = None
            self._stoppable = None
            if stop is not None:
                stop.clear()
            self._free_after_step(batch, cache=ok or stopped)
        if ok:
            self._process(batch, tokens, forks, grammar)
        if self.drafter is not None or not self.scheduler.has_work():
            self._flush()     # nothing to overlap with (the engine may rest now)

    async def _in_worker(self, fn, *args, meanwhile: Callable[[], None] | None = None):
        """fn(*args) in one of the engine's worker threads, as trio.to_thread.run_sync would
        (not abandoned on cancellation); `meanwhile()` runs on the event loop once the thread
        has started, so the host's work of the last step overlaps this one's forward."""
        async with self.threads:
            token = trio.lowlevel.current_trio_token()
            done, box = trio.Event(), []

            def deliver(result) -> None:     # (in the thread) an outcome.Value or .Error
                box.append(result)
                try:
                    token.run_sync_soon(done.set)
                except trio.RunFinishedError:   # noqa: PERF203 - cannot happen: the loop awaits it
                    pass

            trio.lowlevel.start_thread_soon(lambda: fn(*args), deliver)   # deliver gets its outcome
            if meanwhile is not None:
                t0 = time.perf_counter()
                self.tokens_overlapped += meanwhile()
                self.overlapped_s += time.perf_counter() - t0
            with trio.CancelScope(shield=True):
                await done.wait()
        return box[0].unwrap()

    def _stoppable_for(self, batch: Batch, forks, pool, embeds) -> float:
        """The seconds `batch` is expected to take if it may be stopped between layers (0 if
        not): a step without parallel samples, embeddings, disk loads or windowed sequences
        (whose undoing would be more than giving tokens and slots back) long enough to be
        worth stopping, at the speed the scheduler measured."""
        spt = self.scheduler.sec_per_token
        if not spt or forks or pool or embeds or batch.loads:
            return 0.0
        expected = batch.num_tokens * spt
        if expected < INTERRUPT_MIN_S:
            return 0.0
        if any(r.context_window is not None for r in batch.requests):
            return 0.0
        return expected

    def _maybe_interrupt(self, req: Request) -> None:
        """A new request: if it is a short interactive prompt (a voice command over a cached
        system prompt) and a long step that may be stopped has run little of its time, the
        step stops at its next layer; its work is planned again after this prompt's."""
        if self._stoppable is None or req.priority != INTERACTIVE or req.fork_of is not None:
            return
        began, expected = self._stoppable
        now = trio.current_time()
        ran = now - began
        if ran > INTERRUPT_MAX_DONE * expected or expected - ran < INTERRUPT_LEFT_S:
            return
        sched = self.scheduler
        if sched.config.short_prompt_tokens <= 0 or sched._to_compute(req) > sched.config.short_prompt_tokens:
            return
        self.runner.interrupt.set()

    @staticmethod
    def _pooled(batch: Batch, pool: list, tokens: list) -> list:
        """Keep the final states of mean-pooled rows by position (a preempted request that
        computes a position again writes the same state); the other rows' outputs go on."""
        n = len(tokens) - len(pool)
        for (req, s), state in zip(pool, tokens[n:]):
            if isinstance(state, BaseException):
                continue
            if req.embedding.states is None:
                req.embedding.states = np.full((len(req.prompt_ids), len(state)), np.nan, np.float32)
            req.embedding.states[int(batch.positions[s])] = state
        return tokens[:n]

    def _free_after_step(self, batch: Batch, cache: bool) -> None:
        """The step is over: requests of the batch that ended while it ran (cancel,
        disconnect, shutdown, its failure) free their blocks now, cached only if it succeeded."""
        self._in_step = frozenset()
        for req in batch.requests:
            if req.finished and req.status is Status.RUNNING:
                self.scheduler.free(req, cache=cache)
        if not self.scheduler.has_work() and not self._disk_busy():
            self._idle.set()

    def _execute(self, batch: Batch, params, prev, matchers=None, outputs=None, rows=(),
                 embeds=None, spec=None) -> tuple[list, dict]:
        """In the worker thread: copy-on-write, the forward, sampling (under the constrained
        rows' token masks), then the constrained rows' grammars take their tokens here too (a
        large grammar's step costs milliseconds per row: never on the event loop). Returns the
        tokens and, per constrained row's request, what its grammar made of its token."""
        if self.step_hook is not None:
            self.step_hook(batch)
        extra = {}        # only what is in use: a plain runner.step(batch, params, prev) still fits
        if matchers is not None:
            extra["matchers"] = matchers
        if outputs is not None:
            extra["outputs"] = outputs
        if embeds is not None:
            extra["embeds"] = embeds
        if spec:
            extra["spec"] = spec
        tokens = self.runner.step(batch, params, prev, **extra)
        return tokens, self._advance_grammars(rows, tokens)

    def _advance_grammars(self, rows, tokens) -> dict:
        out = {}
        eos = self.tokenizer.stop_token_ids
        for req, tok in zip(rows, tokens):
            if req.finished or req.embed or isinstance(tok, BaseException) or (req.constraint.matcher is None
                                                                                and req.constraint.lazy is None):
                continue
            if isinstance(tok, list):      # speculation: the grammar took the kept tokens as they were verified
                out[req] = ("spec", req.constraint.matcher.is_stopped())
                continue
            tok = tok[0] if isinstance(tok, tuple) else tok
            if tok in req.params.stop_token_ids or (not req.params.ignore_eos and tok in eos):
                continue              # it ends here: its grammar takes nothing
            try:
                if req.constraint.lazy is not None:   # auto tool choice: a call it starts is constrained from here
                    out[req] = ("lazy", req.constraint.lazy.feed(tok))
                elif not req.constraint.matcher.is_error():
                    ok = req.constraint.matcher.consume_token(tok)
                    out[req] = ("took", ok, ok and req.constraint.matcher.is_stopped())
                    if ok and not out[req][2]:   # what it forces next: forced off the GIL, within the limit
                        forced_run(req.constraint.matcher)
            except Exception as e:      # handed to the loop: that request alone ends
                out[req] = ("failed", e)
        if self.scheduler.spec is not None:
            self.spec.chain_next(out, dict(zip(rows, tokens)))
        return out

    def _process(self, batch: Batch, tokens: list, forks=(), grammar: dict | None = None) -> None:
        now = time.monotonic()
        generated = 0
        pairs = list(zip(batch.sampled, tokens))
        for (j, child), tok in zip(forks, tokens[len(batch.sampled):]):
            parent = batch.sampled[j]
            if child.finished:
                continue
            if parent.status is not Status.RUNNING:    # ended while the step ran: so do its samples
                self._end(child, parent.finish_reason or "cancelled", parent.error)
                continue
            try:
                self.scheduler.adopt(parent, child)
            except Exception as e:      # the allocator refused the fork: that sample ends alone
                log.error("a parallel sample could not be forked: %s", _short(e))
                log.debug("fork failed", exc_info=True)
                if child in parent.children:
                    parent.children.remove(child)
                self._end(child, "error", error=INTERNAL)
                continue
            parent.children.remove(child)
            pairs.append((child, tok))
        for req, tok in pairs:
            if req.finished:   # ended while the step ran
                continue
            try:
                if isinstance(tok, list):     # speculation: the drafts it kept and the model's own token
                    took = (grammar or {}).get(req)
                    if took is not None and took[0] == "failed":
                        raise took[1]
                    for t in tok:
                        generated += self._take(req, t, now)
                        if req.finished:
                            break
                    if took is not None and took[1] and not req.finished:   # the format is complete
                        req.stop_reason = "format"
                        self._end(req, "stop")
                    continue
                generated += self._take(req, tok, now, (grammar or {}).get(req))
            except GrammarRefused as e:   # its format went past a limit (the forced-text limit)
                self._end(req, "error", error={"code": "invalid_params", "message": str(e)})
            except Exception as e:   # anything raised on behalf of one request ends that request only
                log.error("request %s failed while processing its token: %s", req.id, _short(e))
                log.debug("processing a token failed", exc_info=True)
                self._end(req, "error", error=INTERNAL)
        blocks_used = self.allocator.num_used_blocks
        self.metrics.on_step(
            running=self.scheduler.num_running, waiting=self.scheduler.num_waiting, blocks_used=blocks_used,
            blocks_total=self.allocator.num_blocks, generated=generated, preemptions=len(batch.preempted),
            reserved_slots=blocks_used * self.block_size, unused_slots=self._unused_slots())

    def _take(self, req: Request, tok, now: float, took=None) -> int:
        """One sampled token (or the row's failure) of `req`; how many tokens it generated.
        `took`: what its grammar made of the token, in the worker (_advance_grammars)."""
        if isinstance(tok, BaseException):   # this row alone failed (its sampling)
            log.error("sampling failed for request %s: %s", req.id, _short(tok))
            self._end(req, "error", error={"code": "internal_error",
                                           "message": "sampling failed for this request (see the server's log)"})
            return 0
        if req.embed:                         # its prompt's hidden state: the whole answer
            req.first_token = now
            if req.embedding.pool == "mean":
                if req.embedding.states is None or np.isnan(req.embedding.states[:, 0]).any():
                    raise RuntimeError("a mean-pooled embedding is missing positions")
                tok = req.embedding.states.mean(0)
                req.embedding.states = None
            self._send(req, EmbeddingEvent(tok))
            req.stop_reason = "embedding"
            self._end(req, "stop")
            return 0
        if req.constraint.matcher is not None and req.constraint.matcher.is_error():   # its grammar failed computing this mask
            self._end(req, "error", error={"code": "invalid_params", "message": matcher_error(req.constraint.matcher)})
            return 0
        info = None
        if isinstance(tok, tuple):            # (token, its logprobs)
            tok, info = tok
        if req.first_token is None:
            req.first_token = now
            self._answered(req)
        req.output_ids.append(tok)
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.tokenizer.stop_token_ids):
            req.stop_reason = tok
            self._end(req, "stop")
            return 1
        self._emit(req, tok, info, took)
        if req.finished:
            return 1
        if took is not None and took[0] == "failed":
            raise took[1]
        if took is not None and took[0] == "lazy":   # the model started a call: constrained from here
            m = took[1]
            if m is not None:      # (it took this token's text after the marker already)
                req.constraint.matcher, req.constraint.lazy = m or None, None
        elif took is not None:     # a constrained output: its grammar took the token
            if not took[1]:
                self._end(req, "error", error={"code": "invalid_params", "message": matcher_error(req.constraint.matcher)})
                return 1
            if took[2]:            # the format is complete: nothing may follow
                req.stop_reason = "format"
                self._end(req, "stop")
                return 1
        if req.detok.stopped is not None:
            req.stop_reason = req.detok.stopped
            self._end(req, "stop")
        elif len(req.output_ids) >= p.max_tokens or (req.num_tokens >= self.max_model_len
                                                      and req.context_window is None):
            self._end(req, "length")
        return 1

    def _emit(self, req: Request, tok: int, info, took) -> None:
        """Send `req`'s token now, or, for a plain row, when the next step's forward runs
        (`_flush`). A plain row: no stop strings (its text can end nothing), no format (its
        grammar's verdict is read right after), and not its last token (a request's ending
        flushes its tokens first, `_end`): what ends a request is decided as before, only
        the detokenizing and sending move."""
        ahead = self.spec.ahead(req, self.tokenizer.stop_token_ids)
        p = req.params
        if (self.config.overlap_host_work and took is None and not p.stop and req.constraint.matcher is None
                and req.constraint.lazy is None and len(req.output_ids) < p.max_tokens
                and (req.num_tokens < self.max_model_len or req.context_window is not None)):
            self._unsent.setdefault(req, []).append((tok, info, ahead))
            return
        self._flush_one(req)
        self._send(req, TokenEvent([tok], req.detok.add(tok), None if info is None else [info], ahead))

    def _flush_one(self, req: Request) -> int:
        sent = 0
        for tok, info, ahead in self._unsent.pop(req, ()):
            if req.send is None or (req.finished and req.finish_reason == "cancelled"):
                break
            self._send(req, TokenEvent([tok], req.detok.add(tok), None if info is None else [info], ahead))
            sent += 1
        return sent

    def _flush(self) -> int:
        """Detokenize and send the tokens taken but not sent (each request's in order); how many."""
        sent = 0
        while self._unsent:
            req = next(iter(self._unsent))
            try:
                sent += self._flush_one(req)
            except Exception as e:   # noqa: BLE001 - one request's failure ends that request only
                log.error("request %s failed while sending its token: %s", req.id, _short(e))
                log.debug("sending a token failed", exc_info=True)
                self._unsent.pop(req, None)
                self._end(req, "error", error=INTERNAL)
        return sent

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

    def _end(self, req: Request, reason: str, error: dict | None = None) -> None:
        """The one place a request ends for its client: its last events go out; its blocks go
        back to the pool now, or after the running step if that step uses them."""
        if req.finished:
            return
        if req in self._unsent:         # its tokens go out before its end
            try:
                self._flush_one(req)
            except Exception as e:      # noqa: BLE001 - it ends anyway
                self._unsent.pop(req, None)
                log.error("request %s failed while sending its token: %s", req.id, _short(e))
                reason, error = "error", INTERNAL
            if req.finished:            # its client was gone: sending ended it
                return
        self._answered(req)
        for child in req.children:      # samples not forked yet end with their parent
            self._end(child, reason, error)
        req.children = []
        req.finish_reason, req.error = reason, error
        req.finished_at = time.monotonic()
        cost = self._costs.pop(req, None)
        if cost is not None:
            left = self._owner_tokens[cost[0]] - cost[1]
            if left > 0:
                self._owner_tokens[cost[0]] = left
            else:
                self._owner_tokens.pop(cost[0], None)
        if req not in self._in_step:
            self.scheduler.free(req, cache=reason != "error")
        if reason in ("stop", "length") and not req.embed and self.spec.on and self.spec.config.mode == "lookup":
            prompt = req.prompt_ids if req.images.held is None else [t for t in req.prompt_ids if t < self._vocab]
            self.spec.history.add(req.salt, prompt, req.output_ids)   # lookup's guesses for its next ones
        tail = req.detok.finish() if req.detok is not None and reason != "error" else ""
        if tail:
            self._send_quiet(req, TokenEvent([], tail))
        timings = req.timings()
        self.metrics.on_finish(reason, len(req.prompt_ids), timings, req.first_token is not None, req.owner,
                               len(req.output_ids))
        self._send_quiet(req, DoneEvent(reason, req.usage(), timings, req.stop_reason, error))
        if req.send is not None:
            req.send.close()
        if not self.scheduler.has_work() and not self._disk_busy():
            self._idle.set()

    def _answered(self, req: Request) -> None:
        """`req` has its first token (or ended): image encoders may run once none waits."""
        if self._awaiting_first:
            self._awaiting_first.discard(req)
            if not self._awaiting_first:
                self.encoder_gate.set()

    def _disk_busy(self) -> bool:
        """The disk tier still has pinned blocks to copy out (the engine does not rest yet)."""
        return self.disk is not None and bool(self.disk.pins)

    @staticmethod
    def _send_quiet(req: Request, event) -> None:
        if req.send is None:
            return
        try:
            req.send.send_nowait(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
