"""Engine metrics, named as vLLM names them where a name exists.

One `Metrics` per engine, with its own Prometheus registry (so tests can run many engines in
one process). `snapshot()` is a plain dict for the protocol's `stats`; `prometheus_text()`
is the exposition format for `GET /metrics`.
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


def _quantiles(values, qs=(0.5, 0.9, 0.99)) -> dict[str, float]:
    if not values:
        return {f"p{int(q * 100)}": 0.0 for q in qs}
    s = sorted(values)
    return {f"p{int(q * 100)}": round(s[min(len(s) - 1, int(q * len(s)))], 6) for q in qs}


class Metrics:
    def __init__(self, model_name: str = ""):
        self.registry = r = CollectorRegistry()
        lbl = ["model_name"]
        self.model_name = model_name
        g = lambda name, doc: Gauge(f"edgepaged:{name}", doc, lbl, registry=r).labels(model_name)  # noqa: E731
        c = lambda name, doc: Counter(f"edgepaged:{name}", doc, lbl, registry=r).labels(model_name)  # noqa: E731
        self.num_requests_running = g("num_requests_running", "Requests holding KV blocks")
        self.num_requests_waiting = g("num_requests_waiting", "Requests waiting for admission")
        self.kv_cache_usage_perc = g("kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)")
        self.kv_blocks_used = g("kv_blocks_used", "KV blocks in use")
        self.kv_blocks_total = g("kv_blocks_total", "KV blocks in the pool")
        self.prefix_cache_queries = c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = c("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.num_preemptions = c("num_preemptions", "Preemptions (by recompute)")
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = c("generation_tokens", "Generated tokens")
        self.request_success = Counter("edgepaged:request_success", "Finished requests by finish reason",
                                       lbl + ["finished_reason"], registry=r)
        h = lambda name, doc, b: Histogram(f"edgepaged:{name}", doc, lbl, buckets=b, registry=r).labels(model_name)  # noqa: E731
        self.queue_time = h("request_queue_time_seconds", "Time from arrival to first schedule", _LATENCY_BUCKETS)
        self.ttft = h("time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.tpot = h("time_per_output_token_seconds", "Time per output token after the first", _TPOT_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "End-to-end request latency", _LATENCY_BUCKETS)
        # plain-Python mirrors for the snapshot
        self.counts = dict(prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, prompt_tokens=0,
                           generation_tokens=0, num_steps=0)
        self.finished: dict[str, int] = {}
        self.recent: dict[str, deque] = {k: deque(maxlen=2048) for k in ("queue_s", "ttft_s", "tpot_s", "e2e_s")}
        self.started = time.monotonic()
        self._tok_window: deque = deque()   # (time, tokens) of recent steps, for tokens/s
        self.max_running = 0
        self.waste_sum, self.waste_steps = 0.0, 0   # reserved-but-unused KV slot fraction, summed over steps
        self.owners: OrderedDict[str, dict] = OrderedDict()   # per caller (request.owner), most recent last

    def _inc(self, name: str, n: int) -> None:
        if n:
            getattr(self, name).inc(n)
            self.counts[name] += n

    def on_step(self, *, running: int, waiting: int, blocks_used: int, blocks_total: int, generated: int,
                preemptions: int, reserved_slots: int, unused_slots: int) -> None:
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        self.kv_blocks_used.set(blocks_used)
        self.kv_blocks_total.set(blocks_total)
        self.kv_cache_usage_perc.set(blocks_used / blocks_total if blocks_total else 0)
        self._inc("generation_tokens", generated)
        self._inc("num_preemptions", preemptions)
        self.counts["num_steps"] += 1
        self.max_running = max(self.max_running, running)
        if reserved_slots:
            self.waste_sum += unused_slots / reserved_slots
            self.waste_steps += 1
        now = time.monotonic()
        self._tok_window.append((now, generated))
        while self._tok_window and now - self._tok_window[0][0] > 10:
            self._tok_window.popleft()

    def on_admit(self, prompt_tokens: int, cached_tokens: int, prefix_caching: bool) -> None:
        if prefix_caching:
            self._inc("prefix_cache_queries", prompt_tokens)
            self._inc("prefix_cache_hits", cached_tokens)

    def on_finish(self, reason: str, prompt_tokens: int, timings: dict[str, float], first_token: bool,
                  owner: str = "", completion_tokens: int = 0) -> None:
        self._on_owner(owner, reason, prompt_tokens, completion_tokens, timings if first_token else None)
        self.request_success.labels(self.model_name, reason).inc()
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self._inc("prompt_tokens", prompt_tokens)
        self.queue_time.observe(timings["queue_s"])
        self.e2e.observe(timings["e2e_s"])
        self.recent["queue_s"].append(timings["queue_s"])
        self.recent["e2e_s"].append(timings["e2e_s"])
        if first_token:
            self.ttft.observe(timings["ttft_s"])
            self.recent["ttft_s"].append(timings["ttft_s"])
            if timings["tpot_s"]:
                self.tpot.observe(timings["tpot_s"])
                self.recent["tpot_s"].append(timings["tpot_s"])

    MAX_OWNERS = 256

    def _on_owner(self, owner: str, reason: str, prompt_tokens: int, completion_tokens: int, timings) -> None:
        """A caller's own figures (its requests only), for the stats it may see."""
        o = self.owners.pop(owner, None) or {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                             "finished": {}, "ttft_s": deque(maxlen=256)}
        o["requests"] += 1
        o["prompt_tokens"] += prompt_tokens
        o["completion_tokens"] += completion_tokens
        o["finished"][reason] = o["finished"].get(reason, 0) + 1
        if timings is not None:
            o["ttft_s"].append(timings["ttft_s"])
        self.owners[owner] = o
        while len(self.owners) > self.MAX_OWNERS:
            self.owners.popitem(last=False)

    def owner_snapshot(self, owner: str) -> dict:
        o = self.owners.get(owner)
        if o is None:
            return {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "finished": {},
                    "ttft_s": _quantiles([])}
        return {**{k: v for k, v in o.items() if k != "ttft_s"}, "finished": dict(o["finished"]),
                "ttft_s": _quantiles(o["ttft_s"])}

    def tokens_per_s(self, now: float | None = None) -> float:
        """Tokens generated per second over the last 10 s up to now: it falls to 0 when the
        box goes idle (no steps), instead of keeping the last busy figure."""
        now = time.monotonic() if now is None else now
        w = [(t, n) for t, n in self._tok_window if now - t <= 10]
        if not w:
            return 0.0
        span = max(now - w[0][0], w[-1][0] - w[0][0], 1.0)
        return round(sum(n for _, n in w) / span, 2)

    def snapshot(self) -> dict:
        c = self.counts
        return {
            "num_requests_running": int(self.num_requests_running._value.get()),
            "num_requests_waiting": int(self.num_requests_waiting._value.get()),
            "kv_blocks_used": int(self.kv_blocks_used._value.get()),
            "kv_blocks_total": int(self.kv_blocks_total._value.get()),
            "kv_cache_usage_perc": round(self.kv_cache_usage_perc._value.get(), 4),
            "prefix_cache_queries": c["prefix_cache_queries"],
            "prefix_cache_hits": c["prefix_cache_hits"],
            "prefix_cache_hit_rate": round(c["prefix_cache_hits"] / c["prefix_cache_queries"], 4)
            if c["prefix_cache_queries"] else 0.0,
            "num_preemptions": c["num_preemptions"],
            "prompt_tokens": c["prompt_tokens"],
            "generation_tokens": c["generation_tokens"],
            "num_steps": c["num_steps"],
            "max_requests_running": self.max_running,
            "finished": dict(self.finished),
            "tokens_per_s": self.tokens_per_s(),
            "uptime_s": round(time.monotonic() - self.started, 3),
            "kv_waste_frac": round(self.waste_sum / self.waste_steps, 4) if self.waste_steps else 0.0,
            **{f"{k}": _quantiles(v) for k, v in self.recent.items()},
        }

    def prometheus_text(self) -> bytes:
        return generate_latest(self.registry)


def merge_prometheus(texts: list[bytes]) -> bytes:
    """Several registries' expositions as one: each metric family once (its HELP and TYPE),
    with every registry's samples (they differ by their model_name label)."""
    families: dict[str, dict] = {}
    for text in texts:
        current = None
        for line in text.decode().splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                current = line.split(" ", 3)[2]
                fam = families.setdefault(current, {"meta": [], "samples": []})
                if line[:6] not in [m[:6] for m in fam["meta"]]:
                    fam["meta"].append(line)
            elif line and current is not None:
                families[current]["samples"].append(line)
    out = []
    for fam in families.values():
        out += fam["meta"] + fam["samples"]
    return ("\n".join(out) + "\n").encode() if out else b""
