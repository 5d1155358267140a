"""The process's memory: giving the C heap's free pages back to the system."""
from __future__ import annotations

_malloc_trim = None


def release_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; a no-op
    elsewhere). Model steps free megabytes of activations, and loading frees each weight's
    file-layout copy once it is re-laid out; glibc otherwise keeps those pages."""
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes
        import ctypes.util
        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)
