"""One message model every door maps onto: a chat turn's role, its text, its images, an
assistant's tool calls, a tool result's call id and tool name, an assistant's thinking.

Each door parses its own shapes (OpenAI's content parts, Ollama's `images` and `tool_name`,
the Responses API's items, the msgpack protocol's maps) into `Message`s; what a conversation
may hold is checked once, here, and `template()` gives the map a chat template renders
(`template_maps`: a message's images ride along under "images", for the front end: a
vision model's prompt takes them, request/vision_prompt.py; a text-only model refuses them
there, naming itself). Where no image can go (a raw prompt, fill in the middle), the door
refuses them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_CALLS = 128          # tool calls on one assistant message
MAX_ROLE_LEN = 32


class MessageError(ValueError):
    """A message that breaks a rule; the text names it (messages[i]...)."""


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str | dict         # as the door gave them: a JSON text (OpenAI) or an object (Ollama)


@dataclass(frozen=True)
class Image:
    """An image as a door gave it, not yet decoded or fetched: `b64` (base64 text: Ollama's
    `images`), `url` (a data: URL or a link: OpenAI's image_url, the Responses API's
    input_image) or `data` (the file's bytes: the msgpack protocol's)."""
    b64: str | None = None
    url: str | None = None
    data: bytes | None = field(default=None, repr=False)


@dataclass
class Message:
    role: str                     # system | user | assistant | tool (a door maps its own: developer -> system)
    text: str = ""
    images: tuple[Image, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None   # a tool result: the call it answers
    name: str | None = None           # a tool result: the tool's name
    thinking: str | None = None       # an assistant turn's thinking, when a door sends it back
    where: str = field(default="", compare=False, repr=False)   # "messages[3]": for errors

    def __post_init__(self):
        w = self.where or "message"
        if not isinstance(self.role, str) or not 0 < len(self.role) <= MAX_ROLE_LEN:
            raise MessageError(f"{w}.role must be a string of 1..{MAX_ROLE_LEN} characters")
        if not isinstance(self.text, str):
            raise MessageError(f"{w}.content must be a string")
        if self.tool_calls and (self.role != "assistant" or len(self.tool_calls) > MAX_CALLS):
            raise MessageError(f"{w}.tool_calls must be a list, on an assistant message")
        for key in ("tool_call_id", "name", "thinking"):
            v = getattr(self, key)
            if v is not None and not isinstance(v, str):
                raise MessageError(f"{w}.{key} must be a string")

    def template(self) -> dict:
        """The map a chat template renders: role, content, OpenAI-shaped tool_calls, a tool
        result's tool_call_id and name; its images under "images" (`Image`s, read later)."""
        out: dict = {"role": self.role, "content": self.text}
        if self.images:
            out["images"] = tuple(self.images)
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def tool_calls(calls, i: int) -> tuple[ToolCall, ...]:
    """OpenAI's (and Ollama's, and the msgpack protocol's) tool calls of message i, an
    assistant turn: [{"id"?, "function": {"name", "arguments"?}}]; a call without an id gets
    call_I_J."""
    where = f"messages[{i}]"
    if calls is None:
        return ()
    if not isinstance(calls, list) or len(calls) > MAX_CALLS:
        raise MessageError(f"{where}.tool_calls must be a list, on an assistant message")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments", {}), (str, dict)):
            raise MessageError(f"{where}.tool_calls[{j}] must have function.name and function.arguments")
        out.append(ToolCall(c.get("id") if isinstance(c.get("id"), str) else f"call_{i}_{j}", fn["name"],
                            fn.get("arguments", {})))
    return tuple(out)


def from_map(m: dict, i: int, text: str | None = None, images: tuple[Image, ...] = ()) -> Message:
    """A message in the schema's own shape (the msgpack protocol's; the doors' after their
    content is made text): role, content, tool_calls, tool_call_id, name (or Ollama's
    tool_name), thinking. `text` (default: content, None as "") and `images`: what a door made
    of the content."""
    where = f"messages[{i}]"
    if text is None:
        text = m.get("content")
        text = "" if text is None else text
    name = m.get("name") if m.get("tool_name") is None else m.get("tool_name")
    return Message(m["role"], text, images, tool_calls(m.get("tool_calls"), i), m.get("tool_call_id"), name,
                   m.get("thinking") if isinstance(m.get("thinking"), str) else None, where)


def template_maps(messages: list[Message]) -> list[dict]:
    """The template maps of a conversation, images included (the front end checks them
    against the model: request/vision_prompt.py)."""
    return [m.template() for m in messages]
