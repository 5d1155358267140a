"""Tiny embedding models of the BERT family for tests and benchmarks: built from transformers'
config classes (BertModel, NomicBertModel) with a small WordPiece vocabulary, saved as Hugging
Face folders (config.json, safetensors, tokenizer files, sentence-transformers' pooling) and
written as GGUF the way llama.cpp's converter writes them (its metadata keys, tensor names and
the vocabulary's word-start mark).

    model, tok = make_encoder("nomic-bert", folder)        # transformers objects, saved to folder
    write_encoder_gguf(folder, "tiny-nomic.gguf")          # the same model as GGUF (F32 or F16)
"""
from __future__ import annotations

import json
import string
from pathlib import Path

import numpy as np

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("the a an is are was of to in on for and or with it this that light lights kitchen living room door "
         "window heat heating temperature turn off on set play music what when where how house home garden "
         "garage bedroom recipe bread flour water salt bake oven minutes hour day night warm cold open close "
         "invoice bill paid paying tax insurance car train school homework math reading book story dog cat").split()
PIECES = ("ing", "ed", "s", "er", "ly", "tion")
POOL_MODES = {"mean": 1, "cls": 2, "last": 3}


def vocabulary() -> list[str]:
    """A small uncased WordPiece vocabulary: specials, characters, continuations, words."""
    chars = list(string.ascii_lowercase + string.digits + string.punctuation) + ["é", "ü"]
    out = SPECIALS + chars + ["##" + c for c in string.ascii_lowercase + string.digits] + \
        ["##" + p for p in PIECES] + [w for w in WORDS if w not in chars]
    seen, vocab = set(), []
    for t in out:
        if t not in seen:
            seen.add(t)
            vocab.append(t)
    return vocab


def make_encoder(kind: str, folder, *, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                 inter: int = 128, context: int = 128, pooling: str = "mean"):
    """(model, tokenizer) of a random `kind` ("bert" | "nomic-bert") model, saved to `folder`."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast, NomicBertConfig, NomicBertModel
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = vocabulary()
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    tok.save_pretrained(folder)
    torch.manual_seed(seed)
    common = dict(vocab_size=len(vocab), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  intermediate_size=inter, max_position_embeddings=context, type_vocab_size=2)
    if kind == "bert":
        model = BertModel(BertConfig(**common, hidden_act="gelu"), add_pooling_layer=False)
    elif kind == "nomic-bert":
        model = NomicBertModel(NomicBertConfig(**common, rope_theta=1000.0))
    else:
        raise ValueError(kind)
    with torch.no_grad():            # layer norms away from 1/0, so a mistake in them shows
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "layernorm" in name or "norm" in name.lower():
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(folder)
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": hidden, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_lasttoken": pooling == "last"}))
    return model, tok


def reference_embeddings(model, tok, texts: list[str], pooling: str = "mean") -> np.ndarray:
    """transformers' vectors, pooled and L2-normalized as sentence-transformers does."""
    import torch
    out = []
    with torch.no_grad():
        for t in texts:
            enc = tok(t, return_tensors="pt")
            h = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state[0]
            v = h.mean(0) if pooling == "mean" else h[0] if pooling == "cls" else h[-1]
            out.append((v / v.norm()).numpy())
    return np.stack(out)


# the shapes households pull (Ollama's names): layers, hidden, heads, FFN, context, vocabulary
SHAPES = {"nomic-embed-text": ("nomic-bert", 12, 768, 12, 3072, 2048, 30528),
          "mxbai-embed-large": ("bert", 24, 1024, 16, 4096, 512, 30522),
          "all-minilm": ("bert", 6, 384, 12, 1536, 512, 30522)}


def write_encoder_gguf(folder, path, *, f16: bool = False) -> Path:
    """The model saved in `folder` (make_encoder) as a GGUF file, as llama.cpp's converter writes it."""
    from safetensors.numpy import load_file

    from ..model.cpu.encoder import HF_TYPES, _hf_config, gguf_names
    folder, path = Path(folder), Path(path)
    cfg = _hf_config(folder)
    kind = HF_TYPES[json.loads((folder / "config.json").read_text())["model_type"]]
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    vocab = (folder / "vocab.txt").read_text().splitlines()
    return _write(path, kind, cfg, gguf_names(state, kind), vocab, f16, folder.name)


def synthetic_encoder_gguf(shape: str, path, *, seed: int = 0, f16: bool = True) -> Path:
    """A random model of a known shape (SHAPES), F16 as Ollama ships them, for benchmarks."""
    from ..model.cpu.encoder import EncoderConfig
    kind, layers, hidden, heads, inter, context, nvocab = SHAPES[shape]
    rng = np.random.default_rng(seed)
    vocab = vocabulary()
    vocab += [f"w{i:05d}" for i in range(nvocab - len(vocab))]
    cfg = EncoderConfig(kind, nvocab, hidden, inter, layers, heads, context, 1e-12,
                        1000.0 if kind == "nomic-bert" else None, "mean", shape)

    def m(rows, cols):
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02)
    t = {"token_embd.weight": m(nvocab, hidden), "token_types.weight": m(2, hidden),
         "token_embd_norm.weight": np.ones(hidden, np.float32), "token_embd_norm.bias": np.zeros(hidden, np.float32)}
    if kind == "bert":
        t["position_embd.weight"] = m(context, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        if kind == "bert":
            for x in "qkv":
                t[p + f"attn_{x}.weight"], t[p + f"attn_{x}.bias"] = m(hidden, hidden), np.zeros(hidden, np.float32)
        else:
            t[p + "attn_qkv.weight"] = m(3 * hidden, hidden)
            t[p + "ffn_gate.weight"] = m(inter, hidden)
        t[p + "attn_output.weight"] = m(hidden, hidden)
        t[p + "ffn_up.weight"], t[p + "ffn_down.weight"] = m(inter, hidden), m(hidden, inter)
        if kind == "bert":
            t[p + "attn_output.bias"] = np.zeros(hidden, np.float32)
            t[p + "ffn_up.bias"], t[p + "ffn_down.bias"] = np.zeros(inter, np.float32), np.zeros(hidden, np.float32)
        for n in ("attn_output_norm", "layer_output_norm"):
            t[p + n + ".weight"], t[p + n + ".bias"] = np.ones(hidden, np.float32), np.zeros(hidden, np.float32)
    return _write(Path(path), kind, cfg, t, vocab, f16, shape)


def _write(path: Path, kind: str, cfg, tensors: dict, vocab: list[str], f16: bool, name: str) -> Path:
    import gguf
    w = gguf.GGUFWriter(str(path), kind)
    w.add_name(name)
    w.add_uint32(f"{kind}.context_length", cfg.context_length)
    w.add_uint32(f"{kind}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{kind}.block_count", cfg.num_layers)
    w.add_uint32(f"{kind}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{kind}.attention.head_count", cfg.num_heads)
    w.add_float32(f"{kind}.attention.layer_norm_epsilon", cfg.eps)
    w.add_bool(f"{kind}.attention.causal", False)
    w.add_uint32(f"{kind}.pooling_type", POOL_MODES[cfg.pooling])
    if kind == "nomic-bert":
        w.add_float32(f"{kind}.rope.freq_base", cfg.rope_theta)
    w.add_uint32("general.file_type", 1 if f16 else 0)
    w.add_string("tokenizer.ggml.model", "bert")
    w.add_string("tokenizer.ggml.pre", "jina-v2-en")
    tokens = [t if t in SPECIALS else t[2:] if t.startswith("##") else "\u2581" + t for t in vocab]
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type", [3 if t in SPECIALS else 1 for t in vocab])
    w.add_uint32("tokenizer.ggml.token_type_count", 2)
    for key, t in (("bos", "[CLS]"), ("eos", "[SEP]"), ("unknown", "[UNK]"), ("seperator", "[SEP]"),
                   ("padding", "[PAD]"), ("mask", "[MASK]")):
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", vocab.index(t))
    for tname, arr in tensors.items():   # (added, not multiplied: llama.cpp keeps these two in F32)
        half = f16 and arr.ndim == 2 and not tname.startswith(("token_types", "position_embd"))
        w.add_tensor(tname, np.ascontiguousarray(arr, dtype=np.float16 if half else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
