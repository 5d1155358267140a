"""The CPU forward with fused operators (Rust: `rust_alloc/cpu_kernels`).

A decode step of a small model on a small CPU is hundreds of tiny tensor ops, and their
per-op cost (dispatch, allocation, thread wake-ups) was as large as the GEMMs. This forward
keeps the GEMMs (oneDNN, or the quantized kernels) and does the rest in four Rust calls per
half-layer pattern:

    residual add + RMSNorm -> QKV GEMM -> rotary + KV-cache write -> attention -> O GEMM
    residual add + RMSNorm -> gate/up GEMM -> SiLU·mul -> down GEMM

Decode rows and short prefill chunks attend in Rust straight from the paged cache; long
prefill chunks use torch's SDPA over the gathered context, as `TorchAttention` does. When
every linear kept its GGUF blocks, a step whose rows all attend in Rust goes further: one
`QuantDecoder.decode` call runs every layer (no Python between the operators), then the
final norm and LM head run here. The torch forward (`forward.TorchForward`) stays the
reference; the tests compare the two.
"""
from __future__ import annotations

import numpy as np
import torch

from ..._native import ops
from .attention import AttentionMetadata, TorchAttention
from ..families import base as steps
from .llama import act_mul
from ..quant import QuantLinear
from .quant_threads import all_torch_threads, kernel_threads_only
from ..settings import CpuConfig


def supports(model, backend) -> bool:
    """Whether this forward runs the model: the torch backend, and heads the Rust
    operators take (even head_dim up to 512, at most 64 query heads per KV head)."""
    cfg = model.cfg
    return (isinstance(backend, TorchAttention) and cfg.head_dim % 2 == 0 and cfg.head_dim <= 512
            and cfg.num_heads // cfg.num_kv_heads <= 64)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.numpy()


def quant_decoder(model) -> ops.QuantDecoder | None:
    """A Rust `QuantDecoder` running every layer of a step in one call, when all of the
    model's linear layers kept their GGUF blocks (None otherwise)."""
    cfg = model.cfg
    if not model.quantized or not steps.llama_blocks(cfg):
        return None

    def lin(m: QuantLinear):
        segs = [(s.data, s.kind, s.rows, s.cols) for s in m.segments]
        return segs, None if m.bias is None else _np(m.bias.float().contiguous())
    layers = [(_np(layer.input_layernorm.weight), _np(layer.post_attention_layernorm.weight),
               [lin(m) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                 layer.mlp.down_proj)]) for layer in model.layers]
    return ops.QuantDecoder(layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                            cfg.intermediate_size, model.layers[0].input_layernorm.eps)


class FusedCpuForward:
    """CPU, float32: the model's modules with Rust operators between the GEMMs."""

    name = "fused-cpu"

    def __init__(self, model, backend: TorchAttention, kv_cache: torch.Tensor, settings: CpuConfig,
                 kernel_threads: bool):
        self.model, self.backend, self.kv = model, backend, kv_cache
        self.settings = settings
        self.threads = kernel_threads          # torch on one thread beside the kernels' pool
        self.decoder = quant_decoder(model)
        if self.decoder is not None:
            self.name = "fused-cpu+quant-decoder"
        self.kv_np = _np(kv_cache)
        self.layer_kv = [(_np(kv_cache[i, 0]), _np(kv_cache[i, 1])) for i in range(model.cfg.num_layers)]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 logits_indices: torch.Tensor | None) -> torch.Tensor:
        with kernel_threads_only(self.threads):
            return self._forward(input_ids, positions, meta, logits_indices)

    def _attention_rows(self, meta: AttentionMetadata):
        """Rows attended in Rust: every decode row, and every row of a short prefill chunk as
        a query of its own (row j of a chunk of q over n sees positions < n - q + j + 1).
        -> (rows int64 [R], lens int32 [R], tables int32 [R, M], sequences left for SDPA)."""
        starts = np.cumsum([0] + meta.q_lens_host)
        limit = self.settings.rust_attention_max
        seq_of, rows, lens, sdpa = [], [], [], []
        for i, (q, n) in enumerate(zip(meta.q_lens_host, meta.seq_lens_host)):
            if q == 1 or q * n <= limit:
                seq_of.extend([i] * q)
                rows.extend(range(starts[i], starts[i] + q))
                lens.extend(range(n - q + 1, n + 1))
            else:
                sdpa.append(i)
        tables = meta.block_tables
        if sdpa or any(q != 1 for q in meta.q_lens_host):   # else one row per sequence, in order
            tables = tables.index_select(0, torch.tensor(seq_of, dtype=torch.long))
        return (np.asarray(rows, np.int64), np.asarray(lens, np.int32), _np(tables.contiguous()), sdpa)

    def _forward(self, input_ids, positions, meta, logits_indices) -> torch.Tensor:
        model, backend = self.model, self.backend
        cfg = model.cfg
        h = model.embed(input_ids).contiguous()
        t = h.shape[0]
        nh, nkv = cfg.num_heads, cfg.num_kv_heads
        q_size = nh * cfg.head_dim
        rows, lens, tables, sdpa = self._attention_rows(meta)
        pos = _np(positions.contiguous())
        slots = _np(meta.slot_mapping.contiguous())
        tables_np = [(_np(r.cos), _np(r.sin)) for r in model.ropes]
        if not sdpa and self.decoder is not None and t < self.settings.fused_max_tokens:
            # every row attends in Rust and the token count suits the quantized kernels: one call
            cos, sin = tables_np[0]
            self.decoder.decode(_np(h), pos, slots, lens, tables, self.kv_np, cos, sin, backend.scale,
                                backend.window or 0)
            return self._final(h, None, meta, logits_indices)
        prefills = {w: backend.prefill_plan(meta, sdpa, w) for w in backend.windows} if sdpa else {}
        hn, a = _np(h), torch.empty_like(h)
        an = _np(a)
        out = torch.empty(t, q_size)
        on = _np(out)
        x = None        # the last step's output, added to the residual by the next Norm
        for layer, (kc, vc), (kt, vt) in zip(model.layers, self.layer_kv, zip(self.kv[:, 0], self.kv[:, 1])):
            attn, mlp = layer.self_attn, layer.mlp
            for step in layer.spec.steps:      # the family's steps (families/base.py)
                if isinstance(step, steps.Norm):
                    norm = getattr(layer, step.name)
                    ops.add_rms_norm(hn, None if x is None else _np(x.contiguous()), _np(norm.weight), norm.eps, an)
                    x = a
                elif isinstance(step, steps.Attention):
                    qkv = attn.qkv_proj(x)
                    if attn.q_norm is not None:      # per-head q/k norms before the rotary
                        qk = qkv[:, : q_size + attn.kv_size].view(t, nh + nkv, -1)
                        qk.copy_(attn.norm_qk(qk))
                    qn = _np(qkv)
                    cos, sin = tables_np[attn.rope]
                    ops.rope_write_kv(qn, pos, cos, sin, slots, kc, vc, nh, nkv)
                    if len(rows):
                        ops.paged_decode(qn, on, rows, lens, tables, kc, vc, nh, nkv, backend.scale,
                                         attn.window or 0, step.softcap or 0.0)
                    if prefills:   # SDPA on all of torch's threads
                        with all_torch_threads():
                            backend.attend_prefills(qkv[:, :q_size].view(t, nh, -1), kt, vt, prefills[attn.window],
                                                    out.view(t, nh, -1))
                    x = attn.o_proj(out)
                elif isinstance(step, steps.OutNorm):
                    x = self._out_norm(x, getattr(layer, step.name))
                elif mlp.activation == "silu":
                    gu = mlp.gate_up_proj(x)
                    m = torch.empty(t, mlp.inter)
                    ops.silu_mul(_np(gu), _np(m))
                    x = mlp.down_proj(m)
                else:
                    x = mlp.down_proj(act_mul(mlp.gate_up_proj(x), mlp.inter, mlp.activation))
        delta = None if x is None else _np(x.contiguous())
        return self._final(h, delta, meta, logits_indices)

    @staticmethod
    def _out_norm(x: torch.Tensor, norm) -> torch.Tensor:
        """Gemma's norm of a block's output before it joins the residual."""
        x = x.contiguous()
        y = torch.empty_like(x)
        ops.add_rms_norm(_np(x), None, _np(norm.weight), norm.eps, _np(y))
        return y

    def _final(self, h: torch.Tensor, delta: np.ndarray | None, meta, logits_indices) -> torch.Tensor:
        model = self.model
        if logits_indices is None:
            logits_indices = meta.last_token_indices()
        if logits_indices.numel() == 0:
            return h.new_empty(0, model.cfg.vocab_size, dtype=torch.float32)
        last = h.index_select(0, logits_indices)
        if delta is not None:
            last.add_(torch.from_numpy(delta).index_select(0, logits_indices))
        normed = torch.empty_like(last)
        ops.add_rms_norm(_np(last), None, _np(model.norm.weight), model.norm.eps, _np(normed))
        return model.head(normed)
