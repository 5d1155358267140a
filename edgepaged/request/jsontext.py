"""JSON text from clients, parsed within one depth bound: a request body and every JSON held in
a string field of one (vLLM's `guided_json`, a tool call's `arguments`, a schema sent as text),
and JSON a model wrote. Past the bound: a ValueError naming it, measured before anything
recurses (Python's parser raised RecursionError past ~1,000 levels, which nobody caught: a
500 and a traceback per 4 KB request).

    value = loads(text)          # ValueError: not JSON, or nested deeper than MAX_DEPTH
"""
from __future__ import annotations

import json

import numpy as np

MAX_DEPTH = 512           # levels of [ and { in one JSON text (a body, a field's text)


class TooDeep(ValueError):
    """JSON nested past MAX_DEPTH."""


def depth(text: str | bytes) -> int:
    """How deep `text`'s brackets nest outside its strings (an upper bound of the JSON's depth;
    unbalanced or invalid text: what its brackets say). Vectorized (~ms a MiB), and nothing to
    do where there are too few brackets to pass the bound (a long prompt)."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    opens = raw.count(b"[") + raw.count(b"{")
    if opens <= MAX_DEPTH:                     # (cannot nest deeper than it has brackets)
        return opens if opens < 2 else _depth(raw)
    return _depth(raw)


def _depth(raw: bytes) -> int:
    """The scan on the few places that matter: brackets and quotes (their positions found
    vectorized), not on every byte."""
    a = np.frombuffer(raw, np.uint8)
    opens = np.flatnonzero((a == 0x5B) | (a == 0x7B))
    closes = np.flatnonzero((a == 0x5D) | (a == 0x7D))
    quotes = np.flatnonzero(a == 0x22)
    if len(quotes):   # a quote opens or closes a string unless an odd run of backslashes comes before it
        slashes = np.flatnonzero(a == 0x5C)
        if len(slashes):
            last = np.r_[np.diff(slashes) != 1, True]            # where each run of backslashes ends
            first = np.r_[True, last[:-1]]
            ends, lengths = slashes[last], slashes[last] - slashes[first] + 1
            at = np.minimum(np.searchsorted(ends, quotes - 1), len(ends) - 1)
            run = np.where(ends[at] == quotes - 1, lengths[at], 0)
            quotes = quotes[run % 2 == 0]
    pos = np.concatenate([opens, closes, quotes])
    kind = np.concatenate([np.ones(len(opens), np.int8), -np.ones(len(closes), np.int8),
                           np.zeros(len(quotes), np.int8)])
    order = np.argsort(pos, kind="stable")
    kind = kind[order]
    outside = np.cumsum(kind == 0) % 2 == 0
    return int(np.cumsum(np.where(outside, kind, 0).astype(np.int64)).max(initial=0))


def loads(text: str | bytes, what: str = "the JSON", most: int = MAX_DEPTH):
    """`text` parsed; ValueError (TooDeep) when it nests deeper than `most`, or is not JSON."""
    d = depth(text)
    if d > most:
        raise TooDeep(f"{what} nests {d} deep; this server takes at most {most} levels")
    try:
        return json.loads(text)
    except RecursionError:       # (cannot happen under the bound; a ValueError all the same)
        raise TooDeep(f"{what} nests too deep; this server takes at most {most} levels") from None
