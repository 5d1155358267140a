"""Qwen2 / Qwen2.5: llama's block with biased Q/K/V products; config.json's sliding window
applies only with use_sliding_window."""
from __future__ import annotations

from .base import Family, register


class Qwen2(Family):
    name = "qwen2"
    attention_bias_default = True

    def hf_config(self, c: dict, base: dict) -> dict:
        return {} if c.get("use_sliding_window", False) else {"sliding_window": None}


register(Qwen2)
