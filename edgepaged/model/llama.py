"""Llama-family decoder (llama, mistral, qwen2) over a flat batch with a paged KV cache."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata, TorchAttention
from .layers import Linear, RMSNorm, Rotary
from .loader import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, **dd):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.h * self.d, self.hkv * self.d
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, **dd)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, False, **dd)
        self.k_cache = self.v_cache = None  # [num_blocks, block_size, Hkv, D], set by the runner

    def forward(self, x, cos, sin, backend, plan):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = Rotary.apply(qkv[:, : self.q_size + self.kv_size].view(t, self.h + self.hkv, self.d), cos, sin)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.hkv, self.d)
        o = backend.forward(qk[:, : self.h], qk[:, self.h:], v, self.k_cache, self.v_cache, plan)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, **dd):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, False, **dd)
        self.down_proj = Linear(self.inter, cfg.hidden_size, False, **dd)

    def forward(self, x):
        gu = self.gate_up_proj(x)
        return self.down_proj(F.silu(gu[:, : self.inter]).mul_(gu[:, self.inter:]))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, **dd):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, **dd)
        self.self_attn = Attention(cfg, **dd)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, **dd)
        self.mlp = MLP(cfg, **dd)

    def forward(self, h, cos, sin, backend, plan):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, backend, plan)
        return h + self.mlp(self.post_attention_layernorm(h))


# where each checkpoint tensor goes: (module path suffix, shard index) in a fused weight
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, device="cpu", dtype=torch.float32):
        super().__init__()
        dd = dict(device=device, dtype=dtype)
        self.cfg = cfg
        self.embed_tokens = torch.empty(cfg.vocab_size, cfg.hidden_size, **dd)
        self.layers = nn.ModuleList(DecoderLayer(cfg, **dd) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, **dd)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, **dd)
        self.rotary = Rotary(cfg.head_dim, max_positions or cfg.context_length, cfg.rope_theta,
                             cfg.rope_scaling, **dd)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        """Copy checkpoint tensors (Hugging Face names) into place, fusing QKV and gate/up."""
        if getattr(self, "quantized", False):  # GGUF blocks kept quantized (quant.py)
            from .quant import load_quantized
            return load_quantized(self, weights)
        seen = set()
        for name, w in weights:
            if name == "rope_freqs":
                self.rotary.build(freq_factors=w, device=self.rotary.cos.device, dtype=self.rotary.cos.dtype)
                continue
            if name.endswith("rotary_emb.inv_freq"):
                continue
            seen.add(name)
            if name == "model.embed_tokens.weight":
                self.embed_tokens.copy_(w)
                continue
            if name == "model.norm.weight":
                self.norm.weight.copy_(w)
                continue
            if name == "lm_head.weight":
                self.lm_head.weight.copy_(w)
                continue
            parts = name.split(".")  # model.layers.{i}.{self_attn|mlp}.{proj}.{weight|bias}
            layer = self.layers[int(parts[2])]
            if parts[-2] not in _FUSED:
                getattr(layer.get_submodule(".".join(parts[3:-1])), parts[-1]).copy_(w)
                continue
            fused, shard = _FUSED[parts[-2]]
            a = layer.self_attn
            sizes = [a.q_size, a.kv_size, a.kv_size] if fused == "qkv_proj" else [self.cfg.intermediate_size] * 2
            start = sum(sizes[:shard])
            getattr(getattr(layer, parts[3]).get_submodule(fused), parts[-1])[start: start + sizes[shard]].copy_(w)
        if self.cfg.tie_word_embeddings or "lm_head.weight" not in seen:
            self.lm_head.weight.copy_(self.embed_tokens)
        expected = 2 + (0 if self.cfg.tie_word_embeddings else 1) + self.cfg.num_layers * (
            9 + (3 if self.cfg.attention_bias else 0))
        if len(seen) < expected:
            raise ValueError(f"checkpoint has {len(seen)} of the {expected} tensors the model needs")

    def pack(self):
        """Re-lay out the GEMM weights for the CPU's oneDNN kernels (no-op elsewhere)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend, meta: AttentionMetadata,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Flat batch [T] -> logits [len(logits_indices), vocab] (float32)."""
        if getattr(self, "fused", False) and isinstance(backend, TorchAttention):  # CPU float32: fused Rust operators around the GEMMs (fused.py)
            from .fused import forward_fused
            return forward_fused(self, input_ids, positions, backend, meta, logits_indices)
        h = (F.embedding(input_ids, self.embed_tokens) if isinstance(self.embed_tokens, torch.Tensor)
             else self.embed_tokens(input_ids))  # a QuantEmbedding (quant.py)
        cos, sin = self.rotary.tables(positions)
        plan = backend.plan(meta)
        for layer in self.layers:
            h = layer(h, cos, sin, backend, plan)
        if logits_indices is None:
            logits_indices = meta.last_token_indices()
        if logits_indices.numel() == 0:
            return h.new_empty(0, self.cfg.vocab_size, dtype=torch.float32)
        return self.lm_head(self.norm(h.index_select(0, logits_indices))).float()
