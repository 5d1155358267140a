"""Speculative decoding with a draft model: a small model with the target's tokenizer (the
embedded SmolLM2-135M for a larger SmolLM2, a 0.5 B Qwen for a larger Qwen) guesses each
drafting request's next k tokens between two steps of the target, which then checks them all
in one forward (`speculate.verify`: the answer is the target's, token for token).

The draft's KV lives in the target's pool. Its runner holds a cache of its own shape with as
many blocks as the target's, and a draft sequence takes block ids from the one allocator,
so its blocks are counted with everyone else's (`/stats` kv_blocks_used) and are the first
the scheduler takes back when the pool runs short (`Scheduler._reclaim_drafts`: a draft's
state is recomputed, never needed). Its sequences carry a salt of their own (the target's
salt mixed with `DRAFT_SALT`): a prefix hit never serves the draft's K/V to the target or the
target's to the draft, and per-user isolation holds for both.

One round, after each target step (`Engine._draft_round`), for the requests that draft:

    begin()        on the event loop: each draft sequence follows its request's tokens (cut
                   at the first token it guessed wrong, the new ones appended), slots for
                   the tokens it has not computed (at most CATCHUP_MAX a round)
    run()          in a worker thread: one forward over those tokens, then one per further
                   guess, each guess the draft's most likely token (the slots of each
                   further guess reserved on the event loop through trio.from_thread)

The guesses are kept on the request (`proposal`, for the tokens it had then); the scheduler's
next plan takes up to k of them as that step's drafts (`Speculation.drafts_for`).
"""
from __future__ import annotations

import logging

import numpy as np

from ..model.sampler import as_array

log = logging.getLogger("edgepaged.engine")

DRAFT_SEQ_BASE = 1 << 48            # a draft sequence's id in the allocator: this + the request's id
DRAFT_SALT = 0x9E3779B97F4A7C15     # mixed into the request's salt: the draft's prefix cache is its own
CATCHUP_MAX = 512                   # the most tokens a draft computes for one request in one round


class DraftError(ValueError):
    """A draft model that cannot draft for this target (another tokenizer, a pool too small)."""


def check_pair(target, draft) -> None:
    """DraftError unless `draft` can draft for `target`: the same tokens for the same text
    (one vocabulary), the same stop tokens, and a cache of at least the target's blocks."""
    tt, dt = target.tokenizer, draft.tokenizer
    sample = ("Turn on the kitchen lights at 7:30, please! Übermorgen regnet es. 東京は晴れ。 "
              "def f(x):\n    return x ** 2  # 😀")
    if tt.encode(sample, add_special_tokens=False) != dt.encode(sample, add_special_tokens=False):
        raise DraftError(f"the draft model {draft.model_path.name} has another tokenizer than "
                         f"{target.model_path.name}: a draft model must share the target's vocabulary")
    if set(dt.stop_token_ids) != set(tt.stop_token_ids):
        raise DraftError(f"the draft model {draft.model_path.name} stops on other tokens than "
                         f"{target.model_path.name}")
    if draft.embedding_only:
        raise DraftError(f"{draft.model_path.name} is an embedding model: it cannot draft tokens")
    if draft.num_blocks < target.num_blocks or draft.block_size != target.block_size:
        raise DraftError("the draft model's cache needs as many blocks of the same size as the target's")


class Drafter:
    """The draft model's side of speculation: its sequences in the target's allocator and its
    rounds of guesses. Everything but `run` is called on the event loop."""

    def __init__(self, runner, allocator, max_model_len: int):
        self.runner = runner
        self.alloc = allocator
        self.max_model_len = max_model_len
        self.seqs: dict = {}              # request -> its draft sequence's id
        self.busy = False                 # a round runs: drops wait for its end
        self._drop_later: list = []
        self.rounds = 0
        self.tokens_computed = 0          # tokens the draft model ran (catch-up and guesses)
        self.reclaimed = 0                # times the scheduler took the draft's blocks back
        self.seconds = 0.0                # spent in rounds (the draft's forwards)
        self.name = runner.model_path.name

    # -- sequences --------------------------------------------------------------------------
    def holds(self) -> bool:
        return bool(self.seqs)

    def drop(self, req, cache: bool = True) -> bool:
        """Give back `req`'s draft sequence (its computed full blocks cached under the draft's
        salt); after the round when one runs. Whether blocks went back now."""
        if req not in self.seqs:
            return False
        if self.busy:
            self._drop_later.append(req)
            return False
        seq = self.seqs.pop(req)
        if self.alloc.has_sequence(seq):
            self.alloc.free_sequence(seq, cache)
        req.drafting.proposal = None
        return True

    def drop_all(self, keep=()) -> bool:
        """Give back every draft sequence but those of `keep`: whether any went."""
        freed = False
        for req in list(self.seqs):
            if req not in keep:
                freed |= self.drop(req)
        return freed

    # -- a round ----------------------------------------------------------------------------
    def begin(self, wanted: list, free_floor: int) -> list:
        """On the event loop: bring each wanted request's draft sequence up to its tokens and
        reserve this round's first forward. `wanted`: (request, k) pairs. Keeps the pool's
        free blocks at `free_floor` or more (a request the pool cannot draft for this round
        drafts nothing). Returns the round's plan: [(request, seq id, k, first tokens, start
        position)], their slots reserved in one `prepare_step` (`self._first`)."""
        plan = []
        room = self.alloc.num_free_blocks - free_floor
        for req, k in wanted:
            tokens = req.all_ids
            seq = self.seqs.get(req)
            if seq is None:
                seq = DRAFT_SEQ_BASE + req.id
                if self.alloc.has_sequence(seq):           # left by an earlier failure
                    self.alloc.free_sequence(seq, False)
                self.alloc.add_sequence(seq, tokens, (req.salt ^ DRAFT_SALT) & 0xFFFFFFFFFFFFFFFF)
                self.seqs[req] = seq
            else:
                had = self.alloc.seq_tokens(seq)
                same = _common_prefix(had, tokens)
                if same == 0:                               # nothing in common (cannot happen for a request)
                    self.alloc.free_sequence(seq, True)
                    self.alloc.add_sequence(seq, tokens, (req.salt ^ DRAFT_SALT) & 0xFFFFFFFFFFFFFFFF)
                else:
                    if same < len(had):
                        self.alloc.truncate(seq, same)      # its wrong guesses go
                    if same < len(tokens):
                        self.alloc.append_tokens(seq, tokens[same:])
            start = self.alloc.seq_num_slots(seq)
            n = min(len(tokens) - start, CATCHUP_MAX)
            if n <= 0:                                      # (a truncate inside a cached block recomputes)
                continue
            k = k if start + n == len(tokens) else 0        # still catching up: no guesses this round
            need = self.alloc.blocks_needed(seq, n + max(k - 1, 0))
            if need > room:
                continue
            room -= need
            plan.append((req, seq, k, tokens[start:start + n], start))
        if not plan:
            return []
        self._first = self.alloc.prepare_step(np.array([p[1] for p in plan], np.int64),
                                              np.array([len(p[3]) for p in plan], np.int64))
        self.busy = True
        return plan

    def _next(self, seqs: list, tokens: list):
        """On the event loop (from the round's thread): the next guess of each sequence
        enters it and gets its slot. None when the round should stop (a sequence went)."""
        if any(not self.alloc.has_sequence(s) for s in seqs):
            return None
        return self.alloc.prepare_step(np.array(seqs, np.int64), np.ones(len(seqs), np.int64),
                                       np.array(tokens, np.int64))

    def run(self, plan: list, trio_token=None, stops=frozenset()) -> dict:
        """In a worker thread: the round's forwards. Returns {request: guesses}."""
        import time
        t0 = time.perf_counter()
        try:
            return self._run(plan, trio_token, stops)
        finally:
            self.seconds += time.perf_counter() - t0

    def _run(self, plan: list, trio_token, stops) -> dict:
        self.rounds += 1
        slots, tables, seq_lens, copies, _ = self._first
        self._first = None
        if len(copies):
            self.runner.copy_blocks(copies)
        ids = np.concatenate([np.asarray(p[3], np.int64) for p in plan])
        pos = np.concatenate([np.arange(p[4], p[4] + len(p[3]), dtype=np.int64) for p in plan])
        qsl = np.concatenate([[0], np.cumsum([len(p[3]) for p in plan])]).astype(np.int32)
        logits = as_array(self.runner.execute(ids, pos, dict(query_start_loc=qsl, seq_lens=seq_lens,
                                                             block_tables=tables, slot_mapping=slots),
                                              qsl[1:] - 1))
        self.tokens_computed += len(ids)
        guesses = {p[0]: [] for p in plan}
        live = []                              # (request, seq, k, position of its next guess)
        for row, (req, seq, k, toks, start) in enumerate(plan):
            if k <= 0:
                continue
            t = int(np.argmax(logits[row]))
            guesses[req].append(t)
            if k > 1 and t not in stops:
                live.append((req, seq, k, start + len(toks)))
        while live:
            step = (self._next([x[1] for x in live], [guesses[x[0]][-1] for x in live]) if trio_token is None
                    else _from_thread(self._next, [x[1] for x in live],
                                                   [guesses[x[0]][-1] for x in live], trio_token=trio_token))
            if step is None:
                break
            slots, tables, seq_lens, copies, _ = step
            if len(copies):
                self.runner.copy_blocks(copies)
            n = len(live)
            ids = np.array([guesses[x[0]][-1] for x in live], np.int64)
            pos = np.array([x[3] for x in live], np.int64)
            qsl = np.arange(n + 1, dtype=np.int32)
            logits = as_array(self.runner.execute(ids, pos, dict(query_start_loc=qsl, seq_lens=seq_lens,
                                                                 block_tables=tables, slot_mapping=slots),
                                                  np.arange(n)))
            self.tokens_computed += n
            nxt = []
            for row, (req, seq, k, p) in enumerate(live):
                t = int(np.argmax(logits[row]))
                guesses[req].append(t)
                if len(guesses[req]) < k and t not in stops:
                    nxt.append((req, seq, k, p + 1))
            live = nxt
        return guesses

    def finish(self, plan: list, guesses: dict | None) -> None:
        """On the event loop after `run`: each request keeps its guesses for the tokens it has
        (None: the round failed, its sequences go uncached)."""
        for req, seq, k, toks, start in plan:
            got = (guesses or {}).get(req)
            # guesses follow the tokens the round saw (all of them: it drafts only when caught up)
            req.drafting.proposal = (start + len(toks), got) if got else None
        self.busy = False
        later, self._drop_later = self._drop_later, []
        failed = {r for r, *_ in plan} if guesses is None else set()
        for req in later + [r for r in failed if r not in later]:
            self.drop(req, cache=req not in failed)

    def stats(self) -> dict:
        return {"model": self.name, "rounds": self.rounds, "tokens_computed": self.tokens_computed,
                "sequences": len(self.seqs), "reclaimed": self.reclaimed,
                "seconds": round(self.seconds, 3)}


def _from_thread(fn, *args, trio_token):
    import trio
    return trio.from_thread.run_sync(fn, *args, trio_token=trio_token)


def _common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    return int(np.argmax(x != y))
