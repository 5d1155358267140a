"""The residual add and the RMSNorm after it, in one kernel (the GPU's decoder layers).

    add_rms_norm(h, x, weight, eps) -> normed      # h += x in place; normed = rms_norm(h) * weight

One program a row: the row of h and of x read once, their sum written back to h and
normalised (sums in fp32, one rounding to the tensors' dtype, as `F.rms_norm` rounds) into a
new tensor. Two launches and three passes over the row (add, then the norm's read and write)
become one launch and one pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(h_ptr, x_ptr, w_ptr, out_ptr, n, s_h, s_x, s_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    h = tl.load(h_ptr + row * s_h + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
    h = (h + x).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + row * s_h + cols, h, mask=mask)
    hf = h.to(tl.float32)
    rms = tl.rsqrt(tl.sum(hf * hf, axis=0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_o + cols, (hf * rms * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """h [T, n] += x [T, n] (in place, in h's dtype); returns rms_norm(h) * weight [T, n]."""
    assert h.shape == x.shape and h.dim() == 2 and h.stride(1) == x.stride(1) == 1, (h.shape, x.shape)
    t, n = h.shape
    out = torch.empty_like(h)
    if t:
        _add_rms_norm_kernel[(t,)](h, x, weight, out, n, h.stride(0), x.stride(0), out.stride(0), eps,
                                   BLOCK=triton.next_power_of_2(n))
    return out
