#!/usr/bin/env python3
"""Two builds of the Rust extension alternated in one process: a kernel change judged
without the machine's drift between processes (on these shared VMs one build measured 16
and 27 tok/s in two runs a minute apart; in one process the two builds' runs interleave).

Each build is loaded from its own copy of `_native.abi3.so` (build the old one, copy it
away, build the new one: `--old` and `--new`, by default the checkout's current one). A
runner is opened under each; before each run the chosen build is put in place of
`edgepaged._native` (sys.modules and every loaded edgepaged module's names bound to its
submodules or their functions), so every kernel a step calls, lazily imported or not, is
that build's.

Per build, alternated run by run: one stream's decode rate (`tok_s_b1`: a 32-token prompt,
--new-tokens greedy tokens) and a --prefill-token prompt's rate (`prefill_tok_s`); the
greedy tokens must be the same under both builds (printed). With --kernels, the integer
products per format (random blocks: G weights a second, 1 and 64 tokens, one thread
unless EDGEPAGED_NUM_THREADS says otherwise, outputs checked bit for bit); with --attention
CONTEXTS, prefill attention (f32 products, a 512-row chunk over each context, bit for bit,
GFLOP/s); --no-model skips the model runs.

    python bench/build_ab.py --old OLD.so [--new NEW.so] [--model 1b|embedded|FILE] [--reps 4]
                             [--kernels] [--attention 512,2048] [--no-model] [--json]

With --json the last line is one object: {"cpu", "model", "runs": {build: {"tok_s_b1": [..],
"prefill_tok_s": [..]}}, "median": {build: {...}}, "speedup": {"tok_s_b1", "prefill_tok_s"},
"same_tokens", "kernels": {format: {tokens: {build: G weights/s}}}, "attention": {context:
{build: GFLOP/s}} }.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np



def load(path: str) -> types.ModuleType:
    """The extension at `path` as a module of its own (PyO3 keeps one module per library)."""
    loader = importlib.machinery.ExtensionFileLoader("_native", path)
    spec = importlib.util.spec_from_file_location("_native", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def submodules(mod: types.ModuleType) -> dict[str, types.ModuleType]:
    return {k: v for k, v in vars(mod).items() if isinstance(v, types.ModuleType)}


class Builds:
    """The builds by name; `use(name)` binds edgepaged to one of them."""

    def __init__(self, paths: dict[str, str]):
        import edgepaged
        import edgepaged._native as current
        self.mods = {name: load(p) for name, p in paths.items()}
        self.current = current
        self.pkg = edgepaged
        self.active = None

    def _objects(self, mod) -> dict[int, tuple[str, str | None]]:
        out = {id(mod): ("", None)}
        for sub, m in submodules(mod).items():
            out[id(m)] = (sub, None)
            for attr, v in vars(m).items():
                if not attr.startswith("__"):
                    out[id(v)] = (sub, attr)
        return out

    def _resolve(self, mod, key):
        sub, attr = key
        if not sub:
            return mod
        m = getattr(mod, sub)
        return m if attr is None else getattr(m, attr)

    def use(self, name: str) -> None:
        target = self.mods[name]
        sources = [self.current, *self.mods.values()]
        known = {}
        for src in sources:
            known.update(self._objects(src))
        sys.modules["edgepaged._native"] = target
        for sub, m in submodules(target).items():
            sys.modules[f"edgepaged._native.{sub}"] = m
        self.pkg._native = target
        for modname, m in list(sys.modules.items()):
            if not modname.startswith("edgepaged") or modname.startswith("edgepaged._native") or m is None:
                continue
            for attr, v in list(vars(m).items()):
                key = known.get(id(v))
                if key is not None:
                    setattr(m, attr, self._resolve(target, key))
        self.active = name


def kernels(builds: Builds, reps: int) -> dict:
    """The integer products of each format under each build, alternated, bit for bit."""
    r16 = 0x200
    rng = np.random.default_rng(0)
    fmts = {"q4_0": (2, 32, 18, [0]), "q4_1": (3, 32, 20, [0, 2]), "q5_0": (6, 32, 22, [0]),
            "q8_0": (8, 32, 34, [0]), "q4_k": (12, 256, 144, [0, 2]), "q5_k": (13, 256, 176, [0, 2]),
            "q6_k": (14, 256, 210, [208])}
    rows, cols = 4096, 2048
    out: dict = {}
    for name, (qt, qk, size, halves) in fmts.items():
        blk = rng.integers(0, 256, (rows * cols // qk, size), dtype=np.uint8)
        for o in halves:
            blk[:, o:o + 2] = rng.uniform(0.001, 0.01, (len(blk), 1)).astype(np.float16).view(np.uint8)
        raw = blk.reshape(-1)
        w = {b: m.quant.repack(raw, qt, rows).reshape(-1) for b, m in builds.mods.items()}
        for t in (1, 64):
            x = rng.standard_normal((t, cols)).astype(np.float32)
            rates: dict = {b: [] for b in builds.mods}
            results = {}
            for _ in range(reps):
                for b, m in builds.mods.items():
                    o = np.zeros((t, rows), np.float32)
                    m.quant.matmul(w[b], qt | r16, x, o)
                    results[b] = o
                    n = max(2, int(2e8 / (rows * cols * t)))
                    t0 = time.perf_counter()
                    for _ in range(n):
                        m.quant.matmul(w[b], qt | r16, x, o)
                    rates[b].append(rows * cols * t * n / (time.perf_counter() - t0) / 1e9)
            first = next(iter(results.values()))
            if not all(np.array_equal(first, r) for r in results.values()):
                sys.exit(f"{name}: the builds' products differ")
            out.setdefault(name, {})[t] = {b: round(statistics.median(v), 2) for b, v in rates.items()}
            print(f"  {name} x {t} token(s): " + ", ".join(f"{b} {statistics.median(v):.1f}" for b, v in rates.items())
                  + " G weights/s", flush=True)
    return out


def attention(builds: Builds, reps: int, contexts: list[int], rows: int = 512) -> dict:
    """Prefill attention (`ops.paged_prefill`, f32 products) of a chunk of `rows` rows over
    each context under each build, alternated, bit for bit: the Llama-3.2-1B shape's heads
    (32 / 8 of 64), an f16 cache in blocks of 16, a shuffled table. GFLOP/s (4 x head_dim per
    row, query head and visible position)."""
    from bench.prefill_attention_bench import NH as nh, NKV as nkv, D as d, case
    rng = np.random.default_rng(1)
    out: dict = {}
    for n in contexts:
        q, k, v, tables, starts, lens = case(rows, n, rng)
        times: dict = {b: [] for b in builds.mods}
        results = {}
        for _ in range(reps):
            for b, m in builds.mods.items():
                was = m.ops.bf16_attention(False)
                o = np.zeros((rows, nh * d), np.float32)
                t0 = time.perf_counter()
                m.ops.paged_prefill(q, o, starts, lens, tables, k, v, nh, nkv, d ** -0.5, 0, 0.0)
                times[b].append(time.perf_counter() - t0)
                m.ops.bf16_attention(was)
                results[b] = o
        first = next(iter(results.values()))
        if not all(np.array_equal(first.view(np.uint32), r.view(np.uint32)) for r in results.values()):
            sys.exit(f"context {n}: the builds' attention differs")
        flop = 4 * d * nh * rows * (n - (rows - 1) / 2)
        out[n] = {b: round(flop / statistics.median(ts) / 1e9, 1) for b, ts in times.items()}
        print(f"  attention, {rows} rows over {n}: " + ", ".join(f"{b} {g} GFLOP/s" for b, g in out[n].items()),
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the old build's _native.abi3.so (a copy)")
    ap.add_argument("--new", default=None, help="the new build's (default: the checkout's edgepaged/_native.abi3.so)")
    ap.add_argument("--model", default="1b", help="1b (family_bench's synthetic Q4_K_M), embedded, or a GGUF file")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=33)
    ap.add_argument("--prefill", type=int, default=256, help="prompt tokens of the prefill runs")
    ap.add_argument("--kernels", action="store_true", help="also the integer products per format")
    ap.add_argument("--attention", default=None, metavar="CONTEXTS",
                    help="also prefill attention over these contexts (e.g. 512,2048,4096), f32 products")
    ap.add_argument("--no-model", action="store_true", help="the kernels (and attention) only")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "edgepaged" / "bench")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    new = args.new or str(Path(__file__).resolve().parent.parent / "edgepaged" / "_native.abi3.so")
    from bench.family_bench import cpu_flags, default_model_path, prompts, synthetic
    from edgepaged.testing.decode import make_allocator, run_batch
    builds = Builds({"old": args.old, "new": new})
    res: dict = {"cpu": cpu_flags()}
    if args.kernels:
        res["kernels"] = kernels(builds, args.reps)
    if args.attention:
        res["attention"] = attention(builds, args.reps, [int(c) for c in args.attention.split(",")])
    if args.no_model:
        if args.json:
            print(json.dumps(res))
        return
    path = (synthetic("q4_k_m", args.cache_dir) if args.model == "1b"
            else Path(default_model_path()) if args.model == "embedded" else Path(args.model))
    res["model"] = path.name
    from edgepaged.model.open import open_runner
    runners = {}
    for b in builds.mods:
        builds.use(b)
        r = open_runner(path, "cpu", num_blocks=(args.prefill + 32 + args.new_tokens) // 16 + 32)
        a = make_allocator(r)
        run_batch(r, a, prompts(r.config.vocab_size, 2, 8, 9), 4, seq_base=1_000_000)   # warm-up
        runners[b] = (r, a)
    runs: dict = {b: {"tok_s_b1": [], "prefill_tok_s": []} for b in builds.mods}
    tokens: dict = {b: [] for b in builds.mods}
    for rep in range(args.reps):
        for i, b in enumerate(builds.mods):
            builds.use(b)
            r, a = runners[b]
            vocab = r.config.vocab_size
            out, _, td = run_batch(r, a, prompts(vocab, 1, 32, rep), args.new_tokens, seq_base=10_000 * rep + 100 * i)
            runs[b]["tok_s_b1"].append(round((args.new_tokens - 1) / td, 2))
            tokens[b].append(out)
            _, tp, _ = run_batch(r, a, prompts(vocab, 1, args.prefill, 50 + rep), 1, seq_base=10_000 * rep + 100 * i + 50)
            runs[b]["prefill_tok_s"].append(round(args.prefill / tp, 1))
        print(f"  run {rep + 1}: " + "; ".join(f"{b} b1 {runs[b]['tok_s_b1'][-1]} tok/s, prefill "
                                              f"{runs[b]['prefill_tok_s'][-1]} tok/s" for b in builds.mods), flush=True)
    med = {b: {k: round(statistics.median(v), 2) for k, v in runs[b].items()} for b in builds.mods}
    res.update(runs=runs, median=med, same_tokens=tokens["old"] == tokens["new"],
               speedup={k: round(med["new"][k] / med["old"][k], 3) for k in ("tok_s_b1", "prefill_tok_s")})
    print(f"{res['model']}: b1 {med['old']['tok_s_b1']} -> {med['new']['tok_s_b1']} tok/s "
          f"(x{res['speedup']['tok_s_b1']}), prefill {med['old']['prefill_tok_s']} -> {med['new']['prefill_tok_s']} "
          f"tok/s (x{res['speedup']['prefill_tok_s']}), same tokens: {res['same_tokens']}")
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
