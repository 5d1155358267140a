"""The Trio engine end to end with a tiny real model (safetensors + tokenizer.json)."""
import random
import threading
import time

import pytest
import trio

from edgepaged.engine import (BACKGROUND, INTERACTIVE, DoneEvent, Engine, EngineConfig, Request, RequestRejected,
                              TokenEvent)
from edgepaged.model import ModelRunner, SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


def request(prompt_ids, max_tokens=16, priority=INTERACTIVE, client="", **sampling) -> Request:
    """An engine request as the front end builds it: token ids, sampling, max_tokens."""
    return Request(prompt_ids=list(prompt_ids), params=SamplingParams(**{**GREEDY, **sampling}, max_tokens=max_tokens),
                   priority=priority, client=client)


def make_engine(model_dir, num_blocks=256, **cfg) -> Engine:
    runner = ModelRunner(model_dir, num_blocks=num_blocks, block_size=16)
    return Engine(runner, EngineConfig(**cfg))


async def collect(engine, req):
    ids, done = [], None
    async with engine.stream(req) as events:
        async for ev in events:
            if isinstance(ev, TokenEvent):
                ids += ev.token_ids
            else:
                done = ev
    return ids, done


def prompts(n, seed=0):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(40)]
    out = []
    for i in range(n):
        own = [rng.randrange(3, 300) for _ in range(rng.randrange(5, 120))]
        out.append(shared + own if i % 3 == 0 else own)
    return out


async def run_together(engine, ps, max_tokens, priorities=None):
    results = [None] * len(ps)

    async def one(i):
        r = request(ps[i], max_tokens, priority=(priorities or {}).get(i, INTERACTIVE))
        results[i] = await collect(engine, r)

    async with trio.open_nursery() as n:
        for i in range(len(ps)):
            n.start_soon(one, i)
    return results


async def test_concurrent_equals_alone_also_under_preemption(tiny_model_dir):
    ps = prompts(12)
    alone = []
    async with make_engine(tiny_model_dir) as eng:
        for p in ps:
            alone.append((await collect(eng, request(p, 24)))[0])
    async with make_engine(tiny_model_dir) as eng:
        together = await run_together(eng, ps, 24)
        assert [ids for ids, _ in together] == alone
        assert all(d.finish_reason == "length" for _, d in together)
        assert eng.allocator.num_used_blocks == 0
    # a pool of 24 blocks cannot hold 12 requests of up to ~190 tokens: preemption by recompute
    async with make_engine(tiny_model_dir, num_blocks=24) as eng:
        together = await run_together(eng, ps, 24, priorities={i: BACKGROUND for i in range(0, 12, 2)})
        assert eng.stats()["num_preemptions"] > 0
        assert [ids for ids, _ in together] == alone
        assert eng.allocator.num_used_blocks == 0
    # the naive scheme gives the same answers too
    async with make_engine(tiny_model_dir, contiguous=True) as eng:
        together = await run_together(eng, ps, 24)
        assert [ids for ids, _ in together] == alone


async def test_500_random_requests_with_cancels_leave_nothing_behind(tiny_model_dir):
    rng = random.Random(5)
    tasks_before = trio.lowlevel.current_statistics().tasks_living
    async with make_engine(tiny_model_dir, num_blocks=48, max_num_seqs=16) as eng:
        outcomes = {"done": 0, "cancelled": 0}

        async def one(i):
            await trio.sleep(rng.random() * 0.5)
            p = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 60))]
            r = request(p, rng.randrange(1, 12), priority=rng.choice([INTERACTIVE, BACKGROUND]),
                        client=f"c{rng.randrange(5)}", temperature=rng.choice([0, 0.8]), seed=i, ignore_eos=False)
            cancel_after = rng.choice([None, None, 0, 1, 3])
            async with eng.stream(r) as events:
                seen = 0
                async for ev in events:
                    if isinstance(ev, DoneEvent):
                        outcomes["done"] += 1
                        return
                    seen += 1
                    if cancel_after is not None and seen > cancel_after:
                        outcomes["cancelled"] += 1
                        return          # leaving the stream cancels the request

        async with trio.open_nursery() as n:
            for i in range(500):
                n.start_soon(one, i)
        assert outcomes["done"] + outcomes["cancelled"] == 500 and outcomes["cancelled"] > 50
        await trio.sleep(0.05)
        a = eng.allocator.stats()
        assert a["used_blocks"] == 0 and a["free_blocks"] == a["num_blocks"] and a["num_sequences"] == 0
        assert not eng.scheduler.has_work() and not eng.requests
    assert trio.lowlevel.current_statistics().tasks_living == tasks_before


async def test_background_flood_does_not_starve_interactive(tiny_model_dir):
    """Counted in engine steps, not seconds: while background agents flood the engine, an
    interactive prompt's first token comes at the end of the first step that starts after it
    arrived (at most the step in flight, then its own). The seconds figure is engine_bench's
    interactive_ttft_ratio."""
    async def steps_to_first_token(eng):
        before = eng.metrics.counts["num_steps"]
        async with eng.stream(request(range(3, 43), 1)) as events:
            async for ev in events:
                assert isinstance(ev, TokenEvent)
                return eng.metrics.counts["num_steps"] - before

    async with make_engine(tiny_model_dir, num_blocks=400, max_num_seqs=32) as eng:
        alone = [await steps_to_first_token(eng) for _ in range(3)]
        async with trio.open_nursery() as n:
            for i in range(60):   # more background work than fits at once
                n.start_soon(collect, eng, request([5 + i % 200] * 50, 200, priority=BACKGROUND, client="agent"))
            with trio.fail_after(30):     # (timed steps under load admit the flood a step at a time)
                while eng.scheduler.num_running < 16:
                    await trio.sleep(0.02)
            assert eng.scheduler.num_running == 16 and eng.scheduler.num_waiting > 0
            flooded = [await steps_to_first_token(eng) for _ in range(7)]
            n.cancel_scope.cancel()
    assert max(alone) <= 1, alone
    assert max(flooded) <= 2, flooded


async def test_loop_stays_responsive_during_a_long_prefill(tiny_model_dir):
    async with make_engine(tiny_model_dir, num_blocks=256, max_num_batched_tokens=1000) as eng:
        lat = []

        async def pinger(stop):
            while not stop.is_set():
                t = time.perf_counter()
                await trio.sleep(0.001)
                lat.append(time.perf_counter() - t - 0.001)

        stop = trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(pinger, stop)
            for k in range(3):
                r = request([7 + (k + i) % 250 for i in range(1000)], 1)
                await collect(eng, r)
            stop.set()
    lat.sort()
    assert lat and lat[int(0.95 * len(lat))] < 0.02, lat[-5:]


async def test_rejections_are_clear(tiny_model_dir):
    async with make_engine(tiny_model_dir, num_blocks=64) as eng:
        with pytest.raises(RequestRejected) as e:
            async with eng.stream(request([5] * 100, 1000)):
                pass
        assert e.value.code == "context_exceeded" and "1000" in str(e.value)
        with pytest.raises(RequestRejected) as e:
            async with eng.stream(request([5] * 2000, 1)):
                pass
        assert e.value.code == "prompt_too_long"
        assert eng.allocator.num_used_blocks == 0 and not eng.scheduler.has_work()


async def test_a_failing_step_fails_only_its_requests(tiny_model_dir):
    async with make_engine(tiny_model_dir, num_blocks=128) as eng:
        poison = 299

        def hook(batch):
            if any(poison in r.prompt_ids for r in batch.requests if r.num_slots <= len(r.prompt_ids)):
                raise RuntimeError("injected fault")

        eng.step_hook = hook
        bad = request([poison, 5, 6], 4)
        _, done = await collect(eng, bad)
        assert done.finish_reason == "error" and done.error["code"] == "internal_error"
        good = request([4, 5, 6], 4)
        ids, done = await collect(eng, good)
        assert done.finish_reason == "length" and len(ids) == 4
        assert eng.allocator.num_used_blocks == 0
        assert eng.stats()["finished"] == {"error": 1, "length": 1}


async def test_stop_strings_and_metrics(tiny_model_dir):
    async def streamed_text(prompt, **kw):
        parts, done = [], None
        r = request(prompt, 16, **kw)
        async with eng.stream(r) as events:
            async for ev in events:
                if isinstance(ev, TokenEvent):
                    parts.append(ev.text)
                else:
                    done = ev
        return "".join(parts), done

    async with make_engine(tiny_model_dir) as eng:
        for k in range(40):   # a prompt whose answer has some visible text
            prompt = [10 + k, 20 + k, 30 + k]
            text, _ = await streamed_text(prompt)
            if len(text) >= 8 and text[:8].isprintable() and "\ufffd" not in text:
                break
        stop = text[3:6]
        r = request(prompt, 16, stop=[stop])
        parts = []
        async with eng.stream(r) as events:
            async for ev in events:
                if isinstance(ev, TokenEvent):
                    parts.append(ev.text)
                else:
                    done = ev
        assert done.finish_reason == "stop" and done.stop == stop
        assert stop not in "".join(parts) and "".join(parts) == text[:text.index(stop)]
        s = eng.stats()
        assert s["finished"]["stop"] == 1 and s["finished"]["length"] == k + 1
        assert s["ttft_s"]["p50"] > 0 and s["kv_blocks_total"] == 256
        assert b"edgepaged:time_to_first_token_seconds_bucket" in eng.metrics.prometheus_text()


async def test_a_cancel_during_a_failing_step_leaves_no_garbage_in_the_prefix_cache(tiny_model_dir):
    """A request cancelled while the step computing its prompt runs, when that step then
    fails: its blocks hold no valid K/V and must not be registered in the prefix cache, or
    the same prompt later attends to garbage. Blocks are freed after the step, cached only
    if it succeeded."""
    prompt = [3 + (7 * i) % 290 for i in range(40)]        # two full blocks of 16 and a rest
    async with make_engine(tiny_model_dir) as eng:
        fresh, _ = await collect(eng, request(prompt, 8))
    async with make_engine(tiny_model_dir) as eng:
        cancelled, release = trio.Event(), threading.Event()
        token = trio.lowlevel.current_trio_token()

        def hook(batch):
            if any(r.prompt_ids == prompt for r in batch.requests):
                token.run_sync_soon(cancelled.set)           # the step is running: cancel now
                assert release.wait(10), "the cancel never came"
                eng.step_hook = None
                raise RuntimeError("injected fault after the cancel")

        eng.step_hook = hook
        async with trio.open_nursery() as n:
            async def victim(task_status=trio.TASK_STATUS_IGNORED):
                with trio.CancelScope() as scope:
                    task_status.started(scope)
                    await collect(eng, request(prompt, 8))
            scope = await n.start(victim)
            await cancelled.wait()
            scope.cancel()                                   # leaving the stream ends the request
            await trio.sleep(0.05)
            assert eng.allocator.num_used_blocks > 0, "its blocks are still in the running step"
            release.set()
        await trio.sleep(0.05)
        assert eng.allocator.num_used_blocks == 0
        again, done = await collect(eng, request(prompt, 8))
        assert done.usage["cached_tokens"] == 0, "nothing of the failed step may come from the prefix cache"
        assert again == fresh


@pytest.mark.parametrize("device_ids,speculation", [(False, "off"), (True, "lookup")],
                         ids=["host_tokens", "device_ids_beside_lookup"])
async def test_look_ahead_decode_changes_no_event_and_caches_the_real_tokens(tiny_model_dir, device_ids,
                                                                             speculation):
    """Look-ahead decode (EngineConfig.async_decode; vLLM's async scheduling): the next decode
    step planned and launched before the last one's tokens are known, fed its input tokens
    from that step (`device_ids`: the torch runner's path that leaves them on the device; else
    the host's). Every request's events are the step-by-step engine's: greedy answers of
    every length, stop tokens and EOS that end a request on a token the next step already
    computed, rows that cannot go ahead (stop strings, logprobs, penalties), a client leaving
    mid-answer, requests arriving while others decode; beside lookup speculation, look-ahead
    only while more requests run than it drafts for. The allocator learned the real tokens
    (never the placeholders): each conversation sent again finds the same cached prefix as on
    the step-by-step engine, and the same answer. Every block comes back."""
    rng = random.Random(5)
    ps = prompts(12, seed=7)
    kinds = []
    for i in range(len(ps)):
        kw = dict(max_tokens=rng.randrange(1, 30), temperature=0, ignore_eos=i % 2 == 0)
        if i in (1, 3, 11):     # plain: each ends on a token the next step already computed
            kw["stop_token_ids"] = [{1: 217, 3: 179, 11: 26}[i]] + [rng.randrange(300, 400) for _ in range(8)]
        if i == 5:
            kw["stop"] = ["e"]                 # decided by the text: no look-ahead while it runs
        if i == 6:
            kw["logprobs"] = 2
        if i == 9:
            kw["repetition_penalty"] = 1.3
        if i in (5, 6, 9) and speculation == "lookup":
            kw["max_tokens"] = 2          # (out of the way soon: more than 4 plain requests then run)
        elif speculation == "lookup":
            kw["max_tokens"] = max(kw["max_tokens"], 12)
        kinds.append(kw)

    async def run(ahead: bool):
        out, follow = [None] * len(ps), [None] * len(ps)
        runner = ModelRunner(tiny_model_dir, num_blocks=200, block_size=16)    # (no evictions: what stays
        runner.device_sampling = device_ids                                  # cached hangs on no timing)
        async with Engine(runner, EngineConfig(max_num_seqs=8, async_decode=ahead, speculation=speculation)) as eng:
            async def one(i, prompt, kw, into):
                await trio.sleep(0.02 * (i % 3) if into is out else 0)     # arrivals while others decode
                r = Request(prompt_ids=list(prompt), params=SamplingParams(**kw))
                events = []
                async with eng.stream(r) as chan:
                    async for ev in chan:
                        events.append(("tok", ev.token_ids, ev.text, ev.logprobs and len(ev.logprobs))
                                      if isinstance(ev, TokenEvent) else
                                      ("done", ev.finish_reason, ev.stop,
                                       {k: v for k, v in ev.usage.items() if k != "cached_tokens" or into is follow}))
                        if i == 10 and into is out and len(events) == 4:
                            break                  # a client that leaves mid-answer
                into[i] = events

            async with trio.open_nursery() as n:
                for i in range(len(ps)):
                    n.start_soon(one, i, ps[i], kinds[i], out)
            await trio.sleep(0.05)
            a = eng.allocator.stats()
            assert a["used_blocks"] == 0 and a["num_sequences"] == 0
            for i in range(len(ps)):          # one at a time: the cached prefix does not hang on timing
                answer = [t for e in out[i] if e[0] == "tok" for t in e[1]]
                await one(i, ps[i] + answer, dict(max_tokens=6, temperature=0, ignore_eos=True), follow)
            assert eng.allocator.stats()["used_blocks"] == 0
            return out, follow, eng.stats()["steps_ahead"]

    on, on_follow, ahead = await run(True)
    off, off_follow, none_ahead = await run(False)
    for i, (a, b) in enumerate(zip(on, off)):
        assert a == b, (i, kinds[i], a, b)
    cached = lambda events: events[-1][3].pop("cached_tokens")     # noqa: E731
    for i, (a, b) in enumerate(zip(on_follow, off_follow)):
        # a request that ended on a token the next step computed holds that token's K/V too:
        # as much cached at least (with a placeholder's hash in its blocks, less)
        ca, cb = cached(a), cached(b)
        assert ca >= cb and a == b, (i, ca, cb, a, b)
    assert none_ahead == 0 and ahead >= (20 if speculation == "off" else 3), ahead
    assert sum(e[-1][1] == "stop" and isinstance(e[-1][2], int) for e in on) >= 2    # stop tokens ended them


async def test_a_long_look_ahead_run_keeps_the_watchdog_fed(tiny_model_dir):
    """A run of look-ahead steps is many steps, not one: `alive(limit)` (the service watchdog)
    stays true while answers decode ahead for longer than the limit."""
    async with make_engine(tiny_model_dir, async_decode=True, speculation="off") as eng:
        seen, stop = [], trio.Event()

        async def watch():
            while not stop.is_set():
                seen.append(eng.alive(0.25))
                await trio.sleep(0.02)

        async with trio.open_nursery() as n:
            n.start_soon(watch)
            t0 = time.monotonic()
            await collect(eng, request(range(5, 30), max_tokens=400))
            took = time.monotonic() - t0
            stop.set()
        assert eng.stats()["steps_ahead"] > 300
    assert took > 0.5 and all(seen), (took, seen.count(False))


async def test_sending_overlapped_with_the_next_step_changes_no_event(tiny_model_dir):
    """The plain rows' tokens are detokenized and sent while the next step's forward runs
    (EngineConfig.overlap_host_work): every request's events (ids, text, logprobs, the end,
    its usage) are those of the engine that sends at once, stop strings, stop tokens, lengths
    and cancels included, and every block comes back."""
    rng = random.Random(11)
    ps = prompts(14, seed=3)
    rounded = lambda lps: lps and [(round(x["logprob"], 4), [(t, round(v, 4)) for t, v in x["top"]])   # noqa: E731
                                   for x in lps]      # (a batch's make-up moves the float sums' last bits)
    kinds = []
    for i in range(len(ps)):
        kw = dict(max_tokens=rng.randrange(1, 24), seed=i, temperature=rng.choice([0, 0.9]), ignore_eos=False)
        if i % 4 == 1 or i == 11:
            kw["stop"] = ["laz", "KK"]       # decided by the text: sent at once, never deferred
        if i % 5 == 2:
            kw["logprobs"] = 2
        if i % 6 == 3:
            kw["stop_token_ids"] = [rng.randrange(3, 300) for _ in range(16)]
        kinds.append(kw)

    async def run(overlap: bool):
        out = [None] * len(ps)
        async with make_engine(tiny_model_dir, num_blocks=40, max_num_seqs=8, overlap_host_work=overlap) as eng:
            async def one(i):
                kw = dict(kinds[i])
                r = Request(prompt_ids=list(ps[i]), params=SamplingParams(**kw))
                events = []
                async with eng.stream(r) as chan:
                    async for ev in chan:
                        events.append(("tok", ev.token_ids, ev.text, rounded(ev.logprobs)) if isinstance(ev, TokenEvent)
                                      else ("done", ev.finish_reason, ev.stop,     # (cached_tokens hang on timing)
                                             {k: v for k, v in ev.usage.items() if k != "cached_tokens"}))
                        if i == 13 and len(events) == 3:
                            break                  # a client that leaves mid-answer
                out[i] = events

            async with trio.open_nursery() as n:
                for i in range(len(ps)):
                    n.start_soon(one, i)
            await trio.sleep(0.05)
            a = eng.allocator.stats()
            assert a["used_blocks"] == 0 and a["num_sequences"] == 0 and not eng._unsent
            return out, eng.stats()["tokens_sent_during_steps"]

    on, sent_during = await run(True)
    off, none_during = await run(False)
    for i, (a, b) in enumerate(zip(on, off)):
        assert a == b, (i, kinds[i], a, b)
    assert none_during == 0 and sent_during > 20       # it did overlap
    for events in on[:13]:
        assert events[-1][0] == "done" and all(e[0] == "tok" for e in events[:-1])
        assert sum(len(e[1]) for e in events[:-1]) == events[-1][3]["completion_tokens"] or events[-1][1] == "stop"
    assert any(e[-1][1] == "stop" and isinstance(e[-1][2], str) for e in on)    # a stop string ended one
