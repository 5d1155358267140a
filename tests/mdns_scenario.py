"""The discovery scenario, run by test_mdns.py inside its own network namespace (only `lo`):
never run it on a host network. Exits 0 when every step held; prints each step."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import trio

from edgepaged.server.mdns import Advertiser, open_browser, txt_properties

IFACE = "127.0.0.1"
CLI = [sys.executable, "-m", "edgepaged.cli"]
ENV = {**os.environ, "EDGEPAGED_MDNS_INTERFACE": IFACE}
ENV.pop("EDGEPAGED_TOKEN", None)


def step(text):
    print(f"[mdns] {text}", flush=True)


def cli(*args, input=None, timeout=120):
    r = subprocess.run([*CLI, *args], input=input, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert r.returncode == 0, f"{args}: rc {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def ls() -> list[dict]:
    return json.loads(cli("ls", "--json", "--timeout", "1.5"))


def start_server(*where, env=ENV):
    where = where or ("--mdns-interface", IFACE)
    proc = subprocess.Popen([*CLI, "serve", "--port", "0", "--http-port", "0", *where,
                             "--kv-memory", "64M", "--mdns-refresh", "0.3"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        banner = next((x for x in lines if "ready on" in x), None)
        if banner:
            return proc, lines, banner
        assert proc.poll() is None, "".join(lines)
        time.sleep(0.1)
    raise AssertionError("the server did not start:\n" + "".join(lines))


async def scenario():
    proc, lines, banner = start_server()
    step(banner.strip())
    port = int(re.search(r"ready on [\d.]+:(\d+)", banner).group(1))
    name = re.search(r"mDNS '([^']+)'", banner).group(1)
    assert "reachable from the local network" in banner and "open to anyone" in banner

    found = ls()
    if not found:     # a busy machine: the first announcement can come after ls's 1.5 s
        found = json.loads(cli("ls", "--json", "--timeout", "5"))
    step(f"ls: {found}")
    assert len(found) == 1, found
    rec = found[0]
    assert rec["port"] == port and rec["address"] == f"127.0.0.1:{port}" and f"{rec['name']}._edgepaged._tcp.local." == name
    assert rec["model"] == "SmolLM2-135M-Instruct.Q4_1" and rec["version"] == 1 and rec["auth"] is False
    assert rec["context_length"] > 0 and rec["running"] == 0 and rec["waiting"] == 0
    http_port = int(re.search(r"HTTP \(OpenAI API, chat page\) http://[\d.]+:(\d+)/", banner).group(1))
    assert rec["http_port"] == http_port, rec      # the TXT record says where HTTP is
    assert f"http://127.0.0.1:{http_port}/" in cli("ls", "--timeout", "1.5")   # and the table shows its URL

    step("a long request: the TXT load follows")
    # (long enough to outlast the next ls calls on a fast box: it is killed below)
    long = subprocess.Popen([*CLI, "ask", "--max-tokens", "3000", "Write a very long story about a dragon."],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    assert long.stdout.read(1), long.stderr.read()      # found by discovery, streaming
    deadline = time.monotonic() + 15
    while True:
        rec = ls()[0]
        if rec["running"] == 1 and rec["kv_usage"] > 0:
            break
        assert time.monotonic() < deadline, rec
    step(f"ls under load: running {rec['running']}, kv {rec['kv_usage']}")

    # a busier decoy at a dead port: discovery must pick the least loaded server, the real one
    decoy_props = txt_properties(version=1, model="decoy", context_length=10, auth=False, running=7, waiting=3,
                                 kv_usage=0.9)
    async with Advertiser(port=1, properties=decoy_props, addresses=[IFACE], interface=IFACE, instance="decoy"):
        deadline = time.monotonic() + 20      # a busy machine may answer a browse late: ask again
        while True:
            names = [r["name"] for r in ls()]
            if len(names) == 2 or time.monotonic() > deadline:
                break
        step(f"ls with a decoy: {names}")
        assert names[-1] == "decoy" and len(names) == 2
        out = cli("chat", input="What is the capital of France?\n")
        step(f"chat by discovery: {out.strip()!r}")
        assert "Paris" in out

    # a stale record that looks idle (a server gone without withdrawing it) while the real one is busy: the
    # client tries it first, cannot connect, and must go on to the real one
    stale_props = txt_properties(version=1, model="stale", context_length=10, auth=False, running=0, waiting=0,
                                 kv_usage=0.0)
    async with Advertiser(port=1, properties=stale_props, addresses=[IFACE], interface=IFACE, instance="stale"):
        deadline = time.monotonic() + 20      # as above: a busy machine may answer a browse late
        while True:
            names = [r["name"] for r in ls()]
            if len(names) == 2 or time.monotonic() > deadline:
                break
        step(f"ls with a stale idle record: {names} (stale first while the long answer runs)")
        assert "stale" in names and len(names) == 2
        out = cli("chat", input="What is the capital of France?\n")
        step(f"chat past the stale record: {out.strip()!r}")
        assert "Paris" in out
    long.kill()
    long.wait()

    async with open_browser(IFACE) as browser:
        assert await browser.wait_for(lambda recs: any(r.port == port for r in recs), 5)
        step("SIGTERM: the record must go")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        gone = await browser.wait_for(lambda recs: not any(r.port == port for r in recs), 10)
        step(f"withdrawn: {gone} after {time.monotonic() - t0:.2f} s")
        assert gone
    assert await trio.to_thread.run_sync(proc.wait, 30) == 0
    step("".join(lines[-2:]).strip())
    assert any("withdrawing the mDNS record" in x for x in lines)
    assert ls() == []

    # a server bound to loopback, no interface named: announced on loopback only (clients on
    # the box find it), never on every interface of the box
    env = {k: v for k, v in ENV.items() if k != "EDGEPAGED_MDNS_INTERFACE"}
    proc, lines, banner = start_server("--host", "127.0.0.1", env=env)
    step(banner.strip())
    try:
        assert "(announced on 127.0.0.1 only)" in banner and "open to anyone on this box" in banner, banner
        port = int(re.search(r"ready on [\d.]+:(\d+)", banner).group(1))
        found = ls() or json.loads(cli("ls", "--json", "--timeout", "5"))
        step(f"ls, a loopback server: {found}")
        assert [r["address"] for r in found] == [f"127.0.0.1:{port}"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    step("ok")


if __name__ == "__main__":
    trio.run(scenario)
