"""Speculative decoding with a draft model (issue 36): a second model with the target's
tokenizer guesses each drafting request's next tokens; the target checks them in one forward.
The draft's KV lives in the target's pool (its own sequences, its own salt), is the first to
go when the pool runs short, and every block comes back. Greedy and seeded answers are the
plain ones whatever the draft guesses: a draft that is the target itself has every guess
kept, another model few."""
from __future__ import annotations

import json

import pytest
import trio

from edgepaged.engine.draft import DRAFT_SEQ_BASE, DraftError, check_pair
from edgepaged.testing.serving import serving
from test_http import afetch
from test_speculation import PROMPT

PROMPTS = [PROMPT, "the cat sat on the mat and the cat sat on the", "a b a b a b a b", "x"]


def _pair(tmp_path, family="llama", target_seed=11, draft_seed=11, num_blocks=64, runtime="cpu"):
    from edgepaged.model import ModelRunner
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.testing.families import make_family_model, write_family_gguf
    files = {}
    for seed in {target_seed, draft_seed}:
        hf = make_family_model(tmp_path / f"m{seed}", family, seed=seed)
        files[seed] = write_family_gguf(tmp_path / f"m{seed}", tmp_path / f"m{seed}.gguf", hf, qtype=0)
    make = (lambda p, n: CpuRunner(p, num_blocks=n)) if runtime == "cpu" else (lambda p, n: ModelRunner(p, num_blocks=n))
    plain = make(files[target_seed], num_blocks)
    target = make(files[target_seed], num_blocks)
    target.attach_draft(make(files[draft_seed], num_blocks))
    return plain, target


async def _answers(runner, speculation, prompts, max_tokens=40, **body):
    out = []
    async with serving(runner, http=True, engine={"speculation": speculation}) as server:
        for p in prompts:
            status, _, raw = await afetch(server.http_base + "/v1/completions",
                                          {"prompt": p, "max_tokens": max_tokens, "temperature": 0, **body})
            assert status == 200, raw
            out.append(json.loads(raw)["choices"][0]["text"])
        stats = server.engine.stats()
        assert stats["kv_blocks_used"] == 0, stats
        assert not any(s >= DRAFT_SEQ_BASE for s in server.engine.allocator.seq_ids())
        server.engine.allocator.check_invariants()
    return out, stats


@pytest.mark.parametrize("runtime", ["cpu", "torch"])
async def test_a_draft_that_is_the_target_has_every_guess_kept(tmp_path, runtime):
    plain_runner, target = _pair(tmp_path, runtime=runtime)
    plain, _ = await _answers(plain_runner, "off", PROMPTS)
    spec, stats = await _answers(target, "draft", PROMPTS)
    assert spec == plain
    s = stats["speculation"]["interactive"]
    assert s["drafted"] > 20 and s["accepted"] == s["drafted"], s
    assert stats["draft_model"]["rounds"] > 0


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
async def test_another_draft_changes_nothing_in_the_answer(tmp_path, family):
    plain_runner, target = _pair(tmp_path, family, target_seed=11, draft_seed=12)
    plain, _ = await _answers(plain_runner, "off", PROMPTS)
    spec, stats = await _answers(target, "draft", PROMPTS)
    assert spec == plain
    s = stats["speculation"]["interactive"]
    assert s["drafted"] > 0 and s["accepted"] < s["drafted"], s     # a stranger guesses wrong


async def test_seeded_sampling_with_a_draft_is_the_plain_answer(tmp_path):
    plain_runner, target = _pair(tmp_path)
    body = {"temperature": 0.9, "seed": 5}
    plain, _ = await _answers(plain_runner, "off", PROMPTS, **body)
    spec, stats = await _answers(target, "draft", PROMPTS, **body)
    assert spec == plain
    assert stats["speculation"]["interactive"]["accepted"] > 0


async def test_draft_blocks_are_counted_and_go_first_when_the_pool_is_short(tmp_path):
    """Eight requests at once on a pool of about two: the draft's sequences are taken back,
    requests are preempted and resumed, every answer is its plain one and every block
    (the draft's too) comes back."""
    from edgepaged.model.cpu.runner import CpuRunner
    plain_runner, _ = _pair(tmp_path)
    prompts = [f"{i} one two three one two three one two" for i in range(8)]
    plain, _ = await _answers(plain_runner, "off", prompts)
    target = CpuRunner(plain_runner.model_path, num_blocks=20)
    target.attach_draft(CpuRunner(plain_runner.model_path, num_blocks=20))
    got = [None] * len(prompts)
    peak = [0]
    async with serving(target, http=True, engine={"speculation": "draft", "spec_max_running": 8}) as server:
        eng = server.engine

        async def one(i):
            status, _, raw = await afetch(server.http_base + "/v1/completions",
                                          {"prompt": prompts[i], "max_tokens": 40, "temperature": 0})
            assert status == 200, raw
            got[i] = json.loads(raw)["choices"][0]["text"]

        async def watch():
            while True:
                peak[0] = max(peak[0], len(eng.drafter.seqs))
                await trio.sleep(0.001)
        async with trio.open_nursery() as n:
            n.start_soon(watch)
            async with trio.open_nursery() as m:
                for i in range(len(prompts)):
                    m.start_soon(one, i)
            n.cancel_scope.cancel()
        stats = eng.stats()
        assert stats["kv_blocks_used"] == 0
        eng.allocator.check_invariants()
    assert got == plain
    assert peak[0] > 0 and stats["num_preemptions"] > 0 and stats["speculation"]["interactive"]["drafted"] > 0
    assert stats["draft_model"]["reclaimed"] > 0, stats["draft_model"]


def test_a_draft_with_another_tokenizer_is_refused(tmp_path, embedded_runner):
    plain_runner, _ = _pair(tmp_path)
    with pytest.raises(DraftError, match="another tokenizer"):
        check_pair(plain_runner, embedded_runner)


def test_serve_with_a_draft_model(tmp_path):
    """`edgepaged serve --model M --draft D` on loopback: the draft's load is said, answers
    come drafted (/stats), and a draft with another tokenizer is refused before serving."""
    import subprocess
    import sys
    import urllib.request

    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http = s.getsockname()[1]
    plain_runner, _ = _pair(tmp_path)
    path = str(plain_runner.model_path)
    cmd = [sys.executable, "-m", "edgepaged.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--http-port",
           str(http), "--no-mdns", "--kv-memory", "16M", "--grace", "1", "--model", path]
    proc = subprocess.Popen([*cmd, "--draft", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "ready on" in line:
                break
        assert any("loaded the draft model" in s and "blocks shared" in s for s in seen), seen
        req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", json.dumps(
            {"prompt": PROMPT, "max_tokens": 32, "temperature": 0}).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.load(r)["usage"]["completion_tokens"] > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/stats", timeout=10) as r:
            stats = json.load(r)
        assert stats["draft_model"]["rounds"] > 0 and stats["speculation"]["interactive"]["accepted"] > 0, stats
    finally:
        proc.terminate()
        proc.wait(30)
    # the embedded model's tokenizer is another one: refused, with the reason
    r = subprocess.run([*cmd, "--draft", _embedded()], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "another tokenizer" in r.stderr, r.stderr[-2000:]


def _embedded() -> str:
    from edgepaged.model.loader import default_model_path
    return str(default_model_path())
