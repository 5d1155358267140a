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
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
