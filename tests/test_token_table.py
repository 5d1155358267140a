"""The grammar tokenizer of a vocabulary with many added tokens: llguidance's own reading of a
tokenizer.json registers added tokens in time quadratic in their number (a Llama-3-sized
synthetic file padded with 79,104 reserved control tokens kept a server from "ready" for 28 s,
the GIL held), so past MANY_ADDED_TOKENS the token table goes over as bytes (grammar.py,
`_TokenTable`). The two ways must give the same masks, token for token."""
from __future__ import annotations

import random
import time

import numpy as np
import pytest
from llguidance import LLMatcher

from edgepaged.model.grammar import MANY_ADDED_TOKENS, Grammars, lltokenizer
from edgepaged.model.loader import default_model_path
from edgepaged.model.tokenizer import Tokenizer

SPECS = [
    {"type": "json_schema", "schema": {"type": "object", "properties": {
        "entity_id": {"type": "string", "pattern": "^light\\.[a-z_]+$"},
        "brightness": {"type": "integer", "minimum": 0, "maximum": 255},
        "note": {"type": "string"}}, "required": ["entity_id", "note"]}},
    {"type": "json_object"},
    {"type": "regex", "pattern": "(Yes|No), because [a-zé ]{3,40}\\."},
]
TEXTS = ["Hello, world! ünïcödé 日本語 🙂", " {\"name\": \"light.kitchen\"}", "  two  spaces\n\tand tabs",
         "word"]


def _tokenizers(tmp_path):
    from edgepaged.testing.families import make_family_model, write_family_gguf
    out = [("embedded (byte-level BPE, GGUF)", Tokenizer.load(default_model_path()))]
    for name in ("mistral", "gemma2", "qwen2"):
        folder = tmp_path / name
        hf = make_family_model(folder, name)
        out.append((f"{name} folder", Tokenizer.load(folder)))
        if name == "mistral":   # SentencePiece read from GGUF fields ('llama' kind)
            out.append((f"{name} GGUF", Tokenizer.load(write_family_gguf(folder, tmp_path / f"{name}.gguf", hf))))
    return out


def _mask(m: LLMatcher, n: int) -> np.ndarray:
    bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
    return np.unpackbits(bits.view(np.uint8), bitorder="little")[:n].astype(bool)


def test_a_token_table_masks_exactly_as_the_tokenizer_json_does(tmp_path):
    for label, tok in _tokenizers(tmp_path):
        n = tok.vocab_size
        stops = sorted(tok.stop_token_ids) or None
        json_way = lltokenizer(tok, n, stops, table=False)
        table_way = lltokenizer(tok, n, stops, table=True)
        for text in TEXTS:
            assert table_way.tokenize_str(text) == json_way.tokenize_str(text), (label, text)
        g = Grammars(tok, n)
        for spec in SPECS:
            grammar = g.compile(spec)
            a, b = LLMatcher(json_way, grammar), LLMatcher(table_way, grammar)
            rng = random.Random(7)
            for step in range(40):
                ma, mb = _mask(a, n), _mask(b, n)
                assert ma.any(), (label, spec["type"], step)
                assert np.array_equal(ma, mb), (label, spec["type"], step, np.flatnonzero(ma != mb)[:10])
                if a.is_stopped():
                    break
                allowed = [int(i) for i in np.flatnonzero(ma) if i not in (stops or [])] or \
                    [int(i) for i in np.flatnonzero(ma)]
                token = rng.choice(allowed)
                assert a.consume_token(token) and b.consume_token(token), (label, spec["type"], step)
            assert a.get_error() == b.get_error() == "", label


def test_a_vocabulary_padded_with_many_control_tokens_builds_its_grammar_tokenizer_at_once(tmp_path):
    from edgepaged.testing.gguf_models import write_random_gguf
    base = Tokenizer.load(default_model_path()).vocab_size
    pad = 60_000                 # the JSON way: ~16 s here, quadratic in the padding
    path = write_random_gguf(tmp_path / "padded.gguf", hidden=64, layers=1, heads=2, kv_heads=1, inter=128,
                             qtypes=dict(token_embd=0, attn_q=0, attn_k=0, attn_v=0, attn_output=0, ffn_gate=0,
                                         ffn_up=0, ffn_down=0),
                             tokenizer_from=default_model_path(), vocab=base + pad)
    tok = Tokenizer.load(path)
    assert len(tok.tok.get_added_tokens_decoder()) > MANY_ADDED_TOKENS
    g = Grammars(tok, tok.vocab_size)
    t0 = time.perf_counter()
    g.lltok
    took = time.perf_counter() - t0
    assert took < 5.0, f"the grammar tokenizer took {took:.1f} s"
    # a reserved control token is a special token: never text inside a JSON string
    m = g.matcher(g.compile({"type": "json_schema", "schema": {"type": "object", "properties": {
        "note": {"type": "string"}}, "required": ["note"]}}))
    assert m.consume_tokens(tok.encode('{"note": "', add_special_tokens=False))
    mask = _mask(m, tok.vocab_size)
    assert mask[tok.encode("light", add_special_tokens=False)[0]]
    assert not mask[base:].any()
    reserved = f"<|reserved_special_token_{pad - 1}|>"
    assert tok.tok.token_to_id(reserved) == base + pad - 1
    assert g.lltok.tokenize_str(reserved) == [base + pad - 1]


@pytest.mark.parametrize("table", [False, True])
def test_the_grammar_tokenizer_keeps_the_model_s_vocabulary_size(table):
    """The model's logits may be wider than its tokenizer (padded rows): both ways mask them all."""
    tok = Tokenizer.load(default_model_path())
    n = tok.vocab_size + 64
    ll = lltokenizer(tok, n, sorted(tok.stop_token_ids), table=table)
    assert ll.vocab_size == n
