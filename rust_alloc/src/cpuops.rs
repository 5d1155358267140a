//! Fused CPU operators for the decoder's work outside the GEMMs: residual add + RMSNorm,
//! rotary embedding + KV-cache write, paged decode attention, SiLU·mul.
//!
//! On a small CPU a decode step of a 135 M model is hundreds of tiny tensor ops; their
//! per-op cost (dispatch, allocation, thread-pool wake-ups) was as large as the GEMMs.
//! Each function here replaces several of them with one pass over the data.
//!
//! The bodies are plain Rust over 8-lane arrays; each is compiled twice, once with AVX2+FMA
//! enabled (picked at run time) and once for the baseline CPU, so LLVM vectorises both.
//! Work is split over the kernels' thread pool only when it is large enough to pay for it.

use crate::quant::parallel_for;

/// Raw pointer that may cross to the pool's threads (they write disjoint parts).
#[derive(Clone, Copy)]
struct P(*mut f32);
unsafe impl Send for P {}
unsafe impl Sync for P {}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpError(pub String);

fn bad<T>(msg: impl Into<String>) -> Result<T, OpError> { Err(OpError(msg.into())) }

/// The same run-time check as the quantized kernels (AVX2 + FMA + F16C).
fn has_avx2() -> bool { crate::quant::Isa::best() == crate::quant::Isa::Avx2 }

/// Compile `$body` (an `#[inline(always)]` fn) for AVX2+FMA and for the baseline, and call
/// the best one.
macro_rules! dispatch {
    ($name:ident, $body:ident, ($($arg:ident : $ty:ty),*)) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $name($($arg: $ty),*) { $body($($arg),*) }
    };
}

const LOG2E: f32 = std::f32::consts::LOG2_E;

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
fn dot(a: &[f32], b: &[f32]) -> f32 {
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
fn split(rows: usize, work: usize, threshold: usize, f: &(dyn Fn(usize, usize) + Sync)) {
    if rows == 0 {
        return;
    }
    if work < threshold || rows < 2 {
        return f(0, rows);
    }
    let chunks = (crate::quant::num_threads() * 2).min(rows);
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
/// into its cache slot (`slots[r] < 0`: not written). Caches are `[num_slots, nkv, d]`.
#[allow(clippy::too_many_arguments)]
pub fn rope_write_kv(
    qkv: &mut [f32], rows: usize, hs: Heads, positions: &[i64], cos: &[f32], sin: &[f32], slots: &[i64],
    k_cache: &mut [f32], v_cache: &mut [f32],
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
    let kvw = hs.nkv * d;
    let num_slots = k_cache.len().min(v_cache.len()) / kvw;
    if let Some(s) = slots.iter().find(|&&s| s >= num_slots as i64) {
        return bad(format!("rope_write_kv: slot {s} outside the cache of {num_slots} slots"));
    }
    let qp = P(qkv.as_mut_ptr());
    let heads = hs.nh + hs.nkv;
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
        k_cache[s * kvw..(s + 1) * kvw].copy_from_slice(&qkv[r * w + qo..r * w + qo + kvw]);
        v_cache[s * kvw..(s + 1) * kvw].copy_from_slice(&qkv[r * w + qo + kvw..r * w + qo + 2 * kvw]);
    }
    Ok(())
}

// ------------------------------------------------------------------ paged decode attention

/// One decode sequence: its query row in the batch, context length, block table row.
struct DecodeArgs<'a> {
    q: P,
    q_stride: usize,
    out: P,
    out_stride: usize,
    rows: &'a [i64],
    lens: &'a [i32],
    tables: &'a [i32],
    max_blocks: usize,
    k: &'a [f32],
    v: &'a [f32],
    bs: usize,
    hs: Heads,
    scale: f32,
    window: usize,
}

#[inline(always)]
unsafe fn decode_item(a: &DecodeArgs, item: usize, scores: &mut Vec<f32>, acc: &mut Vec<f32>) {
    let Heads { nh, nkv, d } = a.hs;
    let g = nh / nkv;
    let (b, kh) = (item / nkv, item % nkv);
    let n = a.lens[b] as usize;
    let lo = if a.window > 0 { n.saturating_sub(a.window) } else { 0 };
    let len = n - lo;
    let row = a.rows[b] as usize;
    let table = &a.tables[b * a.max_blocks..(b + 1) * a.max_blocks];
    let kvw = nkv * d;
    scores.clear();
    scores.resize(g * len, 0.0);
    let q0 = a.q.0.add(row * a.q_stride + kh * g * d) as *const f32;
    // scores[h, t] = q_h · k_t · scale
    for t in 0..len {
        let pos = lo + t;
        let slot = table[pos / a.bs] as usize * a.bs + pos % a.bs;
        let kr = &a.k[slot * kvw + kh * d..slot * kvw + kh * d + d];
        for h in 0..g {
            let q = std::slice::from_raw_parts(q0.add(h * d), d);
            scores[h * len + t] = dot(q, kr) * a.scale;
        }
    }
    // softmax per head
    let mut inv = [0f32; 64];
    for h in 0..g {
        let s = &mut scores[h * len..(h + 1) * len];
        let m = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
        let mut sum = 0f32;
        for x in s.iter_mut() {
            *x = exp(*x - m);
            sum += *x;
        }
        inv[h] = 1.0 / sum;
    }
    // out_h = Σ_t p[h, t] v_t
    acc.clear();
    acc.resize(g * d, 0.0);
    for t in 0..len {
        let pos = lo + t;
        let slot = table[pos / a.bs] as usize * a.bs + pos % a.bs;
        let vr = &a.v[slot * kvw + kh * d..slot * kvw + kh * d + d];
        for h in 0..g {
            let p = scores[h * len + t];
            let o = &mut acc[h * d..(h + 1) * d];
            for i in 0..d {
                o[i] += p * vr[i];
            }
        }
    }
    for h in 0..g {
        let o = std::slice::from_raw_parts_mut(a.out.0.add(row * a.out_stride + (kh * g + h) * d), d);
        for i in 0..d {
            o[i] = acc[h * d + i] * inv[h];
        }
    }
}


#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{DecodeArgs, Heads};
    use crate::quant::avx2::hsum;
    use std::arch::x86_64::*;

    /// `super::exp` on 8 lanes.
    #[inline(always)]
    pub unsafe fn exp8(x: __m256) -> __m256 {
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

    /// `super::silu_mul_rows` on 8 lanes (`exp8`; `inter` a multiple of 8, else the scalar
    /// loop takes the tail). The compiler's own vectorisation of the scalar loop ran 3.6x
    /// slower (32 x 1536 on one thread: 113 µs against 31).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn silu_mul_rows(gu: super::P, out: super::P, inter: usize, r0: usize, r1: usize) {
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

    /// One sequence `b` with head_dim = 8 * NV: every query head against every visible K row
    /// (a position's K rows of all KV heads are one contiguous run), softmax on 8 lanes,
    /// then the V rows summed into NV registers per head. Scores come 8 positions at a time
    /// (one accumulator per position, the 8 reduced together by `hsum8`), the last
    /// `len % 8` one by one. Measured on one thread, 32 sequences of 90 positions, cache
    /// hot, alternated: 175 µs against 189 with every score reduced on its own. The slot
    /// offsets took 58 µs of 206 with a division per position; computed block by block,
    /// 19-36 µs.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn item<const NV: usize>(a: &DecodeArgs, b: usize, scores: &mut Vec<f32>, slots: &mut Vec<usize>) {
        let Heads { nh, nkv, d } = a.hs;
        let g = nh / nkv;
        let n = a.lens[b] as usize;
        let lo = if a.window > 0 { n.saturating_sub(a.window) } else { 0 };
        let len = n - lo;
        let table = &a.tables[b * a.max_blocks..(b + 1) * a.max_blocks];
        let kvw = nkv * d;
        slots.clear();
        // block by block: no division per position (it was a quarter of the kernel's time)
        for bi in lo / a.bs..n.div_ceil(a.bs) {
            let first = bi * a.bs;
            let base = table[bi] as usize * a.bs;
            slots.extend((first.max(lo)..(first + a.bs).min(n)).map(|p| (base + p - first) * kvw));
        }
        let stride = len.next_multiple_of(8);
        scores.clear();
        scores.resize(nh * stride, f32::NEG_INFINITY);
        let q0 = a.q.0.add(a.rows[b] as usize * a.q_stride) as *const f32;
        let (kp, vp) = (a.k.as_ptr(), a.v.as_ptr());
        let sp = scores.as_mut_ptr();
        let nfull = len / 8 * 8;
        let sc8 = _mm256_set1_ps(a.scale);
        for t0 in (0..nfull).step_by(8) {
            for kh in 0..nkv {
                let ks: [*const f32; 8] = std::array::from_fn(|u| kp.add(slots[t0 + u] + kh * d));
                for h in kh * g..(kh + 1) * g {
                    let q = q0.add(h * d);
                    let mut acc = [_mm256_setzero_ps(); 8];
                    for j in 0..NV {
                        let qj = _mm256_loadu_ps(q.add(8 * j));
                        for (u, r) in acc.iter_mut().enumerate() {
                            *r = _mm256_fmadd_ps(qj, _mm256_loadu_ps(ks[u].add(8 * j)), *r);
                        }
                    }
                    _mm256_storeu_ps(sp.add(h * stride + t0), _mm256_mul_ps(hsum8(&acc), sc8));
                }
            }
        }
        for (t, &off) in slots.iter().enumerate().skip(nfull) {
            for kh in 0..nkv {
                let k = kp.add(off + kh * d);
                let mut kr = [_mm256_setzero_ps(); NV];
                for (j, r) in kr.iter_mut().enumerate() {
                    *r = _mm256_loadu_ps(k.add(8 * j));
                }
                for h in kh * g..(kh + 1) * g {
                    let q = q0.add(h * d);
                    let mut acc = _mm256_mul_ps(_mm256_loadu_ps(q), kr[0]);
                    for (j, r) in kr.iter().enumerate().skip(1) {
                        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(8 * j)), *r, acc);
                    }
                    *sp.add(h * stride + t) = hsum(acc) * a.scale;
                }
            }
        }
        let mut inv = [0f32; 64];
        for (h, inv) in inv.iter_mut().enumerate().take(nh) {
            let s = sp.add(h * stride);
            let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
            for c in (0..stride).step_by(8) {
                m = _mm256_max_ps(m, _mm256_loadu_ps(s.add(c)));
            }
            let m = _mm256_set1_ps(-hmax(m));
            let mut sum = _mm256_setzero_ps();
            for c in (0..stride).step_by(8) {
                let e = exp8(_mm256_add_ps(_mm256_loadu_ps(s.add(c)), m));
                // padding lanes hold -inf: exp8 clamps to e^-87, zero them
                let e = if c + 8 > len { _mm256_and_ps(e, tail_mask(len - c)) } else { e };
                _mm256_storeu_ps(s.add(c), e);
                sum = _mm256_add_ps(sum, e);
            }
            *inv = 1.0 / hsum(sum);
        }
        for h in 0..nh {
            let s = sp.add(h * stride);
            let vo = h / g * d;
            let mut acc = [_mm256_setzero_ps(); NV];
            for (t, &off) in slots.iter().enumerate() {
                let p = _mm256_set1_ps(*s.add(t));
                let v = vp.add(off + vo);
                for (j, r) in acc.iter_mut().enumerate() {
                    *r = _mm256_fmadd_ps(p, _mm256_loadu_ps(v.add(8 * j)), *r);
                }
            }
            let o = a.out.0.add(a.rows[b] as usize * a.out_stride + h * d);
            let iv = _mm256_set1_ps(inv[h]);
            for (j, r) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.add(8 * j), _mm256_mul_ps(*r, iv));
            }
        }
    }

    /// Lane `u` of the result: the sum of the 8 lanes of `a[u]`.
    #[inline(always)]
    unsafe fn hsum8(a: &[__m256; 8]) -> __m256 {
        let h01 = _mm256_hadd_ps(a[0], a[1]);
        let h23 = _mm256_hadd_ps(a[2], a[3]);
        let h45 = _mm256_hadd_ps(a[4], a[5]);
        let h67 = _mm256_hadd_ps(a[6], a[7]);
        let h03 = _mm256_hadd_ps(h01, h23);
        let h47 = _mm256_hadd_ps(h45, h67);
        _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(h03, h47), _mm256_permute2f128_ps::<0x31>(h03, h47))
    }

    #[inline(always)]
    unsafe fn hmax(v: __m256) -> f32 {
        let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    /// All-ones in the first `n` (< 8) lanes.
    #[inline(always)]
    unsafe fn tail_mask(n: usize) -> __m256 {
        let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), idx))
    }

    /// Whether `items` runs these heads (else the portable loop does).
    pub fn supports(hs: Heads) -> bool { hs.d % 8 == 0 && hs.nh <= 64 && matches!(hs.d / 8, 4 | 8 | 16) }

    /// Sequences `i0..i1`, every KV head of each.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn items(a: &DecodeArgs, i0: usize, i1: usize) {
        let (mut scores, mut slots) = (Vec::new(), Vec::new());
        let nv = a.hs.d / 8;
        for b in i0..i1 {
            match nv {
                4 => item::<4>(a, b, &mut scores, &mut slots),
                8 => item::<8>(a, b, &mut scores, &mut slots),
                16 => item::<16>(a, b, &mut scores, &mut slots),
                _ => unreachable!(),
            }
        }
    }
}

#[inline(always)]
unsafe fn decode_items(a: &DecodeArgs, i0: usize, i1: usize) {
    let (mut scores, mut acc) = (Vec::new(), Vec::new());
    for it in i0..i1 {
        decode_item(a, it, &mut scores, &mut acc);
    }
}

#[cfg(target_arch = "x86_64")]
dispatch!(decode_items_avx2, decode_items, (a: &DecodeArgs, i0: usize, i1: usize));

/// Attention of one query token per sequence over its paged context (positions
/// `0 .. lens[b]`, the last `window` of them when `window > 0`).
///
/// `q` holds the query heads of row `rows[b]` at `q[rows[b] * q_stride ..]` (`nh * d`
/// values, e.g. the Q part of a fused QKV row); the result goes to
/// `out[rows[b] * out_stride ..]`. `tables` is `[B, max_blocks]` block ids, caches are
/// `[num_blocks * bs, nkv, d]`.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode(
    q: &[f32], q_stride: usize, out: &mut [f32], out_stride: usize, rows: &[i64], lens: &[i32], tables: &[i32],
    k_cache: &[f32], v_cache: &[f32], bs: usize, hs: Heads, scale: f32, window: usize,
) -> Result<(), OpError> {
    let Heads { nh, nkv, d } = hs;
    let b = rows.len();
    if nkv == 0 || nh % nkv != 0 || nh / nkv > 64 || d == 0 || bs == 0 {
        return bad(format!("paged_decode: unsupported heads {nh}/{nkv} x {d}"));
    }
    if lens.len() != b || (b > 0 && tables.len() % b != 0) {
        return bad("paged_decode: rows, lens and tables disagree on the number of sequences");
    }
    let max_blocks = if b > 0 { tables.len() / b } else { 0 };
    let kvw = nkv * d;
    let num_blocks = k_cache.len().min(v_cache.len()) / kvw / bs;
    for i in 0..b {
        let (r, n) = (rows[i], lens[i]);
        if r < 0 || (r as usize) * q_stride + nh * d > q.len() || (r as usize) * out_stride + nh * d > out.len() {
            return bad(format!("paged_decode: row {r} outside q/out"));
        }
        if n < 1 || n as usize > max_blocks * bs {
            return bad(format!("paged_decode: context length {n} does not fit the block table"));
        }
        let used = (n as usize).div_ceil(bs);
        if let Some(&blk) = tables[i * max_blocks..i * max_blocks + used].iter().find(|&&x| x < 0 || x as usize >= num_blocks) {
            return bad(format!("paged_decode: block {blk} outside the cache of {num_blocks} blocks"));
        }
    }
    let args = DecodeArgs {
        q: P(q.as_ptr() as *mut f32), q_stride, out: P(out.as_mut_ptr()), out_stride, rows, lens, tables, max_blocks,
        k: k_cache, v: v_cache, bs, hs, scale, window,
    };
    // The AVX2 kernel takes a whole sequence per item (the contiguous K/V rows of all its
    // KV heads: 8% faster than one item per KV head at a batch-32 decode step, the caches
    // cold); the portable loop takes one (sequence, KV head) per item.
    let avx = has_avx2();
    #[cfg(target_arch = "x86_64")]
    let whole = avx && x86::supports(hs);
    #[cfg(not(target_arch = "x86_64"))]
    let whole = false;
    let items = if whole { b } else { b * nkv };
    let work: usize = lens.iter().map(|&n| n as usize).sum::<usize>() * nh * d;
    let run = |i0: usize, i1: usize| unsafe {
        #[cfg(target_arch = "x86_64")]
        if whole {
            return x86::items(&args, i0, i1);
        }
        #[cfg(target_arch = "x86_64")]
        if avx {
            return decode_items_avx2(&args, i0, i1);
        }
        decode_items(&args, i0, i1)
    };
    if work < 1 << 16 || items < 2 {
        run(0, items);
    } else {
        // items of very different lengths: many small chunks taken in turn
        let per = items.div_ceil(crate::quant::num_threads() * 4).max(1);
        parallel_for(items.div_ceil(per), &|c| run(c * per, ((c + 1) * per).min(items)));
    }
    Ok(())
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
    fn decode_matches_naive() {
        for d in [16, 64] {
            decode_case(Heads { nh: 6, nkv: 2, d });
        }
    }

    fn decode_case(hs: Heads) {
        let (bs, nblocks) = (4usize, 10usize);
        let kvw = hs.nkv * hs.d;
        let mut seed = 7u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let k: Vec<f32> = (0..nblocks * bs * kvw).map(|_| rnd()).collect();
        let v: Vec<f32> = (0..nblocks * bs * kvw).map(|_| rnd()).collect();
        let q: Vec<f32> = (0..3 * hs.nh * hs.d).map(|_| rnd()).collect();
        let tables = [3, 1, 7, 0, 2, 5, 9, 8, 4, 6, 0, 0];
        let lens = [13, 2, 9];
        for window in [0usize, 5] {
            let mut out = vec![0f32; 3 * hs.nh * hs.d];
            paged_decode(&q, hs.nh * hs.d, &mut out, hs.nh * hs.d, &[0, 1, 2], &lens, &tables, &k, &v, bs, hs, 0.25, window)
                .unwrap();
            for b in 0..3 {
                for h in 0..hs.nh {
                    let kh = h / (hs.nh / hs.nkv);
                    let n = lens[b] as usize;
                    let lo = if window > 0 { n.saturating_sub(window) } else { 0 };
                    let qv = &q[(b * hs.nh + h) * hs.d..(b * hs.nh + h + 1) * hs.d];
                    let slot = |p: usize| tables[b * 4 + p / bs] as usize * bs + p % bs;
                    let s: Vec<f64> = (lo..n)
                        .map(|p| {
                            let kr = &k[slot(p) * kvw + kh * hs.d..][..hs.d];
                            qv.iter().zip(kr).map(|(a, b)| (*a as f64) * (*b as f64)).sum::<f64>() * 0.25
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for i in 0..hs.d {
                        let want: f64 = (lo..n).zip(&e).map(|(p, w)| w * v[slot(p) * kvw + kh * hs.d + i] as f64).sum::<f64>() / z;
                        let got = out[(b * hs.nh + h) * hs.d + i] as f64;
                        assert!((want - got).abs() < 1e-5, "b{b} h{h} i{i}: {got} vs {want}");
                    }
                }
            }
        }
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

// ------------------------------------------------------------------ a whole decode step

/// A linear layer on GGUF-quantized weights: row segments stacked along the output (a fused
/// QKV may mix formats), and an optional bias.
pub struct QLinear<'a> {
    pub segs: Vec<crate::quant::QMatrix<'a>>,
    pub bias: Option<&'a [f32]>,
}

impl QLinear<'_> {
    pub fn out_features(&self) -> usize { self.segs.iter().map(|s| s.rows).sum() }

    fn forward(&self, x: &[f32], t: usize, out: &mut [f32]) -> Result<(), OpError> {
        let n = self.out_features();
        let cols = self.segs.first().map_or(0, |s| s.cols);
        crate::quant::matmul_stacked(&self.segs, x, cols, t, out, n, crate::quant::Isa::best()).map_err(|e| OpError(e.0))?;
        if let Some(b) = self.bias {
            for r in 0..t {
                for (o, v) in out[r * n..(r + 1) * n].iter_mut().zip(b) {
                    *o += *v;
                }
            }
        }
        Ok(())
    }
}

/// A zeroed f32 buffer that starts on a 64-byte boundary (a cache line), so the kernels'
/// 32-byte loads of its rows (whose lengths here are multiples of 16 floats) never straddle
/// two lines. A large `Vec` comes from `mmap` 16 bytes past a page start: every other load
/// of its rows would be split. Measured: a batch-32 decode step 7-9% faster than with
/// buffers 16 bytes past a line (steps alternated in one process); the kernels alone on
/// such rows 10-20% slower.
struct Lines {
    buf: Vec<f32>,
    off: usize,
    len: usize,
}

impl Lines {
    fn new(len: usize) -> Self {
        let buf = vec![0f32; len + 16];
        let off = (64 - buf.as_ptr() as usize % 64) % 64 / 4;
        Lines { buf, off, len }
    }
}

impl std::ops::Deref for Lines {
    type Target = [f32];
    fn deref(&self) -> &[f32] { &self.buf[self.off..self.off + self.len] }
}

impl std::ops::DerefMut for Lines {
    fn deref_mut(&mut self) -> &mut [f32] { &mut self.buf[self.off..self.off + self.len] }
}

/// One decoder layer's weights.
pub struct QLayer<'a> {
    pub in_norm: &'a [f32],
    pub post_norm: &'a [f32],
    pub qkv: QLinear<'a>,
    pub o: QLinear<'a>,
    pub gate_up: QLinear<'a>,
    pub down: QLinear<'a>,
}

/// A decode-only step: `t` sequences with one new token each, token `b` at `positions[b]`
/// written to `slots[b]`, attending its `lens[b]` positions through `tables` row `b`.
pub struct DecodeStep<'a> {
    pub positions: &'a [i64],
    pub slots: &'a [i64],
    pub lens: &'a [i32],
    pub tables: &'a [i32],
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub block_size: usize,
    pub scale: f32,
    pub window: usize,
}

/// Every decoder layer of a decode-only step in one call: `h` (`[t, hidden]`, the token
/// embeddings) becomes the residual stream after the last layer (final norm not applied).
/// `kv` is the runner's whole cache `[layers, 2, num_blocks, block_size, nkv, d]`.
#[allow(clippy::too_many_arguments)]
pub fn decode_layers(
    layers: &[QLayer], hs: Heads, hidden: usize, inter: usize, eps: f32, h: &mut [f32], t: usize, step: &DecodeStep,
    kv: &mut [f32],
) -> Result<(), OpError> {
    let (w, q) = (hs.width(), hs.nh * hs.d);
    if h.len() != t * hidden || step.positions.len() != t || step.slots.len() != t || step.lens.len() != t {
        return bad("decode_layers: h, positions, slots and seq_lens must have one row per token");
    }
    if layers.is_empty() || kv.len() % (2 * layers.len()) != 0 {
        return bad("decode_layers: the KV cache does not split into the layers' K and V");
    }
    for l in layers {
        if l.in_norm.len() != hidden || l.post_norm.len() != hidden || l.qkv.out_features() != w
            || l.o.out_features() != hidden || l.gate_up.out_features() != 2 * inter || l.down.out_features() != hidden
            || l.qkv.segs.iter().any(|s| s.cols != hidden) || l.o.segs.iter().any(|s| s.cols != q)
            || l.gate_up.segs.iter().any(|s| s.cols != hidden) || l.down.segs.iter().any(|s| s.cols != inter)
        {
            return bad("decode_layers: a layer's weights do not fit the model's shapes");
        }
    }
    let per = kv.len() / (2 * layers.len());
    let rows: Vec<i64> = (0..t as i64).collect();
    let (mut a, mut qkv, mut attn) = (Lines::new(t * hidden), Lines::new(t * w), Lines::new(t * q));
    let (mut gu, mut m, mut delta) = (Lines::new(t * 2 * inter), Lines::new(t * inter), Lines::new(t * hidden));
    let mut have_delta = false;
    for (i, l) in layers.iter().enumerate() {
        let (kc, rest) = kv[2 * i * per..(2 * i + 2) * per].split_at_mut(per);
        let vc = rest;
        add_rms_norm(h, have_delta.then_some(&delta[..]), l.in_norm, eps, &mut a, t, hidden)?;
        l.qkv.forward(&a, t, &mut qkv)?;
        rope_write_kv(&mut qkv, t, hs, step.positions, step.cos, step.sin, step.slots, kc, vc)?;
        paged_decode(&qkv, w, &mut attn, q, &rows, step.lens, step.tables, kc, vc, step.block_size, hs, step.scale,
                     step.window)?;
        l.o.forward(&attn, t, &mut delta)?;
        add_rms_norm(h, Some(&delta), l.post_norm, eps, &mut a, t, hidden)?;
        l.gate_up.forward(&a, t, &mut gu)?;
        silu_mul(&gu, &mut m, t, inter)?;
        l.down.forward(&m, t, &mut delta)?;
        have_delta = true;
    }
    for (x, d) in h.iter_mut().zip(delta.iter()) {
        *x += *d;
    }
    Ok(())
}
