"""The batched sampler (parameters: `params.SamplingParams`), in numpy: every forward path's
logits are sampled here (a torch tensor is taken as its numpy view), so the CPU runtime
needs no torch and both paths draw the same tokens from the same logits."""
from __future__ import annotations

import numpy as np

from .params import SamplingParams

_rng = np.random.default_rng()


def as_array(logits) -> np.ndarray:
    """float32 numpy [B, V] of logits given as numpy or as a torch tensor (any device)."""
    if isinstance(logits, np.ndarray):
        return logits if logits.dtype == np.float32 else logits.astype(np.float32)
    t = logits.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.float().numpy()


def _step_generator(seed: int, step: int) -> np.random.Generator:
    """A generator for one request's `step`-th token: depends on nothing else in the batch."""
    return np.random.Generator(np.random.PCG64((seed * 0x9E3779B97F4A7C15 + step) % 2**63))


def apply_repetition_penalty(logits: np.ndarray, params, prev_tokens) -> None:
    for i, p in enumerate(params):
        if p.repetition_penalty != 1.0 and prev_tokens is not None and len(prev_tokens[i]):
            ids = np.unique(np.asarray(list(prev_tokens[i]), dtype=np.int64))
            ids = ids[:np.searchsorted(ids, logits.shape[1])]    # (an image's ids are past the vocabulary)
            row = logits[i, ids]
            logits[i, ids] = np.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)


def _softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x, -1, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(-1, keepdims=True)


def _filter(logits: np.ndarray, params) -> np.ndarray:
    """Temperature, then top-k / top-p / min-p as -inf masks. Returns probabilities."""
    for p in params:
        if p.top_k and p.top_k > logits.shape[-1]:
            raise ValueError(f"top_k={p.top_k} is past the vocabulary ({logits.shape[-1]} tokens)")
    temps = np.asarray([p.temperature for p in params], dtype=np.float32)
    logits = logits / temps[:, None]
    if any(p.top_p < 1 or p.min_p > 0 for p in params):
        order = np.argsort(-logits, -1, kind="stable")
        sorted_logits = np.take_along_axis(logits, order, -1)
        probs = _softmax(sorted_logits)
        rank = np.arange(logits.shape[-1])
        remove = np.zeros(sorted_logits.shape, dtype=bool)
        for i, p in enumerate(params):
            if p.top_k:
                remove[i] |= rank >= p.top_k
            if p.top_p < 1:  # drop tokens once the mass before them reaches top_p
                remove[i] |= (np.cumsum(probs[i]) - probs[i]) >= p.top_p
            if p.min_p > 0:
                remove[i] |= probs[i] < p.min_p * probs[i, 0]
        remove[:, 0] = False
        kept = np.where(remove, np.float32(-np.inf), sorted_logits)
        logits = np.full_like(logits, -np.inf)
        np.put_along_axis(logits, order, kept, -1)
    elif any(p.top_k for p in params):
        for i, p in enumerate(params):
            if p.top_k:
                kth = np.partition(logits[i], -p.top_k)[-p.top_k]
                logits[i][logits[i] < kth] = -np.inf
    return _softmax(logits)


def apply_openai_penalties(logits: np.ndarray, params, outputs) -> None:
    """logit_bias, then OpenAI's presence and frequency penalties over the answer's tokens."""
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = np.asarray(list(p.logit_bias), dtype=np.int64)
            np.add.at(logits[i], ids, np.asarray(list(p.logit_bias.values()), dtype=np.float32))
        if p.counts_output and outputs is not None and len(outputs[i]):
            ids, counts = np.unique(np.asarray(list(outputs[i]), dtype=np.int64), return_counts=True)
            logits[i, ids] -= p.frequency_penalty * counts.astype(np.float32) + p.presence_penalty


def prepare(logits, params: list[SamplingParams], prev_tokens=None, outputs=None) -> np.ndarray:
    """The logits sampling draws from (float32 numpy): biases and penalties applied (on a
    copy: the caller's logits stay as they are)."""
    logits = as_array(logits)
    rep = any(p.repetition_penalty != 1.0 for p in params)
    oai = any(p.logit_bias or p.counts_output for p in params)
    if rep or oai:
        logits = logits.copy()
    if rep:
        apply_repetition_penalty(logits, params, prev_tokens)
    if oai:
        apply_openai_penalties(logits, params, outputs)
    return logits


def logprob_info(logits, tokens, params: list[SamplingParams]) -> list:
    """Per row: None, or {"logprob": the sampled token's log-probability under `logits` (the
    model's, after biases, penalties and a format's mask; before temperature and top-k/p),
    "top": [(id, logprob)] the k likeliest}."""
    out: list = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    x = as_array(logits)[rows].astype(np.float64)
    m = np.max(x, -1, keepdims=True)
    lp = x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
    for j, i in enumerate(rows):
        t = int(tokens[i])
        kk = params[i].logprobs
        top = []
        if kk:
            idx = np.argpartition(-lp[j], kk - 1)[:kk] if kk < lp.shape[1] else np.arange(lp.shape[1])
            idx = idx[np.argsort(-lp[j, idx], kind="stable")][:kk]
            top = [(int(n), float(lp[j, n])) for n in idx]
        out[i] = {"logprob": float(lp[j, t]), "top": top}
    return out


def sample(logits, params: list[SamplingParams], prev_tokens=None, outputs=None) -> np.ndarray:
    """logits [B, V] float32 (numpy, or a torch tensor) -> token ids int64 [B].

    prev_tokens[i]: the tokens of row i's sequence so far (prompt + output); used for the
    repetition penalty and, with a seed, to pick the random stream for this step, so a
    seeded request samples the same tokens whatever else is in the batch. outputs[i]: the
    answer's tokens (presence and frequency penalties)."""
    logits = prepare(logits, params, prev_tokens, outputs)
    return sample_prepared(logits, params, prev_tokens)


def sample_prepared(logits, params: list[SamplingParams], prev_tokens=None) -> np.ndarray:
    """`sample` on logits `prepare` gave."""
    logits = as_array(logits)
    out = np.argmax(logits, -1).astype(np.int64)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    sub = [params[i] for i in rows]
    probs = _filter(logits[rows], sub)
    # exponential race: argmax(p / E) with E ~ Exp(1) draws from p
    for j, (i, p) in enumerate(zip(rows, sub)):
        if p.seed is not None:
            step = len(prev_tokens[i]) if prev_tokens is not None else 0
            noise = _step_generator(p.seed, step).standard_exponential(probs.shape[1], dtype=np.float32)
        else:
            noise = _rng.standard_exponential(probs.shape[1], dtype=np.float32)
        out[i] = int(np.argmax(probs[j] / np.maximum(noise, np.float32(1e-20))))
    return out


# ---------------------------------------------------------------- speculation's draws

def verify(logits: np.ndarray, drafts: list[int], params, prev: list[int], outputs: list[int] | None,
           matcher=None, stops=frozenset(), vocab: int | None = None, first: int | None = None,
           forced: int = 0, have: list[int] | None = None) -> list[int]:
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
    or a draw (a seeded request's stream is per position: nothing shifts).

    `have`: which rows past row 0 `logits` holds, in order (None: all of them); a row left
    out is one whose draft the grammar forces after the drafts before it (`chain_drafts`'
    `certain`: its logits were never computed), taken as the forced tokens are."""
    out: list[int] = []
    seen = list(prev)
    answer = list(outputs) if outputs is not None else None
    at = None if have is None else {i: j for j, i in enumerate(have, 1)}
    for i in range(len(drafts) + 1):
        if i == 0 and first is not None:
            t = int(first)
        elif 0 < i < len(drafts) and matcher is not None and (i < forced or (at is not None and i not in at)):
            t = int(drafts[i])
        else:
            j = i if at is None or i == 0 else at[i]
            row = logits[j:j + 1]
            if matcher is not None:
                from ..constrain.grammar import Masks
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
