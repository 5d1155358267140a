//! Fused CPU operators for the decoder's work outside the GEMMs: residual add + RMSNorm,
//! rotary embedding + KV-cache write, SiLU·mul (paged attention is `attention.rs`).
//!
//! On a small CPU a decode step of a 135 M model is hundreds of tiny tensor ops; their
//! per-op cost (dispatch, allocation, thread-pool wake-ups) was as large as the GEMMs.
//! Each function here replaces several of them with one pass over the data.
//!
//! The bodies are plain Rust over 8-lane arrays; each is compiled twice, once with AVX2+FMA
//! enabled (picked at run time) and once for the baseline CPU, so LLVM vectorises both.
//! Work is split over the kernels' thread pool only when it is large enough to pay for it.

use crate::kv::KvElem;
use crate::threads::{num_threads, parallel_for};

/// Raw pointer that may cross to the pool's threads (they write disjoint parts).
#[derive(Clone, Copy)]
pub(crate) struct P(pub(crate) *mut f32);
// SAFETY: a P is only handed to pool threads that write disjoint rows of the buffer it
// points into, and the caller keeps that buffer alive until `parallel_for` returns.
unsafe impl Send for P {}
// SAFETY: as for Send: shared references to a P only read the pointer.
unsafe impl Sync for P {}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpError(pub String);

pub(crate) fn bad<T>(msg: impl Into<String>) -> Result<T, OpError> { Err(OpError(msg.into())) }

/// The same run-time check as the quantized kernels (AVX2 + FMA + F16C).
pub(crate) fn has_avx2() -> bool { crate::isa::Isa::cpu() >= crate::isa::Isa::Avx2 }

pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;

/// e^x for x in about [-87, 88], relative error below 2e-7 (range reduction to
/// [-ln2/2, ln2/2] and a degree-6 polynomial), branch-free so loops over it vectorise.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.3, 88.7);
    let n = (x * LOG2E + 0.5).floor();
    // ln 2 split in two for an exact reduction
    let r = x - n * 0.693_359_375 + n * 2.121_944_4e-4;
    let p = 1.0 + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

// ------------------------------------------------------------------ add + RMSNorm

#[inline(always)]
unsafe fn add_rms_norm_rows(h: P, delta: Option<P>, w: &[f32], eps: f32, out: P, dim: usize, r0: usize, r1: usize) {
    for r in r0..r1 {
        let hr = std::slice::from_raw_parts_mut(h.0.add(r * dim), dim);
        if let Some(d) = delta {
            let dr = std::slice::from_raw_parts(d.0.add(r * dim) as *const f32, dim);
            for (a, b) in hr.iter_mut().zip(dr) {
                *a += *b;
            }
        }
        let ss = dot(hr, hr);
        let inv = 1.0 / (ss / dim as f32 + eps).sqrt();
        let or = std::slice::from_raw_parts_mut(out.0.add(r * dim), dim);
        for ((o, a), g) in or.iter_mut().zip(hr.iter()).zip(w) {
            *o = *a * inv * *g;
        }
    }
}

#[cfg(target_arch = "x86_64")]
dispatch!(add_rms_norm_avx2, add_rms_norm_rows,
          (h: P, delta: Option<P>, w: &[f32], eps: f32, out: P, dim: usize, r0: usize, r1: usize));

/// `h += delta` (when given), then `out = h / rms(h) * w`, row by row; all `[rows, dim]`
/// contiguous. `out` may not alias `h`.
pub fn add_rms_norm(
    h: &mut [f32], delta: Option<&[f32]>, w: &[f32], eps: f32, out: &mut [f32], rows: usize, dim: usize,
) -> Result<(), OpError> {
    if w.len() != dim || h.len() < rows * dim || out.len() < rows * dim || delta.is_some_and(|d| d.len() < rows * dim) {
        return bad(format!("add_rms_norm: shapes do not fit [{rows}, {dim}]"));
    }
    let (hp, op) = (P(h.as_mut_ptr()), P(out.as_mut_ptr()));
    let dp = delta.map(|d| P(d.as_ptr() as *mut f32));
    let avx = has_avx2();
    // SAFETY: h, delta and out hold `rows * dim` values (checked above), out does not alias
    // h (`&mut`), chunks cover disjoint rows; AVX2 only when the CPU has it.
    let run = |r0: usize, r1: usize| unsafe {
        #[cfg(target_arch = "x86_64")]
        if avx {
            return add_rms_norm_avx2(hp, dp, w, eps, op, dim, r0, r1);
        }
        add_rms_norm_rows(hp, dp, w, eps, op, dim, r0, r1)
    };
    split(rows, rows * dim, 1 << 17, &run);
    Ok(())
}

/// Run `f(r0, r1)` over `0..rows`: on the pool in a few chunks when `work` is past
/// `threshold`, else at once on this thread.
pub(crate) fn split(rows: usize, work: usize, threshold: usize, f: &(dyn Fn(usize, usize) + Sync)) {
    if rows == 0 {
        return;
    }
    if work < threshold || rows < 2 {
        return f(0, rows);
    }
    let chunks = (num_threads() * 2).min(rows);
    let per = rows.div_ceil(chunks);
    parallel_for(rows.div_ceil(per), &|c| f(c * per, ((c + 1) * per).min(rows)));
}

// ------------------------------------------------------------------ SiLU · mul

#[inline(always)]
unsafe fn silu_mul_rows(gu: P, out: P, inter: usize, r0: usize, r1: usize) {
    for r in r0..r1 {
        let g = std::slice::from_raw_parts(gu.0.add(r * 2 * inter) as *const f32, inter);
        let u = std::slice::from_raw_parts(gu.0.add(r * 2 * inter + inter) as *const f32, inter);
        let o = std::slice::from_raw_parts_mut(out.0.add(r * inter), inter);
        for i in 0..inter {
            o[i] = g[i] / (1.0 + exp(-g[i])) * u[i];
        }
    }
}

/// `out[r, i] = silu(gu[r, i]) * gu[r, inter + i]`; gu `[rows, 2 * inter]`, out `[rows, inter]`.
pub fn silu_mul(gu: &[f32], out: &mut [f32], rows: usize, inter: usize) -> Result<(), OpError> {
    if gu.len() < rows * 2 * inter || out.len() < rows * inter {
        return bad(format!("silu_mul: shapes do not fit [{rows}, 2 x {inter}]"));
    }
    let (gp, op) = (P(gu.as_ptr() as *mut f32), P(out.as_mut_ptr()));
    let avx = has_avx2();
    // SAFETY: gu holds `rows * 2 * inter` and out `rows * inter` values (checked above);
    // chunks cover disjoint rows; AVX2 only when the CPU has it.
    let run = |r0: usize, r1: usize| unsafe {
        #[cfg(target_arch = "x86_64")]
        if avx {
            return x86::silu_mul_rows(gp, op, inter, r0, r1);
        }
        silu_mul_rows(gp, op, inter, r0, r1)
    };
    split(rows, rows * inter, 1 << 13, &run);
    Ok(())
}

// ------------------------------------------------------------------ softmax

#[inline(always)]
unsafe fn softmax_rows_scalar(x: P, n: usize, scale: f32, r0: usize, r1: usize) {
    for r in r0..r1 {
        let row = std::slice::from_raw_parts_mut(x.0.add(r * n), n);
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for v in row.iter_mut() {
            *v = exp((*v - m) * scale);
            sum += *v;
        }
        let inv = 1.0 / sum;
        for v in row.iter_mut() {
            *v *= inv;
        }
    }
}

/// Each row of `x` [rows, n] in place: softmax(scale * x) (scale > 0). A vision tower's
/// scores between its two products (model/vision.py): numpy's passes over them ran one core.
pub fn softmax_rows(x: &mut [f32], rows: usize, n: usize, scale: f32) -> Result<(), OpError> {
    if x.len() < rows * n || n == 0 || scale.is_nan() || scale <= 0.0 {
        return bad(format!("softmax_rows: [{rows}, {n}] rows with scale {scale}"));
    }
    let xp = P(x.as_mut_ptr());
    let avx = has_avx2();
    // SAFETY: x holds `rows * n` values (checked above); chunks cover disjoint rows; AVX2
    // only when the CPU has it.
    let run = |r0: usize, r1: usize| unsafe {
        #[cfg(target_arch = "x86_64")]
        if avx {
            return x86::softmax_rows(xp, n, scale, r0, r1);
        }
        softmax_rows_scalar(xp, n, scale, r0, r1)
    };
    split(rows, rows * n, 1 << 14, &run);
    Ok(())
}

// ------------------------------------------------------------------ rotary + KV write

/// Shapes of one attention layer.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub nh: usize,
    pub nkv: usize,
    pub d: usize,
}

impl Heads {
    /// Width of a fused QKV row.
    pub fn width(&self) -> usize { (self.nh + 2 * self.nkv) * self.d }
}

#[inline(always)]
unsafe fn rope_rows(qkv: P, width: usize, pos: &[i64], cos: &[f32], sin: &[f32], heads: usize, d: usize, r0: usize, r1: usize) {
    let half = d / 2;
    let mut tmp = [0f32; 512];
    for r in r0..r1 {
        let p = pos[r] as usize;
        let (c, s) = (&cos[p * d..p * d + d], &sin[p * d..p * d + d]);
        for hd in 0..heads {
            let x = std::slice::from_raw_parts_mut(qkv.0.add(r * width + hd * d), d);
            tmp[..d].copy_from_slice(x);
            for i in 0..half {
                x[i] = tmp[i] * c[i] + tmp[i + half] * s[i];
            }
            for i in half..d {
                x[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
dispatch!(rope_avx2, rope_rows,
          (qkv: P, width: usize, pos: &[i64], cos: &[f32], sin: &[f32], heads: usize, d: usize, r0: usize, r1: usize));

/// Rotate the Q and K heads of every fused QKV row in place (tables as `Rotary` builds them:
/// `cat(cos, cos)` and `cat(-sin, sin)`, `[positions, d]`), then write each row's K and V
/// into its cache slot (`slots[r] < 0`: not written), converted to the cache's element type.
/// Caches are `[num_slots, nkv, E::units(d)]`.
#[allow(clippy::too_many_arguments)]
pub fn rope_write_kv<E: KvElem>(
    qkv: &mut [f32], rows: usize, hs: Heads, positions: &[i64], cos: &[f32], sin: &[f32], slots: &[i64],
    k_cache: &mut [E], v_cache: &mut [E],
) -> Result<(), OpError> {
    let (w, d) = (hs.width(), hs.d);
    if d % 2 != 0 || d > 512 || qkv.len() < rows * w || positions.len() != rows || slots.len() != rows {
        return bad(format!("rope_write_kv: shapes do not fit {rows} rows of {w}"));
    }
    if cos.len() != sin.len() || cos.len() % d != 0 {
        return bad("rope_write_kv: cos/sin tables must be [positions, head_dim]");
    }
    let tab = cos.len() / d;
    if let Some(p) = positions.iter().find(|&&p| p < 0 || p as usize >= tab) {
        return bad(format!("rope_write_kv: position {p} outside the rotary table of {tab}"));
    }
    if !E::supports(d) {
        return bad(format!("rope_write_kv: a {} cache does not hold heads of {d} values", E::NAME));
    }
    let kvw = hs.nkv * d;
    let kvu = hs.nkv * E::units(d);
    let num_slots = k_cache.len().min(v_cache.len()) / kvu;
    if let Some(s) = slots.iter().find(|&&s| s >= num_slots as i64) {
        return bad(format!("rope_write_kv: slot {s} outside the cache of {num_slots} slots"));
    }
    let qp = P(qkv.as_mut_ptr());
    let heads = hs.nh + hs.nkv;
    // SAFETY: qkv holds `rows` rows of `w` values, positions index the tables and d <= 512
    // (checked above); AVX2 only when the CPU has it.
    unsafe {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            rope_avx2(qp, w, positions, cos, sin, heads, d, 0, rows);
        } else {
            rope_rows(qp, w, positions, cos, sin, heads, d, 0, rows);
        }
        #[cfg(not(target_arch = "x86_64"))]
        rope_rows(qp, w, positions, cos, sin, heads, d, 0, rows);
    }
    let qo = hs.nh * d;
    for (r, &s) in slots.iter().enumerate() {
        if s < 0 {
            continue;
        }
        let s = s as usize;
        E::store_heads(&mut k_cache[s * kvu..(s + 1) * kvu], &qkv[r * w + qo..r * w + qo + kvw], d);
        E::store_heads(&mut v_cache[s * kvu..(s + 1) * kvu], &qkv[r * w + qo + kvw..r * w + qo + 2 * kvw], d);
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// `super::exp` on 8 lanes.
    #[inline(always)]
    pub(crate) unsafe fn exp8(x: __m256) -> __m256 {
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3)), _mm256_set1_ps(88.7));
        let n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(super::LOG2E), _mm256_set1_ps(0.5)));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_375), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        _mm256_mul_ps(p, _mm256_castsi256_ps(e))
    }

    /// Softmax weights exp(x) for x = score - max <= 0, exactly 0 below e^-46 (~1e-20): such a
    /// weight changes no f32 sum of weights >= 1, and left in, its products with V round to
    /// subnormals, each a microcode assist (peaked attention ran ~2x slower).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn softmax_exp8(x: __m256) -> __m256 {
        _mm256_and_ps(exp8(x), _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(-46.0)))
    }

    /// `super::softmax_rows_scalar` on 8 lanes (the tail of a row, past a multiple of 8, scalar).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn softmax_rows(x: super::P, n: usize, scale: f32, r0: usize, r1: usize) {
        let body = n / 8 * 8;
        let sc = _mm256_set1_ps(scale);
        for r in r0..r1 {
            let row = x.0.add(r * n);
            let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
            for i in (0..body).step_by(8) {
                mv = _mm256_max_ps(mv, _mm256_loadu_ps(row.add(i)));
            }
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), mv);
            let mut m = lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for i in body..n {
                m = m.max(*row.add(i));
            }
            let (mb, mut sv) = (_mm256_set1_ps(m), _mm256_setzero_ps());
            for i in (0..body).step_by(8) {
                let e = softmax_exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(row.add(i)), mb), sc));
                _mm256_storeu_ps(row.add(i), e);
                sv = _mm256_add_ps(sv, e);
            }
            _mm256_storeu_ps(lanes.as_mut_ptr(), sv);
            let mut sum: f32 = lanes.iter().sum();
            for i in body..n {
                let e = super::exp((*row.add(i) - m) * scale);
                *row.add(i) = e;
                sum += e;
            }
            let inv = _mm256_set1_ps(1.0 / sum);
            for i in (0..body).step_by(8) {
                _mm256_storeu_ps(row.add(i), _mm256_mul_ps(_mm256_loadu_ps(row.add(i)), inv));
            }
            for i in body..n {
                *row.add(i) /= sum;
            }
        }
    }

    /// `super::silu_mul_rows` on 8 lanes (`exp8`; `inter` a multiple of 8, else the scalar
    /// loop takes the tail): the compiler's own vectorisation of the scalar loop was several
    /// times slower (bench/RESULTS.md, "Seventh session").
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn silu_mul_rows(gu: super::P, out: super::P, inter: usize, r0: usize, r1: usize) {
        let (one, zero) = (_mm256_set1_ps(1.0), _mm256_setzero_ps());
        let body = inter / 8 * 8;
        for r in r0..r1 {
            let g = gu.0.add(r * 2 * inter);
            let (u, o) = (g.add(inter), out.0.add(r * inter));
            for i in (0..body).step_by(8) {
                let gv = _mm256_loadu_ps(g.add(i));
                let s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
                _mm256_storeu_ps(o.add(i), _mm256_mul_ps(s, _mm256_loadu_ps(u.add(i))));
            }
            for i in body..inter {
                *o.add(i) = *g.add(i) / (1.0 + super::exp(-*g.add(i))) * *u.add(i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (exp(x), x.exp());
            assert!(((a - b) / b).abs() < 3e-7, "exp({x}) = {a}, want {b}");
            x += 0.01;
        }
        assert!(exp(-1000.0) >= 0.0 && exp(-1000.0) < 1e-37);
    }

    #[test]
    fn softmax_rows_sum_to_one() {
        for n in [1usize, 7, 8, 37, 64] {
            let rows = 5;
            let x0: Vec<f32> = (0..rows * n).map(|i| ((i as f32) * 0.77).sin() * 9.0).collect();
            let mut x = x0.clone();
            softmax_rows(&mut x, rows, n, 0.3).unwrap();
            for r in 0..rows {
                let row = &x0[r * n..(r + 1) * n];
                let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let z: f64 = row.iter().map(|v| ((*v as f64 - m) * 0.3).exp()).sum();
                for i in 0..n {
                    let want = ((row[i] as f64 - m) * 0.3).exp() / z;
                    assert!((x[r * n + i] as f64 - want).abs() < 1e-6, "row {r} col {i}");
                }
            }
        }
        assert!(softmax_rows(&mut [1.0, 2.0], 1, 2, 0.0).is_err());
    }

    #[test]
    fn norm_silu_rope() {
        let (rows, dim) = (3, 40);
        let mut h: Vec<f32> = (0..rows * dim).map(|i| (i as f32 * 0.37).sin()).collect();
        let delta: Vec<f32> = (0..rows * dim).map(|i| (i as f32 * 0.11).cos()).collect();
        let w: Vec<f32> = (0..dim).map(|i| 1.0 + i as f32 * 0.01).collect();
        let want_h: Vec<f32> = h.iter().zip(&delta).map(|(a, b)| a + b).collect();
        let mut out = vec![0f32; rows * dim];
        add_rms_norm(&mut h, Some(&delta), &w, 1e-5, &mut out, rows, dim).unwrap();
        assert_eq!(h, want_h);
        for r in 0..rows {
            let x = &want_h[r * dim..(r + 1) * dim];
            let rms = (x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dim as f64 + 1e-5).sqrt();
            for i in 0..dim {
                assert!((out[r * dim + i] as f64 - x[i] as f64 / rms * w[i] as f64).abs() < 1e-5);
            }
        }
        let gu: Vec<f32> = (0..2 * 2 * 24).map(|i| (i as f32 - 48.0) * 0.4).collect();
        let mut o = vec![0f32; 2 * 24];
        silu_mul(&gu, &mut o, 2, 24).unwrap();
        for r in 0..2 {
            for i in 0..24 {
                let (g, u) = (gu[r * 48 + i] as f64, gu[r * 48 + 24 + i] as f64);
                let want = g / (1.0 + (-g).exp()) * u;
                assert!((o[r * 24 + i] as f64 - want).abs() < 1e-5 * want.abs().max(1.0));
            }
        }
        // rotary on one head of 4 at position 1 with cos = 0, sin = ±1: (a, b, c, d) -> (-c, -d, a, b)
        let hs = Heads { nh: 1, nkv: 1, d: 4 };
        let mut qkv = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0];
        let cos = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0];
        let sin = [0.0, 0.0, 0.0, 0.0, -1.0, -1.0, 1.0, 1.0];
        let (mut kc, mut vc) = (vec![0f32; 8], vec![0f32; 8]);
        rope_write_kv(&mut qkv, 1, hs, &[1], &cos, &sin, &[1], &mut kc, &mut vc).unwrap();
        assert_eq!(&qkv[..8], &[-3.0, -4.0, 1.0, 2.0, -7.0, -8.0, 5.0, 6.0]);
        assert_eq!(&kc[4..], &[-7.0, -8.0, 5.0, 6.0]);
        assert_eq!(&vc[4..], &[9.0, 10.0, 11.0, 12.0]);
        assert!(rope_write_kv(&mut qkv, 1, hs, &[2], &cos, &sin, &[1], &mut kc, &mut vc).is_err());
        assert!(rope_write_kv(&mut qkv, 1, hs, &[1], &cos, &sin, &[2], &mut kc, &mut vc).is_err());
    }
}
