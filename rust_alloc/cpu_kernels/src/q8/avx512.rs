//! The integer product on AVX-512 with VNNI: one `vpdpbusd` multiplies the 4 codes of each
//! of 16 rows by 4 broadcast activations of one token and adds them into 16 i32 lanes. Per
//! group of 32 the codes are decoded once (nibbles, plus high bits) into 8 vectors and
//! meet up to `NT` tokens; the group's integer sums then go through the same float steps
//! as the portable path: `acc = fma(a·I, dx, acc)`, `acc = fma(b, dxs, acc)`.

use std::arch::x86_64::*;

use super::{Codes, Layout, Out, QAct, RMatrix, ROWS, TILE};
use crate::quant::QType;

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn sh16(v: __m512i, left: i32) -> __m512i {
    if left >= 0 {
        _mm512_sll_epi16(v, _mm_cvtsi32_si128(left))
    } else {
        _mm512_srl_epi16(v, _mm_cvtsi32_si128(-left))
    }
}

/// The 8 chunks of a group's codes, unsigned bytes (chunk `c`: byte `4r + i` is row `r`'s
/// code `4c + i`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn codes(kind: Codes, cb: *const u8) -> [__m512i; 8] {
    let ld = |i: usize| _mm512_loadu_si512(cb.add(64 * i) as *const _);
    if kind == Codes::Eight {
        return std::array::from_fn(ld);
    }
    let m0f = _mm512_set1_epi8(0x0f);
    let mut c = [_mm512_setzero_si512(); 8];
    for j in 0..4 {
        let v = ld(j);
        c[j] = _mm512_and_si512(v, m0f);
        c[j + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m0f);
    }
    match kind {
        Codes::Five => {
            let (h, m10) = (ld(4), _mm512_set1_epi8(0x10));
            for (i, c) in c.iter_mut().enumerate() {   // bit i of each byte -> bit 4
                *c = _mm512_or_si512(*c, _mm512_and_si512(sh16(h, 4 - i as i32), m10));
            }
        }
        Codes::Six => {
            let (h0, h1, m30) = (ld(4), ld(5), _mm512_set1_epi8(0x30));
            for i in 0..4 {   // bits 2i, 2i+1 of each byte -> bits 4, 5
                c[i] = _mm512_or_si512(c[i], _mm512_and_si512(sh16(h0, 4 - 2 * i as i32), m30));
                c[i + 4] = _mm512_or_si512(c[i + 4], _mm512_and_si512(sh16(h1, 4 - 2 * i as i32), m30));
            }
        }
        _ => {}
    }
    c
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn f16x16(p: *const u8) -> __m512 { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn bytes16(p: *const u8, signed: bool) -> __m512 {
    let b = _mm_loadu_si128(p as *const __m128i);
    _mm512_cvtepi32_ps(if signed { _mm512_cvtepi8_epi32(b) } else { _mm512_cvtepu8_epi32(b) })
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn neg(v: __m512) -> __m512 {
    _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(i32::MIN)))
}

/// The 16 rows' (a, b) of a group: both halves' for Q6_K, else the same twice
/// (`group_ab`, vectorized: the same float operations).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn scales(l: &Layout, rg: *const u8, at: usize, head: usize) -> [(__m512, __m512); 2] {
    let s = rg.add(at + l.code_bytes());
    match l.qtype {
        QType::Q4_0 | QType::Q5_0 | QType::Q8_0 => {
            let d = f16x16(s);
            let z = match l.qtype { QType::Q4_0 => -8.0, QType::Q5_0 => -16.0, _ => -128.0 };
            [(d, _mm512_mul_ps(d, _mm512_set1_ps(z))); 2]
        }
        QType::Q4_1 | QType::Q5_1 => [(f16x16(s), f16x16(s.add(32))); 2],
        QType::Q4_K | QType::Q5_K => {
            let (d, dmin) = (f16x16(rg.add(head)), f16x16(rg.add(head + 32)));
            let a = _mm512_mul_ps(d, bytes16(s, false));
            [(a, neg(_mm512_mul_ps(dmin, bytes16(s.add(16), false)))); 2]
        }
        QType::Q6_K => {
            let d = f16x16(rg.add(head));
            let (a0, a1) = (_mm512_mul_ps(d, bytes16(s, true)), _mm512_mul_ps(d, bytes16(s.add(16), true)));
            let m32 = _mm512_set1_ps(-32.0);
            [(a0, _mm512_mul_ps(a0, m32)), (a1, _mm512_mul_ps(a1, m32))]
        }
        QType::F16 | QType::BF16 => unreachable!(),
    }
}

/// The largest |x| of `n` (a multiple of 32) floats from `x` (`super::amax_scalar`).
///
/// # Safety
/// `x` must point at `n` floats; the CPU must have AVX-512 F.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn amax(x: *const f32, n: usize) -> f32 {
    let mut m = _mm512_setzero_ps();
    for i in (0..n).step_by(16) {
        m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x.add(i))), m);
    }
    _mm512_reduce_max_ps(m)
}

/// One block of 32 activations to codes (`super::codes_scalar`, the same integers).
///
/// # Safety
/// `x` must point at 32 floats and `q` at room for 32 bytes; the CPU must have AVX-512 F/BW.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn codes32(x: *const f32, q: *mut i8, inv: f32) -> (i32, i32) {
    let (v0, v1) = (_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(16)));
    let inv = _mm512_set1_ps(inv);
    let (lo, hi) = (_mm512_set1_epi32(-127), _mm512_set1_epi32(127));
    let code = |v: __m512| {
        let r = _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(v, inv));
        _mm512_min_epi32(_mm512_max_epi32(r, lo), hi)
    };
    let (r0, r1) = (code(v0), code(v1));
    _mm_storeu_si128(q as *mut __m128i, _mm512_cvtepi32_epi8(r0));
    _mm_storeu_si128(q.add(16) as *mut __m128i, _mm512_cvtepi32_epi8(r1));
    (_mm512_reduce_add_epi32(r0), _mm512_reduce_add_epi32(r1))
}

/// `N` tokens (`t0..t0 + N`, inside one tile of the activations) of one row group.
/// Built once per format (`Q`, its GGUF id), so the decode and the scales are straight code.
/// K-quants sum a superblock's groups in `sum` and add it times the token's scale into `acc`
/// (`super`'s doc: the portable path's operations); the other formats go group by group.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<const N: usize, const Q: u8>(
    l: &Layout, rg: *const u8, a: &QAct, t0: usize, o: Out, col: usize, nr: usize,
) {
    let qtype = super::qt(Q);
    let kind = match qtype {
        QType::Q4_0 | QType::Q4_1 | QType::Q4_K => Codes::Four,
        QType::Q5_0 | QType::Q5_1 | QType::Q5_K => Codes::Five,
        QType::Q6_K => Codes::Six,
        _ => Codes::Eight,
    };
    let q6 = qtype == QType::Q6_K;
    let sbg = if matches!(qtype, QType::Q4_K | QType::Q5_K | QType::Q6_K) { super::ACT_GROUPS } else { 1 };
    let b0 = a.at(t0, 0);   // token t0 + t of group g: block b0 + TILE g + t
    let (qa, da, dsa) = (a.q.as_ptr() as *const u8, a.d.as_ptr(), a.ds.as_ptr());
    let (sfa, k16a) = (a.sf.as_ptr(), a.k16.as_ptr());
    let mask: __mmask16 = if nr == ROWS { 0xffff } else { (1u16 << nr) - 1 };
    let mut acc = [_mm512_setzero_ps(); N];
    // the first tile of tokens of a row group streams its weights from memory (the later ones
    // find them in the cache): each group asks for the bytes `decode_prefetch()` ahead of it,
    // the next row groups' (the hardware's own prefetch alone left 15-45 % of a decode step's
    // rate unused: bench/RESULTS.md)
    let pf = if t0 == 0 { super::decode_prefetch() } else { 0 };
    let step = l.rg_bytes().div_ceil(l.groups());
    let mut sum = [_mm512_setzero_ps(); N];   // K-quants: the superblock's so far
    for g in 0..l.groups() {
        let (at, head) = l.group_at(g);
        if pf > 0 {
            super::prefetch(rg.wrapping_add(at + pf), step);
        }
        let c = codes(kind, rg.add(at));
        let ab = scales(l, rg, at, head);
        let bg = b0 + TILE * g;
        let qx = qa.add(32 * bg);
        let x4 = |t: usize, k: usize| _mm512_set1_epi32(std::ptr::read_unaligned(qx.add(32 * t + k) as *const i32));
        if q6 {
            for h in 0..2 {
                let mut i = [_mm512_setzero_si512(); N];
                for ci in 4 * h..4 * h + 4 {
                    for t in 0..N {
                        i[t] = _mm512_dpbusd_epi32(i[t], c[ci], x4(t, 4 * ci));
                    }
                }
                for t in 0..N {
                    let i = _mm512_sub_epi32(i[t], _mm512_set1_epi32(*k16a.add(2 * (bg + t) + h)));
                    sum[t] = _mm512_fmadd_ps(ab[h].0, _mm512_cvtepi32_ps(i), sum[t]);
                }
            }
        } else {
            // under 4 tokens two sums per token (even and odd chunks) keep enough chains in flight
            let mut i0 = [_mm512_setzero_si512(); N];
            if N < 4 {
                let mut i1 = [_mm512_setzero_si512(); N];
                for ci in (0..8).step_by(2) {
                    for t in 0..N {
                        i0[t] = _mm512_dpbusd_epi32(i0[t], c[ci], x4(t, 4 * ci));
                        i1[t] = _mm512_dpbusd_epi32(i1[t], c[ci + 1], x4(t, 4 * ci + 4));
                    }
                }
                for t in 0..N {
                    i0[t] = _mm512_add_epi32(i0[t], i1[t]);
                }
            } else {
                for (ci, c) in c.iter().enumerate() {
                    for t in 0..N {
                        i0[t] = _mm512_dpbusd_epi32(i0[t], *c, x4(t, 4 * ci));
                    }
                }
            }
            for t in 0..N {
                if sbg > 1 {
                    sum[t] = _mm512_fmadd_ps(ab[0].0, _mm512_cvtepi32_ps(i0[t]), sum[t]);
                    sum[t] = _mm512_fmadd_ps(ab[0].1, _mm512_set1_ps(*sfa.add(bg + t)), sum[t]);
                } else {
                    let v = _mm512_mul_ps(ab[0].0, _mm512_cvtepi32_ps(i0[t]));
                    acc[t] = _mm512_fmadd_ps(v, _mm512_set1_ps(*da.add(bg + t)), acc[t]);
                    acc[t] = _mm512_fmadd_ps(ab[0].1, _mm512_set1_ps(*dsa.add(bg + t)), acc[t]);
                }
            }
        }
        // (one loop over the groups, not one per superblock: LLVM unrolled the superblock's
        // 8 groups and that code ran 8 % slower than the old per-group one)
        if sbg > 1 && g % sbg == sbg - 1 {
            let bs = b0 + TILE * (g + 1 - sbg);
            for (t, sum) in sum.iter_mut().enumerate() {
                acc[t] = _mm512_fmadd_ps(*sum, _mm512_set1_ps(*da.add(bs + t)), acc[t]);
                *sum = _mm512_setzero_ps();
            }
        }
    }
    for (t, acc) in acc.iter().enumerate() {
        _mm512_mask_storeu_ps(o.ptr.add((t0 + t) * o.stride + col), mask, *acc);
    }
}

type TileFn = unsafe fn(&Layout, *const u8, &QAct, usize, Out, usize, usize);

fn tiles<const Q: u8>(n: usize) -> TileFn {
    match n {
        1 => tile::<1, Q>,
        2 => tile::<2, Q>,
        3 => tile::<3, Q>,
        4 => tile::<4, Q>,
        5 => tile::<5, Q>,
        6 => tile::<6, Q>,
        7 => tile::<7, Q>,
        _ => tile::<8, Q>,
    }
}

fn pick(q: QType, n: usize) -> TileFn {
    match q {
        QType::Q4_0 => tiles::<2>(n),
        QType::Q4_1 => tiles::<3>(n),
        QType::Q5_0 => tiles::<6>(n),
        QType::Q5_1 => tiles::<7>(n),
        QType::Q8_0 => tiles::<8>(n),
        QType::Q4_K => tiles::<12>(n),
        QType::Q5_K => tiles::<13>(n),
        QType::Q6_K => tiles::<14>(n),
        QType::F16 | QType::BF16 => unreachable!(),
    }
}

/// Row groups `g0..g1` of `w` against every token of `a`, in tiles of `TILE` tokens.
///
/// # Safety
/// `o` must hold `a.tokens` rows with room for the columns of these row groups; the CPU
/// must have AVX-512 F/BW/VL and VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn rows(w: &RMatrix, a: &QAct, o: Out, g0: usize, g1: usize) {
    let l = &w.layout;
    let full = pick(l.qtype, TILE);
    for rgi in g0..g1 {
        let rg = w.rg(rgi).as_ptr();
        let nr = (l.rows - rgi * ROWS).min(ROWS);
        let mut t0 = 0;
        while t0 < a.tokens {
            let n = (a.tokens - t0).min(TILE);
            let f = if n == TILE { full } else { pick(l.qtype, n) };
            f(l, rg, a, t0, o, rgi * ROWS, nr);
            t0 += n;
        }
    }
}

/// `iters` rounds of 16 independent `vpdpbusd` (64 multiply-adds each): the peak probe's loop.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn dpbusd_loop(iters: usize) -> i32 {
    let (a, b) = (std::hint::black_box(_mm512_set1_epi8(3)), std::hint::black_box(_mm512_set1_epi8(-2)));
    let mut acc = [_mm512_setzero_si512(); 16];
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = _mm512_dpbusd_epi32(*x, a, b);
        }
    }
    acc.iter().fold(0, |s, x| s.wrapping_add(_mm512_reduce_add_epi32(*x)))
}
