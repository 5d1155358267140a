"""Rotary tables in numpy: the one place their frequencies are computed (the torch modules
take their tables from here, so both forward paths rotate with the same bits)."""
from __future__ import annotations

import math

import numpy as np


def longrope_attention_factor(scaling: dict) -> float:
    """LongRoPE's scale of cos and sin: sqrt(1 + ln(s) / ln(original context)), s the context
    extension, unless the checkpoint states it."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    orig = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or (scaling.get("max_position_embeddings") or orig) / orig
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None, freq_factors=None,
                  max_positions: int | None = None) -> np.ndarray:
    """float32 [head_dim / 2]: the rotary frequencies, scaled as the checkpoint says."""
    exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / np.power(np.float32(theta), exps, dtype=np.float32)).astype(np.float32)
    kind = (scaling or {}).get("rope_type")
    if kind == "longrope":
        # the long factors when the context reaches past the original one (llama.cpp's rule:
        # by the context the model serves, so a sequence keeps one table all along)
        long = max_positions is not None and max_positions > scaling["original_max_position_embeddings"]
        ext = np.asarray(scaling["long_factor" if long else "short_factor"], dtype=np.float32)
        if ext.size != inv.size:
            raise ValueError(f"longrope: {ext.size} factors for {inv.size} rotary frequencies")
        inv = inv / ext
    elif kind == "linear":
        inv = inv / np.float32(scaling["factor"])
    elif kind == "llama3":  # as in transformers' _compute_llama3_parameters
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > old / lo, inv / np.float32(factor), inv)
        smooth = (np.float32(old) / wavelen - np.float32(lo)) / np.float32(hi - lo)
        mid = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = np.where(is_mid, mid, scaled)
    elif kind is not None:
        raise ValueError(f"unsupported rope scaling {kind!r}")
    if freq_factors is not None:  # llama.cpp's rope_freqs tensor
        inv = inv / np.asarray(freq_factors, dtype=np.float32).reshape(-1)
    return np.ascontiguousarray(inv, dtype=np.float32)


def rotary_tables(head_dim: int, max_positions: int, theta: float, scaling: dict | None = None,
                  freq_factors=None) -> tuple[np.ndarray, np.ndarray]:
    """Half-split rotary tables float32 [max_positions, head_dim]: cat(cos, cos) and
    cat(-sin, sin), so x_rot = x * cos + roll(x, D/2) * sin."""
    inv = rope_inv_freq(head_dim, theta, scaling, freq_factors, max_positions)
    freqs = np.outer(np.arange(max_positions, dtype=np.float32), inv).astype(np.float32)
    cos, sin = np.cos(freqs), np.sin(freqs)
    if (scaling or {}).get("rope_type") == "longrope":
        m = np.float32(longrope_attention_factor(scaling))
        cos, sin = cos * m, sin * m
    return (np.ascontiguousarray(np.concatenate([cos, cos], -1), dtype=np.float32),
            np.ascontiguousarray(np.concatenate([-sin, sin], -1), dtype=np.float32))


def mrope_tables(cos, sin, positions, rows, hw, sections):
    """M-RoPE (Qwen2-VL, Qwen2.5-VL): per-row rotary tables [T, D] for a batch (numpy arrays
    or torch tensors alike): row i rotates by `positions[i]` (its t), except image rows
    `rows`, whose rotary pairs in the second and third of `sections` (counts of the D / 2
    pairs: t, h, w, in that order) turn by their h and w (`hw` [k, 2]). Positions then index
    these tables by row (0 .. T - 1)."""
    c, s = cos[positions], sin[positions]
    half = cos.shape[-1] // 2
    t, h, w = (int(x) for x in sections[:3])
    for axis, lo, hi in ((0, t, t + h), (1, t + h, t + h + w)):
        at = hw[:, axis]
        for off in (0, half):
            c[rows, off + lo:off + hi] = cos[at, off + lo:off + hi]
            s[rows, off + lo:off + hi] = sin[at, off + lo:off + hi]
    return c, s
