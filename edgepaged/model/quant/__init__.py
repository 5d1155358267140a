"""Quantized weights kept quantized on CPU: GGUF blocks in memory, Rust kernels on them.

- `formats`: the block formats, `QuantWeight` (one weight's GGUF bytes), interleaving;
- `modules`: `QuantLinear` and `QuantEmbedding`, the modules the model is built from;
- `threads`: torch's thread count beside the kernels' own pool, the fp32 scratch + GEMM.
"""
from .formats import BLOCK, FORMATS, QuantWeight, can_keep
from .modules import QuantEmbedding, QuantLinear, lay_out_weights, weight_bytes

__all__ = ["BLOCK", "FORMATS", "QuantEmbedding", "QuantLinear", "QuantWeight", "can_keep", "lay_out_weights",
           "weight_bytes"]
