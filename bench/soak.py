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
  http_normal  5%  an HTTP chat from the household's address: must be answered (a 200)
  forced       1%  a format forcing ~200 KB of fixed text (it froze every door): a 400
  big_prompt   1%  a 600 KB prompt (over the byte cap) or a 250 KB one (over the context): a 400
  compile      1%  a ~200 KB schema with one property changed each time, from 127.0.0.3 (two pinned the
                   grammar compiler): compiled, stopped (400), or refused for that address (429/503)
  costly       1%  six formatted requests at once from one identity, each a third of its token cap:
                   more than three admitted counts in `attacks_succeeded`
  noread_http  1%  HTTP streams from 127.0.0.3 that read nothing (they held all 64 slots): the
                   household's HTTP chats must still be answered
  image        1%  an image in every door's shape (a decompression bomb's header, truncated, not an image,
                   a remote URL, nine of them, a good one): the text-only model refuses each with a 400
                   naming itself, nothing decoded
`health_worst_ms`: the slowest /health of the run, polled at 10 Hz from a process of its own.
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
from edgepaged.request.protocol import encode

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
                                      "pest", "upload", "deep_grammar", "wide_grammar", "bad_tools", "borrow",
                                      "http_normal", "forced", "big_prompt", "compile", "costly", "noread_http",
                                      "image")}
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


def post(url: str, body: dict, source: str | None = None) -> tuple[int, dict]:
    """POST `body` as JSON (from the loopback address `source`, else the default)."""
    import http.client
    import urllib.parse
    u = urllib.parse.urlsplit(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=120,
                                   source_address=(source, 0) if source else None)
    try:
        c.request("POST", u.path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        try:
            return r.status, json.loads(data or b"{}")
        except ValueError:
            return r.status, {"raw": data[:200].decode("utf-8", "replace")}
    finally:
        c.close()


def home(rng: random.Random) -> str:
    """A household device's loopback address (phones, laptops, hubs: each its own, as at home)."""
    return f"127.0.0.{10 + rng.randrange(32)}"


def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


async def attack(base: str, body: dict, t: Tally, kind: str, ok=(400,), path="/v1/chat/completions",
                 source: str | None = None):
    status, out = await trio.to_thread.run_sync(post, base + path, body, source)
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
    await attack(base, body, t, "deep_grammar", source=home(rng))


async def wide_grammar(base: str, rng: random.Random, t: Tally) -> None:
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(3000)}}
    await attack(base, {"messages": [{"role": "user", "content": "Fill the form."}], "max_tokens": 3, "n": 8,
                        "temperature": 0.7, "guided_json": schema}, t, "wide_grammar", ok=(200, 400),
                 source=home(rng))


async def bad_tools(base: str, rng: random.Random, t: Tally) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}]
    await attack(base, {"messages": [{"role": "user", "content": rng.choice(QUESTIONS)}], "max_tokens": 8,
                        "tools": tools}, t, "bad_tools", source=home(rng))


async def borrow(base: str, rng: random.Random, t: Tally) -> None:
    secret = f"{rng.randrange(10**8):08d} is my door code. " * 6    # unique from its first block on
    me = home(rng)
    status, _ = await attack(base, {"prompt": secret, "max_tokens": 1}, t, "borrow-prime", ok=(200,),
                             path="/v1/completions", source=me)
    status, out = await attack(base, {"prompt": secret, "max_tokens": 1, "user": me}, t, "borrow",
                               ok=(200,), path="/v1/completions", source=me)
    if status == 200 and out["usage"].get("prompt_tokens_details", {}).get("cached_tokens"):
        t.attacks_succeeded.append("borrow: another identity's cache answered")


async def http_normal(base: str, rng: random.Random, t: Tally) -> None:
    """A household member's HTTP chat: a well-behaved request, counted in `failed` unless answered."""
    t.requests += 1
    status, out = await trio.to_thread.run_sync(post, base + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}], "max_tokens": rng.randint(4, 16),
        "temperature": 0}, home(rng))
    if status == 200 and out.get("choices"):
        t.completed += 1
    else:
        t.failed.append(f"http_normal: HTTP {status} {str(out)[:160]}")


ATTACKER = "127.0.0.3"      # the script on a laptop: an address of its own


async def forced(base: str, rng: random.Random, t: Tally) -> None:
    from bench.grammar_bench import forcing
    status, out = await attack(base, {"messages": [{"role": "user", "content": "Say a or b."}], "max_tokens": 64,
                                      "temperature": 0, **forcing(rng.randrange(999))},
                               t, "forced", source=ATTACKER)
    said = json.dumps(out)
    if status == 400 and "forced-text limit" not in said and "parser's limits" not in said:
        t.attacks_succeeded.append(f"forced: a 400 that does not name the limit: {str(out)[:160]}")


async def big_prompt(base: str, rng: random.Random, t: Tally) -> None:
    size = rng.choice([600_000, 250_000])
    text = " ".join(rng.choice(QUESTIONS) for _ in range(size // 25))[:size]
    await attack(base, {"messages": [{"role": "user", "content": text}], "max_tokens": 1}, t, "big_prompt",
                 source=ATTACKER)


async def compile_attack(base: str, rng: random.Random, t: Tally) -> None:
    tag = rng.randrange(10**9)
    schema = {"type": "object", "properties": {f"field_{tag}_{i}": {"type": "string"} for i in range(6000)}}
    await attack(base, {"messages": [{"role": "user", "content": "Fill the form."}], "max_tokens": 3,
                        "guided_json": schema}, t, "compile", ok=(200, 400, 429, 503), source=ATTACKER)


COSTLY_CAP = 3072            # the soak server's --max-identity-tokens
HEALTH_BOUND_MS = 100      # /health within this, polled at 10 Hz, whatever the attackers do


async def costly(base: str, rng: random.Random, t: Tally) -> None:
    body = {"messages": [{"role": "user", "content": "Write a long sentence."}], "max_tokens": COSTLY_CAP // 3,
            "temperature": 0, "guided_regex": "[a-z ]{1,4000}", "user": f"costly-{rng.randrange(10**9)}"}
    got = []

    async def one():
        got.append(await trio.to_thread.run_sync(post, base + "/v1/chat/completions", body, ATTACKER))
    async with trio.open_nursery() as n:
        for _ in range(6):
            n.start_soon(one)
    admitted = sum(s == 200 for s, _ in got)
    if admitted > 3 or any(s not in (200, 429) for s, _ in got):
        t.attacks_succeeded.append(f"costly: {sorted(s for s, _ in got)} (at most three fit the cap)")


async def noread_http(base: str, rng: random.Random, t: Tally) -> None:
    host, port = base.rsplit("/", 1)[1].split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.bind((ATTACKER, 0))
    try:
        await trio.to_thread.run_sync(s.connect, (host, int(port)))
        data = json.dumps({"messages": [{"role": "user", "content": rng.choice(QUESTIONS)}], "max_tokens": 4000,
                           "ignore_eos": True, "stream": True}).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        await trio.sleep(20 + rng.random() * 30)
    finally:
        s.close()


def _image_payloads() -> list[str]:
    """base64 image files a client might send: a bomb's header, truncated, not an image, a good PNG."""
    import base64
    import struct
    import zlib
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", 60000, 60000, 8, 2, 0, 0, 0)
    bomb = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr))
    png = (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01\x00\x00\x00\x01\x08\x02\x00\x00\x00\x90wS\xde"
           b"\x00\x00\x00\x0cIDATx\x9cc\xf8\xff\xff?\x00\x05\xfe\x02\xfe\xa7V\xbd\xfa\x00\x00\x00\x00IEND\xaeB`\x82")
    return [base64.b64encode(b).decode() for b in (bomb, png[:30], b"hello, not an image", png)]


IMAGES = _image_payloads()
MODEL = "SmolLM2-135M-Instruct.Q4_1"     # the embedded model's name (Ollama's door needs one)


async def image(base: str, rng: random.Random, t: Tally) -> None:
    """An image through one of the doors: the text-only model refuses it (400), naming itself."""
    b64s = [rng.choice(IMAGES) for _ in range(rng.choice([1, 1, 2, 9]))]
    door = rng.choice(["openai", "ollama", "generate", "remote"])
    if door == "ollama":
        body, path = {"model": MODEL, "messages": [{"role": "user", "content": "What is it?", "images": b64s}],
                      "stream": False}, "/api/chat"
    elif door == "generate":
        body, path = {"model": MODEL, "prompt": "What is it?", "images": b64s, "stream": False}, "/api/generate"
    else:
        urls = ["https://camera.invalid/snapshot.jpg"] if door == "remote" else \
            ["data:image/png;base64," + b for b in b64s]
        body, path = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is it?"}] + [
            {"type": "image_url", "image_url": {"url": u}} for u in urls]}], "max_tokens": 4}, "/v1/chat/completions"
    status, out = await attack(base, body, t, "image", path=path, source=ATTACKER)
    msg = out.get("error") if isinstance(out.get("error"), str) else (out.get("error") or {}).get("message", "")
    if status == 400 and "does not take images" not in (msg or ""):
        t.attacks_succeeded.append(f"image: a 400 that does not say the model takes no images: {msg!r}")


ATTACKS = {"deep_grammar": deep_grammar, "wide_grammar": wide_grammar, "bad_tools": bad_tools, "borrow": borrow,
           "http_normal": http_normal, "forced": forced, "big_prompt": big_prompt, "compile": compile_attack,
           "costly": costly, "noread_http": noread_http, "image": image}


HEALTH_POLL = r"""
import http.client, sys, time
host, port, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
import os
worst, polls = 0.0, 0
c = http.client.HTTPConnection(host, port, timeout=60)
while not os.path.exists(stop):
    t = time.perf_counter()
    try:
        c.request("GET", "/health"); r = c.getresponse(); r.read()
    except OSError:
        c = http.client.HTTPConnection(host, port, timeout=60)
        continue
    worst = max(worst, (time.perf_counter() - t) * 1000); polls += 1
    time.sleep(max(0.0, 0.1 - (time.perf_counter() - t)))
print(round(worst, 1), polls)
"""


async def soak(addr: str, http_port: int, clients: int, seconds: float, seed: int, t: Tally) -> None:
    host, port = addr.rsplit(":", 1)
    kinds, weights = list(t.counts), [44, 18, 9, 7, 5, 5, 5, 4, 3, 2, 1, 1, 1, 5, 1, 1, 1, 1, 1, 1]
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
           "--max-identity-tokens", str(COSTLY_CAP), "--grace", "5"]
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
        stop_file = os.path.join(store.name, "health-stop")
        poller = subprocess.Popen([sys.executable, "-c", HEALTH_POLL, "127.0.0.1", str(http_port), stop_file],
                                  stdout=subprocess.PIPE, text=True)
        trio.run(soak, addr, http_port, args.clients, args.seconds, args.seed, t)
        stop.set()
        open(stop_file, "w").close()
        worst_ms, polls = poller.communicate(timeout=120)[0].split()
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
        "health_worst_ms": float(worst_ms), "health_polls": int(polls),
    }
    for f in t.attacks_succeeded[:10]:
        print("ATTACK SUCCEEDED:", f)
    for f in t.failed[:10]:
        print("FAILED:", f)
    print(f"{t.requests} requests from {args.clients} clients in {wall:.0f} s: {t.completed} normal ones completed, "
          f"{len(t.failed)} failed; leaked blocks {out['leaked_blocks']}; RSS {rss0:.0f} -> {rss1:.0f} MB; "
          f"tasks {out['tasks_start']} -> {out['tasks_end']}; max active {out['max_active']}; server exit {rc}; "
          f"/health worst {out['health_worst_ms']} ms over {polls} polls")
    if args.json:
        print(json.dumps(out))
    ok = not t.failed and out["leaked_blocks"] == 0 and rc == 0 and out["tracebacks_in_log"] == 0 \
        and out["health_worst_ms"] <= HEALTH_BOUND_MS \
        and not t.attacks_succeeded
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
