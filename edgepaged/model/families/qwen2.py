"""Qwen2 / Qwen2.5: llama's block with biased Q/K/V products; config.json's sliding window
applies only with use_sliding_window. Qwen2-VL / Qwen2.5-VL's text model: the same block with
multimodal rotary positions (M-RoPE: an image token's rotary pairs turn by its time, row and
column; `rope_sections`), as llama.cpp's converter writes it ("qwen2vl", the sections under
rope.dimension_sections) and Ollama's ("qwen25vl", under rope.mrope_section, its vision tower
inside the file)."""
from __future__ import annotations

from .base import Family, register


class Qwen2(Family):
    name = "qwen2"
    attention_bias_default = True

    def hf_config(self, c: dict, base: dict) -> dict:
        return {} if c.get("use_sliding_window", False) else {"sliding_window": None}


class Qwen2VL(Qwen2):
    name = "qwen2vl"
    sections_key = "rope.dimension_sections"

    def gguf_config(self, key, tensors, base) -> dict:
        sections = key(self.sections_key)
        if not sections:
            raise ValueError(f"a {self.name} file without {self.name}.{self.sections_key} (its M-RoPE sections)")
        return {"rope_sections": tuple(int(x) for x in list(sections)[:3])}


class Qwen25VL(Qwen2VL):
    name = "qwen25vl"
    sections_key = "rope.mrope_section"


register(Qwen2)
register(Qwen2VL)
register(Qwen25VL)
