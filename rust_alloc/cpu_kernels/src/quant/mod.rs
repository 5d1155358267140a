//! Matrix products on GGUF-quantized weights, read in their block formats.
//!
//! `W` is `[n, k]` (output rows, input columns), stored row by row as GGML blocks along `k`;
//! `x` is `[t, k]` fp32 activations and `out` is `[t, n]` fp32: `out = x · Wᵀ`, accumulated in
//! fp32. Every block is split into groups of 32 weights that are dequantized inside registers
//! (exactly as `gguf.quants.dequantize` computes them) and multiplied with `t` token rows at
//! once, so a block is read from memory once per call whatever `t` is.
//!
//! Q4_0, Q4_1 and Q8_0 weights may also be *interleaved* (`interleave`): rows in groups of 8,
//! each block of the 8 rows stored together as their 8 scales, (their 8 offsets,) and then
//! the quant bytes byte by byte across the rows (byte `j` of rows 0..8, byte `j + 1` of rows
//! 0..8, ...). Same bytes in all, no extra memory; every 8 consecutive bytes are one weight
//! position of 8 rows, which is what the batched kernels multiply (8 rows side by side in a
//! vector), so they need no byte transposes or scale gathers. `QMatrix::x8` says which layout a matrix is in; all kernels read both.
//!
//! Two code paths give the same bits: AVX2 + FMA + F16C (`avx2.rs`, chosen at run time when
//! the CPU has them) and portable scalar Rust (`scalar.rs`, the same operations in the same
//! order). Work is split over output rows on a small persistent pool (`threads.rs`).

pub(crate) mod formats;
mod scalar;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(test)]
mod tests;

pub use formats::{dequantize_ref, f16_to_f32};

use crate::threads as pool;

use std::fmt;

/// The GGML block formats these kernels read; the discriminant is GGML's type id. F16 and
/// BF16 (one weight per GGML "block") are read here in blocks of 32.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QType {
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    BF16 = 30,
}

impl QType {
    pub const ALL: [QType; 10] = [
        QType::F16, QType::Q4_0, QType::Q4_1, QType::Q5_0, QType::Q5_1, QType::Q8_0, QType::Q4_K, QType::Q5_K,
        QType::Q6_K, QType::BF16,
    ];

    pub fn from_ggml(id: u32) -> Option<QType> {
        QType::ALL.into_iter().find(|q| *q as u32 == id)
    }

    /// Weights per block.
    pub const fn block_weights(self) -> usize {
        match self {
            QType::F16 | QType::BF16 | QType::Q4_0 | QType::Q4_1 | QType::Q5_0 | QType::Q5_1 | QType::Q8_0 => 32,
            QType::Q4_K | QType::Q5_K | QType::Q6_K => 256,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            QType::F16 | QType::BF16 => 64,
            QType::Q4_0 => 18,
            QType::Q4_1 => 20,
            QType::Q5_0 => 22,
            QType::Q5_1 => 24,
            QType::Q8_0 => 34,
            QType::Q4_K => 144,
            QType::Q5_K => 176,
            QType::Q6_K => 210,
        }
    }

    /// Whether the kernels read this format interleaved in groups of 8 rows.
    pub const fn interleavable(self) -> bool { matches!(self, QType::Q4_0 | QType::Q4_1 | QType::Q8_0) }

    /// Where the quant bytes start in an interleaved group of 8 blocks (after the 8 f16
    /// scales, and the 8 f16 offsets of Q4_1).
    pub(crate) const fn x8_codes(self) -> usize { if matches!(self, QType::Q4_1) { 32 } else { 16 } }

    pub fn name(self) -> &'static str {
        match self {
            QType::F16 => "F16",
            QType::Q4_0 => "Q4_0",
            QType::Q4_1 => "Q4_1",
            QType::Q5_0 => "Q5_0",
            QType::Q5_1 => "Q5_1",
            QType::Q8_0 => "Q8_0",
            QType::Q4_K => "Q4_K",
            QType::Q5_K => "Q5_K",
            QType::Q6_K => "Q6_K",
            QType::BF16 => "BF16",
        }
    }

    /// Bytes of one row of `cols` weights (`cols` must be a multiple of the block size).
    pub fn row_bytes(self, cols: usize) -> Result<usize, QuantError> {
        if cols == 0 || cols % self.block_weights() != 0 {
            return Err(QuantError(format!(
                "{}: a row of {cols} weights is not a positive multiple of the block size {}",
                self.name(),
                self.block_weights()
            )));
        }
        Ok(cols / self.block_weights() * self.block_bytes())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantError(pub String);

impl fmt::Display for QuantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result { f.write_str(&self.0) }
}

impl std::error::Error for QuantError {}

fn bad<T>(msg: impl Into<String>) -> Result<T, QuantError> { Err(QuantError(msg.into())) }

pub use crate::isa::Isa;

/// The best path of the exact kernels (AVX2; an AVX-512 CPU runs it too).
pub const TOP: Isa = Isa::Avx2;

/// The path the exact kernels take on this CPU.
pub fn best() -> Isa { Isa::cpu().min(TOP) }

fn checked(isa: Isa) -> Result<Isa, QuantError> { isa.for_kernels(TOP).map_err(QuantError) }

/// Added to a GGML type id (in the Python API) for weights in the interleaved layout.
pub const X8_FLAG: u32 = 0x100;

/// A quantized weight matrix `[rows, cols]` borrowed from GGUF block bytes, row by row or
/// interleaved (`x8`: then `data` holds `rows` rounded up to a multiple of 8).
#[derive(Clone, Copy)]
pub struct QMatrix<'a> {
    pub qtype: QType,
    pub data: &'a [u8],
    pub rows: usize,
    pub cols: usize,
    pub x8: bool,
    row_bytes: usize,
}

impl<'a> QMatrix<'a> {
    pub fn new(qtype: QType, data: &'a [u8], rows: usize, cols: usize) -> Result<Self, QuantError> {
        Self::with_layout(qtype, false, data, rows, cols)
    }

    /// A matrix in either layout; `x8` needs an interleavable format.
    pub fn with_layout(qtype: QType, x8: bool, data: &'a [u8], rows: usize, cols: usize) -> Result<Self, QuantError> {
        let row_bytes = qtype.row_bytes(cols)?;
        if x8 && !qtype.interleavable() {
            return bad(format!("{} weights cannot be interleaved", qtype.name()));
        }
        let stored = if x8 { rows.div_ceil(8) * 8 } else { rows };
        if data.len() != stored * row_bytes {
            return bad(format!(
                "{}{} weight [{rows}, {cols}] needs {} bytes, got {}",
                qtype.name(),
                if x8 { " (interleaved)" } else { "" },
                stored * row_bytes,
                data.len()
            ));
        }
        Ok(QMatrix { qtype, data, rows, cols, x8, row_bytes })
    }

    pub fn row_bytes(&self) -> usize { self.row_bytes }

    /// Interleaved layout: the group of 8 blocks holding block `b` of row `r`.
    #[inline]
    pub(crate) fn x8_group(&self, r: usize, b: usize) -> &'a [u8] {
        let gb = 8 * self.qtype.block_bytes();
        let at = r / 8 * 8 * self.row_bytes + b * gb;
        &self.data[at..at + gb]
    }
}

/// Interleave `rows` rows of GGUF blocks (`data`, row by row) in groups of 8 (see the module
/// docs); a last partial group is padded with zero blocks (weights 0).
pub fn interleave(qtype: QType, data: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>, QuantError> {
    let w = QMatrix::new(qtype, data, rows, cols)?;
    if !qtype.interleavable() {
        return bad(format!("{} weights cannot be interleaved", qtype.name()));
    }
    let rb = w.row_bytes;
    let mut out = vec![0u8; rows.div_ceil(8) * 8 * rb];
    for (g, dst) in out.chunks_exact_mut(8 * rb).enumerate() {
        let n = (rows - 8 * g).min(8);
        interleave_group(qtype, &data[8 * g * rb..(8 * g + n) * rb], rb, dst);
    }
    Ok(out)
}

/// `interleave` in place, for a row count that is a multiple of 8 (a group of 8 rows takes
/// the same bytes in both layouts): no second copy of the weights, even for a moment.
pub fn interleave_in_place(qtype: QType, data: &mut [u8], rows: usize, cols: usize) -> Result<(), QuantError> {
    let rb = QMatrix::new(qtype, data, rows, cols)?.row_bytes;
    if !qtype.interleavable() || rows % 8 != 0 {
        return bad(format!("{} weights of {rows} rows cannot be interleaved in place", qtype.name()));
    }
    let mut tmp = vec![0u8; 8 * rb];
    for group in data.chunks_exact_mut(8 * rb) {
        tmp.copy_from_slice(group);
        interleave_group(qtype, &tmp, rb, group);
    }
    Ok(())
}

/// Rows `src` (up to 8, `rb` bytes each, row by row) into one interleaved group `dst` (8 rows
/// of bytes; lanes past the rows given stay as they are, zero in a fresh buffer).
fn interleave_group(qtype: QType, src: &[u8], rb: usize, dst: &mut [u8]) {
    let bb = qtype.block_bytes();
    let codes = qtype.x8_codes();
    let scales = if qtype == QType::Q4_1 { 2 } else { 1 };
    for (i, row) in src.chunks_exact(rb).enumerate() {
        for (blk, o) in row.chunks_exact(bb).zip(dst.chunks_exact_mut(8 * bb)) {
            for s in 0..scales {
                o[16 * s + 2 * i..16 * s + 2 * i + 2].copy_from_slice(&blk[2 * s..2 * s + 2]);
            }
            for (j, &v) in blk[2 * scales..].iter().enumerate() {
                o[codes + 8 * j + i] = v;
            }
        }
    }
}

/// A raw fp32 matrix view with a row stride (elements); rows are contiguous.
#[derive(Clone, Copy)]
pub(crate) struct Mat {
    pub ptr: *mut f32,
    pub rows: usize,
    pub stride: usize,
}
// SAFETY: a Mat is a view the kernels hand to the pool's threads, which write disjoint parts
// of it while the caller keeps the buffer borrowed until `parallel_for` returns.
unsafe impl Send for Mat {}
// SAFETY: as for Send; shared references only read the pointer and the geometry.
unsafe impl Sync for Mat {}

impl Mat {
    /// Start of row `i` (unchecked).
    #[inline]
    pub unsafe fn row(&self, i: usize) -> *mut f32 { self.ptr.add(i * self.stride) }
}

fn check_view(len: usize, rows: usize, cols: usize, stride: usize, what: &str) -> Result<(), QuantError> {
    if rows == 0 {
        return Ok(());
    }
    if stride < cols && rows > 1 {
        return bad(format!("{what}: row stride {stride} is shorter than a row of {cols}"));
    }
    if len < (rows - 1) * stride + cols {
        return bad(format!("{what}: {len} elements cannot hold [{rows}, {cols}] with row stride {stride}"));
    }
    Ok(())
}

/// Token rows per tile: a block's dequantized weights are reused for this many rows.
pub const MAX_TILE: usize = 12;

/// Products with at least this many tokens take the AVX2 broadcast path, which works on
/// groups of `BCAST_ROWS` weight rows (the pool's row chunks are multiples of it then); fewer
/// take the register tiles, which decode each block once per tile of up to `MAX_TILE`.
pub(crate) const BCAST_MIN_TOKENS: usize = 16;
pub(crate) const BCAST_ROWS: usize = 16;
/// Interleaved weights take the broadcast path from this many tokens, their register tiles
/// below (same bits either way). Decoding them is cheap enough that the panel pays off early:
/// from 6 tokens on it was faster, below slower (bench/RESULTS.md, "Eighth session").
pub(crate) const X8_BCAST_MIN_TOKENS: usize = 6;
/// The same on 16 lanes (AVX-512 F), where the tiles run several row groups at once: they
/// beat the broadcast path up to 8 tokens (bench/RESULTS.md, 2026-12-03, eighth session).
pub(crate) const X8_BCAST_MIN_TOKENS_16: usize = 9;

/// `X8_BCAST_MIN_TOKENS` for this CPU's exact paths.
pub(crate) fn x8_bcast_min_tokens() -> usize {
    if crate::isa::has_avx512f() { X8_BCAST_MIN_TOKENS_16 } else { X8_BCAST_MIN_TOKENS }
}

/// Whether the exact products' tiles for 2 to `x8_bcast_min_tokens() - 1` tokens run several
/// groups of rows at once (about 8 FMA chains in flight: the default) or one at a time (as
/// before; a benchmark alternates them). The same bits either way.
static TILE_GROUPS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// `TILE_GROUPS`: several groups at once (true) or one.
pub fn tile_groups() -> bool {
    TILE_GROUPS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Set `tile_groups` for the process.
pub fn set_tile_groups(many: bool) {
    TILE_GROUPS.store(many, std::sync::atomic::Ordering::Relaxed);
}

/// `out[t, r] = sum_k x[t, k] * W[r, k]` for `t < tokens`, `r < w.rows`.
///
/// `x` holds `tokens` rows of `w.cols` values, row `t` at `x[t * x_stride..]`; `out` holds
/// `tokens` rows of `w.rows` values at `out[t * out_stride..]`. Runs on the pool.
pub fn matmul(
    w: &QMatrix, x: &[f32], x_stride: usize, tokens: usize, out: &mut [f32], out_stride: usize, isa: Isa,
) -> Result<(), QuantError> {
    matmul_stacked(std::slice::from_ref(w), x, x_stride, tokens, out, out_stride, isa)
}

/// `matmul` of matrices stacked along the output (a fused QKV or gate/up whose parts are
/// separate GGUF tensors): part `i` writes the columns after those of parts `0..i`. One
/// call on the pool for all parts.
pub fn matmul_stacked(
    ws: &[QMatrix], x: &[f32], x_stride: usize, tokens: usize, out: &mut [f32], out_stride: usize, isa: Isa,
) -> Result<(), QuantError> {
    let isa = checked(isa)?;
    let Some(cols) = ws.first().map(|w| w.cols) else { return Ok(()) };
    if ws.iter().any(|w| w.cols != cols) {
        return bad("stacked matrices must have the same number of columns");
    }
    let rows: usize = ws.iter().map(|w| w.rows).sum();
    check_view(x.len(), tokens, cols, x_stride, "x")?;
    check_view(out.len(), tokens, rows, out_stride, "out")?;
    if tokens == 0 || rows == 0 {
        return Ok(());
    }
    let xm = Mat { ptr: x.as_ptr() as *mut f32, rows: tokens, stride: x_stride };
    // Chunks of output rows, taken in turn by the pool's threads. One token streams each row
    // once from memory, and longer runs of rows stream better: two equal chunks per thread.
    // More tokens are compute-bound: guided chunks, each 1 / (2 x threads) of the rows not
    // yet handed out (in whole groups of the kernel's rows), so the last ones are small and
    // the threads finish together (bench/RESULTS.md, "Seventh session").
    let work = rows * cols * tokens;
    let threads = if work < 1 << 16 { 1 } else { pool::num_threads() };
    // (interleaved matrices: whole groups of 8 rows per chunk)
    let x8 = ws.iter().any(|w| w.x8);
    let group = if tokens >= BCAST_MIN_TOKENS || (x8 && tokens >= x8_bcast_min_tokens()) {
        BCAST_ROWS
    } else if x8 {
        8
    } else {
        4
    };
    // (part, first row, end row, first output column), chunks inside each part
    let mut chunks = Vec::with_capacity(ws.len() + 16 * threads);
    let mut off = 0;
    for (i, w) in ws.iter().enumerate().filter(|(_, w)| w.rows > 0) {
        let mut r0 = 0;
        if threads == 1 {
            chunks.push((i, 0, w.rows, off));
        } else if tokens == 1 {
            let n = (2 * threads * w.rows).div_ceil(rows).min(w.rows.div_ceil(16)).max(1);
            let groups = w.rows.div_ceil(group);
            for j in 0..n {
                let r1 = (r0 + (groups / n + usize::from(j < groups % n)) * group).min(w.rows);
                chunks.push((i, r0, r1, off));
                r0 = r1;
            }
        } else {
            let mut left = w.rows.div_ceil(group);
            while left > 0 {
                let g = left.div_ceil(2 * threads);
                let r1 = (r0 + g * group).min(w.rows);
                chunks.push((i, r0, r1, off));
                r0 = r1;
                left -= g;
            }
        }
        off += w.rows;
    }
    let om = &Mat { ptr: out.as_mut_ptr(), rows: tokens, stride: out_stride };
    let run = |c: usize| {
        let (i, r0, r1, off) = chunks[c];
        // SAFETY: views were checked above (part i's columns lie inside out's rows); chunks
        // write disjoint columns of `out`.
        unsafe { rows_kernel(isa, &ws[i], xm, Mat { ptr: om.ptr.add(off), ..*om }, r0, r1) }
    };
    if threads == 1 {
        (0..chunks.len()).for_each(run);
    } else {
        pool::parallel_for(chunks.len(), &run);
    }
    Ok(())
}

unsafe fn rows_kernel(isa: Isa, w: &QMatrix, x: Mat, out: Mat, r0: usize, r1: usize) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::matmul_rows(w, x, out, r0, r1),
        _ => scalar::matmul_rows(w, x, out, r0, r1),
    }
}

/// Dequantize rows `row_start .. row_start + out_rows` of `w` into `out` (row stride
/// `out_stride`), in parallel over rows.
pub fn dequantize(
    w: &QMatrix, row_start: usize, out: &mut [f32], out_rows: usize, out_stride: usize, isa: Isa,
) -> Result<(), QuantError> {
    let isa = checked(isa)?;
    if row_start + out_rows > w.rows {
        return bad(format!("rows {row_start}..{} out of range for {} rows", row_start + out_rows, w.rows));
    }
    check_view(out.len(), out_rows, w.cols, out_stride, "out")?;
    if out_rows == 0 {
        return Ok(());
    }
    let om = Mat { ptr: out.as_mut_ptr(), rows: out_rows, stride: out_stride };
    let threads = if out_rows * w.cols < 1 << 16 { 1 } else { pool::num_threads() };
    #[cfg(target_arch = "x86_64")]
    if w.x8 && isa == Isa::Avx2 {
        // whole groups of 8 rows, decoded together; rows outside the range go to a scratch row
        let (g0, g1) = (row_start / 8, (row_start + out_rows).div_ceil(8));
        let per = (g1 - g0).div_ceil(threads * 4).max(1);
        pool::parallel_for((g1 - g0).div_ceil(per), &|c| {
            let mut spare = vec![0f32; w.cols];
            for g in g0 + c * per..(g0 + (c + 1) * per).min(g1) {
                let dst: [*mut f32; 8] = std::array::from_fn(|i| {
                    let r = 8 * g + i;
                    if r >= row_start && r < row_start + out_rows {
                        // SAFETY: row r - row_start of the checked view
                        unsafe { om.row(r - row_start) }
                    } else {
                        spare.as_mut_ptr()
                    }
                });
                // SAFETY: group g lies inside the matrix; every pointer has room for a row;
                // chunks write disjoint rows.
                unsafe { avx2::dequant_group_x8(w, g, &dst) }
            }
        });
        return Ok(());
    }
    let per = out_rows.div_ceil(threads * 4).max(4);
    let chunks = out_rows.div_ceil(per);
    pool::parallel_for(chunks, &|c| {
        let (a, b) = (c * per, ((c + 1) * per).min(out_rows));
        for i in a..b {
            // SAFETY: row i of the checked view; chunks are disjoint.
            unsafe { dequant_row(isa, w, row_start + i, om.row(i)) }
        }
    });
    Ok(())
}

/// Dequantize the listed rows of `w` (an embedding gather) into `out` row by row.
pub fn gather_rows(w: &QMatrix, rows: &[i64], out: &mut [f32], out_stride: usize, isa: Isa) -> Result<(), QuantError> {
    let isa = checked(isa)?;
    check_view(out.len(), rows.len(), w.cols, out_stride, "out")?;
    if let Some(&r) = rows.iter().find(|&&r| r < 0 || r as usize >= w.rows) {
        return bad(format!("row {r} out of range for {} rows", w.rows));
    }
    let om = Mat { ptr: out.as_mut_ptr(), rows: rows.len(), stride: out_stride };
    let per = if rows.len() * w.cols < 1 << 16 { rows.len().max(1) } else { 64 };
    pool::parallel_for(rows.len().div_ceil(per), &|c| {
        for i in c * per..((c + 1) * per).min(rows.len()) {
            // SAFETY: indices checked above; chunks are disjoint.
            unsafe { dequant_row(isa, w, rows[i] as usize, om.row(i)) }
        }
    });
    Ok(())
}

unsafe fn dequant_row(isa: Isa, w: &QMatrix, r: usize, out: *mut f32) {
    if w.x8 {
        return scalar::dequant_row_x8(w, r, out);
    }
    let row = &w.data[r * w.row_bytes..(r + 1) * w.row_bytes];
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::dequant_row(w.qtype, row, out),
        _ => scalar::dequant_row(w.qtype, row, out),
    }
}
