#!/usr/bin/env python3
"""Judge Triton launch variants on a CUDA GPU, alternating them step by step in one process.

1. prefill: PREFILL_CONFIG's SPLIT_DIAG off and on at the default tiles, over fresh prompts
   (1 x 2048, 8 x 512, 4 x 4096, 1 x 16384) and a 512-row chunk over a 3584-token cached prefix
   (8 sequences), `rounds` times each in turn; the median per variant and shape;
2. prefill tiles: TILE_BYTES x BLOCK_M x warps x stages with the better flags, at 4 x 4096 and 8 x 512;
3. decode: the default DECODE_CONFIG against two others over batches 1/32/128 x contexts 512/4096/32768.

    python bench/kernel_tune.py [--json] [--rounds 3] [--budget-s 200]

Shapes as kernel_bench.py (32/8 heads, D 128, bf16, block 16, scattered tables). Every variant's
output is checked against the default's (max abs difference). --budget-s stops starting new
phases past that many seconds. --json prints one JSON object as the last line. No GPU: says so, exits 0.
"""
import argparse
import itertools
import json
import statistics
import sys
import time


import torch  # noqa: E402

H, HKV, D, BS, DTYPE = 32, 8, 128, 16, torch.bfloat16


def prefill_case(batch, length, prefix):
    ctx = prefix + length
    num_blocks = batch * ctx // BS
    shape = (num_blocks, BS, HKV, D)
    k = torch.randn(shape, device="cuda", dtype=DTYPE)
    v = torch.randn(shape, device="cuda", dtype=DTYPE)
    tables = torch.randperm(num_blocks, device="cuda").view(batch, ctx // BS).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * length, H, D, device="cuda", dtype=DTYPE)
    qsl = torch.arange(0, batch * length + 1, length, device="cuda", dtype=torch.int32)
    flops = 2 * 2 * batch * length * H * D * (prefix + length / 2)   # QK and PV, causal half of the chunk
    return (q, k, v, tables, qsl, lens), flops


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=200.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to tune here.")
        if args.json:
            print(json.dumps({"gpu": False}))
        return 0
    import triton.testing

    from edgepaged.kernels import attention, paged_decode, paged_prefill
    t_start = time.perf_counter()

    def do_bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")

    torch.manual_seed(0)
    result = {"gpu": True, "device": torch.cuda.get_device_name(), "triton": triton.__version__}
    default_prefill = dict(attention.PREFILL_CONFIG)
    scale = D ** -0.5

    # 1. prefill flags, alternating
    shapes = [(1, 2048, 0), (8, 512, 0), (4, 4096, 0), (1, 16384, 0), (8, 512, 3584)]
    flags = [dict(SPLIT_DIAG=False), dict(SPLIT_DIAG=True)]
    cases = {s: prefill_case(*s) for s in shapes}
    times = {(i, s): [] for i in range(len(flags)) for s in shapes}
    diffs = {}
    refs = {}
    for rnd in range(args.rounds):
        for s in shapes:
            inputs, _ = cases[s]
            for i, f in enumerate(flags):
                attention.PREFILL_CONFIG.update(default_prefill, **f)
                out = paged_prefill(*inputs, scale)
                if i == 0 and rnd == 0:
                    refs[s] = out
                elif rnd == 0:
                    diffs[(i, s)] = (out.float() - refs[s].float()).abs().max().item()
                times[(i, s)].append(do_bench(lambda: paged_prefill(*inputs, scale)))
    attention.PREFILL_CONFIG.clear()
    attention.PREFILL_CONFIG.update(default_prefill)
    rows = []
    print(f"prefill flags (median of {args.rounds} alternating rounds), us and TFLOP/s")
    for s in shapes:
        line = f"  B {s[0]:>2} x {s[1]:>5} over {s[2]:>4}:"
        for i, f in enumerate(flags):
            ms = statistics.median(times[(i, s)])
            tf = cases[s][1] / ms / 1e9
            rows.append(dict(batch=s[0], length=s[1], prefix=s[2], **f, us=ms * 1e3, tflops=tf,
                             max_diff=diffs.get((i, s), 0.0)))
            line += f"  diag {int(f['SPLIT_DIAG'])}: {ms * 1e3:8.1f} ({tf:5.1f})"
        print(line)
    result["prefill_flags"] = rows
    score = {i: statistics.geometric_mean([statistics.median(times[(i, s)]) for s in shapes]) for i in range(len(flags))}
    best = flags[min(score, key=score.get)]
    result["prefill_best_flags"] = best
    result["prefill_flag_speedup"] = score[0] / min(score.values())
    print(f"  best flags {best}: geometric-mean speedup {result['prefill_flag_speedup']:.3f} over masking every tile")

    # 2. prefill tiles with the best flags
    if time.perf_counter() - t_start < args.budget_s:
        tile_rows = []
        for tile, bm, warps, stages in itertools.product((16384, 32768), (64, 128), (4, 8), (2, 3)):
            if time.perf_counter() - t_start > args.budget_s:
                break
            cfg = dict(default_prefill, **best, TILE_BYTES=tile, BLOCK_M=bm, num_warps=warps, num_stages=stages)
            attention.PREFILL_CONFIG.update(cfg)
            r = dict(TILE_BYTES=tile, BLOCK_M=bm, num_warps=warps, num_stages=stages)
            try:
                for s in ((4, 4096, 0), (8, 512, 0)):
                    inputs, flops = cases[s]
                    ms = do_bench(lambda: paged_prefill(*inputs, scale))
                    r[f"us_{s[0]}x{s[1]}"] = ms * 1e3
                    r[f"diff_{s[0]}x{s[1]}"] = (paged_prefill(*inputs, scale).float() - refs[s].float()).abs().max().item()
            except Exception as e:   # e.g. out of shared memory
                r["error"] = f"{type(e).__name__}: {str(e)[:100]}"
            tile_rows.append(r)
            print("  tiles " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
        attention.PREFILL_CONFIG.clear()
        attention.PREFILL_CONFIG.update(default_prefill)
        result["prefill_tiles"] = tile_rows
    del cases, refs
    torch.cuda.empty_cache()

    # 3. decode configs, alternating
    if time.perf_counter() - t_start < args.budget_s:
        from bench.kernel_bench import make_inputs
        default_decode = dict(attention.DECODE_CONFIG)
        variants = [default_decode, dict(TILE_BYTES=8192, num_warps=4, num_stages=2),
                    dict(TILE_BYTES=32768, num_warps=4, num_stages=3)]
        drows = []
        for batch, ctx in itertools.product((1, 32, 128), (512, 4096, 32768)):
            inputs = make_inputs(batch, ctx, "cuda")
            q, k, v, tables, lens = inputs
            ts = [[] for _ in variants]
            for _ in range(args.rounds):
                for j, cfg in enumerate(variants):
                    attention.DECODE_CONFIG.clear()
                    attention.DECODE_CONFIG.update(cfg)
                    ts[j].append(do_bench(lambda: paged_decode(q, k, v, tables, lens, scale)))
            us = [statistics.median(t) * 1e3 for t in ts]
            drows.append(dict(batch=batch, ctx=ctx, us=us))
            print(f"  decode B {batch:>3} x {ctx:>5}: " + "  ".join(
                f"{c['TILE_BYTES']}/{c['num_warps']}/{c['num_stages']} {u:7.1f} us" for c, u in zip(variants, us)))
            del q, k, v, inputs
            torch.cuda.empty_cache()
        attention.DECODE_CONFIG.clear()
        attention.DECODE_CONFIG.update(default_decode)
        result["decode_variants"] = variants
        result["decode"] = drows
    result["seconds"] = time.perf_counter() - t_start
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
