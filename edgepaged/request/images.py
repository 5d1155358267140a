"""An image a request carries, from its door's text to decoded RGB pixels, within bounds.

    data = image_bytes(part, limits)     # the message model's `Image` -> its bytes (base64 / data URL)
    img = decode(data, limits)           # -> a PIL RGB image, EXIF orientation applied

Every bound is checked before the work it bounds, and each refusal is an `ImageError` with
the status a door answers (400, or 413 for what is too large):
- the text: a data URL or base64 no longer than the byte cap allows (its length says the
  decoded size before decoding); a remote URL is refused unless the operator allows them
  (a box on the LAN must not fetch what a request names), and this module never fetches;
- the bytes: at most `max_bytes`; the format read from the first bytes, one of JPEG, PNG,
  WebP and GIF (its first frame), nothing else handed to the decoder;
- the pixels: the header's width x height at most `max_pixels` and each side at most
  `max_side`, read before any pixel is decoded (a decompression bomb: a few KB declaring
  100,000 x 100,000 pixels is refused in microseconds); a truncated or corrupt file is
  refused, never half decoded.
`decode` is CPU work (tens of milliseconds for a camera frame): callers run it in a worker
thread, never on the event loop.
"""
from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from dataclasses import dataclass

# what the first bytes of each format the decoder is given look like
MAGIC = (("JPEG", (b"\xff\xd8\xff",)), ("PNG", (b"\x89PNG\r\n\x1a\n",)), ("GIF", (b"GIF87a", b"GIF89a")),
         ("WEBP", (b"RIFF",)))
FORMATS = tuple(name for name, _ in MAGIC)
MIME = {"image/jpeg": "JPEG", "image/jpg": "JPEG", "image/png": "PNG", "image/gif": "GIF", "image/webp": "WEBP"}


class ImageError(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 << 20            # an image's file (a phone's 12 MP JPEG is 3-6 MB)
    max_pixels: int = 25_000_000         # width x height: a 24 MP camera photo (75 MB as RGB); 48 MP refused
    max_side: int = 16384
    max_images: int = 8                  # per request
    max_waiting: int = 16                # per caller identity: images read, decoded or encoded at once
    allow_remote: bool = False           # http(s) URLs: never fetched unless the operator says so


def count(images, limits: ImageLimits, where: str = "the request") -> None:
    if len(images) > limits.max_images:
        raise ImageError(f"{where} has {len(images)} images; at most {limits.max_images} are taken", 413)


_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,",
                       re.ASCII)


def _b64(text: str, limits: ImageLimits, where: str) -> bytes:
    # 4 characters of base64 hold 3 bytes: the decoded size is known before decoding
    if len(text) // 4 * 3 > limits.max_bytes + 3:
        raise ImageError(f"{where}: the image is over {limits.max_bytes >> 20} MiB "
                         f"(about {len(text) // 4 * 3 >> 20} MiB)", 413)
    try:
        return base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where}: the image is not valid base64") from None


def image_bytes(part, limits: ImageLimits, where: str = "the image") -> bytes:
    """The bytes of a message's `Image` part (request/messages.py): its `b64` text, or its
    `url` as a data: URL (base64). A remote URL is refused unless `limits.allow_remote`;
    even then this module does not fetch it (ImageError says so)."""
    if getattr(part, "data", None) is not None:
        if len(part.data) > limits.max_bytes:
            raise ImageError(f"{where}: the image is over {limits.max_bytes >> 20} MiB", 413)
        return bytes(part.data)
    if getattr(part, "b64", None) is not None:
        return _b64(part.b64, limits, where)
    url = part.url or ""
    if url[:5].lower() == "data:":
        m = _DATA_URL.match(url)
        if m is None or not m.group("b64"):
            raise ImageError(f"{where}: a data URL must be data:image/...;base64,<data>")
        mime = (m.group("mime") or "").lower()
        if mime not in MIME:
            raise ImageError(f"{where}: {mime or 'no media type'} is not an image type taken "
                             f"({', '.join(sorted(set(MIME.values())))})", 415)
        return _b64(url[m.end():], limits, where)
    if url[:7].lower() == "http://" or url[:8].lower() == "https://":
        if not limits.allow_remote:
            raise ImageError(f"{where}: remote image URLs are not fetched by this server; send the image itself "
                             "(a data: URL with base64)", 400)
        raise ImageError(f"{where}: remote image URLs are not fetched yet; send a data: URL", 400)
    raise ImageError(f"{where}: an image is base64 text or a data: URL")


def sniff(data: bytes) -> str | None:
    """The format the first bytes say, or None."""
    for name, heads in MAGIC:
        if any(data.startswith(h) for h in heads):
            if name == "WEBP" and data[8:12] != b"WEBP":
                return None
            return name
    return None


def decode(data: bytes, limits: ImageLimits, where: str = "the image"):
    """The bytes as a PIL RGB image (a GIF's first frame; EXIF orientation applied), or
    ImageError before any pixel is decoded when a bound or the format says no."""
    from PIL import Image, ImageOps, UnidentifiedImageError
    if len(data) > limits.max_bytes:
        raise ImageError(f"{where}: the image is over {limits.max_bytes >> 20} MiB", 413)
    fmt = sniff(data)
    if fmt is None:
        raise ImageError(f"{where}: not an image in a format taken ({', '.join(FORMATS)})", 415)
    try:
        with warnings.catch_warnings():     # (Pillow's warning at 89 MP: our own bound follows, lower)
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=[fmt])      # reads the header only
        with im:
            w, h = im.size
            if w < 1 or h < 1 or w > limits.max_side or h > limits.max_side or w * h > limits.max_pixels:
                raise ImageError(f"{where}: {w} x {h} pixels is past the limit ({limits.max_pixels:,} pixels, "
                                 f"{limits.max_side} a side)", 413)
            if fmt == "GIF":
                im.seek(0)
            im.load()
            rgb = ImageOps.exif_transpose(im) if fmt in ("JPEG", "WEBP", "PNG") else im
            return rgb.convert("RGB")
    except ImageError:
        raise
    except Image.DecompressionBombError:     # Pillow's own check, at the header: far past ours
        raise ImageError(f"{where}: its pixels are past the limit ({limits.max_pixels:,} pixels, "
                         f"{limits.max_side} a side)", 413) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"{where}: the {fmt} file is truncated or corrupt ({type(e).__name__})") from None
