"""Gemma 2: sandwich norms (the attention's and the MLP's outputs normed before they join
the residual), a GELU-tanh MLP, embeddings times sqrt(hidden), soft-capped attention scores
and logits, every other layer sliding (local, global, ...). Checkpoints store the norms as
w of x̂·(1 + w); llama.cpp's files store 1 + w."""
from __future__ import annotations

from .base import Family, layer_pattern, register


class Gemma2(Family):
    name = "gemma2"
    sandwich_norms = True
    activation = "gelu_tanh"
    norm_offset = 1.0
    tie_default = True
    gguf_tensors = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                    "post_ffw_norm": "post_feedforward_layernorm"}
    big_layers = 46            # the 27 B model: its query scale is 1/sqrt(hidden / heads)

    def gguf_config(self, key, tensors, base) -> dict:
        layers, hidden, heads = base["num_layers"], base["hidden_size"], base["num_heads"]
        big = layers == self.big_layers   # llama.cpp's query scale for the 27 B models
        return dict(embed_scale=float(hidden) ** 0.5, final_softcap=key("final_logit_softcapping"),
                    attn_scale=key("attention.scale") or (hidden // heads if big else base["head_dim"]) ** -0.5,
                    **self.gguf_layers(key, layers))

    def gguf_layers(self, key, layers: int) -> dict:
        return dict(attn_softcap=key("attn_logit_softcapping"), layer_sliding=layer_pattern(layers, 2))

    def hf_config(self, c: dict, base: dict) -> dict:
        out = dict(embed_scale=float(c["hidden_size"]) ** 0.5,
                   attn_scale=float(c.get("query_pre_attn_scalar", 256)) ** -0.5,
                   final_softcap=c.get("final_logit_softcapping"), attn_softcap=self.hf_softcap(c))
        if base["layer_sliding"] is None:
            out["layer_sliding"] = layer_pattern(base["num_layers"], self.hf_period(c))
        return out

    def hf_softcap(self, c: dict):
        return c.get("attn_logit_softcapping")

    def hf_period(self, c: dict) -> int:
        return 2


register(Gemma2)
