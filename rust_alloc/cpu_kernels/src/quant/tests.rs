//! Kernel tests without Python: decoders against the reference decoder, both code paths
//! against an f64 product of the reference weights, and against each other.

use super::*;
use crate::testing::{random_rows, Rng};

fn isas() -> Vec<Isa> {
    let mut v = vec![Isa::Scalar];
    if best() == Isa::Avx2 {
        v.push(Isa::Avx2);
    }
    v
}

#[test]
fn f16_conversion_is_exact() {
    assert_eq!(f16_to_f32(0x3c00), 1.0);
    assert_eq!(f16_to_f32(0xc000), -2.0);
    assert_eq!(f16_to_f32(0x7bff), 65504.0);
    assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
    assert_eq!(f16_to_f32(0x03ff), 1023.0 * 2f32.powi(-24));
    assert_eq!(f16_to_f32(0x0400), 2f32.powi(-14));
    assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
    assert!(f16_to_f32(0x7e00).is_nan());
    assert_eq!(f16_to_f32(0x8000).to_bits(), 0x8000_0000);
    // every value against the CPU's own conversion, where it has one
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("f16c") {
        for h in 0..=u16::MAX {
            let hw = unsafe { hw_f16(h) };
            let sw = f16_to_f32(h);
            assert!(hw.to_bits() == sw.to_bits() || (hw.is_nan() && sw.is_nan()), "{h:#06x}: {hw} vs {sw}");
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "f16c")]
unsafe fn hw_f16(h: u16) -> f32 {
    use std::arch::x86_64::*;
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

#[test]
fn layouts() {
    for (q, w, b) in [(QType::Q4_0, 32, 18), (QType::Q4_1, 32, 20), (QType::Q8_0, 32, 34), (QType::Q4_K, 256, 144),
                      (QType::Q6_K, 256, 210), (QType::Q5_0, 32, 22), (QType::Q5_1, 32, 24), (QType::Q5_K, 256, 176),
                      (QType::F16, 32, 64), (QType::BF16, 32, 64)] {
        assert_eq!((q.block_weights(), q.block_bytes()), (w, b));
        assert_eq!(QType::from_ggml(q as u32), Some(q));
    }
    assert_eq!(QType::from_ggml(0), None); // F32
    assert!(QType::Q4_K.row_bytes(576).is_err());
    assert!(QType::Q4_0.row_bytes(0).is_err());
}

#[test]
fn dequantize_matches_reference_bit_for_bit() {
    let mut rng = Rng(0x9e3779b97f4a7c15);
    for q in QType::ALL {
        let (rows, cols) = (7, 2 * q.block_weights());
        let data = random_rows(q, rows, cols, &mut rng);
        let w = QMatrix::new(q, &data, rows, cols).unwrap();
        let reference: Vec<f32> = data.chunks_exact(w.row_bytes()).flat_map(|r| dequantize_ref(q, r)).collect();
        for isa in isas() {
            let mut out = vec![f32::NAN; rows * cols];
            dequantize(&w, 0, &mut out, rows, cols, isa).unwrap();
            for (i, (a, b)) in out.iter().zip(&reference).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{} {isa:?} element {i}: {a} vs {b}", q.name());
            }
            // a row range and a gather
            let mut part = vec![0f32; 2 * cols];
            dequantize(&w, 3, &mut part, 2, cols, isa).unwrap();
            assert_eq!(part, reference[3 * cols..5 * cols]);
            let mut g = vec![0f32; 3 * cols];
            gather_rows(&w, &[6, 0, 6], &mut g, cols, isa).unwrap();
            assert_eq!(g[..cols], reference[6 * cols..]);
            assert_eq!(g[cols..2 * cols], reference[..cols]);
        }
    }
}

/// max |a - b| / max |b|
fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    let scale = b.iter().fold(0f64, |m, v| m.max(v.abs())).max(1e-30);
    a.iter().zip(b).fold(0f64, |m, (x, y)| m.max((*x as f64 - y).abs())) / scale
}

#[test]
fn matmul_matches_f64_reference_on_ragged_shapes() {
    let mut rng = Rng(12345);
    for q in QType::ALL {
        for &(rows, blocks, tokens) in &[(1, 1, 1), (3, 2, 2), (17, 3, 3), (67, 1, 8), (130, 4, 9), (40, 2, 21), (5, 6, 16), (130, 4, 1), (67, 3, 1), (6, 1, 1)] {
            let cols = blocks * q.block_weights();
            let data = random_rows(q, rows, cols, &mut rng);
            let w = QMatrix::new(q, &data, rows, cols).unwrap();
            let wf: Vec<f32> = data.chunks_exact(w.row_bytes()).flat_map(|r| dequantize_ref(q, r)).collect();
            let (xs, os) = (cols + 3, rows + 5); // strided views
            let x: Vec<f32> = (0..tokens * xs).map(|_| rng.unit()).collect();
            let mut reference = vec![0f64; tokens * rows];
            for t in 0..tokens {
                for r in 0..rows {
                    reference[t * rows + r] = (0..cols).map(|k| wf[r * cols + k] as f64 * x[t * xs + k] as f64).sum();
                }
            }
            let mut results = vec![];
            for isa in isas() {
                let mut out = vec![f32::NAN; tokens * os];
                matmul(&w, &x, xs, tokens, &mut out, os, isa).unwrap();
                let got: Vec<f32> = (0..tokens).flat_map(|t| out[t * os..t * os + rows].to_vec()).collect();
                let e = rel_err(&got, &reference);
                assert!(e <= 1e-5, "{} {isa:?} [{rows}x{cols}] t={tokens}: rel err {e}", q.name());
                for t in 0..tokens {
                    assert!(out[t * os + rows..(t + 1) * os].iter().all(|v| v.is_nan()), "wrote past a row");
                }
                results.push(got);
            }
            for (i, b) in results.iter().enumerate().skip(1) {
                // every path gives the portable one's bits
                for (j, (u, v)) in b.iter().zip(&results[0]).enumerate() {
                    assert_eq!(u.to_bits(), v.to_bits(), "{} {:?} [{rows}x{cols}] t={tokens} element {j}: {u} vs {v}",
                               q.name(), isas()[i]);
                }
            }
        }
    }
}

#[test]
fn large_matmul_runs_on_the_pool_and_agrees() {
    // big enough to be split over threads, with concurrent callers
    let mut rng = Rng(777);
    let (q, rows, cols, tokens) = (QType::Q4_1, 1000, 576, 3);
    let data = random_rows(q, rows, cols, &mut rng);
    let x: Vec<f32> = (0..tokens * cols).map(|_| rng.unit()).collect();
    let w = QMatrix::new(q, &data, rows, cols).unwrap();
    let mut first = vec![0f32; tokens * rows];
    matmul(&w, &x, cols, tokens, &mut first, rows, best()).unwrap();
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                for _ in 0..20 {
                    let mut out = vec![0f32; tokens * rows];
                    matmul(&w, &x, cols, tokens, &mut out, rows, best()).unwrap();
                    assert_eq!(out, first);
                }
            });
        }
    });
}

#[test]
fn bad_shapes_are_errors() {
    let data = vec![0u8; 2 * 20];
    assert!(QMatrix::new(QType::Q4_1, &data, 2, 32).is_ok());
    assert!(QMatrix::new(QType::Q4_1, &data, 3, 32).is_err());
    assert!(QMatrix::new(QType::Q4_1, &data, 2, 64).is_err());
    let w = QMatrix::new(QType::Q4_1, &data, 2, 32).unwrap();
    let x = vec![0f32; 31];
    let mut out = vec![0f32; 2];
    assert!(matmul(&w, &x, 32, 1, &mut out, 2, Isa::Scalar).is_err());
    let x = vec![0f32; 32];
    assert!(matmul(&w, &x, 32, 1, &mut out[..1], 2, Isa::Scalar).is_err());
    assert!(matmul(&w, &x, 32, 1, &mut out, 2, Isa::Scalar).is_ok());
    assert!(gather_rows(&w, &[2], &mut vec![0f32; 32], 32, Isa::Scalar).is_err());
    assert!(dequantize(&w, 1, &mut vec![0f32; 64], 2, 32, Isa::Scalar).is_err());
}

#[test]
fn a_tokens_result_does_not_depend_on_its_batch() {
    // every tile shape (2..=8 tokens, 1/2 rows, ragged row tails) sums in one order
    let mut rng = Rng(4242);
    for q in QType::ALL {
        let (rows, cols) = (11, 2 * q.block_weights());
        let data = random_rows(q, rows, cols, &mut rng);
        let w = QMatrix::new(q, &data, rows, cols).unwrap();
        let tokens = 13;
        let x: Vec<f32> = (0..tokens * cols).map(|_| rng.unit()).collect();
        let wf: Vec<f32> = data.chunks_exact(w.row_bytes()).flat_map(|r| dequantize_ref(q, r)).collect();
        // the size of rounding differences in output (t, r): sum_k |w x|
        let mag = |t: usize, r: usize| -> f32 { (0..cols).map(|k| (wf[r * cols + k] * x[t * cols + k]).abs()).sum() };
        for isa in isas() {
            let mut all = vec![0f32; tokens * rows];
            matmul(&w, &x, cols, tokens, &mut all, rows, isa).unwrap();
            // one token alone takes the GEMV path (scales applied per block): equal to rounding
            for t0 in 0..tokens {
                let mut one = vec![0f32; rows];
                matmul(&w, &x[t0 * cols..], cols, 1, &mut one, rows, isa).unwrap();
                for (r, (a, b)) in one.iter().zip(&all[t0 * rows..(t0 + 1) * rows]).enumerate() {
                    assert!((a - b).abs() <= 1e-6 * mag(t0, r), "{} {isa:?}: {a} vs {b} ({})", q.name(), mag(t0, r));
                }
                for n in 2..=(tokens - t0).min(9) {
                    let mut part = vec![0f32; n * rows];
                    matmul(&w, &x[t0 * cols..], cols, n, &mut part, rows, isa).unwrap();
                    assert_eq!(part, all[t0 * rows..(t0 + n) * rows], "{} {isa:?} tokens {t0}..{}", q.name(), t0 + n);
                }
            }
        }
    }
}

#[test]
fn batches_of_16_or_more_take_the_broadcast_path_and_are_batch_invariant() {
    // 16+ tokens take the broadcast path (16-row groups, K in chunks, 6-token tiles, partial
    // last group); 2..15 tokens the register tiles. Within each a token's bits do not
    // depend on the batch; across them they agree to rounding; all are right.
    let mut rng = Rng(2718);
    for q in QType::ALL {
        let (rows, cols, tokens) = (29, 1536, 45);
        let data = random_rows(q, rows, cols, &mut rng);
        let w = QMatrix::new(q, &data, rows, cols).unwrap();
        let wf: Vec<f32> = data.chunks_exact(w.row_bytes()).flat_map(|r| dequantize_ref(q, r)).collect();
        let (xs, os) = (cols + 3, rows + 5);
        let x: Vec<f32> = (0..tokens * xs).map(|_| rng.unit()).collect();
        for isa in isas() {
            let mut all = vec![f32::NAN; tokens * os];
            matmul(&w, &x, xs, tokens, &mut all, os, isa).unwrap();
            for t in 0..tokens {
                let reference: Vec<f64> =
                    (0..rows).map(|r| (0..cols).map(|k| wf[r * cols + k] as f64 * x[t * xs + k] as f64).sum()).collect();
                let e = rel_err(&all[t * os..t * os + rows], &reference);
                assert!(e <= 1e-5, "{} {isa:?} token {t}: rel err {e}", q.name());
                assert!(all[t * os + rows..(t + 1) * os].iter().all(|v| v.is_nan()), "wrote past a row");
            }
            let small = |t0: usize, n: usize| {
                let mut part = vec![f32::NAN; n * os];
                matmul(&w, &x[t0 * xs..], xs, n, &mut part, os, isa).unwrap();
                part
            };
            let (tiles_a, tiles_b) = (small(0, 9), small(7, 2));
            assert_eq!(tiles_a[7 * os..8 * os - 5], tiles_b[..rows], "{} {isa:?}: 2..15 tokens, token 7", q.name());
            for (t0, n) in [(0, 16), (13, 17), (20, 20), (3, 33), (0, 45)] {
                let part = small(t0, n);
                for t in 0..n {
                    let (a, b) = (&part[t * os..t * os + rows], &all[(t0 + t) * os..(t0 + t) * os + rows]);
                    assert_eq!(a, b, "{} {isa:?} tokens {t0}..{}: token {t}", q.name(), t0 + n);
                }
            }
            for t in 0..9 {
                let r: Vec<f64> = all[t * os..t * os + rows].iter().map(|&v| v as f64).collect();
                let e = rel_err(&tiles_a[t * os..t * os + rows], &r);
                assert!(e <= 1e-5, "{} {isa:?}: tiles against the broadcast path, token {t}: {e}", q.name());
            }
        }
    }
}

#[test]
fn stacked_parts_equal_separate_products() {
    // a fused QKV of three formats, one call; small (inline) and large (pool) products
    let mut rng = Rng(31337);
    for (rows, tokens) in [([3, 2, 2], 1), ([96, 40, 40], 1), ([96, 40, 40], 5), ([300, 100, 100], 13)] {
        let cols = 256;
        let qs = [QType::Q4_K, QType::Q8_0, QType::Q6_K];
        let data: Vec<Vec<u8>> = qs.iter().zip(rows).map(|(&q, r)| random_rows(q, r, cols, &mut rng)).collect();
        let ws: Vec<QMatrix> = qs.iter().zip(rows).zip(&data).map(|((&q, r), d)| QMatrix::new(q, d, r, cols).unwrap()).collect();
        let n: usize = rows.iter().sum();
        let x: Vec<f32> = (0..tokens * cols).map(|_| rng.unit()).collect();
        for isa in isas() {
            let mut one = vec![f32::NAN; tokens * (n + 3)];
            matmul_stacked(&ws, &x, cols, tokens, &mut one, n + 3, isa).unwrap();
            let mut off = 0;
            for w in &ws {
                let mut part = vec![0f32; tokens * w.rows];
                matmul(w, &x, cols, tokens, &mut part, w.rows, isa).unwrap();
                for t in 0..tokens {
                    assert_eq!(one[t * (n + 3) + off..t * (n + 3) + off + w.rows], part[t * w.rows..(t + 1) * w.rows]);
                    assert!(one[t * (n + 3) + n..(t + 1) * (n + 3)].iter().all(|v| v.is_nan()), "wrote past a row");
                }
                off += w.rows;
            }
        }
    }
    let d = random_rows(QType::Q8_0, 2, 64, &mut rng);
    let (a, b) = (QMatrix::new(QType::Q8_0, &d, 2, 64).unwrap(), QMatrix::new(QType::Q8_0, &d, 4, 32).unwrap());
    assert!(matmul_stacked(&[a, b], &[0f32; 64], 64, 1, &mut [0f32; 6], 6, Isa::Scalar).is_err());
}

#[test]
fn pool_helpers_take_chunks() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    if pool::num_threads() < 2 {
        return;
    }
    let main = std::thread::current().id();
    let by_helpers = AtomicUsize::new(0);
    let mut total_helper = 0;
    for _ in 0..50 {
        by_helpers.store(0, Ordering::SeqCst);
        pool::parallel_for(64, &|_| {
            let t = std::time::Instant::now();
            while t.elapsed() < std::time::Duration::from_micros(20) {}
            if std::thread::current().id() != main {
                by_helpers.fetch_add(1, Ordering::SeqCst);
            }
        });
        total_helper += by_helpers.load(Ordering::SeqCst);
    }
    eprintln!("helpers ran {total_helper} of {} chunks", 50 * 64);
    assert!(total_helper > 0, "the pool's helpers never ran a chunk");
}

#[test]
#[ignore]
fn pool_speedup_probe() {
    let mut rng = Rng(99);
    let (q, rows, cols, tokens) = (QType::Q4_1, 3072, 576, 32);
    let data = random_rows(q, rows, cols, &mut rng);
    let x: Vec<f32> = (0..tokens * cols).map(|_| rng.unit()).collect();
    let w = QMatrix::new(q, &data, rows, cols).unwrap();
    let mut out = vec![0f32; tokens * rows];
    let isa = best();
    let xm = Mat { ptr: x.as_ptr() as *mut f32, rows: tokens, stride: cols };
    let om = Mat { ptr: out.as_mut_ptr(), rows: tokens, stride: rows };
    let t = std::time::Instant::now();
    for _ in 0..20 {
        unsafe { rows_kernel(isa, &w, xm, om, 0, rows) };
    }
    eprintln!("single thread: {:?} per call", t.elapsed() / 20);
    let t = std::time::Instant::now();
    for _ in 0..20 {
        matmul(&w, &x, cols, tokens, &mut out, rows, isa).unwrap();
    }
    eprintln!("pool of {}: {:?} per call", pool::num_threads(), t.elapsed() / 20);
}

const X8_FORMATS: [QType; 3] = [QType::Q4_0, QType::Q4_1, QType::Q8_0];

#[test]
fn interleaved_weights_dequantize_to_the_same_bits() {
    let mut rng = Rng(0x51ed);
    for q in X8_FORMATS {
        for rows in [1, 7, 8, 13, 40] {
            let cols = 96;
            let data = random_rows(q, rows, cols, &mut rng);
            let x8 = interleave(q, &data, rows, cols).unwrap();
            assert_eq!(x8.len(), rows.div_ceil(8) * 8 * q.row_bytes(cols).unwrap());
            let (w, wx) = (QMatrix::new(q, &data, rows, cols).unwrap(), QMatrix::with_layout(q, true, &x8, rows, cols).unwrap());
            let reference: Vec<f32> = data.chunks_exact(w.row_bytes()).flat_map(|r| dequantize_ref(q, r)).collect();
            for isa in isas() {
                let mut out = vec![f32::NAN; rows * cols];
                dequantize(&wx, 0, &mut out, rows, cols, isa).unwrap();
                assert!(out.iter().zip(&reference).all(|(a, b)| a.to_bits() == b.to_bits()), "{} {isa:?} rows {rows}", q.name());
                // a range that starts and ends inside groups, into a strided view
                if rows > 4 {
                    let (r0, n) = (3, rows - 4);
                    let mut part = vec![f32::NAN; n * (cols + 5)];
                    dequantize(&wx, r0, &mut part, n, cols + 5, isa).unwrap();
                    for i in 0..n {
                        assert_eq!(part[i * (cols + 5)..i * (cols + 5) + cols], reference[(r0 + i) * cols..(r0 + i + 1) * cols]);
                        if i + 1 < n {
                            assert!(part[i * (cols + 5) + cols..(i + 1) * (cols + 5)].iter().all(|v| v.is_nan()), "wrote past a row");
                        }
                    }
                }
                let ids: Vec<i64> = (0..rows as i64).rev().collect();
                let mut g = vec![0f32; rows * cols];
                gather_rows(&wx, &ids, &mut g, cols, isa).unwrap();
                for (i, &r) in ids.iter().enumerate() {
                    assert_eq!(g[i * cols..(i + 1) * cols], reference[r as usize * cols..(r as usize + 1) * cols]);
                }
            }
        }
    }
    assert!(interleave(QType::Q4_K, &[0u8; 144], 1, 256).is_err());
    assert!(QMatrix::with_layout(QType::Q4_1, true, &[0u8; 7 * 20], 7, 32).is_err()); // needs 8 rows of bytes
}

#[test]
fn interleaved_products_match_and_are_batch_invariant() {
    // every path on interleaved weights (1 token, 2..15, 16+), ragged row counts and
    // strided views: right against f64, equal to rounding to the row layout, and from two
    // tokens on a token's bits do not depend on its batch (one FMA chain in K order over
    // the exact weights in both the tiles and the broadcast path)
    let mut rng = Rng(0xface);
    for q in X8_FORMATS {
        for (rows, cols) in [(5, 64), (29, 576), (70, 1536), (1000, 576)] {
            let data = random_rows(q, rows, cols, &mut rng);
            let x8 = interleave(q, &data, rows, cols).unwrap();
            let (w, wx) = (QMatrix::new(q, &data, rows, cols).unwrap(), QMatrix::with_layout(q, true, &x8, rows, cols).unwrap());
            let wf: Vec<f32> = data.chunks_exact(w.row_bytes()).flat_map(|r| dequantize_ref(q, r)).collect();
            let tokens = 35;
            let (xs, os) = (cols + 3, rows + 5);
            let x: Vec<f32> = (0..tokens * xs).map(|_| rng.unit()).collect();
            let mag = |t: usize, r: usize| -> f64 { (0..cols).map(|k| (wf[r * cols + k] as f64 * x[t * xs + k] as f64).abs()).sum() };
            for isa in isas() {
                let run = |m: &QMatrix, t0: usize, n: usize| {
                    let mut out = vec![f32::NAN; n * os];
                    matmul(m, &x[t0 * xs..], xs, n, &mut out, os, isa).unwrap();
                    for t in 0..n {
                        assert!(out[t * os + rows..(t + 1) * os].iter().all(|v| v.is_nan()), "wrote past a row");
                    }
                    out
                };
                let all = run(&wx, 0, tokens);
                let rows_layout = run(&w, 0, tokens);
                for t in 0..tokens {
                    let reference: Vec<f64> =
                        (0..rows).map(|r| (0..cols).map(|k| wf[r * cols + k] as f64 * x[t * xs + k] as f64).sum()).collect();
                    let e = rel_err(&all[t * os..t * os + rows], &reference);
                    assert!(e <= 1e-5, "{} {isa:?} [{rows}x{cols}] token {t}: rel err {e}", q.name());
                    if isa == Isa::Avx2 {
                        // the same exact weights and FMA chain as the row layout's broadcast path
                        assert_eq!(all[t * os..t * os + rows], rows_layout[t * os..t * os + rows]);
                    }
                }
                for (t0, n) in [(0, 1), (4, 1), (0, 2), (3, 5), (1, 8), (2, 9), (6, 15), (9, 16), (10, 21)] {
                    let part = run(&wx, t0, n);
                    for t in 0..n {
                        for r in 0..rows {
                            let (a, b) = (part[t * os + r], all[(t0 + t) * os + r]);
                            if n == 1 || isa == Isa::Scalar {
                                assert!(((a - b) as f64).abs() <= 1e-6 * mag(t0 + t, r), "{} {isa:?} n={n}: {a} vs {b}", q.name());
                            } else {
                                assert_eq!(a.to_bits(), b.to_bits(), "{} {isa:?} [{rows}x{cols}] tokens {t0}..{}: token {t} row {r}: {a} vs {b}", q.name(), t0 + n);
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn interleaving_in_place_equals_the_copy() {
    let mut rng = Rng(0xbeef);
    for q in X8_FORMATS {
        let (rows, cols) = (24, 64);
        let data = random_rows(q, rows, cols, &mut rng);
        let mut inplace = data.clone();
        interleave_in_place(q, &mut inplace, rows, cols).unwrap();
        assert_eq!(inplace, interleave(q, &data, rows, cols).unwrap());
        assert!(interleave_in_place(q, &mut inplace[..(rows - 1) * q.row_bytes(cols).unwrap()], rows - 1, cols).is_err());
    }
}

#[test]
fn every_path_equals_the_portable_one_bit_for_bit() {
    // every format, rows in file order and (where the format has it) interleaved, every
    // token count that picks a different order (1; 2..5; 6..15; 16+), ragged rows
    let mut rng = Rng(0x1234_5678_9abc_def1);
    if isas().len() < 2 {
        return; // one path on this CPU: nothing to compare
    }
    for q in QType::ALL {
        for (rows, blocks) in [(1, 1), (13, 2), (37, 3), (8, 1)] {
            let cols = blocks * q.block_weights();
            let data = random_rows(q, rows, cols, &mut rng);
            let x8 = if q.interleavable() { Some(interleave(q, &data, rows, cols).unwrap()) } else { None };
            let layouts: Vec<QMatrix> = std::iter::once(QMatrix::new(q, &data, rows, cols).unwrap())
                .chain(x8.as_deref().map(|d| QMatrix::with_layout(q, true, d, rows, cols).unwrap()))
                .collect();
            for w in &layouts {
                for tokens in [1, 2, 3, 5, 6, 9, 12, 15, 16, 17, 33] {
                    let (xs, os) = (cols + 1, rows + 2);
                    let x: Vec<f32> = (0..tokens * xs).map(|_| rng.unit() * 4.0 - 2.0).collect();
                    let outs: Vec<Vec<f32>> = isas().into_iter().map(|isa| {
                        let mut out = vec![f32::NAN; tokens * os];
                        matmul(w, &x, xs, tokens, &mut out, os, isa).unwrap();
                        out
                    }).collect();
                    for (i, (u, v)) in outs[1].iter().zip(&outs[0]).enumerate() {
                        assert!(u.to_bits() == v.to_bits() || (u.is_nan() && v.is_nan()),
                                "{} x8={} [{rows}x{cols}] t={tokens} element {i}: avx2 {u} vs portable {v}",
                                q.name(), w.x8);
                    }
                }
            }
        }
    }
}
