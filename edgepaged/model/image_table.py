"""The images a runner's prompts hold, as token ids past the vocabulary.

An image's feature rows (`VisionEncoder.encode`) enter the prompt as ids of their own: row k
of an image is `base + k`, `base` (>= the vocabulary size, a multiple of STRIDE above it)
drawn from the image's content hash and never given to another image while the process
runs. Everything that keys on token ids then keys on the image's content: the prefix cache
finds a conversation's image again when the client sends it again (a second turn about the
same photo computes no image token), and two different images never share a block. The
runner's embedding takes these ids from here (`rows`), the vocabulary's from its table.

The features of images in use stay (`hold` / `release`, per request); those of recent
images stay too, within `keep_bytes`, so a prompt that differs before the image (a new
system prompt, an edited earlier turn) runs no encoder either (`get`).
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import numpy as np

STRIDE = 1 << 12          # the most feature rows one image may have
ID_LIMIT = 1 << 32        # token ids are 32-bit in the block allocator


def digest(data: bytes) -> bytes:
    """An image's content hash (of its file's bytes: the same photo sent again is the same)."""
    return hashlib.blake2b(data, digest_size=16).digest()


class ImageTable:
    def __init__(self, vocab_size: int, keep_bytes: int = 256 << 20, both_ways: bool = False, mrope: bool = False):
        self.first = -(-vocab_size // STRIDE) * STRIDE
        self.both_ways = both_ways        # an image's tokens attend to each other both ways (Gemma 3)
        self.mrope = mrope                # its tokens rotate by (row, column) positions (Qwen2.5-VL: `mrope_positions`)
        self.slots = (ID_LIMIT - self.first) // STRIDE
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._base: dict[bytes, int] = {}              # digest -> base, for the process's life
        self._taken: set[int] = set()
        self._feats: OrderedDict[int, np.ndarray] = OrderedDict()   # base -> features (recent last)
        self._holds: dict[int, int] = {}
        self._meta: dict[int, object] = {}            # base -> its layout (VisionEncoder.pixels)
        self._bytes = 0
        self.encoded = 0          # images encoded (`put`), for stats and tests
        self.reused = 0           # images found here instead (`get` hits)

    def is_image(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(ids) >= self.first

    def base_of(self, key: bytes) -> int:
        """The image's base id (drawn from its hash; the next free slot if another image has it)."""
        with self._lock:
            base = self._base.get(key)
            if base is None:
                slot = int.from_bytes(key[:8], "little") % self.slots
                while (base := self.first + slot * STRIDE) in self._taken:
                    slot = (slot + 1) % self.slots
                self._base[key] = base
                self._taken.add(base)
            return base

    def get(self, key: bytes, hold: bool = False) -> tuple[int, np.ndarray, object] | None:
        """(base, features, layout) of an image encoded before and still kept, else None;
        `hold`: held at once (`hold`), so nothing evicts it before its request holds it."""
        with self._lock:
            base = self._base.get(key)
            f = self._feats.get(base) if base is not None else None
            if f is None:
                return None
            self._feats.move_to_end(base)
            self.reused += 1
            if hold:
                self._holds[base] = self._holds.get(base, 0) + 1
            return base, f, self._meta.get(base)

    def put(self, key: bytes, features: np.ndarray, layout=None, hold: bool = False) -> int:
        if len(features) > STRIDE:
            raise ValueError(f"an image of {len(features)} feature rows (at most {STRIDE})")
        base = self.base_of(key)
        with self._lock:
            if base not in self._feats:
                self._bytes += features.nbytes
                self.encoded += 1
            self._feats[base] = features
            self._meta[base] = layout
            self._feats.move_to_end(base)
            if hold:
                self._holds[base] = self._holds.get(base, 0) + 1
            self._trim()
        return base

    def hold(self, bases) -> None:
        with self._lock:
            for b in bases:
                self._holds[b] = self._holds.get(b, 0) + 1

    def release(self, bases) -> None:
        with self._lock:
            for b in bases:
                n = self._holds.get(b, 0) - 1
                if n > 0:
                    self._holds[b] = n
                else:
                    self._holds.pop(b, None)
            self._trim()

    def _trim(self) -> None:
        for base in list(self._feats):
            if self._bytes <= self.keep_bytes:
                break
            if base not in self._holds:
                self._bytes -= self._feats.pop(base).nbytes
                self._meta.pop(base, None)

    def layout(self, base: int):
        """The layout an image was encoded with (held images keep theirs)."""
        with self._lock:
            return self._meta.get(base)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The feature rows of image ids (in the step's worker thread)."""
        ids = np.asarray(ids, np.int64)
        bases = self.first + (ids - self.first) // STRIDE * STRIDE
        with self._lock:
            out = None
            for b in np.unique(bases):
                f = self._feats.get(int(b))
                if f is None:
                    raise RuntimeError("an image of this prompt is no longer kept (its request ended?)")
                sel = bases == b
                k = ids[sel] - b
                if int(k.max()) >= len(f):
                    raise RuntimeError("an image token past its image's rows")
                if out is None:
                    out = np.empty((len(ids), f.shape[1]), np.float32)
                out[sel] = f[k]
        return out

    def stats(self) -> dict:
        with self._lock:
            return {"images_kept": len(self._feats), "images_held": len(self._holds), "bytes_kept": self._bytes,
                    "images_encoded": self.encoded, "images_reused": self.reused}


def image_see(table: ImageTable, ids: np.ndarray, positions: np.ndarray, starts: np.ndarray) -> np.ndarray | None:
    """For a prefill call whose rows hold an image's tokens that attend both ways: how many
    positions each row sees (`ops.paged_prefill`'s `see`): an image token the whole run of its
    image's tokens in the call (up to its last), any other row its causal count; None when
    no row is an image's. `starts`: the sequences' first rows (query_start_loc)."""
    ids = np.asarray(ids, np.int64)
    pic = ids >= table.first
    if not pic.any():
        return None
    positions = np.asarray(positions, np.int64)
    see = (positions + 1).astype(np.int32)
    base = np.where(pic, (ids - table.first) // STRIDE, -1)
    seq_start = np.zeros(len(ids), bool)
    seq_start[np.asarray(starts[:-1], np.int64)[np.asarray(starts[:-1]) < len(ids)]] = True
    # a run: image rows of one image, one sequence, consecutive positions
    cont = np.zeros(len(ids), bool)
    cont[1:] = pic[1:] & pic[:-1] & (base[1:] == base[:-1]) & (positions[1:] == positions[:-1] + 1) & ~seq_start[1:]
    r = 0
    n = len(ids)
    while r < n:
        if not pic[r]:
            r += 1
            continue
        e = r + 1
        while e < n and cont[e]:
            e += 1
        see[r:e] = positions[e - 1] + 1
        r = e
    return see


def mrope_positions(table: ImageTable, ids) -> tuple[np.ndarray, int] | None:
    """Qwen2-VL's multimodal rotary positions (M-RoPE) of a prompt: int64 [P, 3], each
    token's (t, h, w), and the offset of every token after the prompt (its position is its
    index plus the offset; None: no image in the prompt). A text token's three are one
    position, counting on from the last; an image of gh x gw rows (its layout, row by row)
    starting at position p gives its row k (p, p + k // gw, p + k % gw), and the text after it
    goes on from p + max(gh, gw) (transformers' `get_rope_index`, llama.cpp's mtmd)."""
    ids = np.asarray(ids, np.int64)
    pic = ids >= table.first
    if not pic.any():
        return None
    n = len(ids)
    out = np.empty((n, 3), np.int64)
    # runs: text, or one image's rows (consecutive ids; the same image twice starts a new run)
    brk = np.ones(n, bool)
    brk[1:] = (pic[1:] != pic[:-1]) | (pic[1:] & (ids[1:] != ids[:-1] + 1))
    starts = np.flatnonzero(brk)
    cur = 0
    for i, e in zip(starts.tolist(), starts[1:].tolist() + [n]):
        if not pic[i]:
            out[i:e] = (cur + np.arange(e - i))[:, None]
            cur += e - i
            continue
        base = table.first + (int(ids[i]) - table.first) // STRIDE * STRIDE
        layout = table.layout(base)
        if not layout:
            raise RuntimeError("an image of this prompt is no longer kept (its request ended?)")
        gh, gw = int(layout[0]), int(layout[1])
        k = ids[i:e] - base
        out[i:e, 0] = cur
        out[i:e, 1] = cur + k // gw
        out[i:e, 2] = cur + k % gw
        cur += max(gh, gw)
    return out, cur - n


def mrope_rows(rope: tuple[np.ndarray, int], index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For tokens at `index` (int64 [n], their places in the sequence) of a sequence whose
    prompt has `rope` (`mrope_positions`): (their rotary positions [n]: an image row's t, a
    text token's one position), which of them are image rows that turn by their own h and w
    (bool [n]), and those rows' (h, w) [k, 2]."""
    pos3, delta = rope
    index = np.asarray(index, np.int64)
    inside = index < len(pos3)
    p = index + delta
    p[inside] = pos3[index[inside], 0]
    own = np.zeros(len(index), bool)
    hw = np.zeros((0, 2), np.int64)
    if inside.any():
        got = pos3[index[inside]]
        pic = (got[:, 1] != got[:, 0]) | (got[:, 2] != got[:, 0])
        own[np.flatnonzero(inside)[pic]] = True
        hw = got[pic, 1:]
    return p, own, hw
