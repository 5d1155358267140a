"""Gemma 3 (text): Gemma 2's block with q/k norms instead of soft-capped scores, five local
layers to a global one (`sliding_window_pattern`), and the local layers' own rotary table
(base 10000, unscaled)."""
from __future__ import annotations

from .base import layer_pattern, register
from .gemma2 import Gemma2


class Gemma3(Gemma2):
    name = "gemma3"
    hf_types = ("gemma3_text",)
    qk_norm = True
    local_rope = True
    big_layers = 62

    def gguf_layers(self, key, layers: int) -> dict:
        pattern = key("attention.sliding_window_pattern", 6)
        return dict(layer_sliding=[bool(p) for p in pattern] if isinstance(pattern, list)
                    else layer_pattern(layers, pattern),
                    rope_local={"theta": float(key("rope.freq_base_swa", 10000.0)), "scaling": None})

    def hf_softcap(self, c: dict):
        return None

    def hf_period(self, c: dict) -> int:
        return c.get("sliding_window_pattern", 6)


register(Gemma3)
