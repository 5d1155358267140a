"""The GPU path at its limit (issue 67): synthetic Llama-3.2-1B- and Llama-3.1-8B-shaped
Q4_K_M files (written here, as llama.cpp's converter lays them out: Q4_K, Q6_K for attn_v,
ffn_down and the embeddings), served by the torch runner on a CUDA GPU with the weights kept
as GGUF blocks (`kernels/quant.py`), and the machine's limits measured in the same run.

    python -m bench.gpu_bench [--json] [--shapes 1b,8b] [--new-tokens 64] [--prefill 2048] [--sweep]
    python -m bench.gpu_bench --tiny          # CPU: the plumbing, Triton interpreted, a tiny file

Per file (the last line's `files.<shape>`):

    tok_s_b1            one stream's decode tokens per second (first token excluded)
    tok_s_b32           32 streams at once, all their decode tokens per second
    prefill_tok_s       one prompt of --prefill tokens, computed in one forward
    vram_weights_mb     the weights' bytes on the device (blocks kept, the dense norms)
    file_mb             the GGUF file
    b1_hbm_frac         tok_s_b1 x the weights' bytes (each read once a token) / read_gbs
    prefill_tflops_frac prefill_tok_s x 2 x params / bf16_tflops
    step_gpu_busy_frac  the GPU's busy time over a b1 decode step's wall time (torch profiler:
                        the kernels' summed durations over 16 steps / their wall time)
    engine_tok_s_b1     one stream through the Engine (serve's loop; speculation off) with look-ahead
                        decode (the next step launched before the last one's ids reach the host);
                        engine_tok_s_b1_step_by_step without it (alternated in one process);
                        engine_b1_gpu_busy_frac the GPU's kernel time over that request's wall time
    llama_cpp_tok_s_b1, llama_cpp_prefill_tok_s   llama.cpp's CUDA build on the same file (its
                        llama-bench, its defaults: tg --new-tokens, pp --prefill): null, with
                        llama_cpp_note saying why, when it was not carried to this machine or failed
    b1_over_llama_cpp, prefill_over_llama_cpp     the two ratios (targets: >= 1.5, >= 1.0)

Top level: `read_gbs` (a device reduction over 2 GiB, best of 5), `bf16_tflops` (torch.mm
8192^3 in bf16, best of 5), `gpu`, `driver`, `torch`, `triton`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = {"1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, inter=8192, context=4096, vocab=128256),
          "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, inter=14336, context=4096, vocab=128256),
          "tiny": dict(hidden=256, layers=2, heads=4, kv_heads=2, inter=512, context=512, vocab=512)}
TIED = {"1b": True, "8b": False, "tiny": True}


def write_file(shape: str, folder: Path) -> Path:
    from edgepaged.testing.gguf_models import Q4_K_M, write_random_gguf
    path = folder / f"llama{shape}-q4_k_m.gguf"
    if not path.exists():
        print(f"writing {path.name}", file=sys.stderr, flush=True)
        write_random_gguf(path, **SHAPES[shape], qtypes=Q4_K_M, seed=1, tied=TIED[shape])
    return path


def read_gbs(device) -> float:
    import torch
    if device.type != "cuda":
        return float("nan")
    x = torch.ones(1 << 29, dtype=torch.float32, device=device)     # 2 GiB
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        x.sum()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def bf16_tflops(device) -> float:
    import torch
    if device.type != "cuda":
        return float("nan")
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e12


def sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize()


def decode_rate(runner, prompts, new_tokens: int) -> float:
    from edgepaged.testing.decode import make_allocator, run_batch
    alloc = make_allocator(runner)
    run_batch(runner, alloc, prompts[:1], 2)                        # warm-up: compiles the kernels
    _, _, t_decode = run_batch(runner, alloc, prompts, new_tokens)
    return len(prompts) * (new_tokens - 1) / t_decode


def prefill_rate(runner, n: int, reps: int = 3) -> float:
    from edgepaged.testing.decode import make_allocator, prompt_logits
    alloc = make_allocator(runner)
    prompt = (np.arange(n) * 7919 % (runner.config.vocab_size - 10) + 5).tolist()
    best = float("inf")
    for _ in range(reps):
        sync(runner.device)
        t = time.perf_counter()
        prompt_logits(runner, alloc, prompt)
        sync(runner.device)
        best = min(best, time.perf_counter() - t)
    return n / best


def busy_frac(runner, steps: int = 16) -> float | None:
    """GPU kernel time over wall time across `steps` one-stream decode steps (torch profiler)."""
    import torch
    if runner.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    from edgepaged.testing.decode import make_allocator, run_batch
    alloc = make_allocator(runner)
    prompt = [np.arange(5, 37)]
    run_batch(runner, alloc, prompt, 4)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, _, t_decode = run_batch(runner, alloc, prompt, steps + 1)
    kernels_us = sum(e.time_range.elapsed_us() for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    return min(1.0, kernels_us / 1e6 / t_decode)


def engine_rates(runner, new_tokens: int = 64) -> dict:
    """One stream through the Engine itself (what `serve` runs; speculation off): decode tokens
    per second with look-ahead decode on and off, alternated twice in one process, and the GPU's
    busy fraction of a request's wall time with it on (torch profiler: kernel time over the
    wall time of a 32-token prompt and its answer)."""
    import torch
    import trio
    from torch.profiler import ProfilerActivity, profile

    from edgepaged.engine import Engine, EngineConfig, Request, TokenEvent
    from edgepaged.model import SamplingParams
    if runner.device.type != "cuda":
        return {}

    async def once(eng, n):
        r = Request(prompt_ids=list(range(5, 37)), params=SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        times = []
        t0 = time.perf_counter()
        async with eng.stream(r) as chan:
            async for ev in chan:
                if isinstance(ev, TokenEvent):
                    times.extend([time.perf_counter()] * len(ev.token_ids))
        return t0, times

    async def run(ahead: bool, profiled: bool):
        async with Engine(runner, EngineConfig(speculation="off", async_decode=ahead)) as eng:
            await once(eng, 8)                               # warm-up: the graphs captured
            if not profiled:
                _, times = await once(eng, new_tokens)
                return (len(times) - 1) / (times[-1] - times[0]), eng.stats()["steps_ahead"]
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t0, times = await once(eng, new_tokens)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            busy = sum(e.time_range.elapsed_us() for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6
            return min(1.0, busy / wall), eng.stats()["steps_ahead"]

    on, off, ahead = [], [], 0
    for _ in range(2):
        rate, n = trio.run(run, True, False)
        on.append(rate)
        ahead += n
        off.append(trio.run(run, False, False)[0])
    busy, _ = trio.run(run, True, True)
    return {"engine_tok_s_b1": max(on), "engine_tok_s_b1_step_by_step": max(off),
            "engine_b1_gpu_busy_frac": busy, "engine_steps_ahead": ahead}


def sweep(device, limits: dict) -> dict:
    """The kernel's launch configs on the 8 B shape's largest products (ffn_down Q6_K
    [4096, 14336], ffn_up Q4_K [14336, 4096]): one row's GB/s per BLOCK_N (decode), 2,048
    rows' TFLOP/s per (BLOCK_M, BLOCK_N) (prefill), to pick the defaults from on a device."""
    import torch

    from edgepaged.kernels import quant as kq
    from edgepaged.testing.gguf_models import random_blocks
    rng = np.random.default_rng(0)
    out = {}
    for name, qtype, rows, cols in (("q6_k_down", 14, 4096, 14336), ("q4_k_up", 12, 14336, 4096)):
        w = kq.pack(qtype, random_blocks(qtype, rows, cols, rng), rows, cols, device=device)
        res = {}
        for m, configs in ((1, [(1, n) for n in (16, 32, 64, 128)]),
                           (2048, [(bm, bn) for bm in (32, 64, 128) for bn in (32, 64, 128)])):
            x = torch.randn(m, cols, dtype=torch.bfloat16, device=device)
            for bm, bn in configs:
                try:
                    kq.qmatmul(x, w, block_m=bm, block_n=bn)
                    best = float("inf")
                    for _ in range(5):
                        sync(device)
                        t = time.perf_counter()
                        kq.qmatmul(x, w, block_m=bm, block_n=bn)
                        sync(device)
                        best = min(best, time.perf_counter() - t)
                except Exception as e:  # noqa: BLE001 - a config the compiler refuses: say so
                    res[f"m{m}_bm{bm}_bn{bn}"] = f"failed: {type(e).__name__}"
                    continue
                res[f"m{m}_bm{bm}_bn{bn}"] = (round(w.nbytes / best / 1e9 / limits["read_gbs"], 3) if m == 1
                                              else round(2 * m * rows * cols / best / 1e12 / limits["bf16_tflops"], 3))
        out[name] = res
    return out


def llama_cpp(path: Path, new_tokens: int, prefill: int, reps: int = 3, want_gpu: bool = False) -> dict:
    """llama.cpp's `llama-bench` on the same file with its own defaults (every layer on the GPU,
    flash attention where it decides): one stream's tg{new_tokens} and a pp{prefill} prompt,
    `reps` repetitions each (its mean). The executable: $LLAMA_BENCH, else llama-bench on PATH
    (gpu_check.sh points $LLAMA_BENCH at the CUDA build `bench/llama_cuda.sh` made and carried)."""
    exe = os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")
    res: dict = {"llama_cpp_tok_s_b1": None, "llama_cpp_prefill_tok_s": None}
    if not exe:
        res["llama_cpp_note"] = ("llama.cpp's CUDA build was not carried to this machine (no llama-bench on PATH "
                                 "or $LLAMA_BENCH; bench/llama_cuda.sh builds one)")
        return res
    import subprocess
    cmd = [exe, "-m", str(path), "-p", str(prefill), "-n", str(new_tokens), "-r", str(reps), "-o", "json"]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        rows = json.loads(run.stdout) if run.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        run, rows = None, None
        res["llama_cpp_note"] = f"llama-bench did not run: {type(e).__name__}: {e}"
    if run is not None and rows is None:
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        res["llama_cpp_note"] = f"llama-bench failed (rc {run.returncode}): {' | '.join(tail)}"
    for row in rows or []:
        if row.get("n_prompt") and not row.get("n_gen"):
            res["llama_cpp_prefill_tok_s"] = round(row["avg_ts"], 2)
        elif row.get("n_gen") and not row.get("n_prompt"):
            res["llama_cpp_tok_s_b1"] = round(row["avg_ts"], 2)
        res["llama_cpp_note"] = (f"llama-bench {row.get('build_commit', '?')} ({row.get('backends', '?')}, "
                                 f"{row.get('gpu_info') or 'no GPU'}), flash_attn {row.get('flash_attn')}, "
                                 f"n_gpu_layers {row.get('n_gpu_layers')}, mean of {reps}")
    if rows and want_gpu and not any(row.get("gpu_info") for row in rows):
        # its CUDA runtime did not start (it then runs on the CPU): no GPU baseline
        why = [ln for ln in (run.stderr or "").splitlines() if "CUDA" in ln][-1:]
        res.update(llama_cpp_tok_s_b1=None, llama_cpp_prefill_tok_s=None,
                   llama_cpp_note=f"llama-bench found no GPU ({' '.join(why) or 'its gpu_info is empty'}): "
                                  "not a GPU baseline")
    return res


def measure(shape: str, folder: Path, device, args, limits: dict) -> dict:
    import torch

    from edgepaged.model.torch.quant_modules import weight_bytes
    from edgepaged.model.torch.runner import ModelRunner
    path = write_file(shape, folder)
    file_mb = path.stat().st_size / 2 ** 20
    if device.type == "cuda":
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
    tiny = shape == "tiny"
    runner = ModelRunner(path, device=str(device), dtype=torch.float32 if tiny else None, num_blocks=None if not tiny
                         else 256, kv_memory_bytes=None, max_num_batched_tokens=args.prefill,
                         quant_kernels="triton", kv_dtype="f32" if tiny else None)
    wb = weight_bytes(runner.model)
    out = {"file_mb": round(file_mb, 1), "vram_weights_mb": round((wb["quantized"] + wb["dense"]) / 2 ** 20, 1),
           "products": runner.products}
    if device.type == "cuda":
        out["vram_allocated_mb"] = round((torch.cuda.memory_allocated() - before) / 2 ** 20, 1)
    vocab = runner.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(5, vocab - 5, 32) for _ in range(32)]
    out["tok_s_b1"] = decode_rate(runner, prompts[:1], args.new_tokens)
    out["tok_s_b32"] = decode_rate(runner, prompts, args.new_tokens)
    out["prefill_tok_s"] = prefill_rate(runner, args.prefill)
    out["step_gpu_busy_frac"] = busy_frac(runner)
    try:
        out.update(engine_rates(runner, args.new_tokens))
    except Exception as e:  # noqa: BLE001 - reported, the rest of the figures stand
        out["engine_error"] = f"{type(e).__name__}: {e}"
    params = runner.config.num_params
    out["b1_hbm_frac"] = out["tok_s_b1"] * (wb["quantized"] + wb["dense"]) / (limits["read_gbs"] * 1e9)
    out["prefill_tflops_frac"] = out["prefill_tok_s"] * 2 * params / (limits["bf16_tflops"] * 1e12)
    out["b32_over_b1"] = out["tok_s_b32"] / out["tok_s_b1"]
    out["weights_over_file"] = out["vram_weights_mb"] / file_mb
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()                  # (llama.cpp runs on the same GPU next)
    out.update(llama_cpp(path, args.new_tokens, args.prefill, want_gpu=device.type == "cuda"))
    for mine, theirs, key in (("tok_s_b1", "llama_cpp_tok_s_b1", "b1_over_llama_cpp"),
                              ("prefill_tok_s", "llama_cpp_prefill_tok_s", "prefill_over_llama_cpp")):
        out[key] = out[mine] / out[theirs] if out.get(theirs) else None
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--tiny", action="store_true", help="the CPU smoke run: a tiny file, Triton interpreted")
    ap.add_argument("--dir", default=None, help="where the synthetic files are written (default: a temporary folder)")
    ap.add_argument("--sweep", action="store_true", help="also the kernel's launch configs on the 8 B shape's "
                    "largest products: `sweep`, one row's fraction of read_gbs per BLOCK_N and 2,048 rows' "
                    "fraction of bf16_tflops per (BLOCK_M, BLOCK_N)")
    args = ap.parse_args()
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.shapes, args.new_tokens, args.prefill = "tiny", 4, 64
    import torch
    import triton
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    res = {"torch": torch.__version__, "triton": triton.__version__, "device": device.type}
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
        try:
            import subprocess
            res["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            res["driver"] = None
    elif not args.tiny:
        res["note"] = "no CUDA GPU here: run it on one (bench/gpu_check.sh), or --tiny for the plumbing"
        print(json.dumps(res))
        return
    limits = {"read_gbs": read_gbs(device), "bf16_tflops": bf16_tflops(device)}
    if args.tiny:
        limits = {"read_gbs": 1.0, "bf16_tflops": 1.0}     # (fractions meaningless on the interpreter)
    res.update({k: round(v, 2) for k, v in limits.items()})
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    res["files"] = {}
    if args.sweep and device.type == "cuda":
        res["sweep"] = sweep(device, limits)
        print(f"sweep: {res['sweep']}", file=sys.stderr, flush=True)
    try:
        for shape in args.shapes.split(","):
            t = time.perf_counter()
            res["files"][shape] = measure(shape, folder, device, args, limits)
            res["files"][shape]["seconds"] = round(time.perf_counter() - t, 1)
            print(f"{shape}: {res['files'][shape]}", file=sys.stderr, flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
