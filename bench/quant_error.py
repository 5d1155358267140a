"""The integer kernels' error: logits of the int8 path (activations quantized per block of
32, 256 for K-quants, 8-bit dot products) against the exact path (fp32 activations, the weights decoded
exactly) on the same weights, on the embedded model and on the synthetic 1 B files of
`family_bench.py`.

    python bench/quant_error.py [--json] [--models embedded,q4_k_m,q8_0] [--prompts 4] [--tokens 64]

Per model, over every position of `--prompts` random prompts of `--tokens` tokens (an f32
KV cache on both sides, so only the weights' math differs):

    max_abs, mean_abs     |int8 - exact| over every logit
    rel_max               max_abs / max |exact logit|
    top1_agree            share of positions whose argmax is the same
    exact_top1_margin_p10 the 10th percentile of the exact path's top-1 minus top-2 logit
                          (how close the races are that a small error can flip)
    llama_cpp_max_abs, llama_cpp_mean_abs, llama_cpp_top1_agree
                          llama.cpp's logits (llama-cpp-python, same file, same prompts)
                          against the same exact path: the error its own int8 math (and its
                          f16 KV cache) makes; null when it is not installed
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from bench.family_bench import synthetic  # noqa: E402

from edgepaged._native import quant  # noqa: E402
from edgepaged.model import ModelRunner  # noqa: E402
from edgepaged.model.settings import CpuConfig  # noqa: E402
from edgepaged.testing.decode import make_allocator, prompt_logits  # noqa: E402


def logits(path, math: str, prompts) -> torch.Tensor:
    runner = ModelRunner(path, num_blocks=max(len(p) for p in prompts) // 16 + 8, kv_dtype="f32",
                         settings=CpuConfig(quant_math=math))
    alloc = make_allocator(runner)
    out = torch.cat([prompt_logits(runner, alloc, p, every=True) for p in prompts])
    return out, runner


def llama_cpp_logits(path, prompts) -> torch.Tensor | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    from edgepaged.model import default_model_path
    llm = llama_cpp.Llama(str(path or default_model_path()), n_ctx=max(len(p) for p in prompts) + 16,
                          logits_all=True, verbose=False)
    rows = []
    for p in prompts:
        llm.reset()
        llm.eval(p)
        rows.append(torch.from_numpy(np.array(llm.scores[:len(p)], np.float32)))
    return torch.cat(rows)


def compare(path, prompts_n: int, tokens: int, with_llama_cpp: bool) -> dict:
    probe = ModelRunner(path, num_blocks=4)
    vocab = probe.config.vocab_size
    del probe
    rng = np.random.default_rng(7)
    prompts = [rng.integers(300, vocab - 300, tokens).tolist() for _ in range(prompts_n)]
    exact, _ = logits(path, "exact", prompts)
    int8, runner = logits(path, "int8", prompts)
    d = (int8 - exact).abs()
    top2 = exact.topk(2, dim=1).values
    theirs = llama_cpp_logits(path, prompts) if with_llama_cpp else None
    them = {"llama_cpp_max_abs": None, "llama_cpp_mean_abs": None, "llama_cpp_top1_agree": None}
    if theirs is not None:
        e = (theirs - exact).abs()
        them = {"llama_cpp_max_abs": round(e.max().item(), 4), "llama_cpp_mean_abs": round(e.mean().item(), 5),
                "llama_cpp_top1_agree": round((theirs.argmax(1) == exact.argmax(1)).float().mean().item(), 4)}
    return {**them, "max_abs": round(d.max().item(), 4), "mean_abs": round(d.mean().item(), 5),
            "rel_max": round(d.max().item() / exact.abs().max().item(), 5),
            "top1_agree": round((int8.argmax(1) == exact.argmax(1)).float().mean().item(), 4),
            "exact_top1_margin_p10": round(torch.quantile(top2[:, 0] - top2[:, 1], 0.1).item(), 4),
            "max_abs_logit": round(exact.abs().max().item(), 3), "positions": int(exact.shape[0]),
            "int8_isa": quant.info()["int8_isa"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="last line: one JSON object")
    ap.add_argument("--models", default="embedded,q4_k_m,q8_0")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "edgepaged" / "bench")
    args = ap.parse_args()
    out = {}
    for name in args.models.split(","):
        path = None if name == "embedded" else synthetic(name, args.cache_dir)
        res = compare(path, args.prompts, args.tokens, not args.no_llama_cpp)
        out[name] = res
        print(f"{name}: int8 vs exact logits: max |diff| {res['max_abs']} (of max |logit| {res['max_abs_logit']}), "
              f"mean {res['mean_abs']}, same top-1 at {100 * res['top1_agree']:.1f}% of {res['positions']} positions "
              f"(exact top-1 margin, 10th percentile: {res['exact_top1_margin_p10']}); llama.cpp vs exact: max "
              f"{res['llama_cpp_max_abs']}, mean {res['llama_cpp_mean_abs']}, same top-1 {res['llama_cpp_top1_agree']}",
              flush=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
