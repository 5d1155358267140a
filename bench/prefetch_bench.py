#!/usr/bin/env python3
"""One stream's decode rate against how far ahead the integer kernels prefetch the weights
(`quant.decode_prefetch`, EDGEPAGED_DECODE_PREFETCH), the distances alternated run by run in
one process on one file (family_bench's synthetic Llama-shaped Q4_K_M files), with the
memory's read rate measured in the same process.

    python bench/prefetch_bench.py [--json] [--shape 1b|3b|8b | --model FILE] [--bytes 0,8192] [--reps 5]

Per distance: the median tok/s of one stream (32-token prompt, 64 new tokens) and its
fraction of the memory's rate (tok/s x the weights' bytes / mem_read_gbs); the tokens must be
the same at every distance (a prefetch changes no result). With --json the last line is one
object: {"cpu", "file", "weights_bytes", "mem_read_gbs", "results": {bytes: {"tok_s_b1",
"runs", "b1_roofline_frac"}}, "same_tokens"}.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--shape", default="1b", choices=["1b", "3b", "8b"])
    ap.add_argument("--model", default=None, help="a GGUF file instead of the synthetic shape")
    ap.add_argument("--bytes", default="0,8192", help="prefetch distances to alternate (8192: the default)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "edgepaged" / "bench")
    args = ap.parse_args()
    from bench.family_bench import cpu_flags, mem_read_gbs, synthetic

    from edgepaged._native import quant
    from edgepaged.model.open import open_runner
    from edgepaged.testing.decode import make_allocator, run_batch
    path = Path(args.model) if args.model else synthetic("q4_k_m", args.cache_dir, args.shape)
    runner = open_runner(path, "cpu", runtime="cpu", num_blocks=64)
    alloc = make_allocator(runner)
    wb = runner.model.weight_bytes()
    prompt = [np.random.default_rng(0).integers(300, 1000, 32).astype(np.int64)]
    dists = [int(x) for x in args.bytes.split(",") if x]
    was = quant.decode_prefetch()
    runs, toks = {d: [] for d in dists}, {}
    bw = mem_read_gbs()
    try:
        run_batch(runner, alloc, prompt, 4, seq_base=1_000_000)   # warm-up
        for r in range(args.reps):
            for i, d in enumerate(dists):
                quant.decode_prefetch(d)
                out, _, td = run_batch(runner, alloc, prompt, 65, seq_base=100 * r + i)
                runs[d].append(round(64 / td, 2))
                toks[d] = out
            print(f"  run {r + 1}: " + ", ".join(f"{d} B: {runs[d][-1]} tok/s" for d in dists), flush=True)
    finally:
        quant.decode_prefetch(was)
    bw = max(bw, mem_read_gbs())
    res = {"cpu": cpu_flags(), "file": path.name, "weights_bytes": wb, "mem_read_gbs": round(bw, 2), "results": {},
           "same_tokens": all(toks[d] == toks[dists[0]] for d in dists)}
    for d in dists:
        med = round(statistics.median(runs[d]), 2)
        res["results"][str(d)] = {"tok_s_b1": med, "runs": runs[d], "b1_roofline_frac": round(med * wb / (bw * 1e9), 3)}
        print(f"prefetch {d} bytes: {med} tok/s ({res['results'][str(d)]['b1_roofline_frac']} of {bw:.1f} GB/s)")
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
