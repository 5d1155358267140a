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
