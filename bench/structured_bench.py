"""Constrained decoding's cost: 16 concurrent requests on the embedded model in process, once
all free, once half of them constrained by a JSON schema (llguidance masks), alternated
`--rounds` times so both see the same machine.

    python bench/structured_bench.py [--json] [--requests 16] [--max-tokens 96] [--rounds 3] [--model FILE]

Prints tok_s_free_only, tok_s_mixed (generated tokens per second of the whole batch, each the
median over the rounds), their ratio (target >= 0.9), constrained_valid_frac (answers that
parse and validate against the schema; target 1.0) and mask_ms_p50 / mask_ms_p99 (the
masks of one step's constrained rows, computed in their own thread while the forward runs).
With --json the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import trio

from bench.family_bench import cpu_flags

from edgepaged.engine import Engine, EngineConfig
from edgepaged.request.frontend import Caller, FrontEnd
from edgepaged.model import ModelRunner
from edgepaged.request.protocol import GenerateRequest

SCHEMA = {   # bounded everywhere, so every answer can finish inside max_tokens
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "city": {"enum": ["Paris", "Berlin", "Rome", "Madrid", "Lisbon"]},
                   "hobbies": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 16}}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False,
}
PROMPTS = ["Describe a person who lives in Europe as JSON.", "Tell me about your favourite city.",
           "Invent a character for a story, as JSON.", "What do people do on weekends?"]


async def one(engine, front, i: int, constrained: bool, max_tokens: int, out: list) -> None:
    item = GenerateRequest(f"r{i}", "chat", messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                           max_tokens=max_tokens, sampling={"temperature": 0.8, "seed": i},
                           format={"type": "json_schema", "schema": SCHEMA} if constrained else None)
    req = (await front.build(item, Caller(f"c{i}", f"c{i}"))).req
    text = []
    async with engine.stream(req) as events:
        async for ev in events:
            if hasattr(ev, "text"):
                text.append(ev.text)
            else:
                out.append((constrained, "".join(text), ev.usage["completion_tokens"], ev.finish_reason))


async def run(engine, front, n: int, half: bool, max_tokens: int):
    out: list = []
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, engine, front, i, half and i % 2 == 0, max_tokens, out)
    wall = time.perf_counter() - t0
    return sum(x[2] for x in out) / wall, out


def valid(text: str) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except Exception:
        return False


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else None


async def main_async(args):
    runner = ModelRunner(args.model, num_blocks=1024)
    async with Engine(runner, EngineConfig(max_num_seqs=args.requests)) as engine:
        front = FrontEnd(engine)
        await run(engine, front, 4, True, 8)          # warm-up: the llguidance tokenizer, the kernels
        free, mixed, checks = [], [], []
        runner.mask_ms.clear()
        for _ in range(args.rounds):
            tok_s, _ = await run(engine, front, args.requests, False, args.max_tokens)
            free.append(tok_s)
            tok_s, out = await run(engine, front, args.requests, True, args.max_tokens)
            mixed.append(tok_s)
            checks += [valid(text) for constrained, text, _, _ in out if constrained]
    f, m = statistics.median(free), statistics.median(mixed)
    return {
        "bench": "structured", "model": runner.model_path.name, "requests": args.requests,
        "max_tokens": args.max_tokens, "rounds": args.rounds, **cpu_flags(),
        "tok_s_free_only": round(f, 1), "tok_s_mixed": round(m, 1), "mixed_over_free": round(m / f, 3),
        "constrained_valid_frac": round(sum(checks) / len(checks), 3) if checks else None,
        "constrained_answers": len(checks),
        "mask_ms_p50": round(pct(runner.mask_ms, 0.5), 3) if runner.mask_ms else None,
        "mask_ms_p99": round(pct(runner.mask_ms, 0.99), 3) if runner.mask_ms else None,
        "tok_s_free_rounds": [round(x, 1) for x in free], "tok_s_mixed_rounds": [round(x, 1) for x in mixed],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=None, help="a GGUF file or model folder (default: the embedded model)")
    args = ap.parse_args()
    r = trio.run(main_async, args)
    print(f"free only: {r['tok_s_free_only']} tok/s; half constrained: {r['tok_s_mixed']} tok/s "
          f"({r['mixed_over_free']}x); valid {r['constrained_valid_frac']} of {r['constrained_answers']}; "
          f"mask p50 {r['mask_ms_p50']} ms, p99 {r['mask_ms_p99']} ms")
    if args.json:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
