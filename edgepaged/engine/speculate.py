"""Speculative decoding by prompt lookup: a request's next tokens guessed from its own text
(an n-gram of its last tokens found earlier in the prompt or the answer: a summary quotes its
document, an edit repeats it, a tool call echoes names from the prompt), all checked in one
forward of the model (a short prefill over the paged cache), the longest correct run kept
plus the model's own next token. One read of the weights then yields several tokens where a
plain step yields one: past the memory wall of one stream.

    drafts = propose(req.all_ids, k)                  # [] when nothing matches
    tokens = verify(logits_rows, drafts, params, ...) # accepted drafts + one token of the model's

Exact: each row draws its token as a plain decode step would (the same sampler, the same
seeded stream at the same position) and a draft is kept while it is the token drawn, so the
answer is the plain decode's, token for token, greedy or sampled (for a proposal certain of
its draft, this is the rejection rule of speculative sampling).

How much: `Speculation` keeps each request's k (the most drafts per step), halving it after a
step that kept none of them and growing it after one that kept all, within 1..max_k; the
scheduler drafts only while few sequences run (a step full of decodes already reads the
weights once for many tokens) and counts drafted tokens against the step's budget like
prefill tokens.
"""
from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass, field

import numpy as np

from ..constrain.grammar import ForcedTooLong, forced_run, forces
from ..model.sampler import verify  # noqa: F401 (a speculation's draws: the sampler's)

MIN_NGRAM, MAX_NGRAM = 1, 4
SEARCH_TOKENS = 8192           # how far back a match is looked for


def _follows(src: np.ndarray, tail: np.ndarray, k: int, inside: bool) -> list[int]:
    """Up to `k` tokens that followed the latest occurrence of `tail` in `src` (`inside`:
    `tail` ends `src` itself, so that occurrence does not count); [] when none."""
    n, size = len(tail), len(src)
    end = size - n if inside else size - n + 1
    if end <= 0:
        return []
    hits = np.flatnonzero(src[:end] == tail[0])
    for j in range(1, n):
        if not len(hits):
            return []
        hits = hits[src[hits + j] == tail[j]]
    hits = hits[hits + n < size]
    if not len(hits):
        return []
    start = int(hits[-1]) + n
    out = src[start:start + k]
    cut = np.flatnonzero(out < 0)             # an answer's end (`AnswerHistory.SEP`)
    return (out[:cut[0]] if len(cut) else out).tolist()


def propose(tokens, k: int, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM, corpus=None, valid=None) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest n-gram
    (max_n down to min_n) ending the sequence; [] when none occurs. `corpus` (earlier answers
    of the same identity: `AnswerHistory`) is searched after the sequence itself for each n;
    `valid` (a grammar's `validate_tokens`) cuts a guess to the run it allows, and a guess it
    allows none of gives way to the next source or a shorter n-gram."""
    if k <= 0 or len(tokens) < min_n:
        return []
    arr = np.asarray(tokens[-SEARCH_TOKENS:], dtype=np.int64)
    size = len(arr)
    for n in range(min(max_n, size), min_n - 1, -1):
        tail = arr[size - n:]
        for src, inside in ((arr, True), (corpus, False)):
            if src is None or len(src) <= n - (0 if inside else 1):
                continue
            guess = _follows(src, tail, k, inside)
            if guess and valid is not None:
                guess = guess[:valid(guess)]
            if guess:
                return guess
    return []


CHAIN_MAX = 48                 # the most tokens one chain of drafts holds (forced and guessed)


def chain_drafts(matcher, tokens, k: int, corpus=None, limit: int = CHAIN_MAX) -> tuple[list[int], int, list[bool]]:
    """A constrained answer's drafts for its next step, from its grammar in its state after
    `tokens` (`matcher`, in the worker thread; left as it was): the tokens the grammar forces
    next, then at a choice prompt lookup's guesses (its own tokens, then `corpus`) cut where
    the grammar refuses them, then what the grammar forces after those guesses, and so on, to
    `k` guessed tokens (forced ones not counted) and `limit` tokens in all. Returns (drafts,
    lead, certain): the first `lead` drafts are forced (certain), the rest hold only if the
    guesses before them do; `certain[i]`: drafts[i] is the only token the format allows
    after drafts[:i] (no logits row is needed to check it: `verify`'s `have`). With `tokens`
    None, only the forced lead (a draft model guesses the rest).

    One step then covers a format's forced runs and its likely choices together: Home
    Assistant's command answers `{"tool_calls": [{"name": "Hass...` where the format forces
    all but `to` and the name, and the household's earlier answers (`corpus`) guess those."""
    chain: list[int] = []
    certain: list[bool] = []
    lead = guessed = consumed = 0
    try:
        while len(chain) < limit and not matcher.is_stopped():
            ff = forced_run(matcher)[:limit - len(chain)]   # (ForcedTooLong past the limit)
            if ff:
                n = matcher.try_consume_tokens(ff)
                consumed += n
                chain += ff[:n]
                certain += [True] * n
                if not guessed:
                    lead += n
                if n < len(ff):
                    break
                continue
            if tokens is None or guessed >= k:
                break
            guess = propose(list(tokens) + chain, min(k - guessed, limit - len(chain)), corpus=corpus,
                            valid=matcher.validate_tokens)
            if not guess:
                break
            took, whole = 0, True
            for t in guess:                   # a guess runs to where the format forces again
                if not matcher.consume_token(t):
                    whole = False
                    break
                took += 1
                chain.append(t)
                certain.append(False)
                if matcher.is_stopped() or forces(matcher):
                    break
            consumed += took
            guessed += took
            if not took or not whole:
                break
    finally:
        if consumed:
            matcher.rollback(consumed)
    return chain, lead, certain


class AnswerHistory:
    """Recent answers per identity (the prefix cache's salt: what one identity's requests
    share, never another's), each with the last tokens of its prompt: prompt lookup's second
    source. A household asks the same shapes again (a voice command's tool call, a schema's
    keys), so an earlier answer guesses the next one's choices where its own prompt cannot.
    Bounded: `max_tokens` per identity, the `max_ids` identities seen last. Written on the
    event loop (a request's end), read from the worker thread: each identity's corpus is
    one array, replaced whole."""

    CONTEXT = 8          # prompt tokens kept before each answer (its template's turn opening)
    SEP = -1             # between answers: no n-gram runs from one into the next

    def __init__(self, max_tokens: int = 8192, max_ids: int = 32):
        self.max_tokens, self.max_ids = max_tokens, max_ids
        self._answers: dict[int, list[np.ndarray]] = {}
        self._corpus: dict[int, np.ndarray] = {}

    def add(self, salt: int, prompt_ids, output_ids) -> None:
        if len(output_ids) < 2:
            return
        entry = np.asarray(list(prompt_ids[-self.CONTEXT:]) + list(output_ids[:self.max_tokens // 2]) + [self.SEP],
                           dtype=np.int64)
        answers = self._answers.pop(salt, [])
        answers.append(entry)
        while sum(len(a) for a in answers) > self.max_tokens:
            answers.pop(0)
        self._answers[salt] = answers           # (re)inserted last: the identity seen last
        self._corpus[salt] = np.concatenate(answers)
        while len(self._answers) > self.max_ids:
            old = next(iter(self._answers))
            del self._answers[old]
            self._corpus.pop(old, None)

    def corpus(self, salt: int) -> np.ndarray | None:
        return self._corpus.get(salt)

    def corpus_count(self) -> int:
        return len(self._corpus)

    # kept beside the prefix cache's disk tier (the same model identity's folder), so a restarted
    # server drafts a household's commands as before: written at shutdown, read at start
    MAGIC = b"EPANSWR1"

    def save(self, path) -> None:
        """Every identity's answers to `path` (a temporary name, then renamed), checksummed."""
        buf = io.BytesIO()
        np.savez(buf, **{f"s{salt}": c for salt, c in self._corpus.items()})
        data = buf.getvalue()
        tmp = f"{path}.tmp"
        with open(tmp, "wb") as f:
            f.write(self.MAGIC + hashlib.blake2b(data, digest_size=32).digest() + data)
        os.replace(tmp, path)

    def load(self, path, vocab: int) -> int:
        """The answers `save` wrote (token ids within `vocab`, within the bounds); a missing,
        torn or corrupt file is nothing. Returns how many identities came back."""
        try:
            raw = open(path, "rb").read()
        except OSError:
            return 0
        head, digest, data = raw[:8], raw[8:40], raw[40:]
        if head != self.MAGIC or hashlib.blake2b(data, digest_size=32).digest() != digest:
            return 0
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                items = [(int(k[1:]), np.asarray(z[k], dtype=np.int64)) for k in z.files if k.startswith("s")]
        except Exception:   # noqa: BLE001 - a cache: nothing then
            return 0
        for salt, c in items[-self.max_ids:]:
            for entry in np.split(c, np.flatnonzero(c == self.SEP) + 1):
                entry = entry[entry != self.SEP]
                if len(entry) > self.CONTEXT + 1 and entry.min() >= 0 and entry.max() < vocab:
                    self.add(salt, entry[:self.CONTEXT].tolist(), entry[self.CONTEXT:].tolist())
        return len(self._corpus)


@dataclass
class DraftState:
    """A request's speculation, kept by this module (and draft.py) on `Request.drafting`."""
    allowed: bool | None = None           # the request's own say (False: no drafts; None: the server's)
    drafts: list[int] = field(default_factory=list)       # this step's drafted tokens
    k: int | None = None                  # the most drafts a step (adapts as they are kept or not)
    drafted: int = 0
    accepted: int = 0
    proposal: tuple[int, list[int]] | None = None   # a draft model's guesses: (num_tokens when made, tokens)
    # its format's drafts for the next step: (num_tokens they follow, tokens, lead, certain):
    # the first `lead` forced, then guesses and what they force (`chain_drafts`)
    chain: tuple[int, list[int], int, list[bool]] | None = None
    forced: int = 0                       # how many of this step's drafts are forced ones
    certain: list[bool] = field(default_factory=list)   # per draft: forced after the ones before it
    have: list[int] = field(default_factory=list)       # the draft rows (1..) whose logits the step computes


@dataclass
class SpecConfig:
    mode: str = "lookup"           # "lookup" | "draft" (a draft model's guesses: draft.py) | "off"
    max_k: int = 8                 # the most drafted tokens per request and step
    max_running: int = 4           # drafts only while at most this many sequences run
    min_k: int = 1


class Speculation:
    """Per-request k, and the box's counts (drafted, accepted) per request class."""

    def __init__(self, config: SpecConfig | None = None):
        self.config = config or SpecConfig()
        self.drafted: dict[str, int] = {}
        self.accepted: dict[str, int] = {}
        self.steps: dict[str, int] = {}
        self.forced: dict[str, int] = {}     # format-forced tokens taken as drafts (all kept)
        self.history = AnswerHistory()       # earlier answers, per identity: lookup's second source

    @property
    def on(self) -> bool:
        return self.config.mode != "off" and self.config.max_k > 0

    def eligible(self, req) -> bool:
        """Whether `req` may draft at all: one sample's text (held to a format too: the grammar
        masks each draft's row); logprobs, tool calls not yet started, parallel samples not yet
        forked, embeddings and the window policy do not."""
        p = req.params
        return (self.on and req.drafting.allowed is not False and not req.embed
                and req.constraint.lazy is None and not req.children and p.logprobs is None and req.context_window is None)

    def drafts_for(self, req, room: int) -> list[int]:
        """Drafts for `req` this step, at most `room` (budget, context and max_tokens left):
        prompt lookup's, or the draft model's guesses made for the tokens it has now."""
        if req.drafting.k is None:
            req.drafting.k = self.config.max_k
        left = min(room, req.params.max_tokens - len(req.output_ids) - 1)
        f = req.drafting.chain
        if f is not None and f[0] == req.num_tokens and left > 0:
            # what the format forces next (certain, whatever k is: a grammar allows nothing
            # else), then the chain's guesses and what they force (k guesses at most when the
            # chain was made, after the step before)
            _, chain, lead, certain = f
            req.drafting.forced = min(left, lead)
            req.drafting.certain = list(certain[:left])
            return list(chain[:left])
        req.drafting.forced, req.drafting.certain = 0, []
        k = min(req.drafting.k, left)
        if k <= 0:
            return []
        if self.config.mode == "draft":
            p = req.drafting.proposal
            return list(p[1][:k]) if p is not None and p[0] == req.num_tokens else []
        return propose(req.all_ids, k, corpus=self.history.corpus(req.salt))

    def want_k(self, req, max_model_len: int) -> int:
        """How many guesses a draft model makes for `req` in its next round."""
        if req.drafting.k is None:
            req.drafting.k = self.config.max_k
        return max(0, min(req.drafting.k, req.params.max_tokens - len(req.output_ids) - 1,
                          max_model_len - req.num_tokens - 1))

    def k_after(self, k: int | None, drafted: int, accepted: int, forced: int = 0) -> int:
        """A request's k after a step that drafted `drafted` (the first `forced` of them its
        format's) and kept `accepted`: halved when it kept no guess, doubled when it kept all,
        within min_k..max_k; forced tokens say nothing of guessing."""
        cfg = self.config
        k = k or cfg.max_k
        drafted, accepted = drafted - forced, accepted - min(accepted, forced)
        if drafted <= 0:
            return k
        if accepted == 0:
            return max(cfg.min_k, k // 2)
        return min(cfg.max_k, k * 2) if accepted == drafted else k

    def record(self, req, drafted: int, accepted: int, forced: int = 0) -> None:
        """A step's drafts of `req`: `forced` of them (the first) were its format's forced
        tokens, counted apart (they say nothing of guessing) and leaving k as it is."""
        cls = req.priority
        req.drafting.k = self.k_after(req.drafting.k, drafted, accepted, forced)
        if forced:
            kept = min(accepted, forced)
            self.forced[cls] = self.forced.get(cls, 0) + kept
            drafted, accepted = drafted - forced, accepted - kept
            if not drafted:
                return
        self.drafted[cls] = self.drafted.get(cls, 0) + drafted
        self.accepted[cls] = self.accepted.get(cls, 0) + accepted
        self.steps[cls] = self.steps.get(cls, 0) + 1
        req.drafting.drafted += drafted
        req.drafting.accepted += accepted

    def stats(self) -> dict:
        out = {}
        for cls in sorted(set(self.drafted) | set(self.accepted) | set(self.forced)):
            d, a = self.drafted.get(cls, 0), self.accepted.get(cls, 0)
            out[cls] = {"drafted": d, "accepted": a, "acceptance_rate": round(a / d, 3) if d else None,
                        "forced": self.forced.get(cls, 0)}
        return out

    # -- the engine's side: all of a step's speculation is here, the engine only calls it

    def wanted(self, running, max_model_len: int) -> list:
        """(request, k) for a draft model's next round: the running requests that draft (few
        running, decoding, eligible), each with the guesses it wants."""
        if len(running) > self.config.max_running:
            return []
        out = []
        for r in running:
            if r.is_running and not r.finished and r.is_decoding and self.eligible(r):
                k = self.want_k(r, max_model_len)
                if k > 0:
                    out.append((r, k))
        return out

    def settle(self, reqs, tokens: list, allocator) -> None:
        """After a step with drafts (`reqs`: the drafting requests, `tokens`: each one's row
        answer): each sequence keeps the drafts it accepted (the allocator truncates it past
        them: the rejected ones' slots go, never cached), also when the request ended while
        the step ran."""
        for req, got in zip(reqs, tokens):
            kept = len(got) - 1 if isinstance(got, list) else 0
            drafted = len(req.drafting.drafts)
            req.num_known += kept
            if allocator.has_sequence(req.id):
                allocator.truncate(req.id, req.num_known)
                req.num_slots = allocator.seq_num_slots(req.id)
            if isinstance(got, list):
                forced, req.drafting.forced = req.drafting.forced, 0
                self.record(req, drafted, kept, forced)
            req.drafting.drafts = []

    def chain_next(self, took: dict, tokens: dict) -> None:
        """In the step's worker thread, after the grammars took their tokens (`took`: per
        request, what its grammar made of its token; `tokens`: its row's answer): the tokens
        each format forces next (`{"response": "` of a JSON reply, a call's `{"name": "` ...)
        become the request's drafts of the next step (`drafts_for`), checked like any draft:
        several forced tokens cost one forward instead of one each; with prompt lookup, its
        guesses at the format's choices and what they force carry the chain on
        (`chain_drafts`). A call's lazy grammar forcing too much ends its request as a
        format's would (`took[req]` becomes ("failed", error))."""
        lookup = self.config.mode == "lookup"
        for req, t in took.items():
            m = (req.constraint.matcher if t[0] == "took" and t[1] and not t[2] or t[0] == "spec" and not t[1]
                 else t[1] if t[0] == "lazy" and t[1] else None)
            if m is None or req.drafting.allowed is False or req.params.logprobs is not None or req.children:
                continue
            tok = tokens.get(req)
            new = list(tok) if isinstance(tok, list) else [tok[0] if isinstance(tok, tuple) else tok]
            at = req.num_tokens + len(new)
            # what the format forces, and at its choices (lookup only) prompt lookup's guesses
            # over the answer's own tokens and its identity's earlier answers, cut where the
            # grammar refuses them (a guess it forbids is a row computed for nothing)
            k = req.drafting.k or self.config.max_k
            if isinstance(tok, list) and req.drafting.drafts:    # k as this step's guesses leave it (recorded after)
                k = self.k_after(req.drafting.k, len(req.drafting.drafts), len(tok) - 1, req.drafting.forced)
            try:
                chain, lead, certain = chain_drafts(m, req.all_ids + new if lookup else None, k,
                                                    self.history.corpus(req.salt) if lookup else None)
            except ForcedTooLong as e:
                took[req] = ("failed", e)
                continue
            except Exception:   # noqa: BLE001 - no drafts then
                chain, lead, certain = [], 0, []
            req.drafting.chain = (at, chain, lead, certain) if chain else None

    @staticmethod
    def ahead(req, stop_ids) -> list[int] | None:
        """The tokens `req`'s format forces right after its last one (`req.drafting.chain`,
        from `chain_next`), within its max_tokens and before any stop token; None with stop
        strings (the text might end sooner) or nothing forced."""
        f, p = req.drafting.chain, req.params
        if f is None or f[0] != req.num_tokens or p.stop:
            return None
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(stop_ids))
        ahead = []
        for t in f[1][:min(f[2], max(0, p.max_tokens - len(req.output_ids)))]:   # the forced lead only
            if t in stops:
                break
            ahead.append(t)
        return ahead or None
