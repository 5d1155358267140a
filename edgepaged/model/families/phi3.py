"""Phi-3 / Phi-3.5: llama's block with Q/K/V and gate/up fused in the checkpoint, and
LongRoPE (two sets of per-frequency factors; GGUF files carry them as tensors)."""
from __future__ import annotations

import numpy as np

from .base import Family, register


class Phi3(Family):
    name = "phi3"
    gguf_tensors = {"ffn_up": "mlp.gate_up_proj"}
    config_tensors = ("rope_factors_long.weight", "rope_factors_short.weight")

    def gguf_config(self, key, tensors, base) -> dict:
        if "rope_factors_long.weight" not in tensors:
            return {}
        orig = key("rope.scaling.original_context_length") or key("context_length")
        scaling = {"rope_type": "longrope", "original_max_position_embeddings": orig,
                   "max_position_embeddings": key("context_length"),
                   "long_factor": np.asarray(tensors["rope_factors_long.weight"].data, np.float32).tolist(),
                   "short_factor": np.asarray(tensors["rope_factors_short.weight"].data, np.float32).tolist()}
        if (af := key("rope.scaling.attn_factor")) is not None:
            scaling["attention_factor"] = float(af)
        return {"rope_scaling": scaling}


register(Phi3)
