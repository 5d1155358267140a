"""Messages cut to one line: what a client or the log is told of an exception or a library's
message (never a traceback, never a parser's state dump)."""
from __future__ import annotations


def first_line(text: str | None, most: int = 200, default: str = "") -> str:
    """`text`'s first non-empty line, at most `most` characters (…-cut), else `default`."""
    stripped = (text or "").strip()
    line = stripped.splitlines()[0] if stripped else default
    return line if len(line) <= most else line[: most - 1] + "…"


def names(items, most: int = 8, each: int = 40) -> str:
    """Names for a message, bounded: the first `most`, each cut to `each` characters, and how
    many there are in all (an error that echoed every unknown field of a 100 k-field frame was
    789 KB)."""
    items = list(items)
    shown = ", ".join(first_line(str(x), each, "''") for x in items[:most])
    return shown if len(items) <= most else f"{shown}, … ({len(items)} in all)"


def of(e: BaseException, most: int = 200) -> str:
    """An exception as one line: its type and first line."""
    return first_line(f"{type(e).__name__}: {e}", most)
