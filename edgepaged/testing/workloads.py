"""Household workloads: request classes with length distributions and arrival patterns,
each reproducible from a seed.

Classes (prompt tokens, answer tokens, priority) at --scale 1, as a household sends them:
  home      smart-home question       20–80      10–40     interactive
  chat      multi-turn chat turn      200–1500   50–300    interactive  (shared system prompt)
  document  document assistant        3000–6000  100–400   interactive
  agent     background summariser     1000–4000  100–200   background   (shared system prompt)
`scale` multiplies every length (a quick run on a 2-core CPU uses 0.1–0.25).

`max_tokens` is what the client sends, drawn per request from its class's list (None: no
max_tokens, so the answer may run to the context), from what the clients of each class send
by default (their sources, read 2026-11):
  home      Home Assistant's Ollama integration sends no limit (only num_ctx); its OpenAI
            integration sends 3000 (150 in older releases): none / 150 / 3000
  chat      mostly none (as the issue says: many send none), some 1024: none / none / 1024
  document  none, or 2048 where a document tool sets a budget: none / 2048
  agent     scripts on the OpenAI SDK or LangChain send none unless their author sets one;
            some do (512): none / 512
Until 2026-11-30 the defaults assumed every hub sent 64 and every agent 512 (`--caps
home=64,agent=512` gives that workload back; bench/RESULTS.md compares both). `--caps`
(engine_bench.py, household.py) overrides a class's list. The caps are drawn from a random
stream of their own, so the requests themselves (lengths, words, order, arrivals) are the
same whatever the caps.

The answer length a request really gets is drawn from its class; the driver ends the
answer at that length, which frees the blocks exactly as an end-of-sequence token would.

Arrival patterns: `poisson(rate)`, `burst(at)` (everyone at once after dinner), and
`closed(users, think_s)` (each user sends the next request after reading the answer).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import trio

CLASSES = {
    #            prompt        answer      priority       share  max_tokens the client sends
    "home":     ((20, 80),     (10, 40),   "interactive", 0.40, (None, 150, 3000)),
    "chat":     ((200, 1500),  (50, 300),  "interactive", 0.30, (None, None, 1024)),
    "document": ((3000, 6000), (100, 400), "interactive", 0.10, (None, 2048)),
    "agent":    ((1000, 4000), (100, 200), "background",  0.20, (None, 512)),
}
SYSTEM_CHAT = ("You are the household assistant of the Lindqvist family. Be brief and friendly. "
               "The family: Anna (likes cooking), Jonas (cycles to work), Mia (11, school), Leo (7). "
               "The house has a heat pump, solar panels, a robot vacuum and lights in every room. ")
SYSTEM_AGENT = ("You summarise files for the family archive. Write a short neutral summary with "
                "the dates, amounts and names that appear, then a list of follow-ups. ")

WORDS = ("the a of and to in is it that for on with as was at by this from or an be are have not "
         "house light kitchen heat pump solar battery garden school bike dinner invoice receipt "
         "insurance contract meeting weather tomorrow morning evening warm cold open close turn "
         "report summary energy price water window door garage car charge plan week month year "
         "anna jonas mia leo music film recipe pasta soup bread coffee tea milk shopping list").split()


@dataclass
class WorkItem:
    at: float                  # arrival, seconds after the start
    klass: str
    prompt_ids: list[int]
    answer_tokens: int         # how long this answer really is
    max_tokens: int | None     # what the client sends
    priority: str
    client: str
    messages: list | None = None   # the chat behind prompt_ids (for clients that send text)


def _words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def parse_caps(text: str) -> dict:
    """`agent=none/512,home=150` -> {"agent": (None, 512), "home": (150,)}: the max_tokens
    values a class's clients send, drawn uniformly (`none`: no max_tokens)."""
    out = {}
    for part in filter(None, text.split(",")):
        klass, _, values = part.partition("=")
        if klass not in CLASSES or not values:
            raise ValueError(f"--caps: expected CLASS=CAP[/CAP...] with CLASS in {sorted(CLASSES)}, got {part!r}")
        out[klass] = tuple(None if v.lower() == "none" else int(v) for v in values.split("/"))
    return out


def make_item(tok, klass: str, rng: random.Random, scale: float, at: float = 0.0, client: str | None = None,
              context: int = 8192, answer_scale: float | None = None, caps: dict | None = None,
              cap_rng: random.Random | None = None) -> WorkItem:
    """One request of `klass`. `caps` overrides what a class's clients send as max_tokens.
    The cap is drawn from `cap_rng` when given (as `mix` does), so the requests themselves
    (lengths, words, order) do not depend on the caps."""
    (p_lo, p_hi), (a_lo, a_hi), priority, _, caps_default = CLASSES[klass]
    n_prompt = max(4, int(rng.randint(p_lo, p_hi) * scale))
    n_answer = max(2, int(rng.randint(a_lo, a_hi) * (scale if answer_scale is None else answer_scale)))
    system = {"chat": SYSTEM_CHAT, "agent": SYSTEM_AGENT}.get(klass)
    messages = [{"role": "system", "content": system}] if system else []
    overhead = len(tok.apply_chat_template(messages + [{"role": "user", "content": ""}]))
    messages.append({"role": "user", "content": _words(max(1, n_prompt - overhead), rng)})
    ids = tok.apply_chat_template(messages)
    values = (caps or {}).get(klass, caps_default)
    u = (cap_rng or rng).random()      # one draw whatever the list: other requests' caps stay put
    cap = values[min(len(values) - 1, int(u * len(values)))]
    if cap is not None:
        cap = max(n_answer, int(cap * max(scale, 0.25)))
    n_answer = max(1, min(n_answer, context - len(ids) - 1))
    return WorkItem(at, klass, ids, n_answer, cap, priority, client or f"{klass}-{rng.randrange(4)}", messages)


def mix(tok, n: int, seed: int, scale: float, classes: dict | None = None, context: int = 8192,
        answer_scale: float | None = None, caps: dict | None = None) -> list[WorkItem]:
    """n requests drawn from the household mix (arrival times all 0: apply a pattern)."""
    rng, cap_rng = random.Random(seed), random.Random(seed + 7)
    shares = classes or {k: v[3] for k, v in CLASSES.items()}
    names = list(shares)
    return [make_item(tok, rng.choices(names, weights=[shares[k] for k in names])[0], rng, scale, context=context,
                      answer_scale=answer_scale, caps=caps, cap_rng=cap_rng) for _ in range(n)]


def poisson(items: list[WorkItem], rate: float, seed: int = 0) -> list[WorkItem]:
    rng = random.Random(seed + 1)
    t = 0.0
    for it in items:
        t += rng.expovariate(rate)
        it.at = t
    return items


def burst(items: list[WorkItem], at: float = 0.0, spread_s: float = 0.5, seed: int = 0) -> list[WorkItem]:
    rng = random.Random(seed + 2)
    for it in items:
        it.at = at + rng.random() * spread_s
    return items


async def drive_arrivals(items: list[WorkItem], send: Callable[[WorkItem], Awaitable[None]],
                         sampler: Callable[[float], Awaitable[None]] | None = None) -> float:
    """The arrival driver: start `send(item)` in a task of its own at each item's arrival
    time (Trio's clock), and `sampler(t0)` beside them until the last send returns.
    Returns the wall time in seconds from the start to the last answer."""
    t0, start = time.monotonic(), trio.current_time()
    async with trio.open_nursery() as nursery:
        if sampler is not None:
            nursery.start_soon(sampler, t0)
        async with trio.open_nursery() as clients:
            for it in items:
                await trio.sleep_until(start + it.at)   # Trio's clock, not time.monotonic()
                clients.start_soon(send, it)
        wall = time.monotonic() - t0
        nursery.cancel_scope.cancel()
    return wall
