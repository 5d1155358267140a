#!/usr/bin/env python3
"""The exact products for a few tokens on 8 lanes (AVX2) against 16 (AVX-512 F), alternated
process by process in one run: a model's layers' products for one token and its decode at 1
and 3 streams (the embedded SmolLM2-135M by default: Q4_1 weights, the exact math under
0.7 B parameters).

    python bench/products_bench.py [--json] [--model FILE] [--reps 3]

Each rep runs, for each width, a fresh process with EDGEPAGED_NO_AVX512=1 (8 lanes) or 0 (16
lanes): `tok_s_b1` and `tok_s_b3` (family_bench's greedy `run_batch`, best of 3 × 64 new
tokens), `products_gbs` (every layer's weight bytes over the time of their one-token
products, called one by one, best of 20 passes: the weights stream from memory) and, in a
process of one thread, `products_gbs_1t`. With --json the last line is one object: {"cpu",
"model", "weights_bytes", "mem_read_gbs", "lanes": {"8": {figure: median}, "16": ...},
"runs": {...}, "ratio_16_8": {figure: ratio of the medians}} ("16" is null, with "note",
on a CPU without AVX-512 F). Decode attention and sampling are the same code either way;
EDGEPAGED_NO_AVX512 also turns off prefill attention's 16-lane paths, which a 64-token
decode after a 32-token prompt hardly uses.

The tiles for 2 to 5 tokens (three streams, a step that checks drafts) run several groups of
rows at once, so that more FMA chains are in flight (`quant.tile_groups`); each child also
alternates them with one group at a time, pass by pass in the same process:
`products_gbs_t2` / `products_gbs_t3` (the layers' products for 2 / 3 tokens) and `tok_s_b3`,
each with a `_one_group` twin, and "ratio_groups": {lanes: {figure: at once / one at a time}}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np



def child(model: str, decode: bool) -> dict:
    from edgepaged._native import quant as kernels
    from edgepaged.model.open import open_runner
    from edgepaged.testing.decode import make_allocator, run_batch
    runner = open_runner(model, "cpu", num_blocks=64)
    res = {}
    # the few-token tiles' groups at once (the default) and one at a time, alternated
    variants = (("", True), ("_one_group", False))
    if decode:
        alloc = make_allocator(runner)
        vocab = runner.config.vocab_size
        rng = np.random.default_rng(0)
        run_batch(runner, alloc, [rng.integers(300, vocab - 300, 8)], 4, seq_base=1_000_000)
        for n in (1, 3):
            best = {v: 0.0 for v, _ in variants}
            for r in range(3):
                for v, many in variants if n > 1 else variants[:1]:
                    kernels.tile_groups(many)
                    _, _, td = run_batch(runner, alloc, [rng.integers(300, vocab - 300, 32) for _ in range(n)], 64,
                                         seq_base=1000 * (r + 1) + 100 * n + (10 if many else 0))
                    best[v] = max(best[v], n * 63 / td)
            for v, b in best.items():
                if b:
                    res[f"tok_s_b{n}{v}"] = round(b, 1)
        kernels.tile_groups(True)
    parts = [(s, lin.in_features, lin.out_features, a) for layer in runner.model.layers
             for lin in (layer.qkv, layer.o, layer.gate_up, layer.down) for s, a in zip(lin.segments, lin.offsets)]
    nbytes = sum(s.data.nbytes for s, *_ in parts)
    for t in (1, 2, 3) if decode else (1,):
        outs = {n: np.empty((t, n), np.float32) for _, _, n, _ in parts}
        xs = {k: np.ones((t, k), np.float32) for _, k, _, _ in parts}
        best = {v: float("inf") for v, _ in variants}
        for _ in range(20):
            for v, many in variants if t > 1 else variants[:1]:
                kernels.tile_groups(many)
                start = time.perf_counter()
                for s, k, n, a in parts:
                    kernels.matmul(s.data, s.kind, xs[k], outs[n], col=a, rows=s.rows)
                best[v] = min(best[v], time.perf_counter() - start)
        kernels.tile_groups(True)
        for v, b in best.items():
            if b < float("inf"):
                res["products_gbs" + ("" if t == 1 else f"_t{t}") + v] = round(nbytes / b / 1e9, 2)
    return res


def run_child(model: str, lanes: int, threads: int | None) -> dict:
    env = dict(os.environ, EDGEPAGED_NO_AVX512="1" if lanes == 8 else "0")
    if threads:
        env["EDGEPAGED_NUM_THREADS"] = str(threads)
    args = [sys.executable, __file__, "--child", "--model", model] + ([] if threads is None else ["--products-only"])
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    return {("products_gbs_1t" if threads else k): v for k, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--products-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.model is None:
        from edgepaged.model import default_model_path
        a.model = str(default_model_path())
    if a.child:
        print(json.dumps(child(a.model, decode=not a.products_only)))
        return
    from bench.family_bench import cpu_flags, mem_read_gbs
    flags = cpu_flags()
    has16 = "avx512f" in (flags.get("flags") or "")
    widths = [8, 16] if has16 else [8]
    runs: dict[str, list[dict]] = {str(w): [] for w in widths}
    for r in range(a.reps):
        for w in widths:
            res = run_child(a.model, w, None)
            res.update(run_child(a.model, w, 1))
            runs[str(w)].append(res)
            print(f"  rep {r + 1}, {w} lanes: " + ", ".join(f"{k} {v}" for k, v in res.items()), flush=True)
    med = {w: {k: round(statistics.median(x[k] for x in rs), 2) for k in rs[0]} for w, rs in runs.items()}
    out = {"cpu": flags, "model": Path(a.model).name, "weights_bytes": Path(a.model).stat().st_size,
           "mem_read_gbs": round(mem_read_gbs(), 2), "lanes": {"8": med["8"], "16": med.get("16")}, "runs": runs,
           "ratio_16_8": ({k: round(med["16"][k] / med["8"][k], 3) for k in med["8"]} if has16 else None)}
    if not has16:
        out["note"] = "this CPU has no AVX-512 F: only the 8-lane path runs"
    for w, m in med.items():
        print(f"{w} lanes (median of {a.reps}): " + ", ".join(f"{k} {v}" for k, v in m.items()))
    if out["ratio_16_8"]:
        print("16 / 8 lanes: " + ", ".join(f"{k} {v}" for k, v in out["ratio_16_8"].items()))
    # the few-token tiles: several groups of rows at once against one at a time, same process
    out["ratio_groups"] = {w: {k: round(m[k] / m[k + "_one_group"], 3) for k in m if k + "_one_group" in m}
                           for w, m in med.items()}
    for w, r in out["ratio_groups"].items():
        print(f"{w} lanes, groups at once / one at a time: " + ", ".join(f"{k} {v}" for k, v in r.items()))
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
