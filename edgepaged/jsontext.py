"""JSON text from clients, parsed within one depth bound: a request body and every JSON held in
a string field of one (vLLM's `guided_json`, a tool call's `arguments`, a schema sent as text),
and JSON a model wrote. Past the bound: a ValueError naming it, measured before anything
recurses (Python's parser raised RecursionError past ~1,000 levels, which nobody caught: a
500 and a traceback per 4 KB request).

    value = loads(text)          # ValueError: not JSON, or nested deeper than MAX_DEPTH
"""
from __future__ import annotations

import json
import re

import numpy as np

MAX_DEPTH = 512           # levels of [ and { in one JSON text (a body, a field's text)
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)


class TooDeep(ValueError):
    """JSON nested past MAX_DEPTH."""


def depth(text: str | bytes) -> int:
    """How deep `text`'s brackets nest outside its strings (an upper bound of the JSON's depth;
    unbalanced or invalid text: what its brackets say). Vectorized: ~ms a MiB."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    if b"[" not in raw and b"{" not in raw:
        return 0
    if b'"' in raw:
        raw = _STRING.sub(b"", raw)
    a = np.frombuffer(raw, np.uint8)
    step = ((a == 0x5B) | (a == 0x7B)).astype(np.int32) - ((a == 0x5D) | (a == 0x7D)).astype(np.int32)
    return int(np.cumsum(step).max(initial=0))


def loads(text: str | bytes, what: str = "the JSON", most: int = MAX_DEPTH):
    """`text` parsed; ValueError (TooDeep) when it nests deeper than `most`, or is not JSON."""
    d = depth(text)
    if d > most:
        raise TooDeep(f"{what} nests {d} deep; this server takes at most {most} levels")
    try:
        return json.loads(text)
    except RecursionError:       # (cannot happen under the bound; a ValueError all the same)
        raise TooDeep(f"{what} nests too deep; this server takes at most {most} levels") from None
