"""Allocator benchmark: the Rust block allocator against the plain-Python reference model
with the same semantics (tests/alloc_reference.py), on one recorded operation trace.

The trace is an engine-like run: thousands of sequences, a third of them sharing one of a
few long system prompts, chunked prefill, decode growth one token per step, random ends
(frees) and occasional forks, with admission limited by free blocks. It is recorded once
and replayed through both allocators; an "op" is one sequence's part of a call (adding,
reserving slots for it in a step, freeing, forking).

Then the hot path alone: `prepare_step` for 256 running sequences decoding (one sampled
token appended and one slot reserved each), timed per call.

    python bench/alloc_bench.py [--json] [--sequences N] [--seed S]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time

import numpy as np

from edgepaged.testing.alloc_reference import RefAllocator  # noqa: E402

from edgepaged._native.blocks import BlockAllocator, NoFreeBlocksError  # noqa: E402

BLOCK_SIZE = 16


def record_trace(num_sequences: int, seed: int, num_blocks: int) -> list[tuple]:
    """Drive the Rust allocator like an engine would and record every call."""
    rng = random.Random(seed)
    systems = [[rng.randrange(49152) for _ in range(rng.randrange(200, 600))] for _ in range(4)]
    a = BlockAllocator(num_blocks, BLOCK_SIZE)
    ops: list[tuple] = []
    waiting: list[tuple[int, list[int], int]] = []
    running: dict[int, list] = {}  # id -> [prefill_left, decode_left]
    next_id = 0
    created = 0
    chunk_budget = 512
    while created < num_sequences or waiting or running:
        # arrivals
        for _ in range(rng.randrange(0, 6)):
            if created >= num_sequences:
                break
            user = [rng.randrange(49152) for _ in range(rng.randrange(20, 300))]
            prompt = (rng.choice(systems) + user) if rng.random() < 0.35 else user
            waiting.append((next_id, prompt, rng.randrange(4, 200)))
            next_id += 1
            created += 1
        # admission while blocks last
        while waiting and len(running) < 256:
            sid, prompt, out_len = waiting[0]
            cached, free_cached = a.prefix_match(prompt)
            need = free_cached + -(-(min(len(prompt), cached + chunk_budget)) // BLOCK_SIZE) - cached // BLOCK_SIZE
            if need > a.num_free_blocks - 8:
                break
            waiting.pop(0)
            cached = a.add_sequence(sid, prompt)
            ops.append(("add", sid, prompt))
            running[sid] = [len(prompt) - cached, out_len]
        # one step: decode everyone decoding, prefill chunks within a budget
        ids, ns, new = [], [], []
        budget = chunk_budget
        for sid, st in running.items():
            if st[0] > 0:
                n = min(st[0], budget)
                if n == 0:
                    continue
                budget -= n
                ids.append(sid); ns.append(n); new.append(-1)
            else:
                ids.append(sid); ns.append(1); new.append(rng.randrange(49152))
        if ids:
            try:
                a.prepare_step(np.array(ids), np.array(ns), np.array(new))
            except NoFreeBlocksError:
                # preempt the newest running sequence and retry next step
                victim = max(running)
                a.free_sequence(victim)
                ops.append(("free", victim))
                del running[victim]
                continue
            ops.append(("step", np.array(ids), np.array(ns), np.array(new)))
            for sid, n, t in zip(ids, ns, new):
                st = running[sid]
                if st[0] > 0:
                    st[0] -= n
                else:
                    st[1] -= 1
        # ends and forks
        for sid in [s for s, st in running.items() if st[0] == 0 and st[1] <= 0]:
            a.free_sequence(sid)
            ops.append(("free", sid))
            del running[sid]
        if running and rng.random() < 0.02:
            parent = rng.choice(list(running))
            if running[parent][0] == 0:
                a.fork(parent, next_id)
                ops.append(("fork", parent, next_id))
                running[next_id] = [0, rng.randrange(4, 50)]
                next_id += 1
    return ops


def replay(alloc, ops) -> tuple[float, int]:
    n_ops = 0
    t0 = time.perf_counter()
    for op in ops:
        kind = op[0]
        if kind == "step":
            alloc.prepare_step(op[1], op[2], op[3])
            n_ops += len(op[1])
        elif kind == "add":
            alloc.add_sequence(op[1], op[2])
            n_ops += 1
        elif kind == "free":
            alloc.free_sequence(op[1])
            n_ops += 1
        else:
            alloc.fork(op[1], op[2])
            n_ops += 1
    return time.perf_counter() - t0, n_ops


def hot_path(make, steps: int, batch: int = 256, context: int = 512) -> float:
    """Mean microseconds of one decode step's prepare_step for `batch` sequences."""
    a = make(batch * (context + steps) // BLOCK_SIZE + batch + 16, BLOCK_SIZE)
    rng = np.random.default_rng(0)
    ids = np.arange(batch, dtype=np.int64)
    for sid in ids:
        a.add_sequence(int(sid), rng.integers(0, 49152, context))
    a.prepare_step(ids, np.full(batch, context, dtype=np.int64))
    ones = np.ones(batch, dtype=np.int64)
    toks = rng.integers(0, 49152, (steps, batch))
    t0 = time.perf_counter()
    for k in range(steps):
        a.prepare_step(ids, ones, toks[k])
    return (time.perf_counter() - t0) / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    args = ap.parse_args()

    num_blocks = 6000
    t = time.perf_counter()
    ops = record_trace(args.sequences, args.seed, num_blocks)
    print(f"trace: {len(ops)} calls over {args.sequences} sequences (recorded in {time.perf_counter() - t:.1f} s)")

    rust_s, n_ops = replay(BlockAllocator(num_blocks, BLOCK_SIZE), ops)
    py_s, _ = replay(RefAllocator(num_blocks, BLOCK_SIZE), ops)
    rust_ops, py_ops = n_ops / rust_s, n_ops / py_s
    step_us = min(hot_path(BlockAllocator, 400) for _ in range(3))
    py_step_us = hot_path(RefAllocator, 20)

    out = {
        "ops": n_ops,
        "rust_ops_per_s": round(rust_ops),
        "python_ops_per_s": round(py_ops),
        "speedup": round(rust_ops / py_ops, 1),
        "step_us_256": round(step_us, 1),
        "python_step_us_256": round(py_step_us, 1),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.python_implementation()} {platform.python_version()}",
    }
    print(f"{'':24}{'rust':>14}{'python':>14}")
    print(f"{'ops/s (trace replay)':24}{rust_ops:>14,.0f}{py_ops:>14,.0f}   speedup {out['speedup']}x")
    print(f"{'step us, 256 decoding':24}{step_us:>14.1f}{py_step_us:>14.1f}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
