//! Paged prefill attention on the CPU: a chunk of q query rows of one sequence over its
//! paged context, causal (row j of a chunk over n positions sees the first n - q + j + 1),
//! over a cached prefix, within a sliding window, scores soft-capped on request.
//!
//! Decode attention (`attention.rs`) reads every K and V row once per query row. Here the
//! rows of a chunk go in tiles of `TILE` rows: each K and V row the tile sees is read from
//! the cache and converted to f32 once, into a small buffer that stays in L1, and every query
//! head of the tile's rows uses it there (scores, then a causal softmax per row and head, then
//! the probability-weighted V rows). On a CPU without AVX2, or head sizes the vector kernel
//! does not take, the rows go through `paged_decode` one by one (same results).

use crate::kv::KvElem;
use crate::ops::{bad, has_avx2, Heads, OpError, P};
use crate::threads::{num_threads, parallel_for};

/// Query rows per tile.
const TILE: usize = 32;

/// Query vectors per register block of the AVX2 f32 tiles: scores (x 16 positions) and
/// output sums (x 16 dimensions), 12 accumulators each.
const QS: usize = 6;
const QP: usize = 6;

/// Positions per segment of the AVX2 f32 tiles (a multiple of 16): their converted K and V
/// rows, 64-128 KiB each, stay in L2.
const F32_SEG: usize = 256;

/// Positions per segment of a bf16 tile's online softmax (boundaries at multiples of it, so a
/// row's sums do not depend on its tile); even.
const SEG: usize = 256;

struct PrefillArgs<'a, E> {
    q: P,
    q_stride: usize,
    out: P,
    out_stride: usize,
    starts: &'a [i64],
    lens: &'a [i32],
    tables: &'a [i32],
    max_blocks: usize,
    k: &'a [E],
    v: &'a [E],
    bs: usize,
    hs: Heads,
    scale: f32,
    window: usize,
    softcap: f32,
    /// Per row of the call (from its first), the positions it sees at least: past its causal
    /// limit (`paged_prefill_see`); None: causal.
    see: Option<&'a [i32]>,
    first: usize,
}

impl<E> PrefillArgs<'_, E> {
    /// Sequence b's rows: (first row, count).
    fn rows(&self, b: usize) -> (usize, usize) {
        let s = self.starts[b] as usize;
        (s, self.starts[b + 1] as usize - s)
    }

    /// Positions row j (of q) of sequence b sees: lo..hi.
    fn span(&self, b: usize, q: usize, j: usize) -> (usize, usize) {
        let causal = self.lens[b] as usize - q + j + 1;
        let hi = match self.see {
            Some(see) => causal.max(see[self.starts[b] as usize + j - self.first] as usize),
            None => causal,
        };
        // a window counts back from the row's own position: what it sees past it is added
        // (transformers' Gemma 3: causal-and-windowed, or the same image)
        (if self.window > 0 { causal.saturating_sub(self.window) } else { 0 }, hi)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{PrefillArgs, F32_SEG, QP, QS, SEG, TILE};
    use crate::attention::cap_scores;
    use crate::attention::x86::{hmax, tail_mask};
    use crate::kv::KvElem;
    use crate::ops::x86::softmax_exp8;
    use crate::ops::Heads;
    use crate::quant::avx2::{hsum, transpose8};
    use std::arch::x86_64::*;

    pub(super) fn supports(hs: Heads) -> bool { hs.d % 8 == 0 && matches!(hs.d / 8, 4 | 8 | 16) && hs.nh / hs.nkv <= 64 }

    /// Scratch one thread reuses from tile to tile.
    #[derive(Default)]
    pub(super) struct Scratch {
        slots: Vec<usize>,
        scores: Vec<f32>,
        kt: Vec<f32>,
        vb: Vec<f32>,
        // the bf16 path's K, V, queries and probabilities, two bf16 values to a u32
        k2: Vec<u32>,
        v2: Vec<u32>,
        q2: Vec<u32>,
        p2: Vec<u32>,
        // the bf16 path's running output sums, f32 [query vector][d]
        acc: Vec<f32>,
    }

    /// Grow `buf` to `need` elements (every element read is written first: never cleared).
    fn grow<T: Default + Clone>(buf: &mut Vec<T>, need: usize) {
        if buf.len() < need {
            buf.resize(need, T::default());
        }
    }

    /// The span tile `tile` of sequence b sees (lo, hi), and with `rows` each K/V row's offset
    /// in the caches into `s.slots` (KV head kh).
    fn tile_slots<E: KvElem>(a: &PrefillArgs<E>, b: usize, tile: usize, kh: usize, s: &mut Scratch, rows: bool)
        -> (usize, usize) {
        let (_, q) = a.rows(b);
        let j0 = tile * TILE;
        let r = TILE.min(q - j0);
        // from an even position (one masked position more at most): the bf16 tile multiplies
        // positions in pairs (t, t + 1) from lo, so a row's sums are the same in every tile
        let (lo, _) = a.span(b, q, j0);
        let lo = lo & !1;
        let (_, hi) = a.span(b, q, j0 + r - 1);
        if !rows {
            return (lo, hi);
        }
        let table = &a.tables[b * a.max_blocks..(b + 1) * a.max_blocks];
        let du = E::units(a.hs.d);
        let kvw = a.hs.nkv * du;
        s.slots.clear();
        for bi in lo / a.bs..hi.div_ceil(a.bs) {
            let first = bi * a.bs;
            let base = table[bi] as usize * a.bs;
            s.slots.extend((first.max(lo)..(first + a.bs).min(hi)).map(|p| (base + p - first) * kvw + kh * du));
        }
        (lo, hi)
    }

    /// Tile `tile` (rows tile * TILE ..) of sequence b, KV head kh; head_dim = 8 * NV.
    ///
    /// The K rows the tile sees are converted to f32 once, transposed in chunks of 16
    /// positions (`kt[c][j][u]`: position 16c + u, dimension j), so `QS` (6) query vectors
    /// x 16 positions of scores build up in 12 registers with no horizontal sums; the V rows
    /// are converted once too (`vb`, row by row), and `QP` (6) query vectors x 16 dimensions
    /// of the output build up in 12 registers over every position. (4 x 16 and 2 x 32 in 8
    /// registers, before: each 256-bit load of K or V from L2 fed 4 FMAs, now 6; 512 rows
    /// over 2 k positions 1.03-1.31x, 6-20 rows 1.15-1.24x, the same bits.)
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile<E: KvElem, const NV: usize>(
        a: &PrefillArgs<E>, b: usize, tile: usize, kh: usize, s: &mut Scratch, w512: bool,
    ) {
        let Heads { nh, nkv, d } = a.hs;
        let g = nh / nkv;
        let (row0, q) = a.rows(b);
        let j0 = tile * TILE;
        let r = TILE.min(q - j0);
        let (lo, hi) = tile_slots(a, b, tile, kh, s, true);
        let span = hi - lo;
        let stride = span.next_multiple_of(16);
        let nq = r * g; // query vectors of the tile, (row, head) in order
        // The AVX2 kernels take the span in segments of F32_SEG positions: a segment's K and V
        // rows (converted) stay in L2 while every query vector of the tile uses them (the whole
        // span of a 2 k context did not: 74-77 GFLOP/s against 89 at 512). Each score is its own
        // sum and each output lane one sum in position order, continued from segment to segment
        // (`s.acc`): the same bits as one segment. The AVX-512 kernels take one.
        let seg = if w512 { stride } else { F32_SEG.min(stride) };
        // every element read below is written first (K chunks padded with zero rows, scores of
        // every query vector and chunk, V rows of the segment, the running sums zeroed)
        grow(&mut s.kt, seg * d);
        grow(&mut s.vb, seg * d);
        grow(&mut s.scores, nq * stride);
        let (kp, vp) = (a.k.as_ptr(), a.v.as_ptr());
        let (kt, vb, sp) = (s.kt.as_mut_ptr(), s.vb.as_mut_ptr(), s.scores.as_mut_ptr());
        let slots = &s.slots;
        // K of positions p0..p1 (p0 a multiple of 16) transposed per chunk of 16 positions, from
        // kt; padding positions are 0
        let k_rows = |p0: usize, p1: usize| {
            for c0 in (p0..p1).step_by(8) {
                for jb in 0..NV {
                    let mut cols = [_mm256_setzero_ps(); 8];
                    for (u, c) in cols.iter_mut().enumerate().take(span.saturating_sub(c0).min(8)) {
                        *c = E::load8(kp.add(slots[c0 + u]), 8 * jb, d);
                    }
                    transpose8(&mut cols);
                    let (chunk, half) = ((c0 - p0) / 16, (c0 % 16) / 8);
                    for (jj, col) in cols.iter().enumerate() {
                        _mm256_storeu_ps(kt.add(chunk * 16 * d + (8 * jb + jj) * 16 + 8 * half), *col);
                    }
                }
            }
        };
        // V of positions p0..p1 as rows, from vb
        let v_rows = |p0: usize, p1: usize| {
            for (u, &slot) in slots.iter().enumerate().take(p1.min(span)).skip(p0) {
                let src = vp.add(slot);
                for j in 0..NV {
                    _mm256_storeu_ps(vb.add((u - p0) * d + 8 * j), E::load8(src, 8 * j, d));
                }
            }
        };
        let qptr = |qi: usize| a.q.0.add((row0 + j0 + qi / g) * a.q_stride + (kh * g + qi % g) * d) as *const f32;
        let optr = |qi: usize| a.out.0.add((row0 + j0 + qi / g) * a.out_stride + (kh * g + qi % g) * d);
        let sc = _mm256_set1_ps(a.scale);
        let mut qps = [std::ptr::null::<f32>(); TILE * 64];
        let mut ops = [std::ptr::null_mut::<f32>(); TILE * 64];
        let mut spans = [(0usize, 0usize); TILE * 64];
        for qi in 0..nq {
            qps[qi] = qptr(qi);
            ops[qi] = optr(qi);
            let (rlo, rhi) = a.span(b, q, j0 + qi / g);
            spans[qi] = (rlo - lo, rhi - lo);
        }
        // scores: QS query vectors x 16 positions per register block (8 x 16 with AVX-512)
        for p0 in (0..stride).step_by(seg) {
            let p1 = (p0 + seg).min(stride);
            k_rows(p0, p1);
            if w512 {
                scores512(kt, sp, stride, d, &qps[..nq], a.scale);
                continue;
            }
            let mut qi = 0;
            while qi < nq {
                let m = QS.min(nq - qi);
                let qs: [*const f32; QS] = std::array::from_fn(|i| qptr(qi + i.min(m - 1)));
                for c in p0 / 16..p1 / 16 {
                    let kc = kt.add((c - p0 / 16) * 16 * d);
                    let mut acc = [[_mm256_setzero_ps(); 2]; QS];
                    for j in 0..8 * NV {
                        let k0 = _mm256_loadu_ps(kc.add(j * 16));
                        let k1 = _mm256_loadu_ps(kc.add(j * 16 + 8));
                        for (i, x) in acc.iter_mut().enumerate() {
                            let qb = _mm256_broadcast_ss(&*qs[i].add(j));
                            x[0] = _mm256_fmadd_ps(qb, k0, x[0]);
                            x[1] = _mm256_fmadd_ps(qb, k1, x[1]);
                        }
                    }
                    for (i, x) in acc.iter().enumerate().take(m) {
                        let o = sp.add((qi + i) * stride + 16 * c);
                        _mm256_storeu_ps(o, _mm256_mul_ps(x[0], sc));
                        _mm256_storeu_ps(o.add(8), _mm256_mul_ps(x[1], sc));
                    }
                }
                qi += m;
            }
        }
        // (a 16-lane softmax is ~10 % faster here, but its sums round differently from the row
        // kernel's, and the rows a prompt's tail attends after a prefix-cache hit go there: a
        // greedy answer in the tests changed with the cache)
        let mut inv = [0f32; TILE * 64];
        softmax_rows(a, b, j0, r, lo, sp, stride, &mut inv);
        // out = Σ p V / Σ p: QP query vectors x 16 dimensions per register block (4 x 64 with
        // AVX-512)
        if w512 {
            v_rows(0, stride);
            pv512(vb, sp, stride, d, &ops[..nq], &spans[..nq], &inv[..nq]);
            return;
        }
        grow(&mut s.acc, nq * d);
        let sums = s.acc.as_mut_ptr();
        std::ptr::write_bytes(sums, 0, nq * d);
        for p0 in (0..span).step_by(seg) {
            let p1 = (p0 + seg).min(span);
            v_rows(p0, p1);
            let mut qi = 0;
            while qi < nq {
                let m = QP.min(nq - qi);
                let idx: [usize; QP] = std::array::from_fn(|i| qi + i.min(m - 1));
                // positions any of them sees (their scores are 0 elsewhere), in this segment
                let t0 = idx.iter().map(|&k| spans[k].0).min().unwrap_or(0).max(p0);
                let t1 = idx.iter().map(|&k| spans[k].1).max().unwrap_or(0).min(p1);
                let ps: [*const f32; QP] = std::array::from_fn(|i| sp.add(idx[i] * stride) as *const f32);
                for db in 0..NV / 2 {
                    let rs: [*mut f32; QP] = std::array::from_fn(|i| sums.add(idx[i] * d + 16 * db));
                    let mut acc = [[_mm256_setzero_ps(); 2]; QP];
                    for (x, &r) in acc.iter_mut().zip(rs.iter()) {
                        *x = [_mm256_loadu_ps(r), _mm256_loadu_ps(r.add(8))];
                    }
                    for t in t0..t1 {
                        let v = vb.add((t - p0) * d + 16 * db);
                        let (v0, v1) = (_mm256_loadu_ps(v), _mm256_loadu_ps(v.add(8)));
                        for (x, &p) in acc.iter_mut().zip(ps.iter()) {
                            let w = _mm256_broadcast_ss(&*p.add(t));
                            x[0] = _mm256_fmadd_ps(w, v0, x[0]);
                            x[1] = _mm256_fmadd_ps(w, v1, x[1]);
                        }
                    }
                    for (x, &r) in acc.iter().zip(rs.iter()).take(m) {
                        _mm256_storeu_ps(r, x[0]);
                        _mm256_storeu_ps(r.add(8), x[1]);
                    }
                }
                qi += m;
            }
        }
        for (qk, &o) in ops.iter().enumerate().take(nq) {
            let iv = _mm256_set1_ps(inv[qk]);
            for j in 0..NV {
                _mm256_storeu_ps(o.add(8 * j), _mm256_mul_ps(_mm256_loadu_ps(sums.add(qk * d + 8 * j)), iv));
            }
        }
    }

    /// 16 floats at `src` as 16 bf16 (round to nearest even) at `dst`: 8 pairs.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
    unsafe fn bf16x16(src: *const f32, dst: *mut u32) {
        let v: __m256i = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(src)));
        _mm256_storeu_si256(dst as *mut __m256i, v);
    }

    /// Tile `tile` of sequence b, KV head kh, with bf16 products and f32 sums (AVX-512 BF16's
    /// `vdpbf16ps`: 32 products a register, twice the f32 FMA's). The tile's span is attended
    /// segment by segment (`SEG` positions, boundaries at multiples of `SEG` from position 0),
    /// with a running max and sum per query vector (online softmax), so the segment's K and V,
    /// scores and probabilities stay in L2 at any context: per segment the K rows as bf16
    /// pairs of dimensions per chunk of 16 positions (`k2[c][jp][u]`), the V rows as bf16
    /// pairs of positions per dimension (`v2[tp][j]`), the scores, and the probabilities
    /// rounded to bf16 (round to nearest even); the queries as bf16 once. Scores, softmax,
    /// sums and the output stay f32. A row's result depends on its own span only (absolute
    /// segments, pairs from even positions, zeros outside the span add nothing): the same in
    /// any tile.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    pub(super) unsafe fn tile_bf16<E: KvElem>(a: &PrefillArgs<E>, b: usize, tile: usize, kh: usize, s: &mut Scratch,
                                             shared: Option<(*const u32, *const u32)>) {
        let Heads { nh, nkv, d } = a.hs;
        let (g, dp) = (nh / nkv, d / 2);
        let (row0, q) = a.rows(b);
        let j0 = tile * TILE;
        let r = TILE.min(q - j0);
        let (lo, hi) = tile_slots(a, b, tile, kh, s, shared.is_none());
        let nq = r * g;
        grow(&mut s.k2, SEG * dp);
        grow(&mut s.v2, SEG / 2 * d);
        grow(&mut s.q2, nq * dp);
        grow(&mut s.p2, nq * SEG / 2);
        grow(&mut s.scores, nq * SEG);
        grow(&mut s.acc, nq * d);
        let (k2, v2, q2, p2, sp, accp) = (s.k2.as_mut_ptr(), s.v2.as_mut_ptr(), s.q2.as_mut_ptr(), s.p2.as_mut_ptr(),
                                          s.scores.as_mut_ptr(), s.acc.as_mut_ptr());
        std::slice::from_raw_parts_mut(accp, nq * d).fill(0.0);
        // per query vector: the running max, the running sum, this segment's rescale factor
        let mut run_max = [f32::NEG_INFINITY; TILE * 64];
        let mut run_sum = [0f32; TILE * 64];
        let mut fac = [1f32; TILE * 64];
        // the query vectors as bf16 pairs
        for qi in 0..nq {
            let src = a.q.0.add((row0 + j0 + qi / g) * a.q_stride + (kh * g + qi % g) * d) as *const f32;
            for j in (0..d).step_by(16) {
                bf16x16(src.add(j), q2.add(qi * dp + j / 2));
            }
        }
        let row_of = |x: usize| a.span(b, q, j0 + x / g);
        let sc = _mm512_set1_ps(a.scale);
        let mut p0 = lo;
        while p0 < hi {
            let p1 = ((p0 / SEG + 1) * SEG).min(hi);
            let span = p1 - p0;
            let stride = span.next_multiple_of(16);
            let (k2, v2) = match shared {
                // converted once for every tile of the KV head (`convert_bf16` from position 0)
                Some((ks, vs)) => (ks.add(p0 / 16 * 16 * dp) as *mut u32, vs.add(p0 / 2 * d) as *mut u32),
                None => {
                    let base = p0 - lo;
                    convert_bf16(a, |at| if at < span { Some(s.slots[base + at]) } else { None }, k2, v2, 0, stride);
                    (k2, v2)
                }
            };
            // scores: 8 query vectors x 32 positions per block of 16 registers
            let nc = stride / 16;
            let mut qi = 0;
            while qi < nq {
                let m = 8.min(nq - qi);
                let qs: [*const i32; 8] = std::array::from_fn(|i| q2.add((qi + i.min(m - 1)) * dp) as *const i32);
                let mut c = 0;
                while c < nc {
                    let two = c + 1 < nc;
                    let (k0p, k1p) = (k2.add(c * 16 * dp), k2.add((c + two as usize) * 16 * dp));
                    let mut acc = [[_mm512_setzero_ps(); 2]; 8];
                    for jp in 0..dp {
                        let k0: __m512bh = std::mem::transmute(_mm512_loadu_si512(k0p.add(jp * 16) as *const _));
                        let k1: __m512bh = std::mem::transmute(_mm512_loadu_si512(k1p.add(jp * 16) as *const _));
                        for (i, x) in acc.iter_mut().enumerate() {
                            let qb: __m512bh = std::mem::transmute(_mm512_set1_epi32(*qs[i].add(jp)));
                            x[0] = _mm512_dpbf16_ps(x[0], k0, qb);
                            x[1] = _mm512_dpbf16_ps(x[1], k1, qb);
                        }
                    }
                    store_scores(&acc[..m], sp.add(qi * stride + 16 * c), stride, two, sc);
                    c += 1 + two as usize;
                }
                qi += m;
            }
            // the probabilities as bf16 pairs of positions (0 outside each row's span)
            let sh = stride / 2;
            online_softmax512(a, b, j0, r, p0, p1, sp, stride, p2 as *mut u16, &mut run_max, &mut run_sum, &mut fac);
            // acc = acc * fac + Σ p V: 4 query vectors x 64 dimensions per block of 16
            // registers, over the pairs of positions any of the 4 sees in the segment
            let nz = d / 16;
            let mut qi = 0;
            while qi < nq {
                let m = 4.min(nq - qi);
                let t0 = (qi..qi + m).map(|x| row_of(x).0.max(p0) - p0).min().unwrap_or(0);
                let t1 = (qi..qi + m).map(|x| row_of(x).1.min(p1).saturating_sub(p0)).max().unwrap_or(0);
                let ps: [*const i32; 4] = std::array::from_fn(|k| p2.add((qi + k.min(m - 1)) * sh) as *const i32);
                let (tp0, tp1) = (t0 / 2, t1.div_ceil(2));
                for db in 0..nz.div_ceil(4) {
                    if nz - 4 * db >= 4 {
                        pv_block::<4>(accp, d, qi, m, &fac, &ps, v2, db, tp0, tp1);
                    } else {
                        pv_block::<2>(accp, d, qi, m, &fac, &ps, v2, db, tp0, tp1);
                    }
                }
                qi += m;
            }
            p0 = p1;
        }
        // out = acc / Σ p
        for (qk, sum) in run_sum.iter().enumerate().take(nq) {
            let o = a.out.0.add((row0 + j0 + qk / g) * a.out_stride + (kh * g + qk % g) * d);
            let iv = _mm512_set1_ps(1.0 / sum);
            for j in (0..d).step_by(16) {
                _mm512_storeu_ps(o.add(j), _mm512_mul_ps(_mm512_loadu_ps(accp.add(qk * d + j)), iv));
            }
        }
    }

    /// K and V rows of positions from..to (multiples of 16) as the bf16 tile multiplies them:
    /// K as bf16 pairs of dimensions per chunk of 16 positions (`k2[c][jp][u]`, chunk c of
    /// positions 16c..), V as bf16 pairs of positions per dimension (`v2[tp][j]`); `off(t)` the
    /// offset of position t's head row in the caches, None for a position past the rows (zeros).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    pub(super) unsafe fn convert_bf16<E: KvElem, F: Fn(usize) -> Option<usize>>(
        a: &PrefillArgs<E>, off: F, k2: *mut u32, v2: *mut u32, from: usize, to: usize,
    ) {
        let (d, dp) = (a.hs.d, a.hs.d / 2);
        let (kp, vp) = (a.k.as_ptr(), a.v.as_ptr());
        // 16 values of a cache row (from `i`) as 8 bf16 pairs; past the rows, zeros
        let pairs16 = |base: *const E, at: usize, i: usize| -> __m256i {
            match off(at) {
                Some(o) => {
                    let lo8: __m128i = std::mem::transmute(_mm256_cvtneps_pbh(E::load8(base.add(o), i, d)));
                    let hi8: __m128i = std::mem::transmute(_mm256_cvtneps_pbh(E::load8(base.add(o), i + 8, d)));
                    _mm256_set_m128i(hi8, lo8)
                }
                None => _mm256_setzero_si256(),
            }
        };
        // K: per 8 positions and 16 dimensions, 8 x 8 pairs transposed to k2[c][jp][u]
        for c0 in (from..to).step_by(8) {
            for jb in 0..d / 16 {
                let mut cols = [_mm256_setzero_ps(); 8];
                for (u, c) in cols.iter_mut().enumerate() {
                    *c = _mm256_castsi256_ps(pairs16(kp, c0 + u, 16 * jb));
                }
                transpose8(&mut cols);
                let (chunk, half) = (c0 / 16, (c0 % 16) / 8);
                for (jj, col) in cols.iter().enumerate() {
                    _mm256_storeu_ps(k2.add((chunk * dp + 8 * jb + jj) * 16 + 8 * half) as *mut f32, *col);
                }
            }
        }
        // V: per pair of positions (t, t + 1), v2[tp][j] = (v[t][j], v[t + 1][j])
        for tp in from / 2..to / 2 {
            for jb in 0..d / 16 {
                let (x, y) = (pairs16(vp, 2 * tp, 16 * jb), pairs16(vp, 2 * tp + 1, 16 * jb));
                let (l, h) = (_mm256_unpacklo_epi16(x, y), _mm256_unpackhi_epi16(x, y));
                let o = v2.add(tp * d + 16 * jb) as *mut __m256i;
                _mm256_storeu_si256(o, _mm256_permute2x128_si256::<0x20>(l, h));
                _mm256_storeu_si256(o.add(1), _mm256_permute2x128_si256::<0x31>(l, h));
            }
        }
    }

    /// The output sums `acc` (`[query vector][d]`, f32) of 4 query vectors from `qi` (`m` of
    /// them real: the others repeat the last), dimensions `64 db ..` (`16 NR` of them):
    /// acc = acc * fac + Σ over the pairs of positions tp0..tp1 of p V (`ps`: the query vectors'
    /// bf16 probability pairs, `v2`: the segment's V pairs). Every loop static: the 4 x NR
    /// sums stay in registers.
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    unsafe fn pv_block<const NR: usize>(accp: *mut f32, d: usize, qi: usize, m: usize, fac: &[f32],
                                        ps: &[*const i32; 4], v2: *const u32, db: usize, tp0: usize, tp1: usize) {
        let mut acc = [[_mm512_setzero_ps(); NR]; 4];
        for (k, x) in acc.iter_mut().enumerate() {
            let kk = qi + k.min(m - 1);
            let (at, f) = (accp.add(kk * d + 64 * db), _mm512_set1_ps(fac[kk]));
            for (j, y) in x.iter_mut().enumerate() {
                *y = _mm512_mul_ps(_mm512_loadu_ps(at.add(16 * j)), f);
            }
        }
        for tp in tp0..tp1 {
            let v = v2.add(tp * d + 64 * db);
            let w: [__m512bh; 4] = std::array::from_fn(|k| std::mem::transmute(_mm512_set1_epi32(*ps[k].add(tp))));
            for j in 0..NR {
                let vj: __m512bh = std::mem::transmute(_mm512_loadu_si512(v.add(16 * j) as *const _));
                for k in 0..4 {
                    acc[k][j] = _mm512_dpbf16_ps(acc[k][j], vj, w[k]);
                }
            }
        }
        for (k, x) in acc.iter().enumerate() {
            if k < m {
                let at = accp.add((qi + k) * d + 64 * db);
                for (j, y) in x.iter().enumerate() {
                    _mm512_storeu_ps(at.add(16 * j), *y);
                }
            }
        }
    }

    /// Scores of query vectors (one per `acc` entry, rows `stride` apart from `o`) over 16
    /// positions, or 32 with `two`, times the scale.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn store_scores(acc: &[[__m512; 2]], o: *mut f32, stride: usize, two: bool, sc: __m512) {
        for (i, x) in acc.iter().enumerate() {
            let o = o.add(i * stride);
            _mm512_storeu_ps(o, _mm512_mul_ps(x[0], sc));
            if two {
                _mm512_storeu_ps(o.add(16), _mm512_mul_ps(x[1], sc));
            }
        }
    }

    /// out_k[off + 16 j ..] = acc[k][j] * inv[k] for j < nr: a block of output rows.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn store_scaled512(acc: &[[__m512; 4]], nr: usize, outs: &[*mut f32], inv: &[f32], off: usize) {
        for ((x, o), iv) in acc.iter().zip(outs).zip(inv) {
            let iv = _mm512_set1_ps(*iv);
            for (j, y) in x.iter().enumerate().take(nr) {
                _mm512_storeu_ps(o.add(off + 16 * j), _mm512_mul_ps(*y, iv));
            }
        }
    }

    /// `super::exp` on 16 lanes for softmax weights (x <= 0): exactly 0 below e^-46, as
    /// `softmax_exp8`; the power of two applied by `vscalefps`.
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn softmax_exp16(x: __m512) -> __m512 {
        let keep = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(-46.0));
        let x = _mm512_max_ps(x, _mm512_set1_ps(-87.3));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(
            _mm512_fmadd_ps(x, _mm512_set1_ps(crate::ops::LOG2E), _mm512_set1_ps(0.5)));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_375), x);
        let r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(1.0 / 720.0);
        for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n))
    }

    /// One segment (positions p0..p1) of the online softmax of the tile's rows: per (row,
    /// head) over the row's own span in the segment, the scores (`sp`, a row of `stride` per
    /// query vector, from p0) become e^(s - max) rounded to bf16 in `p2` (a row of `stride`
    /// values per query vector: the pairs of positions `pv_block` multiplies), max the running
    /// max of the row's scores so far, 0 elsewhere; `fac` the factor that brings the earlier
    /// sums to the new max (1 when the max stays, 0 before any), `run_sum` the running sum of
    /// the f32 values. A row that sees nothing in the segment keeps its max and sum (factor 1,
    /// probabilities 0). The values go straight from the exponential to bf16 (the same bits as
    /// an f32 row stored and converted in a second pass, one pass fewer).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")]
    unsafe fn online_softmax512<E>(a: &PrefillArgs<E>, b: usize, j0: usize, r: usize, p0: usize, p1: usize,
                                   sp: *mut f32, stride: usize, p2: *mut u16, run_max: &mut [f32],
                                   run_sum: &mut [f32], fac: &mut [f32]) {
        let g = a.hs.nh / a.hs.nkv;
        let (_, q) = a.rows(b);
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        for i in 0..r {
            let (rlo, rhi) = a.span(b, q, j0 + i);
            let (a0, a1) = (rlo.max(p0) - p0, rhi.min(p1).saturating_sub(p0));
            for h in 0..g {
                let qi = i * g + h;
                let row = sp.add(qi * stride);
                let prow = p2.add(qi * stride);
                if a0 >= a1 {
                    std::slice::from_raw_parts_mut(prow, stride).fill(0);
                    fac[qi] = 1.0;
                    continue;
                }
                if a.softcap > 0.0 {
                    cap_scores(std::slice::from_raw_parts_mut(row.add(a0), a1 - a0), a.softcap);
                }
                let tail = |c: usize| -> __mmask16 { if c + 16 <= a1 { 0xffff } else { ((1u32 << (a1 - c)) - 1) as u16 } };
                let mut mv = ninf;
                let mut c = a0;
                while c < a1 {
                    mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(ninf, tail(c), row.add(c)));
                    c += 16;
                }
                let mx = _mm512_reduce_max_ps(mv).max(run_max[qi]);
                // e^(old max - new max): 0 before any score (old max -inf), 1 when it stays
                fac[qi] = _mm512_cvtss_f32(softmax_exp16(_mm512_set1_ps(run_max[qi] - mx)));
                run_max[qi] = mx;
                let neg = _mm512_set1_ps(-mx);
                let mut sum = _mm512_setzero_ps();
                // chunks of 16 from a multiple of 16 (the bf16 pairs start at even positions)
                let c0 = a0 & !15;
                let mut c = c0;
                while c < a1 {
                    let head = if a0 > c { !((1u32 << (a0 - c)) - 1) as u16 } else { 0xffff };
                    let m = head & tail(c);
                    let e = _mm512_maskz_mov_ps(m, softmax_exp16(_mm512_add_ps(_mm512_mask_loadu_ps(ninf, m, row.add(c)), neg)));
                    let pb: __m256i = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(e));
                    _mm256_storeu_si256(prow.add(c) as *mut __m256i, pb);
                    sum = _mm512_add_ps(sum, e);
                    c += 16;
                }
                std::slice::from_raw_parts_mut(prow, c0).fill(0);
                std::slice::from_raw_parts_mut(prow.add(c), stride - c).fill(0);
                run_sum[qi] = run_sum[qi] * fac[qi] + _mm512_reduce_add_ps(sum);
            }
        }
    }

    /// Causal softmax per (row, head) of the tile's scores (`sp`, a row of `stride` per query
    /// vector) over the row's own span; the rest of each row becomes 0; `inv[qi]`: 1 / sum.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn softmax_rows<E>(a: &PrefillArgs<E>, b: usize, j0: usize, r: usize, lo: usize, sp: *mut f32, stride: usize,
                              inv: &mut [f32]) {
        let g = a.hs.nh / a.hs.nkv;
        let (_, q) = a.rows(b);
        for i in 0..r {
            let (rlo, rhi) = a.span(b, q, j0 + i);
            let (a0, a1) = (rlo - lo, rhi - lo);
            for h in 0..g {
                let row = std::slice::from_raw_parts_mut(sp.add((i * g + h) * stride), stride);
                if a.softcap > 0.0 {
                    cap_scores(&mut row[a0..a1], a.softcap);
                }
                let mut mv = _mm256_set1_ps(f32::NEG_INFINITY);
                let mut c = a0;
                while c + 8 <= a1 {
                    mv = _mm256_max_ps(mv, _mm256_loadu_ps(row.as_ptr().add(c)));
                    c += 8;
                }
                let mut mx = hmax(mv);
                for &x in &row[c..a1] {
                    mx = mx.max(x);
                }
                let neg = _mm256_set1_ps(-mx);
                let mut sum = _mm256_setzero_ps();
                let mut c = a0;
                while c + 8 <= a1 {
                    let e = softmax_exp8(_mm256_add_ps(_mm256_loadu_ps(row.as_ptr().add(c)), neg));
                    _mm256_storeu_ps(row.as_mut_ptr().add(c), e);
                    sum = _mm256_add_ps(sum, e);
                    c += 8;
                }
                let mut total = hsum(sum);
                if c < a1 {
                    let mut tail = [f32::NEG_INFINITY; 8];
                    tail[..a1 - c].copy_from_slice(&row[c..a1]);
                    let e = _mm256_and_ps(softmax_exp8(_mm256_add_ps(_mm256_loadu_ps(tail.as_ptr()), neg)), tail_mask(a1 - c));
                    _mm256_storeu_ps(tail.as_mut_ptr(), e);
                    row[c..a1].copy_from_slice(&tail[..a1 - c]);
                    total += hsum(e);
                }
                row[..a0].fill(0.0);
                row[a1..].fill(0.0);
                inv[i * g + h] = 1.0 / total;
            }
        }
    }

    /// Scores of every query vector (`qps`) against every position, 8 vectors x 16 positions
    /// per block of 8 registers: sp[q * stride + t] = q · k_t * scale.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn scores512(kt: *const f32, sp: *mut f32, stride: usize, d: usize, qps: &[*const f32], scale: f32) {
        let sc = _mm512_set1_ps(scale);
        let nq = qps.len();
        let mut qi = 0;
        while qi < nq {
            let m = 8.min(nq - qi);
            let qs: [*const f32; 8] = std::array::from_fn(|i| qps[qi + i.min(m - 1)]);
            let nc = stride / 16;
            let mut c = 0;
            while c < nc {
                // two chunks of 16 positions at a time (16 accumulators), the last one alone
                let two = c + 1 < nc;
                let (k0p, k1p) = (kt.add(c * 16 * d), kt.add((c + two as usize) * 16 * d));
                let mut acc = [[_mm512_setzero_ps(); 2]; 8];
                for j in 0..d {
                    let k0 = _mm512_loadu_ps(k0p.add(j * 16));
                    let k1 = _mm512_loadu_ps(k1p.add(j * 16));
                    for (i, x) in acc.iter_mut().enumerate() {
                        let qb = _mm512_set1_ps(*qs[i].add(j));
                        x[0] = _mm512_fmadd_ps(qb, k0, x[0]);
                        x[1] = _mm512_fmadd_ps(qb, k1, x[1]);
                    }
                }
                store_scores(&acc[..m], sp.add(qi * stride + 16 * c), stride, two, sc);
                c += 1 + two as usize;
            }
            qi += m;
        }
    }

    /// out_q = inv_q · Σ_t p[q, t] v_t over each query vector's positions, 4 vectors x 64
    /// dimensions per block of 16 registers.
    #[target_feature(enable = "avx512f,avx2,fma,f16c")]
    unsafe fn pv512(vb: *const f32, sp: *const f32, stride: usize, d: usize, ops: &[*mut f32], spans: &[(usize, usize)],
                    inv: &[f32]) {
        let nq = ops.len();
        let nz = d / 16;
        let mut qi = 0;
        while qi < nq {
            let m = 4.min(nq - qi);
            let t0 = (qi..qi + m).map(|x| spans[x].0).min().unwrap_or(0);
            let t1 = (qi..qi + m).map(|x| spans[x].1).max().unwrap_or(0);
            let ps: [*const f32; 4] = std::array::from_fn(|k| sp.add((qi + k.min(m - 1)) * stride));
            for db in 0..nz.div_ceil(4) {
                let nr = 4.min(nz - 4 * db);
                let mut acc = [[_mm512_setzero_ps(); 4]; 4];
                for t in t0..t1 {
                    let v = vb.add(t * d + 64 * db);
                    let w = [_mm512_set1_ps(*ps[0].add(t)), _mm512_set1_ps(*ps[1].add(t)),
                             _mm512_set1_ps(*ps[2].add(t)), _mm512_set1_ps(*ps[3].add(t))];
                    for j in 0..nr {
                        let vj = _mm512_loadu_ps(v.add(16 * j));
                        for k in 0..4 {
                            acc[k][j] = _mm512_fmadd_ps(w[k], vj, acc[k][j]);
                        }
                    }
                }
                store_scaled512(&acc[..m], nr, &ops[qi..qi + m], &inv[qi..qi + m], 64 * db);
            }
            qi += m;
        }
    }

    impl Scratch {
        fn bytes(&self) -> usize {
            8 * self.slots.capacity()
                + 4 * (self.scores.capacity() + self.kt.capacity() + self.vb.capacity() + self.acc.capacity())
                + 4 * (self.k2.capacity() + self.v2.capacity() + self.q2.capacity() + self.p2.capacity())
        }
    }

    thread_local! {
        /// Each thread's scratch, kept from call to call: a tile's scores over a 2 k context
        /// (32 rows x 4 heads) pass a megabyte, which a server's allocator maps fresh each
        /// time (`tame_malloc`) and the call then faulted in again, page by page.
        static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
    }

    /// The most a thread's scratch keeps between calls (a longer context's is made per call).
    const KEEP_BYTES: usize = 16 << 20;

    /// Work items i0..i1 (`items` lists (sequence, tile, KV head)).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn run<E: KvElem>(a: &PrefillArgs<E>, items: &[(usize, usize, usize)], w512: bool, bf16: bool,
                                        shared: Option<&super::Shared>) {
        // (never re-entered: a pool thread runs one chunk at a time, and no tile calls back)
        let mut s = SCRATCH.with(|c| std::mem::take(&mut *c.borrow_mut()));
        run_with(a, items, w512, bf16, shared, &mut s);
        if s.bytes() <= KEEP_BYTES {
            SCRATCH.with(|c| *c.borrow_mut() = s);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run_with<E: KvElem>(a: &PrefillArgs<E>, items: &[(usize, usize, usize)], w512: bool, bf16: bool,
                                  shared: Option<&super::Shared>, s: &mut Scratch) {
        for &(b, t, kh) in items {
            if bf16 {
                tile_bf16(a, b, t, kh, s, shared.map(|x| x.of(b, kh)));
                continue;
            }
            match a.hs.d / 8 {
                4 => tile::<E, 4>(a, b, t, kh, s, w512),
                8 => tile::<E, 8>(a, b, t, kh, s, w512),
                16 => tile::<E, 16>(a, b, t, kh, s, w512),
                _ => unreachable!(),
            }
        }
    }
}

/// Attention of the rows `starts[b] .. starts[b + 1]` of sequence b (a prefill chunk of
/// q rows) over its paged context of `lens[b]` positions, the chunk's own among them: row j
/// sees positions `0 .. lens[b] - q + j + 1` (the last `window` of those when window > 0),
/// scaled scores soft-capped as cap · tanh(s / cap) when softcap > 0. `q` holds each row's
/// query heads at `q[row * q_stride ..]` (e.g. the Q part of fused QKV rows); the result
/// goes to `out[row * out_stride ..]`. `tables` is `[B, max_blocks]`, caches are
/// `[num_blocks * bs, nkv, E::units(d)]` (head rows of `d` values, see `kv`).
#[allow(clippy::too_many_arguments)]
pub fn paged_prefill<E: KvElem>(
    q: &[f32], q_stride: usize, out: &mut [f32], out_stride: usize, starts: &[i64], lens: &[i32], tables: &[i32],
    k_cache: &[E], v_cache: &[E], bs: usize, hs: Heads, scale: f32, window: usize, softcap: f32,
) -> Result<(), OpError> {
    // an f32 cache attends in f32; an f16 or q8_0 one with bf16 products when they are on
    let bf16 = std::mem::size_of::<E>() < 4 && crate::isa::bf16_attention();
    prefill(q, q_stride, out, out_stride, starts, lens, tables, k_cache, v_cache, bs, hs, scale, window, softcap, true, bf16)
}

/// `paged_prefill` where rows may see past their causal limit: row r of the call (counted
/// from `starts[0]`) sees positions `0 .. max(its causal limit, see[r])`, `see` within the
/// sequence's context and never smaller for a later row of it. A vision tower's patches
/// (every row sees the whole image: `see` = its length) and Gemma 3's image tokens (each sees
/// its image's last token) attend both ways.
#[allow(clippy::too_many_arguments)]
pub fn paged_prefill_see<E: KvElem>(
    q: &[f32], q_stride: usize, out: &mut [f32], out_stride: usize, starts: &[i64], lens: &[i32], tables: &[i32],
    k_cache: &[E], v_cache: &[E], bs: usize, hs: Heads, scale: f32, window: usize, softcap: f32, see: Option<&[i32]>,
) -> Result<(), OpError> {
    let bf16 = std::mem::size_of::<E>() < 4 && crate::isa::bf16_attention();
    prefill_see(q, q_stride, out, out_stride, starts, lens, tables, k_cache, v_cache, bs, hs, scale, window, softcap, true,
                bf16, see)
}

/// `prefill` in the model's space: over a rotated cache (`KvElem::ROTATED`, q8_0) the query
/// rows are turned first and the output rows turned back (see `paged_decode`).
#[allow(clippy::too_many_arguments)]
fn prefill<E: KvElem>(
    q: &[f32], q_stride: usize, out: &mut [f32], out_stride: usize, starts: &[i64], lens: &[i32], tables: &[i32],
    k_cache: &[E], v_cache: &[E], bs: usize, hs: Heads, scale: f32, window: usize, softcap: f32, allow512: bool,
    bf16: bool,
) -> Result<(), OpError> {
    prefill_see(q, q_stride, out, out_stride, starts, lens, tables, k_cache, v_cache, bs, hs, scale, window, softcap,
                allow512, bf16, None)
}

#[allow(clippy::too_many_arguments)]
fn prefill_see<E: KvElem>(
    q: &[f32], q_stride: usize, out: &mut [f32], out_stride: usize, starts: &[i64], lens: &[i32], tables: &[i32],
    k_cache: &[E], v_cache: &[E], bs: usize, hs: Heads, scale: f32, window: usize, softcap: f32, allow512: bool,
    bf16: bool, see: Option<&[i32]>,
) -> Result<(), OpError> {
    if !E::ROTATED {
        return prefill_rows(q, q_stride, out, out_stride, starts, lens, tables, k_cache, v_cache, bs, hs, scale, window,
                            softcap, allow512, bf16, see);
    }
    let w = hs.nh * hs.d;
    if !E::supports(hs.d) || hs.d > 512 {
        return bad(format!("paged_prefill: unsupported heads {}/{} x {} ({} cache)", hs.nh, hs.nkv, hs.d, E::NAME));
    }
    let (first, last) = (starts.first().copied().unwrap_or(0), starts.last().copied().unwrap_or(0));
    if first < 0 || last < first || (last > 0 && ((last as usize - 1) * q_stride + w > q.len()
                                                  || (last as usize - 1) * out_stride + w > out.len())) {
        return bad("paged_prefill: rows outside q/out");
    }
    let (first, last) = (first as usize, last as usize);
    let qt = crate::kv::turned_rows(q, q_stride, first..last, hs.nh, hs.d);
    let mut ot = vec![0f32; qt.len()];
    let shifted: Vec<i64> = starts.iter().map(|&s| s - first as i64).collect();
    prefill_rows(&qt, w, &mut ot, w, &shifted, lens, tables, k_cache, v_cache, bs, hs, scale, window, softcap, allow512,
                 bf16, see)?;
    crate::kv::turn_back_rows(&ot, out, out_stride, first..last, hs.nh, hs.d);
    Ok(())
}

/// `paged_prefill` on the cache's own rows, the AVX-512 micro-kernels allowed or not (the
/// tests run both), with bf16 products (`bf16`, where the CPU has AVX-512 BF16) or f32 ones.
#[allow(clippy::too_many_arguments)]
fn prefill_rows<E: KvElem>(
    q: &[f32], q_stride: usize, out: &mut [f32], out_stride: usize, starts: &[i64], lens: &[i32], tables: &[i32],
    k_cache: &[E], v_cache: &[E], bs: usize, hs: Heads, scale: f32, window: usize, softcap: f32, allow512: bool,
    bf16: bool, see: Option<&[i32]>,
) -> Result<(), OpError> {
    let nseq = lens.len();
    if starts.len() != nseq + 1 || (nseq > 0 && tables.len() % nseq != 0) {
        return bad("paged_prefill: starts, lens and tables disagree on the number of sequences");
    }
    let first = starts.first().copied().unwrap_or(0).max(0) as usize;
    if let Some(see) = see {
        if see.len() as i64 != starts.last().copied().unwrap_or(0) - first as i64 {
            return bad("paged_prefill: `see` must have one entry per row");
        }
    }
    let mut rows = Vec::new();
    let mut row_lens = Vec::new();
    for b in 0..nseq {
        let (s, e, n) = (starts[b], starts[b + 1], lens[b] as i64);
        if s < 0 || e < s || e - s > n {
            return bad(format!("paged_prefill: sequence {b}: rows {s}..{e} over a context of {n}"));
        }
        let mut last = 0i64;
        for (j, r) in (s..e).enumerate() {
            rows.push(r);
            let mut hi = n - (e - s) + j as i64 + 1;
            if let Some(see) = see {
                let x = see[r as usize - first] as i64;
                if x > n || x < last {
                    return bad(format!("paged_prefill: sequence {b}: `see` past its context of {n} or decreasing"));
                }
                last = x;
                hi = hi.max(x);
            }
            row_lens.push(hi as i32);
        }
    }
    let max_blocks = if nseq > 0 { tables.len() / nseq } else { 0 };
    #[cfg(target_arch = "x86_64")]
    let vector = has_avx2() && x86::supports(hs);
    #[cfg(target_arch = "x86_64")]
    let w512 = allow512 && vector && crate::isa::has_avx512f();
    #[cfg(target_arch = "x86_64")]
    let bf16 = bf16 && w512 && crate::isa::has_avx512bf16();
    #[cfg(not(target_arch = "x86_64"))]
    let vector = false;
    if !vector || rows.is_empty() {
        // one row at a time: the decode kernel checks every row, length and block id
        let mut row_tables = Vec::with_capacity(rows.len() * max_blocks);
        for b in 0..nseq {
            for _ in starts[b]..starts[b + 1] {
                row_tables.extend_from_slice(&tables[b * max_blocks..(b + 1) * max_blocks]);
            }
        }
        if see.is_some() && window > 0 {
            // rows that see past their causal limit attend without the window here (the tiles keep
            // it for the positions before the row); the others with it
            let mut causal = Vec::with_capacity(rows.len());
            for b in 0..nseq {
                let (s, e, n) = (starts[b], starts[b + 1], lens[b] as i64);
                causal.extend((0..e - s).map(|j| (n - (e - s) + j + 1) as i32));
            }
            for wide in [false, true] {
                let pick: Vec<usize> = (0..rows.len()).filter(|&i| (row_lens[i] > causal[i]) == wide).collect();
                if pick.is_empty() {
                    continue;
                }
                let mb = max_blocks;
                let (r, l) = (pick.iter().map(|&i| rows[i]).collect::<Vec<_>>(), pick.iter().map(|&i| row_lens[i]).collect::<Vec<_>>());
                let t: Vec<i32> = pick.iter().flat_map(|&i| row_tables[i * mb..(i + 1) * mb].iter().copied()).collect();
                crate::attention::decode(q, q_stride, out, out_stride, &r, &l, &t, k_cache, v_cache, bs, hs, scale,
                                         if wide { 0 } else { window }, softcap)?;
            }
            return Ok(());
        }
        return crate::attention::decode(q, q_stride, out, out_stride, &rows, &row_lens, &row_tables, k_cache, v_cache, bs,
                                        hs, scale, window, softcap);
    }
    // the same checks as paged_decode's, once per sequence
    let Heads { nh, nkv, d } = hs;
    if nkv == 0 || nh % nkv != 0 || d == 0 || bs == 0 || !E::supports(d) {
        return bad(format!("paged_prefill: unsupported heads {nh}/{nkv} x {d} ({} cache)", E::NAME));
    }
    let kvw = nkv * E::units(d);
    let num_blocks = k_cache.len().min(v_cache.len()) / kvw / bs;
    let last = *starts.last().unwrap_or(&0) as usize;
    if last > 0 && ((last - 1) * q_stride + nh * d > q.len() || (last - 1) * out_stride + nh * d > out.len()) {
        return bad("paged_prefill: rows outside q/out");
    }
    for b in 0..nseq {
        let n = lens[b].max(0) as usize;
        if n < 1 || n > max_blocks * bs {
            return bad(format!("paged_prefill: context length {n} does not fit the block table"));
        }
        if let Some(&blk) = tables[b * max_blocks..b * max_blocks + n.div_ceil(bs)].iter().find(|&&x| x < 0 || x as usize >= num_blocks) {
            return bad(format!("paged_prefill: block {blk} outside the cache of {num_blocks} blocks"));
        }
    }
    let args = PrefillArgs {
        q: P(q.as_ptr() as *mut f32), q_stride, out: P(out.as_mut_ptr()), out_stride, starts, lens, tables, max_blocks,
        k: k_cache, v: v_cache, bs, hs, scale, window, softcap, see, first,
    };
    #[cfg(target_arch = "x86_64")]
    if bf16 && window == 0 && SHARE_KV.load(std::sync::atomic::Ordering::Relaxed) {
        let offs: Vec<usize> = (0..=nseq).scan(0usize, |at, b| {
            let here = *at;
            if b < nseq {
                *at += (lens[b] as usize).next_multiple_of(16) * (d / 2);
            }
            Some(here)
        }).collect();
        // a sequence of one tile a head converts its rows once either way; of 2 or 3, the
        // second pass over the rows costs about what it saves (bench/RESULTS.md)
        let tiles = (0..nseq).map(|b| args.rows(b).1.div_ceil(TILE)).max().unwrap_or(0);
        if tiles >= SHARED_MIN_TILES && offs[nseq] * nkv * 8 <= SHARED_MAX_BYTES {
            shared_heads(&args, &offs, w512);
            return Ok(());
        }
    }
    let mut items = Vec::new();
    for b in 0..nseq {
        let (_, q) = args.rows(b);
        for t in 0..q.div_ceil(TILE) {
            for kh in 0..nkv {
                items.push((b, t, kh));
            }
        }
    }
    run_items(&args, items, w512, bf16, None);
    Ok(())
}

/// The tiles `items` on the kernel threads: later tiles (they see more positions) handed out
/// first, in small chunks taken in turn.
fn run_items<E: KvElem>(args: &PrefillArgs<E>, mut items: Vec<(usize, usize, usize)>, w512: bool, bf16: bool,
                        shared: Option<&Shared>) {
    items.reverse();
    let per = items.len().div_ceil(num_threads() * 4).max(1);
    let run = |c: usize| {
        let chunk = &items[c * per..((c + 1) * per).min(items.len())];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: rows, lengths and block ids were checked against q, out and the caches by
        // `prefill_rows`; items write disjoint (row, head) slices of `out`; the CPU has AVX2, FMA
        // and F16C (and AVX-512 BF16 when `bf16`); `shared` holds every sequence's converted
        // rows of every KV head.
        unsafe {
            x86::run(args, chunk, w512, bf16, shared)
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (chunk, bf16, w512, shared);
    };
    let chunks = items.len().div_ceil(per);
    if chunks < 2 {
        (0..chunks).for_each(run);
    } else {
        parallel_for(chunks, &run);
    }
}

/// Bytes of converted K and V rows the bf16 tiles may share (`shared_heads`); past it, each
/// tile converts its own.
const SHARED_MAX_BYTES: usize = 64 << 20;

/// Tiles a sequence's chunk needs (its longest) before its tiles share converted rows.
const SHARED_MIN_TILES: usize = 4;

/// Whether the bf16 tiles share converted rows (`set_shared_rows`).
static SHARE_KV: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether the bf16 tiles of a chunk of 4 tiles or more (without a window) read K and V rows
/// converted once for all of them (on unless turned off; the same bits either way).
pub fn shared_rows() -> bool { SHARE_KV.load(std::sync::atomic::Ordering::Relaxed) }

/// Turns the shared rows on or off for the process (the benchmarks compare both); returns
/// the previous setting.
pub fn set_shared_rows(on: bool) -> bool { SHARE_KV.swap(on, std::sync::atomic::Ordering::Relaxed) }

/// Every sequence's K and V rows of every KV head as the bf16 tiles multiply them (from
/// position 0, `x86::convert_bf16`): sequence b's of head kh at `kh * total + offs[b]` u32s
/// into `k` and into `v`.
struct Shared {
    k: *const u32,
    v: *const u32,
    offs: Vec<usize>,
}

// SAFETY: the pointers are only read, by pool threads, while `shared_heads` keeps the buffer.
unsafe impl Sync for Shared {}

impl Shared {
    fn of(&self, b: usize, kh: usize) -> (*const u32, *const u32) {
        let at = kh * self.offs[self.offs.len() - 1] + self.offs[b];
        // SAFETY: within the buffer (`shared_heads` sized it from offs and the KV heads)
        unsafe { (self.k.add(at), self.v.add(at)) }
    }
}

/// The converted rows `shared_heads` fills, kept between calls (no fresh pages each layer);
/// a call that finds it taken (another model's step) fills one of its own.
static SHARED_BUF: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());

/// The bf16 tiles without a window: first every sequence's K and V rows of every KV head
/// converted once (in pieces of `SEG` positions on the kernel threads), then every tile reads
/// them, rather than each converting its own (a 512-row chunk has 16 tiles a head). The same
/// bits as tiles converting their own rows: the same values at the same places, and
/// positions past a tile's span multiplied by probabilities of 0.
#[cfg(target_arch = "x86_64")]
fn shared_heads<E: KvElem>(args: &PrefillArgs<E>, offs: &[usize], w512: bool) {
    let nseq = args.lens.len();
    let Heads { nkv, d, .. } = args.hs;
    let total = offs[nseq];
    let mut own = Vec::new();
    let mut kept = SHARED_BUF.try_lock().ok();
    let buf = kept.as_deref_mut().unwrap_or(&mut own);
    if buf.len() < 2 * nkv * total {
        buf.resize(2 * nkv * total, 0);
    }
    let (k, v) = buf.split_at_mut(nkv * total);
    let shared = Shared { k: k.as_ptr(), v: v.as_ptr(), offs: offs.to_vec() };
    let (kw, vw) = (P(k.as_mut_ptr() as *mut f32), P(v.as_mut_ptr() as *mut f32));
    let (kw, vw) = (&kw, &vw);
    let mut pieces = Vec::new();
    for kh in 0..nkv {
        for b in 0..nseq {
            let n = (args.lens[b] as usize).next_multiple_of(16);
            pieces.extend((0..n).step_by(SEG).map(|p| (b, kh, p, (p + SEG).min(n))));
        }
    }
    let (bs, kvw, du) = (args.bs, nkv * E::units(d), E::units(d));
    let convert = |i: usize| {
        let (b, kh, from, to) = pieces[i];
        let n = args.lens[b] as usize;
        let table = &args.tables[b * args.max_blocks..(b + 1) * args.max_blocks];
        // each position's head row, found once (not once per 16 values)
        let mut rows = [usize::MAX; SEG];
        for (p, r) in (from..to.min(n)).zip(rows.iter_mut()) {
            *r = (table[p / bs] as usize * bs + p % bs) * kvw + kh * du;
        }
        let slot = |p: usize| if p < n { Some(rows[p - from]) } else { None };
        let at = kh * total + offs[b];
        // SAFETY: the block ids were checked by `prefill_rows`; pieces write disjoint
        // positions of one (sequence, head)'s rows, within the buffer; the CPU has AVX-512 BF16.
        unsafe { x86::convert_bf16(args, slot, (kw.0 as *mut u32).add(at), (vw.0 as *mut u32).add(at), from, to) }
    };
    parallel_for(pieces.len(), &convert);
    let mut items = Vec::new();
    for b in 0..nseq {
        let (_, q) = args.rows(b);
        for t in 0..q.div_ceil(TILE) {
            items.extend((0..nkv).map(|kh| (b, t, kh)));
        }
    }
    run_items(args, items, w512, true, Some(&shared));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::paged_decode;

    /// bf16 products against f32 ones: the largest difference over the largest output value.
    const BF16_BOUND: f32 = 1e-2;

    /// The tile kernel against the decode kernel row by row: f32, f16 and q8_0 caches, chunks over
    /// a cached prefix, a chunk longer than a tile, windows, soft-capping, odd lengths.
    #[test]
    fn prefill_matches_decode_row_by_row() {
        for (d, nh) in [(32usize, 6usize), (64, 6), (128, 10)] {
            let hs = Heads { nh, nkv: 2, d };
            let (bs, nblocks) = (4usize, 40usize);
            let kvw = hs.nkv * hs.d;
            let mut seed = 11u64;
            let mut rnd = || {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            };
            let k: Vec<f32> = (0..nblocks * bs * kvw).map(|_| rnd()).collect();
            let v: Vec<f32> = (0..nblocks * bs * kvw).map(|_| rnd()).collect();
            let k16: Vec<crate::kv::F16> = k.iter().map(|&x| <crate::kv::F16 as crate::kv::KvScalar>::from_f32(x)).collect();
            let v16: Vec<crate::kv::F16> = v.iter().map(|&x| <crate::kv::F16 as crate::kv::KvScalar>::from_f32(x)).collect();
            let ((k8, kd), (v8, vd)) = (crate::attention::tests::q8_cache(&k, d), crate::attention::tests::q8_cache(&v, d));
            // three sequences: 37 rows over 41 positions, 3 over 3, 20 over 60
            let starts = [0i64, 37, 40, 60];
            let lens = [41i32, 3, 60];
            let mb = 15;
            let tables: Vec<i32> = (0..3).flat_map(|b| (0..mb).map(move |i| ((b * 13 + i * 7) % 40) as i32)).collect();
            let q: Vec<f32> = (0..60 * hs.nh * hs.d).map(|_| rnd()).collect();
            for (window, cap, w512) in [(0usize, 0f32, true), (9, 0.0, true), (0, 0.3, true), (9, 0.3, true),
                                        (0, 0.0, false), (9, 0.3, false)] {
                let mut got = vec![0f32; 60 * hs.nh * d];
                let mut want = vec![0f32; 60 * hs.nh * d];
                prefill(&q, hs.nh * d, &mut got, hs.nh * d, &starts, &lens, &tables, &k, &v, bs, hs, 0.3, window, cap, w512,
                        false).unwrap();
                let mut rows = Vec::new();
                let mut rl = Vec::new();
                let mut rt = Vec::new();
                for b in 0..3 {
                    let qn = (starts[b + 1] - starts[b]) as i32;
                    for j in 0..qn {
                        rows.push(starts[b] + j as i64);
                        rl.push(lens[b] - qn + j + 1);
                        rt.extend_from_slice(&tables[b * mb..(b + 1) * mb]);
                    }
                }
                paged_decode(&q, hs.nh * d, &mut want, hs.nh * d, &rows, &rl, &rt, &k, &v, bs, hs, 0.3, window, cap).unwrap();
                let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(err < 1e-5, "d {d} window {window} cap {cap} avx512 {w512}: max error {err}");
                let mut got16 = vec![0f32; 60 * hs.nh * d];
                let mut want16 = vec![0f32; 60 * hs.nh * d];
                prefill(&q, hs.nh * d, &mut got16, hs.nh * d, &starts, &lens, &tables, &k16, &v16, bs, hs, 0.3, window, cap,
                        w512, false).unwrap();
                paged_decode(&q, hs.nh * d, &mut want16, hs.nh * d, &rows, &rl, &rt, &k16, &v16, bs, hs, 0.3, window, cap)
                    .unwrap();
                let err = got16.iter().zip(&want16).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(err < 1e-5, "f16 d {d} window {window} cap {cap}: max error {err}");
                // q8_0: the tiles read the blocks as the decode kernel does
                let (mut got8, mut want8) = (vec![0f32; 60 * hs.nh * d], vec![0f32; 60 * hs.nh * d]);
                prefill(&q, hs.nh * d, &mut got8, hs.nh * d, &starts, &lens, &tables, &k8, &v8, bs, hs, 0.3, window, cap,
                        w512, false).unwrap();
                paged_decode(&q, hs.nh * d, &mut want8, hs.nh * d, &rows, &rl, &rt, &kd, &vd, bs, hs, 0.3, window, cap)
                    .unwrap();
                let err = got8.iter().zip(&want8).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(err < 1e-5, "q8_0 d {d} window {window} cap {cap}: max error {err}");
                // bf16 products (where the CPU has them): within BF16_BOUND of the f32 sums, relative
                // to the output's largest value
                if w512 && crate::isa::has_avx512bf16() {
                    let bound = |got: &[f32], want: &[f32]| {
                        let top = want.iter().fold(0f32, |m, x| m.max(x.abs()));
                        got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / top
                    };
                    let (mut got16, mut got8) = (vec![0f32; 60 * hs.nh * d], vec![0f32; 60 * hs.nh * d]);
                    prefill(&q, hs.nh * d, &mut got16, hs.nh * d, &starts, &lens, &tables, &k16, &v16, bs, hs, 0.3,
                            window, cap, true, true).unwrap();
                    prefill(&q, hs.nh * d, &mut got8, hs.nh * d, &starts, &lens, &tables, &k8, &v8, bs, hs, 0.3, window,
                            cap, true, true).unwrap();
                    for (cache, err) in [("f16", bound(&got16, &want16)), ("q8_0", bound(&got8, &want8))] {
                        assert!(err > 0.0 && err < BF16_BOUND, "bf16 {cache} d {d} window {window} cap {cap}: error {err}");
                    }
                }
            }
            // a row outside the table is refused, not read
            let mut out = vec![0f32; 60 * hs.nh * d];
            assert!(paged_prefill(&q, hs.nh * d, &mut out, hs.nh * d, &[0, 5], &[4], &tables[..mb], &k, &v, bs, hs, 0.3, 0, 0.0)
                .is_err());
        }
    }

    /// Spans of several bf16 segments (`SEG` positions each, online softmax): within
    /// BF16_BOUND of the f32 tiles, causal and windowed across segment boundaries, soft-capped;
    /// a row the same, bit for bit, whichever tile holds it (45 rows whole against 3 + 42).
    #[test]
    fn bf16_segments_match_f32_and_any_tile() {
        if !(crate::isa::has_avx512f() && crate::isa::has_avx512bf16()) {
            return;
        }
        for (d, nh) in [(64usize, 8usize), (32, 6), (128, 4)] {
            let hs = Heads { nh, nkv: 2, d };
            let (bs, n, rows) = (16usize, 3 * SEG + 77, 45usize);
            let nblocks = n.div_ceil(bs) + 3;
            let mut seed = 5u64;
            let mut rnd = || {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            };
            let f16 = |x: f32| <crate::kv::F16 as crate::kv::KvScalar>::from_f32(x);
            let kvw = hs.nkv * hs.d;
            // scores of a few units: the running max moves from segment to segment
            let k: Vec<crate::kv::F16> = (0..nblocks * bs * kvw).map(|_| f16(4.0 * rnd())).collect();
            let v: Vec<crate::kv::F16> = (0..nblocks * bs * kvw).map(|_| f16(rnd())).collect();
            let tables: Vec<i32> = (0..nblocks as i32).map(|i| (i * 7 + 3) % nblocks as i32).collect();
            let w = hs.nh * hs.d;
            let q: Vec<f32> = (0..rows * w).map(|_| rnd()).collect();
            for (window, cap) in [(0usize, 0f32), (SEG + 40, 0.0), (0, 3.0), (SEG / 2 + 9, 3.0)] {
                // rows `r0..r1` of the chunk as a chunk of their own (over the context they see)
                let run = |r0: usize, r1: usize, bf16: bool, out: &mut [f32]| {
                    prefill(&q[r0 * w..r1 * w], w, out, w, &[0, (r1 - r0) as i64], &[(n - rows + r1) as i32], &tables,
                            &k, &v, bs, hs, 0.3, window, cap, true, bf16)
                        .unwrap()
                };
                let zeros = || vec![0f32; rows * w];
                let (mut f32s, mut whole, mut split) = (zeros(), zeros(), zeros());
                run(0, rows, false, &mut f32s);
                run(0, rows, true, &mut whole);
                let top = f32s.iter().fold(0f32, |m, x| m.max(x.abs()));
                let err = whole.iter().zip(&f32s).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / top;
                assert!(err > 0.0 && err < BF16_BOUND, "d {d} window {window} cap {cap}: error {err}");
                run(0, 3, true, &mut split[..3 * w]);
                run(3, rows, true, &mut split[3 * w..]);
                let same = whole.iter().zip(&split).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "d {d} window {window} cap {cap}");
            }
        }
    }

    /// A row's result does not depend on the tile that holds it: 45 rows whole against 3 + 42
    /// (as a prompt's tail after a prefix-cache hit), windowed or not, the same bits.
    #[allow(clippy::too_many_arguments)]
    fn rows_in_any_tile<E: KvElem>(q: &[f32], k: &[E], v: &[E], tables: &[i32], hs: Heads, bs: usize, n: usize,
                                   w512s: &[bool], bf16: bool, what: &str) {
        let w = hs.nh * hs.d;
        for &w512 in w512s {
            for window in [9usize, 0] {
                let mut whole = vec![0f32; 45 * w];
                prefill(q, w, &mut whole, w, &[0, 45], &[n as i32], tables, k, v, bs, hs, 0.3, window, 0.0, w512, bf16)
                    .unwrap();
                let mut split = vec![0f32; 45 * w];
                prefill(&q[..3 * w], w, &mut split[..3 * w], w, &[0, 3], &[(n - 42) as i32], tables, k, v, bs, hs, 0.3,
                        window, 0.0, w512, bf16).unwrap();
                prefill(&q[3 * w..], w, &mut split[3 * w..], w, &[0, 42], &[n as i32], tables, k, v, bs, hs, 0.3, window,
                        0.0, w512, bf16).unwrap();
                assert!(whole.iter().zip(&split).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what} window {window} avx512 {w512} bf16 {bf16}");
            }
        }
    }

    /// Random f32 K and V of `n` positions over 8 blocks of 16, 45 query rows, a shuffled table.
    fn any_tile_case(hs: Heads, seed: u64) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<i32>) {
        let mut seed = seed;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let kvw = hs.nkv * hs.d;
        let k: Vec<f32> = (0..8 * 16 * kvw).map(|_| rnd()).collect();
        let v: Vec<f32> = (0..8 * 16 * kvw).map(|_| rnd()).collect();
        let q: Vec<f32> = (0..45 * hs.nh * hs.d).map(|_| rnd()).collect();
        (q, k, v, vec![3, 0, 6, 1])
    }

    fn f16s(x: &[f32]) -> Vec<crate::kv::F16> {
        x.iter().map(|&v| <crate::kv::F16 as crate::kv::KvScalar>::from_f32(v)).collect()
    }

    /// The AVX2 f32 tiles over spans of several segments (`F32_SEG` positions each): 40 rows
    /// over 700 positions (3 segments; a window of 300 across their bounds), f32, f16 and q8_0
    /// caches, against the decode kernel row by row within 1e-5.
    #[test]
    fn f32_tiles_over_segments_match_decode() {
        let hs = Heads { nh: 4, nkv: 2, d: 64 };
        let (bs, nblocks, n, rows) = (16usize, 48usize, 700usize, 40usize);
        let mut seed = 3u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let kvw = hs.nkv * hs.d;
        let k: Vec<f32> = (0..nblocks * bs * kvw).map(|_| rnd()).collect();
        let v: Vec<f32> = (0..nblocks * bs * kvw).map(|_| rnd()).collect();
        let w = hs.nh * hs.d;
        let q: Vec<f32> = (0..rows * w).map(|_| rnd()).collect();
        let tables: Vec<i32> = (0..nblocks as i32).map(|i| (i * 17) % nblocks as i32).collect();
        let (k16, v16) = (f16s(&k), f16s(&v));
        let ((k8, kd), (v8, vd)) = (crate::attention::tests::q8_cache(&k, hs.d), crate::attention::tests::q8_cache(&v, hs.d));
        let row_ids: Vec<i64> = (0..rows as i64).collect();
        let row_lens: Vec<i32> = (0..rows).map(|j| (n - rows + j + 1) as i32).collect();
        let row_tables: Vec<i32> = (0..rows).flat_map(|_| tables.iter().copied()).collect();
        for window in [0usize, 300] {
            for w512 in [false, true] {
                let mut want = vec![0f32; rows * w];
                let mut got = vec![0f32; rows * w];
                let one = |got: &mut [f32], want: &mut [f32], what: &str, run: &dyn Fn(&mut [f32], &mut [f32])| {
                    run(got, want);
                    let err = got.iter().zip(want.iter()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(err < 1e-5, "{what} window {window} avx512 {w512}: max error {err}");
                };
                one(&mut got, &mut want, "f32", &|g, wnt| {
                    prefill(&q, w, g, w, &[0, rows as i64], &[n as i32], &tables, &k, &v, bs, hs, 0.3, window, 0.0, w512,
                            false).unwrap();
                    paged_decode(&q, w, wnt, w, &row_ids, &row_lens, &row_tables, &k, &v, bs, hs, 0.3, window, 0.0)
                        .unwrap();
                });
                one(&mut got, &mut want, "f16", &|g, wnt| {
                    prefill(&q, w, g, w, &[0, rows as i64], &[n as i32], &tables, &k16, &v16, bs, hs, 0.3, window, 0.0,
                            w512, false).unwrap();
                    paged_decode(&q, w, wnt, w, &row_ids, &row_lens, &row_tables, &k16, &v16, bs, hs, 0.3, window, 0.0)
                        .unwrap();
                });
                one(&mut got, &mut want, "q8_0", &|g, wnt| {
                    prefill(&q, w, g, w, &[0, rows as i64], &[n as i32], &tables, &k8, &v8, bs, hs, 0.3, window, 0.0,
                            w512, false).unwrap();
                    paged_decode(&q, w, wnt, w, &row_ids, &row_lens, &row_tables, &kd, &vd, bs, hs, 0.3, window, 0.0)
                        .unwrap();
                });
            }
        }
    }

    /// A row's bf16 products do not depend on the tile it falls in: one chunk of 45 rows (tiles
    /// from positions 15 and 47) against the same rows in chunks of 3 and 42 (tiles from 18 and
    /// 50), under a window of 9 (odd spans' starts), bit for bit.
    #[test]
    fn bf16_rows_are_the_same_in_any_tile() {
        if !(crate::isa::has_avx512f() && crate::isa::has_avx512bf16()) {
            return;
        }
        let hs = Heads { nh: 4, nkv: 2, d: 64 };
        let (q, k, v, tables) = any_tile_case(hs, 7);
        rows_in_any_tile(&q, &f16s(&k), &f16s(&v), &tables, hs, 16, 60, &[true], true, "f16");
    }

    /// The f32 tiles too (f32, f16 and q8_0 caches, the AVX2 and AVX-512 paths): the engine
    /// sends every prompt row to the tiles for it (cpu_runtime.py `forward`).
    #[test]
    fn f32_rows_are_the_same_in_any_tile() {
        if !cfg!(target_arch = "x86_64") || !has_avx2() {
            return;
        }
        let hs = Heads { nh: 4, nkv: 2, d: 64 };
        let (q, k, v, tables) = any_tile_case(hs, 5);
        let ((k8, _), (v8, _)) = (crate::attention::tests::q8_cache(&k, hs.d), crate::attention::tests::q8_cache(&v, hs.d));
        let both = [true, false];
        rows_in_any_tile(&q, &k, &v, &tables, hs, 16, 60, &both, false, "f32");
        rows_in_any_tile(&q, &f16s(&k), &f16s(&v), &tables, hs, 16, 60, &both, false, "f16");
        rows_in_any_tile(&q, &k8, &v8, &tables, hs, 16, 60, &both, false, "q8_0");
    }

    /// The bf16 tiles reading their KV head's rows converted once (`shared_heads`) against tiles
    /// converting their own: the same bits, for three sequences in one call (a chunk over a
    /// cached prefix across segments, a short one, a chunk of several tiles from position 0),
    /// f16 and q8_0 caches, soft-capped or not, every head size the tiles take.
    #[test]
    fn bf16_shared_rows_match_rows_of_each_tile() {
        if !(crate::isa::has_avx512f() && crate::isa::has_avx512bf16()) {
            return;
        }
        for (d, nh) in [(64usize, 8usize), (32, 6), (128, 4)] {
            let hs = Heads { nh, nkv: 2, d };
            let bs = 16usize;
            let lens = [(2 * SEG + 37) as i32, 5, 70];
            let starts = [0i64, 100, 103, 173];
            let mb = (lens[0] as usize).div_ceil(bs);
            let nblocks = 3 * mb;
            let mut seed = 9u64;
            let mut rnd = || {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            };
            let kvw = hs.nkv * hs.d;
            let kf: Vec<f32> = (0..nblocks * bs * kvw).map(|_| 4.0 * rnd()).collect();
            let vf: Vec<f32> = (0..nblocks * bs * kvw).map(|_| rnd()).collect();
            let f16 = |x: &f32| <crate::kv::F16 as crate::kv::KvScalar>::from_f32(*x);
            let (k16, v16): (Vec<crate::kv::F16>, Vec<crate::kv::F16>) = (kf.iter().map(f16).collect(), vf.iter().map(f16).collect());
            let ((k8, _), (v8, _)) = (crate::attention::tests::q8_cache(&kf, d), crate::attention::tests::q8_cache(&vf, d));
            let tables: Vec<i32> = (0..3).flat_map(|b| (0..mb).map(move |i| ((b * mb + i * 5) % nblocks) as i32)).collect();
            let w = hs.nh * hs.d;
            let rows = starts[3] as usize;
            let q: Vec<f32> = (0..rows * w).map(|_| rnd()).collect();
            for cap in [0f32, 3.0] {
                let run = |share: bool, q8: bool| {
                    let mut out = vec![0f32; rows * w];
                    let was = set_shared_rows(share);
                    if q8 {
                        prefill(&q, w, &mut out, w, &starts, &lens, &tables, &k8, &v8, bs, hs, 0.3, 0, cap, true, true)
                    } else {
                        prefill(&q, w, &mut out, w, &starts, &lens, &tables, &k16, &v16, bs, hs, 0.3, 0, cap, true, true)
                    }.unwrap();
                    set_shared_rows(was);
                    out
                };
                for q8 in [false, true] {
                    let (shared, own) = (run(true, q8), run(false, q8));
                    assert!(shared.iter().any(|x| *x != 0.0));
                    assert!(shared.iter().zip(&own).all(|(a, b)| a.to_bits() == b.to_bits()), "d {d} cap {cap} q8 {q8}");
                }
            }
        }
    }
}
