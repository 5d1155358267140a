"""ModelRunner: model + tokenizer + paged KV cache + the forward path chosen at load; one
`step` per engine step (copy-on-write, forward, sampling)."""
from __future__ import annotations

import numpy as np
import torch

from . import forward
from .attention import AttentionMetadata, backend_for
from .llama import LlamaForCausalLM
from ..loader import ModelFiles, terminal_progress
from ..runtime import (CPU_KV_MAX_BYTES, CPU_KV_RAM_FRACTION, KvBudgetError, Launched,  # noqa: F401
                      RunnerBase, _gib, _token_id, available_ram, cpu_kv_default_bytes, rss_bytes)
from ..settings import CpuConfig
from ..tokenizer import Tokenizer


def _as_tensor(x, dtype, device) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    return torch.as_tensor(x, dtype=dtype).to(device)


def _each_last_row(logits_indices, meta: AttentionMetadata) -> bool:
    """The rows are each sequence's last, in order (what logits_indices=None computes)."""
    idx = logits_indices.cpu().numpy() if isinstance(logits_indices, torch.Tensor) else np.asarray(logits_indices)
    if idx.shape != (meta.num_seqs,) or not meta.is_decode:     # (decode rows only: one token a sequence)
        return False
    return bool(np.array_equal(idx, np.arange(meta.num_seqs)))


KV_DTYPES = {"f16": torch.float16, "f32": torch.float32, "bf16": torch.bfloat16}


def kv_torch_dtype(name: str | None, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype from its name ("f16", "f32"; None: f16 on CPU, the model's dtype on
    a GPU); ValueError for a name it does not know or a GPU cache unlike the model."""
    if name is None:
        return dtype if device.type == "cuda" else torch.float16
    if name == "q8_0":
        raise ValueError("a q8_0 KV cache is read by the CPU runtime's kernels only (the default for a GGUF "
                         "model on a CPU): use f16 here")
    if name not in KV_DTYPES:
        raise ValueError(f"KV cache dtype {name!r}: use one of {', '.join(KV_DTYPES)}")
    kv = KV_DTYPES[name]
    if device.type == "cuda" and kv != dtype:
        raise ValueError(f"on a GPU the KV cache takes the model's dtype ({str(dtype).replace('torch.', '')})")
    if device.type == "cpu" and kv == torch.bfloat16:
        raise ValueError("a bf16 KV cache is not supported on CPU: use f16 (half the memory of f32) or f32")
    return kv


def keeps_quantized(files: ModelFiles, device: torch.device, dtype: torch.dtype, quantized: bool | None,
                    quant_kernels: str = "rust") -> bool:
    """Resolve the runner's `quantized` option: None = whenever it applies (a GGUF file with
    a tensor in a kernel format: on a CUDA device, Triton's kernels multiply its blocks; on
    the CPU in float32, the Rust kernels)."""
    reasons = []
    if files.reader is None:
        reasons.append("the model is not a GGUF file")
    if quant_kernels == "triton":
        from ... import kernels
        if not kernels.is_available():
            reasons.append("Triton has neither a GPU nor its interpreter here")
    elif device.type != "cpu":
        reasons.append("the device is not the CPU")
    elif dtype != torch.float32:
        reasons.append("the dtype is not float32")
    if not reasons and not files.has_quantized:
        from ..quant.formats import FORMATS
        reasons.append(f"the file has no tensor in {'/'.join(FORMATS.values())}")
    if quantized and reasons:
        raise ValueError("quantized=True but " + "; ".join(reasons))
    return bool(quantized or (quantized is None and not reasons))


class ModelRunner(RunnerBase):
    """Owns the weights, the KV cache and the forward path. Not thread-safe: one step at a time.

    The KV cache `kv_cache` is one tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""

    def __init__(self, model_path=None, device="cpu", dtype=None, kv_memory_bytes=None, block_size=16,
                 num_blocks=None, *, gpu_memory_utilization: float = 0.9, max_num_batched_tokens: int = 2048,
                 progress=None, quantized: bool | None = None, settings: CpuConfig | None = None,
                 kv_dtype: str | None = None, served_name: str | None = None, quant_kernels: str | None = None,
                 decode_graphs: bool | None = None, max_num_seqs: int = 64):
        """served_name: the store's name for it. quantized: keep a GGUF file's quantized weights as they are and multiply with the
        Rust kernels; None = whenever it applies (`keeps_quantized`). settings: the CPU knobs,
        `CpuConfig.from_env()` by default. kv_dtype: the KV cache's element type, "f16" or
        "f32" (None: f16 on CPU, twice the tokens of f32 in the same memory; the model's dtype
        on a GPU, which the Triton kernels need). quant_kernels: what multiplies the GGUF blocks
        kept: "triton" (the default on a CUDA device: `gpu_quant.py`; on a CPU, Triton's
        interpreter, for the tests) or "rust" (the CPU's). decode_graphs: decode steps of up to
        `max_num_seqs` sequences run through static buffers, one CUDA graph per batch-size
        bucket (`graphs.DecodeGraphs`); None: on a CUDA device; True on a CPU runs the same
        padded step eagerly (the tests)."""
        self.served_name = served_name
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
        self._init_stats()
        cfg = self.config
        self.block_bytes = (2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim
                            * torch.empty((), dtype=self.kv_dtype).element_size())
        if num_blocks is None and kv_memory_bytes is not None:   # say so before loading gigabytes of weights
            self._check_budget(kv_memory_bytes, files.path)
        self.tokenizer = Tokenizer.load(files.path, reader=files.reader)
        self.quant_kernels = quant_kernels or ("triton" if on_gpu else "rust")
        self.quantized = keeps_quantized(files, self.device, self.dtype, quantized, self.quant_kernels)
        with torch.inference_mode():
            self.model = LlamaForCausalLM(cfg, device=self.device, dtype=self.dtype, quant_kernels=self.quant_kernels)
            progress = progress or terminal_progress(f"loading {files.path.name}")
            triton = self.quant_kernels == "triton"
            self.quant_math = None if not self.quantized else "triton" if triton else settings.math(cfg.num_params)
            self.model.load_weights(files.weights(self.dtype, self.device, progress, keep_quantized=self.quantized),
                                    math="exact" if triton else self.quant_math or "exact",
                                    interleave=settings.quant_interleave and not triton,
                                    dense_min_tokens=settings.dense_min_tokens)
            self.model.pack()
            if on_gpu:
                self.model.use_triton_norms()
        self.device_sampling = on_gpu      # the sampler on the device (sampling.py); the host's on a CPU
        del files
        self.backend = backend_for(self.device, cfg, block_size, self.dtype)
        if num_blocks is None:
            if kv_memory_bytes is None:
                kv_memory_bytes = (self._gpu_kv_budget(gpu_memory_utilization, max_num_batched_tokens) if on_gpu
                                   else cpu_kv_default_bytes())
            num_blocks = int(kv_memory_bytes // self.block_bytes)
        if num_blocks < 1:
            raise KvBudgetError(f"KV cache budget too small: {kv_memory_bytes} bytes, one block of this model is "
                                f"{self.block_bytes} (e.g. 256M or more)")
        self.num_blocks = num_blocks
        self.kv_cache = self._new_kv(num_blocks)
        self.max_model_len = min(cfg.context_length, num_blocks * block_size)
        if self.max_model_len != self.model.rotary.max_positions:
            self.model.build_rotary(self.max_model_len)
        self.forward = forward.choose(self.model, self.backend, self.kv_cache, settings, self.quantized)
        self.graphs = None
        if decode_graphs or (decode_graphs is None and on_gpu):
            from .graphs import DecodeGraphs
            self.graphs = DecodeGraphs(self.model, self.backend, self.kv_cache, max_num_seqs,
                                       -(-self.max_model_len // block_size), capture=on_gpu)

    def _rotary_size(self) -> int:
        return self.model.rotary.max_positions

    @property
    def async_steps(self) -> bool:
        return self.device.type == "cuda" and self.device_sampling

    def step_begin(self, batch, params, feed=None):
        """One step of plain rows launched on the device and left running: the forward and the
        device's sampler queued, the ids' copy to pinned host memory queued behind them, an
        event recorded. A fed step (`feed`) takes its input ids from the earlier step's ids
        on the device: nothing waits for them. Rows the device cannot sample (a seed, logprobs)
        or a step that reads or writes blocks on the host: the whole step at once."""
        from . import sampling
        if (not self.device_sampling or not sampling.supported(params) or len(batch.copies)
                or getattr(batch, "loads", None) or getattr(batch, "rope_positions", None) is not None
                or self.images is not None):      # (a vision model's steps read their ids on the host)
            return super().step_begin(batch, params, feed)
        dev = self.device
        with torch.inference_mode():
            ids = _as_tensor(batch.input_ids, torch.int64, dev)
            if feed is not None:
                earlier, rows = feed
                src = earlier.ids if earlier.ids is not None else torch.tensor(
                    [_token_id(t) for t in earlier.tokens], dtype=torch.int64)
                ids = src.to(dev)[torch.as_tensor(np.asarray(rows, np.int64)).to(dev)]
            raw = self.execute(ids, batch.positions, dict(query_start_loc=batch.query_start_loc,
                                                          seq_lens=batch.seq_lens, block_tables=batch.block_tables,
                                                          slot_mapping=batch.slot_mapping), batch.logits_indices)
            out = sampling.sample_tensor(raw, params)
            if dev.type != "cuda":
                return Launched(out.tolist(), ids=out)
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            host.copy_(out, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            return Launched(None, ids=out, ready=ready, host=host)

    def step_end(self, launched) -> list:
        if launched.tokens is None:
            launched.ready.synchronize()
            launched.tokens = launched.host.tolist()
        return launched.tokens

    def sample_where_computed(self, logits, params, prev_tokens, outputs, masks=None) -> list | None:
        if not self.device_sampling or not isinstance(logits, torch.Tensor):
            return None
        from . import sampling
        try:
            return sampling.sample(logits, params, prev_tokens, outputs,
                                   masks=None if masks is None else masks.result())
        except Exception:  # noqa: BLE001 - the host's sampler then, which keeps a row's failure its own
            return None

    def rotary_positions(self, positions) -> None:
        have = self._rotary_size()
        super().rotary_positions(positions)
        if self.graphs is not None and self._rotary_size() != have:
            self.graphs.forget()          # the graphs read the old tables: captured again when next used

    @property
    def dense_products(self) -> str:
        return str(self.dtype).replace("torch.", "").replace("float", "fp")

    # ------------------------------------------------------------ KV cache

    @property
    def kv_dtype_name(self) -> str:
        """"f16", "f32" or "bf16": the KV cache's element type."""
        return next(k for k, v in KV_DTYPES.items() if v == self.kv_dtype)

    def _free_memory(self) -> tuple[int, str]:
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0], "free GPU memory"
        return super()._free_memory()

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

    def weight_bytes(self) -> int:
        from .quant_modules import weight_bytes
        w = weight_bytes(self.model)
        return w["quantized"] + w["dense"]

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

    def read_block(self, block: int) -> np.ndarray:
        t = self.kv_cache[:, :, block].contiguous()
        return t.view(torch.uint8).cpu().numpy().reshape(-1)

    def write_block(self, block: int, data: np.ndarray) -> None:
        shape = self.kv_cache[:, :, block].shape
        t = torch.from_numpy(np.array(data, np.uint8, copy=True)).view(self.kv_dtype).reshape(shape)
        self.kv_cache[:, :, block] = t.to(self.device)

    # ------------------------------------------------------------ forward

    def last_hidden(self) -> np.ndarray:
        """The last forward's final-norm rows (one per logits row), float32 numpy."""
        return self.model.last_normed.float().cpu().numpy()

    def _take_images(self, table) -> None:
        """The embedding takes image ids from `table`; the vision tower runs on this runner's
        device (model/torch/vision.py: on a GPU box, the GPU)."""
        from .vision import torch_tower
        self.model.images = table
        self.vision.tower = torch_tower(self.vision, self.device)

    def execute(self, input_ids, positions, attn_metadata, logits_indices=None) -> torch.Tensor:
        """One forward over a flat batch -> float32 logits [len(logits_indices), vocab].

        attn_metadata: an AttentionMetadata, or a mapping with query_start_loc, seq_lens,
        block_tables, slot_mapping (numpy arrays from the allocator are fine); a "prompt" entry
        (the CPU runtime's, see cpu_runtime.CpuModel.forward) is ignored here.
        logits_indices: rows of the flat batch to compute logits for (default: each sequence's last)."""
        dev = self.device
        with torch.inference_mode():
            see = None
            if self.images is not None and self.images.both_ways and not isinstance(attn_metadata, AttentionMetadata):
                from ..image_table import image_see
                see = image_see(self.images, np.asarray(input_ids), np.asarray(positions),
                                np.asarray(attn_metadata["query_start_loc"]))
            meta = (attn_metadata if isinstance(attn_metadata, AttentionMetadata)
                    else AttentionMetadata.build(**{k: v for k, v in attn_metadata.items() if k != "prompt"},
                                                 device=dev, see=see))
            if meta.mrope is not None:      # (the tables must reach the image rows' h and w)
                self.rotary_positions(np.asarray(attn_metadata["mrope"][1]).reshape(-1))
            if max(meta.seq_lens_host) > self.max_model_len:
                raise ValueError(f"context of {max(meta.seq_lens_host)} tokens exceeds max_model_len "
                                 f"{self.max_model_len}")
            self.rotary_positions(positions)
            ids = _as_tensor(input_ids, torch.int64, dev)
            pos = _as_tensor(positions, torch.int64, dev)
            if logits_indices is not None and _each_last_row(logits_indices, meta):
                logits_indices = None        # (the engine's decode steps: each sequence's row, the graph's)
            if (logits_indices is None and self.graphs is not None and self.graphs.takes(meta)
                    and (self.images is None or not bool((ids >= self.images.first).any()))):
                return self.graphs.run(ids, pos, meta)
            idx = None if logits_indices is None else _as_tensor(logits_indices, torch.int64, dev)
            return self.forward(ids, pos, meta, idx)
