#!/usr/bin/env python3
"""One stream's decode rate at a long context when its KV blocks are ones a freed sequence
gave back (the pool has cycled, as in a server that has run a while) against blocks never
used, on the CPU runtime: the free list returns a freed sequence's blocks tail first, and a
context whose blocks run backwards makes the decode attention wait on memory; a step's new
blocks are taken in ascending order (rust_alloc/block_pool, `reserve`) so it does not.

    python bench/cycled_pool_bench.py [--model embedded|FILE] [--context 3000] [--tokens 48] [--reps 4]
                                      [--built prefill|decode] [--streams 1] [--json]

Per rep, on one runner whose pool holds one context and a little more, a fresh allocator: a
sequence on blocks never used (prefilled in one step, --tokens decoded: `fresh_tok_s`), freed
(tail first); then one of the same length, which takes those blocks (`cycled_tok_s`).
`--built decode` writes the contexts a token a step (as a chat's answers grow), `--streams K`
builds K of them: one after another on the fresh pool, side by side on the cycled one (their
new blocks interleave); the first is timed.
`ascending_frac`: of the cycled sequence's block table, the fraction of neighbouring blocks
that are consecutive (the next block id). With --json the last line is one object: {"cpu",
"model", "context", "built", "streams", "fresh_tok_s", "cycled_tok_s", "ratio", "ascending_frac"} (best of --reps).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--context", type=int, default=3000)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--built", choices=["prefill", "decode"], default="prefill",
                    help="the context written by one prefill step, or a token a step (as a chat's answers)")
    ap.add_argument("--streams", type=int, default=1,
                    help="sequences built side by side (one timed); their blocks interleave")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from bench.family_bench import cpu_flags
    from edgepaged.model.loader import default_model_path
    from edgepaged.model.open import open_runner
    from edgepaged.testing.decode import make_allocator, run_batch, step
    path = default_model_path() if args.model == "embedded" else Path(args.model)
    n, k = args.context, args.streams
    runner = open_runner(path, "cpu", num_blocks=k * ((n + args.tokens) // 16 + 2) + 24)
    if n + args.tokens > runner.max_model_len:
        ap.error(f"a context of {n} + {args.tokens} tokens exceeds the model's {runner.max_model_len}")
    rng = np.random.default_rng(0)
    vocab = runner.config.vocab_size

    def build(alloc, sids: list[int], together: bool) -> None:
        """Each sequence's first n positions: one prefill step each, or (--built decode) a
        16-token prompt and then one token a step (the allocator alone: the timing needs the
        block tables, not the K/V's values), the sequences one after another or together."""
        if args.built == "prefill":
            for sid in sids:
                prompt = rng.integers(3, vocab, n)
                alloc.add_sequence(sid, prompt)
                step(runner, alloc, [sid], [n], prompt, np.arange(n))
            return
        for group in [sids] if together else [[sid] for sid in sids]:
            for sid in group:
                alloc.add_sequence(sid, rng.integers(3, vocab, 16))
            alloc.prepare_step(group, [16] * len(group))
            for _ in range(n - 16):
                alloc.prepare_step(group, [1] * len(group), rng.integers(3, vocab, len(group)))

    def stream(alloc, sids: list[int], together: bool) -> tuple[float, list[int]]:
        """Contexts of n tokens for `sids` (`build`), then --tokens decoded greedily by the
        first: (decode tok/s, its block table); every block freed after (not cached)."""
        build(alloc, sids, together)
        sid = sids[0]
        table = list(alloc.block_table(sid))
        tok = [int(rng.integers(3, vocab))]
        t = time.perf_counter()
        for j in range(args.tokens - 1):
            tok = step(runner, alloc, [sid], [1], tok, np.array([n + j]), tok)
        rate = (args.tokens - 1) / (time.perf_counter() - t)
        for s_ in sids:
            alloc.free_sequence(s_, cache=False)
        return rate, table

    run_batch(runner, make_allocator(runner), [rng.integers(3, vocab, 8)], 4, seq_base=1)     # warm-up
    fresh, cycled, asc = [], [], []
    for r in range(args.reps):
        alloc = make_allocator(runner)                # blocks never used (the same cache)
        base = 100 + 10 * r
        # blocks never used, the sequences one after another: each table ascending; freed tail
        # first (the pool has cycled), then the same built together on their blocks
        fresh.append(stream(alloc, [base + i for i in range(k)], False)[0])
        rate, table = stream(alloc, [base + k + i for i in range(k)], True)
        cycled.append(rate)
        asc.append(float(np.mean(np.diff(table) == 1)))
    out = {"cpu": cpu_flags(), "model": path.name, "context": n, "built": args.built, "streams": k,
           "fresh_tok_s": round(max(fresh), 1), "cycled_tok_s": round(max(cycled), 1),
           "ratio": round(max(cycled) / max(fresh), 3), "ascending_frac": round(min(asc), 3)}
    print(f"{path.name}, {n} tokens ({args.built}, {k} stream(s) built together): fresh pool {out['fresh_tok_s']} "
          f"tok/s, cycled pool {out['cycled_tok_s']} tok/s ({out['ratio']}); the cycled table's neighbouring "
          f"blocks consecutive: {out['ascending_frac']}", flush=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
