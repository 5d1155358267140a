"""Quantized weights kept quantized on CPU: GGUF blocks in memory, Rust kernels on them.

- `formats`: the block formats, `QuantWeight` (one weight's GGUF bytes), interleaving;
- `modules`: `QuantLinear` and `QuantEmbedding`, the modules the model is built from;
- `threads`: torch's thread count beside the kernels' own pool, the fp32 scratch + GEMM.
"""
import importlib

from .formats import BLOCK, FORMATS, QuantWeight, can_keep

_TORCH_NAMES = ("QuantEmbedding", "QuantLinear", "lay_out_weights", "weight_bytes")   # need torch

__all__ = ["BLOCK", "FORMATS", "QuantEmbedding", "QuantLinear", "QuantWeight", "can_keep", "lay_out_weights",
           "weight_bytes"]


def __getattr__(name):
    if name in _TORCH_NAMES:
        return getattr(importlib.import_module(".modules", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
