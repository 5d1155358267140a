//! The element types a paged K/V cache may hold: `f32`; IEEE half precision (`F16`, half
//! the memory: twice the tokens in the same budget), rounded to nearest, ties to even; or
//! q8_0 (`i8` units: 32 values as bytes and one half-precision scale, 1.0625 bytes a value,
//! 1.88 times the tokens of f16). Attention converts to f32 as it reads, from the cache
//! itself: there is no dequantized copy.
//!
//! A q8_0 cache holds each head row turned by an orthonormal Walsh-Hadamard rotation (over
//! chunks of 64 values, or 32): an outlier channel's energy spreads over its chunk, so one
//! large value no longer sets the scale that all 31 others are quantized with. Attention over
//! it turns the query the same way (q . k = Hq . Hk) and the output back (H is its own
//! inverse): the public kernels take and give values in the model's own space.
//!
//! The kernels address a cache as rows: a slot holds one row per KV head, and a head row of
//! `d` values takes `E::units(d)` elements of the cache (`d` for f32 and f16; for q8_0 the
//! `d` value bytes, then `d / 32` scales of 2 bytes each, little-endian).

pub use half::f16 as F16;

use crate::quant::f16_to_f32;

/// f32 -> binary16, round to nearest even (overflow to ±inf, NaN stays NaN).
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if man != 0 { 0x200 | (man >> 13) as u16 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        // subnormal: the implicit bit joins the mantissa, shifted right by 1 - e more
        let m = man | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let rest = m & ((1 << shift) - 1);
        let mut out = m >> shift;
        if rest > half || (rest == half && out & 1 == 1) {
            out += 1;
        }
        return sign | out as u16;
    }
    let mut out = ((e as u32) << 10) | (man >> 13);
    let rest = man & 0x1fff;
    if rest > 0x1000 || (rest == 0x1000 && out & 1 == 1) {
        out += 1; // may carry into the exponent: still right (up to inf)
    }
    sign | out as u16
}

/// A K/V cache element that holds one value by itself (f32, F16).
pub trait KvScalar: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// 8 consecutive elements as f32 lanes (AVX2 + F16C).
    ///
    /// # Safety
    /// `p` must point at 8 readable elements and the CPU must have AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// 8 f32 lanes into 8 consecutive elements, as `from_f32` converts them (AVX2 + F16C).
    ///
    /// # Safety
    /// `p` must point at 8 writable elements and the CPU must have AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn store8(p: *mut Self, v: std::arch::x86_64::__m256);
}

impl KvScalar for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 { self }
    #[inline(always)]
    fn from_f32(x: f32) -> Self { x }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 { std::arch::x86_64::_mm256_loadu_ps(p) }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn store8(p: *mut Self, v: std::arch::x86_64::__m256) { std::arch::x86_64::_mm256_storeu_ps(p, v) }
}

impl KvScalar for F16 {
    #[inline(always)]
    fn to_f32(self) -> f32 { f16_to_f32(self.to_bits()) }
    #[inline(always)]
    fn from_f32(x: f32) -> Self { F16::from_bits(f32_to_f16(x)) }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn store8(p: *mut Self, v: std::arch::x86_64::__m256) {
        use std::arch::x86_64::*;
        // F16C rounds to nearest even as `f32_to_f16` does (NaNs: the same quiet payload)
        _mm_storeu_si128(p as *mut __m128i, _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v));
    }
}

/// What the attention kernels and `rope_write_kv` need of a cache's element type: the size
/// of a head row, reading value `i` of a head row (one, or 8 as f32 lanes) and writing the
/// head rows of a slot.
pub trait KvElem: Copy + Send + Sync + 'static {
    /// Its name in error messages and in Python (`f32`, `f16`, `q8_0`).
    const NAME: &'static str;
    /// Whether head rows are stored turned by `hadamard` (the kernels turn q and the output).
    const ROTATED: bool = false;
    /// Elements of the cache one head row of `d` values takes.
    fn units(d: usize) -> usize;
    /// Whether head rows of `d` values can be stored.
    fn supports(d: usize) -> bool;
    /// Value `i` of the head row of `d` values at `row`.
    ///
    /// # Safety
    /// `row` must point at a whole head row (`units(d)` elements) and `i < d`.
    unsafe fn get(row: *const Self, i: usize, d: usize) -> f32;
    /// Values `i .. i + 8` of the head row at `row` as f32 lanes (`i % 8 == 0`).
    ///
    /// # Safety
    /// As `get`, `i + 8 <= d`, and the CPU must have AVX2 and F16C.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(row: *const Self, i: usize, d: usize) -> std::arch::x86_64::__m256;
    /// Write the head rows of one slot: `src` holds `n` heads of `d` values, `dst` the `n`
    /// head rows (`n * units(d)` elements).
    fn store_heads(dst: &mut [Self], src: &[f32], d: usize);
    /// The dot product of `q` (`8 * NV` values) and the head row at `row`, as 8 lanes to sum.
    ///
    /// # Safety
    /// As `load8` for every `i < 8 * NV = d`; `q` readable for `d` values.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot<const NV: usize>(q: *const f32, row: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let mut acc = _mm256_mul_ps(_mm256_loadu_ps(q), Self::load8(row, 0, 8 * NV));
        for j in 1..NV {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(8 * j)), Self::load8(row, 8 * j, 8 * NV), acc);
        }
        acc
    }
    /// `acc += p * row` over the head row at `row` (`8 * NV` values).
    ///
    /// # Safety
    /// As `dot`.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn mad<const NV: usize>(acc: &mut [std::arch::x86_64::__m256; NV], p: f32, row: *const Self) {
        use std::arch::x86_64::*;
        let pv = _mm256_set1_ps(p);
        for (j, r) in acc.iter_mut().enumerate() {
            *r = _mm256_fmadd_ps(pv, Self::load8(row, 8 * j, 8 * NV), *r);
        }
    }
}

macro_rules! scalar_kv {
    ($t:ty, $name:literal) => {
        impl KvElem for $t {
            const NAME: &'static str = $name;
            #[inline(always)]
            fn units(d: usize) -> usize { d }
            fn supports(_: usize) -> bool { true }
            #[inline(always)]
            unsafe fn get(row: *const Self, i: usize, _: usize) -> f32 { (*row.add(i)).to_f32() }
            #[cfg(target_arch = "x86_64")]
            #[inline(always)]
            unsafe fn load8(row: *const Self, i: usize, _: usize) -> std::arch::x86_64::__m256 {
                <$t as KvScalar>::load8(row.add(i))
            }
            #[inline]
            fn store_heads(dst: &mut [Self], src: &[f32], _: usize) { store_row(dst, src) }
        }
    };
}
scalar_kv!(f32, "f32");
scalar_kv!(F16, "f16");

/// Values per q8_0 block (one scale each).
pub const Q8_BLOCK: usize = 32;

/// q8_0: the cache holds `i8` units. A head row of `d` values (a multiple of 32) is its `d`
/// quantized values, then `d / 32` half-precision scales (2 bytes each, little-endian): value
/// `i` is `row[i] * scale[i / 32]`, and the row is the written row turned by `hadamard`.
/// Writing a block of 32 takes its largest magnitude over 127 as the scale, rounded to half
/// precision, and rounds each value over it to the nearest integer (at most half a step off:
/// |error| <= scale / 2).
impl KvElem for i8 {
    const NAME: &'static str = "q8_0";
    const ROTATED: bool = true;
    #[inline(always)]
    fn units(d: usize) -> usize { d + d / Q8_BLOCK * 2 }
    fn supports(d: usize) -> bool { d > 0 && d % Q8_BLOCK == 0 }
    #[inline(always)]
    unsafe fn get(row: *const Self, i: usize, d: usize) -> f32 {
        *row.add(i) as f32 * q8_scale(row, i, d)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(row: *const Self, i: usize, d: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let h = std::ptr::read_unaligned(row.add(d + i / Q8_BLOCK * 2) as *const u16);
        let s = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)));
        let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(row.add(i) as *const __m128i)));
        _mm256_mul_ps(v, s)
    }
    /// Per block of 32: the plain dot product of q and the integers, then one multiply by the
    /// block's scale (not one per 8 values).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot<const NV: usize>(q: *const f32, row: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let d = 8 * NV;
        let mut total = _mm256_setzero_ps();
        for b in 0..NV / 4 {
            let mut acc = _mm256_setzero_ps();
            for j in 4 * b..4 * b + 4 {
                let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(row.add(8 * j) as *const __m128i)));
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(8 * j)), v, acc);
            }
            total = _mm256_fmadd_ps(acc, _mm256_set1_ps(q8_scale(row, 32 * b, d)), total);
        }
        total
    }
    /// Per block of 32: p times the block's scale once, then the integers.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn mad<const NV: usize>(acc: &mut [std::arch::x86_64::__m256; NV], p: f32, row: *const Self) {
        use std::arch::x86_64::*;
        let d = 8 * NV;
        for b in 0..NV / 4 {
            let ps = _mm256_set1_ps(p * q8_scale(row, 32 * b, d));
            for j in 4 * b..4 * b + 4 {
                let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(row.add(8 * j) as *const __m128i)));
                acc[j] = _mm256_fmadd_ps(ps, v, acc[j]);
            }
        }
    }
    fn store_heads(dst: &mut [Self], src: &[f32], d: usize) {
        let u = Self::units(d);
        let mut turned = [0f32; 512];
        for (row, x) in dst.chunks_exact_mut(u).zip(src.chunks_exact(d)) {
            let x = {
                let t = &mut turned[..d];
                t.copy_from_slice(x);
                hadamard(t);
                &*t
            };
            let (vals, scales) = row.split_at_mut(d);
            for (b, xs) in x.chunks_exact(Q8_BLOCK).enumerate() {
                let h = q8_block(xs, &mut vals[b * Q8_BLOCK..(b + 1) * Q8_BLOCK]);
                scales[2 * b] = h as u8 as i8;
                scales[2 * b + 1] = (h >> 8) as u8 as i8;
            }
        }
    }
}

/// One q8_0 block: 32 values as integers over the returned half-precision scale (their largest
/// magnitude over 127), rounded to nearest, ties to even.
#[inline]
fn q8_block(xs: &[f32], q: &mut [i8]) -> u16 {
    let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
    let h = f32_to_f16((amax / 127.0).min(65504.0));
    let s = f16_to_f32(h);
    let inv = if s > 0.0 && s.is_finite() { 1.0 / s } else { 0.0 };
    #[cfg(target_arch = "x86_64")]
    if crate::isa::Isa::cpu() >= crate::isa::Isa::Avx2 {
        // SAFETY: the CPU has AVX2; both slices hold a whole block.
        unsafe { q8_block_avx2(xs, q, inv) };
        return h;
    }
    for (q, v) in q.iter_mut().zip(xs) {
        *q = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    h
}

/// The integers of `q8_block` on 8-lane registers (the same values: the conversion rounds to
/// nearest even as `round_ties_even` does).
///
/// # Safety
/// The CPU must have AVX2; `xs` and `q` hold 32 values each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn q8_block_avx2(xs: &[f32], q: &mut [i8], inv: f32) {
    use std::arch::x86_64::*;
    assert!(xs.len() >= Q8_BLOCK && q.len() >= Q8_BLOCK);
    let (iv, hi, lo) = (_mm256_set1_ps(inv), _mm256_set1_ps(127.0), _mm256_set1_ps(-127.0));
    let n: [__m256i; 4] = std::array::from_fn(|i| {
        let v = _mm256_mul_ps(_mm256_loadu_ps(xs.as_ptr().add(8 * i)), iv);
        _mm256_cvtps_epi32(_mm256_max_ps(_mm256_min_ps(v, hi), lo))
    });
    // packs interleave the 128-bit halves: put the 4-byte groups back in order
    let b = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, b);
}

/// The rotation's chunk for head rows of `d` values (a multiple of 32): 64 values, or 32.
pub fn rot_len(d: usize) -> usize { if d % 64 == 0 { 64 } else { 32 } }

/// Turn a head row of `d` values (a multiple of 32) in place by the orthonormal
/// Walsh-Hadamard matrix of each chunk of `rot_len(d)` values (Sylvester's order, scaled by
/// 1 / sqrt(n)): its own inverse, so turning twice gives the row back.
pub fn hadamard(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::Isa::cpu() >= crate::isa::Isa::Avx2 {
        // SAFETY: the CPU has AVX2 and FMA.
        unsafe { hadamard_avx2(x) };
        return;
    }
    hadamard_scalar(x);
}

fn hadamard_scalar(x: &mut [f32]) {
    let n = rot_len(x.len());
    let norm = 1.0 / (n as f32).sqrt();
    for c in x.chunks_exact_mut(n) {
        let mut h = 1;
        while h < n {
            for i in (0..n).step_by(2 * h) {
                for j in i..i + h {
                    let (a, b) = (c[j], c[j + h]);
                    c[j] = a + b;
                    c[j + h] = a - b;
                }
            }
            h *= 2;
        }
        for v in c.iter_mut() {
            *v *= norm;
        }
    }
}

/// `hadamard` on 8-lane registers, the same butterflies in the same order (the same bits):
/// the stages within a register (pairs 1, 2 and 4 apart) as a lane swap and one fused
/// multiply-add by a ±1 pattern, the stages between registers as adds and subtracts.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hadamard_avx2(x: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = rot_len(x.len());
    let nv = n / 8;
    let norm = _mm256_set1_ps(1.0 / (n as f32).sqrt());
    let s1 = _mm256_setr_ps(1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0);
    let s2 = _mm256_setr_ps(1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0);
    let s4 = _mm256_setr_ps(1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0);
    for c in x.chunks_exact_mut(n) {
        let mut v = [_mm256_setzero_ps(); 8];
        for (i, r) in v.iter_mut().enumerate().take(nv) {
            *r = _mm256_loadu_ps(c.as_ptr().add(8 * i));
        }
        for r in v.iter_mut().take(nv) {
            // lane j + h gets (lane j) - (lane j + h), lane j gets their sum
            *r = _mm256_fmadd_ps(*r, s1, _mm256_permute_ps::<0b10_11_00_01>(*r));
            *r = _mm256_fmadd_ps(*r, s2, _mm256_permute_ps::<0b01_00_11_10>(*r));
            *r = _mm256_fmadd_ps(*r, s4, _mm256_permute2f128_ps::<0x01>(*r, *r));
        }
        let mut h = 1;
        while h < nv {
            for i in (0..nv).step_by(2 * h) {
                for j in i..i + h {
                    let (a, b) = (v[j], v[j + h]);
                    v[j] = _mm256_add_ps(a, b);
                    v[j + h] = _mm256_sub_ps(a, b);
                }
            }
            h *= 2;
        }
        for (i, r) in v.iter().enumerate().take(nv) {
            _mm256_storeu_ps(c.as_mut_ptr().add(8 * i), _mm256_mul_ps(*r, norm));
        }
    }
}

/// Rows `rows` of `x` (stride `stride`, `heads` heads of `d` values from the row's start)
/// copied into a dense `[rows.len(), heads * d]` buffer with every head turned (`hadamard`).
pub fn turned_rows(x: &[f32], stride: usize, rows: impl Iterator<Item = usize>, heads: usize, d: usize) -> Vec<f32> {
    let mut out = Vec::new();
    for r in rows {
        let start = out.len();
        out.extend_from_slice(&x[r * stride..r * stride + heads * d]);
        out[start..].chunks_exact_mut(d).for_each(hadamard);
    }
    out
}

/// The inverse of `turned_rows`: row `i` of `dense` (`heads * d` values each) turned back
/// into row `rows[i]` of `out` (stride `stride`).
pub fn turn_back_rows(dense: &[f32], out: &mut [f32], stride: usize, rows: impl Iterator<Item = usize>, heads: usize,
                      d: usize) {
    for (src, r) in dense.chunks_exact(heads * d).zip(rows) {
        let o = &mut out[r * stride..r * stride + heads * d];
        o.copy_from_slice(src);
        o.chunks_exact_mut(d).for_each(hadamard);
    }
}

/// The scale of value `i`'s block in the q8_0 head row at `row`.
#[inline(always)]
unsafe fn q8_scale(row: *const i8, i: usize, d: usize) -> f32 {
    f16_to_f32(std::ptr::read_unaligned(row.add(d + i / Q8_BLOCK * 2) as *const u16))
}

/// Write `src` into `dst`, converting (8 at a time with AVX2 + F16C, the same bits).
#[inline]
pub fn store_row<E: KvScalar>(dst: &mut [E], src: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::Isa::cpu() >= crate::isa::Isa::Avx2 {
        // SAFETY: the CPU has AVX2 and F16C.
        unsafe { store_row_avx2(dst, src) };
        return;
    }
    store_row_scalar(dst, src);
}

fn store_row_scalar<E: KvScalar>(dst: &mut [E], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = E::from_f32(*s);
    }
}

/// # Safety
/// The CPU must have AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_row_avx2<E: KvScalar>(dst: &mut [E], src: &[f32]) {
    let n = dst.len().min(src.len());
    let full = n / 8 * 8;
    for i in (0..full).step_by(8) {
        // SAFETY: i + 8 <= n elements of both slices.
        unsafe { E::store8(dst.as_mut_ptr().add(i), std::arch::x86_64::_mm256_loadu_ps(src.as_ptr().add(i))) };
    }
    store_row_scalar(&mut dst[full..n], &src[full..n]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_store_as_elements_convert_one_by_one() {
        let mut v: Vec<f32> = (0..1000).map(|i| ((i as f32) * 0.7311).sin() * 10f32.powi(i % 11 - 6)).collect();
        v.extend([f32::NAN, -f32::NAN, f32::INFINITY, -0.0, 65504.0, 65520.0, 1e-8, -6e-8, 2.98e-8, 1.0 + 2f32.powi(-11)]);
        v.extend((0..13).map(|i| f32::from_bits(0x7fc0_0001 + (i << 10))));   // NaN payloads
        for len in [v.len(), 7, 8, 21] {
            let mut got = vec![F16::from_bits(0); len];
            store_row(&mut got, &v[..len]);
            for (g, x) in got.iter().zip(&v) {
                assert_eq!(g.to_bits(), f32_to_f16(*x), "{x}");
            }
            let mut got32 = vec![0f32; len];
            store_row(&mut got32, &v[..len]);
            assert!(got32.iter().zip(&v).all(|(a, b)| a.to_bits() == b.to_bits()));
        }
    }

    #[test]
    fn q8_rows_hold_each_turned_value_within_half_a_step() {
        let d = 64;
        let mut x: Vec<f32> = (0..3 * d).map(|i| ((i as f32) * 0.913).sin() * (1.0 + (i / 32) as f32 * 3.0)).collect();
        x[64..128].fill(0.0); // a head of zeros: scales 0, every value 0
        x[5] = 40.0;          // an outlier
        let mut row = vec![0i8; 3 * <i8 as KvElem>::units(d)];
        <i8 as KvElem>::store_heads(&mut row, &x, d);
        let mut turned = x.clone();
        turned.chunks_exact_mut(d).for_each(hadamard);
        let u = <i8 as KvElem>::units(d);
        for h in 0..3 {
            let r = row[h * u..].as_ptr();
            for i in 0..d {
                let xi = turned[h * d + i];
                let blk = &turned[h * d + i / 32 * 32..][..32];
                let step = blk.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                // SAFETY: r points at a whole head row and i < d.
                let got = unsafe { <i8 as KvElem>::get(r, i, d) };
                assert!((got - xi).abs() <= step * 0.5 + step * 2e-3 + 1e-12, "head {h} value {i}: {got} vs {xi}");
                #[cfg(target_arch = "x86_64")]
                if crate::isa::Isa::cpu() >= crate::isa::Isa::Avx2 && i % 8 == 0 {
                    let mut lanes = [0f32; 8];
                    // SAFETY: the CPU has AVX2 and F16C, i + 8 <= d.
                    unsafe { std::arch::x86_64::_mm256_storeu_ps(lanes.as_mut_ptr(), <i8 as KvElem>::load8(r, i, d)) };
                    for (l, lane) in lanes.iter().enumerate() {
                        assert_eq!(lane.to_bits(), unsafe { <i8 as KvElem>::get(r, i + l, d) }.to_bits());
                    }
                }
            }
        }
        assert!(row[u..2 * u].iter().all(|&q| q == 0));
        // the vector quantizer gives the portable one's integers (ties to even)
        let xs: Vec<f32> = (0..32).map(|i| if i < 4 { 0.5 * i as f32 } else { ((i as f32) * 2.3).sin() * 9.0 }).collect();
        let (mut a, mut b) = ([0i8; 32], [0i8; 32]);
        q8_block(&xs, &mut a);
        let s = f16_to_f32(f32_to_f16(xs.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0));
        for (q, v) in b.iter_mut().zip(&xs) {
            *q = (v / s).round_ties_even().clamp(-127.0, 127.0) as i8;
        }
        assert!(a.iter().zip(&b).all(|(p, q)| (*p as i32 - *q as i32).abs() <= 1), "{a:?} vs {b:?}");
        // the vector rotation gives the portable one's bits
        for n in [32usize, 64, 96, 128, 256] {
            let v: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 3.0 + (i % 7) as f32).collect();
            let (mut a, mut b) = (v.clone(), v.clone());
            hadamard(&mut a);
            hadamard_scalar(&mut b);
            assert!(a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()), "{n}");
        }
        // the rotation: its own inverse, and it keeps lengths (chunks of 64, or of 32)
        for n in [64usize, 96, 128] {
            let v: Vec<f32> = (0..n).map(|i| (i as f32 * 1.7).cos() + if i == 3 { 9.0 } else { 0.0 }).collect();
            let mut t = v.clone();
            hadamard(&mut t);
            let (a, b) = (v.iter().map(|x| x * x).sum::<f32>(), t.iter().map(|x| x * x).sum::<f32>());
            assert!((a - b).abs() < 1e-3 * a, "{n}: {a} vs {b}");
            assert!(t.iter().fold(0f32, |m, x| m.max(x.abs())) < 5.0, "{n}: the outlier spread");
            hadamard(&mut t);
            assert!(t.iter().zip(&v).all(|(p, q)| (p - q).abs() < 1e-5), "{n}");
        }
    }

    #[test]
    fn f16_round_trip_and_rounding() {
        for h in 0..=u16::MAX {
            let x = f16_to_f32(h);
            if x.is_nan() {
                assert!(f16_to_f32(f32_to_f16(x)).is_nan());
                continue;
            }
            assert_eq!(f32_to_f16(x), h, "{h:#06x} ({x})");
        }
        // ties to even between two halfs, and overflow
        assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3c00);
        assert_eq!(f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)), 0x3c02);
        assert_eq!(f32_to_f16(65520.0), 0x7c00);
        assert_eq!(f32_to_f16(-1e-9), 0x8000);
        let mut x = -70000.0f32;
        while x < 70000.0 {   // nearest: no half closer than the one chosen
            let h = f32_to_f16(x);
            let y = f16_to_f32(h);
            if y.is_finite() {
                for n in [h.wrapping_add(1), h.wrapping_sub(1)] {
                    let z = f16_to_f32(n);
                    if z.is_finite() && (z > 0.0) == (y > 0.0) {
                        assert!((z - x).abs() >= (y - x).abs(), "{x}: {y} vs {z}");
                    }
                }
            }
            x += 0.37;
        }
    }
}
