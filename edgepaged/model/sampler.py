"""The batched sampler (parameters: `params.SamplingParams`)."""
from __future__ import annotations

import numpy as np
import torch

from .params import SamplingParams


def _step_generator(seed: int, step: int, device) -> torch.Generator:
    """A generator for one request's `step`-th token: depends on nothing else in the batch."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + step) % 2**63)
    return g


def apply_repetition_penalty(logits: torch.Tensor, params, prev_tokens) -> None:
    for i, p in enumerate(params):
        if p.repetition_penalty != 1.0 and prev_tokens is not None and len(prev_tokens[i]):
            ids = torch.as_tensor(list(prev_tokens[i]), device=logits.device).unique()
            row = logits[i, ids]
            logits[i, ids] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)


def _filter(logits: torch.Tensor, params) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p as -inf masks. Returns probabilities."""
    temps = torch.tensor([p.temperature for p in params], device=logits.device, dtype=logits.dtype)
    logits = logits / temps[:, None]
    if any(p.top_p < 1 or p.min_p > 0 for p in params):
        sorted_logits, order = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        rank = torch.arange(logits.shape[-1], device=logits.device)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        for i, p in enumerate(params):
            if p.top_k:
                remove[i] |= rank >= p.top_k
            if p.top_p < 1:  # drop tokens once the mass before them reaches top_p
                remove[i] |= (probs[i].cumsum(-1) - probs[i]) >= p.top_p
            if p.min_p > 0:
                remove[i] |= probs[i] < p.min_p * probs[i, 0]
        remove[:, 0] = False
        kept = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(-1, order, kept)
    elif any(p.top_k for p in params):
        k = max(p.top_k for p in params)
        top = logits.topk(min(k, logits.shape[-1]), -1).values
        for i, p in enumerate(params):
            if p.top_k:
                logits[i].masked_fill_(logits[i] < top[i, p.top_k - 1], float("-inf"))
    return logits.softmax(-1)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first index of the maximum). On CPU through numpy: for a batch-32
    step's logits an order of magnitude faster than torch's argmax on a small CPU."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(np.argmax(logits.numpy(), -1).astype(np.int64, copy=False))
    return logits.argmax(-1)


def apply_openai_penalties(logits: torch.Tensor, params, outputs) -> None:
    """logit_bias, then OpenAI's presence and frequency penalties over the answer's tokens."""
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        if p.counts_output and outputs is not None and len(outputs[i]):
            ids, counts = torch.as_tensor(list(outputs[i]), device=logits.device).unique(return_counts=True)
            logits[i, ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty


def prepare(logits: torch.Tensor, params: list[SamplingParams], prev_tokens=None, outputs=None) -> torch.Tensor:
    """The logits sampling draws from: biases and penalties applied (a copy when any is)."""
    rep = any(p.repetition_penalty != 1.0 for p in params)
    oai = any(p.logit_bias or p.counts_output for p in params)
    if rep or oai:
        logits = logits.clone()
    if rep:
        apply_repetition_penalty(logits, params, prev_tokens)
    if oai:
        apply_openai_penalties(logits, params, outputs)
    return logits


def logprob_info(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> list:
    """Per row: None, or {"logprob": the sampled token's log-probability under `logits` (the
    model's, after biases, penalties and a format's mask; before temperature and top-k/p),
    "top": [(id, logprob)] the k likeliest}."""
    out: list = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    lp = torch.log_softmax(logits[rows].float(), -1)
    k = max(params[i].logprobs for i in rows)
    top = lp.topk(k, -1) if k else None
    for j, i in enumerate(rows):
        t = int(tokens[i])
        kk = params[i].logprobs
        out[i] = {"logprob": float(lp[j, t]),
                  "top": [(int(top.indices[j, n]), float(top.values[j, n])) for n in range(kk)] if kk else []}
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams], prev_tokens=None, outputs=None) -> torch.Tensor:
    """logits [B, V] float32 -> token ids int64 [B].

    prev_tokens[i]: the tokens of row i's sequence so far (prompt + output); used for the
    repetition penalty and, with a seed, to pick the random stream for this step, so a
    seeded request samples the same tokens whatever else is in the batch. outputs[i]: the
    answer's tokens (presence and frequency penalties)."""
    logits = prepare(logits, params, prev_tokens, outputs)
    return sample_prepared(logits, params, prev_tokens)


def sample_prepared(logits: torch.Tensor, params: list[SamplingParams], prev_tokens=None) -> torch.Tensor:
    """`sample` on logits `prepare` gave."""
    out = _argmax(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    sub = [params[i] for i in rows]
    probs = _filter(logits[rows], sub)
    # exponential race: argmax(p / E) with E ~ Exp(1) draws from p
    noise = torch.empty_like(probs).exponential_()
    for j, (i, p) in enumerate(zip(rows, sub)):
        if p.seed is not None:
            step = len(prev_tokens[i]) if prev_tokens is not None else 0
            noise[j].exponential_(generator=_step_generator(p.seed, step, probs.device))
    out[rows] = (probs / noise.clamp_min_(1e-20)).argmax(-1)
    return out
