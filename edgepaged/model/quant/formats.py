"""GGUF block formats the CPU kernels read, and one weight held as its GGUF bytes.

Q4_0, Q4_1 and Q8_0 weights are interleaved at load (`QuantWeight.interleave`): rows in
groups of 8, each block's bytes spread across the 8 rows, so the kernels read 8 rows' weight
`k` as 8 consecutive bytes (no transposes while decoding). Same bytes, same results
(docs/INTERNALS.md, "Quantized weights on CPU").
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..._native import quant as kernels

# GGML type id -> name, for the formats the kernels read (F16 and BF16 in blocks of 32)
FORMATS = {1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
           30: "BF16"}
BLOCK = {1: (32, 64), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144),
         13: (256, 176), 14: (256, 210), 30: (32, 64)}  # weights, bytes
X8_FLAG = 0x100                 # added to a type id for interleaved weights (the Rust side's X8_FLAG)
INTERLEAVABLE = (2, 3, 8)       # Q4_0, Q4_1, Q8_0


def can_keep(qtype: int, shape) -> bool:
    """Whether a GGUF tensor of this type and (rows, cols) shape can stay quantized."""
    return qtype in FORMATS and len(shape) == 2 and shape[1] % BLOCK[qtype][0] == 0


@dataclass
class QuantWeight:
    """A [rows, cols] weight as GGUF blocks: `data` uint8 [rows, row_bytes], C-contiguous; or,
    once `interleave`d (`x8`), [ceil(rows / 8), 8 * row_bytes] in groups of 8 rows."""
    qtype: int
    data: np.ndarray
    rows: int
    cols: int
    x8: bool = False

    def __post_init__(self):
        bw, bb = BLOCK[self.qtype]
        rb = self.cols // bw * bb
        want = (-(-self.rows // 8), 8 * rb) if self.x8 else (self.rows, rb)
        if self.cols % bw or self.data.shape != want:
            raise ValueError(f"{FORMATS[self.qtype]} weight [{self.rows}, {self.cols}]: bad block bytes "
                             f"{self.data.shape}")
        self.data = np.ascontiguousarray(self.data, dtype=np.uint8)

    @property
    def kind(self) -> int:
        """The type id the kernels take: the GGML id, plus X8_FLAG when interleaved."""
        return self.qtype | X8_FLAG if self.x8 else self.qtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def interleave(self) -> bool:
        """Re-lay the blocks out in groups of 8 rows where the format allows it; True if the
        weight is interleaved afterwards. The array is rewritten in place when its rows are
        a multiple of 8 (no second copy of the weights while loading): nothing else may
        hold it."""
        if not self.x8 and self.qtype in INTERLEAVABLE:
            self.data = kernels.interleave(self.data, self.qtype, self.rows)
            self.x8 = True
        return self.x8

    def dequantize_into(self, out: np.ndarray, row_start: int = 0) -> None:
        """Rows row_start .. row_start + len(out) as float32 into `out` [R, cols]."""
        kernels.dequantize(self.data, self.kind, out, row_start)

    def dequantize(self) -> np.ndarray:
        out = np.empty((self.rows, self.cols), np.float32)
        self.dequantize_into(out)
        return out
