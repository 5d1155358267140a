"""Rotary embedding and the KV-cache write in one kernel (the GPU's attention step).

    q = rope_write_kv(qkv, cos, sin, slot_mapping, k_cache, v_cache, num_heads, num_kv_heads)

`qkv` [T, (H + 2 Hkv) * D] (a fused QKV projection's output, rows may be strided); `cos`/`sin`
[T, D] rows of the half-split tables (`Rotary`: cat(cos, cos) and cat(-sin, sin), so
x_rot = x * cos + roll(x, D/2) * sin). Returns the rotated queries [T, H, D]; the rotated keys
and the values go to their slots in the caches [num_blocks, block_size, Hkv, D] (slot -1: not
written). One program a token: its heads read once, where the unfused step read and wrote
them three times (rotate q and k, then the cache write).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, H, HKV,
                          s_t, s_cos, s_sin, s_qt, s_qh, s_kcb, s_kct, s_kch, s_vcb, s_vct, s_vch,
                          D: tl.constexpr, H_PAD: tl.constexpr, HKV_PAD: tl.constexpr, BS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)[None, :]
    rolled = (d + D // 2) % D
    c = tl.load(cos_ptr + t * s_cos + d).to(tl.float32)
    s = tl.load(sin_ptr + t * s_sin + d).to(tl.float32)
    row = qkv_ptr + t * s_t
    h = tl.arange(0, H_PAD)[:, None]
    hm = h < H
    q = tl.load(row + h * D + d, mask=hm, other=0.0).to(tl.float32)
    qr = tl.load(row + h * D + rolled, mask=hm, other=0.0).to(tl.float32)
    tl.store(q_ptr + t * s_qt + h * s_qh + d, (q * c + qr * s).to(q_ptr.dtype.element_ty), mask=hm)
    slot = tl.load(slot_ptr + t)
    blk, off = slot // BS, slot % BS
    g = tl.arange(0, HKV_PAD)[:, None]
    gm = (g < HKV) & (slot >= 0)
    k = tl.load(row + (H + g) * D + d, mask=gm, other=0.0).to(tl.float32)
    kr = tl.load(row + (H + g) * D + rolled, mask=gm, other=0.0).to(tl.float32)
    v = tl.load(row + (H + HKV + g) * D + d, mask=gm, other=0.0)
    tl.store(kc_ptr + blk * s_kcb + off * s_kct + g * s_kch + d, (k * c + kr * s).to(kc_ptr.dtype.element_ty),
             mask=gm)
    tl.store(vc_ptr + blk * s_vcb + off * s_vct + g * s_vch + d, v.to(vc_ptr.dtype.element_ty), mask=gm)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * d and qkv.stride(1) == 1, qkv.shape
    assert cos.shape == sin.shape == (t, d) and cos.stride(1) == sin.stride(1) == 1, cos.shape
    assert k_cache.stride(3) == v_cache.stride(3) == 1 and d & (d - 1) == 0, "head_dim a power of two"
    q = torch.empty(t, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    if t:
        _rope_write_kv_kernel[(t,)](
            qkv, cos, sin, slot_mapping, q, k_cache, v_cache, num_heads, num_kv_heads,
            qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
            *k_cache.stride()[:3], *v_cache.stride()[:3],
            D=d, H_PAD=triton.next_power_of_2(num_heads), HKV_PAD=triton.next_power_of_2(num_kv_heads),
            BS=k_cache.shape[1])
    return q
