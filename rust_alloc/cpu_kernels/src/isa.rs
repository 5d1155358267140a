//! The instruction sets the kernels have code paths for, detected at run time.

/// A code path, from the portable one up; a CPU that runs one runs every one below it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    /// AVX2 + FMA + F16C (256-bit)
    Avx2,
    /// AVX-512 F/BW/VL + VNNI, with AVX2/FMA/F16C (512-bit integer dot products)
    Avx512Vnni,
}

impl Isa {
    /// The best path this CPU runs.
    pub fn cpu() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            if avx2 && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl") && is_x86_feature_detected!("avx512vnni")
            {
                return Isa::Avx512Vnni;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512-vnni",
        }
    }

    /// Every path up to `top` this CPU runs, the portable one first.
    pub fn available(top: Isa) -> Vec<Isa> {
        let best = Isa::cpu().min(top);
        [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni].into_iter().filter(|&i| i <= best).collect()
    }

    /// `self` if the CPU runs it, capped at `top` (the best path a kernel family has).
    pub(crate) fn for_kernels(self, top: Isa) -> Result<Isa, String> {
        if self > Isa::cpu() {
            return Err(format!("this CPU cannot run the {} kernels", self.name()));
        }
        Ok(self.min(top))
    }
}

/// Whether the CPU has AVX-512 F (with AVX2, FMA and F16C): the float kernels' 16-lane paths.
pub fn has_avx512f() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx512f") && Isa::cpu() >= Isa::Avx2
            && std::env::var("EDGEPAGED_NO_AVX512").map_or(true, |v| v.is_empty() || v == "0"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether the CPU has AVX-512 BF16 (with the 16-lane float paths): `vdpbf16ps`.
pub fn has_avx512bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| has_avx512f() && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bf16"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// 0: not decided yet (the environment decides), 1: on, 2: off.
static BF16_ATTENTION: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Whether prefill attention's tiles over an f16 or q8_0 cache multiply in bf16 (sums in f32):
/// where the CPU has AVX-512 BF16, unless `EDGEPAGED_ATTENTION_BF16=0` (or after
/// `set_bf16_attention(false)`). The CPU runtime then gives every prompt row to the tiles (never
/// row by row), so a prompt's answer does not depend on whether its prefix was cached.
pub fn bf16_attention() -> bool {
    use std::sync::atomic::Ordering;
    let mut v = BF16_ATTENTION.load(Ordering::Relaxed);
    if v == 0 {
        let off = std::env::var("EDGEPAGED_ATTENTION_BF16").is_ok_and(|v| v.trim() == "0");
        v = if off { 2 } else { 1 };
        BF16_ATTENTION.store(v, Ordering::Relaxed);
    }
    v == 1 && has_avx512bf16()
}

/// Turn bf16 products in prefill attention on or off for the process (benchmarks alternate).
pub fn set_bf16_attention(on: bool) {
    BF16_ATTENTION.store(if on { 1 } else { 2 }, std::sync::atomic::Ordering::Relaxed);
}

/// Bytes ahead of its reads a decode step's product asks the memory for (0: the hardware's
/// prefetch alone); usize::MAX: not read from the environment yet.
static DECODE_PREFETCH: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(usize::MAX);

/// How far ahead (bytes) the integer kernels (and the exact ones' interleaved products) prefetch
/// a decode step's weights: 8192 unless `EDGEPAGED_DECODE_PREFETCH` says otherwise (0 turns it
/// off; at most 1 MiB). Measured on a Zen 4, one
/// stream of the 1 B and 3 B Q4_K_M files: +20-44 % (bench/prefetch_bench.py, RESULTS.md).
pub fn decode_prefetch() -> usize {
    use std::sync::atomic::Ordering::Relaxed;
    let v = DECODE_PREFETCH.load(Relaxed);
    if v != usize::MAX {
        return v;
    }
    let v = std::env::var("EDGEPAGED_DECODE_PREFETCH").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(8192usize);
    set_decode_prefetch(v);
    DECODE_PREFETCH.load(Relaxed)
}

/// Set `decode_prefetch` for the process (benchmarks alternate); at most 1 MiB.
pub fn set_decode_prefetch(bytes: usize) {
    DECODE_PREFETCH.store(bytes.min(1 << 20), std::sync::atomic::Ordering::Relaxed);
}
