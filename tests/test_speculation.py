"""Speculative decoding by prompt lookup (issue 36): drafts from the request's own text,
verified in one forward over the paged cache, the rejected ones' slots given back by the
allocator's truncate. Greedy answers are token for token those of a plain decode on every
family; sampled tokens keep the model's distribution (the rejection rule, tested on a
distribution we know); requests that must not draft (constrained, `speculative: false`)
don't; a tight pool preempts drafting requests and every block comes back."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from edgepaged.engine.speculate import propose, verify
from edgepaged.model.params import SamplingParams
from edgepaged.testing.serving import serving
from test_http import afetch

# a prompt a small model tends to continue by copying: a list that repeats
PROMPT = "one two three four five six seven eight nine ten. one two three four five six seven eight nine ten. one two"


def test_propose_finds_the_latest_longest_match():
    toks = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose(toks, 3) == [7, 8, 5]          # the latest occurrence of the 3-gram [1, 2, 3]
    assert propose(toks, 1) == [7]
    assert propose([4, 5, 6], 4) == []             # nothing repeats
    assert propose([5, 5, 5, 5], 2) == [5]         # only what follows inside the sequence
    assert propose(toks, 0) == []


def test_verify_takes_certain_drafts_without_their_rows(embedded_runner):
    """Rows of drafts the format forces after the drafts before them are not computed (`have`
    leaves them out): verify takes those drafts as the grammar forces them and reads each
    other row where it is; the tokens are those of a verify over every row."""
    from edgepaged.engine.speculate import chain_drafts
    from edgepaged.constrain.grammar import Grammars
    g = Grammars(embedded_runner.tokenizer, embedded_runner.config.vocab_size)
    grammar = g.compile({"type": "lark", "grammar": 'start: "{\\"name\\": \\"" ("ab" | "cd") "\\", \\"n\\": 1}"'})
    tok = g.lltok.tokenize_str
    m = g.matcher(grammar)
    text = '{"name": "cd", "n": 1}'
    corpus = tok(text + " " + text)                          # earlier answers: guesses `cd`
    drafts, lead, certain = chain_drafts(m, tok("x"), 8, np.asarray(corpus + [-1], np.int64))
    assert embedded_runner.tokenizer.decode(drafts) == text and not all(certain) and any(certain[lead:])
    V = embedded_runner.config.vocab_size
    rng = np.random.default_rng(0)
    full = rng.standard_normal((len(drafts) + 1, V)).astype(np.float32)
    for i, t in enumerate(drafts[1:] + [min(embedded_runner.tokenizer.stop_token_ids)], 1):
        full[i, t] += 100.0                                  # the model agrees with every draft
    full[0, drafts[0]] += 100.0
    have = [i for i in range(1, len(drafts) + 1) if not (i < len(drafts) and certain[i])]
    params = SamplingParams(temperature=0)
    a = verify(full, drafts, params, [], None, matcher=g.matcher(grammar), vocab=V, forced=lead)
    b = verify(full[[0] + have], drafts, params, [], None, matcher=g.matcher(grammar), vocab=V, forced=lead,
               have=have)
    assert a == b and a[:len(drafts)] == drafts and len(have) < len(drafts)
    # a guess the model does not make: both stop there, with the model's token
    wrong = full.copy()
    j = certain.index(False, lead)                           # the first guess
    wrong[j, drafts[j]] -= 200.0
    a = verify(wrong, drafts, params, [], None, matcher=g.matcher(grammar), vocab=V, forced=lead)
    b = verify(wrong[[0] + have], drafts, params, [], None, matcher=g.matcher(grammar), vocab=V, forced=lead,
               have=have)
    assert a == b and len(a) == j + 1 and a[j] != drafts[j]


def test_sampled_verification_keeps_the_models_distribution():
    """A row distribution p and a draft d: the first token kept is distributed as p whatever
    d is (chi-square against p, 20,000 draws, 5 degrees of freedom, p < 0.001 bound 20.5), and
    d is kept as often as p(d) says."""
    rng = np.random.default_rng(0)
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = np.log(p)[None, :].repeat(3, 0).astype(np.float32)
    params = SamplingParams(temperature=1.0)
    n = 20000
    for draft in (0, 3, 5):
        runs = [verify(logits, [draft, 1], params, [], None) for _ in range(n)]
        first = Counter(r[0] for r in runs)
        counts = np.array([first[i] for i in range(len(p))])
        chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
        assert chi2 < 20.5, (draft, counts, chi2)
        kept = sum(len(r) > 1 for r in runs) / n              # the draft kept: a second token came
        assert abs(kept - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / n), (draft, kept)
    # greedy: a draft is kept only where it is the argmax, then the model's own token
    assert verify(logits, [0, 0], SamplingParams(temperature=0), [], None) == [0, 0, 0]
    assert verify(logits, [2, 0], SamplingParams(temperature=0), [], None) == [0]
    del rng


async def _answers(runner, speculation: str, prompts, max_tokens=48, chat=False, **body) -> tuple[list, dict]:
    out = []
    async with serving(runner, http=True, engine={"speculation": speculation}) as server:
        for p in prompts:
            ask = {"messages": [{"role": "user", "content": p}]} if chat else {"prompt": p}
            status, _, raw = await afetch(server.http_base + ("/v1/chat/completions" if chat else "/v1/completions"),
                                          {**ask, "max_tokens": max_tokens, "temperature": 0, **body})
            assert status == 200, raw
            choice = json.loads(raw)["choices"][0]
            out.append(choice["message"]["content"] if chat else choice["text"])
        stats = server.engine.stats()
        assert stats["kv_blocks_used"] == 0
        server.engine.allocator.check_invariants()
    return out, stats["speculation"]


@pytest.mark.parametrize("runtime", ["cpu", "torch"])
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
async def test_greedy_answers_are_the_plain_ones_on_every_family(name, runtime, tmp_path):
    from edgepaged.model import ModelRunner
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.testing.families import make_family_model, write_family_gguf
    hf = make_family_model(tmp_path / "m", name, seed=11)
    gguf = write_family_gguf(tmp_path / "m", tmp_path / "m.gguf", hf, qtype=0)
    prompts = [PROMPT, "the cat sat on the mat and the cat sat on the", "a b a b a b a b"]

    def runner():
        return CpuRunner(gguf, num_blocks=64) if runtime == "cpu" else ModelRunner(gguf, num_blocks=64)
    plain, _ = await _answers(runner(), "off", prompts)
    spec, stats = await _answers(runner(), "lookup", prompts)
    assert spec == plain
    assert stats["interactive"]["drafted"] > 0, stats          # it did draft


async def test_the_embedded_model_copies_and_accepts(embedded_runner):
    """On a real model a repeated list is copied: most drafts are kept, the answer is the plain one."""
    text = "Repeat this list exactly: apples, pears, plums, cherries, grapes, lemons, limes, figs, dates."
    plain, _ = await _answers(embedded_runner, "off", [text], max_tokens=40, chat=True)
    spec, stats = await _answers(embedded_runner, "lookup", [text], max_tokens=40, chat=True)
    assert spec == plain and "pears" in plain[0]
    s = stats["interactive"]
    assert s["drafted"] > 0 and s["accepted"] > 0, s
    # sampled with a seed: each row draws as the plain step at that position would, so the
    # answer is the plain one too
    seeded = {"temperature": 0.8, "seed": 7}
    plain, _ = await _answers(embedded_runner, "off", [text], max_tokens=40, chat=True, **seeded)
    spec, stats = await _answers(embedded_runner, "lookup", [text], max_tokens=40, chat=True, **seeded)
    assert spec == plain and stats["interactive"]["accepted"] > 0, stats


async def test_who_does_not_draft(embedded_runner):
    """`speculative: false` and logprobs: no drafts."""
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    async with serving(embedded_runner, http=True) as server:
        for extra in ({"speculative": False}, {"logprobs": 2}):
            status, _, raw = await afetch(server.http_base + "/v1/completions", {**body, **extra})
            assert status == 200, raw
        assert server.engine.stats()["speculation"] == {}
        status, _, raw = await afetch(server.http_base + "/v1/completions", body)
        assert server.engine.stats()["speculation"]["interactive"]["drafted"] > 0


async def test_a_format_composes_with_drafts(embedded_runner):
    """A JSON schema's answer drafts too: each draft's row is masked by the grammar's state
    after the drafts before it (a draft the grammar forbids is rejected); the answer is the
    plain one and valid."""
    schema = {"type": "object", "properties": {"fruits": {"type": "array", "items": {"type": "string"}}},
              "required": ["fruits"]}
    ask = {"messages": [{"role": "user", "content": "Put these fruits in JSON: apples, pears, plums, cherries, "
                                                   "grapes, lemons, limes, figs."}],
           "max_tokens": 60, "temperature": 0,
           "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}}}
    out = {}
    async with serving(embedded_runner, http=True) as server:
        for spec in (False, True):
            status, _, raw = await afetch(server.http_base + "/v1/chat/completions", {**ask, "speculative": spec})
            assert status == 200, raw
            out[spec] = json.loads(raw)["choices"][0]["message"]["content"]
        stats = server.engine.stats()
        assert stats["kv_blocks_used"] == 0
    assert out[True] == out[False]
    assert isinstance(json.loads(out[True])["fruits"], list)
    assert stats["speculation"]["interactive"]["drafted"] > 0, stats


async def test_tokens_a_format_forces_are_drafts(embedded_runner):
    """What a format forces (a schema's property names, `{"response": "` of the generic tool
    syntax) is drafted and kept in one forward: the same answer in fewer steps."""
    props = {"the_kitchen_light_brightness_percent": {"type": "integer"},
             "the_living_room_thermostat_setting_in_celsius": {"type": "integer"}}
    schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    ask = {"messages": [{"role": "user", "content": "Kitchen light at 40, living room at 21 degrees."}],
           "max_tokens": 80, "temperature": 0,
           "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}}}
    out, steps = {}, {}
    async with serving(embedded_runner, http=True) as server:
        for spec in (False, True):
            before = server.engine.stats()["num_steps"]
            status, _, raw = await afetch(server.http_base + "/v1/chat/completions", {**ask, "speculative": spec})
            assert status == 200, raw
            out[spec] = json.loads(raw)["choices"][0]["message"]["content"]
            steps[spec] = server.engine.stats()["num_steps"] - before
        stats = server.engine.stats()
        assert stats["kv_blocks_used"] == 0
    assert out[True] == out[False] and set(json.loads(out[True])) == set(props)
    assert stats["speculation"]["interactive"]["forced"] >= 10, stats["speculation"]
    assert steps[True] < steps[False] - 8, steps


async def test_what_a_format_forces_first_rides_on_the_prompt_s_last_chunk(embedded_runner):
    """The tokens a format forces before its first choice (`{"` and the first required
    property's name of a schema) are drafts of the chunk that ends the prompt: its last row
    draws the first forced token, the drafts' rows the rest and the format's first choice, so
    the answer's first choice comes out of the prompt's own step (before: one more step of
    the whole model). The answer is the plain one; every block comes back."""
    props = {"the_kitchen_light_brightness_percent": {"type": "integer"}}
    schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    ask = {"messages": [{"role": "user", "content": "Kitchen light at 40."}], "max_tokens": 30, "temperature": 0,
           "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}}}
    out, firsts = {}, {}
    async with serving(embedded_runner, http=True) as server:
        eng = server.engine
        for spec in (False, True):
            seen = []

            def hook(batch, seen=seen):
                for r in batch.sampled:
                    if not r.output_ids:                 # the step that ends its prompt
                        j = batch.requests.index(r)
                        seen.append((batch.num_new[j], len(r.prompt_ids) - r.num_cached, r in batch.spec,
                                     list(r.drafting.drafts)))
            eng.step_hook = hook
            status, _, raw = await afetch(server.http_base + "/v1/chat/completions", {**ask, "speculative": spec})
            eng.step_hook = None
            assert status == 200, raw
            out[spec] = json.loads(raw)["choices"][0]["message"]["content"]
            firsts[spec] = seen
        stats = eng.stats()
        assert stats["kv_blocks_used"] == 0
        eng.allocator.check_invariants()
    assert out[True] == out[False] and set(json.loads(out[True])) == set(props)
    (n, computed, drafted, drafts), = firsts[True]
    assert drafted and len(drafts) >= 3 and n == computed + len(drafts), firsts   # `{"`, the name's tokens
    (n, computed, drafted, drafts), = firsts[False]
    assert not drafted and n == computed


def test_lookup_guesses_a_grammar_forbids_are_cut(embedded_runner):
    """At a choice of a constrained answer's format, prompt lookup guesses what followed the
    same tokens in the prompt: Home Assistant's prompt lists its tools as JSON, so after the
    answer's `{"` it guesses a tool's `type": "function"`, which the generic tool syntax
    forbids (8 rows computed for nothing in a step of the warm command, bench/RESULTS.md).
    `chain_drafts` keeps the longest run the grammar allows: none of those, all of a run it
    allows (to the format's end); the matcher is left as it was."""
    from edgepaged.engine.speculate import chain_drafts
    from edgepaged.constrain.grammar import Grammars
    g = Grammars(embedded_runner.tokenizer, embedded_runner.config.vocab_size)
    grammar = g.compile({"type": "lark", "grammar": 'start: "{\\"" ("tool_calls\\": [1]" | "response\\": \\"ok\\"") "}"'})
    tok = g.lltok.tokenize_str
    for seen, want in (('{"type": "function"} ', ""), ('{"response": "ok"} ', 'response": "ok"}')):
        ids = tok(seen * 3 + '{"')
        m = g.matcher(grammar)
        assert m.consume_tokens(tok('{"'))
        assert propose(ids, 8), seen                        # lookup guesses something
        chain, lead, certain = chain_drafts(m, ids, 8)
        assert lead == 0 and embedded_runner.tokenizer.decode(chain) == want, (seen, chain)
        assert len(certain) == len(chain) and not any(certain[:1])
        assert not m.is_error() and m.validate_tokens(chain) == len(chain)   # the matcher's state is untouched
        assert m.compute_ff_tokens() == []


def test_a_chain_runs_through_forced_tokens_and_earlier_answers(embedded_runner):
    """Drafts chain what a format forces and guesses at its choices: from the start of a
    tool call's format, with an earlier answer of the same identity (`AnswerHistory`) as
    lookup's second source, the chain is that whole answer (`{"` forced, `to` guessed,
    `ol_calls": [{"name": "` forced, the name guessed ...): one step can check it all. Without
    an earlier answer only the forced `{"`; another identity's answers are not its source."""
    from edgepaged.engine.speculate import AnswerHistory, chain_drafts
    from edgepaged.constrain.grammar import Grammars
    g = Grammars(embedded_runner.tokenizer, embedded_runner.config.vocab_size)
    names = " | ".join(f'"{n}"' for n in ("HassTurnOn", "HassTurnOff", "HassLightSet"))
    grammar = g.compile({"type": "lark", "grammar": 'start: "{\\"" ("tool_calls\\": [{\\"name\\": \\"" name '
                                                    '"\\"}]" | "response\\": \\"ok\\"") "}"\nname: ' + names})
    tok, dec = g.lltok.tokenize_str, embedded_runner.tokenizer.decode
    prompt = tok("<|im_start|>user\nTurn off the kitchen light.<|im_end|>\n<|im_start|>assistant\n")
    answers = {}
    for name in ("HassTurnOff", "HassLightSet"):
        m, text = g.matcher(grammar), '{"tool_calls": [{"name": "' + name + '"}]}'
        out = []
        while len(dec(out)) < len(text):                     # as the answer came out
            ff = m.compute_ff_tokens()
            t = ff if ff else tok(text[len(dec(out)):])[:1]
            assert m.consume_tokens(t), (text, dec(out), t)
            out += t
        assert dec(out) == text and m.is_stopped()
        answers[name] = out
    m = g.matcher(grammar)
    alone, lead, certain = chain_drafts(m, prompt, 8)
    assert dec(alone) == '{"' and lead == len(alone) and all(certain)   # only what the format forces
    for name, ans in answers.items():
        history = AnswerHistory()
        history.add(7, prompt, ans)
        chain, lead, certain = chain_drafts(m, prompt, 8, history.corpus(7))
        assert chain == ans and dec(chain[:lead]) == '{"', (name, dec(chain))
        # certain: `{"` and what the format forces after each guess (`ol_calls": [{"name": "`, ...)
        assert certain[:lead] == [True] * lead and not certain[lead] and sum(certain) > len(chain) // 2
        assert dec([t for t, c in zip(chain, certain) if not c]).startswith("to")
        assert history.corpus(8) is None                     # another identity: nothing
        assert m.compute_ff_tokens() == alone and not m.is_error()   # the matcher as it was
    # k bounds the guesses, not the forced tokens between them
    short, lead, _ = chain_drafts(m, prompt, 1, history.corpus(7))
    assert dec(short).startswith('{"tool_calls": [{"name": "') and len(short) < len(answers["HassLightSet"])


def test_a_streamed_call_s_first_drafts_end_where_its_name_is_out(embedded_runner):
    """A door that streams a call's name as soon as it is complete (OpenAI's chunks) needs the
    prompt's step to draft only that far: `tools.name_cut` finds the fewest drafts of the chain
    after which a stream gives the name out (the forced run after them counts as `ahead`, as
    the engine sends it), so the first byte does not wait for the arguments' rows (a warm Home
    Assistant command: 23 drafts -> 13). A chain that never completes a name is not cut."""
    from edgepaged.request import tools as tl
    from edgepaged.engine.speculate import AnswerHistory, chain_drafts
    from edgepaged.constrain.grammar import Grammars
    rt = embedded_runner.tokenizer
    g = Grammars(rt, embedded_runner.config.vocab_size)
    syntax = tl.ToolSyntax("generic", ())
    fns = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}
           for n in ("HassTurnOn", "HassTurnOff")]
    grammar = g.compile({"type": "lark", "grammar": syntax.auto_grammar(tl.check_tools(fns))})
    tok, dec = g.lltok.tokenize_str, rt.decode
    prompt = tok("<|im_start|>user\nTurn off the kitchen light.<|im_end|>\n<|im_start|>assistant\n")
    text = '{"tool_calls": [{"name": "HassTurnOff", "arguments": {"name": "kitchen light"}}]}'
    m, out = g.matcher(grammar), []
    while len(dec(out)) < len(text):                         # the earlier answer, as it came out
        ff = m.compute_ff_tokens()
        t = ff if ff else tok(text[len(dec(out)):])[:1]
        assert m.consume_tokens(t), (dec(out), t)
        out += t
    history = AnswerHistory()
    history.add(7, prompt, out)
    chain, lead, certain = chain_drafts(g.matcher(grammar), prompt, 16, history.corpus(7))
    assert dec(chain) == text
    j = tl.name_cut(syntax, rt, chain, certain)
    assert j is not None and 0 < j < len(chain) and dec(chain[:j]).endswith("Off"), dec(chain[:j])
    run = j
    while certain[run]:
        run += 1
    stream = tl.ToolStream(syntax, rt)                       # what the stream gives out after that step
    stream.push(chain[:j], dec(chain[:j]))
    assert stream.deltas() == [] and [p["name"] for _, p in stream.name_ahead(chain[j:run])] == ["HassTurnOff"]
    assert tl.name_cut(syntax, rt, chain[:j - 1], certain[:j - 1]) is None     # the name not complete
    reply = '{"response": "ok"}'
    assert tl.name_cut(syntax, rt, tok(reply), [False] * len(tok(reply))) is None


def test_answer_history_is_bounded():
    from edgepaged.engine.speculate import AnswerHistory
    h = AnswerHistory(max_tokens=100, max_ids=3)
    for i in range(50):
        h.add(1, [9] * 20, list(range(i, i + 30)))
    assert len(h.corpus(1)) <= 100 and h.corpus(1)[-2] == 49 + 29   # the latest answers kept
    for salt in range(2, 6):
        h.add(salt, [1], [2, 3])
    assert h.corpus(1) is None and h.corpus(2) is None and h.corpus(5) is not None   # the identities seen last
    h.add(9, [1], [2])                                       # one token: nothing to guess from
    assert h.corpus(9) is None


async def test_an_identity_s_earlier_answers_draft_its_next_one(embedded_runner):
    """A household asks the same shape again: the second command's answer is drafted from the
    first's (its format's forced runs and its choices, in the prompt's own step) and comes in
    fewer steps; the answer is the plain one (`speculative: false`), and another identity,
    with no earlier answers of its own, drafts only what the format forces."""
    schema = {"type": "object", "properties": {"name": {"enum": ["HassTurnOn", "HassTurnOff", "HassLightSet"]},
                                               "area": {"enum": ["kitchen", "bedroom", "office"]}},
              "required": ["name", "area"], "additionalProperties": False}

    def ask(text, user, **extra):
        return {"messages": [{"role": "user", "content": text}], "max_tokens": 40, "temperature": 0, "user": user,
                "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}}, **extra}
    out, steps = {}, {}
    async with serving(embedded_runner, http=True) as server:
        async def run(key, body):
            before = server.engine.stats()["num_steps"]
            status, _, raw = await afetch(server.http_base + "/v1/chat/completions", body)
            assert status == 200, raw
            out[key] = json.loads(raw)["choices"][0]["message"]["content"]
            steps[key] = server.engine.stats()["num_steps"] - before
        await run("plain", ask("Turn off the kitchen light.", "carol", speculative=False))
        await run("first", ask("Turn off the kitchen light.", "anna"))
        await run("again", ask("Turn off the kitchen light.", "anna"))
        await run("other", ask("Turn off the kitchen light.", "jonas"))
        stats = server.engine.stats()
        assert stats["kv_blocks_used"] == 0
        server.engine.allocator.check_invariants()
    assert out["first"] == out["again"] == out["other"] == out["plain"], out
    assert json.loads(out["plain"])["name"].startswith("Hass")
    assert steps["again"] <= 2 < steps["other"], steps      # the whole answer checked in the prompt's step
    assert steps["other"] == steps["first"], steps


async def test_a_streamed_command_s_prompt_step_drafts_to_its_call_s_name(embedded_runner):
    """On the OpenAI door a streamed call goes out name first: the prompt's step of a command
    drafted from the identity's earlier answer stops where the name is out (the arguments
    are drafted by the next step), not streamed it drafts the whole call; both answers are the
    same call, and the stream's first call chunk carries the name."""
    from edgepaged.request.frontend import Caller
    from edgepaged.request.schema import GenerateRequest
    from edgepaged.request.tools import check_tools
    fns = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"name": {"type": "string", "enum": ["kitchen light", "bedroom blinds"]}},
        "required": ["name"], "additionalProperties": False}}} for n in ("HassTurnOn", "HassTurnOff")]
    ask = [{"role": "user", "content": "Turn off the kitchen light."}]
    body = {"messages": ask, "max_tokens": 40, "temperature": 0, "user": "anna", "tools": fns, "tool_choice": "required"}
    dec = embedded_runner.tokenizer.decode
    async with serving(embedded_runner, http=True) as server:
        status, _, raw = await afetch(server.http_base + "/v1/chat/completions", body)
        assert status == 200, raw
        call = json.loads(raw)["choices"][0]["message"]["tool_calls"][0]["function"]
        chains = {}
        for streamed in (False, True):
            item = GenerateRequest("x", "chat", messages=ask, max_tokens=40, tools=check_tools(fns),
                                   tool_choice="required", sampling={"temperature": 0})
            item.stream_calls = streamed
            req = (await server.front.build(item, server.front.caller(None, "anna", "127.0.0.1"))).req
            chains[streamed] = dec(req.drafting.chain[1])
        status, _, sse = await afetch(server.http_base + "/v1/chat/completions", {**body, "stream": True})
        assert status == 200
    # (lookup guesses a name from the prompt's tool list or the earlier answer: a guess)
    assert chains[False].endswith("}]}") and chains[False].startswith('{"tool_calls": [{"name": "Hass'), chains
    assert chains[True].endswith(("HassTurnOn", "HassTurnOff")) and chains[False].startswith(chains[True]), chains
    parts = [json.loads(line[6:])["choices"][0]["delta"].get("tool_calls") for line in sse.decode().splitlines()
             if line.startswith("data: {")]
    parts = [p[0] for p in parts if p]
    assert parts[0]["function"] == {"name": call["name"], "arguments": ""}
    assert "".join(p["function"].get("arguments", "") for p in parts) == call["arguments"]


async def _burst(runner, prompts, warm=False, **body) -> tuple[list, dict]:
    """Every prompt at once (greedy, 40 tokens) on `runner`, speculation allowed for all of
    them; the answers and the engine's stats, after checking every block came back. `warm`:
    the first prompt once before the burst."""
    import trio
    got = [None] * len(prompts)
    async with serving(runner, http=True, engine={"spec_max_running": 8}) as server:
        async def one(i):
            status, _, raw = await afetch(server.http_base + "/v1/completions",
                                          {"prompt": prompts[i], "max_tokens": 40, "temperature": 0, **body})
            assert status == 200, raw
            got[i] = json.loads(raw)["choices"][0]["text"]
        if warm:
            await one(0)
        async with trio.open_nursery() as n:
            for i in range(len(prompts)):
                n.start_soon(one, i)
        stats = server.engine.stats()
        assert stats["kv_blocks_used"] == 0
        server.engine.allocator.check_invariants()
    return got, stats


async def test_a_tight_pool_preempts_constrained_requests_with_forced_drafts_and_loses_nothing(tmp_path):
    """Eight constrained answers at once on a pool of 96 tokens: each prompt's last
    chunk carries its format's forced tokens as drafts, drafting ones are preempted and
    resumed (their prompt and answer computed again, the forced drafts riding again); each
    answer is the one without speculation, every block comes back."""
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.testing.families import make_family_model, write_family_gguf
    hf = make_family_model(tmp_path / "m", "llama", seed=3)
    gguf = write_family_gguf(tmp_path / "m", tmp_path / "m.gguf", hf, qtype=0)
    schema = {"type": "object", "properties": {"the_answer_in_a_few_words": {"type": "string", "maxLength": 30},
                                               "how_many_things_were_counted": {"type": "integer"}},
              "required": ["the_answer_in_a_few_words", "how_many_things_were_counted"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}}
    prompts = [f"{i} one two" for i in range(8)]
    plain, _ = await _answers(CpuRunner(gguf, num_blocks=64), "off", prompts, max_tokens=40,
                              response_format=fmt)
    # the format compiled once first: the eight then arrive together
    got, stats = await _burst(CpuRunner(gguf, num_blocks=6, block_size=16), prompts, warm=True,
                              response_format=fmt)
    assert got == plain
    assert stats["num_preemptions"] > 0 and stats["speculation"]["interactive"]["forced"] > 0, stats


async def test_a_tight_pool_preempts_drafting_requests_and_loses_nothing(tmp_path):
    """Eight requests at once on a pool that holds about two: drafting ones are preempted and
    resumed; each answer is its plain one, every block comes back."""
    from edgepaged.model.cpu.runner import CpuRunner
    from edgepaged.testing.families import make_family_model, write_family_gguf
    hf = make_family_model(tmp_path / "m", "llama", seed=3)
    gguf = write_family_gguf(tmp_path / "m", tmp_path / "m.gguf", hf, qtype=0)
    prompts = [f"{i} {PROMPT}" for i in range(8)]
    plain, _ = await _answers(CpuRunner(gguf, num_blocks=64), "off", prompts, max_tokens=40)
    got, stats = await _burst(CpuRunner(gguf, num_blocks=14, block_size=16), prompts)
    assert got == plain
    assert stats["num_preemptions"] > 0 and stats["speculation"]["interactive"]["drafted"] > 0, stats
