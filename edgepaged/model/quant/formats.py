"""GGUF block formats the CPU kernels read, and one weight held as its GGUF bytes.

A weight is in one of three layouts:
- `rows`: GGUF's own, row by row (the exact kernels read it);
- `x8`: Q4_0/Q4_1/Q8_0 interleaved in groups of 8 rows (`QuantWeight.interleave`), each
  block's bytes spread across the 8 rows, so the exact kernels read 8 rows' weight `k` as 8
  consecutive bytes; same bytes, same results;
- `r16`: repacked in groups of 16 rows for the integer kernels (`QuantWeight.repack`):
  activations quantized to int8 per block of 32 (256 for K-quants) and 8-bit dot products, as llama.cpp
  computes them (docs/INTERNALS.md, "Quantized weights on CPU").
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
R16_FLAG = 0x200                # added to a type id for weights repacked for the integer kernels
INTERLEAVABLE = (2, 3, 8)       # Q4_0, Q4_1, Q8_0
REPACKABLE = (2, 3, 6, 7, 8, 12, 13, 14)   # every block format (not F16 / BF16)
LAYOUTS = ("rows", "x8", "r16")


_KERNEL_LAYOUTS: tuple[str, ...] | None = None


def kernel_layouts() -> tuple[str, ...]:
    """Layouts whose products stay on the Rust kernels however many tokens a step has (the
    others decode to fp32 + GEMM from `dense_min_tokens` rows on): the integer kernels' (r16),
    and the interleaved exact weights (x8) where the exact kernels are vectorised (8 or 16
    lanes): their broadcast path beat decoding to fp32 + numpy's GEMM at 2,048 tokens on the
    embedded model, 1.7x on 16 lanes and 1.2-1.3x on 8 (bench/RESULTS.md, 2026-12-03, eighth
    session). The portable kernels (no AVX2, an ARM box) leave long prefills to the GEMM."""
    global _KERNEL_LAYOUTS
    if _KERNEL_LAYOUTS is None:
        _KERNEL_LAYOUTS = ("r16", "x8") if kernels.info()["exact_lanes"] > 1 else ("r16",)
    return _KERNEL_LAYOUTS


def can_keep(qtype: int, shape) -> bool:
    """Whether a GGUF tensor of this type and (rows, cols) shape can stay quantized."""
    return qtype in FORMATS and len(shape) == 2 and shape[1] % BLOCK[qtype][0] == 0


@dataclass
class QuantWeight:
    """A [rows, cols] weight as GGUF blocks: `data` uint8 [rows, row_bytes], C-contiguous
    (`layout` "rows"); once `interleave`d ("x8"), [ceil(rows / 8), 8 * row_bytes]; once
    `repack`ed ("r16"), [ceil(rows / 16), bytes per 16 rows]."""
    qtype: int
    data: np.ndarray
    rows: int
    cols: int
    layout: str = "rows"

    def __post_init__(self):
        bw, bb = BLOCK[self.qtype]
        rb = self.cols // bw * bb
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}: one of {', '.join(LAYOUTS)}")
        if self.layout == "r16":
            ok = self.data.ndim == 2 and self.data.shape[0] == -(-self.rows // 16)
        else:
            ok = self.data.shape == ((-(-self.rows // 8), 8 * rb) if self.layout == "x8" else (self.rows, rb))
        if self.cols % bw or not ok:
            raise ValueError(f"{FORMATS[self.qtype]} weight [{self.rows}, {self.cols}]: bad block bytes "
                             f"{self.data.shape} for layout {self.layout}")
        self.data = np.ascontiguousarray(self.data, dtype=np.uint8)

    @property
    def x8(self) -> bool:
        return self.layout == "x8"

    @property
    def kind(self) -> int:
        """The type id the kernels take: the GGML id, plus the layout's flag."""
        return self.qtype | {"rows": 0, "x8": X8_FLAG, "r16": R16_FLAG}[self.layout]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def interleave(self) -> bool:
        """Re-lay the blocks out in groups of 8 rows where the format allows it; True if the
        weight is interleaved afterwards. The array is rewritten in place when its rows are
        a multiple of 8 (no second copy of the weights while loading): nothing else may
        hold it."""
        if self.layout == "rows" and self.qtype in INTERLEAVABLE:
            self.data = kernels.interleave(self.data, self.qtype, self.rows)
            self.layout = "x8"
        return self.x8

    def repack(self) -> bool:
        """Repack for the integer kernels where the format has them; True if repacked
        afterwards. A new array: the old one is released."""
        if self.layout == "rows" and self.qtype in REPACKABLE:
            self.data = kernels.repack(self.data, self.qtype, self.rows)
            self.layout = "r16"
        return self.layout == "r16"

    def dequantize_into(self, out: np.ndarray, row_start: int = 0) -> None:
        """Rows row_start .. row_start + len(out) as float32 into `out` [R, cols]."""
        kernels.dequantize(self.data, self.kind, out, row_start)

    def dequantize(self) -> np.ndarray:
        out = np.empty((self.rows, self.cols), np.float32)
        self.dequantize_into(out)
        return out


def merge_segments(segments: list[QuantWeight], repack: bool = False) -> list[QuantWeight]:
    """Neighbouring row segments of one format (in GGUF's row layout) as one matrix: one
    kernel call instead of several. With `repack` (the integer kernels' layout) every
    segment is repacked here, as the weight arrives (its bytes just read, still in the
    cache: twice the rate of repacking it once the whole file is in), and a run of several
    is repacked straight from the parts (`kernels.repack_parts`: no stacked copy first) when
    every part but the last holds whole groups of 16 rows. (Not for a weight whose array
    another shares, a tied LM head: `lay_out` re-lays those once for both.)"""
    runs: list[list[QuantWeight]] = []
    for s in segments:
        if runs and runs[-1][0].qtype == s.qtype and s.layout == runs[-1][0].layout == "rows":
            runs[-1].append(s)
        else:
            runs.append([s])
    merged = []
    for run in runs:
        first = run[0]
        if len(run) == 1:
            if repack:
                first.repack()
            merged.append(first)
        elif repack and first.qtype in REPACKABLE and all(s.rows % 16 == 0 for s in run[:-1]):
            rows = sum(s.rows for s in run)
            data = kernels.repack_parts([s.data for s in run], first.qtype, [s.rows for s in run])
            merged.append(QuantWeight(first.qtype, data, rows, first.cols, "r16"))
        else:
            merged.append(QuantWeight(first.qtype, np.concatenate([s.data for s in run]), sum(s.rows for s in run),
                                      first.cols))
    return merged


def own_weights(weights, keep=()) -> int:
    """Copy into memory of its own every weight still viewing a file's pages (read-only: a
    borrowed read, `ModelFiles.weights(borrow=True)`, that was not re-laid out: formats the
    kernels read as they are, an untied embedding), so no model array depends on the file
    staying as it is. Weights over one array share the copy; `keep`: ids of arrays to leave
    as they are (the weights cache's, a file of edgepaged's own that is never rewritten in
    place). Returns how many were copied."""
    copies: dict[int, np.ndarray] = {}
    n = 0
    for s in weights:
        if s is None or s.data.flags.writeable or id(s.data) in keep:
            continue
        key = id(s.data)
        if key not in copies:
            copies[key] = np.array(s.data, dtype=np.uint8, order="C")
            n += 1
        s.data = copies[key]
    return n


def lay_out(weights, math: str) -> int:
    """The layout every one of these quantized weights takes for the kernels of `math`:
    "int8", repacked for the integer kernels (every block format; F16/BF16 stay in rows);
    "exact", Q4_0/Q4_1/Q8_0 interleaved, the rest in GGUF's rows. Weights over one array (a
    tied embedding and LM head) share the result. Returns how many weights changed."""
    done: dict[int, QuantWeight] = {}   # id of a weight's original array -> the weight that re-laid it
    n = 0
    for s in weights:
        if s.layout != "rows":
            continue
        first = done.get(id(s.data))
        if first is not None:        # another weight over the same array: share its result
            s.data, s.layout = first.data, first.layout
            continue
        key = id(s.data)
        if s.repack() if math == "int8" else s.interleave():
            done[key] = s
            n += 1
    return n
