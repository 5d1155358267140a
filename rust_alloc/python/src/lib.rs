//! The extension module `edgepaged._native`: a thin PyO3 binding of the block pool and the
//! CPU kernels, one submodule per concern:
//!
//! - `edgepaged._native.blocks`: `BlockAllocator` and its errors (crate `block_pool`);
//! - `edgepaged._native.quant`: products, dequantizing and interleaving of GGUF blocks;
//! - `edgepaged._native.ops`: the fused operators, paged decode attention and `QuantDecoder`.
//!
//! Type stubs: `edgepaged/_native/*.pyi`. No `unsafe` here: arrays are taken C-contiguous and
//! borrowed through numpy's checked borrows.

#![forbid(unsafe_code)]

use pyo3::prelude::*;
use pyo3::types::PyDict;

mod blocks;
mod ops;
mod quant;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let modules = py.import("sys")?.getattr("modules")?.cast_into::<PyDict>()?;
    for (name, sub) in [("blocks", blocks::module(py)?), ("quant", quant::module(py)?), ("ops", ops::module(py)?)] {
        let full = format!("edgepaged._native.{name}");
        sub.setattr("__name__", &full)?;
        m.add(name, &sub)?;
        // so that `from edgepaged._native.blocks import BlockAllocator` works
        modules.set_item(full, &sub)?;
    }
    Ok(())
}
