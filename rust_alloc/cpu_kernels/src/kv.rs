//! The element types a paged K/V cache may hold: `f32`, or IEEE half precision (`F16`, half
//! the memory: twice the tokens in the same budget). Attention converts to f32 as it reads;
//! writing rounds to nearest, ties to even.

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

/// An element of a K/V cache.
pub trait KvElem: Copy + Send + Sync + 'static {
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

impl KvElem for f32 {
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

impl KvElem for F16 {
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

/// Write `src` into `dst`, converting (8 at a time with AVX2 + F16C, the same bits).
#[inline]
pub fn store_row<E: KvElem>(dst: &mut [E], src: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::ops::has_avx2() {
        // SAFETY: the CPU has AVX2 and F16C.
        unsafe { store_row_avx2(dst, src) };
        return;
    }
    store_row_scalar(dst, src);
}

fn store_row_scalar<E: KvElem>(dst: &mut [E], src: &[f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = E::from_f32(*s);
    }
}

/// # Safety
/// The CPU must have AVX2 and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_row_avx2<E: KvElem>(dst: &mut [E], src: &[f32]) {
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
