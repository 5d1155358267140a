"""Embeddings: texts per second, and a chat's time to first token beside an embedding flood,
against `edgepaged serve` (a subprocess, loopback only).

1. `texts_s`: 256 texts of ~100 tokens embedded through `/v1/embeddings` in batches of 32
   (four batches in flight), on the served model (default: the embedded SmolLM2-135M).
2. `chat_ttft_alone_s` and `chat_ttft_beside_flood_s`: a short chat's first token (streamed,
   median of 5), alone and while the 256 texts are being embedded; `chat_ttft_ratio` their
   ratio (embeddings are background work).
3. `llama_cpp_texts_s`: llama.cpp's embeddings of the same texts on the same file with
   `llama-server --embeddings --pooling last` when `--llama-server PATH` is given, else null
   with the reason.

    python bench/embed_bench.py [--json] [--model FILE.gguf] [--llama-server PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time
import urllib.request

from family_bench import cpu_flags
from soak import free_port, start_server

WORDS = ("the house keeps its lights low at night while the kitchen timer counts the minutes until the bread "
         "is done and the garden sprinklers wake at dawn").split()


def texts(n: int = 256, words: int = 80) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words)) + f" (note {i})" for i in range(n)]


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def embed_all(base: str, items: list[str], batch: int = 32, parallel: int = 4) -> float:
    """Seconds to embed `items` in batches, `parallel` in flight."""
    chunks = [items[i:i + batch] for i in range(0, len(items), batch)]
    t0 = time.perf_counter()
    threads = []
    for k in range(parallel):
        def run(k=k):
            for c in chunks[k::parallel]:
                out = post(base + "/v1/embeddings", {"input": c})
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


def llama_cpp(server: str | None, model: str, items: list[str]) -> tuple[float | None, str | None]:
    """llama.cpp's server on the same file, last-token pooling, the same batches."""
    import shutil
    exe = server or shutil.which("llama-server")
    if exe is None:
        return None, "llama.cpp's llama-server is not installed here (give --llama-server PATH)"
    port = free_port()
    proc = subprocess.Popen([exe, "-m", model, "--embeddings", "--pooling", "last", "--host", "127.0.0.1", "--port",
                             str(port), "-t", "2", "-c", "8192", "-ub", "2048", "-b", "2048"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            return None, "llama-server did not start"
        post(base + "/v1/embeddings", {"input": items[:4]})
        return round(len(items) / embed_all(base, items), 2), None
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--llama-server", default=None)
    args = ap.parse_args()
    items = texts()
    proc, base, _ = start_server(*(["--model", args.model] if args.model else []))
    try:
        post(base + "/v1/embeddings", {"input": items[:4]})                       # warm
        tokens = post(base + "/v1/embeddings", {"input": items[:32]})["usage"]["prompt_tokens"] / 32
        took = embed_all(base, items)
        alone = [ttft(base) for _ in range(5)]
        beside, done = [], threading.Event()

        def flood():
            embed_all(base, items)
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
    out = {"cpu": cpu_flags(), "model": args.model or "embedded SmolLM2-135M-Instruct Q4_1", "texts": len(items),
           "tokens_per_text": round(tokens, 1), "texts_s": round(len(items) / took, 2),
           "chat_ttft_alone_s": round(statistics.median(alone), 3),
           "chat_ttft_beside_flood_s": round(statistics.median(beside), 3) if beside else None,
           }
    from edgepaged.model.loader import default_model_path
    out["llama_cpp_texts_s"], out["llama_cpp_note"] = llama_cpp(args.llama_server, args.model or str(default_model_path()),
                                                                items)
    if beside:
        out["chat_ttft_ratio"] = round(out["chat_ttft_beside_flood_s"] / out["chat_ttft_alone_s"], 2)
    print(f"{out['texts_s']} texts/s ({out['tokens_per_text']} tokens each); chat TTFT alone "
          f"{out['chat_ttft_alone_s']} s, beside the flood {out['chat_ttft_beside_flood_s']} s")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
