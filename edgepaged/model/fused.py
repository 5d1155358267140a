"""The CPU forward with fused operators (Rust, `rust_alloc/src/cpuops.rs`).

A decode step of a small model on a small CPU is hundreds of tiny tensor ops, and their
per-op cost (dispatch, allocation, thread wake-ups) was as large as the GEMMs. This forward
keeps the GEMMs (oneDNN, or the quantized kernels) and does the rest in four Rust calls per
half-layer pattern:

    residual add + RMSNorm -> QKV GEMM -> rotary + KV-cache write -> attention -> O GEMM
    residual add + RMSNorm -> gate/up GEMM -> SiLU·mul -> down GEMM

Decode rows attend in Rust straight from the paged cache; prefill chunks (many query rows)
use torch's SDPA over the gathered context, as `TorchAttention` does. With quantized weights
(quant.py) a decode-only step goes further: one `QuantDecoder.decode` call runs every layer
in Rust (no Python between the operators), then the final norm and LM head run here. The torch path stays
the reference: `EDGEPAGED_FUSED=0` turns this one off, and the tests compare the two.
"""
from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from .attention import AttentionMetadata, TorchAttention
from .quant import _torch_threads as torch_threads, kernel_saved_threads

try:
    from edgepaged._rust_alloc import cpu_add_rms_norm, cpu_paged_decode, cpu_rope_write_kv, cpu_silu_mul
except ImportError:  # an old build without the operators
    cpu_add_rms_norm = cpu_paged_decode = cpu_rope_write_kv = cpu_silu_mul = None
try:
    from edgepaged._rust_alloc import QuantDecoder
except ImportError:
    QuantDecoder = None


def fused_available(device, dtype) -> bool:
    """Whether the fused forward applies: CPU, float32, a build that has the operators, and
    not turned off with EDGEPAGED_FUSED=0."""
    return (cpu_add_rms_norm is not None and torch.device(device).type == "cpu" and dtype == torch.float32
            and os.environ.get("EDGEPAGED_FUSED", "1") != "0")


def _np(t: torch.Tensor) -> np.ndarray:
    return t.numpy()


def quant_decoder(model):
    """A Rust `QuantDecoder` running every layer of a decode-only step in one call, when all
    of the model's linear layers kept their GGUF blocks (None otherwise). Built once."""
    dec = getattr(model, "_quant_decoder", False)
    if dec is not False:
        return dec
    from .quant import QuantLinear
    dec = None
    linears = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
               for layer in model.layers]
    if QuantDecoder is not None and all(isinstance(m, QuantLinear) for ls in linears for m in ls):
        cfg = model.cfg

        def lin(m):
            segs = [(s.data, s.kind, s.rows, s.cols) for s in m.segments]
            return segs, None if m.bias is None else _np(m.bias.float().contiguous())
        dec = QuantDecoder([(_np(layer.input_layernorm.weight), _np(layer.post_attention_layernorm.weight),
                             [lin(m) for m in ls]) for layer, ls in zip(model.layers, linears)],
                           cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size,
                           model.layers[0].input_layernorm.eps)
    model._quant_decoder = dec
    return dec


def _prefill_attention(qkv, out, plan, attn, backend, nh, d) -> None:
    """Prefill chunks through the torch backend's SDPA, on all of torch's threads even
    inside `kernel_threads_only`."""
    t = qkv.shape[0]
    with torch_threads(kernel_saved_threads()):
        backend.attend_prefills(qkv[:, : nh * d].view(t, nh, d), attn.k_cache, attn.v_cache, plan.prefills,
                                out.view(t, nh, d))


def _final(model, h: torch.Tensor, delta: np.ndarray | None, meta, logits_indices) -> torch.Tensor:
    if logits_indices is None:
        logits_indices = meta.last_token_indices()
    if logits_indices.numel() == 0:
        return h.new_empty(0, model.cfg.vocab_size, dtype=torch.float32)
    last = h.index_select(0, logits_indices)
    if delta is not None:
        last.add_(torch.from_numpy(delta).index_select(0, logits_indices))
    normed = torch.empty_like(last)
    cpu_add_rms_norm(_np(last), None, _np(model.norm.weight), model.norm.eps, _np(normed))
    return model.lm_head(normed).float()


# A prefill chunk of q rows over a context of n positions attends in Rust, row by row, when
# q * n is at most this; longer ones go to SDPA. Measured on the 2-core box (prefill steps of
# the embedded model, both settings alternated in one process): Rust was 15-33% faster up to
# q * n = 131072 (mostly because the whole step then runs in one QuantDecoder call), even at
# 200-260K, and 10-60% slower from 300K on (bench/RESULTS.md, "prefill step paths").
RUST_ATTENTION_MAX = int(os.environ.get("EDGEPAGED_RUST_ATTENTION_MAX", "131072"))
# Steps with fewer rows than this run in one QuantDecoder call when every row attends in
# Rust (the quantized kernels all the way); larger ones go layer by layer, where QuantLinear
# switches to decode-to-scratch + GEMM from its DENSE_MIN_TOKENS on. Same measurement: the
# one call was 15% faster at 192 rows, equal at 256, 6% slower at 320.
FUSED_MAX_TOKENS = int(os.environ.get("EDGEPAGED_FUSED_MAX_TOKENS", "256"))


def _attention_rows(meta: AttentionMetadata):
    """Rows attended in Rust: every decode row, and every row of a short prefill chunk as
    a query of its own (row j of a chunk of q over n sees positions < n - q + j + 1).
    -> (rows int64 [R], lens int32 [R], tables int32 [R, M], sequences left for SDPA)."""
    starts = np.cumsum([0] + meta.q_lens_host)
    seq_of, rows, lens, sdpa = [], [], [], []
    for i, (q, n) in enumerate(zip(meta.q_lens_host, meta.seq_lens_host)):
        if q == 1 or q * n <= RUST_ATTENTION_MAX:
            seq_of.extend([i] * q)
            rows.extend(range(starts[i], starts[i] + q))
            lens.extend(range(n - q + 1, n + 1))
        else:
            sdpa.append(i)
    tables = meta.block_tables
    if not sdpa and all(q == 1 for q in meta.q_lens_host):
        pass                                   # one row per sequence, in order: the table as it is
    else:
        tables = tables.index_select(0, torch.tensor(seq_of, dtype=torch.long))
    return (np.asarray(rows, np.int64), np.asarray(lens, np.int32), _np(tables.contiguous()), sdpa)


def forward_fused(model, input_ids: torch.Tensor, positions: torch.Tensor, backend: TorchAttention,
                  meta: AttentionMetadata, logits_indices: torch.Tensor | None) -> torch.Tensor:
    cfg = model.cfg
    h = (F.embedding(input_ids, model.embed_tokens) if isinstance(model.embed_tokens, torch.Tensor)
         else model.embed_tokens(input_ids)).contiguous()
    t = h.shape[0]
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_size = nh * d
    rows, lens, tables, sdpa = _attention_rows(meta)
    pos = _np(positions.contiguous())
    slots = _np(meta.slot_mapping.contiguous())
    cos, sin = _np(model.rotary.cos), _np(model.rotary.sin)
    window = backend.window or 0
    kv = getattr(model, "kv_cache", None)
    if not sdpa and kv is not None and t < FUSED_MAX_TOKENS and (dec := quant_decoder(model)) is not None:
        # every row attends in Rust and the token count suits the quantized kernels: the whole step is one call
        dec.decode(_np(h), pos, slots, lens, tables, _np(kv), cos, sin, backend.scale, window)
        return _final(model, h, None, meta, logits_indices)
    plan = None
    if sdpa:
        plan = backend.plan(meta, with_decode=False)
        keep = {int(np.cumsum([0] + meta.q_lens_host)[i]) for i in sdpa}
        plan.prefills = [p for p in plan.prefills if p[0].start in keep]
    hn, a = _np(h), torch.empty_like(h)
    an = _np(a)
    out = torch.empty(t, q_size)
    on = _np(out)
    delta = None
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        kc, vc = _np(attn.k_cache), _np(attn.v_cache)
        cpu_add_rms_norm(hn, delta, _np(layer.input_layernorm.weight), layer.input_layernorm.eps, an)
        qkv = attn.qkv_proj(a)
        qn = _np(qkv)
        cpu_rope_write_kv(qn, pos, cos, sin, slots, kc, vc, nh, nkv)
        if len(rows):
            cpu_paged_decode(qn, on, rows, lens, tables, kc, vc, nh, nkv, backend.scale, window)
        if plan is not None:
            _prefill_attention(qkv, out, plan, attn, backend, nh, d)
        delta = _np(attn.o_proj(out))
        cpu_add_rms_norm(hn, delta, _np(layer.post_attention_layernorm.weight),
                         layer.post_attention_layernorm.eps, an)
        gu = mlp.gate_up_proj(a)
        m = torch.empty(t, mlp.inter)
        cpu_silu_mul(_np(gu), _np(m))
        delta = _np(mlp.down_proj(m))
    return _final(model, h, delta, meta, logits_indices)
