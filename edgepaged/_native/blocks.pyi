"""`edgepaged._native.blocks`: the KV block pool (crate rust_alloc/block_pool, bound in
rust_alloc/python/src/blocks.rs)."""

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
        pick_window: int | None = None,
    ) -> None:
        """pick_window: a sequence's next block is chosen among that many of the least
        recently freed (1 to 16; None: 16, or an 8th of a pool under 128 blocks; never more
        than an 8th of the free blocks): the one
        after its last block when there, else the start of the longest run of consecutive
        free ids that no other sequence's next blocks claim."""
    @property
    def pick_window(self) -> int: ...
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
        self, seq_id: int, prompt: _Ints, salt: int = 0, reserve_tokens: int | None = None,
        partial: bool = False,
    ) -> int:
        """Register a sequence; returns how many prompt tokens the prefix cache held. With
        `partial` (paged mode), past the cached full blocks also the leading tokens the prompt
        shares with a cached block that continues them (the sequence holds that block; its
        first step copies it before writing: a `copies` pair), so the count need not be whole
        blocks."""
    def append_tokens(self, seq_id: int, tokens: _Ints) -> None: ...
    def set_token(self, seq_id: int, position: int, token: int) -> None:
        """Put `token` at `position` of the sequence's known tokens: a token whose slot a step
        ahead reserved before it was sampled (a placeholder `prepare_step` appended). Refused
        inside a block already hashed, or past the known tokens."""
    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares all the parent's blocks (refcounts up); the first write into a
        shared block copies it (a `copies` pair of prepare_step)."""
    def free_sequence(self, seq_id: int, cache: bool = True, tail: bool = False) -> None:
        """Release the sequence's blocks, tail first; with `cache`, its computed full blocks
        enter the prefix cache first (pass False when the step computing them failed); with
        `tail` too, its last block when only part of it was computed (4 tokens at least, the
        sequence alone holding it, every block before it cached): a prompt that continues the
        sequence's tokens then starts from it (`add_sequence(..., partial=True)`)."""
    def has_sequence(self, seq_id: int) -> bool: ...
    def blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """Blocks prepare_step would take from the pool for that many more tokens."""
    def admission_blocks(self, prompt: _Ints, salt: int = 0, new_tokens: int = 0,
                         reserve_tokens: int | None = None, partial: bool = False) -> int:
        """Blocks add_sequence(prompt, salt, reserve_tokens, partial) and then a first
        prepare_step of `new_tokens` tokens take from the pool (cached blocks out of the free
        list, new blocks and copies, a contiguous reservation); changes nothing."""
    def can_allocate(self, num_blocks: int) -> bool: ...
    def prefix_match(self, prompt: _Ints, salt: int = 0) -> tuple[int, int]:
        """(cached tokens, how many of those blocks sit in the free list); changes nothing."""
    def num_cached_prefix_tokens(self, prompt: _Ints, salt: int = 0) -> int: ...
    def prepare_step(
        self, seq_ids: _Ints, num_new_tokens: _Ints, new_tokens: _Ints | None = None
    ) -> tuple[
        npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32], int
    ]:
        """Reserve this step's slots: (slot_mapping [T], block_tables [B, M], seq_lens [B],
        copies [K, 2], num_free_blocks after the step). `new_tokens[i]` (or -1) is appended
        to sequence i first. All or nothing."""
    def release_outside(self, seq_id: int, sink_tokens: int, window_tokens: int) -> int:
        """The window policy: give back every block of the sequence wholly inside
        [sink_tokens, num_slots - window_tokens] (no later query attends it); a block others
        share stays theirs. Later block tables leave released entries out (the kernels see
        the kept positions as one shorter sequence). Returns how many were released now."""
    def truncate(self, seq_id: int, num_tokens: int) -> int:
        """Speculation's rollback: keep the sequence's first `num_tokens` tokens (the rejected
        drafted ones go): slots and computed positions past it go, whole blocks past the kept
        slots return to the pool tail first (contiguous: the reservation stays); a block cut
        inside that the prefix cache holds is given back and its kept positions recomputed.
        Returns how many block references were given back. SequenceError for a sequence the
        window policy released blocks of, ValueError for 0 or more tokens than it has."""
    def undo_step(self, seq_id: int, num_tokens: int, num_slots: int) -> int:
        """An interrupted step's undo: back to `num_tokens` tokens and `num_slots` slots."""
    def seq_num_released(self, seq_id: int) -> int: ...
    def block_table(self, seq_id: int) -> list[int]:
        """The sequence's blocks; a released entry (window policy) is 2**32 - 1."""
    def seq_num_slots(self, seq_id: int) -> int: ...
    def seq_num_tokens(self, seq_id: int) -> int: ...
    def seq_tokens(self, seq_id: int) -> list[int]: ...
    def seq_ids(self) -> list[int]: ...
    def refcount(self, block_id: int) -> int: ...
    def is_cached(self, block_id: int) -> bool: ...
    def free_list(self) -> list[int]: ...
    def check_invariants(self) -> None:
        """Raise AssertionError if an internal invariant does not hold (tests)."""
    def stats(self) -> AllocatorStats: ...
