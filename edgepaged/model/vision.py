"""An image's pixels as a vision tower takes them (issue 68's first piece: the towers come next).

    tiles, rows, cols = idefics3_pixels(img, longest_edge=2048, tile=512)   # SmolVLM / SmolVLM2
    pixels = gemma3_pixels(img, size=896)                                    # Gemma 3 (SigLIP at 896)

`img` is a PIL RGB image (`request/images.decode`); the result is float32, channels first,
rescaled to 0..1 and normalised by the model's mean and std: the values transformers' own image
processors give (tests/test_vision.py holds them equal), computed the same way (Pillow's
resampling on the 8-bit image, then the arithmetic in float64 rounded to float32).

Idefics3 (SmolVLM): the longest edge resized to `longest_edge` (Lanczos, the other edge even),
then both edges up to multiples of `tile`; an image larger than one tile is cut into
rows x cols tiles, row by row, and followed by the whole image resized to one tile (the
"global" view); a smaller one is one tile as it is. Gemma 3: one bilinear resize to
size x size.
"""
from __future__ import annotations

import math

import numpy as np

MAX_SIDE = 4096      # Idefics3's absolute cap on an edge after the first resize


def _normalise(rgb: np.ndarray, mean, std) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [3, H, W]: x / 255, then (x - mean) / std (float32 steps)."""
    x = (np.moveaxis(rgb, -1, 0).astype(np.float64) * (1 / 255)).astype(np.float32)
    m = np.asarray(mean, np.float32)[:, None, None]
    s = np.asarray(std, np.float32)[:, None, None]
    return ((x - m) / s).astype(np.float32)


def _fit_longest(h: int, w: int, longest: int) -> tuple[int, int]:
    aspect = w / h
    if w >= h:
        w = longest
        h = int(w / aspect)
        h += h % 2
    else:
        h = longest
        w = int(h * aspect)
        w += w % 2
    h, w = max(h, 1), max(w, 1)
    if w >= h and w > MAX_SIDE:
        w, h = MAX_SIDE, int(MAX_SIDE / aspect)
    elif h > w and h > MAX_SIDE:
        h, w = MAX_SIDE, int(MAX_SIDE * aspect)
    return max(h, 1), max(w, 1)


def _tile_multiple(h: int, w: int, tile: int) -> tuple[int, int]:
    aspect = w / h
    if w >= h:
        w = math.ceil(w / tile) * tile
        h = math.ceil(int(w / aspect) / tile) * tile
    else:
        h = math.ceil(h / tile) * tile
        w = math.ceil(int(h * aspect) / tile) * tile
    return h, w


def idefics3_pixels(img, longest_edge: int = 2048, tile: int = 512, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
                    split: bool = True) -> tuple[np.ndarray, int, int]:
    """The tiles [N, 3, tile, tile] (the global view last when split), rows and cols (0, 0: one
    tile, not split)."""
    from PIL import Image
    lanczos = Image.Resampling.LANCZOS
    h, w = _fit_longest(img.height, img.width, longest_edge)
    im = img.resize((w, h), lanczos)
    if not split:
        return _normalise(np.asarray(im.resize((tile, tile), lanczos)), mean, std)[None], 0, 0
    h, w = _tile_multiple(h, w, tile)
    im = im.resize((w, h), lanczos)
    if h <= tile and w <= tile:
        return _normalise(np.asarray(im), mean, std)[None], 0, 0
    rows, cols = (h - tile) // tile + 1, (w - tile) // tile + 1
    arr = np.asarray(im)
    frames = [arr[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile] for r in range(rows) for c in range(cols)]
    frames.append(np.asarray(im.resize((tile, tile), lanczos)))
    return np.stack([_normalise(f, mean, std) for f in frames]), rows, cols


def gemma3_pixels(img, size: int = 896, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)) -> np.ndarray:
    """[1, 3, size, size]: one bilinear resize, rescaled and normalised."""
    from PIL import Image
    return _normalise(np.asarray(img.resize((size, size), Image.Resampling.BILINEAR)), mean, std)[None]
