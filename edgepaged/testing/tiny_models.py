"""Tiny random models saved in the real file formats (safetensors + tokenizer.json), for
tests that need a real model but not a smart one."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def randomize(model, seed: int) -> None:
    """Deterministic weights with some spread (transformers' init is nearly uniform logits)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def tiny_tokenizer(folder: Path, vocab_size: int = 300) -> None:
    """A small byte-level BPE trained here, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "hello world, hello paged cache"] * 20,
                            trainer)
    tok.save(str(folder / "tokenizer.json"))
    template = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "eos_token": "<|im_end|>",
         "bos_token": None, "pad_token": "<|endoftext|>"}))


def make_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, *, hidden: int = 64, layers: int = 2,
                    context: int = 1024, vocab_size: int = 300) -> Path:
    """Save a tiny random `arch` (llama | qwen2) model with its tokenizer into `folder`."""
    import transformers
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 3 // 2,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=context)
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=False))
    elif arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=True))
    else:
        raise ValueError(arch)
    randomize(model, seed)
    model.save_pretrained(folder)
    tiny_tokenizer(folder, vocab_size)
    return folder
