"""Tokenizer (HF `tokenizers`, built from GGUF metadata or tokenizer.json), chat template,
and an incremental detokenizer with stop strings."""
from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

import numpy as np

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# pre-tokenizer regexes llama.cpp names in tokenizer.ggml.pre
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = _LLAMA3_RE.replace(r"\p{N}{1,3}", r"\p{N}")
# end-of-turn markers that stop generation besides the declared EOS
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>")
_GGUF_CONTROL, _GGUF_USER, _GGUF_UNUSED, _GGUF_BYTE = 3, 4, 5, 6


def _byte_level_pre(pre: str):
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre in ("llama-bpe", "llama3", "qwen2", "smaug-bpe"):
        regex = _QWEN2_RE if pre == "qwen2" else _LLAMA3_RE
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # 'gpt2' / 'default'


def _sentencepiece_merges(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocab: every split of a piece into two pieces, best score first."""
    merges = []
    for piece, pid in vocab.items():
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                merges.append((scores[pid], vocab[left], vocab[right], left, right))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    return [(m[3], m[4]) for m in merges]


# past this many control-token strings `Tokenizer.control_in` looks where one could start
# instead of looking for each (Llama 3 has 256; a vocabulary padded with reserved ones 79 k)
MANY_CONTROL_STRINGS = 1024


def tokenizer_from_gguf(reader) -> "Tokenizer":
    from .loader import gguf_field
    kind = gguf_field(reader, "tokenizer.ggml.model")
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    types = gguf_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in gguf_field(reader, "tokenizer.ggml.merges") or []]
        pre = gguf_field(reader, "tokenizer.ggml.pre", "default")
        tok = HFTokenizer(models.BPE(vocab, merges, ignore_merges=pre in ("llama-bpe", "llama3")))
        tok.pre_tokenizer = _byte_level_pre(pre)
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores = gguf_field(reader, "tokenizer.ggml.scores")
        unk = gguf_field(reader, "tokenizer.ggml.unknown_token_id", 0)
        tok = HFTokenizer(models.BPE(vocab, _sentencepiece_merges(vocab, scores), unk_token=tokens[unk],
                                     fuse_unk=True, byte_fallback=True))
        steps = [normalizers.Replace(" ", "\u2581")]
        dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if gguf_field(reader, "tokenizer.ggml.add_space_prefix", True):
            steps.insert(0, normalizers.Prepend("\u2581"))
            dec.append(decoders.Strip(" ", 1, 0))
        tok.normalizer = normalizers.Sequence(steps)
        tok.decoder = decoders.Sequence(dec)
    elif kind == "bert":
        return _wordpiece_from_gguf(reader, tokens, types)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (edgepaged reads 'gpt2', 'llama' and 'bert')")
    kinds = np.asarray(types)          # (a 128 k-entry vocabulary: no Python loop over it)
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in np.flatnonzero(kinds == _GGUF_CONTROL)])
    user = [AddedToken(tokens[i], special=False, normalized=False) for i in np.flatnonzero(kinds == _GGUF_USER)]
    if user:                           # (an empty call still rebuilds the added-token matcher)
        tok.add_tokens(user)

    def token(key):
        i = gguf_field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and i < len(tokens) else None
    add_bos = gguf_field(reader, "tokenizer.ggml.add_bos_token", kind == "llama")
    # fill-in-the-middle: the ids llama.cpp's converter writes (and their older names)
    fim = tuple(gguf_field(reader, f"tokenizer.ggml.{new}_token_id", gguf_field(reader, f"tokenizer.ggml.{old}_token_id"))
                for new, old in (("fim_pre", "prefix"), ("fim_suf", "suffix"), ("fim_mid", "middle")))
    return Tokenizer(tok, gguf_field(reader, "tokenizer.chat_template"), bos_token=token("bos"),
                     eos_token=token("eos"), unk_token=token("unknown"), pad_token=token("padding"),
                     add_bos=add_bos, fim=fim if all(i is not None and i < len(tokens) for i in fim) else None)


def _wordpiece_from_gguf(reader, tokens: list[str], types: list[int]) -> "Tokenizer":
    """BERT's WordPiece as llama.cpp's converter stores it: a word-starting piece carries a
    leading \u2581, a continuation none (Hugging Face writes it `##piece`), control tokens as
    they are. Lower-cased, accents stripped, split on whitespace and punctuation, wrapped in
    [CLS] ... [SEP] (the BERT tokenizer's defaults for the uncased models households embed with)."""
    from .loader import gguf_field
    vocab = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        piece = t if ty == _GGUF_CONTROL else t[1:] if t.startswith("\u2581") else "##" + t
        vocab.setdefault(piece, i)

    def token(key, default):
        i = gguf_field(reader, f"tokenizer.ggml.{key}_token_id")
        i = default if i is None else i
        return tokens[i] if 0 <= i < len(tokens) else None
    unk = token("unknown", 100) or "[UNK]"
    cls = gguf_field(reader, "tokenizer.ggml.cls_token_id")
    cls = tokens[cls] if cls is not None else token("bos", 101)
    sep = gguf_field(reader, "tokenizer.ggml.seperator_token_id")
    sep = tokens[sep] if sep is not None else token("eos", 102)
    tok = HFTokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    from tokenizers import processors
    tok.post_processor = processors.TemplateProcessing(single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1",
                                                       special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _GGUF_CONTROL])
    return Tokenizer(tok, None, bos_token=cls, eos_token=sep, unk_token=unk, pad_token=token("padding", 0),
                     add_bos=None)


def tokenizer_from_folder(path) -> "Tokenizer":
    path = Path(path)
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    cfg = json.loads((path / "tokenizer_config.json").read_text()) if (path / "tokenizer_config.json").is_file() else {}
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()

    def name(key):
        v = cfg.get(key)
        return v.get("content") if isinstance(v, dict) else v
    extra_eos = []
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        extra_eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
    # tokenizer.json's post-processor already adds BOS where the model wants it
    return Tokenizer(tok, template, bos_token=name("bos_token"), eos_token=name("eos_token"),
                     unk_token=name("unk_token"), pad_token=name("pad_token"), add_bos=None,
                     extra_stop_ids=extra_eos)


# the fill-in-the-middle tokens of the families that have them: Qwen2.5(-Coder), StarCoder,
# CodeLlama (with and without SentencePiece's space mark)
FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
              ("\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>"), ("<PRE>", "<SUF>", "<MID>"))


def _ids(tok: HFTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`text`'s token ids, tokenized without the GIL: `Tokenizer.encode` holds it throughout
    (1 MiB: ~0.6 s in which no other thread of the server runs), the batch call releases it."""
    return tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids


class Tokenizer:
    def __init__(self, tok: HFTokenizer, chat_template: str | None = None, *, bos_token=None, eos_token=None,
                 unk_token=None, pad_token=None, add_bos: bool | None = False, extra_stop_ids=(), fim=None):
        self.tok, self.chat_template, self.add_bos = tok, chat_template, add_bos
        # fill-in-the-middle (prefix, suffix, middle) token ids: the file's, else the known texts
        self.fim = tuple(fim) if fim else next((ids for texts in FIM_TOKENS
                                                if None not in (ids := tuple(tok.token_to_id(t) for t in texts))),
                                               None)
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        self.bos_token_id = tok.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = tok.token_to_id(eos_token) if eos_token else None
        stops = {self.eos_token_id, *extra_stop_ids, *(tok.token_to_id(t) for t in _STOP_TOKENS)}
        self.stop_token_ids = frozenset(i for i in stops if i is not None)
        self._template = None
        # the control tokens' texts, and a twin tokenizer that reads them as plain text
        self.control_strings = tuple(sorted({t.content for t in tok.get_added_tokens_decoder().values()
                                             if t.special and t.content}, key=len, reverse=True))
        self.control_set = frozenset(self.control_strings)
        # for many of them (a vocabulary padded with reserved tokens: 79 k), where each string's
        # own scan of a message would cost 0.2 s: the lengths, and where one may start
        self._control_lengths = sorted({len(c) for c in self.control_strings}, reverse=True)
        firsts = "".join(sorted({c[0] for c in self.control_strings}))
        self._control_start = re.compile(f"[{re.escape(firsts)}]") if firsts else None
        self._plain = None

    @classmethod
    def load(cls, path, reader=None) -> "Tokenizer":
        """From a GGUF file (its metadata) or a Hugging Face folder (tokenizer.json)."""
        if reader is not None:
            return tokenizer_from_gguf(reader)
        path = Path(path)
        if path.is_dir():
            return tokenizer_from_folder(path)
        from .gguf_file import GgufFile
        return tokenizer_from_gguf(GgufFile(path))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special-token text ("<|im_start|>") maps to its id. With add_special_tokens, a BOS is
        prepended when the model asks for one (GGUF add_bos_token / tokenizer.json post-processor)."""
        ids = _ids(self.tok, text, add_special_tokens and self.add_bos is None)
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def fill_in_the_middle(self, prefix: str, suffix: str) -> list[int]:
        """A fill-in-the-middle prompt as llama.cpp's server builds one: [BOS] PRE prefix SUF
        suffix MID (the texts as text: control strings in code stay text); the model writes
        the middle. ValueError for a model without FIM tokens."""
        if self.fim is None:
            raise ValueError("this model has no fill-in-the-middle tokens (a code model's, e.g. Qwen2.5-Coder, "
                             "StarCoder, CodeLlama)")
        pre, suf, mid = self.fim
        bos = [self.bos_token_id] if self.add_bos and self.bos_token_id is not None else []
        return bos + [pre] + self.encode_plain(prefix) + [suf] + self.encode_plain(suffix) + [mid]

    def encode_plain(self, text: str) -> list[int]:
        """`text` as text only: control-token strings in it ("<|im_start|>") become ordinary
        tokens, never the control token."""
        if self._plain is None:
            plain = HFTokenizer.from_str(self.tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return _ids(self._plain, text, False)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True, **kwargs) -> list[int] | str:
        """Render the model's chat template as transformers does; token ids unless tokenize=False.

        Token ids: only the template's own markup yields control tokens. A message whose text
        contains a control string ("<|im_start|>system" pasted from an e-mail) has that text
        tokenized as text, so it can neither close its own turn nor forge another."""
        if self._template is None:
            if not self.chat_template:
                raise ValueError("this model has no chat template; send a raw prompt instead")
            self._template = _compile(self.chat_template)
        special = {k: v for k, v in dict(bos_token=self.bos_token, eos_token=self.eos_token,
                                         unk_token=self.unk_token, pad_token=self.pad_token).items() if v}
        def render(msgs):
            return self._template.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                         **{**special, **kwargs})
        text = render(messages)
        return self._encode_rendered(text, messages, render) if tokenize else text

    def control_in(self, text: str) -> str | None:
        """A control-token string that `text` holds ("<|im_start|>"), or None. Few control
        strings: each one looked for (the longest first); many: each place one could start,
        with every length there is, looked up (time in the text's length, not in the count)."""
        if len(self.control_strings) <= MANY_CONTROL_STRINGS:
            return next((c for c in self.control_strings if c in text), None)
        for m in self._control_start.finditer(text):
            at = m.start()
            for n in self._control_lengths:
                if text[at:at + n] in self.control_set:
                    return text[at:at + n]
        return None

    def _encode_rendered(self, text: str, messages: list[dict], render) -> list[int]:
        """Tokenize a rendered chat: the template's text with control tokens parsed, every
        message text that holds a control string as plain text. Messages without one are
        tokenized exactly as the whole rendered text would be.

        Where each risky message's text lies comes from the renderer itself: `render(messages)`
        is called again with a unique placeholder for each such text, and the rendering is the
        text between the placeholders (the template's own, tokenized with control tokens) and
        the messages' texts (plain). Looking a text up in the rendering instead (`str.find`)
        matched a user's copy of the template's markup (the text that ends the system turn) to
        the template's own, turning the template's end-of-turn into text and the user's copy
        into the control token."""
        def risky_text(t) -> bool:
            return isinstance(t, str) and self.control_in(t) is not None

        def risky_part(p) -> bool:    # a typed content part's text (a vision model's template reads parts)
            return isinstance(p, dict) and p.get("type") == "text" and risky_text(p.get("text"))
        risky = [risky_text(c) or (isinstance(c, list) and any(risky_part(p) for p in c))
                 for c in (m.get("content") for m in messages)]
        if not any(risky):
            return self.encode(text, add_special_tokens=False)
        import secrets
        nonce = secrets.token_hex(8)
        marks, shown = {}, []         # placeholder -> the message text it stands for
        for i, (m, r) in enumerate(zip(messages, risky)):
            if r and isinstance(m["content"], str):
                mark = f"\u2063edgepaged:{nonce}:{i}\u2063"
                marks[mark] = m["content"]
                m = {**m, "content": mark}
            elif r:
                parts = []
                for j, p in enumerate(m["content"]):
                    if risky_part(p):
                        mark = f"\u2063edgepaged:{nonce}:{i}:{j}\u2063"
                        marks[mark] = p["text"]
                        p = {**p, "text": mark}
                    parts.append(p)
                m = {**m, "content": parts}
            shown.append(m)
        marked = render(shown)
        pattern = re.compile("|".join(re.escape(k) for k in marks))
        pieces, pos = [], 0          # (template text, message text) pairs, in order
        for m in pattern.finditer(marked):
            pieces.append((marked[pos:m.start()], marks[m.group(0)]))
            pos = m.end()
        tail = marked[pos:]
        # the template may have trimmed a text it shows ({{ content | trim }}): the same cut here
        texts = self._as_shown(text, pieces, tail)
        if texts is None:
            hit = next(self.control_in(c) for _, c in pieces) if pieces else None
            raise ValueError(f"a message contains the control string {hit!r}, which this model's chat template does "
                             "not keep as plain text")
        ids = []
        for (before, _), shown_text in zip(pieces, texts):
            ids += self.encode(before, add_special_tokens=False) if before else []
            ids += self.encode_plain(shown_text) if shown_text else []
        return ids + (self.encode(tail, add_special_tokens=False) if tail else [])

    @staticmethod
    def _as_shown(text: str, pieces: list, tail: str) -> list[str] | None:
        """How the template showed each message text in `text` (as it is, or trimmed), given
        the template's text around them; None when the rendering is not those pieces."""
        out, pos = [], 0
        for before, content in pieces:
            if not text.startswith(before, pos):
                return None
            pos += len(before)
            for shown in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
                if text.startswith(shown, pos):
                    out.append(shown)
                    pos += len(shown)
                    break
            else:
                return None
        return out if text[pos:] == tail else None


def _compile(source: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a token stream into text deltas.

    Never emits half a UTF-8 character (a decode ending in U+FFFD waits for the next token)
    and never emits text of a stop string: a suffix that may still grow into one is held
    back; when one completes, `stopped` is set and the text before it is the last delta."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids=(), stop: list[str] | tuple = (),
                 skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids = list(prompt_ids)[-6:]  # a little context so the first token decodes with its space
        self.prefix, self.read = 0, len(self.ids)
        self.stop = [s for s in stop if s]
        self.text = ""      # decoded text of the generated tokens (cut at a stop string)
        self.emitted = 0    # len of text handed out
        self.stopped: str | None = None  # the stop string that ended the text

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_id: int) -> str:
        """Feed one token, get the text that is now safe to show (may be '')."""
        if self.stopped is not None:
            return ""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix: self.read])
        new_text = self._decode(self.ids[self.prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text):]
            self.prefix, self.read = self.read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """End of stream: flush held-back text (incomplete bytes decode as U+FFFD)."""
        if self.stopped is None and self.read < len(self.ids):
            prefix_text = self._decode(self.ids[self.prefix: self.read])
            self.text += self._decode(self.ids[self.prefix:])[len(prefix_text):]
            self.prefix = self.read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if self.stop and self.stopped is None:
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, self.emitted)) >= 0]
            if hits:
                end, self.stopped = min(hits)
                self.text = self.text[:end]
            elif not final:
                end -= self._partial_stop()
        delta = self.text[self.emitted: end]
        self.emitted = end
        return delta

    def _partial_stop(self) -> int:
        """Length of the longest tail of the unemitted text that begins some stop string."""
        tail = self.text[self.emitted:]
        for k in range(min(len(tail), max(map(len, self.stop)) - 1), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.stop):
                return k
        return 0
