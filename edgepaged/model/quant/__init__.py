"""Quantized weights kept quantized on CPU: GGUF blocks in memory, Rust kernels on them.

- `formats`: the block formats, `QuantWeight` (one weight's GGUF bytes), interleaving;
- the torch runtime's `QuantLinear` and `QuantEmbedding` (model/torch/quant_modules.py, named
  here too) and its threads beside the kernels' pool (model/torch/quant_threads.py).
"""
import importlib

from .formats import BLOCK, FORMATS, QuantWeight, can_keep

_TORCH_NAMES = ("QuantEmbedding", "QuantLinear", "lay_out_weights", "weight_bytes")   # need torch

__all__ = ["BLOCK", "FORMATS", "QuantEmbedding", "QuantLinear", "QuantWeight", "can_keep", "lay_out_weights",
           "weight_bytes"]


def __getattr__(name):
    if name in _TORCH_NAMES:
        return getattr(importlib.import_module("..torch.quant_modules", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
