"""The engine as the doors and the front end see it (`EngineView`): one model's `Engine`, or
the several models' `box.models.BoxEngine`, which sends each request to its own model's
engine. Nothing else of an engine is asked from above it."""
from __future__ import annotations

from typing import Any, Protocol


class EngineView(Protocol):
    accepting: bool               # False once shutting down: new requests are refused (503)
    max_model_len: int
    block_size: int
    kv_capacity_blocks: int
    runner: Any                   # the (default) model's runner (model.runtime.Runner), or None
    tokenizer: Any
    metrics: Any                  # engine.metrics.Metrics (its owner_snapshot for a caller's own figures)

    def alive(self, limit_s: float) -> bool: ...

    def memory(self) -> dict: ...

    def stream(self, req): ...

    def stream_samples(self, req): ...

    def cancel(self, req) -> None: ...

    async def drain(self, grace_s: float) -> int: ...

    def stats(self) -> dict: ...

    def prometheus_text(self) -> bytes: ...
