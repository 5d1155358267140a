#!/usr/bin/env python3
"""The whole GPU path on a CUDA GPU: the torch runner with the Triton kernels, driven by the Trio engine.

1. correctness: a tiny random llama (a transformers config, written as safetensors + tokenizer.json)
   served by the engine on the GPU in float32 gives the greedy tokens of the same engine on the
   CPU, alone and 12 requests together, also when a 24-block pool forces preemption; every block
   comes back. In bfloat16 on the GPU it reports how many answers equal the f32 CPU's and the
   tokens before each one's first difference (bf16 drifts on a random model).
2. speed (--speed): a random 1 B llama-shaped model (hidden 2048, 16 layers, 32/8 heads, vocab 300:
   the head is left out) in bf16: one stream's decode tok/s (from its first token) and 32
   streams' tok/s (all tokens over the whole run) through the engine, the runner alone, and
   transformers' own generate (eager, batch 1) on the same weights beside it.

    python bench/gpu_model_check.py [--json] [--speed [--profile]]

--json prints one JSON object as the last line. Exits 1 when a check fails, 0 with no GPU (says so).
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


import torch  # noqa: E402

GPU = torch.cuda.is_available()
PROFILE = False


def prompts(n, seed=0, vocab=300):
    import random
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    out = []
    for i in range(n):
        own = [rng.randrange(3, vocab) for _ in range(rng.randrange(5, 120))]
        out.append(shared + own if i % 3 == 0 else own)
    return out


async def generate(engine, ps, max_tokens, together=True):
    import trio

    from edgepaged.engine import Request, TokenEvent
    from edgepaged.model import SamplingParams
    results = [None] * len(ps)
    firsts = []

    async def one(i):
        req = Request(prompt_ids=list(ps[i]), params=SamplingParams(temperature=0, ignore_eos=True,
                                                                      max_tokens=max_tokens))
        ids = []
        async with engine.stream(req) as events:
            async for ev in events:
                if isinstance(ev, TokenEvent):
                    if not ids:
                        firsts.append(time.perf_counter())
                    ids += ev.token_ids
        results[i] = ids

    if together:
        async with trio.open_nursery() as n:
            for i in range(len(ps)):
                n.start_soon(one, i)
    else:
        for i in range(len(ps)):
            await one(i)
    return results, max(firsts)


def run_engine(model_dir, device, dtype, ps, max_tokens, together=True, num_blocks=256, **cfg):
    import trio

    from edgepaged.engine import Engine, EngineConfig
    from edgepaged.model import ModelRunner
    kv = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
    runner = ModelRunner(model_dir, device=device, dtype=dtype, kv_dtype=kv, num_blocks=num_blocks, block_size=16)
    out = {}

    async def main():
        async with Engine(runner, EngineConfig(**cfg)) as eng:
            t0 = time.perf_counter()
            out["ids"], first = await generate(eng, ps, max_tokens, together)
            end = time.perf_counter()
            out["s"] = end - t0
            out["decode_s"] = end - first     # from the last request's first token: decode steps only
            out["used_blocks"] = eng.allocator.num_used_blocks
            out["preemptions"] = eng.stats().get("num_preemptions", 0)
            out["steps_ahead"] = eng.stats()["steps_ahead"]
    trio.run(main)
    return out


def correctness(tmp):
    from edgepaged.testing.tiny_models import make_tiny_model
    model_dir = make_tiny_model(Path(tmp) / "tiny")
    ps = prompts(12)
    res = {}
    cpu_alone = run_engine(model_dir, "cpu", torch.float32, ps, 24, together=False)["ids"]
    checks = {}
    gpu_alone = run_engine(model_dir, "cuda", torch.float32, ps, 24, together=False)
    checks["f32_gpu_alone_equals_cpu"] = gpu_alone["ids"] == cpu_alone
    gpu_tog = run_engine(model_dir, "cuda", torch.float32, ps, 24)
    checks["f32_gpu_together_equals_alone"] = gpu_tog["ids"] == cpu_alone
    checks["blocks_returned"] = gpu_alone["used_blocks"] == 0 and gpu_tog["used_blocks"] == 0
    ahead = run_engine(model_dir, "cuda", torch.float32, ps, 24, speculation="off", async_decode=True)
    checks["f32_gpu_look_ahead_equals_alone"] = ahead["ids"] == cpu_alone and ahead["used_blocks"] == 0
    res["steps_ahead"] = ahead["steps_ahead"]
    checks["look_ahead_ran"] = ahead["steps_ahead"] > 0
    pre = run_engine(model_dir, "cuda", torch.float32, ps, 24, num_blocks=24)
    checks["f32_gpu_preempted_equals_alone"] = pre["ids"] == cpu_alone
    checks["preempted_blocks_returned"] = pre["used_blocks"] == 0
    res["preemptions"] = pre["preemptions"]
    bf = run_engine(model_dir, "cuda", torch.bfloat16, ps, 24)
    # bf16 against f32: how many answers are the same token for token, and the tokens before
    # each answer's first difference over all tokens (a random model's near ties drift)
    leading = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(bf["ids"], cpu_alone)]
    res["bf16_answers_equal"] = sum(n == len(a) for n, a in zip(leading, bf["ids"]))
    res["bf16_leading_tokens_frac"] = sum(leading) / sum(len(a) for a in bf["ids"])
    checks["bf16_blocks_returned"] = bf["used_blocks"] == 0
    for name, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    print(f"  preemptions in the 24-block pool: {res['preemptions']}; bf16 against the f32 CPU run: "
          f"{res['bf16_answers_equal']} of {len(ps)} answers equal, {res['bf16_leading_tokens_frac']:.1%} of tokens "
          f"before each answer's first difference")
    res["checks"] = checks
    return res


def make_1b(folder):
    import transformers

    from edgepaged.testing.tiny_models import tiny_tokenizer
    folder.mkdir(parents=True, exist_ok=True)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                                   tie_word_embeddings=True)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.02 * torch.randn(p.shape, generator=g, device="cuda"))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=g, device="cuda"))
    model.save_pretrained(folder)
    tiny_tokenizer(folder, 300)
    return folder, model


def runner_alone(folder, device, dtype, prompt_ids):
    """Where one stream's step goes: the runner alone (no engine), then under cProfile and torch's profiler."""
    from edgepaged.model import ModelRunner
    from edgepaged.testing.decode import make_allocator, run_batch
    import numpy as np
    kv = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
    runner = ModelRunner(folder, device=device, dtype=dtype, kv_dtype=kv, num_blocks=512, block_size=16)
    alloc = make_allocator(runner)
    prompt = [np.asarray(prompt_ids, np.int64)]
    run_batch(runner, alloc, prompt, 128, seq_base=1)         # every specialization compiled
    _, _, td = run_batch(runner, alloc, prompt, 128, seq_base=2)
    res = {"runner_b1_tok_s": 127 / td}
    if PROFILE:
        import cProfile
        import io
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        run_batch(runner, alloc, prompt, 64, seq_base=3)
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
        print("  cProfile of 64 tokens through the runner alone (tottime):")
        print("\n".join("    " + line for line in buf.getvalue().splitlines()[-34:]))
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
        with torch.profiler.profile(activities=acts) as prof:
            run_batch(runner, alloc, prompt, 16, seq_base=4)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return res


def speed(tmp):
    folder, hf = make_1b(Path(tmp) / "llama1b")
    res = {}
    ps1 = prompts(1, seed=1)
    # Triton compiles a kernel again for each new specialization of its integer arguments (a
    # table's stride divisible by 16 or not, ...): the same runs once untimed first
    ps32 = prompts(32, seed=2)
    run_engine(folder, "cuda", torch.bfloat16, ps1, 128, speculation="off")
    run_engine(folder, "cuda", torch.bfloat16, ps32, 128, speculation="off")
    r = run_engine(folder, "cuda", torch.bfloat16, ps1, 128, speculation="off")
    res["engine_b1_tok_s"] = 127 / r["decode_s"]
    r = run_engine(folder, "cuda", torch.bfloat16, ps32, 128, speculation="off")
    res["engine_b32_tok_s"] = 32 * 128 / r["s"]        # every token over the whole run, prompts included
    ids = torch.tensor([ps1[0]], device="cuda")
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=128, do_sample=False, min_new_tokens=128)
        torch.cuda.synchronize()
    res["hf_generate_b1_tok_s"] = 128 / (time.perf_counter() - t0)
    res.update(runner_alone(folder, "cuda", torch.bfloat16, ps1[0]))
    params = sum(p.numel() for p in hf.parameters())
    res["params"] = params
    print(f"  1 B llama-shaped bf16 ({params / 1e9:.2f} B params): engine 1 stream {res['engine_b1_tok_s']:.0f} tok/s, "
          f"32 streams {res['engine_b32_tok_s']:.0f} tok/s; transformers generate 1 stream "
          f"{res['hf_generate_b1_tok_s']:.0f} tok/s; the runner alone (no engine) 1 stream {res['runner_b1_tok_s']:.0f} tok/s")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--speed", action="store_true", help="also time a 1 B llama-shaped model")
    ap.add_argument("--profile", action="store_true", help="with --speed: profile one stream's steps (cProfile, torch)")
    ap.add_argument("--no-checks", action="store_true", help="skip the correctness checks")
    args = ap.parse_args()
    global PROFILE
    PROFILE = args.profile
    if not GPU:
        print("no CUDA GPU: nothing to check here (the CPU runs these paths in tests/test_model.py).")
        if args.json:
            print(json.dumps({"gpu": False}))
        return 0
    result = {"gpu": True, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        result["checks"] = {}
        if not args.no_checks:
            print("correctness (tiny llama, engine on the GPU against the engine on the CPU):")
            result.update(correctness(tmp))
        if args.speed:
            print("speed:")
            result["speed"] = speed(tmp)
    if args.json:
        print(json.dumps(result))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
