"""Embedding models of the BERT family, the ones households pull for their documents:
`bert` (all-MiniLM, bge, mxbai-embed-large) and `nomic-bert` (nomic-embed-text: rotary
positions, SwiGLU), from GGUF files as llama.cpp writes them or Hugging Face folders
(config.json + safetensors), run with numpy (f32 BLAS) on the CPU.

    runner = EncoderRunner("nomic-embed-text.gguf")   # served like any model: /api/embed, /v1/embeddings

How it runs beside the chats: an embedding request goes through the engine like a prompt
(`FrontEnd.build_embeds`): its tokens enter in chunks, each chunk's token ids are written into
the request's KV blocks (for an encoder the "KV" is just its tokens: a prefix cache hit is
exact), and the step that completes a prompt runs the whole bidirectional encoder over the
ids gathered from its blocks and pools them (mean, CLS or last, as the file says). Its blocks
return to the pool when it ends, like any request's.

The layer, as llama.cpp and transformers compute it (post-norm):
    x = LayerNorm(tok_embd[ids] + token_types[0] (+ position_embd[pos], bert))
    per layer: a = attention(x) (nomic: rotary, half-split, on q and k); x = LayerNorm(x + a)
               f = bert: down(gelu(up(x))) | nomic: down(silu(gate(x)) * up(x)); x = LayerNorm(x + f)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..dense import Matrix, gelu  # noqa: F401 - (the encoder's products and activation, shared with model/vision.py)

ARCHS = ("bert", "nomic-bert")
HF_TYPES = {"bert": "bert", "nomic_bert": "nomic-bert"}
POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last"}


@dataclass
class EncoderConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    context_length: int
    eps: float = 1e-12
    rope_theta: float | None = None      # nomic-bert: rotary positions (no position table)
    pooling: str = "mean"                # mean | cls | last
    name: str = ""

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ValueError(f"unsupported embedding architecture {self.arch!r} (edgepaged runs {', '.join(ARCHS)})")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden size {self.hidden_size} is not a multiple of {self.num_heads} heads")
        if self.pooling not in ("mean", "cls", "last"):
            raise ValueError(f"pooling {self.pooling!r}: edgepaged pools mean, cls or last")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def num_params(self) -> int:
        h, f = self.hidden_size, self.intermediate_size
        mlp = (3 if self.arch == "nomic-bert" else 2) * h * f
        return self.num_layers * (4 * h * h + mlp) + self.vocab_size * h


# ---------------------------------------------------------------- weights under GGUF's names

def _hf_layer_names(kind: str) -> dict[str, str]:
    """Hugging Face parameter name (after `N.`) -> GGUF tensor name (after `blk.N.`)."""
    if kind == "bert":
        return {"attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
                "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
                "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}
    return {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
            "attn.Wqkv": "attn_qkv", "self_attn.o_proj": "attn_output", "attn.out_proj": "attn_output",
            "post_attention_layernorm": "attn_output_norm", "norm1": "attn_output_norm",
            "mlp.up_proj": "ffn_up", "mlp.fc11": "ffn_up", "mlp.gate_proj": "ffn_gate", "mlp.fc12": "ffn_gate",
            "mlp.down_proj": "ffn_down", "mlp.fc2": "ffn_down", "post_mlp_layernorm": "layer_output_norm",
            "norm2": "layer_output_norm"}


def gguf_names(state: dict[str, np.ndarray], kind: str) -> dict[str, np.ndarray]:
    """A Hugging Face state dict (BertModel; NomicBertModel as transformers holds it or as it
    saves it) under llama.cpp's GGUF tensor names; q, k, v fused into attn_qkv for nomic-bert."""
    top = {"embeddings.word_embeddings": "token_embd", "embeddings.token_type_embeddings": "token_types",
           "embeddings.position_embeddings": "position_embd", "embeddings.LayerNorm": "token_embd_norm",
           "emb_ln": "token_embd_norm"}
    layer = _hf_layer_names(kind)
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        name = name.removeprefix("bert.").removeprefix("model.")
        base, _, leaf = name.rpartition(".")
        if leaf not in ("weight", "bias") or base.startswith(("pooler", "cls")) or "position_ids" in name:
            continue
        if base in top:
            out[f"{top[base]}.{leaf}"] = value
            continue
        for prefix in ("encoder.layer.", "encoder.layers.", "layers."):
            if base.startswith(prefix):
                n, _, rest = base[len(prefix):].partition(".")
                if rest in layer:
                    out[f"blk.{n}.{layer[rest]}.{leaf}"] = value
                break
        else:
            continue
    if kind == "nomic-bert":
        for key in [k for k in out if ".attn_q." in k]:
            pre, leaf = key.split(".attn_q.")
            out[f"{pre}.attn_qkv.{leaf}"] = np.concatenate([out.pop(f"{pre}.attn_{x}.{leaf}") for x in "qkv"])
    return out


def _layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    xc = x - mu
    var = np.mean(xc * xc, -1, keepdims=True)
    return xc / np.sqrt(var + eps) * w + b


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


class Encoder:
    """The weights (vectors f32, matrices as `Matrix`) and the forward."""

    def __init__(self, cfg: EncoderConfig, weights: dict[str, np.ndarray], math: str = "exact"):
        self.cfg, self.math = cfg, math
        w = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}

        def need(name):
            if name not in w:
                raise ValueError(f"the {cfg.arch} model has no tensor {name}")
            return w[name]

        def mat(name):
            return Matrix(need(name), math)
        self.tok = need("token_embd.weight")
        self.type0 = need("token_types.weight")[0] if "token_types.weight" in w else np.zeros(cfg.hidden_size, np.float32)
        self.pos = need("position_embd.weight") if cfg.arch == "bert" else None
        self.emb_norm = (need("token_embd_norm.weight"), need("token_embd_norm.bias"))
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"blk.{i}."
            L = {"o": mat(p + "attn_output.weight"), "o_b": w.get(p + "attn_output.bias"),
                 "n1": (need(p + "attn_output_norm.weight"), need(p + "attn_output_norm.bias")),
                 "up": mat(p + "ffn_up.weight"), "up_b": w.get(p + "ffn_up.bias"),
                 "down": mat(p + "ffn_down.weight"), "down_b": w.get(p + "ffn_down.bias"),
                 "n2": (need(p + "layer_output_norm.weight"), need(p + "layer_output_norm.bias"))}
            if p + "attn_qkv.weight" in w:
                L["qkv"], L["qkv_b"] = mat(p + "attn_qkv.weight"), w.get(p + "attn_qkv.bias")
            else:
                L["qkv"] = Matrix(np.concatenate([need(p + f"attn_{x}.weight") for x in "qkv"]), math)
                bs = [w.get(p + f"attn_{x}.bias") for x in "qkv"]
                L["qkv_b"] = np.concatenate(bs) if all(b is not None for b in bs) else None
            if cfg.arch == "nomic-bert":         # gate and up as one matrix: one product, then silu(g) * u
                L["gate_up"] = Matrix(np.concatenate([need(p + "ffn_gate.weight"), need(p + "ffn_up.weight")]), math)
                del L["up"]
            self.layers.append(L)
        if cfg.rope_theta is not None:
            d = cfg.head_dim
            inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
            ang = np.outer(np.arange(cfg.context_length, dtype=np.float64), inv)
            self.cos, self.sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    @property
    def nbytes(self) -> int:
        arrays = [self.tok, self.type0, self.pos, *self.emb_norm] + [
            a for L in self.layers for v in L.values() for a in (v if isinstance(v, tuple) else (v,))]
        return sum(a.nbytes for a in arrays if a is not None)

    @staticmethod
    def pick_math(quant_math: str) -> str:
        """`--quant-math` for an encoder: "auto" is int8 where the CPU has integer kernels."""
        if quant_math != "auto":
            return quant_math
        from ..._native import quant
        return "int8" if quant.info()["int8_isa"] != "scalar" else "exact"

    def _rope(self, x: np.ndarray, n: int) -> np.ndarray:
        """x [n, heads, d], half-split rotary (llama.cpp's NEOX, transformers' rotate_half)."""
        half = x.shape[-1] // 2
        cos, sin = self.cos[:n, None, :], self.sin[:n, None, :]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def _attention(self, qkv: np.ndarray, lens: list[int]) -> np.ndarray:
        cfg = self.cfg
        h, nh, d = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        out = np.empty((qkv.shape[0], h), np.float32)
        scale = np.float32(d ** -0.5)
        at = 0
        for n in lens:
            q = qkv[at:at + n, :h].reshape(n, nh, d)
            k = qkv[at:at + n, h:2 * h].reshape(n, nh, d)
            v = qkv[at:at + n, 2 * h:].reshape(n, nh, d)
            if cfg.rope_theta is not None:
                q, k = self._rope(q, n), self._rope(k, n)
            s = np.matmul(q.transpose(1, 0, 2), k.transpose(1, 2, 0)) * scale      # [nh, n, n]
            s -= s.max(-1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(-1, keepdims=True)
            out[at:at + n] = np.matmul(s, v.transpose(1, 0, 2)).transpose(1, 0, 2).reshape(n, h)
            at += n
        return out

    def hidden(self, seqs: list[np.ndarray]) -> np.ndarray:
        """The last layer's states of the sequences, concatenated [sum of lengths, hidden]."""
        cfg = self.cfg
        lens = [len(s) for s in seqs]
        if max(lens) > cfg.context_length:
            raise ValueError(f"a sequence of {max(lens)} tokens is past the model's {cfg.context_length}")
        ids = np.concatenate(seqs).astype(np.int64)
        x = self.tok[ids] + self.type0
        if self.pos is not None:
            x += self.pos[np.concatenate([np.arange(n) for n in lens])]
        x = _layernorm(x, *self.emb_norm, cfg.eps)
        for L in self.layers:
            qkv = x @ L["qkv"]
            if L["qkv_b"] is not None:
                qkv += L["qkv_b"]
            a = self._attention(qkv, lens) @ L["o"]
            if L["o_b"] is not None:
                a += L["o_b"]
            x = _layernorm(x + a, *L["n1"], cfg.eps)
            if "gate_up" in L:
                from ..._native import ops
                gu = x @ L["gate_up"]
                f = np.empty((gu.shape[0], gu.shape[1] // 2), np.float32)
                ops.silu_mul(gu, f)
            else:
                up = x @ L["up"]
                if L["up_b"] is not None:
                    up += L["up_b"]
                f = gelu(up)
            f = f @ L["down"]
            if L["down_b"] is not None:
                f += L["down_b"]
            x = _layernorm(x + f, *L["n2"], cfg.eps)
        return x

    def embed(self, seqs: list[np.ndarray]) -> list[np.ndarray]:
        """Pooled (not normalized) vectors, one per sequence."""
        x = self.hidden(seqs)
        out, at = [], 0
        for s in seqs:
            n = len(s)
            rows = x[at:at + n]
            pooled = rows.mean(0) if self.cfg.pooling == "mean" else rows[0] if self.cfg.pooling == "cls" else rows[-1]
            out.append(np.ascontiguousarray(pooled, dtype=np.float32))
            at += n
        return out


# ---------------------------------------------------------------- loading

def gguf_arch(path) -> str | None:
    """general.architecture of a GGUF file (None for anything else)."""
    from ..gguf_file import GgufFile
    try:
        return GgufFile(path).fields.get("general.architecture")
    except (ValueError, OSError):
        return None


def is_encoder(path) -> bool:
    """Whether `path` is an embedding model of the BERT family (GGUF, or a Hugging Face folder)."""
    path = Path(path)
    if path.is_dir():
        try:
            return json.loads((path / "config.json").read_text()).get("model_type") in HF_TYPES
        except (OSError, ValueError):
            return False
    return gguf_arch(path) in ARCHS


def _gguf_config(f, name: str) -> EncoderConfig:
    arch = f.fields.get("general.architecture")

    def key(k, default=None):
        v = f.fields.get(f"{arch}.{k}", default)
        if v is None:
            raise ValueError(f"{name}: the GGUF file has no {arch}.{k}")
        return v
    pooling = POOLING.get(int(f.fields.get(f"{arch}.pooling_type", 1)), "none")
    if pooling == "none":
        pooling = "mean"          # a file that says nothing: mean, as sentence-transformers mostly pools
    tokens = f.fields.get("tokenizer.ggml.tokens") or []
    return EncoderConfig(arch=arch, vocab_size=len(tokens), hidden_size=int(key("embedding_length")),
                         intermediate_size=int(key("feed_forward_length")), num_layers=int(key("block_count")),
                         num_heads=int(key("attention.head_count")), context_length=int(key("context_length")),
                         eps=float(key("attention.layer_norm_epsilon", 1e-12)),
                         rope_theta=float(key("rope.freq_base", 1000.0)) if arch == "nomic-bert" else None,
                         pooling=pooling, name=f.fields.get("general.name") or name)


def _gguf_weights(f) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize
    out = {}
    for t in f.tensors:
        data = t.data
        if data.dtype in (np.float32, np.float16):
            arr = np.asarray(data, dtype=np.float32)
        else:
            arr = dequantize(np.asarray(data), t.tensor_type).astype(np.float32)
        shape = tuple(int(x) for x in reversed(t.shape))
        out[t.name] = arr.reshape(shape)
    return out


def _hf_pooling(path: Path) -> str:
    p = path / "1_Pooling" / "config.json"
    if p.is_file():
        c = json.loads(p.read_text())
        if c.get("pooling_mode_cls_token"):
            return "cls"
        if c.get("pooling_mode_lasttoken"):
            return "last"
    return "mean"


def _hf_config(path: Path) -> EncoderConfig:
    c = json.loads((path / "config.json").read_text())
    arch = HF_TYPES.get(c.get("model_type"))
    if arch is None:
        raise ValueError(f"{path}: model_type {c.get('model_type')!r} is not an embedding model edgepaged runs")
    rope = None
    if arch == "nomic-bert":
        rope = float((c.get("rope_parameters") or {}).get("rope_theta") or c.get("rope_theta")
                     or c.get("rotary_emb_base") or 1000.0)
    return EncoderConfig(arch=arch, vocab_size=c["vocab_size"], hidden_size=c.get("hidden_size") or c["n_embd"],
                         intermediate_size=c.get("intermediate_size") or c["n_inner"],
                         num_layers=c.get("num_hidden_layers") or c["n_layer"],
                         num_heads=c.get("num_attention_heads") or c["n_head"],
                         context_length=c.get("max_position_embeddings") or c.get("n_positions") or 512,
                         eps=float(c.get("layer_norm_eps") or c.get("layer_norm_epsilon") or 1e-12),
                         rope_theta=rope, pooling=_hf_pooling(path), name=path.name)


def load_encoder(path, math: str = "exact") -> tuple[Encoder, object]:
    """(Encoder, Tokenizer) from a GGUF file or a Hugging Face folder; `math` as Matrix."""
    from ..tokenizer import Tokenizer
    path = Path(path)
    if path.is_dir():
        cfg = _hf_config(path)
        try:
            from safetensors.numpy import load_file
        except ImportError:
            raise ValueError(f"{path}: reading safetensors needs the safetensors package "
                             "(pip install safetensors), or use a GGUF file") from None
        state = {}
        for f in sorted(path.glob("*.safetensors")):
            state.update(load_file(str(f)))
        return Encoder(cfg, gguf_names(state, cfg.arch), math), Tokenizer.load(path)
    from ..gguf_file import GgufFile
    f = GgufFile(path)
    cfg = _gguf_config(f, path.stem)
    return Encoder(cfg, _gguf_weights(f), math), Tokenizer.load(path, f)


def inspect(path) -> dict:
    """What store.inspect reports of an embedding model's file."""
    from ..gguf_file import GgufFile
    f = GgufFile(path)
    cfg = _gguf_config(f, Path(path).stem)
    names = {t.name for t in f.tensors}
    for need in ("token_embd.weight", "token_embd_norm.weight", "blk.0.ffn_up.weight"):
        if need not in names:
            raise ValueError(f"{path}: the {cfg.arch} model has no tensor {need}")
    return {"config": cfg}


def encoder_file_info(path: Path) -> dict:
    """What a model list says of an encoder's files (as `ModelFiles.info` of a decoder's):
    format, bytes, modification time, and the quantization (GGUF's general.file_type, else
    the type most of the matrices' bytes are in: the store's own name for it)."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    quant = None
    if path.is_file():
        from ..gguf_file import GgufFile
        from ..loader import FILE_TYPES
        f = GgufFile(path)
        ftype = f.fields.get("general.file_type")
        quant = FILE_TYPES.get(ftype, f"type {ftype}") if ftype is not None else "F32"
    return {"format": "gguf" if path.is_file() else "safetensors", "size": sum(x.stat().st_size for x in files),
            "modified": max((x.stat().st_mtime for x in files), default=0.0), "quantization": quant or "F32"}


# ---------------------------------------------------------------- the runner the engine drives

class EncoderRunner:
    """An embedding model as the engine sees a model: a pool of blocks (holding the tokens of
    the requests running), and `step` (the embedding rows only: an encoder generates nothing)."""

    embedding_only = True
    kv_dtype_name = "tokens"
    keeps_kv = False          # its blocks hold token ids: nothing for the disk tier
    interrupt = None          # its steps are not stopped (Engine._maybe_interrupt)
    draft = None
    model_name: str | None = None
    served_name: str | None = None
    weights_cache: str | None = None
    file_info: dict | None = None

    def __init__(self, path, *, kv_memory_bytes: int | None = None, block_size: int = 16, num_blocks=None,
                 math: str | None = None, settings=None, served_name: str | None = None, **_ignored):
        self.model_path = Path(path)
        self.served_name = served_name
        if math is None:
            from ..settings import CpuConfig
            math = Encoder.pick_math((settings or CpuConfig.from_env()).quant_math)
        self.model, self.tokenizer = load_encoder(path, math)
        self.config = self.model.cfg
        self.file_info = encoder_file_info(self.model_path)
        self.block_size = block_size
        self.max_model_len = self.config.context_length
        per_block = block_size * 4
        room = 64 * -(-self.max_model_len // block_size)          # 64 full contexts at once
        self.num_blocks = int(num_blocks or max(room, min(room * 4, (kv_memory_bytes or 0) // per_block)))
        self.slot_tokens = np.zeros(self.num_blocks * block_size, np.int32)
        self.products = "numpy f32" if math == "exact" else "int8 (Q8_0 requantized)"

    def memory(self) -> dict:
        return {"weights_bytes": self.model.nbytes, "kv_bytes": self.slot_tokens.nbytes}

    def attach_draft(self, draft) -> None:
        raise ValueError("an embedding model generates no text: it takes no draft model")

    def step(self, batch, params, prev_tokens=None, embeds=None, **_unused) -> list:
        bs = self.block_size
        for src, dst in np.asarray(batch.copies).reshape(-1, 2) if len(batch.copies) else ():
            self.slot_tokens[dst * bs:(dst + 1) * bs] = self.slot_tokens[src * bs:(src + 1) * bs]
        self.slot_tokens[np.asarray(batch.slot_mapping, dtype=np.int64)] = batch.input_ids
        ends = np.asarray(batch.query_start_loc[1:]) - 1
        rows = np.searchsorted(ends, np.asarray(batch.logits_indices))
        seqs = []
        for j in rows:
            n = int(batch.seq_lens[j])
            pos = np.arange(n)
            table = np.asarray(batch.block_tables[j], dtype=np.int64)
            seqs.append(self.slot_tokens[table[pos // bs] * bs + pos % bs])
        wanted = [i for i in range(len(seqs)) if embeds is not None and embeds[i]]
        out: list = [ValueError("an embedding model generates no text")] * len(seqs)
        if wanted:
            for i, v in zip(wanted, self.model.embed([seqs[i] for i in wanted])):
                out[i] = v
        return out
