"""A plain-Python block allocator with the same semantics as the Rust one.

It is the reference model of the property tests (tests/test_alloc_property.py) and the
baseline of bench/alloc_bench.py. It keys the prefix cache by the exact identity of a block
(parent block and generation, salt, tokens) instead of a 64-bit hash, so it needs no
verification step; everything else — free-list order, eviction, copy-on-write, deduplication,
a prompt started from part of a cached block, a freed sequence's cached last block — follows
the Rust code step for step, so the two must agree on every block id.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from edgepaged._native.blocks import NoFreeBlocksError, SequenceError

CLAIM = 8     # the block ids after a sequence's last block that others' picks leave alone
PARTIAL_SCAN = 64   # a block's cached continuations the partial match compares (the latest)
PARTIAL_MIN = 4     # the fewest leading tokens it shares


@dataclass
class _Seq:
    tokens: list[int]
    blocks: list[int]
    num_slots: int
    num_computed: int
    num_hashed: int
    salt: int


@dataclass
class RefAllocator:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    contiguous: bool = False
    pick_window: int | None = None
    refcounts: list[int] = field(init=False)
    generation: list[int] = field(init=False)
    key: list[tuple | None] = field(init=False)
    free: OrderedDict = field(init=False)
    cache: dict = field(init=False)
    seqs: dict = field(init=False)
    # the partial match's index, as Rust's `Store::children`: per (the parent's content, salt),
    # the cached blocks continuing it, in the Rust list's order (appended; removed by swap)
    children: dict = field(init=False)
    chain: list = field(init=False)     # a cached block's content from the start, as a number (None: uncached)
    chains: dict = field(init=False)    # (the parent's content's number, tokens) -> its number
    pkey: list = field(init=False)

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        n = self.num_blocks
        self.refcounts, self.generation, self.key = [0] * n, [0] * n, [None] * n
        self.free = OrderedDict((i, None) for i in range(n))
        self.cache = {}
        self.seqs = {}
        self.children, self.chain, self.pkey, self.chains = {}, [None] * n, [None] * n, {}
        self.enable_prefix_caching = self.enable_prefix_caching and not self.contiguous
        w = min(16, max(1, n // 8)) if self.pick_window is None else self.pick_window
        self.pick_window = min(16, max(1, w))
        self.prefix_cache_queries = self.prefix_cache_hits = self.evictions = 0

    # -- gauges ----------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cache)

    def stats(self) -> dict:
        return dict(num_blocks=self.num_blocks, block_size=self.block_size,
                    free_blocks=len(self.free), used_blocks=self.num_used_blocks,
                    cached_blocks=len(self.cache), num_sequences=len(self.seqs),
                    prefix_cache_queries=self.prefix_cache_queries,
                    prefix_cache_hits=self.prefix_cache_hits, evictions=self.evictions)

    def free_list(self) -> list[int]:
        return list(self.free)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).blocks)

    # -- blocks ----------------------------------------------------------------------------
    def _seq(self, seq_id: int) -> _Seq:
        if seq_id not in self.seqs:
            raise SequenceError(f"unknown sequence id {seq_id}")
        return self.seqs[seq_id]

    def _pop_free(self) -> int:
        return self._take(next(iter(self.free)))

    def _take(self, b: int) -> int:
        del self.free[b]
        self._uncache(b)
        self.refcounts[b] = 1
        return b

    def _pop_near(self, prev: int | None, lasts: list[int]) -> int:
        """Rust's `pop_near`: among the pick_window least recently freed (at most an 8th of the
        free blocks) that are uncached or the head, prev + 1, else the start of the longest run
        of consecutive such ids not claimed (the CLAIM ids after another sequence's last block;
        `lasts` sorted)."""
        w = min(self.pick_window, len(self.free) // 8)
        if w <= 1:
            return self._pop_free()
        win = []
        for b in self.free:
            if len(win) == w:
                break
            win.append(b)
        head = win[0]

        def free_to_take(x: int) -> bool:     # a cached block only in its LRU turn
            return x == head or self.key[x] is None

        if prev is not None and prev + 1 in win and free_to_take(prev + 1):
            return self._take(prev + 1)

        def claimed(x: int) -> bool:
            i = bisect.bisect_left(lasts, x)
            return i > 0 and x - lasts[i - 1] <= CLAIM

        best_run, best = 0, head
        for x in win:
            if claimed(x) or not free_to_take(x):
                continue
            run = 1
            while x + run in win and free_to_take(x + run) and not claimed(x + run):
                run += 1
            if run > best_run:
                best_run, best = run, x
        return self._take(best)

    def _uncache(self, b: int) -> None:
        k = self.key[b]
        if k is not None:
            self.key[b] = None
            self.generation[b] += 1
            if self.cache.get(k) == b:
                del self.cache[k]
            siblings = self.children[self.pkey[b]]
            i = siblings.index(b)
            last = siblings.pop()             # Rust's swap_remove: the last takes its place
            if i < len(siblings):
                siblings[i] = last
            if not siblings:
                del self.children[self.pkey[b]]
            self.chain[b] = self.pkey[b] = None
            self.evictions += 1

    def _register(self, b: int, parent: int | None, salt: int, k: tuple) -> None:
        """Block b enters the cache as `parent`'s continuation (and the partial match's index)."""
        above = -1 if parent is None else self.chain[parent]
        self.key[b] = k
        self.cache[k] = b
        self.chain[b] = self.chains.setdefault((above, k[2]), len(self.chains))   # k[2]: the tokens
        self.pkey[b] = (above, salt)
        self.children.setdefault(self.pkey[b], []).append(b)

    def _match_partial(self, tokens: list[int], salt: int, full: list[int]) -> tuple[int, int] | None:
        """Rust's `match_partial`: past the whole blocks found, the cached continuation of the
        last of them sharing the most leading tokens with the prompt's next (4 at least, fewer
        than a block, never the last token), among the 64 listed last."""
        bs = self.block_size
        start = len(full) * bs
        if not self.enable_prefix_caching or start + 1 >= len(tokens):
            return None
        want = tokens[start:start + min(len(tokens) - 1 - start, bs - 1)]
        parent = full[-1] if full else None
        pref = None if parent is None else (parent, self.generation[parent])
        above = -1 if parent is None else self.chain[parent]
        best = None
        for b in list(reversed(self.children.get((above, salt), [])))[:PARTIAL_SCAN]:
            k = self.key[b]
            if k is None or k[0] != pref or k[1] != salt:
                continue
            m = 0
            while m < min(len(k[2]), len(want)) and k[2][m] == want[m]:
                m += 1
            if m >= PARTIAL_MIN and m > (best[1] if best else 0):
                best = (b, m)
        return best

    def _acquire(self, b: int) -> None:
        self.free.pop(b, None)
        self.refcounts[b] += 1

    def _release(self, b: int) -> None:
        self.refcounts[b] -= 1
        if self.refcounts[b] == 0:
            self.free[b] = None

    def _key(self, parent: int | None, salt: int, tokens) -> tuple:
        pref = None if parent is None else (parent, self.generation[parent])
        return (pref, salt, tuple(tokens))

    def _match(self, tokens: list[int], salt: int) -> list[int]:
        found: list[int] = []
        if not self.enable_prefix_caching or not tokens:
            return found
        bs, parent = self.block_size, None
        for i in range((len(tokens) - 1) // bs):
            b = self.cache.get(self._key(parent, salt, tokens[i * bs:(i + 1) * bs]))
            if b is None:
                break
            found.append(b)
            parent = b
        return found

    def _hash_computed(self, s: _Seq, dedupe: bool) -> None:
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(s.num_computed, len(s.tokens)) // bs
        while s.num_hashed < full:
            i = s.num_hashed
            b = s.blocks[i]
            if self.key[b] is not None:
                s.num_hashed += 1
                continue
            parent = None if i == 0 else s.blocks[i - 1]
            k = self._key(parent, s.salt, s.tokens[i * bs:(i + 1) * bs])
            existing = self.cache.get(k)
            if existing is not None:
                shrinks = self.refcounts[existing] == 0 and self.refcounts[b] > 1
                if not dedupe or shrinks:
                    break
                self._acquire(existing)
                s.blocks[i] = existing
                self._release(b)
                s.num_hashed += 1
                continue
            self._register(b, parent, s.salt, k)
            s.num_hashed += 1

    # -- operations ------------------------------------------------------------------------
    def prefix_match(self, tokens, salt: int = 0) -> tuple[int, int]:
        found = self._match(list(tokens), salt)
        return len(found) * self.block_size, sum(self.refcounts[b] == 0 for b in found)

    def add_sequence(self, seq_id: int, prompt, salt: int = 0, reserve_tokens: int | None = None,
                     partial: bool = False) -> int:
        tokens = [int(t) for t in prompt]
        if seq_id in self.seqs:
            raise SequenceError(f"sequence id {seq_id} already exists")
        if not tokens:
            raise ValueError("a sequence needs at least one prompt token")
        blocks: list[int] = []
        if self.contiguous:
            want = -(-max(reserve_tokens or 0, len(tokens)) // self.block_size)
            if want > len(self.free):
                raise NoFreeBlocksError(f"not enough free KV blocks: need {want}, {len(self.free)} free")
            blocks = sorted(self._pop_free() for _ in range(want))
        cached = self._match(tokens, salt)
        hashed = len(cached)
        n = len(cached) * self.block_size
        if partial and not self.contiguous:
            found = self._match_partial(tokens, salt, cached)
            if found is not None:
                cached.append(found[0])
                n += found[1]
        for b in cached:
            self._acquire(b)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(tokens)
            self.prefix_cache_hits += n
        if cached:
            blocks = cached
        self.seqs[seq_id] = _Seq(tokens, blocks, n, n, hashed, salt)
        return n

    def append_tokens(self, seq_id: int, tokens) -> None:
        self._seq(seq_id).tokens.extend(int(t) for t in tokens)

    def fork(self, parent_id: int, child_id: int) -> None:
        if child_id in self.seqs:
            raise SequenceError(f"sequence id {child_id} already exists")
        p = self._seq(parent_id)
        for b in p.blocks:
            self._acquire(b)
        self.seqs[child_id] = _Seq(list(p.tokens), list(p.blocks), p.num_slots,
                                   p.num_computed, p.num_hashed, p.salt)

    def free_sequence(self, seq_id: int, cache: bool = True, tail: bool = False) -> None:
        s = self._seq(seq_id)
        if cache:
            s.num_computed = s.num_slots
            self._hash_computed(s, dedupe=False)
            if tail and not self.contiguous:
                self._cache_tail(s)
        del self.seqs[seq_id]
        for b in reversed(s.blocks):
            self._release(b)

    def _cache_tail(self, s: _Seq) -> None:
        """Rust's `cache_tail`: a freed sequence's last block, part of it computed."""
        bs = self.block_size
        n = min(s.num_slots, len(s.tokens))
        i, m = divmod(n, bs)
        if not self.enable_prefix_caching or m < PARTIAL_MIN or len(s.blocks) != i + 1 or s.num_hashed != i:
            return
        b, parent = s.blocks[i], (s.blocks[i - 1] if i else None)
        if self.key[b] is not None or self.refcounts[b] != 1 or (parent is not None and self.key[parent] is None):
            return
        k = self._key(parent, s.salt, s.tokens[i * bs:n])
        if k not in self.cache:
            self._register(b, parent, s.salt, k)

    def truncate(self, seq_id: int, num_tokens: int) -> int:
        s = self._seq(seq_id)
        if num_tokens <= 0 or num_tokens > len(s.tokens):
            raise ValueError(f"truncate sequence {seq_id} to {num_tokens} tokens: it has {len(s.tokens)}")
        bs = self.block_size
        del s.tokens[num_tokens:]
        slots = min(s.num_slots, num_tokens)
        cut = slots // bs
        if slots % bs and cut < len(s.blocks) and self.key[s.blocks[cut]] is not None:
            slots = cut * bs
        s.num_slots = slots
        s.num_computed = min(s.num_computed, slots)
        s.num_hashed = min(s.num_hashed, slots // bs)
        keep = len(s.blocks) if self.contiguous else -(-slots // bs)
        freed = 0
        while len(s.blocks) > keep:
            self._release(s.blocks.pop())
            freed += 1
        return freed

    def _must_copy(self, b: int) -> bool:
        """A write into block `b` copies it first: others hold it, or the prefix cache does (a
        fork truncated inside a block its sibling then computed, cached and let go of holds a
        cached block alone, mid-block)."""
        return self.refcounts[b] > 1 or self.key[b] is not None

    def _needed(self, s: _Seq, n: int) -> int:
        if n == 0:
            return 0
        bs = self.block_size
        need = 0
        for j in range(s.num_slots // bs, (s.num_slots + n - 1) // bs + 1):
            if j >= len(s.blocks) or self._must_copy(s.blocks[j]):
                need += 1
        return need

    def blocks_needed(self, seq_id: int, n: int) -> int:
        return self._needed(self._seq(seq_id), n)

    def prepare_step(self, seq_ids, num_new_tokens, new_tokens=None):
        ids = [int(x) for x in seq_ids]
        ns = [int(x) for x in num_new_tokens]
        new = [-1] * len(ids) if new_tokens is None else [int(x) for x in new_tokens]
        if len(ids) != len(ns) or len(new) != len(ids):
            raise ValueError("seq_ids, num_new_tokens and new_tokens differ in length")
        if any(t >= 2**32 - 1 for t in new):
            raise ValueError("token id out of range")
        need = 0
        bs = self.block_size
        for sid, n, t in zip(ids, ns, new):
            if n < 0:
                raise ValueError("negative num_new_tokens")
            s = self._seq(sid)
            if s.num_slots + n > len(s.tokens) + (t >= 0):
                raise SequenceError(f"sequence {sid}: more new tokens than known tokens")
            if self.contiguous and -(-(s.num_slots + n) // bs) > len(s.blocks):
                raise SequenceError(f"sequence {sid}: tokens exceed its reservation")
            need += self._needed(s, n)
        if len(set(ids)) != len(ids):
            raise ValueError("a sequence appears twice in one step")
        if need > len(self.free):
            raise NoFreeBlocksError(f"not enough free KV blocks: need {need}, {len(self.free)} free")
        for sid, t in zip(ids, new):
            s = self.seqs[sid]
            if t >= 0:
                s.tokens.append(t)
            s.num_computed = s.num_slots
            # every step (as the Rust pool): a block whose deduplication would have shrunk the
            # free list before may be swapped for its cached twin now
            self._hash_computed(s, dedupe=True)
        slots: list[int] = []
        copies: list[tuple[int, int]] = []
        seq_lens: list[int] = []
        lasts = sorted(q.blocks[-1] for q in self.seqs.values() if q.blocks) if self.pick_window > 1 else []
        for sid, n in zip(ids, ns):
            s = self.seqs[sid]
            if s.blocks and lasts:
                lasts.remove(s.blocks[-1])       # its own claim left out
            if n:
                fresh = len(s.blocks)
                for j in range(s.num_slots // bs, (s.num_slots + n - 1) // bs + 1):
                    prev = s.blocks[j - 1] if j > 0 else None
                    if j == len(s.blocks):
                        s.blocks.append(self._pop_near(prev, lasts))
                    elif self._must_copy(s.blocks[j]):
                        dst = self._pop_near(prev, lasts)
                        if j * bs < s.num_slots:
                            copies.append((s.blocks[j], dst))
                        self._release(s.blocks[j])
                        s.blocks[j] = dst
                s.blocks[fresh:] = sorted(s.blocks[fresh:])    # a step's new blocks ascending
                for pos in range(s.num_slots, s.num_slots + n):
                    slots.append(s.blocks[pos // bs] * bs + pos % bs)
                s.num_slots += n
            if s.blocks and self.pick_window > 1:
                bisect.insort(lasts, s.blocks[-1])
            seq_lens.append(s.num_slots)
        width = max([1] + [len(self.seqs[sid].blocks) for sid in ids])
        tables = np.zeros((len(ids), width), dtype=np.int32)
        for row, sid in enumerate(ids):
            blocks = self.seqs[sid].blocks
            tables[row, :len(blocks)] = blocks
        return (np.array(slots, dtype=np.int64), tables, np.array(seq_lens, dtype=np.int32),
                np.array(copies, dtype=np.int32).reshape(-1, 2), len(self.free))
