"""A model's quantized weights as the kernels lay them out, kept on disk between loads.

Loading a GGUF file for the integer kernels re-lays every block weight (`QuantWeight.repack`)
into new memory: for an 8 B model 4.7 GB written, and on a VM most of the load is the kernel
handing out and zeroing those pages (`perf`: `clear_page_erms` 45 % of the load's samples).
The first load of a large model writes what it laid out to one file here, in a thread after
the model is ready; every later load maps that file read-only (`np.memmap`: no private copy,
no commit charge) instead of reading and re-laying the GGUF. A warm page cache makes it ready
in about a second; the pages are the page cache's (shared, clean, dropped and read back under
memory pressure, as llama.cpp's mmap'd weights are).

An entry is keyed by the source file's identity (path, size, mtime, ctime, inode), the math
and layout options, and the code's build (a hash of the native extension and of the modules
that lay the weights out: a change to either re-lays), so it is only served to the very file
and code that made it; its header repeats the key and the file's size, and a file that does
not match is a miss (then rewritten).
Entries are written to a temporary name and renamed, so a torn write never has the final
name. Bounded: at most `MAX_ENTRIES` models, never past `KEEP_FREE` of the disk; entries that
can no longer hit (their source file changed or is gone, another build wrote them) are
dropped first, then the least recently used.

`EDGEPAGED_WEIGHTS_CACHE`: "0" / "off" turns it off, a directory puts it there (default: the
model store's `weights/`). Model files under `CpuConfig.weights_cache_min_bytes` (512 MiB)
load fast anyway and are not cached.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path

import numpy as np

from .quant.formats import QuantWeight

log = logging.getLogger("edgepaged.model")

MAGIC = b"EPWCACHE"
VERSION = 1
ALIGN = 4096
MAX_ENTRIES = 3
KEEP_FREE = 0.10            # of the disk, and at least KEEP_FREE_BYTES
KEEP_FREE_BYTES = 2 << 30
SUFFIX = ".epw"

_build_id: str | None = None


def cache_dir(env=None) -> Path | None:
    """Where entries live, or None when turned off."""
    env = os.environ if env is None else env
    v = (env.get("EDGEPAGED_WEIGHTS_CACHE") or "").strip()
    if v.lower() in ("0", "off", "no", "false"):
        return None
    if v:
        return Path(v).expanduser()
    from ..common.dirs import store_dir
    return store_dir() / "weights"


def build_id() -> str:
    """A hash of the code that decides what an entry holds: the native extension's bytes
    (the layouts its kernels read) and the Python modules that place, merge and lay out the
    weights (which slot holds which rows)."""
    global _build_id
    if _build_id is None:
        from .. import _native
        from .cpu import runner as cpu_runtime
        from . import loader, placement
        from .quant import formats
        h = hashlib.blake2b(digest_size=16)
        for path in (_native.__file__, cpu_runtime.__file__, loader.__file__, placement.__file__, formats.__file__,
                     __file__):
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        _build_id = h.hexdigest()
    return _build_id


def source_identity(path: Path) -> dict:
    st = os.stat(path)
    return {"source": str(Path(path).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "inode": st.st_ino, "device": st.st_dev}


def entry_key(path: Path, options: dict) -> str:
    """The key of `path`'s laid-out weights under `options` (math, layout choices)."""
    ident = dict(source_identity(path), options=options, build=build_id(), version=VERSION)
    return hashlib.blake2b(json.dumps(ident, sort_keys=True).encode(), digest_size=20).hexdigest()


class Entry:
    """One model's laid-out weights: `weights(slot)` gives the slot's segments over the file's
    pages (read-only views: nothing is read until a kernel touches it)."""

    def __init__(self, path: Path, header: dict, mm: np.memmap):
        self.path, self.header, self._mm = path, header, mm
        self._arrays: dict[int, np.ndarray] = {}

    def _array(self, i: int) -> np.ndarray:
        a = self._arrays.get(i)
        if a is None:
            d = self.header["arrays"][i]
            # a plain array (QuantWeight keeps it as it is: weights sharing it stay one array)
            a = np.asarray(self._mm[d["offset"]: d["offset"] + d["nbytes"]]).reshape(d["shape"])
            self._arrays[i] = a
        return a

    def has(self, slot: str) -> bool:
        return slot in self.header["slots"]

    def weights(self, slot: str) -> list[QuantWeight]:
        return [QuantWeight(s["qtype"], self._array(s["array"]), s["rows"], s["cols"], s["layout"])
                for s in self.header["slots"][slot]]


def _read_header(path: Path) -> dict | None:
    with open(path, "rb") as f:
        head = f.read(16)
        if len(head) != 16 or head[:8] != MAGIC:
            return None
        n = int.from_bytes(head[8:], "little")
        if not 0 < n < 64 << 20:
            return None
        raw = f.read(n)
    if len(raw) != n:
        return None
    header = json.loads(raw)
    return header if isinstance(header, dict) else None


def open_entry(directory: Path, key: str) -> Entry | None:
    """The entry for `key`, or None: absent, or not exactly what this key wrote (a header
    that does not parse or names another key, a file of another size). A miss never raises."""
    path = directory / (key + SUFFIX)
    try:
        header = _read_header(path)
        if header is None or header.get("key") != key or header.get("version") != VERSION \
                or path.stat().st_size != header.get("total"):
            if header is not None or path.exists():
                log.info("weights cache: %s does not match its key; ignored (rewritten after this load)", path.name)
            return None
        mm = np.memmap(path, np.uint8, "r")
        os.utime(path)      # most recently used
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.info("weights cache: %s unreadable (%s); ignored", path.name, e)
        return None
    return Entry(path, header, mm)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def drop_stale(directory: Path | None = None) -> list[tuple[float, Path]]:
    """Remove temporaries of dead writers and entries that can never hit again: their source
    file changed or is gone (a removed model's space comes back at once), or another build of
    the code wrote them (an upgrade's old layouts). Returns the live entries as (mtime, path)."""
    directory = cache_dir() if directory is None else directory
    entries: list[tuple[float, Path]] = []
    if directory is None or not directory.is_dir():
        return entries
    for p in directory.iterdir():
        if p.name.endswith(".tmp"):
            try:
                pid = int(p.name.split(".")[-2])
            except (ValueError, IndexError):
                pid = -1
            if pid <= 0 or not _pid_alive(pid):
                p.unlink(missing_ok=True)
            continue
        if not p.name.endswith(SUFFIX):
            continue
        try:
            h = _read_header(p)
            src = h and h.get("identity")
            stale = not src or h.get("build") != build_id() or source_identity(Path(src["source"])) != src
        except (OSError, ValueError, KeyError, TypeError):
            stale = True
        if stale:
            p.unlink(missing_ok=True)
        else:
            entries.append((p.stat().st_mtime, p))
    return sorted(entries)


def _sweep(directory: Path, need: int) -> bool:
    """Make room for an entry of `need` bytes: `drop_stale`, then the least recently used
    past MAX_ENTRIES - 1. True when the disk then keeps its free share."""
    entries = drop_stale(directory)
    while len(entries) >= MAX_ENTRIES:
        entries.pop(0)[1].unlink(missing_ok=True)
    st = os.statvfs(directory)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return free - need >= max(KEEP_FREE * total, KEEP_FREE_BYTES)


def write_entry(directory: Path, key: str, identity: dict, slots: dict[str, list[QuantWeight]]) -> Path | None:
    """Write `slots` (name -> the weight's segments) as the entry for `key`; arrays several
    segments share (a tied embedding and LM head) are written once. Returns the path, or
    None (with one log line) when the disk has no room or a write fails."""
    arrays: list[np.ndarray] = []
    index: dict[int, int] = {}
    table: dict[str, list[dict]] = {}
    for slot, segs in slots.items():
        rows = []
        for s in segs:
            i = index.get(id(s.data))
            if i is None:
                i = index[id(s.data)] = len(arrays)
                arrays.append(np.ascontiguousarray(s.data))
            rows.append({"qtype": s.qtype, "rows": s.rows, "cols": s.cols, "layout": s.layout, "array": i})
        table[slot] = rows
    # the header's size depends on the offsets, which depend on it: fix its room first
    descr = [{"shape": list(a.shape), "nbytes": int(a.nbytes), "offset": 0} for a in arrays]
    header = {"key": key, "version": VERSION, "build": build_id(), "identity": identity, "arrays": descr,
              "slots": table, "total": 0}
    room = -(-(16 + len(json.dumps(header)) + 64 * len(arrays) + 64) // ALIGN) * ALIGN
    at = room
    for d in descr:
        d["offset"] = at
        at += -(-d["nbytes"] // ALIGN) * ALIGN
    header["total"] = at
    raw = json.dumps(header).encode()
    assert 16 + len(raw) <= room
    try:
        directory.mkdir(parents=True, exist_ok=True)
        room_left = _sweep(directory, at)
    except OSError as e:             # a read-only or missing store: no cache, the model runs
        log.warning("weights cache: %s is not usable (%s); not cached", directory, e)
        return None
    if not room_left:
        log.warning("weights cache: no room for %.1f GiB in %s (it keeps %d %% of the disk free); not cached",
                    at / 2**30, directory, KEEP_FREE * 100)
        return None
    final = directory / (key + SUFFIX)
    tmp = directory / f"{key}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + len(raw).to_bytes(8, "little") + raw)
            for a, d in zip(arrays, descr):
                f.seek(d["offset"])
                f.write(memoryview(a.reshape(-1)))
            f.truncate(at)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.warning("weights cache: writing %s failed (%s); not cached", final, e)
        return None
    return final


def lowest_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19; Linux sets it per thread): a
    cache's writer then runs while the box is otherwise idle, never beside an answer's steps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass


def _write_niced(*args) -> None:
    lowest_priority()
    write_entry(*args)


_writing: dict[str, threading.Thread] = {}     # key -> its writer, in this process


def write_in_background(directory: Path, key: str, identity: dict, slots: dict) -> threading.Thread:
    """`write_entry` in a thread of the lowest priority (not a daemon: a process that loaded
    and exits at once, a benchmark's probe, still leaves the entry whole). A key this
    process is writing already (the same file loaded twice at once) gets that writer."""
    t = _writing.get(key)
    if t is not None and t.is_alive():
        return t
    t = threading.Thread(target=_write_niced, args=(directory, key, identity, slots), name="weights-cache",
                         daemon=False)
    _writing[key] = t
    t.start()
    return t


PREPARE = r"""
import sys
from edgepaged.model.cpu.runner import CpuRunner
r = CpuRunner(sys.argv[1], num_blocks=4, progress=lambda *a, **k: None)
print(r.weights_cache)          # the process ends once the writer (not a daemon) is done
"""


def prepare(path) -> str:
    """Load the GGUF file `path` in a subprocess (this environment's settings) so the cache
    holds its layout once it returns: "hit" (it did already), "writing" (written now) or
    "off" (also when the CPU runtime cannot load it: a safetensors folder, a broken file,
    whose user reports that itself). The benchmarks call it before they time a server or
    runner on a large file."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", PREPARE, str(path)], capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    return lines[-1] if out.returncode == 0 and lines else "off"
