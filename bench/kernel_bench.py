#!/usr/bin/env python3
"""Paged decode on a GPU: achieved K/V bandwidth against the device's copy bandwidth and SDPA.

Shape: 32 query / 8 KV heads, head dim 128, bf16, block size 16, scattered block tables, every
sequence of the batch at the full context. Bandwidth = bytes of K and V read per call / time;
copy bandwidth = (bytes read + written) / time of a large device-to-device copy. The SDPA baseline
runs the same attention on contiguous K/V (each KV head's query group as a 4-row query).
Times are medians of triton.testing.do_bench (L2 flushed before each call, Python launch
overhead included); graph_us replays the call as a CUDA graph.

    python bench/kernel_bench.py [--json] [--sweep] [--prefill] [--batches 1,32,128] [--contexts 512,4096,32768]

--json prints one JSON object as the last line; --sweep also times a few decode launch configs at
batch 32 x context 4096; --prefill times paged_prefill on fresh prompts against SDPA's causal attention. Without a CUDA GPU it runs a tiny interpreted smoke check and exits 0.
"""
import argparse
import json
import os
import time


import torch  # noqa: E402

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

H, HKV, D, BS, DTYPE = 32, 8, 128, 16, torch.bfloat16
DEVICE = "cuda"


def make_inputs(batch, ctx, device, dtype=DTYPE, heads=H, kv_heads=HKV, head_dim=D):
    num_blocks = batch * ctx // BS
    shape = (num_blocks, BS, kv_heads, head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, device=device).view(batch, ctx // BS).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    return q, k_cache, v_cache, tables, seq_lens


def smoke():
    """No GPU: one tiny decode in Triton's interpreter, so the script is known to run."""
    from edgepaged.kernels import paged_decode
    q, k, v, tables, lens = make_inputs(2, 64, "cpu", torch.float32, heads=4, kv_heads=2, head_dim=64)
    t0 = time.perf_counter()
    paged_decode(q, k, v, tables, lens, 0.125)
    ms = (time.perf_counter() - t0) * 1e3
    print(f"no CUDA GPU: bandwidth needs a GPU. Interpreted smoke decode (batch 2 x context 64) ran in {ms:.0f} ms.")
    return {"gpu": False, "smoke_ms": ms}


def copy_bandwidth(do_bench):
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x))
    del x, y
    return 2 * (2 << 30) / ms / 1e6  # GB/s, bytes read + written


def bench_shape(batch, ctx, do_bench, copy_gbps, sdpa=True):
    from edgepaged.kernels import paged_decode
    from edgepaged.kernels.attention import _auto_splits
    q, k_cache, v_cache, tables, lens = make_inputs(batch, ctx, DEVICE)
    scale = D ** -0.5
    kv_bytes = 2 * batch * ctx * HKV * D * k_cache.element_size()
    ms = do_bench(lambda: paged_decode(q, k_cache, v_cache, tables, lens, scale))
    row = dict(batch=batch, ctx=ctx, splits=_auto_splits(batch * HKV, ctx, q.device), paged_us=ms * 1e3,
               gbps=kv_bytes / ms / 1e6)
    row["frac_copy"] = row["gbps"] / copy_gbps
    if GPU:  # replayed as a CUDA graph: no Python launch overhead (but no L2 flush between calls)
        import triton.testing
        try:
            row["graph_us"] = triton.testing.do_bench_cudagraph(
                lambda: paged_decode(q, k_cache, v_cache, tables, lens, scale), return_mode="median") * 1e3
        except Exception as e:
            row["graph_us"] = float("nan")
            print(f"  cuda graph timing failed: {type(e).__name__}: {str(e)[:120]}")
    if sdpa:  # same attention on contiguous K/V [B, Hkv, ctx, D]; a KV head's query group as G query rows
        idx = tables.long()
        k = k_cache[idx].view(batch, ctx, HKV, D).transpose(1, 2).contiguous()
        v = v_cache[idx].view(batch, ctx, HKV, D).transpose(1, 2).contiguous()
        qg = q.view(batch, HKV, H // HKV, D)
        f = torch.nn.functional.scaled_dot_product_attention
        ref = f(qg, k, v, scale=scale).view(batch, H, D)
        row["max_diff"] = (paged_decode(q, k_cache, v_cache, tables, lens, scale).float() - ref.float()).abs().max().item()
        sdpa_ms = do_bench(lambda: f(qg, k, v, scale=scale))
        row["sdpa_us"] = sdpa_ms * 1e3
        row["paged_over_sdpa"] = ms / sdpa_ms
        del k, v
    del q, k_cache, v_cache
    if GPU:
        torch.cuda.empty_cache()
    return row


def bench_prefill(batch, length, do_bench):
    """Fresh prompts: B chunks of `length` rows over their own K/V (already written), causal;
    SDPA's causal attention (flash) on the same contiguous K/V beside it. TFLOP/s counts the
    causal half: 2 * 2 * L^2 / 2 * H * D per chunk."""
    from edgepaged.kernels import paged_prefill
    q1, k_cache, v_cache, tables, lens = make_inputs(batch, length, DEVICE)
    q = torch.randn(batch * length, H, D, device=DEVICE, dtype=DTYPE)
    qsl = torch.arange(0, batch * length + 1, length, device=DEVICE, dtype=torch.int32)
    scale = D ** -0.5
    ms = do_bench(lambda: paged_prefill(q, k_cache, v_cache, tables, qsl, lens, scale))
    flops = 2 * batch * length * length * H * D
    row = dict(batch=batch, length=length, prefill_us=ms * 1e3, tflops=flops / ms / 1e9)
    idx = tables.long()
    k = k_cache[idx].view(batch, length, HKV, D).transpose(1, 2).contiguous()
    v = v_cache[idx].view(batch, length, HKV, D).transpose(1, 2).contiguous()
    qb = q.view(batch, length, H, D).transpose(1, 2).contiguous()
    f = torch.nn.functional.scaled_dot_product_attention
    ref = f(qb, k, v, scale=scale, is_causal=True, enable_gqa=True)
    got = paged_prefill(q, k_cache, v_cache, tables, qsl, lens, scale).view(batch, length, H, D).transpose(1, 2)
    row["max_diff"] = (got.float() - ref.float()).abs().max().item()
    sdpa_ms = do_bench(lambda: f(qb, k, v, scale=scale, is_causal=True, enable_gqa=True))
    row["sdpa_us"] = sdpa_ms * 1e3
    row["paged_over_sdpa"] = ms / sdpa_ms
    del q1, q, k_cache, v_cache, k, v, qb
    if GPU:
        torch.cuda.empty_cache()
    return row


def sweep(do_bench, copy_gbps):
    """Time a few decode launch configs at batch 32 x context 4096 (the bandwidth target)."""
    from edgepaged.kernels import attention
    default = dict(attention.DECODE_CONFIG)
    rows = []
    for tile in (8192, 16384, 32768):
        for warps in (4, 8):
            for stages in (2, 3):
                attention.DECODE_CONFIG.update(TILE_BYTES=tile, num_warps=warps, num_stages=stages)
                try:
                    r = bench_shape(32, 4096, do_bench, copy_gbps, sdpa=False)
                except Exception as e:  # e.g. out of shared memory
                    r = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
                rows.append(dict(TILE_BYTES=tile, num_warps=warps, num_stages=stages, **r))
                print(f"  sweep tile {tile:5d} warps {warps} stages {stages}: "
                      + (f"{r['paged_us']:8.1f} us {r['frac_copy']:6.1%} of copy" if "gbps" in r else r["error"]))
    attention.DECODE_CONFIG.clear()
    attention.DECODE_CONFIG.update(default)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--sweep", action="store_true", help="also time a few decode launch configs")
    ap.add_argument("--prefill", action="store_true", help="also time paged_prefill on fresh prompts against SDPA")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--contexts", default="512,4096,32768")
    args = ap.parse_args()
    if not GPU:
        result = smoke()
        if args.json:
            print(json.dumps(result))
        return
    import triton.testing

    def do_bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    torch.manual_seed(0)
    copy_gbps = copy_bandwidth(do_bench)
    result = dict(gpu=True, device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, copy_gbps=copy_gbps, rows=[])
    print(f"{result['device']}: device copy bandwidth {copy_gbps:.0f} GB/s (read + written)")
    print(f"{'batch':>5} {'ctx':>6} {'splits':>6} {'paged_us':>9} {'GB/s':>7} {'%copy':>6} {'graph_us':>9} "
          f"{'sdpa_us':>9} {'paged/sdpa':>10} {'max_diff':>8}")
    for batch in map(int, args.batches.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            need = 4 * batch * ctx * HKV * D * 2 * 1.1  # paged K/V and their contiguous copies
            if need > torch.cuda.mem_get_info()[0]:
                print(f"{batch:>5} {ctx:>6} skipped: needs {need / 1e9:.1f} GB")
                continue
            r = bench_shape(batch, ctx, do_bench, copy_gbps)
            result["rows"].append(r)
            print(f"{batch:>5} {ctx:>6} {r['splits']:>6} {r['paged_us']:>9.1f} {r['gbps']:>7.0f} {r['frac_copy']:>6.1%} "
                  f"{r['graph_us']:>9.1f} {r['sdpa_us']:>9.1f} {r['paged_over_sdpa']:>10.2f} {r['max_diff']:>8.1e}")
    if args.prefill:
        result["prefill"] = []
        print(f"prefill {'batch':>5} {'len':>6} {'paged_us':>9} {'TFLOP/s':>8} {'sdpa_us':>9} {'paged/sdpa':>10} {'max_diff':>8}")
        for batch, length in ((1, 2048), (8, 512), (4, 4096), (1, 16384)):
            r = bench_prefill(batch, length, do_bench)
            result["prefill"].append(r)
            print(f"        {batch:>5} {length:>6} {r['prefill_us']:>9.1f} {r['tflops']:>8.1f} {r['sdpa_us']:>9.1f} "
                  f"{r['paged_over_sdpa']:>10.2f} {r['max_diff']:>8.1e}")
    if args.sweep:
        result["sweep"] = sweep(do_bench, copy_gbps)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
