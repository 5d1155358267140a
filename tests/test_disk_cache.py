"""The prefix cache's disk tier (issue 38, section 3): a computed prompt's full KV blocks are
written to disk; a prompt that misses the RAM cache (evicted, or a restarted server) reads
them back, bit for bit, instead of computing them; a torn or corrupt file is a miss; another
model or another identity never hits; a disk that refuses writes turns the writes off with
one log line and nothing else changes. Real engines, the real allocator, the embedded model
(CPU runtime) and real files."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from edgepaged.engine import DoneEvent, Engine, EngineConfig, Request, TokenEvent
from edgepaged.model import SamplingParams

BS = 16


def prompt(seed: int, n: int = 150) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(300, 40000, n).tolist()


@pytest.fixture(scope="module")
def cpu_runner():
    from edgepaged.model.cpu.runner import CpuRunner
    return CpuRunner(num_blocks=40)


async def answer(engine, ids, salt=0):
    req = Request(prompt_ids=list(ids), params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                  salt=salt)
    out, done = [], None
    async with engine.stream(req) as events:
        async for ev in events:
            if isinstance(ev, TokenEvent):
                out += ev.token_ids
            elif isinstance(ev, DoneEvent):
                done = ev
    await engine.settle()           # the prompt's blocks reach the tier once the engine rests
    return out, done.usage["cached_tokens"]


def cached_blocks(engine, ids, salt=0) -> list[bytes]:
    """The bytes of the RAM cache's blocks holding `ids` (a probe sequence finds them)."""
    a = engine.allocator
    n = a.add_sequence(1 << 60, ids, salt)
    table = a.block_table(1 << 60)[: n // BS]
    out = [engine.runner.read_block(b).tobytes() for b in table]
    a.free_sequence(1 << 60, True)
    return out


def engine_for(runner, tmp_path, **cfg) -> Engine:
    return Engine(runner, EngineConfig(prefix_cache_disk=64 << 20, prefix_cache_dir=str(tmp_path / "kv"), **cfg))


@pytest.mark.parametrize("runtime", ["cpu", "torch"])
async def test_a_prompt_comes_back_from_disk_after_a_restart_bit_for_bit(runtime, cpu_runner, embedded_runner,
                                                                          tmp_path):
    runner = cpu_runner if runtime == "cpu" else embedded_runner
    a = prompt(1)
    async with engine_for(runner, tmp_path) as e1:
        first, cached = await answer(e1, a)
        assert cached == 0
        computed = cached_blocks(e1, a)
        stats = e1.stats()["prefix_cache_disk"]
    async with engine_for(runner, tmp_path) as e2:          # a new engine: nothing in RAM
        assert e2.stats()["prefix_cache_disk"]["blocks"] == len(a) // BS
        again, cached = await answer(e2, a)
        assert cached == (len(a) - 1) // BS * BS              # every full block but the last token's
        assert again == first
        assert cached_blocks(e2, a)[: cached // BS] == computed[: cached // BS]
        s = e2.stats()
        assert s["prefix_cache_disk"]["hits"] == 1 and s["kv_blocks_used"] == 0
        e2.allocator.check_invariants()
    assert stats["written"] == 0 or stats["written"] <= len(a) // BS


async def test_an_evicted_prompt_is_read_back_instead_of_computed(cpu_runner, tmp_path):
    a, others = prompt(2), [prompt(10 + i, 200) for i in range(3)]
    async with engine_for(cpu_runner, tmp_path) as e:
        first, _ = await answer(e, a)
        for o in others:                                      # 40 blocks: these push `a` out of RAM
            await answer(e, o)
        assert e.allocator.prefix_match(a)[0] < 64
        e.disk.tier.flush()
        again, cached = await answer(e, a)
        assert again == first and cached >= 144
        assert e.stats()["prefix_cache_disk"]["hits"] >= 1


async def test_a_corrupt_or_truncated_block_is_a_miss(cpu_runner, tmp_path):
    a = prompt(3)
    async with engine_for(cpu_runner, tmp_path) as e1:
        first, _ = await answer(e1, a)
    from edgepaged.engine.disk_cache import chain_keys
    async with engine_for(cpu_runner, tmp_path) as e2:
        keys = chain_keys(a, 0, e2.disk.tier.identity, BS, len(a) // BS)
        files = [e2.disk.tier._path(k) for k in keys]
        raw = bytearray(files[4].read_bytes())
        raw[-7] ^= 0x40                                       # one bit of block 4's payload
        files[4].write_bytes(bytes(raw))
        files[6].write_bytes(files[6].read_bytes()[:1000])    # block 6 torn
        again, cached = await answer(e2, a)
        assert again == first and cached == 4 * BS            # blocks 0-3 read, 4 on computed
        assert e2.stats()["prefix_cache_disk"]["corrupt"] == 1
        e2.disk.tier.flush()                                       # block 4 computed again, and written again
        assert e2.disk.tier._read(keys[4]) is not None


async def test_another_identity_or_model_never_hits(cpu_runner, tmp_path):
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.testing.families import make_family_model, write_family_gguf
    a = prompt(4)
    async with engine_for(cpu_runner, tmp_path) as e:
        await answer(e, a, salt=7)
    async with engine_for(cpu_runner, tmp_path) as e:
        assert (await answer(e, a, salt=8))[1] == 0          # another identity's salt
        assert (await answer(e, a, salt=7))[1] > 0           # its own
    hf = make_family_model(tmp_path / "m", "llama", seed=1)
    other = CpuRunner(write_family_gguf(tmp_path / "m", tmp_path / "m.gguf", hf, qtype=0), num_blocks=40)
    vocab_ids = [t % 200 + 3 for t in a]
    async with engine_for(other, tmp_path) as e:
        await answer(e, vocab_ids)
    async with engine_for(cpu_runner, tmp_path) as e:
        assert (await answer(e, vocab_ids))[1] == 0          # the other model's blocks: not this one's


FULL_DISK = r"""
import json, logging, resource, signal, sys
import trio
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))      # a disk that refuses this block's file
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("edgepaged").addHandler(Keep())
from edgepaged.engine import Engine, EngineConfig, Request, TokenEvent
from edgepaged.model import SamplingParams
from edgepaged.model.cpu.runner import CpuRunner
runner = CpuRunner(num_blocks=40)
async def main():
    out = []
    for i in range(2):
        async with Engine(runner, EngineConfig(prefix_cache_disk=64 << 20, prefix_cache_dir=sys.argv[1])) as e:
            for j in range(2):
                req = Request(prompt_ids=list(range(300, 450 + j)), params=SamplingParams(temperature=0, max_tokens=4,
                                                                                          ignore_eos=True))
                ids = []
                async with e.stream(req) as events:
                    async for ev in events:
                        if isinstance(ev, TokenEvent):
                            ids += ev.token_ids
                out.append(ids)
            await e.settle()
            e.disk.tier.flush()
            info = e.stats()["prefix_cache_disk"]
    print(json.dumps({"answers": out, "writing": info["writing"], "written": info["written"],
                      "warnings": [l for l in lines if "disk tier" in l]}))
trio.run(main)
"""


def test_a_disk_that_refuses_writes_turns_the_tier_off_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path / "kv")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["writing"] is False and out["written"] == 0
    assert len(out["warnings"]) == 2, out["warnings"]        # one line per engine (each its own tier)
    assert all(len(a) == 4 for a in out["answers"]) and out["answers"][0] == out["answers"][2]


def test_the_writer_runs_at_the_lowest_priority(tmp_path):
    """Hashing and writing a long prompt's blocks must not take CPU from the steps that answer
    it: the tier's writer thread is nice 19 (the process keeps its own priority)."""
    import os
    import threading

    from edgepaged.engine.disk_cache import DiskTier
    tier = DiskTier(tmp_path / "kv", "m", 64, BS, 1 << 20)
    seen = {}
    write = tier._write

    def spy(key, data):
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        write(key, data)
    tier._write = spy
    tier.put([(bytes(32), np.zeros(64, np.uint8))])
    tier.flush()
    assert seen["nice"] == 19 and tier.stats["written"] == 1
    assert os.getpriority(os.PRIO_PROCESS, 0) == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


async def test_the_writer_waits_while_steps_run(cpu_runner, tmp_path):
    """A prompt's blocks are copied out and handed to the writer once the engine rests; they reach
    the disk once no step runs (written beside the steps that answer it, they took a core and the
    interpreter's lock from them: 0.35 s of Home Assistant's first command on a 1 B model).
    Copied in one gather, the bytes are `read_block`'s."""
    written = []
    async with engine_for(cpu_runner, tmp_path) as e:
        e.step_hook = lambda batch: written.append(e.disk.tier.stats["written"])
        ids = prompt(21)
        req = Request(prompt_ids=ids, params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        async with e.stream(req) as events:
            async for ev in events:
                if isinstance(ev, TokenEvent) and len(req.output_ids) == 1:
                    assert not e.disk.quiet.is_set()       # answering: the writer waits
        e.step_hook = None
        assert len(written) > 8 and set(written) == {0}, written
        import trio
        await e.settle()
        await trio.to_thread.run_sync(e.disk.tier.flush)
        assert e.disk.quiet.is_set() and e.disk.tier.stats["written"] == len(ids) // BS
        stored = [e.disk.tier._path(k).read_bytes()[-e.disk.tier.block_bytes:] for k in
                  __import__("edgepaged.engine.disk_cache", fromlist=["chain_keys"]).chain_keys(
                      ids, 0, e.disk.tier.identity, BS, len(ids) // BS)]
        assert stored == cached_blocks(e, ids)
    table = list(range(3, 9))
    got = cpu_runner.read_blocks(table)
    assert [np.ascontiguousarray(g).view(np.uint8).tobytes() for g in got] == \
        [cpu_runner.read_block(b).tobytes() for b in table]


def test_what_waits_for_the_writer_is_bounded(tmp_path, monkeypatch):
    """Blocks waiting for a quiet engine hold memory: past PENDING_BYTES a prompt's blocks are
    dropped (a cache), and the writer writes after BUSY_WAIT_S even if the engine never rests."""
    from edgepaged.engine import disk_cache
    monkeypatch.setattr(disk_cache, "PENDING_BYTES", 3 * 64)
    monkeypatch.setattr(disk_cache, "BUSY_WAIT_S", 0.5)
    tier = disk_cache.DiskTier(tmp_path / "kv", "m", 64, BS, 1 << 20)
    tier.quiet.clear()                                   # an engine that never rests
    blocks = [(bytes([i]) * 32, np.full(64, i, np.uint8)) for i in range(5)]
    tier.put(blocks[:2])
    tier.put(blocks[2:4])                                # 4 x 64 bytes waiting: dropped
    tier.put(blocks[4:])
    import time
    time.sleep(0.2)
    assert tier.stats["written"] == 0                    # still waiting for the engine
    tier.flush()
    assert tier.stats["written"] == 3 and tier._pending == 0
    assert sorted(tier.index) == sorted(k for k, _ in blocks[:2] + blocks[4:])


def test_the_pool_s_first_blocks_are_faulted_in_off_the_critical_path():
    """The blocks a first prompt gets (the allocator's free list starts at block 0) are made
    resident by a background thread once the model is loaded, so that prompt's steps do not
    fault its K/V pages in (0.3-0.5 s of Home Assistant's first command on a 1 B model in a
    virtual machine); the rest of the pool stays committed as it fills."""
    import ctypes
    from edgepaged.model.cpu.runner import KV_PREFAULT_BYTES, KV_PREFAULT_TOKENS, CpuRunner
    r = CpuRunner(num_blocks=1200)          # ~430 MB: a mapping of its own, never touched before
    r.kv_prefault.join(60)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]

    def resident(layer, half, first, last) -> float:
        kv = r.kv_cache
        start = kv[layer, half, first].ctypes.data
        end = kv[layer, half, last - 1].ctypes.data + kv.strides[2]
        lo, hi = -(-start // 4096) * 4096, end // 4096 * 4096       # whole pages inside
        vec = ctypes.create_string_buffer((hi - lo) // 4096)
        assert libc.mincore(lo, hi - lo, vec) == 0, ctypes.get_errno()
        return sum(b & 1 for b in vec.raw) / len(vec.raw)
    n = min(KV_PREFAULT_TOKENS // BS, KV_PREFAULT_BYTES // (r.kv_cache.shape[0] * 2 * r.kv_cache.strides[2]))
    for layer in (0, r.kv_cache.shape[0] - 1):
        for half in (0, 1):
            assert resident(layer, half, 0, n) == 1.0
    assert resident(0, 0, 2 * n + 64, 1200) < 0.5          # huge pages may round up; most is not


def test_blocks_waiting_for_the_writer_are_not_wanted_again(tmp_path):
    """A warm command's prompt shares the cold one's prefix: while the cold prompt's blocks wait
    for a quiet engine they are not copied out again (each warm command copied all 137 blocks of
    Home Assistant's prompt, ~0.25 s of its first step, before this)."""
    from edgepaged.engine.disk_cache import DiskTier
    tier = DiskTier(tmp_path / "kv", "m", 64, BS, 1 << 20)
    tier.quiet.clear()
    ids = prompt(5, 5 * BS)
    want = tier.wanted(ids, 0)
    assert [i for i, _ in want] == [0, 1, 2, 3, 4]
    tier.put([(k, np.full(64, i, np.uint8)) for i, k in want[:3]])
    assert [i for i, _ in tier.wanted(ids, 0)] == [3, 4]
    assert [i for i, _ in tier.wanted(ids, 7)] == [0, 1, 2, 3, 4]        # another identity's own
    tier.quiet.set()
    tier.flush()
    assert tier.stats["written"] == 3 and [i for i, _ in tier.wanted(ids, 0)] == [3, 4] and not tier._queued


async def test_a_prompt_s_blocks_are_copied_after_its_first_token_not_in_its_step(cpu_runner, tmp_path, monkeypatch):
    """The step that completes a prompt pins its full blocks (a sequence of their own shares
    them) instead of copying them: the copy (~70 MB for Home Assistant's 2 k-token prompt on a
    1 B model, 0.05-0.17 s of its first token) is made once the engine rests, outside any step,
    and the pin goes back; the blocks written are the computed ones."""
    calls = []
    real = cpu_runner.read_blocks

    async def run(e, ids, first_token):
        req = Request(prompt_ids=ids, params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        async with e.stream(req) as events:
            async for ev in events:
                if isinstance(ev, TokenEvent) and not first_token:
                    first_token.append(len(calls))

    async with engine_for(cpu_runner, tmp_path) as e:
        monkeypatch.setattr(cpu_runner, "read_blocks", lambda blocks: calls.append(
            (e.step_started, len(blocks))) or real(blocks))
        ids, first = prompt(31), []
        await run(e, ids, first)
        assert first == [0]                                   # nothing copied before its first token
        await e.settle()
        assert calls and all(started is None for started, _ in calls), calls   # never inside a step
        assert sum(n for _, n in calls) == len(ids) // BS
        assert e.allocator.num_sequences == 0 and e.stats()["kv_blocks_used"] == 0   # the pin went back
        e.allocator.check_invariants()
        e.disk.tier.flush()
        from edgepaged.engine.disk_cache import chain_keys
        keys = chain_keys(ids, 0, e.disk.tier.identity, BS, len(ids) // BS)
        assert [e.disk.tier._path(k).read_bytes()[-e.disk.tier.block_bytes:] for k in keys] == cached_blocks(e, ids)


async def test_a_busy_engine_copies_pinned_blocks_between_steps(cpu_runner, tmp_path, monkeypatch):
    """A box that never rests still gets its prompts to the disk: past DISK_COPY_WAIT_S the pinned
    blocks are copied whole between two steps while another request keeps the engine busy (and
    the writer writes them when it rests, or BUSY_WAIT_S after)."""
    import trio
    from edgepaged.engine import disk_cache
    monkeypatch.setattr(disk_cache, "DISK_COPY_WAIT_S", 0.0)
    async with engine_for(cpu_runner, tmp_path) as e:
        long = Request(prompt_ids=prompt(40, 20), params=SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        done = trio.Event()

        async def busy():
            async with e.stream(long) as events:
                async for _ in events:
                    pass
            done.set()

        async with trio.open_nursery() as n:
            n.start_soon(busy)
            while not long.output_ids:
                await trio.sleep(0.01)
            ids = prompt(41, 100)
            req = Request(prompt_ids=ids, params=SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
            async with e.stream(req) as events:
                async for _ in events:
                    pass
            while e.disk.pins and not done.is_set():
                await trio.sleep(0.01)
            assert not done.is_set() and not e.disk.pins     # copied while the long one still ran
            assert e.disk.tier._queued and e.allocator.num_sequences == 1   # handed to the writer, the pin gone
            long_left = not long.finished
            n.cancel_scope.cancel()
        assert long_left
        await e.settle()
        assert e.allocator.num_sequences == 0
        e.allocator.check_invariants()


async def test_the_answers_lookup_drafts_from_come_back_after_a_restart(cpu_runner, tmp_path):
    """Prompt lookup's second source (an identity's earlier answers) is kept in the disk tier's
    folder at shutdown and read at start: after a restart the same request's answer is
    drafted from the one before and kept whole, the same tokens. A torn or corrupt file is
    nothing (no drafts from it, nothing else changes); another identity has none."""
    from edgepaged.engine.engine import ANSWERS_FILE
    a = prompt(5)
    async with engine_for(cpu_runner, tmp_path) as e1:
        first, _ = await answer(e1, a, salt=3)
        kept = e1.spec.history.corpus(3).copy()
        folder = e1.disk.tier.dir
    assert (folder / ANSWERS_FILE).exists()
    async with engine_for(cpu_runner, tmp_path) as e2:
        assert np.array_equal(e2.spec.history.corpus(3), kept) and e2.spec.history.corpus(4) is None
        again, _ = await answer(e2, a, salt=3)
        s = e2.stats()["speculation"]["interactive"]
    assert again == first and s["accepted"] >= len(first) - 2, s      # drafted from the answer before
    raw = (folder / ANSWERS_FILE).read_bytes()
    for bad in (raw[: len(raw) // 2], raw[:40] + bytes([raw[40] ^ 1]) + raw[41:], b"junk"):
        (folder / ANSWERS_FILE).write_bytes(bad)
        e3 = engine_for(cpu_runner, tmp_path)
        assert e3.spec.history.corpus(3) is None


async def test_a_prompt_read_from_disk_carries_its_format_s_drafts_in_the_same_step(embedded_runner, tmp_path):
    """After a restart a command's prompt comes from the disk tier; the step that reads it
    back and computes its last tokens also carries what its format forces and the answer
    drafted from the identity's earlier one (kept on disk too): the whole answer in that one
    step (before: a step for the prompt, then one for the drafts). The same answer as
    before the restart and as a plain decode."""
    from edgepaged.testing.serving import serving
    from test_http import afetch
    schema = {"type": "object", "properties": {"name": {"enum": ["HassTurnOn", "HassTurnOff", "HassLightSet"]},
                                               "area": {"enum": ["kitchen", "bedroom", "office"]}},
              "required": ["name", "area"], "additionalProperties": False}
    system = "You control a home. " + " ".join(f"Device {i} is in the {('kitchen', 'bedroom', 'office')[i % 3]}."
                                               for i in range(30))
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Kitchen light off."}],
            "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}}}
    disk = {"prefix_cache_disk": 64 << 20, "prefix_cache_dir": str(tmp_path / "kv")}
    out, steps = [], []
    for rnd in range(2):
        async with serving(embedded_runner, http=True, engine=disk) as server:
            eng = server.engine
            seen = []
            eng.step_hook = lambda batch, seen=seen: seen.append((len(batch.loads), bool(batch.spec)))
            status, _, raw = await afetch(server.http_base + "/v1/chat/completions", body)
            assert status == 200, raw
            if rnd == 0:
                plain_status, _, plain = await afetch(server.http_base + "/v1/chat/completions",
                                                      {**body, "speculative": False})
                assert plain_status == 200 and json.loads(plain)["choices"][0]["message"]["content"] == \
                    json.loads(raw)["choices"][0]["message"]["content"]
            eng.step_hook = None
            await eng.settle()
            out.append(json.loads(raw)["choices"][0]["message"]["content"])
            steps.append(seen)
            assert eng.stats()["kv_blocks_used"] == 0
            eng.allocator.check_invariants()
    assert out[0] == out[1] and json.loads(out[1])["area"] in ("kitchen", "bedroom", "office")
    assert steps[1] and steps[1][0][0] > 0 and steps[1][0][1], steps[1]   # read back, with its drafts
    assert len(steps[1]) == 1, steps                                      # the whole answer in it


async def test_a_prompt_starts_from_part_of_a_cached_block(cpu_runner, tmp_path):
    """Past its cached whole blocks a prompt takes the K/V of the tokens it shares with a
    cached block that continues them (a Home Assistant command's template tokens before the
    spoken words): it computes only the rest, answers as a cold engine does, and the cached
    block it started from stays as it was (its first step wrote into a copy)."""
    a = prompt(21)
    b = a[:137] + prompt(22, 12)                    # 8 whole blocks and 9 tokens of the 9th shared
    engine = Engine(cpu_runner, EngineConfig())
    async with engine:
        _, cached = await answer(engine, a)
        assert cached == 0
        before = cached_blocks(engine, a)
        got, cached = await answer(engine, b)
        assert cached == 137
        assert cached_blocks(engine, a) == before
        engine.allocator.check_invariants()
    assert got == await cold_answer(cpu_runner, b)


async def test_a_chat_s_next_turn_starts_from_its_last_turn_s_last_block(cpu_runner):
    """A finished request's last block, only part of it computed, stays cached too (the
    allocator's `tail`): the next turn of the conversation (its prompt, its answer, then more)
    takes the K/V of every position the last turn computed, not only its whole blocks (before:
    144 of 157), and answers as a cold engine does."""
    a = prompt(23)
    engine = Engine(cpu_runner, EngineConfig())
    async with engine:
        out, cached = await answer(engine, a)       # 150 + 7 positions computed: 9 blocks and 13 tokens
        assert cached == 0 and len(out) == 8
        b = a + out + prompt(24, 12)
        got, cached = await answer(engine, b)
        assert cached == 157
        engine.allocator.check_invariants()
    assert got == await cold_answer(cpu_runner, b)


async def cold_answer(runner, ids) -> list[int]:
    """The answer of an engine without a prefix cache (every position computed)."""
    async with Engine(runner, EngineConfig(enable_prefix_caching=False)) as cold:
        want, cached = await answer(cold, ids)
    assert cached == 0
    return want
