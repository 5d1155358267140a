"""Answers rendered as Markdown in a terminal, as they stream (`ask` and `chat`).

A streamed answer is cut into blocks: a paragraph (or list, heading, quote) ends at a blank line, a
fenced code block at its closing fence. A finished block is printed once, rendered by `rich`
(code highlighted, lists, emphasis); the block still being written shows as raw text below it, in
a live area that is redrawn as tokens arrive and erased when the block is complete. The raw area
shows at most a screenful (its last lines), so it can always be erased.

`writer_for(stream, plain)` picks this when the stream is a terminal, plain text otherwise
(`--plain`, a pipe, a file).
"""
from __future__ import annotations

import re
import sys
import time

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


class Blocks:
    """Cuts streamed Markdown into finished blocks."""

    def __init__(self):
        self.lines: list[str] = []     # complete lines of the block being written
        self.partial = ""              # the line being written
        self.fence: str | None = None  # the opening fence while inside a code block

    def feed(self, text: str) -> list[str]:
        done = []
        self.partial += text
        while "\n" in self.partial:
            line, self.partial = self.partial.split("\n", 1)
            done += self._line(line)
        return done

    def _line(self, line: str) -> list[str]:
        if self.fence is not None:
            self.lines.append(line)
            m = FENCE.match(line)
            if m and m.group(1)[0] == self.fence[0] and len(m.group(1)) >= len(self.fence) \
                    and not line[m.end():].strip():
                self.fence = None
                return [self._take()]
            return []
        out = []
        m = FENCE.match(line)
        if m:
            if self.lines:
                out.append(self._take())
            self.fence = m.group(1)
            self.lines.append(line)
        elif not line.strip():
            if self.lines:
                out.append(self._take())
        else:
            self.lines.append(line)
        return out

    def _take(self) -> str:
        block, self.lines = "\n".join(self.lines), []
        return block

    def pending(self) -> str:
        return "\n".join(self.lines + [self.partial]) if self.lines else self.partial

    def close(self) -> str:
        """What is left (an unfinished block), for rendering as it is."""
        rest = self.pending()
        self.lines, self.partial, self.fence = [], "", None
        return rest


class PlainWriter:
    def __init__(self, stream):
        self.stream = stream

    def write(self, piece: str) -> None:
        self.stream.write(piece)
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


class MarkdownWriter:
    REFRESH_S = 0.05

    def __init__(self, stream):
        from rich.console import Console
        self.console = Console(file=stream, force_terminal=True, highlight=False, soft_wrap=False)
        self.blocks = Blocks()
        self.live = None
        self.gap = False              # a blank line is due before the next block
        self.last_draw = 0.0

    def write(self, piece: str) -> None:
        for block in self.blocks.feed(piece):
            self._print_block(block)
        self._draw()

    def close(self) -> None:
        self._print_block(self.blocks.close())
        self.console.file.flush()

    def _print_block(self, block: str) -> None:
        from rich.markdown import Markdown
        if self.live is not None:
            self.live.stop()          # transient: the raw text is erased
            self.live = None
        if not block.strip():
            return
        with self.console.capture() as cap:
            self.console.print(Markdown(block, code_theme="ansi_dark", hyperlinks=False))
        lines = cap.get().split("\n")
        while lines and not lines[-1].strip(" "):   # rich puts blank lines around some blocks: the gaps are ours
            lines.pop()
        while lines and not lines[0].strip(" "):
            lines.pop(0)
        self._gap()
        self.console.file.write("\n".join(lines) + "\n")
        self.gap = True

    def _gap(self) -> None:
        if self.gap:
            self.console.print()
            self.gap = False

    def _draw(self) -> None:
        from rich.live import Live
        from rich.text import Text
        now = time.monotonic()
        if now - self.last_draw < self.REFRESH_S:
            return
        self.last_draw = now
        raw = self.blocks.pending()
        if not raw:
            return
        lines = list(Text(raw).wrap(self.console, max(self.console.width - 1, 10)))
        shown = Text("\n").join(lines[-max(self.console.height - 2, 3):])   # a screenful at most: erasable
        if self.live is None:
            self._gap()               # before the live area, so it stays when the area is erased
            self.live = Live(shown, console=self.console, transient=True, auto_refresh=False,
                             vertical_overflow="visible")
            self.live.start()
        self.live.update(shown, refresh=True)


def writer_for(stream, plain: bool = False):
    """Markdown in a terminal; plain text with `plain` or when `stream` is no terminal."""
    isatty = getattr(stream, "isatty", None)
    if plain or not (isatty and isatty()):
        return PlainWriter(stream)
    try:
        import rich  # noqa: F401
    except ImportError:
        return PlainWriter(stream)
    return MarkdownWriter(stream)


class ThinkingView:
    """A thinking model's thinking, shown before its answer as `ollama run` does: between
    "Thinking..." and "...done thinking.", dim on a terminal; on stderr when stdout is no
    terminal (a pipe gets the answer only); nowhere with `hide`."""

    def __init__(self, out, plain: bool = False, hide: bool = False):
        tty = bool(getattr(out, "isatty", None) and out.isatty())
        self.stream = out if tty else sys.stderr
        self.dim = tty and not plain
        self.hide, self.open = hide, False

    def _put(self, text: str) -> None:
        self.stream.write(f"\x1b[2m{text}\x1b[0m" if self.dim else text)
        self.stream.flush()

    def write(self, text: str) -> None:
        if self.hide or not text:
            return
        if not self.open:
            self.open = True
            self._put("Thinking...\n")
        self._put(text)

    def pass_on(self, thinking: str, piece: str, writer) -> None:
        """One streamed piece: its thinking here, its answer to `writer` (which ends the thinking)."""
        self.write(thinking)
        if piece and writer is not None:
            self.close()
            writer.write(piece)

    def close(self) -> None:
        if self.open:
            self.open = False
            self._put("\n...done thinking.\n\n")
