"""Chats that outlive the context (issue 25): `truncate: "auto"` drops the oldest turns after the
system message until the prompt fits with room for the answer, says how many messages it
dropped on every door, and `edgepaged chat` tells the user once. The server here takes prompts
of at most 300 tokens (serve --max-prompt-tokens), so a few turns of the embedded model's
conversation outgrow it."""
import json

import httpx
import trio

from edgepaged.client import open_client
from edgepaged.request.frontend import Caller
from edgepaged.request.protocol import GenerateRequest
from edgepaged.testing import serving as box

LIMIT = 300
SYSTEM = {"role": "system", "content": "You are the house assistant of the Miller family. Be brief."}


def conversation(turns: int) -> list[dict]:
    out = [SYSTEM]
    for i in range(turns):
        out += [{"role": "user", "content": f"Question {i}: tell me something about the number {i} in two "
                                            f"sentences, please, with some detail about where it appears."},
                {"role": "assistant", "content": f"Answer {i}: the number {i} appears in many places, such as "
                                                 f"clocks, calendars and the pages of books you read."}]
    return out + [{"role": "user", "content": "And what is the capital of France?"}]


async def test_the_front_end_drops_whole_old_turns_and_keeps_the_system_message(embedded_runner):
    async with box.serving(embedded_runner, max_prompt_tokens=LIMIT) as server:
        front = server.front
        tok = front.tokenizer
        caller = Caller("t", "t", True)
        messages = conversation(12)
        item = GenerateRequest(1, "chat", messages=messages, max_tokens=16, truncate="auto")
        req = await front.build(item, caller)          # a Ticket: the engine's request and the door's figures
        text = tok.decode(req.req.prompt_ids, skip_special_tokens=False)
        assert len(req.req.prompt_ids) <= LIMIT and req.truncated > 0 and req.truncated % 2 == 0   # whole turns
        assert SYSTEM["content"] in text and "capital of France" in text
        assert "Question 0:" not in text                                    # the oldest went first
        kept = (len(messages) - 2 - req.truncated) // 2                    # turns left besides the last question
        assert f"Question {11}:" in text and (kept == 0 or f"Question {12 - kept}:" in text)
        bigger = await front.build(GenerateRequest(2, "chat", messages=messages, max_tokens=100, truncate="auto"),
                                   caller)
        assert bigger.truncated >= req.truncated                           # room for a longer answer
        short = await front.build(GenerateRequest(3, "chat", messages=conversation(1), max_tokens=16,
                                                  truncate="auto"), caller)
        assert short.truncated == 0                                         # it fits: nothing dropped
        try:                                                                # without truncate: refused, as before
            await front.build(GenerateRequest(4, "chat", messages=messages, max_tokens=16), caller)
        except Exception as e:   # noqa: BLE001
            assert getattr(e, "code", None) == "prompt_too_long"
        else:
            raise AssertionError("a prompt over the limit was taken")


async def test_every_door_says_how_many_messages_were_dropped(embedded_runner):
    messages = conversation(12)
    async with box.serving(embedded_runner, http=True, max_prompt_tokens=LIMIT) as server:
        base = server.http_base
        async with httpx.AsyncClient(timeout=120) as c:
            body = {"messages": messages, "max_tokens": 16, "temperature": 0, "truncate": "auto"}
            r = (await c.post(base + "/v1/chat/completions", json=body)).json()
            assert r["truncated_messages"] > 0 and r["usage"]["prompt_tokens"] <= LIMIT, r
            dropped = r["truncated_messages"]
            lines = []
            async with c.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data: {"):
                        lines.append(json.loads(line[6:]))
            assert [x.get("truncated_messages") for x in lines if x["choices"] and x["choices"][0]["finish_reason"]] \
                == [dropped]
            o = (await c.post(base + "/api/chat", json={"model": server.front.model, "messages": messages,
                                                        "stream": False, "truncate": "auto",
                                                        "options": {"num_predict": 16}})).json()
            assert o["truncated_messages"] == dropped and o["done"], o
            bad = await c.post(base + "/v1/completions", json={"prompt": "hi", "truncate": "sometimes"})
            assert bad.status_code == 400 and "truncate" in bad.json()["error"]["message"]
            # a prompt takes "auto" too: past the context it loses its middle (as Ollama's runner cuts it)
            cut = await c.post(base + "/v1/completions", json={"prompt": "word " * 9000, "truncate": "auto",
                                                               "max_tokens": 4})
            assert cut.status_code == 200 and int(cut.headers["x-edgepaged-truncated-tokens"]) > 0
            long = await c.post(base + "/v1/chat/completions", json={**body, "truncate": None})
            assert long.status_code == 400 and long.json()["error"]["code"] == "prompt_too_long"
        async with open_client(server.address) as client:
            async with client.chat(messages, max_tokens=16, truncate="auto") as stream:
                async for _ in stream:
                    pass
            assert stream.done["truncated_messages"] == dropped
        with trio.fail_after(5):
            while server.engine.stats()["kv_blocks_used"]:
                await trio.sleep(0.05)


def test_chat_tells_once_when_the_oldest_turns_no_longer_fit(tmp_path):
    """`edgepaged chat` sends truncate "auto": past the server's prompt limit it goes on, and says
    once that the oldest messages are left out."""
    import re
    import signal
    import subprocess

    from test_cli import CLI, PROMPT, ROOT, Pty
    serve = subprocess.Popen([*CLI, "serve", "--port", "0", "--no-http", "--no-mdns", "--host", "127.0.0.1",
                              "--kv-memory", "64M", "--max-prompt-tokens", "160", "--grace", "1"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in serve.stdout:
            m = re.search(r"ready on ([\d.]+:\d+)", line)
            if m:
                break
        term = Pty([*CLI, "chat", "--server", m.group(1), "--max-tokens", "24"])
        try:
            pos = term.expect(rb"Ctrl-D leaves.*\n.*> ", timeout=60)
            for i in range(7):
                term.send(f"Tell me one short fact about the number {i}, please.\r".encode())
                pos = term.expect(rf"number {i}, please\.\r?\n".encode(), start=pos)
                pos = term.expect(PROMPT, start=pos, timeout=60)
            term.send(b"\x04")
            assert term.wait() == 0
        finally:
            term.kill()
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=20)
    out = term.out.decode(errors="replace")
    assert "error" not in out.lower(), out
    assert out.count("longer than the model's context") == 1, out
