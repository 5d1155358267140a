"""Soak with faults: `edgepaged serve` (a subprocess, loopback only) under hundreds of
concurrent clients for a bounded time, most of them misbehaving.

Each client loops until the deadline, picking a behaviour each round:
  normal     44%  chat, read everything: must finish with its full answer
  cancel     18%  cancel mid-stream (a cancel frame)
  vanish      9%  drop the socket mid-stream without a word
  noread      7%  send a request and never read the stream, then drop the socket
  garbage     5%  send bytes that are not a frame: must get an error frame and a close
  reconnect   5%  connect, hello, disconnect, a few times in a row
  badparams   5%  a request with top_k past the vocabulary or an infinite temperature: refused
  pest        4%  connections from another loopback address (127.0.0.2) that never say hello
  upload      3%  an HTTP POST that stops halfway through its body, then hangs up
  deep_grammar 2%  a $ref chain of 3,000 or a Lark rule chain of 4,000 (it killed the server): a 400
  wide_grammar 1%  a schema of 3,000 optional properties with n=8 (it froze every door): answered or a 400
  bad_tools    1%  auto tool choice with a tool schema the grammar library rejects (it killed the engine)
  borrow       1%  asks with "user" set to its own address after priming a prompt from that address:
                   the cache must not answer (cached_tokens 0), else `attacks_succeeded` counts it
At the end: every normal request completed, zero blocks leaked (nothing used once idle),
the server's RSS back near where it started after warm-up, and its task count back. `failed`
counts only the requests of well-behaved (normal) clients. The household's clients share one
loopback address here, so the server gets a per-address allowance of connections before
hello as large as the client count; the pests' address has the same allowance and must not
crowd them out.

    python bench/soak.py [--quick] [--json] [--clients N] [--seconds S]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import trio

from edgepaged.client import ServerError, open_client
from edgepaged.protocol import encode

QUESTIONS = ["Turn on the kitchen light?", "Is it going to rain tomorrow?", "What is 12 times 7?",
             "Name a green vegetable.", "What is the capital of France?", "Say good night."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama_server(exe: str, model: str, *flags: str, wait_s: float = 120.0):
    """llama.cpp's `llama-server` on loopback with `flags`, once /health says ready:
    (process, base URL), or (None, None) when it did not start (its process ended)."""
    import time
    import urllib.request
    port = free_port()
    proc = subprocess.Popen([exe, "-m", model, "--host", "127.0.0.1", "--port", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    end = time.monotonic() + wait_s
    while time.monotonic() < end and proc.poll() is None:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            time.sleep(0.5)
    proc.kill()
    proc.wait(30)
    return None, None


def start_server(*flags: str) -> tuple[subprocess.Popen, str, str]:
    """`edgepaged serve` on loopback with `flags`, once it is ready: (process, HTTP base URL,
    msgpack address). Its later output is read (and dropped) in a thread."""
    port, http_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "edgepaged.cli", "serve", "--host", "127.0.0.1", "--port",
                             str(port), "--http-port", str(http_port), "--no-mdns", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "ready on" in line:
            break
    else:
        sys.exit(f"the server did not start (exit {proc.wait()})")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
    return proc, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{port}"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Tally:
    def __init__(self):
        self.counts = {k: 0 for k in ("normal", "cancel", "vanish", "noread", "garbage", "reconnect", "badparams",
                                      "pest", "upload", "deep_grammar", "wide_grammar", "bad_tools", "borrow")}
        self.attacks_succeeded: list[str] = []
        self.completed = 0
        self.failed: list[str] = []
        self.requests = 0


async def behave(addr: str, host: str, port: int, http_port: int, kind: str, rng: random.Random, t: Tally) -> None:
    q = [{"role": "user", "content": rng.choice(QUESTIONS)}]
    n = rng.randint(4, 16)
    if kind == "badparams":
        bad = rng.choice([dict(top_k=10**6), dict(temperature=float("inf")), dict(stop_token_ids=[10**7])])
        async with open_client(addr, name="soak-bad") as c:
            try:
                await c.chat(q, max_tokens=n, **bad).collect()
                t.failed.append(f"a request with {bad} was not refused")
            except ServerError as e:
                if e.code != "invalid_params":
                    t.failed.append(f"a request with {bad} got {e.code}, not invalid_params")
        return
    if kind in ATTACKS:
        await ATTACKS[kind](f"http://{host}:{http_port}", rng, t)
        return
    if kind == "pest":
        held = []
        try:
            for _ in range(rng.randint(5, 20)):
                held.append(await trio.open_tcp_stream(host, port, local_address="127.0.0.2"))
            await trio.sleep(rng.random() * 2)
        finally:
            for s in held:
                await s.aclose()
        return
    if kind == "upload":
        s = await trio.open_tcp_stream(host, http_port)
        async with s:
            await s.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
                             b"application/json\r\nContent-Length: 65536\r\n\r\n{\"messages\": [{\"role\": ")
            await trio.sleep(rng.random() * 0.3)
        return
    if kind in ("normal", "cancel"):
        t.requests += 1
        async with open_client(addr, name=f"soak-{rng.randrange(20)}") as c:
            stream = c.chat(q, max_tokens=n, temperature=0, ignore_eos=True)
            got = 0
            async for _ in stream:
                got += 1
                if kind == "cancel" and got >= rng.randint(1, 3):
                    await stream.cancel()
                    return
            if kind == "normal":
                done = stream.done or {}
                ok = done.get("finish_reason") == "length" and done.get("usage", {}).get("completion_tokens") == n
                if ok:
                    t.completed += 1
                else:
                    t.failed.append(f"normal request ended {done}")
        return
    s = await trio.open_tcp_stream(host, port)
    try:
        if kind == "garbage":
            await s.send_all(rng.choice([b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1", b"\xff\xff\xff\xffjunk",
                                         b"\x00\x00\x00\x03abc"]))
            with trio.move_on_after(10):
                data = b""
                while chunk := await s.receive_some(65536):
                    data += chunk
                if b"error" not in data:
                    t.failed.append("garbage got no error frame")
            return
        await s.send_all(encode({"type": "hello", "version": 1, "client": "soak-raw"}))
        if kind == "reconnect":
            return
        t.requests += 1
        await s.send_all(encode({"type": "chat", "id": 1, "messages": q, "max_tokens": n, "ignore_eos": True}))
        if kind == "vanish":
            await trio.sleep(rng.random() * 0.5)
            s.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        else:   # noread
            await trio.sleep(rng.random() * 2)
    finally:
        await s.aclose()


def post(url: str, body: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


async def attack(base: str, body: dict, t: Tally, kind: str, ok=(400,), path="/v1/chat/completions"):
    status, out = await trio.to_thread.run_sync(post, base + path, body)
    if status not in ok:
        t.attacks_succeeded.append(f"{kind}: HTTP {status}")
    return status, out


async def deep_grammar(base: str, rng: random.Random, t: Tally) -> None:
    q = [{"role": "user", "content": rng.choice(QUESTIONS)}]
    if rng.random() < 0.5:
        body = {"messages": q, "max_tokens": 4, "guided_json": ref_chain(3000)}
    else:
        body = {"messages": q, "max_tokens": 4,
                "guided_grammar": "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(4000)) + 'r4000: "x"\n'}
    await attack(base, body, t, "deep_grammar")


async def wide_grammar(base: str, rng: random.Random, t: Tally) -> None:
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(3000)}}
    await attack(base, {"messages": [{"role": "user", "content": "Fill the form."}], "max_tokens": 3, "n": 8,
                        "temperature": 0.7, "guided_json": schema}, t, "wide_grammar", ok=(200, 400))


async def bad_tools(base: str, rng: random.Random, t: Tally) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}]
    await attack(base, {"messages": [{"role": "user", "content": rng.choice(QUESTIONS)}], "max_tokens": 8,
                        "tools": tools}, t, "bad_tools")


async def borrow(base: str, rng: random.Random, t: Tally) -> None:
    secret = f"{rng.randrange(10**8):08d} is my door code. " * 6    # unique from its first block on
    status, _ = await attack(base, {"prompt": secret, "max_tokens": 1}, t, "borrow-prime", ok=(200,),
                             path="/v1/completions")
    status, out = await attack(base, {"prompt": secret, "max_tokens": 1, "user": "127.0.0.1"}, t, "borrow",
                               ok=(200,), path="/v1/completions")
    if status == 200 and out["usage"].get("prompt_tokens_details", {}).get("cached_tokens"):
        t.attacks_succeeded.append("borrow: another identity's cache answered")


ATTACKS = {"deep_grammar": deep_grammar, "wide_grammar": wide_grammar, "bad_tools": bad_tools, "borrow": borrow}


async def soak(addr: str, http_port: int, clients: int, seconds: float, seed: int, t: Tally) -> None:
    host, port = addr.rsplit(":", 1)
    kinds, weights = list(t.counts), [44, 18, 9, 7, 5, 5, 5, 4, 3, 2, 1, 1, 1]
    deadline = trio.current_time() + seconds

    async def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while trio.current_time() < deadline:
            kind = rng.choices(kinds, weights)[0]
            t.counts[kind] += 1
            try:
                with trio.fail_after(120):
                    await behave(addr, host, int(port), http_port, kind, rng, t)
            except (ServerError, OSError, trio.BrokenResourceError) as e:
                if kind == "normal":
                    t.failed.append(f"normal request: {type(e).__name__}: {e}")
            except trio.TooSlowError:
                t.failed.append(f"{kind} client hung for 120 s")
            await trio.sleep(rng.random() * 0.2)

    async with trio.open_nursery() as n:
        for i in range(clients):
            n.start_soon(client, i)


async def stats(addr: str) -> dict:
    async with open_client(addr, name="soak-observer") as c:
        return await c.stats()


async def wait_idle(addr: str, timeout: float = 60) -> dict:
    with trio.move_on_after(timeout):
        while True:
            s = await stats(addr)
            if s["num_requests_running"] == s["num_requests_waiting"] == s["kv_blocks_used"] == 0 \
                    and s["server"]["requests_inflight"] == 0 and s["server"]["connections"] <= 1:
                return s
            await trio.sleep(0.25)
    return await stats(addr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="about 2 minutes: 120 clients for 75 s")
    ap.add_argument("--clients", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.clients, args.seconds = 120, 75
    port, http_port = free_port(), free_port()
    addr = f"127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "edgepaged.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--no-mdns",
           "--http-port", str(http_port), "--kv-memory", "256MiB", "--max-connections", str(args.clients + 64),
           "--max-unauthenticated", str(2 * args.clients), "--max-unauthenticated-per-address", str(args.clients),
           "--grace", "5"]
    # a store of its own: the prefix cache's disk tier outlives the server, and the seeded
    # clients send the same prompts every run (a borrow's own blocks from the last run were
    # counted as another identity's); the weights cache stays where it was
    import tempfile
    from edgepaged.model.weights_cache import cache_dir
    store = tempfile.TemporaryDirectory(prefix="soak-store-")
    weights = cache_dir()
    env = {**os.environ, "EDGEPAGED_STORE": store.name,
           "EDGEPAGED_WEIGHTS_CACHE": str(weights) if weights is not None else "off"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        for line in proc.stdout:
            if "ready on" in line:
                print(line.strip())
                break
        else:
            sys.exit(f"the server did not start (exit {proc.wait()})")
        log_lines: list[str] = []       # what the server says from here on (the log-flooding check)
        threading.Thread(target=lambda: log_lines.extend(proc.stdout), daemon=True).start()
        # warm up at full concurrency (allocator caches reach their working size), then the baseline
        trio.run(soak, addr, http_port, args.clients, max(10.0, args.seconds / 8), args.seed + 99, Tally())
        base = trio.run(wait_idle, addr)
        rss0 = rss_mb(proc.pid)
        t = Tally()
        t0 = time.monotonic()
        rss_trace, stop = [], threading.Event()

        def sample_rss():
            while not stop.wait(10):
                rss_trace.append((round(time.monotonic() - t0), round(rss_mb(proc.pid), 1)))
        threading.Thread(target=sample_rss, daemon=True).start()
        trio.run(soak, addr, http_port, args.clients, args.seconds, args.seed, t)
        stop.set()
        wall = time.monotonic() - t0
        end = trio.run(wait_idle, addr)
        rss1 = rss_mb(proc.pid)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        store.cleanup()
    out = {
        "requests": t.requests, "completed": t.completed, "failed": len(t.failed),
        "leaked_blocks": end["kv_blocks_used"],
        "rss_mb_start": round(rss0, 1), "rss_mb_end": round(rss1, 1), "rss_growth_mb": round(rss1 - rss0, 1),
        "max_active": end["max_requests_running"], "tasks_start": base["server"]["tasks_living"],
        "tasks_end": end["server"]["tasks_living"], "behaviours": t.counts, "clients": args.clients,
        "seconds": round(wall, 1), "generation_tokens": end["generation_tokens"], "finished": end["finished"],
        "free_plus_cached_equals_total": end["kv_blocks_free"] == end["kv_blocks_total"], "exit_code": rc,
        "rss_trace_mb": rss_trace, "server_log_lines": len(log_lines),
        "tracebacks_in_log": sum("Traceback" in x for x in log_lines),
        "attacks_succeeded": len(t.attacks_succeeded), "server_alive_after": rc == 0,
    }
    for f in t.attacks_succeeded[:10]:
        print("ATTACK SUCCEEDED:", f)
    for f in t.failed[:10]:
        print("FAILED:", f)
    print(f"{t.requests} requests from {args.clients} clients in {wall:.0f} s: {t.completed} normal ones completed, "
          f"{len(t.failed)} failed; leaked blocks {out['leaked_blocks']}; RSS {rss0:.0f} -> {rss1:.0f} MB; "
          f"tasks {out['tasks_start']} -> {out['tasks_end']}; max active {out['max_active']}; server exit {rc}")
    if args.json:
        print(json.dumps(out))
    ok = not t.failed and out["leaked_blocks"] == 0 and rc == 0 and out["tracebacks_in_log"] == 0 \
        and not t.attacks_succeeded
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
