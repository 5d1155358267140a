#!/usr/bin/env python3
"""One stream's decode rate as its context grows, on the CPU runtime, and what the decode
attention reads a second: a long chat's K and V come to weigh as much as the weights (the
embedded SmolLM2-135M reads 96 MB of weights a token, and 94 MB of f16 K/V at 4 k tokens).

    python bench/decode_context_bench.py [--model embedded|FILE] [--kv-dtype f16|q8_0]
        [--contexts 32,512,2048,4096] [--tokens 48] [--reps 3] [--json]

Per context: `tok_s` (a prompt of that many tokens, then --tokens generated greedily; the best
of --reps), and `attention_gbs`: the model's own head shape (query/KV heads, head size) in
one process, `ops.paged_decode` over that many positions of random K/V (of --kv-dtype) through a
shuffled block table, once per layer as a step does; bytes of K and V read / time (median
of 7). `mem_read_gbs` is family_bench's read-bandwidth probe in the same run, the limit
both are judged against. Beside them, alternated rep by rep in the same process, the same
figures with a long context's attention left uncut (`ops.decode_seg(0)`: split by KV heads
only, as before the eleventh session): `tok_s_uncut`, `attention_ms_uncut`. With --json the
last line is one object: {"cpu", "model", "kv_dtype", "mem_read_gbs", "decode_seg",
"results": [{"context", "tok_s", "attention_ms", "attention_gbs", "tok_s_uncut",
"attention_ms_uncut"}, ...]}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np



def kv_layer(nb: int, bs: int, nkv: int, d: int, kv_dtype: str, rng) -> tuple[np.ndarray, np.ndarray]:
    """One layer's K and V caches of `nb` blocks in the runtime's layout for `kv_dtype`,
    random values written through `ops.rope_write_kv` (the model's own writer: q8_0's scales
    too), the rotary an identity."""
    from edgepaged._native import ops
    from edgepaged.model.cpu.runner import kv_numpy_dtype, kv_row_units
    shape = (nb, bs, nkv, kv_row_units(kv_dtype, d))
    k, v = np.zeros(shape, kv_numpy_dtype(kv_dtype)), np.zeros(shape, kv_numpy_dtype(kv_dtype))
    t = nb * bs
    qkv = rng.standard_normal((t, 2 * nkv * d)).astype(np.float32)   # no query heads: K, then V
    cos, sin = np.ones((t, d), np.float32), np.zeros((t, d), np.float32)
    pos = np.arange(t, dtype=np.int64)
    ops.rope_write_kv(qkv, pos, cos, sin, pos, k, v, 0, nkv)
    return k, v


def attention(cfg, n: int, rng, segs: list[int], kv_dtype: str = "f16") -> dict[int, float]:
    """Per segment length in `segs` (`ops.decode_seg`), the ms of a step's decode attention:
    every layer over n positions of a `kv_dtype` cache (median of 7, the variants alternated)."""
    from edgepaged._native import ops
    nh, nkv, d, bs, layers = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16, cfg.num_layers
    nb = -(-n // bs)
    ks, vs = zip(*(kv_layer(nb, bs, nkv, d, kv_dtype, rng) for _ in range(layers)))
    q = rng.standard_normal((1, nh * d)).astype(np.float32)
    out = np.zeros((1, nh * d), np.float32)
    tables = rng.permutation(nb).astype(np.int32)[None]
    rows, lens = np.array([0], np.int64), np.array([n], np.int32)
    times: dict[int, list[float]] = {s: [] for s in segs}
    for _ in range(7):
        for seg in segs:
            ops.decode_seg(seg)
            t = time.perf_counter()
            for k, v in zip(ks, vs):
                ops.paged_decode(q, out, rows, lens, tables, k, v, nh, nkv, d ** -0.5)
            times[seg].append(time.perf_counter() - t)
    ops.decode_seg(segs[0])
    return {seg: statistics.median(ts) * 1e3 for seg, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--kv-dtype", default="f16", choices=["f16", "q8_0", "f32"])
    ap.add_argument("--contexts", default="32,512,2048,4096")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from bench.family_bench import cpu_flags, mem_read_gbs
    from edgepaged.model.loader import default_model_path
    from edgepaged.model.open import open_runner
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
    from edgepaged._native import ops
    seg = ops.decode_seg()
    segs = [seg, 0] if seg else [0]
    bw = mem_read_gbs()
    out = {"cpu": cpu_flags(), "model": path.name, "kv_dtype": args.kv_dtype, "mem_read_gbs": round(bw, 2),
           "decode_seg": seg, "results": []}
    print(f"{path.name}, KV {args.kv_dtype}, read bandwidth {bw:.1f} GB/s, decode attention cut every {seg} "
          "positions (uncut beside it)", flush=True)
    cfg = runner.config
    for n in contexts:
        best = {s: 0.0 for s in segs}
        for r in range(args.reps):
            for s in segs:
                ops.decode_seg(s)
                _, _, td = run_batch(runner, alloc, [rng.integers(3, vocab, n)], args.tokens,
                                     seq_base=1000 * n + 10 * r + s)
                best[s] = max(best[s], (args.tokens - 1) / td)
        ops.decode_seg(seg)
        ms = attention(cfg, n, rng, segs, args.kv_dtype)
        from edgepaged.model.cpu.runner import kv_bytes_per_value
        gbs = (cfg.num_layers * 2 * n * cfg.num_kv_heads * cfg.head_dim * kv_bytes_per_value(args.kv_dtype)
               / (ms[seg] / 1e3) / 1e9)
        out["results"].append({"context": n, "tok_s": round(best[seg], 1), "attention_ms": round(ms[seg], 2),
                               "attention_gbs": round(gbs, 1), "tok_s_uncut": round(best[0], 1),
                               "attention_ms_uncut": round(ms[0], 2)})
        print(f"context {n}: {best[seg]:.1f} tok/s (uncut {best[0]:.1f}); decode attention {ms[seg]:.2f} ms a step "
              f"(uncut {ms[0]:.2f}; {gbs:.1f} GB/s of K/V, {gbs / bw:.2f} of the read bandwidth)", flush=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
