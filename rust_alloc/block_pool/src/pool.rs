//! The block pool: a fixed set of KV-cache blocks, their refcounts, an intrusive LRU free
//! list, the prefix cache (hash chain with exact verification) and per-sequence block tables.
//!
//! Every public operation validates everything it needs before it mutates anything, so an
//! operation that fails leaves the allocator exactly as it was.

use std::collections::HashMap;
use std::fmt;

use crate::hash::{chain_hash, FxBuild};

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllocError {
    /// Not enough free blocks; nothing was changed.
    NoFreeBlocks { needed: usize, free: usize },
    UnknownSequence(i64),
    DuplicateSequence(i64),
    /// A sequence-level request that cannot be honoured (e.g. more new tokens than known).
    Sequence(String),
    /// A bad argument.
    Invalid(String),
}

impl fmt::Display for AllocError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AllocError::NoFreeBlocks { needed, free } => {
                write!(f, "not enough free KV blocks: need {needed}, {free} free")
            }
            AllocError::UnknownSequence(id) => write!(f, "unknown sequence id {id}"),
            AllocError::DuplicateSequence(id) => write!(f, "sequence id {id} already exists"),
            AllocError::Sequence(m) | AllocError::Invalid(m) => f.write_str(m),
        }
    }
}

pub type Result<T> = std::result::Result<T, AllocError>;

/// Identity of a cached block: the block id and its generation (bumped on eviction), so a
/// child's link to its parent can never point at a block that was since reused.
type BlockRef = (u32, u32);

#[derive(Debug, Clone)]
struct Block {
    refcount: u32,
    generation: u32,
    /// Chain hash, present while the block is registered in the prefix cache.
    hash: Option<u64>,
    /// What the hash stands for, kept for exact verification on a hit.
    parent: Option<BlockRef>,
    salt: u64,
    tokens: Vec<u32>,
    /// Its key in `Store::children` (its parent's hash and its salt), while it is cached.
    pkey: u64,
    // intrusive doubly linked free list
    prev: u32,
    next: u32,
    in_free_list: bool,
}

#[derive(Debug, Clone)]
pub struct Sequence {
    pub tokens: Vec<u32>,
    pub blocks: Vec<u32>,
    /// Leading positions that have a KV slot.
    pub num_slots: usize,
    /// Positions whose KV is known to be computed (all slots reserved before the last
    /// `prepare_step`, or found in the prefix cache).
    pub num_computed: usize,
    /// Leading blocks already registered in (or taken from) the prefix cache.
    pub num_hashed_blocks: usize,
    pub salt: u64,
    /// Entries of `blocks` given back by `release_outside` (the window policy): `NIL`
    /// there, never read again; the step's block tables leave them out.
    pub released: usize,
    /// Stamp of the last `prepare_step` that named this sequence.
    step: u64,
}

/// Counters, all monotonic except the gauges computed on demand.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub evictions: u64,
}

/// The result of one `prepare_step`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub slot_mapping: Vec<i64>,
    /// Row-major `[batch, width]`, padded with 0.
    pub block_tables: Vec<i32>,
    pub width: usize,
    pub seq_lens: Vec<i32>,
    /// Copy-on-write pairs `(src, dst)`.
    pub copies: Vec<(u32, u32)>,
}

/// The blocks themselves: refcounts, the free list and the prefix cache. Kept apart from
/// the sequences so one can be borrowed while the other changes.
struct Store {
    block_size: usize,
    blocks: Vec<Block>,
    free_head: u32,
    free_tail: u32,
    num_free: usize,
    cache: HashMap<u64, u32, FxBuild>,
    /// The cached blocks that continue each cached block (or a salt's start): key
    /// `child_key(parent hash, salt)`. `match_partial` looks there for a block whose first
    /// tokens a prompt shares.
    children: HashMap<u64, Vec<u32>, FxBuild>,
    prefix_caching: bool,
    counters: Counters,
    /// How many of the least recently freed blocks a sequence's next block is chosen among
    /// (`pop_near`); 1: always the least recently freed.
    pick_window: usize,
}

/// A sequence's next blocks that `pop_near` keeps other sequences away from: the `CLAIM`
/// block ids after its last block.
const CLAIM: u32 = 8;

/// How many of a block's cached continuations `match_partial` compares with a prompt (the
/// latest first): a system prompt's block that thousands of chats continued costs no more.
const PARTIAL_SCAN: usize = 64;

/// The fewest tokens `match_partial` shares: a block's copy is cheap, but a prompt's first
/// token alone (a chat template's BOS) is not worth making its K/V another request's.
const PARTIAL_MIN: usize = 4;

/// The default `pick_window` of a pool of `num_blocks`: 16, or an 8th of a pool under 128
/// blocks, so that a choice made away from the least recently freed block never reaches far
/// into the prefix cache's order.
pub fn default_pick_window(num_blocks: usize) -> usize { (num_blocks / 8).clamp(1, 16) }

pub struct BlockPool {
    store: Store,
    seqs: HashMap<i64, Sequence, FxBuild>,
    contiguous: bool,
    /// Stamp of the current `prepare_step`, to find a sequence named twice in O(1).
    step: u64,
}

impl Store {
    fn blocks_for(&self, tokens: usize) -> usize { tokens.div_ceil(self.block_size) }

    // ---- free list ----------------------------------------------------------------------

    fn unlink(&mut self, id: u32) {
        let (prev, next) = {
            let b = &self.blocks[id as usize];
            debug_assert!(b.in_free_list);
            (b.prev, b.next)
        };
        if prev == NIL { self.free_head = next } else { self.blocks[prev as usize].next = next }
        if next == NIL { self.free_tail = prev } else { self.blocks[next as usize].prev = prev }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        b.in_free_list = false;
        self.num_free -= 1;
    }

    fn push_free_tail(&mut self, id: u32) {
        let tail = self.free_tail;
        {
            let b = &mut self.blocks[id as usize];
            debug_assert!(!b.in_free_list && b.refcount == 0);
            b.prev = tail;
            b.next = NIL;
            b.in_free_list = true;
        }
        if tail == NIL { self.free_head = id } else { self.blocks[tail as usize].next = id }
        self.free_tail = id;
        self.num_free += 1;
    }

    /// Take the least recently freed block, evicting its cached content if it has any.
    fn pop_free(&mut self) -> u32 {
        let id = self.free_head;
        debug_assert!(id != NIL, "pop_free on an empty free list (callers check first)");
        self.take(id)
    }

    /// Take free block `id` (anywhere in the free list), evicting its cached content.
    fn take(&mut self, id: u32) -> u32 {
        self.unlink(id);
        self.uncache(id);
        self.blocks[id as usize].refcount = 1;
        id
    }

    /// The next block of a sequence whose block before it is `prev`, chosen among the
    /// `pick_window` least recently freed (at most an 8th of the free blocks) that hold no
    /// cached prefix, or the least recently freed itself: `prev + 1` when it is among them, so a context's
    /// blocks run on in memory as it grows a block at a time (decode attention reads a
    /// table of scattered single blocks 1.6x slower than consecutive ones, runs of 8 1.15x:
    /// bench/RESULTS.md); else the first block of the longest run of consecutive ids there,
    /// leaving out the `CLAIM` ids after another sequence's last block (`claims`: those
    /// last blocks, sorted), so sequences growing side by side do not take turns in one run.
    fn pop_near(&mut self, prev: Option<u32>, claims: &[u32]) -> u32 {
        // never more than the oldest 8th of the free blocks: in a pool that is nearly full the
        // few free ones include those just freed, a prefix another request is about to ask for
        // again (a window of 16 there evicted a short chat's prompt between its turns, and a
        // long prompt beside it was preempted again and again)
        let w = self.pick_window.min(self.num_free / 8).min(16);
        if w <= 1 {
            return self.pop_free();
        }
        let mut win = [NIL; 16];
        let mut len = 0;
        let mut id = self.free_head;
        while id != NIL && len < w {
            win[len] = id;
            len += 1;
            id = self.blocks[id as usize].next;
        }
        debug_assert!(len > 0, "pop_near on an empty free list (callers check first)");
        let win = &win[..len];
        // a cached block only in its LRU turn (the head): the prefix cache evicts exactly as
        // without a window (a chain's tail first; taking a cached block deeper in broke a
        // preempted prompt's chain, and beside a short chat it was preempted again and again)
        let head = win[0];
        let free_to_take = |x: u32| x == head || self.blocks[x as usize].hash.is_none();
        if let Some(p) = prev {
            if win.contains(&(p + 1)) && free_to_take(p + 1) {
                return self.take(p + 1);
            }
        }
        let claimed = |x: u32| {
            let i = claims.partition_point(|&l| l < x);
            i > 0 && x - claims[i - 1] <= CLAIM
        };
        let mut best = (0u32, head);
        for &x in win {
            if claimed(x) || !free_to_take(x) {
                continue;
            }
            let mut run = 1;
            while win.contains(&(x + run)) && free_to_take(x + run) && !claimed(x + run) {
                run += 1;
            }
            if run > best.0 {
                best = (run, x);
            }
        }
        self.take(best.1)
    }

    fn uncache(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        if let Some(h) = b.hash.take() {
            b.generation = b.generation.wrapping_add(1);
            b.parent = None;
            b.tokens = Vec::new();
            if self.cache.get(&h) == Some(&id) {
                self.cache.remove(&h);
            }
            let key = b.pkey;
            if let Some(list) = self.children.get_mut(&key) {
                if let Some(i) = list.iter().position(|&x| x == id) {
                    list.swap_remove(i);
                }
                if list.is_empty() {
                    self.children.remove(&key);
                }
            }
            self.counters.evictions += 1;
        }
    }

    fn acquire(&mut self, id: u32) {
        if self.blocks[id as usize].in_free_list {
            self.unlink(id);
        }
        self.blocks[id as usize].refcount += 1;
    }

    /// A sequence's blocks past its first `keep` go back, tail first; returns how many.
    fn release_past(&mut self, blocks: &mut Vec<u32>, keep: usize) -> usize {
        let n = blocks.len().saturating_sub(keep);
        for id in blocks.drain(keep.min(blocks.len())..).rev() {
            self.release(id);
        }
        n
    }

    fn release(&mut self, id: u32) {
        let b = &mut self.blocks[id as usize];
        debug_assert!(b.refcount > 0);
        b.refcount -= 1;
        if b.refcount == 0 {
            self.push_free_tail(id);
        }
    }

    fn refcount(&self, id: u32) -> u32 { self.blocks[id as usize].refcount }

    /// A write into block `id` copies it first: others hold it too, or the prefix cache does
    /// (a cached block's content never changes; a sequence holds one it writes into only when
    /// it started from part of it, `match_partial`).
    fn must_copy(&self, id: u32) -> bool {
        let b = &self.blocks[id as usize];
        b.refcount > 1 || b.hash.is_some()
    }

    // ---- prefix cache -------------------------------------------------------------------

    fn block_ref(&self, id: u32) -> BlockRef { (id, self.blocks[id as usize].generation) }

    fn hash_of(&self, parent: Option<u32>, salt: u64, tokens: &[u32]) -> u64 {
        let parent_hash = parent.map_or(0, |p| self.blocks[p as usize].hash.unwrap_or(0));
        chain_hash(parent_hash, salt, tokens)
    }

    /// The cached block that continues `parent` with these tokens, verified exactly.
    fn lookup(&self, parent: Option<u32>, salt: u64, tokens: &[u32]) -> Option<u32> {
        let &id = self.cache.get(&self.hash_of(parent, salt, tokens))?;
        let b = &self.blocks[id as usize];
        let parent_ref = parent.map(|p| self.block_ref(p));
        (b.parent == parent_ref && b.salt == salt && b.tokens == tokens).then_some(id)
    }

    /// Longest run of cached full blocks for a prompt: never the whole prompt, so at least
    /// one token is left to compute. Returns the block ids.
    fn match_prefix(&self, tokens: &[u32], salt: u64) -> Vec<u32> {
        let mut found = Vec::new();
        if !self.prefix_caching || tokens.is_empty() {
            return found;
        }
        let max_blocks = (tokens.len() - 1) / self.block_size;
        let mut parent = None;
        for chunk in tokens.chunks_exact(self.block_size).take(max_blocks) {
            match self.lookup(parent, salt, chunk) {
                Some(id) => {
                    found.push(id);
                    parent = Some(id);
                }
                None => break,
            }
        }
        found
    }

    /// The key of the cached blocks that continue `parent` (None: a salt's first blocks).
    fn child_key(&self, parent: Option<u32>, salt: u64) -> u64 {
        let parent_hash = parent.map_or(0, |p| self.blocks[p as usize].hash.unwrap_or(0));
        chain_hash(parent_hash, salt, &[])
    }

    /// Past a prompt's cached full blocks (`full`, from `match_prefix`): the cached block
    /// that continues the last of them (same parent, same salt) and shares the most leading
    /// tokens with the prompt's next ones, and how many it shares (`PARTIAL_MIN` at least,
    /// fewer than a block, never the prompt's last token). Its K/V for those positions is the prompt's own: a
    /// sequence starts with it and copies it before its first write (`reserve`: a cached
    /// block's content never changes). The `PARTIAL_SCAN` continuations cached last are looked at.
    fn match_partial(&self, tokens: &[u32], salt: u64, full: &[u32]) -> Option<(u32, usize)> {
        let bs = self.block_size;
        let start = full.len() * bs;
        if !self.prefix_caching || start + 1 >= tokens.len() {
            return None;
        }
        let most = (tokens.len() - 1 - start).min(bs - 1);
        let want = &tokens[start..start + most];
        let parent = full.last().copied();
        let parent_ref = parent.map(|p| self.block_ref(p));
        let mut best: Option<(u32, usize)> = None;
        for &id in self.children.get(&self.child_key(parent, salt))?.iter().rev().take(PARTIAL_SCAN) {
            let b = &self.blocks[id as usize];
            if b.hash.is_none() || b.parent != parent_ref || b.salt != salt {
                continue;
            }
            let m = b.tokens.iter().zip(want).take_while(|(a, w)| a == w).count();
            if m >= PARTIAL_MIN && m > best.map_or(0, |x| x.1) {
                best = Some((id, m));
            }
        }
        best
    }

    /// Register a sequence's computed full blocks in the prefix cache, in order. A block
    /// whose content is already cached elsewhere is swapped for the cached one (its own
    /// copy returns to the pool) when `dedupe` is set; otherwise hashing stops there.
    fn hash_computed_blocks(&mut self, seq: &mut Sequence, dedupe: bool) {
        let bs = self.block_size;
        let full = seq.num_computed.min(seq.tokens.len()) / bs;
        if !self.prefix_caching || seq.num_hashed_blocks >= full {
            return;
        }
        while seq.num_hashed_blocks < full {
            let i = seq.num_hashed_blocks;
            let id = seq.blocks[i];
            if id == NIL || (i > 0 && seq.blocks[i - 1] == NIL) {
                break; // released (or its parent is): nothing to chain it to
            }
            if self.blocks[id as usize].hash.is_some() {
                seq.num_hashed_blocks += 1;
                continue;
            }
            let parent = if i == 0 { None } else { Some(seq.blocks[i - 1]) };
            let toks = &seq.tokens[i * bs..(i + 1) * bs];
            if let Some(existing) = self.lookup(parent, seq.salt, toks) {
                // Swapping must not shrink the free list (a step's need was counted
                // before hashing): skip it when both blocks would stay out of it.
                let shrinks = self.refcount(existing) == 0 && self.refcount(id) > 1;
                if !dedupe || shrinks {
                    break;
                }
                self.acquire(existing);
                seq.blocks[i] = existing;
                self.release(id);
                seq.num_hashed_blocks += 1;
                continue;
            }
            if !self.register(id, parent, seq.salt, toks) {
                break; // a true 64-bit collision: leave this block (and its tail) uncached
            }
            seq.num_hashed_blocks += 1;
        }
    }

    /// A freed sequence's last block, when only part of it was computed (`PARTIAL_MIN` tokens
    /// at least), the sequence alone holds it and every block before it is cached: it enters
    /// the prefix cache too, as a continuation of the last of them that `match_partial` offers
    /// (keyed by its own tokens, which never make a whole block's key) and nothing chains
    /// from. A chat's next turn (the conversation so far, then more) starts from it instead
    /// of computing its last block's tokens again. Whether it entered.
    fn cache_tail(&mut self, seq: &Sequence) -> bool {
        let bs = self.block_size;
        let n = seq.num_slots.min(seq.tokens.len());
        let (i, m) = (n / bs, n % bs);
        if !self.prefix_caching || m < PARTIAL_MIN || seq.blocks.len() != i + 1 || seq.num_hashed_blocks != i {
            return false;
        }
        let id = seq.blocks[i];
        let parent = if i == 0 { None } else { Some(seq.blocks[i - 1]) };
        if id == NIL || self.blocks[id as usize].hash.is_some() || self.refcount(id) != 1
            || parent.is_some_and(|p| p == NIL || self.blocks[p as usize].hash.is_none()) {
            return false;
        }
        // false: the same tail is cached already (or a true 64-bit collision)
        self.register(id, parent, seq.salt, &seq.tokens[i * bs..n])
    }

    /// Enter block `id` into the prefix cache as `parent`'s continuation with these tokens
    /// (and into `children`); false, and nothing changed, when their key is taken.
    fn register(&mut self, id: u32, parent: Option<u32>, salt: u64, toks: &[u32]) -> bool {
        let h = self.hash_of(parent, salt, toks);
        if self.cache.contains_key(&h) {
            return false;
        }
        let parent_ref = parent.map(|p| self.block_ref(p));
        let key = self.child_key(parent, salt);
        let b = &mut self.blocks[id as usize];
        b.hash = Some(h);
        b.parent = parent_ref;
        b.salt = salt;
        b.tokens = toks.to_vec();
        b.pkey = key;
        self.cache.insert(h, id);
        self.children.entry(key).or_default().push(id);
        true
    }

    /// Blocks a reservation of `n` more slots takes from the free list: new blocks plus
    /// copy-on-write copies of shared blocks it would write into.
    fn blocks_needed_for(&self, seq: &Sequence, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        let bs = self.block_size;
        let (first, last) = (seq.num_slots / bs, (seq.num_slots + n - 1) / bs);
        let have = seq.blocks.len().min(last + 1);
        let shared = (first..have).filter(|&j| self.must_copy(seq.blocks[j])).count();
        shared + (last + 1).saturating_sub(have.max(first))
    }

    /// Reserve slots for `n` more positions of `seq`, appending their slots to `slots` and
    /// any copy-on-write pair to `copies`. The caller checked there are enough blocks.
    /// `claims`: the other sequences' last blocks, sorted (`pop_near`).
    fn reserve(&mut self, seq: &mut Sequence, n: usize, slots: &mut Vec<i64>, copies: &mut Vec<(u32, u32)>,
               claims: &[u32]) {
        if n == 0 {
            return;
        }
        let bs = self.block_size;
        let (first, last) = (seq.num_slots / bs, (seq.num_slots + n - 1) / bs);
        let fresh = seq.blocks.len();
        let before = |blocks: &[u32], j: usize| if j > 0 && blocks[j - 1] != NIL { Some(blocks[j - 1]) } else { None };
        for j in first..=last {
            if j == seq.blocks.len() {
                let id = self.pop_near(before(&seq.blocks, j), claims);
                seq.blocks.push(id);
            } else {
                let id = seq.blocks[j];
                if self.must_copy(id) {
                    let dst = self.pop_near(before(&seq.blocks, j), claims);
                    if j * bs < seq.num_slots {
                        copies.push((id, dst));
                    }
                    self.release(id);
                    seq.blocks[j] = dst;
                }
            }
        }
        // the new blocks in ascending order: the free list hands a freed sequence's blocks
        // back tail first (descending), and a context read in descending blocks has the
        // decode attention wait on memory (1.45x at 4 k positions; bench/RESULTS.md)
        seq.blocks[fresh..].sort_unstable();
        let mut pos = seq.num_slots;
        while pos < seq.num_slots + n {
            let base = seq.blocks[pos / bs] as i64 * bs as i64;
            let end = ((pos / bs + 1) * bs).min(seq.num_slots + n);
            slots.extend((pos % bs..pos % bs + (end - pos)).map(|o| base + o as i64));
            pos = end;
        }
        seq.num_slots += n;
    }
}

impl BlockPool {
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        prefix_caching: bool,
        contiguous: bool,
    ) -> Result<Self> {
        if num_blocks == 0 || num_blocks >= NIL as usize {
            return Err(AllocError::Invalid(format!("num_blocks must be in 1..{NIL}, got {num_blocks}")));
        }
        if block_size == 0 || block_size > 1 << 16 {
            return Err(AllocError::Invalid(format!("block_size must be in 1..=65536, got {block_size}")));
        }
        let blocks = (0..num_blocks as u32)
            .map(|i| Block {
                refcount: 0,
                generation: 0,
                hash: None,
                parent: None,
                salt: 0,
                tokens: Vec::new(),
                pkey: 0,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i as usize + 1 == num_blocks { NIL } else { i + 1 },
                in_free_list: true,
            })
            .collect();
        Ok(BlockPool {
            store: Store {
                block_size,
                blocks,
                free_head: 0,
                free_tail: num_blocks as u32 - 1,
                num_free: num_blocks,
                cache: HashMap::with_hasher(FxBuild),
                children: HashMap::with_hasher(FxBuild),
                // A reservation made up front for the whole length is the naive scheme; it
                // has no prefix cache.
                prefix_caching: prefix_caching && !contiguous,
                counters: Counters::default(),
                pick_window: default_pick_window(num_blocks),
            },
            seqs: HashMap::with_hasher(FxBuild),
            contiguous,
            step: 0,
        })
    }

    // ---- gauges -------------------------------------------------------------------------

    /// Choose a sequence's next block among the `w` least recently freed (1: always the least
    /// recently freed; at most 16). The default: `default_pick_window`.
    pub fn set_pick_window(&mut self, w: usize) { self.store.pick_window = w.clamp(1, 16) }
    pub fn pick_window(&self) -> usize { self.store.pick_window }

    pub fn num_blocks(&self) -> usize { self.store.blocks.len() }
    pub fn block_size(&self) -> usize { self.store.block_size }
    pub fn num_free_blocks(&self) -> usize { self.store.num_free }
    pub fn num_used_blocks(&self) -> usize { self.store.blocks.len() - self.store.num_free }
    pub fn num_cached_blocks(&self) -> usize { self.store.cache.len() }
    pub fn num_sequences(&self) -> usize { self.seqs.len() }
    pub fn prefix_caching(&self) -> bool { self.store.prefix_caching }
    pub fn contiguous(&self) -> bool { self.contiguous }
    pub fn counters(&self) -> &Counters { &self.store.counters }

    pub fn refcount(&self, block: usize) -> Result<u32> {
        self.store.blocks.get(block).map(|b| b.refcount).ok_or_else(|| {
            AllocError::Invalid(format!("block id {block} out of range 0..{}", self.store.blocks.len()))
        })
    }

    pub fn is_cached(&self, block: usize) -> bool {
        self.store.blocks.get(block).is_some_and(|b| b.hash.is_some())
    }

    pub fn sequence(&self, seq_id: i64) -> Result<&Sequence> {
        self.seqs.get(&seq_id).ok_or(AllocError::UnknownSequence(seq_id))
    }

    pub fn seq_ids(&self) -> Vec<i64> { self.seqs.keys().copied().collect() }

    /// Free-list order, head (next to be evicted) first. For tests and debugging.
    pub fn free_list(&self) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.store.num_free);
        let mut cur = self.store.free_head;
        while cur != NIL {
            out.push(cur);
            cur = self.store.blocks[cur as usize].next;
        }
        out
    }

    /// Pure query: `(cached_tokens, free_cached_blocks)` — how many prompt tokens the prefix
    /// cache holds and how many of those blocks sit in the free list (admitting the prompt
    /// takes them out of it).
    pub fn prefix_match(&self, tokens: &[u32], salt: u64) -> (usize, usize) {
        let found = self.store.match_prefix(tokens, salt);
        let free = found.iter().filter(|&&id| self.store.refcount(id) == 0).count();
        (found.len() * self.store.block_size, free)
    }

    // ---- sequences ----------------------------------------------------------------------

    /// Add a sequence with its prompt; reuse cached prefix blocks. Returns the number of
    /// prompt tokens found in the prefix cache. In contiguous mode, reserve blocks for
    /// `reserve_tokens` (at least the prompt) up front, all or nothing.
    pub fn add_sequence(
        &mut self,
        seq_id: i64,
        tokens: Vec<u32>,
        salt: u64,
        reserve_tokens: Option<usize>,
    ) -> Result<usize> {
        self.add_sequence_with(seq_id, tokens, salt, reserve_tokens, false)
    }

    /// `add_sequence`; with `partial`, past the cached full blocks also the leading tokens of
    /// the cached block that shares the most with the prompt's next ones (`match_partial`):
    /// the sequence holds that block, and its first step copies it before writing the rest
    /// (a `copies` pair). The count returned then need not be whole blocks. Paged mode only.
    pub fn add_sequence_with(
        &mut self,
        seq_id: i64,
        tokens: Vec<u32>,
        salt: u64,
        reserve_tokens: Option<usize>,
        partial: bool,
    ) -> Result<usize> {
        if self.seqs.contains_key(&seq_id) {
            return Err(AllocError::DuplicateSequence(seq_id));
        }
        if tokens.is_empty() {
            return Err(AllocError::Invalid("a sequence needs at least one prompt token".into()));
        }
        let st = &mut self.store;
        let mut blocks = Vec::new();
        if self.contiguous {
            let want = st.blocks_for(reserve_tokens.unwrap_or(0).max(tokens.len()));
            if want > st.num_free {
                return Err(AllocError::NoFreeBlocks { needed: want, free: st.num_free });
            }
            blocks.extend((0..want).map(|_| st.pop_free()));
            blocks.sort_unstable();     // ascending, as `reserve` leaves a chunk's new blocks
        }
        let mut cached = st.match_prefix(&tokens, salt);
        let num_hashed_blocks = cached.len();
        let mut cached_tokens = cached.len() * st.block_size;
        if partial && !self.contiguous {
            if let Some((id, m)) = st.match_partial(&tokens, salt, &cached) {
                cached.push(id);
                cached_tokens += m;
            }
        }
        for &id in &cached {
            st.acquire(id);
        }
        if st.prefix_caching {
            st.counters.prefix_cache_queries += tokens.len() as u64;
            st.counters.prefix_cache_hits += cached_tokens as u64;
        }
        if !cached.is_empty() {
            blocks = cached;
        }
        self.seqs.insert(
            seq_id,
            Sequence {
                tokens,
                blocks,
                num_slots: cached_tokens,
                num_computed: cached_tokens,
                num_hashed_blocks,
                salt,
                released: 0,
                step: 0,
            },
        );
        Ok(cached_tokens)
    }

    pub fn append_tokens(&mut self, seq_id: i64, tokens: &[u32]) -> Result<()> {
        let seq = self.seqs.get_mut(&seq_id).ok_or(AllocError::UnknownSequence(seq_id))?;
        seq.tokens.extend_from_slice(tokens);
        Ok(())
    }

    /// Put `token` at `position` of a sequence's known tokens: a token a step ahead
    /// reserved a slot for before it was sampled (`prepare_step` appended a placeholder;
    /// the engine's look-ahead decode) is learned when it lands. Refused where the position
    /// is in a block already hashed (cached blocks never change) or past the known tokens.
    pub fn set_token(&mut self, seq_id: i64, position: usize, token: u32) -> Result<()> {
        let bs = self.store.block_size;
        let seq = self.seqs.get_mut(&seq_id).ok_or(AllocError::UnknownSequence(seq_id))?;
        if position >= seq.tokens.len() || position < seq.num_hashed_blocks * bs {
            return Err(AllocError::Invalid(format!(
                "set token {position} of sequence {seq_id}: it has {} tokens, {} of them in cached blocks",
                seq.tokens.len(),
                seq.num_hashed_blocks * bs
            )));
        }
        seq.tokens[position] = token;
        Ok(())
    }

    /// Child shares all of the parent's blocks (refcounts up); writes into a shared block
    /// copy it first (see `prepare_step`).
    pub fn fork(&mut self, parent_id: i64, child_id: i64) -> Result<()> {
        if self.seqs.contains_key(&child_id) {
            return Err(AllocError::DuplicateSequence(child_id));
        }
        let child = self.sequence(parent_id)?.clone();
        for &id in child.blocks.iter().filter(|&&id| id != NIL) {
            self.store.acquire(id);
        }
        self.seqs.insert(child_id, child);
        Ok(())
    }

    /// Release a sequence's blocks, tail first so its last blocks are evicted first. With
    /// `cache`, its computed full blocks enter the prefix cache first; without it (the step
    /// that was to compute them failed) only already-cached blocks stay cached.
    pub fn free_sequence(&mut self, seq_id: i64, cache: bool) -> Result<()> {
        self.free_sequence_with(seq_id, cache, false)
    }

    /// `free_sequence`; with `tail` (and `cache`, paged mode), its last block too when only
    /// part of it was computed (`Store::cache_tail`): the next request that continues the
    /// sequence's tokens (`add_sequence_with(.., partial)`) takes those positions' K/V.
    pub fn free_sequence_with(&mut self, seq_id: i64, cache: bool, tail: bool) -> Result<()> {
        let mut seq = self.seqs.remove(&seq_id).ok_or(AllocError::UnknownSequence(seq_id))?;
        if cache {
            seq.num_computed = seq.num_slots;
            self.store.hash_computed_blocks(&mut seq, false);
            if tail && !self.contiguous {
                self.store.cache_tail(&seq);
            }
        }
        for &id in seq.blocks.iter().rev().filter(|&&id| id != NIL) {
            self.store.release(id);
        }
        Ok(())
    }

    /// The window policy: give back the blocks of `seq_id` that no later query attends, every
    /// block wholly inside `[sink_tokens, num_slots - window_tokens]` (a query at position
    /// `q` attends its first `sink_tokens` and the `window_tokens` up to `q`; the next one is
    /// at `num_slots`). A block shared with other sequences (or the prefix cache) stays
    /// theirs: only this sequence's reference goes. Call it only while no step uses the
    /// sequence's blocks. Returns how many entries were released now.
    pub fn release_outside(&mut self, seq_id: i64, sink_tokens: usize, window_tokens: usize) -> Result<usize> {
        if window_tokens == 0 {
            return Err(AllocError::Invalid("the window must hold at least one token".into()));
        }
        if self.contiguous {
            return Err(AllocError::Invalid("the window policy needs the paged pool, not contiguous".into()));
        }
        let bs = self.store.block_size;
        let seq = self.seqs.get_mut(&seq_id).ok_or(AllocError::UnknownSequence(seq_id))?;
        let first = sink_tokens.div_ceil(bs);
        let end = ((seq.num_slots + 1).saturating_sub(window_tokens) / bs).min(seq.blocks.len());
        let mut n = 0;
        for j in first..end {
            let id = seq.blocks[j];
            if id != NIL {
                seq.blocks[j] = NIL;
                self.store.release(id);
                n += 1;
            }
        }
        seq.released += n;
        Ok(n)
    }

    /// Speculation's rollback: keep the first `num_tokens` tokens of a sequence (the drafted
    /// tokens its model rejected go). Slots and computed positions past it go with them;
    /// whole blocks past the kept slots return to the pool, tail first (in contiguous mode
    /// the reservation stays). A block cut inside that is registered in the prefix cache is
    /// given back too and its kept positions are computed again: a cached block's content
    /// never changes, and a block holding rejected tokens was never hashed (hashing covers
    /// computed positions, and the rollback comes before the next step). A block others
    /// share stays theirs; a later write into it copies it first. Not for a sequence the
    /// window policy released blocks of. Returns how many block references were given back.
    pub fn truncate(&mut self, seq_id: i64, num_tokens: usize) -> Result<usize> {
        let bs = self.store.block_size;
        let contiguous = self.contiguous;
        let seq = self.seqs.get_mut(&seq_id).ok_or(AllocError::UnknownSequence(seq_id))?;
        if num_tokens == 0 || num_tokens > seq.tokens.len() {
            return Err(AllocError::Invalid(format!(
                "truncate sequence {seq_id} to {num_tokens} tokens: it has {} (keep at least one)",
                seq.tokens.len()
            )));
        }
        if seq.released > 0 {
            return Err(AllocError::Sequence(format!(
                "sequence {seq_id} gave blocks back under the window policy: it cannot be truncated"
            )));
        }
        seq.tokens.truncate(num_tokens);
        let mut slots = seq.num_slots.min(num_tokens);
        let cut = slots / bs;
        if slots % bs != 0 && cut < seq.blocks.len() && self.store.blocks[seq.blocks[cut] as usize].hash.is_some() {
            slots = cut * bs;
        }
        seq.num_slots = slots;
        seq.num_computed = seq.num_computed.min(slots);
        seq.num_hashed_blocks = seq.num_hashed_blocks.min(slots / bs);
        let keep = if contiguous { seq.blocks.len() } else { slots.div_ceil(bs) };
        Ok(self.store.release_past(&mut seq.blocks, keep))
    }

    /// An interrupted step's undo: the sequence goes back to what it had before that step,
    /// `num_tokens` tokens (a token the step appended goes) and `num_slots` slots; the blocks
    /// past the kept slots return to the pool, tail first (in contiguous mode the reservation
    /// stays). Hashing covers only the slots reserved before a step, so nothing the step was
    /// to compute reached the prefix cache; a copy-on-write copy it made stays the
    /// sequence's. Not for a sequence the window policy released blocks of. Returns how many
    /// block references were given back.
    pub fn undo_step(&mut self, seq_id: i64, num_tokens: usize, num_slots: usize) -> Result<usize> {
        let bs = self.store.block_size;
        let contiguous = self.contiguous;
        let seq = self.seqs.get_mut(&seq_id).ok_or(AllocError::UnknownSequence(seq_id))?;
        if num_tokens == 0 || num_tokens > seq.tokens.len() || num_slots > num_tokens || num_slots > seq.num_slots
            || num_slots < seq.num_hashed_blocks * bs
        {
            return Err(AllocError::Invalid(format!(
                "undo a step of sequence {seq_id} to {num_tokens} tokens and {num_slots} slots: it has {} tokens, \
                 {} slots, {} of them in cached blocks",
                seq.tokens.len(),
                seq.num_slots,
                seq.num_hashed_blocks * bs
            )));
        }
        if seq.released > 0 {
            return Err(AllocError::Sequence(format!(
                "sequence {seq_id} gave blocks back under the window policy: its step cannot be undone"
            )));
        }
        seq.tokens.truncate(num_tokens);
        seq.num_slots = num_slots;
        seq.num_computed = seq.num_computed.min(num_slots);
        let keep = if contiguous { seq.blocks.len() } else { num_slots.div_ceil(bs) };
        Ok(self.store.release_past(&mut seq.blocks, keep))
    }

    /// Blocks `prepare_step` would take from the free list for `n` more tokens of a sequence
    /// (new blocks plus copy-on-write copies of shared blocks it would write into).
    pub fn blocks_needed(&self, seq_id: i64, n: usize) -> Result<usize> {
        Ok(self.store.blocks_needed_for(self.sequence(seq_id)?, n))
    }

    /// Blocks that `add_sequence(tokens, salt, reserve_tokens)` and then a first
    /// `prepare_step` of `new_tokens` tokens would take from the free pool: the cached
    /// prefix blocks taken out of the free list, and the new blocks (contiguous mode: its
    /// reservation). A pure query: the scheduler's admission test asks it rather than
    /// counting blocks itself.
    pub fn admission_blocks(&self, tokens: &[u32], salt: u64, new_tokens: usize, reserve_tokens: Option<usize>) -> usize {
        self.admission_blocks_with(tokens, salt, new_tokens, reserve_tokens, false)
    }

    /// `admission_blocks` for `add_sequence_with(.., partial)`: a partly shared block is
    /// taken out of the free list too, and the first step's copy of it is a new block.
    pub fn admission_blocks_with(&self, tokens: &[u32], salt: u64, new_tokens: usize, reserve_tokens: Option<usize>,
                                 partial: bool) -> usize {
        let st = &self.store;
        let mut cached = st.match_prefix(tokens, salt);
        if self.contiguous {
            let from_free = cached.iter().filter(|&&id| st.refcount(id) == 0).count();
            return from_free + st.blocks_for(reserve_tokens.unwrap_or(0).max(tokens.len()));
        }
        let mut cached_tokens = cached.len() * st.block_size;
        if partial {
            if let Some((id, m)) = st.match_partial(tokens, salt, &cached) {
                cached.push(id);
                cached_tokens += m;
            }
        }
        let from_free = cached.iter().filter(|&&id| st.refcount(id) == 0).count();
        let seq = Sequence {
            tokens: Vec::new(),
            blocks: cached,
            num_slots: cached_tokens,
            num_computed: cached_tokens,
            num_hashed_blocks: 0,
            salt,
            released: 0,
            step: 0,
        };
        from_free + st.blocks_needed_for(&seq, new_tokens)
    }

    /// The hot path, once per engine step: reserve slots for `num_new[i]` new tokens of
    /// each sequence `seq_ids[i]` and return the slot mapping, the padded block tables,
    /// the context lengths and the copy-on-write copies. All or nothing.
    ///
    /// `new_tokens`, when given, holds one token per sequence to append first (the token
    /// sampled last step), or -1 for none: decoding needs no separate call per sequence.
    pub fn prepare_step(
        &mut self,
        seq_ids: &[i64],
        num_new: &[i64],
        new_tokens: Option<&[i64]>,
    ) -> Result<StepPlan> {
        if seq_ids.len() != num_new.len() || new_tokens.is_some_and(|t| t.len() != seq_ids.len()) {
            return Err(AllocError::Invalid(format!(
                "seq_ids has {} entries but num_new_tokens has {}{}",
                seq_ids.len(),
                num_new.len(),
                new_tokens.map_or(String::new(), |t| format!(" and new_tokens {}", t.len()))
            )));
        }
        let appended = |k: usize| new_tokens.map_or(0, |t| (t[k] >= 0) as usize);
        if let Some(bad) = new_tokens.and_then(|t| t.iter().find(|&&x| x >= u32::MAX as i64)) {
            return Err(AllocError::Invalid(format!("token id {bad} out of range")));
        }
        // validate and count, changing nothing observable
        self.step += 1;
        let st = &self.store;
        let bs = st.block_size;
        let (mut need, mut total, mut width) = (0usize, 0usize, 1usize);
        for (k, (&sid, &n)) in seq_ids.iter().zip(num_new).enumerate() {
            if n < 0 {
                return Err(AllocError::Invalid(format!("num_new_tokens[{k}] is negative ({n})")));
            }
            let n = n as usize;
            let seq = self.seqs.get_mut(&sid).ok_or(AllocError::UnknownSequence(sid))?;
            if seq.step == self.step {
                return Err(AllocError::Invalid(format!("sequence {sid} appears twice in one step")));
            }
            seq.step = self.step;
            let known = seq.tokens.len() + appended(k);
            if seq.num_slots + n > known {
                return Err(AllocError::Sequence(format!(
                    "sequence {sid}: {n} new tokens requested but only {} known tokens lack a slot",
                    known - seq.num_slots
                )));
            }
            let blocks_after = seq.blocks.len().max(st.blocks_for(seq.num_slots + n));
            if self.contiguous && blocks_after > seq.blocks.len() {
                return Err(AllocError::Sequence(format!(
                    "sequence {sid}: {} tokens exceed its reservation of {} tokens",
                    seq.num_slots + n,
                    seq.blocks.len() * bs
                )));
            }
            need += st.blocks_needed_for(seq, n);
            total += n;
            width = width.max(blocks_after - seq.released);
        }
        if need > st.num_free {
            return Err(AllocError::NoFreeBlocks { needed: need, free: st.num_free });
        }

        let mut plan = StepPlan {
            slot_mapping: Vec::with_capacity(total),
            block_tables: vec![0i32; seq_ids.len() * width],
            width,
            seq_lens: Vec::with_capacity(seq_ids.len()),
            copies: Vec::new(),
        };
        // What was reserved before counts as computed: cache its full blocks first, for
        // every sequence, so a deduplication never meets a block reserved in this step.
        for (k, &sid) in seq_ids.iter().enumerate() {
            let seq = self.seqs.get_mut(&sid).unwrap();
            if appended(k) == 1 {
                seq.tokens.push(new_tokens.unwrap()[k] as u32);
            }
            seq.num_computed = seq.num_slots;
            self.store.hash_computed_blocks(seq, true);
        }
        // every sequence's last block, sorted: the ids after them are claimed (`pop_near`)
        let last_of = |seq: &Sequence| seq.blocks.last().copied().filter(|&b| b != NIL);
        let picks = need > 0 && self.store.pick_window > 1;
        let mut lasts: Vec<u32> = if picks { self.seqs.values().filter_map(last_of).collect() } else { Vec::new() };
        lasts.sort_unstable();
        for (row, (&sid, &n)) in seq_ids.iter().zip(num_new).enumerate() {
            let seq = self.seqs.get_mut(&sid).unwrap();
            // only a sequence that takes blocks moves its claim (its own left out while it picks)
            let moves = picks && self.store.blocks_needed_for(seq, n as usize) > 0;
            if let Some(i) = last_of(seq).filter(|_| moves).and_then(|b| lasts.binary_search(&b).ok()) {
                lasts.remove(i);     // (always there: collected above, and only this row moves it)
            }
            self.store.reserve(seq, n as usize, &mut plan.slot_mapping, &mut plan.copies, &lasts);
            if let Some(b) = last_of(seq).filter(|_| moves) {
                let at = lasts.partition_point(|&l| l < b);
                lasts.insert(at, b);
            }
            // released blocks are left out: the kernels see the kept positions as one shorter
            // sequence (the sinks, then the window), rotated at their true positions
            plan.seq_lens.push((seq.num_slots - seq.released * self.store.block_size) as i32);
            let dst = &mut plan.block_tables[row * width..row * width + seq.blocks.len() - seq.released];
            for (d, &b) in dst.iter_mut().zip(seq.blocks.iter().filter(|&&b| b != NIL)) {
                *d = b as i32;
            }
        }
        Ok(plan)
    }

    /// Check every invariant; used by the tests (cheap enough for debugging runs too).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let st = &self.store;
        let mut refs = vec![0u32; st.blocks.len()];
        for (sid, seq) in &self.seqs {
            if seq.num_slots > seq.blocks.len() * st.block_size {
                return Err(format!("sequence {sid} has slots beyond its blocks"));
            }
            if seq.num_computed > seq.num_slots || seq.num_slots > seq.tokens.len() {
                return Err(format!("sequence {sid}: computed <= slots <= tokens violated"));
            }
            for &b in seq.blocks.iter().filter(|&&b| b != NIL) {
                refs[b as usize] += 1;
            }
            if seq.blocks.iter().filter(|&&b| b == NIL).count() != seq.released {
                return Err(format!("sequence {sid}: {} released entries counted", seq.released));
            }
        }
        let free: std::collections::HashSet<u32> = self.free_list().into_iter().collect();
        if free.len() != st.num_free {
            return Err(format!("free list has {} entries, counter says {}", free.len(), st.num_free));
        }
        for (i, b) in st.blocks.iter().enumerate() {
            if b.refcount != refs[i] {
                return Err(format!("block {i}: refcount {} but {} tables hold it", b.refcount, refs[i]));
            }
            if (b.refcount == 0) != free.contains(&(i as u32)) || b.in_free_list != (b.refcount == 0) {
                return Err(format!("block {i}: refcount {} vs free-list membership", b.refcount));
            }
            if let Some(h) = b.hash {
                if st.cache.get(&h) != Some(&(i as u32)) {
                    return Err(format!("block {i} has a hash the cache does not map to it"));
                }
            }
        }
        if st.cache.values().any(|&id| st.blocks[id as usize].hash.is_none()) {
            return Err("cache maps to a block without a hash".into());
        }
        let mut listed = 0;
        for (key, list) in &st.children {
            for &id in list {
                let b = &st.blocks[id as usize];
                if b.hash.is_none() || b.pkey != *key {
                    return Err(format!("block {id} is listed as a continuation it is not"));
                }
                if b.tokens.len() > st.block_size || (b.tokens.len() < st.block_size && b.tokens.len() < PARTIAL_MIN) {
                    return Err(format!("cached block {id} holds {} tokens", b.tokens.len()));
                }
            }
            listed += list.len();
        }
        if listed != st.cache.len() {
            return Err(format!("{listed} continuations listed for {} cached blocks", st.cache.len()));
        }
        Ok(())
    }
}
