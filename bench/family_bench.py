"""1-8 B speed: a synthetic GGUF of Llama-3.2-1B's shape (16 layers, hidden 2048, FFN 8192,
32/8 heads, the embedded model's 49,152-token vocabulary, random blocks), or with --shape of
Llama-3.2-3B's (28 layers, hidden 3072, FFN 8192, 24/8 heads) or Llama-3.1-8B's (32 layers,
hidden 4096, FFN 14336, 32/8 heads), both with Llama 3's 128,256-token vocabulary, in a
Q4_K_M mix (Q4_K; Q6_K for attn_v, ffn_down and the tied embeddings) and in Q8_0, against
llama.cpp (llama-cpp-python, or its own llama-bench) on the same file, in the same run.

    python bench/family_bench.py [--json] [--shape 1b|3b|8b] [--files q4_k_m,q8_0] [--new-tokens 64]
                                 [--reps 2] [--llama-bench PATH]

The files are written once and cached outside the repository (`--cache-dir`, default
~/.cache/edgepaged/bench). For each file the last JSON line holds:

    tok_s_b1           one stream: (new_tokens - 1) / decode seconds (best of --reps)
    tok_s_b32          32 streams at once: 32 * (new_tokens - 1) / decode seconds
    prefill_tok_s      a 512-token prompt: 512 / its prefill seconds
    roofline_frac_b32  2 * params * tok_s_b32 / (fp32 GEMM FLOP/s at 2048^3, this run, best)
    b1_roofline_frac   tok_s_b1 * the weights' bytes / mem_read_gbs: one stream reads every
                       weight once a token, so 1.0 is the memory's limit (mem_read_gbs, top
                       level: a read-bandwidth probe in this process, both threads, best of
                       the run)
    weights_rss_mb     resident memory the weights add to a fresh process after one token (MiB;
                       the --runtime's runner); the cpu runtime's: ready_s, its load on a warm page
                       cache, `weights_cache` saying how ("hit": the laid-out weights mapped from
                       the weights cache under --cache-dir/weights, written by a load before it;
                       "off": a file under 512 MiB, not cached), ready_uncached_s and
                       weights_rss_uncached_mb the same with the cache off (the file read and
                       laid out again)
    file_mb            the file (MiB)
    prefill_int8_frac  prefill_tok_s * 2 * (params - the LM head's) / int8_peak_gops: the
                       prompt's products as a fraction of the CPU's int8 limit (`vpdpbusd` on
                       every thread, measured in this run, best; null without AVX-512 VNNI or
                       with exact math); the formats' unpacking and scales cost the rest
    attention_products "bf16" or "f32": prefill attention's products (bf16 over an f16 or q8_0
                       cache on a CPU with AVX-512 BF16 unless EDGEPAGED_ATTENTION_BF16=0; else f32)
    isa                the instruction set the products ran on ("avx512-vnni", "avx2", "scalar";
                       `machine` lists the CPU's flags); `math`: "int8" or "exact" (the
                       server's default for the file, EDGEPAGED_QUANT_MATH to choose)
    llama_cpp_tok_s_b1, llama_cpp_prefill_tok_s   the same figures from llama.cpp, or null
                       with `llama_cpp_note` saying why (not installed: it builds from
                       source, about 15 minutes: pip install llama-cpp-python)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from edgepaged.model import default_model_path
from edgepaged.testing.decode import make_allocator, run_batch
from edgepaged.testing.gguf_models import Q4_K_M, write_random_gguf

SHAPES = {"1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, inter=8192, context=4096),
          "3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, inter=8192, context=4096, vocab=128256),
          "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, inter=14336, context=4096, vocab=128256)}
SHAPE = SHAPES["1b"]
MIXES = {"q4_k_m": Q4_K_M, "q8_0": {k: 8 for k in Q4_K_M}}
PREFILL = 512


def cpu_flags() -> dict:
    """The CPU's model name and the SIMD features that matter here."""
    name, flags = "", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and not name:
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
              "amx_int8", "amx_bf16")
    return {"cpu": name or platform.processor() or platform.machine(), "flags": [f for f in wanted if f in flags]}


def synthetic(mix: str, cache_dir: Path, shape: str = "1b") -> Path:
    """The shape's file in the mix, written once under cache_dir (1b: the embedded model's
    49,152-token vocabulary; 3b, 8b: Llama 3's 128,256, the embedded model's tokens and
    reserved ones). Its laid-out weights are kept beside it (`weights/`, unless
    EDGEPAGED_WEIGHTS_CACHE says otherwise) and written here, before anything is measured:
    a benchmark's runner or server maps them as a restarted one would, with no writer
    running beside the measurement."""
    path = cache_dir / f"llama{shape}-{mix}.gguf"
    if not path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} (once)", flush=True)
        tmp = path.with_suffix(".tmp")
        write_random_gguf(tmp, **SHAPES[shape], qtypes=MIXES[mix], seed=1, tied=True,
                          tokenizer_from=default_model_path())
        tmp.rename(path)
    os.environ.setdefault("EDGEPAGED_WEIGHTS_CACHE", str(cache_dir / "weights"))
    from edgepaged.model import weights_cache
    weights_cache.prepare(path)
    return path


def mem_read_gbs(mib: int = 1024, reps: int = 3) -> float:
    """Read bandwidth, every thread (core) at once, GB/s: the best of `reps` passes of two
    reductions over a `mib` MiB array split between the threads (numpy's reductions let go of
    the GIL): a max over 64-bit integers (the least work per byte numpy has) and a float32 sum
    (measured 25-34 GB/s on one Zen 4 depending on the reduction: the best counts), and of the
    kernels' own probe (`quant.read_gbs`: the pool's threads streaming as a decode step does,
    its prefetch on and off): the highest any of them reached is the limit."""
    import threading
    a = np.ones(mib * 2**20 // 4, np.float32)
    threads = int(os.environ.get("EDGEPAGED_NUM_THREADS") or os.cpu_count() or 1)
    best = 0.0
    for fn, view in ((np.max, a.view(np.uint64)), (np.sum, a)):
        parts = np.array_split(view, threads)
        for _ in range(reps):
            ts = [threading.Thread(target=fn, args=(p,)) for p in parts]
            t = time.perf_counter()
            for th in ts:
                th.start()
            for th in ts:
                th.join()
            best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    del a, parts, view
    from edgepaged._native import quant
    return max(best, quant.read_gbs(mib, reps))


def gemm_gflops(reps: int = 5) -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * 2048 ** 3 / (time.perf_counter() - t) / 1e9)
    return best


RSS_PROBE = r"""
import gc, json, sys
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
import torch
from edgepaged.model import ModelRunner
from edgepaged.model.quant import weight_bytes
ModelRunner(num_blocks=4)          # torch's and the loader's own code paged in first
gc.collect()
before = rss()
r = ModelRunner(sys.argv[1], num_blocks=4)
gc.collect()
print(json.dumps({"rss": rss() - before, **weight_bytes(r.model)}))
"""


CPU_PROBE = r"""
import gc, json, sys, time
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
from edgepaged.model.cpu.runner import CpuRunner
from edgepaged.testing.decode import make_allocator, prompt_logits
CpuRunner(num_blocks=4, progress=lambda *a, **k: None)    # the loader's own code paged in first
gc.collect()
before = rss()
t = time.perf_counter()
r = CpuRunner(sys.argv[1], num_blocks=4, progress=lambda *a, **k: None)
ready = time.perf_counter() - t
gc.collect()
loaded = rss() - before
prompt_logits(r, make_allocator(r), [300])    # one token: every weight read once (a mapped cache's pages too)
print(json.dumps({"rss": rss() - before, "rss_loaded": loaded, "ready_s": ready, "weight_bytes": r.weight_bytes(),
                  "weights_cache": r.weights_cache}))
"""


def weights_rss(path: Path, runtime: str = "torch", cache_dir: Path | None = None) -> dict:
    """What the weights add to a fresh process after one token and (cpu) how long the load
    takes on a warm page cache: without the weights cache (twice: the first warms the page
    cache; `ready_uncached_s`), then with it (`cache_dir`/weights: the first load writes the
    entry unless an earlier run did; the second, measured, maps it: `ready_s`, `rss`)."""
    if runtime != "cpu":
        out = subprocess.run([sys.executable, "-c", RSS_PROBE, str(path)], capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def probe(cache: str) -> dict:
        env = dict(os.environ, EDGEPAGED_WEIGHTS_CACHE=cache)
        out = subprocess.run([sys.executable, "-c", CPU_PROBE, str(path)], capture_output=True, text=True, check=True,
                             env=env)
        return json.loads(out.stdout.strip().splitlines()[-1])
    probe("0")
    res = probe("0")
    cache = os.environ.get("EDGEPAGED_WEIGHTS_CACHE") or str((cache_dir or path.parent) / "weights")
    probe(cache)
    res.update({k: v for k, v in probe(cache).items() if k in ("rss", "rss_loaded", "ready_s", "weights_cache")},
               ready_uncached_s=res["ready_s"], rss_uncached=res["rss"])
    return res


def prompts(vocab: int, n: int, length: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(300, vocab - 300, length).astype(np.int64) for _ in range(n)]


def attention_products(runner) -> str:
    """"bf16" where prefill attention over the runner's cache multiplies in bf16 (an f16 or q8_0
    cache, a CPU with AVX-512 BF16, EDGEPAGED_ATTENTION_BF16 not 0), else "f32"."""
    from edgepaged._native import ops
    return "bf16" if ops.bf16_attention() and runner.kv_dtype_name in ("f16", "q8_0") else "f32"


def ours(path: Path, new_tokens: int, reps: int, runtime: str = "cpu") -> dict:
    from edgepaged.model.open import open_runner
    runner = open_runner(path, "cpu", runtime=runtime, num_blocks=(32 * (32 + new_tokens) + PREFILL) // 16 + 64)
    alloc = make_allocator(runner)
    vocab = runner.config.vocab_size
    run_batch(runner, alloc, prompts(vocab, 2, 8, 9), 4, seq_base=1_000_000)   # warm-up
    res = {"tok_s_b1": 0.0, "tok_s_b32": 0.0, "prefill_tok_s": 0.0, "params": runner.config.num_params,
           "_config": runner.config,
           "runtime": runtime,
           "forward": getattr(runner, "forward_name", None) or runner.forward.name, "kv_dtype": runner.kv_dtype_name, "math": runner.quant_math,
           "isa": runner.products.split("(")[-1].rstrip(")").split(",")[0], "attention_products": attention_products(runner)}
    for r in range(reps):
        base = 10_000 * (r + 1)
        _, _, td = run_batch(runner, alloc, prompts(vocab, 1, 32, r), new_tokens, seq_base=base)
        res["tok_s_b1"] = max(res["tok_s_b1"], (new_tokens - 1) / td)
        _, tp, _ = run_batch(runner, alloc, prompts(vocab, 1, PREFILL, 50 + r), 1, seq_base=base + 100)
        res["prefill_tok_s"] = max(res["prefill_tok_s"], PREFILL / tp)
        _, _, td = run_batch(runner, alloc, prompts(vocab, 32, 32, 100 + r), new_tokens, seq_base=base + 200)
        res["tok_s_b32"] = max(res["tok_s_b32"], 32 * (new_tokens - 1) / td)
        print(f"  run {r + 1}: b1 {res['tok_s_b1']:.1f} tok/s, prefill {res['prefill_tok_s']:.1f} tok/s, "
              f"b32 {res['tok_s_b32']:.1f} tok/s (best so far)", flush=True)
    return res


def prefill_only(path: Path, reps: int = 2) -> float:
    """`prefill_tok_s` alone, measured as `ours` measures it (its warm-up, then the best of
    `reps` PREFILL-token prompts): other benchmarks compare with it in their own run."""
    from edgepaged.model.open import open_runner
    runner = open_runner(path, "cpu", num_blocks=PREFILL // 16 + 64)
    alloc = make_allocator(runner)
    vocab = runner.config.vocab_size
    run_batch(runner, alloc, prompts(vocab, 2, 8, 9), 4, seq_base=1_000_000)   # warm-up
    return max(PREFILL / run_batch(runner, alloc, prompts(vocab, 1, PREFILL, 50 + r), 1, seq_base=10_000 * (r + 1))[1]
               for r in range(reps))


def prefill_chunked(path: Path, tokens: int, chunk: int = 512, reps: int = 1) -> float:
    """The prefill rate of one `tokens`-token prompt computed in `chunk`-token steps, as the
    server's scheduler cuts a long prompt alone (`--max-batched-tokens`): each chunk attends
    over everything before it. The same warm-up as `prefill_only`; the best of `reps`."""
    from edgepaged.model.open import open_runner
    from edgepaged.testing.decode import step
    runner = open_runner(path, "cpu", num_blocks=tokens // 16 + 64)
    alloc = make_allocator(runner)
    vocab = runner.config.vocab_size
    run_batch(runner, alloc, prompts(vocab, 2, 8, 9), 4, seq_base=1_000_000)   # warm-up
    best = 0.0
    for r in range(reps):
        sid, p = 10_000 * (r + 1), prompts(vocab, 1, tokens, 70 + r)[0]
        alloc.add_sequence(sid, p)
        t = time.perf_counter()
        for at in range(0, tokens, chunk):
            n = min(chunk, tokens - at)
            step(runner, alloc, [sid], [n], p[at:at + n], np.arange(at, at + n))
        best = max(best, tokens / (time.perf_counter() - t))
        alloc.free_sequence(sid, cache=False)
    return best


def llama_bench(exe: str, path: Path, new_tokens: int, reps: int) -> dict:
    """llama.cpp's own llama-bench: a PREFILL-token prompt and new_tokens generated, --reps
    repetitions each (its mean)."""
    threads = int(os.environ.get("EDGEPAGED_NUM_THREADS") or os.cpu_count())
    out = subprocess.run([exe, "-m", str(path), "-p", str(PREFILL), "-n", str(new_tokens), "-t", str(threads),
                          "-r", str(max(reps, 2)), "-o", "json"], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        return {"llama_cpp_tok_s_b1": None, "llama_cpp_prefill_tok_s": None,
                "llama_cpp_note": f"llama-bench failed: {out.stderr.strip().splitlines()[-1:]}"}
    res = {"llama_cpp_note": f"llama-bench ({Path(exe).name}), {threads} threads"}
    for row in json.loads(out.stdout):
        if row.get("n_prompt") and not row.get("n_gen"):
            res["llama_cpp_prefill_tok_s"] = row["avg_ts"]
        elif row.get("n_gen") and not row.get("n_prompt"):
            res["llama_cpp_tok_s_b1"] = row["avg_ts"]
    return res


def llama_cpp(path: Path, new_tokens: int, reps: int, vocab: int, bench_exe: str | None = None) -> dict:
    try:
        import llama_cpp
    except ImportError:
        import shutil
        exe = bench_exe or shutil.which("llama-bench")
        if exe:
            return llama_bench(exe, path, new_tokens, reps)
        return {"llama_cpp_tok_s_b1": None, "llama_cpp_prefill_tok_s": None,
                "llama_cpp_note": "neither llama-cpp-python nor llama-bench is installed (pip install "
                                  "llama-cpp-python builds from source, about 15 minutes on 2 cores)"}
    threads = int(os.environ.get("EDGEPAGED_NUM_THREADS") or os.cpu_count())
    llm = llama_cpp.Llama(str(path), n_ctx=PREFILL + new_tokens + 64, n_batch=PREFILL, n_ubatch=PREFILL,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    res = {"llama_cpp_tok_s_b1": 0.0, "llama_cpp_prefill_tok_s": 0.0,
           "llama_cpp_note": f"llama-cpp-python {llama_cpp.__version__}, {threads} threads"}
    for r in range(reps + 1):                 # the first round warms up
        llm.reset()
        long = prompts(vocab, 1, PREFILL, 50 + r)[0].tolist()
        t = time.perf_counter()
        llm.eval(long)
        tp = time.perf_counter() - t
        llm.reset()
        llm.eval(prompts(vocab, 1, 32, r)[0].tolist())
        t = time.perf_counter()
        for i in range(new_tokens - 1):       # one token at a time, as a stream decodes
            llm.eval([int(long[i])])          # (which token does not change the work)
        td = time.perf_counter() - t
        if r:
            res["llama_cpp_prefill_tok_s"] = max(res["llama_cpp_prefill_tok_s"], PREFILL / tp)
            res["llama_cpp_tok_s_b1"] = max(res["llama_cpp_tok_s_b1"], (new_tokens - 1) / td)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    ap.add_argument("--files", default="q4_k_m,q8_0")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2, help="runs of each figure; the best counts")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "edgepaged" / "bench")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b",
                    help="1b (Llama-3.2-1B), 3b (Llama-3.2-3B), 8b (Llama-3.1-8B): layers, widths, heads and "
                         "(3b, 8b) Llama 3's vocabulary")
    ap.add_argument("--model", default=None, help="measure this GGUF file instead of a synthetic shape (embedded: "
                    "the embedded SmolLM2-135M); its figures under the key 'model'")
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench (used when llama-cpp-python is "
                    "not installed; default: llama-bench on the PATH)")
    ap.add_argument("--runtime", default="cpu",
                    help="ours: cpu (the torch-free runtime, what serve runs on a CPU) or torch (the torch runner); "
                         "'cpu,torch' measures both in this run, the second's figures prefixed torch_")
    args = ap.parse_args()
    from edgepaged._native import quant
    # the weights cache beside the bench's files (not the model store's): the probes write
    # it, the measured runner maps it as a restarted server would
    os.environ.setdefault("EDGEPAGED_WEIGHTS_CACHE", str(args.cache_dir / "weights"))
    machine = cpu_flags()
    out = {"machine": machine, "threads": quant.info()["threads"], "shape": args.shape}
    gflops = gemm_gflops()
    bw = mem_read_gbs()
    peak = quant.int8_peak_gops()
    files = args.files.split(",")
    if args.model:
        files = ["model"]
        out["shape"] = None
    for mix in files:
        path = (Path(default_model_path() if args.model == "embedded" else args.model) if args.model
                else synthetic(mix, args.cache_dir, args.shape))
        print(f"{mix}: {path.name}, {path.stat().st_size / 2**20:.0f} MiB", flush=True)
        res = {"file_mb": round(path.stat().st_size / 2**20, 1)}
        runtimes = args.runtime.split(",")
        w = weights_rss(path, runtimes[0], args.cache_dir)
        res["weights_rss_mb"] = round(w["rss"] / 2**20, 1)
        res["weights_rss_frac"] = round(res["weights_rss_mb"] / res["file_mb"], 3)
        if "ready_s" in w:
            res["ready_s"] = round(w["ready_s"], 2)
            res["weights_bytes"] = w["weight_bytes"]
            res["weights_cache"] = w["weights_cache"]
            res["ready_uncached_s"] = round(w["ready_uncached_s"], 2)
            res["weights_rss_uncached_mb"] = round(w["rss_uncached"] / 2**20, 1)
        res.update(ours(path, args.new_tokens, args.reps, runtimes[0]))
        for other in runtimes[1:]:
            theirs = ours(path, args.new_tokens, args.reps, other)
            res.update({f"{other}_{k}": v for k, v in theirs.items() if k in ("tok_s_b1", "tok_s_b32", "prefill_tok_s",
                                                                              "forward")})
        gflops = max(gflops, gemm_gflops())
        bw = max(bw, mem_read_gbs())
        res["roofline_frac_b32"] = round(2 * res["params"] * res["tok_s_b32"] / (gflops * 1e9), 3)
        # one stream reads every weight once a token: its rate as a fraction of the memory's
        wb = res.get("weights_bytes") or path.stat().st_size
        res["b1_roofline_frac"] = round(res["tok_s_b1"] * wb / (bw * 1e9), 3)
        # a prompt's rows multiply every layer's weights (the LM head only its last row's)
        peak = max(peak or 0.0, quant.int8_peak_gops() or 0.0) or None
        cfg = res.pop("_config")
        per_token = 2 * (res["params"] - cfg.vocab_size * cfg.hidden_size)
        res["prefill_int8_frac"] = round(res["prefill_tok_s"] * per_token / (peak * 1e9), 3) \
            if peak and res.get("math") == "int8" else None
        if args.no_llama_cpp:
            res.update(llama_cpp_tok_s_b1=None, llama_cpp_prefill_tok_s=None, llama_cpp_note="--no-llama-cpp")
        else:
            res.update(llama_cpp(path, args.new_tokens, args.reps, 49152, args.llama_bench))
        for k in ("tok_s_b1", "prefill_tok_s"):
            theirs = res.get(f"llama_cpp_{k}")
            res[f"{k}_vs_llama_cpp"] = round(res[k] / theirs, 3) if theirs else None
        res = {k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}
        out[mix] = res
        print(f"  {mix}: b1 {res['tok_s_b1']} tok/s (llama.cpp {res['llama_cpp_tok_s_b1']}), prefill "
              f"{res['prefill_tok_s']} (llama.cpp {res['llama_cpp_prefill_tok_s']}), b32 {res['tok_s_b32']}, "
              f"roofline_frac_b32 {res['roofline_frac_b32']}, b1_roofline_frac {res['b1_roofline_frac']}, weights {res['weights_rss_mb']} MiB / file "
              f"{res['file_mb']} MiB, {res['isa']}"
              + (f", ready {res['ready_s']} s ({res['weights_cache']}; uncached {res['ready_uncached_s']} s)"
                 if "ready_s" in res else ""), flush=True)
    out["gemm_gflops"] = round(gflops, 1)
    out["mem_read_gbs"] = round(bw, 2)
    out["int8_peak_gops"] = None if peak is None else round(peak, 1)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
