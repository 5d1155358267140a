#!/usr/bin/env python3
"""One stream's decode rate as its context grows, on the CPU runtime, and what the decode
attention reads a second: a long chat's K and V come to weigh as much as the weights (the
embedded SmolLM2-135M reads 96 MB of weights a token, and 94 MB of f16 K/V at 4 k tokens).

    python bench/decode_context_bench.py [--model embedded|FILE] [--kv-dtype f16|q8_0]
        [--contexts 32,512,2048,4096] [--tokens 48] [--reps 3] [--json]

Per context: `tok_s` (a prompt of that many tokens, then --tokens generated greedily; the best
of --reps), and `attention_gbs`: the model's own head shape (query/KV heads, head size) in
one process, `ops.paged_decode` over that many positions of random f16 K/V through a
shuffled block table, once per layer as a step does; bytes of K and V read / time (median
of 7). `mem_read_gbs` is family_bench's read-bandwidth probe in the same run, the limit
both are judged against. With --json the last line is one object: {"cpu", "model",
"kv_dtype", "mem_read_gbs", "results": [{"context", "tok_s", "attention_ms", "attention_gbs"},
...]}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def attention(cfg, n: int, rng) -> tuple[float, float]:
    """(ms, GB/s) of a step's decode attention: every layer over n positions."""
    from edgepaged._native import ops
    nh, nkv, d, bs, layers = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16, cfg.num_layers
    nb = -(-n // bs)
    ks = [rng.standard_normal((nb, bs, nkv, d)).astype(np.float16) for _ in range(layers)]
    vs = [rng.standard_normal((nb, bs, nkv, d)).astype(np.float16) for _ in range(layers)]
    q = rng.standard_normal((1, nh * d)).astype(np.float32)
    out = np.zeros((1, nh * d), np.float32)
    tables = rng.permutation(nb).astype(np.int32)[None]
    rows, lens = np.array([0], np.int64), np.array([n], np.int32)
    times = []
    for _ in range(7):
        t = time.perf_counter()
        for k, v in zip(ks, vs):
            ops.paged_decode(q, out, rows, lens, tables, k, v, nh, nkv, d ** -0.5)
        times.append(time.perf_counter() - t)
    s = statistics.median(times)
    return s * 1e3, layers * 2 * n * nkv * d * 2 / s / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--kv-dtype", default="f16", choices=["f16", "q8_0", "f32"])
    ap.add_argument("--contexts", default="32,512,2048,4096")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from family_bench import cpu_flags, mem_read_gbs
    from edgepaged.model.loader import default_model_path
    from edgepaged.model.runtime import open_runner
    from edgepaged.testing.decode import make_allocator, run_batch
    path = default_model_path() if args.model == "embedded" else Path(args.model)
    contexts = [int(x) for x in args.contexts.split(",") if x]
    runner = open_runner(path, "cpu", kv_dtype=args.kv_dtype,
                         num_blocks=(max(contexts) + args.tokens) // 16 + 16)
    if max(contexts) + args.tokens > runner.max_model_len:
        ap.error(f"a context of {max(contexts)} + {args.tokens} tokens exceeds the model's {runner.max_model_len}")
    alloc = make_allocator(runner)
    rng = np.random.default_rng(0)
    vocab = runner.config.vocab_size
    run_batch(runner, alloc, [rng.integers(3, vocab, 8)], 4, seq_base=1)     # warm-up
    bw = mem_read_gbs()
    out = {"cpu": cpu_flags(), "model": path.name, "kv_dtype": args.kv_dtype, "mem_read_gbs": round(bw, 2),
           "results": []}
    print(f"{path.name}, KV {args.kv_dtype}, read bandwidth {bw:.1f} GB/s", flush=True)
    for n in contexts:
        best = 0.0
        for r in range(args.reps):
            _, _, td = run_batch(runner, alloc, [rng.integers(3, vocab, n)], args.tokens, seq_base=1000 * n + 10 * r)
            best = max(best, (args.tokens - 1) / td)
        ms, gbs = attention(runner.config, n, rng)
        out["results"].append({"context": n, "tok_s": round(best, 1), "attention_ms": round(ms, 2),
                               "attention_gbs": round(gbs, 1)})
        print(f"context {n}: {best:.1f} tok/s; decode attention {ms:.2f} ms a step ({gbs:.1f} GB/s of K/V, "
              f"{gbs / bw:.2f} of the read bandwidth)", flush=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
