"""A chat's next turns: each sends the conversation so far (its earlier prompts and answers)
and one more message, as every chat client does. What the prefix cache found of each turn's
prompt and how soon its first token came, against `edgepaged serve` on loopback.

Figures (the last line with --json): `turns`: per turn after the first, `prompt_tokens`,
`cached_tokens` (the OpenAI door's `prompt_tokens_details`), `whole_block_tokens` (what whole
blocks of 16 alone would have found: the cached count rounded down) and `ttft_s` (first
streamed content); `cached_frac` over those turns.

    python bench/chat_turns_bench.py [--json] [--model FILE.gguf] [--turns 4] [--max-tokens 96]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request

from bench.family_bench import cpu_flags
from bench.soak import start_server

ASKS = ["Give me three ideas for a rainy Sunday with kids.", "And one more, for the evening?",
        "Which of them costs the least?", "Write a short shopping list for it.", "Thanks! Anything to avoid?"]


def turn(base: str, msgs: list[dict], max_tokens: int) -> dict:
    body = {"model": "m", "messages": msgs, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    first, text, usage = None, [], None
    with urllib.request.urlopen(req, timeout=900) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: {"):
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    return {"text": "".join(text), "ttft_s": round((first or time.perf_counter()) - t0, 3),
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="chat-turns-") as store:
        os.environ["EDGEPAGED_STORE"] = store          # nothing cached from an earlier run (disk tier)
        proc, base, _ = start_server("--prefix-cache-disk", "0", *(["--model", args.model] if args.model else []))
        try:
            msgs = [{"role": "system", "content": "You are a helpful assistant in a family home."}]
            rows = []
            for i in range(args.turns):
                msgs.append({"role": "user", "content": ASKS[i % len(ASKS)]})
                r = turn(base, msgs, args.max_tokens)
                msgs.append({"role": "assistant", "content": r.pop("text")})
                r["whole_block_tokens"] = r["cached_tokens"] // 16 * 16
                rows.append(r)
                print(f"turn {i + 1}: {r['prompt_tokens']} prompt tokens, {r['cached_tokens']} cached "
                      f"(whole blocks {r['whole_block_tokens']}), first token {r['ttft_s']} s", flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
    later = rows[1:]
    out = {"machine": cpu_flags(), "model": args.model or "embedded", "turns": later,
           "cached_frac": round(sum(r["cached_tokens"] for r in later) / max(1, sum(r["prompt_tokens"] for r in later)), 3)}
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
