"""Tiny random models of every family edgepaged runs, built from transformers' config classes
with each family's quirks switched on, saved as a Hugging Face folder (safetensors, the
family's kind of tokenizer, its chat template) and written as GGUF the way llama.cpp's
converter writes them (its tensor names and metadata keys, Q/K rows permuted for llama,
1 + w in gemma's norms, phi3's fused tensors and LongRoPE factor tensors).

Tokenizers: byte-level BPE trained here with the family's pre-tokenizer (llama, qwen2,
qwen3), or a SentencePiece BPE model with byte fallback trained here and converted by
transformers (mistral, gemma2, gemma3, phi3), each with the family's turn tokens."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .tiny_models import randomize

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
TEMPLATES = Path(__file__).parent / "templates"
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello paged cache",
          "Grüße aus München und Zürich", "добрый день, как дела", "你好，世界。今天天气很好",
          "¿Dónde está la biblioteca? À bientôt!", "numbers 12345 and 67890", "def f(x):\n    return x * 2"]
MULTILINGUAL = "Grüße aus Köln! 你好，世界 — добрый вечер. Ça va? 12345 😀 <tab>\there  two  spaces"

_CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
_LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
           " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
_MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
            "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}")


@dataclass(frozen=True)
class Family:
    name: str
    gguf_arch: str
    spm: bool                  # SentencePiece (else byte-level BPE)
    specials: tuple            # the tokenizer's special tokens, in id order after the SPM's own
    eos: str
    bos: str | None
    end_of_turn: str           # the token that ends an answer
    template: str
    add_bos: bool = False
    dummy_prefix: bool = True  # SPM: a space before the text (not gemma)


_FAMILIES = {
    "llama": Family("llama", "llama", False, ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                               "<|end_header_id|>", "<|eot_id|>"),
                    "<|end_of_text|>", "<|begin_of_text|>", "<|eot_id|>", _LLAMA3, add_bos=True),
    "mistral": Family("mistral", "llama", True, ("[INST]", "[/INST]"), "</s>", "<s>", "</s>", _MISTRAL,
                      add_bos=True),
    # (Qwen2.5's tokenizer has the fill-in-the-middle tokens in every model, the Coder's use them)
    "qwen2": Family("qwen2", "qwen2", False, ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>",
                                              "<|fim_middle|>", "<|fim_suffix|>"), "<|im_end|>", None,
                    "<|im_end|>", _CHATML),
    "qwen3": Family("qwen3", "qwen3", False, ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                                              "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
                    "<|im_end|>", None, "<|im_end|>", "qwen3.jinja"),
    "gemma2": Family("gemma2", "gemma2", True, ("<start_of_turn>", "<end_of_turn>"), "<eos>", "<bos>",
                     "<end_of_turn>", "gemma2.jinja", add_bos=True, dummy_prefix=False),
    "gemma3": Family("gemma3", "gemma3", True, ("<start_of_turn>", "<end_of_turn>"), "<eos>", "<bos>",
                     "<end_of_turn>", "gemma3.jinja", add_bos=True, dummy_prefix=False),
    "phi3": Family("phi3", "phi3", True, ("<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
                   "<|endoftext|>", "<s>", "<|end|>", "phi3.jinja", add_bos=False),
}


def family(name: str) -> Family:
    return _FAMILIES[name]


def template_text(fam: Family) -> str:
    return (TEMPLATES / fam.template).read_text() if fam.template.endswith(".jinja") else fam.template


# ---------------------------------------------------------------- tokenizers

def _bpe_tokenizer(folder: Path, fam: Family, vocab_size: int) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from ..model.tokenizer import _LLAMA3_RE, _QWEN2_RE
    regex = _LLAMA3_RE if fam.name == "llama" else _QWEN2_RE
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(fam.specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    if fam.name == "llama":   # Llama 3: whole words first (ignore_merges), BOS added by the post-processor
        state = json.loads(tok.to_str())
        state["model"]["ignore_merges"] = True
        tok = Tokenizer.from_str(json.dumps(state))
        tok.post_processor = processors.TemplateProcessing(single=f"{fam.bos} $A", pair=f"{fam.bos} $A $B",
                                                           special_tokens=[(fam.bos, tok.token_to_id(fam.bos))])
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template_text(fam), "eos_token": fam.eos,
         "bos_token": fam.bos, "pad_token": fam.specials[0]}))


def _spm_tokenizer(folder: Path, fam: Family, vocab_size: int) -> Path:
    """A SentencePiece BPE model with byte fallback, converted to tokenizer.json by transformers."""
    import sentencepiece as spm
    from transformers import AutoTokenizer
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 20))
    ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>") \
        if fam.name.startswith("gemma") else dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "spm"), vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, add_dummy_prefix=fam.dummy_prefix, user_defined_symbols=list(fam.specials),
        character_coverage=1.0, normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, minloglevel=2, **ids)
    corpus.unlink()
    model = folder / "tokenizer.model"
    (folder / "spm.model").rename(model)
    (folder / "spm.vocab").unlink()
    special = {t: {"content": t, "special": True, "normalized": False, "lstrip": False, "rstrip": False,
                   "single_word": False} for t in fam.specials}
    cls = "GemmaTokenizer" if fam.name.startswith("gemma") else "LlamaTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": cls, "bos_token": fam.bos, "eos_token": fam.eos, "unk_token": "<unk>",
         "pad_token": "<pad>" if fam.name.startswith("gemma") else None, "add_bos_token": fam.add_bos,
         "mask_token": None, "add_eos_token": False, "legacy": True, "add_prefix_space": fam.dummy_prefix,
         "added_tokens_decoder": {str(i): special[t] for i, t in enumerate(fam.specials, 4 if "gemma" in cls.lower()
                                                                             else 3)},
         "chat_template": template_text(fam)}))
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    if fam.dummy_prefix:
        # as the families' own tokenizer.json files have it (Mistral, Phi-3): a space before
        # every stretch of text, special tokens included, as SentencePiece and llama.cpp do
        tj = json.loads((folder / "tokenizer.json").read_text())
        tj["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                                  {"type": "Replace", "pattern": {"String": " "},
                                                                   "content": "\u2581"}]}
        tj["pre_tokenizer"] = None
        tj["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
        (folder / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    return model


def tokenizer_gguf_fields(folder: Path, fam: Family) -> dict:
    """The GGUF tokenizer metadata llama.cpp's converter writes for this folder's tokenizer."""
    tj = json.loads((folder / "tokenizer.json").read_text())
    if fam.spm:
        import sentencepiece as spm
        sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        tokens, scores, types = [], [], []
        for i in range(sp.get_piece_size()):
            piece = sp.id_to_piece(i)
            tokens.append(piece)
            scores.append(sp.get_score(i))
            types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) or piece in fam.specials else
                         6 if sp.is_byte(i) else 4 if piece in fam.specials else 1)
        f = dict(model="llama", tokens=tokens, scores=scores, types=types, add_space_prefix=fam.dummy_prefix)
    else:
        vocab = tj["model"]["vocab"]
        tokens = [None] * len(vocab)
        for t, i in vocab.items():
            tokens[i] = t
        for added in tj["added_tokens"]:
            if added["id"] >= len(tokens):
                tokens += [None] * (added["id"] + 1 - len(tokens))
            tokens[added["id"]] = added["content"]
        merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
        types = [3 if t in fam.specials else 1 for t in tokens]
        f = dict(model="gpt2", tokens=tokens, merges=merges, types=types,
                 pre="llama-bpe" if fam.name == "llama" else "qwen2")
    ids = {t: i for i, t in enumerate(f["tokens"])}
    f.update(bos=ids.get(fam.bos), eos=ids[fam.eos], add_bos=fam.add_bos, template=template_text(fam))
    return f


# ---------------------------------------------------------------- models

def hf_config(name: str, vocab_size: int, token_ids: dict, context: int = 1024, **overrides):
    """The tiny config of family `name`; `overrides` replace its fields (e.g. head_dim=32)."""
    cfg = _hf_config(name, vocab_size, token_ids, context)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def _hf_config(name: str, vocab_size: int, token_ids: dict, context: int = 1024):
    import transformers as T
    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=context, **token_ids)
    if name == "llama":   # Llama 3.1's rope scaling, over a short original context
        return T.LlamaConfig(**common, num_hidden_layers=2, tie_word_embeddings=True, rope_theta=10000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if name == "mistral":
        return T.MistralConfig(**common, num_hidden_layers=2, sliding_window=8, tie_word_embeddings=False)
    if name == "qwen2":
        return T.Qwen2Config(**common, num_hidden_layers=2, tie_word_embeddings=False)
    if name == "qwen3":   # head_dim != hidden / heads on purpose
        return T.Qwen3Config(**common, num_hidden_layers=2, head_dim=32, rope_theta=1e6, tie_word_embeddings=True)
    if name == "gemma2":
        return T.Gemma2Config(**common, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16,
                              sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    if name == "gemma3":
        return T.Gemma3TextConfig(**common, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16,
                                  sliding_window=8, sliding_window_pattern=2, rope_theta=1e6,
                                  rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                                  final_logit_softcapping=3.0)
    if name == "phi3":    # LongRoPE: original context 32, factors for head_dim / 2 = 8 frequencies
        return T.Phi3Config(**common, num_hidden_layers=2, original_max_position_embeddings=32,
                            rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                          "long_factor": [2.0 + 0.5 * i for i in range(8)]},
                            sliding_window=None, tie_word_embeddings=False)
    raise ValueError(name)


def _rig_stop(model, eot: int, prompt: list[int], steps: int = 24, also: tuple = ()) -> None:
    """Make token `eot` win after a few tokens of a greedy answer to `prompt`: a constant in
    the embeddings' feature 1 and a weight on it in the LM head's row of `eot`, the smallest
    of a ladder that makes it appear within `steps` tokens."""
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        emb[:, 1] = 6.0 / (model.config.hidden_size ** 0.5 if model.config.model_type.startswith("gemma") else 1.0)
        for bias in (0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128):
            head[eot, 1] = bias
            out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                                 eos_token_id=eot, pad_token_id=eot)[0, len(prompt):].tolist()
            if eot in out:
                head[eot, 1] = bias * 1.25    # a margin: the answer ends there on other kernels too
                for t in also:                # tokens that should win where a grammar allows them
                    head[t, 1] = bias * 1.25
                return
    raise AssertionError("could not make the end-of-turn token win")


def make_family_model(folder, name: str, seed: int = 0, *, stop_prompt: list[dict] | None = None,
                      rig_token: str | None = None, tools: list | None = None, context: int = 1024,
                      rig_also: tuple = (), overrides: dict | None = None, extra_specials: tuple = ()):
    """Save a tiny random `name` model with its tokenizer and template into `folder`; returns
    the transformers model (eval mode, eager attention). With `stop_prompt` (chat messages)
    the family's end-of-turn token (or `rig_token`) comes within a few tokens of a greedy
    answer to them (rendered with `tools`), for serving tests. `overrides`: config fields
    replaced (`hf_config`); `extra_specials`: special tokens besides the family's (a vision
    model's image tokens)."""
    import dataclasses

    import transformers
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fam = family(name)
    if extra_specials:
        fam = dataclasses.replace(fam, specials=tuple(fam.specials) + tuple(extra_specials))
    if fam.spm:
        _spm_tokenizer(folder, fam, 400)
    else:
        _bpe_tokenizer(folder, fam, 384)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = {"eos_token_id": tok.token_to_id(fam.eos), "bos_token_id": tok.token_to_id(fam.bos) if fam.bos else None,
           "pad_token_id": tok.token_to_id("<pad>") if fam.name.startswith("gemma") else None}
    cfg = hf_config(name, tok.get_vocab_size(), ids, context, **(overrides or {}))
    if stop_prompt is not None:
        from transformers import AutoTokenizer
        kw = {"tools": tools} if tools else {}
        text = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(stop_prompt, tokenize=False,
                                                                               add_generation_prompt=True, **kw)
        stop_prompt = tok.encode(text, add_special_tokens=False).ids
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    randomize(model, seed)
    model.eval()
    if stop_prompt is not None:
        _rig_stop(model, tok.token_to_id(rig_token or fam.end_of_turn), stop_prompt,
                  also=tuple(tok.token_to_id(t) for t in rig_also))
    model.save_pretrained(folder)
    gen = folder / "generation_config.json"
    if gen.exists():
        gen.unlink()
    return model.eval()


# ---------------------------------------------------------------- GGUF as llama.cpp writes it

def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order for llama (interleaved rotary pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate_up_proj": "ffn_up",
          "post_attention_layernorm": "ffn_norm"}
_GEMMA_LAYER = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def _llama3_factors(rope: dict, head_dim: int) -> list[float]:
    """The rope_freqs tensor llama.cpp's converter writes for Llama 3.1's scaling: a divisor
    per frequency (1 for short wavelengths, `factor` for long ones, smoothed between)."""
    import math
    base, factor = rope.get("rope_theta", 10000.0), rope["factor"]
    lo, hi, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def gguf_tensor_name(hf: str, arch: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    i, base, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    names = {**_LAYER, **(_GEMMA_LAYER if arch.startswith("gemma") else {})}
    return f"blk.{i}.{names[base]}.{kind}"


def write_family_gguf(folder, path, model=None, *, qtype: int = 0, user_defined: tuple = (),
                      pooling: int | None = None, arch: str | None = None, template: str | None = None,
                      control: tuple = ()) -> Path:
    """Write the Hugging Face folder's model (or `model`) as a llama.cpp GGUF file at `path`:
    `qtype` 0 (F32), 1 (F16) or 8 (Q8_0) for the 2-D weights; `user_defined`: tokens written
    as text tokens (GGUF's USER_DEFINED), not control tokens (Qwen3's <think> in its files);
    `pooling`: an embedding model's `{arch}.pooling_type` (1 mean, 3 last); `arch`: the
    file's general.architecture (and its keys' prefix) when not the family's own (a family
    a test registers, laid out as the one it varies); `template`: its chat template when not
    the family's; `control`: tokens written as control tokens besides the family's own."""
    import gguf
    import transformers
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    name = {"gemma3_text": "gemma3"}.get(cfg["model_type"], cfg["model_type"])
    fam = family(name)
    layout = fam.gguf_arch        # the tensor layout and the converter's quirks
    arch = arch or layout
    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    c = model.config
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{name}")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if pooling is not None:
        w.add_uint32(f"{arch}.pooling_type", pooling)
    if head_dim != c.hidden_size // heads or name.startswith("gemma") or name == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = c.rope_parameters if isinstance(getattr(c, "rope_parameters", None), dict) else {}
    if name == "gemma3":
        full = rope["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_sliding_window(c.sliding_window)
        # not written by llama.cpp's converter (it assumes 6 and 10000): our tiny model's differ
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", 2)
        w.add_float32(f"{arch}.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
    else:
        w.add_rope_freq_base(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    if name == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
    if name.startswith("gemma") and c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if name == "mistral":
        w.add_sliding_window(c.sliding_window)
    longrope = None
    if name == "llama" and rope.get("rope_type") == "llama3":
        longrope = ("rope_freqs", _llama3_factors(rope, head_dim))
    if name == "phi3":
        w.add_rope_dimension_count(head_dim)
        if rope.get("rope_type") == "longrope":
            orig = rope.get("original_max_position_embeddings") or c.original_max_position_embeddings
            w.add_rope_scaling_orig_ctx_len(orig)
            s = c.max_position_embeddings / orig
            w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(s) / np.log(orig))))
            longrope = (rope["long_factor"], rope["short_factor"])
    tf = tokenizer_gguf_fields(folder, fam)
    tf["types"] = [4 if t in user_defined else 3 if t in control else ty for t, ty in zip(tf["tokens"], tf["types"])]
    w.add_tokenizer_model(tf["model"])
    w.add_token_list(tf["tokens"])
    w.add_token_types(tf["types"])
    if tf["model"] == "gpt2":
        w.add_tokenizer_pre(tf["pre"])
        w.add_token_merges(tf["merges"])
    else:
        w.add_token_scores(tf["scores"])
        w.add_add_space_prefix(tf["add_space_prefix"])
        w.add_unk_token_id(tf["tokens"].index("<unk>"))
    if tf["bos"] is not None:
        w.add_bos_token_id(tf["bos"])
    w.add_eos_token_id(tf["eos"])
    w.add_add_bos_token(tf["add_bos"])
    w.add_chat_template(template or tf["template"])
    fim = [tf["tokens"].index(t) if t in tf["tokens"] else None for t in ("<|fim_prefix|>", "<|fim_suffix|>",
                                                                             "<|fim_middle|>")]
    if None not in fim:          # as llama.cpp's converter writes a Qwen2.5(-Coder)'s
        for key, i in zip(("fim_pre", "fim_suf", "fim_mid"), fim):
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", i)
    T = gguf.GGMLQuantizationType
    for hf, t in model.state_dict().items():
        if hf.endswith("rotary_emb.inv_freq") or (hf == "lm_head.weight" and c.tie_word_embeddings):
            continue
        a = t.detach().float().numpy().copy()
        if name.startswith("gemma") and hf.endswith("norm.weight"):
            a = a + 1.0                    # the converter stores gemma's 1 + w
        if layout == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            a = _permute(a, heads if "q_proj" in hf else kv_heads)
        gname = gguf_tensor_name(hf, layout)
        if a.ndim == 2 and qtype == 8 and a.shape[1] % 32 == 0:
            w.add_tensor(gname, gguf.quants.quantize(a, T.Q8_0), raw_dtype=T.Q8_0)
        elif a.ndim == 2 and qtype == 1:
            w.add_tensor(gname, a.astype(np.float16))
        else:
            w.add_tensor(gname, a.astype(np.float32))
    if longrope and longrope[0] == "rope_freqs":
        w.add_tensor("rope_freqs.weight", np.asarray(longrope[1], np.float32))
    elif longrope:
        w.add_tensor("rope_factors_long.weight", np.asarray(longrope[0], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(longrope[1], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def make_thinker(folder, path) -> Path:
    """A tiny Qwen3 (its real template) whose weights make it open <think> at every step, so
    its answer is all thinking and never closes; <think> a text token as in Qwen3's files.
    Returns the GGUF path."""
    model = make_family_model(folder, "qwen3", seed=3)
    from tokenizers import Tokenizer
    opener = Tokenizer.from_file(str(Path(folder) / "tokenizer.json")).token_to_id("<think>")
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 1] = 6.0
        model.get_output_embeddings().weight[opener, 1] = 64.0
    return write_family_gguf(folder, path, model, user_defined=("<think>", "</think>"))

