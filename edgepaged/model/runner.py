"""ModelRunner: model + tokenizer + paged KV cache; one `execute` per engine step."""
from __future__ import annotations

import os

import numpy as np
import torch

from .attention import AttentionMetadata, TorchAttention, make_backend
from .fused import fused_available
from .llama import LlamaForCausalLM
from .loader import ModelFiles, terminal_progress
from .quant import kernel_threads_only, quant_weights, wants_quantized
from .sampler import SamplingParams, sample
from .tokenizer import Tokenizer

CPU_KV_MAX_BYTES = 1 << 30       # CPU default budget: min(1 GiB, 25% of available RAM)
CPU_KV_RAM_FRACTION = 0.25


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _as_tensor(x, dtype, device) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    return torch.as_tensor(x, dtype=dtype).to(device)


class ModelRunner:
    """Owns the weights and the KV cache. Not thread-safe: one step at a time.

    K/V caches: `k_caches[l]`, `v_caches[l]` are [num_blocks, block_size, kv_heads, head_dim]
    views of one tensor `kv_cache` [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, model_path=None, device="cpu", dtype=None, kv_memory_bytes=None, block_size=16,
                 num_blocks=None, *, gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int = 2048,
                 progress=None, quantized: bool | None = None):
        """quantized: keep a GGUF file's quantized weights as they are and multiply with the
        Rust kernels (edgepaged/model/quant.py); None = whenever the file is GGUF, the device
        the CPU and the dtype float32. `self.quantized` says what was chosen."""
        if threads := os.environ.get("EDGEPAGED_NUM_THREADS"):
            torch.set_num_threads(int(threads))
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self.dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
        self.block_size = block_size
        files = ModelFiles(model_path)
        self.model_path, self.config = files.path, files.config
        self.tokenizer = Tokenizer.load(files.path, reader=files.reader)
        cfg = self.config
        with torch.inference_mode():
            self.model = LlamaForCausalLM(cfg, device=self.device, dtype=self.dtype)
            progress = progress or terminal_progress(f"loading {files.path.name}")
            self.quantized = self.model.quantized = wants_quantized(files, self.device, self.dtype, quantized)
            self.model.load_weights(quant_weights(files, progress) if self.quantized
                                    else files.weights(self.dtype, self.device, progress))
            self.model.pack()
        del files
        self.backend = make_backend(self.device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, block_size,
                                    cfg.sliding_window, self.dtype)
        # CPU float32: the forward with fused Rust operators (fused.py); EDGEPAGED_FUSED=0 turns it off
        self.model.fused = (fused_available(self.device, self.dtype) and isinstance(self.backend, TorchAttention)
                            and cfg.head_dim % 2 == 0 and cfg.head_dim <= 512
                            and cfg.num_heads // cfg.num_kv_heads <= 64)
        self.block_bytes = (2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim
                            * torch.empty((), dtype=self.dtype).element_size())
        if num_blocks is None:
            if kv_memory_bytes is None:
                kv_memory_bytes = (self._gpu_kv_budget(gpu_memory_utilization, max_num_batched_tokens) if on_gpu
                                   else min(CPU_KV_MAX_BYTES, int(CPU_KV_RAM_FRACTION * _available_ram())))
            num_blocks = int(kv_memory_bytes // self.block_bytes)
        if num_blocks < 1:
            raise ValueError(f"KV cache budget too small: {kv_memory_bytes} bytes, one block is {self.block_bytes}")
        self._allocate_kv(num_blocks)
        self.max_model_len = min(cfg.context_length, num_blocks * block_size)
        if self.max_model_len != self.model.rotary.max_positions:
            self.model.rotary.build(max_positions=self.max_model_len, device=self.device, dtype=self.dtype)

    # ------------------------------------------------------------ KV cache

    def _allocate_kv(self, num_blocks: int):
        cfg = self.config
        self.num_blocks = num_blocks
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                                    device=self.device, dtype=self.dtype)
        self.model.kv_cache = self.kv_cache   # the fused CPU decode takes it whole (fused.py)
        self.k_caches = list(self.kv_cache[:, 0])
        self.v_caches = list(self.kv_cache[:, 1])
        for layer, k, v in zip(self.model.layers, self.k_caches, self.v_caches):
            layer.self_attn.k_cache, layer.self_attn.v_cache = k, v

    def _gpu_kv_budget(self, utilization: float, max_tokens: int) -> int:
        """Like vLLM: total * utilization - (memory of others + weights + activation peak of a
        max_tokens prefill)."""
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)
        self._allocate_kv(-(-max_tokens // self.block_size))
        torch.cuda.reset_peak_memory_stats(self.device)
        n = max_tokens
        blocks = list(range(self.num_blocks))
        meta = AttentionMetadata.build([0, n], [n], [blocks], np.arange(n), self.device)
        with torch.inference_mode():
            self.model(torch.zeros(n, dtype=torch.long, device=self.device), torch.arange(n, device=self.device),
                       self.backend, meta)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - self.kv_cache.numel() * self.kv_cache.element_size()
        del self.kv_cache, self.k_caches, self.v_caches
        self.model.kv_cache = None
        for layer in self.model.layers:
            layer.self_attn.k_cache = layer.self_attn.v_cache = None
        torch.cuda.empty_cache()
        return int(total * utilization - others - peak)

    def copy_blocks(self, copies) -> None:
        """Copy-on-write: for each (src, dst) row copy block src to dst in every layer's K and V."""
        copies = _as_tensor(copies, torch.int64, self.device).reshape(-1, 2)
        if len(copies):
            self.kv_cache[:, :, copies[:, 1]] = self.kv_cache[:, :, copies[:, 0]]

    # ------------------------------------------------------------ forward

    def execute(self, input_ids, positions, attn_metadata, logits_indices=None) -> torch.Tensor:
        """One forward over a flat batch -> float32 logits [len(logits_indices), vocab].

        attn_metadata: an AttentionMetadata, or a mapping with query_start_loc, seq_lens,
        block_tables, slot_mapping (numpy arrays from the allocator are fine).
        logits_indices: rows of the flat batch to compute logits for (default: each sequence's last)."""
        dev = self.device
        with torch.inference_mode():
            meta = (attn_metadata if isinstance(attn_metadata, AttentionMetadata)
                    else AttentionMetadata.build(**attn_metadata, device=dev))
            if max(meta.seq_lens_host) > self.max_model_len:
                raise ValueError(f"context of {max(meta.seq_lens_host)} tokens exceeds max_model_len "
                                 f"{self.max_model_len}")
            ids = _as_tensor(input_ids, torch.int64, dev)
            pos = _as_tensor(positions, torch.int64, dev)
            idx = None if logits_indices is None else _as_tensor(logits_indices, torch.int64, dev)
            with kernel_threads_only(self.quantized):  # one pool at a time on the cores (quant.py)
                return self.model(ids, pos, self.backend, meta, idx)

    def step(self, input_ids, positions, attn_metadata, logits_indices=None,
             params: list[SamplingParams] | None = None, prev_tokens=None) -> list[int]:
        """execute + sample: one token per logits row. params[i] / prev_tokens[i] (the
        sequence's tokens so far) belong to logits row i; params=None means greedy."""
        logits = self.execute(input_ids, positions, attn_metadata, logits_indices)
        if len(logits) == 0:
            return []
        params = params or [SamplingParams(temperature=0)] * len(logits)
        with torch.inference_mode():
            return sample(logits, params, prev_tokens).tolist()
