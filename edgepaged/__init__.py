"""edgepaged: a local LLM runtime for a home server."""
import os as _os

# numpy's OpenBLAS (the CPU runtime's GEMM for long prompts) keeps its threads spinning for
# ~2^28 cycles after each product; on a small box they then take the cores from the Rust
# kernels that run next (a 2 K-token prefill's attention ran 1.7x slower). 2^4 cycles: they
# sleep at once. Read when numpy loads, so only where edgepaged is imported first (the CLI).
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
