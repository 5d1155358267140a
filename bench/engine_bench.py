"""Engine benchmark: the embedded model in-process on a household mix with Poisson arrivals,
once with paging and once with contiguous reservation (prompt + max_tokens reserved at
admission, as the systems compared in vLLM's paper did), same KV budget, same requests.
Then the interactive-under-flood check: interactive TTFT p99 alone, and while background
agents flood the engine.

    python bench/engine_bench.py [--json] [--scale 0.15] [--requests 40] [--rate 3] [--caps agent=none/512]
                                 [--overlap on|off]

`--caps` changes what a class of clients sends as max_tokens (bench/workloads.py), nothing
else about the requests: the max_active ratio depends on it (see bench/RESULTS.md).

Prints a table; with --json the last line is one JSON object with, for `paged` and
`contiguous`: tok_s, ttft_p50_s, ttft_p99_s, max_active, preemptions, kv_waste_frac,
interactive_ttft_ratio (and more).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import trio

from edgepaged.engine import Engine, EngineConfig, Request, TokenEvent
from edgepaged.model import SamplingParams
from edgepaged.model.cpu.runner import CpuRunner
from edgepaged.testing.workloads import drive_arrivals, make_item, mix, parse_caps, poisson


def pct(values, q):
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def drive(engine: Engine, item, out: list) -> None:
    """One client: send, read until the answer's drawn length, then end it."""
    room = engine.max_model_len - len(item.prompt_ids)   # no max_tokens sent: up to the context, as the front end does
    req = Request(prompt_ids=item.prompt_ids, priority=item.priority, client=item.client,
                  params=SamplingParams(temperature=0, ignore_eos=True, max_tokens=item.max_tokens or room))
    t0 = time.monotonic()
    first, n = None, 0
    async with engine.stream(req) as events:
        async for ev in events:
            if isinstance(ev, TokenEvent):
                if first is None:
                    first = time.monotonic()
                n += len(ev.token_ids)
                if n >= item.answer_tokens:
                    break          # the answer ends here: the blocks go back as on an EOS
            else:
                break
    out.append(dict(klass=item.klass, priority=item.priority, tokens=n, ttft=(first or time.monotonic()) - t0,
                    e2e=time.monotonic() - t0, complete=n >= item.answer_tokens))


async def run_mix(runner, items, contiguous: bool, cfg: dict) -> dict:
    engine = Engine(runner, EngineConfig(contiguous=contiguous, **cfg))
    results: list[dict] = []
    trace = []
    async with engine:
        async def sampler(t0):
            while True:
                s = engine.scheduler
                trace.append((round(time.monotonic() - t0, 3), s.num_running, s.num_waiting,
                              engine.allocator.num_used_blocks))
                await trio.sleep(0.25)

        wall = await drive_arrivals(items, lambda it: drive(engine, it, results), sampler)
        st = engine.stats()
    toks = sum(r["tokens"] for r in results)
    ttfts = [r["ttft"] for r in results]
    return {
        "tok_s": round(toks / wall, 2),
        "wall_s": round(wall, 2),
        "requests": len(results),
        "completed": sum(r["complete"] for r in results),
        "ttft_p50_s": round(pct(ttfts, 0.5), 3),
        "ttft_p99_s": round(pct(ttfts, 0.99), 3),
        "max_active": st["max_requests_running"],
        "preemptions": st["num_preemptions"],
        "kv_waste_frac": st["kv_waste_frac"],
        "prefix_hit_rate": st["prefix_cache_hit_rate"],
        "kv_blocks_max": max((t[3] for t in trace), default=0),
        "trace": trace,
    }


async def interactive_ratio(runner, tok, contiguous: bool, cfg: dict, scale: float, seed: int) -> dict:
    """Interactive TTFT p99 alone vs under a background flood (same interactive prompts)."""
    import random
    rng = random.Random(seed)
    inter = [make_item(tok, "home", rng, 1.0) for _ in range(6)]
    flood = [make_item(tok, "agent", rng, scale) for _ in range(24)]
    engine = Engine(runner, EngineConfig(contiguous=contiguous, **cfg))
    async with engine:
        alone: list[dict] = []
        for it in inter:
            await drive(engine, it, alone)
        flooded: list[dict] = []
        async with trio.open_nursery() as n:
            for it in flood:
                n.start_soon(drive, engine, it, [])
            await trio.sleep(1.0)
            for it in inter:
                await drive(engine, it, flooded)
                await trio.sleep(0.5)
            n.cancel_scope.cancel()
    a = pct([r["ttft"] for r in alone], 0.99)
    f = pct([r["ttft"] for r in flooded], 0.99)
    return {"interactive_ttft_alone_p99_s": round(a, 3), "interactive_ttft_flood_p99_s": round(f, 3),
            "interactive_ttft_ratio": round(f / a, 2) if a else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.15, help="multiplies every request length")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=3.0, help="Poisson arrivals per second (3.0 loads the 2-core box "
                    "on this mix; at 1.5 paging keeps up and holds what has arrived: bench/RESULTS.md has both)")
    ap.add_argument("--kv-tokens", type=int, default=8192, help="KV budget in tokens (same for both modes)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-batched-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--caps", default="", help="override the max_tokens a class's clients send, e.g. "
                    "'agent=none/512' (sensitivity runs; the default is workloads.CLASSES)")
    ap.add_argument("--overlap", choices=("on", "off"), default="on",
                    help="the engine streams the last step's tokens while the next step runs (on) or between steps")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    t = time.monotonic()
    runner = CpuRunner(num_blocks=args.kv_tokens // 16, block_size=16)   # what serve runs on a CPU
    tok = runner.tokenizer
    print(f"model {runner.model_path.name} loaded in {time.monotonic() - t:.1f} s; KV pool {runner.num_blocks} "
          f"blocks x 16 = {runner.num_blocks * 16} tokens ({runner.kv_dtype_name}); context {runner.max_model_len}; "
          f"{runner.products} products")
    cfg = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_batched_tokens,
               overlap_host_work=args.overlap == "on")
    items = poisson(mix(tok, args.requests, args.seed, args.scale, context=runner.max_model_len,
                        caps=parse_caps(args.caps)), args.rate,
                    args.seed)
    out = {}
    for mode in ("paged", "contiguous"):
        t = time.monotonic()
        r = trio.run(run_mix, runner, items, mode == "contiguous", cfg)
        r.update(trio.run(interactive_ratio, runner, tok, mode == "contiguous", cfg, args.scale, args.seed))
        out[mode] = r
        print(f"{mode}: done in {time.monotonic() - t:.0f} s", flush=True)

    keys = ["tok_s", "ttft_p50_s", "ttft_p99_s", "max_active", "preemptions", "kv_waste_frac", "prefix_hit_rate",
            "kv_blocks_max", "completed", "interactive_ttft_alone_p99_s", "interactive_ttft_flood_p99_s",
            "interactive_ttft_ratio"]
    print(f"\n{'':32}{'paged':>12}{'contiguous':>12}")
    for k in keys:
        print(f"{k:32}{out['paged'][k]!s:>12}{out['contiguous'][k]!s:>12}")
    ratio = out["paged"]["max_active"] / max(1, out["contiguous"]["max_active"])
    print(f"max_active paged/contiguous: {ratio:.1f}x   (requests={args.requests}, scale={args.scale}, "
          f"rate={args.rate}/s, kv={args.kv_tokens} tokens)")
    if args.json:
        for m in out.values():
            m.pop("trace")
        out.update(max_active_ratio=round(ratio, 2), requests=args.requests, scale=args.scale, rate=args.rate,
                   kv_tokens=args.kv_tokens, caps=args.caps or "default", machine=f"{platform.machine()} {os.cpu_count()} cpus",
                   products=runner.products, kv_dtype=runner.kv_dtype_name)
        print(json.dumps(out))


if __name__ == "__main__":
    main()
