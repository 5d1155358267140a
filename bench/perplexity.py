"""Perplexity under the context policies (issue 25): the embedded model on a public-domain text
the repository ships (bench/data/coriolanus.txt, about 4,000 tokens), teacher-forced, with full
attention, with the window policy (the first `--sink` tokens and the last `--window`), and with
the window and no sinks.

    python bench/perplexity.py [--json] [--window 1024,256] [--sink 4] [--tokens N]

The real parts do the work: the Rust allocator gives the window's blocks back after each token
exactly as the engine does (`release_outside`), the step's block tables leave them out, and the
runner (the torch-free CPU runtime, the server's default) computes the logits. Full attention
reads the text in chunks of 256 tokens; the window policies one token a step, as a sequence
that generates meets it (a query then attends its sink blocks and between W and W + 15 of the
tokens before it: whole blocks of 16). The last line with --json is one object:

    {"tokens", "full": {"ppl", "nll"}, "window_W": {...}, "window_W_no_sink": {...}, "seconds", ...}

With --kv-dtype (issue 38: the q8_0 KV cache's error) it measures instead the KV cache's
element types in turn on one model, the way llama.cpp's `llama-perplexity` measures (chunks of
--ctx tokens, each chunk's second half scored), read as a server reads: each chunk's first
half one prefill, its second half one token a step. The same text through `llama-perplexity`
with `-ctk/-ctv` of each type beside it when it is installed (--llama-perplexity PATH, or on
PATH; null with the reason when absent). `TYPE@bf16` is that cache with prefill attention's
tiles multiplying in bf16 (on a CPU with AVX-512 BF16: the default unless
EDGEPAGED_ATTENTION_BF16=0); `TYPE@f32` in f32: `--kv-dtype f16@f32,f16@bf16` measures what bf16
products cost:

    python bench/perplexity.py --kv-dtype f16,q8_0 [--model FILE.gguf | --model 1b] [--json]

    {"model", "ctx", "chunks", "ours": {"f16": {"ppl", "kld_mean", "same_top_pct", ...}, "q8_0": {...}},
     "ours_delta_pct": {"q8_0": ...}, "llama_cpp": {"f16": {"ppl", ...}, "q8_0": {...}} | null,
     "llama_cpp_delta_pct": {...}, "cpu", ...}

(`*_delta_pct`: 100 * (ppl / ppl of the first type - 1), each tool against its own first type;
`kld_mean`: the mean KL divergence of the next-token distributions from the first type's, the
finer measure of the error, as llama.cpp's --kl-divergence gives it.)
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from edgepaged.testing.perplexity import chunked_perplexity, perplexity

TEXT = Path(__file__).resolve().parent / "data" / "coriolanus.txt"


def text_ids(tokenizer, limit: int | None = None) -> list[int]:
    ids = tokenizer.encode(TEXT.read_text())
    return ids[:limit] if limit else ids



def policies(windows: list[int], sink: int) -> list[tuple[str, int | None, int]]:
    out = [("full", None, 0)]
    for w in windows:
        out += [(f"window_{w}", w, sink), (f"window_{w}_no_sink", w, 0)]
    return out


LLAMA_TYPES = {"f16": "f16", "q8_0": "q8_0", "f32": "f32"}


class Products:
    """A runner whose prefill attention multiplies in bf16 or f32 (`TYPE@bf16`, `TYPE@f32` in
    --kv-dtype) for its own steps only, so both run in one process, chunk by chunk."""

    def __init__(self, runner, bf16: bool):
        self.runner, self.bf16 = runner, bf16

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, *args, **kw):
        from edgepaged._native import ops
        was = ops.bf16_attention()
        ops.bf16_attention(self.bf16)
        try:
            return self.runner.execute(*args, **kw)
        finally:
            ops.bf16_attention(was)


def llama_perplexity(exe: str, model: Path, ctx: int, chunks: int, kv: str, base: Path, first: bool) -> dict:
    """llama.cpp's perplexity of the text with a `kv` cache (its K and V types) and, after the
    first type (which saves its logits to `base`), its KL divergence from the first."""
    import re
    import subprocess
    cmd = [exe, "-m", str(model), "-f", str(TEXT), "-c", str(ctx), "-b", str(ctx), "--chunks", str(chunks),
           "-t", "2", "-ctk", LLAMA_TYPES[kv.split("@")[0]], "-ctv", LLAMA_TYPES[kv.split("@")[0]], "-fa", "on",   # (a quantized V needs it)
           "--kl-divergence-base", str(base)] + ([] if first else ["--kl-divergence"])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    text = p.stdout + p.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", text) or re.search(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", text)
    if not m:
        raise RuntimeError(f"llama-perplexity failed ({p.returncode}): {text[-800:]}")
    out = {"ppl": float(m.group(1))}
    k = re.search(r"Mean\s+KLD:\s+([-0-9.e]+)", text)
    t = re.search(r"Same top p:\s+([0-9.]+)", text)
    if k:
        out["kld_mean"] = float(k.group(1))
    if t:
        out["same_top_pct"] = float(t.group(1))
    return out


def kv_dtypes(args) -> dict:
    import shutil
    import tempfile

    from bench.family_bench import cpu_flags, synthetic

    from edgepaged._native import ops
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.model.loader import default_model_path
    model = (synthetic("q4_k_m", args.cache_dir) if args.model == "1b"
             else Path(args.model) if args.model not in (None, "embedded") else default_model_path())
    kinds = [k for k in args.kv_dtype.split(",") if k]
    exe = args.llama_perplexity or shutil.which("llama-perplexity")
    out = {"text": TEXT.name, "model": model.name, "ctx": args.ctx, "cpu": cpu_flags(),
           "method": "llama-perplexity's: chunks of ctx tokens, the second half of each scored; KL divergence "
                     f"of each type's next-token distributions from {kinds[0]}'s"}
    t0 = time.monotonic()
    runners = {kv: CpuRunner(model, num_blocks=(args.chunks or 64) * (args.ctx // 16 + 1) + 8,
                             kv_dtype=kv.split("@")[0], progress=lambda *a, **k: None) for kv in kinds}
    runners = {kv: Products(r, kv.endswith("@bf16")) if "@" in kv else r for kv, r in runners.items()}
    out["bf16_attention_default"] = ops.bf16_attention()
    tok = runners[kinds[0]].tokenizer
    ids = tok.encode(TEXT.read_text())
    out["ours"] = chunked_perplexity(runners, ids, args.ctx, args.chunks, tok.bos_token_id if tok.add_bos else None)
    out["tokens"], out["chunks"] = len(ids), out["ours"][kinds[0]]["chunks"]
    del runners
    for kv, r in out["ours"].items():
        print(f"  ours      {kv:5} perplexity {r['ppl']:10.4f}  KLD {r['kld_mean']:.3g}  same top "
              f"{r['same_top_pct']:.2f} %", flush=True)
    print(f"  ({out['chunks']} chunks of {args.ctx}, {time.monotonic() - t0:.0f} s)", flush=True)
    base = out["ours"][kinds[0]]["ppl"]
    out["ours_delta_pct"] = {k: round(100 * (v["ppl"] / base - 1), 4) for k, v in out["ours"].items() if k != kinds[0]}
    if exe:
        out["llama_cpp_tool"] = Path(exe).name
        out["llama_cpp"] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for i, kv in enumerate(kinds):
                t = time.monotonic()
                out["llama_cpp"][kv] = r = llama_perplexity(exe, model, args.ctx, out["chunks"], kv,
                                                            Path(tmp) / "base.kld", i == 0)
                print(f"  llama.cpp {kv:5} perplexity {r['ppl']:10.4f}  KLD {r.get('kld_mean', 0):.3g}  same top "
                      f"{r.get('same_top_pct', 100):.2f} %  ({time.monotonic() - t:.0f} s)", flush=True)
        lb = out["llama_cpp"][kinds[0]]["ppl"]
        out["llama_cpp_delta_pct"] = {k: round(100 * (v["ppl"] / lb - 1), 4) for k, v in out["llama_cpp"].items()
                                      if k != kinds[0]}
    else:
        out["llama_cpp"] = out["llama_cpp_delta_pct"] = None
        out["llama_cpp_note"] = "llama-perplexity not found (--llama-perplexity PATH, or on PATH)"
    out["seconds"] = round(time.monotonic() - t0, 1)
    for k, v in out["ours_delta_pct"].items():
        theirs = (out["llama_cpp_delta_pct"] or {}).get(k)
        print(f"  {k}: perplexity {v:+.3f} % against {kinds[0]}, KLD {out['ours'][k]['kld_mean']:.3g} (llama.cpp: "
              f"{'n/a' if theirs is None else f'{theirs:+.3f} %, KLD ' + str(out['llama_cpp'][k].get('kld_mean'))})",
              flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--window", default="1024,256", help="windows to measure (tokens), comma-separated")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=None, help="only the text's first N tokens")
    ap.add_argument("--kv-dtype", default=None, metavar="LIST",
                    help="measure these KV cache types instead (e.g. f16,q8_0), llama.cpp's way")
    ap.add_argument("--model", default=None, help="with --kv-dtype: a GGUF file, 1b (family_bench's Q4_K_M "
                                                  "Llama-3.2-1B shape) or embedded (the default)")
    ap.add_argument("--ctx", type=int, default=512, help="with --kv-dtype: tokens per chunk")
    ap.add_argument("--chunks", type=int, default=None, help="with --kv-dtype: at most this many chunks")
    ap.add_argument("--llama-perplexity", default=None, metavar="PATH", help="llama.cpp's llama-perplexity")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "edgepaged" / "bench")
    args = ap.parse_args()
    if args.kv_dtype:
        if args.ctx < 8 or (args.chunks is not None and args.chunks < 1):
            ap.error("--ctx takes at least 8 tokens and --chunks at least 1")
        out = kv_dtypes(args)
        if args.json:
            print(json.dumps(out))
        return
    from edgepaged.model.open import open_runner
    runner = open_runner(None, num_blocks=512, block_size=16)
    ids = text_ids(runner.tokenizer, args.tokens)
    out = {"text": TEXT.name, "tokens": len(ids), "model": runner.model_path.name,
           "runtime": type(runner).__name__, "sink": args.sink}
    print(f"{TEXT.name}: {len(ids)} tokens, {runner.model_path.name}", flush=True)
    t0 = time.monotonic()
    for name, w, s in policies([int(x) for x in args.window.split(",") if x], args.sink):
        t = time.monotonic()
        out[name] = perplexity(runner, ids, w, s)
        print(f"  {name:22} perplexity {out[name]['ppl']:8.3f}  (KV blocks at most {out[name]['kv_blocks_max']}, "
              f"{time.monotonic() - t:.0f} s)", flush=True)
    out["seconds"] = round(time.monotonic() - t0, 1)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
