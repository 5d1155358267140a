"""Where each checkpoint weight goes: the one placement routine every model build uses (the
torch modules of `llama.py` and the numpy model of `model/cpu/runner.py`), torch-free.

`place(cfg, weights, sink)` walks the loader's `(hf_name, weight)` stream, checks every name
and shape, fuses Q/K/V and gate/up parts as soon as all of them arrived, and hands each
piece to the sink: `embedding(w)`, `final_norm(w)`, `rope_freqs(w)`, `norm(layer, name, w)`
(name: input_layernorm, post_attention_layernorm, pre_/post_feedforward_layernorm, q_norm,
k_norm), `linear(layer, fused, parts, bias_parts)` (fused: qkv_proj, o_proj, gate_up_proj,
down_proj) and, at the end, `head(w)` (None: tied to the embedding table). Norm weights
arrive with gemma's offset added.
"""
from __future__ import annotations

from typing import Iterable

# fused module -> the checkpoint's parts, in order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
PARENT = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}


def linear_shapes(cfg) -> dict[str, tuple[int, int]]:
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    return {"qkv_proj": (q + 2 * kv, hidden), "o_proj": (hidden, q), "gate_up_proj": (2 * inter, hidden),
            "down_proj": (hidden, inter), "lm_head": (cfg.vocab_size, hidden)}


def check_linear(cfg, what: str, parts: list) -> None:
    """ValueError unless the parts stack to the [out, in] this model's `what` needs."""
    rows = sum(p.rows if hasattr(p, "rows") else p.shape[0] for p in parts)
    cols = {p.cols if hasattr(p, "cols") else p.shape[-1] for p in parts}
    need = linear_shapes(cfg)[what]
    if (rows, *cols) != need:
        raise ValueError(f"{what}: the checkpoint's weights make [{rows}, {'/'.join(map(str, cols))}], the "
                         f"model needs {list(need)}")


def place(cfg, weights: Iterable[tuple[str, object]], sink) -> None:
    offset = cfg.extra.get("norm_offset", 0.0)   # gemma's checkpoints store w of x̂·(1 + w)
    norms = [cfg.layer(i).norms() for i in range(cfg.num_layers)]
    pending: dict[tuple[int, str], dict[str, object]] = {}
    built: set[tuple[int, str]] = set()
    head, embedded = None, False

    def linear(i: int, fused: str, parts: list, bias) -> None:
        check_linear(cfg, fused, parts)
        sink.linear(i, fused, parts, bias)
        built.add((i, fused))

    for name, w in weights:
        if name == "rope_freqs":   # llama3's frequency factors: the global table only
            sink.rope_freqs(w)
        elif name.endswith("rotary_emb.inv_freq"):
            continue
        elif name == "model.embed_tokens.weight":
            sink.embedding(w)
            embedded = True
        elif name == "model.norm.weight":
            sink.final_norm(w + offset)
        elif name == "lm_head.weight":
            head = w
        else:   # model.layers.{i}.{self_attn|mlp|*_layernorm}.{...}
            parts = name.split(".")
            if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
                raise ValueError(f"unexpected tensor in the checkpoint: {name}")
            i = int(parts[2])
            if not 0 <= i < cfg.num_layers:
                raise ValueError(f"{name}: the model has {cfg.num_layers} layers")
            norm = parts[3] if parts[3].endswith("layernorm") else \
                parts[4] if parts[3:5] in (["self_attn", "q_norm"], ["self_attn", "k_norm"]) else None
            if norm is not None:
                if norm not in norms[i] or parts[-1] != "weight":
                    raise ValueError(f"unexpected tensor in the checkpoint: {name} (this {cfg.arch} model has "
                                     "no such norm)")
                sink.norm(i, norm, w + offset)
                continue
            proj, kind = parts[-2], parts[-1]
            if proj in FUSED and proj not in ("o_proj", "down_proj") and PARENT[proj] == parts[3] \
                    and kind == "weight":   # already fused in the checkpoint (phi3)
                linear(i, proj, [w], None)
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
                bias = [got[f"{n}.bias"] for n in names] if want_bias else None
                linear(i, fused, [got[f"{n}.weight"] for n in names], bias)
                del pending[(i, fused)]
    missing = [f"layer {i} {f}" for (i, f) in pending] + [
        f"layer {i} {f}" for i in range(cfg.num_layers) for f in FUSED if (i, f) not in built and (i, f) not in pending]
    if not embedded:
        missing.append("model.embed_tokens.weight")
    if missing:
        raise ValueError(f"the checkpoint lacks weights: {', '.join(missing[:6])}")
    if head is not None and not cfg.tie_word_embeddings:
        check_linear(cfg, "lm_head", [head])
        sink.head(head)
    else:                                         # the LM head shares the embedding table
        sink.head(None)
