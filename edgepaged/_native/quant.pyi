"""`edgepaged._native.quant`: products on GGUF-quantized weights (crate rust_alloc/cpu_kernels,
bound in rust_alloc/python/src/quant.rs).

`weight`: the GGUF block bytes of a [N, K] matrix, C-contiguous uint8 (any shape); `qtype`:
the GGML type id (1 F16, 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K,
30 BF16), plus `info()["x8_flag"]` for weights from `interleave`, or `info()["r16_flag"]`
for weights from `repack` (their products quantize the activations to int8 per block of
32 and use 8-bit dot products; dequantize and gather_rows stay exact). Activations and outputs are C-contiguous float32 arrays used in
place (torch CPU tensors through `.numpy()`). The GIL is released while they run;
`scalar=True` forces the portable path.
"""

from typing import TypedDict

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

class Formats(TypedDict, total=False):
    F16: tuple[int, int, int]
    Q4_0: tuple[int, int, int]
    Q4_1: tuple[int, int, int]
    Q5_0: tuple[int, int, int]
    Q5_1: tuple[int, int, int]
    Q8_0: tuple[int, int, int]
    Q4_K: tuple[int, int, int]
    Q5_K: tuple[int, int, int]
    Q6_K: tuple[int, int, int]
    BF16: tuple[int, int, int]

class Info(TypedDict):
    isa: str            # the exact kernels' path: "avx2" or "scalar"
    int8_isa: str       # the integer kernels' path: "avx512-vnni", "avx2" or "scalar"
    threads: int        # kernel threads, the caller included (EDGEPAGED_NUM_THREADS)
    formats: Formats    # name -> (ggml type id, weights per block, bytes per block)
    x8_flag: int        # added to a type id for interleaved weights
    interleavable: list[int]  # type ids that can be interleaved (Q4_0, Q4_1, Q8_0)
    r16_flag: int       # added to a type id for repacked weights
    repackable: list[int]     # type ids that can be repacked (every block format)

def matmul(
    weight: U8, qtype: int, x: F32, out: F32, *, col: int = 0, rows: int | None = None, scalar: bool = False
) -> None:
    """out[t, col:col + N] = W x[t] for x [T, K] (or [K]) into out [T, M] (or [M]); N is
    `rows`, or the rest of out's width. fp32 accumulation; blocks decoded in registers exactly
    as gguf.quants.dequantize does."""
def dequantize(weight: U8, qtype: int, out: F32, row_start: int = 0, *, scalar: bool = False) -> None:
    """Rows row_start .. row_start + out.shape[0] of W, decoded into out [R, K]."""
def gather_rows(weight: U8, qtype: int, rows: npt.NDArray[np.int64], out: F32, *, scalar: bool = False) -> None:
    """out[i] = row rows[i] of W, decoded (an embedding lookup)."""
def interleave(weight: U8, qtype: int, rows: int) -> U8:
    """GGUF blocks [rows, row_bytes] re-laid out in groups of 8 rows (each block's bytes spread
    across the 8 rows): uint8 [ceil(rows / 8), 8 * row_bytes], the last group padded with
    zeros. A writable C-contiguous array whose rows are a multiple of 8 is rewritten in
    place (the result is a view of it)."""
def repack(weight: U8, qtype: int, rows: int) -> U8:
    """GGUF blocks [rows, row_bytes] repacked for the integer kernels in groups of 16 rows:
    uint8 [ceil(rows / 16), bytes per 16 rows] (the file's bytes; K-quants 2-3% more), a new
    array; rows past `rows` are zero."""
def repack_parts(parts: list[U8], qtype: int, part_rows: list[int]) -> U8:
    """`repack` of the parts' rows stacked (each [rows_i, row_bytes], every part but the last a
    multiple of 16 rows), read where they lie: no stacked copy first."""
def info() -> Info: ...

def int8_peak_gops(reps: int = 3) -> float | None:
    """The int8 products' limit on this CPU: GOPS of `vpdpbusd` (AVX-512 VNNI) on every thread
    of the kernels' pool at once, the best of `reps` passes; None without AVX-512 VNNI."""

def read_gbs(mib: int = 1024, reps: int = 3) -> float:
    """The memory's read bandwidth as the decode kernels meet it, GB/s: every thread of the
    kernels' pool streams its share of a `mib` MiB buffer (the decode's prefetch on, then off),
    the best of `reps` passes each."""

def tile_groups(many: bool | None = None) -> bool:
    """Whether the exact products' tiles for a few tokens (2 to 8 on 16 lanes, to 5 on 8) run
    several groups of rows at once (the default: more FMA chains in flight) or one at a time;
    `many` sets it for the process first (benchmarks alternate). The same results either
    way."""


def decode_prefetch(bytes: int | None = None) -> int:
    """How far ahead (bytes) the integer kernels prefetch a decode step's weights: 8192 unless
    EDGEPAGED_DECODE_PREFETCH says otherwise (0: the hardware's prefetch alone); `bytes` sets
    it for the process first (at most 1 MiB)."""
