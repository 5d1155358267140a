//! Portable path: the arithmetic of `avx2.rs`, operation for operation, in plain Rust, so that
//! every output has the same bits on every CPU. Where the SIMD path keeps an 8-lane register
//! this path keeps 8 floats, where it fuses a multiply and an add this one calls
//! `f32::mul_add` (one rounding), and the same token counts pick the same orders:
//!
//! - one token, rows in file order (`gemv`): per block (or K-quant group) the integer codes
//!   meet `x` in 8-lane sums, the scales come in once (`acc += d·s`, offsets through the
//!   8-lane partial sums of `x`), then one horizontal sum;
//! - one token, interleaved rows (`gemv_x8`): per block two sums (weights 0..16 and 16..32),
//!   then `acc += d·(s0 + s1)` and Q4_1's `accm += m·Σx`;
//! - 2..15 tokens, rows in file order (`rows`): 8 lanes of FMAs over the exact weights, one
//!   horizontal sum;
//! - 16+ tokens, or 2+ tokens on interleaved rows (`rows_bcast`, `rows_x8`): one FMA chain in
//!   K order over the exact weights.

use super::formats::{group, group_x8, groups, half, q4k_scale_min};
use super::{Mat, QMatrix, QType, BCAST_MIN_TOKENS};

type L8 = [f32; 8];

/// The SIMD path's horizontal sum of a register, in its order.
#[inline]
pub(crate) fn hsum8(a: &L8) -> f32 { ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])) }

/// `acc[i] += d · s[i]`, fused.
#[inline]
fn fma_d(d: f32, s: &L8, acc: &mut L8) {
    for i in 0..8 {
        acc[i] = d.mul_add(s[i], acc[i]);
    }
}

/// Σ over the four 8-lane quarters of a group: `codes[8v + i] · x[8v + i]` into lane `i`,
/// the first quarter a product, the next three fused (avx2's `codes_dot`).
#[inline]
fn codes_dot(codes: &[i32; 32], x: &[f32]) -> L8 {
    let mut s = [0f32; 8];
    for i in 0..8 {
        s[i] = codes[i] as f32 * x[i];
    }
    for v in 1..4 {
        for i in 0..8 {
            s[i] = (codes[8 * v + i] as f32).mul_add(x[8 * v + i], s[i]);
        }
    }
    s
}

/// The 32 nibble codes of 16 bytes: low nibbles are weights 0..16, high ones 16..32.
#[inline]
fn nibbles(p: &[u8], minus: i32) -> [i32; 32] {
    let mut c = [0i32; 32];
    for j in 0..16 {
        c[j] = (p[j] & 15) as i32 - minus;
        c[j + 16] = (p[j] >> 4) as i32 - minus;
    }
    c
}

/// One block against one token (avx2's `Dot::dot`); `xs`: the block's 8-lane partial sums
/// of `x` per group. Returns whether the row's value is `acc - accm` (K-quant mins).
#[inline]
fn dot(q: QType, blk: &[u8], x: &[f32], xs: &[f32], acc: &mut L8, accm: &mut L8) -> bool {
    match q {
        QType::Q8_0 => {
            let c: [i32; 32] = std::array::from_fn(|k| blk[2 + k] as i8 as i32);
            fma_d(half(blk, 0), &codes_dot(&c, x), acc);
        }
        QType::Q4_0 => fma_d(half(blk, 0), &codes_dot(&nibbles(&blk[2..], 8), x), acc),
        QType::Q4_1 => {
            fma_d(half(blk, 0), &codes_dot(&nibbles(&blk[4..], 0), x), acc);
            fma_d(half(blk, 2), xs[..8].try_into().unwrap(), accm);
        }
        QType::Q4_K => {
            let (d, dmin) = (half(blk, 0), half(blk, 2));
            let s = &blk[4..16];
            let sm: [(f32, f32); 8] = std::array::from_fn(|j| {
                let (sc, mn) = q4k_scale_min(s, j);
                (d * sc as f32, dmin * mn as f32)
            });
            for c in 0..4 {
                let p = &blk[16 + 32 * c..48 + 32 * c];
                let lo: [i32; 32] = std::array::from_fn(|k| (p[k] & 15) as i32);
                let hi: [i32; 32] = std::array::from_fn(|k| (p[k] >> 4) as i32);
                fma_d(sm[2 * c].0, &codes_dot(&lo, &x[64 * c..]), acc);
                fma_d(sm[2 * c + 1].0, &codes_dot(&hi, &x[64 * c + 32..]), acc);
                fma_d(sm[2 * c].1, xs[16 * c..16 * c + 8].try_into().unwrap(), accm);
                fma_d(sm[2 * c + 1].1, xs[16 * c + 8..16 * c + 16].try_into().unwrap(), accm);
            }
            return true;
        }
        QType::Q6_K => {
            let d = half(blk, 208);
            let ds: [f32; 16] = std::array::from_fn(|i| d * (blk[192 + i] as i8) as f32);
            for h in 0..2 {
                for j in 0..4 {
                    let g = 4 * h + j;
                    // code of weight 8v + i of group g: 4 low bits from ql, 2 high from qh, minus 32
                    let code = |v: usize, i: usize| {
                        let l = blk[64 * h + 32 * (j % 2) + 8 * v + i];
                        let lo = if j < 2 { l & 15 } else { l >> 4 };
                        let hb = blk[128 + 32 * h + 8 * v + i];
                        let hi = match j {
                            0 => (hb & 3) << 4,
                            1 => (hb & 12) << 2,
                            2 => hb & 48,
                            _ => (hb & 192) >> 2,
                        };
                        ((lo | hi) as i32 - 32) as f32
                    };
                    let xg = &x[32 * g..];
                    let a: L8 = std::array::from_fn(|i| code(1, i).mul_add(xg[8 + i], code(0, i) * xg[i]));
                    let b: L8 = std::array::from_fn(|i| code(3, i).mul_add(xg[24 + i], code(2, i) * xg[16 + i]));
                    fma_d(ds[2 * g], &a, acc);
                    fma_d(ds[2 * g + 1], &b, acc);
                }
            }
        }
        // every weight exact (as dequantized), times x: 8 lanes of FMAs
        _ => {
            let mut wg = [0f32; 32];
            for g in 0..groups(q) {
                group(q, blk, g, &mut wg);
                for k in 0..32 {
                    acc[k % 8] = wg[k].mul_add(x[32 * g + k], acc[k % 8]);
                }
            }
        }
    }
    false
}

/// Rows `r0..r1` in file order against one token.
unsafe fn gemv(w: &QMatrix, x: &[f32], out: *mut f32, r0: usize, r1: usize) {
    let (bw, bb) = (w.qtype.block_weights(), w.qtype.block_bytes());
    // 8-lane partial sums of x per group of 32
    let mut xsum = vec![0f32; w.cols / 4];
    for g in 0..w.cols / 32 {
        let p = &x[32 * g..32 * g + 32];
        for i in 0..8 {
            xsum[8 * g + i] = (p[i] + p[8 + i]) + (p[16 + i] + p[24 + i]);
        }
    }
    for r in r0..r1 {
        let row = &w.data[r * w.row_bytes()..(r + 1) * w.row_bytes()];
        let (mut acc, mut accm) = ([0f32; 8], [0f32; 8]);
        let mut sub = false;
        for b in 0..w.cols / bw {
            sub = dot(w.qtype, &row[b * bb..(b + 1) * bb], &x[b * bw..], &xsum[b * bw / 4..], &mut acc, &mut accm);
        }
        let v: L8 = std::array::from_fn(|i| if sub { acc[i] - accm[i] } else { acc[i] + accm[i] });
        *out.add(r) = hsum8(&v);
    }
}

/// Rows `r0..r1` of an interleaved matrix against one token.
unsafe fn gemv_x8(w: &QMatrix, x: &[f32], out: *mut f32, r0: usize, r1: usize) {
    let q = w.qtype;
    let xsum: Vec<f32> = (0..w.cols / 32).map(|b| (0..32).map(|k| x[32 * b + k]).sum()).collect();
    let c = q.x8_codes();
    for r in r0..r1 {
        let i = r % 8;
        let (mut acc, mut accm) = (0f32, 0f32);
        for (b, &xs) in xsum.iter().enumerate() {
            let gb = w.x8_group(r, b);
            let xb = &x[32 * b..];
            let (mut s0, mut s1) = (0f32, 0f32);
            for j in 0..16 {
                let (lo, hi) = match q {
                    QType::Q8_0 => (gb[c + 8 * j + i] as i8 as i32, gb[c + 8 * (j + 16) + i] as i8 as i32),
                    _ => {
                        let n = gb[c + 8 * j + i];
                        let e = if q == QType::Q4_0 { 8 } else { 0 };
                        ((n & 15) as i32 - e, (n >> 4) as i32 - e)
                    }
                };
                s0 = (lo as f32).mul_add(xb[j], s0);
                s1 = (hi as f32).mul_add(xb[j + 16], s1);
            }
            acc = half(gb, 2 * i).mul_add(s0 + s1, acc);
            if q == QType::Q4_1 {
                accm = half(gb, 16 + 2 * i).mul_add(xs, accm);
            }
        }
        *out.add(r) = acc + accm;
    }
}

/// Row `r`'s weights, exact, into `wr[..w.cols]`.
fn decode_row(w: &QMatrix, r: usize, wr: &mut [f32]) {
    let q = w.qtype;
    let mut wg = [0f32; 32];
    if w.x8 {
        for b in 0..w.cols / 32 {
            group_x8(q, w.x8_group(r, b), r % 8, &mut wg);
            wr[32 * b..32 * b + 32].copy_from_slice(&wg);
        }
        return;
    }
    let (bw, bb) = (q.block_weights(), q.block_bytes());
    let row = &w.data[r * w.row_bytes()..(r + 1) * w.row_bytes()];
    for b in 0..w.cols / bw {
        for g in 0..groups(q) {
            group(q, &row[b * bb..(b + 1) * bb], g, &mut wg);
            wr[b * bw + 32 * g..b * bw + 32 * g + 32].copy_from_slice(&wg);
        }
    }
}

/// Output columns `r0..r1` (weight rows) for every token row of `x`, in the order the AVX2
/// path takes for this many tokens.
///
/// # Safety
/// `x` and `out` must be valid views of `[x.rows, w.cols]` and `[x.rows, > r1 - 1]`.
pub(crate) unsafe fn matmul_rows(w: &QMatrix, x: Mat, out: Mat, r0: usize, r1: usize) {
    let xrow = |t: usize| std::slice::from_raw_parts(x.ptr.add(t * x.stride), w.cols);
    if x.rows == 1 {
        return if w.x8 { gemv_x8(w, xrow(0), out.ptr, r0, r1) } else { gemv(w, xrow(0), out.ptr, r0, r1) };
    }
    let mut wr = vec![0f32; w.cols];
    let chain = w.x8 || x.rows >= BCAST_MIN_TOKENS;
    for r in r0..r1 {
        decode_row(w, r, &mut wr);
        for t in 0..x.rows {
            let xr = xrow(t);
            let v = if chain {
                // one FMA chain in K order
                wr.iter().zip(xr).fold(0f32, |acc, (&a, &b)| a.mul_add(b, acc))
            } else {
                // 8 lanes, lane k % 8 fed in K order, then the horizontal sum
                let mut acc = [0f32; 8];
                for (k, (&a, &b)) in wr.iter().zip(xr).enumerate() {
                    acc[k % 8] = a.mul_add(b, acc[k % 8]);
                }
                hsum8(&acc)
            };
            *out.ptr.add(t * out.stride + r) = v;
        }
    }
}

/// Dequantize one row into `out[..row.len() / block_bytes * block_weights]`.
///
/// # Safety
/// `out` must have room for the row.
pub(crate) unsafe fn dequant_row(q: QType, row: &[u8], out: *mut f32) {
    let mut wg = [0f32; 32];
    for (b, blk) in row.chunks_exact(q.block_bytes()).enumerate() {
        for g in 0..groups(q) {
            group(q, blk, g, &mut wg);
            std::ptr::copy_nonoverlapping(wg.as_ptr(), out.add(b * q.block_weights() + g * 32), 32);
        }
    }
}

/// Dequantize row `r` of an interleaved matrix into `out[..w.cols]`.
///
/// # Safety
/// `out` must have room for the row; `r < w.rows`.
pub(crate) unsafe fn dequant_row_x8(w: &QMatrix, r: usize, out: *mut f32) {
    let mut wg = [0f32; 32];
    for b in 0..w.cols / 32 {
        group_x8(w.qtype, w.x8_group(r, b), r % 8, &mut wg);
        std::ptr::copy_nonoverlapping(wg.as_ptr(), out.add(b * 32), 32);
    }
}
