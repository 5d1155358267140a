"""The torch runner's forward paths: how one flat batch becomes logits. The runner picks one
at load, from the device, the weights' formats and the settings (`choose`); nothing is
decided again per step. (GGUF files on the CPU run by default on the torch-free runtime,
`model/cpu/runner.py`, whose forward uses the same Rust operators.)

| path               | where                          | what                                             |
|--------------------|--------------------------------|--------------------------------------------------|
| `TorchForward`     | GPU (Triton attention), or CPU | the model's torch forward; the reference in tests |
| `FusedCpuForward`  | CPU, float32                   | Rust operators between the GEMMs; one Rust call per step when every linear kept its GGUF blocks (`model/torch/cpu_forward.py`) |

A path is called as `path(input_ids, positions, meta, logits_indices) -> logits` (float32,
one row per index) and reads and writes the KV cache it was built with.
"""
from __future__ import annotations

from typing import Protocol

import torch

from . import cpu_forward
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


def choose(model, backend, kv_cache: torch.Tensor, device: torch.device, dtype: torch.dtype, settings: CpuConfig,
           quantized: bool) -> ForwardPath:
    """The fused CPU forward where it applies (CPU, float32, settings.fused, heads it takes),
    else the torch forward. `quantized`: the model kept GGUF blocks, so torch runs on one
    thread beside the kernels' pool (unless settings say otherwise)."""
    threads = quantized and settings.torch_single_thread
    if (device.type == "cpu" and dtype == torch.float32 and settings.fused
            and cpu_forward.supports(model, backend)):
        return cpu_forward.FusedCpuForward(model, backend, kv_cache, settings, threads)
    return TorchForward(model, backend, kv_cache, threads)
