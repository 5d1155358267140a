"""Thinking models (Qwen3 and the like): `<think>…</think>` before the answer.

    kwargs = template_kwargs(template, think)   # enable_thinking for templates that take it
    split = ThinkSplit.of(request)              # an answer's text -> (thinking, content); None: no thinking
    thinking, content = split.feed(text)        # as the text streams; a marker cut between pieces waits
    thinking, content = split.flush()           # at the end: what was held

The Ollama door asks for it (`think`, and `message.thinking` in its answers, as Ollama does);
every door may pass `think` to the template (OpenAI: vLLM's `chat_template_kwargs`).
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def thinks(template: str | None) -> bool:
    """Whether a chat template knows thinking blocks."""
    return bool(template) and (OPEN in template or "enable_thinking" in template)


def template_kwargs(template: str | None, think: bool | None) -> dict:
    """The template's thinking switch (Qwen3's `enable_thinking`) when asked and taken."""
    if think is None or not template or "enable_thinking" not in template:
        return {}
    return {"enable_thinking": bool(think)}


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` may still grow into `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ThinkSplit:
    """One answer's text on its way out, split into thinking and content. The answer thinks
    when it opens with `<think>` (whitespace before it aside), or from its start when the
    prompt already opened the block (`inside`); thinking ends at `</think>`, and the blank
    lines after it are dropped. Text that does not open with the marker is all content."""

    def __init__(self, inside: bool = False):
        self.state = "opened" if inside else "start"      # start | opened | inside | after | content
        self.buf = ""

    @classmethod
    def of(cls, ticket) -> "ThinkSplit | None":
        """The split of a request's answer (the front end's `Ticket`), or None when it is no
        thinking model's."""
        return cls(ticket.think_open) if ticket is not None and ticket.thinking else None

    def whole(self, text: str) -> tuple[str, str]:
        """A whole answer -> (thinking, content)."""
        thinking, content = self.feed(text)
        more, rest = self.flush()
        return thinking + more, content + rest

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        thinking, content = [], []
        while self.buf:
            if self.state in ("start", "after", "opened"):
                t = self.buf.lstrip()
                if not t:
                    if self.state != "start":
                        self.buf = ""                       # blank lines around the block go
                    break                                   # only whitespace so far: wait
                if self.state == "opened":
                    self.buf, self.state = t, "inside"
                    continue
                if self.state == "start" and t.startswith(OPEN):
                    self.buf, self.state = t[len(OPEN):], "opened"
                    continue
                if self.state == "start" and OPEN.startswith(t):
                    break                                   # may still become the marker
                self.buf = t if self.state == "after" else self.buf
                self.state = "content"
            elif self.state == "inside":
                at = self.buf.find(CLOSE)
                if at >= 0:
                    thinking.append(self.buf[:at].rstrip())
                    self.buf, self.state = self.buf[at + len(CLOSE):], "after"
                    continue
                keep = _held(self.buf, CLOSE)
                out = self.buf[:len(self.buf) - keep]
                out = out.rstrip()                          # whitespace that may end the block waits
                thinking.append(out)
                self.buf = self.buf[len(out):]
                break
            else:
                content.append(self.buf)
                self.buf = ""
        return "".join(thinking), "".join(content)

    def flush(self) -> tuple[str, str]:
        """The end of the answer: what was held goes where it belongs."""
        rest, self.buf = self.buf, ""
        if self.state in ("inside", "opened"):
            return rest.strip(), ""
        if self.state == "start":
            return "", rest
        return "", rest if self.state == "content" else ""
