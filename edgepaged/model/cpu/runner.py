"""The CPU runtime without torch: GGUF models run with numpy and the Rust extension only.

Every operator of a step is Rust (`rust_alloc/cpu_kernels`): the quantized products (or, for
a GGUF file's float matrices, numpy's GEMM), RMSNorm with the residual add, rotary and the
KV-cache write, attention straight from the paged cache for decode rows and prefill rows
alike (row j of a chunk of q rows over n positions attends to the first n - q + j + 1: causal,
chunked, over a cached prefix; a layer's sliding window and gemma2's soft-capped scores in
the same kernel), SiLU·mul. A model of llama's block whose linears all kept their GGUF
blocks runs every layer of a step in one Rust call (`ops.QuantDecoder`) below
`fused_max_tokens` rows. Sampling and the constrained-decoding masks are numpy
(`sampler.py`, `grammar.py`), shared with the torch runner.

`CpuRunner` has the engine's side of `runner.ModelRunner` (`runtime.RunnerBase`); the
torch runner stays the GPU path, the safetensors path and the reference the tests compare
this one against.
"""
from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import numpy as np

from ..._native import ops
from ...common.memory import release_free_memory
from ..._native import quant as kernels
from ..families import base as steps
from ..families.base import llama_blocks
from ..loader import ModelFiles, terminal_progress
from ..placement import check_linear, place
from ..quant.formats import QuantWeight, kernel_layouts, lay_out, merge_segments, own_weights
from ..rope import rotary_tables
from ..runtime import KvBudgetError, RunnerBase, StepInterrupted, _Background, cpu_kv_default_bytes
from ..settings import CpuConfig
from ..tokenizer import Tokenizer

SCRATCH_BYTES = 16 << 20
# the pool's first blocks (those the allocator hands out first: its free list starts at block
# 0) are faulted in off the critical path once the model is loaded: a first prompt of this
# many tokens finds its K/V pages ready (faulting them in its steps cost 0.3-0.5 s of Home
# Assistant's first command on a 1 B model; a fresh page is expensive in a virtual machine),
# at most KV_PREFAULT_BYTES of the pool (Home Assistant's prompt with 60 entities is ~2,200)
KV_PREFAULT_TOKENS = 4096
KV_PREFAULT_BYTES = 256 << 20
# q8_0: int8 head rows of D values and D / 32 half-precision scales (rust_alloc/cpu_kernels/src/kv.rs)
KV_DTYPES = {"f16": np.float16, "f32": np.float32, "q8_0": np.int8}
KV_NAMES = {np.dtype(v): k for k, v in KV_DTYPES.items()}


def kv_numpy_dtype(name: str | None):
    """The KV cache's element type by name (None: f16, twice the tokens of f32 in the same
    memory); ValueError for bf16 (no CPU kernel reads it) or a name it does not know."""
    if name is None:
        return np.float16
    if name == "bf16":
        raise ValueError("a bf16 KV cache is not supported on CPU: use f16 (half the memory of f32), q8_0 or f32")
    if name not in KV_DTYPES:
        raise ValueError(f"KV cache dtype {name!r}: use one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[name]


def kv_row_units(name: str, head_dim: int) -> int:
    """Elements of the cache one head row of `head_dim` values takes (q8_0: the values, then 2
    bytes of scale per 32)."""
    return head_dim + head_dim // 16 if name == "q8_0" else head_dim


def kv_bytes_per_value(name: str | None) -> float:
    """Bytes of KV cache per stored value (f32 4, f16 2, q8_0 34 / 32), from the type and its
    row units (heads of a multiple of 32 values)."""
    name = name or "f16"
    return np.dtype(kv_numpy_dtype(name)).itemsize * kv_row_units(name, 32) / 32


class WeightsCacheMismatch(RuntimeError):
    """A weights cache entry that lacks a weight the model has: the load starts over without it."""


class Linear:
    """y = x W^T (+ b): W as GGUF row segments multiplied by the Rust kernels (from
    `dense_min_tokens` rows on, segments on the exact kernels (but interleaved ones:
    `formats.kernel_layouts`) are decoded in tiles into a
    scratch and multiplied by numpy's GEMM, as `QuantLinear` does with oneDNN), or a float32
    matrix for numpy's GEMM."""

    def __init__(self, parts: list, bias: np.ndarray | None, dense_min_tokens: int, repack: bool = False):
        """repack: the integer kernels' layout, made as the parts are merged."""
        if all(isinstance(p, QuantWeight) for p in parts):
            self.segments = merge_segments(parts, repack)
            self.offsets = np.cumsum([0] + [s.rows for s in self.segments]).tolist()
            self.weight = None
            self.out_features, self.in_features = self.offsets[-1], parts[0].cols
        else:
            self.segments = []
            self.weight = np.ascontiguousarray(np.concatenate(
                [p.dequantize() if isinstance(p, QuantWeight) else np.asarray(p, np.float32) for p in parts]))
            self.out_features, self.in_features = self.weight.shape
        self.bias = None if bias is None else np.ascontiguousarray(bias, dtype=np.float32)
        self.dense_min_tokens = dense_min_tokens

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments) if self.weight is None else self.weight.nbytes

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """`out`: a float32 [rows, out_features] buffer to write into (a step's workspace)."""
        t = x.shape[0]
        if out is not None and out.shape != (t, self.out_features):
            out = None                   # a layer unlike the first: a buffer of its own
        if self.weight is not None:
            out = np.matmul(x, self.weight.T, out=out)
        else:
            if out is None:
                out = np.empty((t, self.out_features), np.float32)
            if t:
                for s, a in zip(self.segments, self.offsets):
                    if t >= self.dense_min_tokens and s.layout not in kernel_layouts():
                        self._dense(x, s, out[:, a: a + s.rows])
                    else:
                        kernels.matmul(s.data, s.kind, x, out, col=a, rows=s.rows)
        if self.bias is not None:
            out += self.bias
        return out

    def _dense(self, x: np.ndarray, s: QuantWeight, out: np.ndarray) -> None:
        k = self.in_features
        tile = max(1, SCRATCH_BYTES // 4 // k)
        w = _scratch(min(tile, s.rows), k)
        for r0 in range(0, s.rows, tile):
            n = min(tile, s.rows - r0)
            s.dequantize_into(w[:n], r0)
            np.matmul(x, w[:n].T, out=out[:, r0: r0 + n])


_SCRATCH = threading.local()


def _scratch(rows: int, cols: int) -> np.ndarray:
    """A float32 [rows, cols] buffer of this thread's, kept (at most SCRATCH_BYTES): weights
    decoded to fp32 a tile at a time (`Linear._dense`). Made per call, its 16 MB were faulted in
    again at every product of a step in a server (`tame_malloc` maps a buffer of 1 MiB or more
    fresh)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < rows * cols:
        buf = _SCRATCH.buf = np.empty(rows * cols, np.float32)
    return buf[:rows * cols].reshape(rows, cols)


class Layer:
    """A layer's steps (its family's, `cfg.layer(i)`) and weights: norms by name, linears."""
    __slots__ = ("spec", "norms", "qkv", "o", "gate_up", "down")

    def __init__(self, spec):
        self.spec = spec
        self.norms: dict[str, np.ndarray] = {}
        self.qkv = self.o = self.gate_up = self.down = None


class CpuModel:
    """A decoder's weights as numpy arrays and GGUF blocks, and its forward over the paged cache."""

    images = None     # an ImageTable: ids past the vocabulary are its images' feature rows

    def __init__(self, cfg, settings: CpuConfig, max_positions: int):
        self.cfg, self.settings = cfg, settings
        self.layers = [Layer(cfg.layer(i)) for i in range(cfg.num_layers)]
        self.embed_q: QuantWeight | None = None
        self.embed_dense: np.ndarray | None = None
        self.final_norm = np.ones(cfg.hidden_size, np.float32)
        self.head: Linear | None = None
        self.freq_factors = None
        self._math = "exact"
        self.max_positions = 0
        self.decoder = None
        self._cache = None        # a weights cache entry while loading from it
        self.interrupt = None     # the runner's threading.Event: set, a step stops between layers
        # the steps' workspace, kept (`_workspace`); a forward holds it while it runs
        self._ws: dict[str, np.ndarray] = {}
        self._ws_lock = threading.Lock()
        self.build_rotary(max_positions)

    # ------------------------------------------------------------ weights (placement's sink)

    def rope_freqs(self, w):
        self.freq_factors = np.asarray(w, np.float32)
        self.build_rotary(self.max_positions)

    def embedding(self, w):
        if isinstance(w, QuantWeight):
            self.embed_q = self._cached("embed")[0] if self._cache is not None else w
        else:
            self.embed_dense = np.ascontiguousarray(w, dtype=np.float32)

    def final_norm_weight(self, w):
        self.final_norm = np.ascontiguousarray(w, dtype=np.float32)

    def norm(self, i: int, name: str, w):
        self.layers[i].norms[name] = np.ascontiguousarray(w, dtype=np.float32)

    def linear(self, i: int, fused: str, parts: list, bias):
        b = None if bias is None else np.concatenate([np.asarray(x, np.float32) for x in bias])
        attr = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}[fused]
        if self._cache is not None and any(isinstance(p, QuantWeight) for p in parts):
            if not all(isinstance(p, QuantWeight) for p in parts):     # never written: placeholders here
                raise WeightsCacheMismatch(f"{self._cache.path.name}: layer {i} {fused} is not wholly quantized")
            parts = self._cached(f"{i}.{attr}")     # laid out already: merge_segments keeps them
        setattr(self.layers[i], attr, Linear(parts, b, self.settings.dense_min_tokens, self._math == "int8"))

    def head_weight(self, w):
        tied = w is None        # the embedding's array: lay_out re-lays it once for both
        if w is None:
            w = self.embed_q if self.embed_q is not None else self.embed_dense
            check_linear(self.cfg, "lm_head", [w])
        parts = self._cached("head") if self._cache is not None and isinstance(w, QuantWeight) else [w]
        self.head = Linear(parts, None, self.settings.dense_min_tokens, self._math == "int8" and not tied)

    def _cached(self, slot: str) -> list[QuantWeight]:
        if not self._cache.has(slot):
            raise WeightsCacheMismatch(f"{self._cache.path.name} has no weights for {slot}")
        return self._cache.weights(slot)

    def cache_slots(self) -> dict[str, list[QuantWeight]]:
        """Every quantized weight as the kernels read it, by slot (what the weights cache keeps)."""
        slots = {"embed": [self.embed_q]} if self.embed_q is not None else {}
        if self.head.weight is None:
            slots["head"] = self.head.segments
        for i, la in enumerate(self.layers):
            for a in ("qkv", "o", "gate_up", "down"):
                lin = getattr(la, a)
                if lin.weight is None:
                    slots[f"{i}.{a}"] = lin.segments
        return slots

    def linears(self) -> list[Linear]:
        """The LM head and every layer's linears."""
        return [self.head] + [getattr(la, a) for la in self.layers for a in ("qkv", "o", "gate_up", "down")]

    def load(self, weights, math_: str, interleave: bool, cache=None) -> None:
        """cache: a weights cache entry (`weights_cache.Entry`) for these very weights: every
        quantized one comes from it, laid out already (`weights` then only needs their
        shapes: `ModelFiles.weights(lazy=True)`)."""
        sink = SimpleNamespace(rope_freqs=self.rope_freqs, embedding=self.embedding, norm=self.norm,
                               linear=self.linear, final_norm=self.final_norm_weight, head=self.head_weight)
        self._math = math_        # int8: the fused linears are repacked as their parts merge
        self._cache = cache
        try:
            place(self.cfg, weights, sink)
        finally:
            self._cache = None
        keep = {id(s.data) for segs in self.cache_slots().values() for s in segs} if cache is not None else ()
        if cache is None and (math_ != "exact" or interleave):
            # the embedding table is only gathered from (rows layout does): re-laid out only
            # when it is the LM head too (tied), so the two stay one array
            tied = self.embed_q is not None and any(s.data is self.embed_q.data for s in self.head.segments)
            quant = [self.embed_q] if tied else []
            for lin in self.linears():
                quant.extend(lin.segments)
            lay_out(quant, math_)
        # what still views the file's pages (a borrowed read not re-laid out): copied
        own_weights([self.embed_q] + [s for lin in self.linears() for s in lin.segments], keep)
        release_free_memory()     # the file-layout copies just freed: pages back to the system
        self.decoder = self._quant_decoder()

    @property
    def quantized(self) -> bool:
        """Whether every linear of the decoder layers kept its GGUF blocks."""
        return all(getattr(la, a).weight is None for la in self.layers for a in ("qkv", "o", "gate_up", "down"))

    def weight_bytes(self) -> int:
        seen, n = set(), 0
        arrays = [self.embed_q.data if self.embed_q is not None else self.embed_dense, self.final_norm]
        for lin in self.linears():
            arrays += [s.data for s in lin.segments] + [lin.weight, lin.bias]
        for la in self.layers:
            arrays += list(la.norms.values())
        for a in arrays:
            if a is not None and id(a) not in seen:
                seen.add(id(a))
                n += a.nbytes
        return n

    def build_rotary(self, max_positions: int) -> None:
        cfg = self.cfg
        self.max_positions = max_positions
        self.ropes = [rotary_tables(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, self.freq_factors)]
        if cfg.rope_local is not None:   # gemma3's sliding layers: their own base, unscaled
            self.ropes.append(rotary_tables(cfg.head_dim, max_positions, cfg.rope_local["theta"],
                                            cfg.rope_local["scaling"]))

    def _quant_decoder(self):
        """One Rust call for every layer of a step: every layer llama's block with one window
        (`families.llama_blocks`), every linear quantized."""
        cfg = self.cfg
        if not llama_blocks(cfg) or not self.quantized:
            return None

        def lin(m: Linear):
            return [(s.data, s.kind, s.rows, s.cols) for s in m.segments], m.bias
        layers = [(la.norms["input_layernorm"], la.norms["post_attention_layernorm"],
                   [lin(la.qkv), lin(la.o), lin(la.gate_up), lin(la.down)]) for la in self.layers]
        return ops.QuantDecoder(layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                                cfg.intermediate_size, cfg.rms_eps)

    # ------------------------------------------------------------ forward

    def _workspace(self, t: int, ws: dict | None, **widths: int) -> dict[str, np.ndarray]:
        """Float32 [t, width] buffers by name: views of buffers kept from step to step (`ws`,
        the model's own while a forward holds its lock), else new ones. The server maps every
        buffer of 1 MiB or more fresh at each allocation (`tame_malloc`: flat RSS), so a
        512-token step of the 1 B file faulted ~70 MB of workspace in again each time (a
        fresh runner's first 512-token step: 0.25-0.4 s slower than the next); kept, they are
        at most the largest step's (the budget's), ~70 MB on the 1 B file at 512 tokens. (A
        Qwen3-shaped q-norm's two 8 MB buffers made per layer: 300-430 ms of a 512-token step
        over 36 layers, kept 60-65 ms; a Gemma 3 4 B shape's gelu in numpy temporaries: 44-50 ms
        a layer, in place 27 ms, the same bits.)"""
        out = {}
        for name, width in widths.items():
            if ws is None:
                out[name] = np.empty((t, width), np.float32)
                continue
            buf = ws.get(name)
            if buf is None or buf.shape[0] < t or buf.shape[1] != width:
                buf = ws[name] = np.empty((t, width), np.float32)
            out[name] = buf[:t]
        return out

    def embed(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if self.images is not None:
            pic = self.images.is_image(ids)
            if pic.any():        # an image's rows, as they are (a family's embedding scale is the text's)
                h = self._embed(np.where(pic, 0, ids), out)
                h[pic] = self.images.rows(ids[pic])
                return h
        return self._embed(ids, out)

    def _embed(self, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if self.embed_q is not None:
            h = np.empty((len(ids), self.cfg.hidden_size), np.float32) if out is None else out
            kernels.gather_rows(self.embed_q.data, self.embed_q.kind, ids, h)
        else:
            h = self.embed_dense[ids]
        if self.cfg.embed_scale is not None:
            h *= np.float32(self.cfg.embed_scale)
        return h

    def _norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        y = np.empty_like(x)
        ops.add_rms_norm(x, None, w, self.cfg.rms_eps, y)
        return y

    def forward(self, ids, positions, query_start_loc, seq_lens, block_tables, slots, kv, logits_indices,
                prompt=None, ropes=None):
        """Flat batch [T] -> float32 logits [len(logits_indices), vocab]; kv is the runner's
        [layers, 2, num_blocks, block_size, kv_heads, head_dim] pool. `prompt` (bool per
        sequence): its rows are its prompt's; without it, a sequence of 2 rows or more is one.
        `ropes`: rotary tables in place of the model's (M-RoPE's, per row: `positions` index them)."""
        ws = self._ws if self._ws_lock.acquire(blocking=False) else None   # (never two forwards on one buffer)
        try:
            return self._forward(ids, positions, query_start_loc, seq_lens, block_tables, slots, kv, logits_indices,
                                 prompt, ws, ropes or self.ropes)
        finally:
            if ws is not None:
                self._ws_lock.release()

    def _forward(self, ids, positions, query_start_loc, seq_lens, block_tables, slots, kv, logits_indices,
                 prompt, ws, ropes):
        cfg, settings = self.cfg, self.settings
        t = len(ids)
        q_lens = np.diff(query_start_loc)
        h = self.embed(ids, self._workspace(t, ws, h=cfg.hidden_size)["h"])
        # Every prompt row goes to the tiles (paged_prefill), however few: a prompt's tail after a
        # prefix-cache hit must attend as the whole prompt did the first time (the same answer
        # either way), and the row kernel rounds differently from the tiles (its sums per 8
        # dimensions, a q8_0 cache's scales per block: a near tie of the embedded model turned
        # on a q8_0 cache's hit, on AVX2); with bf16 products (ops.bf16_attention) all the more.
        # A row's result is the same in any tile (prefill.rs tests). Measured on the embedded
        # model (Zen 3, AVX2): a 30- or 90-token prompt 2-15 % slower than row by row in the
        # one-call decoder, 200 tokens the same (bench/RESULTS.md). Other chunks of several
        # rows (a draft's rows to check) attend row by row when short (q * n at most
        # tile_attention_min: a tile's set-up outweighs their little work), else in tiles: a
        # long chunk reads the context once per tile of rows, not once per row.
        limit = min(settings.rust_attention_max, settings.tile_attention_min)
        prompts = (q_lens > 1) if prompt is None else np.asarray(prompt, dtype=bool)
        tiles = bool(prompts.any())
        row_by_row = not tiles and (len(q_lens) == t or int((q_lens * seq_lens).max()) <= limit)
        one_call = self.decoder is not None and t < settings.fused_max_tokens and row_by_row
        if row_by_row or one_call:
            # one row per query: row j of a sequence's q rows sees n - q + j + 1 positions (a
            # decode-only step: each sequence's own row, its table as it is)
            first = np.repeat(query_start_loc[:-1], q_lens)
            lens = (np.repeat(seq_lens - q_lens, q_lens) + (np.arange(t) - first) + 1).astype(np.int32)
            tables = block_tables if len(q_lens) == t else np.repeat(block_tables, q_lens, axis=0)
            per_row = (np.arange(t, dtype=np.int64), lens, np.ascontiguousarray(tables, dtype=np.int32))
        if one_call:
            cos, sin = ropes[0]
            self.decoder.decode(h, positions, slots, per_row[1], per_row[2], kv, cos, sin, cfg.scale,
                                self.layers[0].spec.attention.window or 0)
            delta = None
        elif row_by_row:                 # decode rows, short chunks: paged_decode, one call per layer
            delta = self._layers(h, positions, slots, kv, decode=per_row, ws=ws, ropes=ropes)
        else:                            # a long prefill chunk in the step: paged_prefill, tiles of rows
            see = None
            if self.images is not None and self.images.both_ways:    # (Gemma 3's image tokens see their image)
                from ..image_table import image_see
                see = image_see(self.images, ids, positions, query_start_loc)
            delta = self._layers(h, positions, slots, kv, ws=ws, chunks=(
                np.ascontiguousarray(query_start_loc, dtype=np.int64), np.ascontiguousarray(seq_lens, dtype=np.int32),
                np.ascontiguousarray(block_tables, dtype=np.int32)), see=see, ropes=ropes)
        if logits_indices is None:
            logits_indices = query_start_loc[1:] - 1
        if len(logits_indices) == 0:
            return np.empty((0, cfg.vocab_size), np.float32)
        last = h[logits_indices]
        if delta is not None:
            last += delta[logits_indices]
        # the normed rows stay in `last_normed` (a request for an embedding takes its row)
        self.last_normed = self._norm(np.ascontiguousarray(last), self.final_norm)
        logits = self.head(self.last_normed)
        if cfg.final_softcap:
            cap = np.float32(cfg.final_softcap)
            logits = np.tanh(logits / cap) * cap
        return logits

    def _layers(self, h, positions, slots, kv, decode=None, chunks=None, ws=None, see=None, ropes=None) -> np.ndarray:
        """Layer by layer, each its family's steps (families/base.py); h holds the residual
        stream without the last layer's output, which is returned (a view of `ws`, the
        workspace, when given: valid until the next forward)."""
        cfg = self.cfg
        t, nh, nkv, d = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = nh * d, nkv * d
        inter = cfg.intermediate_size
        # the step's workspace, written by every layer in turn (a buffer of a megabyte or more
        # is mapped fresh at each allocation in a server, tame_malloc, and its pages faulted in
        # again: ~15 % of a 512-token prefill step on the 1 B file when each layer made its
        # own), kept from step to step (`_workspace`); res: o's and down's outputs, each
        # consumed by a Norm
        la = self.layers[0]
        b = self._workspace(t, ws, a=cfg.hidden_size, out=q_size, qkv=la.qkv.out_features,
                            gu=la.gate_up.out_features, m=inter, res=cfg.hidden_size)
        a, out, qkv_buf, gu_buf, m_buf, res_buf = b["a"], b["out"], b["qkv"], b["gu"], b["m"], b["res"]
        x = None       # the last step's output, added to the residual by the next Norm
        stop = self.interrupt
        for li, layer in enumerate(self.layers):
            if stop is not None and stop.is_set():
                raise StepInterrupted(f"the step stopped before layer {li} of {len(self.layers)}")
            kc, vc = kv[li, 0], kv[li, 1]
            n = layer.norms
            for step in layer.spec.steps:
                if isinstance(step, steps.Norm):
                    ops.add_rms_norm(h, x, n[step.name], cfg.rms_eps, a)
                    x = a
                elif isinstance(step, steps.Attention):
                    qkv = layer.qkv(x, qkv_buf)
                    if step.qk_norm:        # per-head q/k norms before the rotary, in workspace buffers
                        for at, size, heads, name in ((0, q_size, nh, "q"), (q_size, kv_size, nkv, "k")):
                            b = self._workspace(t * heads, ws, **{name + "c": d, name + "y": d})
                            c, y = b[name + "c"], b[name + "y"]
                            np.copyto(c.reshape(t, size), qkv[:, at: at + size])
                            ops.add_rms_norm(c, None, n[name + "_norm"], cfg.rms_eps, y)
                            qkv[:, at: at + size] = y.reshape(t, size)
                    cos, sin = (ropes or self.ropes)[step.rope]
                    ops.rope_write_kv(qkv, positions, cos, sin, slots, kc, vc, nh, nkv)
                    attend = (ops.paged_decode, decode) if decode is not None else (ops.paged_prefill, chunks)
                    extra = {} if see is None else {"see": see}     # rows that see past their causal limit
                    attend[0](qkv, out, *attend[1], kc, vc, nh, nkv, cfg.scale, step.window or 0,
                              step.softcap or 0.0, **extra)
                    x = layer.o(out, res_buf)
                elif isinstance(step, steps.OutNorm):   # (Gemma's norms after o and down: into `post`)
                    post = self._workspace(t, ws, post=cfg.hidden_size)["post"]
                    ops.add_rms_norm(x, None, n[step.name], cfg.rms_eps, post)
                    x = post
                else:
                    gu = layer.gate_up(x, gu_buf)
                    m = m_buf
                    if step.activation == "silu":
                        ops.silu_mul(gu, m)
                    else:   # gelu_tanh, in place in m: 0.5 g (1 + tanh(c (g + 0.044715 g g g))) up, in that order
                        g = gu[:, :inter]
                        np.multiply(np.float32(0.044715), g, out=m)
                        m *= g
                        m *= g
                        m += g
                        m *= np.float32(math.sqrt(2 / math.pi))
                        np.tanh(m, out=m)
                        m += np.float32(1)
                        m *= g
                        m *= np.float32(0.5)        # (g m / 2 = (g / 2) m: halving is exact)
                        m *= gu[:, inter:]
                    x = layer.down(m, res_buf)
        return x


class CpuRunner(RunnerBase):
    """Weights, KV cache and forward of a GGUF model on the CPU, with numpy and the Rust
    extension only. Not thread-safe: one step at a time. `kv_cache` is one numpy array
    [layers, 2, num_blocks, block_size, kv_heads, head_dim] (f16 by default; q8_0: int8, the
    last axis head_dim + head_dim / 16, see `kv_row_units`)."""

    def __init__(self, model_path=None, kv_memory_bytes=None, block_size=16, num_blocks=None, *, progress=None,
                 settings: CpuConfig | None = None, kv_dtype: str | None = None, quantized: bool | None = None,
                 served_name: str | None = None):
        """quantized: keep the file's quantized weights as GGUF blocks (None or True; False
        decodes them to float32 matrices). served_name: the store's name for it."""
        self.served_name = served_name
        self.settings = settings = settings or CpuConfig.from_env()
        self.kv_np_dtype = kv_numpy_dtype(kv_dtype)
        self.kv_dtype_name = KV_NAMES[np.dtype(self.kv_np_dtype)]
        self.block_size = block_size
        files = ModelFiles(model_path)       # a GGUF file, or a safetensors folder (widened to float32)
        self.model_path, self.config = files.path, files.config
        self.file_info = files.info()
        self._init_stats()
        cfg = self.config
        if self.kv_dtype_name == "q8_0" and cfg.head_dim % 32:
            raise ValueError(f"a q8_0 KV cache holds heads of a multiple of 32 values; {files.path.name}'s are "
                             f"{cfg.head_dim}: use f16")
        self.kv_row = kv_row_units(self.kv_dtype_name, cfg.head_dim)
        self.block_bytes = (2 * cfg.num_layers * block_size * cfg.num_kv_heads * self.kv_row
                            * np.dtype(self.kv_np_dtype).itemsize)
        if num_blocks is None and kv_memory_bytes is not None:   # say so before loading the weights
            self._check_budget(kv_memory_bytes, files.path)
        # the tokenizer (a 128 k-entry vocabulary takes ~0.5 s) is built beside the weights,
        # whose reading and repacking release the GIL
        tokenizer = _Background(lambda f=files: Tokenizer.load(f.path, reader=f.reader))   # (files is deleted below)
        keep = files.has_quantized and quantized is not False
        if quantized and not files.has_quantized:
            from ..quant.formats import FORMATS
            raise ValueError(f"quantized=True but the file has no tensor in {'/'.join(FORMATS.values())}")
        self.quantized = keep
        self.quant_math = settings.math(cfg.num_params) if keep else None
        # a long step (a prefill chunk, layer by layer) stops between layers when the engine
        # sets it: Engine._maybe_interrupt
        self.interrupt = threading.Event()
        self.model = self._new_model(settings)
        if num_blocks is None:
            if kv_memory_bytes is None:
                kv_memory_bytes = cpu_kv_default_bytes()
            num_blocks = int(kv_memory_bytes // self.block_bytes)
        if num_blocks < 1:
            raise KvBudgetError(f"KV cache budget too small: {kv_memory_bytes} bytes, one block of this model is "
                                f"{self.block_bytes} (e.g. 256M or more)")
        self.num_blocks = num_blocks
        # committed as it fills: numpy's zeros are calloc's fresh zero pages
        self.kv_cache = np.zeros((cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, self.kv_row),
                                 self.kv_np_dtype)
        # small pages: the pool is resident as it fills. In numpy's huge pages each layer's K and V
        # came in 2 MB at a time: the prefault below made 209 MB resident for its 94 MB on the
        # embedded model (the idle server 462 MB, 351 in small pages)
        from ...common.memory import small_pages
        small_pages(self.kv_cache.ctypes.data, self.kv_cache.nbytes)
        self.max_model_len = min(cfg.context_length, num_blocks * block_size)
        if self.max_model_len != self.model.max_positions:
            self.model.build_rotary(self.max_model_len)
        # its first pages faulted in beside the weights' loading (`_prefault_kv`)
        self.kv_prefault = threading.Thread(target=self._prefault_kv, name="edgepaged-kv-prefault", daemon=True)
        self.kv_prefault.start()
        progress = progress or terminal_progress(f"loading {files.path.name}")
        self._cache_writer = None         # the weights cache's writer thread, while it writes
        self.weights_cache = self._load_weights(files, progress, keep, settings)
        del files
        self.tokenizer = tokenizer.result()
        self.forward_name = "cpu (numpy + rust" + (", one-call decoder)" if self.model.decoder else ")")

    dense_products = "fp32"

    def _take_images(self, table) -> None:
        self.model.images = table

    def _prefault_kv(self) -> None:
        """In a thread of its own: the first KV_PREFAULT_TOKENS tokens' blocks of every layer's
        K and V (at most KV_PREFAULT_BYTES) faulted in, their contents untouched (so a step may
        already be writing there). At the normal priority: at nice 19 it took 2.6-4.0 s instead
        of 0.8 (the 1 B file, 134 MB), and a first request sent as the server was ready waited
        for the pages it held (its first 512-token step 3.99-4.03 s, 3.72-3.81 at nice 0,
        3.42-3.48 the next)."""
        from ...common.memory import populate
        kv = self.kv_cache
        n = min(self.num_blocks, -(-KV_PREFAULT_TOKENS // self.block_size),
                max(1, KV_PREFAULT_BYTES // (kv.shape[0] * 2 * kv.strides[2])))
        for layer in range(kv.shape[0]):
            for half in range(2):
                if not populate(kv[layer, half].ctypes.data, n * kv.strides[2]):
                    return

    def _new_model(self, settings: CpuConfig) -> CpuModel:
        """An empty model for this runner's config and interrupt event (its cache's type decides
        bf16 products in the prefill tiles: `ops.paged_prefill`)."""
        m = CpuModel(self.config, settings, self.config.context_length)
        m.interrupt = self.interrupt
        return m

    def _load_weights(self, files, progress, keep: bool, settings: CpuConfig) -> str:
        """The model's weights, from the weights cache when it has them laid out already (see
        `weights_cache`); else from the file, and a large model's layout is then written to
        the cache in a thread. Returns "hit", "writing", or "off" (not cached: turned off, a
        file under `weights_cache_min_bytes`, a model not wholly quantized)."""
        from .. import weights_cache as wc
        math_ = self.quant_math or "exact"
        directory = wc.cache_dir() if keep and files.path.stat().st_size >= settings.weights_cache_min_bytes else None
        key = entry = None
        if directory is not None:
            options = {"math": math_, "interleave": settings.quant_interleave, "rope": "unpermuted"}
            key = wc.entry_key(files.path, options)
            entry = wc.open_entry(directory, key)
        if entry is not None:
            try:
                self.model.load(files.weights(None, progress=progress, keep_quantized=True, lazy=True), math_,
                                settings.quant_interleave, cache=entry)
                return "hit"
            except (WeightsCacheMismatch, ValueError, KeyError, TypeError, IndexError) as e:
                # an entry that matched its key but not the model (a header edited by hand):
                # never a failed load, the file is read instead
                wc.log.warning("weights cache: %s; loading from the file", e)
                entry.path.unlink(missing_ok=True)
                self.model = self._new_model(settings)
        # int8 math re-lays every block weight as it arrives: read through the file's pages
        self.model.load(files.weights(None, progress=progress, keep_quantized=keep,
                                      borrow=self.quant_math == "int8"), math_, settings.quant_interleave)
        if directory is None or not self.model.quantized or self.model.head.weight is not None:
            return "off"
        self._cache_writer = wc.write_in_background(directory, key, wc.source_identity(files.path),
                                                    self.model.cache_slots())
        return "writing"

    def weight_bytes(self) -> int:
        return self.model.weight_bytes()

    def _rotary_size(self) -> int:
        return self.model.max_positions

    def copy_blocks(self, copies) -> None:
        """Copy-on-write: for each (src, dst) row copy block src to dst in every layer's K and V."""
        copies = np.asarray(copies, dtype=np.int64).reshape(-1, 2)
        if len(copies):
            self.kv_cache[:, :, copies[:, 1]] = self.kv_cache[:, :, copies[:, 0]]

    def last_hidden(self) -> np.ndarray:
        """The last forward's final-norm rows (one per logits row), float32."""
        return self.model.last_normed

    def read_block(self, block: int) -> np.ndarray:
        return np.ascontiguousarray(self.kv_cache[:, :, block]).view(np.uint8).reshape(-1)

    def read_blocks(self, blocks) -> list[np.ndarray]:
        """Several blocks' K/V copied out in one gather: per block a [layers, 2, ...] view of
        the copy (its bytes are `read_block`'s once made contiguous)."""
        got = np.take(self.kv_cache, np.asarray(blocks, dtype=np.intp), axis=2)
        return [got[:, :, i] for i in range(len(blocks))]

    def write_block(self, block: int, data: np.ndarray) -> None:
        self.kv_cache[:, :, block] = np.asarray(data, np.uint8).view(self.kv_np_dtype).reshape(
            self.kv_cache[:, :, block].shape)

    def execute(self, input_ids, positions, attn_metadata, logits_indices=None) -> np.ndarray:
        """One forward over a flat batch -> float32 logits [len(logits_indices), vocab].
        attn_metadata: a mapping with query_start_loc, seq_lens, block_tables, slot_mapping."""
        m = attn_metadata
        seq_lens = np.asarray(m["seq_lens"], dtype=np.int64)
        if len(seq_lens) and seq_lens.max() > self.max_model_len:
            raise ValueError(f"context of {seq_lens.max()} tokens exceeds max_model_len {self.max_model_len}")
        qsl = np.asarray(m["query_start_loc"], dtype=np.int64)
        tables = np.asarray(m["block_tables"], dtype=np.int32).reshape(len(seq_lens), -1)
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        self.rotary_positions(pos)
        ropes = None
        if m.get("mrope") is not None and self.config.rope_sections:
            # Qwen2.5-VL's image rows: tables of the batch's own rows (rope.mrope_tables)
            from ..rope import mrope_tables
            rows, hw = m["mrope"]
            self.rotary_positions(np.asarray(hw).reshape(-1))
            cos, sin = self.model.ropes[0]
            ropes = [mrope_tables(cos, sin, pos, np.asarray(rows, np.int64), np.asarray(hw, np.int64),
                                  self.config.rope_sections)]
            pos = np.arange(len(pos), dtype=np.int64)
        slots = np.ascontiguousarray(m["slot_mapping"], dtype=np.int64)
        idx = None if logits_indices is None else np.asarray(logits_indices, dtype=np.int64)
        prompt = m.get("prompt")
        if len(ids) == 1 and prompt is not None and bool(prompt[0]):
            # A prompt's one row alone (its last token after a prefix-cache hit of the rest: a
            # request sent again, an embedding asked again) runs beside a copy of itself that
            # writes no K/V: the products then take the many-row kernels, whose sums for a row
            # are the same bits however many rows come along (the one-row kernel's are not:
            # ~3e-5 apart on the embedded model), so the logits are the whole prompt's.
            ids, pos = np.repeat(ids, 2), np.repeat(pos, 2)
            qsl, seq_lens, tables = np.array([0, 1, 2]), np.repeat(seq_lens, 2), np.repeat(tables, 2, axis=0)
            slots, prompt = np.array([slots[0], -1], np.int64), np.array([True, True])
            idx = np.array([0], np.int64) if idx is None else idx
        return self.model.forward(ids, pos, qsl, seq_lens, tables, slots, self.kv_cache, idx, prompt, ropes)


__all__ = ["CpuModel", "CpuRunner", "kv_bytes_per_value", "kv_numpy_dtype", "kv_row_units"]
