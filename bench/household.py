"""The household benchmark: request-length mixes and arrival patterns end to end over the
protocol, paging against contiguous reservation and against other runtimes, with plots.

1. End to end: `edgepaged serve` as a subprocess (loopback), many concurrent clients over the
   real protocol, a household mix (bench/workloads.py) with Poisson arrivals — once with
   paging, once with contiguous reservation (`--contiguous`), same KV budget, same requests.
   Clients send the max_tokens real clients send; each answer ends at its drawn length (the
   client cancels there, which frees the blocks as an end-of-sequence token would).
2. Baselines on the same prompts: transformers `generate` with static batches of 8 (fp32,
   left padding); llama-cpp-python on the same GGUF when installed (skipped with a reason).
3. A trace-driven simulation of a household day (thousands of requests) with the real Rust
   allocator and the real scheduling policy; step times come from a cost model fitted to
   this machine's measured forward times (not measured end to end). Paged against
   contiguous, and a sliding-window policy that keeps only the last W tokens of each
   sequence (its KV is accounted on the same run: windowing changes how much state a
   sequence keeps, paging changes how it is allocated).

    python bench/household.py [--quick] [--json] [--out bench/out/household] [--caps agent=none/512]

With --json the last line is one JSON object: paged, contiguous, hf (tok_s, max_active,
ttft_p50/p90/p99_s, ...), llama_cpp, simulation. Plots (PNG) go to --out.

    python bench/household.py --model FILE [--requests 16] [--rate R] [--json]
    python bench/household.py --model FILE --kv-memory BYTES --kv-dtype f16,q8_0 --modes paged,contiguous \
        [--llama-server PATH] [--json]

points the same arrival driver at `edgepaged serve --model FILE` (a 1-8 B GGUF, say): the
16 requests of the household mix all at once (Poisson at R/s with --rate), the end-to-end
part only, paged: the banner, the figures above for `paged`, and
`blocks_back` (the server's KV blocks held by requests once every client is done: 0).
The second form (issue 38, when memory binds) runs the same arrivals against each KV type and
scheme with the same KV memory, in one run: `runs` {"f16/paged": {kv_bound_active, tok_s,
home_ttft_p90_s, ...}, ...}, `kv_bound_ratio_q8_0` (q8_0's kv_bound_active over f16's, paged),
and `llama_cpp` {type: {tok_s, home_ttft_p90_s, slots}} from llama.cpp's server given the same
memory (as many slots as hold the longest request).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import trio

from edgepaged.testing.workloads import CLASSES, burst, drive_arrivals, make_item, mix, parse_caps, poisson  # noqa: E402

from edgepaged.client import ServerError, open_client  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODES = ("paged", "contiguous", "window")



def pct(values, q):
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 4)


def quantiles(values) -> dict:
    return {f"p{int(q * 100)}": pct(values, q) for q in (0.5, 0.9, 0.99)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------ end to end
class Serve:
    def __init__(self, kv_bytes: int, contiguous: bool, max_batched: int, model: Path | None = None,
                 extra: list[str] | None = None):
        self.port = free_port()
        if model:     # a large file's layout in the weights cache first: no writer beside the run
            from edgepaged.model import weights_cache
            weights_cache.prepare(model)
        cmd = [sys.executable, "-m", "edgepaged.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--no-mdns", "--no-http", "--kv-memory", str(kv_bytes), "--max-batched-tokens", str(max_batched),
               "--max-connections", "512", "--grace", "1",
               # no disk tier: a server must not find the prompts an earlier run (another mode) computed
               "--prefix-cache-disk", "0",
               # the clients all come from loopback here: each stands for a device of its own
               "--max-unauthenticated", "256", "--max-unauthenticated-per-address", "256"] + (["--contiguous"] if contiguous else []) + (
               ["--model", str(model)] if model else []) + (extra or [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.banner = None
        for line in self.proc.stdout:
            if "ready on" in line:
                self.banner = line.strip()
                break
        if self.banner is None:
            raise SystemExit(f"the server did not start (exit {self.proc.wait()})")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
        self.addr = f"127.0.0.1:{self.port}"

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def client(addr: str, item, out: list) -> None:
    t0 = time.monotonic()
    rec = dict(klass=item.klass, priority=item.priority, tokens=0, want=item.answer_tokens, error=None)
    times = []
    try:
        async with open_client(addr, name=item.client) as c:
            stream = c.chat(item.messages, max_tokens=item.max_tokens, temperature=0, ignore_eos=True,
                            priority=item.priority)
            async for _ in stream:
                if len(stream.token_ids) > rec["tokens"]:
                    rec["tokens"] = len(stream.token_ids)
                    times.append(time.monotonic())
                if rec["tokens"] >= item.answer_tokens:
                    await stream.cancel()       # the answer ends here
                    break
            done = stream.done or {}
            rec["queue_s"] = done.get("timings", {}).get("queue_s")
            if done.get("error"):
                rec["error"] = done["error"]
    except ServerError as e:
        rec["error"] = {"code": e.code, "message": str(e)}
    rec["ttft_s"] = times[0] - t0 if times else None
    rec["tpot_s"] = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    rec["e2e_s"] = time.monotonic() - t0
    rec["complete"] = rec["tokens"] >= item.answer_tokens and rec["error"] is None
    out.append(rec)


async def run_e2e(addr: str, items) -> dict:
    results: list[dict] = []
    samples = []

    async def sampler(t0):
        async with open_client(addr, name="bench-observer") as c:
            while True:
                s = await c.stats()
                samples.append((round(time.monotonic() - t0, 2), s["num_requests_running"], s["num_requests_waiting"],
                                s["kv_blocks_used"], s["tokens_per_s"]))
                await trio.sleep(0.5)

    wall = await drive_arrivals(items, lambda it: client(addr, it, results), sampler)
    async with open_client(addr, name="bench-observer") as c:
        final = await c.stats()
    return summarize(results, wall, final, samples)


async def run_closed_loop(addr: str, tok, users: int, per_user: int, think_s: float, scale: float,
                          answer_scale: float, seed: int) -> dict:
    """Closed-loop users: each sends a request, reads the answer, thinks, sends the next."""
    results: list[dict] = []
    t0 = time.monotonic()

    async def user(u: int):
        rng = random.Random(seed * 100 + u)
        klass = ("home", "chat", "chat", "document", "home", "agent")[u % 6]
        for _ in range(per_user):
            it = make_item(tok, klass, rng, scale, client=f"user-{u}", answer_scale=answer_scale)
            await client(addr, it, results)
            await trio.sleep(rng.expovariate(1 / think_s))

    async with trio.open_nursery() as n:
        for u in range(users):
            n.start_soon(user, u)
    wall = time.monotonic() - t0
    async with open_client(addr, name="bench-observer") as c:
        final = await c.stats()
    return summarize(results, wall, final, [])


def summarize(results, wall, final, samples) -> dict:
    toks = sum(r["tokens"] for r in results)
    per_class = {}
    for k in CLASSES:
        rs = [r for r in results if r["klass"] == k]
        if rs:
            per_class[k] = {"n": len(rs), "ttft_s": quantiles([r["ttft_s"] for r in rs if r["ttft_s"] is not None]),
                            "tpot_s": quantiles([r["tpot_s"] for r in rs if r["tpot_s"] is not None]),
                            "queue_s": quantiles([r["queue_s"] for r in rs if r.get("queue_s") is not None])}
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    return {
        "tok_s": round(toks / wall, 2), "wall_s": round(wall, 1), "requests": len(results),
        "completed": sum(r["complete"] for r in results), "failed": sum(not r["complete"] for r in results),
        "max_active": final["max_requests_running"], "preemptions": final["num_preemptions"],
        "prefix_hit_rate": final["prefix_cache_hit_rate"],
        "ttft_p50_s": pct(ttfts, 0.5), "ttft_p90_s": pct(ttfts, 0.9), "ttft_p99_s": pct(ttfts, 0.99),
        "tpot_p50_s": pct([r["tpot_s"] for r in results if r["tpot_s"]], 0.5),
        "queue_p99_s": pct([r["queue_s"] for r in results if r.get("queue_s") is not None], 0.99),
        "kv_blocks_max": max((s[3] for s in samples), default=0), "kv_blocks_total": final["kv_blocks_total"],
        # while anything ran: the mean of the half-second samples
        "mean_active": round(sum(s[1] for s in busy) / len(busy), 2) if (busy := [s for s in samples if s[1]]) else None,
        "kv_blocks_mean": round(sum(s[3] for s in busy) / len(busy), 1) if busy else None,
        "queue_p50_s": pct([r["queue_s"] for r in results if r.get("queue_s") is not None], 0.5),
        # what memory allows, whatever the box's speed: sequences running when the pool held the next back
        "kv_bound_active": final.get("kv_bound_active"), "kv_bound_active_max": final.get("kv_bound_active_max"),
        "kv_bound_moments": final.get("kv_bound_moments"),
        "per_class": per_class, "samples": samples,
        "ttfts_by_class": {k: sorted(r["ttft_s"] for r in results if r["klass"] == k and r["ttft_s"] is not None)
                           for k in CLASSES},
    }


# ------------------------------------------------------------------------------ baselines
def run_hf(items, model_path: Path, batch: int = 8) -> dict:
    """transformers generate, static batches in arrival order, greedy, fp32."""
    import torch
    import transformers
    t = time.monotonic()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                              dtype=torch.float32).eval()
    load_s = time.monotonic() - t
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 2
    useful = 0
    t0 = time.monotonic()
    with torch.inference_mode():
        for i in range(0, len(items), batch):
            group = items[i:i + batch]
            width = max(len(it.prompt_ids) for it in group)
            ids = torch.full((len(group), width), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, it in enumerate(group):   # left padding
                ids[r, width - len(it.prompt_ids):] = torch.tensor(it.prompt_ids)
                mask[r, width - len(it.prompt_ids):] = 1
            n = max(it.answer_tokens for it in group)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=pad)
            useful += sum(it.answer_tokens for it in group)
    wall = time.monotonic() - t0
    return {"tok_s": round(useful / wall, 2), "wall_s": round(wall, 1), "max_active": batch, "load_s": round(load_s, 1),
            "requests": len(items), "completed": len(items), "failed": 0,
            "note": "static batches of 8 in arrival order, all requests available at once (favours the baseline)"}


def run_llama_cpp(items, model_path: Path) -> dict | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python: not installed (optional: pip install llama-cpp-python, ~12 min build) - skipped")
        return None
    from llama_cpp import Llama
    llm = Llama(model_path=str(model_path), n_ctx=8192, n_threads=os.cpu_count(), verbose=False)
    useful = 0
    t0 = time.monotonic()
    for it in items:       # one at a time: llama-cpp-python serves a single sequence
        llm.reset()
        for k, _ in enumerate(llm.generate(it.prompt_ids, temp=0.0)):
            if k + 1 >= it.answer_tokens:
                break
        useful += it.answer_tokens
    wall = time.monotonic() - t0
    return {"tok_s": round(useful / wall, 2), "wall_s": round(wall, 1), "max_active": 1, "requests": len(items)}


# ------------------------------------------------------------------------------ simulation
def fit_cost_model(runner) -> tuple[list[float], list]:
    """Least-squares fit of step seconds = a + b * tokens + c * attention (sum of q_len x
    context), from forward passes of this machine at several batch shapes."""
    import numpy as np
    from edgepaged._native.blocks import BlockAllocator
    shapes = [(b, 1, ctx) for b in (1, 8, 32) for ctx in (64, 512)] + [(1, n, n) for n in (32, 128, 512)] + \
             [(4, 128, 128)]
    rows, ys = [], []
    for b, q, ctx in shapes:                      # b sequences, q new tokens each, context ctx after the step
        if b * -(-ctx // runner.block_size) > runner.num_blocks:
            ctx = runner.num_blocks // b * runner.block_size
        a = BlockAllocator(runner.num_blocks, runner.block_size)
        ids = np.arange(b)
        for i in range(b):
            a.add_sequence(i, [5 + i] * ctx)
        if ctx > q:
            a.prepare_step(ids, np.full(b, ctx - q))
        sm, bt, sl, _, _ = a.prepare_step(ids, np.full(b, q))
        meta = dict(query_start_loc=np.arange(0, b * q + 1, q, dtype=np.int32), seq_lens=sl, block_tables=bt,
                    slot_mapping=sm)
        pos = np.concatenate([np.arange(ctx - q, ctx)] * b)
        best = 1e9
        for _ in range(3):
            t = time.perf_counter()
            runner.execute(np.full(b * q, 7), pos, meta)
            best = min(best, time.perf_counter() - t)
        rows.append([1.0, b * q, b * q * ctx])
        ys.append(best)
    # least squares with no negative cost: a term that fits below zero (the attention term when
    # the fused path makes attention cheap next to the GEMMs) is dropped and the rest refitted
    x, y, keep = np.array(rows), np.array(ys), [0, 1, 2]
    while True:
        fit = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (fit >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(fit)))
    coef = [0.0, 0.0, 0.0]
    for i, c in zip(keep, fit):
        coef[i] = max(0.0, float(c))
    return coef, list(zip(shapes, ys))


def simulate(items, num_blocks: int, block_size: int, contiguous: bool, coef, window: int, context: int) -> dict:
    from edgepaged._native.blocks import BlockAllocator
    from edgepaged.engine.request import Request
    from edgepaged.engine.scheduler import Scheduler, SchedulerConfig
    from edgepaged.model.params import SamplingParams
    alloc = BlockAllocator(num_blocks, block_size, contiguous=contiguous)
    usable = num_blocks - (0 if contiguous else max(1, num_blocks // 100))
    max_len = min(context, usable * block_size)
    sched = Scheduler(alloc, SchedulerConfig(max_model_len=max_len, max_num_seqs=64, max_num_batched_tokens=512,
                                             contiguous=contiguous))
    pending = sorted(items, key=lambda it: it.at)
    reqs, t, k = {}, 0.0, 0
    trace, waits, window_blocks = [], [], []
    max_active = 0
    rejected = 0
    while k < len(pending) or sched.has_work():
        while k < len(pending) and pending[k].at <= t:
            it = pending[k]
            k += 1
            mt = it.max_tokens if it.max_tokens is not None else max_len - len(it.prompt_ids)
            r = Request(prompt_ids=it.prompt_ids, params=SamplingParams(temperature=0, max_tokens=max(1, mt)),
                        priority=it.priority, client=it.client)
            r.arrival = it.at
            try:
                sched.add(r)
            except ValueError:
                rejected += 1
                continue
            reqs[r] = it
        batch = sched.schedule()
        if batch is None:
            if k < len(pending):
                t = pending[k].at
                continue
            break
        attn = sum(n * int(ln) for n, ln in zip(batch.num_new, batch.seq_lens))
        t += coef[0] + coef[1] * batch.num_tokens + coef[2] * attn
        for r in batch.requests:
            if r.first_scheduled is None:
                r.first_scheduled = t
                waits.append(t - r.arrival)
        for r in batch.sampled:
            r.output_ids.append(7)
            if len(r.output_ids) >= min(reqs[r].answer_tokens, r.params.max_tokens):
                sched.free(r, cache=True)
        running = sched.running
        max_active = max(max_active, len(running))
        window_blocks.append(sum(-(-min(r.num_slots, window) // block_size) for r in running))
        trace.append((round(t, 2), len(running), sched.num_waiting, alloc.num_used_blocks))
    return {"sim_seconds": round(t, 1), "requests": len(items), "rejected": rejected, "max_active": max_active,
            "preemptions": sched.num_preemptions, "queue_wait_p50_s": pct(waits, 0.5),
            "queue_wait_p99_s": pct(waits, 0.99), "kv_blocks_max": max((x[3] for x in trace), default=0),
            "kv_blocks_mean": round(sum(x[3] for x in trace) / max(1, len(trace)), 1),
            f"window{window}_kv_blocks_max": max(window_blocks, default=0),
            f"window{window}_kv_blocks_mean": round(sum(window_blocks) / max(1, len(window_blocks)), 1),
            "trace": trace[:: max(1, len(trace) // 2000)]}


def day_trace(tok, n: int, seed: int, scale: float, context: int):
    """n requests over a household day: quiet nights, a morning peak and an evening burst."""
    rng = random.Random(seed)
    items = mix(tok, n, seed, scale, context=context)
    hours = [0.2] * 6 + [1.5, 2.5, 1.5] + [0.8] * 8 + [2.0, 3.0, 2.5] + [1.2, 0.6, 0.3, 0.2]
    for it in items:
        h = rng.choices(range(24), weights=hours)[0]
        it.at = (h + rng.random()) * 3600
    return sorted(items, key=lambda it: it.at)


# ------------------------------------------------------------------------------ plots
def plots(out_dir: Path, runs: dict, hf: dict, sim: dict) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = out_dir
    out.mkdir(parents=True, exist_ok=True)
    files = []
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    for name in MODES:
        r = runs[name]
        ax[0].plot([s[0] for s in r["samples"]], [s[3] for s in r["samples"]], label=f"{name} (KV blocks used)")
        ax[0].plot([s[0] for s in r["samples"]], [s[1] * 10 for s in r["samples"]], ":", label=f"{name} active x10")
    ax[0].set(xlabel="seconds", ylabel="blocks", title="End to end: KV blocks used and active sequences")
    ax[0].legend(fontsize=7)
    for name in ("paged", "contiguous"):
        tr = sim[name]["trace"]
        ax[1].plot([x[0] / 3600 for x in tr], [x[3] for x in tr], label=name)
    ax[1].set(xlabel="hour of the simulated day", ylabel="KV blocks used", title="Simulated household day")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    files.append(str(out / "kv_blocks_over_time.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name, style in zip(MODES, ("-", ":", "--")):
        for k, v in runs[name]["ttfts_by_class"].items():
            if v:
                ax.step(v, [(i + 1) / len(v) for i in range(len(v))], style, where="post", label=f"{name} {k}")
    ax.set(xscale="log", xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF per request class")
    ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(str(out / "ttft_cdf.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name in MODES:
        r = runs[name]
        pts = [(s[1], s[4]) for s in r["samples"] if s[4] > 0]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=10, label=name)
    ax.scatter([hf["max_active"]], [hf["tok_s"]], marker="x", s=60, label="transformers (static batch 8)")
    ax.set(xlabel="active sequences", ylabel="tokens/s (10 s window)", title="Throughput vs concurrency")
    ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(str(out / "throughput_vs_concurrency.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files


async def settled_stats(addr: str, timeout_s: float = 30.0) -> dict:
    """The server's stats once no request runs or waits (clients that cancelled have been
    cleaned up), or after `timeout_s`."""
    async with open_client(addr, name="bench-observer") as c:
        deadline = time.monotonic() + timeout_s
        while True:
            s = await c.stats()
            if (s["num_requests_running"] == 0 and s["num_requests_waiting"] == 0) or time.monotonic() > deadline:
                return s
            await trio.sleep(0.2)


def llama_server_run(exe: str, model: Path, items, kv_memory: int, kv: str, tok, cfg) -> dict:
    """The same arrivals against llama.cpp's `llama-server` given the same KV memory: as many
    slots (`-np`) as it holds of the longest request (prompt and answer), `kv` as its K and V
    types; each prompt as its token ids on /completion, each answer `answer_tokens` long
    (ignore_eos), streamed. tok/s, TTFT by class, slots."""
    from bench.soak import start_llama_server
    from edgepaged.model.cpu.runner import kv_bytes_per_value   # llama.cpp's f16 and q8_0 are the same sizes
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_bytes_per_value(kv)
    longest = max(len(it.prompt_ids) + it.answer_tokens for it in items) + 32
    slots = max(1, int(kv_memory // per_token) // longest)
    proc, base = start_llama_server(exe, str(model), "-t", "2", "-np", str(slots), "-c", str(slots * longest),
                                    "-ctk", kv, "-ctv", kv, "-fa", "on", "--jinja", wait_s=300)
    if proc is None:
        return {"note": "llama-server did not start"}
    results = []
    t0 = time.monotonic()

    def one(it):
        time.sleep(max(0.0, it.at - (time.monotonic() - t0)))
        # the prompt's token ids (the same file's tokenizer), counted by the tokens streamed back:
        # a random-weight model's tokens may print as nothing
        body = {"prompt": list(it.prompt_ids), "n_predict": it.answer_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_tokens": True, "cache_prompt": True}
        start = time.monotonic()
        req = urllib.request.Request(base + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        first, n = None, 0
        try:
            with urllib.request.urlopen(req, timeout=3600) as r:
                for line in r:
                    if line.startswith(b"data: {"):
                        got = len(json.loads(line[6:]).get("tokens") or [])
                        if got:
                            first = first or time.monotonic()
                            n += got
        except OSError as e:
            results.append({"klass": it.klass, "ttft_s": None, "tokens": n, "error": str(e)})
            return
        results.append({"klass": it.klass, "ttft_s": (first - start) if first else None, "tokens": n})

    threads = [threading.Thread(target=one, args=(it,)) for it in items]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        proc.terminate()
        proc.wait(30)
    wall = time.monotonic() - t0
    ttfts = {k: sorted(r["ttft_s"] for r in results if r["klass"] == k and r["ttft_s"] is not None) for k in CLASSES}
    return {"tok_s": round(sum(r["tokens"] for r in results) / wall, 2), "wall_s": round(wall, 1), "slots": slots,
            "ctx_per_slot": longest, "failed": sum(1 for r in results if r.get("error")),
            "home_ttft_p90_s": pct(ttfts.get("home", []), 0.9), "ttft_p90_s": pct([t for v in ttfts.values() for t in v], 0.9)}


def serve_matrix(args, items, model: Path) -> None:
    """--model with --kv-dtype LIST / --modes LIST / --llama-server: the same arrivals against
    each (KV type, paged or contiguous) server with the same --kv-memory, in one run, and
    llama.cpp's server given the same memory."""
    import shutil

    from edgepaged.model.loader import ModelFiles
    from edgepaged.model.tokenizer import Tokenizer
    files = ModelFiles(model)
    cfg, tok = files.config, Tokenizer.load(files.path, reader=files.reader)
    del files
    kinds = [k for k in (args.kv_dtype or "f16").split(",") if k]
    modes = [m for m in args.modes.split(",") if m]
    out = {"model": model.name, "kv_memory": args.kv_memory, "speculate": args.speculate or "default", "runs": {},
           "llama_cpp": {},
           "workload": dict(requests=args.requests, scale=args.scale, answer_scale=args.answer_scale, rate=args.rate)}
    for kv in kinds:
        for mode in modes:
            t = time.monotonic()
            srv = Serve(args.kv_memory, mode == "contiguous", 512, model=model,
                        extra=["--kv-dtype", kv] + (["--speculate", args.speculate] if args.speculate else []))
            try:
                r = trio.run(run_e2e, srv.addr, items)
                final = trio.run(settled_stats, srv.addr)
            finally:
                srv.stop()
            cls = by_class(r)
            out["runs"][f"{kv}/{mode}"] = row = {
                "kv_bound_active": r["kv_bound_active"], "kv_bound_active_max": r["kv_bound_active_max"],
                "kv_bound_moments": r["kv_bound_moments"], "max_active": r["max_active"], "tok_s": r["tok_s"],
                "home_ttft_p90_s": cls.get("home", {}).get("ttft_p90_s"), "ttft_p90_s": r["ttft_p90_s"],
                "failed": r["failed"], "preemptions": r["preemptions"], "kv_blocks_total": r["kv_blocks_total"],
                "blocks_back": final["kv_blocks_used"] == 0, "wall_s": r["wall_s"]}
            print(f"{kv}/{mode}: kv_bound_active {row['kv_bound_active']} (max active {row['max_active']}, "
                  f"{row['kv_blocks_total']} blocks), {row['tok_s']} tok/s, home TTFT p90 {row['home_ttft_p90_s']} s, "
                  f"failed {row['failed']} ({time.monotonic() - t:.0f} s)", flush=True)
    f16 = out["runs"].get("f16/paged", {}).get("kv_bound_active")
    for kv in kinds:
        q = out["runs"].get(f"{kv}/paged", {}).get("kv_bound_active")
        if kv != "f16" and f16 and q:
            out[f"kv_bound_ratio_{kv}"] = round(q / f16, 2)
    exe = args.llama_server or shutil.which("llama-server")
    if exe is None:
        out["llama_cpp"] = None
        out["llama_cpp_note"] = "llama.cpp's llama-server is not installed here (give --llama-server PATH)"
    else:
        for kv in kinds:
            t = time.monotonic()
            out["llama_cpp"][kv] = r = llama_server_run(exe, model, items, args.kv_memory, kv, tok, cfg)
            print(f"llama.cpp {kv}: {r.get('slots')} slots of {r.get('ctx_per_slot')}, {r.get('tok_s')} tok/s, "
                  f"home TTFT p90 {r.get('home_ttft_p90_s')} s, failed {r.get('failed')} "
                  f"({time.monotonic() - t:.0f} s)", flush=True)
    if args.json:
        print(json.dumps(out))


def serve_model(args) -> None:
    """--model: the household driver against `edgepaged serve --model FILE`, paged only."""
    from edgepaged.model.loader import ModelFiles
    from edgepaged.model.tokenizer import Tokenizer
    files = ModelFiles(args.model)
    tok, context = Tokenizer.load(files.path, reader=files.reader), files.config.context_length
    reqs = mix(tok, args.requests, args.seed, args.scale, context=context, answer_scale=args.answer_scale,
               caps=parse_caps(args.caps))
    items = poisson(reqs, args.rate, args.seed) if args.rate else burst(reqs, seed=args.seed)
    del files
    print(f"{len(items)} requests (scale {args.scale}, answers x{args.answer_scale}, "
          f"{f'Poisson {args.rate}/s' if args.rate else 'all at once'}) to {Path(args.model).name}", flush=True)
    if args.kv_dtype or args.modes != "paged" or args.llama_server:
        return serve_matrix(args, items, Path(args.model))
    t = time.monotonic()
    srv = Serve(args.kv_memory, False, 512, model=Path(args.model))
    print(srv.banner, flush=True)
    print(f"server up in {time.monotonic() - t:.1f} s", flush=True)
    try:
        res = trio.run(run_e2e, srv.addr, items)
        final = trio.run(settled_stats, srv.addr)
    finally:
        srv.stop()
    res["blocks_back"] = final["kv_blocks_used"] == 0
    res["kv_blocks_used_at_end"] = final["kv_blocks_used"]
    res["kv_dtype"] = final.get("kv_dtype")
    print(f"paged: {res['tok_s']} tok/s, {res['completed']} of {res['requests']} completed, {res['failed']} failed, "
          f"max active {res['max_active']}, TTFT p50 {res['ttft_p50_s']} s p99 {res['ttft_p99_s']} s, "
          f"KV blocks held at the end {final['kv_blocks_used']}", flush=True)
    if args.json:
        for k in ("samples", "ttfts_by_class"):
            res.pop(k)
        print(json.dumps({"model": Path(args.model).name, "banner": srv.banner, "paged": res,
                          "workload": dict(requests=args.requests, scale=args.scale, answer_scale=args.answer_scale,
                                           rate=args.rate, kv_memory=args.kv_memory)}))


def by_class(r: dict) -> dict:
    return {k: {"n": len(v), "ttft_p50_s": pct(v, 0.5), "ttft_p90_s": pct(v, 0.9), "ttft_max_s": pct(v, 1.0)}
            for k, v in r["ttfts_by_class"].items() if v}


def clients_mode(args) -> None:
    """`--clients N`: N closed-loop household clients, the same draws against the paged server
    (`paged`) and, beside it, the same server reserving each request's whole context
    (`contiguous`: the KV layout every paged runtime is measured against). The scheduler's
    earlier policy (`paged_before` in bench/HISTORY.md) is gone from the engine."""
    from edgepaged.model import ModelRunner
    runner = ModelRunner(num_blocks=args.kv_tokens // 16, block_size=16)
    tok, kv_bytes = runner.tokenizer, args.kv_tokens // 16 * runner.block_bytes
    del runner
    out = {"clients": args.clients, "per_client": args.per_client, "kv_tokens": args.kv_tokens}
    for mode in ("paged", "contiguous"):
        t = time.monotonic()
        srv = Serve(kv_bytes, mode == "contiguous", args.max_batched_tokens,
                    extra=["--step-time", str(args.step_time)] if args.step_time is not None else None)
        try:
            r = trio.run(run_closed_loop, srv.addr, tok, args.clients, args.per_client, 1.0, args.scale,
                         args.answer_scale, args.seed)
        finally:
            srv.stop()
        out[mode] = {k: r[k] for k in ("tok_s", "wall_s", "requests", "completed", "failed", "ttft_p50_s",
                                        "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "preemptions")}
        out[mode]["by_class"] = by_class(r)
        print(f"{mode}: {r['tok_s']} tok/s, home TTFT p90 {out[mode]['by_class'].get('home', {}).get('ttft_p90_s')} s, "
              f"failed {r['failed']} ({time.monotonic() - t:.0f} s)", flush=True)
        for k, v in out[mode]["by_class"].items():
            print(f"  {k:9} n={v['n']:<3} TTFT p50 {v['ttft_p50_s']} p90 {v['ttft_p90_s']} max {v['ttft_max_s']}")
    out["tok_s_ratio"] = round(out["paged"]["tok_s"] / out["contiguous"]["tok_s"], 3)
    out["machine"] = platform.processor() or platform.machine()
    if args.json:
        print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="about 4 minutes on a 2-core CPU")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--scale", type=float, default=0.25, help="prompt length scale")
    ap.add_argument("--answer-scale", type=float, default=0.5)
    ap.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (1.0; 4.0 with --quick)")
    ap.add_argument("--kv-tokens", type=int, default=8192)
    ap.add_argument("--day-requests", type=int, default=3000)
    ap.add_argument("--window", type=int, default=None,
                    help="the window policy's window in tokens (the `window` mode and the simulation): 1024, "
                         "256 with --quick (its prompts are short)")
    ap.add_argument("--sink", type=int, default=4, help="the window policy's sink tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--caps", default="", help="override the max_tokens a class's clients send, e.g. "
                    "'home=64,agent=512' (sensitivity runs; the default is workloads.CLASSES)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "household"))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="a GGUF file: only the end-to-end run against it (see above)")
    ap.add_argument("--kv-memory", type=int, default=512 << 20, help="--model: the server's KV budget in bytes")
    ap.add_argument("--kv-dtype", default=None, metavar="LIST",
                    help="--model: the KV cache types to run in turn with the same --kv-memory (e.g. f16,q8_0)")
    ap.add_argument("--modes", default="paged", metavar="LIST", help="--model: paged, contiguous or both (paged,contiguous)")
    ap.add_argument("--speculate", default=None, choices=["lookup", "off"],
                    help="--model with --kv-dtype/--modes: the servers' --speculate (default: theirs)")
    ap.add_argument("--llama-server", default=None, metavar="PATH",
                    help="--model: llama.cpp's server, run beside with the same KV memory (each --kv-dtype)")
    ap.add_argument("--clients", type=int, default=None,
                    help="closed loop only: this many household clients (each asks, reads, thinks ~1 s, asks "
                         "again), paged against contiguous KV reservation")
    ap.add_argument("--per-client", type=int, default=4, help="--clients: requests per client")
    ap.add_argument("--step-time", type=float, default=None, help="--clients: the servers' --step-time")
    ap.add_argument("--max-batched-tokens", type=int, default=512,
                    help="--clients: the servers' step token budget")
    args = ap.parse_args()
    if args.clients:
        return clients_mode(args)
    if args.model:
        if "--requests" not in sys.argv:
            args.requests = 16
        return serve_model(args)
    if args.quick:
        # 4 arrivals/s: more than the box serves on this mix, so requests pile up and the KV scheme
        # decides how many run at once (at 2/s paging now keeps up and holds what is present:
        # bench/RESULTS.md has both)
        args.requests, args.scale, args.answer_scale, args.day_requests = 24, 0.1, 0.3, 600
        args.rate = 4.0 if args.rate is None else args.rate
        args.window = 256 if args.window is None else args.window
    elif args.rate is None:
        args.rate = 1.0
    if args.window is None:
        args.window = 1024

    from edgepaged.model import ModelRunner
    from edgepaged.model.loader import default_model_path
    model_path = default_model_path()
    runner = ModelRunner(num_blocks=args.kv_tokens // 16, block_size=16)
    tok, context = runner.tokenizer, runner.config.context_length
    caps = parse_caps(args.caps)
    items = poisson(mix(tok, args.requests, args.seed, args.scale, context=context, answer_scale=args.answer_scale,
                        caps=caps), args.rate, args.seed)
    kv_bytes = args.kv_tokens // 16 * runner.block_bytes
    print(f"{len(items)} requests (scale {args.scale}, answers x{args.answer_scale}, Poisson {args.rate}/s); "
          f"KV budget {args.kv_tokens} tokens ({kv_bytes >> 20} MiB) for both modes", flush=True)

    out = {}
    window_flags = ["--context-policy", "window", "--window", str(args.window), "--sink", str(args.sink)]
    for mode in MODES:
        t = time.monotonic()
        srv = Serve(kv_bytes, mode == "contiguous", 512, extra=window_flags if mode == "window" else None)
        try:
            out[mode] = trio.run(run_e2e, srv.addr, items)
        finally:
            srv.stop()
        print(f"{mode}: {out[mode]['tok_s']} tok/s, max active {out[mode]['max_active']}, kv_bound_active "
              f"{out[mode]['kv_bound_active']} ({out[mode]['kv_bound_moments']} steps), "
              f"{time.monotonic() - t:.0f} s", flush=True)

    # other arrival patterns, paged: everyone at once after dinner, and closed-loop users
    # (a server each: max_active, preemptions and the prefix hit rate are the server's since it started)
    patterns = {}
    burst_items = burst(mix(tok, args.requests, args.seed + 1, args.scale, context=context,
                            answer_scale=args.answer_scale, caps=caps), seed=args.seed)
    runs = {"burst": lambda addr: trio.run(run_e2e, addr, burst_items),
            "closed_loop": lambda addr: trio.run(run_closed_loop, addr, tok, 6 if args.quick else 12,
                                                 2 if args.quick else 5, 1.0, args.scale, args.answer_scale,
                                                 args.seed)}
    for name, run in runs.items():
        srv = Serve(kv_bytes, False, 512)
        try:
            patterns[name] = run(srv.addr)
        finally:
            srv.stop()
    for name, r in patterns.items():
        print(f"paged, {name}: {r['tok_s']} tok/s, max active {r['max_active']}, TTFT p99 {r['ttft_p99_s']} s, "
              f"failed {r['failed']}", flush=True)

    # what memory allows, whatever the box's speed: the burst again (twice the requests) in a pool
    # small enough that both schemes fill it; kv_bound_active counts the sequences running at the
    # steps where the pool held the next request back
    pool_items = burst(mix(tok, 2 * args.requests, args.seed + 2, args.scale, context=context,
                           answer_scale=args.answer_scale, caps=caps), seed=args.seed)
    # (--quick's prompts are short: a quarter of 8,192 tokens held every sequence paged ran at once, so
    # paging never reached the pool's limit and there was no ratio; an eighth binds both schemes)
    pool_tokens = args.kv_tokens // (8 if args.quick else 4)
    small_kv = pool_tokens // 16 * runner.block_bytes
    pool = {}
    for mode in ("paged", "contiguous"):
        srv = Serve(small_kv, mode == "contiguous", 512)
        try:
            r = trio.run(run_e2e, srv.addr, pool_items)
        finally:
            srv.stop()
        pool[mode] = {k: r[k] for k in ("kv_bound_active", "kv_bound_active_max", "kv_bound_moments", "max_active",
                                        "mean_active", "tok_s", "failed", "requests")}
        print(f"pool-bound burst ({pool_tokens} KV tokens), {mode}: kv_bound_active {r['kv_bound_active']} "
              f"(max {r['kv_bound_active_max']}, {r['kv_bound_moments']} steps), max active {r['max_active']}, "
              f"failed {r['failed']}", flush=True)
    p, c = pool["paged"]["kv_bound_active"], pool["contiguous"]["kv_bound_active"]
    pool["ratio"] = round(p / c, 2) if p and c else None
    pool["kv_tokens"] = pool_tokens
    out["kv_bound"] = pool

    # the window's cost in quality, on the same model: perplexity of a public-domain text
    from bench.perplexity import perplexity, text_ids
    ids = text_ids(runner.tokenizer, 2048 if args.quick else None)
    ppl = {"text_tokens": len(ids), "window": args.window, "sink": args.sink}
    for name, w, sk in (("full", None, 0), ("window", args.window, args.sink), ("window_no_sink", args.window, 0)):
        ppl[name] = perplexity(runner, ids, w, sk)["ppl"]
    print(f"perplexity ({len(ids)} tokens): full {ppl['full']}, window {ppl['window']}, window without sinks "
          f"{ppl['window_no_sink']}", flush=True)
    out["perplexity"] = ppl
    out["paged"]["perplexity"] = out["contiguous"]["perplexity"] = ppl["full"]
    out["window"]["perplexity"] = ppl["window"]

    coef, measured = fit_cost_model(runner)
    print(f"cost model (fitted to this machine): step_s = {coef[0]:.4f} + {coef[1]:.2e} * tokens + "
          f"{coef[2]:.2e} * attention", flush=True)
    del runner
    out["hf"] = run_hf(items, model_path)
    print(f"transformers: {out['hf']['tok_s']} tok/s", flush=True)
    out["llama_cpp"] = run_llama_cpp(items, model_path)

    day = day_trace(tok, args.day_requests, args.seed, args.scale, context)
    sim = {"cost_model": {"intercept_s": coef[0], "per_token_s": coef[1], "per_attention_s": coef[2],
                          "note": "step times from a cost model fitted to measured forward passes"}}
    for mode in ("paged", "contiguous"):
        t = time.monotonic()
        sim[mode] = simulate(day, args.kv_tokens // 16, 16, mode == "contiguous", coef, args.window, context)
        print(f"simulated day, {mode}: max active {sim[mode]['max_active']}, preemptions "
              f"{sim[mode]['preemptions']}, queue p99 {sim[mode]['queue_wait_p99_s']} s ({time.monotonic() - t:.0f} s)",
              flush=True)
    files = plots(Path(args.out), out, out["hf"], sim)

    keys = ["tok_s", "max_active", "mean_active", "kv_bound_active", "kv_bound_moments", "ttft_p50_s", "ttft_p90_s",
            "ttft_p99_s", "tpot_p50_s", "queue_p50_s", "queue_p99_s", "preemptions", "prefix_hit_rate",
            "kv_blocks_max", "kv_blocks_mean", "perplexity", "completed", "failed"]
    print(f"\n{'':18}{'paged':>12}{'contiguous':>12}{'window':>12}{'transformers':>14}")
    for k in keys:
        print(f"{k:18}{out['paged'].get(k)!s:>12}{out['contiguous'].get(k)!s:>12}{out['window'].get(k)!s:>12}"
              f"{out['hf'].get(k, '-')!s:>14}")
    for k in ("home", "chat", "document", "agent"):
        for mode in MODES:
            pc = out[mode]["per_class"].get(k)
            if pc:
                print(f"  {mode:10} {k:9} n={pc['n']:<3} TTFT {pc['ttft_s']}  TPOT {pc['tpot_s']}")
    print(f"plots: {', '.join(files)}")
    print(f"paged/transformers tok_s {out['paged']['tok_s'] / out['hf']['tok_s']:.2f}x; paged/contiguous max_active "
          f"{out['paged']['max_active'] / max(1, out['contiguous']['max_active']):.1f}x; kv_bound_active paged/"
          f"contiguous {out['kv_bound']['ratio']}x (pool-bound burst)")
    if args.json:
        for mode in MODES:
            for k in ("samples", "ttfts_by_class"):
                out[mode].pop(k)
        for mode in ("paged", "contiguous"):
            sim[mode].pop("trace")
        out["simulation"] = sim
        out["patterns"] = {k: {x: v[x] for x in ("tok_s", "max_active", "ttft_p50_s", "ttft_p99_s", "failed",
                                                 "requests", "preemptions")} for k, v in patterns.items()}
        out["machine"] = f"{platform.machine()} {os.cpu_count()} cpus"
        out["workload"] = dict(requests=args.requests, scale=args.scale, answer_scale=args.answer_scale,
                               rate=args.rate, kv_tokens=args.kv_tokens, day_requests=args.day_requests,
                               caps=args.caps or "default")
        print(json.dumps(out))


if __name__ == "__main__":
    main()
