#!/usr/bin/env python3
"""Prefill attention on the CPU (`ops.paged_prefill`'s tiles): f32 products against bf16
products (`EDGEPAGED_ATTENTION_BF16`, on a CPU with AVX-512 BF16), alternated call by call
in one process, on one layer of the Llama-3.2-1B shape (32 query / 8 KV heads of 64, f16
cache, block size 16, a shuffled block table): a chunk of --rows rows over each context.

    python bench/prefill_attention_bench.py [--json] [--rows 512] [--contexts 512,1024,2048,4096] [--reps 7]

The bf16 tiles run twice more, alternated with the others: reading K and V rows converted once
for every tile of the chunk (`ops.prefill_shared_rows`, the default from 4 tiles = 97 rows)
and each tile converting its own (as before); the two give the same bits (checked).

Per context: the median milliseconds of each, GFLOP/s (4 * head_dim per row, query head and
visible position), the speed-up, and the largest difference over the largest output. With
--json the last line is one object: {"cpu", "bf16_available", "rows", "results": [{"context",
"f32_ms", "bf16_ms", "f32_gflops", "bf16_gflops", "speedup", "rel_diff", "bf16_own_rows_ms",
"shared_rows_speedup"}, ...]} (bf16 figures null where the CPU has no AVX-512 BF16).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from edgepaged._native import ops

NH, NKV, D, BS = 32, 8, 64, 16


def case(rows: int, n: int, rng) -> tuple:
    """A chunk of `rows` rows over `n` positions: (q, k, v, tables, starts, lens), an f16
    cache in blocks of BS under a shuffled table (`build_ab.py --attention` takes it too)."""
    nb = n // BS + 1
    k = rng.standard_normal((nb, BS, NKV, D)).astype(np.float16)
    v = rng.standard_normal((nb, BS, NKV, D)).astype(np.float16)
    q = rng.standard_normal((rows, NH * D)).astype(np.float32)
    tables = rng.permutation(nb).astype(np.int32)[None]
    return q, k, v, tables, np.array([0, rows], np.int64), np.array([n], np.int32)


def one(rows: int, n: int, reps: int, rng) -> dict:
    q, k, v, tables, starts, lens = case(rows, n, rng)
    was, shared_was = ops.bf16_attention(), ops.prefill_shared_rows()
    have = ops.bf16_attention(True)
    # (bf16, shared rows): f32; bf16 tiles on shared rows; bf16 tiles converting their own
    variants = [(False, True)] + ([(True, True), (True, False)] if have else [])
    times, outs = {x: [] for x in variants}, {}
    try:
        for _ in range(reps):
            for bf16, shared in variants:
                ops.bf16_attention(bf16)
                ops.prefill_shared_rows(shared)
                out = np.zeros((rows, NH * D), np.float32)
                t = time.perf_counter()
                ops.paged_prefill(q, out, starts, lens, tables, k, v, NH, NKV, D ** -0.5, 0, 0.0)
                times[(bf16, shared)].append(time.perf_counter() - t)
                outs[(bf16, shared)] = out
    finally:
        ops.bf16_attention(was)
        ops.prefill_shared_rows(shared_was)
    visible = rows * (n - (rows - 1) / 2)        # rows see n - rows + 1 .. n positions
    flop = 4 * D * NH * visible
    f32 = statistics.median(times[(False, True)])
    res = {"context": n, "f32_ms": round(f32 * 1e3, 2), "f32_gflops": round(flop / f32 / 1e9, 1),
           "bf16_ms": None, "bf16_gflops": None, "speedup": None, "rel_diff": None, "bf16_own_rows_ms": None,
           "shared_rows_speedup": None}
    if have:
        b, own = statistics.median(times[(True, True)]), statistics.median(times[(True, False)])
        ref = outs[(False, True)]
        if not np.array_equal(outs[(True, True)].view(np.uint32), outs[(True, False)].view(np.uint32)):
            raise SystemExit(f"context {n}: the bf16 tiles on shared rows differ from tiles converting their own")
        res.update(bf16_ms=round(b * 1e3, 2), bf16_gflops=round(flop / b / 1e9, 1), speedup=round(f32 / b, 2),
                   rel_diff=float(f"{np.abs(outs[(True, True)] - ref).max() / np.abs(ref).max():.2e}"),
                   bf16_own_rows_ms=round(own * 1e3, 2), shared_rows_speedup=round(own / b, 3))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--contexts", default="512,1024,2048,4096")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    from bench.family_bench import cpu_flags
    rng = np.random.default_rng(0)
    was = ops.bf16_attention()
    out = {"cpu": cpu_flags(), "bf16_available": ops.bf16_attention(True), "rows": args.rows, "results": []}
    ops.bf16_attention(was)
    for n in (int(x) for x in args.contexts.split(",") if x):
        if n < args.rows:
            ap.error(f"a context of {n} is shorter than --rows {args.rows}")
        r = one(args.rows, n, args.reps, rng)
        out["results"].append(r)
        print(f"{args.rows} rows over {n}: f32 {r['f32_ms']} ms ({r['f32_gflops']} GFLOP/s), bf16 {r['bf16_ms']} ms "
              f"({r['bf16_gflops']}), speed-up {r['speedup']}, difference {r['rel_diff']}; bf16 tiles converting "
              f"their own rows {r['bf16_own_rows_ms']} ms (shared rows x{r['shared_rows_speedup']})", flush=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
