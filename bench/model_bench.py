"""Model runtime benchmark: greedy decode throughput of the CPU runtime (CpuRunner; --runtime torch: the torch runner) on the embedded model
against transformers' `generate` (fp32, same GGUF, same prompts, left padding), plus the
machine's fp32 GEMM rate, all in one run.

Each batch of B distinct chat prompts is prefilled in one flat batch, then decoded for
--new-tokens steps (EOS ignored, so every sequence yields exactly that many tokens).

    tok_s_bN      decode throughput: B * (new_tokens - 1) / time of the decode steps (the first
                  token comes from the prefill); the same for transformers (hf_tok_s_bN), whose
                  decode time is generate(new_tokens) - generate(1 token). Each batch runs
                  --reps times (default 2) on both sides and the best run counts, as the GEMM
                  reference below keeps its best measurement: a slow spell of the shared
                  machine during one run then moves neither side (the runs are listed too,
                  runs_tok_s_bN / runs_hf_tok_s_bN)
    tok_s_e2e_bN  B * new_tokens / (prefill + decode), hf_tok_s_e2e_bN likewise (one generate call)
    gemm_gflops   the machine's fp32 GEMM rate at 2048^3 in the same run: torch.mm (MKL here)
                  and oneDNN's linear, median of 5 each, measured before the first batch and
                  after each run; the best of all (a short measurement taken during a slow
                  spell of a shared machine would flatter the fraction). The best of each
                  library is reported too (gemm_gflops_torch_mm, gemm_gflops_onednn)
    roofline_frac_b32 = 2 * params (LM head included) * tok_s_b32 / (gemm_gflops * 1e9)
    dense_m32_gflops  oneDNN's fp32 linear on this model's own layer shapes at 32 tokens, weights
                      hot in cache, FLOP-weighted over one step (LM head included), best of 3;
                      dense_m32_frac = that / gemm_gflops: how much of the 2048^3 rate the
                      vendor GEMM itself reaches on these shapes, a ceiling for roofline_frac_b32
                      of any GEMM-based decode here

    python bench/model_bench.py [--json] [--batches 1,8,32] [--new-tokens 64] [--reps 2] [--no-hf] [--profile]
                                [--quantized auto|on|off] [--runtime cpu|torch]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch

from edgepaged.model import ModelRunner, default_model_path
from edgepaged.testing.decode import make_allocator, run_batch

QUESTIONS = [
    "What is the capital of France?", "How do I boil an egg?", "Name three primary colors.",
    "Why is the sky blue?", "Write a haiku about autumn.", "What is 12 times 7?",
    "Give me a tip for better sleep.", "What does a CPU do?", "Explain photosynthesis briefly.",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water?", "Suggest a name for a cat.",
    "How many legs does a spider have?", "What is a prime number?", "Describe the moon in one sentence.",
    "What language is spoken in Brazil?", "How do airplanes fly?", "What is the largest ocean?",
    "Recommend a book for a long trip.", "What is machine learning?", "How far is the sun from earth?",
    "What is the tallest mountain?", "Translate 'good morning' to Spanish.", "What are clouds made of?",
    "Why do leaves change color?", "How do I make tea?", "What is gravity?", "List two uses of copper.",
    "What is the speed of light?", "How do bees make honey?", "What is an atom?", "Tell me a fun fact.",
]


def median_s(f, reps: int) -> float:
    """Median wall time of `reps` calls of f, after one warm-up call."""
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def gemm_gflops(n=2048, reps=5) -> dict:
    """fp32 GEMM rates at n^3 (median of `reps`): torch.mm and, where torch has it, oneDNN's
    linear; `gemm_gflops` is the faster, the machine's fp32 GEMM rate."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    ways = {"torch_mm": lambda: torch.mm(a, b)}
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        bt = b.t().contiguous()
        ways["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(a, bt, None, "none", [], "")
    res = {}
    for name, f in ways.items():
        res[f"gemm_gflops_{name}"] = 2 * n**3 / median_s(f, reps) / 1e9
    res["gemm_gflops"] = max(res.values())
    return res


def dense_shapes_gflops(cfg, m=32, reps=7) -> float:
    """fp32 rate of oneDNN's linear on this model's own layer shapes at m tokens, each weight
    hot in cache (one per shape, reused): FLOP of one step's linear layers (LM head included)
    over the sum of their median times. What the vendor GEMM reaches on these shapes: a
    ceiling for roofline_frac_b32 of any GEMM-based decode on this machine."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h): cfg.num_layers, (h, cfg.num_heads * d): cfg.num_layers,
              (2 * i, h): cfg.num_layers, (h, i): cfg.num_layers, (cfg.vocab_size, h): 1}
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return float("nan")
    flop = secs = 0.0
    for (n, k), count in shapes.items():
        x, w = torch.randn(m, k), torch.randn(n, k)
        flop += 2 * m * n * k * count
        secs += median_s(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), reps) * count
    return flop / secs / 1e9


def hf_generate(prompts_text, batches, new_tokens, reps=1) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    def timed(enc, n):
        with torch.inference_mode():
            t = time.perf_counter()
            out = model.generate(**enc, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                 pad_token_id=tok.pad_token_id)
            dt = time.perf_counter() - t
        assert out.shape[1] - enc["input_ids"].shape[1] == n
        return dt

    res = {}
    timed(tok(prompts_text[:2], return_tensors="pt", padding=True, add_special_tokens=False), 2)  # warm-up
    for b in batches:
        enc = tok(prompts_text[:b], return_tensors="pt", padding=True, add_special_tokens=False)
        runs = []
        for _ in range(reps):
            first = timed(enc, 1)
            total = timed(enc, new_tokens)
            runs.append((b * (new_tokens - 1) / (total - first), b * new_tokens / total))
        res[f"hf_tok_s_b{b}"] = max(r[0] for r in runs)
        res[f"hf_tok_s_e2e_b{b}"] = max(r[1] for r in runs)
        res[f"runs_hf_tok_s_b{b}"] = [round(r[0], 1) for r in runs]
    return res


def profile_decode(runner, alloc, prompts):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_batch(runner, alloc, prompts, 8, seq_base=10_000)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--hf-batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2, help="runs per batch on each side; the best counts")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--profile", action="store_true", help="print a torch profile of decode at the largest batch")
    ap.add_argument("--runtime", choices=["torch", "cpu"], default="cpu",
                    help="cpu: the torch-free CpuRunner (what serve runs on a CPU); torch: ModelRunner (the torch "
                         "reference on a CPU)")
    ap.add_argument("--quantized", choices=["auto", "on", "off"], default="auto",
                    help="weights kept quantized (Rust kernels) or fp32; auto = the runner's default")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    t = time.perf_counter()
    quantized = {"auto": None, "on": True, "off": False}[args.quantized]
    if args.runtime == "cpu":
        from edgepaged.model.cpu.runner import CpuRunner
        runner = CpuRunner(quantized=quantized)
    else:
        runner = ModelRunner(quantized=quantized)
    load_s = time.perf_counter() - t
    tk = runner.tokenizer
    texts = [tk.apply_chat_template([{"role": "user", "content": q}], tokenize=False) for q in QUESTIONS]
    prompts = [np.array(tk.encode(x, add_special_tokens=False), np.int64) for x in texts]
    alloc = make_allocator(runner)
    res = {"model": runner.model_path.name, "runtime": args.runtime, "quantized": getattr(runner, "quantized", False),
           "params": runner.config.num_params, "threads": torch.get_num_threads(),
           "products": getattr(runner, "products", None), "kv_dtype": getattr(runner, "kv_dtype_name", None),
           "new_tokens": args.new_tokens, "load_s": round(load_s, 2),
           "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    run_batch(runner, alloc, prompts[:2], 4, seq_base=90_000)  # warm-up
    gemm = [gemm_gflops()]
    for b in batches:
        reps = prompts[:b] if b <= len(prompts) else (prompts * (b // len(prompts) + 1))[:b]
        runs = []
        for r in range(max(1, args.reps)):
            out, tp, td = run_batch(runner, alloc, reps, args.new_tokens, seq_base=1000 * b + 100_000 * r)
            runs.append((b * (args.new_tokens - 1) / td, b * args.new_tokens / (tp + td), tp))
            gemm.append(gemm_gflops())
        res[f"tok_s_b{b}"] = max(r[0] for r in runs)
        res[f"tok_s_e2e_b{b}"] = max(r[1] for r in runs)
        res[f"prefill_s_b{b}"] = min(r[2] for r in runs)
        res[f"runs_tok_s_b{b}"] = [round(r[0], 1) for r in runs]
        if not args.json:
            print(f"B={b}: decode {res[f'tok_s_b{b}']:.1f} tok/s, end to end {res[f'tok_s_e2e_b{b}']:.1f} "
                  f"(prefill {tp * 1e3:.0f} ms); first answer: {tk.decode(out[0], skip_special_tokens=True)[:50]!r}",
                  file=sys.stderr)
    res.update({k: max(g[k] for g in gemm) for k in gemm[0]})
    if args.profile:
        profile_decode(runner, alloc, prompts[: max(batches)])
    if 32 in batches:
        res["roofline_frac_b32"] = 2 * runner.config.num_params * res["tok_s_b32"] / (res["gemm_gflops"] * 1e9)
        res["dense_m32_gflops"] = max(dense_shapes_gflops(runner.config) for _ in range(3))
        res["dense_m32_frac"] = res["dense_m32_gflops"] / res["gemm_gflops"]
    del runner
    if not args.no_hf:
        res.update(hf_generate(texts, [int(b) for b in args.hf_batches.split(",")], args.new_tokens, max(1, args.reps)))
        if "tok_s_b32" in res and "hf_tok_s_b8" in res:
            res["speedup_b32_vs_hf_b8"] = res["tok_s_b32"] / res["hf_tok_s_b8"]
            res["speedup_e2e_b32_vs_hf_b8"] = res["tok_s_e2e_b32"] / res["hf_tok_s_e2e_b8"]
    res = {k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}
    if not args.json:
        for k, v in res.items():
            print(f"{k:>26}: {v}", file=sys.stderr)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
