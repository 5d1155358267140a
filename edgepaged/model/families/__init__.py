"""Model families, one file each (see `base.py` for what a family file says):

| file        | families                       |
|-------------|--------------------------------|
| `llama.py`  | llama, mistral                 |
| `qwen2.py`  | qwen2, qwen2vl, qwen25vl       |
| `qwen3.py`  | qwen3                          |
| `gemma2.py` | gemma2                         |
| `gemma3.py` | gemma3                         |
| `phi3.py`   | phi3                           |

Adding one: a file here (its class, `register`ed: every module of this package is imported,
nothing lists them), a test, the README's table. A test may register a family of its own
(tests/test_families.py does).
"""
from __future__ import annotations

import importlib
import pkgutil

from .base import (Attention, Family, LayerSpec, Mlp, Norm, OutNorm, for_hf_type, get, layer_pattern, llama_blocks, names,
                   pre_norm_layer, register, unregister)

for _module in pkgutil.iter_modules(__path__):      # each family file registers its families
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

BUILT_IN = names()

__all__ = ["Attention", "BUILT_IN", "Family", "LayerSpec", "Mlp", "Norm", "OutNorm", "for_hf_type", "get",
           "layer_pattern", "llama_blocks", "names", "pre_norm_layer", "register", "unregister"]
