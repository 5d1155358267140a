"""Constrained decoding with llguidance: a request's output format (JSON, a JSON schema, a
regex, a Lark grammar) becomes a matcher over the model's own tokenizer, whose mask of the
allowed next tokens is applied to that request's logits before sampling.

    g = Grammars(tokenizer, vocab_size)
    grammar = g.compile({"type": "json_schema", "schema": {...}})   # ValueError naming the problem
    m = g.matcher(grammar)                                           # one per request
    masks = Masks.compute([(row, m), ...], rows, vocab)              # off the event loop
    masks.apply(logits)                                              # disallowed tokens: -inf
    m.consume_token(token); m.is_stopped()                           # after sampling

The format spec is transport-neutral: {"type": "json_object"} (any JSON object),
{"type": "json_schema", "schema": {...}}, {"type": "regex", "pattern": "..."},
{"type": "lark", "grammar": "..."}. Every door maps its own fields onto it.
"""
from __future__ import annotations

import json
import threading

import numpy as np

FORMAT_TYPES = ("json_object", "json_schema", "regex", "lark")
# JSON as models write it: one space after ',' and ':', no other whitespace (a small model
# cannot run on in whitespace; a schema's own "x-guidance" may say otherwise)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammars:
    """The llguidance tokenizer of one model (built once, on first use: ~0.1-1 s) and the
    compilation of format specs into grammars and matchers."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lltok = None
        self._lock = threading.Lock()

    @property
    def lltok(self):
        with self._lock:
            if self._lltok is None:
                import llguidance
                # any of the model's stop tokens may end a complete output
                stops = sorted(self.tokenizer.stop_token_ids) or None
                self._lltok = llguidance.LLTokenizer(self.tokenizer.tok.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=stops)
            return self._lltok

    def compile(self, spec: dict) -> str:
        """A format spec -> llguidance grammar text; ValueError saying what is wrong."""
        from llguidance import LLMatcher
        kind = spec.get("type") if isinstance(spec, dict) else None
        if kind not in FORMAT_TYPES:
            raise ValueError(f"format type must be one of {', '.join(FORMAT_TYPES)}, got {kind!r}")
        try:
            if kind == "json_object":
                grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
            elif kind == "json_schema":
                schema = spec.get("schema")
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if not isinstance(schema, dict):
                    raise ValueError("the schema must be a JSON object")
                grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
            elif kind == "regex":
                if not isinstance(spec.get("pattern"), str):
                    raise ValueError("a regex format needs a string pattern")
                grammar = LLMatcher.grammar_from_regex(spec["pattern"])
            else:
                if not isinstance(spec.get("grammar"), str):
                    raise ValueError("a lark format needs a string grammar")
                grammar = LLMatcher.grammar_from_lark(spec["grammar"])
        except ValueError:
            raise
        except Exception as e:     # llguidance's own errors (RuntimeError, ...)
            raise ValueError(f"{e}") from None
        ok, message = _validate(grammar, self.lltok)
        if not ok:
            raise ValueError(message)
        return grammar

    def matcher(self, grammar: str):
        """A fresh matcher at the start of the output; ValueError when the grammar fails."""
        from llguidance import LLMatcher
        m = LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m


def _validate(grammar: str, lltok) -> tuple[bool, str]:
    from llguidance import LLMatcher
    try:
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    except Exception as e:
        return False, str(e)
    if is_error:
        return False, "; ".join(messages) or "the grammar does not compile"
    return True, ""


_executor = None


def _exec():
    global _executor
    if _executor is None:
        from llguidance import LLExecutor
        _executor = LLExecutor()
    return _executor


class Masks:
    """Allowed-token bitmasks of a step's constrained rows (computed together, in llguidance's
    threads, without the GIL), applied to their logits rows."""

    def __init__(self, rows: list[int], bits: np.ndarray, vocab: int):
        self.rows, self.bits, self.vocab = rows, bits, vocab

    @classmethod
    def compute(cls, matchers: list, vocab: int) -> "Masks | None":
        """matchers[i]: row i's matcher or None. None when no row is constrained."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        words = (vocab + 31) // 32
        bits = np.zeros((len(rows), words), np.int32)
        _exec().unsafe_compute_mask_ptr([(matchers[i], j) for j, i in enumerate(rows)], bits.ctypes.data,
                                        words * 4, len(rows))
        return cls(rows, bits, vocab)

    def allowed(self, j: int) -> np.ndarray:
        """Row `rows[j]`'s allowed tokens, bool [vocab]."""
        return np.unpackbits(self.bits[j].view(np.uint8), bitorder="little")[: self.vocab].astype(bool)

    def apply(self, logits) -> None:
        """Disallowed tokens of the constrained rows to -inf (logits: float32 [B, >= vocab],
        numpy or a CPU torch tensor, written in place)."""
        arr = logits if isinstance(logits, np.ndarray) else logits.numpy()
        for j, i in enumerate(self.rows):
            row = arr[i]
            allowed = self.allowed(j)
            row[: self.vocab][~allowed] = -np.inf
            row[self.vocab:] = -np.inf
