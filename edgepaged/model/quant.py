"""Quantized weights kept quantized on CPU: GGUF blocks in memory, Rust kernels on them.

With `ModelRunner(..., quantized=None | True)` on a GGUF file and a CPU, every linear weight
in a block format the kernels read (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) stays as its GGUF bytes:
resident weights are about the file's size instead of 4x it in fp32.

- `QuantLinear`: y = x W^T (+ b) with W as one or more row segments of GGUF blocks (a fused
  QKV or gate/up may mix formats, as Q4_K_M files do). Up to `dense_min_tokens - 1` token
  rows it runs `quant_matmul` (blocks decoded in registers, read once per call); from
  `dense_min_tokens` rows on (long prefills) it decodes row tiles into a reusable fp32
  scratch of at most `SCRATCH_BYTES` and runs oneDNN's GEMM on them.
- `QuantEmbedding`: rows of the token table decoded on lookup (`quant_gather_rows`).
- Q4_0, Q4_1 and Q8_0 weights are interleaved at load (`QuantWeight.interleave`): rows in
  groups of 8, each block's bytes spread across the 8 rows, so the kernels read 8 rows' weight
  `k` as 8 consecutive bytes (no transposes while decoding: decode steps 6-7% faster at
  batch 32, 9-17% at batch 1-16). Same bytes, same results; EDGEPAGED_QUANT_INTERLEAVE=0
  keeps the GGUF row order.
- `quant_weights(files)`: the GGUF tensors as `QuantWeight` (kept) or dense tensors;
  `load_quantized(model, weights)` builds the modules (hooked from `load_weights`).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from torch import nn

from .layers import Linear

# GGML type id -> name, for the formats the kernels read
FORMATS = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}
BLOCK = {2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 14: (256, 210)}  # weights, bytes
# token rows from which the fp32 path (decode tiles to scratch + GEMM) is as fast as the
# kernels; measured on a 2-core AVX2 box (bench/quant_bench.py --crossover, all linears of
# the embedded model): since the kernels multiply 16+ tokens by outer products, they are
# 13-33% faster up to 512 rows and tie at 768-1024. Override with the env
DENSE_MIN_TOKENS = int(os.environ.get("EDGEPAGED_QUANT_DENSE_MIN_TOKENS", "768"))
SCRATCH_BYTES = 16 << 20
X8_FLAG = 0x100                 # added to a type id for interleaved weights (the Rust side's X8_FLAG)
INTERLEAVABLE = (2, 3, 8)       # Q4_0, Q4_1, Q8_0

try:
    from edgepaged._rust_alloc import quant_dequantize, quant_gather_rows, quant_info, quant_matmul
except ImportError:  # an old build without the kernels
    quant_matmul = quant_dequantize = quant_gather_rows = quant_info = None
try:
    from edgepaged._rust_alloc import quant_interleave
except ImportError:  # a build from before the interleaved layout
    quant_interleave = None


def kernels_available() -> bool:
    return quant_matmul is not None


@dataclass
class QuantWeight:
    """A [rows, cols] weight as GGUF blocks: `data` uint8 [rows, row_bytes], C-contiguous; or,
    once `interleave`d (`x8`), [ceil(rows / 8), 8 * row_bytes] in groups of 8 rows."""
    qtype: int
    data: np.ndarray
    rows: int
    cols: int
    x8: bool = False

    def __post_init__(self):
        bw, bb = BLOCK[self.qtype]
        rb = self.cols // bw * bb
        want = (-(-self.rows // 8), 8 * rb) if self.x8 else (self.rows, rb)
        if self.cols % bw or self.data.shape != want:
            raise ValueError(f"{FORMATS[self.qtype]} weight [{self.rows}, {self.cols}]: bad block bytes "
                             f"{self.data.shape}")
        self.data = np.ascontiguousarray(self.data, dtype=np.uint8)

    @property
    def kind(self) -> int:
        """The type id the kernels take: the GGML id, plus X8_FLAG when interleaved."""
        return self.qtype | X8_FLAG if self.x8 else self.qtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def interleave(self) -> bool:
        """Re-lay the blocks out in groups of 8 rows where the format and the build allow it;
        True if the weight is interleaved afterwards. The array is rewritten in place when
        its rows are a multiple of 8 (no second copy of the weights while loading): nothing
        else may hold it."""
        if not self.x8 and self.qtype in INTERLEAVABLE and quant_interleave is not None:
            self.data = quant_interleave(self.data, self.qtype, self.rows)
            self.x8 = True
        return self.x8

    def dequantize(self) -> torch.Tensor:
        out = torch.empty(self.rows, self.cols)
        quant_dequantize(self.data, self.kind, out.numpy())
        return out


def can_keep(qtype: int, shape) -> bool:
    """Whether a GGUF tensor of this type and (rows, cols) shape can stay quantized."""
    return qtype in FORMATS and len(shape) == 2 and shape[1] % BLOCK[qtype][0] == 0


_local = threading.local()


def _scratch(n: int) -> torch.Tensor:
    """A per-thread fp32 buffer of at least n elements, reused between calls."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _local.buf = torch.empty(n)
    return buf[:n]


def _f32_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    x = x.reshape(-1, k)
    if x.dtype != torch.float32:
        x = x.float()
    return x if x.stride(1) == 1 or x.shape[1] == 1 else x.contiguous()


class QuantLinear(nn.Module):
    """y = x W^T + b, W kept as GGUF blocks (row segments stacked along the output)."""

    def __init__(self, segments: list[QuantWeight], bias: torch.Tensor | None = None,
                 dense_min_tokens: int | None = None):
        super().__init__()
        if not segments or len({s.cols for s in segments}) != 1:
            raise ValueError("QuantLinear needs segments with one input width")
        merged: list[QuantWeight] = []
        for s in segments:  # neighbours of one format become one matrix: one kernel call
            if merged and merged[-1].qtype == s.qtype and not (s.x8 or merged[-1].x8):
                p = merged[-1]
                merged[-1] = QuantWeight(s.qtype, np.concatenate([p.data, s.data]), p.rows + s.rows, s.cols)
            else:
                merged.append(s)
        self.segments = merged
        self.single = merged[0] if len(merged) == 1 else None
        self.offsets = np.cumsum([0] + [s.rows for s in merged]).tolist()
        self.in_features, self.out_features = segments[0].cols, self.offsets[-1]
        self.bias = bias
        self.dense_min_tokens = dense_min_tokens or DENSE_MIN_TOKENS

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def extra_repr(self) -> str:
        fmts = "+".join(f"{FORMATS[s.qtype]}[{s.rows}]" for s in self.segments)
        return f"in_features={self.in_features}, out_features={self.out_features}, {fmts}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != torch.float32 or x.stride(1) != 1:
            lead = x.shape[:-1]
            return self.forward(_f32_rows(x, self.in_features)).view(*lead, self.out_features)
        t = x.shape[0]
        if t >= self.dense_min_tokens:
            out = self._dense(x)
        else:
            out = torch.empty(t, self.out_features)
            if t:
                xn, on = x.numpy(), out.numpy()
                if self.single:
                    quant_matmul(self.single.data, self.single.kind, xn, on)
                else:
                    for s, a in zip(self.segments, self.offsets):
                        quant_matmul(s.data, s.kind, xn, on[:, a: a + s.rows])
        if self.bias is not None:
            out += self.bias
        return out

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """Decode row tiles into the scratch and multiply with oneDNN (large token counts)."""
        k = self.in_features
        tile_rows = max(1, SCRATCH_BYTES // 4 // k)
        out = None
        for s, a in zip(self.segments, self.offsets):
            for r0 in range(0, s.rows, tile_rows):
                n = min(tile_rows, s.rows - r0)
                w = _scratch(n * k).view(n, k)
                quant_dequantize(s.data, s.kind, w.numpy(), r0)
                y = _gemm(x, w)
                if n == self.out_features:
                    return y
                if out is None:
                    out = torch.empty(x.shape[0], self.out_features)
                out[:, a + r0: a + r0 + n] = y
        return out


def _gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T; oneDNN where torch has it (MKL's sgemm is several times slower on AMD CPUs),
    on all of torch's threads even inside `kernel_threads_only`."""
    with _torch_threads(_local.__dict__.get("saved_threads")):
        if _ONEDNN:   # re-laid out for oneDNN first: the GEMM then runs ~5% faster than on plain rows
            if _REORDER:
                w = torch.ops.mkldnn._reorder_linear_weight(w)
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return torch.mm(x, w.t())


def kernel_saved_threads() -> int | None:
    """Inside `kernel_threads_only`: the torch thread count it replaced (None outside)."""
    return _local.__dict__.get("saved_threads")


class _torch_threads:
    """Set torch's intra-op thread count for a block (None: leave it)."""

    def __init__(self, n: int | None):
        self.n = n

    def __enter__(self):
        self.saved = torch.get_num_threads()
        if self.n is not None and self.n != self.saved:
            torch.set_num_threads(self.n)
        return self.saved

    def __exit__(self, *exc):
        if torch.get_num_threads() != self.saved:
            torch.set_num_threads(self.saved)


class kernel_threads_only:
    """For a forward with quantized weights: torch runs on one thread while the kernels'
    own pool does the parallel work. Two pools on the same cores fight: an OpenMP worker
    that spins after torch's last op holds the core a kernel helper needs, and decode at
    batch 1 ran 1.5x slower. `active=False` leaves torch alone."""

    def __init__(self, active: bool):
        self.active = active and os.environ.get("EDGEPAGED_QUANT_TORCH_THREADS", "1") == "1"

    def __enter__(self):
        if self.active:
            self._t = _torch_threads(1)
            _local.saved_threads = self._t.__enter__()

    def __exit__(self, *exc):
        if self.active:
            _local.saved_threads = None
            self._t.__exit__(*exc)


_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_REORDER = _ONEDNN and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class QuantEmbedding:
    """Token embedding table kept as GGUF blocks; rows are decoded on lookup."""

    def __init__(self, weight: QuantWeight):
        self.weight = weight

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), self.weight.cols)
        quant_gather_rows(self.weight.data, self.weight.kind, ids.numpy(), out.numpy())
        return out


# ---------------------------------------------------------------- loading

def wants_quantized(files, device, dtype, quantized: bool | None) -> bool:
    """Resolve ModelRunner's `quantized` option: None = whenever it applies."""
    reasons = []
    if files.reader is None:
        reasons.append("the model is not a GGUF file")
    if torch.device(device).type != "cpu":
        reasons.append("the device is not the CPU")
    if dtype != torch.float32:
        reasons.append("the dtype is not float32")
    if not kernels_available():
        reasons.append("the Rust extension has no quantized kernels (rebuild: ./run.sh setup)")
    if not reasons and not any(int(t.tensor_type) in FORMATS for t in files.reader.tensors):
        reasons.append("the file has no tensor in Q4_0/Q4_1/Q8_0/Q4_K/Q6_K")
    if quantized and reasons:
        raise ValueError("quantized=True but " + "; ".join(reasons))
    return bool(quantized or (quantized is None and not reasons))


def quant_weights(files, progress=None) -> Iterator[tuple[str, object]]:
    """GGUF tensors under Hugging Face names: `QuantWeight` for 2-D weights in a kernel
    format (read from the file, Q/K rows un-permuted), fp32 tensors for the rest."""
    from gguf.quants import dequantize

    from .loader import _GGUF_NAMES, _to_torch, unpermute_rope
    reader, cfg = files.reader, files.config
    total = len(reader.tensors)
    for i, t in enumerate(reader.tensors, 1):
        parts = t.name.split(".")
        if parts[0] == "rope_freqs":
            name, base = "rope_freqs", "rope_freqs"
        elif parts[0] == "blk":
            base = parts[2]
            name = f"model.layers.{parts[1]}.{_GGUF_NAMES[base]}.{parts[3]}"
        else:
            base = parts[0]
            name = f"{_GGUF_NAMES[base]}.{parts[1]}"
        qtype = int(t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        rope_heads = (cfg.num_heads if base == "attn_q" else cfg.num_kv_heads) if (
            cfg.arch == "llama" and base in ("attn_q", "attn_k")) else None
        if parts[-1] == "weight" and can_keep(qtype, shape):
            # read the bytes into our own memory rather than through the reader's memmap,
            # whose touched pages would count as resident until the reader is gone
            data = np.fromfile(files.path, np.uint8, int(t.n_bytes), offset=int(t.data_offset))
            data = data.reshape(shape[0], -1)
            if rope_heads:
                data = np.ascontiguousarray(unpermute_rope(data, rope_heads))
            yield name, QuantWeight(qtype, data, *shape)
        else:
            w = dequantize(t.data, t.tensor_type)
            if rope_heads:
                w = unpermute_rope(w, rope_heads)
            yield name, _to_torch(w).float()
        if progress:
            progress(i, total)


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def _linear(parts: list, bias: torch.Tensor | None, old: Linear) -> nn.Module:
    """QuantLinear when every part stayed quantized, else a dense (packed) Linear."""
    if all(isinstance(p, QuantWeight) for p in parts):
        return QuantLinear(parts, bias)
    dense = torch.cat([p.dequantize() if isinstance(p, QuantWeight) else p for p in parts])
    if tuple(dense.shape) != (old.weight.shape if old.weight is not None else ()):
        raise ValueError(f"weight of shape {tuple(dense.shape)} where {tuple(old.weight.shape)} was expected")
    old.weight = dense
    if bias is not None:
        old.bias = bias
    return old


def load_quantized(model, weights) -> None:
    """`LlamaForCausalLM.load_weights` for a stream with `QuantWeight`s in it: builds
    QuantLinear / QuantEmbedding modules in place of the dense ones."""
    cfg = model.cfg
    got: dict[str, object] = {}
    for name, w in weights:
        if name == "rope_freqs":
            model.rotary.build(freq_factors=w, device=model.rotary.cos.device, dtype=model.rotary.cos.dtype)
        elif not name.endswith("rotary_emb.inv_freq"):
            got[name] = w

    def take(name):
        if name not in got:
            raise ValueError(f"checkpoint lacks {name}")
        return got.pop(name)

    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for parent in (layer.self_attn, layer.mlp):
            kind = "self_attn" if parent is layer.self_attn else "mlp"
            for fused, names in _FUSED.items():
                old = getattr(parent, fused, None)
                if old is None:
                    continue
                parts = [take(f"{p}{kind}.{n}.weight") for n in names]
                biases = [got.pop(f"{p}{kind}.{n}.bias", None) for n in names]
                bias = None
                if old.bias is not None:
                    if any(b is None for b in biases):
                        raise ValueError(f"checkpoint lacks a bias of layer {i} {fused}")
                    bias = torch.cat(biases).float()
                setattr(parent, fused, _linear(parts, bias, old))
        layer.input_layernorm.weight.copy_(take(f"{p}input_layernorm.weight"))
        layer.post_attention_layernorm.weight.copy_(take(f"{p}post_attention_layernorm.weight"))
    model.norm.weight.copy_(take("model.norm.weight"))
    embed = take("model.embed_tokens.weight")
    head = got.pop("lm_head.weight", None)
    if cfg.tie_word_embeddings or head is None:
        head = embed
    if isinstance(embed, QuantWeight):
        model.embed_tokens = QuantEmbedding(embed)
    else:
        model.embed_tokens = embed.to(model.norm.weight.dtype)
    model.lm_head = _linear([head], None, model.lm_head)
    if got:
        raise ValueError(f"unexpected tensors in the checkpoint: {sorted(got)[:5]}")
    if os.environ.get("EDGEPAGED_QUANT_INTERLEAVE", "1") != "0":
        interleave_weights(model)


def interleave_weights(model) -> int:
    """Interleave every Q4_0/Q4_1/Q8_0 weight of the model's quantized modules in place
    (a tied embedding and LM head share theirs); the number interleaved."""
    done: dict[int, QuantWeight] = {}   # id of a weight's original array -> the weight that interleaved it
    n = 0
    for m in [model.embed_tokens, *model.modules()]:
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            for s in (m.segments if isinstance(m, QuantLinear) else [m.weight]):
                if s.x8:
                    continue
                first = done.get(id(s.data))
                if first is not None:        # another weight over the same array: share its result
                    s.data, s.x8 = first.data, first.x8
                    continue
                key = id(s.data)
                if s.interleave():
                    done[key] = s
                    n += 1
    return n


def weight_bytes(model) -> dict[str, int]:
    """Bytes of the model's weights: GGUF blocks kept quantized, and dense tensors (fp32
    linears, packed or not, norms, a dense embedding table; rotary tables excluded)."""
    seen, q, dense = set(), 0, 0
    for m in [model.embed_tokens, *model.modules()]:
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            for s in (m.segments if isinstance(m, QuantLinear) else [m.weight]):
                if id(s.data) not in seen:
                    seen.add(id(s.data))
                    q += s.nbytes
            tensors = [getattr(m, "bias", None)]
        elif isinstance(m, Linear):
            tensors = [m.weight, m.packed, m.bias]
        elif isinstance(m, torch.Tensor):
            tensors = [m]
        else:
            tensors = [getattr(m, "weight", None)] if type(m).__name__ == "RMSNorm" else []
        dense += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return {"quantized": q, "dense": dense}
