"""The scheduling policy: plain synchronous code over the queues and the block allocator.

Each step fills a token budget: running sequences' decode tokens first, then prefill chunks
of partially prefilled sequences, then new admissions (chunked prefill), so a long document
never stalls everyone else's decoding. Admission needs the blocks of the first chunk (and a
small watermark kept back). When a running sequence cannot get its next block, the lowest
ranked running sequence (background before interactive, then newest first) is preempted by
recompute: its blocks are freed and it is requeued at the front with its output kept.

A prefill chunk is first cut at `long_prefill_tokens` (a quarter of the budget), so that a
long document in prefill does not take the whole step while short questions wait to be
admitted: every running prefill and every admission of the priority gets its chunk, then the
budget left over lengthens the chunks again, in order. Alone, a long prompt still prefills in
full-budget chunks.

Waiting order: preempted interactive, waiting interactive, preempted background, waiting
background. Within a priority, clients share fairly: the client with the fewest running
requests goes first (oldest request on ties), so one client's fifty requests never push
another client's single request to the back.
"""
from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .request import BACKGROUND, INTERACTIVE, PRIORITIES, Request, RequestRejected, Status


# An interactive answer's first tokens (a tool call streams once its name is out: about 15
# tokens of the generic syntax): while one of them is being decoded, a timed step takes at most
# short_step_extra_tokens of other prefill, and no more than fits in FIRST_TOKENS_STEP_S at the
# measured speed (at least MIN_EXTRA_TOKENS), so those tokens come quickly beside a document
# being read; so does the step that starts a short prompt. 0.1 s of a document a step made a
# warm Home Assistant command's 6 steps 60-70 ms longer each (bench/RESULTS.md).
FIRST_TOKENS = 16
FIRST_TOKENS_STEP_S = 0.03
MIN_EXTRA_TOKENS = 8
# the first SHORT_STEPS_ALONE short steps in a row take no other prefill at all (a command's
# prompt step and its first tokens, ~0.4 s on the 1 B file: 10 tokens of a document in each
# made its first byte ~0.1 s later); a longer run of them (a burst of questions) gives the
# document its FIRST_TOKENS_STEP_S share again, so no burst starves it
SHORT_STEPS_ALONE = 8


@dataclass
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    watermark_frac: float = 0.01
    contiguous: bool = False
    background_share: float = 0.5    # at most this fraction of max_num_seqs runs background work
    # a prefill chunk takes at most this many tokens until every request of its priority had
    # its turn in the step; what budget is left then lengthens the chunks again (None: a
    # quarter of max_num_batched_tokens; 0: no such cap)
    long_prefill_tokens: int | None = None
    # a waiting prompt this short may be admitted ahead of one of its priority that the pool
    # cannot take yet (a home question behind a document), unless that one has waited
    # skip_ahead_max_wait_s already: then nothing passes it, so it is never starved (0: off)
    short_prompt_tokens: int = 256
    skip_ahead_max_wait_s: float = 10.0
    # while more than one request is in the box, a step takes at most about this long: its
    # token budget follows the measured seconds per token (a home question that arrives
    # during a step waits for it, then for its own); None or 0: the full budget always
    step_time_target_s: float | None = 0.5
    # with the step timed: a step that starts a short prompt takes at most this many tokens
    # more of other prefill, so that prompt's first token comes quickly
    short_step_extra_tokens: int = 64
    # an interactive answer's first this many tokens keep a timed step short (FIRST_TOKENS; 0: off)
    first_tokens: int = FIRST_TOKENS



@dataclass
class Batch:
    """One step's work, with the allocator's answer for it."""
    requests: list[Request]
    num_new: list[int]
    input_ids: np.ndarray            # int64 [T]
    positions: np.ndarray            # int64 [T]
    query_start_loc: np.ndarray      # int32 [B+1]
    seq_lens: np.ndarray             # int32 [B]
    block_tables: np.ndarray         # int32 [B, M]
    slot_mapping: np.ndarray         # int64 [T]
    copies: np.ndarray               # int32 [K, 2]
    logits_indices: np.ndarray       # int64 [S]: rows whose next token is sampled
    sampled: list[Request]           # the requests of those rows
    preempted: list[Request] = field(default_factory=list)
    # speculative decoding: request -> the flat rows of its drafted tokens (its first row,
    # the last real token's, is its row in logits_indices); their logits come back too
    spec: dict = field(default_factory=dict)
    # the disk tier: (block id, payload) of blocks whose K/V is read from disk, not computed:
    # their tokens have slots and count in seq_lens but are not rows of the forward
    loads: list = field(default_factory=list)
    # each request's (num_known, num_slots) before the step: what undo_step goes back to
    before: list = field(default_factory=list)
    # bool [B]: the sequence's rows are its prompt's (a prefill chunk), not generated tokens
    prompt: np.ndarray | None = None
    # M-RoPE (Qwen2.5-VL, requests with images): each row's rotary position where it is not
    # its index (int64 [T]: the t of an image's row, the text's shifted past its images), and
    # the image rows' own (rows, int64 [k, 2]: their h and w); None: every row rotates by its index
    rope_positions: np.ndarray | None = None
    mrope: tuple | None = None
    # a step planned ahead (Scheduler.plan_ahead): each row's input is the earlier step's token
    # of this row there (input_ids holds placeholders); None: input_ids are the tokens
    feed: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])


class Row(enum.Enum):
    """What a request's rows in a step are (`Scheduler._build`)."""
    CHUNK = "chunk"                  # prompt tokens (a prefill chunk, or tokens computed again)
    DECODE = "decode"                # the last sampled token
    DRAFTS = "drafts"                # the last sampled token, then its drafts (speculation)
    PROMPT_DRAFTS = "prompt_drafts"  # the prompt's last chunk, then what its format forces first


class _Queue:
    """Waiting requests of one priority: preempted ones first, then fair across clients."""

    def __init__(self):
        self.preempted: deque[Request] = deque()
        self.clients: dict[str, deque[Request]] = {}

    def __len__(self) -> int:
        return len(self.preempted) + sum(len(q) for q in self.clients.values())

    def push(self, req: Request) -> None:
        self.clients.setdefault(req.client, deque()).append(req)

    def push_front(self, req: Request) -> None:
        self.preempted.appendleft(req)

    def peek(self, running_per_client: dict[str, int]) -> Request | None:
        if self.preempted:
            return self.preempted[0]
        best = None
        for client, q in self.clients.items():
            key = (running_per_client.get(client, 0), q[0].arrival)
            if best is None or key < best[0]:
                best = (key, q[0])
        return best[1] if best else None

    def pop(self, req: Request) -> None:
        if self.preempted and self.preempted[0] is req:
            self.preempted.popleft()
            return
        q = self.clients[req.client]
        q.remove(req)
        if not q:
            del self.clients[req.client]

    def waiting(self):
        """Every waiting request, preempted ones first, then by arrival."""
        yield from self.preempted
        yield from sorted((r for q in self.clients.values() for r in q), key=lambda r: r.arrival)

    def remove(self, req: Request) -> bool:
        if req in self.preempted:
            self.preempted.remove(req)
            return True
        q = self.clients.get(req.client)
        if q is not None and req in q:
            self.pop(req)
            return True
        return False


@dataclass
class _Step:
    """One `schedule()` call's working state."""
    budget: int                        # tokens left in the step
    bg_prefill_left: int               # background prefill tokens left in the step
    total: int = 0                     # the step's budget at its start
    timed: bool = False                # cut to the step time target (the box is under load)
    plan: dict = field(default_factory=dict)        # request -> tokens this step
    need: dict = field(default_factory=dict)        # request -> blocks it takes from the pool
    preempted: list = field(default_factory=list)
    kv_bound: bool = False             # the pool held a waiting request back
    short: bool = False                # kept short for a prompt's start or an answer's first tokens


class ScheduleError(Exception):
    """A step's plan failed (the allocator said no where the policy expected room): the
    engine ends `requests` with an error and goes on."""

    def __init__(self, requests: list, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.requests, self.cause = requests, cause


class Scheduler:
    """The policy. Crosses into Rust once per step in the steady state (`prepare_step`, which
    also says how many blocks are free afterwards); blocks a request needs are computed here
    from the scheduler's copy of its block count. Admissions (`prefix_match`,
    `add_sequence`) and frees cross once per request."""

    def __init__(self, allocator, config: SchedulerConfig):
        self.alloc = allocator
        self.config = config
        self.block_size = allocator.block_size
        self.watermark = max(1, int(config.watermark_frac * allocator.num_blocks)) if not config.contiguous else 0
        self.queues = {p: _Queue() for p in PRIORITIES}
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._free_blocks: int | None = None   # known free blocks; None: ask the allocator
        # steps in which the pool (not the token budget, the sequence limit or the arrivals)
        # held a waiting request back, by how many sequences were running then
        self.kv_bound: dict[int, int] = {}
        self.sec_per_token: float | None = None   # measured on steps of 128+ tokens (observe_step)
        self._computes: dict = {}                 # this step's waiting prompts: tokens their prefill computes
        self._short_run = 0                       # short steps planned in a row (_short_extra)
        self.spec = None                          # speculate.Speculation: drafts for decodes (the engine's)
        self.drafter = None                       # draft.Drafter: a draft model's sequences in this pool
        # the runner's ImageTable when its images attend both ways (Gemma 3): a prefill chunk
        # never ends inside an image (its tokens see their whole image: `_whole_images`)
        self.images = None

    # -- queue state ------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.queues.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def blocks_needed(self, req: Request, n: int) -> int:
        """Blocks `prepare_step` takes from the pool for `n` more tokens of a running request
        (new blocks past its table, plus copies of shared blocks it writes into), as the
        allocator counts them: the allocator is the only book of blocks."""
        if n <= 0:
            return 0
        return self.alloc.blocks_needed(req.id, n)

    @property
    def free_blocks(self) -> int:
        if self._free_blocks is None:
            self._free_blocks = self.alloc.num_free_blocks
        return self._free_blocks

    def check(self, req: Request) -> None:
        """Reject up front a request that could never run; raise RequestRejected."""
        cfg = self.config
        n = len(req.prompt_ids)
        if n == 0:
            raise RequestRejected("empty_prompt", "the prompt is empty")
        if n >= cfg.max_model_len:
            raise RequestRejected("prompt_too_long", f"the prompt has {n} tokens; this server's context is "
                                  f"{cfg.max_model_len} tokens (including the answer)")
        win = req.context_window
        if win is not None and (cfg.contiguous or win[1] < 1 or win[0] < 0):
            raise RequestRejected("invalid_params", "the window policy needs a window of at least one token and "
                                  "the paged pool")
        if req.max_total > cfg.max_model_len and win is None:
            raise RequestRejected("context_exceeded", f"prompt ({n} tokens) + max_tokens ({req.params.max_tokens}) "
                                  f"exceeds the context of {cfg.max_model_len} tokens")
        # under the window policy a sequence holds at most about a context's worth at once
        most = req.max_total if win is None else min(req.max_total, cfg.max_model_len)
        usable = self.alloc.num_blocks - self.watermark
        if self._blocks_for(most) > usable:
            raise RequestRejected("kv_capacity", f"prompt + max_tokens needs {self._blocks_for(most)} KV "
                                  f"blocks; the pool has {usable}")

    def add(self, req: Request) -> None:
        """Queue a request (checked: RequestRejected if it could never run)."""
        self.check(req)
        req.status = Status.WAITING
        self.queues[req.priority].push(req)

    def free(self, req: Request, cache: bool) -> None:
        """Take a request out wherever it is. A running one's blocks return to the pool; with
        `cache`, its computed full blocks enter the prefix cache first (pass False when the
        step that was to compute them failed), and its last block's computed tokens (the
        allocator's `tail`: a chat's next turn, an agent's next call, continue them). Call it
        only while no step uses its blocks."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
            self.alloc.free_sequence(req.id, cache, tail=cache)
            self._free_blocks = None
        elif req.status is Status.WAITING:
            self.queues[req.priority].remove(req)
        req.status = Status.FREED
        if self.drafter is not None and self.drafter.drop(req, cache):
            self._free_blocks = None

    def adopt(self, parent: Request, child: Request) -> None:
        """A parallel sample: `child` takes `parent`'s KV blocks as they are (the allocator's
        copy-on-write fork; the shared last block is copied by whichever writes first) and runs
        from here as a request of its own."""
        self.alloc.fork(parent.id, child.id)
        child.num_known, child.num_slots = parent.num_known, parent.num_slots
        child.num_cached, child.admitted, child.first_scheduled = parent.num_cached, True, parent.first_scheduled
        child.released_upto = parent.released_upto
        child.status = Status.RUNNING
        self.running.append(child)
        self._free_blocks = None

    def _reclaim_drafts(self) -> bool:
        """A draft model's sequences are the first blocks taken back when the pool runs short
        (its state is recomputed when it drafts again): whether any went."""
        if self.drafter is not None and self.drafter.drop_all():
            self.drafter.reclaimed += 1
            self._free_blocks = None
            return True
        return False

    def _preempt(self, req: Request) -> None:
        req.disk_tier.loads = None
        self.running.remove(req)
        self.alloc.free_sequence(req.id, tail=True)      # it starts again from what it computed
        if self.drafter is not None:
            self.drafter.drop(req)
        self._free_blocks = None
        req.status = Status.WAITING
        req.num_known = req.num_slots = req.released_upto = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.queues[req.priority].push_front(req)

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        """Plan one step: interactive work first (decodes, prefill chunks, admissions), then
        background work — unless an interactive prefill runs this step: background then
        waits one step, so an interactive request's first token never waits behind it.
        ScheduleError (naming the requests of the failed plan) when the allocator refuses it."""
        budget = self.step_budget()
        self._computes: dict = {}
        step = _Step(budget=budget, total=budget, timed=budget < self.config.max_num_batched_tokens,
                     bg_prefill_left=max(16, budget // 8))
        try:
            return self._schedule(step)
        except Exception as e:
            self._free_blocks = None
            victims = list(step.plan) or list(self.running) or [q.peek({}) for q in self.queues.values() if len(q)]
            raise ScheduleError([r for r in victims if r is not None], e) from e

    def _schedule(self, step: "_Step") -> Batch | None:
        self._release_windows()
        rank = {INTERACTIVE: 0, BACKGROUND: 1}
        self.running.sort(key=lambda r: (rank[r.priority], r.arrival))
        for prio in PRIORITIES:
            self._schedule_running(step, prio, (True,))          # decodes
            first = self.config.first_tokens
            if prio == INTERACTIVE and step.timed and first and any(
                    r.priority == INTERACTIVE and 0 < len(r.output_ids) < first for r in step.plan):
                # an answer's first tokens (a tool call's name): a short step
                step.budget, step.short = min(step.budget, self._short_extra()), True
            if prio == INTERACTIVE:                               # short new prompts before long prefills
                self._admit_overdue(step, prio)                   # (after prompts that waited their limit)
                if self._admit_short(step, prio) and step.timed:
                    # a short prompt's first token comes out of this step: keep it short
                    step.budget, step.short = min(step.budget, self._short_extra()), True
            self._schedule_running(step, prio, (False,))         # prefill chunks of running requests
            self._admit(step, prio)
            self._lengthen_chunks(step, prio)
            if prio == INTERACTIVE and any(not r.is_decoding for r in step.plan):
                break
        if step.kv_bound:
            n = len(self.running)
            self.kv_bound[n] = self.kv_bound.get(n, 0) + 1
        if not step.plan:
            return None
        self._short_run = self._short_run + 1 if step.short else 0
        return self._build(step)

    def _short_extra(self) -> int:
        """Other prefill a short step takes: none in the first SHORT_STEPS_ALONE short steps
        in a row, then short_step_extra_tokens, and no more than fits in FIRST_TOKENS_STEP_S
        at the measured speed (at least MIN_EXTRA_TOKENS)."""
        if self._short_run < SHORT_STEPS_ALONE:
            return 0
        extra = self.config.short_step_extra_tokens
        if self.sec_per_token:
            extra = max(MIN_EXTRA_TOKENS, min(extra, int(FIRST_TOKENS_STEP_S / self.sec_per_token)))
        return extra

    def kv_bound_stats(self) -> dict:
        """What memory allows, whatever the box's speed: in the steps where the pool held a
        waiting request back, how many sequences ran (median and most) and how many such
        steps there were."""
        moments = sum(self.kv_bound.values())
        if not moments:
            return {"kv_bound_moments": 0, "kv_bound_active": None, "kv_bound_active_max": None}
        acc, median = 0, None
        for n in sorted(self.kv_bound):
            acc += self.kv_bound[n]
            if median is None and 2 * acc >= moments:
                median = n
        return {"kv_bound_moments": moments, "kv_bound_active": median, "kv_bound_active_max": max(self.kv_bound)}

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """The engine's measure of a step: steps of 128+ tokens update the seconds per token
        (their fixed cost is small beside the tokens')."""
        if num_tokens >= 128 and seconds > 0:
            x = seconds / num_tokens
            self.sec_per_token = x if self.sec_per_token is None else 0.7 * self.sec_per_token + 0.3 * x

    def step_budget(self) -> int:
        """The step's token budget: the configured one, cut so the step takes about
        step_time_target_s while more than one request is in the box (at least 64 tokens).
        A lone request (a document read alone) keeps the whole budget."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        target, spt = cfg.step_time_target_s, self.sec_per_token
        if target and len(self.running) + self.num_waiting > 1:
            # not measured yet (the first steps): a small step, to measure with
            budget = max(64, min(budget, int(target / spt) if spt else 128))
        return budget

    def _release_windows(self) -> None:
        """The window policy: blocks of running sequences that no later query attends go back
        to the pool before the step is planned (no step uses them now). One call into the
        allocator per sequence and block boundary crossed."""
        bs = self.block_size
        for r in self.running:
            if r.context_window is None:
                continue
            sink, window = r.context_window
            end = (r.num_slots + 1 - window) // bs
            if end > max(r.released_upto, -(-sink // bs)):
                if self.alloc.release_outside(r.id, sink, window):
                    self._free_blocks = None
                r.released_upto = end

    def _chunk_budget(self, step: _Step, prio: str) -> int:
        """Background prefill takes at most an eighth of the step budget per step, all
        background requests together, so an interactive request arriving meanwhile waits for
        a short step, not a long one: on a CPU a step costs about its token count, so the cap
        costs background work little throughput and bounds how long the in-flight step holds
        a new interactive prompt back. (A cap per request was not enough: eight background
        chunks filled a whole step, and an interactive prompt arriving then waited for it.)"""
        if prio == BACKGROUND:
            return min(step.budget, step.bg_prefill_left)
        return step.budget

    def _first_chunk(self, step: _Step, prio: str) -> int:
        """The most a prefill chunk gets before the leftover pass: the long-prefill cap."""
        cap = self.config.long_prefill_tokens
        if cap is None:
            cap = max(16, self.config.max_num_batched_tokens // 4)
        return min(self._chunk_budget(step, prio), cap) if cap > 0 else self._chunk_budget(step, prio)

    def _lengthen_chunks(self, step: _Step, prio: str) -> None:
        """Budget left after every running prefill and admission of `prio` got its (cut)
        chunk goes back to those chunks, in plan order, as far as free blocks allow."""
        for req in list(step.plan):
            if req.priority != prio or req.is_decoding or self._chunk_budget(step, prio) <= 0:
                continue
            n = step.plan[req]
            extra = min(req.num_known - req.num_slots - n, self._chunk_budget(step, prio))
            extra = self._whole_images(req, req.num_slots, n + extra) - n
            if extra <= 0:
                continue
            k = self.blocks_needed(req, n + extra)
            if k - step.need[req] > self._free(step) - self.watermark:
                continue
            step.plan[req], step.need[req] = n + extra, k
            self._planned(step, req, extra)

    def _whole_images(self, req: Request, start: int, n: int) -> int:
        """A prefill chunk of `n` tokens from `start`, cut before an image it would end inside
        of (or, starting at one, taken to that image's end): an image whose tokens attend both
        ways is computed in one step."""
        if self.images is None or not self.images.both_ways or req.images.held is None or n <= 0:
            return n
        if req.images.spans is None:
            ids = np.asarray(req.prompt_ids, np.int64)
            pic = ids >= self.images.first
            edges = np.flatnonzero(np.diff(np.concatenate([[0], pic.astype(np.int8), [0]])))
            base = (ids - self.images.first) // (1 << 12)
            spans = []
            for a, b in zip(edges[::2], edges[1::2]):   # runs of image ids, split where the image changes
                cut = [a] + [int(i) for i in range(a + 1, b) if base[i] != base[i - 1]] + [b]
                spans += list(zip(cut[:-1], cut[1:]))
            req.images.spans = [(int(a), int(b)) for a, b in spans]
        end = start + n
        for a, b in req.images.spans:
            if a < end < b:
                return a - start if a > start else b - start
        return n

    @staticmethod
    def _planned(step: _Step, req: Request, n: int) -> None:
        step.budget -= n
        if req.priority == BACKGROUND and not req.is_decoding:
            step.bg_prefill_left -= n

    def _free(self, step: _Step) -> int:
        return self.free_blocks - sum(step.need.values())

    def _preempt_in_step(self, step: _Step, victim: Request) -> None:
        if victim in step.plan:
            self._planned(step, victim, -step.plan.pop(victim))
        step.need.pop(victim, None)
        self._preempt(victim)
        step.preempted.append(victim)

    def _schedule_running(self, step: _Step, prio: str, kinds=(True, False)) -> None:
        """Running sequences of one priority: decodes (kind True), prefill chunks (False). A
        sequence that cannot get its blocks preempts the lowest ranked running one not yet planned."""
        for decoding in kinds:
            for req in list(self.running):
                if (req.priority != prio or req.status is not Status.RUNNING or req in step.plan
                        or req.is_decoding != decoding):
                    continue
                n = 1 if decoding else self._whole_images(req, req.num_slots, min(req.num_known - req.num_slots,
                                                                                   self._first_chunk(step, prio)))
                if n <= 0:
                    continue
                # drafts ride behind the last sampled token as it enters the sequence; a recomputed
                # request's last token is in it already (its prefill put every token there): no
                # drafts, one row (`_build` would otherwise plan rows the sequence has no tokens for)
                req.drafting.drafts = self._drafts(step, req) if decoding and req.num_known == req.num_tokens - 1 else []
                if req.drafting.drafts:
                    k = self.blocks_needed(req, 1 + len(req.drafting.drafts))
                    if k <= self._free(step) - self.watermark:
                        n = 1 + len(req.drafting.drafts)
                        step.plan[req], step.need[req] = n, k
                        self._planned(step, req, n)
                        continue
                    req.drafting.drafts = []                   # no room for them: a plain decode
                k = self.blocks_needed(req, n)
                while k > self._free(step):
                    if self._reclaim_drafts():
                        continue
                    victims = [r for r in self.running if r is not req and r not in step.plan]
                    victim = victims[-1] if victims else req
                    self._preempt_in_step(step, victim)
                    if victim is req:
                        break
                if req.status is Status.RUNNING:
                    step.plan[req], step.need[req] = n, k
                    self._planned(step, req, n)

    def _prefill_drafts(self, step: _Step, req: Request, n: int) -> list[int]:
        """The tokens its format forces first, when this chunk of `n` ends `req`'s prompt
        (`req.drafting.chain`, from its grammar's compile off the loop: the forced lead certain to be
        kept, then the chain's guesses), drafts of the chunk as the pool allows; also when the
        step reads the prompt's blocks from the disk tier (`_build` drops the loaded tokens'
        rows first: the drafts follow the computed ones)."""
        spec, f = self.spec, req.drafting.chain
        if (f is None or spec is None or f[0] != req.num_tokens or req.num_known != req.num_tokens
                or req.num_slots + n != req.num_tokens or not spec.eligible(req)
                or len(self.running) > spec.config.max_running):
            return []
        _, chain, lead, certain = f       # (its guesses were held to k when it was made)
        left = min(len(chain), req.params.max_tokens - len(req.output_ids) - 1,
                   self.config.max_model_len - req.num_tokens - 1)
        if left <= 0:
            return []
        k = self.blocks_needed(req, n + left)
        if k - step.need.get(req, 0) > self._free(step) - self.watermark:
            return []
        step.need[req] = k
        req.drafting.forced = min(left, lead)
        req.drafting.certain = list(certain[:left])
        return list(chain[:left])

    @staticmethod
    def _draft_rows(r: Request, at: int) -> list[int]:
        """The positions whose logits check `r`'s drafts (its draft i's row at `at + i - 1`
        checks draft i, the last one draws the token after them): all but those of drafts its
        format forces after the ones before them (`drafts_certain`: no row, no lm_head).
        `r.drafting.have` says which (1-based) rows are there."""
        k, certain = len(r.drafting.drafts), r.drafting.certain
        r.drafting.have = [i for i in range(1, k + 1) if not (i < k and i < len(certain) and certain[i])]
        return [at + i - 1 for i in r.drafting.have]

    def _drafts(self, step: _Step, req: Request) -> list[int]:
        """Speculation's drafts for a decode: only while few sequences run, within the step's
        budget (one token kept for each other decode) and the context."""
        spec = self.spec
        if spec is None or not spec.eligible(req) or len(self.running) > spec.config.max_running:
            return []
        room = min(step.budget - len(self.running), self.config.max_model_len - req.num_tokens - 1)
        return spec.drafts_for(req, room) if room > 0 else []

    def _admit(self, step: _Step, prio: str) -> None:
        cfg = self.config
        queue = self.queues[prio]
        running_per_client: dict[str, int] = {}
        for r in self.running:
            running_per_client[r.client] = running_per_client.get(r.client, 0) + 1
        limit = cfg.max_num_seqs
        if prio == BACKGROUND:   # keep room for interactive arrivals
            limit = max(1, int(cfg.max_num_seqs * cfg.background_share))
        while self._chunk_budget(step, prio) > 0:
            req = queue.peek(running_per_client)
            if req is None or req in step.preempted:
                return
            if cfg.contiguous:
                reserve = req.reserve_tokens = min(req.max_total, cfg.max_model_len)
                k = self.alloc.admission_blocks(req.all_ids, req.salt, 0, reserve)
            else:
                reserve = None
                _, k = self._admission(req, self._first_chunk(step, prio))
            same_prio = sum(r.priority == prio for r in self.running)
            full = len(self.running) >= cfg.max_num_seqs or same_prio >= limit
            pool_short = k > self._free(step) - self.watermark
            if pool_short and not full and self._reclaim_drafts():
                continue
            step.kv_bound |= pool_short and not full
            if full or pool_short:
                # an interactive request may take the place of running background work
                victims = [r for r in self.running if r.priority == BACKGROUND] if prio == INTERACTIVE else []
                if victims:
                    self._preempt_in_step(step, victims[-1])
                    continue
                return
            self._start(step, queue, req, reserve)
            running_per_client[req.client] = running_per_client.get(req.client, 0) + 1

    def _admission(self, req: Request, most: int) -> tuple[int, int]:
        """Admitting `req` now with a first chunk of at most `most` tokens: (that chunk, the
        blocks it takes from the pool: its new blocks and the cached ones it takes out of the
        free list)."""
        cached = self.alloc.prefix_match(req.all_ids, req.salt)[0]
        loaded = self._disk_tokens(req, cached)
        n = min(len(req.all_ids) - cached - loaded, most)
        n = max(self._whole_images(req, cached + loaded, n), 0)     # (the chunk `_start` will plan)
        return n, self.alloc.admission_blocks(req.all_ids, req.salt, loaded + n, partial=self._partial(req))

    @staticmethod
    def _partial(req: Request) -> bool:
        """Whether `req` may start from part of a cached block (the allocator's `partial`):
        past its cached full blocks, the leading tokens a cached block that continues them
        shares with it (a Home Assistant command's template tokens before the spoken words:
        2,181 of 2,195 tokens shared, 2,176 in whole blocks). Not with blocks the disk tier
        read (they start at a block boundary)."""
        return req.disk_tier.found is None

    def _disk_tokens(self, req: Request, cached: int) -> int:
        """Tokens of `req`'s prompt past the RAM cache's `cached` that the disk tier found."""
        if req.disk_tier.found is None or cached % self.block_size:
            return 0
        start, blocks = req.disk_tier.found
        first = cached // self.block_size
        if not start <= first < start + len(blocks):
            return 0
        return (start + len(blocks) - first) * self.block_size

    def _start(self, step: _Step, queue: _Queue, req: Request, reserve: int | None, first: int | None = None) -> None:
        """Admit `req`: its sequence in the allocator (the prefix cache's blocks shared), its
        first chunk in the step (`first` tokens, else the long-prefill cut)."""
        tokens = req.all_ids
        queue.remove(req)
        cached = self.alloc.add_sequence(req.id, tokens, req.salt, reserve, partial=reserve is None and self._partial(req))
        self._free_blocks = None
        loaded = self._disk_tokens(req, cached) if reserve is None else 0
        if loaded:       # the disk tier's blocks: their K/V is read into the step's new blocks
            start, blocks = req.disk_tier.found
            req.disk_tier.loads = blocks[cached // self.block_size - start:]
        req.disk_tier.found = None
        if not req.admitted:
            req.num_cached = cached + loaded
            req.admitted = True
        req.num_known, req.num_slots, req.released_upto = len(tokens), cached, 0
        req.status = Status.RUNNING
        self.running.append(req)
        n = min(len(tokens) - cached - loaded, self._first_chunk(step, req.priority) if first is None else first)
        n = max(self._whole_images(req, cached + loaded, n), 0)
        step.plan[req] = loaded + n
        step.need[req] = self.blocks_needed(req, loaded + n)
        self._planned(step, req, n)

    def _admit_short(self, step: _Step, prio: str) -> bool:
        """New short prompts (a home question) start before the running requests' long
        prefills take the step, and ahead of a waiting prompt the pool cannot take yet: fair
        across clients, up to half the step's budget (one longer than what is left starts with
        its first part), as the pool allows. Long prompts then share what is left, as before;
        once one has waited skip_ahead_max_wait_s it starts first (`_admit_overdue`), and if
        the pool cannot take it nothing goes ahead of it, so short ones cannot starve it."""
        cfg = self.config
        if cfg.short_prompt_tokens <= 0 or cfg.contiguous:
            return False
        # up to half the step; a timed step lets them have half the configured budget still (a
        # burst of home questions starts together), and keeps the rest of it short
        half = (cfg.max_num_batched_tokens if step.timed else step.total) // 2
        queue, cap = self.queues[prio], half if step.timed else min(step.budget, half)
        if any(self._to_compute(r) > cfg.short_prompt_tokens and not self._may_pass(r) for r in queue.waiting()):
            return False                # a long prompt has waited its limit: nothing goes ahead of it
        per_client: dict[str, int] = {}
        for r in self.running:
            per_client[r.client] = per_client.get(r.client, 0) + 1
        # in a timed step, short is also at most the step's budget: a document whose prefix is
        # cached (220 of 492 tokens to compute) started beside a home command made its step
        # 0.6 s at 0.25 s steps; it starts as long prompts do, after them, in a short step
        short = min(cfg.short_prompt_tokens, step.total) if step.timed else cfg.short_prompt_tokens
        candidates = [r for r in queue.waiting() if self._to_compute(r) <= short and r not in step.preempted]
        started = False
        while candidates and len(self.running) < cfg.max_num_seqs:
            # fair across clients, as the queue is: the client running least first, then the
            # shortest prompt to compute (a home question before a chat turn), then arrival
            req = min(candidates, key=lambda r: (per_client.get(r.client, 0), self._to_compute(r), r.arrival))
            candidates.remove(req)
            n, k = self._admission(req, cap)           # a prompt longer than what is left: its first part
            if n <= 0:
                break
            if k > self._free(step) - self.watermark and not (self._reclaim_drafts()
                                                               and k <= self._free(step) - self.watermark):
                step.kv_bound = True
                continue
            self._start(step, queue, req, None, first=n)
            per_client[req.client] = per_client.get(req.client, 0) + 1
            cap -= n
            started = True
        return started

    def _admit_overdue(self, step: _Step, prio: str) -> None:
        """Long prompts that have waited skip_ahead_max_wait_s start first, oldest first, as
        the budget and the pool allow: short prompts may then still take what is left of the
        step (they cannot starve one that is running). One the pool cannot take yet keeps
        every short prompt behind it (`_admit_short`)."""
        cfg = self.config
        if cfg.short_prompt_tokens <= 0 or cfg.contiguous:
            return
        queue = self.queues[prio]
        overdue = sorted((r for r in queue.waiting() if self._to_compute(r) > cfg.short_prompt_tokens
                          and not self._may_pass(r) and r not in step.preempted), key=lambda r: r.arrival)
        for req in overdue:
            if len(self.running) >= cfg.max_num_seqs or self._chunk_budget(step, prio) <= 0:
                return
            k = self._admission(req, self._first_chunk(step, prio))[1]
            if k > self._free(step) - self.watermark and not (self._reclaim_drafts()
                                                               and k <= self._free(step) - self.watermark):
                step.kv_bound = True
                return
            self._start(step, queue, req, None)

    def _to_compute(self, req: Request) -> int:
        """The tokens a waiting request's prefill computes: its prompt less what the prefix
        cache holds (Home Assistant's 2,000-token prompt with a new spoken command is a short
        prompt once its prefix is cached)."""
        n = len(req.all_ids)
        if n <= self.config.short_prompt_tokens or not self.alloc.enable_prefix_caching:
            return n
        if req not in self._computes:     # once a step: the short-prompt passes ask several times
            cached = self.alloc.prefix_match(req.all_ids, req.salt)[0]
            self._computes[req] = n - cached - self._disk_tokens(req, cached)
        return self._computes[req]

    def _may_pass(self, head: Request) -> bool:
        """Whether short prompts may go ahead of `head` (it has not waited too long)."""
        cfg = self.config
        return cfg.short_prompt_tokens > 0 and time.monotonic() - head.arrival < cfg.skip_ahead_max_wait_s

    def undo_step(self, batch: Batch) -> None:
        """A step stopped before it sampled (StepInterrupted): each of its requests goes back
        to what it had before it — the token a decode appended, the slots the step reserved
        and the blocks past them — so the next plan computes that work again."""
        for r, (known, slots) in zip(batch.requests, batch.before):
            if self.alloc.has_sequence(r.id):
                self.alloc.undo_step(r.id, known, slots)
            r.num_known, r.num_slots = known, slots
            r.drafting.drafts, r.drafting.forced, r.drafting.certain = [], 0, []
        self._free_blocks = None

    def plan_ahead(self, prev: Batch, plain) -> Batch | None:
        """The next step of `prev`'s decodes, planned while `prev` runs, before its tokens are
        known (look-ahead decode; vLLM's async scheduling): each row's input is `prev`'s token
        of its request (`Batch.feed`: its row there; the allocator holds a placeholder until
        `learn_ahead`). None unless it is the step `schedule` would plan once those tokens
        are in: every running request decodes one plain token (`plain(req)`) in `prev` and
        goes on after it (not at its length limit), nothing waits, no drafts could come (no
        draft model; lookup speculation only while more requests run than it drafts for),
        the pool has the blocks (no preemption)."""
        if self.num_waiting or self.drafter is not None or not self.running:
            return None
        if self.spec is not None and len(self.running) <= self.spec.config.max_running:
            return None          # (speculation's drafts, which hang on the pending tokens, may come)
        rows = {r: j for j, r in enumerate(prev.sampled)}
        if len(prev.sampled) != len(prev.requests) or prev.spec or prev.loads:
            return None
        reqs = []
        for req in self.running:
            if req not in rows or req.finished or req.status is not Status.RUNNING or not plain(req):
                return None
            if req.num_known != req.num_tokens or req.num_slots != req.num_tokens:   # (prev's decode, token pending)
                return None
            if len(req.output_ids) + 1 >= req.params.max_tokens or req.num_tokens + 1 >= self.config.max_model_len:
                return None       # its pending token may be its last: the next plan is decided by it
            reqs.append(req)
        rank = {INTERACTIVE: 0, BACKGROUND: 1}
        reqs.sort(key=lambda r: (rank[r.priority], r.arrival))
        need = sum(self.blocks_needed(r, 1) for r in reqs)
        if need > self.free_blocks - self.watermark:
            return None
        n = len(reqs)
        before = [(r.num_known, r.num_slots) for r in reqs]
        slot_mapping, block_tables, seq_lens, copies, self._free_blocks = self.alloc.prepare_step(
            np.array([r.id for r in reqs], dtype=np.int64), np.ones(n, dtype=np.int64), np.zeros(n, dtype=np.int64))
        positions = np.array([r.num_slots for r in reqs], dtype=np.int64)
        for r in reqs:
            r.num_known += 1
            r.num_slots += 1
        batch = Batch(reqs, [1] * n, np.zeros(n, dtype=np.int64), positions, np.arange(n + 1, dtype=np.int32),
                      seq_lens, block_tables, slot_mapping, copies, np.arange(n, dtype=np.int64), list(reqs),
                      before=before, prompt=np.zeros(n, dtype=bool))
        batch.feed = np.array([rows[r] for r in reqs], dtype=np.int64)
        return batch

    def learn_ahead(self, batch: Batch, tokens: list) -> list:
        """`batch` was planned ahead (plan_ahead): the tokens it was fed are known now (the
        earlier step's, by row); the allocator takes each in its placeholder's place. Returns
        the requests whose token did not come (that row failed): their blocks must not be cached."""
        failed = []
        for req, j, pos in zip(batch.requests, batch.feed, batch.positions):
            tok = tokens[int(j)]
            tok = tok[0] if isinstance(tok, tuple) else tok
            if isinstance(tok, (int, np.integer)) and self.alloc.has_sequence(req.id):
                self.alloc.set_token(req.id, int(pos), int(tok))
            else:
                failed.append(req)
        return failed

    def _build(self, step: _Step) -> Batch:
        reqs = list(step.plan)
        before = [(r.num_known, r.num_slots) for r in reqs]
        num_new = [step.plan[r] for r in reqs]
        last = [r.output_ids[-1] if r.num_known == r.num_tokens - 1 else None for r in reqs]
        kinds = [Row.CHUNK if t is None else Row.DECODE for t in last]
        for i, r in enumerate(reqs):
            if r.drafting.drafts and kinds[i] is Row.DECODE and num_new[i] == 1 + len(r.drafting.drafts):
                # the last token and the drafts enter the sequence; the rejected ones leave it after
                # the step (the allocator's truncate), never reaching the prefix cache
                self.alloc.append_tokens(r.id, [last[i]] + r.drafting.drafts)
                kinds[i] = Row.DRAFTS
            elif kinds[i] is Row.CHUNK and (forced := self._prefill_drafts(step, r, num_new[i])):
                # the chunk that ends the prompt: what the format forces first (`{"` of a JSON
                # answer) rides along as drafts, so its last row draws the format's first choice
                self.alloc.append_tokens(r.id, forced)
                r.drafting.drafts = forced
                num_new[i] += len(forced)
                kinds[i] = Row.PROMPT_DRAFTS
            else:
                r.drafting.drafts = []
        # the allocator appends a decode's last token itself (-1: none to append)
        appended = [last[i] if kinds[i] is Row.DECODE else -1 for i in range(len(reqs))]
        slot_mapping, block_tables, seq_lens, copies, self._free_blocks = self.alloc.prepare_step(
            np.array([r.id for r in reqs], dtype=np.int64), np.array(num_new, dtype=np.int64),
            np.array(appended, dtype=np.int64))
        loads = []
        if any(r.disk_tier.loads for r in reqs):
            # tokens whose K/V the disk tier read: slots and context, no rows of the forward
            keep = np.ones(len(slot_mapping), dtype=bool)
            at = 0
            for i, r in enumerate(reqs):
                n = num_new[i]
                if r.disk_tier.loads:
                    k = len(r.disk_tier.loads) * self.block_size
                    loads += [(int(slot_mapping[at + j * self.block_size]) // self.block_size, data)
                              for j, data in enumerate(r.disk_tier.loads)]
                    keep[at:at + k] = False
                    r.num_slots += k
                    r.disk_tier.loads = None
                    num_new[i] = n - k
                at += n
            slot_mapping = slot_mapping[keep]
        total = sum(num_new)
        input_ids = np.empty(total, dtype=np.int64)
        positions = np.empty(total, dtype=np.int64)
        qsl = np.zeros(len(reqs) + 1, dtype=np.int32)
        logits_indices, sampled, spec = [], [], {}
        t = 0
        for i, (r, n, kind) in enumerate(zip(reqs, num_new, kinds)):
            start = r.num_slots
            if kind is Row.DRAFTS:            # a decode with drafts: the last token, then the drafts
                r.num_known += 1
                input_ids[t:t + n] = [r.output_ids[-1]] + r.drafting.drafts
                logits_indices.append(t)
                sampled.append(r)
                spec[r] = self._draft_rows(r, t + 1)
            elif kind is Row.PROMPT_DRAFTS:   # the prompt's last chunk, then the forced drafts
                p = n - len(r.drafting.drafts)
                input_ids[t:t + p] = r.all_ids[start:start + p]
                input_ids[t + p:t + n] = r.drafting.drafts
                logits_indices.append(t + p - 1)
                sampled.append(r)
                spec[r] = self._draft_rows(r, t + p)
            elif kind is Row.DECODE:
                r.num_known += 1
            if kind in (Row.DRAFTS, Row.PROMPT_DRAFTS):
                pass
            elif n == 1 and kind is Row.DECODE:
                input_ids[t] = last[i]
            else:
                input_ids[t:t + n] = r.all_ids[start:start + n]
            positions[t:t + n] = np.arange(start, start + n)
            r.num_slots += n
            t += n
            qsl[i + 1] = t
            if kind not in (Row.DRAFTS, Row.PROMPT_DRAFTS) and r.num_slots == r.num_tokens:
                logits_indices.append(t - 1)
                sampled.append(r)
        prompt = np.array([kind in (Row.CHUNK, Row.PROMPT_DRAFTS) for kind in kinds], dtype=bool)
        batch = Batch(reqs, num_new, input_ids, positions, qsl, seq_lens, block_tables, slot_mapping, copies,
                      np.array(logits_indices, dtype=np.int64), sampled, step.preempted, spec, loads, before, prompt)
        if self.images is not None and self.images.mrope:
            self._mrope(batch)
        return batch

    def _mrope(self, batch: Batch) -> None:
        """The batch's M-RoPE positions (Batch.rope_positions, Batch.mrope) for its requests
        whose prompts hold images; the others rotate by their index."""
        from ..model.image_table import mrope_positions, mrope_rows
        rope, rows, hw = None, [], []
        for i, r in enumerate(batch.requests):
            if r.images.held is None:
                continue
            if r.images.rope is None:
                r.images.rope = mrope_positions(self.images, r.prompt_ids) or (np.zeros((0, 3), np.int64), 0)
            if not r.images.rope[1] and not len(r.images.rope[0]):
                continue
            if rope is None:
                rope = batch.positions.copy()
            a, b = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
            rope[a:b], own, got = mrope_rows(r.images.rope, batch.positions[a:b])
            rows.append(a + np.flatnonzero(own))
            hw.append(got)
        if rope is not None:
            batch.rope_positions = rope
            if rows and sum(len(x) for x in rows):
                batch.mrope = (np.concatenate(rows), np.concatenate(hw))
