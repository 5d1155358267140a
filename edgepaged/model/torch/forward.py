"""The torch runner's forward: how one flat batch becomes logits. The torch runtime is the
GPU path (Triton attention) and, on a CPU, the tests' reference (torch attention); a model
on a CPU is served by the torch-free runtime (`model/cpu/runner.py`, numpy + Rust), which
reads GGUF files and safetensors folders alike.

A forward is called as `path(input_ids, positions, meta, logits_indices) -> logits` (float32,
one row per index) and reads and writes the KV cache it was built with.
"""
from __future__ import annotations

from typing import Protocol

import torch

from .attention import AttentionMetadata
from .quant_threads import kernel_threads_only
from ..settings import CpuConfig


class ForwardPath(Protocol):
    name: str

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 logits_indices: torch.Tensor | None) -> torch.Tensor: ...


class TorchForward:
    """The model's own torch forward over a backend (TorchAttention on CPU, Triton on GPU)."""

    def __init__(self, model, backend, kv_cache: torch.Tensor, kernel_threads: bool = False):
        self.model, self.backend, self.kv = model, backend, kv_cache
        self.threads = kernel_threads
        self.name = f"torch ({type(backend).__name__})"

    def __call__(self, input_ids, positions, meta, logits_indices):
        with kernel_threads_only(self.threads):
            return self.model(input_ids, positions, self.backend, meta, self.kv, logits_indices)


def choose(model, backend, kv_cache: torch.Tensor, settings: CpuConfig, quantized: bool) -> ForwardPath:
    """The torch forward. `quantized`: the model kept GGUF blocks, so torch runs on one thread
    beside the kernels' pool (unless settings say otherwise)."""
    return TorchForward(model, backend, kv_cache, quantized and settings.torch_single_thread)
