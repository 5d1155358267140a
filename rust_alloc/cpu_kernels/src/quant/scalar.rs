//! Portable path: the same group decode and tile loop as `avx2.rs`, in plain Rust with eight
//! accumulator lanes per token, summed in the order the SIMD path sums its register.

use super::formats::{group, group_x8, groups};
use super::{Mat, QMatrix, QType, MAX_TILE};

#[inline]
pub(crate) fn hsum8(a: &[f32; 8]) -> f32 { ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])) }

/// Output columns `r0..r1` (weight rows) for every token row of `x`.
///
/// # Safety
/// `x` and `out` must be valid views of `[x.rows, w.cols]` and `[x.rows, > r1 - 1]`.
pub(crate) unsafe fn matmul_rows(w: &QMatrix, x: Mat, out: Mat, r0: usize, r1: usize) {
    let q = w.qtype;
    let (bw, bb) = (q.block_weights(), q.block_bytes());
    let nb = w.cols / bw;
    let mut wg = [0f32; 32];
    for r in r0..r1 {
        let row = if w.x8 { &[][..] } else { &w.data[r * w.row_bytes()..(r + 1) * w.row_bytes()] };
        let mut t0 = 0;
        while t0 < x.rows {
            let nt = (x.rows - t0).min(MAX_TILE);
            let mut acc = [[0f32; 8]; MAX_TILE];
            for b in 0..nb {
                for g in 0..groups(q) {
                    if w.x8 {
                        group_x8(q, w.x8_group(r, b), r % 8, &mut wg);
                    } else {
                        group(q, &row[b * bb..(b + 1) * bb], g, &mut wg);
                    }
                    let k0 = b * bw + g * 32;
                    for (t, acc) in acc.iter_mut().enumerate().take(nt) {
                        let xr = std::slice::from_raw_parts(x.ptr.add((t0 + t) * x.stride + k0), 32);
                        for i in 0..32 {
                            acc[i % 8] += wg[i] * xr[i];
                        }
                    }
                }
            }
            for (t, acc) in acc.iter().enumerate().take(nt) {
                *out.ptr.add((t0 + t) * out.stride + r) = hsum8(acc);
            }
            t0 += nt;
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
