"""ModelRunner: model + tokenizer + paged KV cache + the forward path chosen at load; one
`step` per engine step (copy-on-write, forward, sampling)."""
from __future__ import annotations

import collections
import os
import time

import numpy as np
import torch

from . import forward
from .attention import AttentionMetadata, backend_for
from .grammar import Masks
from .llama import LlamaForCausalLM
from .loader import ModelFiles, terminal_progress
from .params import SamplingParams
from .sampler import logprob_info, prepare, sample, sample_prepared
from .settings import CpuConfig
from .tokenizer import Tokenizer


class _Background:
    """fn(*args) in a thread of its own; `result()` waits for it (and raises what it raised)."""

    def __init__(self, fn, *args):
        import threading
        self._out = self._err = None
        self._thread = threading.Thread(target=self._run, args=(fn, args), daemon=True)
        self._thread.start()

    def _run(self, fn, args):
        try:
            self._out = fn(*args)
        except BaseException as e:   # handed to the caller
            self._err = e

    def result(self):
        self._thread.join()
        if self._err is not None:
            raise self._err
        return self._out

CPU_KV_MAX_BYTES = 1 << 30       # CPU default budget: min(1 GiB, 25% of available RAM)
CPU_KV_RAM_FRACTION = 0.25


def available_ram() -> int:
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


def rss_bytes() -> int | None:
    """The process's resident memory (Linux), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class KvBudgetError(ValueError):
    """A KV cache budget this machine cannot hold (or too small for one block)."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n < 2**40 else f"{n / 2**40:.1f} TiB"


KV_DTYPES = {"f16": torch.float16, "f32": torch.float32, "bf16": torch.bfloat16}


def kv_torch_dtype(name: str | None, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype from its name ("f16", "f32"; None: f16 on CPU, the model's dtype on
    a GPU); ValueError for a name it does not know or a GPU cache unlike the model."""
    if name is None:
        return dtype if device.type == "cuda" else torch.float16
    if name not in KV_DTYPES:
        raise ValueError(f"KV cache dtype {name!r}: use one of {', '.join(KV_DTYPES)}")
    kv = KV_DTYPES[name]
    if device.type == "cuda" and kv != dtype:
        raise ValueError(f"on a GPU the KV cache takes the model's dtype ({str(dtype).replace('torch.', '')})")
    if device.type == "cpu" and kv == torch.bfloat16:
        raise ValueError("a bf16 KV cache is not supported on CPU: use f16 (half the memory of f32) or f32")
    return kv


def keeps_quantized(files: ModelFiles, device: torch.device, dtype: torch.dtype, quantized: bool | None) -> bool:
    """Resolve the runner's `quantized` option: None = whenever it applies (a GGUF file with
    a tensor in a kernel format, on the CPU in float32)."""
    reasons = []
    if files.reader is None:
        reasons.append("the model is not a GGUF file")
    if device.type != "cpu":
        reasons.append("the device is not the CPU")
    if dtype != torch.float32:
        reasons.append("the dtype is not float32")
    if not reasons and not files.has_quantized:
        from .quant.formats import FORMATS
        reasons.append(f"the file has no tensor in {'/'.join(FORMATS.values())}")
    if quantized and reasons:
        raise ValueError("quantized=True but " + "; ".join(reasons))
    return bool(quantized or (quantized is None and not reasons))


class ModelRunner:
    """Owns the weights, the KV cache and the forward path. Not thread-safe: one step at a time.

    The KV cache `kv_cache` is one tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, model_path=None, device="cpu", dtype=None, kv_memory_bytes=None, block_size=16,
                 num_blocks=None, *, gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int = 2048,
                 progress=None, quantized: bool | None = None, settings: CpuConfig | None = None,
                 kv_dtype: str | None = None):
        """quantized: keep a GGUF file's quantized weights as they are and multiply with the
        Rust kernels; None = whenever it applies (`keeps_quantized`). settings: the CPU knobs,
        `CpuConfig.from_env()` by default. kv_dtype: the KV cache's element type, "f16" or
        "f32" (None: f16 on CPU, twice the tokens of f32 in the same memory; the model's dtype
        on a GPU, which the Triton kernels need)."""
        self.settings = settings = settings or CpuConfig.from_env()
        if settings.num_threads:
            torch.set_num_threads(settings.num_threads)
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self.dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
        self.kv_dtype = kv_torch_dtype(kv_dtype, self.device, self.dtype)
        self.block_size = block_size
        files = ModelFiles(model_path)
        self.model_path, self.config = files.path, files.config
        self.file_info = files.info()     # format, size, modification time, quantization (model lists)
        self.mask_ms: collections.deque = collections.deque(maxlen=10000)   # constrained steps' mask times
        cfg = self.config
        self.block_bytes = (2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim
                            * torch.empty((), dtype=self.kv_dtype).element_size())
        if num_blocks is None and kv_memory_bytes is not None:   # say so before loading gigabytes of weights
            self._check_budget(kv_memory_bytes, files.path)
        self.tokenizer = Tokenizer.load(files.path, reader=files.reader)
        self.quantized = keeps_quantized(files, self.device, self.dtype, quantized)
        with torch.inference_mode():
            self.model = LlamaForCausalLM(cfg, device=self.device, dtype=self.dtype)
            progress = progress or terminal_progress(f"loading {files.path.name}")
            self.quant_math = settings.math(cfg.num_params) if self.quantized else None
            self.model.load_weights(files.weights(self.dtype, self.device, progress, keep_quantized=self.quantized),
                                    math=self.quant_math or "exact", interleave=settings.quant_interleave,
                                    dense_min_tokens=settings.dense_min_tokens)
            self.model.pack()
        del files
        self.backend = backend_for(self.device, cfg, block_size, self.dtype)
        if num_blocks is None:
            if kv_memory_bytes is None:
                kv_memory_bytes = (self._gpu_kv_budget(gpu_memory_utilization, max_num_batched_tokens) if on_gpu
                                   else min(CPU_KV_MAX_BYTES, int(CPU_KV_RAM_FRACTION * available_ram())))
            num_blocks = int(kv_memory_bytes // self.block_bytes)
        if num_blocks < 1:
            raise KvBudgetError(f"KV cache budget too small: {kv_memory_bytes} bytes, one block of this model is "
                                f"{self.block_bytes} (e.g. 256M or more)")
        self.num_blocks = num_blocks
        self.kv_cache = self._new_kv(num_blocks)
        self.max_model_len = min(cfg.context_length, num_blocks * block_size)
        if self.max_model_len != self.model.rotary.max_positions:
            self.model.build_rotary(self.max_model_len)
        self.forward = forward.choose(self.model, self.backend, self.kv_cache, self.device, self.dtype, settings,
                                      self.quantized)

    @property
    def products(self) -> str:
        """How the weights multiply, for banners: "int8 (avx512-vnni)", "exact (avx2)" (GGUF
        blocks kept quantized), "fp32" (dense)."""
        if not self.quantized:
            return str(self.dtype).replace("torch.", "").replace("float", "fp")
        from .._native import quant
        info = quant.info()
        return f"{self.quant_math} ({info['int8_isa'] if self.quant_math == 'int8' else info['isa']})"

    # ------------------------------------------------------------ KV cache

    @property
    def kv_dtype_name(self) -> str:
        """"f16", "f32" or "bf16": the KV cache's element type."""
        return next(k for k, v in KV_DTYPES.items() if v == self.kv_dtype)

    def _check_budget(self, kv_bytes: int, path) -> None:
        """KvBudgetError for a budget the device's free memory cannot hold, next to the weights."""
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            where = "free GPU memory"
        else:
            free = available_ram()
            where = "available memory"
        weights = path.stat().st_size if path.is_file() else 0
        room = free - weights
        if kv_bytes > room:
            hint = f"at most about {_gib(max(room, 0) * 0.9)}" if room > 2**28 else "a smaller model or more memory"
            raise KvBudgetError(f"{_gib(kv_bytes)} of KV cache does not fit: this machine has {_gib(free)} of "
                                f"{where}, and the weights take about {_gib(weights)} of it (try {hint})")
        if kv_bytes < self.block_bytes:
            raise KvBudgetError(f"{kv_bytes} bytes of KV cache is less than one block of this model "
                                f"({self.block_bytes} bytes; e.g. 256M)")

    def _new_kv(self, num_blocks: int) -> torch.Tensor:
        """The KV pool. On CPU its memory is committed as it fills, not up front: numpy's zeros
        come from calloc, whose large blocks are fresh zero pages the system hands out when
        first written (torch.zeros writes them all at once)."""
        cfg = self.config
        shape = (cfg.num_layers, 2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        if self.device.type != "cpu":
            return torch.zeros(shape, device=self.device, dtype=self.kv_dtype)
        itemsize = torch.empty((), dtype=self.kv_dtype).element_size()
        raw = np.zeros(int(np.prod(shape)) * itemsize, dtype=np.uint8)
        return torch.from_numpy(raw).view(self.kv_dtype).view(shape)

    def memory(self) -> dict:
        """What the model holds: weights, the KV pool (reserved: its size; used: blocks in
        use, passed in by the engine), and the process's resident memory."""
        from .quant.modules import weight_bytes
        try:
            w = weight_bytes(self.model)
            weights = w["quantized"] + w["dense"]
        except Exception:  # noqa: BLE001 - a model without the usual modules: say nothing wrong
            weights = None
        return {"weights_bytes": weights, "kv_reserved_bytes": self.num_blocks * self.block_bytes,
                "block_bytes": self.block_bytes, "rss_bytes": rss_bytes()}

    def _gpu_kv_budget(self, utilization: float, max_tokens: int) -> int:
        """Like vLLM: total * utilization - (memory of others + weights + activation peak of a
        max_tokens prefill)."""
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)
        blocks = -(-max_tokens // self.block_size)
        kv = self._new_kv(blocks)
        torch.cuda.reset_peak_memory_stats(self.device)
        n = max_tokens
        meta = AttentionMetadata.build([0, n], [n], [list(range(blocks))], np.arange(n), self.device)
        with torch.inference_mode():
            self.model(torch.zeros(n, dtype=torch.long, device=self.device), torch.arange(n, device=self.device),
                       self.backend, meta, kv)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - kv.numel() * kv.element_size()
        del kv
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
            return self.forward(ids, pos, meta, idx)

    def _masks(self, matchers) -> Masks | None:
        t0 = time.perf_counter()
        masks = Masks.compute(matchers, self.config.vocab_size)
        self.mask_ms.append((time.perf_counter() - t0) * 1000)
        return masks

    def step(self, batch, params: list[SamplingParams], prev_tokens=None, matchers=None, outputs=None) -> list:
        """One engine step: the batch's copy-on-write copies, the forward, one sampled token
        per logits row. `batch` has the scheduler's arrays (input_ids, positions,
        query_start_loc, seq_lens, block_tables, slot_mapping, copies, logits_indices);
        params[i] / prev_tokens[i] (the sequence's tokens so far) / matchers[i] (a constrained
        output's llguidance matcher, or None) / outputs[i] (the answer's tokens, for presence and
        frequency penalties) belong to logits row i. The constrained rows' token masks are
        computed in a thread of their own while the forward runs. A row that asked for
        logprobs gets (token, info) instead of its token (sampler.logprob_info)."""
        if len(batch.copies):
            self.copy_blocks(batch.copies)
        meta = dict(query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
                    block_tables=batch.block_tables, slot_mapping=batch.slot_mapping)
        masks = None
        if matchers is not None and any(m is not None for m in matchers):
            masks = _Background(self._masks, matchers)
        logits = self.execute(batch.input_ids, batch.positions, meta, batch.logits_indices)
        if masks is not None:
            masks = masks.result()
            if logits.device.type != "cpu":
                logits = logits.cpu()
            masks.apply(logits)
        if len(logits) == 0:
            return []
        with torch.inference_mode():
            try:
                if any(p.logprobs is not None for p in params):
                    logits = prepare(logits, params, prev_tokens, outputs)
                    tokens = sample_prepared(logits, params, prev_tokens)
                    infos = logprob_info(logits, tokens, params)
                    return [t if info is None else (t, info) for t, info in zip(tokens.tolist(), infos)]
                return sample(logits, params, prev_tokens, outputs).tolist()
            except Exception as e:
                if len(params) == 1:     # that row's failure, reported as its own
                    return [e]
            # one row's sampling failed: sample row by row, so the failure stays that row's
            out: list = []
            for i, p in enumerate(params):
                try:
                    out.append(int(sample(logits[i:i + 1], [p], None if prev_tokens is None else [prev_tokens[i]],
                                          None if outputs is None else [outputs[i]])[0]))
                except Exception as e:
                    out.append(e)
            return out
