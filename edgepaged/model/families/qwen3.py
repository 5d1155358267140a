"""Qwen3: Qwen2's block without the Q/K/V biases, with a per-head RMSNorm of q and k before
the rotary (`q_norm`, `k_norm`)."""
from __future__ import annotations

from .base import register
from .qwen2 import Qwen2


class Qwen3(Qwen2):
    name = "qwen3"
    qk_norm = True
    attention_bias_default = False


register(Qwen3)
