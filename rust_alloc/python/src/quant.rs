//! `edgepaged._native.quant`: the quantized kernels on numpy arrays, no copies, the GIL
//! released while they run. Torch CPU tensors pass through `tensor.numpy()`, which shares
//! their memory. Activations and outputs are C-contiguous; a product may write a band of
//! the output's columns (`col`), so the parts of a fused weight fill one output.

use numpy::{PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyReadwriteArrayDyn, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use cpu_kernels::q8::{self, Layout, RMatrix};
use cpu_kernels::quant::{self, QMatrix, QType, QuantError, X8_FLAG};
use cpu_kernels::Isa;

fn verr(e: QuantError) -> PyErr { PyValueError::new_err(e.0) }

/// Added to a GGML type id for weights repacked for the integer kernels (`repack`).
pub(crate) const R16_FLAG: u32 = 0x200;

/// How a weight's bytes are laid out.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lay {
    /// GGUF's rows
    Rows,
    /// interleaved in groups of 8 rows (`interleave`)
    X8,
    /// repacked in groups of 16 rows for the integer kernels (`repack`)
    R16,
}

impl Lay {
    fn name(self) -> &'static str {
        match self {
            Lay::Rows => "in rows",
            Lay::X8 => "interleaved",
            Lay::R16 => "repacked",
        }
    }
}

/// A GGML type id, plus `X8_FLAG` or `R16_FLAG` -> (format, layout).
pub(crate) fn qtype(id: u32) -> PyResult<(QType, Lay)> {
    let lay = match id & (X8_FLAG | R16_FLAG) {
        0 => Lay::Rows,
        X8_FLAG => Lay::X8,
        R16_FLAG => Lay::R16,
        _ => return Err(PyValueError::new_err(format!("type id {id:#x}: one layout flag at most"))),
    };
    let q = QType::from_ggml(id & !(X8_FLAG | R16_FLAG)).ok_or_else(|| {
        let names: Vec<&str> = QType::ALL.iter().map(|q| q.name()).collect();
        PyValueError::new_err(format!("GGML type {id} is not supported by the quantized kernels ({})", names.join(", ")))
    })?;
    if lay == Lay::X8 && !q.interleavable() {
        return Err(PyValueError::new_err(format!("{} weights cannot be interleaved", q.name())));
    }
    if lay == Lay::R16 && !q8::supports(q) {
        return Err(PyValueError::new_err(format!("{} weights have no integer kernels", q.name())));
    }
    Ok((q, lay))
}

fn isa(scalar: bool) -> Isa { if scalar { Isa::Scalar } else { quant::best() } }

fn isa8(scalar: bool) -> Isa { if scalar { Isa::Scalar } else { q8::best() } }

/// A repacked matrix of `rows` (or, None, as many as its bytes hold) rows of `cols`.
pub(crate) fn rmatrix(q: QType, data: &[u8], rows: Option<usize>, cols: usize) -> PyResult<RMatrix<'_>> {
    let rows = match rows {
        Some(n) => n,
        None => {
            let per = Layout::new(q, 16, cols).map_err(verr)?.rg_bytes();
            if per == 0 || data.len() % per != 0 {
                return Err(PyValueError::new_err(format!("weight: {} bytes are not whole groups of 16 repacked {} rows",
                                                         data.len(), q.name())));
            }
            data.len() / per * 16
        }
    };
    RMatrix::new(Layout::new(q, rows, cols).map_err(verr)?, data).map_err(verr)
}

/// (rows, last dim) of an array seen as 2-D (a 1-D array is one row).
pub(crate) fn rows_cols(shape: &[usize]) -> (usize, usize) {
    match shape.split_last() {
        Some((&c, lead)) => (lead.iter().product(), c),
        None => (1, 1),
    }
}

pub(crate) fn contiguous<'a, T: numpy::Element>(a: &'a PyReadonlyArrayDyn<'_, T>, what: &str) -> PyResult<&'a [T]> {
    a.as_slice().map_err(|_| PyValueError::new_err(format!("{what}: expected a C-contiguous array")))
}

pub(crate) fn contiguous_mut<'a, T: numpy::Element>(a: &'a mut PyReadwriteArrayDyn<'_, T>, what: &str) -> PyResult<&'a mut [T]> {
    a.as_slice_mut().map_err(|_| PyValueError::new_err(format!("{what}: expected a C-contiguous array")))
}

/// The matrix in `data`; its rows from the bytes, or `rows` (an interleaved matrix stores
/// them rounded up to a multiple of 8).
pub(crate) fn matrix<'a>((q, lay): (QType, Lay), data: &'a [u8], cols: usize, rows: Option<usize>) -> PyResult<QMatrix<'a>> {
    let x8 = lay == Lay::X8;
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
        Some(n) => return Err(PyValueError::new_err(format!("weight has {stored} rows but {n} are asked for"))),
        None => stored,
    };
    QMatrix::with_layout(q, x8, data, rows, cols).map_err(verr)
}

/// out[t, col:col + N] = W · x[t] for a GGUF-quantized W [N, K] (uint8 blocks); x [T, K] or
/// [K] float32; out [T, M] or [M] float32 (M >= col + N), written in place. N is `rows`, or
/// the rest of out's width.
#[pyfunction]
#[pyo3(signature = (weight, qtype, x, out, *, col = 0, rows = None, scalar = false))]
#[allow(clippy::too_many_arguments)]
fn matmul(
    py: Python<'_>, weight: PyReadonlyArrayDyn<'_, u8>, qtype: u32, x: PyReadonlyArrayDyn<'_, f32>,
    mut out: PyReadwriteArrayDyn<'_, f32>, col: usize, rows: Option<usize>, scalar: bool,
) -> PyResult<()> {
    let q = self::qtype(qtype)?;
    let (t, k) = rows_cols(x.shape());
    let (to, m) = rows_cols(out.shape());
    if t != to {
        return Err(PyValueError::new_err(format!("x has {t} rows but out has {to}")));
    }
    let n = rows.unwrap_or(m.saturating_sub(col));
    if col + n > m {
        return Err(PyValueError::new_err(format!("columns {col}..{} do not fit out's {m}", col + n)));
    }
    let xs = contiguous(&x, "x")?;
    let os = &mut contiguous_mut(&mut out, "out")?[col..];
    if q.1 == Lay::R16 {
        let w = rmatrix(q.0, contiguous(&weight, "weight")?, Some(n), k)?;
        let isa = isa8(scalar);
        return py.detach(move || q8::matmul_f32(&w, xs, k, t, os, m, isa)).map_err(verr);
    }
    let w = matrix(q, contiguous(&weight, "weight")?, k, Some(n))?;
    let isa = isa(scalar);
    py.detach(move || quant::matmul(&w, xs, k, t, os, m, isa)).map_err(verr)
}

/// Dequantize weight rows row_start .. row_start + out.shape[0] into out [R, K] float32.
#[pyfunction]
#[pyo3(signature = (weight, qtype, out, row_start = 0, *, scalar = false))]
fn dequantize(
    py: Python<'_>, weight: PyReadonlyArrayDyn<'_, u8>, qtype: u32, mut out: PyReadwriteArrayDyn<'_, f32>,
    row_start: usize, scalar: bool,
) -> PyResult<()> {
    let q = self::qtype(qtype)?;
    let (r, k) = rows_cols(out.shape());
    let os = contiguous_mut(&mut out, "out")?;
    if q.1 == Lay::R16 {
        let w = rmatrix(q.0, contiguous(&weight, "weight")?, None, k)?;
        return py.detach(move || q8::dequantize(&w, row_start, os, r, k)).map_err(verr);
    }
    let w = matrix(q, contiguous(&weight, "weight")?, k, None)?;
    let isa = isa(scalar);
    py.detach(move || quant::dequantize(&w, row_start, os, r, k, isa)).map_err(verr)
}

/// out[i] = dequantized weight row rows[i] (an embedding lookup); rows int64 [R], out [R, K].
#[pyfunction]
#[pyo3(signature = (weight, qtype, rows, out, *, scalar = false))]
fn gather_rows(
    py: Python<'_>, weight: PyReadonlyArrayDyn<'_, u8>, qtype: u32, rows: PyReadonlyArrayDyn<'_, i64>,
    mut out: PyReadwriteArrayDyn<'_, f32>, scalar: bool,
) -> PyResult<()> {
    let q = self::qtype(qtype)?;
    let (r, k) = rows_cols(out.shape());
    let ids = contiguous(&rows, "rows")?;
    if ids.len() != r {
        return Err(PyValueError::new_err(format!("{} rows requested but out has {r}", ids.len())));
    }
    let os = contiguous_mut(&mut out, "out")?;
    if q.1 == Lay::R16 {
        let w = rmatrix(q.0, contiguous(&weight, "weight")?, None, k)?;
        return py.detach(move || q8::gather_rows(&w, ids, os, k)).map_err(verr);
    }
    let w = matrix(q, contiguous(&weight, "weight")?, k, None)?;
    let isa = isa(scalar);
    py.detach(move || quant::gather_rows(&w, ids, os, k, isa)).map_err(verr)
}

/// A weight in GGUF's row order about to be re-laid out by `what`: its format, row bytes and
/// columns, or ValueError (another layout already, or bytes that are not `rows` rows of blocks).
fn rows_layout(what: &str, qtype: u32, len: usize, rows: usize) -> PyResult<(QType, usize, usize)> {
    let (q, lay) = self::qtype(qtype)?;
    if lay != Lay::Rows {
        return Err(PyValueError::new_err(format!("{what}: the weight is {} already (not in GGUF's row order)",
                                                 lay.name())));
    }
    let rb = if rows == 0 { 0 } else { len / rows };
    if rows == 0 || rb * rows != len || rb % q.block_bytes() != 0 {
        return Err(PyValueError::new_err(format!("{what}: {len} bytes are not {rows} rows of {} blocks", q.name())));
    }
    Ok((q, rb, rb / q.block_bytes() * q.block_weights()))
}

/// GGUF blocks [rows, row_bytes] of a Q4_0/Q4_1/Q8_0 weight interleaved in groups of 8 rows
/// for the kernels (pass the type id plus `x8_flag` with it): uint8 [ceil(rows / 8), 8 * row_bytes].
/// A writable C-contiguous array whose rows are a multiple of 8 is rewritten in place (the
/// result is a view of it); others are copied.
#[pyfunction]
fn interleave<'py>(py: Python<'py>, weight: Bound<'py, PyArrayDyn<u8>>, qtype: u32, rows: usize) -> PyResult<Bound<'py, PyAny>> {
    let (q, rb, cols) = rows_layout("interleave", qtype, weight.len(), rows)?;
    let shape = [rows.div_ceil(8), 8 * rb];
    if rows % 8 == 0 && weight.is_c_contiguous() {
        // (not writeable, or borrowed elsewhere: copied below)
        if let Ok(mut rw) = weight.try_readwrite() {
            let data = contiguous_mut(&mut rw, "weight")?;
            py.detach(|| quant::interleave_in_place(q, data, rows, cols)).map_err(verr)?;
            drop(rw);
            return Ok(weight.reshape(shape)?.into_any());
        }
    }
    let ro = weight.readonly();
    let data = contiguous(&ro, "weight")?;
    let out = py.detach(|| quant::interleave(q, data, rows, cols)).map_err(verr)?;
    Ok(numpy::PyArray1::from_vec(py, out).reshape(shape)?.into_any())
}

/// GGUF blocks [rows, row_bytes] repacked for the integer kernels (pass the type id plus
/// `r16_flag` with it): uint8 [ceil(rows / 16), bytes per 16 rows], a new array.
#[pyfunction]
fn repack<'py>(py: Python<'py>, weight: PyReadonlyArrayDyn<'py, u8>, qtype: u32, rows: usize) -> PyResult<Bound<'py, PyAny>> {
    let data = contiguous(&weight, "weight")?;
    let (q, _, cols) = rows_layout("repack", qtype, data.len(), rows)?;
    let l = Layout::new(q, rows, cols).map_err(verr)?;
    let out = py.detach(|| q8::repack(q, data, rows, cols)).map_err(verr)?;
    Ok(numpy::PyArray1::from_vec(py, out).reshape([l.row_groups(), l.rg_bytes()])?.into_any())
}

/// `repack` of several row-layout parts stacked (a fused weight's Q/K/V or gate/up), read
/// in place: every part but the last a multiple of 16 rows.
#[pyfunction]
fn repack_parts<'py>(py: Python<'py>, parts: Vec<PyReadonlyArrayDyn<'py, u8>>, qtype: u32, part_rows: Vec<usize>)
                     -> PyResult<Bound<'py, PyAny>> {
    let slices = parts.iter().enumerate().map(|(i, p)| contiguous(p, &format!("part {i}"))).collect::<PyResult<Vec<_>>>()?;
    let rows: usize = part_rows.iter().sum();
    let total: usize = slices.iter().map(|s| s.len()).sum();
    let (q, _, cols) = rows_layout("repack_parts", qtype, total, rows)?;
    let l = Layout::new(q, rows, cols).map_err(verr)?;
    let out = py.detach(|| q8::repack_parts(q, &slices, &part_rows, cols)).map_err(verr)?;
    Ok(numpy::PyArray1::from_vec(py, out).reshape([l.row_groups(), l.rg_bytes()])?.into_any())
}

/// The int8 products' limit on this CPU (GOPS: `vpdpbusd` on every thread, the best of `reps`
/// passes), or None without AVX-512 VNNI.
#[pyfunction]
#[pyo3(signature = (reps=3))]
fn int8_peak_gops(py: Python<'_>, reps: usize) -> Option<f64> {
    py.detach(|| q8::int8_peak_gops(reps))
}

/// The memory's read bandwidth as the decode kernels meet it (GB/s): every thread of the pool
/// streams its share of a `mib` MiB buffer, the decode's prefetch on and off, the best of `reps`
/// passes each.
#[pyfunction]
#[pyo3(signature = (mib=1024, reps=3))]
fn read_gbs(py: Python<'_>, mib: usize, reps: usize) -> f64 {
    py.detach(|| q8::read_gbs(mib, reps))
}

/// How far ahead (bytes) the integer kernels prefetch a decode step's weights (8192 unless
/// EDGEPAGED_DECODE_PREFETCH says otherwise; 0: off); `bytes` sets it for the process first.
#[pyfunction]
#[pyo3(signature = (bytes=None))]
fn decode_prefetch(bytes: Option<usize>) -> usize {
    if let Some(b) = bytes {
        q8::set_decode_prefetch(b);
    }
    q8::decode_prefetch()
}

/// Whether the exact products' tiles for a few tokens (2 to 8 on 16 lanes, to 5 on 8) run
/// several groups of rows at once (the default: more FMA chains in flight) or one at a time;
/// `many` sets it for the process first (benchmarks alternate). The same results either way.
#[pyfunction]
#[pyo3(signature = (many=None))]
fn tile_groups(many: Option<bool>) -> bool {
    if let Some(m) = many {
        quant::set_tile_groups(m);
    }
    quant::tile_groups()
}

/// {"isa": "avx2" | "scalar", "int8_isa": "avx512-vnni" | "avx2" | "scalar", "threads": n,
/// "formats": {name: (ggml_type, block_weights, block_bytes)}, "x8_flag": 0x100,
/// "interleavable": [ggml_type, ...], "r16_flag": 0x200, "repackable": [ggml_type, ...]}
#[pyfunction]
fn info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("isa", quant::best().name())?;
    d.set_item("int8_isa", q8::best().name())?;
    // the exact products' interleaved paths take 16 rows a vector with AVX-512 F
    let lanes = match quant::best() {
        Isa::Scalar => 1,
        _ if cpu_kernels::isa::has_avx512f() => 16,
        _ => 8,
    };
    d.set_item("exact_lanes", lanes)?;
    d.set_item("threads", cpu_kernels::threads::num_threads())?;
    let f = PyDict::new(py);
    for q in QType::ALL {
        f.set_item(q.name(), (q as u32, q.block_weights(), q.block_bytes()))?;
    }
    d.set_item("formats", f)?;
    d.set_item("x8_flag", X8_FLAG)?;
    d.set_item("interleavable", QType::ALL.iter().filter(|q| q.interleavable()).map(|q| *q as u32).collect::<Vec<_>>())?;
    d.set_item("r16_flag", R16_FLAG)?;
    d.set_item("repackable", QType::ALL.iter().filter(|q| q8::supports(**q)).map(|q| *q as u32).collect::<Vec<_>>())?;
    Ok(d)
}

pub(crate) fn module(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    let m = PyModule::new(py, "quant")?;
    m.add_function(wrap_pyfunction!(matmul, &m)?)?;
    m.add_function(wrap_pyfunction!(dequantize, &m)?)?;
    m.add_function(wrap_pyfunction!(gather_rows, &m)?)?;
    m.add_function(wrap_pyfunction!(interleave, &m)?)?;
    m.add_function(wrap_pyfunction!(repack, &m)?)?;
    m.add_function(wrap_pyfunction!(repack_parts, &m)?)?;
    m.add_function(wrap_pyfunction!(info, &m)?)?;
    m.add_function(wrap_pyfunction!(int8_peak_gops, &m)?)?;
    m.add_function(wrap_pyfunction!(read_gbs, &m)?)?;
    m.add_function(wrap_pyfunction!(decode_prefetch, &m)?)?;
    m.add_function(wrap_pyfunction!(tile_groups, &m)?)?;
    Ok(m)
}
