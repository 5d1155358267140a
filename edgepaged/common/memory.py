"""The process's memory: giving the C heap's free pages back to the system, faulting pages in
ahead of their first use."""
from __future__ import annotations

import functools
import mmap

MADV_POPULATE_WRITE = 23     # Linux 5.14+
MADV_NOHUGEPAGE = 15


@functools.cache
def _libc_function(name: str):
    """A function of the C library (ctypes, errno kept), or None where there is none."""
    import ctypes
    import ctypes.util
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True), name)
    except (OSError, AttributeError):
        return None


def release_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim; a no-op
    elsewhere). Model steps free megabytes of activations, and loading frees each weight's
    file-layout copy once it is re-laid out; glibc otherwise keeps those pages."""
    trim = _libc_function("malloc_trim")
    if trim is not None:
        trim(0)


def small_pages(address: int, length: int) -> bool:
    """Keep [address, address + length) in small pages (madvise MADV_NOHUGEPAGE): numpy asks
    for huge pages on its large arrays, and a huge page is resident whole once any byte of it
    is touched. False where the system cannot."""
    import ctypes
    madvise = _libc_function("madvise")
    if madvise is None:
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = address - address % mmap.PAGESIZE
    return madvise(start, address + length - start, MADV_NOHUGEPAGE) == 0


def populate(address: int, length: int) -> bool:
    """Fault in [address, address + length) writable without touching its contents
    (madvise MADV_POPULATE_WRITE): safe beside threads that write there. False where the
    system cannot (another OS, an older kernel)."""
    import ctypes
    madvise = _libc_function("madvise")
    if madvise is None:
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = address - address % mmap.PAGESIZE      # the page holding the first byte
    return madvise(start, address + length - start, MADV_POPULATE_WRITE) == 0
