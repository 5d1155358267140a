"""The model runtime: loading, the forward paths over a paged KV cache, sampling.

Names are imported on first use, so `edgepaged.model.params` (plain data) can be imported
without torch.
"""
import importlib

_NAMES = {
    "AttentionMetadata": "torch.attention", "ModelConfig": "loader", "ModelFiles": "loader",
    "default_model_path": "loader", "ModelRunner": "torch.runner", "SamplingParams": "params", "sample": "sampler",
    "IncrementalDetokenizer": "tokenizer", "Tokenizer": "tokenizer", "CpuConfig": "settings",
}

__all__ = sorted(_NAMES)


def __getattr__(name):
    if name in _NAMES:
        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
