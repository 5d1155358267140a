"""Worker-thread lanes: which blocking work may run beside the event loop, and how much at once.

Trio's default limiter (40 threads) is shared by everything that calls `trio.to_thread`
without a limiter of its own; each kind of work below has its own, so none can take another's
threads (the engine's steps have theirs: `Engine.threads`).

- PREPARE: a request's preparation that holds the GIL in Python or in C calls that never let
  it go (a large body's JSON, a format's measuring, a chat template's rendering): one at a
  time, in arrival order. Several such threads at once left the event loop waiting its turn
  behind each of them (eight clients sending 200 KB schemas: /health 150-270 ms late); one
  leaves it a turn every switch interval. Tokenizing releases the GIL (`Tokenizer.encode`).
- MANAGE: the model store's blocking work (downloads, hashing, copying files): a slow disk or
  a file that never ends takes at most these threads.
"""
from __future__ import annotations

import trio

PREPARE = trio.CapacityLimiter(1)
MANAGE = trio.CapacityLimiter(4)
