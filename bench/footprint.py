"""The appliance's footprint: what a CPU box installs and holds for the embedded model, and
the torch-free runtime's speed against the torch runner's in the same run.

    venv_mb                    the runtime's virtual environment: the abi3 wheel (maturin build
                               --release) and the model package, pip-installed into a fresh
                               venv with no torch (target <= 300)
    ready_s                    from `edgepaged serve`'s process start (that venv) to the first
                               answer over TCP, mDNS off, default KV budget (target <= 2)
    rss_idle_mb                the server's resident memory once idle after that answer (target
                               <= 400), and rss_after_16_requests_mb after 16 concurrent
                               requests of 64 tokens
    tok_s_b1, tok_s_b32        greedy decode tok/s on the torch-free runner (cpu_runtime.CpuRunner),
    torch_tok_s_b1/_b32        and on the torch runner (ModelRunner, the torch reference on a CPU), their
    ratio_b1, ratio_b32        decode steps alternating one by one in this process, best of
                               --reps (target ratio >= 1.0); prefill_s_b32 / torch_prefill_s_b32
                               the first step (the prompts' prefill)

    prefill_s_nN / torch_prefill_s_nN   with --prefill N,...: one prompt of N tokens alone,
                               best of --reps alternating (long prompts: attention in Rust
                               tiles against torch's SDPA)

    python bench/footprint.py [--json] [--venv DIR] [--reps 3] [--new-tokens 64] [--prefill 512,2048]

--venv reuses a runtime venv made before (else one is built in a temporary folder). The
torch side needs torch in the running environment (`./run.sh bench footprint`); without it
the torch figures are null, and `torch_absent` says why.
"""
from __future__ import annotations

import edgepaged  # noqa: F401  (first: its OpenBLAS setting must precede numpy's import)
import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.family_bench import cpu_flags  # noqa: E402

from edgepaged.client import SyncClient  # noqa: E402
from edgepaged.testing.appliance import Served, build_wheel, dir_mb, rss_mb, runtime_venv  # noqa: E402
from edgepaged.testing.decode import make_allocator, run_batch, step  # noqa: E402

QUESTION = "What is the capital of France?"


def serve_figures(venv: Path) -> dict:
    srv = Served(venv)
    try:
        with SyncClient(srv.address) as c:
            text = "".join(c.chat([{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0))
        ready = time.monotonic() - srv.t0
        time.sleep(1.0)
        idle = rss_mb(srv.proc.pid)

        def one(i):
            with SyncClient(srv.address) as c:
                "".join(c.chat([{"role": "user", "content": f"Tell me fact number {i} about the sea."}],
                               max_tokens=64, temperature=0))
        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(0.5)
        after = rss_mb(srv.proc.pid)
    finally:
        srv.stop()
    return {"ready_s": round(ready, 2), "first_answer": text, "rss_idle_mb": round(idle, 1),
            "rss_after_16_requests_mb": round(after, 1)}


def speed(reps: int, new_tokens: int) -> dict:
    """Greedy decode tok/s of both runners at batch 1 and 32, their steps alternating one by one
    (a prefill each, then cpu step, torch step, cpu step, ...) so a slow spell of the shared
    machine hits both; per rep, decode time summed per runner; the best rep counts."""
    from edgepaged.model.cpu.runner import CpuRunner
    runners = {"cpu": CpuRunner(num_blocks=1024)}
    out: dict = {}
    try:
        from edgepaged.model.torch.runner import ModelRunner
        runners["torch"] = ModelRunner(num_blocks=1024)
    except ImportError as e:
        out["torch_absent"] = f"torch is not installed here ({e})"
    tk = runners["cpu"].tokenizer
    qs = [f"Question {i}: what is {i} times {i + 3}?" for i in range(32)]
    prompts = [np.array(tk.encode(tk.apply_chat_template([{"role": "user", "content": q}], tokenize=False),
                                  add_special_tokens=False), np.int64) for q in qs]
    allocs = {k: make_allocator(r) for k, r in runners.items()}
    for k, r in runners.items():
        run_batch(r, allocs[k], prompts[:2], 4, seq_base=900_000)      # warm-up
    best: dict = {}
    for b in (1, 32):
        for rep in range(reps):
            state = {}
            for k, r in runners.items():
                ids = list(range(10_000 * b + 1000 * rep, 10_000 * b + 1000 * rep + b))
                for sid, p in zip(ids, prompts[:b]):
                    allocs[k].add_sequence(sid, p)
                t = time.perf_counter()
                toks = step(r, allocs[k], ids, [len(p) for p in prompts[:b]], np.concatenate(prompts[:b]),
                            np.concatenate([np.arange(len(p)) for p in prompts[:b]]))
                state[k] = [ids, toks, np.array([len(p) for p in prompts[:b]], np.int64), 0.0, time.perf_counter() - t]
            for _ in range(new_tokens - 1):
                for k, r in runners.items():         # alternating, step by step
                    ids, toks, lens, td, tp = state[k]
                    t = time.perf_counter()
                    toks = step(r, allocs[k], ids, [1] * b, toks, lens, toks)
                    state[k] = [ids, toks, lens + 1, td + time.perf_counter() - t, tp]
            for k, (ids, _, _, td, tp) in state.items():
                for sid in ids:
                    allocs[k].free_sequence(sid, cache=False)
                prev = best.get((k, b), (0.0, 1e9))
                best[(k, b)] = (max(prev[0], b * (new_tokens - 1) / td), min(prev[1], tp))
    for b in (1, 32):
        out[f"tok_s_b{b}"] = round(best[("cpu", b)][0], 1)
        out[f"prefill_s_b{b}"] = round(best[("cpu", b)][1], 3)
        t = best.get(("torch", b))
        out[f"torch_tok_s_b{b}"] = None if t is None else round(t[0], 1)
        out[f"torch_prefill_s_b{b}"] = None if t is None else round(t[1], 3)
        out[f"ratio_b{b}"] = None if t is None else round(best[("cpu", b)][0] / t[0], 3)
    out["products"] = runners["cpu"].products
    return out


def long_prefills(lengths: list[int], reps: int) -> dict:
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.model.torch.runner import ModelRunner
    blocks = max(lengths) // 16 + 2
    runners = {"": CpuRunner(num_blocks=blocks), "torch_": ModelRunner(num_blocks=blocks)}
    out = {}
    for n in lengths:
        ids = (np.arange(n) * 7919 % 30000 + 100).astype(np.int64)
        meta = dict(query_start_loc=np.array([0, n]), seq_lens=np.array([n]),
                    block_tables=np.arange(-(-n // 16), dtype=np.int32)[None], slot_mapping=np.arange(n))
        for _ in range(reps):
            for k, r in runners.items():
                t = time.perf_counter()
                r.execute(ids, np.arange(n), meta)
                dt = time.perf_counter() - t
                out[f"{k}prefill_s_n{n}"] = round(min(out.get(f"{k}prefill_s_n{n}", 1e9), dt), 3)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    ap.add_argument("--venv", type=Path, default=None, help="a runtime venv made before")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill", default="", help="prompt lengths to time alone, e.g. 512,2048")
    args = ap.parse_args()
    res: dict = {**cpu_flags()}
    with tempfile.TemporaryDirectory() as tmp:
        venv = args.venv
        if venv is None:
            print("building the wheel and a runtime venv...", file=sys.stderr)
            wheel = build_wheel(Path(tmp) / "dist")
            venv = Path(tmp) / "venv"
            runtime_venv(venv, wheel)
            res["wheel_mb"] = round(wheel.stat().st_size / 2**20, 1)
        res["venv_mb"] = round(dir_mb(venv), 1)
        print("serving from it...", file=sys.stderr)
        res.update(serve_figures(venv))
    print("decode speed, torch-free vs torch...", file=sys.stderr)
    res.update(speed(args.reps, args.new_tokens))
    if args.prefill:
        res.update(long_prefills([int(x) for x in args.prefill.split(",")], args.reps))
    if not args.json:
        for k, v in res.items():
            print(f"{k:>26}: {v}", file=sys.stderr)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
