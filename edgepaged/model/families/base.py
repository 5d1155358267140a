"""What a model family is: its config keys, its tensor names and its decoder layer as a
sequence of named steps, written once (one small file per family) and executed by every
runtime: the CPU runtime (`model/cpu/runner.py`, numpy and Rust) and the torch modules
(`model/torch/llama.py`, the GPU path and the tests' reference).

A layer is a tuple of steps over the residual stream h:

    Norm(name)       h += the last step's output (if any); x = RMSNorm_name(h)
    Attention(...)   x = attention(x): QKV product, q/k norms, rotary (table `rope`), KV
                     write, attention (window, soft-capped scores), O product
    OutNorm(name)    x = RMSNorm_name(x): a block's output normed before it joins h (gemma)
    Mlp(activation)  x = down(act(gate(x)) * up(x))

and the layer's output is the last step's x (added to h by the next layer's first `Norm`,
or before the final norm). llama's block is (Norm, Attention, Norm, Mlp); gemma's
(Norm, Attention, OutNorm, Norm, Mlp, OutNorm).

A family is a `Family` subclass registered with `register`: a variant subclasses the family
it varies (a test defines one in its own file: tests/test_families.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class Norm:
    """h += the previous block's output; x = RMSNorm(h) with the layer's norm `name`."""
    name: str


@dataclass(frozen=True)
class Attention:
    qk_norm: bool = False          # per-head RMSNorm of q and k before the rotary (q_norm, k_norm)
    rope: int = 0                  # which rotary table (0: the model's; 1: the local one, gemma3)
    window: int | None = None      # sliding window (None: the whole context)
    softcap: float | None = None   # tanh soft-capping of the scores (gemma2)


@dataclass(frozen=True)
class OutNorm:
    """x = RMSNorm(x) with norm `name`: a block's output before it joins the residual."""
    name: str


@dataclass(frozen=True)
class Mlp:
    activation: str = "silu"       # silu | gelu_tanh, of the gate, times up


Step = Norm | Attention | OutNorm | Mlp


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer as its steps (see the module's docstring)."""
    steps: tuple

    def __post_init__(self):
        kinds = [type(s) for s in self.steps]
        if kinds.count(Attention) != 1 or kinds.count(Mlp) != 1 or not self.steps or kinds[0] is not Norm:
            raise ValueError(f"a layer is a Norm, then one Attention and one Mlp each after a Norm: {self.steps}")
        for i, s in enumerate(self.steps):
            if isinstance(s, (Attention, Mlp)) and not isinstance(self.steps[i - 1], Norm):
                raise ValueError(f"step {i} ({type(s).__name__}) must follow a Norm: {self.steps}")
            if isinstance(s, Mlp) and s.activation not in ACTIVATIONS:
                raise ValueError(f"unsupported MLP activation {s.activation!r} (edgepaged runs "
                                 f"{', '.join(ACTIVATIONS)})")

    @property
    def attention(self) -> Attention:
        return next(s for s in self.steps if isinstance(s, Attention))

    @property
    def mlp(self) -> Mlp:
        return next(s for s in self.steps if isinstance(s, Mlp))

    def norms(self) -> tuple[str, ...]:
        """The layer's norm weights (Hugging Face's names), q/k norms included."""
        names = tuple(s.name for s in self.steps if isinstance(s, (Norm, OutNorm)))
        return names + (("q_norm", "k_norm") if self.attention.qk_norm else ())

    @property
    def llama_block(self) -> bool:
        """llama's block (what the one-call Rust decoder runs): norm, attention without q/k
        norms, soft-cap or local rotary, norm, SiLU MLP."""
        a = self.attention
        return (self.steps == (Norm("input_layernorm"), a, Norm("post_attention_layernorm"), Mlp("silu"))
                and not a.qk_norm and a.rope == 0 and not a.softcap)


def llama_blocks(cfg) -> bool:
    """Whether every layer of model `cfg` is llama's block with one window: what the one-call
    Rust decoder (`ops.QuantDecoder`) runs."""
    specs = [cfg.layer(i) for i in range(cfg.num_layers)]
    return all(s.llama_block for s in specs) and len({s.attention.window for s in specs}) == 1


def pre_norm_layer(*, qk_norm=False, rope=0, window=None, softcap=None, activation="silu",
                   sandwich=False) -> LayerSpec:
    """The pre-norm decoder layer every family here is a case of (Hugging Face's norm names:
    `post_attention_layernorm` is the MLP's input norm in llama and the attention's output
    norm in gemma)."""
    attn = Attention(qk_norm=qk_norm, rope=rope, window=window, softcap=softcap)
    if sandwich:
        return LayerSpec((Norm("input_layernorm"), attn, OutNorm("post_attention_layernorm"),
                          Norm("pre_feedforward_layernorm"), Mlp(activation), OutNorm("post_feedforward_layernorm")))
    return LayerSpec((Norm("input_layernorm"), attn, Norm("post_attention_layernorm"), Mlp(activation)))


def layer_pattern(n: int, period: int) -> list[bool]:
    """Gemma's local/global layout: layer i slides unless (i + 1) is a multiple of `period`."""
    return [(i + 1) % period != 0 for i in range(n)]


# GGUF's (llama.cpp's) tensor names -> Hugging Face's, shared by the families; a family adds
# or replaces entries in `gguf_tensors`
GGUF_TENSORS = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm", "attn_qkv": "self_attn.qkv_proj",
}

GgufKey = Callable[..., object]   # key(name, default=None): the file's `{arch}.{name}` metadata


class Family:
    """A decoder family. Class attributes describe it; the config hooks return the
    `ModelConfig` fields the family sets beyond the common ones (which the loader reads from
    every file alike); `layer` says what layer i of a model is."""

    name = ""                  # GGUF's general.architecture and edgepaged's arch name
    hf_types: tuple[str, ...] = ()   # config.json model_type values (default: (name,))
    gguf_tensors: dict[str, str] = {}  # GGUF base names -> Hugging Face names, beyond GGUF_TENSORS
    permute_qk = False         # llama.cpp's converter permuted Q/K rows (interleaved rotary)
    config_tensors: tuple[str, ...] = ()   # GGUF tensors read into the config (phi3's LongRoPE factors)
    # the layer's structure (a GGUF file with q/k norm tensors has them whatever the family;
    # config.json's hidden_act names the activation)
    qk_norm = False
    sandwich_norms = False
    activation = "silu"
    local_rope = False         # the sliding layers' own rotary table (gemma3)
    norm_offset = 0.0          # Hugging Face checkpoints store w of x̂·(1 + w) (gemma: 1)
    tie_default = False        # config.json without tie_word_embeddings: tied?
    attention_bias_default = False   # config.json without attention_bias

    def gguf_config(self, key: GgufKey, tensors: set[str], base: dict) -> dict:
        """Fields from a GGUF file's metadata (`key`) and tensor names, beyond `base`."""
        return {}

    def hf_config(self, c: dict, base: dict) -> dict:
        """Fields from a config.json (`c`), beyond `base`."""
        return {}

    def layer(self, cfg, i: int) -> LayerSpec:
        """Layer i of model `cfg` as steps: by default the pre-norm layer with the config's
        structure (q/k norms, sandwich norms, activation, soft-cap, windows, local rotary)."""
        return pre_norm_layer(qk_norm=cfg.qk_norm, rope=1 if cfg.local_rope(i) else 0, window=cfg.window(i),
                              softcap=cfg.attn_softcap, activation=cfg.activation, sandwich=cfg.sandwich_norms)

    def tensor_names(self) -> dict[str, str]:
        return {**GGUF_TENSORS, **self.gguf_tensors}

    def __repr__(self):
        return f"<family {self.name}>"


_REGISTRY: dict[str, Family] = {}


def register(family: Family | type) -> Family:
    """Add a family (an instance or a `Family` subclass); its name must be new. Returns it."""
    if isinstance(family, type):
        family = family()
    if not family.name or family.name in _REGISTRY:
        raise ValueError(f"a family needs a new name, got {family.name!r}")
    _REGISTRY[family.name] = family
    return family


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def get(name: str) -> Family:
    """The family named `name` (GGUF's general.architecture); ValueError naming the ones run."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unsupported model architecture {name!r}: edgepaged runs {', '.join(names())}") from None


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def for_hf_type(model_type: str) -> Family | None:
    """The family of a config.json's model_type, or None."""
    for f in _REGISTRY.values():
        if model_type in (f.hf_types or (f.name,)):
            return f
    return None
