"""`edgepaged._native.ops`: the fused CPU operators and the whole-step decoder (crate
rust_alloc/cpu_kernels, bound in rust_alloc/python/src/ops.rs). float32 C-contiguous arrays,
written in place; the GIL is released while they run."""

from typing import Sequence

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]

def add_rms_norm(h: F32, delta: F32 | None, weight: F32, eps: float, out: F32) -> None:
    """h += delta (if given); out = h / rms(h) * weight, row by row ([T, D])."""
def silu_mul(gu: F32, out: F32) -> None:
    """out[t, i] = silu(gu[t, i]) * gu[t, I + i]; gu [T, 2I], out [T, I]."""
def softmax_rows(x: F32, scale: float) -> None:
    """Each row of x [..., n] in place: softmax(scale * row), scale > 0 (the pool's threads)."""
def rope_write_kv(
    qkv: F32, positions: I64, cos: F32, sin: F32, slots: I64, k_cache: F32, v_cache: F32, num_heads: int,
    num_kv_heads: int,
) -> None:
    """Rotary on the Q and K heads of fused QKV rows [T, (H + 2 Hkv) D] in place (tables [P, D]
    as `Rotary` builds them), then K/V into their cache slots (-1: skip); caches
    [num_blocks, block_size, Hkv, D] float32 or float16, or int8 for q8_0: [..., Hkv, D + D / 16]
    (each head row D values, then D / 32 half-precision scales as 2 bytes; D a multiple of 32)."""
def paged_decode(
    q: F32, out: F32, rows: I64, seq_lens: I32, block_tables: I32, k_cache: F32, v_cache: F32, num_heads: int,
    num_kv_heads: int, scale: float, window: int = 0,
) -> None:
    """Attention of the query at row rows[b] of q over sequence b's paged context (its last
    `window` positions when window > 0) -> out[rows[b]]."""

def paged_prefill(
    q: F32, out: F32, starts: I64, seq_lens: I32, block_tables: I32, k_cache: F32, v_cache: F32, num_heads: int,
    num_kv_heads: int, scale: float, window: int = 0, softcap: float = 0.0, see: I32 | None = None,
) -> None:
    """Attention of rows starts[b] .. starts[b + 1] of q (a prefill chunk of sequence b) over
    the sequence's paged context of seq_lens[b] positions: row j of a chunk of q rows sees the
    first seq_lens[b] - q + j + 1 (their last `window` when window > 0) -> out[row]; with
    `see` (int32, one per row from starts[0], within the context, never smaller for a later
    row of a sequence) at least its first see[row]: rows that attend both ways (a vision
    tower's patches, Gemma 3's image tokens). Tiles of rows share each K/V row read
    (rust_alloc/cpu_kernels/src/prefill.rs)."""

def bf16_attention(on: bool | None = None) -> bool:
    """Whether paged_prefill's tiles over an f16 or q8_0 cache multiply in bf16 (f32 sums):
    on a CPU with AVX-512 BF16 unless EDGEPAGED_ATTENTION_BF16=0; `on` turns it on or off
    for the process first."""

def prefill_shared_rows(on: bool | None = None) -> bool:
    """Whether paged_prefill's bf16 tiles of a chunk of 4 tiles (97 rows) or more, without a
    window, read K and V rows converted once for all of them rather than each converting its
    own (the same bits either way); `on` turns it on or off for the process first."""

def decode_seg(positions: int | None = None) -> int:
    """Positions per segment of a long context's decode attention (512 unless
    EDGEPAGED_DECODE_SEG says otherwise; 0: none); `positions` sets it for the process first."""

# one linear: (segments, bias or None); a segment: (uint8 blocks, ggml type (+ x8 flag), rows, cols)
_Linear = tuple[Sequence[tuple[npt.NDArray[np.uint8], int, int, int]], F32 | None]

class QuantDecoder:
    """Every decoder layer of a quantized model in one call per step. Holds the arrays it is
    given (the model's own) and borrows them read-only for each call."""
    def __init__(
        self, layers: Sequence[tuple[F32, F32, Sequence[_Linear]]], num_heads: int, num_kv_heads: int,
        head_dim: int, hidden: int, intermediate: int, eps: float,
    ) -> None:
        """layers: per layer (input_norm, post_norm, [qkv, o, gate_up, down])."""
    def decode(
        self, h: F32, positions: I64, slots: I64, seq_lens: I32, block_tables: I32, kv_cache: F32, cos: F32,
        sin: F32, scale: float, window: int = 0,
    ) -> None:
        """h [T, hidden]: the embeddings in, the residual stream after the last layer out (final
        norm not applied). Row t is at positions[t], writes slots[t] and attends its
        seq_lens[t] positions through block_tables[t]; kv_cache is the runner's
        [layers, 2, num_blocks, block_size, Hkv, D]."""
