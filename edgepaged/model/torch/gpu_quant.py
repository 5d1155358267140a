"""A GGUF model's weights kept quantized on the GPU (Triton: `edgepaged.kernels.quant`).

- `TritonQuantLinear`: y = x W^T (+ b) with W as row segments, each packed once at load
  (`kernels.quant.pack`: the blocks' fields split into arrays, 1.00-1.03 times the file's
  bytes) and multiplied from its codes (`qmatmul`); a segment in a format the kernel does not
  read (Q4_1, Q5_0, Q5_1, F16, BF16) is decoded once into the model's dtype and multiplied by
  torch.
- `TritonQuantEmbedding`: rows of the token table decoded on lookup (`qgather`).

The placement (`llama._TorchSink`) builds these instead of the CPU's `QuantLinear` /
`QuantEmbedding` when the runner's quantized kernels are "triton" (a CUDA device; on a CPU,
Triton's interpreter, for the tests).
"""
from __future__ import annotations

import torch

from ..quant.formats import QuantWeight
from .quant_modules import SegmentedLinear


def _kernels():
    from ...kernels import quant
    return quant


class _Segment:
    """One row segment: packed for the kernel, or decoded (a format it does not read)."""

    def __init__(self, w: QuantWeight, device, dtype):
        kq = _kernels()
        if w.layout != "rows":
            raise ValueError(f"a {w.layout} weight: the GPU kernels read GGUF's own row layout")
        self.rows, self.cols, self.qtype = w.rows, w.cols, w.qtype
        if w.qtype in kq.KEPT:
            self.packed, self.dense = kq.pack(w.qtype, w.data, w.rows, w.cols, device=device), None
        else:
            self.packed, self.dense = None, torch.from_numpy(w.dequantize()).to(device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes if self.packed is not None else self.dense.numel() * self.dense.element_size()


class TritonQuantLinear(SegmentedLinear):
    """y = x W^T + b, W kept as GGUF blocks on the device (row segments along the output)."""
    where = " (triton)"

    def __init__(self, segments: list[QuantWeight | _Segment], bias: torch.Tensor | None, device, dtype):
        """`segments`: GGUF weights, or segments packed already (a tied LM head shares the
        embedding table's)."""
        super().__init__([s if isinstance(s, _Segment) else _Segment(s, device, dtype) for s in segments])
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        x = x.contiguous()
        kq = _kernels()
        out = torch.empty(x.shape[0], self.out_features, dtype=self.dtype, device=x.device)
        for s, a in zip(self.segments, self.offsets):
            part = out[:, a: a + s.rows]
            if s.packed is not None:
                kq.qmatmul(x, s.packed, out=part)
            else:
                torch.matmul(x, s.dense.t(), out=part) if len(self.segments) == 1 else part.copy_(x @ s.dense.t())
        if self.bias is not None:
            out += self.bias
        return out.view(*lead, self.out_features)


class TritonQuantEmbedding:
    """The token table kept as GGUF blocks on the device; rows decoded on lookup."""

    def __init__(self, weight: QuantWeight, device, dtype):
        self.seg = _Segment(weight, device, dtype)     # (a tied LM head multiplies by it too)
        self.dtype = dtype

    @property
    def nbytes(self) -> int:
        return self.seg.nbytes

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.seg.packed is None:
            return self.seg.dense[ids.reshape(-1)]
        return _kernels().qgather(ids, self.seg.packed, self.dtype)
