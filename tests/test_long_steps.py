"""Long steps (a document's prefill chunk): one stops between layers for a short interactive
prompt that arrives while it runs (Engine._maybe_interrupt), is undone and planned again after
that prompt, and nothing is lost; its layers write into one workspace."""
from __future__ import annotations

import json
import threading

import pytest
import trio

from edgepaged.testing.serving import serving
from test_http import afetch

CHAT = "one two three four five six seven eight nine ten. one two three four five six seven eight nine ten. one two"
DOC = " ".join(f"w{i % 37} x{i % 11}" for i in range(120))
CMD = "turn on the light"


async def _ask(base: str, prompt: str, max_tokens: int) -> str:
    status, _, raw = await afetch(base + "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                                             "temperature": 0})
    assert status == 200, raw
    return json.loads(raw)["choices"][0]["text"]


async def test_a_long_step_stops_for_a_short_prompt_and_loses_nothing(tmp_path, monkeypatch):
    """A document's prefill chunk beside a decoding (and drafting) chat: a short prompt
    arrives while the step is held before its forward, the step stops at its first layer,
    its requests go back to what they had before it (the chat's appended token and drafts,
    the document's slots and blocks) and the next plan starts the prompt. Every answer is
    the one computed without the stop, every block comes back, and the document's cached
    prefix is sound: asked again, the same answer from the cache."""
    from edgepaged.engine import engine as engine_mod
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.testing.families import make_family_model, write_family_gguf
    hf = make_family_model(tmp_path / "m", "llama", seed=3)
    gguf = write_family_gguf(tmp_path / "m", tmp_path / "m.gguf", hf, qtype=0)
    asks = {"chat": (CHAT, 400), "doc": (DOC, 8), "cmd": (CMD, 8)}
    plain = {}
    async with serving(CpuRunner(gguf, num_blocks=128), http=True, engine={"speculation": "off"}) as server:
        for k, (p, n) in asks.items():
            plain[k] = await _ask(server.http_base, p, n)
    # the tiny model's steps take microseconds: any step may stop, whatever it has run
    monkeypatch.setattr(engine_mod, "INTERRUPT_MIN_S", 0.0)
    monkeypatch.setattr(engine_mod, "INTERRUPT_LEFT_S", -1e9)
    monkeypatch.setattr(engine_mod, "INTERRUPT_MAX_DONE", 1e9)
    runner = CpuRunner(gguf, num_blocks=128)
    got, held, go = {}, [], threading.Event()
    async with serving(runner, http=True) as server:
        eng = server.engine

        def hold(batch):       # in the worker: the step with the document's chunk beside the chat's decode
            if not held and eng._stoppable is not None and any(r.output_ids for r in batch.requests) \
                    and any(not r.output_ids for r in batch.requests):
                held.append([(r.id, r.num_known, r.num_slots) for r in batch.requests])
                go.wait(30)
        eng.step_hook = hold

        async def one(k):
            got[k] = await _ask(server.http_base, *asks[k])
        async with trio.open_nursery() as n:
            n.start_soon(one, "chat")
            with trio.fail_after(30):
                while not any(r.output_ids for r in eng.requests.values()):    # the chat decodes
                    await trio.sleep(0.001)
                n.start_soon(one, "doc")
                while not held:
                    await trio.sleep(0.005)
                n.start_soon(one, "cmd")
                while not runner.interrupt.is_set():      # the prompt reached the engine: the step stops
                    await trio.sleep(0.005)
            go.set()
        assert got == plain
        stats = eng.stats()
        assert stats["steps_interrupted"] == 1, stats
        assert stats["kv_blocks_used"] == 0
        eng.allocator.check_invariants()
        hits = stats["prefix_cache_hits"]
        assert await _ask(server.http_base, *asks["doc"]) == plain["doc"]
        assert eng.stats()["prefix_cache_hits"] > hits + 256      # its prompt came from the cache
        eng.allocator.check_invariants()


def test_a_prefill_step_s_layers_share_one_workspace(tmp_path):
    """The layers of a step write their products into one workspace: in a server (whose
    malloc maps every buffer of a megabyte or more fresh, `tame_malloc`) a buffer per layer
    had its pages faulted in again each time, ~15 % of a 512-token prefill step on the 1 B
    file. Each layer's QKV, gate-up and down products land in the same buffers, and the
    logits are those of buffers of their own."""
    import numpy as np

    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.testing.decode import make_allocator, prompt_logits
    from edgepaged.testing.families import make_family_model, write_family_gguf
    hf = make_family_model(tmp_path / "m", "llama", seed=3, overrides={"num_hidden_layers": 4})
    gguf = write_family_gguf(tmp_path / "m", tmp_path / "m.gguf", hf, qtype=0)
    runner = CpuRunner(gguf, num_blocks=64)
    prompt = [5 + i % 300 for i in range(300)]
    before = prompt_logits(runner, make_allocator(runner), prompt)
    seen: dict[str, set] = {}

    class Record:
        def __init__(self, name, lin):
            self.name, self.lin = name, lin

        def __getattr__(self, k):
            return getattr(self.lin, k)

        def __call__(self, x, out=None):
            y = self.lin(x) if out is None else self.lin(x, out)
            seen.setdefault(self.name, set()).add(y.ctypes.data)
            return y
    for la in runner.model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(la, name, Record(name, getattr(la, name)))
    after = prompt_logits(runner, make_allocator(runner), prompt)
    assert {k: len(v) for k, v in seen.items()} == {"qkv": 1, "o": 1, "gate_up": 1, "down": 1}, seen
    assert seen["o"] == seen["down"]           # each consumed by the next norm before the other writes
    np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_the_workspace_is_kept_from_step_to_step(tmp_path, family):
    """A server maps every buffer of a megabyte or more fresh (`tame_malloc`), so a workspace
    made per step was faulted in again each step: kept, a 512-token prefill of the 1 B file
    ran 1.06x faster (alternated in one process, bench/RESULTS.md). A later, shorter step
    writes into the same buffers and computes what buffers of its own give; a forward that
    finds the workspace taken (another forward on the model) takes buffers of its own. Qwen3's
    per-head q/k norms take theirs there too (made per layer: 300-430 ms of a 512-token step
    of a 36-layer Qwen3 shape), and Gemma 3's norms after o and down and its gelu."""
    import numpy as np

    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.testing.decode import make_allocator, prompt_logits
    from edgepaged.testing.families import make_family_model, write_family_gguf
    hf = make_family_model(tmp_path / "m", family, seed=4)
    gguf = write_family_gguf(tmp_path / "m", tmp_path / "m.gguf", hf, qtype=0)
    runner = CpuRunner(gguf, num_blocks=64)
    long_prompt, short_prompt = [5 + i % 300 for i in range(300)], [7 + i % 50 for i in range(120)]
    model = runner.model
    model._ws_lock.acquire()                   # taken: every forward makes its own buffers
    want_long = prompt_logits(runner, make_allocator(runner), long_prompt)
    want_short = prompt_logits(runner, make_allocator(runner), short_prompt)
    assert model._ws == {}
    model._ws_lock.release()
    got_long = prompt_logits(runner, make_allocator(runner), long_prompt)
    kept = {k: v.ctypes.data for k, v in model._ws.items()}
    names = {"h", "a", "out", "qkv", "gu", "m", "res"} | ({"qc", "qy", "kc", "ky"} if family != "llama" else set()) \
        | ({"post"} if family == "gemma3" else set())
    assert set(kept) == names and all(len(v) >= 300 for v in model._ws.values()), set(kept)
    got_short = prompt_logits(runner, make_allocator(runner), short_prompt)
    assert {k: v.ctypes.data for k, v in model._ws.items()} == kept     # the same buffers, not new ones
    np.testing.assert_array_equal(got_long, want_long)
    np.testing.assert_array_equal(got_short, want_short)
