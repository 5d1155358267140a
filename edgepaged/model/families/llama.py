"""Llama (1, 2, 3.x) and Mistral: the plain pre-norm block (RMSNorm, attention, RMSNorm,
SiLU MLP). llama.cpp's converter permutes llama's Q/K rows for its interleaved rotary;
Llama 3.1's frequency factors arrive as the `rope_freqs` tensor. Mistral's GGUF files say
"llama"; its config.json says "mistral" (a sliding window, when set)."""
from __future__ import annotations

from .base import Family, register


class Llama(Family):
    name = "llama"
    permute_qk = True


class Mistral(Family):
    name = "mistral"


register(Llama)
register(Mistral)
