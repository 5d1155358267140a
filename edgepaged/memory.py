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


MADV_POPULATE_WRITE = 23     # Linux 5.14+


def populate(address: int, length: int) -> bool:
    """Fault in [address, address + length) writable without touching its contents
    (madvise MADV_POPULATE_WRITE): safe beside threads that write there. False where the
    system cannot (another OS, an older kernel)."""
    import ctypes
    import ctypes.util
    try:
        madvise = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = address & ~4095          # the page holding the first byte
    return madvise(start, address + length - start, MADV_POPULATE_WRITE) == 0
