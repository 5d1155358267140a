"""Random llama models written as GGUF files in chosen block formats (random block bytes with
sane f16 scales: the `gguf` package cannot quantize K-quants), with a byte-level tokenizer."""
from __future__ import annotations

from pathlib import Path

import numpy as np

# byte offsets of the f16 scales in a block, per GGML type id
SCALE_AT = {2: [0], 3: [0, 2], 8: [0], 12: [0, 2], 14: [208]}
# what one step of the integer code is worth, roughly, for a weight scale of 1 per format
CODE_SPAN = {2: 8, 3: 8, 8: 128, 12: 8 * 32, 14: 32 * 64}


def random_blocks(qtype: int, rows: int, cols: int, rng, std: float | None = None) -> np.ndarray:
    """uint8 [rows, row_bytes] of random blocks; scales put weights at about `std` (default
    a random 1e-3..0.2, either sign, for kernel tests)."""
    import gguf
    bw, bb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    nb = cols // bw
    raw = rng.integers(0, 256, (rows, nb, bb), dtype=np.uint8)
    for i, at in enumerate(SCALE_AT[qtype]):
        if std is None:
            s = rng.uniform(1e-3, 0.2, (rows, nb)) * rng.choice([-1, 1], (rows, nb))
        elif qtype in (3, 12) and i == 1:  # the min (Q4_1 m, Q4_K dmin): centre the weights
            s = np.full((rows, nb), -std * 1.7 if qtype == 3 else std * 1.7 / 32)
        else:
            s = np.full((rows, nb), std / CODE_SPAN[qtype] * 1.7)
        raw[..., at: at + 2] = s.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    if qtype == 14:  # Q6_K int8 sub-block scales: keep them positive and moderate
        raw[..., 192:208] = rng.integers(16, 48, (rows, nb, 16), dtype=np.uint8)
    elif qtype == 12:  # Q4_K packed 6-bit scales/mins: keep them in 16..47
        raw[..., 4:16] = (raw[..., 4:16] & 0x1F) | 0x10
    return raw.reshape(rows, -1)


def write_random_gguf(path, *, hidden: int, layers: int, heads: int, kv_heads: int, inter: int,
                      qtypes: dict[str, int], seed: int = 0, tied: bool = True, context: int = 256) -> Path:
    """A random llama GGUF: `qtypes` maps tensor kinds (token_embd, output, attn_q, attn_k,
    attn_v, attn_output, ffn_gate, ffn_up, ffn_down) to GGML type ids; each kind's bytes are
    made once and shared by every layer (fast to write, same file size)."""
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel
    rng = np.random.default_rng(seed)
    tokens = sorted(ByteLevel.alphabet()) + ["<|im_start|>", "<|im_end|>"]
    vocab = len(tokens)
    head_dim = hidden // heads
    shapes = {"token_embd": (vocab, hidden), "output": (vocab, hidden), "attn_q": (hidden, hidden),
              "attn_k": (kv_heads * head_dim, hidden), "attn_v": (kv_heads * head_dim, hidden),
              "attn_output": (hidden, hidden), "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden),
              "ffn_down": (hidden, inter)}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3])
    w.add_token_merges([])
    w.add_eos_token_id(vocab - 1)
    blocks = {}

    def add(name, kind):
        rows, cols = shapes[kind]
        qt = qtypes[kind]
        if kind not in blocks:
            std = 1.0 if kind == "token_embd" else 1 / np.sqrt(cols)
            if qt == 0:
                blocks[kind] = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
            else:
                blocks[kind] = random_blocks(qt, rows, cols, rng, std)
        w.add_tensor(name, blocks[kind], raw_dtype=None if qt == 0 else gguf.GGMLQuantizationType(qt))

    ones = np.ones(hidden, np.float32)
    add("token_embd.weight", "token_embd")
    if not tied:
        add("output.weight", "output")
    w.add_tensor("output_norm.weight", ones)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            add(f"blk.{i}.{kind}.weight", kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
