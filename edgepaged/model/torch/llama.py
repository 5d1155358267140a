"""The decoder of every family (`families/`) in torch, over a flat batch with a paged KV cache.

The module tree is built empty and filled by one placement routine, `load_weights`, from
the loader's weight stream: each linear becomes a dense `Linear` or, when every part of it
arrived as GGUF blocks, a `QuantLinear`. The forward is the GPU path and, on a CPU, the tests'
reference for the torch-free runtime (`model/cpu/`).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata
from ..families import base as steps
from .layers import Linear, RMSNorm, Rotary
from ..loader import ModelConfig
from ...common.memory import release_free_memory
from ..placement import FUSED, PARENT, check_linear, place
from ..quant import QuantEmbedding, QuantLinear, QuantWeight, lay_out_weights
from .gpu_quant import TritonQuantEmbedding, TritonQuantLinear


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, step: steps.Attention, **dd):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.h * self.d, self.hkv * self.d
        self.window = step.window                     # None: the whole context
        self.rope = step.rope                         # which rotary table (gemma3's local one: 1)
        self.q_norm = RMSNorm(self.d, cfg.rms_eps, **dd) if step.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_eps, **dd) if step.qk_norm else None
        self.qkv_proj: nn.Module | None = None
        self.o_proj: nn.Module | None = None

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """q/k norms (qwen3, gemma3) over [T, H + Hkv, D], per head."""
        if self.q_norm is None:
            return qk
        return torch.cat([self.q_norm(qk[:, : self.h]), self.k_norm(qk[:, self.h:])], 1)

    def forward(self, x, ropes, backend, plan, k_cache, v_cache):
        t = x.shape[0]
        cos, sin = ropes[self.rope]
        qkv = self.qkv_proj(x)
        if backend.fuses_rope_write and self.q_norm is None:     # (the GPU's: one kernel, kernels/rope.py)
            q = backend.rope_write(qkv, cos[:, 0], sin[:, 0], plan, k_cache, v_cache, self.h, self.hkv)
            return self.o_proj(backend.attend(q, k_cache, v_cache, plan, self.window).reshape(t, self.q_size))
        qk = Rotary.apply(self.norm_qk(qkv[:, : self.q_size + self.kv_size].view(t, self.h + self.hkv, self.d)),
                          cos, sin)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.hkv, self.d)
        o = backend.forward(qk[:, : self.h], qk[:, self.h:], v, k_cache, v_cache, plan, self.window)
        return self.o_proj(o.reshape(t, self.q_size))


def act_mul(gu: torch.Tensor, inter: int, activation: str) -> torch.Tensor:
    """act(gate) * up over the fused [T, 2 * inter] gate/up output."""
    gate = gu[:, :inter]
    a = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    return a.mul_(gu[:, inter:])


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, step: steps.Mlp):
        super().__init__()
        self.inter, self.activation = cfg.intermediate_size, step.activation
        self.gate_up_proj: nn.Module | None = None
        self.down_proj: nn.Module | None = None

    def forward(self, x):
        return self.down_proj(act_mul(self.gate_up_proj(x), self.inter, self.activation))


class DecoderLayer(nn.Module):
    """Layer i's steps (`cfg.layer(i)`, from its family file) over torch modules; its norms
    are attributes under Hugging Face's names (`input_layernorm`, ...)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, **dd):
        super().__init__()
        self.spec = cfg.layer(layer)
        for name in self.spec.norms():
            if name not in ("q_norm", "k_norm"):
                setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_eps, **dd))
        self.self_attn = Attention(cfg, self.spec.attention, **dd)
        self.mlp = MLP(cfg, self.spec.mlp)

    fused_norms = None     # kernels.norms.add_rms_norm: the residual add and the norm after it in one kernel

    def forward(self, h, ropes, backend, plan, k_cache, v_cache):
        x = None
        for step in self.spec.steps:
            if isinstance(step, steps.Norm):
                norm = getattr(self, step.name)
                if x is not None and self.fused_norms is not None:
                    x = self.fused_norms(h, x, norm.weight, norm.eps)     # h += x in place
                    continue
                if x is not None:
                    h = h + x
                x = norm(h)
            elif isinstance(step, steps.Attention):
                x = self.self_attn(x, ropes, backend, plan, k_cache, v_cache)
            elif isinstance(step, steps.OutNorm):
                x = getattr(self, step.name)(x)
            else:
                x = self.mlp(x)
        return h + x


def _dense(w, dtype, device) -> torch.Tensor:
    if isinstance(w, QuantWeight):
        w = torch.from_numpy(w.dequantize())
    return w.to(dtype=dtype, device=device)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, device="cpu", dtype=torch.float32,
                 quant_kernels: str | None = None):
        """quant_kernels: what multiplies GGUF blocks kept quantized: "rust" (the CPU's
        kernels, `QuantLinear`) or "triton" (`gpu_quant.TritonQuantLinear`: a CUDA device, or
        Triton's interpreter in the tests); None: triton on a CUDA device, else rust."""
        super().__init__()
        self.dd = dict(device=device, dtype=dtype)
        self.quant_kernels = quant_kernels or ("triton" if torch.device(device).type == "cuda" else "rust")
        self.cfg = cfg
        self.embed_tokens: torch.Tensor | QuantEmbedding | None = None
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, **self.dd) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, **self.dd)
        self.lm_head: nn.Module | None = None
        positions = max_positions or cfg.context_length
        self.rotary = Rotary(cfg.head_dim, positions, cfg.rope_theta, cfg.rope_scaling, **self.dd)
        # gemma3's sliding layers: their own base, unscaled
        self.rotary_local = None if cfg.rope_local is None else Rotary(
            cfg.head_dim, positions, cfg.rope_local["theta"], cfg.rope_local["scaling"], **self.dd)

    def use_triton_norms(self, on: bool = True) -> None:
        """Each residual add and the RMSNorm after it as one Triton kernel (the default on a
        CUDA device; on a CPU, Triton's interpreter: the tests)."""
        fused = None
        if on:
            from ...kernels.norms import add_rms_norm
            fused = add_rms_norm
        for layer in self.layers:
            layer.fused_norms = fused

    @property
    def ropes(self) -> list[Rotary]:
        """The rotary tables; a layer's `self_attn.rope` indexes this list."""
        return [self.rotary] + ([self.rotary_local] if self.rotary_local is not None else [])

    def build_rotary(self, max_positions: int) -> None:
        for r in self.ropes:
            r.build(max_positions=max_positions, **self.dd)

    # ------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, object]], *, math: str = "exact", interleave: bool = True,
                     dense_min_tokens: int = 768) -> None:
        """The checkpoint's weights (Hugging Face names; tensors or `QuantWeight`s) into the
        modules, by `placement.place`. A linear becomes a `QuantLinear` when every part of it
        is GGUF blocks, else a dense `Linear`. At the end quantized weights take the layout of
        their kernels (`math`: "int8" repacks them; "exact" interleaves Q4_0/Q4_1/Q8_0
        unless `interleave` is off)."""
        place(self.cfg, weights, _TorchSink(self, dense_min_tokens))
        if math != "exact" or interleave:
            lay_out_weights([self.embed_tokens, *self.modules()], math)
            release_free_memory()     # the file-layout copies just freed: pages back to the system

    def pack(self):
        """Re-lay out the dense GEMM weights for the CPU's oneDNN kernels (no-op elsewhere)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack()

    @property
    def quantized(self) -> bool:
        """Whether every linear of the decoder layers kept its GGUF blocks."""
        kept = (QuantLinear, TritonQuantLinear)
        return all(isinstance(getattr(getattr(layer, PARENT[f]), f), kept) for layer in self.layers for f in FUSED)

    images = None     # an ImageTable: ids past the vocabulary are its images' feature rows

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.images is not None:
            pic = input_ids >= self.images.first
            if bool(pic.any()):      # an image's rows, as they are (the embedding scale is the text's)
                h = self._embed(torch.where(pic, 0, input_ids))
                rows = self.images.rows(input_ids[pic].cpu().numpy())
                h[pic] = torch.from_numpy(rows).to(device=h.device, dtype=h.dtype)
                return h
        return self._embed(input_ids)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed_tokens, (QuantEmbedding, TritonQuantEmbedding)):
            h = self.embed_tokens(input_ids)
        else:
            h = F.embedding(input_ids, self.embed_tokens)
        return h if self.cfg.embed_scale is None else h.mul_(self.cfg.embed_scale)

    # ------------------------------------------------------------ forward

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend, meta: AttentionMetadata,
                kv_cache: torch.Tensor, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Flat batch [T] -> logits [len(logits_indices), vocab] (float32); kv_cache is
        [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
        h = self.embed(input_ids)
        ropes = [r.tables(positions) for r in self.ropes]
        if meta.mrope is not None and self.cfg.rope_sections:       # Qwen2.5-VL's image rows
            from ..rope import mrope_tables
            cos, sin = mrope_tables(self.rotary.cos, self.rotary.sin, positions, *meta.mrope, self.cfg.rope_sections)
            ropes[0] = (cos.unsqueeze(1), sin.unsqueeze(1))
        plan = backend.plan(meta)
        for i, layer in enumerate(self.layers):
            h = layer(h, ropes, backend, plan, kv_cache[i, 0], kv_cache[i, 1])
        return self.logits(h, meta, logits_indices)

    def logits(self, h: torch.Tensor, meta: AttentionMetadata, logits_indices: torch.Tensor | None) -> torch.Tensor:
        """Final norm and LM head on the rows whose next token is sampled."""
        if logits_indices is None:
            logits_indices = meta.last_token_indices()
        if logits_indices.numel() == 0:
            return h.new_empty(0, self.cfg.vocab_size, dtype=torch.float32)
        return self.head(self.norm(h.index_select(0, logits_indices)))

    def head(self, normed: torch.Tensor) -> torch.Tensor:
        """LM head on normed rows -> float32 logits (soft-capped where the model says). The
        normed rows stay in `last_normed` (a request for an embedding takes its row)."""
        self.last_normed = normed
        logits = self.lm_head(normed).float()
        if self.cfg.final_softcap:
            cap = self.cfg.final_softcap
            logits = torch.tanh(logits / cap).mul_(cap)
        return logits


class _TorchSink:
    """`placement.place`'s pieces into a LlamaForCausalLM's modules."""

    def __init__(self, model: LlamaForCausalLM, dense_min_tokens: int):
        self.m, self.dense_min_tokens = model, dense_min_tokens

    def _linear(self, parts: list, bias) -> nn.Module:
        dd = self.m.dd
        if all(isinstance(p, QuantWeight) for p in parts):
            if self.m.quant_kernels == "triton":
                return TritonQuantLinear(parts, bias, **dd)
            return QuantLinear(parts, None if bias is None else bias.float(), self.dense_min_tokens)
        return Linear(torch.cat([_dense(p, **dd) for p in parts]), bias)

    def rope_freqs(self, w):
        self.m.rotary.build(freq_factors=w, **self.m.dd)

    def embedding(self, w):
        if not isinstance(w, QuantWeight):
            self.m.embed_tokens = _dense(w, **self.m.dd)
        elif self.m.quant_kernels == "triton":
            self.m.embed_tokens = TritonQuantEmbedding(w, **self.m.dd)
        else:
            self.m.embed_tokens = QuantEmbedding(w)

    def final_norm(self, w):
        self.m.norm.weight.copy_(w)

    def norm(self, i: int, name: str, w):
        layer = self.m.layers[i]
        getattr(layer.self_attn if name in ("q_norm", "k_norm") else layer, name).weight.copy_(w)

    def linear(self, i: int, fused: str, parts: list, bias):
        if bias is not None:
            bias = torch.cat([_dense(b, **self.m.dd) for b in bias])
        setattr(getattr(self.m.layers[i], PARENT[fused]), fused, self._linear(parts, bias))

    def head(self, w):
        if w is None:
            e = self.m.embed_tokens
            if isinstance(e, TritonQuantEmbedding):     # tied: the table's packed blocks, not a copy
                check_linear(self.m.cfg, "lm_head", [e.seg])
                self.m.lm_head = TritonQuantLinear([e.seg], None, **self.m.dd)
                return
            w = e.weight if isinstance(e, QuantEmbedding) else e
            check_linear(self.m.cfg, "lm_head", [w])
        self.m.lm_head = self._linear([w], None)
