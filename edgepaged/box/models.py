"""Several models on one box: loaded on their first request, unloaded when idle, within one
memory budget for weights + KV.

    models = ModelSet(specs, load, budget_bytes=..., kv_bytes=..., engine_config=..., front_config=...)
    async with trio.open_nursery() as n:
        await n.start(models.run)
        front = MultiFront(models)          # what every door talks to, as to a one-model FrontEnd

A request names its model (`model` on every door; none: the box's default, the first given).
`ModelSet.get` returns that model's FrontEnd, loading it first when it is not loaded (the
request waits like a queued one: no error). Each loaded model runs an Engine of its own with a
KV pool sized from what the budget leaves: min(kv_bytes, budget - every loaded model's
weights and KV - its own weights). When a model does not fit, the least recently used idle
models are unloaded first; when none can go (all busy), the request gets `model_unavailable`.
A model unloads after `keep_alive` seconds with nothing to do (default 300; a request's
`keep_alive` sets it for that model, Ollama's way; negative: never).
"""
from __future__ import annotations

import gc
import logging
import os
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable

import numpy as np
import trio

from ..engine import Engine, EngineConfig, RequestRejected
from ..engine.metrics import merge_prometheus
from ..request.frontend import AuthThrottle, Box, FrontEnd, FrontEndConfig

log = logging.getLogger("edgepaged.box.models")
KEEP_ALIVE_S = 300.0
IDLE_FLOOR_S = 0.5          # a model is idle this long at least before it unloads (keep_alive 0 included)
MIN_KV_BYTES = 8 << 20      # less KV than this is no model worth loading


@dataclass
class ModelSpec:
    name: str
    path: str
    size_bytes: int                       # the file's size: what its weights take, near enough
    context: int | None = None
    architecture: str | None = None
    quantization: str | None = None
    system: str | None = None             # a default system prompt (Ollama's SYSTEM, /api/create's system)
    parameters: dict | None = None        # default options (Ollama's PARAMETER lines)

    @classmethod
    def of(cls, entry) -> "ModelSpec":
        """The spec of a store.Entry that store.inspect has filled in."""
        return cls(entry.name, entry.path, entry.size_bytes, entry.context, entry.architecture, entry.quantization,
                   entry.system, entry.parameters)


class Slot:
    """One model of the set: unloaded, loading, or loaded (its FrontEnd and Engine)."""

    def __init__(self, spec: ModelSpec, keep_alive_s: float):
        self.spec, self.keep_alive_s = spec, keep_alive_s
        self.front: FrontEnd | None = None
        self.kv_bytes = 0                 # reserved from the budget while loading or loaded
        self.reserved = False
        self.lock = trio.Lock()           # one load at a time; requests for it wait on it
        self.unload_now = trio.Event()
        self.gone = trio.Event()
        self.last_used = 0.0
        self.loads = 0
        self.holds = 0                    # requests accepted for it and not yet in its engine

    @property
    def loaded(self) -> bool:
        return self.front is not None

    @property
    def engine(self) -> Engine | None:
        return self.front.engine if self.front is not None else None

    @property
    def busy(self) -> bool:
        """Requests hold it: running or waiting in its engine, or accepted and still being
        built (a model is never unloaded under a request it has taken)."""
        e = self.engine
        return self.holds > 0 or (e is not None and (bool(e.requests) or e.has_pending()))

    def footprint(self) -> int:
        return self.spec.size_bytes + self.kv_bytes if self.reserved else 0


class ModelUnavailable(RequestRejected):
    pass


class ModelSet:
    def __init__(self, specs: list[ModelSpec], load: Callable[[ModelSpec, int], object], *, budget_bytes: int,
                 kv_bytes: int, engine_config: EngineConfig | None = None, front_config: FrontEndConfig | None = None,
                 keep_alive_s: float = KEEP_ALIVE_S, grace_s: float = 10.0, check_every_s: float = 0.25):
        if not specs:
            raise ValueError("no models to serve")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"a model is named twice: {names}")
        self.slots = {s.name: Slot(s, keep_alive_s) for s in specs}
        self.keep_alive_s = keep_alive_s
        self.default = specs[0].name
        self.load_fn = load
        self.budget_bytes, self.kv_bytes = budget_bytes, kv_bytes
        self.engine_config = engine_config or EngineConfig()
        self.front_config = front_config or FrontEndConfig()
        self.throttle = AuthThrottle()        # one for the box: a wrong token is wrong for every model
        self.grace_s, self.check_every_s = grace_s, check_every_s
        self.accepting = True
        self._budget = trio.Lock()
        self._nursery: trio.Nursery | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._janitor)
            task_status.started(self)
            await trio.sleep_forever()

    async def drain(self, grace_s: float) -> int:
        """Stop taking requests; every loaded model's engine drains (at once). Returns how many
        requests were cancelled."""
        self.accepting = False
        counts = []

        async def one(engine):
            counts.append(await engine.drain(grace_s))
        async with trio.open_nursery() as n:
            for slot in self.slots.values():
                if slot.engine is not None:
                    n.start_soon(one, slot.engine)
        return sum(counts)

    # -- picking, loading, unloading --------------------------------------------------------------
    def slot(self, name: str | None) -> Slot:
        """The slot a request's `model` names (Ollama's `name:latest` too); model_not_found."""
        if not name:
            if self.default not in self.slots:
                raise RequestRejected("model_not_found", "this box has no models now; pull one")
            return self.slots[self.default]
        for candidate in (name, name.removesuffix(":latest")):
            if candidate in self.slots:
                return self.slots[candidate]
        raise RequestRejected("model_not_found", f"no model {name!r} on this box; it serves "
                              f"{', '.join(self.slots)}")

    async def get(self, name: str | None, keep_alive_s: float | None = None) -> FrontEnd:
        """The FrontEnd of the model `name`, loaded first when it is not."""
        if not self.accepting:
            raise RequestRejected("shutdown", "the server is shutting down")
        slot = self.slot(name)
        if keep_alive_s is not None:
            slot.keep_alive_s = keep_alive_s
        slot.last_used = trio.current_time()
        if slot.front is None:
            async with slot.lock:
                if slot.front is None:
                    await self._load(slot)
        slot.last_used = trio.current_time()
        return slot.front

    def _in_use(self, but: Slot) -> int:
        return sum(s.footprint() for s in self.slots.values() if s is not but)

    async def _load(self, slot: Slot) -> None:
        spec = slot.spec
        async with self._budget:       # the reservation is decided one model at a time
            need = spec.size_bytes + min(MIN_KV_BYTES, self.kv_bytes)
            if need > self.budget_bytes:
                raise ModelUnavailable("model_unavailable", f"{spec.name} needs about {_mib(need)} MiB and the box's "
                                       f"model memory is {_mib(self.budget_bytes)} MiB (serve --memory-budget)")
            while self.budget_bytes - self._in_use(slot) < need:
                idle = [s for s in self.slots.values() if s is not slot and s.loaded and not s.busy]
                if not idle:
                    busy = [s.spec.name for s in self.slots.values() if s.reserved and s is not slot]
                    raise ModelUnavailable("model_unavailable", f"{spec.name} needs about {_mib(need)} MiB and the "
                                           f"box's model memory ({_mib(self.budget_bytes)} MiB) is held by models in "
                                           f"use ({', '.join(busy)}); try again when they are idle")
                victim = min(idle, key=lambda s: s.last_used)
                log.info("unloading %s to make room for %s", victim.spec.name, spec.name)
                await self._unload(victim)
            slot.kv_bytes = min(self.kv_bytes, self.budget_bytes - self._in_use(slot) - spec.size_bytes)
            slot.reserved = True
        try:
            runner = await trio.to_thread.run_sync(self.load_fn, spec, slot.kv_bytes)
            slot.unload_now, slot.gone = trio.Event(), trio.Event()
            await self._nursery.start(self._serve, slot, runner)
        except BaseException:
            slot.reserved, slot.kv_bytes = False, 0
            raise
        slot.loads += 1
        log.info("loaded %s (KV %d MiB)", spec.name, _mib(slot.kv_bytes))

    async def _serve(self, slot: Slot, runner, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with Engine(runner, self.engine_config) as engine:
                front = FrontEnd(engine, self.front_config, self.throttle)
                await trio.to_thread.run_sync(warm, front)
                slot.front = front
                task_status.started()
                await slot.unload_now.wait()
                slot.front = None        # no new request finds it from here
                await engine.drain(self.grace_s)
        finally:
            slot.front = None
            slot.reserved, slot.kv_bytes = False, 0
            del runner
            gc.unfreeze()        # (the server freezes what a load made: the unloaded model's cycles too)
            gc.collect()
            gc.freeze()
            slot.gone.set()

    async def _unload(self, slot: Slot) -> None:
        if slot.loaded:
            slot.unload_now.set()
            await slot.gone.wait()

    async def unload(self, name: str | None) -> bool:
        """Unload a model now (Ollama's keep_alive 0 with no prompt); whether it was loaded."""
        slot = self.slot(name)
        async with slot.lock:
            was = slot.loaded
            await self._unload(slot)
            return was

    def add(self, spec: ModelSpec) -> None:
        """A model pulled, copied or created while the box runs: served from now on (a model of
        that name already here is replaced once it is idle: see `remove`)."""
        self.slots[spec.name] = Slot(spec, self.keep_alive_s)
        if self.default not in self.slots:
            self.default = spec.name

    async def remove(self, name: str) -> bool:
        """A model deleted from the store: unloaded (its requests finish first) and no longer
        served. Whether the box had it. The default model moves to the next one, if any."""
        slot = next((self.slots[n] for n in (name, name.removesuffix(":latest"), f"{name}:latest")
                     if n in self.slots), None)
        if slot is None:
            return False
        async with slot.lock:
            await self._unload(slot)
            self.slots.pop(slot.spec.name, None)
        if self.default == slot.spec.name and self.slots:
            self.default = next(iter(self.slots))
        return True

    async def _janitor(self) -> None:
        """Unload what has been idle past its keep_alive."""
        while True:
            await trio.sleep(self.check_every_s)
            now = trio.current_time()
            for slot in list(self.slots.values()):
                if not slot.loaded or slot.lock.locked():
                    continue
                if slot.busy:
                    slot.last_used = now
                elif slot.keep_alive_s >= 0 and now - slot.last_used > max(slot.keep_alive_s, IDLE_FLOOR_S):
                    log.info("unloading %s: idle for %.1f s", slot.spec.name, now - slot.last_used)
                    async with slot.lock:
                        await self._unload(slot)

    # -- what the box says about its models ---------------------------------------------------------
    def listing(self) -> list[dict]:
        now = trio.current_time()
        out = []
        for s in self.slots.values():
            e = s.engine
            out.append({"name": s.spec.name, "loaded": s.loaded, "default": s.spec.name == self.default,
                        "context_length": e.max_model_len if e is not None else s.spec.context,
                        "size_bytes": s.spec.size_bytes, "architecture": s.spec.architecture,
                        "quantization": s.spec.quantization, "kv_bytes": s.kv_bytes if s.loaded else 0,
                        "keep_alive_s": s.keep_alive_s,
                        "expires_in_s": None if not s.loaded or s.keep_alive_s < 0 else
                        round(max(0.0, s.keep_alive_s - (now - s.last_used)), 1),
                        "loads": s.loads, **file_facts(s.spec.path)})
        return out


_PARAMS: dict[tuple, int | None] = {}     # (path, mtime, size) -> parameter count (None: unreadable)
_COUNTING: set[tuple] = set()


def _count(key: tuple) -> None:
    try:
        from ..model.gguf_file import GgufFile
        f = GgufFile(key[0])
        _PARAMS[key] = sum(int(np.prod(t.shape, dtype=np.int64)) for t in f.tensors) or None
    except Exception:   # noqa: BLE001 - a list entry without a parameter count
        _PARAMS[key] = None
    finally:
        _COUNTING.discard(key)


def file_facts(path) -> dict:
    """What a model list says of a model not loaded: its file's modification time and its
    parameter count, from the GGUF header's tensor shapes (~0.2 s for a 49 k vocabulary's
    header: counted once per file in a thread of its own; a list asked before that ends has
    no count yet)."""
    try:
        st = os.stat(path)
    except (OSError, TypeError, ValueError):
        return {}
    key = (str(path), st.st_mtime, st.st_size)
    if key not in _PARAMS and key not in _COUNTING:
        if len(_PARAMS) > 1024:
            _PARAMS.clear()
        _COUNTING.add(key)
        threading.Thread(target=_count, args=(key,), name="edgepaged-model-facts", daemon=True).start()
    return {"modified": st.st_mtime, "parameters": _PARAMS.get(key)}


def warm(front: FrontEnd) -> None:
    """A freshly loaded model's grammar tokenizer, built before its first request (in a worker
    thread), and what the load made frozen out of the cyclic collector's sight."""
    front.warm_grammars()
    gc.freeze()


def _mib(n: int) -> int:
    return int(n) >> 20


class BoxEngine:
    """The doors' view of every loaded engine at once: requests go to the engine of their own
    model (`req.engine`), the load is the sum, shutdown drains them all."""

    def __init__(self, models: ModelSet):
        self.models = models

    def _engines(self) -> list[Engine]:
        return [s.engine for s in self.models.slots.values() if s.engine is not None]

    @property
    def accepting(self) -> bool:
        return self.models.accepting

    def _default_spec(self) -> Slot:
        return self.models.slots[self.models.default]

    @property
    def max_model_len(self) -> int:
        s = self._default_spec()
        return s.engine.max_model_len if s.engine is not None else (s.spec.context or 0)

    @property
    def block_size(self) -> int:
        return next((e.block_size for e in self._engines()), 16)

    @property
    def kv_capacity_blocks(self) -> int:
        return sum(e.kv_capacity_blocks for e in self._engines())

    @property
    def runner(self):
        s = self._default_spec()
        return s.engine.runner if s.engine is not None else None

    @property
    def tokenizer(self):
        s = self._default_spec()
        return s.engine.tokenizer if s.engine is not None else None

    def alive(self, limit_s: float) -> bool:
        return all(e.alive(limit_s) for e in self._engines())

    def memory(self) -> dict:
        from ..model.runtime import rss_bytes
        per = [e.memory() for e in self._engines()]
        total = {k: sum(m.get(k) or 0 for m in per) for k in ("weights_bytes", "kv_reserved_bytes", "kv_used_bytes")}
        return {**total, "rss_bytes": rss_bytes(), "budget_bytes": self.models.budget_bytes}

    def stream(self, req):
        return req.engine.stream(req)

    def stream_samples(self, req):
        return req.engine.stream_samples(req)

    def cancel(self, req) -> None:
        req.engine.cancel(req)

    async def drain(self, grace_s: float) -> int:
        return await self.models.drain(grace_s)

    def stats(self) -> dict:
        """The box's load: every loaded model's figures added up (quantiles of the default's),
        and `models`, each model's state."""
        engines = self._engines()
        per = [e.stats() for e in engines]
        base = dict(per[0]) if per else {"num_requests_running": 0, "num_requests_waiting": 0, "kv_blocks_used": 0,
                                         "kv_blocks_total": 0, "kv_blocks_free": 0, "kv_cache_usage_perc": 0.0,
                                         "tokens_per_s": 0.0, "finished": {}, "prompt_tokens": 0,
                                         "generation_tokens": 0, "num_steps": 0}
        for s in per[1:]:
            for k in ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "kv_blocks_total",
                      "kv_blocks_free", "prompt_tokens", "generation_tokens", "num_steps", "tokens_per_s",
                      "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "evictions"):
                if k in s:
                    base[k] = base.get(k, 0) + s[k]
            for reason, n in s.get("finished", {}).items():
                base.setdefault("finished", {})
                base["finished"][reason] = base["finished"].get(reason, 0) + n
        total = base.get("kv_blocks_total") or 0
        base["kv_cache_usage_perc"] = round(base.get("kv_blocks_used", 0) / total, 4) if total else 0.0
        base["max_model_len"] = self.max_model_len
        base["models"] = self.models.listing()
        base["memory_budget_bytes"] = self.models.budget_bytes
        return base

    def prometheus_text(self) -> bytes:
        """Every loaded model's exposition, merged (label model_name)."""
        return merge_prometheus([e.prometheus_text() for e in self._engines()])

    @property
    def metrics(self):
        return _NoOwnerMetrics(self._engines())


class _NoOwnerMetrics:
    """A caller's own figures over every loaded engine (FrontEnd.stats for ordinary users)."""

    def __init__(self, engines):
        self.engines = engines

    def owner_snapshot(self, owner: str) -> dict:
        snaps = [e.metrics.owner_snapshot(owner) for e in self.engines]
        if not snaps:
            return {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "finished": {}, "ttft_s": {}}
        out = dict(snaps[0])
        for s in snaps[1:]:
            for k in ("requests", "prompt_tokens", "completion_tokens"):
                out[k] += s[k]
        return out


class MultiFront(Box):
    """The box of several models: auth and identity are the box's; a request is validated,
    rendered and tokenized by its model's FrontEnd."""

    embedding_only = False                      # each model's own front end says

    def __init__(self, models: ModelSet):
        super().__init__(models.front_config, models.throttle)
        self.modelset = models
        self.engine = BoxEngine(models)

    def warm_grammars(self) -> None:
        """Each model's front end warms its own when the model loads."""

    @property
    def model(self) -> str:
        return self.modelset.default

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_prompt_tokens(self) -> int:
        ctx = self.engine.max_model_len
        return min(self.config.max_prompt_tokens or ctx - 1, ctx - 1)

    @property
    def max_tokens(self) -> int:
        ctx = self.engine.max_model_len
        return min(self.config.max_tokens or ctx, ctx)

    @asynccontextmanager
    async def _held(self, model, keep_alive_s=None):
        """The FrontEnd of the model a request names, the model held from here (while it loads
        and the request is built; the engine's `pending` holds it until the door streams it)."""
        if not isinstance(model, (str, type(None))):
            raise RequestRejected("bad_request", "model must be a string (a model's name)")
        slot = self.modelset.slot(model) if self.modelset.accepting else None
        if slot is not None:
            slot.holds += 1
        try:
            yield await self.modelset.get(model, keep_alive_s)
        finally:
            if slot is not None:
                slot.holds -= 1
                slot.last_used = trio.current_time()

    async def build(self, item, caller):
        t0 = trio.current_time()
        async with self._held(item.model, item.keep_alive_s) as front:
            waited = trio.current_time() - t0          # (its model's load, when it was not loaded)
            ticket = await front.build(item, caller)
            ticket.load_s = waited if waited > 0.001 else 0.0
            front.engine.expect(ticket.req)
            return ticket

    async def build_embeds(self, inputs, caller, truncate: bool = True, model: str | None = None):
        """`FrontEnd.build_embeds` on the model `model` names."""
        async with self._held(model) as front:
            reqs = await front.build_embeds(inputs, caller, truncate)
            for r in reqs:
                front.engine.expect(r)
            return reqs

    def models(self) -> list[dict]:
        """The protocol's `models` answer: every model of the box, loaded or not."""
        return [{"name": m["name"], "context_length": m["context_length"], "default": m["default"],
                 "loaded": m["loaded"]} for m in self.modelset.listing()]
