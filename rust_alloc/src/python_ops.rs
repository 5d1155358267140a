//! Python binding of the fused CPU operators (`cpuops`): C-contiguous numpy arrays (torch CPU
//! tensors through `tensor.numpy()`, which shares their memory), written in place, the GIL
//! released while they run.

use numpy::{PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::cpuops::{self, Heads, OpError};

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
    Ok(())
}
