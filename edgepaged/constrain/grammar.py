"""Constrained decoding with llguidance: a request's output format (JSON, a JSON schema, a
regex, a Lark grammar) becomes a matcher over the model's own tokenizer, whose mask of the
allowed next tokens is applied to that request's logits before sampling.

    g = Grammars(tokenizer, vocab_size)
    grammar = g.compile({"type": "json_schema", "schema": {...}})   # ValueError naming the problem
    m = g.matcher(grammar)                                           # one per request
    ready = await g.prepare(spec, samples=n)   # the server's way: checked, compiled off the event
                                               # loop on a large stack, cached; GrammarRefused
    masks = Masks.compute([(row, m), ...], rows, vocab)              # off the event loop
    masks.apply(logits)                                              # disallowed tokens: -inf
    m.consume_token(token); m.is_stopped()                           # after sampling

The format spec is transport-neutral: {"type": "json_object"} (any JSON object),
{"type": "json_schema", "schema": {...}}, {"type": "regex", "pattern": "..."},
{"type": "lark", "grammar": "..."}. Every door maps its own fields onto it.

A grammar is untrusted input: llguidance's compiler recurses once per Lark rule, `$ref` and
nesting level with no limit of its own, and an overflow of a thread's stack kills the whole
process. So before anything compiles, `check_limits` measures the grammar (its size, and the
depth of its nesting, its rule graph and its `$ref` graph, counted together) and refuses what
is past `GrammarLimits`; what passes compiles in a thread whose stack is 32x what the allowed
depth needs (`_Compiler`), under llguidance's own limits (grammar size, lexer fuel and states,
per-step work) and a wall-clock budget.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..common.brief import first_line

if TYPE_CHECKING:
    from llguidance import LLMatcher

log = logging.getLogger("edgepaged.grammar")

FORMAT_TYPES = ("json_object", "json_schema", "regex", "lark")
# JSON as models write it: one space after ',' and ':', no other whitespace (a small model
# cannot run on in whitespace; a schema's own "x-guidance" may say otherwise)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's output format may cost (docs/SECURITY.md). Each refusal is a 400."""
    max_depth: int = 128              # nesting + rule chains + $ref chains, counted together
    max_bytes: int = 256 << 10        # the format's text (a schema as JSON, a grammar, a pattern)
    compile_timeout_s: float = 10.0   # wall clock for compiling and building the matchers
    max_grammar_size: int = 200_000   # llguidance: symbols in the grammar's productions
    initial_lexer_fuel: int = 1_000_000   # llguidance: regex work at compile time (~20 ms)
    max_lexer_states: int = 100_000   # llguidance: lexer states (1-2 kB each)
    step_lexer_fuel: int = 200_000    # llguidance: lexer work per token (~15 ms)
    step_max_items: int = 50_000      # llguidance: parser items per token (~2.5 ms)
    max_forced_bytes: int = 16 << 10  # what a format may force at once (a run of fixed text)

    def llguidance(self):
        from llguidance import LLParserLimits
        return LLParserLimits(max_grammar_size=self.max_grammar_size, initial_lexer_fuel=self.initial_lexer_fuel,
                              max_lexer_states=self.max_lexer_states, step_lexer_fuel=self.step_lexer_fuel,
                              step_max_items=self.step_max_items, verbose_errors=False)


class GrammarRefused(ValueError):
    """A format refused before it ran (past a limit, or not a valid grammar). `busy`: the
    compiler had no room in time (a 503 rather than a 400)."""

    def __init__(self, message: str, busy: bool = False, code: str | None = None):
        super().__init__(message)
        self.busy = busy
        self.code = code or ("busy" if busy else "invalid_params")


class CompileStopped(GrammarRefused):
    """A compile stopped at the format compile-time limit (its child process killed)."""


class ForcedTooLong(GrammarRefused):
    """A format that forces more than `GrammarLimits.max_forced_bytes` of fixed text at once."""


# -- a format's forced text, bounded -------------------------------------------------------------

# Forced runs up to this many bytes become forced tokens (drafts of the next step); a longer run
# is generated a token a step like any other text (a JSON reply forces ~10-100 bytes at a time).
FORCED_TOKENIZE_BYTES = 512


def force_off_gil(m) -> None:
    """Make the matcher's parser take the text its format forces next without the GIL: its mask
    computation does (llguidance releases the GIL there), where `compute_ff_*` force it with the
    GIL held, ~1-2.5 us a byte, up to ~250 KB (0.3-0.6 s: one format forcing a long run froze
    every door). Forced, the run is a slice those calls return at once. A JSON reply's mask
    costs 10-100 us."""
    if not m.is_stopped() and not m.is_error():
        m.compute_bitmask()


def forced_run(m, max_bytes: int | None = None) -> list[int]:
    """The tokens `m`'s format forces next, within bounds: the forcing runs without the GIL
    (`force_off_gil`), a run of more than FORCED_TOKENIZE_BYTES gives no tokens (it is sampled a
    token a step, its mask allowing only what fits it), and a run of more than `max_bytes`
    (`GrammarLimits.max_forced_bytes`) is ForcedTooLong. [] when nothing is forced."""
    if m.is_stopped() or m.is_error():
        return []
    force_off_gil(m)
    if m.is_error():
        return []
    n = len(m.compute_ff_bytes())
    limit = GrammarLimits.max_forced_bytes if max_bytes is None else max_bytes
    if n > limit:
        raise ForcedTooLong(f"the format forces {n} bytes of fixed text at once; this server allows {limit} "
                            "(the format's forced-text limit)")
    if not n or n > FORCED_TOKENIZE_BYTES:
        return []
    return list(m.compute_ff_tokens())


def forces(m) -> bool:
    """Whether `m`'s format forces any text next (forced without the GIL)."""
    force_off_gil(m)
    return not m.is_error() and len(m.compute_ff_bytes()) > 0


# -- measuring before compiling -----------------------------------------------------------------

def _resolve(root, ref: str):
    """The target of a local `$ref` (#, #/a/b, #name as an $anchor is not followed) or None."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:] if ref.startswith("#/") else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if ref in ("#", "") or ref.startswith("#/") else None


def schema_depth(schema) -> int:
    """How deep compiling a JSON schema recurses, near enough: its nesting, with each local
    `$ref` counted as the depth of what it points to (a chain of refs adds up; a ref back
    into what is being measured, a recursive schema, counts once). No recursion here."""
    memo: dict[int, int] = {}
    on_path: set[int] = set()
    # iterative post-order: (node, expanded?)
    stack = [(schema, False)]
    while stack:
        node, expanded = stack.pop()
        key = id(node)
        if key in memo:
            continue
        kids = _kids(schema, node)
        if not expanded:
            if key in on_path:
                continue
            on_path.add(key)
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in memo and id(k) not in on_path)
            continue
        on_path.discard(key)
        memo[key] = 1 + max((memo.get(id(k), 0) for k in kids), default=0)
    return memo.get(id(schema), 0)


def _kids(root, node) -> list:
    if isinstance(node, dict):
        kids = [v for v in node.values() if isinstance(v, (dict, list))]
        target = _resolve(root, node.get("$ref")) if "$ref" in node else None
        if isinstance(target, (dict, list)):
            kids.append(target)
        return kids
    if isinstance(node, list):
        return [v for v in node if isinstance(v, (dict, list))]
    return []


_DEF = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z_0-9]*)(?:\.-?\d+)?[ \t]*:(?!:)")
_NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


def _scan(text: str, refs: set | None = None) -> int:
    """Bracket nesting of a grammar's (or a regex's) text, skipping string literals and
    escapes; the identifiers outside literals go to `refs`."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':                    # a string literal
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in ")]}":
            depth = max(0, depth - 1)
        elif refs is not None and (c.isalpha() or c == "_"):
            m = _NAME.match(text, i)
            refs.add(m.group())
            i = m.end()
            continue
        i += 1
    return deepest


def lark_depth(text: str) -> int:
    """How deep compiling a Lark grammar recurses, near enough: the longest chain of rule
    references (a cycle counts once), each rule adding its own bracket nesting and the
    depth of any JSON schema (`%json {...}`) it holds."""
    rules: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        code = line.split("//", 1)[0] if '"' not in line else line
        m = _DEF.match(code)
        if m and not code.lstrip().startswith("%"):
            name = m.group(1)
            rules.setdefault(name, []).append(code[m.end():])
        elif name is not None:
            rules[name].append(code)
    local, refs = {}, {}
    for name, lines in rules.items():
        body = "\n".join(lines)
        r: set = set()
        own = _scan(body, r)
        for at in (m.end() for m in re.finditer(r"%json\s*", body)):
            blob = _balanced(body, at)
            if blob is not None:
                try:
                    own = max(own, schema_depth(json.loads(blob)))
                except (ValueError, RecursionError):
                    own = max(own, _scan(blob))
        local[name], refs[name] = own, [x for x in r if x in rules and x != name]
    memo: dict[str, int] = {}
    on_path: set = set()
    for start in rules:
        stack = [(start, False)]
        while stack:
            name, expanded = stack.pop()
            if name in memo:
                continue
            if not expanded:
                if name in on_path:
                    continue
                on_path.add(name)
                stack.append((name, True))
                stack.extend((k, False) for k in refs[name] if k not in memo and k not in on_path)
                continue
            on_path.discard(name)
            memo[name] = 1 + local[name] + max((memo.get(k, 0) for k in refs[name]), default=0)
    return max(memo.values(), default=_scan(text))


def _balanced(text: str, at: int) -> str | None:
    """The bracketed JSON value starting at `at` ({...} or [...]), or None."""
    if at >= len(text) or text[at] not in "{[":
        return None
    depth, i, n = 0, at, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return text[at:i + 1]
        i += 1
    return None


_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*\d*\s*)?\}")
_LARK_TIMES = re.compile(r"~\s*(\d+)")


def repeat_bound(text: str) -> int:
    """The largest product of the minimum counts of nested counted repetitions in a pattern
    (`(c{1000}){1000}`: 1,000,000; `\\d{4}`: 4), escapes and character classes skipped; Lark's
    `item ~ n` counted too. How much fixed text one such repetition may force at once, near
    enough, read without compiling anything."""
    stack, last, i, n = [1], 1, 0, len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i, last = i + 2, 1
        elif c == "[":                     # a character class: one character
            j = i + 1 + (i + 1 < n and text[i + 1] == "^")
            j += j < n and text[j] == "]"
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            i, last = j + 1, 1
        elif c == "(":
            stack.append(1)
            i, last = i + 1, 1
        elif c == ")":
            last = stack.pop() if len(stack) > 1 else 1
            i += 1
        elif c in "{~" and (m := (_COUNT if c == "{" else _LARK_TIMES).match(text, i)):
            last *= max(1, int(m.group(1)))
            i = m.end()
        else:
            i, last = i + 1, 1
        stack[-1] = max(stack[-1], last)
    return max(stack)


def _forced_texts(schema) -> tuple[int, int]:
    """(the largest repetition bound of a JSON schema's patterns, its longest literal string an
    answer must hold: a const, a one-value enum, a property name), walked without recursion."""
    most_repeat, longest, stack = 1, 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "pattern" and isinstance(v, str):
                    most_repeat = max(most_repeat, repeat_bound(v))
                elif k == "patternProperties" and isinstance(v, dict):
                    most_repeat = max([most_repeat] + [repeat_bound(p) for p in v if isinstance(p, str)])
                elif k == "properties" and isinstance(v, dict):
                    longest = max([longest] + [len(p) for p in v if isinstance(p, str)])
                elif k == "const" and isinstance(v, str):
                    longest = max(longest, len(v))
                elif k == "enum" and isinstance(v, list) and len(v) == 1 and isinstance(v[0], str):
                    longest = max(longest, len(v[0]))
                if isinstance(v, (dict, list)):
                    stack.append(v)
        elif isinstance(node, list):
            stack.extend(x for x in node if isinstance(x, (dict, list)))
    return most_repeat, longest


def check_forced(kind: str, value, limits: GrammarLimits) -> None:
    """Refuse a format that can force more fixed text at once than `max_forced_bytes`, where
    its text says so: a counted repetition (`c{200000}`, nested counts multiplied), a literal
    an answer must hold (a 200 KB const or property name). Forcing it cost up to ~0.5 s of a
    core per request (llguidance forces it whole); what this misses is bounded at run time
    (`forced_run`)."""
    most = limits.max_forced_bytes
    if kind == "json_schema":
        repeat, literal = _forced_texts(value)
    else:
        repeat, literal = repeat_bound(value), 0
    if repeat > most:
        raise GrammarRefused(f"the format repeats fixed text {repeat} times at once; this server allows {most} "
                             "(the format's forced-text limit)")
    if literal > most:
        raise GrammarRefused(f"the format holds a literal of {literal} characters; this server allows {most} "
                             "(the format's forced-text limit)")


def check_limits(spec: dict, limits: GrammarLimits) -> None:
    """Refuse (GrammarRefused) a format spec past the limits, before anything compiles."""
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind not in FORMAT_TYPES:
        raise GrammarRefused(f"format type must be one of {', '.join(FORMAT_TYPES)}, got {kind!r}")
    if kind == "json_object":
        return
    field = {"json_schema": "schema", "regex": "pattern", "lark": "grammar"}[kind]
    value = spec.get(field)
    if kind == "json_schema" and isinstance(value, str):
        if len(value.encode("utf-8", "surrogatepass")) > limits.max_bytes:
            raise GrammarRefused(f"the schema is over {limits.max_bytes} bytes (the format size limit)")
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise GrammarRefused("the schema is not valid JSON (or nests too deep)") from None
    if kind == "json_schema":
        if not isinstance(value, dict):
            raise GrammarRefused("the schema must be a JSON object")
        depth, what = schema_depth(value), "the schema nests (counting $ref chains)"
        if depth > limits.max_depth:
            raise GrammarRefused(f"{what} {depth} deep; this server compiles at most {limits.max_depth} "
                                 "(the format depth limit)")
        try:
            size = len(json.dumps(value))
        except (ValueError, TypeError, RecursionError):
            raise GrammarRefused("the schema must be plain JSON") from None
    else:
        if not isinstance(value, str):
            raise GrammarRefused(f"a {kind} format needs a string {field}")
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > limits.max_bytes:
            raise GrammarRefused(f"the {field} is over {limits.max_bytes} bytes (the format size limit)")
        depth = lark_depth(value) if kind == "lark" else _scan(value)
        what = "the grammar's rules chain and nest" if kind == "lark" else "the pattern's groups nest"
    if size > limits.max_bytes:
        raise GrammarRefused(f"the {field} is over {limits.max_bytes} bytes (the format size limit)")
    if depth > limits.max_depth:
        raise GrammarRefused(f"{what} {depth} deep; this server compiles at most {limits.max_depth} "
                             "(the format depth limit)")
    check_forced(kind, value, limits)


def check_grammar_text(grammar: str, limits: GrammarLimits) -> None:
    """The same measure for a grammar text as llguidance takes it (Lark, or the JSON form
    grammar_from_* return): what a door builds from tools goes through it too."""
    if len(grammar) > 4 * limits.max_bytes:
        raise GrammarRefused(f"the grammar is over {4 * limits.max_bytes} bytes (the format size limit)")
    depth = 0
    if grammar.lstrip().startswith("{"):
        try:
            wrapper = json.loads(grammar)
        except (ValueError, RecursionError):
            raise GrammarRefused("the grammar is not valid") from None
        for g in wrapper.get("grammars", []) if isinstance(wrapper, dict) else []:
            if isinstance(g, dict) and isinstance(g.get("json_schema"), (dict, list)):
                depth = max(depth, schema_depth(g["json_schema"]))
            if isinstance(g, dict) and isinstance(g.get("lark_grammar"), str):
                depth = max(depth, lark_depth(g["lark_grammar"]))
    else:
        depth = lark_depth(grammar)
    if depth > limits.max_depth:
        raise GrammarRefused(f"the grammar's rules chain and nest {depth} deep; this server compiles at most "
                             f"{limits.max_depth} (the format depth limit)")


# -- compiling where a deep grammar cannot hurt the server --------------------------------------

class _Compiler:
    """Threads with a large stack for llguidance's recursive compiler: 256 MiB of address space
    each (only what is touched is memory), 32x the 8 MiB on which FACTS measured 1,000 `$ref`
    levels compiling; the depth limit allows far fewer. At most `threads` compiles at once."""

    STACK_BYTES = 256 << 20

    def __init__(self, threads: int = 2, nice: int = 0):
        import queue
        self.jobs: queue.Queue = queue.Queue()
        self.threads: list[threading.Thread] = []
        self.size, self.nice = threads, nice
        self._lock = threading.Lock()
        self.pending = 0                # jobs queued or running

    def _start(self) -> None:
        with self._lock:
            if self.threads:
                return
            old = threading.stack_size()
            try:
                threading.stack_size(self.STACK_BYTES)
                for i in range(self.size):
                    t = threading.Thread(target=self._work, name=f"edgepaged-grammar-{i}", daemon=True)
                    t.start()
                    self.threads.append(t)
            finally:
                threading.stack_size(old)

    def _work(self) -> None:
        if self.nice:                   # (Linux: a thread's own priority; GIL-free work here)
            try:
                import os
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except (AttributeError, OSError):
                pass
        while True:                     # a compiler thread never dies of one job
            fn, done = self.jobs.get()
            try:
                done(fn)
            except BaseException as e:  # noqa: BLE001
                log.error("the grammar compiler failed on a job: %s", first_line(f"{type(e).__name__}: {e}"))
            finally:
                with self._lock:
                    self.pending -= 1

    def submit(self, fn, done) -> None:
        """Run `fn()` on a compiler thread; `done(fn)` is called there (it runs fn itself,
        so it can note when fn started)."""
        self._start()
        with self._lock:
            self.pending += 1
        self.jobs.put((fn, done))

    def run(self, fn):
        """Run `fn()` on a compiler thread and wait (for synchronous callers and tests)."""
        box, ev = {}, threading.Event()

        def done(f):
            try:
                box["v"] = f()
            except BaseException as e:   # handed to the caller
                box["e"] = e
            ev.set()
        self.submit(fn, done)
        ev.wait()
        if "e" in box:
            raise box["e"]
        return box["v"]


COMPILER = _Compiler()          # formats up to SMALL_FORMAT_BYTES (and synchronous callers)
LARGE_COMPILER = _Compiler(1, nice=10)   # larger ones: one at a time, each checked first in a child process

# A format's text (its spec as JSON, or a grammar) up to this size compiles in well under a
# second (a 32 KB, 1,000-property schema: ~0.15 s here) in the small lane: json_object, a
# household's tool sets. A larger one goes to the large lane, where one stranger's compile
# never holds up those.
SMALL_FORMAT_BYTES = 32 << 10


def in_child(job: dict, timeout_s: float) -> str:
    """`job` checked by `compile_child` in a fresh process, killed after `timeout_s`
    (llguidance's compile cannot be stopped in a thread: a format past its budget kept a
    compiler thread for as long as it ran). The grammar text; GrammarRefused for the child's
    own refusal, for the time limit (CompileStopped), or when the child died."""
    import pickle
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "edgepaged.constrain.compile_child"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
    try:
        out, _ = proc.communicate(pickle.dumps(job), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise CompileStopped(f"the format takes longer than {timeout_s:g} s to compile (the format compile-time "
                             "limit); it was stopped") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    try:
        kind, value = pickle.loads(out)
    except Exception:                    # noqa: BLE001 - the child died (out of memory, a crash in the library)
        raise GrammarRefused("the format could not be compiled (its compile failed)") from None
    if kind == "ok":
        return value
    if kind == "failed":
        log.warning("a grammar failed to compile: %s", value)
        raise GrammarRefused("the format could not be compiled")
    raise GrammarRefused(value)


class CompileQuota:
    """Compiles per caller (formats compiled before never count): at most `per_caller` queued
    or running at once, `large` of them large; a caller whose compile was stopped at the time
    limit waits `cooldown_s` before its next large one (each costs the box up to the budget of
    a core). Past it: too_many_requests (a 429)."""

    def __init__(self, per_caller: int = 16, large: int = 1, cooldown_s: float = 30.0, max_callers: int = 4096):
        self.per_caller, self.large, self.cooldown_s, self.max_callers = per_caller, large, cooldown_s, max_callers
        self.running: dict[str, list[int]] = {}     # caller -> [compiles, large ones]
        self.stopped: dict[str, float] = {}      # caller -> when its last compile was stopped
        self._lock = threading.Lock()

    def take(self, who: str, large: bool) -> None:
        with self._lock:
            now = time.monotonic()
            if len(self.stopped) > self.max_callers:
                self.stopped = {k: t for k, t in self.stopped.items() if now - t < self.cooldown_s}
            since = now - self.stopped.get(who, -1e9)
            if large and since < self.cooldown_s:
                raise GrammarRefused(f"your last large format was stopped at the compile-time limit; send the next "
                                     f"one in {self.cooldown_s - since:.0f} s", busy=True, code="too_many_requests")
            n = self.running.setdefault(who, [0, 0])
            if n[0] >= self.per_caller or large and n[1] >= self.large:
                most = self.large if large else self.per_caller
                raise GrammarRefused(f"your earlier {'large ' if large else ''}formats are still compiling (at most "
                                     f"{most} at once per caller); send the next when one is done", busy=True,
                                     code="too_many_requests")
            n[0] += 1
            n[1] += large

    def give(self, who: str, large: bool, stopped: bool = False) -> None:
        with self._lock:
            n = self.running.get(who)
            if n is not None:
                n[0] -= 1
                n[1] -= large
                if n[0] <= 0:
                    del self.running[who]
            if stopped:
                self.stopped[who] = time.monotonic()


# llguidance reads a tokenizer.json with the `tokenizers` crate it is built with, whose added-token
# registration compares each new token with every one before it: a vocabulary padded with tens of
# thousands of reserved control tokens (79,104 in a Llama-3-sized file written from a 49 k
# vocabulary) took 28 s, with the GIL held, before a server could say ready. Past this many added
# tokens the token table is handed over as bytes instead (`_TokenTable`): ~0.5 s for 128 k tokens.
MANY_ADDED_TOKENS = 4096


# one llguidance tokenizer per loaded tokenizer (it is immutable and building it holds the GIL
# ~0.3 s): a front end made anew over a loaded model (a reload, a test's server) reuses it
_LLTOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LLTOKS_LOCK = threading.Lock()


def _shared_lltok(tokenizer, vocab_size: int, stops: list[int] | None):
    key = (vocab_size, tuple(stops or ()))
    with _LLTOKS_LOCK:
        made = _LLTOKS.setdefault(tokenizer, {})
        if key not in made:
            made[key] = lltokenizer(tokenizer, vocab_size, stops)
        return made[key]


def lltokenizer(tokenizer, vocab_size: int, stops: list[int] | None, *, table: bool | None = None):
    """llguidance's tokenizer for one of ours (model/tokenizer.py): from its tokenizer.json, or,
    for a vocabulary with more than MANY_ADDED_TOKENS added tokens (or `table=True`), from its
    token table as bytes with our own tokenizer encoding for it (`_TokenTable`): the same token
    bytes and the same special tokens, so the same masks (tests/test_token_table.py compares them)."""
    import llguidance
    hf = tokenizer.tok
    if table is None:
        table = len(hf.get_added_tokens_decoder()) > MANY_ADDED_TOKENS
    if not table:
        return llguidance.LLTokenizer(hf.to_str(), n_vocab=vocab_size, eos_token=stops)
    return llguidance.LLTokenizer(_TokenTable(tokenizer, vocab_size, stops), eos_token=stops)


def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable bytes stand for themselves, the others for
    the characters from U+0100 on, in byte order."""
    def own(b):
        return 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF
    chars, k = {}, 0x100
    for b in range(256):
        if own(b):
            chars[chr(b)] = b
        else:
            chars[chr(k)] = b
            k += 1
    return chars


class _TokenTable:
    """What llguidance's TokenizerWrapper protocol asks for: every token id's bytes (a special
    token's text behind llguidance's 0xFF marker, added by it for `special_token_ids`), the ids
    of EOS and BOS, and a call that tokenizes a string fragment. The bytes follow the same rules
    llguidance applies to a tokenizer.json: an added token marked special, or written <...>, is
    special; another added token reads as the vocabulary's pieces do, else as its text; a
    byte-level vocabulary maps its characters back to bytes; a byte-fallback (SentencePiece) one reads <0xNN> as that byte and its space
    character as a space. The fragment is tokenized as llguidance does it: no BOS, no space
    prepended by the normalizer or the pre-tokenizer, control-token text parsed as the token."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer, vocab_size: int, stops: list[int] | None):
        hf = tokenizer.tok

        def state(part):
            return json.loads(part.__getstate__()) if part is not None else None
        decoders = _flatten(state(hf.decoder), "decoders")
        kinds = {d.get("type") for d in decoders}
        space = next((d["pattern"]["String"] for d in decoders if d.get("type") == "Replace"
                      and d.get("content") == " " and len(d.get("pattern", {}).get("String") or "") == 1), " ")
        byte_level, fallback = "ByteLevel" in kinds, "ByteFallback" in kinds
        if not (byte_level or fallback):
            raise ValueError(f"cannot tell this tokenizer's token bytes (decoder {sorted(kinds)})")
        n = max(vocab_size, hf.get_vocab_size())
        tokens = [b""] * n
        if byte_level:   # each character to its byte as a Latin-1 character; any other fails
            to_byte = {c: chr(b) for c, b in _byte_level_chars().items()}
            table = str.maketrans({**{chr(i): "\uffff" for i in range(256)}, **to_byte})

        def piece(text: str) -> bytes | None:
            if byte_level:
                try:
                    return text.translate(table).encode("latin-1")
                except UnicodeEncodeError:
                    return None
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                return bytes([int(text[3:5], 16)])
            return text.replace(space, " ").encode()
        for text, i in hf.get_vocab(with_added_tokens=False).items():
            if i < n:
                tokens[i] = piece(text) or b""   # (llguidance leaves a token it cannot read empty too)
        special = []
        for i, t in hf.get_added_tokens_decoder().items():
            if i >= n:
                continue
            if t.special or (t.content.startswith("<") and t.content.endswith(">")):
                tokens[i] = t.content.encode()
                special.append(i)
            else:   # read as the vocabulary's pieces are, else as its text
                tokens[i] = piece(t.content) or t.content.encode()
        self.tokens, self.special_token_ids = tokens, special
        self.eos_token_id = stops[0] if stops else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        # the fragment tokenizer: no prepended space (a Prepend normalizer dropped, a Metaspace
        # pre-tokenizer told never to prepend); encoded without special tokens (no BOS/EOS).
        # Most byte-level vocabularies prepend nothing: the model's own tokenizer serves.
        self._fragment = hf
        if any(x.get("type") == "Prepend" for x in _flatten(state(hf.normalizer), "normalizers")) or any(
                x.get("type") == "Metaspace" for x in _flatten(state(hf.pre_tokenizer), "pretokenizers")):
            from tokenizers import Tokenizer as HFTokenizer
            whole = json.loads(hf.to_str())
            if whole.get("normalizer") is not None:
                kept = [x for x in _flatten(whole["normalizer"], "normalizers") if x.get("type") != "Prepend"]
                whole["normalizer"] = (None if not kept else kept[0] if len(kept) == 1
                                       else {"type": "Sequence", "normalizers": kept})
            for p in _flatten(whole.get("pre_tokenizer"), "pretokenizers"):
                if p.get("type") == "Metaspace":
                    p["prepend_scheme"] = "never"
            self._fragment = HFTokenizer.from_str(json.dumps(whole))

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return self._fragment.encode(text, add_special_tokens=False).ids


def _flatten(node, key: str) -> list[dict]:
    """A tokenizer.json component and, for a Sequence, its parts, depth first (the dicts
    themselves: a change to one is a change to the state)."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [x for part in node.get(key) or [] for x in _flatten(part, key)]
    return [node]


@dataclass
class Prepared:
    """A compiled format: its grammar text, one fresh matcher per sample, and the tokens it
    forces first (`{"` of a JSON answer: drafts of the prompt's last chunk), the first `lead`
    of them certain (the rest: `prepare`'s `drafts`)."""
    grammar: str
    matchers: list
    forced: list = field(default_factory=list)
    lead: int = 0
    certain: list = field(default_factory=list)   # per token of `forced`: the format allows nothing else


class Grammars:
    """The llguidance tokenizer of one model (built once, on first use: ~0.1-1 s) and the
    compilation of format specs into grammars and matchers."""

    CACHE_SIZE = 64
    LARGE_CACHED = 4      # of them, formats over SMALL_FORMAT_BYTES compiled

    def __init__(self, tokenizer, vocab_size: int, limits: GrammarLimits | None = None):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.limits = limits or GrammarLimits()
        self._lltok = None
        self._lock = threading.Lock()
        self._cache: OrderedDict = OrderedDict()    # key -> (grammar, template matcher) or GrammarRefused
        self.quota = CompileQuota()
        self._tokenizer_json: str | None = None     # for compile_child, made at the first large format
        self._cache_lock = threading.Lock()

    @property
    def lltok(self):
        if self._lltok is not None:    # (no lock once built: a forked compile child may read it)
            return self._lltok
        with self._lock:
            if self._lltok is None:
                # any of the model's stop tokens may end a complete output
                stops = sorted(self.tokenizer.stop_token_ids) or None
                self._lltok = _shared_lltok(self.tokenizer, self.vocab_size, stops)
            return self._lltok

    def compile(self, spec: dict) -> str:
        """A format spec -> llguidance grammar text; ValueError (GrammarRefused) saying what is
        wrong or which limit it is past. Checked before it compiles, compiled on a large stack."""
        check_limits(spec, self.limits)
        return COMPILER.run(lambda: self._compile(spec))

    def _compile(self, spec: dict) -> str:
        from llguidance import LLMatcher
        kind = spec["type"]
        try:
            if kind == "json_object":
                grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
            elif kind == "json_schema":
                schema = spec.get("schema")
                if isinstance(schema, str):
                    schema = json.loads(schema)
                # an object that lists its properties and says nothing of others is closed, as
                # Ollama, llama.cpp and vLLM compile it (pydantic's schemas omit the field: open,
                # a model adds keys and runs on to its length limit inside one)
                from .schemas import closed
                grammar = LLMatcher.grammar_from_json_schema(closed(schema), defaults=JSON_STYLE)
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(spec["pattern"])
            else:
                grammar = LLMatcher.grammar_from_lark(spec["grammar"])
        except Exception as e:     # llguidance's own errors (RuntimeError, ValueError, ...)
            raise GrammarRefused(_short(str(e))) from None
        ok, message = _validate(grammar, self.lltok, self.limits)
        if not ok:
            raise GrammarRefused(message)
        return grammar

    def matcher(self, grammar: str):
        """A fresh matcher at the start of the output; ValueError when the grammar fails.
        Checked against the limits and built on a large stack."""
        check_grammar_text(grammar, self.limits)
        return COMPILER.run(lambda: self._matcher(grammar))

    def _matcher(self, grammar: str):
        from llguidance import LLMatcher
        m = LLMatcher(self.lltok, grammar, log_level=0, limits=self.limits.llguidance())
        if m.is_error():
            raise GrammarRefused(_short(m.get_error()))
        return m

    async def prepare(self, spec: dict | None = None, samples: int = 1, *, grammar: str | None = None,
                      drafts=None, who: str = "") -> Prepared:
        """The server's path: a format spec (or a grammar text a door built, `grammar`) checked
        against the limits, compiled and given `samples` fresh matchers, all on a compiler
        thread, never on the event loop, within `compile_timeout_s`; cached by the spec's
        text (refusals too). GrammarRefused (a 400; `busy`: a 503 or 429) otherwise. `drafts`: a
        function of the first matcher (left as it was) giving (tokens, lead, certain): the
        prompt's drafts in place of what the format forces first. `who`: the caller, whose
        large formats count against `quota`.

        A format compiled before takes copies of its matcher at once, never behind a compile.
        A small one (SMALL_FORMAT_BYTES) compiles in the small lane; a large one in the large
        lane, first in a child process that is killed at the time limit (`in_child`), then here."""
        import trio
        # measuring a 256 KiB schema takes ~20 ms: in a worker thread, not on the event loop
        from ..common.lanes import PREPARE
        key, hit, large = await trio.to_thread.run_sync(self._check_and_look_up, spec, grammar, who, limiter=PREPARE)
        if hit is not None:
            g, _, matchers, (forced, lead, certain) = await trio.to_thread.run_sync(
                self._ready, hit[0], hit[1], samples, drafts, limiter=PREPARE)
            return Prepared(g, matchers, forced, lead, certain)
        state = {"started": None, "stopped": False}
        token = trio.lowlevel.current_trio_token()
        finished = trio.Event()
        box: dict = {}
        budget = self.limits.compile_timeout_s

        def work():
            if state.get("abandoned"):     # its request gave up waiting (timeout, cancel): skip it
                raise GrammarRefused("abandoned", busy=True)
            state["started"] = time.monotonic()
            if large:                      # (a child checks it within the budget; then it is built here)
                try:
                    g = in_child(self._job(spec, grammar), budget)
                except CompileStopped:
                    state["stopped"] = True
                    raise
                template = self._matcher(g)
                template.compute_bitmask()
            else:
                g = self._compile(spec) if grammar is None else grammar
                template = self._first_mask(self._matcher(g))
            return self._ready(g, template, samples, drafts)

        def done(fn):
            try:
                box["v"] = fn()
            except GrammarRefused as e:
                box["e"] = e
            except Exception as e:    # never a traceback to the client; one line in the log
                log.warning("a grammar failed to compile: %s", _short(f"{type(e).__name__}: {e}"))
                box["e"] = GrammarRefused("the format could not be compiled")
            finally:
                self.quota.give(who, large, state["stopped"])
            took = time.monotonic() - (state["started"] or time.monotonic())
            if took > budget * (2 if large else 1) and "v" in box:   # too slow: refused from now on
                box["e"] = GrammarRefused(f"the format took {took:.1f} s to compile; this server allows "
                                          f"{budget:g} s (the format compile-time limit)")
            self._remember(key, box)
            try:
                token.run_sync_soon(finished.set)
            except trio.RunFinishedError:
                pass

        try:
            (LARGE_COMPILER if large else COMPILER).submit(work, done)
        except BaseException:
            self.quota.give(who, large)
            raise
        try:
            # a large format: the child's budget, then its build here (about as long again)
            with trio.move_on_after(budget * (2 if large else 1)):
                await finished.wait()
        finally:
            if not finished.is_set():   # a queued compile nobody waits for is not run
                state["abandoned"] = True
        if not finished.is_set():
            if state["started"] is None:
                raise GrammarRefused("the grammar compiler is busy; try again shortly", busy=True)
            raise GrammarRefused(f"the format takes longer than {budget:g} s to compile "
                                 "(the format compile-time limit)")
        if "e" in box:
            raise box["e"]
        g, _, matchers, (forced, lead, certain) = box["v"]
        return Prepared(g, matchers, forced, lead, certain)

    @staticmethod
    def _first_mask(template):
        template.compute_bitmask()      # the first token's mask: within the per-token limits?
        if template.is_error():
            log.debug("a format failed its first mask: %s", template.get_error())
            raise GrammarRefused("the format is past the parser's per-token limits at its first token "
                                 "(e.g. too many optional properties); use a simpler format")
        return template

    def _job(self, spec: dict | None, grammar: str | None) -> dict:
        """What `compile_child` needs to check a format as this object would."""
        if self._tokenizer_json is None:
            self._tokenizer_json = self.tokenizer.tok.to_str()
        return {"tokenizer": self._tokenizer_json, "vocab": self.vocab_size,
                "stops": sorted(self.tokenizer.stop_token_ids), "eos": self.tokenizer.eos_token_id,
                "bos": self.tokenizer.bos_token_id, "limits": self.limits, "spec": spec, "grammar": grammar,
                "table": len(self.tokenizer.tok.get_added_tokens_decoder()) > MANY_ADDED_TOKENS}

    def _checked(self, spec: dict | None, grammar: str | None) -> str:
        """(In `compile_child`) the format compiled, its first mask and forced text within the
        limits; its grammar text."""
        g = self._compile(spec) if grammar is None else grammar
        template = self._first_mask(self._matcher(g))
        forced_run(template, self.limits.max_forced_bytes)
        return g

    def _ready(self, g: str, template, samples: int, drafts):
        """`samples` fresh matchers of a compiled format (copies of its template, which every
        request of the format shares and none changes), what it forces first, and the prompt's
        drafts: (grammar, template, matchers, (forced, lead, certain))."""
        matchers = [template.deep_copy() for _ in range(samples)]
        try:
            forced = forced_run(matchers[0], self.limits.max_forced_bytes)
        except ForcedTooLong:
            raise
        except Exception:   # noqa: BLE001 - nothing forced then
            forced = []
        lead, certain = len(forced), [True] * len(forced)
        if drafts is not None:
            try:
                forced, lead, certain = drafts(matchers[0])
            except Exception:   # noqa: BLE001 - what the format forces, then
                log.debug("the prompt's drafts failed", exc_info=True)
        return g, template, matchers, (forced, lead, certain)

    def _check_and_look_up(self, spec: dict | None, grammar: str | None, who: str = ""):
        """(the cache key, the cached compile or None, large?); GrammarRefused past a limit or
        cached, or past the caller's quota. A compile to come holds the caller's quota
        (`quota.give` when it ends), taken before the format is measured."""
        key = json.dumps(spec, sort_keys=True, default=str) if grammar is None else "grammar:" + grammar
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if isinstance(hit, GrammarRefused):
            raise GrammarRefused(str(hit))
        large = len(key) > SMALL_FORMAT_BYTES
        if hit is None:
            self.quota.take(who, large)
            try:
                if grammar is None:
                    check_limits(spec, self.limits)
                else:
                    check_grammar_text(grammar, self.limits)
            except BaseException:
                self.quota.give(who, large)
                raise
        return key, hit, large

    def _remember(self, key: str, box: dict) -> None:
        with self._cache_lock:
            if "e" in box and box["e"].busy:
                return                  # (busy: nothing known about the format itself)
            self._cache[key] = box["e"] if "e" in box else box["v"][:2]
            self._cache.move_to_end(key)
            while len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
            # a large format's matcher holds ~30 MB (a 200 KB schema): only the latest few stay
            large = [k for k, v in self._cache.items() if len(k) > SMALL_FORMAT_BYTES and isinstance(v, tuple)]
            for k in large[:-self.LARGE_CACHED] if len(large) > self.LARGE_CACHED else ():
                del self._cache[k]


def _short(message: str) -> str:
    """An llguidance message for a client's eyes: its first line, cut short (never a parser
    state dump)."""
    return first_line(message, 300, "the grammar is not valid")


class LazyConstraint(Protocol):
    """Auto tool choice (request/tools.py `LazyCall`): fed each sampled token, it gives the
    matcher that constrains a call the model starts (None until then)."""

    def feed(self, token: int): ...


@dataclass
class Constraint:
    """A request's constrained output, kept on `Request.constraint`: its format's matcher, or
    (auto tool choice) what starts one when the model starts a call."""
    matcher: LLMatcher | None = None      # llguidance's matcher at this request's state
    lazy: LazyConstraint | None = None


def matcher_error(m) -> str:
    """What a client is told when its grammar fails while generating (a parser limit hit or
    a state it cannot leave); the full state goes to the debug log only."""
    log.debug("a constrained output failed: %s", m.get_error())
    return ("the output format's grammar failed while generating (it reached the parser's limits); "
            "use a simpler format")


def _validate(grammar: str, lltok, limits: GrammarLimits) -> tuple[bool, str]:
    from llguidance import LLMatcher
    try:
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, lltok, limits=limits.llguidance())
    except Exception as e:
        return False, _short(str(e))
    if is_error:
        return False, _short("; ".join(messages)) or "the grammar does not compile"
    return True, ""


_executor = None


def _exec():
    global _executor
    if _executor is None:
        from llguidance import LLExecutor
        _executor = LLExecutor()
    return _executor


class Masks:
    """Allowed-token bitmasks of a step's constrained rows (computed together, in llguidance's
    threads, without the GIL), applied to their logits rows."""

    def __init__(self, rows: list[int], bits: np.ndarray, vocab: int):
        self.rows, self.bits, self.vocab = rows, bits, vocab

    @classmethod
    def compute(cls, matchers: list, vocab: int) -> "Masks | None":
        """matchers[i]: row i's matcher or None. None when no row is constrained."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        words = (vocab + 31) // 32
        bits = np.zeros((len(rows), words), np.int32)
        _exec().unsafe_compute_mask_ptr([(matchers[i], j) for j, i in enumerate(rows)], bits.ctypes.data,
                                        words * 4, len(rows))
        return cls(rows, bits, vocab)

    def allowed(self, j: int) -> np.ndarray:
        """Row `rows[j]`'s allowed tokens, bool [vocab]."""
        return np.unpackbits(self.bits[j].view(np.uint8), bitorder="little")[: self.vocab].astype(bool)

    def apply(self, logits) -> None:
        """Disallowed tokens of the constrained rows to -inf (logits: float32 [B, >= vocab],
        numpy or a CPU torch tensor, written in place)."""
        arr = logits if isinstance(logits, np.ndarray) else logits.numpy()
        for j, i in enumerate(self.rows):
            row = arr[i]
            allowed = self.allowed(j)
            row[: self.vocab][~allowed] = -np.inf
            row[self.vocab:] = -np.inf
