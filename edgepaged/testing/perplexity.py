"""Teacher-forced perplexity of a runner under a context policy, over the real allocator
(bench/perplexity.py and tests/test_window.py): full attention reads the text in chunks, the
window policy one token a step, giving the window's blocks back after each token as the
engine does (`release_outside`)."""
from __future__ import annotations

import math

import numpy as np


def perplexity(runner, ids: list[int], window: int | None = None, sink: int = 0, chunk: int = 256) -> dict:
    """Mean negative log-likelihood of ids[1:] given what the policy keeps before each."""
    from edgepaged._native.blocks import BlockAllocator
    bs = runner.block_size
    alloc = BlockAllocator(runner.num_blocks, bs, enable_prefix_caching=False)
    step = 1 if window else chunk
    alloc.add_sequence(1, ids)
    nll, n, pos, most = 0.0, 0, 0, 0
    while pos < len(ids) - 1:
        c = min(step, len(ids) - 1 - pos)
        slots, tables, lens, copies, _ = alloc.prepare_step(np.array([1], np.int64), np.array([c], np.int64))
        most = max(most, alloc.num_used_blocks)
        meta = {"query_start_loc": np.array([0, c], np.int32), "seq_lens": lens, "block_tables": tables,
                "slot_mapping": slots}
        logits = np.asarray(runner.execute(np.array(ids[pos:pos + c], np.int64), np.arange(pos, pos + c), meta,
                                           np.arange(c)), np.float64)
        m = logits.max(-1, keepdims=True)
        lp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
        nxt = np.array(ids[pos + 1:pos + c + 1])
        nll -= float(lp[np.arange(c), nxt].sum())
        n += c
        pos += c
        if window:
            alloc.release_outside(1, sink, window)
    alloc.free_sequence(1, False)
    assert alloc.num_used_blocks == 0
    return {"ppl": round(math.exp(nll / n), 3), "nll": round(nll / n, 4), "predicted": n, "kv_blocks_max": most}


def chunked_perplexity(runners: dict, ids: list[int], ctx: int = 512, chunks: int | None = None,
                       bos: int | None = None) -> dict:
    """llama.cpp's `llama-perplexity` measure for each runner of `runners` (name -> runner, the
    first the base): the text in chunks of `ctx` tokens (the first one `bos` when the model adds
    one), each token of a chunk's second half scored given the chunk before it. Read as a
    server reads it: each chunk's first half is one prefill, then its second half one token a
    step (the decode kernels), every chunk in the same batch. Beside each runner's perplexity,
    its mean KL divergence from the base's next-token distributions and how often their top
    tokens agree (as llama.cpp's --kl-divergence reports them)."""
    from edgepaged._native.blocks import BlockAllocator
    n = len(ids) // ctx if chunks is None else min(chunks, len(ids) // ctx)
    if n < 1:
        raise ValueError(f"the text has {len(ids)} tokens: fewer than one chunk of {ctx}")
    texts = [list(ids[c * ctx:(c + 1) * ctx]) for c in range(n)]
    if bos is not None:
        for t in texts:
            t[0] = bos
    first = ctx // 2
    names = list(runners)
    allocs = {}
    for name, r in runners.items():
        allocs[name] = a = BlockAllocator(r.num_blocks, r.block_size, enable_prefix_caching=False)
        for c, t in enumerate(texts):
            a.add_sequence(c, t)
    seqs = np.arange(n, dtype=np.int64)

    def step(name, counts, starts):
        slots, tables, lens, _, _ = allocs[name].prepare_step(seqs, np.array(counts, np.int64))
        qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        toks = np.concatenate([texts[c][s:s + k] for c, (s, k) in enumerate(zip(starts, counts))]).astype(np.int64)
        pos = np.concatenate([np.arange(s, s + k) for s, k in zip(starts, counts)])
        meta = {"query_start_loc": qsl, "seq_lens": lens, "block_tables": tables, "slot_mapping": slots}
        logits = np.asarray(runners[name].execute(toks, pos, meta, qsl[1:] - 1), np.float64)
        m = logits.max(-1, keepdims=True)
        return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))

    for name in names:
        step(name, [first] * n, [0] * n)
    nll = dict.fromkeys(names, 0.0)
    kld = dict.fromkeys(names, 0.0)
    same = dict.fromkeys(names, 0)
    scored = 0
    for j in range(first, ctx - 1):
        nxt = np.array([texts[c][j + 1] for c in range(n)])
        base = None
        for name in names:
            lp = step(name, [1] * n, [j] * n)
            nll[name] -= float(lp[np.arange(n), nxt].sum())
            if base is None:
                base = lp
            kld[name] += float((np.exp(base) * (base - lp)).sum())
            same[name] += int((lp.argmax(-1) == base.argmax(-1)).sum())
        scored += n
    for a in allocs.values():
        for c in range(n):
            a.free_sequence(c, False)
        assert a.num_used_blocks == 0
    return {name: {"ppl": round(math.exp(nll[name] / scored), 4), "nll": round(nll[name] / scored, 6),
                   "kld_mean": float(f"{kld[name] / scored:.3g}"), "same_top_pct": round(100 * same[name] / scored, 3),
                   "chunks": n, "ctx": ctx, "scored": scored} for name in names}
