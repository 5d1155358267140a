"""Greedy decoding of a batch of prompts straight on a ModelRunner and the block allocator
(no engine): one flat prefill, then one decode step per token. model_bench and quant_bench
time it; the model tests use it as a plain paged decoder."""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from .._native.blocks import BlockAllocator
from ..model.params import SamplingParams

GREEDY = SamplingParams(temperature=0)


def make_allocator(runner) -> BlockAllocator:
    return BlockAllocator(runner.num_blocks, runner.block_size, enable_prefix_caching=False)


def step(runner, alloc, seq_ids, num_new, input_ids, positions, new_tokens=None) -> list[int]:
    """Reserve slots, run one step, return each sequence's greedy next token."""
    slots, tables, lens, copies, _ = alloc.prepare_step(seq_ids, num_new, new_tokens)
    batch = SimpleNamespace(input_ids=np.asarray(input_ids, np.int64), positions=np.asarray(positions, np.int64),
                            query_start_loc=np.cumsum([0, *num_new]).astype(np.int32), seq_lens=lens,
                            block_tables=tables, slot_mapping=slots, copies=copies, logits_indices=None)
    return runner.step(batch, [GREEDY] * len(seq_ids))


def run_batch(runner, alloc, prompts, new_tokens, seq_base=0):
    """Prefill all prompts in one flat batch, then greedy decode. Returns (outputs, t_prefill, t_decode)."""
    ids = list(range(seq_base, seq_base + len(prompts)))
    for s, p in zip(ids, prompts):
        alloc.add_sequence(s, p)
    t0 = time.perf_counter()
    positions = np.concatenate([np.arange(len(p)) for p in prompts])
    toks = step(runner, alloc, ids, [len(p) for p in prompts], np.concatenate(prompts), positions)
    t1 = time.perf_counter()
    out = [[t] for t in toks]
    lens = np.array([len(p) for p in prompts], np.int64)
    for _ in range(new_tokens - 1):
        toks = step(runner, alloc, ids, [1] * len(ids), toks, lens, toks)
        lens += 1
        for o, t in zip(out, toks):
            o.append(t)
    t2 = time.perf_counter()
    for s in ids:
        alloc.free_sequence(s, cache=False)
    return out, t1 - t0, t2 - t1


def prompt_logits(runner, alloc, prompt, seq_id=0, every: bool = False):
    """float32 logits of one prompt prefilled alone: for its last position, or (`every`)
    for each of its positions [len(prompt), vocab]. Frees the sequence's blocks after."""
    alloc.add_sequence(seq_id, prompt)
    try:
        slots, tables, lens, _, _ = alloc.prepare_step([seq_id], [len(prompt)], None)
        meta = dict(query_start_loc=np.array([0, len(prompt)], np.int32), seq_lens=lens, block_tables=tables,
                    slot_mapping=slots)
        idx = np.arange(len(prompt)) if every else None
        positions = np.arange(len(prompt))
        table = getattr(runner, "images", None)
        if table is not None and table.mrope:        # (Qwen2.5-VL: its images' rotary positions)
            from ..model.image_table import mrope_positions, mrope_rows
            rope = mrope_positions(table, prompt)
            if rope is not None:
                positions, own, hw = mrope_rows(rope, positions)
                meta["mrope"] = (np.flatnonzero(own), hw)
        return runner.execute(np.asarray(prompt, np.int64), positions, meta, idx)
    finally:
        alloc.free_sequence(seq_id, cache=False)
