"""The scheduling policy on its own: no Trio, no model; the real Rust allocator."""
import pytest

from edgepaged._native.blocks import BlockAllocator
from edgepaged.engine.request import BACKGROUND, INTERACTIVE, Request, Status
from edgepaged.engine.scheduler import (FIRST_TOKENS, FIRST_TOKENS_STEP_S, MIN_EXTRA_TOKENS, SHORT_STEPS_ALONE,
                                       RequestRejected, Scheduler, SchedulerConfig)
from edgepaged.model.params import SamplingParams

BS = 16


def make(num_blocks=64, **kw):
    # (steps are not timed here unless a test asks: the policy's budgets as configured)
    cfg = dict(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256, step_time_target_s=None)
    cfg.update(kw)
    contiguous = cfg.get("contiguous", False)
    return Scheduler(BlockAllocator(num_blocks, BS, contiguous=contiguous), SchedulerConfig(**cfg))


def req(n=20, max_tokens=8, priority=INTERACTIVE, client="", base=1, arrival=None):
    r = Request(prompt_ids=[base + i % 50 for i in range(n)], params=SamplingParams(temperature=0, max_tokens=max_tokens),
                priority=priority, client=client)
    if arrival is not None:
        r.arrival = arrival
    return r


def step(s: Scheduler, token=7):
    """One engine step without a model: every sampled request gets `token`; requests that
    reach max_tokens finish."""
    b = s.schedule()
    if b is None:
        return None
    for r in b.sampled:
        r.output_ids.append(token)
        if len(r.output_ids) >= r.params.max_tokens:
            s.free(r, cache=True)
    return b


def test_rejects_what_can_never_fit():
    s = make(num_blocks=8, max_model_len=200)
    with pytest.raises(RequestRejected) as e:
        s.add(req(n=200))
    assert e.value.code == "prompt_too_long"
    with pytest.raises(RequestRejected) as e:
        s.add(req(n=150, max_tokens=100))
    assert e.value.code == "context_exceeded"
    with pytest.raises(RequestRejected) as e:
        s.add(req(n=100, max_tokens=90))   # 12 blocks > 8 - watermark
    assert e.value.code == "kv_capacity"
    assert s.num_waiting == 0


def test_chunked_prefill_keeps_decodes_going():
    s = make(max_num_batched_tokens=64)
    short = req(n=10, max_tokens=50)
    s.add(short)
    step(s)
    long = req(n=300, max_tokens=4, base=100)
    s.add(long)
    chunks = []
    while long.num_slots < 300:
        b = step(s)
        assert short in b.requests and b.num_new[b.requests.index(short)] == 1   # decode never stalls
        assert b.num_tokens <= 64
        chunks.append(b.num_new[b.requests.index(long)])
    assert chunks == [63, 63, 63, 63, 48]
    assert long in b.sampled     # the last chunk samples the first token


def test_fair_share_between_clients():
    s = make(max_num_seqs=4)
    flood = [req(client="alice", base=i) for i in range(50)]
    for r in flood:
        s.add(r)
    bob = req(client="bob", base=99)
    s.add(bob)
    b = step(s)
    assert bob in b.requests, "one client's fifty requests must not push another's single one back"


def test_interactive_before_background_and_takes_its_place():
    s = make(max_num_seqs=2, background_share=1.0)
    bg = [req(priority=BACKGROUND, base=i, max_tokens=100, arrival=i) for i in range(3)]
    for r in bg:
        s.add(r)
    step(s)
    assert [r.status for r in bg] == [Status.RUNNING, Status.RUNNING, Status.WAITING]
    inter = req(priority=INTERACTIVE, base=77, arrival=10)
    s.add(inter)
    b = step(s)
    assert inter in b.requests
    assert bg[1].status is Status.WAITING and bg[1].num_preemptions == 1   # newest background gave way
    assert s.num_preemptions == 1


def test_out_of_blocks_preempts_newest_and_resumes_with_output_kept():
    s = make(num_blocks=6, max_num_batched_tokens=512)
    a, b_ = req(n=30, max_tokens=40, base=1, arrival=1), req(n=30, max_tokens=40, base=60, arrival=2)
    s.add(a)
    s.add(b_)
    preempted = []
    for _ in range(200):
        batch = step(s)
        if batch is None:
            break
        preempted += batch.preempted
    assert preempted and preempted[0] is b_, "the newest request is the victim"
    assert a.status is Status.FREED and b_.status is Status.FREED
    assert len(a.output_ids) == len(b_.output_ids) == 40
    assert s.alloc.num_used_blocks == 0


def test_contiguous_reserves_prompt_plus_max_tokens():
    s = make(num_blocks=64, contiguous=True)
    r = req(n=20, max_tokens=100)
    s.add(r)
    step(s)
    assert s.alloc.num_used_blocks == -(-120 // BS)
    while step(s):
        pass
    assert s.alloc.num_used_blocks == 0 and r.status is Status.FREED


def test_free_takes_a_request_out_wherever_it_is():
    s = make(max_num_seqs=1)
    r1, r2 = req(base=1), req(base=2)
    s.add(r1)
    s.add(r2)
    step(s)
    assert r1.status is Status.RUNNING and r2.status is Status.WAITING
    s.free(r2, cache=True)
    s.free(r1, cache=False)
    assert s.alloc.num_used_blocks == 0 and not s.has_work()


def test_background_share_and_pause_for_interactive_prefill():
    s = make(max_num_seqs=4)          # background may hold at most half
    bg = [req(priority=BACKGROUND, base=i, max_tokens=100, arrival=i) for i in range(4)]
    for r in bg:
        s.add(r)
    step(s)
    assert sum(r.status is Status.RUNNING for r in bg) == 2
    step(s)
    inter = req(priority=INTERACTIVE, base=77, arrival=10)
    s.add(inter)
    b = step(s)
    assert b.requests == [inter], "background waits while an interactive prompt prefills"
    b = step(s)
    assert inter in b.requests and len(b.requests) == 3   # then everyone decodes together


def test_background_prefill_is_capped_per_step_not_per_request():
    """All background prefill together takes at most an eighth of the step budget, so a
    flood of background prompts makes short steps an interactive arrival waits behind."""
    s = make(num_blocks=256, max_num_seqs=32, max_num_batched_tokens=256)   # cap: 32 tokens
    bg = [req(n=100, priority=BACKGROUND, base=i, max_tokens=4, arrival=i) for i in range(12)]
    for r in bg:
        s.add(r)
    for _ in range(40):
        b = step(s)
        if b is None:
            break
        prefill = sum(n for r, n in zip(b.requests, b.num_new) if n > 1 or not r.output_ids)
        assert prefill <= 32, f"a background-only step prefilled {prefill} tokens"
    inter = req(n=60, priority=INTERACTIVE, base=99, arrival=100)
    s.add(inter)
    b = step(s)
    assert b.requests == [inter] and b.num_new == [60]    # the interactive prompt at once


def test_a_long_prefill_leaves_room_for_short_prompts():
    """A document in prefill does not take the whole step while short questions wait: its
    chunk is cut to a quarter of the budget until they are admitted, then takes what is left."""
    s = make(num_blocks=256, max_num_batched_tokens=256)
    doc = req(n=1000, max_tokens=4, base=1)
    s.add(doc)
    b = step(s)
    assert b.num_new == [256]                      # alone: full-budget chunks
    short = [req(n=30, max_tokens=4, base=100 + 50 * i, client=f"c{i}") for i in range(3)]
    for r in short:
        s.add(r)
    b = step(s)
    assert set(short) <= set(b.requests), "short prompts wait behind a long prefill"
    assert [b.num_new[b.requests.index(r)] for r in short] == [30, 30, 30]
    assert b.num_new[b.requests.index(doc)] == 256 - 90 and b.num_tokens == 256   # nothing of the budget lost


def test_the_scheduler_knows_the_blocks_a_step_needs_without_asking():
    """The scheduler computes the blocks a request needs from its own copy of the request's
    block count (one crossing into Rust per step): it must agree with the allocator's own
    answer at every step, through prefix hits, chunked prefill, decoding and preemption."""
    s = make(num_blocks=20, max_num_batched_tokens=48, max_num_seqs=6)
    reqs = [req(n=20 + 13 * i, max_tokens=30, base=1 if i % 2 else 7, client=f"c{i}") for i in range(8)]
    for r in reqs:
        s.add(r)
    steps = 0
    while s.has_work():
        for r in s.running:
            for n in (1, 5, 16, 17, 40):
                assert s.blocks_needed(r, n) == s.alloc.blocks_needed(r.id, n), (r.id, r.num_slots, n)
        b = step(s)
        if b is not None:   # what prepare_step said is free is what is free
            assert s.free_blocks == s.alloc.num_free_blocks
        steps += 1
        assert steps < 2000
    assert s.alloc.num_used_blocks == 0 and s.num_preemptions > 0


def test_a_shared_tail_block_counts_its_copy():
    """After a fork the last, partly filled block is shared: the first write copies it."""
    a = BlockAllocator(16, BS)
    s = Scheduler(a, SchedulerConfig(max_model_len=256))
    parent = req(n=20)
    a.add_sequence(parent.id, parent.prompt_ids)
    a.prepare_step([parent.id], [20])
    child = Request(prompt_ids=parent.prompt_ids, params=parent.params)
    a.fork(parent.id, child.id)
    for r in (parent, child):
        r.num_known = r.num_slots = 20
        a.append_tokens(r.id, [5])
        r.output_ids.append(5)
        assert s.blocks_needed(r, 1) == a.blocks_needed(r.id, 1) == 1


def _blocked_pool(**kw):
    """A pool mostly held by a running request, a long interactive prompt waiting at the head
    (the pool cannot take even its first chunk yet) and a home question behind it."""
    import time as _time
    s = make(num_blocks=24, max_num_batched_tokens=256, **kw)
    running = req(n=320, max_tokens=40, client="reader")
    s.add(running)
    while not running.is_decoding:
        step(s)                                 # 20 of 24 blocks held: 3 free past the watermark
    doc = req(n=300, max_tokens=4, client="doc", base=3)
    home = req(n=12, max_tokens=4, client="home", base=5)
    doc.arrival, home.arrival = _time.monotonic(), _time.monotonic() + 0.001
    s.add(doc)
    s.add(home)
    return s, running, doc, home


def test_a_short_prompt_goes_ahead_of_one_the_pool_cannot_take_yet():
    s, running, doc, home = _blocked_pool()
    b = step(s)
    assert home in b.requests and doc not in b.requests     # the home question did not wait
    assert doc.status is Status.WAITING and s.num_waiting == 1


def test_skipping_ahead_off_keeps_arrival_order():
    s, running, doc, home = _blocked_pool(short_prompt_tokens=0)     # short-first admission off
    b = step(s)
    assert home not in b.requests and home.status is Status.WAITING


def test_nothing_passes_a_prompt_that_waited_too_long():
    s, running, doc, home = _blocked_pool(skip_ahead_max_wait_s=0.0)
    b = step(s)
    assert home not in b.requests                            # the document is not starved
    while running.status is Status.RUNNING:                  # once the pool frees, the document goes first
        step(s)
    b = step(s)
    assert doc in b.requests


def test_a_new_short_prompt_starts_before_running_long_prefills_take_the_step():
    """Four long prompts mid-prefill use the whole step budget; a home question arriving then
    starts in the next step (before: it waited for their prefills to end)."""
    for short, expect in ((256, True), (0, False)):
        s = make(num_blocks=256, max_num_batched_tokens=128, short_prompt_tokens=short)
        longs = [req(n=400, max_tokens=4, client=f"doc{i}", base=10 * i) for i in range(4)]
        for r in longs:
            s.add(r)
        step(s)
        home = req(n=12, max_tokens=4, client="home", base=7)
        s.add(home)
        b = step(s)
        assert (home in b.requests) is expect, short
        assert sum(1 for r in longs if r in b.requests) >= 2          # the long ones go on too


def test_a_long_prompt_with_its_prefix_cached_is_a_short_one():
    """Home Assistant's 2,000-token prompt with a new command: once its prefix is cached only
    the command is computed, and it starts beside running long prefills as a home question
    does (before: its full length made it wait for them)."""
    s = make(num_blocks=512, max_num_batched_tokens=128, max_model_len=4096)
    first = req(n=2000, max_tokens=1, client="ha", base=3)
    s.add(first)
    while first.status is not Status.FREED:
        step(s)
    longs = [req(n=400, max_tokens=4, client=f"doc{i}", base=10 * i) for i in range(4)]
    for r in longs:
        s.add(r)
    step(s)
    again = req(n=2000, max_tokens=4, client="ha", base=3)
    again.prompt_ids = again.prompt_ids[:-8] + [99] * 8          # the same system prompt, another command
    s.add(again)
    b = step(s)
    assert again in b.requests and again.num_cached >= 1984


def test_kv_bound_moments_count_the_pool_only():
    """kv_bound_active: the running sequences at the steps where the pool (not the sequence
    limit, the token budget or the arrivals) held a waiting request back."""
    s = make(num_blocks=10, max_num_seqs=8, max_num_batched_tokens=256)
    assert s.kv_bound_stats() == {"kv_bound_moments": 0, "kv_bound_active": None, "kv_bound_active_max": None}
    for i in range(6):                       # 3 blocks each: three fit in 10 (minus the watermark)
        s.add(req(n=40, max_tokens=4, base=10 * i + 1, client=f"c{i}"))
    while step(s) is not None:
        pass
    st = s.kv_bound_stats()
    assert st["kv_bound_moments"] >= 1 and 1 <= st["kv_bound_active"] <= st["kv_bound_active_max"] <= 3, st
    # the sequence limit holding requests back is not the pool
    s = make(num_blocks=200, max_num_seqs=2)
    for i in range(6):
        s.add(req(n=20, max_tokens=4, base=10 * i + 1, client=f"c{i}"))
    while step(s) is not None:
        pass
    assert s.kv_bound_stats()["kv_bound_moments"] == 0


def test_steps_are_timed_under_load():
    """With more than one request in, a step's budget follows the measured seconds per token
    (a small one before any is measured); a lone request keeps the whole budget."""
    s = make(num_blocks=200, max_num_batched_tokens=512, step_time_target_s=0.5, max_model_len=4096)
    doc = req(n=1500, max_tokens=4, client="doc")
    s.add(doc)
    assert s.step_budget() == 512 and step(s).num_tokens == 512          # alone: full-budget chunks
    s.add(req(n=600, max_tokens=4, client="other"))
    assert s.step_budget() == 128                                       # not measured yet
    s.observe_step(512, 1.536)                                          # 3 ms a token
    assert s.step_budget() == 166 and step(s).num_tokens <= 166
    s.observe_step(100, 10.0)                                           # small steps say nothing
    assert s.step_budget() == 166


def test_a_timed_step_starts_home_questions_together_and_stays_short():
    """A burst of short prompts starts in one step (shortest first, half the configured
    budget), and that step takes little else, so their first tokens come out of it."""
    s = make(num_blocks=400, max_num_batched_tokens=512, max_num_seqs=32, step_time_target_s=0.5,
             short_step_extra_tokens=64, max_model_len=4096)
    s.observe_step(512, 1.536)
    doc = req(n=1400, max_tokens=4, client="doc", base=3)
    s.add(doc)
    s.add(req(n=700, max_tokens=4, client="doc2", base=5))
    step(s)
    step(s)
    chat = req(n=200, max_tokens=4, client="chat", base=7)
    homes = [req(n=31, max_tokens=4, client=f"home{i}", base=11 + i) for i in range(6)]
    s.add(chat)
    for h in homes:
        s.add(h)
    b = step(s)
    assert all(h in b.requests and b.num_new[b.requests.index(h)] == 31 for h in homes)
    others = sum(n for r, n in zip(b.requests, b.num_new) if r not in homes and n > 1)
    assert others <= 64 + 256 - 6 * 31, b.num_new                     # the chat's first part at most, and 64 more
    assert b.num_tokens <= 256 + 64 + len(b.requests)


def test_a_prompt_longer_than_a_timed_step_does_not_start_as_short_beside_a_command():
    """A document whose prefix is cached computes 220 of its 492 tokens: under the
    short-prompt limit (256), but in a timed step of 0.25 s (83 tokens at 3 ms) it is not
    short. It used to start whole beside a home command's 18-token tail (a 238-token step,
    0.6 s on the 1 B file, the command's first byte after 1.2 s); now the command starts and
    the document takes what a short step leaves."""
    s = make(num_blocks=400, max_num_batched_tokens=512, step_time_target_s=0.25, short_step_extra_tokens=64,
             max_model_len=4096)
    s.observe_step(512, 1.536)                       # 3 ms a token
    chat = req(n=40, max_tokens=40, client="chat", base=3)
    s.add(chat)
    step(s)
    doc = req(n=220, max_tokens=8, client="doc", base=5)
    home = req(n=18, max_tokens=8, client="ha", base=11)
    s.add(doc)
    s.add(home)
    b = step(s)
    assert home in b.requests and b.num_new[b.requests.index(home)] == 18
    assert b.num_tokens <= 18 + 1 + max(MIN_EXTRA_TOKENS, int(FIRST_TOKENS_STEP_S / 0.003)), b.num_new


def test_a_long_prompt_past_its_wait_starts_before_short_ones():
    s = make(num_blocks=400, max_num_batched_tokens=256, skip_ahead_max_wait_s=10.0, max_model_len=4096)
    long = req(n=900, max_tokens=4, client="doc", arrival=0.0)        # waited "forever"
    s.add(long)
    shorts = [req(n=30, max_tokens=4, client=f"h{i}", base=20 + i) for i in range(3)]
    for r in shorts:
        s.add(r)
    b = step(s)
    assert long in b.requests and b.num_new[b.requests.index(long)] >= 64
    assert all(r in b.requests for r in shorts)                          # and the short ones still start


def test_a_new_answer_s_first_steps_stay_short_while_a_document_is_read():
    """A home command's answer (a tool call whose first streamed byte needs its name, a few
    tokens) decodes beside a document's prefill: its first FIRST_TOKENS steps carry at most
    FIRST_TOKENS_STEP_S of that prefill, not the timed step's full budget (before: each of
    those steps took a full chunk of the document, 0.5 s, and the call's first byte came
    after 2.7 s on the 1 B file; with 8 first tokens, 1.8 s: the name is about 15 tokens in)."""
    s = make(num_blocks=400, max_num_batched_tokens=512, step_time_target_s=0.5, short_step_extra_tokens=64,
             max_model_len=4096)
    s.observe_step(512, 1.536)                       # 3 ms a token: a timed step takes 166
    doc = req(n=1400, max_tokens=4, client="doc", base=3)
    s.add(doc)
    step(s)
    home = req(n=31, max_tokens=40, client="ha", base=11)
    s.add(home)
    extra = max(MIN_EXTRA_TOKENS, int(FIRST_TOKENS_STEP_S / 0.003))   # 10 tokens at 3 ms
    b = step(s)                                      # the command's prompt: a short step
    assert home in b.requests and b.num_tokens <= 31 + extra + 1, b.num_new
    for i in range(FIRST_TOKENS - 1):                # its first tokens: steps of FIRST_TOKENS_STEP_S
        b = step(s)
        assert home in b.requests and b.num_tokens <= extra + 1, (i, b.num_new)
    for _ in range(2):                               # then the document has the step again
        b = step(s)
    assert b.num_tokens > 64 + 1 and doc in b.requests


def test_a_command_s_first_short_steps_take_no_document_and_a_burst_does_not_starve_it():
    """The first SHORT_STEPS_ALONE short steps in a row carry none of a document's prefill
    (a command's prompt and first tokens come ~0.1 s sooner on the 1 B file); a longer run
    of short steps (answers starting one after another) gives the document its share of each
    step again, so it is never starved."""
    s = make(num_blocks=400, max_num_batched_tokens=512, step_time_target_s=0.5, short_step_extra_tokens=64,
             max_model_len=4096, max_num_seqs=32)
    s.observe_step(512, 1.536)                       # 3 ms a token
    doc = req(n=3000, max_tokens=4, client="doc", base=3)
    s.add(doc)
    step(s)
    extra = max(MIN_EXTRA_TOKENS, int(FIRST_TOKENS_STEP_S / 0.003))
    took = []
    for i in range(3 * SHORT_STEPS_ALONE):
        if i % 4 == 0:                               # a new command every few steps: the run goes on
            s.add(req(n=20, max_tokens=40, client=f"ha{i}", base=11 + i))
        before = doc.num_slots
        b = step(s)
        took.append(doc.num_slots - before)
        assert b.num_tokens <= 20 + 32 + extra, (i, b.num_new)
    # a warm command's prompt and the first tokens of its tool call: 7 steps on the 1 B file
    assert SHORT_STEPS_ALONE >= 7 and took[:SHORT_STEPS_ALONE] == [0] * SHORT_STEPS_ALONE, took
    later = took[SHORT_STEPS_ALONE:]
    assert all(t <= extra for t in later) and sum(t > 0 for t in later) >= len(later) // 2, took


def test_a_recomputed_request_does_not_draft_behind_a_token_it_holds():
    """Preempted after its first token and recomputed in chunks of 8: its last chunk leaves
    one token to compute, which the sequence holds already (the recompute put every token
    there), so it is planned as one plain row, not as the last token plus lookup's drafts
    (rows for tokens the sequence does not have: the allocator refused the step and every
    request in it ended with an error; seen once in `test_concurrent_equals_alone_also_under_
    preemption`). The answer goes on, drafts accepted again after it."""
    from edgepaged.engine.speculate import SpecConfig, Speculation
    pat = [11, 12, 13, 14, 15]
    s = make(num_blocks=64, max_num_batched_tokens=8)
    s.spec = Speculation(SpecConfig(mode="lookup"))
    r = req(n=40, max_tokens=60)
    r.prompt_ids = [pat[i % 5] for i in range(40)]
    s.add(r)
    kept_after = 0
    while len(r.output_ids) < 40:
        b = s.schedule()
        assert b is not None
        if r in b.spec:        # the engine's part: every draft that continues the pattern is kept
            kept = 0
            for d in r.drafting.drafts:
                if d != pat[(r.num_tokens + kept) % 5]:
                    break
                kept += 1
            r.output_ids += r.drafting.drafts[:kept]
            r.num_known += kept
            s.alloc.truncate(r.id, r.num_known)
            r.num_slots = s.alloc.seq_num_slots(r.id)
            r.drafting.drafts = []
            kept_after += kept if r.num_preemptions else 0
        if r in b.sampled:
            r.output_ids.append(pat[r.num_tokens % 5])
        if len(r.output_ids) == 1 and not r.num_preemptions:
            s._preempt(r)
    assert r.num_preemptions == 1 and kept_after > 10
    assert r.output_ids[:40] == [pat[(40 + i) % 5] for i in range(40)]


def test_a_long_prompt_beside_a_returning_chat_finishes():
    """A prompt that needs nearly the whole pool, chunked, while a short chat comes back turn
    after turn (its prompt cached between turns): the prompt finishes, preempted at most a few
    times. A block choice that took cached blocks out of LRU order (the pool's pick window, a
    first version) broke the preempted prompt's chain deeper than its tail on every preemption,
    and it was preempted again and again (test_fuzz_doors' embeddings request timed out)."""
    s = make(num_blocks=256, max_model_len=4096, max_num_batched_tokens=64)
    long = Request(prompt_ids=[1000 + i for i in range(4050)], params=SamplingParams(temperature=0, max_tokens=1))
    s.add(long)
    chat = None
    steps = 0
    while long.status is not Status.FREED:
        if chat is None or chat.status is Status.FREED:
            chat = req(60, max_tokens=24, base=5)      # the same question again: its prompt is cached
            s.add(chat)
        assert step(s) is not None
        steps += 1
        assert steps < 400, f"the long prompt did not finish ({s.num_preemptions} preemptions)"
    assert s.num_preemptions <= 3
