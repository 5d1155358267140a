"""Random llama models written as GGUF files in chosen block formats (random block bytes with
sane f16 scales: the `gguf` package cannot quantize K-quants), with a byte-level tokenizer."""
from __future__ import annotations

from pathlib import Path

import numpy as np

# byte offsets of the f16 scales in a block, per GGML type id
SCALE_AT = {2: [0], 3: [0, 2], 6: [0], 7: [0, 2], 8: [0], 12: [0, 2], 13: [0, 2], 14: [208]}
# what one step of the integer code is worth, roughly, for a weight scale of 1 per format
CODE_SPAN = {2: 8, 3: 8, 6: 16, 7: 16, 8: 128, 12: 8 * 32, 13: 16 * 32, 14: 32 * 64}


def random_blocks(qtype: int, rows: int, cols: int, rng, std: float | None = None) -> np.ndarray:
    """uint8 [rows, row_bytes] of random blocks; scales put weights at about `std` (default
    a random 1e-3..0.2, either sign, for kernel tests)."""
    import gguf
    if qtype in (1, 30):   # F16 / BF16: the values themselves
        w = rng.standard_normal((rows, cols)) * (std if std is not None else rng.uniform(1e-3, 0.2))
        if qtype == 1:
            return w.astype(np.float16).view(np.uint8).reshape(rows, -1)
        return (w.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    bw, bb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    nb = cols // bw
    raw = rng.integers(0, 256, (rows, nb, bb), dtype=np.uint8)
    for i, at in enumerate(SCALE_AT[qtype]):
        if std is None:
            s = rng.uniform(1e-3, 0.2, (rows, nb)) * rng.choice([-1, 1], (rows, nb))
        elif qtype in (3, 7, 12, 13) and i == 1:  # the min (Q4_1/Q5_1 m, Q4_K/Q5_K dmin): centre the weights
            s = np.full((rows, nb), -std * 1.7 if qtype in (3, 7) else std * 1.7 / 32)
        else:
            s = np.full((rows, nb), std / CODE_SPAN[qtype] * 1.7)
        raw[..., at: at + 2] = s.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    if qtype == 14:  # Q6_K int8 sub-block scales: keep them positive and moderate
        raw[..., 192:208] = rng.integers(16, 48, (rows, nb, 16), dtype=np.uint8)
    elif qtype in (12, 13):  # Q4_K / Q5_K packed 6-bit scales/mins: keep them in 16..47
        raw[..., 4:16] = (raw[..., 4:16] & 0x1F) | 0x10
    return raw.reshape(rows, -1)


# llama.cpp's Q4_K_M mix, as the issue on 1-8 B speed describes it: Q4_K, with Q6_K for the
# value and down projections and the embeddings (tied LM head)
Q4_K_M = dict(token_embd=14, attn_q=12, attn_k=12, attn_v=14, attn_output=12, ffn_gate=12, ffn_up=12, ffn_down=14)


def write_random_gguf(path, *, hidden: int, layers: int, heads: int, kv_heads: int, inter: int,
                      qtypes: dict[str, int], seed: int = 0, tied: bool = True, context: int = 256,
                      tokenizer_from=None, vocab: int | None = None) -> Path:
    """A random llama GGUF: `qtypes` maps tensor kinds (token_embd, output, attn_q, attn_k,
    attn_v, attn_output, ffn_gate, ffn_up, ffn_down) to GGML type ids; each kind's bytes are
    made once and shared by every layer (fast to write, same file size). The tokenizer is a
    byte-level one of 259 tokens (one merge), or the one of the GGUF file `tokenizer_from` (its
    vocabulary, merges, token types, pre-tokenizer and chat template), padded to `vocab` tokens
    with reserved control tokens (Llama 3's 128,256 for the 3 B and 8 B shapes)."""
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel
    rng = np.random.default_rng(seed)
    source = None
    if tokenizer_from is not None:
        from edgepaged.model.gguf_file import GgufFile
        from edgepaged.model.loader import gguf_field
        source = GgufFile(tokenizer_from)
        tokens = gguf_field(source, "tokenizer.ggml.tokens")
    else:
        # one merge (two spaces): llama.cpp refuses a BPE vocabulary without merges
        tokens = sorted(ByteLevel.alphabet()) + ["\u0120\u0120", "<|im_start|>", "<|im_end|>"]
    pad = max(0, (vocab or 0) - len(tokens))
    tokens = list(tokens) + [f"<|reserved_special_token_{i}|>" for i in range(pad)]
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
    if source is not None:
        from edgepaged.model.loader import gguf_field
        w.add_tokenizer_model(gguf_field(source, "tokenizer.ggml.model"))
        w.add_tokenizer_pre(gguf_field(source, "tokenizer.ggml.pre", "default"))
        w.add_token_list(tokens)
        w.add_token_types(list(gguf_field(source, "tokenizer.ggml.token_type")) + [3] * pad)
        w.add_token_merges(gguf_field(source, "tokenizer.ggml.merges") or [])
        for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id)):
            if (i := gguf_field(source, f"tokenizer.ggml.{key}_token_id")) is not None:
                add(i)
        if template := gguf_field(source, "tokenizer.chat_template"):
            w.add_chat_template(template)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([1] * 257 + [3, 3] + [3] * pad)
        w.add_token_merges(["\u0120 \u0120"])
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


def write_widened_gguf(src, path, *, inter: int, noise: float, seed: int = 0) -> Path:
    """A larger model that a llama GGUF `src` drafts for: `src` with its MLP widened to `inter`
    neurons (the new ones random; their down projection `noise` times the size of the
    originals', so 0 gives `src`'s function and more moves the new model away from it). The
    widened projections are Q8_0 and everything else (tokenizer, attention, embeddings) is
    `src`'s as it is. A rig for draft-model speculation with a known relation between the two
    (the embedded SmolLM2-135M widened to 12,288 neurons has about the 1 B Q4_K_M file's
    weight bytes)."""
    import gguf
    from gguf.quants import dequantize, quantize
    rng = np.random.default_rng(seed)
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    if arch != "llama":
        raise ValueError(f"{src}: widening needs a llama file (this is {arch})")
    w = gguf.GGUFWriter(str(path), arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = inter if key == f"{arch}.feed_forward_length" else f.contents()
        if key == "general.file_type":
            value = int(gguf.LlamaFileType.MOSTLY_Q8_0)
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, f.types[0])
    q8 = gguf.GGMLQuantizationType.Q8_0
    for t in r.tensors:
        kind = t.name.split(".")[-2] if t.name.count(".") >= 2 else ""
        if kind not in ("ffn_gate", "ffn_up", "ffn_down"):
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=None if t.tensor_type in (
                gguf.GGMLQuantizationType.F32,) else t.tensor_type)
            continue
        x = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        if kind == "ffn_down":          # [hidden, n]: new input columns
            extra = rng.standard_normal((x.shape[0], inter - x.shape[1])) * (noise * float(x.std()))
            x = np.concatenate([x, extra.astype(np.float32)], axis=1)
        else:                           # [n, hidden]: new rows
            extra = rng.standard_normal((inter - x.shape[0], x.shape[1])) * float(x.std())
            x = np.concatenate([x, extra.astype(np.float32)], axis=0)
        w.add_tensor(t.name, quantize(np.ascontiguousarray(x), q8), raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
