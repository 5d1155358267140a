"""A conversation's images into a vision model's prompt.

    held = await prepare_images(messages, runner, limits)     # bytes, decode, encode: off the loop
    ids = render(tokenizer, messages, held, template_kwargs)  # in a worker thread

Each image of the messages (the doors' template maps carry them under "images", as
`request/messages.Image`s) is read (base64 or a data: URL, within `ImageLimits`), hashed,
and looked up in the runner's `ImageTable`: an image seen recently (the same photo resent
with the conversation, as Open WebUI and Home Assistant do) is not decoded or encoded
again. A new one is decoded (`request/images.decode`: the bounds before any pixel) and
encoded by the model's `VisionEncoder` in a worker thread, one image at a time across the
server (`ENCODER`, callers' images taken round robin): a burst of camera snapshots queues
there while the engine's steps go on,
and the encoder steps aside between its layers while an interactive prompt (a voice
command) waits for its first token (the engine's `encoder_gate`).

The chat template renders each image where the family's template puts it (a content part
`{"type": "image"}`: the template writes the family's marker, a control token a message's
own text can never yield); each marker token becomes the image's own tokens (`VisionEncoder.prompt_tokens`), the
feature rows as the image's ids past the vocabulary (model/image_table.py), so the prefix
cache keys them by the image's content.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict, deque
from contextlib import asynccontextmanager

import trio

from ..model.image_table import digest
from ..model.vision import IMAGE
from .images import ImageError, ImageLimits, count, decode, image_bytes

class FairSlot:
    """One holder at a time (`async with slot.turn(who)`); waiting callers take their turns
    round robin, each caller's own in order: one camera's burst does not hold another
    caller's photo back by the whole burst."""

    def __init__(self):
        self._busy = False
        self._queues: OrderedDict[str, deque] = OrderedDict()     # caller -> its waiters, in turn order

    @asynccontextmanager
    async def turn(self, who: str):
        if not self._busy and not self._queues:
            self._busy = True
        else:
            ev = trio.Event()
            self._queues.setdefault(who, deque()).append(ev)
            try:
                await ev.wait()
            except BaseException:
                if ev.is_set():          # handed the slot as it was cancelled: hand it on
                    self._next()
                else:
                    q = self._queues.get(who)
                    if q is not None and ev in q:
                        q.remove(ev)
                        if not q:
                            del self._queues[who]
                raise
        try:
            yield
        finally:
            self._next()

    def _next(self) -> None:
        if not self._queues:
            self._busy = False
            return
        who, q = next(iter(self._queues.items()))
        ev = q.popleft()
        if q:
            self._queues.move_to_end(who)       # its next image after the other callers'
        else:
            del self._queues[who]
        ev.set()                                # (still busy: the slot is handed over)

    def waiting(self) -> int:
        return sum(len(q) for q in self._queues.values())


ENCODER = FairSlot()                   # images encoded at once, server-wide: one
_WAITING: dict[str, int] = {}          # per caller identity: its images being read, decoded or encoded
GATE_WAIT_S = 2.0                      # the most an encoder waits for interactive prompts at one pause
_PROBE = "\x02probe\x03"


class ImagesHeld:
    """The images of one request's prompt, held in the table (never evicted) until its
    request ends (`release`) or this object is dropped (a request that never ran)."""

    def __init__(self, table, items: list):
        self.items = items                       # [(base, layout)] in prompt order
        self.bases = [b for b, _ in items]
        self._done = weakref.finalize(self, table.release, list(self.bases))

    def release(self) -> None:
        self._done()


def has_images(messages) -> bool:
    return any(m.get("images") for m in messages or ())


def _read(img, limits: ImageLimits, where: str) -> tuple[bytes, bytes]:
    data = image_bytes(img, limits, where)
    return data, digest(data)


def _encode(enc, table, key: bytes, data: bytes, limits: ImageLimits, where: str, gate=None) -> tuple[int, object]:
    got = table.get(key, hold=True)          # (encoded meanwhile by another request)
    if got is not None:
        return got[0], got[2]
    img = decode(data, limits, where)
    try:
        pixels, layout = enc.pixels(img)
    except ImageError:
        raise
    except ValueError as e:        # (a shape the family cannot take: Qwen2.5-VL's aspect bound)
        raise ImageError(f"{where}: {e}") from None
    pause = None
    if gate is not None:
        def pause():   # between two layers: while a voice command waits for its first token
            gate.wait(GATE_WAIT_S)
    return table.put(key, enc.encode(pixels, pause), layout, hold=True), layout


async def prepare_images(messages: list[dict], runner, limits: ImageLimits, gate=None, who: str | None = None
                         ) -> ImagesHeld:
    """Every image of `messages`, read, found or encoded, and held; ImageError (its status:
    400, 413, 415; 429 past `limits.max_waiting` images of one caller `who` at once, before any
    work) for an image that breaks a bound or is no image. `gate` (a threading.Event: the
    engine's `encoder_gate`): the encoder runs its layers while it is set, and waits at most
    GATE_WAIT_S at each of its pauses while not (an interactive prompt first)."""
    parts = [(i, img) for i, m in enumerate(messages) for img in (m.get("images") or ())]
    count([p for _, p in parts], limits)
    if who is None:
        return await _prepare(parts, runner, limits, gate, "")
    waiting = _WAITING.get(who, 0)
    if waiting + len(parts) > limits.max_waiting:
        raise ImageError(f"{waiting} of your images are waiting for the image encoder already (at most "
                         f"{limits.max_waiting} at once); send this one when some are done", 429)
    _WAITING[who] = waiting + len(parts)
    try:
        return await _prepare(parts, runner, limits, gate, who)
    finally:
        left = _WAITING[who] - len(parts)
        if left:
            _WAITING[who] = left
        else:
            del _WAITING[who]


async def _prepare(parts: list, runner, limits: ImageLimits, gate, who: str) -> ImagesHeld:
    enc, table = runner.vision, runner.images
    items: list = []
    held = ImagesHeld(table, items)         # (releases what was held if a later image fails)
    for j, (i, img) in enumerate(parts):
        where = f"messages[{i}]'s image" + (f" {j + 1}" if len(parts) > 1 else "")
        data, key = await trio.to_thread.run_sync(_read, img, limits, where)   # (a 20 MiB hash: off the loop)
        got = table.get(key, hold=True)
        if got is not None:
            base, layout = got[0], got[2]
        else:
            async with ENCODER.turn(who):
                base, layout = await trio.to_thread.run_sync(_encode, enc, table, key, data, limits, where, gate)
        items.append((base, layout))
        held.bases.append(base)
        held._done.detach()
        held._done = weakref.finalize(held, table.release, list(held.bases))
    return held


def _renders(tok, content) -> bool:
    try:
        text = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=False,
                                       tokenize=False)
    except Exception:   # noqa: BLE001 - a template that refuses the shape does not take it
        return False
    return _PROBE in text


def template_shapes(tok) -> tuple[bool, bool]:
    """(takes typed content parts, takes string content) for this tokenizer's template."""
    shapes = getattr(tok, "_content_shapes", None)
    if shapes is None:
        shapes = tok._content_shapes = (_renders(tok, [{"type": "text", "text": _PROBE}]), _renders(tok, _PROBE))
    return shapes


def template_messages(tok, messages: list[dict]) -> list[dict]:
    """The maps the chat template renders: each image a typed content part
    (`{"type": "image"}`, where the family's template writes its marker), the text a text
    part (or a string, for a template that reads strings too)."""
    typed, strings = template_shapes(tok)
    if not typed:
        raise ImageError("this model's chat template takes no image parts (content as a list of "
                         "{\"type\": \"image\"} and text parts), so it cannot place an image")
    out = []
    for m in messages:
        m = dict(m)
        images = m.pop("images", None) or ()
        text = m.get("content") or ""
        if images:
            m["content"] = [{"type": "image"} for _ in images] + ([{"type": "text", "text": text}] if text else [])
        elif not strings and isinstance(text, str):
            m["content"] = [{"type": "text", "text": text}]
        out.append(m)
    return out


def expand(ids: list[int], marker_id: int, held: ImagesHeld, enc, tok) -> list[int]:
    """Each marker token -> its image's tokens, the feature rows as the image's ids."""
    at = [i for i, t in enumerate(ids) if t == marker_id]
    if len(at) != len(held.items):
        raise ImageError(f"the chat template placed {len(at)} image markers for {len(held.items)} images")
    out, prev = [], 0
    for i, (base, layout) in zip(at, held.items):
        out += ids[prev:i]
        k = 0
        for t in enc.prompt_tokens(layout, tok):
            if t == IMAGE:
                out.append(base + k)
                k += 1
            else:
                out.append(t)
        prev = i + 1
    return out + ids[prev:]


def render(tok, messages: list[dict], held: ImagesHeld, enc, **kwargs) -> list[int]:
    """The prompt's ids: the template rendered with the images' markers, each expanded."""
    marker_id = tok.tok.token_to_id(enc.marker)
    if marker_id is None:
        raise ImageError(f"this model's tokenizer has no {enc.marker} token: it does not go with {enc.path.name}")
    ids = tok.apply_chat_template(template_messages(tok, messages), **kwargs)
    return expand(ids, marker_id, held, enc, tok)
