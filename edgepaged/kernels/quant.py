"""GGUF weights kept quantized on the GPU: products straight from the blocks' codes.

    w = pack(qtype, blocks, rows, cols)        # once, at load: GGUF bytes -> device arrays
    y = qmatmul(x, w)                          # x [M, cols] -> y [M, rows] (x's dtype, fp32 sums)
    e = qgather(ids, w, torch.bfloat16)        # rows of w, decoded (a quantized embedding table)

`pack` splits a weight's GGUF blocks into arrays of one field each (struct of arrays: the
codes, the scales, the mins, the high bits), keeping every bit as GGUF stores it (the 6-bit
scales of Q4_K/Q5_K unpacked to a byte each): 1.00-1.03 times the file's bytes. One kernel
reads them for every format: each program computes a [BLOCK_M, BLOCK_N] tile of the output,
walking K a group of 32 values at a time, UNROLL groups a loop trip (each format's codes, scale
and min for that group decoded in registers to the activations' dtype); with BLOCK_M >= 16 the group's product is a
tensor-core `tl.dot` (prefill, large batches), with BLOCK_M == 1 a multiply-and-sum per row
(one decode row: the step memory-bound).

The formats, as ggml lays them out (`gguf.quants` is the reference the tests hold them to):
- Q8_0: blocks of 32: d (f16), 32 int8 codes; w = d * q.
- Q4_0: blocks of 32: d (f16), 16 bytes; values 0-15 the low nibbles, 16-31 the high; w = d * (q - 8).
- Q4_K: super-blocks of 256 in 8 groups of 32: d, dmin (f16), 12 bytes of 6-bit scales and mins,
  128 bytes of nibbles (chunk c of 64 values: bytes 32c..32c+31, group 2c the low nibbles, 2c+1
  the high); w = d * sc[g] * q - dmin * m[g].
- Q5_K: Q4_K plus 32 bytes of high bits (value l of group g: bit g of byte l); q has 5 bits.
- Q6_K: super-blocks of 256: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one
  per 16 values), d; group g = (half n, quarter j): value l's low nibble is byte 64n + l + 32(j%2)
  (shift 4(j//2)), its high bits byte 32n + l (shift 2j), its scale 8n + 2j + l//16; w = d * sc * (q - 32).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

Q4_0, Q8_0, Q4_K, Q5_K, Q6_K = 2, 8, 12, 13, 14
KEPT = (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K)      # the formats the kernel reads; others are widened at load
_BLOCK = {Q4_0: (32, 18), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}


@dataclass
class Packed:
    """One weight [rows, cols] as device arrays of one field each (`pack`)."""
    qtype: int
    rows: int
    cols: int
    codes: torch.Tensor            # uint8 (int8 for Q8_0) [rows, bytes of codes per row]
    scales: torch.Tensor           # f16 [rows, blocks] (Q4_0, Q8_0, Q6_K: d; Q4_K/Q5_K: d)
    mins: torch.Tensor | None      # f16 [rows, super-blocks]: Q4_K/Q5_K's dmin
    sub: torch.Tensor | None       # uint8 [rows, groups] (Q4_K/Q5_K: 6-bit scales; Q6_K: int8 per 16)
    sub_mins: torch.Tensor | None  # uint8 [rows, groups]: Q4_K/Q5_K's 6-bit mins
    high: torch.Tensor | None      # uint8 [rows, ...]: Q5_K's and Q6_K's high bits

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (self.codes, self.scales, self.mins, self.sub, self.sub_mins, self.high) if t is not None)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit scales and mins [..., 12] -> ([..., 8], [..., 8])."""
    s = s.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def pack(qtype: int, blocks: np.ndarray, rows: int, cols: int, device=None) -> Packed:
    """GGUF blocks (uint8 [rows, row bytes], GGUF's own row layout) -> a `Packed` on `device`."""
    if qtype not in KEPT:
        raise ValueError(f"GGML type {qtype}: not one the GPU kernel reads (one of {KEPT})")
    bw, bb = _BLOCK[qtype]
    if cols % bw or blocks.shape != (rows, cols // bw * bb):
        raise ValueError(f"type {qtype} weight [{rows}, {cols}]: bad block bytes {blocks.shape}")
    b = np.ascontiguousarray(blocks, np.uint8).reshape(rows, cols // bw, bb)

    def dev(a, dtype=None):
        t = torch.from_numpy(np.ascontiguousarray(a))
        return (t.view(dtype) if dtype is not None else t).to(device)

    def f16(a):
        return dev(a.reshape(rows, -1).copy(), torch.float16) if a.dtype == np.uint8 else dev(a)

    mins = sub = sub_mins = high = None
    if qtype in (Q8_0, Q4_0):
        scales = f16(b[..., 0:2])
        codes = dev(b[..., 2:].reshape(rows, -1))
        if qtype == Q8_0:
            codes = codes.view(torch.int8)
    elif qtype in (Q4_K, Q5_K):
        scales, mins = f16(b[..., 0:2]), f16(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        sub, sub_mins = dev(sc.reshape(rows, -1)), dev(mn.reshape(rows, -1))
        if qtype == Q4_K:
            codes = dev(b[..., 16:144].reshape(rows, -1))
        else:
            high = dev(b[..., 16:48].reshape(rows, -1))
            codes = dev(b[..., 48:176].reshape(rows, -1))
    else:   # Q6_K: ql 128, qh 64, scales 16 (int8), d
        codes = dev(b[..., 0:128].reshape(rows, -1))
        high = dev(b[..., 128:192].reshape(rows, -1))
        sub = dev(b[..., 192:208].reshape(rows, -1))
        scales = f16(b[..., 208:210])
    return Packed(qtype, rows, cols, codes, scales, mins, sub, sub_mins, high)


@triton.jit
def _group(codes_ptr, scales_ptr, mins_ptr, sub_ptr, sub_mins_ptr, high_ptr, n, nmask, g,
           s_codes, s_scales, s_mins, s_sub, s_high, QT: tl.constexpr):
    """The weights of group g (values 32g..32g+31) of rows n: float32 [BLOCK_N, 32]."""
    l = tl.arange(0, 32)[None, :]
    m2 = nmask[:, None]
    row = n[:, None].to(tl.int64)
    if QT == 8:      # Q8_0
        q = tl.load(codes_ptr + row * s_codes + g * 32 + l, mask=m2, other=0).to(tl.float32)
        d = tl.load(scales_ptr + row * s_scales + g, mask=m2, other=0).to(tl.float32)
        w = d * q
    elif QT == 2:    # Q4_0
        byte = tl.load(codes_ptr + row * s_codes + g * 16 + (l % 16), mask=m2, other=0)
        q = ((byte >> ((l // 16) * 4).to(tl.uint8)) & 15).to(tl.float32)
        d = tl.load(scales_ptr + row * s_scales + g, mask=m2, other=0).to(tl.float32)
        w = d * (q - 8.0)
    elif QT == 14:   # Q6_K
        sb = g // 8
        gi = g % 8
        half = gi // 4
        j = gi % 4
        lo = tl.load(codes_ptr + row * s_codes + sb * 128 + half * 64 + (j % 2) * 32 + l, mask=m2, other=0)
        hi = tl.load(high_ptr + row * s_high + sb * 64 + half * 32 + l, mask=m2, other=0)
        q = ((lo >> ((j // 2) * 4).to(tl.uint8)) & 15) | (((hi >> (2 * j).to(tl.uint8)) & 3) << 4)
        sc = tl.load(sub_ptr + row * s_sub + sb * 16 + half * 8 + 2 * j + l // 16, mask=m2, other=0)
        sc = sc.to(tl.int8, bitcast=True).to(tl.float32)
        d = tl.load(scales_ptr + row * s_scales + sb, mask=m2, other=0).to(tl.float32)
        w = d * sc * (q.to(tl.float32) - 32.0)
    else:            # Q4_K, Q5_K
        sb = g // 8
        gi = g % 8
        byte = tl.load(codes_ptr + row * s_codes + sb * 128 + (gi // 2) * 32 + l, mask=m2, other=0)
        q = (byte >> ((gi % 2) * 4).to(tl.uint8)) & 15
        if QT == 13:
            hb = tl.load(high_ptr + row * s_high + sb * 32 + l, mask=m2, other=0)
            q = q | (((hb >> gi.to(tl.uint8)) & 1) << 4)
        d = tl.load(scales_ptr + row * s_scales + sb, mask=m2, other=0).to(tl.float32)
        dmin = tl.load(mins_ptr + row * s_mins + sb, mask=m2, other=0).to(tl.float32)
        sc = tl.load(sub_ptr + row * s_sub + g, mask=m2, other=0).to(tl.float32)
        mn = tl.load(sub_mins_ptr + row * s_sub + g, mask=m2, other=0).to(tl.float32)
        w = d * sc * q.to(tl.float32) - dmin * mn
    return w


@triton.jit
def _qmatmul_kernel(x_ptr, out_ptr, codes_ptr, scales_ptr, mins_ptr, sub_ptr, sub_mins_ptr, high_ptr,
                    M, N, K, s_xm, s_om, s_codes, s_scales, s_mins, s_sub, s_high,
                    QT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = m < M
    k32 = tl.arange(0, 32)
    if BLOCK_M == 1:   # decode rows: multiply and sum, the weights read once per program
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for g0 in range(0, K // 32, UNROLL):       # UNROLL groups a trip: their loads in flight together
            for u in tl.static_range(UNROLL):
                g = g0 + u
                w = _group(codes_ptr, scales_ptr, mins_ptr, sub_ptr, sub_mins_ptr, high_ptr, n, nmask, g,
                           s_codes, s_scales, s_mins, s_sub, s_high, QT)
                x = tl.load(x_ptr + pid_m.to(tl.int64) * s_xm + g * 32 + k32).to(tl.float32)
                acc += tl.sum(w * x[None, :], axis=1)
        tl.store(out_ptr + pid_m.to(tl.int64) * s_om + n, acc.to(out_ptr.dtype.element_ty), mask=nmask)
    else:              # many rows: each group's product on the tensor cores
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        rows = m[:, None].to(tl.int64)
        for g0 in range(0, K // 32, UNROLL):
            for u in tl.static_range(UNROLL):
                g = g0 + u
                w = _group(codes_ptr, scales_ptr, mins_ptr, sub_ptr, sub_mins_ptr, high_ptr, n, nmask, g,
                           s_codes, s_scales, s_mins, s_sub, s_high, QT)
                x = tl.load(x_ptr + rows * s_xm + g * 32 + k32[None, :], mask=mmask[:, None], other=0.0)
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        tl.store(out_ptr + rows * s_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])


def _stride(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.stride(0)


def qmatmul(x: torch.Tensor, w: Packed, out: torch.Tensor | None = None, block_n: int | None = None,
            block_m: int | None = None, unroll: int | None = None) -> torch.Tensor:
    """x [M, cols] (f32, f16 or bf16; rows contiguous) @ w.T -> [M, rows] in x's dtype (sums in
    float32). One row (a decode step of one stream): the multiply-and-sum kernel, BLOCK_N
    outputs a program; more: tensor-core tiles of BLOCK_M rows (16 at least: the weights are
    read once for up to 16 rows)."""
    M, K = x.shape
    assert K == w.cols and x.stride(1) == 1, (x.shape, w.cols)
    if out is None:
        out = torch.empty((M, w.rows), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    if block_m is None:
        block_m = 1 if M == 1 else (16 if M <= 16 else 32 if M <= 32 else 64)
    if block_n is None:
        block_n = 32 if block_m == 1 else 64
    if unroll is None:      # one row: groups of 32 a loop trip, a K-quant's super-block where K allows
        # (the tiled path keeps 1: its shared memory grows with it, past a desktop card's 99 KB)
        unroll = next(u for u in (8, 4, 2, 1) if (K // 32) % u == 0) if block_m == 1 else 1
    grid = (triton.cdiv(w.rows, block_n), M if block_m == 1 else triton.cdiv(M, block_m))
    _qmatmul_kernel[grid](x, out, *_args(w), M, w.rows, K, x.stride(0), out.stride(0), *_strides(w),
                          QT=w.qtype, BLOCK_M=block_m, BLOCK_N=block_n, UNROLL=unroll)
    return out


@triton.jit
def _qgather_kernel(ids_ptr, out_ptr, codes_ptr, scales_ptr, mins_ptr, sub_ptr, sub_mins_ptr, high_ptr,
                    T, N, K, s_om, s_codes, s_scales, s_mins, s_sub, s_high,
                    QT: tl.constexpr, BLOCK_T: tl.constexpr):
    """Rows `ids` of the weight, decoded: out[t, :] = w[ids[t], :] (an embedding lookup)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    n = tl.load(ids_ptr + t, mask=tmask, other=0)
    k32 = tl.arange(0, 32)
    for g in range(0, K // 32):
        w = _group(codes_ptr, scales_ptr, mins_ptr, sub_ptr, sub_mins_ptr, high_ptr, n, tmask, g,
                   s_codes, s_scales, s_mins, s_sub, s_high, QT)
        tl.store(out_ptr + t[:, None].to(tl.int64) * s_om + g * 32 + k32[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=tmask[:, None])


def _args(w: Packed):
    dummy = w.codes
    return (w.codes, w.scales, dummy if w.mins is None else w.mins, dummy if w.sub is None else w.sub,
            dummy if w.sub_mins is None else w.sub_mins, dummy if w.high is None else w.high)


def _strides(w: Packed):
    return (w.codes.stride(0), w.scales.stride(0), _stride(w.mins), _stride(w.sub), _stride(w.high))


def qgather(ids: torch.Tensor, w: Packed, dtype: torch.dtype, block_t: int = 16) -> torch.Tensor:
    """The rows `ids` (int64 [T]) of `w`, decoded to `dtype`: [T, cols]."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty((ids.numel(), w.cols), dtype=dtype, device=w.codes.device)
    if ids.numel():
        _qgather_kernel[(triton.cdiv(ids.numel(), block_t),)](
            ids, out, *_args(w), ids.numel(), w.rows, w.cols, out.stride(0), *_strides(w),
            QT=w.qtype, BLOCK_T=block_t)
    return out
