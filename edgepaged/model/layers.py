"""Building blocks: Linear (pre-packed for oneDNN on CPU), RMSNorm, rotary embedding."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


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
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        return F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype) * self.weight


def longrope_attention_factor(scaling: dict) -> float:
    """LongRoPE's scale of cos and sin: sqrt(1 + ln(s) / ln(original context)), s the context
    extension, unless the checkpoint states it."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    orig = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or (scaling.get("max_position_embeddings") or orig) / orig
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None,
                  freq_factors: torch.Tensor | None = None, max_positions: int | None = None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type")
    if kind == "longrope":
        # the long factors when the context reaches past the original one (llama.cpp's rule:
        # by the context the model serves, so a sequence keeps one table all along)
        long = max_positions is not None and max_positions > scaling["original_max_position_embeddings"]
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        if ext.numel() != inv.numel():
            raise ValueError(f"longrope: {ext.numel()} factors for {inv.numel()} rotary frequencies")
        inv = inv / ext
    elif kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":  # as in transformers' _compute_llama3_parameters
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(is_mid, mid, scaled)
    elif kind is not None:
        raise ValueError(f"unsupported rope scaling {kind!r}")
    if freq_factors is not None:  # llama.cpp's rope_freqs tensor
        inv = inv / freq_factors.float().cpu()
    return inv


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
        inv = rope_inv_freq(self.head_dim, self.theta, self.scaling, self.freq_factors, self.max_positions)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv)
        cos, sin = freqs.cos(), freqs.sin()
        if (self.scaling or {}).get("rope_type") == "longrope":
            m = longrope_attention_factor(self.scaling)
            cos, sin = cos * m, sin * m
        self.cos = torch.cat([cos, cos], -1).to(device=device, dtype=dtype)
        self.sin = torch.cat([-sin, sin], -1).to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for the batch, shaped [T, 1, D] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)
