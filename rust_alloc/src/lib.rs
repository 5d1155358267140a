//! edgepaged's KV-cache block allocator. The core (`pool`) is plain Rust; `python` binds it
//! to Python as `edgepaged._rust_alloc` when built with the `python` feature (maturin).

pub mod cpuops;
mod hash;
pub mod pool;
pub mod quant;
#[cfg(feature = "python")]
mod python;
#[cfg(feature = "python")]
mod python_quant;
#[cfg(feature = "python")]
mod python_ops;

pub use pool::{AllocError, BlockPool, StepPlan};

#[cfg(test)]
mod tests;
