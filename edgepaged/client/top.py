"""`edgepaged top`: one screen of the server's state from a stats snapshot."""
from __future__ import annotations

import select
import time
from contextlib import contextmanager


class _Keys:
    def __init__(self, fd):
        self.fd, self.live = fd, fd is not None

    def wait(self, seconds: float) -> str | None:
        """Sleep `seconds`, or less when a key is pressed; the key, or None."""
        if self.fd is None:
            time.sleep(seconds)
            return None
        ready, _, _ = select.select([self.fd], [], [], seconds)
        if not ready:
            return None
        import os
        data = os.read(self.fd, 16)
        return data.decode(errors="replace")[:1] if data else None


@contextmanager
def keys(stream):
    """Single key presses from a terminal (cbreak mode, no echo) for `top`; none elsewhere."""
    try:
        import termios
        import tty
        if not stream.isatty():
            raise OSError
        fd = stream.fileno()
        old = termios.tcgetattr(fd)
    except (ImportError, OSError, ValueError, AttributeError):
        yield _Keys(None)
        return
    try:
        tty.setcbreak(fd)
        yield _Keys(fd)
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


def _bar(frac: float, width: int = 30) -> str:
    n = round(max(0.0, min(1.0, frac)) * width)
    return "[" + "#" * n + "." * (width - n) + "]"


def render(s: dict, address: str = "", info: dict | None = None) -> str:
    info = info or {}
    used, total = s.get("kv_blocks_used", 0), s.get("kv_blocks_total", 0) or 1
    ttft, tpot = s.get("ttft_s", {}), s.get("tpot_s", {})
    server = s.get("server", {})
    lines = [
        f"edgepaged {address}  {info.get('model', '')}  up {s.get('uptime_s', 0):.0f} s  "
        f"connections {server.get('connections', '?')}",
        f"requests   running {s.get('num_requests_running', 0):>4}   waiting {s.get('num_requests_waiting', 0):>4}"
        f"   finished {sum(s.get('finished', {}).values())}",
        f"KV blocks  {_bar(used / total)} {used}/{total} used, {s.get('kv_blocks_cached', 0)} cached "
        f"({s.get('block_size', '?')} tokens each)",
        f"prefix     hit rate {100 * s.get('prefix_cache_hit_rate', 0):5.1f}%   "
        f"({s.get('prefix_cache_hits', 0)} of {s.get('prefix_cache_queries', 0)} prompt tokens)",
        f"preempted  {s.get('num_preemptions', 0)}   evictions {s.get('evictions', 0)}",
        f"speed      {s.get('tokens_per_s', 0):.1f} tokens/s   generated {s.get('generation_tokens', 0)}",
        f"latency    TTFT p50 {1000 * ttft.get('p50', 0):.0f} ms  p90 {1000 * ttft.get('p90', 0):.0f} ms   "
        f"TPOT p50 {1000 * tpot.get('p50', 0):.0f} ms",
    ]
    return "\n".join(lines)
