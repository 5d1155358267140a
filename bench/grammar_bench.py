"""Grammars never freeze the box (issue 34's measurements), against `edgepaged serve` on the
embedded model (a subprocess, loopback only):

1. `/health` latency, polled every 10 ms, while the largest grammar the server accepts (a
   schema of optional properties filling --grammar-max-bytes) compiles with n=8, cold and
   then cached, and while the deepest accepted one (a $ref chain at --grammar-max-depth)
   does: `health_worst_ms_cold` (target <= 50), `health_worst_ms_cached`,
   `health_worst_ms_deep`, `health_p99_ms`, and the request's own status and seconds.
   `health_worst_ms_forced` (target <= 100): the same while 16 requests at once hold formats
   that force ~200 KB of fixed text (`forcing`) (each froze every door for
   ~1.5 s before: llguidance forced and tokenized all of it with the GIL held, after every
   step); `forced_statuses`: how they were answered (a 400 naming the limit).
2. The plain requests' generated tokens/s (4 greedy streams) alone, beside 8 requests held to
   a JSON schema, and beside 8 free requests of the same shape, alternated `--rounds` times:
   `plain_ratio_beside_constrained` (beside 8 constrained / alone, target >= 0.9) and
   `plain_ratio_constrained_vs_free` (the grammars' own cost: beside constrained / beside free).

    python bench/grammar_bench.py [--json] [--seconds 12] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.error
import urllib.request

import trio

from bench.family_bench import cpu_flags
from bench.soak import start_server
from bench.structured_bench import SCHEMA    # the same bounded schema as structured_bench's

from edgepaged.client import open_client

PLAIN = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
FORM = [{"role": "user", "content": "Describe a person who lives in Europe as JSON."}]


def widest_schema(limit: int) -> tuple[dict, int]:
    """Optional string properties, as many as fit `limit` bytes of JSON."""
    n = limit // 30
    while True:
        schema = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(n)}}
        if len(json.dumps(schema)) <= limit:
            return schema, n
        n -= 50


def deepest_schema(depth: int) -> dict:
    n = depth - 4        # the object, its properties, the property and the last definition count too
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "$defs": defs}


def forcing(k: int) -> dict:
    """A format that forces ~200 KB of fixed text: a counted repetition (refused before it
    compiles: its text says so) or an array of copies of one const (no count shows it: found
    when the run is forced), alternately."""
    if k % 2:
        return {"guided_regex": f"(a|b)c{{{200_000 + k}}}"}
    return {"guided_json": {"type": "object", "required": ["a"], "properties": {"a": {
        "type": "array", "items": {"const": "xxxxxxxx"}, "minItems": 25_000 + k}}}}


def post(url: str, body: dict, timeout=300) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def health_during(base: str, body: dict | list) -> dict:
    """Poll /health every 10 ms from another thread while `body` is answered (a list: each
    body at once, from a thread of its own)."""
    lat, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            t = time.perf_counter()
            with urllib.request.urlopen(base + "/health", timeout=60) as r:
                r.read()
            lat.append(time.perf_counter() - t)
            time.sleep(0.01)
    th = threading.Thread(target=poll)
    th.start()
    time.sleep(0.2)
    t0 = time.perf_counter()
    if isinstance(body, list):
        got = [None] * len(body)

        def one(i):
            got[i] = post(base + "/v1/chat/completions", body[i])
        ts = [threading.Thread(target=one, args=(i,)) for i in range(len(body))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        status, raw = got[0]
        statuses = sorted(s for s, _ in got)
    else:
        status, raw = post(base + "/v1/chat/completions", body)
        statuses = [status]
    took = time.perf_counter() - t0
    time.sleep(0.1)
    stop.set()
    th.join()
    lat.sort()
    return {"status": status, "seconds": round(took, 2), "worst_ms": round(1000 * lat[-1], 1),
            "p99_ms": round(1000 * lat[int(0.99 * (len(lat) - 1))], 1), "polls": len(lat),
            "error": None if status == 200 else json.loads(raw).get("error", {}).get("message"),
            "statuses": statuses}


async def throughput(addr: str, seconds: float, beside: str | None) -> float:
    """Generated tokens/s of 4 plain greedy streams over `seconds`, with 8 constrained or free
    requests (`beside`) looping beside them."""
    plain_tokens = [0]
    deadline = trio.current_time() + seconds

    async def plain(i):
        async with open_client(addr, name=f"plain{i}") as c:
            while trio.current_time() < deadline:
                with trio.move_on_at(deadline):
                    async for _ in c.chat(PLAIN, max_tokens=64, temperature=0, ignore_eos=True):
                        plain_tokens[0] += 1

    async def other(i):
        async with open_client(addr, name=f"other{i}") as c:
            while trio.current_time() < deadline:
                kw = {"format": {"type": "json_schema", "schema": SCHEMA}} if beside == "constrained" else {}
                with trio.move_on_at(deadline):
                    await c.chat(FORM, max_tokens=64, temperature=0.8, seed=i, **kw).collect()

    t0 = trio.current_time()
    async with trio.open_nursery() as n:
        for i in range(4):
            n.start_soon(plain, i)
        if beside:
            for i in range(8):
                n.start_soon(other, i)
    return plain_tokens[0] / (trio.current_time() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--seconds", type=float, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    proc, base, addr = start_server("--max-unauthenticated-per-address", "32")
    try:
        post(base + "/v1/chat/completions", {"messages": PLAIN, "max_tokens": 4})      # warm
        schema, props = widest_schema(256 << 10)
        wide = {"messages": FORM, "max_tokens": 8, "n": 8, "temperature": 0.7, "guided_json": schema}
        cold = health_during(base, wide)
        cached = health_during(base, wide)
        deep = health_during(base, {"messages": FORM, "max_tokens": 8, "n": 8, "temperature": 0.7,
                                    "guided_json": deepest_schema(128)})
        print(f"largest accepted schema ({props} optional properties, n=8): {cold}; again (cached): {cached}")
        print(f"deepest accepted schema (depth 128, n=8): {deep}")
        forced = health_during(base, [{"messages": [{"role": "user", "content": "Say a or b."}], "max_tokens": 64,
                                       "temperature": 0, **forcing(k)} for k in range(16)])
        print(f"16 formats forcing 200 KB each: {forced}")
        runs = {"alone": [], "constrained": [], "free": []}
        for _ in range(args.rounds):
            for beside in ("alone", "constrained", "free"):
                tps = trio.run(throughput, addr, args.seconds, None if beside == "alone" else beside)
                runs[beside].append(tps)
                print(f"plain tok/s beside {beside}: {tps:.1f}")
    finally:
        proc.terminate()
        proc.wait(30)
    med = {k: statistics.median(v) for k, v in runs.items()}
    out = {"cpu": cpu_flags(), "largest_schema_properties": props, "health_worst_ms_cold": cold["worst_ms"],
           "health_worst_ms_cached": cached["worst_ms"], "health_worst_ms_deep": deep["worst_ms"],
           "health_worst_ms_forced": forced["worst_ms"], "forced_statuses": forced["statuses"],
           "forced_error": forced["error"],
           "health_p99_ms": max(cold["p99_ms"], cached["p99_ms"], deep["p99_ms"], forced["p99_ms"]),
           "largest_status": cold["status"], "largest_seconds_cold": cold["seconds"],
           "largest_seconds_cached": cached["seconds"], "largest_error": cold["error"],
           "plain_tok_s_alone": round(med["alone"], 1), "plain_tok_s_beside_constrained": round(med["constrained"], 1),
           "plain_tok_s_beside_free": round(med["free"], 1),
           "plain_ratio_beside_constrained": round(med["constrained"] / med["alone"], 3),
           "plain_ratio_constrained_vs_free": round(med["constrained"] / med["free"], 3), "rounds": runs}
    print(f"health worst {out['health_worst_ms_cold']} ms (cold), {out['health_worst_ms_cached']} ms (cached); "
          f"plain tok/s alone {out['plain_tok_s_alone']}, beside 8 constrained {out['plain_tok_s_beside_constrained']} "
          f"({out['plain_ratio_beside_constrained']}x), beside 8 free {out['plain_tok_s_beside_free']}")
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
