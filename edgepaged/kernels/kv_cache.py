"""Scatter this step's new K/V rows into the paged cache through the slot mapping."""
import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, num_kv_heads,
    s_kt, s_kh, s_vt, s_vh, s_kcb, s_kct, s_kch, s_vcb, s_vct, s_vch,
    BS: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr,
):
    # One program per token: all its KV heads at once.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk, off = slot // BS, slot % BS
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D)[None, :]
    mask = (h < num_kv_heads) & (slot >= 0)  # slot -1: padding, skip
    k = tl.load(k_ptr + t * s_kt + h * s_kh + d, mask=mask)
    v = tl.load(v_ptr + t * s_vt + h * s_vh + d, mask=mask)
    tl.store(kc_ptr + blk * s_kcb + off * s_kct + h * s_kch + d, k, mask=mask)
    tl.store(vc_ptr + blk * s_vcb + off * s_vct + h * s_vch + d, v, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, Hkv, D] into k_cache/v_cache [num_blocks, block_size, Hkv, D] in place.

    slot_mapping [T] (int64) holds block_id * block_size + offset per token; -1 skips the token.
    key/value may be strided views (e.g. slices of a fused QKV projection); the last dim must be
    contiguous. Values are cast to the cache's dtype.
    """
    T, Hkv, D = key.shape
    assert value.shape == key.shape and k_cache.shape == v_cache.shape and k_cache.shape[2:] == (Hkv, D)
    assert slot_mapping.shape == (T,) and D & (D - 1) == 0, "head_dim must be a power of two"
    assert key.stride(2) == value.stride(2) == k_cache.stride(3) == v_cache.stride(3) == 1
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        key, value, k_cache, v_cache, slot_mapping, Hkv,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        BS=k_cache.shape[1], H_PAD=triton.next_power_of_2(Hkv), D=D,
    )
