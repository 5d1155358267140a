//! Python binding of the fused CPU operators (`cpuops`): C-contiguous numpy arrays (torch CPU
//! tensors through `tensor.numpy()`, which shares their memory), written in place, the GIL
//! released while they run.

use numpy::{PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::cpuops::{self, DecodeStep, Heads, OpError, QLayer, QLinear};
use crate::quant::QMatrix;

fn verr(e: OpError) -> PyErr { PyValueError::new_err(e.0) }

fn ro<'a, T: numpy::Element>(a: &'a PyReadonlyArrayDyn<'_, T>, what: &str) -> PyResult<&'a [T]> {
    a.as_slice().map_err(|_| PyValueError::new_err(format!("{what}: expected a C-contiguous array")))
}

fn rw<'a, T: numpy::Element>(a: &'a mut PyReadwriteArrayDyn<'_, T>, what: &str) -> PyResult<&'a mut [T]> {
    a.as_slice_mut().map_err(|_| PyValueError::new_err(format!("{what}: expected a C-contiguous array")))
}

/// (rows, last dim) of an array seen as 2-D.
fn rows_cols(shape: &[usize]) -> (usize, usize) {
    match shape.split_last() {
        Some((&c, lead)) => (lead.iter().product(), c),
        None => (1, 1),
    }
}

/// h += delta (if not None), out = rms_norm(h) * weight; h, delta, out [T, D] float32.
#[pyfunction]
#[pyo3(signature = (h, delta, weight, eps, out))]
fn cpu_add_rms_norm(
    py: Python<'_>, mut h: PyReadwriteArrayDyn<'_, f32>, delta: Option<PyReadonlyArrayDyn<'_, f32>>,
    weight: PyReadonlyArrayDyn<'_, f32>, eps: f32, mut out: PyReadwriteArrayDyn<'_, f32>,
) -> PyResult<()> {
    let (rows, dim) = rows_cols(h.shape());
    if out.shape() != h.shape() || delta.as_ref().is_some_and(|d| d.shape() != h.shape()) {
        return Err(PyValueError::new_err("cpu_add_rms_norm: h, delta and out must have one shape"));
    }
    let hs = rw(&mut h, "h")?;
    let ds = match &delta {
        Some(d) => Some(ro(d, "delta")?),
        None => None,
    };
    let w = ro(&weight, "weight")?;
    let os = rw(&mut out, "out")?;
    py.detach(|| cpuops::add_rms_norm(hs, ds, w, eps, os, rows, dim)).map_err(verr)
}

/// out[t, i] = silu(gu[t, i]) * gu[t, I + i]; gu [T, 2I], out [T, I] float32.
#[pyfunction]
fn cpu_silu_mul(py: Python<'_>, gu: PyReadonlyArrayDyn<'_, f32>, mut out: PyReadwriteArrayDyn<'_, f32>) -> PyResult<()> {
    let (rows, w) = rows_cols(gu.shape());
    let (orows, inter) = rows_cols(out.shape());
    if rows != orows || w != 2 * inter {
        return Err(PyValueError::new_err("cpu_silu_mul: gu must be [T, 2I] and out [T, I]"));
    }
    let g = ro(&gu, "gu")?;
    let o = rw(&mut out, "out")?;
    py.detach(|| cpuops::silu_mul(g, o, rows, inter)).map_err(verr)
}

/// Rotary embedding of the Q and K heads of fused QKV rows [T, (H + 2 Hkv) D] in place, then
/// K and V written to their cache slots (int64 [T], -1: skip). cos/sin [P, D] tables,
/// positions int64 [T]; caches [num_blocks, block_size, Hkv, D] float32.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn cpu_rope_write_kv(
    py: Python<'_>, mut qkv: PyReadwriteArrayDyn<'_, f32>, positions: PyReadonlyArrayDyn<'_, i64>,
    cos: PyReadonlyArrayDyn<'_, f32>, sin: PyReadonlyArrayDyn<'_, f32>, slots: PyReadonlyArrayDyn<'_, i64>,
    mut k_cache: PyReadwriteArrayDyn<'_, f32>, mut v_cache: PyReadwriteArrayDyn<'_, f32>, num_heads: usize,
    num_kv_heads: usize,
) -> PyResult<()> {
    let (rows, width) = rows_cols(qkv.shape());
    let (_, d) = rows_cols(cos.shape());
    let hs = Heads { nh: num_heads, nkv: num_kv_heads, d };
    if width != hs.width() {
        return Err(PyValueError::new_err(format!("cpu_rope_write_kv: QKV rows of {width}, heads need {}", hs.width())));
    }
    let q = rw(&mut qkv, "qkv")?;
    let (p, c, s, sl) = (ro(&positions, "positions")?, ro(&cos, "cos")?, ro(&sin, "sin")?, ro(&slots, "slots")?);
    let kc = rw(&mut k_cache, "k_cache")?;
    let vc = rw(&mut v_cache, "v_cache")?;
    py.detach(|| cpuops::rope_write_kv(q, rows, hs, p, c, s, sl, kc, vc)).map_err(verr)
}

/// Paged attention of one query token per sequence. q [T, >= H D] (the first H D values of
/// row rows[b] are sequence b's query heads, e.g. a fused QKV batch), out [T, H D];
/// rows int64 [B], seq_lens int32 [B], block_tables int32 [B, M]; caches as above.
#[pyfunction]
#[pyo3(signature = (q, out, rows, seq_lens, block_tables, k_cache, v_cache, num_heads, num_kv_heads, scale, window = 0))]
#[allow(clippy::too_many_arguments)]
fn cpu_paged_decode(
    py: Python<'_>, q: PyReadonlyArrayDyn<'_, f32>, mut out: PyReadwriteArrayDyn<'_, f32>,
    rows: PyReadonlyArrayDyn<'_, i64>, seq_lens: PyReadonlyArrayDyn<'_, i32>, block_tables: PyReadonlyArrayDyn<'_, i32>,
    k_cache: PyReadonlyArrayDyn<'_, f32>, v_cache: PyReadonlyArrayDyn<'_, f32>, num_heads: usize, num_kv_heads: usize,
    scale: f32, window: usize,
) -> PyResult<()> {
    let kshape = k_cache.shape();
    if kshape.len() != 4 || v_cache.shape() != kshape || kshape[2] != num_kv_heads {
        return Err(PyValueError::new_err("cpu_paged_decode: caches must be [num_blocks, block_size, Hkv, D]"));
    }
    let (bs, d) = (kshape[1], kshape[3]);
    let hs = Heads { nh: num_heads, nkv: num_kv_heads, d };
    let (_, q_stride) = rows_cols(q.shape());
    let (_, out_stride) = rows_cols(out.shape());
    let (qs, r, l, t) = (ro(&q, "q")?, ro(&rows, "rows")?, ro(&seq_lens, "seq_lens")?, ro(&block_tables, "block_tables")?);
    let (kc, vc) = (ro(&k_cache, "k_cache")?, ro(&v_cache, "v_cache")?);
    let os = rw(&mut out, "out")?;
    py.detach(|| cpuops::paged_decode(qs, q_stride, os, out_stride, r, l, t, kc, vc, bs, hs, scale, window)).map_err(verr)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cpu_add_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_silu_mul, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_rope_write_kv, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_paged_decode, m)?)?;
    m.add_class::<QuantDecoder>()?;
    Ok(())
}

/// (address, length) of an array's data, kept alive by the `QuantDecoder` that holds it.
#[derive(Clone, Copy)]
struct Raw {
    ptr: usize,
    len: usize,
}

impl Raw {
    unsafe fn f32(&self) -> &'static [f32] { std::slice::from_raw_parts(self.ptr as *const f32, self.len) }
    unsafe fn u8(&self) -> &'static [u8] { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
}

fn raw_f32(a: &Bound<'_, PyAny>, what: &str) -> PyResult<Raw> {
    let arr: PyReadonlyArrayDyn<'_, f32> = a.extract().map_err(|_| PyValueError::new_err(format!("{what}: expected a float32 array")))?;
    let s = ro(&arr, what)?;
    Ok(Raw { ptr: s.as_ptr() as usize, len: s.len() })
}

fn raw_u8(a: &Bound<'_, PyAny>, what: &str) -> PyResult<Raw> {
    let arr: PyReadonlyArrayDyn<'_, u8> = a.extract().map_err(|_| PyValueError::new_err(format!("{what}: expected a uint8 array")))?;
    let s = ro(&arr, what)?;
    Ok(Raw { ptr: s.as_ptr() as usize, len: s.len() })
}

struct RawLinear {
    segs: Vec<(crate::quant::QType, bool, Raw, usize, usize)>, // format, interleaved, blocks, rows, cols
    bias: Option<Raw>,
}

struct RawLayer {
    in_norm: Raw,
    post_norm: Raw,
    lin: [RawLinear; 4], // qkv, o, gate_up, down
}

/// Every decoder layer of a quantized model for decode-only steps, in one call per step
/// (cpuops::decode_layers). Holds references to the weight arrays it was given, which must
/// not be resized or freed while it lives (they are the model's own).
#[pyclass(module = "edgepaged._rust_alloc")]
pub struct QuantDecoder {
    layers: Vec<RawLayer>,
    _keep: Vec<Py<PyAny>>,
    hs: Heads,
    hidden: usize,
    inter: usize,
    eps: f32,
}

#[pymethods]
impl QuantDecoder {
    /// layers: per layer (input_norm, post_norm, [qkv, o, gate_up, down]) with each linear
    /// as (segments, bias or None) and each segment as (uint8 blocks [rows, row_bytes],
    /// ggml type (plus the x8 flag for interleaved blocks), rows, cols).
    #[new]
    #[pyo3(signature = (layers, num_heads, num_kv_heads, head_dim, hidden, intermediate, eps))]
    fn new(
        layers: &Bound<'_, PyAny>, num_heads: usize, num_kv_heads: usize, head_dim: usize, hidden: usize,
        intermediate: usize, eps: f32,
    ) -> PyResult<Self> {
        let mut keep = Vec::new();
        let mut out = Vec::new();
        for layer in layers.try_iter()? {
            let layer = layer?;
            let (inn, post, lins): (Bound<'_, PyAny>, Bound<'_, PyAny>, Vec<Bound<'_, PyAny>>) = layer.extract()?;
            if lins.len() != 4 {
                return Err(PyValueError::new_err("QuantDecoder: each layer needs [qkv, o, gate_up, down]"));
            }
            let mut raw_lins = Vec::new();
            for lin in lins {
                let (segs, bias): (Vec<(Bound<'_, PyAny>, u32, usize, usize)>, Option<Bound<'_, PyAny>>) = lin.extract()?;
                let mut rs = Vec::new();
                for (data, qt, rows, cols) in segs {
                    let (q, x8) = crate::python_quant::qtype(qt)?;
                    let raw = raw_u8(&data, "weight")?;
                    crate::quant::QMatrix::with_layout(q, x8, unsafe { raw.u8() }, rows, cols)
                        .map_err(|e| PyValueError::new_err(e.0))?;
                    keep.push(data.unbind());
                    rs.push((q, x8, raw, rows, cols));
                }
                let bias = match bias {
                    Some(b) => {
                        let r = raw_f32(&b, "bias")?;
                        keep.push(b.unbind());
                        Some(r)
                    }
                    None => None,
                };
                raw_lins.push(RawLinear { segs: rs, bias });
            }
            let (i, p) = (raw_f32(&inn, "input norm")?, raw_f32(&post, "post norm")?);
            keep.push(inn.unbind());
            keep.push(post.unbind());
            let lin: [RawLinear; 4] = raw_lins.try_into().map_err(|_| PyValueError::new_err("4 linears"))?;
            out.push(RawLayer { in_norm: i, post_norm: p, lin });
        }
        Ok(QuantDecoder {
            layers: out, _keep: keep, hs: Heads { nh: num_heads, nkv: num_kv_heads, d: head_dim }, hidden,
            inter: intermediate, eps,
        })
    }

    /// h [T, hidden] (embeddings in, residual stream after the last layer out), positions and
    /// slots int64 [T], seq_lens int32 [T], block_tables int32 [T, M], kv_cache the runner's
    /// [layers, 2, num_blocks, block_size, Hkv, D], cos/sin [P, D].
    #[pyo3(signature = (h, positions, slots, seq_lens, block_tables, kv_cache, cos, sin, scale, window = 0))]
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &self, py: Python<'_>, mut h: PyReadwriteArrayDyn<'_, f32>, positions: PyReadonlyArrayDyn<'_, i64>,
        slots: PyReadonlyArrayDyn<'_, i64>, seq_lens: PyReadonlyArrayDyn<'_, i32>,
        block_tables: PyReadonlyArrayDyn<'_, i32>, mut kv_cache: PyReadwriteArrayDyn<'_, f32>,
        cos: PyReadonlyArrayDyn<'_, f32>, sin: PyReadonlyArrayDyn<'_, f32>, scale: f32, window: usize,
    ) -> PyResult<()> {
        let kshape = kv_cache.shape().to_vec();
        if kshape.len() != 6 || kshape[0] != self.layers.len() || kshape[1] != 2 || kshape[4] != self.hs.nkv
            || kshape[5] != self.hs.d
        {
            return Err(PyValueError::new_err("QuantDecoder.decode: kv_cache must be [layers, 2, blocks, block_size, Hkv, D]"));
        }
        let (t, hidden) = rows_cols(h.shape());
        if hidden != self.hidden {
            return Err(PyValueError::new_err(format!("QuantDecoder.decode: h rows of {hidden}, model hidden {}", self.hidden)));
        }
        let hsl = rw(&mut h, "h")?;
        let (p, s, l, bt) = (ro(&positions, "positions")?, ro(&slots, "slots")?, ro(&seq_lens, "seq_lens")?, ro(&block_tables, "block_tables")?);
        let (c, sn) = (ro(&cos, "cos")?, ro(&sin, "sin")?);
        let kv = rw(&mut kv_cache, "kv_cache")?;
        // SAFETY: the arrays behind every Raw are held in `_keep`.
        let layers: Vec<QLayer> = self
            .layers
            .iter()
            .map(|l| unsafe {
                let lin = |r: &RawLinear| QLinear {
                    segs: r
                        .segs
                        .iter()
                        .map(|(q, x8, raw, rows, cols)| QMatrix::with_layout(*q, *x8, raw.u8(), *rows, *cols).unwrap())
                        .collect(),
                    bias: r.bias.map(|b| b.f32()),
                };
                QLayer {
                    in_norm: l.in_norm.f32(), post_norm: l.post_norm.f32(), qkv: lin(&l.lin[0]), o: lin(&l.lin[1]),
                    gate_up: lin(&l.lin[2]), down: lin(&l.lin[3]),
                }
            })
            .collect();
        let step = DecodeStep {
            positions: p, slots: s, lens: l, tables: bt, cos: c, sin: sn, block_size: kshape[3], scale, window,
        };
        let (hs, inter, eps) = (self.hs, self.inter, self.eps);
        py.detach(|| cpuops::decode_layers(&layers, hs, hidden, inter, eps, hsl, t, &step, kv)).map_err(verr)
    }
}
