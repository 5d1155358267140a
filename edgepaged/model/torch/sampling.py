"""The sampler on the device that holds the logits (a GPU): the same rules as
`model/sampler.py`, in torch, so a step's B x vocab logits never cross to the host (on a GPU
box with a 128 k vocabulary, 32 streams' logits are 16 MB a step, and sorting them for top-p
in numpy took longer than the step).

    tokens = sample(logits, params, prev_tokens, outputs)   # list[int], or None: the host's sampler

The rules, in `sampler.py`'s order: repetition penalty over the sequence's tokens, logit
bias, presence and frequency penalties over the answer's, then temperature (0: the argmax),
top-k, top-p (a token stays while the mass before it is under top_p), min-p (a fraction of the
likeliest token's probability), the likeliest token always kept; a draw by the exponential
race (argmax of p / E, E ~ Exp(1)), as the host's. What stays on the host: a seeded request
(its tokens come from its own numpy stream, the same on any box: `None` here) and logprobs.
A format's masks are applied here too (`apply_masks`: the allowed-token bits to the device).
"""
from __future__ import annotations

import torch

from ..params import SamplingParams


def supported(params: list[SamplingParams]) -> bool:
    return all(p.seed is None and p.logprobs is None for p in params)


def _ids(rows: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> a padded [B, L] int64 tensor and its [B, L] validity mask."""
    width = max((len(r) for r in rows), default=0) or 1
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        if len(r):
            ids[i, :len(r)] = torch.as_tensor(list(r), dtype=torch.int64)
            valid[i, :len(r)] = True
    return ids.to(device, non_blocking=True), valid.to(device, non_blocking=True)


def prepare(logits: torch.Tensor, params: list[SamplingParams], prev_tokens=None, outputs=None) -> torch.Tensor:
    """Penalties and biases applied (a float32 copy when any applies)."""
    logits = logits.float()
    v = logits.shape[1]
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 and prev_tokens is not None
           and len(prev_tokens[i])]
    bias = [i for i, p in enumerate(params) if p.logit_bias]
    counts = [i for i, p in enumerate(params) if p.counts_output and outputs is not None and len(outputs[i])]
    if not (rep or bias or counts):
        return logits
    logits = logits.clone()
    dev = logits.device
    if rep:
        ids, valid = _ids([prev_tokens[i] for i in rep], dev)
        valid &= ids < v                   # (an image's ids are past the vocabulary)
        ids = ids.clamp(max=v - 1)
        seen = torch.zeros(len(rep), v, dtype=torch.bool, device=dev).scatter_(1, ids, valid)
        pen = torch.tensor([params[i].repetition_penalty for i in rep], dtype=torch.float32, device=dev)[:, None]
        rows = logits[rep]
        logits[rep] = torch.where(seen, torch.where(rows > 0, rows / pen, rows * pen), rows)
    for i in bias:
        p = params[i]
        ids = torch.tensor(list(p.logit_bias), dtype=torch.int64, device=dev)
        logits[i].index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=torch.float32, device=dev))
    if counts:
        ids, valid = _ids([outputs[i] for i in counts], dev)
        n = torch.zeros(len(counts), v, dtype=torch.float32, device=dev).scatter_add_(1, ids, valid.float())
        freq = torch.tensor([params[i].frequency_penalty for i in counts], dtype=torch.float32, device=dev)[:, None]
        pres = torch.tensor([params[i].presence_penalty for i in counts], dtype=torch.float32, device=dev)[:, None]
        logits[counts] -= freq * n + pres * (n > 0)
    return logits


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p as -inf masks -> probabilities (`sampler._filter`)."""
    v = logits.shape[1]
    dev = logits.device
    for p in params:
        if p.top_k and p.top_k > v:
            raise ValueError(f"top_k={p.top_k} is past the vocabulary ({v} tokens)")
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)[:, None]
    logits = logits / temps
    top_k = torch.tensor([p.top_k or v for p in params], dtype=torch.int64, device=dev)[:, None]
    if any(p.top_p < 1 or p.min_p > 0 for p in params):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_logits, -1)
        rank = torch.arange(v, device=dev)[None, :]
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)[:, None]
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)[:, None]
        remove = rank >= top_k
        remove |= (torch.cumsum(probs, -1) - probs >= top_p) & (top_p < 1)
        remove |= (probs < min_p * probs[:, :1]) & (min_p > 0)
        remove[:, 0] = False
        kept = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(1, order, kept)
    elif any(p.top_k for p in params):
        for i, p in enumerate(params):
            if p.top_k:
                thr = torch.topk(logits[i], p.top_k).values[-1]
                logits[i] = logits[i].masked_fill(logits[i] < thr, float("-inf"))
    return torch.softmax(logits, -1)


def apply_masks(logits: torch.Tensor, masks) -> torch.Tensor:
    """A step's format masks (`constrain.grammar.Masks`: allowed-token bits of its constrained
    rows) applied on the device: a float32 copy with the disallowed tokens at -inf."""
    import numpy as np
    logits = logits.float().clone()
    rows = torch.as_tensor(masks.rows, dtype=torch.int64, device=logits.device)
    bits = np.unpackbits(masks.bits.view(np.uint8), axis=1, bitorder="little")[:, : masks.vocab]
    allowed = torch.from_numpy(bits.astype(bool)).to(logits.device, non_blocking=True)
    sub = logits.index_select(0, rows)
    sub[:, : masks.vocab].masked_fill_(~allowed, float("-inf"))
    sub[:, masks.vocab:] = float("-inf")
    return logits.index_copy_(0, rows, sub)


def sample(logits: torch.Tensor, params: list[SamplingParams], prev_tokens=None, outputs=None,
           generator: torch.Generator | None = None, masks=None) -> list[int] | None:
    """One token per row, drawn on the logits' device (`masks`: a format's allowed tokens of
    its rows, `constrain.grammar.Masks`); None when a row needs the host's sampler (a seed,
    logprobs)."""
    out = sample_tensor(logits, params, prev_tokens, outputs, generator, masks)
    return None if out is None else out.tolist()


def sample_tensor(logits: torch.Tensor, params: list[SamplingParams], prev_tokens=None, outputs=None,
                  generator: torch.Generator | None = None, masks=None) -> torch.Tensor | None:
    """`sample`, the ids left on the device (int64 [B]): nothing waits for them (a step
    launched ahead feeds them to the next one)."""
    if not supported(params):
        return None
    if masks is not None:
        logits = apply_masks(logits, masks)
    logits = prepare(logits, params, prev_tokens, outputs)
    out = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs = _filter(logits[rows], [params[i] for i in rows])
        noise = torch.empty_like(probs).exponential_(generator=generator)
        out[rows] = torch.argmax(probs / noise.clamp_min(1e-20), -1)
    return out
