//! Python binding of the quantized kernels (`quant`): numpy arrays in, no copies, the GIL
//! released while they run. Torch CPU tensors pass through `tensor.numpy()`, which shares
//! their memory; a non-contiguous row stride is fine as long as each row is contiguous.

use numpy::{PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::quant::{self, Isa, QMatrix, QType, QuantError, X8_FLAG};

fn verr(e: QuantError) -> PyErr { PyValueError::new_err(e.0) }

/// A GGML type id, plus `X8_FLAG` for interleaved weights -> (format, interleaved).
pub(crate) fn qtype(id: u32) -> PyResult<(QType, bool)> {
    let x8 = id & X8_FLAG != 0;
    let q = QType::from_ggml(id & !X8_FLAG).ok_or_else(|| {
        PyValueError::new_err(format!("GGML type {id} is not supported by the quantized kernels (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)"))
    })?;
    if x8 && !q.interleavable() {
        return Err(PyValueError::new_err(format!("{} weights cannot be interleaved", q.name())));
    }
    Ok((q, x8))
}

fn isa(scalar: bool) -> Isa { if scalar { Isa::Scalar } else { Isa::best() } }

/// (rows, cols, row stride in elements) of a 1-D or 2-D float32 array whose rows are contiguous.
fn geometry<T>(a: &Bound<'_, PyArrayDyn<T>>, what: &str) -> PyResult<(usize, usize, usize)>
where
    T: numpy::Element,
{
    let shape = a.shape();
    let strides = a.strides();
    let item = std::mem::size_of::<T>() as isize;
    let (rows, cols, rs, cs) = match shape.len() {
        1 => (1, shape[0], shape[0] as isize * item, strides[0]),
        2 => (shape[0], shape[1], strides[0], strides[1]),
        n => return Err(PyValueError::new_err(format!("{what}: expected a 1-D or 2-D array, got {n}-D"))),
    };
    if cols > 1 && cs != item {
        return Err(PyValueError::new_err(format!("{what}: rows must be contiguous")));
    }
    if rows > 1 && (rs < 0 || rs % item != 0) {
        return Err(PyValueError::new_err(format!("{what}: unsupported row stride {rs} bytes")));
    }
    let stride = if rows > 1 { (rs / item) as usize } else { cols };
    Ok((rows, cols, stride))
}

fn span(rows: usize, cols: usize, stride: usize) -> usize { if rows == 0 { 0 } else { (rows - 1) * stride + cols } }

fn weight_bytes<'a>(w: &'a PyReadonlyArrayDyn<'_, u8>) -> PyResult<&'a [u8]> {
    w.as_slice().map_err(|_| PyValueError::new_err("weight: expected a C-contiguous uint8 array of GGUF blocks"))
}

/// The matrix in `data`; its rows from the bytes, or `rows` (an interleaved matrix stores
/// them rounded up to a multiple of 8).
fn matrix<'a>((q, x8): (QType, bool), data: &'a [u8], cols: usize, rows: Option<usize>) -> PyResult<QMatrix<'a>> {
    let rb = q.row_bytes(cols).map_err(verr)?;
    let unit = if x8 { 8 * rb } else { rb };
    if data.len() % unit != 0 {
        return Err(PyValueError::new_err(format!(
            "weight: {} bytes are not whole {} {} of {cols} weights ({unit} bytes each)",
            data.len(),
            q.name(),
            if x8 { "groups of 8 interleaved rows" } else { "rows" },
        )));
    }
    let stored = data.len() / rb;
    let rows = match rows {
        Some(n) if n <= stored && n + if x8 { 8 } else { 1 } > stored => n,
        Some(n) => return Err(PyValueError::new_err(format!("weight has {stored} rows but out has {n} columns"))),
        None => stored,
    };
    QMatrix::with_layout(q, x8, data, rows, cols).map_err(verr)
}

/// out[t, :] = W · x[t, :] for a GGUF-quantized W [N, K] (uint8 blocks, N = out.shape[-1],
/// K = x.shape[-1]); x [T, K] or [K] float32, out [T, N] or [N] float32, written in place.
#[pyfunction]
#[pyo3(signature = (weight, qtype, x, out, *, scalar = false))]
fn quant_matmul(
    py: Python<'_>, weight: PyReadonlyArrayDyn<'_, u8>, qtype: u32, x: PyReadonlyArrayDyn<'_, f32>,
    mut out: numpy::PyReadwriteArrayDyn<'_, f32>, scalar: bool,
) -> PyResult<()> {
    let q = self::qtype(qtype)?;
    let (t, k, xs) = geometry(&x, "x")?;
    let (to, n, os) = geometry(&out, "out")?;
    if t != to {
        return Err(PyValueError::new_err(format!("x has {t} rows but out has {to}")));
    }
    let data = weight_bytes(&weight)?;
    let w = matrix(q, data, k, Some(n))?;
    // SAFETY: spans computed from the arrays' own shapes and strides; numpy's borrow
    // tracking has refused overlapping x/out.
    let xsl = unsafe { std::slice::from_raw_parts(x.as_array().as_ptr(), span(t, k, xs)) };
    let osl = unsafe { std::slice::from_raw_parts_mut(out.as_array_mut().as_mut_ptr(), span(t, n, os)) };
    let isa = isa(scalar);
    py.detach(move || quant::matmul(&w, xsl, xs, t, osl, os, isa)).map_err(verr)
}

/// Dequantize weight rows row_start .. row_start + out.shape[0] into out [R, K] float32.
#[pyfunction]
#[pyo3(signature = (weight, qtype, out, row_start = 0, *, scalar = false))]
fn quant_dequantize(
    py: Python<'_>, weight: PyReadonlyArrayDyn<'_, u8>, qtype: u32, mut out: numpy::PyReadwriteArrayDyn<'_, f32>,
    row_start: usize, scalar: bool,
) -> PyResult<()> {
    let q = self::qtype(qtype)?;
    let (r, k, os) = geometry(&out, "out")?;
    let data = weight_bytes(&weight)?;
    let w = matrix(q, data, k, None)?;
    let osl = unsafe { std::slice::from_raw_parts_mut(out.as_array_mut().as_mut_ptr(), span(r, k, os)) };
    let isa = isa(scalar);
    py.detach(move || quant::dequantize(&w, row_start, osl, r, os, isa)).map_err(verr)
}

/// out[i] = dequantized weight row rows[i] (an embedding lookup); rows int64 [R], out [R, K].
#[pyfunction]
#[pyo3(signature = (weight, qtype, rows, out, *, scalar = false))]
fn quant_gather_rows(
    py: Python<'_>, weight: PyReadonlyArrayDyn<'_, u8>, qtype: u32, rows: PyReadonlyArrayDyn<'_, i64>,
    mut out: numpy::PyReadwriteArrayDyn<'_, f32>, scalar: bool,
) -> PyResult<()> {
    let q = self::qtype(qtype)?;
    let (r, k, os) = geometry(&out, "out")?;
    let data = weight_bytes(&weight)?;
    let w = matrix(q, data, k, None)?;
    let ids = rows.as_slice().map_err(|_| PyValueError::new_err("rows: expected a contiguous int64 array"))?;
    if ids.len() != r {
        return Err(PyValueError::new_err(format!("{} rows requested but out has {r}", ids.len())));
    }
    let osl = unsafe { std::slice::from_raw_parts_mut(out.as_array_mut().as_mut_ptr(), span(r, k, os)) };
    let isa = isa(scalar);
    py.detach(move || quant::gather_rows(&w, ids, osl, os, isa)).map_err(verr)
}

/// GGUF blocks [rows, row_bytes] of a Q4_0/Q4_1/Q8_0 weight interleaved in groups of 8 rows
/// for the kernels (pass the type id plus `x8_flag` with it): uint8 [ceil(rows / 8), 8 * row_bytes].
/// A writable C-contiguous array whose rows are a multiple of 8 is rewritten in place (the
/// result is a view of it); others are copied.
#[pyfunction]
fn quant_interleave<'py>(py: Python<'py>, weight: Bound<'py, numpy::PyArrayDyn<u8>>, qtype: u32, rows: usize) -> PyResult<Bound<'py, PyAny>> {
    let (q, x8) = self::qtype(qtype)?;
    if x8 {
        return Err(PyValueError::new_err("quant_interleave: the weight is interleaved already"));
    }
    let len = weight.len();
    let rb = if rows == 0 { 0 } else { len / rows };
    if rows == 0 || rb * rows != len || rb % q.block_bytes() != 0 {
        return Err(PyValueError::new_err(format!("quant_interleave: {len} bytes are not {rows} rows of {} blocks", q.name())));
    }
    let cols = rb / q.block_bytes() * q.block_weights();
    let shape = [rows.div_ceil(8), 8 * rb];
    if rows % 8 == 0 && weight.is_c_contiguous() {
        // (not writeable, or borrowed elsewhere: copied below)
        if let Ok(mut rw) = weight.try_readwrite() {
            let data = rw.as_slice_mut().map_err(|_| PyValueError::new_err("quant_interleave: not contiguous"))?;
            py.detach(|| quant::interleave_in_place(q, data, rows, cols)).map_err(verr)?;
            drop(rw);
            return Ok(weight.reshape(shape)?.into_any());
        }
    }
    let ro = weight.readonly();
    let data = weight_bytes(&ro)?;
    let out = py.detach(|| quant::interleave(q, data, rows, cols)).map_err(verr)?;
    Ok(numpy::PyArray1::from_vec(py, out).reshape(shape)?.into_any())
}

/// {"isa": "avx2" | "scalar", "threads": n, "formats": {name: (ggml_type, block_weights, block_bytes)}}
#[pyfunction]
fn quant_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("isa", Isa::best().name())?;
    d.set_item("threads", quant::num_threads())?;
    let f = PyDict::new(py);
    for q in QType::ALL {
        f.set_item(q.name(), (q as u32, q.block_weights(), q.block_bytes()))?;
    }
    d.set_item("formats", f)?;
    d.set_item("x8_flag", X8_FLAG)?;
    d.set_item("interleavable", QType::ALL.iter().filter(|q| q.interleavable()).map(|q| *q as u32).collect::<Vec<_>>())?;
    Ok(d)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quant_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(quant_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(quant_gather_rows, m)?)?;
    m.add_function(wrap_pyfunction!(quant_info, m)?)?;
    m.add_function(wrap_pyfunction!(quant_interleave, m)?)?;
    Ok(())
}
