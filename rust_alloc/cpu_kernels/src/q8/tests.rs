//! The integer products against the reference decoder and against each other.

use super::*;
use crate::quant::formats::group;

use crate::testing::{random_rows, Rng};

const FORMATS: [QType; 8] =
    [QType::Q4_0, QType::Q4_1, QType::Q5_0, QType::Q5_1, QType::Q8_0, QType::Q4_K, QType::Q5_K, QType::Q6_K];

fn reference(q: QType, data: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let (rb, bb, bw) = (q.row_bytes(cols).unwrap(), q.block_bytes(), q.block_weights());
    let mut out = vec![0f32; rows * cols];
    let mut w = [0f32; 32];
    for r in 0..rows {
        for b in 0..cols / bw {
            for g in 0..bw / 32 {
                group(q, &data[r * rb + b * bb..r * rb + (b + 1) * bb], g, &mut w);
                out[r * cols + b * bw + 32 * g..r * cols + b * bw + 32 * g + 32].copy_from_slice(&w);
            }
        }
    }
    out
}

#[test]
fn repacked_rows_dequantize_to_the_file_s_weights() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    // the second shape is big enough to be repacked on the pool's threads
    for (q, (rows, cols)) in FORMATS.iter().flat_map(|&q| [(q, (21, 2 * q.block_weights())), (q, (300, 4096))]) {
        let data = random_rows(q, rows, cols, &mut rng);
        let packed = repack(q, &data, rows, cols).unwrap();
        let m = RMatrix::new(Layout::new(q, rows, cols).unwrap(), &packed).unwrap();
        let want = reference(q, &data, rows, cols);
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            dequantize_row(&m, r, &mut row);
            for k in 0..cols {
                assert_eq!(row[k].to_bits(), want[r * cols + k].to_bits(), "{} row {r} col {k}", q.name());
            }
        }
        assert!(packed.len() * 100 <= data.len() * 103 + 16 * 100 * q.row_bytes(cols).unwrap(), "{}", q.name());
    }
}

#[test]
fn parts_repack_as_their_stacked_rows() {
    // Q/K/V-like parts (the last one not a whole row group), small and pool-sized
    let mut rng = Rng(0x0bad_cafe_1234_5678);
    for (q, (part_rows, cols)) in FORMATS.iter().flat_map(|&q| {
        [(q, (vec![32usize, 16, 21], 2 * q.block_weights())), (q, (vec![256usize, 64, 64], 4096))]
    }) {
        let parts: Vec<Vec<u8>> = part_rows.iter().map(|&r| random_rows(q, r, cols, &mut rng)).collect();
        let stacked: Vec<u8> = parts.concat();
        let rows: usize = part_rows.iter().sum();
        let want = repack(q, &stacked, rows, cols).unwrap();
        let slices: Vec<&[u8]> = parts.iter().map(|p| p.as_slice()).collect();
        assert!(repack_parts(q, &slices, &part_rows, cols).unwrap() == want, "{} {:?}", q.name(), part_rows);
    }
    // a part before the last that is not whole row groups is refused
    let q = QType::Q8_0;
    let parts = [random_rows(q, 20, 32, &mut rng), random_rows(q, 16, 32, &mut rng)];
    assert!(repack_parts(q, &[&parts[0], &parts[1]], &[20, 16], 32).is_err());
}

#[test]
fn every_path_equals_the_portable_one_and_the_integers_are_exact() {
    let mut rng = Rng(0x0bad_cafe_f00d_1234);
    for q in FORMATS {
        // the last: long rows, several tiles of tokens and a partial one
        for (rows, nblocks, tokens) in [(1, 1, 1), (16, 2, 3), (37, 1, 9), (50, 3, 17), (5, 2, 8), (18, 0, 75)] {
            let cols = if nblocks == 0 { 9216 } else { nblocks * q.block_weights() };
            let data = random_rows(q, rows, cols, &mut rng);
            let packed = repack(q, &data, rows, cols).unwrap();
            let m = RMatrix::new(Layout::new(q, rows, cols).unwrap(), &packed).unwrap();
            let x: Vec<f32> = (0..tokens * cols).map(|_| rng.unit()).collect();
            let mut a = QAct::new();
            // activations quantized per block of 32 are refused by K-quants, and the other way
            let wrong = !m.layout.kquant();
            if !wrong || cols % 256 == 0 {
                quantize_per(&x, cols, tokens, cols, &mut a, best(), wrong).unwrap();
                let mut out = vec![0f32; tokens * rows];
                assert!(matmul(&m, &a, &mut out, rows, best()).unwrap_err().0.contains("activations quantized per"));
            }
            quantize_for(&m.layout, &x, cols, tokens, &mut a).unwrap();
            assert_eq!(a.sb, m.layout.kquant());
            let mut outs = vec![];
            for isa in Isa::available(TOP) {
                let mut out = vec![f32::NAN; tokens * (rows + 3)];
                matmul(&m, &a, &mut out, rows + 3, isa).unwrap();
                for t in 0..tokens {   // the columns past `rows` untouched
                    assert!(out[t * (rows + 3) + rows..(t + 1) * (rows + 3)].iter().all(|v| v.is_nan()));
                }
                outs.push((isa, out));
            }
            for (isa, out) in &outs[1..] {
                for (i, (u, v)) in out.iter().zip(&outs[0].1).enumerate() {
                    assert!(u.to_bits() == v.to_bits() || (u.is_nan() && v.is_nan()),
                            "{} {isa:?} [{rows}, {cols}] x {tokens}, element {i}: {u} vs {v}", q.name());
                }
            }
            // against the dequantized weights times the quantized activations, in f64
            let w = reference(q, &data, rows, cols);
            for t in 0..tokens {
                for r in 0..rows {
                    let (mut s, mut mag) = (0f64, 0f64);
                    for k in 0..cols {
                        let i = a.at(t, k / 32);
                        let xq = a.q[32 * i + k % 32] as f64 * a.d[i] as f64;
                        s += w[r * cols + k] as f64 * xq;
                        mag += (w[r * cols + k] as f64 * xq).abs();
                    }
                    let got = outs[0].1[t * (rows + 3) + r] as f64;
                    assert!((got - s).abs() <= 1e-5 * mag.max(1e-30), "{} t{t} r{r}: {got} vs {s}", q.name());
                    if m.layout.kquant() {   // one scale per ACT_GROUPS blocks: their largest |x| / 127
                        let (n, span) = (cols / (32 * ACT_GROUPS), 32 * ACT_GROUPS);
                        let amax = x[t * cols + span * (r % n)..t * cols + span * (r % n + 1)].iter()
                            .fold(0f32, |m, v| m.max(v.abs()));
                        assert_eq!(a.d[a.at(t, ACT_GROUPS * (r % n) + r % ACT_GROUPS)], amax / 127.0);
                    }
                }
            }
        }
    }
}

#[test]
fn activations_quantize_per_block_of_32() {
    let x: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) * 0.5).collect();
    let mut a = QAct::new();
    quantize(&x, 64, 1, 64, &mut a).unwrap();
    assert_eq!(a.d[0], 10.0 / 127.0);
    assert_eq!(a.q[0], -127);
    assert_eq!(a.q[20], 0);
    let s: i32 = a.q[..32].iter().map(|&v| v as i32).sum();
    assert_eq!(a.s[0], s);
    assert_eq!(a.ds[0], a.d[0] * s as f32);
    assert!(quantize(&x, 64, 1, 48, &mut a).is_err());
    // ties go to even: with max|x| = 127 the scale is 1 and x · 1 = x
    let mut x = vec![0f32; 32];
    x[0] = 127.0;
    x[1..6].copy_from_slice(&[2.5, -3.5, 0.5, -0.5, 126.5]);
    quantize(&x, 32, 1, 32, &mut a).unwrap();
    assert_eq!(&a.q[..6], &[127, 2, -4, 0, 0, 126]);
}

#[test]
fn every_path_quantizes_to_the_same_bytes() {
    let mut rng = Rng(0x5eed_0f_ac71_0a75);
    for (tokens, cols) in [(1, 32), (3, 64), (9, 2048), (40, 1024), (2, 256)] {
        // values on a grid of halves make ties; a zero block and a huge one
        let mut x: Vec<f32> = (0..tokens * cols).map(|i| match i % 3 {
            0 => (rng.unit() * 254.0).round() * 0.5,
            _ => rng.unit() * 3.0,
        }).collect();
        x[..32].iter_mut().for_each(|v| *v = 0.0);
        x[cols - 32] = 3e38;
        for sb in [false, true] {
            if sb && cols % 256 != 0 {
                assert!(quantize_per(&x, cols, tokens, cols, &mut QAct::new(), Isa::Scalar, sb).is_err());
                continue;
            }
            let mut want = QAct::new();
            quantize_per(&x, cols, tokens, cols, &mut want, Isa::Scalar, sb).unwrap();
            for isa in Isa::available(TOP) {
                let mut a = QAct::new();
                quantize_per(&x, cols, tokens, cols, &mut a, isa, sb).unwrap();
                assert_eq!(a.q, want.q, "{isa:?}");
                assert_eq!(a.s, want.s, "{isa:?}");
                assert_eq!(a.k16, want.k16, "{isa:?}");
                for (u, v) in a.d.iter().chain(&a.ds).chain(&a.sf).zip(want.d.iter().chain(&want.ds).chain(&want.sf)) {
                    assert_eq!(u.to_bits(), v.to_bits(), "{isa:?}");
                }
            }
        }
    }
}
