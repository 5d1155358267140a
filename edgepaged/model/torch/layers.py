"""Building blocks: Linear (pre-packed for oneDNN on CPU), RMSNorm, rotary embedding."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..rope import longrope_attention_factor, rope_inv_freq, rotary_tables  # noqa: F401 (re-exported)


def _can_prepack(w: torch.Tensor) -> bool:
    return (w.device.type == "cpu" and w.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class Linear(nn.Module):
    """y = x W^T + b with W [out, in]. On CPU fp32 the weight is re-laid out once for oneDNN,
    which runs the small-batch GEMMs of decode faster than the default sgemm."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.packed = None

    def pack(self, keep_weight: bool = False):
        if _can_prepack(self.weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight)
            if not keep_weight:
                self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = torch.ones(size, device=device, dtype=dtype)
        self.eps, self.shape = eps, (size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused kernel in every dtype: in bf16/f16 it sums and scales in fp32 and rounds
        # once (closer to fp32 than rounding before the weight, as transformers does: max
        # error 0.016 against 0.022 on a 2048-wide bf16 row), and on a GPU, where a decode
        # step waits on Python launching kernels, it is 1 launch where that was 4
        return F.rms_norm(x, self.shape, self.weight, self.eps)


class Rotary(nn.Module):
    """Half-split rotary embedding from a precomputed table indexed by position.

    Tables hold cat(cos, cos) and cat(-sin, sin), so x_rot = x*cos + roll(x, D/2)*sin."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling=None, device=None, dtype=None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.freq_factors = None
        self.build(device=device, dtype=dtype)

    def build(self, max_positions=None, freq_factors=None, device=None, dtype=None):
        if max_positions is not None:
            self.max_positions = max_positions
        if freq_factors is not None:
            self.freq_factors = freq_factors
        factors = self.freq_factors
        if isinstance(factors, torch.Tensor):
            factors = factors.float().cpu().numpy()
        cos, sin = rotary_tables(self.head_dim, self.max_positions, self.theta, self.scaling, factors)
        self.cos = torch.from_numpy(cos).to(device=device, dtype=dtype)
        self.sin = torch.from_numpy(sin).to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for the batch, shaped [T, 1, D] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)
