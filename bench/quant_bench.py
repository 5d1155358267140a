"""Quantized weights kept quantized on CPU: decode throughput and resident memory of the
embedded GGUF model, quantized path against the fp32 (dequantized) path and llama.cpp.

All in one run, same GGUF, same prompt(s), greedy, EOS ignored (every sequence yields exactly
--new-tokens tokens). tok/s = B * new_tokens / (prefill + decode time).

- tok_s_b1: this runtime, quantized path, one stream ("What is the capital of France?")
- llama_cpp_tok_s_b1: llama-cpp-python on the same file and prompt tokens (null, with the
  reason printed, when it is not installed)
- fp32_tok_s_b1 / fp32_tok_s_b32: the fp32 path (weights dequantized at load)
- tok_s_b32: the quantized runner at batch 32 (its own rule picks kernels or fp32 GEMM per call);
  both runners stay loaded and their runs alternate, best of --reps each
- weights_rss_mb: resident memory that building the model and loading its weights adds
  (fresh process, the GGUF reader and tokenizer already open), against gguf_mb, the file
  size; runner_rss_mb: what a whole ModelRunner adds (tokenizer, 16-block KV cache and
  what the GGUF reader leaves behind included); fp32_* the same for the fp32 path
- --crossover: per token count, time of every linear layer of the model with the kernels
  and with decode-to-scratch + GEMM (how EDGEPAGED_QUANT_DENSE_MIN_TOKENS, edgepaged/model/settings.py, is chosen)

    python bench/quant_bench.py [--json] [--new-tokens 64] [--batch 32] [--no-llama-cpp] [--crossover]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

from edgepaged.model import ModelRunner, default_model_path
from edgepaged.testing import decode

QUESTION = "What is the capital of France?"
QUESTIONS = [
    QUESTION, "How do I boil an egg?", "Name three primary colors.", "Why is the sky blue?",
    "Write a haiku about autumn.", "What is 12 times 7?", "Give me a tip for better sleep.", "What does a CPU do?",
    "Explain photosynthesis briefly.", "Who wrote Romeo and Juliet?", "What is the boiling point of water?",
    "Suggest a name for a cat.", "How many legs does a spider have?", "What is a prime number?",
    "Describe the moon in one sentence.", "What language is spoken in Brazil?", "How do airplanes fly?",
    "What is the largest ocean?", "Recommend a book for a long trip.", "What is machine learning?",
    "How far is the sun from earth?", "What is the tallest mountain?", "Translate 'good morning' to Spanish.",
    "What are clouds made of?", "Why do leaves change color?", "How do I make tea?", "What is gravity?",
    "List two uses of copper.", "What is the speed of light?", "How do bees make honey?", "What is an atom?",
    "Tell me a fun fact.",
]

RSS_PROBE = r"""
import dataclasses, gc, json, sys
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
import torch
from edgepaged.model import ModelRunner
from edgepaged.model.torch.llama import LlamaForCausalLM
from edgepaged.model.loader import ModelFiles
from edgepaged.model.quant import weight_bytes
from edgepaged.model.tokenizer import Tokenizer
quantized, what = sys.argv[1] == "1", sys.argv[2]
if what == "runner":                      # the whole runner: tokenizer, 16-block KV cache, ...
    before = rss()
    runner = ModelRunner(num_blocks=16, quantized=quantized)
    gc.collect()
    print(json.dumps({"runner_rss": rss() - before, **weight_bytes(runner.model)}))
    sys.exit()
files = ModelFiles()                      # what the runner opens first: the GGUF reader ...
tok = Tokenizer.load(files.path, reader=files.reader)   # ... and the tokenizer
with torch.inference_mode():              # torch's code paths for building a model, paged in
    tiny = dataclasses.replace(files.config, num_layers=1, vocab_size=64, context_length=16)
    LlamaForCausalLM(tiny).pack()
gc.collect()
base = rss()
with torch.inference_mode():              # then the runner's own loading steps
    model = LlamaForCausalLM(files.config)
    model.load_weights(files.weights(torch.float32, keep_quantized=quantized))
    model.pack()
gc.collect()
print(json.dumps({"weights_rss": rss() - base}))
"""


def weights_rss(quantized: bool) -> dict:
    """Resident memory of the weights and of a whole ModelRunner, each in a fresh process."""
    res = {}
    for what in ("weights", "runner"):
        out = subprocess.run([sys.executable, "-c", RSS_PROBE, "1" if quantized else "0", what],
                             capture_output=True, text=True, check=True)
        res.update(json.loads(out.stdout.strip().splitlines()[-1]))
    return res


def cpu_idle(seconds: float = 1.0) -> float:
    """Fraction of the machine's CPU time idle over `seconds` (others' load makes numbers noisy)."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)
    a = snap()
    time.sleep(seconds)
    b = snap()
    return (b[0] - a[0]) / max(1, b[1] - a[1])


def chat_ids(tok, question: str) -> np.ndarray:
    return np.array(tok.apply_chat_template([{"role": "user", "content": question}]), np.int64)


def run_batch(runner, alloc, prompts, new_tokens, seq_base):
    """model_bench's run (one flat prefill, then greedy decode) -> (outputs, seconds in all)."""
    out, t_prefill, t_decode = decode.run_batch(runner, alloc, prompts, new_tokens, seq_base)
    return out, t_prefill + t_decode


def paired_tok_s(batch: int, new_tokens: int, reps: int, llama_once=None, cpu_runtime: bool = False) -> dict:
    """The quantized and the fp32 runner side by side (and llama.cpp at batch 1), their runs
    interleaved (quantized, fp32, llama.cpp, quantized, ...) so that a slow spell of the
    shared machine hits all of them; the best of `reps` runs counts for each, at batch 1 and
    at `batch`; with `cpu_runtime`, the torch-free runner (quantized) runs beside them too.
    -> {True: {...}, False: {...}, "cpu": {...} (cpu_runtime), "llama_cpp": tok/s or None}"""
    from edgepaged._native.blocks import BlockAllocator
    sides = {}
    keys = (True, False, "cpu") if cpu_runtime else (True, False)
    for quantized in keys:
        if quantized == "cpu":
            from edgepaged.model.cpu.runner import CpuRunner
            runner = CpuRunner()
        else:
            runner = ModelRunner(quantized=quantized)
        alloc = BlockAllocator(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        run_batch(runner, alloc, [chat_ids(runner.tokenizer, q) for q in QUESTIONS[:2]], 4, seq_base=900_000)
        sides[quantized] = (runner, alloc, {})
    prompts = [chat_ids(sides[True][0].tokenizer, q) for q in QUESTIONS]
    llama = None
    for b in (1, batch):
        for i in range(reps):
            for quantized in keys:
                runner, alloc, res = sides[quantized]
                out, dt = run_batch(runner, alloc, (prompts * (b // len(prompts) + 1))[:b], new_tokens,
                                    seq_base=1000 * b + 100 * i)
                res[b] = max(res.get(b, 0.0), b * new_tokens / dt)
                if b == 1:
                    res["answer"] = runner.tokenizer.decode(out[0], skip_special_tokens=True)
            if b == 1 and llama_once is not None:
                llama = max(llama or 0.0, new_tokens / llama_once())
    return {**{k: sides[k][2] for k in keys}, "llama_cpp": llama}


def llama_cpp_runner(new_tokens: int):
    """-> (a function timing one single-stream run in seconds, or None; what ran / why not)."""
    try:
        import llama_cpp
    except ImportError:
        return None, "llama-cpp-python is not installed (pip install llama-cpp-python; it builds from source)"
    from edgepaged.model.tokenizer import Tokenizer
    path = default_model_path()
    tk = Tokenizer.load(path)
    ids = chat_ids(tk, QUESTION).tolist()
    threads = int(os.environ.get("EDGEPAGED_NUM_THREADS") or torch.get_num_threads())
    llm = llama_cpp.Llama(str(path), n_ctx=512, n_batch=512, n_threads=threads, n_threads_batch=threads,
                          verbose=False)

    def once() -> float:
        llm.reset()
        t0 = time.perf_counter()
        for i, _ in enumerate(llm.generate(ids, top_k=1, temp=0.0, reset=True), 1):
            if i == new_tokens:
                break
        return time.perf_counter() - t0
    once()  # warm-up
    return once, f"llama-cpp-python {llama_cpp.__version__}, {threads} threads"


def crossover(token_counts) -> list[dict]:
    """Time all linear layers of the quantized model at each token count, both ways."""
    from edgepaged.model.quant import QuantLinear
    runner = ModelRunner(num_blocks=16, quantized=True)
    mods = [m for m in runner.model.modules() if isinstance(m, QuantLinear)]
    rows = []
    with torch.inference_mode():
        for t in token_counts:
            xs = {k: torch.randn(t, k) for k in {m.in_features for m in mods}}
            row = {"tokens": t}
            for name, dense_min in (("kernel_ms", 1 << 30), ("dense_ms", 1)):
                for m in mods:
                    m.dense_min_tokens = dense_min
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    for m in mods:
                        m(xs[m.in_features])
                    best = min(best, time.perf_counter() - t0)
                row[name] = round(best * 1e3, 2)
            rows.append(row)
            print(f"T={t:4d}: kernels {row['kernel_ms']:8.2f} ms, decode-to-scratch + GEMM {row['dense_ms']:8.2f} ms",
                  flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3, help="runs per path and batch size (interleaved); the best counts")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--crossover", action="store_true", help="also time kernels vs GEMM per token count")
    ap.add_argument("--cpu-runtime", action="store_true",
                    help="also the torch-free runtime (cpu_tok_s_*, cpu_vs_torch_*), interleaved with the others")
    args = ap.parse_args()

    from edgepaged._native import quant
    path = default_model_path()
    info = quant.info()
    res = {"model": path.name, "gguf_mb": round(path.stat().st_size / 2**20, 1),
           "threads": torch.get_num_threads(), "kernel": info["isa"], "int8_kernel": info["int8_isa"], "kernel_threads": info["threads"], "new_tokens": args.new_tokens,
           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "cpu_idle_at_start": round(cpu_idle(), 2)}
    q = weights_rss(True)
    f = weights_rss(False)
    res["weights_rss_mb"] = round(q["weights_rss"] / 2**20, 1)
    res["runner_rss_mb"] = round(q["runner_rss"] / 2**20, 1)
    res["quantized_weight_mb"] = round(q["quantized"] / 2**20, 1)
    res["fp32_weights_rss_mb"] = round(f["weights_rss"] / 2**20, 1)
    res["fp32_runner_rss_mb"] = round(f["runner_rss"] / 2**20, 1)

    if args.no_llama_cpp:
        llama_once, why = None, "skipped (--no-llama-cpp)"
    else:
        llama_once, why = llama_cpp_runner(args.new_tokens)
    print(f"llama.cpp: {why}", file=sys.stderr)
    res["llama_cpp"] = why

    both = paired_tok_s(args.batch, args.new_tokens, args.reps, llama_once, args.cpu_runtime)
    if args.cpu_runtime:
        for b in (1, args.batch):
            res[f"cpu_tok_s_b{b}"] = both["cpu"][b]
            res[f"cpu_vs_torch_b{b}"] = both["cpu"][b] / both[True][b]
    quant, fp32 = both[True], both[False]
    res["llama_cpp_tok_s_b1"] = both["llama_cpp"]
    res["tok_s_b1"], res[f"tok_s_b{args.batch}"] = quant[1], quant[args.batch]
    res["fp32_tok_s_b1"], res[f"fp32_tok_s_b{args.batch}"] = fp32[1], fp32[args.batch]
    res["answer_b1"] = quant["answer"]
    if res["llama_cpp_tok_s_b1"]:
        res["b1_vs_llama_cpp"] = res["tok_s_b1"] / res["llama_cpp_tok_s_b1"]
    res["b1_vs_fp32"] = res["tok_s_b1"] / res["fp32_tok_s_b1"]
    res[f"b{args.batch}_vs_fp32"] = res[f"tok_s_b{args.batch}"] / res[f"fp32_tok_s_b{args.batch}"]
    res["rss_vs_gguf"] = res["weights_rss_mb"] / res["gguf_mb"]
    res["cpu_idle_at_end"] = round(cpu_idle(), 2)
    if args.crossover:
        res["crossover"] = crossover([1, 4, 8, 16, 32, 64, 128, 256])
    res = {k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}
    if not args.json:
        for k, v in res.items():
            if k != "crossover":
                print(f"{k:>24}: {v}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
