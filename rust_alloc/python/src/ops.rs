//! `edgepaged._native.ops`: the fused CPU operators and the whole-step decoder on
//! C-contiguous numpy arrays (torch CPU tensors through `tensor.numpy()`, which shares their
//! memory), written in place, the GIL released while they run.

use numpy::{PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use cpu_kernels::decoder::{decode_layers, DecodeStep, Part, QLayer, QLinear};
use cpu_kernels::kv::{KvElem, F16};
use cpu_kernels::ops::{self, Heads, OpError};
use cpu_kernels::{attention, prefill, QMatrix, QType};

use crate::quant::{contiguous, contiguous_mut, qtype, rmatrix, rows_cols, Lay};

fn verr(e: OpError) -> PyErr { PyValueError::new_err(e.0) }

/// A K/V cache array, float32, float16 or q8_0 (int8 head rows: `d` values, then `d / 32`
/// half-precision scales as 2 bytes each; the last axis is `d + d / 16`), borrowed for
/// writing.
enum CacheMut<'py> {
    F32(PyReadwriteArrayDyn<'py, f32>),
    F16(PyReadwriteArrayDyn<'py, F16>),
    Q8(PyReadwriteArrayDyn<'py, i8>),
}

/// The same, borrowed for reading.
enum CacheRef<'py> {
    F32(PyReadonlyArrayDyn<'py, f32>),
    F16(PyReadonlyArrayDyn<'py, F16>),
    Q8(PyReadonlyArrayDyn<'py, i8>),
}

fn cache_mut<'py>(a: &Bound<'py, PyAny>, what: &str) -> PyResult<CacheMut<'py>> {
    if let Ok(x) = a.extract::<PyReadwriteArrayDyn<'py, f32>>() {
        return Ok(CacheMut::F32(x));
    }
    if let Ok(x) = a.extract::<PyReadwriteArrayDyn<'py, i8>>() {
        return Ok(CacheMut::Q8(x));
    }
    a.extract::<PyReadwriteArrayDyn<'py, F16>>().map(CacheMut::F16)
        .map_err(|_| PyValueError::new_err(format!("{what}: expected a writable float32, float16 or int8 (q8_0) array")))
}

fn cache_ref<'py>(a: &Bound<'py, PyAny>, what: &str) -> PyResult<CacheRef<'py>> {
    if let Ok(x) = a.extract::<PyReadonlyArrayDyn<'py, f32>>() {
        return Ok(CacheRef::F32(x));
    }
    if let Ok(x) = a.extract::<PyReadonlyArrayDyn<'py, i8>>() {
        return Ok(CacheRef::Q8(x));
    }
    a.extract::<PyReadonlyArrayDyn<'py, F16>>().map(CacheRef::F16)
        .map_err(|_| PyValueError::new_err(format!("{what}: expected a float32, float16 or int8 (q8_0) array")))
}

impl CacheMut<'_> {
    fn shape(&self) -> Vec<usize> {
        match self {
            CacheMut::F32(a) => a.shape().to_vec(),
            CacheMut::F16(a) => a.shape().to_vec(),
            CacheMut::Q8(a) => a.shape().to_vec(),
        }
    }

    fn units(&self, d: usize) -> usize {
        match self { CacheMut::Q8(_) => <i8 as KvElem>::units(d), _ => d }
    }
}

impl CacheRef<'_> {
    fn shape(&self) -> Vec<usize> {
        match self {
            CacheRef::F32(a) => a.shape().to_vec(),
            CacheRef::F16(a) => a.shape().to_vec(),
            CacheRef::Q8(a) => a.shape().to_vec(),
        }
    }

    /// The head size of a cache whose head rows take `units` elements.
    fn head_dim(&self, units: usize) -> PyResult<usize> {
        match self {
            CacheRef::Q8(_) if units % 17 != 0 => {
                Err(PyValueError::new_err(format!("a q8_0 cache's head rows take d + d / 16 bytes, not {units}")))
            }
            CacheRef::Q8(_) => Ok(units / 17 * 16),
            _ => Ok(units),
        }
    }
}

const MIXED: &str = "k_cache and v_cache must have one dtype";

/// One part of a linear layer's weight, checked.
fn part(q: QType, lay: Lay, data: &[u8], rows: usize, cols: usize) -> PyResult<Part<'_>> {
    if lay == Lay::R16 {
        return Ok(Part::Int8(rmatrix(q, data, Some(rows), cols)?));
    }
    QMatrix::with_layout(q, lay == Lay::X8, data, rows, cols).map(Part::Exact).map_err(|e| PyValueError::new_err(e.0))
}

/// h += delta (if not None), out = rms_norm(h) * weight; h, delta, out [T, D] float32.
#[pyfunction]
#[pyo3(signature = (h, delta, weight, eps, out))]
fn add_rms_norm(
    py: Python<'_>, mut h: PyReadwriteArrayDyn<'_, f32>, delta: Option<PyReadonlyArrayDyn<'_, f32>>,
    weight: PyReadonlyArrayDyn<'_, f32>, eps: f32, mut out: PyReadwriteArrayDyn<'_, f32>,
) -> PyResult<()> {
    let (rows, dim) = rows_cols(h.shape());
    if out.shape() != h.shape() || delta.as_ref().is_some_and(|d| d.shape() != h.shape()) {
        return Err(PyValueError::new_err("add_rms_norm: h, delta and out must have one shape"));
    }
    let hs = contiguous_mut(&mut h, "h")?;
    let ds = match &delta {
        Some(d) => Some(contiguous(d, "delta")?),
        None => None,
    };
    let w = contiguous(&weight, "weight")?;
    let os = contiguous_mut(&mut out, "out")?;
    py.detach(|| ops::add_rms_norm(hs, ds, w, eps, os, rows, dim)).map_err(verr)
}

/// out[t, i] = silu(gu[t, i]) * gu[t, I + i]; gu [T, 2I], out [T, I] float32.
#[pyfunction]
fn silu_mul(py: Python<'_>, gu: PyReadonlyArrayDyn<'_, f32>, mut out: PyReadwriteArrayDyn<'_, f32>) -> PyResult<()> {
    let (rows, w) = rows_cols(gu.shape());
    let (orows, inter) = rows_cols(out.shape());
    if rows != orows || w != 2 * inter {
        return Err(PyValueError::new_err("silu_mul: gu must be [T, 2I] and out [T, I]"));
    }
    let g = contiguous(&gu, "gu")?;
    let o = contiguous_mut(&mut out, "out")?;
    py.detach(|| ops::silu_mul(g, o, rows, inter)).map_err(verr)
}

/// Each row of `x` [..., n] float32 in place: softmax(scale * row) (scale > 0).
#[pyfunction]
fn softmax_rows(py: Python<'_>, mut x: PyReadwriteArrayDyn<'_, f32>, scale: f32) -> PyResult<()> {
    let (rows, n) = rows_cols(x.shape());
    let xs = contiguous_mut(&mut x, "x")?;
    py.detach(|| ops::softmax_rows(xs, rows, n, scale)).map_err(verr)
}

/// Rotary embedding of the Q and K heads of fused QKV rows [T, (H + 2 Hkv) D] in place, then
/// K and V written to their cache slots (int64 [T], -1: skip). cos/sin [P, D] tables,
/// positions int64 [T]; caches [num_blocks, block_size, Hkv, D] float32, float16 or int8 (q8_0 head rows of D + D / 16 bytes).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn rope_write_kv<'py>(
    py: Python<'py>, mut qkv: PyReadwriteArrayDyn<'py, f32>, positions: PyReadonlyArrayDyn<'py, i64>,
    cos: PyReadonlyArrayDyn<'py, f32>, sin: PyReadonlyArrayDyn<'py, f32>, slots: PyReadonlyArrayDyn<'py, i64>,
    k_cache: Bound<'py, PyAny>, v_cache: Bound<'py, PyAny>, num_heads: usize, num_kv_heads: usize,
) -> PyResult<()> {
    let (rows, width) = rows_cols(qkv.shape());
    let (_, d) = rows_cols(cos.shape());
    let hs = Heads { nh: num_heads, nkv: num_kv_heads, d };
    if width != hs.width() {
        return Err(PyValueError::new_err(format!("rope_write_kv: QKV rows of {width}, heads need {}", hs.width())));
    }
    let q = contiguous_mut(&mut qkv, "qkv")?;
    let (p, c, s, sl) = (contiguous(&positions, "positions")?, contiguous(&cos, "cos")?, contiguous(&sin, "sin")?, contiguous(&slots, "slots")?);
    match (cache_mut(&k_cache, "k_cache")?, cache_mut(&v_cache, "v_cache")?) {
        (CacheMut::F32(mut k), CacheMut::F32(mut v)) => {
            let (kc, vc) = (contiguous_mut(&mut k, "k_cache")?, contiguous_mut(&mut v, "v_cache")?);
            py.detach(|| ops::rope_write_kv(q, rows, hs, p, c, s, sl, kc, vc)).map_err(verr)
        }
        (CacheMut::F16(mut k), CacheMut::F16(mut v)) => {
            let (kc, vc) = (contiguous_mut(&mut k, "k_cache")?, contiguous_mut(&mut v, "v_cache")?);
            py.detach(|| ops::rope_write_kv(q, rows, hs, p, c, s, sl, kc, vc)).map_err(verr)
        }
        (CacheMut::Q8(mut k), CacheMut::Q8(mut v)) => {
            let (kc, vc) = (contiguous_mut(&mut k, "k_cache")?, contiguous_mut(&mut v, "v_cache")?);
            py.detach(|| ops::rope_write_kv(q, rows, hs, p, c, s, sl, kc, vc)).map_err(verr)
        }
        _ => Err(PyValueError::new_err(MIXED)),
    }
}

/// Paged attention of one query token per sequence (scores soft-capped when softcap > 0). q [T, >= H D] (the first H D values of
/// row rows[b] are sequence b's query heads, e.g. a fused QKV batch), out [T, H D];
/// The attention kernels' common signature (paged_decode's and paged_prefill's).
type AttnKernel<E> = fn(&[f32], usize, &mut [f32], usize, &[i64], &[i32], &[i32], &[E], &[E], usize, Heads, f32, usize, f32,
                        Option<&[i32]>) -> Result<(), OpError>;

/// Checks the caches and runs `f32k` or `f16k` on them, the GIL released. `rows`: decode's
/// row per sequence, or prefill's row starts.
#[allow(clippy::too_many_arguments)]
fn attend<'py>(
    py: Python<'py>, what: &str, q: PyReadonlyArrayDyn<'py, f32>, mut out: PyReadwriteArrayDyn<'py, f32>,
    rows: PyReadonlyArrayDyn<'py, i64>, seq_lens: PyReadonlyArrayDyn<'py, i32>, block_tables: PyReadonlyArrayDyn<'py, i32>,
    k_cache: Bound<'py, PyAny>, v_cache: Bound<'py, PyAny>, num_heads: usize, num_kv_heads: usize,
    scale: f32, window: usize, softcap: f32, kernels: (AttnKernel<f32>, AttnKernel<F16>, AttnKernel<i8>),
    see: Option<PyReadonlyArrayDyn<'py, i32>>,
) -> PyResult<()> {
    let (f32k, f16k, q8k) = kernels;
    let see = match &see {
        Some(a) => Some(contiguous(a, "see")?),
        None => None,
    };
    let (k_cache, v_cache) = (cache_ref(&k_cache, "k_cache")?, cache_ref(&v_cache, "v_cache")?);
    let kshape = k_cache.shape();
    if kshape.len() != 4 || v_cache.shape() != kshape || kshape[2] != num_kv_heads {
        return Err(PyValueError::new_err(format!("{what}: caches must be [num_blocks, block_size, Hkv, D]")));
    }
    let (bs, d) = (kshape[1], k_cache.head_dim(kshape[3])?);
    let hs = Heads { nh: num_heads, nkv: num_kv_heads, d };
    let (_, q_stride) = rows_cols(q.shape());
    let (_, out_stride) = rows_cols(out.shape());
    let (qs, r, l, t) = (contiguous(&q, "q")?, contiguous(&rows, "rows")?, contiguous(&seq_lens, "seq_lens")?, contiguous(&block_tables, "block_tables")?);
    let os = contiguous_mut(&mut out, "out")?;
    match (&k_cache, &v_cache) {
        (CacheRef::F32(k), CacheRef::F32(v)) => {
            let (kc, vc) = (contiguous(k, "k_cache")?, contiguous(v, "v_cache")?);
            py.detach(|| f32k(qs, q_stride, os, out_stride, r, l, t, kc, vc, bs, hs, scale, window, softcap, see))
        }
        (CacheRef::F16(k), CacheRef::F16(v)) => {
            let (kc, vc) = (contiguous(k, "k_cache")?, contiguous(v, "v_cache")?);
            py.detach(|| f16k(qs, q_stride, os, out_stride, r, l, t, kc, vc, bs, hs, scale, window, softcap, see))
        }
        (CacheRef::Q8(k), CacheRef::Q8(v)) => {
            let (kc, vc) = (contiguous(k, "k_cache")?, contiguous(v, "v_cache")?);
            py.detach(|| q8k(qs, q_stride, os, out_stride, r, l, t, kc, vc, bs, hs, scale, window, softcap, see))
        }
        _ => return Err(PyValueError::new_err(MIXED)),
    }
    .map_err(verr)
}

/// rows int64 [B], seq_lens int32 [B], block_tables int32 [B, M]; caches as above.
#[pyfunction]
#[pyo3(signature = (q, out, rows, seq_lens, block_tables, k_cache, v_cache, num_heads, num_kv_heads, scale, window = 0, softcap = 0.0))]
#[allow(clippy::too_many_arguments)]
fn paged_decode<'py>(
    py: Python<'py>, q: PyReadonlyArrayDyn<'py, f32>, out: PyReadwriteArrayDyn<'py, f32>,
    rows: PyReadonlyArrayDyn<'py, i64>, seq_lens: PyReadonlyArrayDyn<'py, i32>, block_tables: PyReadonlyArrayDyn<'py, i32>,
    k_cache: Bound<'py, PyAny>, v_cache: Bound<'py, PyAny>, num_heads: usize, num_kv_heads: usize,
    scale: f32, window: usize, softcap: f32,
) -> PyResult<()> {
    attend(py, "paged_decode", q, out, rows, seq_lens, block_tables, k_cache, v_cache, num_heads, num_kv_heads, scale,
           window, softcap, (|q, qs, o, os, r, l, t, k, v, bs, hs, sc, w, sf, _| attention::paged_decode::<f32>(
               q, qs, o, os, r, l, t, k, v, bs, hs, sc, w, sf),
           |q, qs, o, os, r, l, t, k, v, bs, hs, sc, w, sf, _| attention::paged_decode::<F16>(
               q, qs, o, os, r, l, t, k, v, bs, hs, sc, w, sf),
           |q, qs, o, os, r, l, t, k, v, bs, hs, sc, w, sf, _| attention::paged_decode::<i8>(
               q, qs, o, os, r, l, t, k, v, bs, hs, sc, w, sf)), None)
}

/// Prefill attention: rows starts[b]..starts[b + 1] of q (a chunk of sequence b) over the
/// sequence's paged context of seq_lens[b] positions, causal within the chunk.
/// starts int64 [B + 1], seq_lens int32 [B], block_tables int32 [B, M]; caches as above.
#[pyfunction]
#[pyo3(signature = (q, out, starts, seq_lens, block_tables, k_cache, v_cache, num_heads, num_kv_heads, scale, window = 0, softcap = 0.0, see = None))]
#[allow(clippy::too_many_arguments)]
fn paged_prefill<'py>(
    py: Python<'py>, q: PyReadonlyArrayDyn<'py, f32>, out: PyReadwriteArrayDyn<'py, f32>,
    starts: PyReadonlyArrayDyn<'py, i64>, seq_lens: PyReadonlyArrayDyn<'py, i32>, block_tables: PyReadonlyArrayDyn<'py, i32>,
    k_cache: Bound<'py, PyAny>, v_cache: Bound<'py, PyAny>, num_heads: usize, num_kv_heads: usize,
    scale: f32, window: usize, softcap: f32, see: Option<PyReadonlyArrayDyn<'py, i32>>,
) -> PyResult<()> {
    attend(py, "paged_prefill", q, out, starts, seq_lens, block_tables, k_cache, v_cache, num_heads, num_kv_heads,
           scale, window, softcap, (prefill::paged_prefill_see::<f32>, prefill::paged_prefill_see::<F16>,
                                    prefill::paged_prefill_see::<i8>), see)
}

/// One linear layer of the decoder: its weight segments (format, interleaved, blocks, rows,
/// cols) and its bias.
struct Linear {
    segs: Vec<(QType, Lay, Py<PyArrayDyn<u8>>, usize, usize)>,
    bias: Option<Py<PyArrayDyn<f32>>>,
}

struct Layer {
    in_norm: Py<PyArrayDyn<f32>>,
    post_norm: Py<PyArrayDyn<f32>>,
    lin: [Linear; 4], // qkv, o, gate_up, down
}

/// The weights of one decode call, borrowed read-only from their arrays for the call.
struct Borrowed<'py> {
    bytes: Vec<PyReadonlyArrayDyn<'py, u8>>,
    floats: Vec<PyReadonlyArrayDyn<'py, f32>>,
}

fn f32_array<'py>(a: &Bound<'py, PyAny>, what: &str) -> PyResult<Bound<'py, PyArrayDyn<f32>>> {
    let arr = a.cast::<PyArrayDyn<f32>>().map_err(|_| PyValueError::new_err(format!("{what}: expected a float32 array")))?;
    if !arr.is_c_contiguous() {
        return Err(PyValueError::new_err(format!("{what}: expected a C-contiguous array")));
    }
    Ok(arr.clone())
}

/// Every decoder layer of a quantized model for decode-only steps, in one call per step
/// (`cpu_kernels::decoder::decode_layers`). Holds the weight arrays it was given (the
/// model's own) and borrows them read-only for each call.
#[pyclass(module = "edgepaged._native.ops")]
pub struct QuantDecoder {
    layers: Vec<Layer>,
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
        let mut out = Vec::new();
        for layer in layers.try_iter()? {
            let (inn, post, lins): (Bound<'_, PyAny>, Bound<'_, PyAny>, Vec<Bound<'_, PyAny>>) = layer?.extract()?;
            if lins.len() != 4 {
                return Err(PyValueError::new_err("QuantDecoder: each layer needs [qkv, o, gate_up, down]"));
            }
            let mut linears = Vec::new();
            for lin in lins {
                let (segs, bias): (Vec<(Bound<'_, PyAny>, u32, usize, usize)>, Option<Bound<'_, PyAny>>) = lin.extract()?;
                let mut kept = Vec::new();
                for (data, qt, rows, cols) in segs {
                    let (q, lay) = qtype(qt)?;
                    let arr = data.cast::<PyArrayDyn<u8>>()
                        .map_err(|_| PyValueError::new_err("QuantDecoder: a weight must be a uint8 array"))?;
                    part(q, lay, contiguous(&arr.readonly(), "weight")?, rows, cols)?;
                    kept.push((q, lay, arr.clone().unbind(), rows, cols));
                }
                let bias = bias.map(|b| f32_array(&b, "bias").map(Bound::unbind)).transpose()?;
                linears.push(Linear { segs: kept, bias });
            }
            let lin: [Linear; 4] = linears.try_into().map_err(|_| PyValueError::new_err("4 linears"))?;
            out.push(Layer {
                in_norm: f32_array(&inn, "input norm")?.unbind(),
                post_norm: f32_array(&post, "post norm")?.unbind(),
                lin,
            });
        }
        Ok(QuantDecoder {
            layers: out, hs: Heads { nh: num_heads, nkv: num_kv_heads, d: head_dim }, hidden,
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
        block_tables: PyReadonlyArrayDyn<'_, i32>, kv_cache: Bound<'_, PyAny>,
        cos: PyReadonlyArrayDyn<'_, f32>, sin: PyReadonlyArrayDyn<'_, f32>, scale: f32, window: usize,
    ) -> PyResult<()> {
        let mut kv_cache = cache_mut(&kv_cache, "kv_cache")?;
        let kshape = kv_cache.shape();
        if kshape.len() != 6 || kshape[0] != self.layers.len() || kshape[1] != 2 || kshape[4] != self.hs.nkv
            || kshape[5] != kv_cache.units(self.hs.d)
        {
            return Err(PyValueError::new_err("QuantDecoder.decode: kv_cache must be [layers, 2, blocks, block_size, Hkv, D]"));
        }
        let (t, hidden) = rows_cols(h.shape());
        if hidden != self.hidden {
            return Err(PyValueError::new_err(format!("QuantDecoder.decode: h rows of {hidden}, model hidden {}", self.hidden)));
        }
        // borrow every weight read-only for the call (the arrays are the model's; nobody
        // writes them, and numpy's borrow tracking would refuse it if somebody did)
        let mut held = Borrowed { bytes: Vec::new(), floats: Vec::new() };
        for l in &self.layers {
            held.floats.push(l.in_norm.bind(py).readonly());
            held.floats.push(l.post_norm.bind(py).readonly());
            for lin in &l.lin {
                held.bytes.extend(lin.segs.iter().map(|s| s.2.bind(py).readonly()));
                held.floats.extend(lin.bias.iter().map(|b| b.bind(py).readonly()));
            }
        }
        let (mut bytes, mut floats) = (held.bytes.iter(), held.floats.iter());
        let mut next_f32 = || contiguous(floats.next().expect("borrowed above"), "weight");
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let (in_norm, post_norm) = (next_f32()?, next_f32()?);
            let mut lins = Vec::with_capacity(4);
            for lin in &l.lin {
                let mut segs = Vec::with_capacity(lin.segs.len());
                for &(q, lay, _, rows, cols) in &lin.segs {
                    let data = contiguous(bytes.next().expect("borrowed above"), "weight")?;
                    segs.push(part(q, lay, data, rows, cols)?);
                }
                let bias = if lin.bias.is_some() { Some(next_f32()?) } else { None };
                lins.push(QLinear { segs, bias });
            }
            let [qkv, o, gate_up, down]: [QLinear; 4] = lins.try_into().map_err(|_| PyValueError::new_err("4 linears"))?;
            layers.push(QLayer { in_norm, post_norm, qkv, o, gate_up, down });
        }
        let hsl = contiguous_mut(&mut h, "h")?;
        let (p, s) = (contiguous(&positions, "positions")?, contiguous(&slots, "slots")?);
        let (l, bt) = (contiguous(&seq_lens, "seq_lens")?, contiguous(&block_tables, "block_tables")?);
        let (c, sn) = (contiguous(&cos, "cos")?, contiguous(&sin, "sin")?);
        let step = DecodeStep {
            positions: p, slots: s, lens: l, tables: bt, cos: c, sin: sn, block_size: kshape[3], scale, window,
        };
        let (hs, inter, eps) = (self.hs, self.inter, self.eps);
        match &mut kv_cache {
            CacheMut::F32(a) => {
                let kv = contiguous_mut(a, "kv_cache")?;
                py.detach(|| decode_layers(&layers, hs, hidden, inter, eps, hsl, t, &step, kv))
            }
            CacheMut::F16(a) => {
                let kv = contiguous_mut(a, "kv_cache")?;
                py.detach(|| decode_layers(&layers, hs, hidden, inter, eps, hsl, t, &step, kv))
            }
            CacheMut::Q8(a) => {
                let kv = contiguous_mut(a, "kv_cache")?;
                py.detach(|| decode_layers(&layers, hs, hidden, inter, eps, hsl, t, &step, kv))
            }
        }
        .map_err(verr)
    }
}

/// Whether `paged_prefill` over an f16 or q8_0 cache multiplies in bf16 (f32 sums): where the
/// CPU has AVX-512 BF16, unless EDGEPAGED_ATTENTION_BF16=0; `on` turns it on or off for the
/// process first. An f32 cache always attends in f32.
#[pyfunction]
#[pyo3(signature = (on=None))]
fn bf16_attention(on: Option<bool>) -> bool {
    if let Some(on) = on {
        cpu_kernels::isa::set_bf16_attention(on);
    }
    cpu_kernels::isa::bf16_attention()
}

/// Whether the bf16 prefill tiles of a chunk of 4 tiles (97 rows) or more, without a window,
/// read K and V rows converted once for all of them rather than each converting its own (the
/// same bits either way); `on` turns it on or off for the process first.
#[pyfunction]
#[pyo3(signature = (on=None))]
fn prefill_shared_rows(on: Option<bool>) -> bool {
    if let Some(on) = on {
        cpu_kernels::prefill::set_shared_rows(on);
    }
    cpu_kernels::prefill::shared_rows()
}

/// Positions per segment of a long context's decode attention (512 unless
/// EDGEPAGED_DECODE_SEG says otherwise; 0: none); `positions` sets it for the process first.
#[pyfunction]
#[pyo3(signature = (positions=None))]
fn decode_seg(positions: Option<usize>) -> usize {
    if let Some(n) = positions {
        cpu_kernels::attention::set_decode_seg(n);
    }
    cpu_kernels::attention::decode_seg()
}

pub(crate) fn module(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    let m = PyModule::new(py, "ops")?;
    m.add_function(wrap_pyfunction!(decode_seg, &m)?)?;
    m.add_function(wrap_pyfunction!(prefill_shared_rows, &m)?)?;
    m.add_function(wrap_pyfunction!(bf16_attention, &m)?)?;
    m.add_function(wrap_pyfunction!(add_rms_norm, &m)?)?;
    m.add_function(wrap_pyfunction!(silu_mul, &m)?)?;
    m.add_function(wrap_pyfunction!(softmax_rows, &m)?)?;
    m.add_function(wrap_pyfunction!(rope_write_kv, &m)?)?;
    m.add_function(wrap_pyfunction!(paged_decode, &m)?)?;
    m.add_function(wrap_pyfunction!(paged_prefill, &m)?)?;
    m.add_class::<QuantDecoder>()?;
    Ok(m)
}
