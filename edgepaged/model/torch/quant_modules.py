"""The modules a model with quantized weights is built from.

- `QuantLinear`: y = x W^T (+ b) with W as one or more row segments of GGUF blocks (a fused
  QKV or gate/up may mix formats, as Q4_K_M files do). Below `dense_min_tokens` token rows
  it runs the kernels' product (blocks decoded in registers, read once per call); from
  there on (long prefills) a segment on the exact kernels decodes row tiles into a reusable
  fp32 scratch of at most `SCRATCH_BYTES` and runs oneDNN's GEMM on them, while a segment
  repacked for the integer kernels keeps them (they beat any decode + GEMM).
- `QuantEmbedding`: rows of the token table decoded on lookup.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..._native import quant as kernels
from ..quant.formats import FORMATS, QuantWeight, kernel_layouts, lay_out, merge_segments
from .quant_threads import gemm, scratch

SCRATCH_BYTES = 16 << 20


def _f32_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    x = x.reshape(-1, k)
    if x.dtype != torch.float32:
        x = x.float()
    return x.contiguous()


class SegmentedLinear(nn.Module):
    """A linear whose weight is row segments stacked along the output, each with `rows`,
    `cols`, `qtype` and `nbytes` (the CPU's and the GPU's quantized linears)."""
    where = ""

    def __init__(self, segments: list):
        super().__init__()
        if not segments or len({s.cols for s in segments}) != 1:
            raise ValueError(f"{type(self).__name__} needs segments with one input width")
        self.segments = segments
        self.offsets = np.cumsum([0] + [s.rows for s in segments]).tolist()
        self.in_features, self.out_features = segments[0].cols, self.offsets[-1]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def extra_repr(self) -> str:
        fmts = "+".join(f"{FORMATS[s.qtype]}[{s.rows}]" for s in self.segments)
        return f"in_features={self.in_features}, out_features={self.out_features}, {fmts}{self.where}"


class QuantLinear(SegmentedLinear):
    """y = x W^T + b, W kept as GGUF blocks (row segments stacked along the output)."""

    def __init__(self, segments: list[QuantWeight], bias: torch.Tensor | None = None, dense_min_tokens: int = 768):
        if not segments:
            raise ValueError("QuantLinear needs segments with one input width")
        super().__init__(merge_segments(segments))
        self.bias = bias
        self.dense_min_tokens = dense_min_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous():
            lead = x.shape[:-1]
            return self.forward(_f32_rows(x, self.in_features)).view(*lead, self.out_features)
        t = x.shape[0]
        # long prefills: exact segments decode to fp32 + GEMM; repacked ones stay on the
        # integer kernels, faster than any decode + GEMM (and so do interleaved ones)
        dense = [t >= self.dense_min_tokens and s.layout not in kernel_layouts() for s in self.segments]
        if dense == [True]:
            out = self._dense(x, self.segments[0])
        else:
            out = torch.empty(t, self.out_features)
            if t:
                xn, on = x.numpy(), out.numpy()
                for s, a, d in zip(self.segments, self.offsets, dense):
                    if d:
                        out[:, a: a + s.rows] = self._dense(x, s)
                    else:
                        kernels.matmul(s.data, s.kind, xn, on, col=a, rows=s.rows)
        if self.bias is not None:
            out += self.bias
        return out

    def _dense(self, x: torch.Tensor, s: QuantWeight) -> torch.Tensor:
        """x s^T: row tiles of `s` decoded into the scratch and multiplied with oneDNN."""
        k = self.in_features
        tile_rows = max(1, SCRATCH_BYTES // 4 // k)
        out = None
        for r0 in range(0, s.rows, tile_rows):
            n = min(tile_rows, s.rows - r0)
            w = scratch(n * k).view(n, k)
            s.dequantize_into(w.numpy(), r0)
            y = gemm(x, w)
            if n == s.rows:
                return y
            if out is None:
                out = torch.empty(x.shape[0], s.rows)
            out[:, r0: r0 + n] = y
        return out


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
        kernels.gather_rows(self.weight.data, self.weight.kind, ids.numpy(), out.numpy())
        return out


def quant_weights_of(m) -> list[QuantWeight]:
    if isinstance(m, QuantLinear):
        return m.segments
    if isinstance(m, QuantEmbedding):
        return [m.weight]
    return []


def lay_out_weights(modules, math: str) -> int:
    """The layout every quantized weight of these modules takes for the kernels of `math`:
    "int8", repacked for the integer kernels (every block format; F16/BF16 stay in rows);
    "exact", Q4_0/Q4_1/Q8_0 interleaved, the rest in GGUF's rows. A tied embedding and LM
    head share theirs. Returns how many weights changed."""
    return lay_out([s for m in modules for s in quant_weights_of(m)], math)


def weight_bytes(model) -> dict[str, int]:
    """Bytes of the model's weights: GGUF blocks kept quantized, and dense tensors (fp32
    linears, packed or not, norms, a dense embedding table; rotary tables excluded)."""
    from .gpu_quant import TritonQuantEmbedding, TritonQuantLinear
    from .layers import Linear, RMSNorm
    seen, q, dense = set(), 0, 0
    for m in [model.embed_tokens, *model.modules()]:
        tensors = []
        if isinstance(m, (TritonQuantLinear, TritonQuantEmbedding)):
            segs = m.segments if isinstance(m, TritonQuantLinear) else [m.seg]
            for s in segs:
                if id(s) not in seen:
                    seen.add(id(s))
                    q += s.nbytes
            tensors = [getattr(m, "bias", None)]
        elif isinstance(m, (QuantLinear, QuantEmbedding)):
            for s in quant_weights_of(m):
                if id(s.data) not in seen:
                    seen.add(id(s.data))
                    q += s.nbytes
            tensors = [getattr(m, "bias", None)]
        elif isinstance(m, Linear):
            tensors = [m.weight, m.packed, m.bias]
        elif isinstance(m, torch.Tensor):
            tensors = [m]
        elif isinstance(m, RMSNorm):
            tensors = [m.weight]
        for t in tensors:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                dense += t.numel() * t.element_size()
    return {"quantized": q, "dense": dense}
