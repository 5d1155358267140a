"""Vision model files for tests, written as llama.cpp's converter writes them: the tower and
projector of a transformers vision-language model as an `mmproj` GGUF (`general.architecture`
"clip", `general.type` "mmproj", `clip.*` keys, the tensors under the names gguf-py's own
`TensorNameMap(MODEL_ARCH.MMPROJ)` gives them, in their Hugging Face shapes; the embeddings,
norms and biases F32, the other weights F16; Gemma 3's soft-embedding norm stored with + 1,
its input projection F16 and not transposed), as llama.cpp's `conversion/{smolvlm,gemma}.py`
do (read there; never copied)."""
from __future__ import annotations

from pathlib import Path

import numpy as np



def _written(w, path) -> Path:
    """A GGUFWriter's file written out and closed."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)

def write_mmproj(model, path, family: str, *, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
                 longest_edge: int | None = None) -> Path:
    """`model`: a transformers Idefics3ForConditionalGeneration ("idefics3") or
    Gemma3ForConditionalGeneration ("gemma3")."""
    import gguf
    cfg = model.config
    vc = cfg.vision_config
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.MMPROJ, vc.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    w.add_string(gguf.Keys.Clip.PROJECTOR_TYPE, family)
    w.add_uint32(gguf.Keys.ClipVision.PROJECTION_DIM, cfg.text_config.hidden_size)
    w.add_uint32(gguf.Keys.ClipVision.IMAGE_SIZE, vc.image_size)
    w.add_uint32(gguf.Keys.ClipVision.PATCH_SIZE, vc.patch_size)
    w.add_uint32(gguf.Keys.ClipVision.EMBEDDING_LENGTH, vc.hidden_size)
    w.add_uint32(gguf.Keys.ClipVision.FEED_FORWARD_LENGTH, vc.intermediate_size)
    w.add_uint32(gguf.Keys.ClipVision.BLOCK_COUNT, vc.num_hidden_layers)
    w.add_uint32(gguf.Keys.ClipVision.Attention.HEAD_COUNT, vc.num_attention_heads)
    w.add_float32(gguf.Keys.ClipVision.Attention.LAYERNORM_EPS, vc.layer_norm_eps)
    w.add_array(gguf.Keys.ClipVision.IMAGE_MEAN, list(mean))
    w.add_array(gguf.Keys.ClipVision.IMAGE_STD, list(std))
    w.add_bool(gguf.Keys.ClipVision.USE_GELU, True)
    if family == "idefics3":
        w.add_uint32(gguf.Keys.ClipVision.Projector.SCALE_FACTOR, cfg.scale_factor)
        w.add_uint32(gguf.Keys.ClipVision.PREPROC_IMAGE_SIZE, longest_edge or vc.image_size)
        keep = ("model.vision_model.", "model.connector.")
    else:
        k = (vc.image_size // vc.patch_size) // int(round(cfg.mm_tokens_per_image ** 0.5))
        if k != 4:
            w.add_uint32(gguf.Keys.ClipVision.Projector.SCALE_FACTOR, k)
        keep = ("model.vision_tower.", "model.multi_modal_projector.")
    for hf_name, a in state.items():
        name = "model." + hf_name if not hf_name.startswith("model.") else hf_name
        if not name.startswith(keep) or name.startswith("model.vision_tower.head."):
            continue                        # (SigLIP's pooling head: the converter leaves it out)
        base = name.removeprefix("model.")
        if family == "idefics3":
            base = "model." + base          # the converter sees SmolVLM's checkpoint names
        suffix = ".weight" if base.endswith("weight") else ".bias"
        stem = base.removesuffix("_weight").removesuffix(".weight").removesuffix(".bias")
        if family == "gemma3" and stem.startswith("vision_tower.") and not stem.startswith("vision_tower.vision_model."):
            stem = stem.replace("vision_tower.", "vision_tower.vision_model.", 1)
        gname = names.get_name(stem)
        if gname is None:
            raise ValueError(f"no mmproj name for {hf_name}")
        gname += suffix
        if gname == "mm.soft_emb_norm.weight":
            a = a + 1.0
        if a.ndim == 1 or ".embeddings." in name or gname.endswith(".bias"):
            data = a.astype(np.float32)
        else:
            data = a.astype(np.float16)
        w.add_tensor(gname, data)
    return _written(w, path)


# SmolVLM's chat template (its content parts: text, and an image as <image>)
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
SMOLVLM_TOKENS = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
                  *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)))


def make_smolvlm(folder, *, seed: int = 0, image_size: int = 64, patch: int = 16, scale: int = 2,
                 longest_edge: int = 128, hidden: int = 64, layers: int = 2):
    """A tiny random SmolVLM (transformers' Idefics3ForConditionalGeneration) written as a
    Hugging Face GGUF repository ships one: the text model (llama) as `model.gguf`, its
    tokenizer with SmolVLM's image tokens and chat template, and the tower and connector as
    `mmproj-model.gguf` (F16 weights: the transformers model's are rounded so, to be the
    reference). Returns (the transformers model, model.gguf, mmproj-model.gguf)."""
    import json

    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    from .families import make_family_model, write_family_gguf
    from .tiny_models import randomize
    folder = Path(folder)
    make_family_model(folder, "llama", seed)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SMOLVLM_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": SMOLVLM_TEMPLATE,
                                                              "eos_token": "<end_of_utterance>"}))
    text = transformers.AutoConfig.from_pretrained(str(folder))
    text.vocab_size, text.tie_word_embeddings = tok.get_vocab_size(), False
    text.hidden_size, text.intermediate_size = hidden, hidden * 2
    text.eos_token_id = tok.token_to_id("<end_of_utterance>")
    cfg = transformers.Idefics3Config(
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                           image_size=image_size, patch_size=patch),
        text_config=text.to_dict(), scale_factor=scale, image_token_id=tok.token_to_id("<image>"),
        tie_word_embeddings=False)
    hf = transformers.Idefics3ForConditionalGeneration(cfg).eval()
    randomize(hf, seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2 and ".embeddings." not in name and "text_model" not in name and "lm_head" not in name:
                p.copy_(p.half().float())            # as the mmproj keeps them
    llama = transformers.LlamaForCausalLM(text).eval()
    state = {k.removeprefix("model.text_model."): v for k, v in hf.state_dict().items()
             if k.startswith("model.text_model.")}
    llama.model.load_state_dict(state)
    llama.lm_head.load_state_dict(hf.lm_head.state_dict())
    llama.save_pretrained(folder)
    model = write_family_gguf(folder, folder / "model.gguf", llama, template=SMOLVLM_TEMPLATE,
                              control=SMOLVLM_TOKENS)
    mmproj = write_mmproj(hf, folder / "mmproj-model.gguf", "idefics3", longest_edge=longest_edge)
    return hf, model, mmproj


# ---------------------------------------------------------------- benchmark-sized files

def _copy_gguf(src, dst, *, extra_tokens: tuple = (), template: str | None = None, extra_kv: dict | None = None,
               extra_tensors: dict | None = None) -> Path:
    """`src` rewritten at `dst` with `extra_tokens` appended to its vocabulary (control
    tokens; the embedding and output tables grow by zero rows) and its chat template
    replaced: a text model that takes a vision family's image tokens, its weights as they were."""
    import gguf
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    V = gguf.GGUFValueType
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        value = f.contents()
        if f.name == "tokenizer.ggml.tokens":
            value = list(value) + list(extra_tokens)
        elif f.name == "tokenizer.ggml.token_type":
            value = list(value) + [3] * len(extra_tokens)
        elif f.name == "tokenizer.ggml.scores":
            value = list(value) + [0.0] * len(extra_tokens)
        elif f.name == "tokenizer.chat_template" and template is not None:
            value = template
        elif f.name.endswith(".vocab_size"):
            value = int(value) + len(extra_tokens)
        vtype = f.types[0]
        w.add_key_value(f.name, value, vtype, sub_type=f.types[-1] if vtype == V.ARRAY else None)
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.name in ("token_embd.weight", "output.weight") and extra_tokens:
            data = np.concatenate([data, np.zeros((len(extra_tokens),) + data.shape[1:], data.dtype)])
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    for k, (value, vtype, *sub) in (extra_kv or {}).items():
        w.add_key_value(k, value, vtype, sub_type=sub[0] if sub else None)
    for name, data in (extra_tensors or {}).items():
        w.add_tensor(name, data)
    return _written(w, dst)


VISION_SHAPES = {
    # SmolVLM-256M-Instruct: SmolLM2-135M's text model, SigLIP-B/16 at 512 px, pixel shuffle 4 (64 tokens a tile)
    "smolvlm-256m": dict(hidden=768, inter=3072, layers=12, heads=12, image=512, patch=16, scale=4,
                         longest_edge=2048),
}


def synthetic_smolvlm(folder, shape: str = "smolvlm-256m", seed: int = 0) -> tuple[Path, Path]:
    """A SmolVLM of `shape`'s sizes as a GGUF repository ships it: the embedded SmolLM2-135M
    (its Q4_1 weights; SmolVLM-256M's text model has that shape) with SmolVLM's image tokens
    and chat template, and a random tower + connector of the shape as an mmproj (F16).
    Written once per folder. Returns (model, mmproj)."""
    import torch
    import transformers

    from ..model.loader import default_model_path
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model, mmproj = folder / f"{shape}-text.gguf", folder / f"mmproj-{shape}.gguf"
    if model.exists() and mmproj.exists():
        return model, mmproj
    _copy_gguf(default_model_path(), model, extra_tokens=SMOLVLM_TOKENS, template=SMOLVLM_TEMPLATE)
    s = VISION_SHAPES[shape]
    torch.manual_seed(seed)
    cfg = transformers.Idefics3Config(
        vision_config=dict(hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
                           num_attention_heads=s["heads"], image_size=s["image"], patch_size=s["patch"]),
        text_config=dict(vocab_size=64, hidden_size=576, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=9, num_key_value_heads=3),
        scale_factor=s["scale"], image_token_id=63)
    hf = transformers.Idefics3ForConditionalGeneration(cfg).eval()
    write_mmproj(hf, mmproj, "idefics3", longest_edge=s["longest_edge"])
    return model, mmproj


# Gemma 3: its image tokens, and a chat template that reads typed parts (as Gemma 3's does)
GEMMA3_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")


def write_ollama_vision(model, text_gguf, path) -> Path:
    """A Gemma 3 as `ollama pull gemma3:4b` brings it: the text model's GGUF with the tower and
    projector inside, as Ollama's converter writes them (keys `gemma3.vision.*` and
    `gemma3.mm.tokens_per_image`; tensors `v.patch_embedding`, `v.blk.N.attn_q`, ...,
    `mm.mm_input_projection.weight` in its Hugging Face shape, `mm.mm_soft_emb_norm.weight`
    + 1; 1-D tensors F32, the others F16)."""
    import gguf
    cfg = model.config
    vc = cfg.vision_config
    V = gguf.GGUFValueType
    kv = {"gemma3.vision.block_count": (vc.num_hidden_layers, V.UINT32),
          "gemma3.vision.embedding_length": (vc.hidden_size, V.UINT32),
          "gemma3.vision.feed_forward_length": (vc.intermediate_size, V.UINT32),
          "gemma3.vision.image_size": (vc.image_size, V.UINT32), "gemma3.vision.patch_size": (vc.patch_size, V.UINT32),
          "gemma3.vision.num_channels": (3, V.UINT32),
          "gemma3.vision.attention.head_count": (vc.num_attention_heads, V.UINT32),
          "gemma3.vision.attention.layer_norm_epsilon": (float(vc.layer_norm_eps), V.FLOAT32),
          "gemma3.mm.tokens_per_image": (cfg.mm_tokens_per_image, V.UINT32)}
    renames = (("vision_tower.vision_model.embeddings", "v"), ("vision_tower.vision_model", "v"),
               ("encoder.layers", "blk"), ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
               ("self_attn.v_proj", "attn_v"), ("self_attn.out_proj", "attn_output"),
               ("input_projection_weight", "input_projection.weight"), ("multi_modal_projector", "mm"))
    tensors = {}
    for hf_name, a in model.state_dict().items():
        name = hf_name.removeprefix("model.")
        if not name.startswith(("vision_tower.", "multi_modal_projector.")) or ".head." in name:
            continue
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = name.replace("vision_tower.", "vision_tower.vision_model.", 1)   # (the checkpoint's names)
        for a_, b_ in renames:
            name = name.replace(a_, b_)
        a = a.detach().float().numpy()
        if name.endswith("_norm.weight") and not name.startswith("v."):
            a = a + 1.0
        tensors[name] = a.astype(np.float32) if a.ndim == 1 else a.astype(np.float16)
    return _copy_gguf(text_gguf, path, extra_kv=kv, extra_tensors=tensors)


def make_gemma3_vlm(folder, *, seed: int = 0, image_size: int = 64, patch: int = 8, tokens: int = 16,
                    sliding_window: int = 512):
    """A tiny random Gemma 3 (transformers' Gemma3ForConditionalGeneration) in both GGUF
    layouts: as a Hugging Face GGUF repository ships it (`model.gguf` + `mmproj-model.gguf`,
    llama.cpp's converter's names) and as Ollama's single file (`ollama-gemma3.gguf`: the
    tower inside). The tower's matrices are rounded to F16 as the files keep them. Returns
    (the transformers model, model.gguf, mmproj-model.gguf, ollama-gemma3.gguf)."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    from .families import make_family_model, write_family_gguf
    from .tiny_models import randomize
    folder = Path(folder)
    make_family_model(folder, "gemma3", seed, extra_specials=GEMMA3_TOKENS,    # (as Gemma 3 is: no final softcap,
                      overrides={"sliding_window": sliding_window, "final_logit_softcapping": None})   # which its VLM ignores)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = transformers.AutoConfig.from_pretrained(str(folder))
    cfg = transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           image_size=image_size, patch_size=patch),
        mm_tokens_per_image=tokens, image_token_index=tok.token_to_id("<image_soft_token>"),
        boi_token_index=tok.token_to_id("<start_of_image>"), eoi_token_index=tok.token_to_id("<end_of_image>"))
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    randomize(hf, seed)
    with torch.no_grad():
        hf.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.05)
        hf.model.multi_modal_projector.mm_soft_emb_norm.weight.normal_(0, 0.1)
        for name, p in hf.named_parameters():     # (Ollama's file keeps even the embeddings F16)
            if p.dim() >= 2 and ("vision_tower" in name or "multi_modal_projector.mm_input" in name):
                p.copy_(p.half().float())
    causal = transformers.Gemma3ForCausalLM(text).eval()
    causal.model.load_state_dict(hf.model.language_model.state_dict())
    causal.lm_head.weight = causal.model.embed_tokens.weight
    causal.save_pretrained(folder)
    model = write_family_gguf(folder, folder / "model.gguf", causal, template=GEMMA3_TEMPLATE, control=GEMMA3_TOKENS)
    mmproj = write_mmproj(hf, folder / "mmproj-model.gguf", "gemma3")
    ollama = write_ollama_vision(hf, model, folder / "ollama-gemma3.gguf")
    return hf, model, mmproj, ollama


GEMMA3_TOWERS = {
    # Gemma 3 4B / 12B / 27B: SigLIP-so400m at 896 px (patch 14: 64 x 64 patches, pooled 4 x 4 to 256 tokens),
    # projected to the text model's width (2560 for 4 B)
    "gemma3-4b": dict(hidden=1152, inter=4304, layers=27, heads=16, image=896, patch=14, tokens=256, text=2560),
}


def synthetic_gemma3_tower(folder, shape: str = "gemma3-4b", seed: int = 0) -> tuple[Path, Path]:
    """Gemma 3's image side at `shape`'s sizes for timing the encoder: a random tower +
    projector as llama.cpp's mmproj (F16), and a one-layer Gemma 3 text model of the real
    width with the image tokens (a stub: what llama.cpp's tool needs beside the mmproj; its
    answers mean nothing). Written once per folder. Returns (text stub, mmproj)."""
    import torch
    import transformers

    from .families import make_family_model, write_family_gguf
    folder = Path(folder)
    stub, mmproj = folder / f"{shape}-text-stub.gguf", folder / f"mmproj-{shape}.gguf"
    if stub.exists() and mmproj.exists():
        return stub, mmproj
    s = GEMMA3_TOWERS[shape]
    make_family_model(folder / "stub", "gemma3", seed, extra_specials=GEMMA3_TOKENS,
                      overrides={"final_logit_softcapping": None})
    text = transformers.AutoConfig.from_pretrained(str(folder / "stub"))
    text.hidden_size, text.intermediate_size, text.num_hidden_layers = s["text"], 256, 1
    text.num_attention_heads, text.num_key_value_heads, text.head_dim = 8, 4, 256
    text.query_pre_attn_scalar, text.layer_types = 256, ["full_attention"]
    torch.manual_seed(seed)
    causal = transformers.Gemma3ForCausalLM(text).eval()
    write_family_gguf(folder / "stub", stub, causal, template=GEMMA3_TEMPLATE, control=GEMMA3_TOKENS, qtype=1)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(folder / "stub" / "tokenizer.json"))
    cfg = transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=dict(hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
                           num_attention_heads=s["heads"], image_size=s["image"], patch_size=s["patch"]),
        mm_tokens_per_image=s["tokens"], image_token_index=tok.token_to_id("<image_soft_token>"),
        boi_token_index=tok.token_to_id("<start_of_image>"), eoi_token_index=tok.token_to_id("<end_of_image>"))
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    write_mmproj(hf, mmproj, "gemma3")
    return stub, mmproj


GEMMA3_TEXT = {
    # Gemma 3 4B's text model: 34 layers (5 local of a 1,024-token window to 1 global), 8 heads of
    # 256 over 4 KV heads, a 10,240-wide MLP, 262,208 tokens
    "gemma3-4b": dict(layers=34, inter=10240, vocab=262208, window=1024, pattern=6, context=8192),
}
# llama.cpp's Q4_K_M (its common choice per tensor: Q6_K for the embeddings, V and down)
Q4_K_M = {"token_embd": 14, "attn_q": 12, "attn_k": 12, "attn_v": 14, "attn_output": 12, "ffn_gate": 12,
          "ffn_up": 12, "ffn_down": 14}


def synthetic_gemma3(folder, shape: str = "gemma3-4b", seed: int = 0) -> tuple[Path, Path]:
    """A Gemma 3 of `shape`'s sizes end to end, as a Hugging Face GGUF repository ships it:
    the text model as Q4_K_M (random blocks, each kind's shared by every layer: fast to write,
    the file's size and work; the vocabulary the stub's tokens, Gemma 3's image tokens
    among them, padded to the real count with control tokens) beside the random tower's
    mmproj (`synthetic_gemma3_tower`). Its answers mean nothing; its time is the 4 B's.
    Written once per folder. Returns (model, mmproj)."""
    import gguf

    from .gguf_models import random_blocks
    folder = Path(folder)
    stub, mmproj = synthetic_gemma3_tower(folder, shape, seed)
    path = folder / f"{shape}-q4_k_m.gguf"
    if path.exists():
        return path, mmproj
    t = GEMMA3_TEXT[shape]
    r = gguf.GGUFReader(str(stub))
    arch = "gemma3"
    V = gguf.GGUFValueType
    n_tok = len(r.fields["tokenizer.ggml.tokens"].contents())
    pad = t["vocab"] - n_tok
    override = {f"{arch}.block_count": t["layers"], f"{arch}.feed_forward_length": t["inter"],
                f"{arch}.context_length": t["context"], f"{arch}.attention.sliding_window": t["window"],
                f"{arch}.attention.sliding_window_pattern": t["pattern"], "general.name": f"synthetic-{shape}"}
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        value = override.get(f.name, f.contents())
        if f.name == "tokenizer.ggml.tokens":
            value = list(value) + [f"<unused{i}>" for i in range(pad)]
        elif f.name == "tokenizer.ggml.token_type":
            value = list(value) + [3] * pad
        elif f.name == "tokenizer.ggml.scores":
            value = list(value) + [0.0] * pad
        vtype = f.types[0]
        w.add_key_value(f.name, value, vtype, sub_type=f.types[-1] if vtype == V.ARRAY else None)
    w.add_uint32("general.file_type", int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
    hidden = int(r.fields[f"{arch}.embedding_length"].contents())
    q = int(r.fields[f"{arch}.attention.head_count"].contents()) * 256
    kv = int(r.fields[f"{arch}.attention.head_count_kv"].contents()) * 256
    shapes = {"token_embd": (t["vocab"], hidden), "attn_q": (q, hidden), "attn_k": (kv, hidden),
              "attn_v": (kv, hidden), "attn_output": (hidden, q), "ffn_gate": (t["inter"], hidden),
              "ffn_up": (t["inter"], hidden), "ffn_down": (hidden, t["inter"])}
    rng = np.random.default_rng(seed)
    blocks = {k: random_blocks(Q4_K_M[k], rows, cols, rng, 1.0 if k == "token_embd" else cols ** -0.5)
              for k, (rows, cols) in shapes.items()}
    norms = {x.name.split(".", 2)[2]: np.asarray(x.data, np.float32) for x in r.tensors
             if x.name.startswith("blk.0.") and x.name.endswith("norm.weight")}

    def add(name, kind):
        w.add_tensor(name, blocks[kind], raw_dtype=gguf.GGMLQuantizationType(Q4_K_M[kind]))
    add("token_embd.weight", "token_embd")
    w.add_tensor("output_norm.weight", np.asarray(next(x for x in r.tensors if x.name == "output_norm.weight").data,
                                                  np.float32))
    for i in range(t["layers"]):
        for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            add(f"blk.{i}.{kind}.weight", kind)
        for name, a in norms.items():
            w.add_tensor(f"blk.{i}.{name}", a)
    _written(w, tmp)
    tmp.rename(path)
    return path, mmproj


# LLaVA-1.5: "<image>" where the picture goes, USER / ASSISTANT turns (content parts read)
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ 'USER: ' }}{% else %}{{ 'ASSISTANT: ' }}"
    "{% endif %}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<image>\\\\n' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '\\\\n' }}{% else %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def write_llava_mmproj(model, path) -> Path:
    """LLaVA-1.5's tower and projector as llama.cpp's older converter writes them (its
    llava_surgery + convert_image_encoder_to_gguf route, what Hugging Face repositories and
    Ollama's llava projector layer hold): projector type "mlp", the last encoder layer left
    out (LLaVA reads the one before), no post-layernorm, `v.class_embd`, `v.pre_ln`, fc1 named
    ffn_down and fc2 ffn_up (its old naming), the projector's linears as mm.0 and mm.2; 2-D
    weights F16, the rest F32; CLIP's mean and std; use_gelu false (quick-GELU)."""
    import gguf
    from ..model.vision import CLIP_MEAN, CLIP_STD
    cfg = model.config
    vc = cfg.vision_config
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_bool("clip.has_text_encoder", False)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_llava_projector", True)
    w.add_string("clip.projector_type", "mlp")
    for key, value in (("image_size", vc.image_size), ("patch_size", vc.patch_size),
                       ("embedding_length", vc.hidden_size), ("feed_forward_length", vc.intermediate_size),
                       ("projection_dim", vc.projection_dim), ("attention.head_count", vc.num_attention_heads),
                       ("block_count", vc.num_hidden_layers - 1)):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", vc.layer_norm_eps)
    w.add_array("clip.vision.image_mean", list(CLIP_MEAN))
    w.add_array("clip.vision.image_std", list(CLIP_STD))
    w.add_bool("clip.use_gelu", False)
    last = vc.num_hidden_layers - 1
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.out_proj": "attn_out", "layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_down",
             "mlp.fc2": "ffn_up"}
    for hf_name, t in model.state_dict().items():
        a = t.detach().float().numpy()
        name = hf_name.removeprefix("model.")
        if name.startswith("vision_tower."):
            stem = name.split("vision_model.", 1)[-1] if "vision_model." in name else name.removeprefix("vision_tower.")
            if stem == "embeddings.class_embedding":
                out = "v.class_embd"
            elif stem.startswith("embeddings.patch_embedding."):
                out = "v.patch_embd." + stem.rsplit(".", 1)[1]
            elif stem.startswith("embeddings.position_embedding."):
                out = "v.position_embd.weight"
            elif stem.startswith("pre_layrnorm."):
                out = "v.pre_ln." + stem.rsplit(".", 1)[1]
            elif stem.startswith("encoder.layers."):
                _, _, i, rest = stem.split(".", 3)
                part, suffix = rest.rsplit(".", 1)
                if int(i) == last:
                    continue                       # (LLaVA reads the layer before the last)
                out = f"v.blk.{i}.{parts[part]}.{suffix}"
            else:
                continue                           # post_layernorm: not used
        elif name.startswith("multi_modal_projector.linear_"):
            i, suffix = name.removeprefix("multi_modal_projector.linear_").split(".")
            out = f"mm.{0 if i == '1' else 2}.{suffix}"
        else:
            continue
        w.add_tensor(out, a.astype(np.float16) if a.ndim >= 2 else a.astype(np.float32))
    return _written(w, path)


def make_llava(folder, *, seed: int = 0, image_size: int = 32, patch: int = 8):
    """A tiny random LLaVA-1.5 (transformers' LlavaForConditionalGeneration: CLIP + a two-layer
    projector + llama) as a GGUF repository ships it: `model.gguf` (llama, with the `<image>`
    token and a template that places it) and `mmproj-model.gguf` (`write_llava_mmproj`); the
    tower's and projector's matrices rounded to F16 as the file keeps them. Returns (the
    transformers model, model.gguf, mmproj-model.gguf)."""
    import json

    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    from .families import make_family_model, write_family_gguf
    from .tiny_models import randomize
    folder = Path(folder)
    make_family_model(folder, "llama", seed)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    tok.save(str(folder / "tokenizer.json"))
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tc, "chat_template": LLAVA_TEMPLATE}))
    text = transformers.AutoConfig.from_pretrained(str(folder))
    text.vocab_size, text.tie_word_embeddings = tok.get_vocab_size(), False
    cfg = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                                    num_attention_heads=4, image_size=image_size, patch_size=patch,
                                                    projection_dim=32),
        text_config=text.to_dict(), image_token_index=tok.token_to_id("<image>"), projector_hidden_act="gelu",
        vision_feature_layer=-2, vision_feature_select_strategy="default", tie_word_embeddings=False)
    hf = transformers.LlavaForConditionalGeneration(cfg).eval()
    randomize(hf, seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2 and ("vision_tower" in name or "multi_modal_projector" in name):
                p.copy_(p.half().float())
    llama = transformers.LlamaForCausalLM(text).eval()
    llama.model.load_state_dict(hf.model.language_model.state_dict())
    llama.lm_head.load_state_dict(hf.lm_head.state_dict())
    llama.save_pretrained(folder)
    model = write_family_gguf(folder, folder / "model.gguf", llama, template=LLAVA_TEMPLATE, control=("<image>",))
    return hf, model, write_llava_mmproj(hf, folder / "mmproj-model.gguf")


# Qwen2.5-VL: its vision tokens, and ChatML that reads typed parts (as Qwen2.5-VL's template does)
QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _qwen_vision_tensors(model, names: dict) -> dict:
    """Qwen2.5-VL's tower and merger as llama.cpp's and Ollama's converters split and name
    them (`names`: the patch embedding's two time slices, the merger's parts); q, k, v
    split from the fused qkv; 1-D tensors F32, the rest F16."""
    vc = model.config.vision_config
    hidden = vc.hidden_size
    parts = {"norm1": "ln1", "norm2": "ln2", "attn.proj": "attn_out", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    out = {}
    for hf_name, t in model.state_dict().items():
        name = hf_name.removeprefix("model.")
        if not name.startswith("visual."):
            continue
        a = t.detach().float().numpy()
        stem = name.removeprefix("visual.")
        if stem == "patch_embed.proj.weight":
            out[names["patch0"]] = a[:, :, 0]
            out[names["patch1"]] = a[:, :, 1]
            continue
        if stem.startswith("merger."):
            part, suffix = stem.removeprefix("merger.").rsplit(".", 1)
            out[f"{names[part]}.{suffix}"] = a
            continue
        _, i, rest = stem.split(".", 2)
        part, suffix = rest.rsplit(".", 1)
        if part == "attn.qkv":
            for j, x in enumerate("qkv"):
                out[f"v.blk.{i}.attn_{x}.{suffix}"] = a[j * hidden:(j + 1) * hidden]
            continue
        out[f"v.blk.{i}.{parts[part]}.{suffix}"] = a
    return {k: (v.astype(np.float32) if v.ndim == 1 else v.astype(np.float16)) for k, v in out.items()}


def write_qwen25vl_mmproj(model, path) -> Path:
    """Qwen2.5-VL's tower and merger as llama.cpp's converter writes them (Qwen2VLVisionModel):
    projector type "qwen2.5vl_merger", the Conv3d's two time slices as `v.patch_embd.weight`
    and `v.patch_embd.weight.1`, `v.blk.N.{ln1,ln2,attn_q,attn_k,attn_v,attn_out,ffn_gate,
    ffn_up,ffn_down}`, the merger's norm `v.post_ln`, its linears mm.0 and mm.2;
    `clip.vision.n_wa_pattern` (the full-attention layers' period), CLIP's mean and std."""
    import gguf
    from ..model.vision import CLIP_MEAN, CLIP_STD
    vc = model.config.vision_config
    full = list(vc.fullatt_block_indexes)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", "qwen2.5vl_merger")
    w.add_bool("clip.use_silu", True)
    for key, value in (("image_size", 560), ("patch_size", vc.patch_size), ("embedding_length", vc.hidden_size),
                       ("feed_forward_length", vc.intermediate_size), ("projection_dim", vc.out_hidden_size),
                       ("attention.head_count", vc.num_heads), ("block_count", vc.depth),
                       ("n_wa_pattern", full[0] + 1)):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", list(CLIP_MEAN))
    w.add_array("clip.vision.image_std", list(CLIP_STD))
    names = {"patch0": "v.patch_embd.weight", "patch1": "v.patch_embd.weight.1", "ln_q": "v.post_ln",
             "mlp.0": "mm.0", "mlp.2": "mm.2"}
    for name, a in _qwen_vision_tensors(model, names).items():
        w.add_tensor(name, a)
    return _written(w, path)


def make_qwen25vl(folder, *, seed: int = 0, sections=(2, 3, 3), heads: int = 2, window: int = 112,
                  full=(1, 3)):
    """A tiny random Qwen2.5-VL (transformers' Qwen2_5_VLForConditionalGeneration: a windowed
    ViT of 4 layers, the merger, Qwen2's text model with M-RoPE `sections`) in both GGUF
    layouts: llama.cpp's (`model.gguf`, architecture "qwen2vl" with rope.dimension_sections,
    + `mmproj-model.gguf`) and Ollama's single file (`ollama-qwen25vl.gguf`: architecture
    "qwen25vl", rope.mrope_section, the tower inside: `v.patch_embd_0/1`, `v.merger.*`). The
    tower's matrices are rounded to F16 as the files keep them. Returns (the transformers
    model, model.gguf, mmproj-model.gguf, ollama-qwen25vl.gguf)."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    from .families import make_family_model, write_family_gguf
    from .tiny_models import randomize
    folder = Path(folder)
    make_family_model(folder, "qwen2", seed, extra_specials=QWEN_VL_TOKENS)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = transformers.AutoConfig.from_pretrained(str(folder))
    tc = text.to_dict()
    tc["rope_parameters"] = {"rope_type": "default", "rope_theta": float(getattr(text, "rope_theta", None) or
                                                                          text.rope_parameters["rope_theta"]),
                             "mrope_section": list(sections)}
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=tc,
        vision_config=dict(depth=4, hidden_size=64, num_heads=heads, intermediate_size=96,
                           out_hidden_size=text.hidden_size, patch_size=14, window_size=window,
                           fullatt_block_indexes=list(full), spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=tok.token_to_id("<|image_pad|>"), vision_start_token_id=tok.token_to_id("<|vision_start|>"),
        vision_end_token_id=tok.token_to_id("<|vision_end|>"), tie_word_embeddings=False)
    hf = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    randomize(hf, seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() >= 2 and "visual" in name:
                p.copy_(p.half().float())
    causal = transformers.Qwen2ForCausalLM(text).eval()
    causal.model.load_state_dict(hf.model.language_model.state_dict())
    causal.lm_head.load_state_dict(hf.lm_head.state_dict())
    causal.save_pretrained(folder)
    V = gguf_types()
    plain = write_family_gguf(folder, folder / "text-qwen2vl.gguf", causal, arch="qwen2vl", template=QWEN_VL_TEMPLATE,
                              control=QWEN_VL_TOKENS)
    model = _copy_gguf(plain, folder / "model.gguf",
                       extra_kv={"qwen2vl.rope.dimension_sections": ([*sections, 0], V.ARRAY, V.INT32)})
    mmproj = write_qwen25vl_mmproj(hf, folder / "mmproj-model.gguf")
    plain = write_family_gguf(folder, folder / "text-qwen25vl.gguf", causal, arch="qwen25vl",
                              template=QWEN_VL_TEMPLATE, control=QWEN_VL_TOKENS)
    vc = hf.config.vision_config
    kv = {"qwen25vl.rope.mrope_section": (list(sections), V.ARRAY, V.INT32),
          "qwen25vl.vision.block_count": (vc.depth, V.UINT32),
          "qwen25vl.vision.embedding_length": (vc.hidden_size, V.UINT32),
          "qwen25vl.vision.attention.head_count": (vc.num_heads, V.UINT32),
          "qwen25vl.vision.num_channels": (3, V.UINT32), "qwen25vl.vision.patch_size": (vc.patch_size, V.UINT32),
          "qwen25vl.vision.spatial_merge_size": (vc.spatial_merge_size, V.UINT32),
          "qwen25vl.vision.spatial_patch_size": (vc.patch_size, V.UINT32),
          "qwen25vl.vision.window_size": (vc.window_size, V.UINT32),
          "qwen25vl.vision.attention.layer_norm_epsilon": (1e-6, V.FLOAT32),
          "qwen25vl.vision.rope.freq_base": (10000.0, V.FLOAT32),
          "qwen25vl.vision.fullatt_block_indexes": (list(vc.fullatt_block_indexes), V.ARRAY, V.INT32),
          "qwen25vl.vision.temporal_patch_size": (2, V.UINT32)}
    names = {"patch0": "v.patch_embd_0.weight", "patch1": "v.patch_embd_1.weight", "ln_q": "v.merger.ln_q",
             "mlp.0": "v.merger.mlp.0", "mlp.2": "v.merger.mlp.2"}
    ollama = _copy_gguf(plain, folder / "ollama-qwen25vl.gguf", extra_kv=kv,
                        extra_tensors=_qwen_vision_tensors(hf, names))
    return hf, model, mmproj, ollama


def gguf_types():
    import gguf
    return gguf.GGUFValueType
