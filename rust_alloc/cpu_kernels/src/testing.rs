//! Helpers the kernels' unit tests share.

use crate::quant::formats::f16_to_f32;
use crate::quant::QType;

/// A small xorshift generator: the same numbers on every machine.
pub(crate) struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: usize) -> usize { (self.next() % n as u64) as usize }
    pub fn unit(&mut self) -> f32 { (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0 }
    /// A sane f16 scale: |s| in [2^-10, 2^-2), either sign.
    pub fn scale(&mut self) -> [u8; 2] {
        let sign = (self.next() & 1) as u16;
        let exp = 5 + self.below(8) as u16;
        let man = self.below(1024) as u16;
        ((sign << 15) | (exp << 10) | man).to_le_bytes()
    }
}

/// Random block bytes with sane f16 scales where each format keeps them.
pub(crate) fn random_rows(q: QType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let rb = q.row_bytes(cols).unwrap();
    let mut v: Vec<u8> = (0..rows * rb).map(|_| rng.next() as u8).collect();
    for blk in v.chunks_exact_mut(q.block_bytes()) {
        let at: &[usize] = match q {
            QType::Q8_0 | QType::Q4_0 | QType::Q5_0 => &[0],
            QType::Q4_1 | QType::Q4_K | QType::Q5_1 | QType::Q5_K => &[0, 2],
            QType::Q6_K => &[208],
            // every weight a sane half (F16) or bfloat16 (its top half: the same kind of bits)
            QType::F16 | QType::BF16 => &[0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38, 40,
                                         42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62],
        };
        for &a in at {
            let s = rng.scale();
            if q == QType::BF16 {   // a bfloat16 of about the same size: f32 bits of the half, top 16
                let x = f16_to_f32(u16::from_le_bytes(s));
                blk[a..a + 2].copy_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes());
            } else {
                blk[a..a + 2].copy_from_slice(&s);
            }
        }
    }
    v
}
