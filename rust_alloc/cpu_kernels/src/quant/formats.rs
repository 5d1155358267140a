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
