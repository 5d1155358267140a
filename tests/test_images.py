"""Images from a request's text to RGB pixels (`request/images.py`), and hostile ones refused
before the work they would cost: real files written by Pillow (JPEG with an EXIF rotation,
PNG, WebP, an animated GIF), a decompression bomb (a tiny PNG declaring 100,000 x 100,000
pixels), truncated and corrupt files, formats not taken, oversized base64, remote URLs."""
import base64
import io
import struct
import time
import zlib

import pytest
from PIL import Image as PILImage

from edgepaged.request.images import ImageError, ImageLimits, count, decode, image_bytes, sniff
from edgepaged.request.messages import Image

LIMITS = ImageLimits()


def _file(fmt: str, size=(64, 48), **kw) -> bytes:
    im = PILImage.new("RGB", size)
    for x in range(size[0]):                      # a gradient: left dark, right bright
        for y in range(0, size[1], 8):
            im.putpixel((x, y), (4 * x % 256, 0, 0))
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _png_bomb(w=100_000, h=100_000) -> bytes:
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 1000)) + \
        chunk(b"IEND", b"")


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF"])
def test_each_format_taken_decodes_to_rgb(fmt):
    data = _file(fmt)
    assert sniff(data) == fmt
    im = decode(data, LIMITS)
    assert im.mode == "RGB" and im.size == (64, 48)


def test_exif_orientation_is_applied_and_a_gif_gives_its_first_frame():
    exif = PILImage.Exif()
    exif[0x0112] = 6                                  # rotate 90 degrees clockwise to display
    im = decode(_file("JPEG", exif=exif.tobytes()), LIMITS)
    assert im.size == (48, 64)
    frames = [PILImage.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    first = decode(buf.getvalue(), LIMITS)
    assert first.getpixel((0, 0))[0] > 200 and first.getpixel((0, 0))[2] < 50


def test_a_decompression_bomb_is_refused_before_any_pixel_is_decoded():
    t = time.perf_counter()
    with pytest.raises(ImageError, match="pixels are past the limit") as e:
        decode(_png_bomb(), LIMITS)                   # (Pillow's own check: far past ours)
    assert e.value.status == 413 and time.perf_counter() - t < 0.5
    with pytest.raises(ImageError, match="6000 x 5000 pixels is past the limit") as e:
        decode(_png_bomb(6000, 5000), LIMITS)         # ours: 30 M pixels against 25 M
    assert e.value.status == 413 and time.perf_counter() - t < 0.5
    with pytest.raises(ImageError, match="a side"):
        decode(_png_bomb(20_000, 10), LIMITS)


@pytest.mark.parametrize("what", ["truncated", "corrupt", "bmp", "tiff", "svg", "empty", "webp-lookalike"])
def test_broken_files_and_formats_not_taken_are_refused(what):
    data = {"truncated": _file("JPEG", (256, 256))[:700], "corrupt": _file("PNG")[:40] + b"\0" * 200,
            "bmp": _file("BMP"), "tiff": _file("TIFF"), "svg": b"<svg xmlns='http://www.w3.org/2000/svg'/>",
            "empty": b"", "webp-lookalike": b"RIFF\0\0\0\0WAVEfmt "}[what]
    with pytest.raises(ImageError) as e:
        decode(data, LIMITS)
    assert e.value.status in (400, 415)
    assert ("truncated or corrupt" in str(e.value)) == (what in ("truncated", "corrupt"))


def test_the_text_is_bounded_before_it_is_decoded_and_remote_urls_are_not_fetched():
    small = _file("PNG")
    b64 = base64.b64encode(small).decode()
    assert image_bytes(Image(b64=b64), LIMITS) == small
    assert image_bytes(Image(url="data:image/png;base64," + b64), LIMITS) == small
    tiny = ImageLimits(max_bytes=1000)
    with pytest.raises(ImageError, match="over 0 MiB") as e:
        image_bytes(Image(b64="A" * 4000), tiny)
    assert e.value.status == 413
    with pytest.raises(ImageError, match="not valid base64"):
        image_bytes(Image(b64="not base64!"), LIMITS)
    with pytest.raises(ImageError, match="text/plain is not an image type") as e:
        image_bytes(Image(url="data:text/plain;base64,aGk="), LIMITS)
    assert e.value.status == 415
    with pytest.raises(ImageError, match="must be data:image"):
        image_bytes(Image(url="data:image/png,rawbytes"), LIMITS)
    for url in ("http://192.0.2.1/cam.jpg", "https://example.org/a.png"):     # refused, never fetched
        with pytest.raises(ImageError, match="not fetched"):
            image_bytes(Image(url=url), LIMITS)
    with pytest.raises(ImageError, match="base64 text or a data: URL"):
        image_bytes(Image(url="file:///etc/passwd"), LIMITS)
    with pytest.raises(ImageError, match="at most 8") as e:
        count([Image(b64=b64)] * 9, LIMITS)
    assert e.value.status == 413
    with pytest.raises(ImageError, match="over 0 MiB"):
        decode(small * 10, ImageLimits(max_bytes=100))
