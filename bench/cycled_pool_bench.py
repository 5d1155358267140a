#!/usr/bin/env python3
"""One stream's decode rate at a long context when its KV blocks are ones a freed sequence
gave back (the pool has cycled, as in a server that has run a while) against blocks never
used, on the CPU runtime: the free list returns a freed sequence's blocks tail first, and a
context whose blocks run backwards makes the decode attention wait on memory; a step's new
blocks are taken in ascending order (rust_alloc/block_pool, `reserve`) so it does not.

    python bench/cycled_pool_bench.py [--model embedded|FILE] [--context 3000] [--tokens 48] [--reps 4] [--json]

Per rep, on one runner whose pool holds one context and a little more, a fresh allocator: a
sequence on blocks never used (prefilled in one step, --tokens decoded: `fresh_tok_s`), freed
(tail first); then one of the same length, which takes those blocks (`cycled_tok_s`). `ascending_frac`: of the cycled sequence's block table, the fraction of
neighbouring blocks in ascending order. With --json the last line is one object: {"cpu",
"model", "context", "fresh_tok_s", "cycled_tok_s", "ratio", "ascending_frac"} (best of --reps).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--context", type=int, default=3000)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from family_bench import cpu_flags
    from edgepaged.model.loader import default_model_path
    from edgepaged.model.runtime import open_runner
    from edgepaged.testing.decode import make_allocator, run_batch, step
    path = default_model_path() if args.model == "embedded" else Path(args.model)
    n = args.context
    runner = open_runner(path, "cpu", num_blocks=(n + args.tokens) // 16 + 24)
    if n + args.tokens > runner.max_model_len:
        ap.error(f"a context of {n} + {args.tokens} tokens exceeds the model's {runner.max_model_len}")
    rng = np.random.default_rng(0)
    vocab = runner.config.vocab_size

    def stream(alloc, sid: int) -> tuple[float, list[int]]:
        """A prompt of n tokens prefilled in one step, then --tokens decoded greedily: (decode
        tok/s, its block table), its blocks freed after (not cached)."""
        prompt = rng.integers(3, vocab, n)
        alloc.add_sequence(sid, prompt)
        tok = step(runner, alloc, [sid], [n], prompt, np.arange(n))
        table = list(alloc.block_table(sid))
        t = time.perf_counter()
        for k in range(args.tokens - 1):
            tok = step(runner, alloc, [sid], [1], tok, np.array([n + k]), tok)
        rate = (args.tokens - 1) / (time.perf_counter() - t)
        alloc.free_sequence(sid, cache=False)
        return rate, table

    run_batch(runner, make_allocator(runner), [rng.integers(3, vocab, 8)], 4, seq_base=1)     # warm-up
    fresh, cycled, asc = [], [], []
    for r in range(args.reps):
        alloc = make_allocator(runner)                # blocks never used (the same cache)
        fresh.append(stream(alloc, 100 + 10 * r)[0])  # ... and back tail first: the pool has cycled
        rate, table = stream(alloc, 101 + 10 * r)     # its blocks: the first sequence's
        cycled.append(rate)
        asc.append(float(np.mean(np.diff(table) > 0)))
    out = {"cpu": cpu_flags(), "model": path.name, "context": n, "fresh_tok_s": round(max(fresh), 1),
           "cycled_tok_s": round(max(cycled), 1), "ratio": round(max(cycled) / max(fresh), 3),
           "ascending_frac": round(min(asc), 3)}
    print(f"{path.name}, {n} tokens: fresh pool {out['fresh_tok_s']} tok/s, cycled pool {out['cycled_tok_s']} tok/s "
          f"({out['ratio']}); the cycled table's neighbouring blocks ascending: {out['ascending_frac']}", flush=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
