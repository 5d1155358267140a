"""`edgepaged._native`: the Rust extension module (rust_alloc/python), one submodule per
concern, each also importable by its full name (`from edgepaged._native.blocks import
BlockAllocator`)."""

from . import blocks as blocks
from . import ops as ops
from . import quant as quant
