"""Dense products and activations the CPU runtime's encoders and the vision towers share
(numpy, and the integer kernels for `Matrix`'s int8 math): neither runtime's own module, so
the torch runtime may use a vision tower without importing the CPU runtime."""
from __future__ import annotations

import numpy as np


def gelu(x: np.ndarray, rows: int = 16) -> np.ndarray:
    """BERT's exact GELU, x (1 + erf(x / sqrt 2)) / 2, in place of x; erf to ~1.5e-7
    (Abramowitz and Stegun 7.1.26), float32 passes over a few rows at a time (small
    temporaries: no fresh pages to fault in per call, and each pass stays in the cache)."""
    for r in range(0, len(x), rows):
        _gelu_rows(x[r:r + rows])
    return x


def _gelu_rows(x: np.ndarray) -> None:
    f32 = np.float32
    a = np.abs(x)
    a *= f32(0.7071067811865476)
    t = a * f32(0.3275911)
    t += f32(1.0)
    np.reciprocal(t, out=t)
    q = t * f32(1.061405429)
    for c in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
        q += f32(c)
        q *= t
    np.square(a, out=a)
    np.negative(a, out=a)
    np.exp(a, out=a)
    q *= a                         # 1 - erf(|x| / sqrt 2)
    np.subtract(f32(1.0), q, out=q)
    np.copysign(q, x, out=q)       # erf(x / sqrt 2)
    q += f32(1.0)
    q *= f32(0.5)
    x *= q


class Matrix:
    """One linear layer's weight [out, in]: `exact`, f32 (x @ W.T, BLAS); `int8`, requantized
    to Q8_0 (blocks of 32 with a scale) and multiplied by the integer kernels with the
    activations quantized per block of 32 (llama.cpp's math for its quantized files: ~4x the
    f32 rate here; the error is measured in bench/embed_bench.py)."""

    __array_ufunc__ = None                 # `x @ matrix` comes to __rmatmul__

    def __init__(self, w: np.ndarray, math: str):
        self.rows, self.cols = w.shape
        self.q = None
        if math == "int8" and self.cols % 32 == 0:
            import gguf

            from .quant.formats import QuantWeight
            raw = gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
            self.q = QuantWeight(8, raw.view(np.uint8).reshape(self.rows, -1), self.rows, self.cols)
            self.q.repack()
            self.t = None
        else:
            self.t = np.ascontiguousarray(np.asarray(w, dtype=np.float32).T)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes if self.q is not None else self.t.nbytes

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        return self.into(x, None)

    def into(self, x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """x @ W.T, written into `out` [len(x), rows] (float32, C-contiguous) when given."""
        if out is None:
            out = np.empty((x.shape[0], self.rows), np.float32)
        if self.q is None:
            return np.matmul(x, self.t, out=out)
        from .._native import quant as kernels
        kernels.matmul(self.q.data, self.q.kind, np.ascontiguousarray(x, dtype=np.float32), out, col=0,
                       rows=self.rows)
        return out
