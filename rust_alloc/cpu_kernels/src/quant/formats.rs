//! The GGML block layouts, decoded one group of 32 weights at a time (the unit both code
//! paths work in), plus a whole-row reference decoder written the other way round (per
//! output element, in the order GGML's reference C loops walk a block) for the tests.
//!
//! Per block (little-endian f16 scales):
//! - Q8_0, 34 B / 32: `d`, 32 × i8.                                   w = d·q
//! - Q4_0, 18 B / 32: `d`, 16 B nibbles (low: weights 0..16, high: 16..32).  w = d·(q − 8)
//! - Q4_1, 20 B / 32: `d`, `m`, 16 B nibbles as Q4_0.                 w = d·q + m
//! - Q4_K, 144 B / 256: `d`, `dmin`, 12 B of 6-bit (scale, min) pairs for 8 groups, 128 B
//!   nibbles: bytes `32c..32c+32` hold group `2c` (low nibbles) and `2c+1` (high).
//!   w = (d·sc)·q − dmin·mn
//! - Q6_K, 210 B / 256: 128 B `ql` (low 4 bits), 64 B `qh` (high 2 bits), 16 × i8 scales (one
//!   per 16 weights), `d`. Half `h` (128 weights) uses `ql[64h..]`, `qh[32h..]`; its group `j`
//!   takes `ql[64h + 32(j%2) + i] >> 4(j/2)` and `qh[32h + i] >> 2j`.  w = (d·sc)·(q − 32)
//! - Q5_0, 22 B / 32: `d`, 4 B high bits (bit `i` for weight `i`), 16 B nibbles as Q4_0.
//!   w = d·(q − 16)
//! - Q5_1, 24 B / 32: `d`, `m`, 4 B high bits, 16 B nibbles.            w = d·q + m
//! - Q5_K, 176 B / 256: `d`, `dmin`, 12 B (scale, min) as Q4_K, 32 B high bits (bit `g` of byte
//!   `i` for weight `i` of group `g`), 128 B nibbles as Q4_K.           w = (d·sc)·q − dmin·mn
//! - F16 / BF16, 2 B a weight, read in blocks of 32.

use super::QType;

/// IEEE half -> single, exact (subnormals, infinities and NaN included).
#[inline]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) >> 15) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match exp {
        0 => {
            if man == 0 {
                sign
            } else {
                // subnormal: man · 2^-24, normalized
                let shift = man.leading_zeros() - 21; // bring the top bit to position 10
                let man = (man << shift) & 0x3ff;
                sign | ((113 - shift) << 23) | (man << 13)
            }
        }
        31 => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

#[inline]
pub(crate) fn half(b: &[u8], at: usize) -> f32 { f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]])) }

/// Q4_K's packed 6-bit (scale, min) of group `j` (0..8).
#[inline]
pub(crate) fn q4k_scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

#[inline]
pub(crate) fn bf16_to_f32(h: u16) -> f32 { f32::from_bits((h as u32) << 16) }

#[inline]
fn u32le(b: &[u8], at: usize) -> u32 { u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) }

/// Groups of 32 weights per block.
pub(crate) const fn groups(q: QType) -> usize { q.block_weights() / 32 }

/// Decode group `g` of block `blk` into `w`, computing each weight exactly as
/// `gguf.quants.dequantize` does (same fp32 operations in the same order).
#[inline]
pub(crate) fn group(q: QType, blk: &[u8], g: usize, w: &mut [f32; 32]) {
    match q {
        QType::Q8_0 => {
            let d = half(blk, 0);
            for i in 0..32 {
                w[i] = (blk[2 + i] as i8) as f32 * d;
            }
        }
        QType::Q4_0 => {
            let d = half(blk, 0);
            for i in 0..16 {
                let b = blk[2 + i];
                w[i] = ((b & 15) as i32 - 8) as f32 * d;
                w[i + 16] = ((b >> 4) as i32 - 8) as f32 * d;
            }
        }
        QType::Q4_1 => {
            let (d, m) = (half(blk, 0), half(blk, 2));
            for i in 0..16 {
                let b = blk[4 + i];
                w[i] = d * (b & 15) as f32 + m;
                w[i + 16] = d * (b >> 4) as f32 + m;
            }
        }
        QType::Q4_K => {
            let (sc, mn) = q4k_scale_min(&blk[4..16], g);
            let d = half(blk, 0) * sc as f32;
            let dm = half(blk, 2) * mn as f32;
            let qs = &blk[16 + 32 * (g / 2)..16 + 32 * (g / 2) + 32];
            let shift = 4 * (g % 2);
            for i in 0..32 {
                w[i] = d * ((qs[i] >> shift) & 15) as f32 - dm;
            }
        }
        QType::Q6_K => {
            let (h, j) = (g / 4, g % 4);
            let ql = &blk[64 * h + 32 * (j % 2)..];
            let qh = &blk[128 + 32 * h..];
            let d = half(blk, 208);
            let (sl, sh) = (4 * (j / 2), 2 * j);
            for i in 0..32 {
                let code = ((ql[i] >> sl) & 15) | (((qh[i] >> sh) & 3) << 4);
                let sc = blk[192 + 2 * g + i / 16] as i8;
                w[i] = (d * sc as f32) * (code as i32 - 32) as f32;
            }
        }
        QType::Q5_0 | QType::Q5_1 => {
            let q51 = q == QType::Q5_1;
            let (d, m) = (half(blk, 0), if q51 { half(blk, 2) } else { 0.0 });
            let at = if q51 { 4 } else { 2 };
            let qh = u32le(blk, at);
            for i in 0..16 {
                let b = blk[at + 4 + i];
                let lo = ((b & 15) as u32 | ((qh >> i) & 1) << 4) as i32;
                let hi = ((b >> 4) as u32 | ((qh >> (i + 16)) & 1) << 4) as i32;
                if q51 {
                    w[i] = d * lo as f32 + m;
                    w[i + 16] = d * hi as f32 + m;
                } else {
                    w[i] = d * (lo - 16) as f32;
                    w[i + 16] = d * (hi - 16) as f32;
                }
            }
        }
        QType::Q5_K => {
            let (sc, mn) = q4k_scale_min(&blk[4..16], g);
            let d = half(blk, 0) * sc as f32;
            let dm = half(blk, 2) * mn as f32;
            let qs = &blk[48 + 32 * (g / 2)..48 + 32 * (g / 2) + 32];
            let shift = 4 * (g % 2);
            for i in 0..32 {
                let code = ((qs[i] >> shift) & 15) | (((blk[16 + i] >> g) & 1) << 4);
                w[i] = d * code as f32 - dm;
            }
        }
        QType::F16 => {
            for i in 0..32 {
                w[i] = half(blk, 2 * i);
            }
        }
        QType::BF16 => {
            for i in 0..32 {
                w[i] = bf16_to_f32(u16::from_le_bytes([blk[2 * i], blk[2 * i + 1]]));
            }
        }
    }
}

/// The 32 weights of lane `i` (row `8g + i`) of an interleaved group of 8 blocks `gb`
/// (Q4_0, Q4_1, Q8_0), computed exactly as `group` computes them.
#[inline]
pub(crate) fn group_x8(q: QType, gb: &[u8], i: usize, w: &mut [f32; 32]) {
    let c = q.x8_codes();
    match q {
        QType::Q8_0 => {
            let d = half(gb, 2 * i);
            for k in 0..32 {
                w[k] = (gb[c + 8 * k + i] as i8) as f32 * d;
            }
        }
        QType::Q4_0 => {
            let d = half(gb, 2 * i);
            for j in 0..16 {
                let b = gb[c + 8 * j + i];
                w[j] = ((b & 15) as i32 - 8) as f32 * d;
                w[j + 16] = ((b >> 4) as i32 - 8) as f32 * d;
            }
        }
        QType::Q4_1 => {
            let (d, m) = (half(gb, 2 * i), half(gb, 16 + 2 * i));
            for j in 0..16 {
                let b = gb[c + 8 * j + i];
                w[j] = d * (b & 15) as f32 + m;
                w[j + 16] = d * (b >> 4) as f32 + m;
            }
        }
        _ => unreachable!("{} is not interleavable", q.name()),
    }
}

/// Reference decoder of one row (tests): GGML's dequantize_row loops, element by element.
pub fn dequantize_ref(q: QType, row: &[u8]) -> Vec<f32> {
    let nb = row.len() / q.block_bytes();
    let mut y = vec![0f32; nb * q.block_weights()];
    for (b, blk) in row.chunks_exact(q.block_bytes()).enumerate() {
        let y = &mut y[b * q.block_weights()..(b + 1) * q.block_weights()];
        match q {
            QType::Q8_0 => {
                for j in 0..32 {
                    y[j] = half(blk, 0) * (blk[2 + j] as i8) as f32;
                }
            }
            QType::Q4_0 | QType::Q4_1 => {
                let qs = if q == QType::Q4_0 { &blk[2..18] } else { &blk[4..20] };
                for j in 0..16 {
                    for (k, v) in [(j, qs[j] & 0x0f), (j + 16, qs[j] >> 4)] {
                        y[k] = if q == QType::Q4_0 {
                            half(blk, 0) * (v as i32 - 8) as f32
                        } else {
                            half(blk, 0) * v as f32 + half(blk, 2)
                        };
                    }
                }
            }
            QType::Q4_K => {
                let (d, dmin) = (half(blk, 0), half(blk, 2));
                let mut out = 0;
                for c in 0..4 {
                    let qs = &blk[16 + 32 * c..16 + 32 * c + 32];
                    let (s1, m1) = q4k_scale_min(&blk[4..16], 2 * c);
                    let (s2, m2) = q4k_scale_min(&blk[4..16], 2 * c + 1);
                    for l in 0..32 {
                        y[out + l] = d * s1 as f32 * (qs[l] & 15) as f32 - dmin * m1 as f32;
                        y[out + 32 + l] = d * s2 as f32 * (qs[l] >> 4) as f32 - dmin * m2 as f32;
                    }
                    out += 64;
                }
            }
            QType::Q5_0 | QType::Q5_1 => {
                let q51 = q == QType::Q5_1;
                let at = if q51 { 4 } else { 2 };
                let qh = u32le(blk, at);
                for j in 0..16 {
                    let x0 = ((blk[at + 4 + j] & 0x0f) as u32 | ((qh >> j) << 4) & 0x10) as i32;
                    let x1 = ((blk[at + 4 + j] >> 4) as u32 | (qh >> (j + 12)) & 0x10) as i32;
                    if q51 {
                        y[j] = half(blk, 0) * x0 as f32 + half(blk, 2);
                        y[j + 16] = half(blk, 0) * x1 as f32 + half(blk, 2);
                    } else {
                        y[j] = half(blk, 0) * (x0 - 16) as f32;
                        y[j + 16] = half(blk, 0) * (x1 - 16) as f32;
                    }
                }
            }
            QType::Q5_K => {
                let (d, dmin) = (half(blk, 0), half(blk, 2));
                let (qh, mut u1, mut u2) = (&blk[16..48], 1u8, 2u8);
                for c in 0..4 {
                    let ql = &blk[48 + 32 * c..48 + 32 * c + 32];
                    let (s1, m1) = q4k_scale_min(&blk[4..16], 2 * c);
                    let (s2, m2) = q4k_scale_min(&blk[4..16], 2 * c + 1);
                    for l in 0..32 {
                        let a = (ql[l] & 15) + if qh[l] & u1 != 0 { 16 } else { 0 };
                        let b = (ql[l] >> 4) + if qh[l] & u2 != 0 { 16 } else { 0 };
                        y[64 * c + l] = d * s1 as f32 * a as f32 - dmin * m1 as f32;
                        y[64 * c + 32 + l] = d * s2 as f32 * b as f32 - dmin * m2 as f32;
                    }
                    u1 <<= 2;
                    u2 <<= 2;
                }
            }
            QType::F16 => {
                for j in 0..32 {
                    y[j] = half(blk, 2 * j);
                }
            }
            QType::BF16 => {
                for j in 0..32 {
                    y[j] = bf16_to_f32(u16::from_le_bytes([blk[2 * j], blk[2 * j + 1]]));
                }
            }
            QType::Q6_K => {
                let d = half(blk, 208);
                for n in 0..2 {
                    let (ql, qh, sc) = (&blk[64 * n..], &blk[128 + 32 * n..], &blk[192 + 8 * n..]);
                    let y = &mut y[128 * n..];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 15) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                }
            }
        }
    }
    y
}
