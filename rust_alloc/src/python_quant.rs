//! Python binding of the quantized kernels (`quant`): numpy arrays in, no copies, the GIL
//! released while they run. Torch CPU tensors pass through `tensor.numpy()`, which shares
//! their memory; a non-contiguous row stride is fine as long as each row is contiguous.

use numpy::{PyArrayDyn, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::quant::{self, Isa, QMatrix, QType, QuantError};

fn verr(e: QuantError) -> PyErr { PyValueError::new_err(e.0) }

fn qtype(id: u32) -> PyResult<QType> {
    QType::from_ggml(id).ok_or_else(|| {
        PyValueError::new_err(format!("GGML type {id} is not supported by the quantized kernels (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)"))
    })
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

fn matrix<'a>(q: QType, data: &'a [u8], cols: usize) -> PyResult<QMatrix<'a>> {
    let rb = q.row_bytes(cols).map_err(verr)?;
    if data.len() % rb != 0 {
        return Err(PyValueError::new_err(format!(
            "weight: {} bytes are not whole {} rows of {cols} weights ({rb} bytes each)",
            data.len(),
            q.name()
        )));
    }
    QMatrix::new(q, data, data.len() / rb, cols).map_err(verr)
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
    let w = matrix(q, data, k)?;
    if w.rows != n {
        return Err(PyValueError::new_err(format!("weight has {} rows but out has {n} columns", w.rows)));
    }
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
    let w = matrix(q, data, k)?;
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
    let w = matrix(q, data, k)?;
    let ids = rows.as_slice().map_err(|_| PyValueError::new_err("rows: expected a contiguous int64 array"))?;
    if ids.len() != r {
        return Err(PyValueError::new_err(format!("{} rows requested but out has {r}", ids.len())));
    }
    let osl = unsafe { std::slice::from_raw_parts_mut(out.as_array_mut().as_mut_ptr(), span(r, k, os)) };
    let isa = isa(scalar);
    py.detach(move || quant::gather_rows(&w, ids, osl, os, isa)).map_err(verr)
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
    Ok(d)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quant_matmul, m)?)?;
    m.add_function(wrap_pyfunction!(quant_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(quant_gather_rows, m)?)?;
    m.add_function(wrap_pyfunction!(quant_info, m)?)?;
    Ok(())
}
