"""The runtime's knobs, read once into one object (`CpuConfig.from_env()`, which `serve`
calls when it assembles the box: `server/settings.py`'s `ServeSettings.cpu`), never at
import: every EDGEPAGED_ variable that changes how the model runs is a row of `ENV_KNOBS`
below (the README's "Knobs" and docs/SETTINGS.md list the same ones, and tests check both).

Why each default: bench/RESULTS.md.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name)
    if text is None or not text.strip():
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected an integer") from None


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    text = env.get(name)
    if text is None or not text.strip():
        return default
    return text.strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class EnvKnob:
    name: str          # the environment variable
    default: str       # as a person reads it
    what: str


ENV_KNOBS: tuple[EnvKnob, ...] = (
    EnvKnob('EDGEPAGED_NUM_THREADS', 'CPUs',
            "threads of the kernels' pool and of torch (read by Rust too)"),
    EnvKnob('EDGEPAGED_SPIN_US', '200',
            'µs an idle kernel thread spins before it sleeps (Rust)'),
    EnvKnob('EDGEPAGED_RUNTIME', 'auto',
            'cpu (numpy + Rust, GGUF or safetensors on the CPU), torch, auto (read by `open.choose_runtime`)'),
    EnvKnob('EDGEPAGED_QUANT_MATH', 'auto',
            "`int8`: activations quantized per block of 32 (per 256 for K-quants) and 8-bit dot products (llama.cpp's way); `exact`: fp32 activations, the weights decoded exactly; `auto`: int8 for models of 0.7 B parameters and more on a CPU with AVX2 or AVX-512 VNNI, exact otherwise (`serve --quant-math`)"),
    EnvKnob('EDGEPAGED_QUANT_INTERLEAVE', '1',
            "exact math: 0 keeps GGUF's row order for Q4_0/Q4_1/Q8_0"),
    EnvKnob('EDGEPAGED_QUANT_DENSE_MIN_TOKENS', '768',
            "token rows from which quantized products decode to fp32 + GEMM (not the integer kernels' weights, nor interleaved Q4_0/Q4_1/Q8_0 ones)"),
    EnvKnob('EDGEPAGED_QUANT_TORCH_THREADS', '1',
            "0: let torch keep all its threads beside the kernels' pool"),
    EnvKnob('EDGEPAGED_RUST_ATTENTION_MAX', '131072',
            'a prefill chunk of q rows over n positions attends in Rust while q * n is at most this'),
    EnvKnob('EDGEPAGED_FUSED_MAX_TOKENS', '256',
            'CPU runtime: steps with fewer rows run all layers in one Rust call'),
    EnvKnob('EDGEPAGED_TILE_ATTENTION_MIN', '8192',
            "CPU runtime: a prefill chunk of q rows over n positions attends in `paged_prefill`'s tiles (its step layer by layer) once q * n is above this"),
    EnvKnob('EDGEPAGED_NO_AVX512', '0',
            '1: the kernels use AVX2 even on a CPU with AVX-512 (read by Rust, at the first kernel call)'),
    EnvKnob('EDGEPAGED_DECODE_PREFETCH', '8192',
            "bytes ahead of its reads the integer kernels prefetch a decode step's weights (0: the hardware's prefetch alone; read by Rust; `quant.decode_prefetch`)"),
    EnvKnob('EDGEPAGED_DECODE_SEG', '512',
            "positions per segment of a long context's decode attention, each segment one item on the kernel threads, joined after (0: split by KV heads only; read by Rust; `ops.decode_seg`)"),
    EnvKnob('EDGEPAGED_ATTENTION_BF16', 'on',
            "prefill attention's tiles over an f16 or q8_0 cache multiply in bf16 (f32 sums) on a CPU with AVX-512 BF16, every prompt row in the tiles; 0: f32 products (read by Rust, at the first prefill; `ops.bf16_attention`)"),
    EnvKnob('EDGEPAGED_WEIGHTS_CACHE_MIN', '512 MiB',
            'the smallest model file (bytes) whose laid-out weights the weights cache keeps (`weights_cache`; `edgepaged pull` lays such a file out at once)'),
)


MATHS = ("auto", "int8", "exact")


@dataclass(frozen=True)
class CpuConfig:
    num_threads: int | None = None     # None: every CPU this process may use
    quant_math: str = "auto"           # how quantized weights are multiplied (MATHS)
    quant_interleave: bool = True
    dense_min_tokens: int = 768
    torch_single_thread: bool = True
    rust_attention_max: int = 131072
    fused_max_tokens: int = 256
    tile_attention_min: int = 8192
    runtime: str = "auto"              # what runs a model: RUNTIMES (model/runtime.py)
    no_avx512: bool = False            # (Rust reads the variable itself; here for the record)
    weights_cache_min_bytes: int = 512 << 20   # smaller model files are not kept laid out (weights_cache)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "CpuConfig":
        env = os.environ if env is None else env
        threads = _int(env, "EDGEPAGED_NUM_THREADS", 0)
        math = (env.get("EDGEPAGED_QUANT_MATH") or "auto").strip().lower()
        if math not in MATHS:
            raise ValueError(f"EDGEPAGED_QUANT_MATH={math!r}: expected one of {', '.join(MATHS)}")
        return cls(
            quant_math=math,
            num_threads=threads if threads > 0 else None,
            quant_interleave=_flag(env, "EDGEPAGED_QUANT_INTERLEAVE", True),
            dense_min_tokens=_int(env, "EDGEPAGED_QUANT_DENSE_MIN_TOKENS", 768),
            torch_single_thread=_flag(env, "EDGEPAGED_QUANT_TORCH_THREADS", True),
            rust_attention_max=_int(env, "EDGEPAGED_RUST_ATTENTION_MAX", 131072),
            fused_max_tokens=_int(env, "EDGEPAGED_FUSED_MAX_TOKENS", 256),
            tile_attention_min=_int(env, "EDGEPAGED_TILE_ATTENTION_MIN", 8192),
            runtime=(env.get("EDGEPAGED_RUNTIME") or "auto").strip().lower(),
            no_avx512=_flag(env, "EDGEPAGED_NO_AVX512", False),
            weights_cache_min_bytes=_int(env, "EDGEPAGED_WEIGHTS_CACHE_MIN", 512 << 20),
        )

    def math(self, num_params: int) -> str:
        """How a model of `num_params` parameters multiplies its quantized weights: "int8"
        or "exact" (`quant_math`; "auto": int8 from `INT8_MIN_PARAMS` on, where llama.cpp's
        math buys 2-3x at its own error, exact below, where small models are the most
        sensitive to the activations' rounding and fast anyway; exact on a CPU without
        integer kernels, whose portable ones are slow)."""
        if self.quant_math != "auto":
            return self.quant_math
        from .._native import quant
        return "int8" if quant.info()["int8_isa"] != "scalar" and num_params >= INT8_MIN_PARAMS else "exact"


# From here on `auto` picks the integer kernels (README, "Quantized models": the error).
INT8_MIN_PARAMS = 700_000_000
