"""Opening a model: which device (`resolve_device`), which runtime (`choose_runtime`: the
CPU runtime, model/cpu/, or the torch one, model/torch/) and the runner itself
(`open_runner`). Above both runtimes, which know nothing of each other."""
from __future__ import annotations

import os

from .runtime import RUNTIMES


def has_torch() -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec("torch") is not None
    except ValueError:         # torch in sys.modules as None (blocked)
        return False


def resolve_device(device: str) -> str:
    """"auto": a GPU when torch is installed and sees one (torch is imported only where an
    NVIDIA driver is present), else "cpu". A GPU asked for without torch: ValueError saying
    what to install."""
    from .loader import NEEDS_TORCH
    if device == "auto":
        if not has_torch() or not (os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidia0")):
            return "cpu"
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not has_torch():
        raise ValueError(f"--device {device}: the GPU path needs torch: {NEEDS_TORCH}")
    return device


def choose_runtime(runtime: str | None, device: str, model_path, settings=None) -> str:
    """Which runner serves: "cpu" (numpy + Rust: a GGUF file or a safetensors folder on the
    CPU; the default there) or "torch" (a GPU, or asked for: the GPU path and the tests'
    reference). runtime None: the settings' (EDGEPAGED_RUNTIME, read at assembly and passed
    down), else "auto"."""
    from .loader import NEEDS_TORCH
    if settings is None:
        from .settings import CpuConfig
        settings = CpuConfig.from_env()
    runtime = (runtime or settings.runtime or "auto").strip().lower()
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime {runtime!r}: one of {', '.join(RUNTIMES)}")
    if runtime == "cpu" and device != "cpu":
        raise ValueError(f"the cpu runtime runs on the CPU, not --device {device}")
    if runtime == "auto":
        runtime = "cpu" if device == "cpu" else "torch"
    if runtime == "torch" and not has_torch():
        what = f"--device {device}" if device != "cpu" else "the torch runtime"
        raise ValueError(f"{what} needs torch: {NEEDS_TORCH}")
    return runtime


def open_runner(model_path=None, device: str = "auto", kv_memory_bytes=None, block_size: int = 16, *,
                max_num_batched_tokens: int = 2048, kv_dtype: str | None = None, settings=None,
                runtime: str | None = None, num_blocks=None, served_name: str | None = None):
    """The runner a server uses for this model and device (`choose_runtime`); `served_name`:
    the store's name for it (lists and banners show it). `settings` (CpuConfig): read by the
    caller once at assembly (else here, once) and passed to the runner."""
    if settings is None:
        from .settings import CpuConfig
        settings = CpuConfig.from_env()
    device = resolve_device(device)
    from .cpu.encoder import is_encoder
    if model_path is not None and is_encoder(model_path):    # an embedding model (BERT family): numpy
        from .cpu.encoder import EncoderRunner
        return EncoderRunner(model_path, kv_memory_bytes=kv_memory_bytes, block_size=block_size, num_blocks=num_blocks,
                             settings=settings, served_name=served_name)
    if choose_runtime(runtime, device, model_path, settings) == "cpu":
        from .cpu.runner import CpuRunner
        return CpuRunner(model_path, kv_memory_bytes=kv_memory_bytes, block_size=block_size, num_blocks=num_blocks,
                         settings=settings, kv_dtype=kv_dtype, served_name=served_name)
    from .torch.runner import ModelRunner
    return ModelRunner(model_path, device=device, kv_memory_bytes=kv_memory_bytes, block_size=block_size,
                       num_blocks=num_blocks, max_num_batched_tokens=max_num_batched_tokens, kv_dtype=kv_dtype,
                       settings=settings, served_name=served_name)
