"""The benchmarks' household workloads (bench/workloads.py): reproducible from a seed, and a
`--caps` override changes what the clients send as max_tokens and nothing else, so that a
sensitivity run compares the same requests."""
from __future__ import annotations


import pytest

from edgepaged.testing.workloads import CLASSES, mix, parse_caps, poisson


@pytest.fixture(scope="module")
def tok(embedded_runner):
    return embedded_runner.tokenizer


def shape(items):
    return [(it.klass, it.prompt_ids, it.answer_tokens, it.priority, it.client, round(it.at, 9)) for it in items]


def test_a_seed_gives_the_same_requests(tok):
    a = poisson(mix(tok, 30, 3, 0.1), 2.0, 3)
    b = poisson(mix(tok, 30, 3, 0.1), 2.0, 3)
    assert shape(a) == shape(b) and [i.max_tokens for i in a] == [i.max_tokens for i in b]
    assert shape(poisson(mix(tok, 30, 4, 0.1), 2.0, 4)) != shape(a)
    assert {i.klass for i in a} == set(CLASSES)


def test_caps_change_only_the_caps(tok):
    base = mix(tok, 40, 0, 0.15)
    old = mix(tok, 40, 0, 0.15, caps=parse_caps("agent=512,home=64"))   # the defaults before 2026-11-30
    assert shape(old) == shape(base)
    for b, o in zip(base, old):
        if b.klass in ("chat", "document"):
            assert o.max_tokens == b.max_tokens
        else:
            assert o.max_tokens is not None
    agents = [b.max_tokens for b in base if b.klass == "agent"]
    homes = [b.max_tokens for b in base if b.klass == "home"]
    assert None in agents and any(a is not None for a in agents)   # both drawn among 8+ agents
    assert None in homes and any(h is not None for h in homes)
    # a cap never cuts the answer the request really gets
    assert all(o.max_tokens is None or o.max_tokens >= o.answer_tokens for o in base + old)


def test_bad_caps_are_clear_errors():
    assert parse_caps("") == {}
    assert parse_caps("agent=none/512") == {"agent": (None, 512)}
    for bad in ("robot=64", "agent=", "agent=lots"):
        with pytest.raises(ValueError):
            parse_caps(bad)
