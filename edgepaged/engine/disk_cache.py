"""The prefix cache's second tier: full KV blocks of computed prompts kept on disk, found
again after they leave the RAM cache and after a restart. On a CPU box a prompt is
expensive (Home Assistant's 2,000-token prompt is ~10 s of prefill on a 1 B model) and the
same bytes of K/V read back from a disk cost a fraction of a second.

    tier = DiskTier(directory, identity, block_bytes, limit_bytes)
    found = tier.fetch(tokens, salt)    # worker thread, at a request's arrival: the payloads of
                                        # its prompt's leading full blocks on disk, checked
    want = tier.wanted(tokens, salt)    # worker thread, after the step that completed a prompt:
    tier.put([(key, data), ...])        # its full blocks not on disk yet, copied out of the
                                        # cache, written by the tier's writer thread

A block is keyed by the chain of its prompt's tokens up to it (each block's key hashes the
one before and its own tokens), the request's salt (a block is never served to another
identity) and the model's identity (file, size, KV dtype, block size, multiplication: never
served to another model or another arithmetic). A file holds a header (magic, key, payload
size, BLAKE2b of the payload) and the payload; a torn, truncated or corrupt file is a miss
(and is removed), never wrong K/V. Files are written to a temporary name and renamed. The tier
holds at most `limit_bytes`: the least recently used files go first. A write that fails
(a full disk, a read-only folder) turns the tier's writes off with one log line; reads go on.

The writer waits for the engine to be quiet (`quiet`: set while no step runs) before it
writes, at most until `BUSY_WAIT_S` after the blocks were handed over: a long prompt's
blocks (~70 MB for 2 k tokens of a 1 B model) hashed and written beside the steps that
answer it took a core from them and the interpreter's lock from the step thread (the writer
runs at the lowest priority, so it held that lock while descheduled). What waits is bounded
by `PENDING_BYTES`; past it a prompt's blocks are dropped (a cache). Blocks handed over and
not written yet are not wanted again (a warm command does not copy the whole shared prefix
again while it waits).

The engine's side of the tier is here too, `DiskPrefix` (the end of this file): a request's
prompt looked up before it queues (`load`), a completed prompt's blocks pinned after its step
(`pin`) and copied out of the pool when the engine rests (`flush`, `due`). The scheduler's
part, loading the blocks found into the step that admits the request, reads the request's
`DiskState` (`Request.disk_tier`), kept by this module.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..common import brief
from ..model.weights_cache import lowest_priority


@dataclass
class DiskState:
    """A request's part of the disk tier, kept by this module and the scheduler on
    `Request.disk_tier`."""
    found: tuple[int, list[bytes]] | None = None   # its prompt's blocks found on disk: (first block index, payloads)
    loads: list[bytes] | None = None               # this step: the payloads its first planned tokens load from
    saved: bool = False                            # its prompt's blocks were offered to the disk tier

log = logging.getLogger("edgepaged.engine")

MAGIC = b"EPKV0001"
HEADER = len(MAGIC) + 32 + 8 + 32     # magic, key, payload bytes, BLAKE2b-256 of the payload
DEFAULT_SHARE = 0.05                  # of the free space, when --prefix-cache-disk is not given
BUSY_WAIT_S = 10.0                    # the writer writes after this long even if the engine is busy
PENDING_BYTES = 512 << 20             # copied blocks waiting for the writer, at most
DEFAULT_MOST = 8 << 30


def default_limit(directory: Path) -> int:
    """A modest share of the free space where the tier lives: 5 %, at most 8 GiB."""
    d = Path(directory)
    while not d.exists() and d != d.parent:
        d = d.parent
    try:
        st = os.statvfs(d)
    except OSError:
        return 0
    return int(min(DEFAULT_MOST, DEFAULT_SHARE * st.f_bavail * st.f_frsize))


def chain_keys(tokens, salt: int, identity: bytes, block_size: int, most: int) -> list[bytes]:
    """The keys of the first `most` full blocks of `tokens`."""
    keys, prev = [], hashlib.blake2b(identity + int(salt).to_bytes(8, "little", signed=False),
                                     digest_size=32).digest()
    arr = np.asarray(tokens, dtype=np.uint32)
    for i in range(min(most, len(arr) // block_size)):
        prev = hashlib.blake2b(prev + arr[i * block_size:(i + 1) * block_size].tobytes(), digest_size=32).digest()
        keys.append(prev)
    return keys


class DiskTier:
    def __init__(self, directory, identity: str, block_bytes: int, block_size: int, limit_bytes: int):
        self.identity = hashlib.blake2b(identity.encode(), digest_size=16).digest()
        self.dir = Path(directory) / self.identity.hex()
        self.block_bytes, self.block_size, self.limit = block_bytes, block_size, limit_bytes
        self.writable = True
        self.index: dict[bytes, float] = {}      # key -> last use (monotonic order kept by dict order)
        self.lock = threading.Lock()
        self.stats = {"hits": 0, "misses": 0, "written": 0, "corrupt": 0, "evicted": 0, "blocks": 0}
        self._queue: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._pending = 0               # bytes handed to the writer and not written yet
        self._queued: set[bytes] = set()   # their keys (not wanted again meanwhile)
        # set while the engine runs no step (the engine clears it around its steps); the
        # writer writes when it is set, or after BUSY_WAIT_S of waiting
        self.quiet = threading.Event()
        self.quiet.set()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            files = sorted(self.dir.glob("*/*.kv"), key=lambda p: p.stat().st_mtime)
        except OSError as e:
            log.warning("the prefix cache's disk tier is off: %s", e)
            self.writable, files = False, []
        # what is counted is what fits the limit: the folder may hold more (another server on the
        # same folder wrote its own share; a smaller limit than last time): the oldest go
        most = self.limit // (self.block_bytes + HEADER)
        if len(files) > most:
            for f in files[:len(files) - most]:
                try:
                    f.unlink()
                    self.stats["evicted"] += 1
                except OSError:
                    pass
            files = files[len(files) - most:]
        for f in files:
            try:
                self.index[bytes.fromhex(f.stem)] = f.stat().st_mtime
            except (ValueError, OSError):
                continue
        self.stats["blocks"] = len(self.index)

    @property
    def size_bytes(self) -> int:
        return len(self.index) * (self.block_bytes + HEADER)

    def _path(self, key: bytes) -> Path:
        h = key.hex()
        return self.dir / h[:2] / f"{h}.kv"

    # -- reads (a worker thread) --------------------------------------------------------------
    def fetch(self, tokens, salt: int, skip_blocks: int = 0) -> tuple[int, list[np.ndarray]]:
        """The payloads of the prompt's leading full blocks the tier holds, from block
        `skip_blocks` on (those before are in RAM already): (first block index, payloads); a
        prompt keeps its last token to compute (its logits)."""
        most = (len(tokens) - 1) // self.block_size
        keys = chain_keys(tokens, salt, self.identity, self.block_size, most)
        out: list[np.ndarray] = []
        for key in keys[skip_blocks:]:
            with self.lock:
                known = key in self.index
            if not known:
                break
            data = self._read(key)
            if data is None:
                break
            out.append(data)
            with self.lock:
                self.index.pop(key, None)
                self.index[key] = time.time()    # most recently used last
        self.stats["hits" if out else "misses"] += 1
        return skip_blocks, out

    def _read(self, key: bytes) -> np.ndarray | None:
        p = self._path(key)
        try:
            raw = p.read_bytes()
        except OSError:
            self._forget(key)
            return None
        ok = (len(raw) == HEADER + self.block_bytes and raw[:8] == MAGIC and raw[8:40] == key
              and int.from_bytes(raw[40:48], "little") == self.block_bytes
              and hashlib.blake2b(raw[HEADER:], digest_size=32).digest() == raw[48:80])
        if not ok:                     # torn, truncated or corrupt: a miss, and gone
            self.stats["corrupt"] += 1
            self._forget(key)
            try:
                p.unlink()
            except OSError:
                pass
            return None
        return np.frombuffer(raw, dtype=np.uint8, offset=HEADER)

    def _forget(self, key: bytes) -> None:
        with self.lock:
            self.index.pop(key, None)

    # -- writes ---------------------------------------------------------------------------------
    def wanted(self, tokens, salt: int) -> list[tuple[int, bytes]]:
        """(block index, key) of the prompt's full blocks the tier does not hold."""
        if not self.writable or self.limit < self.block_bytes + HEADER:
            return []
        keys = chain_keys(tokens, salt, self.identity, self.block_size, len(tokens) // self.block_size)
        with self.lock:
            return [(i, k) for i, k in enumerate(keys) if k not in self.index and k not in self._queued]

    def put(self, items: list[tuple[bytes, np.ndarray]]) -> None:
        """Hand copied blocks to the writer thread (dropped when it is behind: a cache)."""
        if not items or not self.writable:
            return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="edgepaged-kv-disk", daemon=True)
            self._writer.start()
        size = sum(d.nbytes for _, d in items)
        with self.lock:
            if self._pending + size > PENDING_BYTES:
                return
            self._pending += size
            self._queued.update(k for k, _ in items)
        self._queue.put_nowait((items, size, time.monotonic() + BUSY_WAIT_S))

    def _write_loop(self) -> None:
        # hashing and writing a long prompt's blocks (~0.15 s of CPU for 2 k tokens of a 1 B
        # model) must not slow the steps that answer it
        lowest_priority()
        while True:
            job = self._queue.get()
            if job is None:
                return
            items, size, due = job
            try:
                for key, data in items:
                    if self.writable:
                        # while steps run, wait; past `due` (BUSY_WAIT_S after the put) a
                        # box that never rests gets its cache written all the same
                        self.quiet.wait(max(0.0, due - time.monotonic()))
                        self._write(key, data)
                    with self.lock:
                        self._queued.discard(key)
            finally:
                with self.lock:
                    self._pending -= size
                self._queue.task_done()

    def flush(self, timeout: float = 30.0) -> None:
        """Wait for the writer to finish what it was given (tests, shutdown)."""
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.01)

    def _write(self, key: bytes, data: np.ndarray) -> None:
        with self.lock:
            if key in self.index:
                return
        payload = np.ascontiguousarray(data).view(np.uint8).tobytes()
        if len(payload) != self.block_bytes:
            return
        head = MAGIC + key + len(payload).to_bytes(8, "little") + hashlib.blake2b(payload, digest_size=32).digest()
        p = self._path(key)
        tmp = p.with_suffix(f".tmp{threading.get_ident()}")
        try:
            self._make_room()
            p.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(payload)
            os.replace(tmp, p)
        except OSError as e:          # a full disk, a read-only folder: no more writes, one line
            self.writable = False
            log.warning("the prefix cache's disk tier stops writing (%s): prompts are cached in RAM only", e)
            try:
                tmp.unlink()
            except OSError:
                pass
            return
        with self.lock:
            self.index[key] = time.time()
            self.stats["written"] += 1
            self.stats["blocks"] = len(self.index)

    def _make_room(self) -> None:
        """Least recently used files go until one more block fits the limit."""
        while True:
            with self.lock:
                if not self.index or self.size_bytes + self.block_bytes + HEADER <= self.limit:
                    return
                key = next(iter(self.index))
                self.index.pop(key)
                self.stats["evicted"] += 1
            try:
                self._path(key).unlink()
            except OSError:
                pass

    def close(self) -> None:
        if self._writer is not None:
            self.quiet.set()            # shutting down: what waits is written now
            self.flush()
            self._queue.put(None)

    def info(self) -> dict:
        return {**self.stats, "blocks": len(self.index), "bytes": self.size_bytes, "limit_bytes": self.limit,
                "writing": self.writable}


# ---------------------------------------------------------------- the engine's side

# A completed prompt's blocks the disk tier lacks stay pinned (a sequence of their own shares
# them) until the engine has no step to run, and are copied out of the pool then, a piece at a
# time (a request that arrives waits one piece at most): copying ~70 MB of a 2 k-token prompt
# inside the step that completed it held that prompt's first token back 0.05-0.17 s. A box
# that never rests copies them whole between two steps this long after the pin.
DISK_COPY_WAIT_S = 1.0
DISK_COPY_PIECE = 32            # blocks a piece
_pin_ids = itertools.count(1 << 62)   # the pins' sequence ids (requests count from 1)


@dataclass
class _Pin:
    seq: int                           # the allocator sequence holding the blocks
    items: list[tuple[bytes, int]]     # (disk key, block) still to copy
    since: float


def identity(runner) -> str:
    """A model's identity for the tier: the file (name, size, time), the KV cache's type and
    block size and how the weights multiply, so a block never serves another model or another
    arithmetic."""
    path = runner.model_path
    try:
        st = path.stat()
        ident = f"{path.name}|{st.st_size}|{st.st_mtime_ns}"
    except OSError:
        ident = str(path)
    return ident + f"|{runner.kv_dtype_name}|{runner.block_size}|{runner.quant_math}|{type(runner).__name__}"


class DiskPrefix:
    """The disk tier as the engine uses it, all of it here: a request's prompt blocks looked
    up on disk before it queues (`load`; the scheduler reads `DiskState.found` at admission and
    plans the loads), a completed prompt's blocks pinned after its step (`pin`) and copied out
    of the pool when the engine rests or the pin has waited (`flush`, `due`)."""

    def __init__(self, tier: DiskTier, runner, allocator, threads):
        self.tier, self.runner, self.allocator, self.threads = tier, runner, allocator, threads
        self.block_size = runner.block_size
        self.pins: list[_Pin] = []        # completed prompts' blocks waiting to be copied to the tier
        self._pinned: set[bytes] = set()  # their keys (not pinned twice)

    @classmethod
    def open(cls, runner, allocator, threads, limit_bytes: int, directory: Path | None = None) -> "DiskPrefix":
        if directory is None:
            from ..common.dirs import store_dir
            directory = store_dir() / "kvcache"
        return cls(DiskTier(directory, identity(runner), runner.block_bytes, runner.block_size, limit_bytes),
                   runner, allocator, threads)

    @property
    def quiet(self) -> threading.Event:
        return self.tier.quiet

    def info(self) -> dict:
        return self.tier.info()

    async def load(self, req) -> None:
        """The prompt's blocks the RAM cache lacks and the tier holds, read and checked in a
        worker thread before the request queues (the scheduler loads them at admission)."""
        import trio
        bs = self.block_size
        if req.embed or req.context_window is not None or len(req.prompt_ids) <= bs or req.images.held is not None:
            return         # (an image's ids are this process's: never on disk)
        ram = self.allocator.prefix_match(req.prompt_ids, req.salt)[0]
        if ram >= (len(req.prompt_ids) - 1) // bs * bs:
            return
        try:
            start, blocks = await trio.to_thread.run_sync(self.tier.fetch, req.prompt_ids, req.salt, ram // bs,
                                                         limiter=self.threads)
        except Exception as e:     # noqa: BLE001 - a cache: computed instead
            log.warning("the prefix cache's disk tier could not be read: %s", brief.of(e))
            return
        if blocks:
            req.disk_tier.found = (start, blocks)

    def pin(self, requests) -> None:
        """After a step: the prompts it completed pin their full blocks the tier lacks (a
        sequence of their own shares them), to be copied out when the engine rests."""
        bs = self.block_size
        for r in requests:
            if (r.disk_tier.saved or r.embed or r.images.held is not None or r.context_window is not None
                    or r.num_slots < len(r.prompt_ids)
                    or len(r.prompt_ids) < bs or r.finished or not self.allocator.has_sequence(r.id)):
                continue
            r.disk_tier.saved = True
            try:
                want = [(j, key) for j, key in self.tier.wanted(r.prompt_ids, r.salt) if key not in self._pinned]
                if not want:
                    continue
                pin = next(_pin_ids)
                self.allocator.fork(r.id, pin)
                try:
                    self.allocator.truncate(pin, (want[-1][0] + 1) * bs)
                    table = self.allocator.block_table(pin)
                except Exception:
                    self.allocator.free_sequence(pin, cache=False)
                    raise
                items = [(key, int(table[j])) for j, key in want if j < len(table)]
                self.pins.append(_Pin(pin, items, time.monotonic()))
                self._pinned.update(key for key, _ in items)
            except Exception as e:   # noqa: BLE001 - a cache: nothing else hurt
                log.warning("the prefix cache's disk tier could not take a prompt: %s", brief.of(e))

    def due(self) -> bool:
        """Whether the pins are copied now, between two steps: the oldest waited
        `DISK_COPY_WAIT_S` (a box that never rests), or the pool runs short of free blocks."""
        return bool(self.pins) and (time.monotonic() - self.pins[0].since > DISK_COPY_WAIT_S
                                    or self.allocator.num_free_blocks < sum(len(p.items) for p in self.pins))

    async def flush(self, whole: bool, has_work=lambda: False) -> None:
        """The pinned blocks copied out of the pool (one gather a piece, in a worker thread)
        and handed to the tier's writer; a pin done is released. Not `whole`: a piece at a
        time, returning when `has_work()` (a request waits)."""
        import trio
        while self.pins:
            pin = self.pins[0]
            n = len(pin.items) if whole else DISK_COPY_PIECE
            piece, pin.items = pin.items[:n], pin.items[n:]
            try:
                data = await trio.to_thread.run_sync(self.runner.read_blocks, [b for _, b in piece],
                                                     limiter=self.threads)
                self.tier.put([(key, d) for (key, _), d in zip(piece, data)])
            except Exception as e:   # noqa: BLE001 - a cache: nothing else hurt
                log.warning("the prefix cache's disk tier could not take a prompt: %s", brief.of(e))
            finally:
                self._pinned.difference_update(key for key, _ in piece)
                if not pin.items:
                    self.pins.pop(0)
                    try:
                        self.allocator.free_sequence(pin.seq, cache=True)
                    except Exception as e:   # noqa: BLE001 - cannot happen; the engine goes on
                        log.error("a disk tier pin could not be released: %s", brief.of(e))
            if not whole and has_work():
                return

    async def close(self) -> None:
        """At the engine's end: every pin copied out, and what the tier was given on disk."""
        import trio
        if self.pins:
            with trio.CancelScope(shield=True):
                await self.flush(whole=True)
        await trio.to_thread.run_sync(self.tier.close, limiter=self.threads)
