"""Faults: out of KV memory under a burst (requests wait or are preempted, never fail, and
the waiting shows in the metrics), and SIGKILL followed by a restart that serves at once."""
import os
import signal
import socket
import sys

import trio

from edgepaged.client import SyncClient
from edgepaged.engine import Engine, EngineConfig, Request, TokenEvent
from edgepaged.model import ModelRunner, SamplingParams

from test_cli import ServeProcess


async def test_burst_beyond_the_kv_pool_waits_never_fails(tiny_model_dir):
    runner = ModelRunner(tiny_model_dir, num_blocks=20, block_size=16)   # 320 tokens of KV in all
    done = []
    async with Engine(runner, EngineConfig(max_num_seqs=16)) as eng:
        async def one(i):
            r = Request(prompt_ids=[3 + (i * 7 + k) % 290 for k in range(60)],
                        params=SamplingParams(temperature=0, ignore_eos=True, max_tokens=40))
            n = 0
            async with eng.stream(r) as events:
                async for ev in events:
                    if isinstance(ev, TokenEvent):
                        n += len(ev.token_ids)
                    else:
                        done.append((ev.finish_reason, n))

        async with trio.open_nursery() as nursery:   # everyone at once: 30 x 100 tokens >> 320
            for i in range(30):
                nursery.start_soon(one, i)
        s = eng.stats()
    assert done == [("length", 40)] * 30, "no request lost or failed"
    assert s["num_preemptions"] > 0 or s["queue_s"]["p90"] > 0
    assert s["queue_s"]["p99"] > s["queue_s"]["p50"] >= 0, "the waiting shows in the metrics"
    assert s["kv_blocks_used"] == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigkill_then_restart_serves_at_once(tiny_model_dir):
    port = _free_port()
    cmd = [sys.executable, "-m", "edgepaged.cli", "serve", "--model", str(tiny_model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--no-mdns", "--no-http", "--kv-memory", "16M"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    first = ServeProcess(cmd, env)
    try:
        first.wait_for("ready on", 120)
        with SyncClient(f"127.0.0.1:{port}") as c:
            stream = c.generate("hello world", max_tokens=500, ignore_eos=True)
            next(iter(stream))                 # mid-answer...
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait(10)
        second = ServeProcess(cmd, env)        # ...and straight back on the same port
        try:
            second.wait_for("ready on", 120)
            with SyncClient(f"127.0.0.1:{port}") as c:
                text, done = c.generate("hello world", max_tokens=5, ignore_eos=True).collect()
                assert done["finish_reason"] == "length"
        finally:
            second.proc.send_signal(signal.SIGTERM)
            assert second.proc.wait(30) == 0
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
