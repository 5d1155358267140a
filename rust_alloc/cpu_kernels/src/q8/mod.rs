//! Integer products: quantized weights repacked for 8-bit dot products, activations
//! quantized to int8 per block of 32, as llama.cpp computes them.
//!
//! **Weights** (`repack`): rows in groups of 16, the layout 512-bit `vpdpbusd` wants: one
//! 64-byte vector holds 4 consecutive codes of each of the 16 rows (row `r` in bytes
//! `4r .. 4r + 4`), so one instruction multiplies 16 rows by 4 activations. Every weight is
//! `w = a·q + b` with an unsigned code `q` and, per row and group of 32 (16 for Q6_K),
//! a scale `a` and an offset `b` from the format (Q4_0: `a = d`, `b = −8d`; Q4_K:
//! `a = d·sc`, `b = −dmin·m`; Q8_0 stores `q = s + 128`, `b = −128d`). Per group of 32 and
//! 16 rows the layout holds the codes (4 bits: 4 vectors, chunk `c` in the low nibbles and
//! chunk `c + 4` in the high ones; 5 bits: plus one vector of high bits, bit `c` of byte
//! `4r + i`; 6 bits: plus two vectors of 2-bit highs; Q8_0: 8 vectors) and the group's
//! scales; K-quants add per superblock of 256 the rows' `d` (and `dmin`). The same bytes
//! per weight as the file (K-quants 2-3% more: their 6-bit scales are kept as bytes).
//!
//! **Activations** (`quantize`): per token and block of 32, `dx = max|x| / 127`,
//! `qx = round(x / dx)` (int8), and `dxs = dx · Σ qx`. For K-quant
//! weights (`quantize_for`) `dx` is one per superblock of 256 (`max|x|` over the 256: llama.cpp's
//! q8_K), so a superblock's 8 groups share it.
//!
//! **Product**: per row `r`, token `t` and group `g`, the integer dot `I = Σ q·qx` (exact),
//! then `acc ← fma(a·I, dx, acc)`, `acc ← fma(b, dxs, acc)`, groups in order. K-quants take
//! `dx` out of the superblock's sum: `S ← fma(a, I, S)`, `S ← fma(b, Σ qx, S)` over its groups
//! (Q6_K: `S ← fma(a, I − 32 Σ qx, S)` per half of 16, in integers up to the last step), then
//! `acc ← fma(S, dx, acc)`: per group and token one multiply fewer and one float operand
//! less than the groups' own scales would take. Every code
//! path (portable, AVX2, AVX-512 VNNI) computes the same integers and the same float
//! operations in the same order: their results are equal to the bit.

pub(crate) mod scalar;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
#[cfg(test)]
mod tests;

use crate::quant::formats::{half, q4k_scale_min};
use crate::quant::{QType, QuantError};
use crate::threads::{num_threads, parallel_for};

/// Rows per group of the layout (the lanes of a 512-bit register of i32).
pub const ROWS: usize = 16;

/// Groups of 32 activations that share one scale in products with K-quant weights: a
/// superblock's 8 (llama.cpp's q8_K). Measured against 4 and 1 (bench/RESULTS.md): 4 kept
/// less than half of the speed; 8 makes llama.cpp's error (a K-quant file's perplexity +0.5 %
/// against the exact math where llama.cpp's is +0.6 %; per 32: −0.1 %).
pub const ACT_GROUPS: usize = 8;

// the prefetch distance is a process-wide kernel setting, kept with the others in isa.rs
pub use crate::isa::{decode_prefetch, set_decode_prefetch};

/// Ask for the `n` bytes from `p` (cache lines of 64 bytes). A prefetch never faults: `p` may
/// lie past the matrix (the last row groups' reads ahead), so it is never dereferenced.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch(p: *const u8, n: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    for off in (0..n).step_by(64) {
        // SAFETY: PREFETCHT0 reads nothing architecturally and never faults, at any address
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(off) as *const i8) };
    }
}

fn bad<T>(msg: impl Into<String>) -> Result<T, QuantError> { Err(QuantError(msg.into())) }

pub use crate::isa::Isa;

/// The best path of the integer kernels.
pub const TOP: Isa = Isa::Avx512Vnni;

/// The path the integer kernels take on this CPU.
pub fn best() -> Isa { Isa::cpu().min(TOP) }

fn checked(isa: Isa) -> Result<Isa, QuantError> { isa.for_kernels(TOP).map_err(QuantError) }

/// How a format's codes are stored per group of 32 and 16 rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Codes {
    /// 4 vectors of nibbles
    Four,
    /// nibbles + one vector of high bits
    Five,
    /// nibbles + two vectors of 2-bit highs
    Six,
    /// 8 vectors of bytes
    Eight,
}

/// The repacked layout of one matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub qtype: QType,
    pub rows: usize,
    pub cols: usize,
}

impl Layout {
    pub fn new(qtype: QType, rows: usize, cols: usize) -> Result<Layout, QuantError> {
        if !supports(qtype) {
            return bad(format!("{} weights have no integer kernels", qtype.name()));
        }
        qtype.row_bytes(cols)?;
        Ok(Layout { qtype, rows, cols })
    }

    #[inline]
    pub(crate) fn codes(&self) -> Codes {
        match self.qtype {
            QType::Q4_0 | QType::Q4_1 | QType::Q4_K => Codes::Four,
            QType::Q5_0 | QType::Q5_1 | QType::Q5_K => Codes::Five,
            QType::Q6_K => Codes::Six,
            _ => Codes::Eight,
        }
    }

    /// Bytes of the codes of one group of 32 (16 rows).
    #[inline]
    pub(crate) fn code_bytes(&self) -> usize {
        match self.codes() {
            Codes::Four => 256,
            Codes::Five => 320,
            Codes::Six => 384,
            Codes::Eight => 512,
        }
    }

    /// Bytes of one group's scales (16 rows), after its codes.
    #[inline]
    pub(crate) fn scale_bytes(&self) -> usize {
        match self.qtype {
            QType::Q4_1 | QType::Q5_1 => 64,   // d, m: f16 each
            _ => 32,                           // d f16; K-quants: sc, m (or two sc) as bytes
        }
    }

    /// Groups of 32 per superblock (K-quants: 8, with a header of the rows' d (and dmin)).
    #[inline]
    pub(crate) fn sb_groups(&self) -> usize { if self.kquant() { 8 } else { 1 } }

    /// Groups of 32 whose activations share one scale: `ACT_GROUPS` for K-quants, else 1.
    #[inline]
    pub(crate) fn act_groups(&self) -> usize { if self.kquant() { ACT_GROUPS } else { 1 } }

    #[inline]
    pub(crate) fn kquant(&self) -> bool { matches!(self.qtype, QType::Q4_K | QType::Q5_K | QType::Q6_K) }

    #[inline]
    pub(crate) fn header_bytes(&self) -> usize {
        match self.qtype {
            QType::Q4_K | QType::Q5_K => 64,   // d[16], dmin[16] f16
            QType::Q6_K => 32,                  // d[16] f16
            _ => 0,
        }
    }

    #[inline]
    pub(crate) fn group_bytes(&self) -> usize { self.code_bytes() + self.scale_bytes() }

    #[inline]
    pub(crate) fn sb_bytes(&self) -> usize { self.header_bytes() + self.sb_groups() * self.group_bytes() }

    #[inline]
    pub fn groups(&self) -> usize { self.cols / 32 }

    #[inline]
    pub fn row_groups(&self) -> usize { self.rows.div_ceil(ROWS) }

    /// Bytes of one group of 16 rows over the whole row.
    #[inline]
    pub fn rg_bytes(&self) -> usize { self.groups() / self.sb_groups() * self.sb_bytes() }

    pub fn bytes(&self) -> usize { self.row_groups() * self.rg_bytes() }

    /// Offset of group `g` (its codes) inside a row group, and of its superblock's header.
    #[inline]
    pub(crate) fn group_at(&self, g: usize) -> (usize, usize) {
        let (sb, j) = (g / self.sb_groups(), g % self.sb_groups());
        let h = sb * self.sb_bytes();
        (h + self.header_bytes() + j * self.group_bytes(), h)
    }
}

/// The format a kernel was built for (its GGUF type id, `Q`).
#[inline(always)]
pub(crate) const fn qt(q: u8) -> QType {
    match q {
        2 => QType::Q4_0,
        3 => QType::Q4_1,
        6 => QType::Q5_0,
        7 => QType::Q5_1,
        8 => QType::Q8_0,
        12 => QType::Q4_K,
        13 => QType::Q5_K,
        _ => QType::Q6_K,
    }
}

/// Whether a format has integer kernels (every block format; not F16 / BF16).
pub fn supports(q: QType) -> bool { !matches!(q, QType::F16 | QType::BF16) }

/// A repacked matrix borrowed from its bytes.
#[derive(Clone, Copy)]
pub struct RMatrix<'a> {
    pub layout: Layout,
    pub data: &'a [u8],
}

impl<'a> RMatrix<'a> {
    pub fn new(layout: Layout, data: &'a [u8]) -> Result<Self, QuantError> {
        if data.len() != layout.bytes() {
            return bad(format!("a repacked {} [{}, {}] needs {} bytes, got {}", layout.qtype.name(), layout.rows,
                               layout.cols, layout.bytes(), data.len()));
        }
        Ok(RMatrix { layout, data })
    }

    #[inline]
    pub(crate) fn rg(&self, i: usize) -> &'a [u8] {
        let n = self.layout.rg_bytes();
        &self.data[i * n..(i + 1) * n]
    }
}

// ------------------------------------------------------------------ repacking

/// The 32 codes of group `g` of a GGUF block and (a, b) or, for Q6_K, the two scales.
struct GroupCodes {
    q: [u8; 32],
}

fn u32le(b: &[u8], at: usize) -> u32 { u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) }

/// Codes of group `g` (0 .. block_weights / 32) of GGUF block `blk`, unsigned.
fn group_codes(q: QType, blk: &[u8], g: usize) -> GroupCodes {
    let mut c = [0u8; 32];
    match q {
        QType::Q4_0 | QType::Q4_1 => {
            let at = if q == QType::Q4_0 { 2 } else { 4 };
            for i in 0..16 {
                c[i] = blk[at + i] & 15;
                c[i + 16] = blk[at + i] >> 4;
            }
        }
        QType::Q5_0 | QType::Q5_1 => {
            let at = if q == QType::Q5_0 { 2 } else { 4 };
            let qh = u32le(blk, at);
            for i in 0..16 {
                c[i] = (blk[at + 4 + i] & 15) | (((qh >> i) & 1) << 4) as u8;
                c[i + 16] = (blk[at + 4 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4) as u8;
            }
        }
        QType::Q8_0 => {
            for i in 0..32 {
                c[i] = blk[2 + i] ^ 0x80;   // s8 + 128
            }
        }
        QType::Q4_K => {
            // 8 codes at a time: the nibble of 8 bytes (the bulk of a Q4_K_M file's load)
            let qs = &blk[16 + 32 * (g / 2)..16 + 32 * (g / 2) + 32];
            let shift = 4 * (g % 2) as u32;
            for (o, x) in c.chunks_exact_mut(8).zip(qs.chunks_exact(8)) {
                let v = u64::from_le_bytes(x.try_into().expect("8 bytes"));
                o.copy_from_slice(&((v >> shift) & 0x0f0f_0f0f_0f0f_0f0f).to_le_bytes());
            }
        }
        QType::Q5_K => {
            let qs = &blk[48 + 32 * (g / 2)..];
            for i in 0..32 {
                c[i] = ((qs[i] >> (4 * (g % 2))) & 15) | (((blk[16 + i] >> g) & 1) << 4);
            }
        }
        QType::Q6_K => {
            // 8 codes at a time, as Q4_K's
            let (h, j) = (g / 4, g % 4);
            let ql = &blk[64 * h + 32 * (j % 2)..64 * h + 32 * (j % 2) + 32];
            let qh = &blk[128 + 32 * h..128 + 32 * h + 32];
            let (s0, s1) = (4 * (j / 2) as u32, 2 * j as u32);
            for ((o, l), hb) in c.chunks_exact_mut(8).zip(ql.chunks_exact(8)).zip(qh.chunks_exact(8)) {
                let (l, hb) = (u64::from_le_bytes(l.try_into().expect("8")), u64::from_le_bytes(hb.try_into().expect("8")));
                let v = ((l >> s0) & 0x0f0f_0f0f_0f0f_0f0f) | (((hb >> s1) & 0x0303_0303_0303_0303) << 4);
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        QType::F16 | QType::BF16 => unreachable!(),
    }
    GroupCodes { q: c }
}

/// Repack `rows` rows of GGUF blocks (`data`, row by row) into the layout above; rows past
/// `rows` up to a multiple of 16 are zero (codes and scales: they add nothing).
pub fn repack(q: QType, data: &[u8], rows: usize, cols: usize) -> Result<Vec<u8>, QuantError> {
    let l = Layout::new(q, rows, cols)?;
    let rb = q.row_bytes(cols)?;
    if data.len() != rows * rb {
        return bad(format!("{} [{rows}, {cols}] needs {} bytes, got {}", q.name(), rows * rb, data.len()));
    }
    let mut out = vec![0u8; l.bytes()];
    let n = l.row_groups();
    let dst = Bytes(out.as_mut_ptr());
    let one = |rgi: usize| {
        let dst = dst.get();
        // SAFETY: row group rgi owns bytes rgi * rg_bytes .. (rgi + 1) * rg_bytes of `out`,
        // which outlives the calls; no two calls share a row group.
        let rg = unsafe { std::slice::from_raw_parts_mut(dst.0.add(rgi * l.rg_bytes()), l.rg_bytes()) };
        repack_rows(&l, data, rb, rgi, rg);
    };
    if rows * cols >= 1 << 20 {
        parallel_for(n, &one);
    } else {
        (0..n).for_each(one);
    }
    Ok(out)
}

/// `repack` of the rows of several parts stacked (a fused Q/K/V or gate/up weight), read
/// where they lie: no stacked copy is made first. Every part but the last holds whole row
/// groups (a multiple of 16 rows), so a row group never straddles two parts; the result is
/// `repack` of the stacked rows, byte for byte.
pub fn repack_parts(q: QType, parts: &[&[u8]], part_rows: &[usize], cols: usize) -> Result<Vec<u8>, QuantError> {
    if parts.len() != part_rows.len() || parts.is_empty() {
        return bad(format!("{} parts but {} row counts", parts.len(), part_rows.len()));
    }
    let rb = q.row_bytes(cols)?;
    let mut first_group = Vec::with_capacity(parts.len() + 1);
    let mut groups = 0usize;
    for (i, (p, &r)) in parts.iter().zip(part_rows).enumerate() {
        if p.len() != r * rb {
            return bad(format!("part {i}: {} [{r}, {cols}] needs {} bytes, got {}", q.name(), r * rb, p.len()));
        }
        if i + 1 < parts.len() && r % ROWS != 0 {
            return bad(format!("part {i} has {r} rows: every part but the last needs a multiple of {ROWS}"));
        }
        first_group.push(groups);
        groups += r.div_ceil(ROWS);
    }
    first_group.push(groups);
    let rows: usize = part_rows.iter().sum();
    let l = Layout::new(q, rows, cols)?;
    let layouts = part_rows.iter().map(|&r| Layout::new(q, r, cols)).collect::<Result<Vec<_>, _>>()?;
    let mut out = vec![0u8; l.bytes()];
    let dst = Bytes(out.as_mut_ptr());
    let one = |rgi: usize| {
        let dst = dst.get();
        let p = first_group.partition_point(|&g| g <= rgi) - 1;
        // SAFETY: row group rgi owns bytes rgi * rg_bytes .. (rgi + 1) * rg_bytes of `out`
        // (every part's row groups have the whole's size: it depends on the format and the
        // columns only), which outlives the calls; no two calls share a row group.
        let rg = unsafe { std::slice::from_raw_parts_mut(dst.0.add(rgi * l.rg_bytes()), l.rg_bytes()) };
        repack_rows(&layouts[p], parts[p], rb, rgi - first_group[p], rg);
    };
    if rows * cols >= 1 << 20 {
        parallel_for(l.row_groups(), &one);
    } else {
        (0..l.row_groups()).for_each(one);
    }
    Ok(out)
}

/// A byte pointer the pool's threads write disjoint parts of.
#[derive(Clone, Copy)]
struct Bytes(*mut u8);
// SAFETY: the threads write disjoint row groups of a buffer the caller keeps alive until
// `parallel_for` returns.
unsafe impl Send for Bytes {}
// SAFETY: as for Send.
unsafe impl Sync for Bytes {}

impl Bytes {
    /// A copy (so a closure captures the whole, Sync, value).
    fn get(&self) -> Bytes { *self }
}

/// Row group `rgi` of GGUF rows `data` (`rb` bytes a row) into `rg`.
fn repack_rows(l: &Layout, data: &[u8], rb: usize, rgi: usize, rg: &mut [u8]) {
    let q = l.qtype;
    let (bw, bb) = (q.block_weights(), q.block_bytes());
    let gpb = bw / 32; // groups per GGUF block
    let nr = (l.rows - rgi * ROWS).min(ROWS);
    let blk = |r: usize, g: usize| {
        let row = &data[(rgi * ROWS + r) * rb..(rgi * ROWS + r + 1) * rb];
        &row[g / gpb * bb..(g / gpb + 1) * bb]
    };
    for g in 0..l.groups() {
        let (at, head) = l.group_at(g);
        if l.kquant() && g % 8 == 0 {
            for r in 0..nr {
                let b = blk(r, g);
                match q {
                    QType::Q6_K => rg[head + 2 * r..head + 2 * r + 2].copy_from_slice(&b[208..210]),
                    _ => {
                        rg[head + 2 * r..head + 2 * r + 2].copy_from_slice(&b[0..2]);
                        rg[head + 32 + 2 * r..head + 32 + 2 * r + 2].copy_from_slice(&b[2..4]);
                    }
                }
            }
        }
        let mut codes = [[0u8; 32]; ROWS];
        for (r, c) in codes.iter_mut().enumerate().take(nr) {
            *c = group_codes(q, blk(r, g), g % gpb).q;
        }
        let (cb, sc) = (&mut rg[at..at + l.code_bytes()], at + l.code_bytes());
        write_codes(l.codes(), &codes, cb);
        for r in 0..nr {
            let b = blk(r, g);
            let j = g % gpb;
            let s = &mut rg[sc..sc + l.scale_bytes()];
            match q {
                QType::Q4_0 | QType::Q5_0 | QType::Q8_0 => s[2 * r..2 * r + 2].copy_from_slice(&b[0..2]),
                QType::Q4_1 | QType::Q5_1 => {
                    s[2 * r..2 * r + 2].copy_from_slice(&b[0..2]);
                    s[32 + 2 * r..32 + 2 * r + 2].copy_from_slice(&b[2..4]);
                }
                QType::Q4_K | QType::Q5_K => {
                    let (scale, min) = q4k_scale_min(&b[4..16], j);
                    s[r] = scale;
                    s[16 + r] = min;
                }
                QType::Q6_K => {
                    s[r] = b[192 + 2 * j];
                    s[16 + r] = b[192 + 2 * j + 1];
                }
                QType::F16 | QType::BF16 => unreachable!(),
            }
        }
    }
}

/// The codes of 16 rows × 32 into their vectors: byte `4r + i` of chunk `c` is row `r`'s
/// code `4c + i`.
fn write_codes(kind: Codes, codes: &[[u8; 32]; ROWS], out: &mut [u8]) {
    if matches!(kind, Codes::Four | Codes::Six) {
        // 4 codes (one row, i = 0..4) at a time, as the loop below writes them: byte 4r + i of
        // chunk c holds code 4c + i's low nibble and code 4c + 16 + i's; Q6_K's 2-bit highs of
        // codes 4c + i (c < 4) go to byte 4r + i at 256, those of 4c + 16 + i at 320
        let word = |r: usize, k: usize| u32::from_le_bytes(codes[r][k..k + 4].try_into().expect("4 bytes"));
        for r in 0..ROWS {
            let (mut h0, mut h1) = (0u32, 0u32);
            for c in 0..4 {
                let (lo, hi) = (word(r, 4 * c), word(r, 4 * c + 16));
                let v = (lo & 0x0f0f_0f0f) | ((hi & 0x0f0f_0f0f) << 4);
                out[64 * c + 4 * r..64 * c + 4 * r + 4].copy_from_slice(&v.to_le_bytes());
                h0 |= ((lo >> 4) & 0x0303_0303) << (2 * c);
                h1 |= ((hi >> 4) & 0x0303_0303) << (2 * c);
            }
            if kind == Codes::Six {
                out[256 + 4 * r..256 + 4 * r + 4].copy_from_slice(&h0.to_le_bytes());
                out[320 + 4 * r..320 + 4 * r + 4].copy_from_slice(&h1.to_le_bytes());
            }
        }
        return;
    }
    let at = |c: usize, r: usize, i: usize| codes[r][4 * c + i];
    for r in 0..ROWS {
        for i in 0..4 {
            let b = 4 * r + i;
            match kind {
                Codes::Eight => {
                    for c in 0..8 {
                        out[64 * c + b] = at(c, r, i);
                    }
                }
                _ => {
                    for c in 0..4 {
                        out[64 * c + b] = (at(c, r, i) & 15) | ((at(c + 4, r, i) & 15) << 4);
                    }
                    if kind == Codes::Five {
                        out[256 + b] = (0..8).fold(0u8, |h, c| h | (((at(c, r, i) >> 4) & 1) << c));
                    }
                    if kind == Codes::Six {
                        out[256 + b] = (0..4).fold(0u8, |h, c| h | (((at(c, r, i) >> 4) & 3) << (2 * c)));
                        out[320 + b] = (0..4).fold(0u8, |h, c| h | (((at(c + 4, r, i) >> 4) & 3) << (2 * c)));
                    }
                }
            }
        }
    }
}

/// Code `k` (0..32) of row `r` (0..16) from a group's code bytes.
#[inline]
pub(crate) fn code_at(kind: Codes, cb: &[u8], r: usize, k: usize) -> u8 {
    let (c, i) = (k / 4, k % 4);
    let b = 4 * r + i;
    match kind {
        Codes::Eight => cb[64 * c + b],
        _ => {
            let lo = if c < 4 { cb[64 * c + b] & 15 } else { cb[64 * (c - 4) + b] >> 4 };
            match kind {
                Codes::Five => lo | (((cb[256 + b] >> c) & 1) << 4),
                Codes::Six => lo | (((cb[256 + 64 * (c / 4) + b] >> (2 * (c % 4))) & 3) << 4),
                _ => lo,
            }
        }
    }
}

/// Per row of a group: the scale `a` and offset `b` of each of its halves of 16 (the same
/// for both halves except Q6_K), computed as every kernel computes them.
#[inline]
pub(crate) fn group_ab(l: &Layout, rg: &[u8], g: usize, r: usize) -> [(f32, f32); 2] {
    let (at, head) = l.group_at(g);
    let s = &rg[at + l.code_bytes()..];
    match l.qtype {
        QType::Q4_0 | QType::Q5_0 | QType::Q8_0 => {
            let d = half(s, 2 * r);
            let z = match l.qtype { QType::Q4_0 => -8.0, QType::Q5_0 => -16.0, _ => -128.0 };
            [(d, d * z); 2]
        }
        QType::Q4_1 | QType::Q5_1 => [(half(s, 2 * r), half(s, 32 + 2 * r)); 2],
        QType::Q4_K | QType::Q5_K => {
            let (d, dmin) = (half(rg, head + 2 * r), half(rg, head + 32 + 2 * r));
            let (a, b) = (d * s[r] as f32, -(dmin * s[16 + r] as f32));
            [(a, b); 2]
        }
        QType::Q6_K => {
            let d = half(rg, head + 2 * r);
            let (a0, a1) = (d * (s[r] as i8) as f32, d * (s[16 + r] as i8) as f32);
            [(a0, a0 * -32.0), (a1, a1 * -32.0)]
        }
        QType::F16 | QType::BF16 => unreachable!(),
    }
}

/// Row `r` of a repacked matrix as fp32, each weight exactly as `gguf.quants.dequantize`
/// computes it (its formula per format, not `a·q + b`).
pub fn dequantize_row(m: &RMatrix, r: usize, out: &mut [f32]) {
    let l = &m.layout;
    let rg = m.rg(r / ROWS);
    let rr = r % ROWS;
    let kind = l.codes();
    for g in 0..l.groups() {
        let (at, head) = l.group_at(g);
        let cb = &rg[at..at + l.code_bytes()];
        let s = &rg[at + l.code_bytes()..];
        for k in 0..32 {
            let q = code_at(kind, cb, rr, k) as i32;
            out[32 * g + k] = match l.qtype {
                QType::Q4_0 => half(s, 2 * rr) * (q - 8) as f32,
                QType::Q5_0 => half(s, 2 * rr) * (q - 16) as f32,
                QType::Q8_0 => half(s, 2 * rr) * (q - 128) as f32,
                QType::Q4_1 | QType::Q5_1 => half(s, 2 * rr) * q as f32 + half(s, 32 + 2 * rr),
                QType::Q4_K | QType::Q5_K => {
                    let (d, dmin) = (half(rg, head + 2 * rr), half(rg, head + 32 + 2 * rr));
                    d * s[rr] as f32 * q as f32 - dmin * s[16 + rr] as f32
                }
                QType::Q6_K => {
                    let sc = s[16 * (k / 16) + rr] as i8;
                    half(rg, head + 2 * rr) * sc as f32 * (q - 32) as f32
                }
                QType::F16 | QType::BF16 => unreachable!(),
            };
        }
    }
}

// ------------------------------------------------------------------ activations

/// Tokens per tile of the activations' layout.
pub const TILE: usize = 8;

/// Token rows quantized to int8 per block of 32, laid out in tiles of `TILE` tokens: the
/// blocks of a tile's tokens for one group of 32 columns are adjacent (`at`), so a kernel
/// walks every token of a tile from one pointer. A last tile of fewer tokens is padded.
pub struct QAct {
    pub tokens: usize,
    pub cols: usize,
    /// the codes: block `i = at(t, g)` at `q[32 i .. 32 i + 32]`
    pub q: Vec<i8>,
    /// the block's scale, at `d[i]`
    pub d: Vec<f32>,
    /// scale · Σ codes of the block, at `ds[i]`
    pub ds: Vec<f32>,
    /// Σ codes of the block (the AVX2 path's Q8_0 correction), at `s[i]`
    pub s: Vec<i32>,
    /// quantized for K-quant weights: one scale per superblock of 8 blocks (`d[i]` the same
    /// for the 8), the sums below filled
    pub sb: bool,
    /// Σ codes of the block as a float (exact), at `sf[i]`
    pub sf: Vec<f32>,
    /// 32 · Σ codes of each half block (Q6_K's offset), at `k16[2 i]`, `k16[2 i + 1]`
    pub k16: Vec<i32>,
}

impl QAct {
    pub fn new() -> Self {
        QAct { tokens: 0, cols: 0, q: vec![], d: vec![], ds: vec![], s: vec![], sb: false, sf: vec![], k16: vec![] }
    }

    /// Groups of 32 per token.
    #[inline]
    pub fn groups(&self) -> usize { self.cols / 32 }

    /// The index of token `t`'s block of group `g`.
    #[inline]
    pub fn at(&self, t: usize, g: usize) -> usize { ((t / TILE) * self.groups() + g) * TILE + t % TILE }
}

impl Default for QAct {
    fn default() -> Self { Self::new() }
}

/// The largest |x| of `xs` (a multiple of 32 values): the activations' scale is this / 127.
pub(crate) fn amax_scalar(xs: &[f32]) -> f32 { xs.iter().fold(0f32, |m, v| m.max(v.abs())) }

/// One block of 32 activations to int8 codes `round(x · inv)` (ties to even) within ±127,
/// `inv` = 1 / the scale (0 for a zero scale); returns the sums of the codes of each half.
/// Every path computes these same integers.
pub(crate) fn codes_scalar(xs: &[f32], q: &mut [i8], inv: f32) -> (i32, i32) {
    let (mut s0, mut s1) = (0i32, 0i32);
    for (k, (q, v)) in q[..32].iter_mut().zip(xs).enumerate() {
        *q = ((v * inv).round_ties_even() as i32).clamp(-127, 127) as i8;
        if k < 16 { s0 += *q as i32 } else { s1 += *q as i32 }
    }
    (s0, s1)
}

/// Raw pointers to a `QAct`'s buffers, for the threads that fill disjoint tokens of it.
#[derive(Clone, Copy)]
struct ActOut {
    q: *mut i8,
    d: *mut f32,
    ds: *mut f32,
    s: *mut i32,
    sf: *mut f32,
    k16: *mut i32,
}
// SAFETY: the threads write the blocks of disjoint tokens, inside buffers the caller keeps
// borrowed until `parallel_for` returns.
unsafe impl Send for ActOut {}
// SAFETY: as for Send.
unsafe impl Sync for ActOut {}

impl ActOut {
    /// A copy (so a closure captures the whole, Sync, value and not its pointer fields).
    fn get(&self) -> ActOut { *self }
}

/// Quantize `tokens` rows of `cols` values (`x`, row stride `stride`) into `a` (its buffers
/// reused), per block of 32. Rows go to the pool's threads when there are many.
pub fn quantize(x: &[f32], stride: usize, tokens: usize, cols: usize, a: &mut QAct) -> Result<(), QuantError> {
    quantize_with(x, stride, tokens, cols, a, best())
}

/// `quantize` for products with `w`'s layout: K-quants one scale per superblock of 256.
pub fn quantize_for(l: &Layout, x: &[f32], stride: usize, tokens: usize, a: &mut QAct) -> Result<(), QuantError> {
    quantize_per(x, stride, tokens, l.cols, a, best(), l.kquant())
}

/// `quantize` on a given code path (every path gives the same bytes).
pub fn quantize_with(x: &[f32], stride: usize, tokens: usize, cols: usize, a: &mut QAct, isa: Isa)
    -> Result<(), QuantError> {
    quantize_per(x, stride, tokens, cols, a, isa, false)
}

/// `quantize_with`, one scale per superblock of 256 when `sb` (for K-quant weights).
pub fn quantize_per(x: &[f32], stride: usize, tokens: usize, cols: usize, a: &mut QAct, isa: Isa, sb: bool)
    -> Result<(), QuantError> {
    let isa = checked(isa)?;
    let span = if sb { 32 * ACT_GROUPS } else { 32 };
    if cols == 0 || cols % span != 0 {
        return bad(format!("activations of {cols} columns: the integer kernels need a multiple of {span}"));
    }
    if tokens > 0 && x.len() < (tokens - 1) * stride + cols {
        return bad("activations: x is shorter than its rows");
    }
    let nb = cols / 32;
    let blocks = tokens.div_ceil(TILE) * TILE * nb;
    a.tokens = tokens;
    a.cols = cols;
    a.sb = sb;
    a.q.resize(32 * blocks, 0);
    a.d.resize(blocks, 0.0);
    a.ds.resize(blocks, 0.0);
    a.s.resize(blocks, 0);
    a.sf.resize(blocks, 0.0);
    a.k16.resize(2 * blocks, 0);
    let p = ActOut { q: a.q.as_mut_ptr(), d: a.d.as_mut_ptr(), ds: a.ds.as_mut_ptr(),
                     s: a.s.as_mut_ptr(), sf: a.sf.as_mut_ptr(), k16: a.k16.as_mut_ptr() };
    let per = span / 32;
    let row = |t: usize| {
        let p = p.get();
        for b0 in (0..nb).step_by(per) {
            let xs = &x[t * stride + 32 * b0..t * stride + 32 * (b0 + per)];
            // SAFETY: the ISA is the CPU's; xs holds 32 · per floats
            let amax = unsafe {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512Vnni => avx512::amax(xs.as_ptr(), xs.len()),
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => avx2::amax(xs.as_ptr(), xs.len()),
                    _ => amax_scalar(xs),
                }
            };
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            for b in b0..b0 + per {
                let i = ((t / TILE) * nb + b) * TILE + t % TILE;
                let xs = &x[t * stride + 32 * b..t * stride + 32 * b + 32];
                // SAFETY: block i of token t lies inside the buffers sized above, and no other
                // token writes it; the ISA is the CPU's.
                unsafe {
                    let q = std::slice::from_raw_parts_mut(p.q.add(32 * i), 32);
                    let (s0, s1) = match isa {
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx512Vnni => avx512::codes32(xs.as_ptr(), q.as_mut_ptr(), inv),
                        #[cfg(target_arch = "x86_64")]
                        Isa::Avx2 => avx2::codes32(xs.as_ptr(), q.as_mut_ptr(), inv),
                        _ => codes_scalar(xs, q, inv),
                    };
                    *p.d.add(i) = d;
                    *p.s.add(i) = s0 + s1;
                    *p.ds.add(i) = d * (s0 + s1) as f32;
                    *p.sf.add(i) = (s0 + s1) as f32;
                    *p.k16.add(2 * i) = 32 * s0;
                    *p.k16.add(2 * i + 1) = 32 * s1;
                }
            }
        }
    };
    if tokens * cols >= 1 << 15 && tokens >= 2 && num_threads() > 1 {
        let per = tokens.div_ceil(2 * num_threads());
        parallel_for(tokens.div_ceil(per), &|c| (c * per..((c + 1) * per).min(tokens)).for_each(row));
    } else {
        (0..tokens).for_each(row);
    }
    Ok(())
}

// ------------------------------------------------------------------ the product

/// A raw output view (rows of `stride` floats) the pool's threads write disjoint parts of.
#[derive(Clone, Copy)]
pub(crate) struct Out {
    pub ptr: *mut f32,
    pub stride: usize,
}
// SAFETY: the threads write disjoint columns of the output, which the caller keeps borrowed
// until `parallel_for` returns.
unsafe impl Send for Out {}
// SAFETY: as for Send; shared references only read the pointer.
unsafe impl Sync for Out {}

/// `out[t, r] = Σ_k W[r, k] · x[t, k]` over the quantized activations `a` (row `t` of `out`
/// at `out[t * out_stride ..]`, columns `0 .. rows`). Runs on the pool, 16 rows a chunk.
pub fn matmul(w: &RMatrix, a: &QAct, out: &mut [f32], out_stride: usize, isa: Isa) -> Result<(), QuantError> {
    let isa = checked(isa)?;
    let l = &w.layout;
    if a.cols != l.cols {
        return bad(format!("activations of {} columns, weights of {}", a.cols, l.cols));
    }
    if a.sb != l.kquant() {
        return bad(format!("{} weights need activations quantized per {} (quantize_for)", l.qtype.name(),
                           if l.kquant() { "superblock of 256" } else { "block of 32" }));
    }
    if a.tokens > 0 && (out_stride < l.rows || out.len() < (a.tokens - 1) * out_stride + l.rows) {
        return bad("out is too small for [tokens, rows]");
    }
    if a.tokens == 0 || l.rows == 0 {
        return Ok(());
    }
    let o = Out { ptr: out.as_mut_ptr(), stride: out_stride };
    let groups = l.row_groups();
    let work = l.rows * l.cols * a.tokens;
    let threads = if work < 1 << 16 { 1 } else { num_threads() };
    let per = if a.tokens == 1 { groups.div_ceil(2 * threads) } else { groups.div_ceil(4 * threads) }.max(1);
    let run = |c: usize| {
        let (g0, g1) = (c * per, ((c + 1) * per).min(groups));
        // SAFETY: row groups g0..g1 write output columns 16 g0 .. min(16 g1, rows) of rows
        // 0..tokens, inside `out` (checked above) and disjoint between chunks; the ISA
        // was checked against the CPU.
        unsafe { kernel(isa, w, a, o, g0, g1) }
    };
    let chunks = groups.div_ceil(per);
    if threads == 1 {
        (0..chunks).for_each(run);
    } else {
        parallel_for(chunks, &run);
    }
    Ok(())
}

/// # Safety
/// `o` must hold `a.tokens` rows with room for the columns of row groups `g0..g1`; the CPU
/// must have `isa`.
unsafe fn kernel(isa: Isa, w: &RMatrix, a: &QAct, o: Out, g0: usize, g1: usize) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => avx512::rows(w, a, o, g0, g1),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::rows(w, a, o, g0, g1),
        _ => scalar::rows(w, a, o, g0, g1),
    }
}

thread_local! {
    static ACTS: std::cell::RefCell<QAct> = std::cell::RefCell::new(QAct::new());
}

/// `matmul` on fp32 activations: `x` (`tokens` rows, row stride `x_stride`) is quantized
/// first, into a buffer kept per thread.
pub fn matmul_f32(
    w: &RMatrix, x: &[f32], x_stride: usize, tokens: usize, out: &mut [f32], out_stride: usize, isa: Isa,
) -> Result<(), QuantError> {
    ACTS.with(|a| {
        let mut a = a.borrow_mut();
        quantize_per(x, x_stride, tokens, w.layout.cols, &mut a, best(), w.layout.kquant())?;
        matmul(w, &a, out, out_stride, isa)
    })
}

/// Rows `row_start .. row_start + out_rows` of `w` as fp32 into `out` (row stride `out_stride`).
pub fn dequantize(w: &RMatrix, row_start: usize, out: &mut [f32], out_rows: usize, out_stride: usize)
    -> Result<(), QuantError> {
    let l = &w.layout;
    if row_start + out_rows > l.rows {
        return bad(format!("rows {row_start}..{} out of range for {} rows", row_start + out_rows, l.rows));
    }
    if out_rows > 0 && (out_stride < l.cols || out.len() < (out_rows - 1) * out_stride + l.cols) {
        return bad("out is too small for the rows asked for");
    }
    for i in 0..out_rows {
        dequantize_row(w, row_start + i, &mut out[i * out_stride..i * out_stride + l.cols]);
    }
    Ok(())
}

/// The listed rows of `w` as fp32 (an embedding lookup).
pub fn gather_rows(w: &RMatrix, rows: &[i64], out: &mut [f32], out_stride: usize) -> Result<(), QuantError> {
    let l = &w.layout;
    if let Some(&r) = rows.iter().find(|&&r| r < 0 || r as usize >= l.rows) {
        return bad(format!("row {r} out of range for {} rows", l.rows));
    }
    if !rows.is_empty() && (out_stride < l.cols || out.len() < (rows.len() - 1) * out_stride + l.cols) {
        return bad("out is too small for the rows asked for");
    }
    for (i, &r) in rows.iter().enumerate() {
        dequantize_row(w, r as usize, &mut out[i * out_stride..i * out_stride + l.cols]);
    }
    Ok(())
}

/// The integer products' limit on this CPU, measured in place: int8 multiply-adds of
/// `vpdpbusd` (AVX-512 VNNI, 512-bit) on every thread of the pool at once, 16 independent
/// accumulators each (no loads, no dependency stalls), as GOPS (2 operations a multiply-add);
/// the best of `reps` passes of ~0.05 s. None without AVX-512 VNNI. A kernel's rate over this
/// is its fraction of the limit (the quantized formats' unpacking and scales are on top).
pub fn int8_peak_gops(reps: usize) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    if best() == Isa::Avx512Vnni {
        const ITERS: usize = 1 << 20;
        let threads = num_threads();
        let mut best_gops = 0f64;
        for _ in 0..reps.max(1) {
            let t = std::time::Instant::now();
            // SAFETY: the CPU has AVX-512 VNNI (best() says so)
            parallel_for(threads, &|_| {
                std::hint::black_box(unsafe { avx512::dpbusd_loop(ITERS) });
            });
            let ops = (threads * ITERS * 16 * 64 * 2) as f64;
            best_gops = best_gops.max(ops / t.elapsed().as_secs_f64() / 1e9);
        }
        return Some(best_gops);
    }
    let _ = reps;
    None
}

/// The memory's read bandwidth as the decode kernels meet it, measured in place (GB/s): every
/// thread of the pool streams its share of a `mib` MiB buffer (chunks of 1 MiB taken in turn,
/// as a product's row groups are), four independent 64-bit sums per pass, asking for the bytes
/// `decode_prefetch` ahead as the kernels do; the best of `reps` passes, with and without the
/// prefetch. One stream of a model reads every weight once a token: its bytes over this are
/// the memory's limit on its rate (a probe through numpy's reductions read 10-30 % below what
/// the decode itself streamed on a Zen 3 VM).
pub fn read_gbs(mib: usize, reps: usize) -> f64 {
    const CHUNK: usize = 1 << 20;
    let words = mib.max(1) * CHUNK / 8;
    // written first: every page is resident before a pass is timed
    let buf: Vec<u64> = (0..words as u64).collect();
    let chunks = buf.len() * 8 / CHUNK;
    let mut best = 0f64;
    for pass in 0..2 * reps.max(1) {
        let ahead = if pass % 2 == 0 { decode_prefetch() } else { 0 };
        let sums: Vec<std::sync::atomic::AtomicU64> = (0..chunks).map(|_| std::sync::atomic::AtomicU64::new(0)).collect();
        let t = std::time::Instant::now();
        parallel_for(chunks, &|c| {
            let part = &buf[c * CHUNK / 8..(c + 1) * CHUNK / 8];
            let mut s = [0u64; 4];
            for (k, w) in part.chunks_exact(64).enumerate() {
                #[cfg(target_arch = "x86_64")]
                if ahead > 0 && k % 8 == 0 {
                    prefetch((w.as_ptr() as *const u8).wrapping_add(ahead), 512);
                }
                let _ = k;
                for q in w.chunks_exact(4) {
                    for i in 0..4 {
                        s[i] = s[i].wrapping_add(q[i]);
                    }
                }
            }
            sums[c].store(s.iter().fold(0u64, |a, &b| a.wrapping_add(b)), std::sync::atomic::Ordering::Relaxed);
        });
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(&sums);
        best = best.max((chunks * CHUNK) as f64 / secs / 1e9);
    }
    best
}
