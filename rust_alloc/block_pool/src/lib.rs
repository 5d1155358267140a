//! edgepaged's KV-cache block pool: a fixed set of blocks with refcounts, an intrusive LRU
//! free list, the prefix cache (a hash chain verified token by token on a hit), per-sequence
//! block tables and copy-on-write. Plain safe Rust: no `unsafe`, no Python.

#![forbid(unsafe_code)]

mod hash;
pub mod pool;

pub use pool::{AllocError, BlockPool, Counters, Sequence, StepPlan};

#[cfg(test)]
mod tests;
