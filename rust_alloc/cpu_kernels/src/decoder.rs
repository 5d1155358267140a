//! A whole decode step of a quantized model in one call: every decoder layer (norms, the
//! quantized products, rotary + KV write, paged attention, SiLU) with no Python between
//! the operators.

use crate::attention::paged_decode;
use crate::kv::KvElem;
use crate::ops::{add_rms_norm, bad, rope_write_kv, silu_mul, Heads, OpError};


/// One part of a linear layer's weight: GGUF blocks for the exact kernels, or repacked for
/// the integer ones.
#[derive(Clone, Copy)]
pub enum Part<'a> {
    Exact(crate::quant::QMatrix<'a>),
    Int8(crate::q8::RMatrix<'a>),
}

impl Part<'_> {
    pub fn rows(&self) -> usize {
        match self { Part::Exact(m) => m.rows, Part::Int8(m) => m.layout.rows }
    }

    pub fn cols(&self) -> usize {
        match self { Part::Exact(m) => m.cols, Part::Int8(m) => m.layout.cols }
    }
}

/// A linear layer on GGUF-quantized weights: row parts stacked along the output (a fused
/// QKV may mix formats), and an optional bias.
pub struct QLinear<'a> {
    pub segs: Vec<Part<'a>>,
    pub bias: Option<&'a [f32]>,
}

impl QLinear<'_> {
    pub fn out_features(&self) -> usize { self.segs.iter().map(|s| s.rows()).sum() }

    fn forward(&self, x: &[f32], t: usize, out: &mut [f32]) -> Result<(), OpError> {
        let n = self.out_features();
        let cols = self.segs.first().map_or(0, |s| s.cols());
        let err = |e: crate::quant::QuantError| OpError(e.0);
        let exact: Vec<_> = self.segs.iter().filter_map(|s| if let Part::Exact(m) = s { Some(*m) } else { None }).collect();
        if exact.len() == self.segs.len() {   // every part exact: one call on the pool for all of them
            crate::quant::matmul_stacked(&exact, x, cols, t, out, n, crate::quant::best()).map_err(err)?;
        } else {
            let mut col = 0;
            for s in &self.segs {
                match s {
                    Part::Exact(m) => crate::quant::matmul(m, x, cols, t, &mut out[col..], n, crate::quant::best()),
                    Part::Int8(m) => crate::q8::matmul_f32(m, x, cols, t, &mut out[col..], n, crate::q8::best()),
                }
                .map_err(err)?;
                col += s.rows();
            }
        }
        if let Some(b) = self.bias {
            for r in 0..t {
                for (o, v) in out[r * n..(r + 1) * n].iter_mut().zip(b) {
                    *o += *v;
                }
            }
        }
        Ok(())
    }
}

/// A zeroed f32 buffer that starts on a 64-byte boundary (a cache line), so the kernels'
/// 32-byte loads of its rows (whose lengths here are multiples of 16 floats) never straddle
/// two lines. A large `Vec` comes from `mmap` 16 bytes past a page start: every other load
/// of its rows would be split (measured: bench/RESULTS.md, "Model runtime": step buffers on a cache line).
struct Lines {
    buf: Vec<f32>,
    off: usize,
    len: usize,
}

impl Lines {
    fn new(len: usize) -> Self {
        let buf = vec![0f32; len + 16];
        let off = (64 - buf.as_ptr() as usize % 64) % 64 / 4;
        Lines { buf, off, len }
    }
}

impl std::ops::Deref for Lines {
    type Target = [f32];
    fn deref(&self) -> &[f32] { &self.buf[self.off..self.off + self.len] }
}

impl std::ops::DerefMut for Lines {
    fn deref_mut(&mut self) -> &mut [f32] { &mut self.buf[self.off..self.off + self.len] }
}

/// One decoder layer's weights.
pub struct QLayer<'a> {
    pub in_norm: &'a [f32],
    pub post_norm: &'a [f32],
    pub qkv: QLinear<'a>,
    pub o: QLinear<'a>,
    pub gate_up: QLinear<'a>,
    pub down: QLinear<'a>,
}

/// A decode-only step: `t` sequences with one new token each, token `b` at `positions[b]`
/// written to `slots[b]`, attending its `lens[b]` positions through `tables` row `b`.
pub struct DecodeStep<'a> {
    pub positions: &'a [i64],
    pub slots: &'a [i64],
    pub lens: &'a [i32],
    pub tables: &'a [i32],
    pub cos: &'a [f32],
    pub sin: &'a [f32],
    pub block_size: usize,
    pub scale: f32,
    pub window: usize,
}

/// Every decoder layer of a decode-only step in one call: `h` (`[t, hidden]`, the token
/// embeddings) becomes the residual stream after the last layer (final norm not applied).
/// `kv` is the runner's whole cache `[layers, 2, num_blocks, block_size, nkv, d]`.
#[allow(clippy::too_many_arguments)]
pub fn decode_layers<E: KvElem>(
    layers: &[QLayer], hs: Heads, hidden: usize, inter: usize, eps: f32, h: &mut [f32], t: usize, step: &DecodeStep,
    kv: &mut [E],
) -> Result<(), OpError> {
    let (w, q) = (hs.width(), hs.nh * hs.d);
    if h.len() != t * hidden || step.positions.len() != t || step.slots.len() != t || step.lens.len() != t {
        return bad("decode_layers: h, positions, slots and seq_lens must have one row per token");
    }
    if layers.is_empty() || kv.len() % (2 * layers.len()) != 0 {
        return bad("decode_layers: the KV cache does not split into the layers' K and V");
    }
    for l in layers {
        if l.in_norm.len() != hidden || l.post_norm.len() != hidden || l.qkv.out_features() != w
            || l.o.out_features() != hidden || l.gate_up.out_features() != 2 * inter || l.down.out_features() != hidden
            || l.qkv.segs.iter().any(|s| s.cols() != hidden) || l.o.segs.iter().any(|s| s.cols() != q)
            || l.gate_up.segs.iter().any(|s| s.cols() != hidden) || l.down.segs.iter().any(|s| s.cols() != inter)
        {
            return bad("decode_layers: a layer's weights do not fit the model's shapes");
        }
    }
    let per = kv.len() / (2 * layers.len());
    let rows: Vec<i64> = (0..t as i64).collect();
    let (mut a, mut qkv, mut attn) = (Lines::new(t * hidden), Lines::new(t * w), Lines::new(t * q));
    let (mut gu, mut m, mut delta) = (Lines::new(t * 2 * inter), Lines::new(t * inter), Lines::new(t * hidden));
    let mut have_delta = false;
    for (i, l) in layers.iter().enumerate() {
        let (kc, rest) = kv[2 * i * per..(2 * i + 2) * per].split_at_mut(per);
        let vc = rest;
        add_rms_norm(h, have_delta.then_some(&delta[..]), l.in_norm, eps, &mut a, t, hidden)?;
        l.qkv.forward(&a, t, &mut qkv)?;
        rope_write_kv(&mut qkv, t, hs, step.positions, step.cos, step.sin, step.slots, kc, vc)?;
        paged_decode(&qkv, w, &mut attn, q, &rows, step.lens, step.tables, kc, vc, step.block_size, hs, step.scale,
                     step.window, 0.0)?;
        l.o.forward(&attn, t, &mut delta)?;
        add_rms_norm(h, Some(&delta), l.post_norm, eps, &mut a, t, hidden)?;
        l.gate_up.forward(&a, t, &mut gu)?;
        silu_mul(&gu, &mut m, t, inter)?;
        l.down.forward(&m, t, &mut delta)?;
        have_delta = true;
    }
    for (x, d) in h.iter_mut().zip(delta.iter()) {
        *x += *d;
    }
    Ok(())
}
