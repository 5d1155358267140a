"""An image file as a client sends it over the msgpack protocol: its bytes as they are when
they fit one frame beside the conversation, else re-encoded smaller (a JPEG, its longest edge
at most 2048 pixels, lower quality or size until it fits): a vision model sees at most that
much of a photo anyway (SmolVLM's longest edge is 2048, Gemma 3's 896)."""
from __future__ import annotations

import io
from pathlib import Path

from ..request.protocol import MAX_FRAME_BYTES

FRAME_ROOM = 64 << 10          # kept for the rest of the frame: the conversation and the fields
LONGEST = 2048


def image_for_frame(path, budget: int | None = None) -> bytes:
    """The bytes to send for the image file at `path` (ValueError: not an image, or unreadable)."""
    budget = budget or MAX_FRAME_BYTES - FRAME_ROOM
    data = Path(path).expanduser().read_bytes()
    from ..request.images import sniff
    if sniff(data) is None:
        raise ValueError(f"{path}: not an image in a format taken (JPEG, PNG, WebP, GIF)")
    if len(data) <= budget:
        return data
    from PIL import Image, ImageOps
    try:
        with Image.open(io.BytesIO(data)) as im:
            im = ImageOps.exif_transpose(im).convert("RGB")
    except Exception as e:   # noqa: BLE001 - said as the file's problem
        raise ValueError(f"{path}: the image cannot be read ({type(e).__name__})") from None
    longest = LONGEST
    while True:
        scaled = im.copy()
        scaled.thumbnail((longest, longest), Image.Resampling.LANCZOS)
        for quality in (90, 80, 70):
            out = io.BytesIO()
            scaled.save(out, "JPEG", quality=quality)
            if out.tell() <= budget:
                return out.getvalue()
        longest = longest * 3 // 4
