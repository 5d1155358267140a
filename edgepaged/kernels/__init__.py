"""Triton kernels for the paged KV cache (shipped as `edgepaged.kernels`).

    write_kv(key, value, k_cache, v_cache, slot_mapping)
    paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=None, num_splits=None,
                 softcap=None)
    paged_prefill(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window=None,
                  softcap=None)
    quant.pack / quant.qmatmul / quant.qgather: GGUF weights kept quantized, products from their codes
    norms.add_rms_norm(h, x, weight, eps): the residual add and the RMSNorm after it, one kernel
    rope.rope_write_kv(qkv, cos, sin, slots, k_cache, v_cache, H, Hkv): rotary and the cache write, one kernel

The contract (shapes, dtypes, metadata) is in docs/INTERNALS.md. Triton is imported only when a
kernel is first used, so `is_available()` can be asked on a machine without it.
"""
import functools
import importlib.util
import os

__all__ = ["write_kv", "paged_decode", "paged_prefill", "is_available", "interpreting"]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def is_available() -> bool:
    """True when the kernels can run here: Triton is installed and there is a CUDA GPU or the interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    import torch
    return torch.cuda.is_available() or interpreting()


def __getattr__(name):  # lazy import of the kernels (PEP 562)
    if name == "write_kv":
        from .kv_cache import write_kv
        return write_kv
    if name in ("paged_decode", "paged_prefill"):
        from . import attention
        return getattr(attention, name)
    if name in ("quant", "norms", "rope"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
