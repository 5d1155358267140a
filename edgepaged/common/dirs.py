"""Where the box keeps its files: the model store (and under it the weights cache and the
disk tier of the prefix cache). A leaf: every layer may ask it."""
from __future__ import annotations

import os
from pathlib import Path

STORE_ENV = "EDGEPAGED_STORE"


def store_dir() -> Path:
    """The store: $EDGEPAGED_STORE; under systemd, the unit's StateDirectory (its first
    entry) + /models; else $XDG_DATA_HOME (default ~/.local/share) /edgepaged/models."""
    if os.environ.get(STORE_ENV):
        return Path(os.environ[STORE_ENV])
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0]) / "models"
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "edgepaged" / "models"
