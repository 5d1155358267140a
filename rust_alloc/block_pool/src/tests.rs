//! Invariant tests of the core pool (no Python needed).

use crate::pool::{AllocError, BlockPool};

fn pool(n: usize, bs: usize) -> BlockPool { BlockPool::new(n, bs, true, false).unwrap() }

fn ok(p: &BlockPool) { p.check_invariants().unwrap() }

#[test]
fn new_rejects_bad_sizes() {
    assert!(matches!(BlockPool::new(0, 16, true, false), Err(AllocError::Invalid(_))));
    assert!(matches!(BlockPool::new(4, 0, true, false), Err(AllocError::Invalid(_))));
}

#[test]
fn prepare_step_reserves_slots_and_tables() {
    let mut p = pool(8, 4);
    assert_eq!(p.add_sequence(1, (0..6).collect(), 0, None).unwrap(), 0);
    let plan = p.prepare_step(&[1], &[6], None).unwrap();
    assert_eq!(plan.slot_mapping, vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(plan.width, 2);
    assert_eq!(plan.block_tables, vec![0, 1]);
    assert_eq!(plan.seq_lens, vec![6]);
    assert_eq!(p.num_free_blocks(), 6);
    p.append_tokens(1, &[100]).unwrap();
    let plan = p.prepare_step(&[1], &[1], None).unwrap();
    assert_eq!(plan.slot_mapping, vec![6]);
    ok(&p);
    // more tokens than known
    assert!(matches!(p.prepare_step(&[1], &[1], None), Err(AllocError::Sequence(_))));
    ok(&p);
}

#[test]
fn prepare_step_appends_sampled_tokens_first() {
    let mut p = pool(4, 2);
    p.add_sequence(1, vec![5, 6], 0, None).unwrap();
    p.add_sequence(2, vec![7], 0, None).unwrap();
    p.prepare_step(&[1, 2], &[2, 1], None).unwrap();
    let plan = p.prepare_step(&[1, 2], &[1, 1], Some(&[8, 9])).unwrap();
    assert_eq!(plan.seq_lens, vec![3, 2]);
    assert_eq!(p.sequence(1).unwrap().tokens, vec![5, 6, 8]);
    // -1 appends nothing; a failing step appends nothing either
    assert!(matches!(p.prepare_step(&[1], &[1], Some(&[-1])), Err(AllocError::Sequence(_))));
    p.prepare_step(&[1], &[0], Some(&[-1])).unwrap();
    assert_eq!(p.sequence(1).unwrap().tokens, vec![5, 6, 8]);
    p.append_tokens(2, &[1, 1, 1, 1, 1]).unwrap();
    assert!(matches!(p.prepare_step(&[1, 2], &[1, 5], Some(&[3, -1])), Err(AllocError::NoFreeBlocks { .. })));
    assert_eq!(p.sequence(1).unwrap().tokens, vec![5, 6, 8]);
    assert!(matches!(p.prepare_step(&[1], &[1], Some(&[1, 2])), Err(AllocError::Invalid(_))));
    ok(&p);
}

#[test]
fn a_token_learned_after_its_slot_and_never_inside_a_hashed_block() {
    let mut p = pool(8, 2);
    p.add_sequence(1, vec![5, 6, 7], 0, None).unwrap();
    p.prepare_step(&[1], &[3], None).unwrap();
    // a step ahead: the slot of a token not sampled yet (placeholder 0), learned later
    let plan = p.prepare_step(&[1], &[1], Some(&[0])).unwrap();
    assert_eq!(plan.slot_mapping.len(), 1);
    p.set_token(1, 3, 9).unwrap();
    assert_eq!(p.sequence(1).unwrap().tokens, vec![5, 6, 7, 9]);
    // the next step hashes the now full block [7, 9] with the real token
    p.prepare_step(&[1], &[0], None).unwrap();
    assert_eq!(p.prefix_match(&[5, 6, 7, 9, 1], 0).0, 4);
    // blocks already hashed, and positions past the known tokens, are refused
    assert!(matches!(p.set_token(1, 1, 3), Err(AllocError::Invalid(_))));
    assert!(matches!(p.set_token(1, 3, 3), Err(AllocError::Invalid(_))));
    assert!(matches!(p.set_token(1, 4, 3), Err(AllocError::Invalid(_))));
    assert!(matches!(p.set_token(7, 0, 3), Err(AllocError::UnknownSequence(7))));
    ok(&p);
}

#[test]
fn all_or_nothing_when_out_of_blocks() {
    let mut p = pool(3, 4);
    p.add_sequence(1, (0..8).collect(), 0, None).unwrap();
    p.add_sequence(2, (100..108).collect(), 0, None).unwrap();
    let before = p.free_list();
    let e = p.prepare_step(&[1, 2], &[8, 8], None).unwrap_err();
    assert_eq!(e, AllocError::NoFreeBlocks { needed: 4, free: 3 });
    assert_eq!(p.free_list(), before);
    assert_eq!(p.sequence(1).unwrap().num_slots, 0);
    ok(&p);
    // unknown id and duplicate id in a batch change nothing either
    assert!(matches!(p.prepare_step(&[1, 9], &[1, 1], None), Err(AllocError::UnknownSequence(9))));
    assert!(matches!(p.prepare_step(&[1, 1], &[1, 1], None), Err(AllocError::Invalid(_))));
    assert!(matches!(p.add_sequence(1, vec![1], 0, None), Err(AllocError::DuplicateSequence(1))));
    assert_eq!(p.sequence(1).unwrap().num_slots, 0);
    ok(&p);
}

#[test]
fn prefix_cache_hit_shares_full_blocks_only() {
    let mut p = pool(16, 4);
    let prompt: Vec<u32> = (0..10).collect();
    p.add_sequence(1, prompt.clone(), 0, None).unwrap();
    p.prepare_step(&[1], &[10], None).unwrap();
    p.free_sequence(1, true).unwrap();
    ok(&p);
    assert_eq!(p.num_cached_blocks(), 2); // 2 full blocks of 4; the partial one is not cached
    let t1 = p.add_sequence(2, prompt.clone(), 0, None).unwrap();
    assert_eq!(t1, 8);
    assert_eq!(p.sequence(2).unwrap().blocks, vec![0, 1]);
    // a different salt sees nothing
    assert_eq!(p.add_sequence(3, prompt.clone(), 7, None).unwrap(), 0);
    // a prompt of exactly two blocks leaves its last block to compute
    assert_eq!(p.add_sequence(4, (0..8).collect(), 0, None).unwrap(), 4);
    // a different first block: no hit for the second one either (chain)
    let mut other = prompt.clone();
    other[0] = 99;
    assert_eq!(p.add_sequence(5, other, 0, None).unwrap(), 0);
    assert_eq!(p.refcount(0).unwrap(), 2);
    ok(&p);
}

#[test]
fn eviction_takes_least_recently_freed_tail_first() {
    let mut p = pool(4, 2);
    p.add_sequence(1, (0..5).collect(), 0, None).unwrap();
    p.prepare_step(&[1], &[5], None).unwrap(); // blocks 0,1,2
    p.free_sequence(1, true).unwrap();
    // freed tail first: 3 (never used) is first, then 2, 1, 0
    assert_eq!(p.free_list(), vec![3, 2, 1, 0]);
    p.add_sequence(2, (50..57).collect(), 0, None).unwrap();
    p.prepare_step(&[2], &[5], None).unwrap(); // takes 3, 2 (uncached partial), 1 (cached: evicted)
    assert_eq!(p.counters().evictions, 1);
    assert_eq!(p.num_cached_blocks(), 1);
    // block 0 still holds [0, 1]
    p.free_sequence(2, true).unwrap();
    assert_eq!(p.add_sequence(3, vec![0, 1, 2], 0, None).unwrap(), 2);
    ok(&p);
}

#[test]
fn evicted_parent_never_links_to_a_stale_child() {
    let mut p = pool(3, 2);
    p.add_sequence(1, vec![1, 2, 3, 4, 5], 0, None).unwrap();
    p.prepare_step(&[1], &[5], None).unwrap();
    p.free_sequence(1, true).unwrap(); // cached: b0=[1,2], b1=[3,4]
    // reuse everything with other content
    p.add_sequence(2, vec![7, 7, 7, 7, 7, 7], 0, None).unwrap();
    p.prepare_step(&[2], &[6], None).unwrap();
    p.free_sequence(2, false).unwrap();
    assert_eq!(p.add_sequence(3, vec![1, 2, 3, 4, 5], 0, None).unwrap(), 0);
    ok(&p);
}

#[test]
fn fork_copy_on_write() {
    let mut p = pool(8, 4);
    p.add_sequence(1, (0..6).collect(), 0, None).unwrap();
    p.prepare_step(&[1], &[6], None).unwrap(); // blocks 0, 1 (partial: 2 of 4)
    p.fork(1, 2).unwrap();
    assert_eq!(p.refcount(1).unwrap(), 2);
    ok(&p);
    p.append_tokens(1, &[10]).unwrap();
    p.append_tokens(2, &[20]).unwrap();
    let plan = p.prepare_step(&[1, 2], &[1, 1], None).unwrap();
    // the first writer copies the shared partial block; the second then owns the original
    assert_eq!(plan.copies, vec![(1, 2)]);
    assert_eq!(plan.slot_mapping, vec![2 * 4 + 2, 4 + 2]);
    assert_eq!(p.refcount(1).unwrap(), 1);
    assert_eq!(p.refcount(0).unwrap(), 2); // the full block stays shared
    ok(&p);
    assert!(matches!(p.fork(1, 2), Err(AllocError::DuplicateSequence(2))));
    assert!(matches!(p.fork(9, 3), Err(AllocError::UnknownSequence(9))));
}

#[test]
fn duplicate_blocks_are_deduplicated_once_computed() {
    let mut p = pool(8, 2);
    let prompt = vec![1, 2, 3, 4, 5];
    p.add_sequence(1, prompt.clone(), 0, None).unwrap();
    p.add_sequence(2, prompt.clone(), 0, None).unwrap();
    p.prepare_step(&[1, 2], &[5, 5], None).unwrap(); // both compute everything: 6 blocks
    assert_eq!(p.num_used_blocks(), 6);
    p.append_tokens(1, &[6]).unwrap();
    p.append_tokens(2, &[6]).unwrap();
    p.prepare_step(&[1, 2], &[1, 1], None).unwrap();
    // seq 2's two full blocks were swapped for seq 1's cached ones
    assert_eq!(p.sequence(2).unwrap().blocks[..2], p.sequence(1).unwrap().blocks[..2]);
    assert_eq!(p.num_used_blocks(), 4);
    ok(&p);
}

#[test]
fn contiguous_reserves_up_front() {
    let mut p = BlockPool::new(10, 4, true, true).unwrap();
    assert!(!p.prefix_caching());
    p.add_sequence(1, (0..5).collect(), 0, Some(20)).unwrap();
    assert_eq!(p.num_used_blocks(), 5);
    assert!(matches!(
        p.add_sequence(2, (0..5).collect(), 0, Some(24)),
        Err(AllocError::NoFreeBlocks { needed: 6, free: 5 })
    ));
    assert_eq!(p.num_sequences(), 1);
    let plan = p.prepare_step(&[1], &[5], None).unwrap();
    assert_eq!(plan.width, 5);
    assert_eq!(p.num_used_blocks(), 5);
    p.append_tokens(1, &(0..20).collect::<Vec<u32>>()).unwrap();
    assert!(matches!(p.prepare_step(&[1], &[16], None), Err(AllocError::Sequence(_))));
    p.prepare_step(&[1], &[15], None).unwrap();
    p.free_sequence(1, true).unwrap();
    assert_eq!(p.num_free_blocks(), 10);
    ok(&p);
}

#[test]
fn random_operations_keep_invariants() {
    // blocks of 4 (no tail is ever cached: PARTIAL_MIN) and of 8 (tails of 4-7 tokens are)
    for bs in [4, 8] {
        random_operations(bs);
    }
}

/// Random adds (whole or `partial`), frees (cached or not, with or without the tail), forks
/// and steps on a pool of 64 blocks, checking the invariants after each, and what each slot
/// holds: a step writes its tokens into its slots after its copies, and every position an
/// add found cached holds the prompt's own token there.
fn random_operations(bs: usize) {
    // a small deterministic LCG so the test needs no crates
    let mut s: u64 = 12345;
    let mut rnd = |n: u64| {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 33) % n
    };
    let mut p = pool(64, bs);
    let mut content = vec![u32::MAX; 64 * bs];
    let mut live: Vec<i64> = Vec::new();
    let mut next_id = 0i64;
    let (mut tails, mut parts, mut released) = (0, 0, 0);
    for _ in 0..20_000 {
        // as many frees as adds (a pool that is always full steps rarely), steps most often
        match rnd(7) {
            0 | 1 => {
                let len = 1 + rnd(5 * bs as u64) as usize;
                let base = rnd(3) as u32 * 100;
                // a shared start (prefix hits, evictions, deduplication), then the prompt's own
                let shared = rnd(len as u64 + 1) as u32;
                let toks: Vec<u32> = (0..len as u32).map(|i| if i < shared { base + i % 7 } else { 1000 + rnd(50) as u32 }).collect();
                if let Ok(c) = p.add_sequence_with(next_id, toks.clone(), rnd(2), None, rnd(2) == 0) {
                    let q = p.sequence(next_id).unwrap();
                    for (pos, &t) in toks.iter().enumerate().take(c) {
                        let slot = q.blocks[pos / bs] as usize * bs + pos % bs;
                        assert_eq!(content[slot], t, "block size {bs}: cached position {pos} of {c}");
                    }
                    parts += (c % bs != 0) as usize;
                    live.push(next_id);
                }
                next_id += 1;
            }
            2 | 3 if !live.is_empty() => {
                let id = live.swap_remove(rnd(live.len() as u64) as usize);
                let cached = p.num_cached_blocks();
                let (cache, tail) = (rnd(4) != 0, rnd(2) == 0);
                let (n, held) = {
                    let q = p.sequence(id).unwrap();
                    (q.num_slots, q.blocks.last().filter(|&&b| b != u32::MAX).map(|&b| p.refcount(b as usize).unwrap()))
                };
                p.free_sequence_with(id, cache, tail).unwrap();
                if cache && tail && n % bs >= 4 && held == Some(1) && p.num_cached_blocks() > cached {
                    tails += 1;
                }
            }
            4 if !live.is_empty() && rnd(4) == 0 => {
                let id = live[rnd(live.len() as u64) as usize];
                if p.fork(id, next_id).is_ok() {
                    live.push(next_id);
                }
                next_id += 1;
            }
            4 if !live.is_empty() && rnd(8) == 0 => {
                // the window policy: blocks no later query attends go back (never cached after)
                let id = live[rnd(live.len() as u64) as usize];
                released += p.release_outside(id, bs * rnd(2) as usize, 1 + rnd(3 * bs as u64) as usize).unwrap();
            }
            _ if !live.is_empty() => {
                let k = 1 + rnd(live.len() as u64) as usize;
                let r = rnd(live.len() as u64) as usize;
                live.rotate_left(r);
                let ids: Vec<i64> = live[..k].to_vec();
                for &id in &ids {
                    if rnd(2) == 0 {
                        p.append_tokens(id, &[rnd(5) as u32]).unwrap();
                    }
                }
                let n: Vec<i64> = ids
                    .iter()
                    .map(|&id| {
                        let q = p.sequence(id).unwrap();
                        let avail = (q.tokens.len() - q.num_slots) as u64;
                        rnd(avail + 1) as i64
                    })
                    .collect();
                let from: Vec<usize> = ids.iter().map(|&id| p.sequence(id).unwrap().num_slots).collect();
                let free_before = p.free_list();
                match p.prepare_step(&ids, &n, None) {
                    Ok(plan) => {
                        for &(src, dst) in &plan.copies {
                            let (src, dst) = (src as usize * bs, dst as usize * bs);
                            content.copy_within(src..src + bs, dst);
                        }
                        let mut at = 0;
                        for (i, &id) in ids.iter().enumerate() {
                            let q = p.sequence(id).unwrap();
                            for pos in from[i]..from[i] + n[i] as usize {
                                content[plan.slot_mapping[at] as usize] = q.tokens[pos];
                                at += 1;
                            }
                        }
                    }
                    Err(AllocError::NoFreeBlocks { .. }) => assert_eq!(p.free_list(), free_before),
                    Err(e) => panic!("unexpected {e}"),
                }
            }
            _ => {}
        }
        ok(&p);
        assert_eq!(p.num_free_blocks() + p.num_used_blocks(), 64);
    }
    assert!(bs < 8 || tails > 30, "block size {bs}: {tails} tails cached");
    assert!(bs < 8 || parts > 30, "block size {bs}: {parts} prompts started inside a block");
    assert!(released > 30, "block size {bs}: {released} blocks released by the window policy");
    for id in live {
        p.free_sequence(id, true).unwrap();
    }
    assert_eq!(p.num_used_blocks(), 0);
    ok(&p);
}

#[test]
fn the_window_policy_releases_blocks_no_query_attends() {
    // blocks of 4; sink 4 tokens (block 0), window 8 tokens
    let mut p = pool(16, 4);
    p.add_sequence(1, (0..10).collect(), 0, None).unwrap();
    p.prepare_step(&[1], &[10], None).unwrap();
    // next query at 10 attends 0..4 and 3..10: nothing wholly dead yet
    assert_eq!(p.release_outside(1, 4, 8).unwrap(), 0);
    let mut tok = 100;
    for _ in 0..6 {
        p.prepare_step(&[1], &[1], Some(&[tok])).unwrap();
        tok += 1;
    }
    // 16 slots: the next query (16) attends 0..4 and 9..16: block 1 (4..8) is dead, block 2 (8..12) not
    let table = p.sequence(1).unwrap().blocks.clone();
    assert_eq!(p.release_outside(1, 4, 8).unwrap(), 1);
    assert_eq!(p.release_outside(1, 4, 8).unwrap(), 0);           // once
    assert_eq!(p.refcount(table[1] as usize).unwrap(), 0);
    assert_eq!(p.refcount(table[0] as usize).unwrap(), 1);        // the sink stays
    ok(&p);
    // tables leave it out; the kernels see 12 positions: the sink block, then 8..16 (+ the new one)
    let plan = p.prepare_step(&[1], &[1], Some(&[tok])).unwrap();
    let now = p.sequence(1).unwrap().blocks.clone();
    assert_eq!(plan.seq_lens, vec![13]);
    assert_eq!(plan.width, 4);
    assert_eq!(plan.block_tables, vec![table[0] as i32, table[2] as i32, table[3] as i32, now[4] as i32]);
    assert_eq!(now[1], u32::MAX);
    assert_eq!(plan.slot_mapping, vec![now[4] as i64 * 4]);        // written at its true place
    ok(&p);
    // a fork shares the kept blocks; releasing in one keeps what the other holds
    p.fork(1, 2).unwrap();
    for _ in 0..7 {
        p.prepare_step(&[1], &[1], Some(&[tok])).unwrap();
        tok += 1;
    }
    let kept = p.sequence(1).unwrap().blocks.clone();
    assert!(p.release_outside(1, 4, 8).unwrap() >= 1);
    assert_eq!(p.refcount(kept[2] as usize).unwrap(), 1);          // seq 2 still holds block 2
    ok(&p);
    p.free_sequence(1, true).unwrap();
    p.free_sequence(2, true).unwrap();
    assert_eq!(p.num_free_blocks(), 16);
    ok(&p);
    // the contiguous pool has no window policy
    let mut c = BlockPool::new(8, 4, false, true).unwrap();
    c.add_sequence(1, (0..4).collect(), 0, Some(8)).unwrap();
    assert!(matches!(c.release_outside(1, 0, 4), Err(AllocError::Invalid(_))));
}

#[test]
fn a_released_block_keeps_its_prefix_cache_entry_valid() {
    let mut p = pool(12, 4);
    let prompt: Vec<u32> = (0..12).collect();
    p.add_sequence(1, prompt.clone(), 0, None).unwrap();
    p.prepare_step(&[1], &[12], None).unwrap();
    let mut tok = 50;
    for _ in 0..8 {
        p.prepare_step(&[1], &[1], Some(&[tok])).unwrap();
        tok += 1;
    }
    // blocks 0..3 hashed by now; window 4, no sink: blocks 0..4 dead
    let table = p.sequence(1).unwrap().blocks.clone();
    assert_eq!(p.release_outside(1, 0, 4).unwrap(), 4);
    ok(&p);
    assert!(p.is_cached(table[0] as usize) && p.refcount(table[0] as usize).unwrap() == 0);
    // a new request with the same prompt finds the released blocks' content, intact
    assert_eq!(p.add_sequence(2, prompt, 0, None).unwrap(), 8);
    assert_eq!(p.sequence(2).unwrap().blocks[..2], table[..2]);
    ok(&p);
    p.free_sequence(1, true).unwrap();
    p.free_sequence(2, true).unwrap();
    ok(&p);
}

#[test]
fn truncate_rolls_back_drafted_tokens() {
    let mut p = pool(8, 4);
    p.add_sequence(1, (0..6).collect(), 0, None).unwrap();
    p.prepare_step(&[1], &[6], None).unwrap();
    p.fork(1, 2).unwrap(); // a sample shares the blocks
    p.append_tokens(1, &[50, 51, 52, 53]).unwrap();
    p.prepare_step(&[1], &[4], None).unwrap(); // drafted tokens verified in one step (a copy of the shared block)
    assert_eq!(p.sequence(1).unwrap().blocks.len(), 3);
    assert_eq!(p.truncate(1, 7).unwrap(), 1); // three rejected: the third block goes
    let s = p.sequence(1).unwrap();
    assert_eq!((s.num_slots, s.num_computed, s.tokens.len(), s.blocks.len()), (7, 6, 7, 2));
    ok(&p);
    // the shared sample is untouched
    assert_eq!(p.sequence(2).unwrap().num_slots, 6);
    assert!(matches!(p.truncate(1, 0), Err(AllocError::Invalid(_))));
    assert!(matches!(p.truncate(1, 8), Err(AllocError::Invalid(_))));
    assert!(matches!(p.truncate(9, 1), Err(AllocError::UnknownSequence(9))));
    p.free_sequence(1, true).unwrap();
    p.free_sequence(2, true).unwrap();
    assert_eq!(p.num_free_blocks(), 8);
    ok(&p);
}

#[test]
fn undo_step_gives_back_what_the_step_reserved() {
    let mut p = pool(8, 4);
    // a prompt of 10 tokens: 6 computed, then a step of 4 more is interrupted
    p.add_sequence(1, (0..10).collect(), 0, None).unwrap();
    p.prepare_step(&[1], &[6], None).unwrap();
    p.prepare_step(&[1], &[4], None).unwrap();
    assert_eq!(p.sequence(1).unwrap().blocks.len(), 3);
    assert_eq!(p.undo_step(1, 10, 6).unwrap(), 1);
    let s = p.sequence(1).unwrap();
    assert_eq!((s.num_slots, s.num_computed, s.tokens.len(), s.blocks.len()), (6, 6, 10, 2));
    ok(&p);
    // the chunk again: the same slots, and the first full block was cached before the step
    let plan = p.prepare_step(&[1], &[4], None).unwrap();
    assert_eq!(plan.slot_mapping.len(), 4);
    assert_eq!(p.num_cached_blocks(), 1);
    // a decode step that appended its token: the token goes too
    let plan = p.prepare_step(&[1], &[1], Some(&[77])).unwrap();
    assert_eq!(plan.seq_lens, vec![11]);
    assert_eq!(p.undo_step(1, 10, 10).unwrap(), 0);
    assert_eq!(p.sequence(1).unwrap().tokens.len(), 10);
    p.prepare_step(&[1], &[1], Some(&[77])).unwrap();
    assert_eq!(p.sequence(1).unwrap().tokens[10], 77);
    // a fresh prompt whose first chunk is interrupted keeps no block
    p.add_sequence(2, (100..108).collect(), 0, None).unwrap();
    p.prepare_step(&[2], &[8], None).unwrap();
    assert_eq!(p.undo_step(2, 8, 0).unwrap(), 2);
    assert_eq!(p.sequence(2).unwrap().blocks.len(), 0);
    ok(&p);
    // nothing the interrupted step reserved entered the prefix cache
    p.free_sequence(2, true).unwrap();
    assert_eq!(p.prefix_match(&(100..108).collect::<Vec<u32>>(), 0).0, 0);
    // more than the sequence has, or slots the step did not reserve
    assert!(matches!(p.undo_step(1, 12, 11), Err(AllocError::Invalid(_))));
    assert!(matches!(p.undo_step(1, 11, 4), Err(AllocError::Invalid(_)))); // cached blocks stay
    assert!(matches!(p.undo_step(9, 1, 0), Err(AllocError::UnknownSequence(9))));
    p.free_sequence(1, true).unwrap();
    assert_eq!(p.num_free_blocks(), 8);
    ok(&p);
}

#[test]
fn a_chunk_takes_its_new_blocks_in_ascending_order() {
    // sequence 1 fills blocks 0..8 and goes back tail first (the free list: the unused 8 and
    // 9, then 7, 6, ... 0); sequence 2's chunks take the least recently freed, each ascending
    let mut p = pool(10, 4);
    p.add_sequence(1, (0..32).collect(), 0, None).unwrap();
    assert_eq!(p.prepare_step(&[1], &[32], None).unwrap().block_tables, (0..8).collect::<Vec<i32>>());
    p.free_sequence(1, true).unwrap();
    assert_eq!(p.free_list(), vec![8, 9, 7, 6, 5, 4, 3, 2, 1, 0]);
    p.add_sequence(2, (100..132).collect(), 0, None).unwrap();
    let plan = p.prepare_step(&[2], &[20], None).unwrap();
    assert_eq!(plan.block_tables, vec![5, 6, 7, 8, 9], "the free list's first five (8, 9, 7, 6, 5), ascending");
    assert_eq!(plan.slot_mapping[..5], [20, 21, 22, 23, 24]);
    let plan = p.prepare_step(&[2], &[12], None).unwrap();
    assert_eq!(plan.block_tables, vec![5, 6, 7, 8, 9, 2, 3, 4]);
    ok(&p);
}

/// A pool of 256 blocks of 4 whose every block was used by one sequence and freed (tail first:
/// the free list 255, 254, ... 0), choosing among `w` of the least recently freed.
fn cycled(w: usize) -> BlockPool {
    let mut p = pool(256, 4);
    p.set_pick_window(w);
    p.add_sequence(1, (0..1024).collect(), 0, None).unwrap();
    p.prepare_step(&[1], &[1024], None).unwrap();
    p.free_sequence(1, false).unwrap();
    assert_eq!(p.free_list(), (0..256).rev().collect::<Vec<u32>>());
    p
}

/// Grow `seqs` side by side a token a step for `blocks` blocks each; every new block must be
/// one of the `w` least recently freed. Returns each one's block table.
fn grow(p: &mut BlockPool, seqs: &[i64], blocks: usize, w: usize) -> Vec<Vec<u32>> {
    for &s in seqs {
        p.add_sequence(s, vec![s as u32], 0, None).unwrap();
    }
    let mut tokens: Vec<i64> = vec![];
    for step in 0..blocks * 4 {
        // the k-th pick of a step is among the w least recently freed left after the k - 1 before
        let window: Vec<u32> = p.free_list().into_iter().take(w + seqs.len() - 1).collect();
        let before: Vec<usize> = seqs.iter().map(|&s| p.sequence(s).unwrap().blocks.len()).collect();
        let new = if step == 0 { None } else { Some(&tokens[..]) };
        p.prepare_step(seqs, &vec![1; seqs.len()], new).unwrap();
        let mut taken = vec![];
        for (k, &s) in seqs.iter().enumerate() {
            taken.extend_from_slice(&p.sequence(s).unwrap().blocks[before[k]..]);
        }
        assert!(taken.iter().all(|b| window.contains(b)), "step {step}: {taken:?} outside {window:?}");
        tokens = seqs.iter().map(|&s| s * 1000 + step as i64).collect();   // no two blocks alike
        ok(p);
    }
    seqs.iter().map(|&s| p.sequence(s).unwrap().blocks.clone()).collect()
}

fn consecutive(t: &[u32]) -> usize { t.windows(2).filter(|w| w[1] == w[0] + 1).count() }

#[test]
fn a_sequence_growing_a_block_at_a_time_takes_the_block_after_its_last() {
    // before: the least recently freed each time, a context in descending blocks
    let mut p = cycled(1);
    assert_eq!(grow(&mut p, &[2], 32, 1)[0], (224..256).rev().collect::<Vec<u32>>());
    // among 16: the start of the run in the window (240), then each next id; then the next 16
    let mut p = cycled(16);
    let t = grow(&mut p, &[2], 32, 16).remove(0);
    assert_eq!(t, (240..256).chain(224..240).collect::<Vec<u32>>());
}

#[test]
fn cached_blocks_are_evicted_in_lru_order_whatever_the_window() {
    // the same pool, its blocks freed into the prefix cache: a growing sequence takes the
    // least recently freed each time (the chain's tail first), as with no window
    let mut p = pool(256, 4);
    p.set_pick_window(16);
    p.add_sequence(1, (0..1024).collect(), 0, None).unwrap();
    p.prepare_step(&[1], &[1024], None).unwrap();
    p.append_tokens(1, &[5]).unwrap();
    p.prepare_step(&[1], &[0], None).unwrap();       // the last block's tokens count as computed
    p.free_sequence(1, true).unwrap();
    assert_eq!(p.num_cached_blocks(), 256);
    assert_eq!(grow(&mut p, &[2], 32, 16)[0], (224..256).rev().collect::<Vec<u32>>());
}

#[test]
fn a_nearly_full_pool_takes_the_least_recently_freed() {
    // 12 blocks free: a window of at most 12 / 8 = 1, strict LRU (the few free blocks hold
    // what was just freed: a prompt about to be asked for again)
    let mut p = cycled(16);
    p.add_sequence(9, (5000..5976).collect(), 0, None).unwrap();
    p.prepare_step(&[9], &[976], None).unwrap();
    assert_eq!(p.num_free_blocks(), 12);
    let head = p.free_list()[0];
    p.add_sequence(2, vec![7], 0, None).unwrap();
    p.prepare_step(&[2], &[1], None).unwrap();
    assert_eq!(p.sequence(2).unwrap().blocks, vec![head]);
    ok(&p);
}

#[test]
fn sequences_growing_side_by_side_keep_to_runs_of_their_own() {
    // before: taking turns in one run of ids, neither has two consecutive blocks
    let mut p = cycled(1);
    let t = grow(&mut p, &[2, 3], 16, 1);
    assert_eq!(consecutive(&t[0]) + consecutive(&t[1]), 0, "{t:?}");
    let mut p = cycled(16);
    let t = grow(&mut p, &[2, 3], 16, 16);
    for table in &t {
        assert!(consecutive(table) >= 12, "{t:?}");   // of 15 neighbours
    }
}

#[test]
fn a_prompt_starts_from_part_of_a_cached_block() {
    let mut p = pool(16, 8);
    let one: Vec<u32> = (1..=17).collect();
    p.add_sequence(1, one.clone(), 0, None).unwrap();
    p.prepare_step(&[1], &[17], None).unwrap();
    let (b0, b1) = (p.sequence(1).unwrap().blocks[0], p.sequence(1).unwrap().blocks[1]);
    p.free_sequence(1, true).unwrap();
    // [1..8] [9..16] cached; the next prompt shares [1..8] [9..14] and goes on otherwise
    let two: Vec<u32> = vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 40, 41, 42];
    assert_eq!(p.prefix_match(&two, 0).0, 8);
    let want = p.admission_blocks_with(&two, 0, 3, None, true);
    assert_eq!(p.admission_blocks_with(&two, 0, 3, None, false), p.admission_blocks(&two, 0, 3, None));
    let free = p.num_free_blocks();
    assert_eq!(p.add_sequence_with(2, two.clone(), 0, None, true).unwrap(), 14);
    assert_eq!(p.sequence(2).unwrap().blocks, vec![b0, b1]);
    // what admission counted: the blocks out of the free list, then the first step's (the copy too)
    assert_eq!(want, free - p.num_free_blocks() + p.blocks_needed(2, 3).unwrap());
    assert_eq!(p.blocks_needed(2, 3).unwrap(), 2);
    ok(&p);
    let plan = p.prepare_step(&[2], &[3], None).unwrap();
    let seq = p.sequence(2).unwrap();
    assert_eq!(plan.copies, vec![(b1, seq.blocks[1])]);        // copied before its first write
    assert!(seq.blocks[1] != b1 && seq.blocks[0] == b0);
    assert_eq!(plan.slot_mapping[0], seq.blocks[1] as i64 * 8 + 6);
    assert!(p.is_cached(b1 as usize) && p.refcount(b1 as usize).unwrap() == 0);   // the cached block as it was
    assert_eq!(p.prefix_match(&one, 0).0, 16);
    ok(&p);
    p.free_sequence(2, true).unwrap();
    ok(&p);
    // never the prompt's last token, never fewer than 4 tokens, never another salt's block;
    // without `partial`, whole blocks
    assert_eq!(p.add_sequence_with(3, one[..13].to_vec(), 0, None, true).unwrap(), 12);
    assert_eq!(p.add_sequence_with(4, vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 50, 51], 0, None, true).unwrap(), 8);
    assert_eq!(p.add_sequence_with(5, one[..15].to_vec(), 7, None, true).unwrap(), 0);
    assert_eq!(p.add_sequence(6, one[..15].to_vec(), 0, None).unwrap(), 8);
    // the longest share among the block's continuations: [9..14 40 41] (computed by sequence 2), [9..16]
    let mut three = two[..15].to_vec();
    three.extend([60, 61]);
    assert_eq!(p.add_sequence_with(7, three, 0, None, true).unwrap(), 15);
    ok(&p);
    for id in [3, 4, 5, 6, 7] {
        p.free_sequence(id, false).unwrap();
    }
    // an evicted continuation is no longer offered
    let mut q = pool(3, 4);
    q.add_sequence(1, (1..=9).collect(), 0, None).unwrap();
    q.prepare_step(&[1], &[9], None).unwrap();
    q.free_sequence(1, true).unwrap();
    assert_eq!(q.admission_blocks_with(&[1, 2, 3, 4, 5, 6, 7, 8, 0, 0], 0, 2, None, true), 3);
    q.add_sequence(2, vec![9; 12], 1, None).unwrap();
    q.prepare_step(&[2], &[12], None).unwrap();               // takes every block: the cache is gone
    ok(&q);
    q.free_sequence(2, false).unwrap();
    assert_eq!(q.add_sequence_with(3, vec![1, 2, 3, 4, 5, 6, 7, 8, 0, 0], 0, None, true).unwrap(), 0);
    ok(&q);
}

#[test]
fn a_freed_sequence_s_last_partial_block_starts_its_next_turn() {
    // a turn of a chat: 13 prompt tokens, 10 answered (the last one sampled, never computed)
    let turn = |p: &mut BlockPool, id: i64, salt: u64| {
        let c = p.add_sequence(id, (1..=13).collect(), salt, None).unwrap();
        p.prepare_step(&[id], &[13 - c as i64], None).unwrap();
        for t in 50..59 {
            p.prepare_step(&[id], &[1], Some(&[t])).unwrap();
        }
        p.append_tokens(id, &[59]).unwrap();
        assert_eq!(p.sequence(id).unwrap().num_slots, 22);
        *p.sequence(id).unwrap().blocks.last().unwrap()
    };
    let mut p = pool(16, 8);
    let tail = turn(&mut p, 1, 0);
    p.free_sequence_with(1, true, true).unwrap();
    ok(&p);
    // [1..8] [9..13 50 51 52] and the tail's 6 computed tokens [53..58]
    assert_eq!(p.num_cached_blocks(), 3);
    assert!(p.is_cached(tail as usize));
    // the next turn: the conversation so far (59 sampled last), then the user's next words
    let mut next: Vec<u32> = (1..=13).chain(50..=59).collect();
    next.extend([90, 91]);
    assert_eq!(p.prefix_match(&next, 0).0, 16);                      // whole blocks: 16
    let want = p.admission_blocks_with(&next, 0, 3, None, true);
    let free = p.num_free_blocks();
    assert_eq!(p.add_sequence_with(2, next.clone(), 0, None, true).unwrap(), 22);
    assert_eq!(want, free - p.num_free_blocks() + p.blocks_needed(2, 3).unwrap());
    let plan = p.prepare_step(&[2], &[3], None).unwrap();
    let seq = p.sequence(2).unwrap();
    assert_eq!(plan.copies, vec![(tail, seq.blocks[2])]);              // written into a copy
    assert_eq!(plan.slot_mapping[0], seq.blocks[2] as i64 * 8 + 6);
    assert!(p.is_cached(tail as usize) && p.refcount(tail as usize).unwrap() == 0);
    ok(&p);
    p.free_sequence(2, false).unwrap();
    // another identity never starts from it; nor a prompt that shares fewer than 4 of its tokens
    assert_eq!(p.add_sequence_with(3, next.clone(), 9, None, true).unwrap(), 0);
    let mut other: Vec<u32> = (1..=13).chain(50..=55).collect();
    other.extend([70, 71, 72]);
    assert_eq!(p.add_sequence_with(4, other, 0, None, true).unwrap(), 16);
    p.free_sequence(3, false).unwrap();
    p.free_sequence(4, false).unwrap();
    ok(&p);
    // not without `tail`; not a block another sequence holds too (a fork); the same tail once
    let cached = p.num_cached_blocks();
    let t5 = turn(&mut p, 5, 1);
    p.free_sequence_with(5, true, false).unwrap();
    assert!(!p.is_cached(t5 as usize));
    let t6 = turn(&mut p, 6, 2);
    p.fork(6, 7).unwrap();
    p.free_sequence_with(6, true, true).unwrap();
    assert!(!p.is_cached(t6 as usize));
    p.free_sequence_with(7, true, true).unwrap();                    // the last holder's
    assert!(p.is_cached(t6 as usize));
    let t8 = turn(&mut p, 8, 0);   // its steps swapped its whole blocks for the cached ones
    assert!(p.is_cached(tail as usize) && t8 != tail);
    p.free_sequence_with(8, true, true).unwrap();                    // salt 0's tail is cached already
    assert!(!p.is_cached(t8 as usize));
    assert_eq!(p.num_cached_blocks(), cached + 2 + 3);              // salt 1's whole blocks, salt 2's and its tail
    ok(&p);
    // a tail of fewer than 4 tokens stays out
    let mut q = pool(8, 8);
    q.add_sequence(1, (1..=10).collect(), 0, None).unwrap();
    q.prepare_step(&[1], &[10], None).unwrap();
    q.free_sequence_with(1, true, true).unwrap();
    assert_eq!(q.num_cached_blocks(), 1);
    ok(&q);
}

#[test]
fn a_fork_never_writes_into_a_block_its_sibling_cached() {
    // the sibling computes a whole block the fork holds only part of (the fork was cut back
    // inside it), caches it and ends: the fork then holds a cached block alone, and its next
    // write copies it first (before b877dcf it wrote in place, and the cached block held the
    // fork's tokens under the sibling's hash: found by tests/test_alloc_property.py)
    let mut p = pool(8, 4);
    p.add_sequence(1, (1..=9).collect(), 0, None).unwrap();
    p.prepare_step(&[1], &[8], None).unwrap();
    let b1 = p.sequence(1).unwrap().blocks[1];
    p.fork(1, 2).unwrap();
    p.truncate(2, 6).unwrap();                       // not cached yet: the fork keeps it, 6 slots
    assert_eq!(p.sequence(2).unwrap().blocks[1], b1);
    p.prepare_step(&[1], &[1], None).unwrap();       // the sibling's next step caches [5 6 7 8]
    p.free_sequence(1, true).unwrap();
    assert!(p.is_cached(b1 as usize) && p.refcount(b1 as usize).unwrap() == 1);
    p.append_tokens(2, &[77, 78]).unwrap();
    assert_eq!(p.blocks_needed(2, 2).unwrap(), 1);
    let plan = p.prepare_step(&[2], &[2], None).unwrap();
    let now = p.sequence(2).unwrap().blocks[1];
    assert_eq!(plan.copies, vec![(b1, now)]);
    assert_eq!(plan.slot_mapping, vec![now as i64 * 4 + 2, now as i64 * 4 + 3]);
    assert!(p.is_cached(b1 as usize) && p.refcount(b1 as usize).unwrap() == 0);
    assert_eq!(p.prefix_match(&(1..=9).collect::<Vec<u32>>(), 0).0, 8);
    ok(&p);
}
