//! edgepaged's CPU kernels: matrix products on GGUF-quantized weights (`quant`), the fused
//! operators around them (`ops`: norms, rotary + KV write, SiLU), paged decode attention
//! (`attention`), a whole decode step in one call (`decoder`) and the small thread pool they
//! share (`threads`).
//!
//! Every kernel picks its instruction set at run time (`isa::Isa::cpu`, capped at what the
//! kernel family has: `quant::best`, `q8::best`) and has a portable path. All of edgepaged's `unsafe` code lives in this crate; each block says why
//! it is sound in a `SAFETY:` comment.

#![deny(clippy::undocumented_unsafe_blocks)]

/// Compile `$body` (an `#[inline(always)]` fn) once more with AVX2+FMA+F16C enabled, as
/// `$name`; callers pick it when `ops::has_avx2()` says the CPU has them.
macro_rules! dispatch {
    ($name:ident, $body:ident, ($($arg:ident : $ty:ty),*)) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn $name($($arg: $ty),*) { $body($($arg),*) }
    };
}

pub mod attention;
pub mod decoder;
pub mod isa;
pub mod kv;
pub mod ops;
pub mod prefill;
pub mod q8;
pub mod quant;
pub mod threads;
#[cfg(test)]
mod testing;

pub use attention::paged_decode;
pub use prefill::{paged_prefill, paged_prefill_see};
pub use decoder::{decode_layers, DecodeStep, QLayer, QLinear};
pub use ops::{add_rms_norm, rope_write_kv, silu_mul, Heads, OpError};
pub use isa::Isa;
pub use quant::{QMatrix, QType, QuantError};
