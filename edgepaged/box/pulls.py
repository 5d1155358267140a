"""Bringing a model into the store, from wherever its name says: a local GGUF file, the
Hugging Face hub (store.py) or Ollama's registry (registry.py). Above both: the store knows
nothing of the registry."""
from __future__ import annotations

from pathlib import Path

from . import registry, store


def pull(spec: str, name: str | None = None, root: Path | None = None, progress=None, *,
         local_files: bool = True) -> store.Entry:
    """Bring a model into the store: `spec` is a local GGUF file (unless `local_files` is off:
    a name a client sent over the network never reads the server's files), REPO[:FILE] on
    the hub, or an Ollama name (`llama3.2:3b`, `ollama:user/model:tag`) from Ollama's
    registry (registry.py)."""
    root = root or store.store_dir()
    local = Path(spec).expanduser()
    if local_files and (store._exists(local) or spec.startswith((".", "/", "~"))
                        or spec.lower().endswith(".gguf") and ":" not in spec):
        if not local.is_file():
            raise store.StoreError(f"no file {spec}")
        return store.import_file(local, name, root)
    if registry.is_ollama_name(spec):
        return registry.pull_ollama(spec, name, root, progress)
    return store.pull_hub(spec, name, root)
