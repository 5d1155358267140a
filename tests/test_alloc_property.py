"""The Rust allocator against the plain-Python reference model, under random operation
sequences (hypothesis stateful testing), plus direct checks of the Python binding."""
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from edgepaged._native.blocks import (AllocatorError, BlockAllocator, NoFreeBlocksError,
                                   SequenceError)

from edgepaged.testing.alloc_reference import RefAllocator

NUM_BLOCKS, BLOCK_SIZE = 24, 4
# a few shared "system prompts" so prefix hits, evictions and deduplication happen often
PREFIXES = [list(range(100, 109)), list(range(200, 213)), [7] * 8]


def _result(fn, *args, **kw):
    """(kind, value): the outcome of a call, exceptions included, in comparable form."""
    try:
        out = fn(*args, **kw)
    except (AllocatorError, ValueError) as e:
        return ("error", type(e).__name__)
    if isinstance(out, tuple):
        return ("ok", tuple(np.asarray(x).tolist() for x in out))
    return ("ok", out)


class AllocatorMachine(RuleBasedStateMachine):
    PICK_WINDOW = None      # the default: 3 in a pool of 24 blocks (at most an 8th of the free ones)
    NUM_BLOCKS = NUM_BLOCKS
    BS = BLOCK_SIZE

    def __init__(self):
        super().__init__()
        self.rust = BlockAllocator(self.NUM_BLOCKS, self.BS, pick_window=self.PICK_WINDOW)
        self.ref = RefAllocator(self.NUM_BLOCKS, self.BS, pick_window=self.PICK_WINDOW)
        assert self.rust.pick_window == self.ref.pick_window
        self.next_id = 0
        # simulated KV cache: which token sits in each slot
        self.content = np.full(self.NUM_BLOCKS * self.BS, -1, dtype=np.int64)

    # -- helpers ---------------------------------------------------------------------------
    def _state(self, a):
        ids = sorted(a.seqs) if isinstance(a, RefAllocator) else sorted(a.seq_ids())
        return (a.stats(), a.free_list(), {i: list(a.block_table(i)) for i in ids})

    def _both(self, name, *args, **kw):
        before = self._state(self.rust)
        r = _result(getattr(self.rust, name), *args, **kw)
        p = _result(getattr(self.ref, name), *args, **kw)
        assert r == p, f"{name}{args}: rust {r} != reference {p}"
        if r[0] == "error":
            assert self._state(self.rust) == before, f"failed {name} changed the state"
        return r

    def _live(self):
        return sorted(self.ref.seqs)

    # -- rules -----------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(range(-1, len(PREFIXES))),
          suffix=st.lists(st.integers(0, 5), max_size=9), salt=st.sampled_from([0, 0, 1]), partial=st.booleans())
    def add(self, prefix, suffix, salt, partial):
        prompt = (PREFIXES[prefix] if prefix >= 0 else []) + suffix
        sid = self.next_id
        self.next_id += 1
        kind, cached = self._both("add_sequence", sid, prompt, salt, partial=partial)
        if kind == "ok" and cached:
            # a prefix hit returns only blocks that hold exactly these tokens
            table = self.rust.block_table(sid)
            slots = [table[p // self.BS] * self.BS + p % self.BS for p in range(cached)]
            assert self.content[slots].tolist() == prompt[:cached]

    @precondition(lambda self: self.ref.seqs)
    @rule(data=st.data())
    def append(self, data):
        sid = data.draw(st.sampled_from(self._live()))
        toks = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=6))
        self._both("append_tokens", sid, toks)

    @precondition(lambda self: self.ref.seqs)
    @rule(data=st.data())
    def step(self, data):
        live = self._live()
        ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        ns, new = [], []
        for sid in ids:
            s = self.ref.seqs[sid]
            new.append(data.draw(st.sampled_from([-1, -1, 3, 4])))
            avail = len(s.tokens) - s.num_slots + (new[-1] >= 0)
            ns.append(data.draw(st.integers(0, avail + (1 if data.draw(st.booleans()) else 0))))
        args = [np.array(ids, dtype=np.int64), np.array(ns, dtype=np.int64)]
        if data.draw(st.booleans()):
            args.append(np.array(new, dtype=np.int64))
        kind, out = self._both("prepare_step", *args)
        if kind == "ok":
            self._write(ids, ns, out)

    def _write(self, ids, ns, out):
        """A step's KV writes into the simulated cache, as the runner makes them."""
        slots, tables, seq_lens, copies, num_free = out
        assert num_free == self.ref.num_free_blocks
        for src, dst in copies:  # copy-on-write first, as the runner does
            self.content[dst * self.BS:(dst + 1) * self.BS] = self.content[src * self.BS:(src + 1) * self.BS]
        k = 0
        for sid, n, length in zip(ids, ns, seq_lens):
            toks = self.ref.seqs[sid].tokens
            for pos in range(length - n, length):
                self.content[slots[k]] = toks[pos]
                k += 1
        assert k == len(slots)

    @precondition(lambda self: self.ref.seqs)
    @rule(data=st.data(), cache=st.booleans(), tail=st.booleans())
    def free(self, data, cache, tail):
        self._both("free_sequence", data.draw(st.sampled_from(self._live())), cache, tail=tail)

    @precondition(lambda self: self.ref.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._live()))
        self._both("fork", parent, self.next_id)
        self.next_id += 1

    @precondition(lambda self: self.ref.seqs)
    @rule(data=st.data())
    def truncate(self, data):
        """Speculation's rollback, at any point: inside a block, at its edge, in a shared or a
        cached block, past the computed positions, 0 and past the end (refused)."""
        sid = data.draw(st.sampled_from(self._live()))
        n = len(self.ref.seqs[sid].tokens)
        kind, _ = self._both("truncate", sid, data.draw(st.integers(-1, n + 1)))

    @rule(sid=st.integers(1000, 1002))
    def unknown_ids(self, sid):
        self._both("truncate", sid, 1)
        self._both("free_sequence", sid)
        self._both("prepare_step", [sid], [1])
        self._both("append_tokens", sid, [1])

    @precondition(lambda self: self.ref.seqs)
    @rule(data=st.data())
    def duplicate_id(self, data):
        self._both("add_sequence", data.draw(st.sampled_from(self._live())), [1, 2, 3])

    @rule(prefix=st.sampled_from(range(-1, len(PREFIXES))),
          suffix=st.lists(st.integers(0, 5), min_size=1, max_size=9), salt=st.sampled_from([0, 0, 1]),
          data=st.data())
    def admit(self, prefix, suffix, salt, data):
        """The scheduler's admission test: `admission_blocks` (a query) says what adding the
        sequence and its first step then take from the free pool, to the block."""
        prompt = (PREFIXES[prefix] if prefix >= 0 else []) + suffix
        cached = self.rust.prefix_match(prompt, salt)[0]
        n = data.draw(st.integers(0, len(prompt) - cached))
        want = self.rust.admission_blocks(prompt, salt, n)
        assert want == self.rust.admission_blocks(prompt, salt, n)          # it changed nothing
        free = self.rust.num_free_blocks
        sid = self.next_id
        self.next_id += 1
        kind, got = self._both("add_sequence", sid, prompt, salt)
        assert kind == "ok" and got == cached
        kind, out = self._both("prepare_step", np.array([sid], dtype=np.int64), np.array([n], dtype=np.int64))
        if kind == "ok":
            self._write([sid], [n], out)
            assert free - self.rust.num_free_blocks == want, (prompt, salt, n)
        else:                  # the pool could not hold the step: the query said more than was free
            assert want > free

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), salt=st.sampled_from([0, 1]))
    def query(self, prefix, salt):
        self._both("prefix_match", PREFIXES[prefix] + [1], salt)

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def same_state_and_invariants(self):
        assert self._state(self.rust) == self._state(self.ref)
        self.rust.check_invariants()
        st_ = self.rust.stats()
        assert st_["free_blocks"] + st_["used_blocks"] == self.NUM_BLOCKS
        holders = [0] * self.NUM_BLOCKS
        for sid in self.rust.seq_ids():
            for b in self.rust.block_table(sid):
                holders[b] += 1
        free = set(self.rust.free_list())
        for b in range(self.NUM_BLOCKS):
            assert self.rust.refcount(b) == holders[b]
            assert not (b in free and holders[b] > 0)

    @invariant()
    def computed_kv_matches_tokens(self):
        # every slot a sequence reserved before holds its token (copy-on-write worked)
        for sid, s in self.ref.seqs.items():
            for pos in range(s.num_computed):
                b = s.blocks[pos // self.BS]
                assert self.content[b * self.BS + pos % self.BS] == s.tokens[pos], (sid, pos)


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestAllocatorMachine = AllocatorMachine.TestCase


class AllocatorMachineWindow(AllocatorMachine):
    """The same in a pool of 64, a sequence's next block chosen among up to 6 of the least
    recently freed (`pop_near`; fewer when under 48 are free)."""
    PICK_WINDOW = 6
    NUM_BLOCKS = 64


AllocatorMachineWindow.TestCase.settings = AllocatorMachine.TestCase.settings
TestAllocatorMachineWindow = AllocatorMachineWindow.TestCase


class AllocatorMachineEight(AllocatorMachine):
    """Blocks of 8: a prompt starts from part of a cached block (4 tokens or more shared:
    `add_sequence(..., partial=True)`), and a freed sequence's last block, 4+ tokens of it
    computed, is cached too (`free_sequence(..., tail=True)`)."""
    BS = 8


AllocatorMachineEight.TestCase.settings = AllocatorMachine.TestCase.settings
TestAllocatorMachineEight = AllocatorMachineEight.TestCase


def test_a_block_deduplicated_at_a_later_step_is_so_in_both():
    """A fork's shared block whose twin sat in the cache unused (swapping then would have
    shrunk the free list) is swapped for it at a later step, once the twin is in use: the Rust
    pool did, the reference only hashed on new computed tokens (hypothesis found the case)."""
    p1 = list(range(200, 213)) + [0]
    tables = []
    for a in (BlockAllocator(24, 4), RefAllocator(24, 4)):
        def step(ids, ns):
            return a.prepare_step(np.array(ids, dtype=np.int64), np.array(ns, dtype=np.int64))
        a.add_sequence(2, p1, 1)
        step([2], [4])                      # block 0 computed, not hashed yet
        assert a.add_sequence(4, p1, 1) == 0
        step([4], [4])                      # its twin
        a.free_sequence(4, True)            # the twin cached, unused
        a.fork(2, 6)
        step([6], [0])                      # a swap would shrink the free list: not now
        assert list(a.block_table(6)) == [0]
        assert a.add_sequence(7, p1, 1) == 4
        step([7], [0])                      # the twin in use
        step([6], [0])
        tables.append((list(a.block_table(6)), list(a.block_table(2)), a.num_free_blocks, list(a.free_list())))
    assert tables[0] == tables[1]
    assert tables[0][0] == [1]           # the twin (sequence 4's block)


def test_errors_are_specific_and_change_nothing():
    a = BlockAllocator(4, 4)
    a.add_sequence(1, list(range(16)))
    a.add_sequence(2, [1])
    with pytest.raises(NoFreeBlocksError):
        a.prepare_step([1, 2], [16, 1])
    assert a.num_free_blocks == 4 and a.seq_num_slots(1) == 0
    with pytest.raises(SequenceError):
        a.add_sequence(1, [5])
    with pytest.raises(SequenceError):
        a.free_sequence(99)
    with pytest.raises(ValueError):
        a.add_sequence(3, [])
    with pytest.raises(ValueError):
        a.add_sequence(3, [-1])
    with pytest.raises(ValueError):
        a.prepare_step([1], [1, 2])
    with pytest.raises(ValueError):
        BlockAllocator(0, 16)
    with pytest.raises(ValueError):
        a.prepare_step("not ints", [1])
    a.check_invariants()


def test_prepare_step_arrays():
    a = BlockAllocator(64, 16)
    a.add_sequence(7, np.arange(40, dtype=np.int64))
    a.add_sequence(8, np.arange(3, dtype=np.int32))
    slots, tables, lens, copies, num_free = a.prepare_step(np.array([7, 8]), np.array([40, 3], dtype=np.int32))
    assert num_free == 64 - 4 == a.num_free_blocks
    assert slots.dtype == np.int64 and slots.shape == (43,)
    assert tables.dtype == np.int32 and tables.shape == (2, 3)
    assert lens.tolist() == [40, 3] and copies.shape == (0, 2)
    assert tables[1, 1:].tolist() == [0, 0]  # padding
    assert slots[:16].tolist() == list(range(tables[0, 0] * 16, tables[0, 0] * 16 + 16))


def test_contiguous_mode_reserves_up_front():
    a = BlockAllocator(8, 4, contiguous=True)
    assert not a.enable_prefix_caching
    assert a.admission_blocks([1, 2], 0, 2, reserve_tokens=16) == 4      # what admitting it takes
    a.add_sequence(1, [1, 2], reserve_tokens=16)
    assert a.num_used_blocks == 4
    with pytest.raises(NoFreeBlocksError):
        a.add_sequence(2, [1], reserve_tokens=20)
    assert a.num_sequences == 1


def test_truncate_rolls_back_without_caching_rejected_tokens():
    """Speculation's rollback: four drafted tokens computed, three rejected; the block that
    held them is never hashed (not when the next step caches what was computed, not when the
    sequence ends), a whole block past the kept slots goes back, and a cut inside a cached
    block gives that block back (its kept positions are computed again)."""
    a = BlockAllocator(16, 4)
    a.add_sequence(1, list(range(8)))
    a.prepare_step([1], [8])
    a.append_tokens(1, [50, 51, 52, 53, 54])        # drafted: 5 more, computed in one verification step
    a.prepare_step([1], [5])
    assert a.seq_num_slots(1) == 13 and len(a.block_table(1)) == 4
    assert a.truncate(1, 10) == 1                   # 3 rejected: the fourth block goes
    assert a.seq_num_slots(1) == 10 and a.seq_tokens(1) == list(range(8)) + [50, 51]
    a.append_tokens(1, [60])
    a.prepare_step([1], [1])                        # caches what was computed: blocks 0-1 only
    a.free_sequence(1)
    assert a.prefix_match(list(range(8)) + [50, 51, 60, 0, 1], 0)[0] == 8
    assert a.prefix_match(list(range(8)) + [50, 51, 52, 53, 1], 0)[0] == 8   # the rejected never cached
    a.check_invariants()
    # a cut inside a block the prefix cache holds: that block goes, its kept slots are recomputed
    a.add_sequence(2, list(range(8)) + [9])       # blocks 0-1 from the cache
    assert a.seq_num_slots(2) == 8
    a.truncate(2, 6)
    assert a.seq_num_slots(2) == 4 and len(a.block_table(2)) == 1 and a.seq_tokens(2) == list(range(6))
    with pytest.raises(ValueError):
        a.truncate(2, 0)
    with pytest.raises(ValueError):
        a.truncate(2, 7)
    with pytest.raises(SequenceError):
        a.truncate(99, 1)
    a.check_invariants()
