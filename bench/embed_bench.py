"""Embeddings: texts per second, and a chat's time to first token beside an embedding flood,
against `edgepaged serve` (a subprocess, loopback only).

1. `texts_s`: 256 texts of ~100 tokens embedded through `/v1/embeddings` in batches of 32
   (four batches in flight) by a synthetic nomic-embed-text-shaped GGUF (F16, as Ollama ships
   it: 12 layers, hidden 768, rotary, SwiGLU), served beside the embedded chat model on one
   box; `shapes` has the same for every `--shape` (mxbai-embed-large, the largest BERT shape,
   by default too) and for the chat model itself (`decoder`: last-token pooling). The
   encoders multiply with the integer kernels (`--quant-math auto`: weights requantized to
   Q8_0); `int8_cos_min_vs_exact` per shape: the smallest cosine between those vectors and
   the exact f32 ones over 32 of the texts.
2. `chat_ttft_alone_s` and `chat_ttft_beside_flood_s`: a short chat's first token (streamed,
   median of 5) on the chat model, alone and while the nomic-shaped model embeds the 256
   texts; `chat_ttft_ratio` their ratio.
3. `llama_cpp_texts_s`: llama.cpp's server (`--embeddings`, the file's own pooling) on the
   same nomic-shaped file when `--llama-server PATH` is given or `llama-server` is on the
   PATH, else null with the reason; per shape in `shapes` too.

    python bench/embed_bench.py [--json] [--shape NAME ...] [--model FILE.gguf] [--llama-server PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request
from pathlib import Path

from bench.family_bench import cpu_flags
from bench.soak import start_llama_server, start_server

WORDS = ("the house keeps its lights low at night while the kitchen timer counts the minutes until the bread "
         "is done and the garden sprinklers wake at dawn").split()


def texts(n: int = 256, words: int = 80, vocabulary=WORDS) -> list[str]:
    return [" ".join(vocabulary[(i * 7 + j) % len(vocabulary)] for j in range(words)) + f" (note {i})"
            for i in range(n)]


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def embed_all(base: str, items: list[str], batch: int = 32, parallel: int = 4, model: str | None = None) -> float:
    """Seconds to embed `items` in batches, `parallel` in flight."""
    chunks = [items[i:i + batch] for i in range(0, len(items), batch)]
    t0 = time.perf_counter()
    threads = []
    for k in range(parallel):
        def run(k=k):
            for c in chunks[k::parallel]:
                out = post(base + "/v1/embeddings", {"input": c, **({"model": model} if model else {})})
                assert len(out["data"]) == len(c)
        threads.append(threading.Thread(target=run))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


_asked = [0]


def ttft(base: str) -> float:
    _asked[0] += 1          # a new question each time: its prompt is prefilled, not found in the cache
    body = json.dumps({"messages": [{"role": "user", "content": f"Question {_asked[0]}: turn on the kitchen light."}],
                       "max_tokens": 8,
                       "stream": True, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                return time.perf_counter() - t0
    return time.perf_counter() - t0


def llama_cpp(server: str | None, model: str, items: list[str], pooling: str = "last") -> tuple[float | None, str | None]:
    """llama.cpp's server on the same file, the same pooling, the same batches."""
    import shutil
    exe = server or shutil.which("llama-server")
    if exe is None:
        return None, "llama.cpp's llama-server is not installed here (give --llama-server PATH)"
    proc, base = start_llama_server(exe, model, "--embeddings", "--pooling", pooling, "-t", "2", "-c", "8192",
                                    "-ub", "2048", "-b", "2048")
    if proc is None:
        return None, "llama-server did not start"
    try:
        post(base + "/v1/embeddings", {"input": items[:4]})
        return round(len(items) / embed_all(base, items), 2), None
    finally:
        proc.terminate()
        proc.wait(30)


def measure(base: str, items: list[str], model: str | None) -> dict:
    body = {"input": items[:32], **({"model": model} if model else {})}
    post(base + "/v1/embeddings", {**body, "input": items[:4]})                   # warm (and load)
    tokens = post(base + "/v1/embeddings", body)["usage"]["prompt_tokens"] / 32
    took = embed_all(base, items, model=model)
    return {"tokens_per_text": round(tokens, 1), "texts_s": round(len(items) / took, 2)}


def int8_error(path: Path, items: list[str]) -> float:
    """The smallest cosine between the served vectors (int8 math: weights requantized to
    Q8_0, activations per block of 32) and the exact f32 ones, over 32 of the texts."""
    import numpy as np

    from edgepaged.model.cpu.encoder import load_encoder
    exact, tok = load_encoder(path, "exact")
    int8, _ = load_encoder(path, "int8")
    seqs = [np.array(tok.encode(t)) for t in items[:32]]
    return round(min(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
                     for a, b in zip(exact.embed(seqs), int8.embed(seqs))), 6)


def main() -> None:
    from edgepaged.model.loader import default_model_path
    from edgepaged.testing.encoders import SHAPES, WORDS as ENCODER_WORDS, synthetic_encoder_gguf
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="the chat model (default: the embedded SmolLM2-135M)")
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES),
                    help="encoder shapes to measure (default: nomic-embed-text and mxbai-embed-large)")
    ap.add_argument("--llama-server", default=None)
    args = ap.parse_args()
    shapes = args.shape or ["nomic-embed-text", "mxbai-embed-large"]
    if "nomic-embed-text" not in shapes:
        shapes.insert(0, "nomic-embed-text")
    import tempfile
    work = Path(tempfile.mkdtemp(prefix="embed-bench-"))
    files = {s: synthetic_encoder_gguf(s, work / f"{s}.gguf") for s in shapes}
    chat = args.model or str(default_model_path())
    items = texts(vocabulary=ENCODER_WORDS)            # words the synthetic vocabulary has: ~1 token each
    decoder_items = texts()
    flags = ["--model", chat] + [x for s in shapes for x in ("--model", str(files[s]))] + ["--memory-budget", "12G"]
    proc, base, _ = start_server(*flags)
    out = {"cpu": cpu_flags(), "chat_model": args.model or "embedded SmolLM2-135M-Instruct Q4_1", "texts": len(items),
           "shapes": {}}
    names = {s: files[s].stem for s in shapes}
    try:
        for s in shapes:
            out["shapes"][s] = measure(base, items, names[s])
            print(f"{s}: {out['shapes'][s]['texts_s']} texts/s ({out['shapes'][s]['tokens_per_text']} tokens each)")
        out["shapes"]["decoder"] = measure(base, decoder_items, None)
        nomic = names["nomic-embed-text"]
        alone = [ttft(base) for _ in range(5)]
        beside, done = [], threading.Event()

        def flood():
            embed_all(base, items, model=nomic)
            done.set()
        th = threading.Thread(target=flood)
        th.start()
        time.sleep(0.5)
        while not done.is_set() and len(beside) < 5:
            beside.append(ttft(base))
        th.join()
    finally:
        proc.terminate()
        proc.wait(30)
    out["texts_s"] = out["shapes"]["nomic-embed-text"]["texts_s"]
    out["tokens_per_text"] = out["shapes"]["nomic-embed-text"]["tokens_per_text"]
    out["chat_ttft_alone_s"] = round(statistics.median(alone), 3)
    out["chat_ttft_beside_flood_s"] = round(statistics.median(beside), 3) if beside else None
    if beside:
        out["chat_ttft_ratio"] = round(out["chat_ttft_beside_flood_s"] / out["chat_ttft_alone_s"], 2)
    for s in shapes:
        out["shapes"][s]["int8_cos_min_vs_exact"] = int8_error(files[s], items)
        out["shapes"][s]["llama_cpp_texts_s"], note = llama_cpp(args.llama_server, str(files[s]), items, "mean")
        if note:
            out["shapes"][s]["llama_cpp_note"] = note
    out["llama_cpp_texts_s"] = out["shapes"]["nomic-embed-text"]["llama_cpp_texts_s"]
    out["llama_cpp_note"] = out["shapes"]["nomic-embed-text"].get("llama_cpp_note")
    if out["llama_cpp_texts_s"]:
        out["ratio_vs_llama_cpp"] = round(out["texts_s"] / out["llama_cpp_texts_s"], 2)
    print(f"nomic-embed-text shape: {out['texts_s']} texts/s; chat TTFT alone {out['chat_ttft_alone_s']} s, "
          f"beside the flood {out['chat_ttft_beside_flood_s']} s; llama.cpp: "
          f"{out['llama_cpp_texts_s'] or out['llama_cpp_note']}")
    import shutil
    shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
