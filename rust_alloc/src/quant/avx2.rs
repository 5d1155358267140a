//! AVX2 + FMA + F16C path. Each format turns 8 weights of a group of 32 into one `__m256` of
//! exact fp32 weights (integer codes widened with `vpmovzx/sx`, converted, scaled); the
//! tile loop then multiplies them with up to `MAX_TILE` token rows, one FMA per 8 weights
//! and token, so the decode cost is shared by the whole tile. Batches of 16+ tokens with a
//! long K (the MLP down projection) decode each weight once into an L1 panel instead
//! (`rows_panel`), with the same sums in the same order.

use std::arch::x86_64::*;

use super::formats::{groups, q4k_scale_min};
use super::{Mat, QMatrix, QType, MAX_TILE};

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half(p: *const u8) -> f32 {
    let h = u16::from_le_bytes([*p, *p.add(1)]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// Eight bytes at `p`, zero-extended to eight i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn u8x8(p: *const u8) -> __m256i { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)) }

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

pub(crate) trait Fmt {
    const Q: QType;
    /// What a block's header decodes to once, before its groups.
    type S: Copy;
    unsafe fn scales(blk: *const u8) -> Self::S;
    /// Weights `32 g + 8 v .. 32 g + 8 v + 8` of the block, exact fp32.
    unsafe fn vec(blk: *const u8, s: &Self::S, g: usize, v: usize) -> __m256;
}

struct Q80;
struct Q40;
struct Q41;
struct Q4K;
struct Q6K;

impl Fmt for Q80 {
    const Q: QType = QType::Q8_0;
    type S = __m256;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(blk: *const u8) -> __m256 { _mm256_set1_ps(half(blk)) }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn vec(blk: *const u8, d: &__m256, _g: usize, v: usize) -> __m256 {
        let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(blk.add(2 + 8 * v) as *const __m128i));
        _mm256_mul_ps(_mm256_cvtepi32_ps(q), *d)
    }
}

impl Fmt for Q40 {
    const Q: QType = QType::Q4_0;
    type S = __m256;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(blk: *const u8) -> __m256 { _mm256_set1_ps(half(blk)) }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn vec(blk: *const u8, d: &__m256, _g: usize, v: usize) -> __m256 {
        let b = u8x8(blk.add(2 + 8 * (v % 2)));
        let q = if v < 2 { _mm256_and_si256(b, _mm256_set1_epi32(15)) } else { _mm256_srli_epi32::<4>(b) };
        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(8))), *d)
    }
}

impl Fmt for Q41 {
    const Q: QType = QType::Q4_1;
    type S = (__m256, __m256);
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(blk: *const u8) -> (__m256, __m256) {
        (_mm256_set1_ps(half(blk)), _mm256_set1_ps(half(blk.add(2))))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn vec(blk: *const u8, s: &(__m256, __m256), _g: usize, v: usize) -> __m256 {
        let b = u8x8(blk.add(4 + 8 * (v % 2)));
        let q = if v < 2 { _mm256_and_si256(b, _mm256_set1_epi32(15)) } else { _mm256_srli_epi32::<4>(b) };
        _mm256_add_ps(_mm256_mul_ps(s.0, _mm256_cvtepi32_ps(q)), s.1)
    }
}

impl Fmt for Q4K {
    const Q: QType = QType::Q4_K;
    type S = ([f32; 8], [f32; 8]);
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(blk: *const u8) -> ([f32; 8], [f32; 8]) {
        let (d, dmin) = (half(blk), half(blk.add(2)));
        let s = std::slice::from_raw_parts(blk.add(4), 12);
        let (mut ds, mut dm) = ([0f32; 8], [0f32; 8]);
        for j in 0..8 {
            let (sc, mn) = q4k_scale_min(s, j);
            ds[j] = d * sc as f32;
            dm[j] = dmin * mn as f32;
        }
        (ds, dm)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn vec(blk: *const u8, s: &([f32; 8], [f32; 8]), g: usize, v: usize) -> __m256 {
        let b = u8x8(blk.add(16 + 32 * (g / 2) + 8 * v));
        let q = if g % 2 == 0 { _mm256_and_si256(b, _mm256_set1_epi32(15)) } else { _mm256_srli_epi32::<4>(b) };
        _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(s.0[g]), _mm256_cvtepi32_ps(q)), _mm256_set1_ps(s.1[g]))
    }
}

impl Fmt for Q6K {
    const Q: QType = QType::Q6_K;
    type S = [f32; 16];
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(blk: *const u8) -> [f32; 16] {
        let d = half(blk.add(208));
        let mut ds = [0f32; 16];
        for (i, v) in ds.iter_mut().enumerate() {
            *v = d * (*blk.add(192 + i) as i8) as f32;
        }
        ds
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn vec(blk: *const u8, s: &[f32; 16], g: usize, v: usize) -> __m256 {
        let (h, j) = (g / 4, g % 4);
        let q = match j {
            0 => q6_codes::<0>(blk, h, v),
            1 => q6_codes::<1>(blk, h, v),
            2 => q6_codes::<2>(blk, h, v),
            _ => q6_codes::<3>(blk, h, v),
        };
        _mm256_mul_ps(_mm256_set1_ps(s[2 * g + v / 2]), _mm256_cvtepi32_ps(q))
    }
}

/// One token (decode at batch 1): the weights are never scaled one by one. Per block (or
/// K-quant group) the integer codes, converted, meet `x` in a product `s`, and the scales
/// come in once: `acc += d·s`, and for formats with an offset `accm += m·Σx` (`xsum` holds
/// each group's 8-lane partial sums of `x`). A row's value is `hsum(acc ± accm)`.
pub(crate) trait Dot: Fmt {
    /// `true` if the row value is `acc - accm` (K-quant mins), `false` for `acc + accm`.
    const SUB_M: bool = false;
    unsafe fn dot(blk: *const u8, x: *const f32, xsum: *const f32, acc: &mut __m256, accm: &mut __m256);
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn ld(p: *const f32) -> __m256 { _mm256_loadu_ps(p) }

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn cvt(q: __m256i) -> __m256 { _mm256_cvtepi32_ps(q) }

/// Σ over the four 8-lane quarters of a group: codes · x.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn codes_dot(q: [__m256i; 4], x: *const f32) -> __m256 {
    let s = _mm256_mul_ps(cvt(q[0]), ld(x));
    let s = _mm256_fmadd_ps(cvt(q[1]), ld(x.add(8)), s);
    let s = _mm256_fmadd_ps(cvt(q[2]), ld(x.add(16)), s);
    _mm256_fmadd_ps(cvt(q[3]), ld(x.add(24)), s)
}

/// The 32 nibble codes of 16 bytes: low nibbles are weights 0..16, high ones 16..32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles16(p: *const u8) -> [__m256i; 4] {
    let (b0, b1, m15) = (u8x8(p), u8x8(p.add(8)), _mm256_set1_epi32(15));
    [_mm256_and_si256(b0, m15), _mm256_and_si256(b1, m15), _mm256_srli_epi32::<4>(b0), _mm256_srli_epi32::<4>(b1)]
}

impl Dot for Q80 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(blk: *const u8, x: *const f32, _xsum: *const f32, acc: &mut __m256, _accm: &mut __m256) {
        let q = [0, 1, 2, 3].map(|v| _mm256_cvtepi8_epi32(_mm_loadl_epi64(blk.add(2 + 8 * v) as *const __m128i)));
        *acc = _mm256_fmadd_ps(_mm256_set1_ps(half(blk)), codes_dot(q, x), *acc);
    }
}

impl Dot for Q40 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(blk: *const u8, x: *const f32, _xsum: *const f32, acc: &mut __m256, _accm: &mut __m256) {
        let e8 = _mm256_set1_epi32(8);
        let q = nibbles16(blk.add(2)).map(|q| _mm256_sub_epi32(q, e8));
        *acc = _mm256_fmadd_ps(_mm256_set1_ps(half(blk)), codes_dot(q, x), *acc);
    }
}

impl Dot for Q41 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(blk: *const u8, x: *const f32, xsum: *const f32, acc: &mut __m256, accm: &mut __m256) {
        let s = codes_dot(nibbles16(blk.add(4)), x);
        *acc = _mm256_fmadd_ps(_mm256_set1_ps(half(blk)), s, *acc);
        *accm = _mm256_fmadd_ps(_mm256_set1_ps(half(blk.add(2))), ld(xsum), *accm);
    }
}

impl Dot for Q4K {
    const SUB_M: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(blk: *const u8, x: *const f32, xsum: *const f32, acc: &mut __m256, accm: &mut __m256) {
        let (ds, dm) = Q4K::scales(blk);
        let m15 = _mm256_set1_epi32(15);
        for c in 0..4 {
            let p = blk.add(16 + 32 * c);
            let (b0, b1, b2, b3) = (u8x8(p), u8x8(p.add(8)), u8x8(p.add(16)), u8x8(p.add(24)));
            let and = |b| _mm256_and_si256(b, m15);
            let lo = codes_dot([and(b0), and(b1), and(b2), and(b3)], x.add(64 * c));
            let hi = codes_dot(
                [_mm256_srli_epi32::<4>(b0), _mm256_srli_epi32::<4>(b1), _mm256_srli_epi32::<4>(b2), _mm256_srli_epi32::<4>(b3)],
                x.add(64 * c + 32),
            );
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(ds[2 * c]), lo, *acc);
            *acc = _mm256_fmadd_ps(_mm256_set1_ps(ds[2 * c + 1]), hi, *acc);
            *accm = _mm256_fmadd_ps(_mm256_set1_ps(dm[2 * c]), ld(xsum.add(16 * c)), *accm);
            *accm = _mm256_fmadd_ps(_mm256_set1_ps(dm[2 * c + 1]), ld(xsum.add(16 * c + 8)), *accm);
        }
    }
}

/// Q6_K codes of group `4h + j`, quarter `v`: 4 low bits from `ql`, 2 high from `qh`, minus 32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_codes<const J: i32>(blk: *const u8, h: usize, v: usize) -> __m256i {
    let l = u8x8(blk.add(64 * h + 32 * (J as usize % 2) + 8 * v));
    let lo = if J < 2 { _mm256_and_si256(l, _mm256_set1_epi32(15)) } else { _mm256_srli_epi32::<4>(l) };
    let hb = u8x8(blk.add(128 + 32 * h + 8 * v));
    let hi = match J {
        0 => _mm256_slli_epi32::<4>(_mm256_and_si256(hb, _mm256_set1_epi32(3))),
        1 => _mm256_slli_epi32::<2>(_mm256_and_si256(hb, _mm256_set1_epi32(12))),
        2 => _mm256_and_si256(hb, _mm256_set1_epi32(48)),
        _ => _mm256_srli_epi32::<2>(_mm256_and_si256(hb, _mm256_set1_epi32(192))),
    };
    _mm256_sub_epi32(_mm256_or_si256(lo, hi), _mm256_set1_epi32(32))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_group<const J: i32>(blk: *const u8, ds: &[f32; 16], h: usize, x: *const f32, acc: &mut __m256) {
    let g = 4 * h + J as usize;
    let xg = x.add(32 * g);
    let q = |v| cvt(q6_codes::<J>(blk, h, v));
    let a = _mm256_fmadd_ps(q(1), ld(xg.add(8)), _mm256_mul_ps(q(0), ld(xg)));
    let b = _mm256_fmadd_ps(q(3), ld(xg.add(24)), _mm256_mul_ps(q(2), ld(xg.add(16))));
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(ds[2 * g]), a, *acc);
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(ds[2 * g + 1]), b, *acc);
}

impl Dot for Q6K {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot(blk: *const u8, x: *const f32, _xsum: *const f32, acc: &mut __m256, _accm: &mut __m256) {
        let ds = Q6K::scales(blk);
        for h in 0..2 {
            q6_group::<0>(blk, &ds, h, x, acc);
            q6_group::<1>(blk, &ds, h, x, acc);
            q6_group::<2>(blk, &ds, h, x, acc);
            q6_group::<3>(blk, &ds, h, x, acc);
        }
    }
}

/// Bytes ahead of the block being read that a one-token product prefetches.
const PREFETCH: usize = 384;

/// `NR` rows against one token; `xsum` per group as in `Dot`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_tile<F: Dot, const NR: usize>(row: *const u8, rb: usize, nb: usize, x: *const f32, xsum: *const f32, o: *mut f32) {
    let mut acc = [_mm256_setzero_ps(); NR];
    let mut accm = [_mm256_setzero_ps(); NR];
    for b in 0..nb {
        let xb = x.add(b * F::Q.block_weights());
        let sb = xsum.add(b * F::Q.block_weights() / 4);
        for r in 0..NR {
            let p = row.add(r * rb + b * F::Q.block_bytes());
            // the rows are read once, from memory: ask for the bytes a few hundred ahead
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH) as *const i8);
            F::dot(p, xb, sb, &mut acc[r], &mut accm[r]);
        }
    }
    for r in 0..NR {
        let v = if F::SUB_M { _mm256_sub_ps(acc[r], accm[r]) } else { _mm256_add_ps(acc[r], accm[r]) };
        *o.add(r) = hsum(v);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv<F: Dot>(w: &QMatrix, x: *const f32, out: *mut f32, r0: usize, r1: usize) {
    let nb = w.cols / F::Q.block_weights();
    let rb = w.row_bytes();
    let base = w.data.as_ptr();
    // 8-lane partial sums of x per group of 32
    let mut xsum = vec![0f32; w.cols / 4];
    for g in 0..w.cols / 32 {
        let p = x.add(32 * g);
        let s = _mm256_add_ps(_mm256_add_ps(ld(p), ld(p.add(8))), _mm256_add_ps(ld(p.add(16)), ld(p.add(24))));
        _mm256_storeu_ps(xsum.as_mut_ptr().add(8 * g), s);
    }
    let xs = xsum.as_ptr();
    let mut r = r0;
    while r + 4 <= r1 {
        gemv_tile::<F, 4>(base.add(r * rb), rb, nb, x, xs, out.add(r));
        r += 4;
    }
    while r < r1 {
        gemv_tile::<F, 1>(base.add(r * rb), rb, nb, x, xs, out.add(r));
        r += 1;
    }
}

/// Block `b` of `NR` weight rows (`row`, row stride `rb`) decoded in registers, 8 weights at
/// a time, each vector multiplied into `acc[r][t]` with the `NT` token rows at `x` (stride
/// `xs`, K from 0). With `STORE` the decoded vectors also go to `wp` (row stride `ws`, K
/// from 0), for later tiles to read. One order of products for every tile shape.
#[inline]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_fma<F: Fmt, const NR: usize, const NT: usize, const STORE: bool>(
    row: *const u8, rb: usize, b: usize, x: *const f32, xs: usize, acc: &mut [[__m256; NT]; NR], wp: *mut f32,
    ws: usize,
) {
    let blk = |r: usize| row.add(r * rb + b * F::Q.block_bytes());
    let mut s = [F::scales(blk(0)); NR];
    for (r, s) in s.iter_mut().enumerate().skip(1) {
        *s = F::scales(blk(r));
    }
    for g in 0..groups(F::Q) {
        for v in 0..4 {
            let k = b * F::Q.block_weights() + g * 32 + 8 * v;
            let mut w = [_mm256_setzero_ps(); NR];
            for (r, w) in w.iter_mut().enumerate() {
                *w = F::vec(blk(r), &s[r], g, v);
                if STORE {
                    _mm256_store_ps(wp.add(r * ws + k), *w);
                }
            }
            for t in 0..NT {
                let xv = _mm256_loadu_ps(x.add(t * xs + k));
                for r in 0..NR {
                    acc[r][t] = _mm256_fmadd_ps(w[r], xv, acc[r][t]);
                }
            }
        }
    }
}

/// Dot products of `NR` weight rows (`row`, `row + rb`, ..) with `NT` token rows (`x`, row
/// stride `xs`), written to `o[t * os + r]`. One accumulator per (row, token), fed in the same
/// order whatever the tile: a token's result does not depend on the batch around it.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<F: Fmt, const NR: usize, const NT: usize>(
    row: *const u8, rb: usize, nb: usize, x: *const f32, xs: usize, o: *mut f32, os: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); NT]; NR];
    for b in 0..nb {
        for r in 0..NR {
            _mm_prefetch::<_MM_HINT_T0>(row.add(r * rb + b * F::Q.block_bytes()).wrapping_add(PREFETCH) as *const i8);
        }
        block_fma::<F, NR, NT, false>(row, rb, b, x, xs, &mut acc, std::ptr::null_mut(), 0);
    }
    for (r, acc) in acc.iter().enumerate() {
        for (t, a) in acc.iter().enumerate() {
            *o.add(t * os + r) = hsum(*a);
        }
    }
}

/// Token tiles outside, row groups inside: the tile's activations stay in L1 while the
/// chunk's weight rows (a few KB to a few hundred) are read again from L1/L2.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows<F: Fmt>(w: &QMatrix, x: Mat, out: Mat, r0: usize, r1: usize) {
    let nb = w.cols / F::Q.block_weights();
    let rb = w.row_bytes();
    let base = w.data.as_ptr();
    let mut t0 = 0;
    while t0 < x.rows {
        let nt = (x.rows - t0).min(MAX_TILE);
        let xp = x.ptr.add(t0 * x.stride);
        let mut r = r0;
        macro_rules! run {
            ($nr:literal, $nt:literal) => {{
                while r + $nr <= r1 {
                    tile::<F, $nr, $nt>(base.add(r * rb), rb, nb, xp, x.stride, out.ptr.add(t0 * out.stride + r), out.stride);
                    r += $nr;
                }
                while r < r1 {
                    tile::<F, 1, $nt>(base.add(r * rb), rb, nb, xp, x.stride, out.ptr.add(t0 * out.stride + r), out.stride);
                    r += 1;
                }
            }};
        }
        match nt {
            1 => run!(4, 1),
            2 => run!(2, 2),
            3 => run!(2, 3),
            4 => run!(2, 4),
            5 => run!(2, 5),
            6 => run!(2, 6),
            7 => run!(1, 7),
            8 => run!(1, 8),
            9 => run!(1, 9),
            10 => run!(1, 10),
            11 => run!(1, 11),
            _ => run!(1, 12),
        }
        t0 += nt;
    }
}

/// Weights per K chunk of a panel (at most): a multiple of every block (32 and 256 weights).
const KC: usize = 384;
/// Weight rows per panel.
const PR: usize = 12;
/// Most token rows a panel is decoded for at once.
const TB: usize = 32;
/// The panel path takes products with at least this many tokens and this long a K. With a
/// long K a tile's token rows (12 x K floats) no longer fit in L1 and every FMA waited on
/// L2; the panel reads K in chunks. Measured in the model (decode steps alternated between
/// the paths in one process): the MLP down projection (K = 1536) at batch 32 in 19 ms
/// instead of 27, equal at batch 16; a whole step at batch 32 or 24 4-5% faster. With
/// K = 576 the panel was no faster in the model (the tile's rows still fit in L1).
const PANEL_MIN_TOKENS: usize = 16;
const PANEL_MIN_COLS: usize = 1024;

/// The accumulators of an `MR` x `MT` tile from `acc[r * TB + t]`, and back.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_acc<const MR: usize, const MT: usize>(acc: *const __m256) -> [[__m256; MT]; MR] {
    std::array::from_fn(|r| std::array::from_fn(|t| *acc.add(r * TB + t)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_acc<const MR: usize, const MT: usize>(a: &[[__m256; MT]; MR], acc: *mut __m256) {
    for (r, a) in a.iter().enumerate() {
        for (t, a) in a.iter().enumerate() {
            *acc.add(r * TB + t) = *a;
        }
    }
}

/// A micro-tile: `MR` rows of the decoded panel (`wp`, row stride `KC`) against `MT` token
/// rows (`xp`, stride `xs`) over `nv` 8-lane vectors of K, continuing the accumulators in
/// `acc[r * TB + t]`. The same accumulator per (row, token) and the same order of products
/// as `tile`: the results are bit for bit those of `tile`, whatever the batch.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn micro<const MR: usize, const MT: usize>(wp: *const f32, xp: *const f32, xs: usize, nv: usize, acc: *mut __m256) {
    let mut a = load_acc::<MR, MT>(acc);
    for v in 0..nv {
        let mut w = [_mm256_setzero_ps(); MR];
        for (r, w) in w.iter_mut().enumerate() {
            *w = _mm256_load_ps(wp.add(r * KC + 8 * v));
        }
        for t in 0..MT {
            let xv = _mm256_loadu_ps(xp.add(t * xs + 8 * v));
            for r in 0..MR {
                a[r][t] = _mm256_fmadd_ps(w[r], xv, a[r][t]);
            }
        }
    }
    store_acc(&a, acc);
}

/// `micro` for the first token tile of a chunk: the weights come from their blocks (`row`,
/// row stride `rb`, `cb` blocks), are decoded in registers, used, and stored to the panel
/// (`wp`) for the tiles after it. The decoding runs between this tile's FMAs, where it
/// costs little, instead of in a pass of its own.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn micro_first<F: Fmt, const MR: usize, const MT: usize>(
    row: *const u8, rb: usize, cb: usize, wp: *mut f32, xp: *const f32, xs: usize, acc: *mut __m256,
) {
    let mut a = load_acc::<MR, MT>(acc);
    for b in 0..cb {
        block_fma::<F, MR, MT, true>(row, rb, b, xp, xs, &mut a, wp, KC);
    }
    store_acc(&a, acc);
}

#[repr(align(64))]
struct Panel([f32; PR * KC]);
#[repr(align(64))]
struct Acc([__m256; PR * TB]);

/// Rows `r0..r1` against many token rows, K in chunks: per chunk the weights of `PR` rows
/// are decoded once into a panel in L1 (18 KB at most), by the first token tile, between
/// its FMAs (`micro_first`); the other 3 x 4 tiles (3 rows, 4 tokens: 7 loads per 12 FMA)
/// read them there. The accumulators wait in `acc` between chunks; the next chunk's weight
/// bytes are prefetched meanwhile.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_panel<F: Fmt>(w: &QMatrix, x: Mat, out: Mat, r0: usize, r1: usize) {
    let (bw, bb) = (F::Q.block_weights(), F::Q.block_bytes());
    let nb = w.cols / bw;
    let kcb = nb.div_ceil(nb.div_ceil(KC / bw)); // blocks per chunk, chunks of equal size
    let rb = w.row_bytes();
    let base = w.data.as_ptr();
    let mut panel = Panel([0f32; PR * KC]);
    let mut acc = Acc([_mm256_setzero_ps(); PR * TB]);
    let (pp, ap) = (panel.0.as_mut_ptr(), acc.0.as_mut_ptr());
    let tb = x.rows.div_ceil(x.rows.div_ceil(TB)); // token blocks of equal size
    let mut t0 = 0;
    while t0 < x.rows {
        let nt = tb.min(x.rows - t0);
        let mut p0 = r0;
        while p0 < r1 {
            let pr = PR.min(r1 - p0);
            acc.0.fill(_mm256_setzero_ps());
            let mut c0 = 0;
            while c0 < nb {
                let cb = kcb.min(nb - c0);
                let (np0, nc0) = if c0 + cb < nb { (p0, c0 + cb) } else { (p0 + pr, 0) };
                if np0 < r1 {
                    let bytes = kcb.min(nb - nc0) * bb;
                    for r in 0..PR.min(r1 - np0) {
                        let q = base.add((np0 + r) * rb + nc0 * bb);
                        for o in (0..bytes).step_by(64) {
                            _mm_prefetch::<_MM_HINT_T0>(q.add(o) as *const i8);
                        }
                    }
                }
                let nv = cb * bw / 8;
                let xc = x.ptr.add(t0 * x.stride + c0 * bw);
                for tt in (0..nt).step_by(4) {
                    let mt = (nt - tt).min(4);
                    for rr in (0..pr).step_by(3) {
                        let mr = (pr - rr).min(3);
                        let (wq, xq, aq) = (pp.add(rr * KC), xc.add(tt * x.stride), ap.add(rr * TB + tt));
                        macro_rules! go {
                            ($($r:literal $t:literal),*) => {
                                match (mr, mt) {
                                    $(($r, $t) => micro::<$r, $t>(wq, xq, x.stride, nv, aq),)*
                                    _ => unreachable!(),
                                }
                            };
                        }
                        if tt == 0 {
                            let row = base.add((p0 + rr) * rb + c0 * bb);
                            macro_rules! first {
                                ($($r:literal $t:literal),*) => {
                                    match (mr, mt) {
                                        $(($r, $t) => micro_first::<F, $r, $t>(row, rb, cb, wq, xq, x.stride, aq),)*
                                        _ => unreachable!(),
                                    }
                                };
                            }
                            first!(1 1, 1 2, 1 3, 1 4, 2 1, 2 2, 2 3, 2 4, 3 1, 3 2, 3 3, 3 4);
                        } else {
                            go!(1 1, 1 2, 1 3, 1 4, 2 1, 2 2, 2 3, 2 4, 3 1, 3 2, 3 3, 3 4);
                        }
                    }
                }
                c0 += cb;
            }
            for r in 0..pr {
                for t in 0..nt {
                    *out.row(t0 + t).add(p0 + r) = hsum(acc.0[r * TB + t]);
                }
            }
            p0 += pr;
        }
        t0 += nt;
    }
}


/// # Safety
/// Views checked by the caller; the CPU has AVX2, FMA and F16C.
pub(crate) unsafe fn matmul_rows(w: &QMatrix, x: Mat, out: Mat, r0: usize, r1: usize) {
    if x.rows == 1 {
        return match w.qtype {
            QType::Q8_0 => gemv::<Q80>(w, x.ptr, out.ptr, r0, r1),
            QType::Q4_0 => gemv::<Q40>(w, x.ptr, out.ptr, r0, r1),
            QType::Q4_1 => gemv::<Q41>(w, x.ptr, out.ptr, r0, r1),
            QType::Q4_K => gemv::<Q4K>(w, x.ptr, out.ptr, r0, r1),
            QType::Q6_K => gemv::<Q6K>(w, x.ptr, out.ptr, r0, r1),
        };
    }
    if x.rows >= PANEL_MIN_TOKENS && w.cols >= PANEL_MIN_COLS {
        return match w.qtype {
            QType::Q8_0 => rows_panel::<Q80>(w, x, out, r0, r1),
            QType::Q4_0 => rows_panel::<Q40>(w, x, out, r0, r1),
            QType::Q4_1 => rows_panel::<Q41>(w, x, out, r0, r1),
            QType::Q4_K => rows_panel::<Q4K>(w, x, out, r0, r1),
            QType::Q6_K => rows_panel::<Q6K>(w, x, out, r0, r1),
        };
    }
    match w.qtype {
        QType::Q8_0 => rows::<Q80>(w, x, out, r0, r1),
        QType::Q4_0 => rows::<Q40>(w, x, out, r0, r1),
        QType::Q4_1 => rows::<Q41>(w, x, out, r0, r1),
        QType::Q4_K => rows::<Q4K>(w, x, out, r0, r1),
        QType::Q6_K => rows::<Q6K>(w, x, out, r0, r1),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant<F: Fmt>(row: &[u8], out: *mut f32) {
    for (b, blk) in row.chunks_exact(F::Q.block_bytes()).enumerate() {
        let s = F::scales(blk.as_ptr());
        for g in 0..groups(F::Q) {
            let o = out.add(b * F::Q.block_weights() + g * 32);
            for v in 0..4 {
                _mm256_storeu_ps(o.add(8 * v), F::vec(blk.as_ptr(), &s, g, v));
            }
        }
    }
}

/// # Safety
/// `out` has room for the row; the CPU has AVX2, FMA and F16C.
pub(crate) unsafe fn dequant_row(q: QType, row: &[u8], out: *mut f32) {
    match q {
        QType::Q8_0 => dequant::<Q80>(row, out),
        QType::Q4_0 => dequant::<Q40>(row, out),
        QType::Q4_1 => dequant::<Q41>(row, out),
        QType::Q4_K => dequant::<Q4K>(row, out),
        QType::Q6_K => dequant::<Q6K>(row, out),
    }
}
