//! The integer product on AVX2 (no VNNI): `vpmaddubsw` (unsigned codes × signed
//! activations, pairs summed to i16) then `vpmaddwd` by ones (to i32), 8 rows per 256-bit
//! register, the 16 rows of a group in two halves. Codes of up to 6 bits never saturate
//! the i16 pairs; Q8_0's 8-bit codes go through the sign trick instead (|w| times x with
//! w's sign) and get `128 · Σ qx` added back, so every path sums the same integers.

use std::arch::x86_64::*;

use super::{Codes, Layout, Out, QAct, RMatrix, ROWS, TILE};
use crate::quant::QType;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x8(p: *const u8) -> __m256 { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bytes8(p: *const u8, signed: bool) -> __m256 {
    let b = _mm_loadl_epi64(p as *const __m128i);
    _mm256_cvtepi32_ps(if signed { _mm256_cvtepi8_epi32(b) } else { _mm256_cvtepu8_epi32(b) })
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn neg(v: __m256) -> __m256 { _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN))) }

/// (a, b) of rows `8h .. 8h + 8` of a group, for its halves of 16 (`super::group_ab`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scales(l: &Layout, rg: *const u8, at: usize, head: usize, h: usize) -> [(__m256, __m256); 2] {
    let s = rg.add(at + l.code_bytes());
    match l.qtype {
        QType::Q4_0 | QType::Q5_0 | QType::Q8_0 => {
            let d = f16x8(s.add(16 * h));
            let z = match l.qtype { QType::Q4_0 => -8.0, QType::Q5_0 => -16.0, _ => -128.0 };
            [(d, _mm256_mul_ps(d, _mm256_set1_ps(z))); 2]
        }
        QType::Q4_1 | QType::Q5_1 => [(f16x8(s.add(16 * h)), f16x8(s.add(32 + 16 * h))); 2],
        QType::Q4_K | QType::Q5_K => {
            let (d, dmin) = (f16x8(rg.add(head + 16 * h)), f16x8(rg.add(head + 32 + 16 * h)));
            let a = _mm256_mul_ps(d, bytes8(s.add(8 * h), false));
            [(a, neg(_mm256_mul_ps(dmin, bytes8(s.add(16 + 8 * h), false)))); 2]
        }
        QType::Q6_K => {
            let d = f16x8(rg.add(head + 16 * h));
            let a0 = _mm256_mul_ps(d, bytes8(s.add(8 * h), true));
            let a1 = _mm256_mul_ps(d, bytes8(s.add(16 + 8 * h), true));
            let m32 = _mm256_set1_ps(-32.0);
            [(a0, _mm256_mul_ps(a0, m32)), (a1, _mm256_mul_ps(a1, m32))]
        }
        QType::F16 | QType::BF16 => unreachable!(),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sh16(v: __m256i, left: i32) -> __m256i {
    if left >= 0 { _mm256_sll_epi16(v, _mm_cvtsi32_si128(left)) } else { _mm256_srl_epi16(v, _mm_cvtsi32_si128(-left)) }
}

/// Chunks `j` and `j + 4` (rows `8h .. 8h + 8`) of a group's 4-, 5- or 6-bit codes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pair(kind: Codes, cb: *const u8, h: usize, j: usize) -> (__m256i, __m256i) {
    let ld = |o: usize| _mm256_loadu_si256(cb.add(o + 32 * h) as *const __m256i);
    let m0f = _mm256_set1_epi8(0x0f);
    let v = ld(64 * j);
    let (mut lo, mut hi) = (_mm256_and_si256(v, m0f), _mm256_and_si256(_mm256_srli_epi16::<4>(v), m0f));
    match kind {
        Codes::Five => {
            let (hb, m10) = (ld(256), _mm256_set1_epi8(0x10));
            lo = _mm256_or_si256(lo, _mm256_and_si256(sh16(hb, 4 - j as i32), m10));
            hi = _mm256_or_si256(hi, _mm256_and_si256(sh16(hb, -(j as i32)), m10));
        }
        Codes::Six => {
            let m30 = _mm256_set1_epi8(0x30);
            lo = _mm256_or_si256(lo, _mm256_and_si256(sh16(ld(256), 4 - 2 * j as i32), m30));
            hi = _mm256_or_si256(hi, _mm256_and_si256(sh16(ld(320), 4 - 2 * j as i32), m30));
        }
        _ => {}
    }
    (lo, hi)
}

/// The largest |x| of `n` (a multiple of 32) floats from `x` (`super::amax_scalar`).
///
/// # Safety
/// `x` must point at `n` floats; the CPU must have AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn amax(x: *const f32, n: usize) -> f32 {
    let sign = _mm256_set1_ps(-0.0);
    let mut m = _mm256_setzero_ps();
    for i in (0..n).step_by(8) {
        m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x.add(i))), m);
    }
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
}

/// One block of 32 activations to codes (`super::codes_scalar`, the same integers).
///
/// # Safety
/// `x` must point at 32 floats and `q` at room for 32 bytes; the CPU must have AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn codes32(x: *const f32, q: *mut i8, inv: f32) -> (i32, i32) {
    let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x.add(8 * i)));
    let inv = _mm256_set1_ps(inv);
    let (lo, hi) = (_mm256_set1_epi32(-127), _mm256_set1_epi32(127));
    let r: [__m256i; 4] = std::array::from_fn(|i| {
        let f = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(v[i], inv));
        _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(f), lo), hi)
    });
    // packs interleave the 128-bit lanes: 32-bit groups come out as 0 2 4 6 1 3 5 7
    let b = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
    let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q as *mut __m256i, b);
    let hsum = |v: __m256i| {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)))
    };
    (hsum(_mm256_add_epi32(r[0], r[1])), hsum(_mm256_add_epi32(r[2], r[3])))
}

/// A group's integer sums `i` of rows `8h .. 8h + 8` (block `bt` of a token) into its running
/// sums, as every path adds them: a K-quant's into its superblock's `sum` (`a·i + b·Σ`), the
/// other formats' into `acc` (`(a·i)·d + b·ds`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_group(kq: bool, (a, b): (__m256, __m256), i: __m256i, x: &QAct, bt: usize, sum: &mut __m256,
                    acc: &mut __m256) {
    if kq {
        *sum = _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(i), *sum);
        *sum = _mm256_fmadd_ps(b, _mm256_set1_ps(*x.sf.as_ptr().add(bt)), *sum);
    } else {
        let v = _mm256_mul_ps(a, _mm256_cvtepi32_ps(i));
        *acc = _mm256_fmadd_ps(v, _mm256_set1_ps(*x.d.as_ptr().add(bt)), *acc);
        *acc = _mm256_fmadd_ps(b, _mm256_set1_ps(*x.ds.as_ptr().add(bt)), *acc);
    }
}

/// Q6_K's group: each half's integer sum less 32·Σx of its activations, times its scale.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_group6(a: [__m256; 2], i: [__m256i; 2], x: &QAct, bt: usize, sum: &mut __m256) {
    for half in 0..2 {
        let k = _mm256_sub_epi32(i[half], _mm256_set1_epi32(*x.k16.as_ptr().add(2 * bt + half)));
        *sum = _mm256_fmadd_ps(a[half], _mm256_cvtepi32_ps(k), *sum);
    }
}

/// After a superblock's last group (K-quants, `g`): its sums times each token's scale into
/// `acc`, from zero again.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn end_superblock<const N: usize>(sbg: usize, g: usize, b0: usize, x: &QAct, sum: &mut [__m256; N],
                                         acc: &mut [__m256; N]) {
    if sbg > 1 && g % sbg == sbg - 1 {
        let bs = b0 + TILE * (g + 1 - sbg);
        for t in 0..N {
            acc[t] = _mm256_fmadd_ps(sum[t], _mm256_set1_ps(*x.d.as_ptr().add(bs + t)), acc[t]);
            sum[t] = _mm256_setzero_ps();
        }
    }
}

/// `N` tokens of rows `8h .. 8h + 8` of one row group, for the `H` halves from `h0` (one
/// token takes both halves in one pass: each broadcast of its activations serves 16 rows).
/// K-quants sum a superblock's groups in `sum`, then add it times the token's scale
/// (`super`'s doc).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const N: usize, const Q: u8, const H: usize, const P: bool>(
    l: &Layout, rg: *const u8, pre: *const __m256i, a: &QAct, t0: usize, h0: usize, acc: &mut [[__m256; N]; H],
) {
    // the format a constant: its code kind, scales and superblock offsets fold away (the
    // same integers; a format read at run time left this loop branchy and spilling)
    let l = &Layout { qtype: super::qt(Q), rows: l.rows, cols: l.cols };
    let nb = l.groups();
    let kind = l.codes();
    let q6 = l.qtype == QType::Q6_K;
    let sbg = l.act_groups();
    let ones = _mm256_set1_epi16(1);
    let b0 = a.at(t0, 0);   // t0 .. t0 + N lie in one tile: token t0 + t of group g is block b0 + TILE g + t
    // the first tile's first half-pass asks for the bytes ahead (avx512.rs `tile`)
    let pf = if t0 == 0 && h0 == 0 && !P { super::decode_prefetch() } else { 0 };
    let step = l.rg_bytes().div_ceil(nb);
    let mut sum = [[_mm256_setzero_ps(); N]; H];   // K-quants: the superblock's so far
    for g in 0..nb {
        let (at, head) = l.group_at(g);
        if pf > 0 {
            super::prefetch(rg.wrapping_add(at + pf), step);
        }
        let cb = rg.add(at);
        let bg = b0 + TILE * g;
        let qx = a.q.as_ptr().add(32 * bg) as *const u8;
        let x4 = |t: usize, k: usize| _mm256_set1_epi32(std::ptr::read_unaligned(qx.add(32 * t + k) as *const i32));
        let dot = |c: __m256i, x: __m256i| _mm256_madd_epi16(_mm256_maddubs_epi16(c, x), ones);
        let mut i0 = [[_mm256_setzero_si256(); N]; H];   // Q6_K: first half; else the whole group
        let mut i1 = [[_mm256_setzero_si256(); N]; H];   // Q6_K: second half
        if kind == Codes::Eight {
            for c in 0..8 {
                let xs: [__m256i; N] = std::array::from_fn(|t| x4(t, 4 * c));
                for (hh, i) in i0.iter_mut().enumerate() {
                    let w = _mm256_xor_si256(_mm256_loadu_si256(cb.add(64 * c + 32 * (h0 + hh)) as *const __m256i),
                                             _mm256_set1_epi8(-128));
                    let aw = _mm256_abs_epi8(w);
                    for (it, x) in i.iter_mut().zip(&xs) {
                        *it = _mm256_add_epi32(*it, dot(aw, _mm256_sign_epi8(*x, w)));
                    }
                }
            }
            for t in 0..N {   // Σ (w + 128)·qx, as the other paths sum it
                let s = _mm256_set1_epi32(128 * *a.s.as_ptr().add(bg + t));
                for i in i0.iter_mut() {
                    i[t] = _mm256_add_epi32(i[t], s);
                }
            }
        } else {
            // the pairs' i16 sums added up in i16 as far as they cannot overflow (|x| <= 127:
            // a pair of 4-bit codes sums to 3,810 at most, of 5-bit 7,874, of 6-bit 16,002),
            // then widened to i32 once (`vpmaddwd` by ones): the same integers, fewer multiplies
            let every = match kind { Codes::Four => 4, _ => 2 };
            let mut s0 = [[_mm256_setzero_si256(); N]; H];
            let mut s1 = [[_mm256_setzero_si256(); N]; H];
            let widen = |v: __m256i| _mm256_madd_epi16(v, ones);
            for j in 0..4 {
                let xs: [(__m256i, __m256i); N] = std::array::from_fn(|t| (x4(t, 4 * j), x4(t, 4 * j + 16)));
                for hh in 0..H {
                    let (lo, hi) = if P {
                        let v = pre.add(PRE_VECS * (2 * g + h0 + hh) + 2 * j);
                        (_mm256_load_si256(v), _mm256_load_si256(v.add(1)))
                    } else {
                        pair(kind, cb, h0 + hh, j)
                    };
                    for t in 0..N {
                        let (p, q) = (_mm256_maddubs_epi16(lo, xs[t].0), _mm256_maddubs_epi16(hi, xs[t].1));
                        if q6 {
                            s0[hh][t] = _mm256_add_epi16(s0[hh][t], p);
                            s1[hh][t] = _mm256_add_epi16(s1[hh][t], q);
                        } else {
                            s0[hh][t] = _mm256_add_epi16(s0[hh][t], _mm256_add_epi16(p, q));
                        }
                        if j % every == every - 1 {
                            i0[hh][t] = _mm256_add_epi32(i0[hh][t], widen(s0[hh][t]));
                            s0[hh][t] = _mm256_setzero_si256();
                            if q6 {
                                i1[hh][t] = _mm256_add_epi32(i1[hh][t], widen(s1[hh][t]));
                                s1[hh][t] = _mm256_setzero_si256();
                            }
                        }
                    }
                }
            }
        }
        for hh in 0..H {
            let ab = if P {
                let v = pre.add(PRE_VECS * (2 * g + h0 + hh) + 8) as *const __m256;
                [(_mm256_load_ps(v as *const f32), _mm256_load_ps(v.add(1) as *const f32)),
                 (_mm256_load_ps(v.add(2) as *const f32), _mm256_load_ps(v.add(3) as *const f32))]
            } else {
                scales(l, rg, at, head, h0 + hh)
            };
            let (acc, sum) = (&mut acc[hh], &mut sum[hh]);
            for t in 0..N {
                if q6 {
                    add_group6([ab[0].0, ab[1].0], [i0[hh][t], i1[hh][t]], a, bg + t, &mut sum[t]);
                } else {
                    add_group(sbg > 1, ab[0], i0[hh][t], a, bg + t, &mut sum[t], &mut acc[t]);
                }
            }
            end_superblock(sbg, g, b0, a, sum, acc);   // (one loop over the groups: avx512.rs `tile`)
        }
    }
}

/// `tile` over codes unpacked at `pre` (`unpack`; 4-bit codes and Q6_K's; 5-bit codes take
/// `tile`'s, whose i16 sums hold 4 products): each code vector
/// loaded once for the `N` tokens, each broadcast of a token's activations serving the `H`
/// halves, every product added straight into an i16 sum, then `tile`'s float operations in
/// its order (the same bits). A 4-bit pair sums to 3,810 at most: one i16 sum takes a group's
/// 8 products, widened once. A 6-bit pair to 16,002: an i16 sum takes two chunks' products of
/// one half of the group (its own scale), widened into that half's i32 sum.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_pre<const N: usize, const Q: u8, const H: usize>(
    l: &Layout, pre: *const __m256i, a: &QAct, t0: usize, h0: usize, acc: &mut [[__m256; N]; H],
) {
    let l = &Layout { qtype: super::qt(Q), rows: l.rows, cols: l.cols };
    let q6 = l.qtype == QType::Q6_K;
    let (nb, sbg) = (l.groups(), l.act_groups());
    let ones = _mm256_set1_epi16(1);
    let b0 = a.at(t0, 0);
    let mut sum = [[_mm256_setzero_ps(); N]; H];
    for g in 0..nb {
        let bg = b0 + TILE * g;
        let qx = a.q.as_ptr().add(32 * bg) as *const u8;
        let v = pre.add(PRE_VECS * (2 * g + h0));
        let scale = |hh: usize, k: usize| _mm256_load_ps(v.add(PRE_VECS * hh + 8 + k) as *const f32);
        if q6 {
            let mut i = [[[_mm256_setzero_si256(); 2]; N]; H];
            for jp in 0..2 {
                for half in 0..2 {
                    let mut s = [[_mm256_setzero_si256(); N]; H];
                    for j in 2 * jp..2 * jp + 2 {
                        let c: [__m256i; H] = std::array::from_fn(|hh| _mm256_load_si256(v.add(PRE_VECS * hh + 2 * j + half)));
                        for t in 0..N {
                            let x = _mm256_set1_epi32(std::ptr::read_unaligned(qx.add(32 * t + 4 * j + 16 * half) as *const i32));
                            for hh in 0..H {
                                s[hh][t] = _mm256_add_epi16(s[hh][t], _mm256_maddubs_epi16(c[hh], x));
                            }
                        }
                    }
                    for hh in 0..H {
                        for t in 0..N {
                            i[hh][t][half] = _mm256_add_epi32(i[hh][t][half], _mm256_madd_epi16(s[hh][t], ones));
                        }
                    }
                }
            }
            for hh in 0..H {
                let sa = [scale(hh, 0), scale(hh, 2)];
                let (acc, sum) = (&mut acc[hh], &mut sum[hh]);
                for t in 0..N {
                    add_group6(sa, i[hh][t], a, bg + t, &mut sum[t]);
                }
                end_superblock(sbg, g, b0, a, sum, acc);
            }
        } else {
            let mut s = [[_mm256_setzero_si256(); N]; H];
            for j in 0..4 {
                for half in 0..2 {
                    let c: [__m256i; H] = std::array::from_fn(|hh| _mm256_load_si256(v.add(PRE_VECS * hh + 2 * j + half)));
                    for t in 0..N {
                        let x = _mm256_set1_epi32(std::ptr::read_unaligned(qx.add(32 * t + 4 * j + 16 * half) as *const i32));
                        for hh in 0..H {
                            s[hh][t] = _mm256_add_epi16(s[hh][t], _mm256_maddubs_epi16(c[hh], x));
                        }
                    }
                }
            }
            for hh in 0..H {
                let ab = (scale(hh, 0), scale(hh, 1));
                let (acc, sum) = (&mut acc[hh], &mut sum[hh]);
                for t in 0..N {
                    let i = _mm256_madd_epi16(s[hh][t], ones);
                    add_group(sbg > 1, ab, i, a, bg + t, &mut sum[t], &mut acc[t]);
                }
                end_superblock(sbg, g, b0, a, sum, acc);   // (each half's right after its sums: 5 % faster)
            }
        }
    }
}

/// Vectors of one half (8 rows) of a group, unpacked: the codes of `pair` for j = 0..4 (lo,
/// hi each), then the scales of `scales` ((a, b) twice).
const PRE_VECS: usize = 12;

thread_local! {
    static PRE: std::cell::RefCell<Vec<__m256i>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Every group's codes and scales of one row group, both halves, at `pre` (`PRE_VECS` per
/// half, group by group).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack<const Q: u8>(l: &Layout, rg: *const u8, pre: *mut __m256i) {
    let l = &Layout { qtype: super::qt(Q), rows: l.rows, cols: l.cols };
    let kind = l.codes();
    for g in 0..l.groups() {
        let (at, head) = l.group_at(g);
        for h in 0..2 {
            let v = pre.add(PRE_VECS * (2 * g + h));
            for j in 0..4 {
                let (lo, hi) = pair(kind, rg.add(at), h, j);
                _mm256_store_si256(v.add(2 * j), lo);
                _mm256_store_si256(v.add(2 * j + 1), hi);
            }
            let ab = scales(l, rg, at, head, h);
            for (i, x) in [ab[0].0, ab[0].1, ab[1].0, ab[1].1].into_iter().enumerate() {
                _mm256_store_ps(v.add(8 + i) as *mut f32, x);
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store(o: Out, t: usize, col: usize, n: usize, v: __m256) {
    let mut tmp = [0f32; 8];
    _mm256_storeu_ps(tmp.as_mut_ptr(), v);
    std::ptr::copy_nonoverlapping(tmp.as_ptr(), o.ptr.add(t * o.stride + col), n);
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn tiles<const N: usize, const Q: u8, const P: bool>(
    l: &Layout, rg: *const u8, pre: *const __m256i, a: &QAct, t0: usize, o: Out, col: usize, nr: usize,
) {
    // Q6_K's unpacked passes: 4 tokens over one half (two i32 sums a token: 16 rows would spill)
    let six = P && super::qt(Q) == QType::Q6_K;
    if (N == 1 || (P && !six)) && nr > 8 {
        // one token, or the other passes over unpacked codes: both halves in one pass (each
        // broadcast of a token's activations serves 16 rows)
        let mut acc = [[_mm256_setzero_ps(); N]; 2];
        if P && matches!(super::qt(Q), QType::Q4_0 | QType::Q4_1 | QType::Q4_K) {
            tile_pre::<N, Q, 2>(l, pre, a, t0, 0, &mut acc);
        } else {
            tile::<N, Q, 2, P>(l, rg, pre, a, t0, 0, &mut acc);
        }
        for (h, v) in acc.iter().enumerate() {
            for (t, x) in v.iter().enumerate() {
                store(o, t0 + t, col + 8 * h, (nr - 8 * h).min(8), *x);
            }
        }
        return;
    }
    for h in 0..2 {
        let n = nr.saturating_sub(8 * h).min(8);
        if n == 0 {
            break;
        }
        let mut acc = [[_mm256_setzero_ps(); N]; 1];
        if six {
            tile_pre::<N, Q, 1>(l, pre, a, t0, h, &mut acc);
        } else {
            tile::<N, Q, 1, P>(l, rg, pre, a, t0, h, &mut acc);
        }
        for (t, v) in acc[0].iter().enumerate() {
            store(o, t0 + t, col + 8 * h, n, *v);
        }
    }
}

/// Row groups `g0..g1` of `w` against every token of `a`.
///
/// # Safety
/// `o` must hold `a.tokens` rows with room for the columns of these row groups; the CPU
/// must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn rows(w: &RMatrix, a: &QAct, o: Out, g0: usize, g1: usize) {
    match w.layout.qtype {
        QType::Q4_0 => rows_of::<{ QType::Q4_0 as u8 }>(w, a, o, g0, g1),
        QType::Q4_1 => rows_of::<{ QType::Q4_1 as u8 }>(w, a, o, g0, g1),
        QType::Q5_0 => rows_of::<{ QType::Q5_0 as u8 }>(w, a, o, g0, g1),
        QType::Q5_1 => rows_of::<{ QType::Q5_1 as u8 }>(w, a, o, g0, g1),
        QType::Q8_0 => rows_of::<{ QType::Q8_0 as u8 }>(w, a, o, g0, g1),
        QType::Q4_K => rows_of::<{ QType::Q4_K as u8 }>(w, a, o, g0, g1),
        QType::Q5_K => rows_of::<{ QType::Q5_K as u8 }>(w, a, o, g0, g1),
        QType::Q6_K => rows_of::<{ QType::Q6_K as u8 }>(w, a, o, g0, g1),
        QType::F16 | QType::BF16 => unreachable!("no integer kernels for {}", w.layout.qtype.name()),
    }
}

/// `rows` for the format `Q` (its GGML id).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_of<const Q: u8>(w: &RMatrix, a: &QAct, o: Out, g0: usize, g1: usize) {
    let l = &w.layout;
    // tokens per pass: a pass's tokens lie in one tile of the activations (`tile`'s `b0`), so
    // its count divides TILE (a 3-token pass read the wrong blocks)
    const { assert!(TILE % 4 == 0) };   // (4 and 2 tokens a pass)
    // more than one pass over a row group's tokens: its codes unpacked and its scales made
    // once, read by every pass (the same vectors: the same integers and products); Q6_K's
    // 2-token passes over packed codes (4 spilled)
    let pre = l.codes() != Codes::Eight && a.tokens > 4;
    let nt = if l.qtype == QType::Q6_K && !pre { 2 } else { 4 };
    PRE.with(|buf| {
        let mut buf = buf.borrow_mut();
        if pre && buf.len() < PRE_VECS * 2 * l.groups() {
            buf.resize(PRE_VECS * 2 * l.groups(), _mm256_setzero_si256());
        }
        let pp = buf.as_mut_ptr();
        for rgi in g0..g1 {
            let rg = w.rg(rgi).as_ptr();
            let nr = (l.rows - rgi * ROWS).min(ROWS);
            if pre {
                unpack::<Q>(l, rg, pp);
            }
            let mut t0 = 0;
            while t0 < a.tokens {
                let n = (a.tokens - t0).min(nt);
                let col = rgi * ROWS;
                match (n, pre) {
                    (1, false) => tiles::<1, Q, false>(l, rg, pp, a, t0, o, col, nr),
                    (2, false) => tiles::<2, Q, false>(l, rg, pp, a, t0, o, col, nr),
                    (3, false) => tiles::<3, Q, false>(l, rg, pp, a, t0, o, col, nr),
                    (_, false) => tiles::<4, Q, false>(l, rg, pp, a, t0, o, col, nr),
                    (1, true) => tiles::<1, Q, true>(l, rg, pp, a, t0, o, col, nr),
                    (2, true) => tiles::<2, Q, true>(l, rg, pp, a, t0, o, col, nr),
                    (3, true) => tiles::<3, Q, true>(l, rg, pp, a, t0, o, col, nr),
                    (_, true) => tiles::<4, Q, true>(l, rg, pp, a, t0, o, col, nr),
                }
                t0 += n;
            }
        }
    });
}
