//! Paged decode attention on the CPU: one query token per sequence over its context,
//! read through the block table straight from the paged K/V cache.

use crate::kv::KvElem;
use crate::ops::{bad, dot, exp, has_avx2, Heads, OpError, P};
use crate::threads::{num_threads, parallel_for};

/// One decode sequence: its query row in the batch, context length, block table row.
struct DecodeArgs<'a, E> {
    q: P,
    q_stride: usize,
    out: P,
    out_stride: usize,
    rows: &'a [i64],
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
}

/// Gemma 2's soft-capping of scaled scores: cap · tanh(s / cap) (`cap` 0: off).
#[inline]
pub(crate) fn cap_scores(s: &mut [f32], cap: f32) {
    if cap > 0.0 {
        for x in s {
            *x = cap * (*x / cap).tanh();
        }
    }
}

#[inline(always)]
unsafe fn decode_item<E: KvElem>(a: &DecodeArgs<E>, item: usize, scores: &mut Vec<f32>, acc: &mut Vec<f32>) {
    let Heads { nh, nkv, d } = a.hs;
    let g = nh / nkv;
    let (b, kh) = (item / nkv, item % nkv);
    let n = a.lens[b] as usize;
    let lo = if a.window > 0 { n.saturating_sub(a.window) } else { 0 };
    let len = n - lo;
    let row = a.rows[b] as usize;
    let table = &a.tables[b * a.max_blocks..(b + 1) * a.max_blocks];
    let du = E::units(d);
    let kvw = nkv * du;
    scores.clear();
    scores.resize(g * len, 0.0);
    let q0 = a.q.0.add(row * a.q_stride + kh * g * d) as *const f32;
    let mut row_f32 = [0f32; 512];
    let kr = &mut row_f32[..d];
    // scores[h, t] = q_h · k_t · scale
    for t in 0..len {
        let pos = lo + t;
        let slot = table[pos / a.bs] as usize * a.bs + pos % a.bs;
        let kp = a.k.as_ptr().add(slot * kvw + kh * du);
        for (i, x) in kr.iter_mut().enumerate() {
            *x = E::get(kp, i, d);
        }
        for h in 0..g {
            let q = std::slice::from_raw_parts(q0.add(h * d), d);
            scores[h * len + t] = dot(q, kr) * a.scale;
        }
    }
    cap_scores(scores, a.softcap);
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
        let vr = &mut row_f32[..d];
        let vp = a.v.as_ptr().add(slot * kvw + kh * du);
        for (i, x) in vr.iter_mut().enumerate() {
            *x = E::get(vp, i, d);
        }
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
pub(crate) mod x86 {
    use super::{cap_scores, DecodeArgs, Heads, KvElem};
    use crate::ops::x86::softmax_exp8;
    use crate::quant::avx2::hsum;
    use std::arch::x86_64::*;

    /// Positions ahead whose K and V rows are asked for (two blocks of 16).
    const PF_ROWS: usize = 32;

    /// One sequence `b` with head_dim = 8 * NV: every query head against every visible K row
    /// (a position's K rows of all KV heads are one contiguous run), softmax on 8 lanes,
    /// then the V rows summed into NV registers per head. Scores come 8 positions at a time
    /// (one accumulator per position, the 8 reduced together by `hsum8`), the last
    /// `len % 8` one by one, and the slot offsets are computed block by block, with no
    /// division per position (both measured: bench/RESULTS.md, "Seventh session").
    /// Only KV heads `kvh` (and their query heads): a sequence may be split by heads
    /// between threads.
    ///
    /// Only the visible positions `seg` (counted from the first visible one): with `part`
    /// given, each head's unnormalised sum Σ e^(s - m) v, its max m and its Σ e^(s - m) go
    /// there (`part[h * (d + 2) ..]`: m, the sum, then the d values) for `merge` to join with
    /// the other segments'; else the normalised result goes to `out`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn item<E: KvElem, const NV: usize>(
        a: &DecodeArgs<E>, b: usize, kvh: std::ops::Range<usize>, seg: std::ops::Range<usize>, part: *mut f32,
        scores: &mut Vec<f32>, slots: &mut Vec<usize>,
    ) {
        let Heads { nh, nkv, d } = a.hs;
        let g = nh / nkv;
        let n_all = a.lens[b] as usize;
        let lo_all = if a.window > 0 { n_all.saturating_sub(a.window) } else { 0 };
        let far = n_all - lo_all >= 256;
        let (lo, n) = (lo_all + seg.start, lo_all + seg.end);
        let len = n - lo;
        let table = &a.tables[b * a.max_blocks..(b + 1) * a.max_blocks];
        let du = E::units(d);
        let kvw = nkv * du;
        slots.clear();
        // block by block: no division per position (it was a quarter of the kernel's time)
        for bi in lo / a.bs..n.div_ceil(a.bs) {
            let first = bi * a.bs;
            let base = table[bi] as usize * a.bs;
            slots.extend((first.max(lo)..(first + a.bs).min(n)).map(|p| (base + p - first) * kvw));
        }
        let stride = len.next_multiple_of(8);
        scores.clear();
        scores.resize((kvh.end - kvh.start) * g * stride, f32::NEG_INFINITY);
        let q0 = a.q.0.add(a.rows[b] as usize * a.q_stride) as *const f32;
        let (kp, vp) = (a.k.as_ptr(), a.v.as_ptr());
        let sp = scores.as_mut_ptr();
        let nfull = len / 8 * 8;
        let sc8 = _mm256_set1_ps(a.scale);
        let heads = kvh.start * g..kvh.end * g;
        let h0 = heads.start;
        // the rows PF_ROWS positions ahead asked for now: the blocks of a table are anywhere in
        // the pool, and a block's rows are too short a run for the hardware to see coming (a
        // long context's decode attention waited on memory at ~9 GB/s: bench/RESULTS.md,
        // "Tenth session"); a short one is in cache
        let row_bytes = du * std::mem::size_of::<E>();
        // position t's rows of KV heads `kvs` (from `base`, the K or the V cache)
        let fetch = |base: *const E, t: usize, kvs: std::ops::Range<usize>| {
            if far && t < len {
                let p = base.add(slots[t] + kvs.start * du) as *const i8;
                let mut o = 0;
                while o < kvs.len() * row_bytes {
                    _mm_prefetch::<_MM_HINT_T0>(p.add(o));
                    o += 64;
                }
            }
        };
        for t0 in (0..nfull).step_by(8) {
            for u in 0..8 {
                fetch(kp, t0 + PF_ROWS + u, kvh.clone());
            }
            for kh in kvh.clone() {
                let ks: [*const E; 8] = std::array::from_fn(|u| kp.add(slots[t0 + u] + kh * du));
                for h in kh * g..(kh + 1) * g {
                    let q = q0.add(h * d);
                    let mut acc = [_mm256_setzero_ps(); 8];
                    if E::ROTATED {
                        // a blocked cache: each position's dot product per block, one scale each
                        for (u, r) in acc.iter_mut().enumerate() {
                            *r = E::dot::<NV>(q, ks[u]);
                        }
                    } else {
                        for j in 0..NV {
                            let qj = _mm256_loadu_ps(q.add(8 * j));
                            for (u, r) in acc.iter_mut().enumerate() {
                                *r = _mm256_fmadd_ps(qj, E::load8(ks[u], 8 * j, d), *r);
                            }
                        }
                    }
                    _mm256_storeu_ps(sp.add((h - h0) * stride + t0), _mm256_mul_ps(hsum8(&acc), sc8));
                }
            }
        }
        for (t, &off) in slots.iter().enumerate().skip(nfull) {
            for kh in kvh.clone() {
                let k = kp.add(off + kh * du);
                let mut kr = [_mm256_setzero_ps(); NV];
                for (j, r) in kr.iter_mut().enumerate() {
                    *r = E::load8(k, 8 * j, d);
                }
                for h in kh * g..(kh + 1) * g {
                    let q = q0.add(h * d);
                    let mut acc = _mm256_mul_ps(_mm256_loadu_ps(q), kr[0]);
                    for (j, r) in kr.iter().enumerate().skip(1) {
                        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(8 * j)), *r, acc);
                    }
                    *sp.add((h - h0) * stride + t) = hsum(acc) * a.scale;
                }
            }
        }
        if a.softcap > 0.0 {
            for h in heads.clone() {
                cap_scores(std::slice::from_raw_parts_mut(sp.add((h - h0) * stride), len), a.softcap);
            }
        }
        let (mut inv, mut maxes, mut sums) = ([0f32; 64], [0f32; 64], [0f32; 64]);
        for h in heads.clone() {
            let s = sp.add((h - h0) * stride);
            let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
            for c in (0..stride).step_by(8) {
                m = _mm256_max_ps(m, _mm256_loadu_ps(s.add(c)));
            }
            maxes[h] = hmax(m);
            let m = _mm256_set1_ps(-maxes[h]);
            let mut sum = _mm256_setzero_ps();
            for c in (0..stride).step_by(8) {
                let e = softmax_exp8(_mm256_add_ps(_mm256_loadu_ps(s.add(c)), m));
                // padding lanes hold -inf: exp8 clamps to e^-87, zero them
                let e = if c + 8 > len { _mm256_and_ps(e, tail_mask(len - c)) } else { e };
                _mm256_storeu_ps(s.add(c), e);
                sum = _mm256_add_ps(sum, e);
            }
            sums[h] = hsum(sum);
            inv[h] = 1.0 / sums[h];
        }
        for h in heads {
            let s = sp.add((h - h0) * stride);
            let vo = h / g * du;
            let mut acc = [_mm256_setzero_ps(); NV];
            let first = h % g == 0;     // the group's other heads find its V rows in cache
            for (t, &off) in slots.iter().enumerate() {
                if first {
                    fetch(vp, t + PF_ROWS, h / g..h / g + 1);
                }
                E::mad::<NV>(&mut acc, *s.add(t), vp.add(off + vo));
            }
            if !part.is_null() {
                let o = part.add(h * (d + 2));
                (*o, *o.add(1)) = (maxes[h], sums[h]);
                for (j, r) in acc.iter().enumerate() {
                    _mm256_storeu_ps(o.add(2 + 8 * j), *r);
                }
                continue;
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
    pub(crate) unsafe fn hsum8(a: &[__m256; 8]) -> __m256 {
        let h01 = _mm256_hadd_ps(a[0], a[1]);
        let h23 = _mm256_hadd_ps(a[2], a[3]);
        let h45 = _mm256_hadd_ps(a[4], a[5]);
        let h67 = _mm256_hadd_ps(a[6], a[7]);
        let h03 = _mm256_hadd_ps(h01, h23);
        let h47 = _mm256_hadd_ps(h45, h67);
        _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(h03, h47), _mm256_permute2f128_ps::<0x31>(h03, h47))
    }

    #[inline(always)]
    pub(crate) unsafe fn hmax(v: __m256) -> f32 {
        let s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    /// All-ones in the first `n` (< 8) lanes.
    #[inline(always)]
    pub(crate) unsafe fn tail_mask(n: usize) -> __m256 {
        let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), idx))
    }

    /// Whether `items` runs these heads (else the portable loop does).
    pub(super) fn supports(hs: Heads) -> bool { hs.d % 8 == 0 && hs.nh <= 64 && matches!(hs.d / 8, 4 | 8 | 16) }

    /// Items `i0..i1` of `list`: (sequence b, its part of `parts` runs of KV heads, its segment
    /// of positions out of `segs[b].0`). A sequence cut in segments has all its heads in each
    /// (part 0 of 1), and writes its partial sums to `partial` from block `segs[b].1` (segment
    /// s, then head h: `d + 2` values each).
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn items<E: KvElem>(a: &DecodeArgs<E>, list: &[(u32, u32, u32)], i0: usize, i1: usize,
                                          parts: usize, segs: &[(usize, usize)], partial: &super::P) {
        let (mut scores, mut slots) = (Vec::new(), Vec::new());
        let (nv, nkv) = (a.hs.d / 8, a.hs.nkv);
        for &(b, p, sg) in &list[i0..i1] {
            let (b, p, sg) = (b as usize, p as usize, sg as usize);
            let (nseg, at) = segs[b];
            let parts = if nseg > 1 { 1 } else { parts };
            let kvh = p * nkv / parts..(p + 1) * nkv / parts;
            let len = super::visible(a, b);
            let seg = sg * len / nseg..(sg + 1) * len / nseg;
            let part = if nseg > 1 { partial.0.add((at + sg) * a.hs.nh * (a.hs.d + 2)) } else { std::ptr::null_mut() };
            match nv {
                4 => item::<E, 4>(a, b, kvh, seg, part, &mut scores, &mut slots),
                8 => item::<E, 8>(a, b, kvh, seg, part, &mut scores, &mut slots),
                16 => item::<E, 16>(a, b, kvh, seg, part, &mut scores, &mut slots),
                _ => unreachable!(),
            }
        }
    }
}

#[inline(always)]
unsafe fn decode_items<E: KvElem>(a: &DecodeArgs<E>, i0: usize, i1: usize) {
    let (mut scores, mut acc) = (Vec::new(), Vec::new());
    for it in i0..i1 {
        decode_item(a, it, &mut scores, &mut acc);
    }
}

#[cfg(target_arch = "x86_64")]
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_items_avx2<E: KvElem>(a: &DecodeArgs<E>, i0: usize, i1: usize) { decode_items(a, i0, i1) }

/// Attention of one query token per sequence over its paged context (positions
/// `0 .. lens[b]`, the last `window` of them when `window > 0`), the scaled scores
/// soft-capped as cap · tanh(s / cap) when `softcap > 0`.
///
/// `q` holds the query heads of row `rows[b]` at `q[rows[b] * q_stride ..]` (`nh * d`
/// values, e.g. the Q part of a fused QKV row); the result goes to
/// `out[rows[b] * out_stride ..]`. `tables` is `[B, max_blocks]` block ids, caches are
/// `[num_blocks * bs, nkv, E::units(d)]` (head rows of `d` values, see `kv`).
///
/// A cache whose rows are stored turned (`KvElem::ROTATED`, q8_0) is read with each query
/// head turned the same way, and each output head turned back: the same attention.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode<E: KvElem>(
    q: &[f32], q_stride: usize, out: &mut [f32], out_stride: usize, rows: &[i64], lens: &[i32], tables: &[i32],
    k_cache: &[E], v_cache: &[E], bs: usize, hs: Heads, scale: f32, window: usize, softcap: f32,
) -> Result<(), OpError> {
    if !E::ROTATED {
        return decode(q, q_stride, out, out_stride, rows, lens, tables, k_cache, v_cache, bs, hs, scale, window, softcap);
    }
    let w = hs.nh * hs.d;
    if !E::supports(hs.d) || hs.d > 512 {
        return bad(format!("paged_decode: unsupported heads {}/{} x {} ({} cache)", hs.nh, hs.nkv, hs.d, E::NAME));
    }
    if let Some(r) = rows.iter().find(|&&r| r < 0 || (r as usize) * q_stride + w > q.len() || (r as usize) * out_stride + w > out.len()) {
        return bad(format!("paged_decode: row {r} outside q/out"));
    }
    let qt = crate::kv::turned_rows(q, q_stride, rows.iter().map(|&r| r as usize), hs.nh, hs.d);
    let mut ot = vec![0f32; qt.len()];
    let dense: Vec<i64> = (0..rows.len() as i64).collect();
    decode(&qt, w, &mut ot, w, &dense, lens, tables, k_cache, v_cache, bs, hs, scale, window, softcap)?;
    crate::kv::turn_back_rows(&ot, out, out_stride, rows.iter().map(|&r| r as usize), hs.nh, hs.d);
    Ok(())
}

/// `paged_decode` on the cache's own rows (q and out in the turned space of a rotated cache).
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode<E: KvElem>(
    q: &[f32], q_stride: usize, out: &mut [f32], out_stride: usize, rows: &[i64], lens: &[i32], tables: &[i32],
    k_cache: &[E], v_cache: &[E], bs: usize, hs: Heads, scale: f32, window: usize, softcap: f32,
) -> Result<(), OpError> {
    let Heads { nh, nkv, d } = hs;
    let b = rows.len();
    if nkv == 0 || nh % nkv != 0 || nh / nkv > 64 || d == 0 || d > 512 || bs == 0 || !E::supports(d) {
        return bad(format!("paged_decode: unsupported heads {nh}/{nkv} x {d} ({} cache)", E::NAME));
    }
    if lens.len() != b || (b > 0 && tables.len() % b != 0) {
        return bad("paged_decode: rows, lens and tables disagree on the number of sequences");
    }
    let max_blocks = if b > 0 { tables.len() / b } else { 0 };
    let kvw = nkv * E::units(d);
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
        k: k_cache, v: v_cache, bs, hs, scale, window, softcap,
    };
    // The AVX2 kernel takes a whole sequence per item (the contiguous K/V rows of all its
    // KV heads, read in one pass); the portable loop takes one (sequence, KV head) per item.
    let avx = has_avx2();
    #[cfg(target_arch = "x86_64")]
    let whole = avx && x86::supports(hs);
    #[cfg(not(target_arch = "x86_64"))]
    let whole = false;
    let work: usize = lens.iter().map(|&n| n as usize).sum::<usize>() * nh * d;
    // fewer sequences than threads (one stream, a command's few rows): each split by KV heads,
    // so that every thread has work (one sequence over 2,193 positions ran on one thread)
    let nt = num_threads();
    let parts = if whole && work >= 1 << 16 && b < 2 * nt { (2 * nt).div_ceil(b.max(1)).min(nkv) } else { 1 };
    // A long context is cut into segments of about `decode_seg()` positions, each an item with
    // all the KV heads (a position's rows of every head are one contiguous run), whose partial
    // sums are joined after (`merge`): split by heads alone, a single stream's 3 KV heads left a
    // thread idle and each read a third of every run (bench/RESULTS.md, "Eleventh session").
    // The cut depends on the sequence's own length only, never on the batch: a sequence's
    // result is the same alone or beside others. A shorter one is split by heads (same bits).
    let seg = decode_seg();
    let mut segs = Vec::with_capacity(b);
    let mut nparts = 0;
    for i in 0..b {
        let n = if whole && seg > 0 { visible(&args, i).div_ceil(seg) } else { 1 };
        segs.push((n, nparts));
        if n > 1 {
            nparts += n;
        }
    }
    let mut partial = vec![0f32; nparts * nh * (d + 2)];
    // (sequence, part of its KV heads out of `parts` or 1, segment)
    let list: Vec<(u32, u32, u32)> = if whole {
        (0..b as u32).flat_map(|i| {
            let (n, p) = (segs[i as usize].0 as u32, if segs[i as usize].0 > 1 { 1 } else { parts as u32 });
            (0..n).flat_map(move |sg| (0..p).map(move |k| (i, k, sg)))
        })
        .collect()
    } else {
        Vec::new()
    };
    let items = if whole { list.len() } else { b * nkv };
    let pp = &P(partial.as_mut_ptr());
    let (list, segs_ref) = (&list, &segs);
    // SAFETY: every row, length and block id was checked against q, out and the caches
    // above; items write disjoint rows of `out` or disjoint blocks of `partial`; the AVX2
    // paths run only when the CPU has it.
    let run = |i0: usize, i1: usize| unsafe {
        #[cfg(target_arch = "x86_64")]
        if whole {
            return x86::items(&args, list, i0, i1, parts, segs_ref, pp);
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
        let per = items.div_ceil(num_threads() * 4).max(1);
        parallel_for(items.div_ceil(per), &|c| run(c * per, ((c + 1) * per).min(items)));
    }
    if nparts > 0 {
        merge(&args, &segs, &partial);
    }
    Ok(())
}

/// Positions sequence `b` sees (its window's, or all).
fn visible<E>(a: &DecodeArgs<E>, b: usize) -> usize {
    let n = a.lens[b] as usize;
    n - if a.window > 0 { n.saturating_sub(a.window) } else { 0 }
}

/// Join the segments' partial sums of each sequence cut in several: per head, the largest
/// max M, then Σ e^(m - M) · sum and Σ e^(m - M) · acc, in segment order.
fn merge<E>(a: &DecodeArgs<E>, segs: &[(usize, usize)], partial: &[f32]) {
    let Heads { nh, d, .. } = a.hs;
    for (b, &(n, at)) in segs.iter().enumerate() {
        if n < 2 {
            continue;
        }
        for h in 0..nh {
            let part = |s: usize| &partial[((at + s) * nh + h) * (d + 2)..][..d + 2];
            let m = (0..n).map(|s| part(s)[0]).fold(f32::NEG_INFINITY, f32::max);
            let mut acc = [0f32; 512];
            let mut sum = 0f32;
            for s in 0..n {
                let p = part(s);
                let f = exp(p[0] - m);
                sum += f * p[1];
                for (x, y) in acc[..d].iter_mut().zip(&p[2..]) {
                    *x += f * y;
                }
            }
            let inv = 1.0 / sum;
            // SAFETY: row b's output was checked against `out` by `decode`.
            let o = unsafe { std::slice::from_raw_parts_mut(a.out.0.add(a.rows[b] as usize * a.out_stride + h * d), d) };
            for (o, x) in o.iter_mut().zip(&acc[..d]) {
                *o = x * inv;
            }
        }
    }
}

/// Positions per segment of a long context's decode attention (`EDGEPAGED_DECODE_SEG`;
/// 0: no cut).
pub fn decode_seg() -> usize {
    use std::sync::atomic::Ordering::Relaxed;
    let v = DECODE_SEG.load(Relaxed);
    if v != usize::MAX {
        return v;
    }
    let v = std::env::var("EDGEPAGED_DECODE_SEG").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(DEFAULT_DECODE_SEG);
    DECODE_SEG.store(v, Relaxed);
    v
}

const DEFAULT_DECODE_SEG: usize = 512;
static DECODE_SEG: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(usize::MAX);

/// Set `decode_seg` for the process (benchmarks alternate).
pub fn set_decode_seg(n: usize) { DECODE_SEG.store(n, std::sync::atomic::Ordering::Relaxed) }

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A q8_0 copy of an f32 cache of head rows of `d` values, and the values it stands for
    /// as f32 (the blocks' values, turned back).
    pub(crate) fn q8_cache(x: &[f32], d: usize) -> (Vec<i8>, Vec<f32>) {
        let u = <i8 as KvElem>::units(d);
        let mut q = vec![0i8; x.len() / d * u];
        <i8 as KvElem>::store_heads(&mut q, x, d);
        // SAFETY: every head row is whole and i < d.
        let mut back: Vec<f32> =
            (0..x.len()).map(|i| unsafe { <i8 as KvElem>::get(q.as_ptr().add(i / d * u), i % d, d) }).collect();
        back.chunks_exact_mut(d).for_each(crate::kv::hadamard);
        (q, back)
    }

    /// A q8_0 cache attends as the f32 cache of the values it stands for does (the kernels
    /// read the blocks themselves, no dequantized copy), on the vector and the portable path,
    /// with windows and soft-capping, the rows given and taken in the model's space; heads of
    /// 16 values are refused.
    #[test]
    fn q8_decode_attends_to_the_values_it_holds() {
        let (bs, nblocks) = (4usize, 10usize);
        for hs in [Heads { nh: 6, nkv: 2, d: 64 }, Heads { nh: 4, nkv: 1, d: 32 }, Heads { nh: 2, nkv: 2, d: 96 }] {
            let kvw = hs.nkv * hs.d;
            let mut seed = 5u64;
            let mut rnd = || {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            };
            let k: Vec<f32> = (0..nblocks * bs * kvw).map(|_| rnd() * 4.0).collect();
            let v: Vec<f32> = (0..nblocks * bs * kvw).map(|_| rnd()).collect();
            let q: Vec<f32> = (0..3 * hs.nh * hs.d).map(|_| rnd()).collect();
            let ((k8, kd), (v8, vd)) = (q8_cache(&k, hs.d), q8_cache(&v, hs.d));
            let tables = [3, 1, 7, 0, 2, 5, 9, 8, 4, 6, 0, 0];
            let lens = [13, 2, 9];
            let w = hs.nh * hs.d;
            for (window, cap) in [(0usize, 0f32), (5, 0.0), (0, 0.05), (5, 0.05)] {
                let (mut got, mut want, mut exact) = (vec![0f32; 3 * w], vec![0f32; 3 * w], vec![0f32; 3 * w]);
                paged_decode(&q, w, &mut got, w, &[0, 1, 2], &lens, &tables, &k8, &v8, bs, hs, 0.25, window, cap).unwrap();
                paged_decode(&q, w, &mut want, w, &[0, 1, 2], &lens, &tables, &kd, &vd, bs, hs, 0.25, window, cap).unwrap();
                paged_decode(&q, w, &mut exact, w, &[0, 1, 2], &lens, &tables, &k, &v, bs, hs, 0.25, window, cap).unwrap();
                let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(err < 1e-5, "{hs:?} window {window} cap {cap}: {err}");
                // and near the unquantized cache: 8 bits, a few hundredths of the values' range
                let err = got.iter().zip(&exact).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(err < 0.02, "{hs:?} window {window} cap {cap}: {err} from f32");
            }
        }
        let hs = Heads { nh: 2, nkv: 1, d: 16 };
        let mut out = vec![0f32; 32];
        let e = paged_decode(&[0f32; 32], 32, &mut out, 32, &[0], &[1], &[0], &[0i8; 64], &[0i8; 64], 4, hs, 1.0, 0, 0.0);
        assert!(e.unwrap_err().0.contains("q8_0"));
    }

    #[test]
    fn decode_matches_naive() {
        for d in [16, 64] {
            decode_case(Heads { nh: 6, nkv: 2, d }, &[13, 2, 9], 4, &[3, 1, 7, 0, 2, 5, 9, 8, 4, 6, 0, 0], 10);
        }
    }

    /// Fewer sequences than threads over long contexts: each sequence split by KV heads
    /// between the threads (one, three and five sequences; 8 KV heads, as Llama 3.2's).
    #[test]
    fn decode_split_by_heads_matches_naive() {
        let bs = 16usize;
        for lens in [&[2193i32][..], &[700, 1, 2193], &[300, 301, 302, 303, 304]] {
            let mb = 2193usize.div_ceil(bs);
            let total = lens.len() * mb;
            let tables: Vec<i32> = (0..total).map(|i| (total - 1 - i) as i32).collect();
            decode_case(Heads { nh: 32, nkv: 8, d: 64 }, lens, bs, &tables, total);
        }
    }

    /// Long contexts cut in segments (`decode_seg`): the joined result is the attention over
    /// the whole context, with windows over several segments; a sequence's result is the same
    /// bits alone and beside others (the cut depends on its own length only); a q8_0 cache
    /// cut in segments attends as the f32 cache of its values.
    #[test]
    fn decode_segments_match_naive_and_any_batch() {
        let bs = 16usize;
        let hs = Heads { nh: 9, nkv: 3, d: 64 };
        for lens in [&[2193i32][..], &[1500, 1, 600], &[513, 1024, 1025]] {
            let mb = 2193usize.div_ceil(bs);
            let total = lens.len() * mb;
            let tables: Vec<i32> = (0..total).map(|i| ((i * 37) % total) as i32).collect();
            decode_case_with(hs, lens, bs, &tables, total, &[(0, 0.0), (1100, 0.0), (600, 0.05)]);
        }
        // alone and in a batch: the same bits
        let mut seed = 11u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let (w, kvw, nblocks) = (hs.nh * hs.d, hs.nkv * hs.d, 3 * 100);
        let k: Vec<f32> = (0..nblocks * bs * kvw).map(|_| rnd()).collect();
        let v: Vec<f32> = (0..nblocks * bs * kvw).map(|_| rnd()).collect();
        let q: Vec<f32> = (0..3 * w).map(|_| rnd()).collect();
        let tables: Vec<i32> = (0..nblocks as i32).rev().collect();
        let lens = [1500, 40, 1200];
        let mut batch = vec![0f32; 3 * w];
        paged_decode(&q, w, &mut batch, w, &[0, 1, 2], &lens, &tables, &k, &v, bs, hs, 0.125, 0, 0.0).unwrap();
        for b in 0..3 {
            let mut alone = vec![0f32; 3 * w];
            paged_decode(&q, w, &mut alone, w, &[b as i64], &lens[b..b + 1], &tables[b * 100..(b + 1) * 100], &k, &v, bs, hs,
                         0.125, 0, 0.0).unwrap();
            assert_eq!(alone[b * w..(b + 1) * w], batch[b * w..(b + 1) * w], "sequence {b}");
        }
        // a q8_0 cache, cut in segments
        let ((k8, kd), (v8, vd)) = (q8_cache(&k, hs.d), q8_cache(&v, hs.d));
        let (mut got, mut want) = (vec![0f32; 3 * w], vec![0f32; 3 * w]);
        paged_decode(&q, w, &mut got, w, &[0, 1, 2], &lens, &tables, &k8, &v8, bs, hs, 0.125, 0, 0.0).unwrap();
        paged_decode(&q, w, &mut want, w, &[0, 1, 2], &lens, &tables, &kd, &vd, bs, hs, 0.125, 0, 0.0).unwrap();
        let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(err < 1e-5, "q8_0 in segments: {err}");
    }

    fn decode_case(hs: Heads, lens: &[i32], bs: usize, tables: &[i32], nblocks: usize) {
        decode_case_with(hs, lens, bs, tables, nblocks, &[(0, 0.0), (5, 0.0), (0, 0.05), (5, 0.05)]);
    }

    fn decode_case_with(hs: Heads, lens: &[i32], bs: usize, tables: &[i32], nblocks: usize, cases: &[(usize, f32)]) {
        let kvw = hs.nkv * hs.d;
        let (nb, mb) = (lens.len(), tables.len() / lens.len());
        let mut seed = 7u64;
        let mut rnd = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) - 0.5
        };
        let k: Vec<f32> = (0..nblocks * bs * kvw).map(|_| rnd()).collect();
        let v: Vec<f32> = (0..nblocks * bs * kvw).map(|_| rnd()).collect();
        let q: Vec<f32> = (0..nb * hs.nh * hs.d).map(|_| rnd()).collect();
        let rows: Vec<i64> = (0..nb as i64).collect();
        for &(window, cap) in cases {
            let mut out = vec![0f32; nb * hs.nh * hs.d];
            paged_decode(&q, hs.nh * hs.d, &mut out, hs.nh * hs.d, &rows, lens, tables, &k, &v, bs, hs, 0.25, window, cap)
                .unwrap();
            for b in 0..nb {
                for h in 0..hs.nh {
                    let kh = h / (hs.nh / hs.nkv);
                    let n = lens[b] as usize;
                    let lo = if window > 0 { n.saturating_sub(window) } else { 0 };
                    let qv = &q[(b * hs.nh + h) * hs.d..(b * hs.nh + h + 1) * hs.d];
                    let slot = |p: usize| tables[b * mb + p / bs] as usize * bs + p % bs;
                    let s: Vec<f64> = (lo..n)
                        .map(|p| {
                            let kr = &k[slot(p) * kvw + kh * hs.d..][..hs.d];
                            let s = qv.iter().zip(kr).map(|(a, b)| (*a as f64) * (*b as f64)).sum::<f64>() * 0.25;
                            if cap > 0.0 { cap as f64 * (s / cap as f64).tanh() } else { s }
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for i in 0..hs.d {
                        let want: f64 = (lo..n).zip(&e).map(|(p, w)| w * v[slot(p) * kvw + kh * hs.d + i] as f64).sum::<f64>() / z;
                        let got = out[(b * hs.nh + h) * hs.d + i] as f64;
                        assert!((want - got).abs() < 1e-5, "b{b} h{h} i{i} window {window} cap {cap}: {got} vs {want}");
                    }
                }
            }
        }
    }
}
