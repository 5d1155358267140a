"""The CLI against a real `serve` subprocess started the README's way (without mDNS: tests
never advertise on the host network; test_mdns.py covers discovery in its own namespace)."""
import hashlib
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
CLI = [str(BIN / "edgepaged")] if (BIN / "edgepaged").exists() else [sys.executable, "-m", "edgepaged.cli"]
SERVE_ARGS = ["--port", "0", "--http-port", "0", "--host", "127.0.0.1", "--no-mdns", "--kv-memory", "64M",
              "--grace", "1"]


def readme_serve_command() -> list[str]:
    """`./run.sh serve` when this venv is the one run.sh set up (its stamp is current: the set-up
    step is then a no-op), else what run.sh execs."""
    stamp = hashlib.sha256(b"".join((ROOT / f).read_bytes() for f in ("pyproject.toml", "packaging/constraints.txt",
                                                                      "run.sh"))).hexdigest()[:16]
    venv_stamp = Path(sys.prefix, ".deps-stamp")
    if venv_stamp.exists() and venv_stamp.read_text().strip() == stamp:
        return [str(ROOT / "run.sh"), "serve", *SERVE_ARGS]
    return [sys.executable, "-m", "edgepaged.cli", "serve", *SERVE_ARGS]


class ServeProcess:
    def __init__(self, cmd, env):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=ROOT)
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if m := re.search(pattern, line):
                    return m
            if self.proc.poll() is not None and not any(re.search(pattern, x) for x in self.lines):
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} in the server's output:\n{''.join(self.lines)}")


@pytest.fixture(scope="module")
def server():
    env = {**os.environ, "EDGEPAGED_VENV": sys.prefix}
    env.pop("EDGEPAGED_TOKEN", None)
    s = ServeProcess(readme_serve_command(), env)
    m = s.wait_for(r"ready on ([\d.]+):(\d+)", timeout=180)
    s.address = f"{m.group(1)}:{m.group(2)}"
    yield s
    if s.proc.poll() is None:
        s.proc.kill()
        s.proc.wait()


def cli(*args, input=None, timeout=120):
    return subprocess.run([*CLI, *args], input=input, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_banner_says_where_and_how_much(server):
    banner = next(line for line in server.lines if "ready on" in line)
    assert "SmolLM2-135M-Instruct" in banner and "mDNS off" in banner
    assert re.search(r"KV capacity \d+ tokens", banner)
    assert "open to anyone on this box" in banner      # bound to 127.0.0.1: not the local network


def test_http_beside_the_msgpack_port(server):
    import urllib.request
    banner = next(line for line in server.lines if "ready on" in line)
    m = re.search(r"HTTP \(OpenAI API, chat page\) (http://127\.0\.0\.1:\d+/)", banner)
    assert m, "the banner says where HTTP is"
    with urllib.request.urlopen(m.group(1) + "health", timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"
    with urllib.request.urlopen(m.group(1), timeout=10) as r:
        assert b"<title>edgepaged chat</title>" in r.read()


def test_wrong_port_is_named_on_both_sides(server):
    """The protocol client at the HTTP port is told so; a browser at the msgpack port gets a
    short HTTP answer naming the HTTP port."""
    import socket
    banner = next(line for line in server.lines if "ready on" in line)
    http = re.search(r"HTTP \(OpenAI API, chat page\) http://127\.0\.0\.1:(\d+)/", banner).group(1)
    r = cli("ask", "--server", f"127.0.0.1:{http}", "hi", timeout=60)
    assert r.returncode != 0 and "HTTP port" in r.stderr and "1213486160" not in r.stderr, r.stderr
    host, port = server.address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: box\r\n\r\n")
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400") and f"the HTTP port is {http}".encode() in reply, reply


def test_a_used_port_fails_at_once(server):
    """Ports are bound before the model loads: a second serve on a used port says so in < 1 s."""
    host, port = server.address.split(":")
    t0 = time.monotonic()
    r = subprocess.run([*CLI, "serve", "--host", host, "--port", port, "--no-mdns"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    took = time.monotonic() - t0
    assert r.returncode != 0 and "Address already in use" in r.stderr and f"{host}:{port}" in r.stderr, r.stderr
    assert took < 1.0, took


def test_ask_answers_paris(server):
    r = cli("ask", "--server", server.address, "What is the capital of France?")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_ask_for_more_than_the_context_gets_what_fits(server):
    """--max-tokens past the context asks for "up to the server's limit": the server fits it to
    the prompt (a number it refused: prompt + max_tokens would pass the context)."""
    r = cli("ask", "--server", server.address, "--json", "--temperature", "0", "--max-tokens", "100000", "Say hi.")
    assert r.returncode == 0, r.stdout + r.stderr
    done = json.loads(r.stdout.splitlines()[-1])
    assert done["error"] is None and done["finish_reason"] in ("stop", "length") and done["text"]
    assert "DeprecationWarning" not in r.stderr


def test_ask_for_a_model_the_box_does_not_serve_fails(server):
    """A one-model box answered `--model nope` with its own model and exit 0; the Ollama door
    says 404. Now the CLI says the model is not there, exits 1, and the served name works."""
    r = cli("ask", "--server", server.address, "--model", "nope", "hi")
    assert r.returncode == 1 and "no model 'nope'" in r.stderr and "SmolLM2" in r.stderr, r.stdout + r.stderr
    r = cli("ask", "--server", server.address, "--json", "--model", "nope", "hi")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "model_not_found"
    r = cli("ask", "--server", server.address, "--model", "SmolLM2-135M-Instruct.Q4_1:latest", "--max-tokens", "2",
            "hi")
    assert r.returncode == 0, r.stderr


def test_ask_json_and_stdin(server):
    r = cli("ask", "--server", server.address, "--json", input="What is the capital of France?")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "Paris" in out["text"] and out["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] > 0 and out["timings"]["ttft_s"] > 0



def test_ask_defaults_end_and_errors_come_as_json(server):
    """An answer cut at --max-tokens says so; --json reports errors as JSON too."""
    r = cli("ask", "--server", server.address, "--max-tokens", "3", "Write a long story about a dragon.")
    assert r.returncode == 0 and "length limit (3 tokens)" in r.stderr, r.stderr
    r = cli("ask", "--server", server.address, "--json", "--max-tokens", "3", "--seed", "7", "--temperature", "0.8",
            "--top-p", "0.9", "--repeat-penalty", "1.3", "Hello")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 3
    r = cli("ask", "--server", "127.0.0.1:1", "--json", "hi")
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["error"]["code"] and out["error"]["message"] and out["text"] is None


def test_the_last_server_is_tried_before_discovery(server, tmp_path):
    """A second command without --server finds the server that answered last in < 0.5 s
    (no mDNS: it is off in tests), and a dead cached one falls back to discovery."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "EDGEPAGED_SERVER_CACHE": "1"}
    r = subprocess.run([*CLI, "stats", "--json", "--server", server.address], env=env, capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0 and (tmp_path / "edgepaged" / "last_server").read_text().strip() == server.address
    code = ("import time, trio; from edgepaged.client import open_client\n"
            "async def main():\n"
            "    t = time.monotonic()\n"
            "    async with open_client(None, discover_timeout_s=0.2, mdns_interface='127.0.0.1') as c:\n"
            "        print(c.address, time.monotonic() - t)\n"
            "trio.run(main)")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    address, took = r.stdout.split()
    assert r.returncode == 0 and address == server.address and float(took) < 0.5, r.stderr
    (tmp_path / "edgepaged" / "last_server").write_text("127.0.0.1:1\n")    # a server that went away
    # (discovery, if any, on loopback only)
    r = subprocess.run([*CLI, "stats", "--json", "--timeout", "0.3", "--mdns-interface", "127.0.0.1"], env=env,
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode != 0 and "no edgepaged server answered" in r.stderr, r.stderr
    r = subprocess.run([*CLI, "stats", "--json", "--no-cache", "--timeout", "0.3", "--mdns-interface", "127.0.0.1"],
                       env={**env, "XDG_CACHE_HOME": str(tmp_path / "none")}, capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode != 0 and not (tmp_path / "none" / "edgepaged").exists()

def test_stats_and_top(server):
    r = cli("stats", "--server", server.address, "--json")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_total"] > 0
    r = cli("top", "--server", server.address, "--count", "2", "--interval", "0.1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("KV blocks") == 2 and "prefix" in r.stdout and "tokens/s" in r.stdout



def test_top_quits_on_q_and_idle_speed_is_zero(server):
    term = Pty([*CLI, "top", "--server", server.address, "--interval", "0.2"])
    try:
        term.expect(rb"q quits", timeout=60)
        term.send(b"q")
        assert term.wait() == 0
    finally:
        term.kill()
    from edgepaged.engine.metrics import Metrics
    m = Metrics("m")
    m.on_step(running=1, waiting=0, blocks_used=1, blocks_total=8, generated=50, preemptions=0, reserved_slots=16,
              unused_slots=0)
    now = time.monotonic()
    assert m.tokens_per_s(now) > 0 and m.tokens_per_s(now + 11) == 0.0

def test_unreachable_server_is_a_clear_error():
    r = cli("ask", "--server", "127.0.0.1:1", "hi")
    assert r.returncode == 1 and "cannot connect to 127.0.0.1:1" in r.stderr and "Traceback" not in r.stderr


PROMPT = rb"\n(?:\x1b\[\?2004h)?> "   # the chat's prompt (readline may switch bracketed paste on before it)


class Pty:
    def __init__(self, argv):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:   # the child: a session leader whose controlling terminal is the pty
            try:
                # as a background job of a script starts it: Ctrl-C must still work on a terminal
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                os.execv(argv[0], argv)
            finally:
                os._exit(127)
        self.out = b""
        self.exited = False

    def expect(self, pattern: bytes, timeout: float = 60, start: int = 0) -> int:
        """Wait until `pattern` appears in the output after `start`; returns the end of the match."""
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.out[start:])
            if m:
                return start + m.end()
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} in:\n{self.out.decode(errors='replace')}")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:
                    data = b""
                if not data:
                    raise AssertionError(f"EOF before {pattern!r}:\n{self.out.decode(errors='replace')}")
                self.out += data

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def wait(self, timeout: float = 20) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.exited = True
                return os.waitstatus_to_exitcode(status)
            try:   # keep draining so the child never blocks on a full pty
                if select.select([self.fd], [], [], 0.05)[0]:
                    self.out += os.read(self.fd, 4096)
            except OSError:
                pass
        raise AssertionError("the chat did not exit")

    def kill(self) -> None:
        if not self.exited:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.exited = True
        os.close(self.fd)


def test_chat_in_a_terminal(server):
    term = Pty([*CLI, "chat", "--server", server.address, "--max-tokens", "400"])
    try:
        pos = term.expect(rb"Ctrl-D leaves.*\n.*> ", timeout=60)
        term.send(b"Write a very long story about a dragon who learns to cook.\r")
        pos = term.expect(rb"learns to cook\.\r?\n", start=pos)          # the echo of the line
        pos = term.expect(rb"\w+\W+\w+\W+\w+\W+\w+", start=pos, timeout=60)   # the answer is streaming
        streamed_before_stop = term.out[pos - 20:pos]
        term.send(b"zzqq")                              # typed while the answer streams: neither echoed nor kept
        time.sleep(0.3)
        term.send(b"\x03")                                                # Ctrl-C mid-answer
        pos = term.expect(rb"\[stopped\]", start=pos, timeout=30)
        pos = term.expect(rb"> ", start=pos)
        term.send(b"What is the capital of France?\r")
        pos = term.expect(rb"Paris", start=pos + 10, timeout=90)
        pos = term.expect(rb"> ", start=pos, timeout=90)
        term.send(b"\x04")                                                # Ctrl-D leaves
        assert term.wait() == 0
    finally:
        term.kill()
    assert streamed_before_stop
    assert b"zzqq" not in term.out, term.out[-600:]
    stats = json.loads(cli("stats", "--server", server.address, "--json").stdout)
    assert stats["finished"].get("cancelled", 0) >= 1
    assert stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0



def test_chat_commands_blocks_and_saved_conversations(server, tmp_path):
    """Unknown /commands are errors (never sent); \"\"\" opens a multi-line message; /set
    parameter, /show, /save and /load."""
    saved = tmp_path / "talk.json"
    term = Pty([*CLI, "chat", "--server", server.address, "--max-tokens", "12"])
    try:
        pos = term.expect(rb"Ctrl-D leaves.*\n.*> ", timeout=60)
        term.send(b"/frobnicate now\r")
        pos = term.expect(rb"unknown command /frobnicate", start=pos)
        term.send(b"/set parameter temperature 0.5\r")
        pos = term.expect(rb"\(set temperature 0\.5\)", start=pos)
        term.send(b"/show\r")
        pos = term.expect(rb"SmolLM2-135M-Instruct.*\"temperature\": 0\.5", start=pos)
        term.send(b'"""Say hello\r')
        pos = term.expect(rb"\.\.\. ", start=pos)                        # the block goes on
        term.send(b'to me."""\r')
        pos = term.expect(rb'to me\."""\r?\n', start=pos)
        pos = term.expect(PROMPT, start=pos, timeout=60)            # the answer, then the prompt again
        term.send(b"\x1b[200~A pasted line,\nand the next one.\x1b[201~\r")   # bracketed paste: one message
        pos = term.expect(rb"next one\.", start=pos)
        pos = term.expect(PROMPT, start=pos, timeout=60)
        term.send(f"/save {saved}\r".encode())
        pos = term.expect(rb"\(saved 4 messages", start=pos)
        term.send(b"/reset\r")
        pos = term.expect(rb"conversation cleared", start=pos)
        term.send(f"/load {saved}\r".encode())
        pos = term.expect(rb"\(loaded 4 messages", start=pos)
        # Ctrl-D once the prompt reads again (sent earlier it can land before readline takes
        # the terminal, and be lost: CI saw the chat wait on)
        pos = term.expect(PROMPT, start=pos)
        term.send(b"\x04")
        assert term.wait() == 0
    finally:
        term.kill()
    data = json.loads(saved.read_text())
    assert data["messages"][0] == {"role": "user", "content": "Say hello\nto me."}
    assert data["params"]["temperature"] == 0.5 and data["messages"][1]["role"] == "assistant"
    assert data["messages"][2] == {"role": "user", "content": "A pasted line,\nand the next one."}

CODE_QUESTION = "Show me a Python hello world program."   # the embedded model answers with a ```python block


def screen_text(data: bytes, columns: int = 80) -> str:
    """The text a terminal shows after `data` (pyte, a terminal emulator), blank lines dropped."""
    import pyte
    screen = pyte.Screen(columns, 400)
    pyte.ByteStream(screen).feed(data)
    return "\n".join(line.rstrip() for line in screen.display if line.strip())


def _one_chat_answer(server, question: str, *flags: str) -> bytes:
    """The bytes `chat` writes to its terminal for one answer."""
    term = Pty([*CLI, "chat", "--server", server.address, *flags])
    try:
        pos = term.expect(rb"Ctrl-D leaves.*\n.*> ", timeout=60)
        term.send(question.encode() + b"\r")
        pos = term.expect(re.escape(question[-8:].encode()) + rb"\r?\n", start=pos)
        end = term.expect(PROMPT, start=pos, timeout=90)
        term.send(b"\x04")
        assert term.wait() == 0
        return term.out[pos:end]
    finally:
        term.kill()


def test_answers_render_as_markdown_in_a_terminal(server):
    """In a terminal the answer is rendered (rich): no ``` fences or `backticks` left, code styled;
    --plain, and any stdout that is not a terminal, get the model's text as it is."""
    rendered = _one_chat_answer(server, CODE_QUESTION)
    text = screen_text(rendered)   # what the terminal shows (the raw text of a block is erased once rendered)
    assert "print(" in text and "Hello World" in text, text
    assert "```" not in text and "`" not in text, text                   # fences and backticks rendered away
    assert re.search(rb"\x1b\[[0-9;]*m[^\x1b]*print", rendered), rendered  # the code is styled

    plain = _one_chat_answer(server, CODE_QUESTION, "--plain")
    assert b"```python" in plain and not re.search(rb"\x1b\[[0-9;]*m", plain.split(b"\n> ")[0]), plain

    piped = cli("ask", "--server", server.address, CODE_QUESTION)        # stdout is a pipe: plain
    assert piped.returncode == 0 and "```python" in piped.stdout and "\x1b[" not in piped.stdout


def test_sigterm_finishes_running_requests_then_exits_0(server):
    """Last in this file: it stops the module's server."""
    # greedy: its first 1000 tokens are known to hold no end of turn, more than the 10 s grace makes
    long = subprocess.Popen([*CLI, "ask", "--server", server.address, "--max-tokens", "2000", "--temperature", "0",
                             "Write a very long story about a dragon."], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    first = long.stdout.read(1)   # the answer is streaming
    assert first
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0
    server.wait_for(r"SIGTERM: stopping", timeout=1)
    server.wait_for(r"stopped \(1 request\(s\) cancelled\)", timeout=5)
    out, err = long.communicate(timeout=30)
    assert long.returncode == 1 and "shutting down" in err


def test_addresses():
    from edgepaged.client import ServerError, parse_address
    assert parse_address("box") == ("box", 7878)
    assert parse_address("10.0.0.2:9000") == ("10.0.0.2", 9000)
    assert parse_address("[fe80::1]:9000") == ("fe80::1", 9000)
    assert parse_address("[fe80::1]") == ("fe80::1", 7878) and parse_address("fe80::1") == ("fe80::1", 7878)
    assert parse_address("http://127.0.0.1:17878") == ("127.0.0.1", 17878)
    assert parse_address("http://box/") == ("box", 7878) and parse_address(" tcp://[::1]:9/x ") == ("::1", 9)
    for bad in ("box:", ":", "box:70000", "box:x", "http://"):
        with pytest.raises(ServerError):
            parse_address(bad)



def test_markdown_blocks_are_cut_where_they_end():
    """A block is printed rendered once complete: a paragraph at a blank line, a fenced block at
    its own closing fence (not at a blank line inside it, not at a shorter or other fence)."""
    from edgepaged.client.markdown import Blocks
    b = Blocks()
    text = ("Intro line\nstill intro\n\n````python\nx = 1\n\n```\nnot the end\n````\nAfter\n\n"
            "~~~\ncode\n~~~\n- a\n- b")
    done = [blk for i in range(len(text)) for blk in b.feed(text[i])]   # a character at a time
    assert done == ["Intro line\nstill intro", "````python\nx = 1\n\n```\nnot the end\n````", "After",
                    "~~~\ncode\n~~~"]
    assert b.pending() == "- a\n- b" and b.close() == "- a\n- b" and b.pending() == ""


def test_every_serve_flag_says_what_it_does():
    """`serve --help`: each flag has a description; the benchmark-only one says it is for benchmarks."""
    from edgepaged.cli import serve
    missing = [p.opts[0] for p in serve.params if not p.hidden and not (getattr(p, "help", None) or "").strip()]
    assert not missing, missing
    contiguous = next(p for p in serve.params if "--contiguous" in p.opts)
    assert contiguous.hidden or "benchmark" in contiguous.help
