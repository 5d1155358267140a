//! AVX2 + FMA + F16C path. Each format turns 8 weights of a group of 32 into one `__m256` of
//! exact fp32 weights (integer codes widened with `vpmovzx/sx`, converted, scaled); the
//! tile loop then multiplies them with up to `MAX_TILE` token rows, one FMA per 8 weights
//! and token, so the decode cost is shared by the whole tile. Batches of 16+ tokens decode
//! each weight once per call instead, 8 rows side by side into a K-major panel in L1, and
//! multiply it by outer products with 6-token tiles (`rows_bcast`). Interleaved weights (x8)
//! need no transposes for that panel (`x8_panel`); with one token they are multiplied 8 rows
//! per vector, the scales folded in per block (`gemv_x8`), with a few tokens by register
//! tiles of 8 rows (`rows_x8`, several groups at once), from `x8_bcast_min_tokens()` on by
//! the broadcast path. With AVX-512 F those take 16 rows (two groups) per vector, each lane's
//! operations and their order unchanged (`gemv_x16_tile`, `tile_x16`, `bmicro16`: the same
//! bits), the tiles up to 8 tokens and the broadcast path's up to 12.

use std::arch::x86_64::*;

use super::formats::{groups, q4k_scale_min};
use super::{Mat, QMatrix, QType, BCAST_MIN_TOKENS, BCAST_ROWS, MAX_TILE};

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
struct Q50;
struct Q51;
struct Q5K;
struct F16;
struct BF16;

/// Lane `i` of 8: 16 if bit `i` of `bits` is set, else 0 (a 5-bit code's top bit).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn high_bits8(bits: u32) -> __m256i {
    let lanes = _mm256_srlv_epi32(_mm256_set1_epi32(bits as i32), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_slli_epi32::<4>(_mm256_and_si256(lanes, _mm256_set1_epi32(1)))
}

/// Q5_0 / Q5_1 codes of quarter `v` (weights 8v .. 8v + 8), 0..32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_codes(qh: *const u8, qs: *const u8, v: usize) -> __m256i {
    let hb = u32::from_le_bytes([*qh, *qh.add(1), *qh.add(2), *qh.add(3)]);
    let b = u8x8(qs.add(8 * (v % 2)));
    let lo = if v < 2 { _mm256_and_si256(b, _mm256_set1_epi32(15)) } else { _mm256_srli_epi32::<4>(b) };
    _mm256_or_si256(lo, high_bits8(hb >> (8 * v)))
}

impl Fmt for Q50 {
    const Q: QType = QType::Q5_0;
    type S = __m256;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(blk: *const u8) -> __m256 { _mm256_set1_ps(half(blk)) }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn vec(blk: *const u8, d: &__m256, _g: usize, v: usize) -> __m256 {
        let q = _mm256_sub_epi32(q5_codes(blk.add(2), blk.add(6), v), _mm256_set1_epi32(16));
        _mm256_mul_ps(*d, _mm256_cvtepi32_ps(q))
    }
}

impl Fmt for Q51 {
    const Q: QType = QType::Q5_1;
    type S = (__m256, __m256);
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(blk: *const u8) -> (__m256, __m256) {
        (_mm256_set1_ps(half(blk)), _mm256_set1_ps(half(blk.add(2))))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn vec(blk: *const u8, s: &(__m256, __m256), _g: usize, v: usize) -> __m256 {
        // d·q exact (an f16 times a 5-bit code): one FMA rounds d·q + m as gguf does
        _mm256_fmadd_ps(s.0, _mm256_cvtepi32_ps(q5_codes(blk.add(4), blk.add(8), v)), s.1)
    }
}

impl Fmt for Q5K {
    const Q: QType = QType::Q5_K;
    type S = ([f32; 8], [f32; 8]);
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(blk: *const u8) -> ([f32; 8], [f32; 8]) { Q4K::scales(blk) }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn vec(blk: *const u8, s: &([f32; 8], [f32; 8]), g: usize, v: usize) -> __m256 {
        let b = u8x8(blk.add(48 + 32 * (g / 2) + 8 * v));
        let lo = if g % 2 == 0 { _mm256_and_si256(b, _mm256_set1_epi32(15)) } else { _mm256_srli_epi32::<4>(b) };
        let hb = _mm256_srlv_epi32(u8x8(blk.add(16 + 8 * v)), _mm256_set1_epi32(g as i32));
        let q = _mm256_or_si256(lo, _mm256_slli_epi32::<4>(_mm256_and_si256(hb, _mm256_set1_epi32(1))));
        // (d·sc)·q exact (11 + 6 + 5 significant bits): one FMA, gguf's rounding
        _mm256_fmsub_ps(_mm256_set1_ps(s.0[g]), _mm256_cvtepi32_ps(q), _mm256_set1_ps(s.1[g]))
    }
}

impl Fmt for F16 {
    const Q: QType = QType::F16;
    type S = ();
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(_blk: *const u8) {}
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn vec(blk: *const u8, _s: &(), _g: usize, v: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * v) as *const __m128i))
    }
}

impl Fmt for BF16 {
    const Q: QType = QType::BF16;
    type S = ();
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scales(_blk: *const u8) {}
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn vec(blk: *const u8, _s: &(), _g: usize, v: usize) -> __m256 {
        let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(blk.add(16 * v) as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
    }
}

/// One token through `Fmt::vec`: each weight exact, times x (formats without a `Dot` of their own).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_by_vec<F: Fmt>(blk: *const u8, x: *const f32, acc: &mut __m256) {
    let s = F::scales(blk);
    for g in 0..groups(F::Q) {
        for v in 0..4 {
            *acc = _mm256_fmadd_ps(F::vec(blk, &s, g, v), ld(x.add(32 * g + 8 * v)), *acc);
        }
    }
}

macro_rules! dot_by_vec {
    ($($t:ty),*) => {$(
        impl Dot for $t {
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn dot(blk: *const u8, x: *const f32, _xsum: *const f32, acc: &mut __m256, _m: &mut __m256) {
                dot_by_vec::<$t>(blk, x, acc)
            }
        }
    )*};
}
dot_by_vec!(Q50, Q51, Q5K, F16, BF16);

/// `$body` with `$F` the format type of `$q` (every format).
macro_rules! with_fmt {
    ($q:expr, $F:ident => $body:expr) => {
        match $q {
            QType::Q8_0 => { type $F = Q80; $body }
            QType::Q4_0 => { type $F = Q40; $body }
            QType::Q4_1 => { type $F = Q41; $body }
            QType::Q4_K => { type $F = Q4K; $body }
            QType::Q6_K => { type $F = Q6K; $body }
            QType::Q5_0 => { type $F = Q50; $body }
            QType::Q5_1 => { type $F = Q51; $body }
            QType::Q5_K => { type $F = Q5K; $body }
            QType::F16 => { type $F = F16; $body }
            QType::BF16 => { type $F = BF16; $body }
        }
    };
}

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
        // d·q is exact in fp32 (an f16 scale times a 4-bit code: at most 15 significant
        // bits), so one FMA rounds d·q + m exactly as gguf's multiply-then-add does
        _mm256_fmadd_ps(s.0, _mm256_cvtepi32_ps(q), s.1)
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
        // (d·sc)·q is exact (11 + 6 + 4 significant bits): one FMA, the same rounding as gguf's two steps
        _mm256_fmsub_ps(_mm256_set1_ps(s.0[g]), _mm256_cvtepi32_ps(q), _mm256_set1_ps(s.1[g]))
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
/// `xs`, K from 0). One order of products for every tile shape.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_fma<F: Fmt, const NR: usize, const NT: usize>(
    row: *const u8, rb: usize, b: usize, x: *const f32, xs: usize, acc: &mut [[__m256; NT]; NR],
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
        block_fma::<F, NR, NT>(row, rb, b, x, xs, &mut acc);
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

// ------------------------------------------------------------ interleaved weights (x8)

/// Scales (and Q4_1 offsets) of the 8 rows of an interleaved group of 8 blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn x8_scales<F: Fmt>(gb: *const u8) -> (__m256, __m256) {
    let d = _mm256_cvtph_ps(_mm_loadu_si128(gb as *const __m128i));
    let m = if F::Q == QType::Q4_1 { _mm256_cvtph_ps(_mm_loadu_si128(gb.add(16) as *const __m128i)) } else { _mm256_setzero_ps() };
    (d, m)
}

/// Integer codes of weight `k` (0..32) of the 8 rows (Q4_0: minus 8).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn x8_codes<F: Fmt>(gb: *const u8, k: usize) -> __m256i {
    let c = gb.add(F::Q.x8_codes());
    match F::Q {
        QType::Q8_0 => _mm256_cvtepi8_epi32(_mm_loadl_epi64(c.add(8 * k) as *const __m128i)),
        _ => {
            let n = u8x8(c.add(8 * (k % 16)));
            let q = if k < 16 { _mm256_and_si256(n, _mm256_set1_epi32(15)) } else { _mm256_srli_epi32::<4>(n) };
            if F::Q == QType::Q4_0 { _mm256_sub_epi32(q, _mm256_set1_epi32(8)) } else { q }
        }
    }
}

/// Weight `k` of the 8 rows, exact fp32 (the same operations as `Fmt::vec`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn x8_vec<F: Fmt>(gb: *const u8, d: __m256, m: __m256, k: usize) -> __m256 {
    let q = cvt(x8_codes::<F>(gb, k));
    if F::Q == QType::Q4_1 { _mm256_fmadd_ps(d, q, m) } else { _mm256_mul_ps(q, d) }
}

/// Integer codes of weights `j` and `j + 16` (0..16) of the 8 rows: for Q4_0/Q4_1 one load
/// of 8 bytes, the low nibbles and the high ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn x8_pair<F: Fmt>(gb: *const u8, j: usize) -> (__m256i, __m256i) {
    if F::Q == QType::Q8_0 {
        return (x8_codes::<F>(gb, j), x8_codes::<F>(gb, j + 16));
    }
    let n = u8x8(gb.add(F::Q.x8_codes() + 8 * j));
    let (lo, hi) = (_mm256_and_si256(n, _mm256_set1_epi32(15)), _mm256_srli_epi32::<4>(n));
    if F::Q == QType::Q4_0 {
        let e8 = _mm256_set1_epi32(8);
        (_mm256_sub_epi32(lo, e8), _mm256_sub_epi32(hi, e8))
    } else {
        (lo, hi)
    }
}

/// One interleaved group of 8 blocks into the K-major panel: weight `k` of the 8 rows at
/// `wp[k * 16 ..][..8]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn x8_panel<F: Fmt>(gb: *const u8, wp: *mut f32) {
    let (d, m) = x8_scales::<F>(gb);
    let st = |k: usize, q: __m256i| {
        let q = cvt(q);
        // the same operations as `Fmt::vec` (and `x8_vec`)
        let w = if F::Q == QType::Q4_1 { _mm256_fmadd_ps(d, q, m) } else { _mm256_mul_ps(q, d) };
        _mm256_store_ps(wp.add(k * BR), w)
    };
    for j in 0..16 {
        let (lo, hi) = x8_pair::<F>(gb, j);
        st(j, lo);
        st(16 + j, hi);
    }
}

/// How far ahead an interleaved product asks for its blocks: `isa::decode_prefetch()` (the
/// integer kernels' distance) when set, else `near` (a few blocks).
#[inline]
fn far_ahead(near: usize) -> usize {
    match crate::isa::decode_prefetch() {
        0 => near,
        d => d.max(near),
    }
}

/// Ask for the interleaved group of 8 blocks at `p` (read once, from memory).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prefetch_group<F: Fmt>(p: *const u8) {
    for o in (0..8 * F::Q.block_bytes()).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o) as *const i8);
    }
}

/// Store lanes `0..n` of `v` at `o` (all 8 when `n` is 8).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_lanes(o: *mut f32, v: __m256, n: usize) {
    if n == 8 {
        _mm256_storeu_ps(o, v);
    } else {
        let mut t = [0f32; 8];
        _mm256_storeu_ps(t.as_mut_ptr(), v);
        std::ptr::copy_nonoverlapping(t.as_ptr(), o, n);
    }
}

/// `NG` interleaved groups (8 rows each, from `g`) against one token: per block the integer
/// codes meet `x` in two sums (weights 0..16 and 16..32), the rows' scales come in once per
/// block (`acc += d * s`), Q4_1's offsets through the block sums of `x` (`accm += m * Σx`).
/// The 8 rows of a group are the 8 lanes: no horizontal sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_x8_tile<F: Fmt, const NG: usize>(w: &QMatrix, g: usize, x: *const f32, xsum: &[f32], out: *mut f32, n_last: usize) {
    let gbytes = 8 * w.row_bytes();
    let bb8 = 8 * F::Q.block_bytes();
    let base = w.data.as_ptr().add(g * gbytes);
    let mut acc = [_mm256_setzero_ps(); NG];
    let mut accm = [_mm256_setzero_ps(); NG];
    let ahead = far_ahead(4 * bb8);
    for (b, &xs) in xsum.iter().enumerate() {
        let xb = x.add(32 * b);
        let mut s = [[_mm256_setzero_ps(); 2]; NG];
        for j in 0..16 {
            let (xl, xh) = (_mm256_broadcast_ss(&*xb.add(j)), _mm256_broadcast_ss(&*xb.add(j + 16)));
            for (i, s) in s.iter_mut().enumerate() {
                let (lo, hi) = x8_pair::<F>(base.add(i * gbytes + b * bb8), j);
                s[0] = _mm256_fmadd_ps(cvt(lo), xl, s[0]);
                s[1] = _mm256_fmadd_ps(cvt(hi), xh, s[1]);
            }
        }
        for i in 0..NG {
            let gb = base.add(i * gbytes + b * bb8);
            prefetch_group::<F>(gb.wrapping_add(ahead));
            let (d, m) = x8_scales::<F>(gb);
            acc[i] = _mm256_fmadd_ps(d, _mm256_add_ps(s[i][0], s[i][1]), acc[i]);
            if F::Q == QType::Q4_1 {
                accm[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs), accm[i]);
            }
        }
    }
    for i in 0..NG {
        let n = if i + 1 == NG { n_last } else { 8 };
        store_lanes(out.add(8 * i), _mm256_add_ps(acc[i], accm[i]), n);
    }
}

/// 8 bytes at `off` of the group at `gb` and 8 of the next group (`gbytes` on), side by side.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn x16_bytes(gb: *const u8, gbytes: usize, off: usize) -> __m128i {
    let lo = _mm_loadl_epi64(gb.add(off) as *const __m128i);
    _mm_castpd_si128(_mm_loadh_pd(_mm_castsi128_pd(lo), gb.add(gbytes + off) as *const f64))
}

/// The 8 f16 values at `off` of two neighbouring groups (scales or offsets), 16 lanes of fp32.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn x16_halves(gb: *const u8, gbytes: usize, off: usize) -> __m512 {
    let a = _mm_loadu_si128(gb.add(off) as *const __m128i);
    let b = _mm_loadu_si128(gb.add(gbytes + off) as *const __m128i);
    _mm512_cvtph_ps(_mm256_set_m128i(b, a))
}

/// Integer codes of weight `k` (0..32) of two neighbouring groups' 16 rows: `x8_codes` on
/// 16 lanes (`gc`: the first group's codes).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn x16_codes<F: Fmt>(gc: *const u8, gbytes: usize, k: usize) -> __m512i {
    if F::Q == QType::Q8_0 {
        return _mm512_cvtepi8_epi32(x16_bytes(gc, gbytes, 8 * k));
    }
    let n = _mm512_cvtepu8_epi32(x16_bytes(gc, gbytes, 8 * (k % 16)));
    let q = if k < 16 { _mm512_and_si512(n, _mm512_set1_epi32(15)) } else { _mm512_srli_epi32::<4>(n) };
    if F::Q == QType::Q4_0 { _mm512_sub_epi32(q, _mm512_set1_epi32(8)) } else { q }
}

/// The float of each 4-bit code (0..16) of format F, a `vpermps` table: c, or c - 8 for Q4_0.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn code_table<F: Fmt>() -> __m512 {
    let first = if F::Q == QType::Q4_0 { -8.0 } else { 0.0 };
    _mm512_add_ps(_mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.), _mm512_set1_ps(first))
}

/// Weights `j` and `j + 16` (0..16) of two neighbouring groups' 16 rows as fp32 codes
/// (`x8_pair` on 16 lanes, converted). A 4-bit code becomes its float by a table lookup
/// (`vpermps` reads the low 4 bits of each lane: no mask, no conversion; one load of each
/// group's 8 bytes for both weights): the same values `vcvtdq2ps` gives, in fewer
/// instructions.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn x16_pair_f32<F: Fmt>(gc: *const u8, gbytes: usize, j: usize) -> (__m512, __m512) {
    if F::Q == QType::Q8_0 {
        return (_mm512_cvtepi32_ps(x16_codes::<F>(gc, gbytes, j)), _mm512_cvtepi32_ps(x16_codes::<F>(gc, gbytes, j + 16)));
    }
    let table = code_table::<F>();
    let n = _mm512_cvtepu8_epi32(x16_bytes(gc, gbytes, 8 * j));
    (_mm512_permutexvar_ps(n, table), _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(n), table))
}

/// The two partial sums (weights 0..16 and 16..32) of `NB` consecutive blocks from block `b`
/// of two neighbouring groups' 16 rows (`gb`: the first group): `gemv_x8_tile`'s FMA chains
/// on 16 lanes, the blocks' chains independent of each other (more of them in flight).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn x16_sums<F: Fmt, const NB: usize>(gb: *const u8, gbytes: usize, b: usize, x: *const f32) -> [[__m512; 2]; NB] {
    let bb8 = 8 * F::Q.block_bytes();
    let mut s = [[_mm512_setzero_ps(); 2]; NB];
    for j in 0..16 {
        for (n, s) in s.iter_mut().enumerate() {
            let xb = x.add(32 * (b + n));
            let (xl, xh) = (_mm512_set1_ps(*xb.add(j)), _mm512_set1_ps(*xb.add(j + 16)));
            let (lo, hi) = x16_pair_f32::<F>(gb.add((b + n) * bb8 + F::Q.x8_codes()), gbytes, j);
            s[0] = _mm512_fmadd_ps(lo, xl, s[0]);
            s[1] = _mm512_fmadd_ps(hi, xh, s[1]);
        }
    }
    s
}

/// `gemv_x8_tile` with 16 lanes: two interleaved groups side by side in each vector (lanes
/// 0..8 group `g`'s rows, 8..16 group `g + 1`'s). Every lane runs the 8-lane kernel's
/// operations in its order (the same FMA chains, the scales folded in per block, block by
/// block), so the bits are the same; half the instructions per weight, and two blocks' chains
/// at once (one pair's chains alone waited on the FMA's latency).
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn gemv_x16_tile<F: Fmt>(w: &QMatrix, g: usize, x: *const f32, xsum: &[f32], out: *mut f32) {
    let gbytes = 8 * w.row_bytes();
    let bb8 = 8 * F::Q.block_bytes();
    let base = w.data.as_ptr().add(g * gbytes);
    let (mut acc, mut accm) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let ahead = far_ahead(4 * bb8);
    let mut fold = |b: usize, s: [__m512; 2]| {
        let gb = base.add(b * bb8);
        prefetch_group::<F>(gb.wrapping_add(ahead));
        prefetch_group::<F>(gb.wrapping_add(gbytes + ahead));
        acc = _mm512_fmadd_ps(x16_halves(gb, gbytes, 0), _mm512_add_ps(s[0], s[1]), acc);
        if F::Q == QType::Q4_1 {
            accm = _mm512_fmadd_ps(x16_halves(gb, gbytes, 16), _mm512_set1_ps(xsum[b]), accm);
        }
    };
    let mut b = 0;
    // (Q8_0's codes take two loads a pair: one block at a time ran faster on a Zen 5)
    while F::Q != QType::Q8_0 && b + 2 <= xsum.len() {
        let [s0, s1] = x16_sums::<F, 2>(base, gbytes, b, x);
        fold(b, s0);
        fold(b + 1, s1);
        b += 2;
    }
    while b < xsum.len() {
        let [s0] = x16_sums::<F, 1>(base, gbytes, b, x);
        fold(b, s0);
        b += 1;
    }
    _mm512_storeu_ps(out, _mm512_add_ps(acc, accm));
}

/// Rows `r0..r1` (`r0` a multiple of 8) of an interleaved matrix against one token.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_x8<F: Fmt>(w: &QMatrix, x: *const f32, out: *mut f32, r0: usize, r1: usize) {
    let xsum: Vec<f32> = (0..w.cols / 32).map(|b| (0..32).map(|k| *x.add(32 * b + k)).sum()).collect();
    let mut r = r0;
    if crate::isa::has_avx512f() {
        while r + 16 <= r1 {
            gemv_x16_tile::<F>(w, r / 8, x, &xsum, out.add(r));
            r += 16;
        }
    }
    while r + 16 <= r1 {
        gemv_x8_tile::<F, 2>(w, r / 8, x, &xsum, out.add(r), 8);
        r += 16;
    }
    if r < r1 {
        gemv_x8_tile::<F, 1>(w, r / 8, x, &xsum, out.add(r), (r1 - r).min(8));
        r += 8;
    }
    if r < r1 {
        gemv_x8_tile::<F, 1>(w, r / 8, x, &xsum, out.add(r), r1 - r);
    }
}

/// One interleaved group (8 rows) against `NT` token rows (`x`, stride `xs`): each output
/// one FMA chain in K order over the exact weights, as in `bmicro` (same bits as the
/// broadcast path). Written to `o[t * os ..][..n]`; `R` groups at once (group `g + r` written
/// at `o + 8r`, all 8 rows of all but the last): `R x NT` chains in flight (see `tile_x16`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_x8<F: Fmt, const NT: usize, const R: usize>(w: &QMatrix, g: usize, x: *const f32, xs: usize, o: *mut f32,
                                                           os: usize, n: usize) {
    let gbytes = 8 * w.row_bytes();
    let base = w.data.as_ptr().add(g * gbytes);
    let bb8 = 8 * F::Q.block_bytes();
    let mut acc = [[_mm256_setzero_ps(); NT]; R];
    let ahead = far_ahead(2 * bb8);
    for b in 0..w.cols / 32 {
        let gbs: [*const u8; R] = std::array::from_fn(|r| base.add(r * gbytes + b * bb8));
        for gb in gbs {
            prefetch_group::<F>(gb.wrapping_add(ahead));
        }
        let dm: [(__m256, __m256); R] = std::array::from_fn(|r| x8_scales::<F>(gbs[r]));
        for k in 0..32 {
            for r in 0..R {
                let wv = x8_vec::<F>(gbs[r], dm[r].0, dm[r].1, k);
                for (t, a) in acc[r].iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(wv, _mm256_broadcast_ss(&*x.add(t * xs + 32 * b + k)), *a);
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (t, a) in acc.iter().enumerate() {
            store_lanes(o.add(t * os + 8 * r), *a, if r + 1 == R { n } else { 8 });
        }
    }
}

/// `tile_x8` with 16 lanes: two interleaved groups side by side in each vector (lanes 0..8
/// group `g`'s rows, 8..16 group `g + 1`'s), all 16 rows written; `R` such pairs at once
/// (rows `8g .. 8g + 16R`, pair `r` written at `o + 16r`). Each lane decodes its weights and
/// runs its FMA chain as `tile_x8` does, in K order: the same bits. An output's chain is
/// serial (one FMA per weight, each waiting on the last), so a few tokens' chains alone waited
/// on the FMA's latency: 2 to 5 tokens took as long as 8. `R` pairs give `R x NT` chains in
/// flight.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn tile_x16<F: Fmt, const NT: usize, const R: usize>(w: &QMatrix, g: usize, x: *const f32, xs: usize, o: *mut f32,
                                                            os: usize) {
    let gbytes = 8 * w.row_bytes();
    let base = w.data.as_ptr().add(g * gbytes);
    let bb8 = 8 * F::Q.block_bytes();
    let codes = F::Q.x8_codes();
    let mut acc = [[_mm512_setzero_ps(); NT]; R];
    let ahead = far_ahead(2 * bb8);
    let table = code_table::<F>();
    for b in 0..w.cols / 32 {
        let gbs: [*const u8; R] = std::array::from_fn(|r| base.add(2 * r * gbytes + b * bb8));
        for gb in gbs {
            prefetch_group::<F>(gb.wrapping_add(ahead));
            prefetch_group::<F>(gb.wrapping_add(gbytes + ahead));
        }
        let d: [__m512; R] = std::array::from_fn(|r| x16_halves(gbs[r], gbytes, 0));
        let m: [__m512; R] = std::array::from_fn(|r| {
            if F::Q == QType::Q4_1 { x16_halves(gbs[r], gbytes, 16) } else { _mm512_setzero_ps() }
        });
        for k in 0..32 {
            for r in 0..R {
                let gc = gbs[r].add(codes);
                // the weights' floats: Q8_0's codes converted; a 4-bit code by `vpermps` on a
                // table (it reads the low 4 bits of each lane), as `x16_pair_f32`: the values
                // `vcvtdq2ps` gives, in fewer instructions
                let q = if F::Q != QType::Q8_0 {
                    let n = _mm512_cvtepu8_epi32(x16_bytes(gc, gbytes, 8 * (k % 16)));
                    _mm512_permutexvar_ps(if k < 16 { n } else { _mm512_srli_epi32::<4>(n) }, table)
                } else {
                    _mm512_cvtepi32_ps(x16_codes::<F>(gc, gbytes, k))
                };
                // the same operations as `x8_vec`
                let wv = if F::Q == QType::Q4_1 { _mm512_fmadd_ps(d[r], q, m[r]) } else { _mm512_mul_ps(q, d[r]) };
                for (t, a) in acc[r].iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(wv, _mm512_set1_ps(*x.add(t * xs + 32 * b + k)), *a);
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (t, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(o.add(t * os + 16 * r), *a);
        }
    }
}

const X8_TILE: usize = 8;

/// Rows `r0..r1` (`r0` a multiple of 8) of an interleaved matrix against 2 to
/// `x8_bcast_min_tokens() - 1` tokens: token tiles of at most 8 outside (their activations stay
/// in L1), groups inside.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_x8<F: Fmt>(w: &QMatrix, x: Mat, out: Mat, r0: usize, r1: usize) {
    let ntiles = x.rows.div_ceil(X8_TILE);
    let mut t0 = 0;
    for i in 0..ntiles {
        let mt = (x.rows - t0).div_ceil(ntiles - i);
        let xp = x.ptr.add(t0 * x.stride);
        let mut r = r0;
        // groups at once: about 8 FMA chains in flight (two FMA units, 4 cycles each)
        let many = super::tile_groups();
        if crate::isa::has_avx512f() {
            while r + 16 <= r1 {
                let o = out.ptr.add(t0 * out.stride + r);
                let want = if !many { 1 } else { match mt { 1 | 2 => 4, 3 => 3, 4..=7 => 2, _ => 1 } };
                let pairs = if r + 16 * want <= r1 { want } else { 1 };
                macro_rules! go16 {
                    ($($n:literal => $r:literal),*) => {
                        match (mt, pairs) {
                            $(($n, $r) => tile_x16::<F, $n, $r>(w, r / 8, xp, x.stride, o, out.stride),
                              ($n, _) => tile_x16::<F, $n, 1>(w, r / 8, xp, x.stride, o, out.stride),)*
                            _ => unreachable!(),
                        }
                    };
                }
                go16!(1 => 4, 2 => 4, 3 => 3, 4 => 2, 5 => 2, 6 => 2, 7 => 2, 8 => 1);
                r += 16 * pairs;
            }
        }
        while r < r1 {
            let o = out.ptr.add(t0 * out.stride + r);
            // (16 registers: fewer groups than on 16 lanes)
            let want = if !many { 1 } else { match mt { 1 | 2 => 3, 3 | 4 => 2, _ => 1 } };
            let groups = if r + 8 * want < r1 { want } else { 1 };
            let n = (r1 - r - 8 * (groups - 1)).min(8);
            macro_rules! go {
                ($($n:literal => $r:literal),*) => {
                    match (mt, groups) {
                        $(($n, $r) => tile_x8::<F, $n, $r>(w, r / 8, xp, x.stride, o, out.stride, n),
                          ($n, _) => tile_x8::<F, $n, 1>(w, r / 8, xp, x.stride, o, out.stride, n),)*
                        _ => unreachable!(),
                    }
                };
            }
            go!(1 => 3, 2 => 3, 3 => 2, 4 => 2, 5 => 1, 6 => 1, 7 => 1, 8 => 1);
            r += 8 * groups;
        }
        t0 += mt;
    }
}

/// Interleaved group `g` (rows `8g .. 8g + 8`) dequantized, row `8g + i` to `dst[i]` (room
/// for `w.cols` floats each; several may be the same scratch row).
///
/// # Safety
/// The group lies inside `w`; the CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dequant_group_x8(w: &QMatrix, g: usize, dst: &[*mut f32; 8]) {
    match w.qtype {
        QType::Q8_0 => dequant_x8::<Q80>(w, g, dst),
        QType::Q4_0 => dequant_x8::<Q40>(w, g, dst),
        QType::Q4_1 => dequant_x8::<Q41>(w, g, dst),
        q => unreachable!("{} is not interleavable", q.name()),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant_x8<F: Fmt>(w: &QMatrix, g: usize, dst: &[*mut f32; 8]) {
    let base = w.data.as_ptr().add(g * 8 * w.row_bytes());
    let bb8 = 8 * F::Q.block_bytes();
    for b in 0..w.cols / 32 {
        let gb = base.add(b * bb8);
        let (d, m) = x8_scales::<F>(gb);
        for v in 0..4 {
            let mut t: [__m256; 8] = std::array::from_fn(|j| x8_vec::<F>(gb, d, m, 8 * v + j));
            transpose8(&mut t);
            for (i, t) in t.iter().enumerate() {
                _mm256_storeu_ps(dst[i].add(32 * b + 8 * v), *t);
            }
        }
    }
}

/// Rows per group of the broadcast path: two 8-lane vectors.
const BR: usize = BCAST_ROWS;
/// Weights per K chunk of the broadcast path's panel (at most; whole blocks).
const BKC: usize = 320;

/// Transpose the 8 x 8 floats in `r` (row i = r[i]): afterwards r[j] holds column j.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn transpose8(r: &mut [__m256; 8]) {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    r[0] = _mm256_permute2f128_ps::<0x20>(u0, u4);
    r[1] = _mm256_permute2f128_ps::<0x20>(u1, u5);
    r[2] = _mm256_permute2f128_ps::<0x20>(u2, u6);
    r[3] = _mm256_permute2f128_ps::<0x20>(u3, u7);
    r[4] = _mm256_permute2f128_ps::<0x31>(u0, u4);
    r[5] = _mm256_permute2f128_ps::<0x31>(u1, u5);
    r[6] = _mm256_permute2f128_ps::<0x31>(u2, u6);
    r[7] = _mm256_permute2f128_ps::<0x31>(u3, u7);
}

/// Byte `j` of 16 consecutive bytes in each of 8 rows (`p[r]`), gathered across the rows:
/// `c[i]` holds bytes `2i` (lanes 0..8, row by row) and `2i + 1` (lanes 8..16).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bytes_8x16(p: &[*const u8; 8]) -> [__m128i; 8] {
    let x = p.map(|q| _mm_loadu_si128(q as *const __m128i));
    let a0 = _mm_unpacklo_epi8(x[0], x[1]);
    let a1 = _mm_unpackhi_epi8(x[0], x[1]);
    let a2 = _mm_unpacklo_epi8(x[2], x[3]);
    let a3 = _mm_unpackhi_epi8(x[2], x[3]);
    let a4 = _mm_unpacklo_epi8(x[4], x[5]);
    let a5 = _mm_unpackhi_epi8(x[4], x[5]);
    let a6 = _mm_unpacklo_epi8(x[6], x[7]);
    let a7 = _mm_unpackhi_epi8(x[6], x[7]);
    let b0 = _mm_unpacklo_epi16(a0, a2);
    let b1 = _mm_unpackhi_epi16(a0, a2);
    let b2 = _mm_unpacklo_epi16(a1, a3);
    let b3 = _mm_unpackhi_epi16(a1, a3);
    let b4 = _mm_unpacklo_epi16(a4, a6);
    let b5 = _mm_unpackhi_epi16(a4, a6);
    let b6 = _mm_unpacklo_epi16(a5, a7);
    let b7 = _mm_unpackhi_epi16(a5, a7);
    [
        _mm_unpacklo_epi32(b0, b4),
        _mm_unpackhi_epi32(b0, b4),
        _mm_unpacklo_epi32(b1, b5),
        _mm_unpackhi_epi32(b1, b5),
        _mm_unpacklo_epi32(b2, b6),
        _mm_unpackhi_epi32(b2, b6),
        _mm_unpacklo_epi32(b3, b7),
        _mm_unpackhi_epi32(b3, b7),
    ]
}

/// The f16 at byte `off` of each of 8 rows' blocks, as 8 fp32 lanes (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn halves8(p: &[*const u8; 8], off: usize) -> __m256 {
    let h = p.map(|q| std::ptr::read_unaligned(q.add(off) as *const i16));
    _mm256_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]))
}

/// Q4_0, Q4_1 and Q8_0 blocks of 8 rows straight into the K-major panel: the quant bytes are
/// transposed across the rows first (24 byte unpacks per 16 bytes of 8 rows), so every
/// 8-lane vector holds one weight of the 8 rows, decoded with the rows' scales side by side,
/// with the same fp32 results as `Fmt::vec` (exact weights).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_kmajor_small<F: Fmt>(p: &[*const u8; 8], wp: *mut f32) {
    let st = |k: usize, v: __m256| _mm256_store_ps(wp.add(k * BR), v);
    let hi64 = |c: __m128i| _mm_unpackhi_epi64(c, c);
    match F::Q {
        QType::Q8_0 => {
            let d = halves8(p, 0);
            for h in 0..2 {
                let q: [*const u8; 8] = p.map(|q| q.add(2 + 16 * h));
                let c = bytes_8x16(&q);
                for (i, c) in c.iter().enumerate() {
                    st(16 * h + 2 * i, _mm256_mul_ps(cvt(_mm256_cvtepi8_epi32(*c)), d));
                    st(16 * h + 2 * i + 1, _mm256_mul_ps(cvt(_mm256_cvtepi8_epi32(hi64(*c))), d));
                }
            }
        }
        QType::Q4_0 | QType::Q4_1 => {
            let q41 = F::Q == QType::Q4_1;
            let d = halves8(p, 0);
            let m = if q41 { halves8(p, 2) } else { _mm256_setzero_ps() };
            let q: [*const u8; 8] = p.map(|q| q.add(if q41 { 4 } else { 2 }));
            let c = bytes_8x16(&q);
            let (m15, e8) = (_mm256_set1_epi32(15), _mm256_set1_epi32(8));
            let w = |n: __m256i| {
                if q41 {
                    _mm256_fmadd_ps(d, cvt(n), m) // exact, as in `Q41::vec`
                } else {
                    _mm256_mul_ps(cvt(_mm256_sub_epi32(n, e8)), d)
                }
            };
            for (i, c) in c.iter().enumerate() {
                for (j, b) in [*c, hi64(*c)].into_iter().enumerate() {
                    let n = _mm256_cvtepu8_epi32(b);
                    st(2 * i + j, w(_mm256_and_si256(n, m15)));
                    st(16 + 2 * i + j, w(_mm256_srli_epi32::<4>(n)));
                }
            }
        }
        _ => unreachable!(),
    }
}

/// Decode blocks `c0 .. c0 + cb` of rows `row .. row + nr` (`nr` <= 16, row stride `rb`;
/// with `x8` interleaved groups of 8 rows, `row` a group's start) into the K-major panel
/// `wp`: weight `k` of row `r` at `wp[k * 16 + r]`. Lanes of rows past `nr` hold finite
/// values that no output reads.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_kmajor<F: Fmt>(row: *const u8, rb: usize, nr: usize, c0: usize, cb: usize, wp: *mut f32, x8: bool) {
    let (bw, bb) = (F::Q.block_weights(), F::Q.block_bytes());
    for half in 0..BR / 8 {
        let n = nr.saturating_sub(8 * half).min(8);
        if n == 0 {
            break;
        }
        if x8 {
            // interleaved: each 8 bytes are one weight position of the 8 rows
            for b in 0..cb {
                x8_panel::<F>(row.add(8 * half * rb + (c0 + b) * 8 * bb), wp.add(b * bw * BR + 8 * half));
            }
            continue;
        }
        for b in 0..cb {
            let blk = |r: usize| row.add((8 * half + if r < n { r } else { 0 }) * rb + (c0 + b) * bb);
            if matches!(F::Q, QType::Q8_0 | QType::Q4_0 | QType::Q4_1) {
                let p: [*const u8; 8] = std::array::from_fn(blk);
                decode_kmajor_small::<F>(&p, wp.add(b * bw * BR + 8 * half));
                continue;
            }
            let sc: [F::S; 8] = std::array::from_fn(|r| F::scales(blk(r)));
            for g in 0..groups(F::Q) {
                for v in 0..4 {
                    let mut m: [__m256; 8] = std::array::from_fn(|r| F::vec(blk(r), &sc[r], g, v));
                    transpose8(&mut m);
                    let k = b * bw + g * 32 + 8 * v;
                    for (j, m) in m.iter().enumerate() {
                        _mm256_store_ps(wp.add((k + j) * BR + 8 * half), *m);
                    }
                }
            }
        }
    }
}

/// `MT` token rows (`x`, stride `xs`, K from 0) times the 16-row K-major panel `wp` over
/// `nk` weights, added to (or, with `FIRST`, written over) `o[t * os .. + 16]`. Each output
/// is one chain of FMAs in K order, whatever the tile: a token's result does not depend on
/// the batch around it.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bmicro<const MT: usize, const FIRST: bool>(wp: *const f32, nk: usize, x: *const f32, xs: usize, o: *mut f32, os: usize) {
    let mut a = [[_mm256_setzero_ps(); 2]; MT];
    if !FIRST {
        for (t, a) in a.iter_mut().enumerate() {
            a[0] = _mm256_loadu_ps(o.add(t * os));
            a[1] = _mm256_loadu_ps(o.add(t * os + 8));
        }
    }
    for k in 0..nk {
        let w0 = _mm256_load_ps(wp.add(k * BR));
        let w1 = _mm256_load_ps(wp.add(k * BR + 8));
        for (t, a) in a.iter_mut().enumerate() {
            let xb = _mm256_broadcast_ss(&*x.add(t * xs + k));
            a[0] = _mm256_fmadd_ps(w0, xb, a[0]);
            a[1] = _mm256_fmadd_ps(w1, xb, a[1]);
        }
    }
    for (t, a) in a.iter().enumerate() {
        _mm256_storeu_ps(o.add(t * os), a[0]);
        _mm256_storeu_ps(o.add(t * os + 8), a[1]);
    }
}

/// `bmicro` on 16 lanes (AVX-512 F): the panel's 16 rows of weight `k` are one vector, so a
/// token takes one FMA per `k` instead of two, and a tile takes up to `BT16` tokens (more
/// chains in flight, the panel read fewer times). Each lane runs the same FMA chain in K order
/// as in `bmicro`: the same bits.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn bmicro16<const MT: usize, const FIRST: bool>(wp: *const f32, nk: usize, x: *const f32, xs: usize, o: *mut f32,
                                                       os: usize) {
    let mut a = [_mm512_setzero_ps(); MT];
    if !FIRST {
        for (t, a) in a.iter_mut().enumerate() {
            *a = _mm512_loadu_ps(o.add(t * os));
        }
    }
    for k in 0..nk {
        let w = _mm512_load_ps(wp.add(k * BR));
        for (t, a) in a.iter_mut().enumerate() {
            *a = _mm512_fmadd_ps(w, _mm512_set1_ps(*x.add(t * xs + k)), *a);
        }
    }
    for (t, a) in a.iter().enumerate() {
        _mm512_storeu_ps(o.add(t * os), *a);
    }
}

/// Tokens per tile of the broadcast path on 16 lanes (on 8: 6).
const BT16: usize = 12;

#[repr(align(64))]
struct BPanel([f32; BR * BKC]);

/// Rows `r0..r1` against 16+ token rows by outer products. Per group of 16 rows and K chunk
/// (at most 320 weights) the weights are decoded once into a K-major panel in L1 (20 KB):
/// weight `k` of the 16 rows is one 64-byte line. Every tile of up to 6 tokens then runs a
/// 6 x 16 register tile over it: per `k`, 2 panel loads and 6 broadcasts of `x` feed 12
/// FMAs, and each output is a single FMA chain in K order (the register tiles of `rows`
/// keep 8 partial sums per output instead: equal to rounding). The output rows hold the
/// partial sums between chunks, written as whole 16-float runs. The next chunk's weight
/// bytes are prefetched into L2 while a chunk is multiplied.
/// Faster than the earlier dot-product panel and register tiles at 16+ tokens (bench/RESULTS.md, "Sixth
/// session"). With AVX-512 F the tiles take up to 12 tokens, one 16-lane FMA per token and
/// `k` (`bmicro16`: the same bits; 1.4-1.9x on the embedded model's products from 6 tokens
/// on, bench/RESULTS.md, 2026-12-03, eighth session).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_bcast<F: Fmt>(w: &QMatrix, x: Mat, out: Mat, r0: usize, r1: usize) {
    let (bw, bb) = (F::Q.block_weights(), F::Q.block_bytes());
    let nb = w.cols / bw;
    let kcb = nb.div_ceil(nb.div_ceil((BKC / bw).max(1))); // blocks per chunk, chunks of equal size
    let rb = w.row_bytes();
    let base = w.data.as_ptr();
    let mut panel = BPanel([0f32; BR * BKC]);
    let wp = panel.0.as_mut_ptr();
    // a partial group's outputs pass through here, one token tile at a time: [token][16]
    let mut part = [0f32; BT16 * BR];
    let pp = part.as_mut_ptr();
    // token tiles of equal size (32 tokens: 6 6 5 5 5 5), at most 6; on 16 lanes at most 12
    let wide = crate::isa::has_avx512f();
    let ntiles = x.rows.div_ceil(if wide { BT16 } else { 6 });
    let mut g0 = r0;
    while g0 < r1 {
        let nr = BR.min(r1 - g0);
        let row = base.add(g0 * rb);
        let mut c0 = 0;
        while c0 < nb {
            let cb = kcb.min(nb - c0);
            decode_kmajor::<F>(row, rb, nr, c0, cb, wp, w.x8);
            let (nrow, nc0, nnr) = if c0 + cb < nb { (row, c0 + cb, nr) } else { (row.add(BR * rb), 0, BR.min(r1 - g0 - nr)) };
            let nbytes = kcb.min(nb - nc0) * bb;
            if w.x8 {
                // each group of 8 rows holds the chunk's blocks in one run of 8 x nbytes
                for h in 0..nnr.div_ceil(8) {
                    let q = nrow.add(8 * h * rb + nc0 * 8 * bb);
                    for o in (0..8 * nbytes).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T1>(q.add(o) as *const i8);
                    }
                }
            } else {
                for r in 0..nnr {
                    let q = nrow.add(r * rb + nc0 * bb);
                    for o in (0..nbytes).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T1>(q.add(o) as *const i8);
                    }
                }
            }
            let nk = cb * bw;
            let first = c0 == 0;
            let mut t0 = 0;
            for i in 0..ntiles {
                let mt = (x.rows - t0).div_ceil(ntiles - i);
                let xp = x.ptr.add(t0 * x.stride + c0 * bw);
                let full = nr == BR;
                let (op, os) = if full { (out.ptr.add(t0 * out.stride + g0), out.stride) } else { (pp, BR) };
                if !full && !first {
                    for t in 0..mt {
                        std::ptr::copy_nonoverlapping(out.row(t0 + t).add(g0), pp.add(t * BR), nr);
                    }
                }
                macro_rules! go {
                    ($k:ident; $($n:literal),*) => {
                        match (mt, first) {
                            $(($n, true) => $k::<$n, true>(wp, nk, xp, x.stride, op, os),
                              ($n, false) => $k::<$n, false>(wp, nk, xp, x.stride, op, os),)*
                            _ => unreachable!(),
                        }
                    };
                }
                if wide {
                    go!(bmicro16; 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12);
                } else {
                    go!(bmicro; 1, 2, 3, 4, 5, 6);
                }
                if !full {
                    for t in 0..mt {
                        std::ptr::copy_nonoverlapping(pp.add(t * BR), out.row(t0 + t).add(g0), nr);
                    }
                }
                t0 += mt;
            }
            c0 += cb;
        }
        g0 += nr;
    }
}

/// # Safety
/// Views checked by the caller; the CPU has AVX2, FMA and F16C.
pub(crate) unsafe fn matmul_rows(w: &QMatrix, x: Mat, out: Mat, r0: usize, r1: usize) {
    if w.x8 && x.rows < super::x8_bcast_min_tokens() {
        return match (w.qtype, x.rows) {
            (QType::Q8_0, 1) => gemv_x8::<Q80>(w, x.ptr, out.ptr, r0, r1),
            (QType::Q4_0, 1) => gemv_x8::<Q40>(w, x.ptr, out.ptr, r0, r1),
            (QType::Q4_1, 1) => gemv_x8::<Q41>(w, x.ptr, out.ptr, r0, r1),
            (QType::Q8_0, _) => rows_x8::<Q80>(w, x, out, r0, r1),
            (QType::Q4_0, _) => rows_x8::<Q40>(w, x, out, r0, r1),
            (QType::Q4_1, _) => rows_x8::<Q41>(w, x, out, r0, r1),
            (q, _) => unreachable!("{} is not interleavable", q.name()),
        };
    }
    if x.rows == 1 {
        return with_fmt!(w.qtype, F => gemv::<F>(w, x.ptr, out.ptr, r0, r1));
    }
    if x.rows >= BCAST_MIN_TOKENS || w.x8 {
        return with_fmt!(w.qtype, F => rows_bcast::<F>(w, x, out, r0, r1));
    }
    with_fmt!(w.qtype, F => rows::<F>(w, x, out, r0, r1))
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
    with_fmt!(q, F => dequant::<F>(row, out))
}
