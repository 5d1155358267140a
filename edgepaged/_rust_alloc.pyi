"""Type stubs of the Rust block allocator (rust_alloc/, built by maturin)."""

from typing import Sequence, TypedDict

import numpy as np
import numpy.typing as npt

_Ints = Sequence[int] | npt.NDArray[np.int64] | npt.NDArray[np.int32]

class AllocatorError(Exception): ...
class NoFreeBlocksError(AllocatorError): ...
class SequenceError(AllocatorError): ...

class AllocatorStats(TypedDict):
    num_blocks: int
    block_size: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    num_sequences: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    evictions: int

class BlockAllocator:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        contiguous: bool = False,
    ) -> None: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_free_blocks(self) -> int:
        """Blocks with refcount 0 (cached ones included: they are evicted on demand)."""
    @property
    def num_used_blocks(self) -> int: ...
    @property
    def num_cached_blocks(self) -> int: ...
    @property
    def num_sequences(self) -> int: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def contiguous(self) -> bool: ...
    def add_sequence(
        self, seq_id: int, prompt: _Ints, salt: int = 0, reserve_tokens: int | None = None
    ) -> int:
        """Register a sequence; returns how many prompt tokens the prefix cache held."""
    def append_tokens(self, seq_id: int, tokens: _Ints) -> None: ...
    def fork(self, parent_id: int, child_id: int) -> None: ...
    def free_sequence(self, seq_id: int, cache: bool = True) -> None: ...
    def has_sequence(self, seq_id: int) -> bool: ...
    def blocks_needed(self, seq_id: int, num_new_tokens: int) -> int: ...
    def can_allocate(self, num_blocks: int) -> bool: ...
    def prefix_match(self, prompt: _Ints, salt: int = 0) -> tuple[int, int]:
        """(cached tokens, how many of those blocks sit in the free list); changes nothing."""
    def num_cached_prefix_tokens(self, prompt: _Ints, salt: int = 0) -> int: ...
    def prepare_step(
        self, seq_ids: _Ints, num_new_tokens: _Ints, new_tokens: _Ints | None = None
    ) -> tuple[
        npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]
    ]:
        """Reserve this step's slots: (slot_mapping [T], block_tables [B, M], seq_lens [B],
        copies [K, 2]). `new_tokens[i]` (or -1) is appended to sequence i first. All or
        nothing."""
    def block_table(self, seq_id: int) -> list[int]: ...
    def seq_num_slots(self, seq_id: int) -> int: ...
    def seq_num_tokens(self, seq_id: int) -> int: ...
    def seq_tokens(self, seq_id: int) -> list[int]: ...
    def seq_ids(self) -> list[int]: ...
    def refcount(self, block_id: int) -> int: ...
    def is_cached(self, block_id: int) -> bool: ...
    def free_list(self) -> list[int]: ...
    def check_invariants(self) -> None: ...
    def stats(self) -> AllocatorStats: ...

# ---- quantized matmul kernels (rust_alloc/src/quant, bound in python_quant.rs) ----
# `weight`: the GGUF block bytes of a [N, K] matrix, C-contiguous uint8 (any shape);
# `qtype`: the GGML type id (2 Q4_0, 3 Q4_1, 8 Q8_0, 12 Q4_K, 14 Q6_K). Arrays are used in
# place (torch CPU tensors through `.numpy()`); rows must be contiguous, row strides are free.
# The GIL is released while they run. `scalar=True` forces the portable path.

class QuantFormats(TypedDict, total=False):
    Q4_0: tuple[int, int, int]
    Q4_1: tuple[int, int, int]
    Q8_0: tuple[int, int, int]
    Q4_K: tuple[int, int, int]
    Q6_K: tuple[int, int, int]

class QuantInfo(TypedDict):
    isa: str            # "avx2" or "scalar"
    threads: int        # kernel threads, the caller included (EDGEPAGED_NUM_THREADS)
    formats: QuantFormats  # name -> (ggml type id, weights per block, bytes per block)
    x8_flag: int        # added to a type id for interleaved weights (quant_interleave)
    interleavable: list[int]  # type ids that can be interleaved (Q4_0, Q4_1, Q8_0)

# `qtype` below: a GGML type id, plus x8_flag for weights from quant_interleave.

def quant_matmul(
    weight: npt.NDArray[np.uint8], qtype: int, x: npt.NDArray[np.float32], out: npt.NDArray[np.float32],
    *, scalar: bool = False,
) -> None:
    """out[t] = W x[t] for x [T, K] (or [K]) into out [T, N] (or [N]); fp32 accumulation,
    blocks decoded in registers exactly as gguf.quants.dequantize does."""
def quant_dequantize(
    weight: npt.NDArray[np.uint8], qtype: int, out: npt.NDArray[np.float32], row_start: int = 0,
    *, scalar: bool = False,
) -> None:
    """Rows row_start .. row_start + out.shape[0] of W, decoded into out [R, K]."""
def quant_gather_rows(
    weight: npt.NDArray[np.uint8], qtype: int, rows: npt.NDArray[np.int64], out: npt.NDArray[np.float32],
    *, scalar: bool = False,
) -> None:
    """out[i] = row rows[i] of W, decoded (an embedding lookup)."""
def quant_info() -> QuantInfo: ...
def quant_interleave(weight: npt.NDArray[np.uint8], qtype: int, rows: int) -> npt.NDArray[np.uint8]:
    """GGUF blocks [rows, row_bytes] re-laid out in groups of 8 rows (each block's bytes spread
    across the 8 rows): uint8 [ceil(rows / 8), 8 * row_bytes], the last group padded with zeros."""

F32 = npt.NDArray[np.float32]

# Fused CPU operators (rust_alloc/src/cpuops.rs, used by edgepaged/model/fused.py): float32
# C-contiguous arrays, written in place.
def cpu_add_rms_norm(h: F32, delta: F32 | None, weight: F32, eps: float, out: F32) -> None:
    """h += delta (if given); out = h / rms(h) * weight, row by row ([T, D])."""
def cpu_silu_mul(gu: F32, out: F32) -> None:
    """out[t, i] = silu(gu[t, i]) * gu[t, I + i]; gu [T, 2I], out [T, I]."""
def cpu_rope_write_kv(
    qkv: F32, positions: npt.NDArray[np.int64], cos: F32, sin: F32, slots: npt.NDArray[np.int64],
    k_cache: F32, v_cache: F32, num_heads: int, num_kv_heads: int,
) -> None:
    """Rotary on the Q and K heads of fused QKV rows in place, then K/V into their cache slots (-1: skip)."""
def cpu_paged_decode(
    q: F32, out: F32, rows: npt.NDArray[np.int64], seq_lens: npt.NDArray[np.int32],
    block_tables: npt.NDArray[np.int32], k_cache: F32, v_cache: F32, num_heads: int, num_kv_heads: int,
    scale: float, window: int = 0,
) -> None:
    """Attention of the query at row rows[b] of q over sequence b's paged context -> out[rows[b]]."""
