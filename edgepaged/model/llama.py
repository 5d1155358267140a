"""Llama-family decoder (llama, mistral, qwen2) over a flat batch with a paged KV cache.

The module tree is built empty and filled by one placement routine, `load_weights`, from
the loader's weight stream: each linear becomes a dense `Linear` or, when every part of it
arrived as GGUF blocks, a `QuantLinear`. The forward is the torch reference; the CPU's
fused forward (`cpu_forward.py`) runs the same modules with Rust operators around them.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata
from .layers import Linear, RMSNorm, Rotary
from .loader import ModelConfig
from ..memory import release_free_memory
from .quant import QuantEmbedding, QuantLinear, QuantWeight, lay_out_weights

# fused module -> the checkpoint's parts, in order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
PARENT = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, **dd):
        super().__init__()
        self.h, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.h * self.d, self.hkv * self.d
        self.window = cfg.window(layer)               # None: the whole context
        self.rope = 1 if cfg.local_rope(layer) else 0  # which rotary table (gemma3's local one: 1)
        self.q_norm = RMSNorm(self.d, cfg.rms_eps, **dd) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_eps, **dd) if cfg.qk_norm else None
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
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter, self.activation = cfg.intermediate_size, cfg.activation
        self.gate_up_proj: nn.Module | None = None
        self.down_proj: nn.Module | None = None

    def forward(self, x):
        return self.down_proj(act_mul(self.gate_up_proj(x), self.inter, self.activation))


class DecoderLayer(nn.Module):
    """Pre-norm block; with `sandwich_norms` (gemma) the attention's and the MLP's outputs are
    normed too before they join the residual. Hugging Face's names: `post_attention_layernorm`
    is the MLP's input norm in llama and the attention's output norm in gemma."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, **dd):
        super().__init__()
        self.sandwich = cfg.sandwich_norms
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, **dd)
        self.self_attn = Attention(cfg, layer, **dd)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, **dd)
        self.mlp = MLP(cfg)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, **dd)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, **dd)

    def norms(self) -> tuple[RMSNorm, RMSNorm | None, RMSNorm, RMSNorm | None]:
        """(attention input, attention output or None, MLP input, MLP output or None)."""
        if self.sandwich:
            return (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                    self.post_feedforward_layernorm)
        return self.input_layernorm, None, self.post_attention_layernorm, None

    def forward(self, h, ropes, backend, plan, k_cache, v_cache):
        attn_in, attn_out, mlp_in, mlp_out = self.norms()
        a = self.self_attn(attn_in(h), ropes, backend, plan, k_cache, v_cache)
        h = h + (attn_out(a) if attn_out is not None else a)
        m = self.mlp(mlp_in(h))
        return h + (mlp_out(m) if mlp_out is not None else m)


def _dense(w, dtype, device) -> torch.Tensor:
    if isinstance(w, QuantWeight):
        w = torch.from_numpy(w.dequantize())
    return w.to(dtype=dtype, device=device)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, device="cpu", dtype=torch.float32):
        super().__init__()
        self.dd = dict(device=device, dtype=dtype)
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
        """The one placement routine: checkpoint weights (Hugging Face names; tensors or
        `QuantWeight`s) into the modules. Q/K/V and gate/up parts are fused into one linear
        each, built as soon as all its parts arrived: a `QuantLinear` when every part is
        GGUF blocks, else a dense `Linear`. At the end quantized weights take the layout of
        their kernels (`math`: "int8" repacks them; "exact" interleaves Q4_0/Q4_1/Q8_0
        unless `interleave` is off)."""
        cfg, dd = self.cfg, self.dd
        offset = cfg.extra.get("norm_offset", 0.0)   # gemma's checkpoints store w of x̂·(1 + w)
        pending: dict[tuple[int, str], dict[str, object]] = {}
        head = None

        q, kv, hidden, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
            cfg.intermediate_size
        shapes = {"qkv_proj": (q + 2 * kv, hidden), "o_proj": (hidden, q), "gate_up_proj": (2 * inter, hidden),
                  "down_proj": (hidden, inter), "lm_head": (cfg.vocab_size, hidden)}

        def linear(what: str, parts: list, bias) -> nn.Module:
            rows = sum(p.rows if isinstance(p, QuantWeight) else p.shape[0] for p in parts)
            cols = {p.cols if isinstance(p, QuantWeight) else p.shape[-1] for p in parts}
            if (rows, *cols) != shapes[what]:
                raise ValueError(f"{what}: the checkpoint's weights make [{rows}, {'/'.join(map(str, cols))}], the "
                                 f"model needs {list(shapes[what])}")
            if all(isinstance(p, QuantWeight) for p in parts):
                return QuantLinear(parts, None if bias is None else bias.float(), dense_min_tokens)
            return Linear(torch.cat([_dense(p, **dd) for p in parts]), bias)

        for name, w in weights:
            if name == "rope_freqs":   # llama3's frequency factors: the global table only
                self.rotary.build(freq_factors=w, device=dd["device"], dtype=dd["dtype"])
            elif name.endswith("rotary_emb.inv_freq"):
                continue
            elif name == "model.embed_tokens.weight":
                self.embed_tokens = QuantEmbedding(w) if isinstance(w, QuantWeight) else _dense(w, **dd)
            elif name == "model.norm.weight":
                self.norm.weight.copy_(w + offset)
            elif name == "lm_head.weight":
                head = w
            else:   # model.layers.{i}.{self_attn|mlp|*_layernorm}.{...}
                parts = name.split(".")
                i, layer = int(parts[2]), self._layer(int(parts[2]), name)
                norm = getattr(layer, parts[3], None) if parts[3].endswith("layernorm") else \
                    getattr(layer.self_attn, parts[4], None) if parts[3:5] in (["self_attn", "q_norm"],
                                                                              ["self_attn", "k_norm"]) else False
                if norm is None or (norm is not False and parts[-1] != "weight"):
                    raise ValueError(f"unexpected tensor in the checkpoint: {name} (this {cfg.arch} model has "
                                     "no such norm)")
                if norm is not False:
                    norm.weight.copy_(w + offset)
                    continue
                proj, kind = parts[-2], parts[-1]
                if proj in FUSED and proj not in ("o_proj", "down_proj") and PARENT[proj] == parts[3] \
                        and kind == "weight":   # already fused in the checkpoint (phi3)
                    setattr(getattr(layer, PARENT[proj]), proj, linear(proj, [w], None))
                    continue
                fused = next((f for f, ps in FUSED.items() if proj in ps and PARENT[f] == parts[3]), None)
                if fused is None or kind not in ("weight", "bias"):
                    raise ValueError(f"unexpected tensor in the checkpoint: {name}")
                got = pending.setdefault((i, fused), {})
                got[f"{proj}.{kind}"] = w
                names = FUSED[fused]
                want_bias = fused == "qkv_proj" and cfg.attention_bias
                if all(f"{n}.weight" in got for n in names) and (
                        not want_bias or all(f"{n}.bias" in got for n in names)):
                    bias = torch.cat([_dense(got[f"{n}.bias"], **dd) for n in names]) if want_bias else None
                    setattr(getattr(layer, PARENT[fused]), fused, linear(fused, [got[f"{n}.weight"] for n in names], bias))
                    del pending[(i, fused)]
        missing = [f"layer {i} {f}" for (i, f) in pending] + [
            f"layer {i} {f}" for i, layer in enumerate(self.layers) for f in FUSED
            if getattr(getattr(layer, PARENT[f]), f) is None and (i, f) not in pending]
        if self.embed_tokens is None:
            missing.append("model.embed_tokens.weight")
        if missing:
            raise ValueError(f"the checkpoint lacks weights: {', '.join(missing[:6])}")
        if head is None or cfg.tie_word_embeddings:   # the LM head shares the embedding table
            head = self.embed_tokens.weight if isinstance(self.embed_tokens, QuantEmbedding) else self.embed_tokens
        self.lm_head = linear("lm_head", [head], None)
        if math != "exact" or interleave:
            lay_out_weights([self.embed_tokens, *self.modules()], math)
            release_free_memory()     # the file-layout copies just freed: pages back to the system

    def _layer(self, i: int, name: str) -> DecoderLayer:
        if not 0 <= i < len(self.layers):
            raise ValueError(f"{name}: the model has {len(self.layers)} layers")
        return self.layers[i]

    def pack(self):
        """Re-lay out the dense GEMM weights for the CPU's oneDNN kernels (no-op elsewhere)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack()

    @property
    def quantized(self) -> bool:
        """Whether every linear of the decoder layers kept its GGUF blocks."""
        return all(isinstance(getattr(getattr(layer, PARENT[f]), f), QuantLinear) for layer in self.layers for f in FUSED)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed_tokens, QuantEmbedding):
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
        """LM head on normed rows -> float32 logits (soft-capped where the model says)."""
        logits = self.lm_head(normed).float()
        if self.cfg.final_softcap:
            cap = self.cfg.final_softcap
            logits = torch.tanh(logits / cap).mul_(cap)
        return logits
