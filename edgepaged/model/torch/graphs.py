"""The decode step with static shapes: one CUDA graph per batch-size bucket (vLLM's way).

A decode step (every sequence one new token) is a few hundred kernel launches of a few
microseconds each; launched from Python one by one they leave a GPU idle most of the step.
Captured once as a CUDA graph they replay in one launch. A graph replays the very buffers it
was captured with, so the step runs over persistent device buffers sized for the largest
bucket: the tokens, positions, slot mapping, sequence lengths and block tables of a batch
are copied into their first rows and the rest padded (token 0 at position 0, slot -1: its
K/V written nowhere; length 1 over block 0: it reads a row of garbage and its output is
dropped), so a batch of B sequences runs the graph of the smallest bucket >= B.

    steps = DecodeGraphs(model, backend, kv_cache, max_batch, max_blocks, capture=on_cuda)
    logits = steps.run(input_ids, positions, meta)    # a decode batch: [B, vocab] float32

With `capture` off (a CPU, the tests) the same padded step runs eagerly: what a test checks
there is what the graph replays on a GPU, the padding included. Nothing in the step reads
the host: the attention backend gets the bucket's static metadata (`plan` once per bucket).
"""
from __future__ import annotations

import torch

from .attention import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class DecodeGraphs:
    def __init__(self, model, backend, kv_cache: torch.Tensor, max_batch: int, max_blocks: int, *,
                 capture: bool = False):
        """`max_batch`: the most sequences a step decodes (the largest bucket is the first >=
        it); `max_blocks`: the block table's width (max_model_len / block_size)."""
        self.model, self.backend, self.kv = model, backend, kv_cache
        self.buckets = [b for b in BUCKETS if b < max_batch] + [next((b for b in BUCKETS if b >= max_batch),
                                                                     max_batch)]
        n, dev = self.buckets[-1], kv_cache.device
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, dtype=torch.int64, device=dev)
        self.capture = capture
        self.graphs: dict[int, tuple] = {}      # bucket -> (graph, its output)
        self.steps: dict[int, int] = {}         # bucket -> decode steps run in it
        self.pool = None

    def forget(self) -> None:
        """Drop the captured graphs (a tensor they read was replaced: the rotary tables grew)."""
        self.graphs.clear()

    def bucket(self, b: int) -> int | None:
        """The bucket a batch of b sequences runs in (None: larger than any)."""
        return next((x for x in self.buckets if x >= b), None)

    def takes(self, meta: AttentionMetadata) -> bool:
        return meta.is_decode and self.bucket(meta.num_seqs) is not None \
            and meta.block_tables.shape[1] <= self.tables.shape[1]

    def _meta(self, b: int, lens_host: list[int]) -> AttentionMetadata:
        return AttentionMetadata(self.qsl[:b + 1], self.lens[:b], self.tables[:b], self.slots[:b], [1] * b, lens_host)

    def _step(self, b: int, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(self.ids[:b], self.pos[:b], self.backend, meta, self.kv, self.rows[:b])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One decode step of B sequences through the bucket's static buffers -> logits [B, vocab]."""
        n = meta.num_seqs
        b = self.bucket(n)
        width = meta.block_tables.shape[1]
        self.ids[:n].copy_(input_ids, non_blocking=True)
        self.pos[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if b > n:      # the padding rows: nothing written, one position of block 0 read
            self.ids[n:b].zero_()
            self.pos[n:b].zero_()
            self.slots[n:b].fill_(-1)
            self.lens[n:b].fill_(1)
            self.tables[n:b].zero_()
        self.steps[b] = self.steps.get(b, 0) + 1
        if not self.capture:
            # eager, as the graph would run it: static shapes, the lengths' host copy for a
            # backend that plans from it (the torch one; the Triton one reads the device's)
            return self._step(b, self._meta(b, list(meta.seq_lens_host) + [1] * (b - n)))[:n]
        if b not in self.graphs:
            self.graphs[b] = self._capture(b)
        graph, out = self.graphs[b]
        graph.replay()
        return out[:n]

    def _capture(self, b: int):
        """The bucket's step captured on a side stream after a warm-up run (Triton compiles
        and autotunes outside the capture)."""
        meta = self._meta(b, [1] * b)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(b, meta)
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()      # one memory pool for every bucket's graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._step(b, meta)
        return graph, out
