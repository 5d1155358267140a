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

from dataclasses import dataclass

import numpy as np

from ..model.sampler import prepare, sample_prepared

MIN_NGRAM, MAX_NGRAM = 1, 4
SEARCH_TOKENS = 8192           # how far back a match is looked for


def propose(tokens, k: int, min_n: int = MIN_NGRAM, max_n: int = MAX_NGRAM) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest n-gram
    (max_n down to min_n) ending the sequence; [] when none occurs."""
    if k <= 0 or len(tokens) < min_n + 1:
        return []
    arr = np.asarray(tokens[-SEARCH_TOKENS:], dtype=np.int64)
    size = len(arr)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = arr[size - n:]
        # candidate starts i (i + n < size: something follows), where arr[i:i+n] == tail
        hits = np.flatnonzero(arr[:size - n] == tail[0])
        for j in range(1, n):
            if not len(hits):
                break
            hits = hits[arr[hits + j] == tail[j]]
        hits = hits[hits + n < size]
        if len(hits):
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []


def checked_guesses(tokens, k: int, matcher) -> list[int]:
    """Prompt lookup's guesses for a constrained answer at a choice of its format, cut where
    its grammar (`matcher`, in its state after `tokens`) refuses them: a guess the grammar
    forbids could never be kept, and its row would be computed for nothing (Home Assistant's
    prompt lists its tools as JSON, so after the answer's `{"` lookup guesses a tool's
    `"type": "function"` where the answer must say `tool_calls` or `response`)."""
    guess = propose(tokens, k)
    return guess[:matcher.validate_tokens(guess)] if guess else []


def verify(logits: np.ndarray, drafts: list[int], params, prev: list[int], outputs: list[int] | None,
           matcher=None, stops=frozenset(), vocab: int | None = None, first: int | None = None,
           forced: int = 0) -> list[int]:
    """`logits` [len(drafts) + 1, V]: row i follows draft i (row 0 the last real token).
    Each row draws its token exactly as a plain decode step would (the sampler, with the
    row's history: a seeded request takes the same random stream at the same position), and a
    draft is kept while it is the token drawn. So the answer is the plain decode's token for
    token, greedy, seeded or not (for a proposal certain of its draft this is the rejection
    rule of speculative sampling: the draft is kept with probability p(draft), else the token
    comes from p without it). Returns the kept drafts and the first token that differs (or
    the one after the last draft): at least one token, at most len(drafts) + 1. With a
    grammar's `matcher`, each row is masked by the grammar's state after the tokens before it
    (a draft the grammar forbids can never be drawn) and the matcher takes the tokens drawn
    (not a stop token: the answer ends there).

    `first`: row 0's token when the step's plain pass drew it already (the same draw).
    `forced`: how many leading drafts are tokens the grammar forces (the only ones it allows
    there): rows 1 .. forced - 1 draw them with certainty, so they are taken without a mask
    or a draw (a seeded request's stream is per position: nothing shifts)."""
    out: list[int] = []
    seen = list(prev)
    answer = list(outputs) if outputs is not None else None
    for i in range(len(drafts) + 1):
        if i == 0 and first is not None:
            t = int(first)
        elif 0 < i < forced and matcher is not None:
            t = int(drafts[i])
        else:
            row = logits[i:i + 1]
            if matcher is not None:
                from ..model.grammar import Masks
                row = row.copy()
                Masks.compute([matcher], vocab or row.shape[1]).apply(row)
            row = prepare(row, [params], [seen], [answer] if answer is not None else None)
            t = int(sample_prepared(row, [params], [seen])[0])
        out.append(t)
        if matcher is not None and (t in stops or not matcher.consume_token(t) or matcher.is_stopped()):
            return out
        if i == len(drafts) or t != drafts[i]:
            return out
        seen.append(t)
        if answer is not None:
            answer.append(t)
    return out


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

    @property
    def on(self) -> bool:
        return self.config.mode != "off" and self.config.max_k > 0

    def eligible(self, req) -> bool:
        """Whether `req` may draft at all: one sample's text (held to a format too: the grammar
        masks each draft's row); logprobs, tool calls not yet started, parallel samples not yet
        forked, embeddings and the window policy do not."""
        p = req.params
        return (self.on and req.speculative is not False and not req.embed
                and req.lazy is None and not req.children and p.logprobs is None and req.context_window is None)

    def drafts_for(self, req, room: int) -> list[int]:
        """Drafts for `req` this step, at most `room` (budget, context and max_tokens left):
        prompt lookup's, or the draft model's guesses made for the tokens it has now."""
        if req.spec_k is None:
            req.spec_k = self.config.max_k
        left = min(room, req.params.max_tokens - len(req.output_ids) - 1)
        f = req.forced
        if f is not None and f[0] == req.num_tokens and left > 0:
            # what the format forces next: certain, whatever k is (a grammar allows nothing else)
            req.drafts_forced = min(left, len(f[1]))
            return list(f[1][:left])
        req.drafts_forced = 0
        k = min(req.spec_k, left)
        if k <= 0:
            return []
        if self.config.mode == "draft":
            p = req.proposal
            return list(p[1][:k]) if p is not None and p[0] == req.num_tokens else []
        c = req.checked
        if c is not None and c[0] == req.num_tokens:     # guessed and checked by its grammar already
            return list(c[1][:k])
        return propose(req.all_ids, k)

    def want_k(self, req, max_model_len: int) -> int:
        """How many guesses a draft model makes for `req` in its next round."""
        if req.spec_k is None:
            req.spec_k = self.config.max_k
        return max(0, min(req.spec_k, req.params.max_tokens - len(req.output_ids) - 1,
                          max_model_len - req.num_tokens - 1))

    def record(self, req, drafted: int, accepted: int, forced: int = 0) -> None:
        """A step's drafts of `req`: `forced` of them (the first) were its format's forced
        tokens, counted apart (they say nothing of guessing) and leaving k as it is."""
        cls = req.priority
        if forced:
            kept = min(accepted, forced)
            self.forced[cls] = self.forced.get(cls, 0) + kept
            drafted, accepted = drafted - forced, accepted - kept
            if not drafted:
                return
        self.drafted[cls] = self.drafted.get(cls, 0) + drafted
        self.accepted[cls] = self.accepted.get(cls, 0) + accepted
        self.steps[cls] = self.steps.get(cls, 0) + 1
        req.spec_drafted += drafted
        req.spec_accepted += accepted
        cfg = self.config
        if accepted == 0:
            req.spec_k = max(cfg.min_k, (req.spec_k or cfg.max_k) // 2)
        elif accepted == drafted:
            req.spec_k = min(cfg.max_k, (req.spec_k or cfg.max_k) * 2)

    def stats(self) -> dict:
        out = {}
        for cls in sorted(set(self.drafted) | set(self.accepted) | set(self.forced)):
            d, a = self.drafted.get(cls, 0), self.accepted.get(cls, 0)
            out[cls] = {"drafted": d, "accepted": a, "acceptance_rate": round(a / d, 3) if d else None,
                        "forced": self.forced.get(cls, 0)}
        return out
