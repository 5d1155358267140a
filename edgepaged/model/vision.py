"""An image's pixels as a vision tower takes them, the towers, and the files they come from.

    tiles, rows, cols = idefics3_pixels(img, longest_edge=2048, tile=512)   # SmolVLM / SmolVLM2
    pixels = gemma3_pixels(img, size=896)                                    # Gemma 3 (SigLIP at 896)
    patches, gh, gw = qwen2vl_pixels(img)                                    # Qwen2.5-VL (any size)
    enc = VisionEncoder(mmproj)            # a served model's image side: pixels, tower, prompt tokens

The towers here run on the CPU runtime (numpy's BLAS for the products, the Rust kernels for
attention and softmax); the torch runner runs the same towers on its device
(model/torch/vision.py). Weights come under transformers' names from llama.cpp's mmproj
files or from Ollama's single files (`read_vision`).

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
from pathlib import Path

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


QWEN25VL = "qwen2.5vl_merger"     # llama.cpp's projector type of Qwen2.5-VL

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def llava_pixels(img, size: int = 336, mean=CLIP_MEAN, std=CLIP_STD) -> np.ndarray:
    """[1, 3, size, size]: CLIP's processor (LLaVA-1.5's): the shorter edge resized to `size`
    (bicubic, the longer one truncated to keep the aspect), the centre cut out, rescaled and
    normalised."""
    from PIL import Image
    w, h = img.size
    if w <= h:
        nw, nh = size, int(size * h / w)
    else:
        nw, nh = int(size * w / h), size
    arr = np.asarray(img.resize((nw, nh), Image.Resampling.BICUBIC))
    top, left = (nh - size) // 2, (nw - size) // 2
    return _normalise(arr[top:top + size, left:left + size], mean, std)[None]


def gemma3_pixels(img, size: int = 896, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)) -> np.ndarray:
    """[1, 3, size, size]: one bilinear resize, rescaled and normalised."""
    from PIL import Image
    return _normalise(np.asarray(img.resize((size, size), Image.Resampling.BILINEAR)), mean, std)[None]


def smart_resize(h: int, w: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """Qwen2-VL's dynamic resolution: both edges multiples of `factor`, the area within
    [min_pixels, max_pixels], the aspect kept as near as the rounding allows (transformers'
    `smart_resize`); ValueError for an image more than 200 times as long as it is wide."""
    if max(h, w) / min(h, w) > 200:
        raise ValueError(f"an image {max(h, w) / min(h, w):.0f} times as long as it is wide (at most 200)")
    hb, wb = round(h / factor) * factor, round(w / factor) * factor
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb = max(factor, math.floor(h / beta / factor) * factor)
        wb = max(factor, math.floor(w / beta / factor) * factor)
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


def qwen2vl_pixels(img, *, patch: int = 14, merge: int = 2, temporal: int = 2, min_pixels: int = 56 * 56,
                   max_pixels: int = 28 * 28 * 1280, mean=CLIP_MEAN, std=CLIP_STD) -> tuple[np.ndarray, int, int]:
    """Qwen2-VL / Qwen2.5-VL: the image resized (bicubic) to `smart_resize`'s size, rescaled
    and normalised, cut into patches -> ([gh * gw, 3 * temporal * patch * patch] rows in the
    processor's order: merge x merge blocks of patches row by row, each patch's channels,
    its `temporal` copies, rows, columns), gh, gw (the grid in patches)."""
    from PIL import Image
    h, w = smart_resize(img.height, img.width, patch * merge, min_pixels, max_pixels)
    x = _normalise(np.asarray(img.resize((w, h), Image.Resampling.BICUBIC)), mean, std)
    gh, gw = h // patch, w // patch
    x = x.reshape(3, gh // merge, merge, patch, gw // merge, merge, patch).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal, patch, patch))
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * temporal * patch * patch)), gh, gw


# ---------------------------------------------------------------- the tower (numpy; the Rust kernels next)

def _layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """LayerNorm of the rows of x, into `out` when given (no temporary as large as x)."""
    m = x.mean(-1, keepdims=True)
    xc = np.subtract(x, m, out=out)
    v = np.einsum("ij,ij->i", xc, xc)[:, None] / np.float32(x.shape[-1])
    xc /= np.sqrt(v + np.float32(eps))
    xc *= w
    xc += b
    return xc


class _Workspace:
    """A tower's float32 buffers by name, kept from call to call and grown to the largest
    asked for: a server maps each buffer of a megabyte or more fresh (`tame_malloc`), and a
    tower's products and norms made new ones at every layer (a SigLIP-B frame 29-34 s
    against 22-24 without that setting, here). One image is encoded at a time (ENCODER)."""

    def __init__(self):
        self.bufs: dict[str, np.ndarray] = {}

    def __call__(self, name: str, rows: int, cols: int) -> np.ndarray:
        b = self.bufs.get(name)
        if b is None or b.shape[0] < rows or b.shape[1] != cols:
            b = self.bufs[name] = np.empty((rows, cols), np.float32)
        return b[:rows]


def _gelu_tanh(x: np.ndarray, rows: int = 64) -> np.ndarray:
    """GELU's tanh form, x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) / 2, in place of x, a
    few rows at a time (small temporaries that stay in the cache)."""
    f32 = np.float32
    c = f32(0.7978845608028654)
    for r in range(0, len(x), rows):
        v = x[r:r + rows]
        t = v * v
        t *= f32(0.044715) * c
        t += c
        t *= v
        np.tanh(t, out=t)
        t += f32(1.0)
        t *= f32(0.5)
        v *= t
    return x




class SiglipTower:
    """A SigLIP vision transformer (SmolVLM's, Gemma 3's, ...): patches by a strided
    convolution, learned positions, pre-norm encoder layers (attention with biases over every
    patch, a GELU-tanh MLP), a final LayerNorm. `weights`: float32 arrays under Hugging Face's
    names below `prefix` (`embeddings.patch_embedding.weight`, `encoder.layers.{i}.self_attn.q_proj.weight`,
    ..., `post_layernorm.weight`). `math`: the products' (`dense.Matrix`): "exact" (f32
    BLAS) or "int8" (weights requantized to Q8_0, the integer kernels: the encoders' math)."""

    def __init__(self, weights: dict, *, layers: int, heads: int, patch: int, eps: float = 1e-6, prefix: str = "",
                 math: str = "exact"):
        from .dense import Matrix
        w = {k[len(prefix):]: np.asarray(v, np.float32) for k, v in weights.items() if k.startswith(prefix)}
        self.layers, self.heads, self.patch, self.eps, self.math = layers, heads, patch, eps, math
        self._ws = _Workspace()
        conv = w["embeddings.patch_embedding.weight"]              # [hidden, 3, patch, patch]
        self.hidden = conv.shape[0]
        self.conv = Matrix(conv.reshape(self.hidden, -1), math)    # each patch's 3 x p x p values -> hidden
        self.conv_b = w["embeddings.patch_embedding.bias"]
        self.positions = w["embeddings.position_embedding.weight"]
        self.post = (w["post_layernorm.weight"], w["post_layernorm.bias"])
        self.blocks = []
        for i in range(layers):
            p = f"encoder.layers.{i}."
            a = p + "self_attn."
            self.blocks.append({
                "ln1": (w[p + "layer_norm1.weight"], w[p + "layer_norm1.bias"]),
                "qkv": Matrix(np.concatenate([w[a + f"{t}_proj.weight"] for t in "qkv"]), math),
                "qkv_b": np.concatenate([w[a + f"{t}_proj.bias"] for t in "qkv"]),
                "o": Matrix(w[a + "out_proj.weight"], math), "o_b": w[a + "out_proj.bias"],
                "ln2": (w[p + "layer_norm2.weight"], w[p + "layer_norm2.bias"]),
                "fc1": Matrix(w[p + "mlp.fc1.weight"], math), "fc1_b": w[p + "mlp.fc1.bias"],
                "fc2": Matrix(w[p + "mlp.fc2.weight"], math), "fc2_b": w[p + "mlp.fc2.bias"]})

    def __call__(self, pixels: np.ndarray, pause=None) -> np.ndarray:
        """pixels float32 [N, 3, S, S] (whole tiles) -> last hidden states [N, (S / patch)^2, hidden].
        A tile at a time; `pause()`, when given, is called before each product of each layer
        (it may wait: the encoder's work in pieces)."""
        n, c, s, _ = pixels.shape
        p, g = self.patch, s // self.patch
        out = np.empty((n, g * g, self.hidden), np.float32)
        ws = self._ws
        for i in range(n):
            # the strided convolution as one product: each patch's c x p x p values in the kernel's order
            cols = np.ascontiguousarray(pixels[i].reshape(c, g, p, g, p).transpose(1, 3, 0, 2, 4).reshape(g * g, -1))
            x = self.conv.into(cols, ws("x", g * g, self.hidden))
            x += self.conv_b
            x += self.positions[: g * g]
            for blk in self.blocks:
                x = self._layer(x, blk, pause)
            _layer_norm(x, *self.post, self.eps, out=out[i])
        return out

    @staticmethod
    def _attention(qkv: np.ndarray, t: int, nh: int, d: int, pause=None, out=None) -> np.ndarray:
        """Every patch attends to every patch (`segment_attention` over one segment)."""
        return segment_attention(qkv, np.array([0, t], np.int64), nh, d, pause=pause, out=out)

    act = staticmethod(_gelu_tanh)      # the MLP's activation, in place

    def _layer(self, x: np.ndarray, blk: dict, pause=None) -> np.ndarray:
        """One encoder layer; `pause()` before each of its products (a few tens of ms apart)."""
        step = pause or (lambda: None)
        h, nh = self.hidden, self.heads
        d = h // nh
        t = len(x)
        ws = self._ws                       # (x is ws("x") or the caller's: updated in place)
        y = ws("y", t, h)
        step()
        qkv = blk["qkv"].into(_layer_norm(x, *blk["ln1"], self.eps, out=y), ws("qkv", t, 3 * h))
        qkv += blk["qkv_b"]
        step()
        att = self._attention(qkv, t, nh, d, pause, out=ws("att", t, h))
        step()
        a = blk["o"].into(att, y)
        a += blk["o_b"]
        x += a
        step()
        f = blk["fc1"].into(_layer_norm(x, *blk["ln2"], self.eps, out=y), ws("f", t, blk["fc1"].rows))
        f += blk["fc1_b"]
        step()
        f = blk["fc2"].into(self.act(f), y)
        f += blk["fc2_b"]
        x += f
        return x


def _quick_gelu(x: np.ndarray, rows: int = 64) -> np.ndarray:
    """CLIP's activation, x * sigmoid(1.702 x), in place, a few rows at a time."""
    f32 = np.float32
    for r in range(0, len(x), rows):
        v = x[r:r + rows]
        t = v * f32(-1.702)
        np.exp(t, out=t)
        t += f32(1.0)
        v /= t
    return x


class ClipTower(SiglipTower):
    """CLIP's vision transformer (LLaVA-1.5's ViT-L/14): a class embedding before the patches
    (a convolution without bias), a LayerNorm before the layers (`pre_layrnorm`), quick-GELU,
    and LLaVA's features: the output of the layer before the last (`layers` is how many run:
    the file's count minus one when it keeps the last), the class token dropped, no final norm."""

    act = staticmethod(_quick_gelu)

    def __init__(self, weights: dict, *, layers: int, heads: int, patch: int, eps: float = 1e-5, prefix: str = "",
                 math: str = "exact"):
        w = {k[len(prefix):]: np.asarray(v, np.float32) for k, v in weights.items() if k.startswith(prefix)}
        hidden = w["embeddings.patch_embedding.weight"].shape[0]
        w.setdefault("embeddings.patch_embedding.bias", np.zeros(hidden, np.float32))
        w.setdefault("post_layernorm.weight", np.ones(hidden, np.float32))
        w.setdefault("post_layernorm.bias", np.zeros(hidden, np.float32))
        super().__init__(w, layers=layers, heads=heads, patch=patch, eps=eps, math=math)
        self.cls = w["embeddings.class_embedding"].reshape(-1)
        self.pre = (w["pre_layrnorm.weight"], w["pre_layrnorm.bias"])

    def __call__(self, pixels: np.ndarray, pause=None) -> np.ndarray:
        n, c, s, _ = pixels.shape
        p, g = self.patch, s // self.patch
        out = np.empty((n, g * g, self.hidden), np.float32)
        for i in range(n):
            cols = np.ascontiguousarray(pixels[i].reshape(c, g, p, g, p).transpose(1, 3, 0, 2, 4).reshape(g * g, -1))
            x = np.concatenate([self.cls[None], cols @ self.conv + self.conv_b])
            x += self.positions[: g * g + 1]
            x = _layer_norm(x, *self.pre, self.eps)
            for blk in self.blocks:
                x = self._layer(x, blk, pause)
            out[i] = x[1:]
        return out


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """RMSNorm of the rows of x, into `out` when given (no temporary as large as x)."""
    v = np.einsum("ij,ij->i", x, x)[:, None] / np.float32(x.shape[-1])
    v += np.float32(eps)
    out = np.multiply(x, np.float32(1.0) / np.sqrt(v), out=out)
    out *= w
    return out


def segment_attention(qkv: np.ndarray, cu: np.ndarray, nh: int, d: int, scale: float | None = None,
                      pause=None, out: np.ndarray | None = None) -> np.ndarray:
    """Attention without a mask inside each segment [cu[i], cu[i + 1]) of the rows (a
    windowed ViT's windows; one segment: every row sees every row), q, k, v side by side in
    `qkv` [t, 3 * nh * d]: two BLAS products around `ops.softmax_rows` (the pool's threads),
    long segments a head and a block of query rows at a time (`_long_segment`), short ones
    (the windows) of one length together. Measured here (Zen 3, alternated in one process):
    a SigLIP-B tile (1,024 patches, 12 heads of 64) 58-62 ms a layer against 87-100 ms on the
    Rust prefill tiles it ran on before; Gemma 3's tower (4,096 patches, 16 heads of 72)
    0.8-1.0 s a layer against 1.7 s with numpy's softmax (its exp ran one core). `pause()`,
    when given, is called between the heads of a long segment (the encoder's pieces: a head
    of Gemma 3's tower is ~60 ms, its whole attention ~1 s)."""
    from .._native import ops
    t, h = len(qkv), nh * d
    scale = d ** -0.5 if scale is None else scale
    cu = np.asarray(cu, np.int64)
    lens = np.diff(cu)
    out = np.empty((t, h), np.float32) if out is None else out
    for n in np.unique(lens):
        n = int(n)
        starts = cu[:-1][lens == n]
        if n >= 512:       # long segments one by one, in blocks of query rows (their scores stay in the cache)
            for a in starts:
                _long_segment(qkv, out, int(a), n, nh, d, scale, pause=pause)
            continue
        idx = (starts[:, None] + np.arange(n)).reshape(-1)
        step = max(1, (64 << 20) // (4 * n * n * len(starts)))
        for h0 in range(0, nh, step):
            h1 = min(nh, h0 + step)
            part = qkv[idx].reshape(len(starts), n, 3, nh, d)[:, :, :, h0:h1]
            q = part[:, :, 0].transpose(0, 2, 1, 3)
            kt = part[:, :, 1].transpose(0, 2, 3, 1)
            vv = part[:, :, 2].transpose(0, 2, 1, 3)
            sc = np.matmul(q, kt)            # (BLAS), the softmax on the pool's threads, BLAS again
            ops.softmax_rows(sc, scale)
            o = np.matmul(sc, vv).transpose(0, 2, 1, 3).reshape(len(starts) * n, (h1 - h0) * d)
            out[idx, h0 * d:h1 * d] = o
    return out


def _long_segment(qkv, out, a: int, n: int, nh: int, d: int, scale: float, block_bytes: int = 16 << 20,
                  pause=None) -> None:
    """`segment_attention` of rows a .. a + n, head by head, `block_bytes` of scores at a time
    in one buffer (a server maps each buffer of a megabyte or more fresh: `tame_malloc`):
    scores (BLAS), their softmax (the pool's threads), times V (BLAS)."""
    from .._native import ops
    h = nh * d
    rows = min(n, max(16, block_bytes // (4 * n)))
    seg = qkv[a:a + n]
    buf = np.empty((rows, n), np.float32)
    pv = np.empty((rows, d), np.float32)
    for i in range(nh):
        if pause is not None and i:
            pause()
        kt = np.ascontiguousarray(seg[:, h + i * d:h + (i + 1) * d].T)
        v = np.ascontiguousarray(seg[:, 2 * h + i * d:2 * h + (i + 1) * d])
        q = np.ascontiguousarray(seg[:, i * d:(i + 1) * d])
        for r in range(0, n, rows):
            m = min(rows, n - r)
            sc = np.matmul(q[r:r + m], kt, out=buf[:m])
            ops.softmax_rows(sc, scale)
            out[a + r:a + r + m, i * d:(i + 1) * d] = np.matmul(sc, v, out=pv[:m])


class QwenVisionTower:
    """Qwen2.5-VL's vision transformer: patches (3 x 2 x 14 x 14, the image twice in time:
    a Conv3d, here one product with its two time slices summed) in merge x merge blocks, a
    2-D rotary (the first half of each head's rotary pairs by the patch's row, the second
    by its column), RMS-normed pre-norm blocks (fused qkv with biases, a SwiGLU MLP with
    biases), attention inside windows of `window` pixels except in the `full` layers, then
    the merger: RMSNorm, each block's 4 patches side by side, linear, GELU, linear.
    `weights`: float32 arrays under the names `read_mmproj` gives (`encoder.layers.N.*`,
    `embeddings.patch_embedding.weight` (+ `.weight_1`), `post_layernorm.weight`: the
    merger's norm, `projector.linear_1/2.*`)."""

    def __init__(self, weights: dict, *, layers: int, heads: int, patch: int = 14, merge: int = 2,
                 window: int = 112, full=(7, 15, 23, 31), eps: float = 1e-6, theta: float = 10000.0,
                 math: str = "exact"):
        from .dense import Matrix
        w = weights
        conv = np.asarray(w["embeddings.patch_embedding.weight"], np.float32)
        if conv.ndim == 5:                  # transformers' Conv3d [hidden, 3, 2, p, p]
            conv = conv.sum(2)
        elif "embeddings.patch_embedding.weight_1" in w:       # llama.cpp: the two time slices apart
            conv = conv + w["embeddings.patch_embedding.weight_1"]
        self.hidden = conv.shape[0]
        self.layers, self.heads, self.patch, self.merge, self.eps = layers, heads, patch, merge, eps
        self.window, self.full = window, {int(i) for i in full}
        self._ws = _Workspace()
        self.conv = Matrix(conv.reshape(self.hidden, -1), math)
        d = self.hidden // heads
        self.inv_freq = (1.0 / theta ** (np.arange(0, d // 2, 2, dtype=np.float32) / (d // 2))).astype(np.float32)
        self.blocks = []
        for i in range(layers):
            p = f"encoder.layers.{i}."
            a = p + "self_attn."
            self.blocks.append({
                "ln1": w[p + "layer_norm1.weight"], "ln2": w[p + "layer_norm2.weight"],
                "qkv": Matrix(np.concatenate([w[a + f"{t}_proj.weight"] for t in "qkv"]), math),
                "qkv_b": np.concatenate([w[a + f"{t}_proj.bias"] for t in "qkv"]),
                "o": Matrix(w[a + "out_proj.weight"], math), "o_b": w[a + "out_proj.bias"],
                "gu": Matrix(np.concatenate([w[p + "mlp.gate.weight"], w[p + "mlp.fc1.weight"]]), math),
                "gu_b": np.concatenate([w[p + "mlp.gate.bias"], w[p + "mlp.fc1.bias"]]),
                "down": Matrix(w[p + "mlp.fc2.weight"], math), "down_b": w[p + "mlp.fc2.bias"]})
        self.ln_q = w["post_layernorm.weight"]
        self.mm0 = (Matrix(w["projector.linear_1.weight"], math), w["projector.linear_1.bias"])
        self.mm2 = (Matrix(w["projector.linear_2.weight"], math), w["projector.linear_2.bias"])
        self.width = int(w["projector.linear_2.weight"].shape[0])

    def order(self, gh: int, gw: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(the merged units in window order, the windows' bounds in patch rows, each patch's
        (row, column) in the processor's order)."""
        m = self.merge
        GH, GW = gh // m, gw // m
        side = max(1, self.window // m // self.patch)        # merged units a window's side
        r, c = np.divmod(np.arange(GH * GW), GW)
        key = (r // side) * (GW // side + 1) + c // side
        units = np.argsort(key, kind="stable")
        _, counts = np.unique(key[units], return_counts=True)
        cu = np.concatenate([[0], np.cumsum(counts) * m * m])
        i, j = np.divmod(np.arange(m * m), m)
        rows = (r[:, None] * m + i[None]).reshape(-1)
        cols = (c[:, None] * m + j[None]).reshape(-1)
        return units, cu, np.stack([rows, cols], 1)

    def __call__(self, pixels: np.ndarray, grid: tuple[int, int], pause=None) -> np.ndarray:
        """pixels [gh * gw, 3 * 2 * p * p] (qwen2vl_pixels), grid (gh, gw) -> the image's
        feature rows [(gh / 2) * (gw / 2), text hidden], row by row of the merged grid."""
        step = pause or (lambda: None)
        gh, gw = grid
        n, mm = gh * gw, self.merge * self.merge
        p2 = self.patch * self.patch
        x = np.ascontiguousarray(pixels.reshape(n, 3, -1, p2)[:, :, 0].reshape(n, 3 * p2)) @ self.conv
        units, cu_win, hw = self.order(gh, gw)
        perm = (units[:, None] * mm + np.arange(mm)).reshape(-1)      # patch rows in window order
        x, hw = x[perm], hw[perm]
        ang = np.concatenate([hw[:, :1] * self.inv_freq, hw[:, 1:] * self.inv_freq], 1).astype(np.float32)
        cos, sin = np.cos(ang), np.sin(ang)
        cu_all = np.array([0, n], np.int64)
        for li, blk in enumerate(self.blocks):
            x = self._block(x, blk, cos, sin, cu_all if li in self.full else cu_win, step)
        step()
        y = _rms_norm(x, self.ln_q, 1e-6).reshape(n // mm, -1) @ self.mm0[0]
        y += self.mm0[1]
        from .dense import gelu
        y = gelu(np.ascontiguousarray(y, np.float32)) @ self.mm2[0]
        y += self.mm2[1]
        out = np.empty_like(y)
        out[units] = y
        return out

    def _block(self, x, blk, cos, sin, cu, step) -> np.ndarray:
        """One block over x (the caller's buffer, updated in place), its buffers kept (`_Workspace`)."""
        from .._native import ops
        t, nh, h = len(x), self.heads, self.hidden
        d = h // nh
        ws = self._ws
        y = ws("y", t, h)
        step()
        qkv = blk["qkv"].into(_rms_norm(x, blk["ln1"], self.eps, out=y), ws("qkv", t, 3 * h))
        qkv += blk["qkv_b"]
        a, b = ws("ra", t, h // 2).reshape(t, nh, d // 2), ws("rb", t, h // 2).reshape(t, nh, d // 2)
        c, s = cos[:, None], sin[:, None]
        for at in (0, h):                   # the rotary on q and k: pairs (j, j + d / 2)
            v = qkv[:, at:at + h].reshape(t, nh, 2, d // 2)
            np.copyto(a, v[:, :, 0])
            np.copyto(b, v[:, :, 1])
            np.multiply(a, c, out=v[:, :, 0])
            v[:, :, 0] -= b * s
            np.multiply(b, c, out=v[:, :, 1])
            v[:, :, 1] += a * s
        step()
        att = segment_attention(qkv, cu, nh, d, pause=step, out=ws("att", t, h))
        step()
        o = blk["o"].into(att, y)
        o += blk["o_b"]
        x += o
        step()
        gu = blk["gu"].into(_rms_norm(x, blk["ln2"], self.eps, out=y), ws("gu", t, blk["gu"].rows))
        gu += blk["gu_b"]
        f = ws("f", t, gu.shape[1] // 2)
        ops.silu_mul(gu, f)
        step()
        down = blk["down"].into(f, y)
        down += blk["down_b"]
        x += down
        return x


def llava_image_tokens(tower: ClipTower, proj: dict, pixels: np.ndarray, pause=None) -> np.ndarray:
    """LLaVA-1.5's image embeddings: the tower's patch features, then the projector (a linear,
    GELU, a linear; biases) -> [N * patches, text hidden]."""
    from .dense import gelu
    x = tower(pixels, pause).reshape(-1, tower.hidden)
    x = x @ proj["projector.linear_1.weight"].T + proj["projector.linear_1.bias"]
    x = gelu(np.ascontiguousarray(x, np.float32)) @ proj["projector.linear_2.weight"].T + proj["projector.linear_2.bias"]
    return x.astype(np.float32)


def pixel_shuffle(x: np.ndarray, scale: int) -> np.ndarray:
    """Idefics3's connector: each scale x scale block of patches into one token of scale^2
    times the width ([N, P, D] -> [N, P / scale^2, D * scale^2], transformers' order)."""
    n, seq, dim = x.shape
    side = int(round(seq ** 0.5))
    x = x.reshape(n, side, side // scale, dim * scale).transpose(0, 2, 1, 3)
    x = x.reshape(n, side // scale, side // scale, dim * scale * scale).transpose(0, 2, 1, 3)
    return x.reshape(n, seq // (scale * scale), dim * scale * scale)


def idefics3_image_tokens(tower: SiglipTower, projection: np.ndarray, pixels: np.ndarray, scale: int,
                          pause=None) -> np.ndarray:
    """SmolVLM's image embeddings: the tower over the tiles, pixel shuffle, the connector's
    projection (`projection` [text hidden, D * scale^2], no bias) -> [N * tokens a tile, text hidden]."""
    x = pixel_shuffle(tower(pixels, pause), scale) @ np.asarray(projection, np.float32).T
    return x.reshape(-1, x.shape[-1])


def gemma3_image_tokens(tower: SiglipTower, norm_weight: np.ndarray, projection: np.ndarray, pixels: np.ndarray,
                        tokens_per_image: int = 256, eps: float = 1e-6) -> np.ndarray:
    """Gemma 3's image embeddings: the tower, an average pool of its patch grid down to
    `tokens_per_image` (16 x 16), Gemma's RMSNorm (weight 1 + w), the projection
    (`projection` [vision hidden, text hidden]) -> [N * tokens_per_image, text hidden]."""
    x = tower(pixels)
    n, p, d = x.shape
    g, t = int(round(p ** 0.5)), int(round(tokens_per_image ** 0.5))
    k = g // t
    grid = x.reshape(n, g, g, d)
    pooled = grid.reshape(n, t, k, t, k, d).mean(axis=(2, 4), dtype=np.float32).reshape(n, t * t, d)
    normed = pooled / np.sqrt((pooled * pooled).mean(-1, keepdims=True) + eps) * (1.0 + np.asarray(norm_weight,
                                                                                                 np.float32))
    out = normed.astype(np.float32) @ np.asarray(projection, np.float32)
    return out.reshape(-1, out.shape[-1])


# ---------------------------------------------------------------- llama.cpp's mmproj files

_LAYER = {"ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2",
          "ffn_gate": "mlp.gate"}
_TOP = {"v.patch_embd": "embeddings.patch_embedding", "v.position_embd": "embeddings.position_embedding",
        "v.post_ln": "post_layernorm", "mm.model.fc": "connector.proj", "mm.input_projection": "projector.input",
        "mm.soft_emb_norm": "projector.norm", "v.pre_ln": "pre_layrnorm", "mm.0": "projector.linear_1",
        "mm.2": "projector.linear_2"}


def _tower_weights(tensors, layers: dict, top: dict, where: str) -> dict:
    """A file's tower and projector tensors as float32 arrays under the tower's names, by a
    layout's maps (`layers`: a block's part -> its name; `top`: the rest); ValueError naming a
    tensor neither map knows."""
    weights = {}
    for t in tensors:
        if t.name == "v.class_embd":              # (CLIP's class embedding: a name without a suffix)
            weights["embeddings.class_embedding"] = np.asarray(t.data, np.float32)
            continue
        if t.name in ("v.patch_embd.weight.1", "v.patch_embd_1.weight"):   # (Qwen2.5-VL's second time slice)
            weights["embeddings.patch_embedding.weight_1"] = np.asarray(t.data, np.float32)
            continue
        stem, _, suffix = t.name.rpartition(".")
        parts = stem.split(".", 3)
        if stem.startswith("v.blk.") and len(parts) == 4 and parts[3] in layers:
            name = f"encoder.layers.{parts[2]}.{layers[parts[3]]}"
        elif stem in top:
            name = top[stem]
        else:
            raise ValueError(f"{where}: unexpected vision tensor {t.name!r}")
        weights[f"{name}.{suffix}"] = np.asarray(t.data, np.float32)
    return weights


def read_mmproj(path) -> tuple[str, dict, dict]:
    """A llama.cpp `mmproj` GGUF -> (projector type, hyperparameters, float32 weights under the
    tower's names: `embeddings.patch_embedding.weight`, `encoder.layers.N.self_attn.q_proj.weight`,
    ..., and the projector's `connector.proj.weight` (Idefics3) or `projector.input.weight` /
    `projector.norm.weight` (Gemma 3: the norm as stored, 1 + w))."""
    from .gguf_file import GgufFile
    from .loader import gguf_field
    f = GgufFile(path)
    if gguf_field(f, "general.architecture") != "clip":
        raise ValueError(f"{Path(path).name}: not a vision projector (mmproj) file")
    kind = gguf_field(f, "clip.projector_type") or ("mlp" if gguf_field(f, "clip.has_llava_projector") else None)
    hp = {k.removeprefix("clip.vision."): gguf_field(f, k) for k in f.fields if k.startswith("clip.vision.")}
    weights = _tower_weights(f.tensors, _LAYER, _TOP, f"{Path(path).name} ({kind} projector)")
    # llama.cpp's older converter (LLaVA's "mlp" files) named fc1 ffn_down and fc2 ffn_up: the
    # shapes say which is which (fc1 widens the hidden size)
    for i in range(int(hp.get("block_count", 0)) if kind == "mlp" else 0):
        a, b = f"encoder.layers.{i}.mlp.fc1.", f"encoder.layers.{i}.mlp.fc2."
        if a + "weight" in weights and weights[a + "weight"].shape[0] < weights[a + "weight"].shape[1]:
            for suffix in ("weight", "bias"):
                if a + suffix in weights and b + suffix in weights:
                    weights[a + suffix], weights[b + suffix] = weights[b + suffix], weights[a + suffix]
    return kind, hp, weights


# Ollama's single-file layout (its converter's names: the tower and projector inside the model's
# GGUF, keys under "{arch}.vision."): Gemma 3's
_OLLAMA_LAYER = {"layer_norm1": "layer_norm1", "layer_norm2": "layer_norm2", "attn_q": "self_attn.q_proj",
                 "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.out_proj",
                 "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
_OLLAMA_TOP = {"v.patch_embedding": "embeddings.patch_embedding", "v.position_embedding": "embeddings.position_embedding",
               "v.post_layernorm": "post_layernorm", "mm.mm_input_projection": "projector.input",
               "mm.mm_soft_emb_norm": "projector.norm"}
# Qwen2.5-VL's (`qwen25vl`: llama.cpp's part names, the merger under its own)
_OLLAMA_QWEN_LAYER = {**_LAYER, "attn_out": "self_attn.out_proj"}
_OLLAMA_QWEN_TOP = {"v.patch_embd_0": "embeddings.patch_embedding", "v.merger.ln_q": "post_layernorm",
                    "v.merger.mlp.0": "projector.linear_1", "v.merger.mlp.2": "projector.linear_2"}
OLLAMA_VISION = {"gemma3": "gemma3", "qwen25vl": QWEN25VL}      # the model's architecture -> its projector's kind
_OLLAMA_MAPS = {"gemma3": (_OLLAMA_LAYER, _OLLAMA_TOP), "qwen25vl": (_OLLAMA_QWEN_LAYER, _OLLAMA_QWEN_TOP)}


def read_ollama_vision(path) -> tuple[str, dict, dict]:
    """The vision tower inside a model's GGUF as Ollama's converter writes it (`ollama pull
    gemma3:4b`): (projector kind, hyperparameters under the mmproj's names, float32 weights
    under the tower's names, as `read_mmproj`); ValueError when the file has none."""
    from .gguf_file import GgufFile
    from .loader import gguf_field
    f = GgufFile(path)
    arch = gguf_field(f, "general.architecture")
    if not f.vision_tensors:
        raise ValueError(f"{Path(path).name}: no vision tower in this model file")
    if arch not in OLLAMA_VISION:
        raise ValueError(f"{Path(path).name}: the vision tower of a {arch} file is not supported yet")
    pre = f"{arch}.vision."
    hp = {k.removeprefix(pre): gguf_field(f, k) for k in f.fields if k.startswith(pre)}
    hp.setdefault("attention.layer_norm_epsilon", 1e-6)
    qwen = arch == "qwen25vl"           # (its converter keeps CLIP's mean and std to itself)
    hp.setdefault("image_mean", list(CLIP_MEAN) if qwen else [0.5, 0.5, 0.5])
    hp.setdefault("image_std", list(CLIP_STD) if qwen else [0.5, 0.5, 0.5])
    tokens = gguf_field(f, f"{arch}.mm.tokens_per_image")
    if tokens:            # (Ollama's own runtime took 256; the file may say otherwise)
        grid = int(hp["image_size"]) // int(hp["patch_size"])
        hp["projector.scale_factor"] = grid // int(round(int(tokens) ** 0.5))
    return OLLAMA_VISION[arch], hp, _tower_weights(f.vision_tensors, *_OLLAMA_MAPS[arch], Path(path).name)


def read_vision(path) -> tuple[str, dict, dict]:
    """An mmproj file (llama.cpp's layout) or a model file with its tower inside (Ollama's)."""
    from .gguf_file import GgufFile
    from .loader import gguf_field
    f = GgufFile(path)
    return read_mmproj(path) if gguf_field(f, "general.architecture") == "clip" else read_ollama_vision(path)


def has_vision(path) -> bool:
    """Whether a model's GGUF carries its vision tower inside (Ollama's layout)."""
    from .gguf_file import GgufFile
    try:
        return bool(GgufFile(path).vision_tensors)
    except Exception:   # noqa: BLE001 - not a GGUF file: no
        return False


def tower_from_mmproj(path, math: str = "exact") -> tuple[str, dict, SiglipTower, dict]:
    """The projector type, hyperparameters, the SigLIP tower and the projector's weights of an
    mmproj file, or of a model file with its tower inside (`math`: the tower's products,
    SiglipTower)."""
    kind, hp, w = read_vision(path)
    if kind == QWEN25VL:
        layers = int(hp["block_count"])
        if hp.get("fullatt_block_indexes") is not None:          # (Ollama's key)
            full = [int(i) for i in hp["fullatt_block_indexes"]]
        else:                                                   # (llama.cpp's: every n-th layer)
            n = int(hp.get("n_wa_pattern") or 0)
            full = [i for i in range(layers) if n and (i + 1) % n == 0]
        tower = QwenVisionTower(w, layers=layers, heads=int(hp["attention.head_count"]),
                                patch=int(hp["patch_size"]), merge=int(hp.get("spatial_merge_size", 2)),
                                window=int(hp.get("window_size", 112)), full=full,
                                eps=float(hp.get("attention.layer_norm_epsilon", 1e-6)),
                                theta=float(hp.get("rope.freq_base", 10000.0)), math=math)
        return kind, hp, tower, {}
    cls = ClipTower if kind == "mlp" else SiglipTower
    layers = int(hp["block_count"])
    if kind == "mlp" and hp.get("feature_layer") is not None:      # (the layers whose output LLaVA takes)
        fl = hp["feature_layer"]
        layers = min(layers, int(fl[-1] if isinstance(fl, (list, tuple)) else fl))
    tower = cls(w, layers=layers, heads=int(hp["attention.head_count"]), patch=int(hp["patch_size"]),
                eps=float(hp["attention.layer_norm_epsilon"]), math=math)
    proj = {k: v for k, v in w.items() if k.startswith(("connector.", "projector."))}
    return kind, hp, tower, proj


# ---------------------------------------------------------------- a served model's images

IMAGE = -1     # in `VisionEncoder.prompt_tokens`: a position the image's next feature row takes


class VisionEncoder:
    """A vision model's image side, from its llama.cpp `mmproj` file: the pixels its tower
    takes, the tower and projector (image -> feature rows of the text model's width), and the
    tokens that stand for an image in the prompt (the family's own wrapping, each IMAGE one
    feature row, in order). The chat template marks where an image goes (`marker`).

    Idefics3 (SmolVLM / SmolVLM2): the image cut into tiles (`idefics3_pixels`), each tile's
    rows after `<fake_token_around_image><row_R_col_C>`, a newline after each row of tiles,
    then the whole image after `\\n<fake_token_around_image><global-img>`, closed by
    `<fake_token_around_image>` (transformers' Idefics3Processor); marker `<image>`.

    Gemma 3: one bilinear resize to the tower's size (`gemma3_pixels`), its patches pooled to
    `tokens_per_image` (256); the marker `<start_of_image>` becomes `\\n\\n<start_of_image>`,
    the image's rows, `<end_of_image>\\n\\n` (transformers' Gemma3Processor; the newlines
    tokenized apart from the text around them). Its image tokens attend to each other both
    ways (`both_ways`: the runner's prefill lets them see their whole image).

    LLaVA-1.5 (projector "mlp", llama.cpp's older converter's layout): CLIP's processor (the
    shorter edge to 336, the centre), the tower's next-to-last layer, 576 tokens each the
    projector's row, in place of `<image>`, nothing around them.

    Qwen2.5-VL (projector "qwen2.5vl_merger"; Ollama's `qwen25vl` file): dynamic resolution
    (`qwen2vl_pixels`: edges to multiples of 28, the area within the bounds), the windowed
    tower and merger (`QwenVisionTower`), one feature row per 2 x 2 patches, row by row, in
    place of `<|image_pad|>` (the template wraps it in <|vision_start|> ... <|vision_end|>);
    the layout is the merged grid (rows, columns), which the text model's multimodal rotary
    positions take (`mrope`: image_table.mrope_positions)."""

    FAMILIES = ("idefics3", "gemma3", "mlp", QWEN25VL)

    def __init__(self, path, math: str = "exact"):
        try:
            kind, hp, tower, proj = tower_from_mmproj(path, math)
        except KeyError as e:       # a file without a key or tensor a tower needs
            raise ValueError(f"{Path(path).name}: not a complete vision projector (no {e})") from None
        if kind not in self.FAMILIES:
            raise ValueError(f"{Path(path).name}: vision projector {kind!r} is not supported yet (supported: "
                             f"{', '.join(self.FAMILIES)})")
        self.path, self.kind, self.hp, self.tower, self.proj = Path(path), kind, hp, tower, proj
        self.mrope = kind == QWEN25VL
        if self.mrope:
            self.mean = tuple(float(x) for x in hp.get("image_mean", CLIP_MEAN))
            self.std = tuple(float(x) for x in hp.get("image_std", CLIP_STD))
            self.width, self.marker, self.both_ways = tower.width, "<|image_pad|>", False
            # llama.cpp's mmproj may state the images' bounds in tokens; else transformers' processor's
            side = tower.patch * tower.merge
            self.min_pixels = int(hp.get("image_min_pixels") or 56 * 56)
            self.max_pixels = int(hp.get("image_max_pixels") or side * side * 1280)
            return
        self.tile = int(hp["image_size"])
        self.mean = tuple(float(x) for x in hp.get("image_mean", (0.5, 0.5, 0.5)))
        self.std = tuple(float(x) for x in hp.get("image_std", (0.5, 0.5, 0.5)))
        grid = self.tile // int(hp["patch_size"])
        self.eps = float(hp.get("attention.layer_norm_epsilon", 1e-6))
        if kind == "idefics3":
            self.scale = int(hp.get("projector.scale_factor", 2))
            self.longest_edge = int(hp.get("preproc_image_size", self.tile))
            self.tokens_per_tile = grid * grid // (self.scale * self.scale)
            self.width = int(proj["connector.proj.weight"].shape[0])       # the text model's hidden size
            self.marker, self.both_ways = "<image>", False
        elif kind == "mlp":             # LLaVA-1.5: CLIP, every patch a token, a two-layer projector
            self.tokens_per_tile = grid * grid
            self.width = int(proj["projector.linear_2.weight"].shape[0])
            self.marker, self.both_ways = "<image>", False
        else:
            pool = int(hp.get("projector.scale_factor", 4))                # patches a side per pooled token
            self.tokens_per_tile = (grid // pool) ** 2
            self.width = int(proj["projector.input.weight"].shape[1])
            self.marker, self.both_ways = "<start_of_image>", True

    def pixels(self, img) -> tuple[np.ndarray, tuple]:
        """A decoded RGB image -> (the tower's input, its layout for `prompt_tokens`)."""
        if self.mrope:          # (the layout: the merged grid, rows x columns of feature rows)
            t = self.tower      # (ValueError for an image it cannot take: the caller's 400)
            px, gh, gw = qwen2vl_pixels(img, patch=t.patch, merge=t.merge, min_pixels=self.min_pixels,
                                        max_pixels=self.max_pixels, mean=self.mean, std=self.std)
            return (px, (gh, gw)), (gh // t.merge, gw // t.merge)
        if self.kind == "gemma3":
            return gemma3_pixels(img, self.tile, self.mean, self.std), (0, 0)
        if self.kind == "mlp":
            return llava_pixels(img, self.tile, self.mean, self.std), (0, 0)
        tiles, rows, cols = idefics3_pixels(img, longest_edge=self.longest_edge, tile=self.tile, mean=self.mean,
                                            std=self.std)
        return tiles, (rows, cols)

    def encode(self, pixels: np.ndarray, pause=None) -> np.ndarray:
        """The tower and projector: float32 [feature rows, text hidden], rows in prompt order.
        `pause()`: called between the tower's layers (SiglipTower)."""
        if self.mrope:
            px, grid = pixels
            return np.ascontiguousarray(self.tower(px, grid, pause), dtype=np.float32)
        if self.kind == "mlp":
            return np.ascontiguousarray(llava_image_tokens(self.tower, self.proj, pixels, pause), dtype=np.float32)
        if self.kind == "gemma3":
            tower = self.tower if pause is None else (lambda px: self.tower(px, pause))
            out = gemma3_image_tokens(tower, self.proj["projector.norm.weight"] - 1.0,
                                      self.proj["projector.input.weight"], pixels, self.tokens_per_tile, self.eps)
        else:
            out = idefics3_image_tokens(self.tower, self.proj["connector.proj.weight"], pixels, self.scale, pause)
        return np.ascontiguousarray(out, dtype=np.float32)

    def describe(self) -> str:
        """The projector in a few words (serve's log line)."""
        if self.mrope:
            side = self.tower.patch * self.tower.merge
            return f"{self.kind}, any size up to {self.max_pixels // (side * side)} tokens an image"
        return f"{self.kind}, {self.tokens_per_tile} tokens a tile"

    def rows_for(self, layout: tuple) -> int:
        if self.mrope:
            return int(layout[0]) * int(layout[1])
        rows, cols = layout
        return self.tokens_per_tile * (rows * cols + 1)

    def prompt_tokens(self, layout: tuple, tokenizer) -> list[int]:
        """The ids standing for one image (IMAGE where a feature row goes)."""
        def special(name: str) -> int:
            i = tokenizer.tok.token_to_id(name)
            if i is None:
                raise ValueError(f"this model's tokenizer has no {name} token: it does not go with "
                                 f"{self.path.name}")
            return i
        image = [] if self.mrope else [IMAGE] * self.tokens_per_tile
        pieces: list = []
        if self.mrope:              # (the template wraps it: <|vision_start|><|image_pad|><|vision_end|>)
            pieces = [IMAGE] * self.rows_for(layout)
        elif self.kind == "mlp":
            pieces = image
        elif self.kind == "gemma3":
            pieces = ["\n\n", special("<start_of_image>"), *image, special("<end_of_image>"), "\n\n"]
        else:
            fake, glob = special("<fake_token_around_image>"), special("<global-img>")
            rows, cols = layout
            for r in range(rows):
                for c in range(cols):
                    pieces += [fake, special(f"<row_{r + 1}_col_{c + 1}>"), *image]
                pieces.append("\n")
            if rows:
                pieces.append("\n")
            pieces += [fake, glob, *image, fake]
        out: list[int] = []
        text = ""
        for p in pieces + [None]:
            if isinstance(p, str):
                text += p          # ("\n" + "\n" is one piece: a tokenizer may merge it)
                continue
            if text:
                out += tokenizer.encode_plain(text)
                text = ""
            if p is not None:
                out.append(p)
        return out
