"""Tool calls, transport-neutral: the tool list as the chat template takes it, the model's
own call syntax chosen from its template, the grammar that makes a required call parse, and
the parser that turns an answer back into calls.

    syntax = syntax_for(tokenizer.chat_template)       # hermes (<tool_call>), llama3 (JSON), mistral ([TOOL_CALLS]),
                                                        # generic (a template without tools: JSON all through)
    tools = check_tools(body["tools"])                  # ValueError naming the problem
    messages = prepare_messages(messages, tools, template)  # history with calls and results, tools shown
    grammar = syntax.grammar(tools, parallel, name)     # tool_choice required / a named function
    content, calls = syntax.parse(text)                 # calls: [{"id", "name", "arguments" (a JSON string)}]

Every door (the OpenAI API, the Ollama API, the msgpack protocol) maps its own fields here.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from . import jsontext
from ..constrain.grammar import JSON_STYLE   # JSON as models write it
from ..constrain.schemas import MAX_INTEGER, NUMBER_STEP, closed  # noqa: F401 (a format's concern)

MAX_TOOLS = 128
GENERIC_CALLS = '{"tool_calls": '    # the generic syntax's answers: a call list or a reply, in JSON
GENERIC_TEXT = '{"response": '
NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def check_tools(tools) -> list[dict]:
    """OpenAI's (and Ollama's) tool list -> [{"type": "function", "function": {name, description,
    parameters}}], checked; ValueError naming what is wrong."""
    if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS:
        raise ValueError(f"tools must be a list of 1..{MAX_TOOLS} tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ValueError(f"tools[{i}].function.name must be 1..64 letters, digits, '_', '.' or '-'")
        if name in names:
            raise ValueError(f"tools[{i}]: two tools are named {name!r}")
        names.add(name)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema (an object)")
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise ValueError(f"tools[{i}].function.description must be a string")
        out.append({"type": "function", "function": {"name": name, "description": desc, "parameters": params}})
    return out


MAX_DEFAULT_CALLS = 4      # calls in one answer when the request leaves parallel_tool_calls unset
MAX_PARALLEL_CALLS = 16    # ... when it asks for parallel calls


def _arguments(value):
    """A call's arguments as the templates want them: a dict (a JSON string is parsed)."""
    if isinstance(value, str):
        try:
            parsed = jsontext.loads(value, "a tool call's arguments") if value.strip() else {}
        except ValueError:
            return value
        return parsed
    return value if value is not None else {}


def template_takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


@dataclass(frozen=True)
class ToolSyntax:
    """How a model family writes tool calls. `specials`: (text, id) of the markers that are
    special tokens of the vocabulary (Qwen's <tool_call>): the grammars name those tokens,
    as a model writes them, instead of spelling their text."""
    name: str
    specials: tuple = ()

    def lit(self, text: str) -> str:
        """A Lark literal for `text`: the special token when the vocabulary has one."""
        for t, i in self.specials:
            if t == text:
                return f"<[{i}]>"
        return json.dumps(text)

    # -- what the model sees ----------------------------------------------------------------
    def call_text(self, calls: list[dict]) -> str:
        """An earlier assistant turn's calls, written the model's way (templates without tools)."""
        if self.name == "mistral":
            return "[TOOL_CALLS] " + json.dumps([{"name": c["name"], "arguments": c["arguments"]} for c in calls])
        if self.name == "generic":
            return json.dumps({"tool_calls": [{"name": c["name"], "arguments": c["arguments"]} for c in calls]},
                              ensure_ascii=False)
        if self.name == "llama3":
            return "\n".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)
        return "\n".join("<tool_call>\n" + json.dumps({"name": c["name"], "arguments": c["arguments"]})
                         + "\n</tool_call>" for c in calls)

    # -- what makes a required call parse ----------------------------------------------------
    def grammar(self, tools: list[dict], parallel: bool | None = True, name: str | None = None) -> str:
        """A Lark grammar (llguidance, with %json) for one call (or several, `parallel`: at most
        MAX_PARALLEL_CALLS, or MAX_DEFAULT_CALLS when the request left it unset) of the tools
        (only `name`, when given), each call's arguments following its schema. The call list
        is bounded, so the answer ends when it closes (unbounded, a model repeated calls until
        its length limit)."""
        most = 1 if parallel is False else MAX_DEFAULT_CALLS if parallel is None else MAX_PARALLEL_CALLS
        fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
        if not fns:
            raise ValueError(f"tool_choice names {name!r}, which is not in tools")
        key = "parameters" if self.name == "llama3" else "arguments"
        schemas = [{"type": "object", "properties": {"name": {"const": f["name"]}, key: closed(f["parameters"])},
                    "required": ["name", key], "additionalProperties": False} for f in fns]
        one = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        one = {**one, "x-guidance": JSON_STYLE}
        if self.name == "generic":
            arr = {"type": "array", "items": one, "minItems": 1, "maxItems": most, "x-guidance": JSON_STYLE}
            return f'start: {json.dumps(GENERIC_CALLS)} calls "}}"\ncalls: %json {json.dumps(arr)}\n'
        if self.name == "mistral":
            arr = {"type": "array", "items": one, "minItems": 1, "maxItems": most}
            return f'start: {self.lit("[TOOL_CALLS]")} " "? body\nbody: %json {json.dumps(arr)}\n'
        body = f"body: %json {json.dumps(one)}\n"
        more = f'{{0,{most - 1}}}' if most > 1 else ""
        if self.name == "llama3":
            return "start: body" + (f' ("\\n" body){more}' if more else "") + "\n" + body
        return ("start: call" + (f' ("\\n" call){more}' if more else "") + "\n"
                + f'call: {self.lit("<tool_call>")} "\\n" body "\\n" {self.lit("</tool_call>")}\n' + body)

    def auto_grammar(self, tools: list[dict]) -> str | None:
        """Auto tool choice, generic syntax only: the whole answer is JSON, either one call or
        `{"response": "<text>"}` (a small model without tool training picks between the two
        far more reliably than it opens a call in free text; one call, as the other families'
        auto choice: a toy model given room for more strings calls on to the length limit).
        None for the other families, whose calls are constrained once the model opens one
        (`continuation`)."""
        if self.name != "generic":
            return None
        g = self.grammar(tools, parallel=False)
        text = {"type": "string", "x-guidance": JSON_STYLE}
        return ("start: calls_answer | text_answer\n"
                + g.replace("start: ", "calls_answer: ", 1)
                + f'text_answer: {json.dumps(GENERIC_TEXT)} text "}}"\ntext: %json {json.dumps(text)}\n')

    # -- what comes back ------------------------------------------------------------------------
    @property
    def marker(self) -> str:
        """The text that opens a call."""
        return {"mistral": "[TOOL_CALLS]", "llama3": "{", "hermes": "<tool_call>", "generic": GENERIC_CALLS}[self.name]

    def find(self, text: str) -> int | None:
        """Where a call starts in an answer, or None (Llama 3: the answer must start with one)."""
        if self.name == "llama3":
            if self.starts(text):
                return len(text) - len(text.lstrip())
            return None
        at = text.find(self.marker)
        return at if at >= 0 else None

    def continuation(self, tools: list[dict], parallel: bool = True) -> str | None:
        """The grammar of what follows a call's marker once the model wrote it (auto
        tool choice): the call's body, each tool's arguments following its schema, and the
        closing marker; the answer ends there (one call: a marker that is a special token of
        the vocabulary, as Qwen's are, cannot start a second one inside llguidance's grammar
        reliably). None where there is no marker to wait for (Llama 3)."""
        if self.name in ("llama3", "generic"):
            return None
        g = self.grammar(tools, parallel)
        body = g[g.index("body: %json"):]
        if self.name == "mistral":
            return 'start: " "? body\n' + body
        return f'start: "\\n" body "\\n" {self.lit("</tool_call>")}\n' + body

    def starts(self, text: str) -> bool | None:
        """Whether an answer beginning with `text` is a tool call: True, False, or None (too
        early to tell). A leading <think>…</think> block (Qwen3) is looked past."""
        t = text.lstrip()
        if t.startswith("<think>"):
            if "</think>" not in t:
                return None
            t = t.split("</think>", 1)[1].lstrip()
        elif "<think>".startswith(t):
            return None
        marker = self.marker
        if not t:
            return None
        if t.startswith(marker):
            return True
        return None if marker.startswith(t) else False

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """An answer -> (content without the calls, calls [{"id", "name", "arguments": JSON
        text}]). Text that does not parse as a call stays content."""
        found = []
        if self.name == "hermes":
            content = text
            for m in re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S):
                call = _json_call(m.group(1), "arguments")
                if call is not None:
                    found.append(call)
                if call is not None or not m.group(0).endswith("</tool_call>"):   # a call cut short: not content
                    content = content.replace(m.group(0), "", 1)
            return (content.strip() if found else text), found
        if self.name == "mistral":
            at = text.find("[TOOL_CALLS]")
            if at < 0:
                return text, []
            try:
                calls = jsontext.loads(text[at + len("[TOOL_CALLS]"):].strip())
            except ValueError:    # cut short (a length limit): the calls it completed still count
                found = [c for c in (_call(x, "arguments") for x in _complete_items(
                    text[at + len("[TOOL_CALLS]"):])) if c is not None]
                return (text[:at].strip(), found) if found else (text, [])
            calls = calls if isinstance(calls, list) else [calls]
            found = [c for c in (_call(x, "arguments") for x in calls) if c is not None]
            return (text[:at].strip(), found) if found and len(found) == len(calls) else (text, [])
        if self.name == "generic":
            at = text.find(GENERIC_CALLS)
            if at < 0:
                return text, []
            try:
                obj = jsontext.loads(text[at:].strip())
            except ValueError:    # cut short (a length limit): the calls it completed still count
                return text[:at].strip(), [c for c in (_call(x, "arguments") for x in _complete_items(
                    text[at + len(GENERIC_CALLS):])) if c is not None]
            calls = obj.get("tool_calls") if isinstance(obj, dict) else None
            found = [c for c in (_call(x, "arguments") for x in calls or []) if c is not None]
            return (text[:at].strip(), found) if found and len(found) == len(calls) else (text, [])
        # llama3: the whole answer is one JSON object per line
        lines = [x for x in text.strip().splitlines() if x.strip()]
        calls = [_json_call(x, "parameters") for x in lines]
        if lines and all(c is not None for c in calls):
            return "", calls
        return text, []


def _complete_items(text: str) -> list:
    """The complete JSON values at the start of an array's text cut short ("[{...}, {..." ->
    the first object)."""
    out, dec, i = [], json.JSONDecoder(), text.find("[") + 1
    if i <= 0:
        return out
    while True:
        while i < len(text) and text[i] in " \n\t,":
            i += 1
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return out
        out.append(value)


def _json_call(text: str, key: str) -> dict | None:
    try:
        obj = jsontext.loads(text)
    except ValueError:
        return None
    return _call(obj, key)


def _call(obj, key: str) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = jsontext.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "name": obj["name"], "arguments": json.dumps(args,
                                                                                               ensure_ascii=False)}


def syntax_for(template: str | None, tokenizer=None) -> ToolSyntax:
    """The family's tool-call syntax, from its chat template: Mistral's [TOOL_CALLS], Llama
    3.x's bare JSON, Hermes/Qwen's <tool_call> (a template that takes tools in another way
    too), else the generic syntax (JSON answers, constrained: a template that knows no tools);
    with the markers that are special tokens of `tokenizer`."""
    t = template or ""
    specials = []
    if tokenizer is not None:
        for text in ("<tool_call>", "</tool_call>", "[TOOL_CALLS]"):
            i = tokenizer.tok.token_to_id(text)
            if i is not None and text in getattr(tokenizer, "control_set", ()):
                specials.append((text, i))
    if "[TOOL_CALLS]" in t:
        name = "mistral"
    elif "<|python_tag|>" in t or ("<|eot_id|>" in t and "tools" in t and "<tool_call>" not in t):
        name = "llama3"
    elif template_takes_tools(t) or "<tool_call>" in t or any(x == "<tool_call>" for x, _ in specials):
        name = "hermes"
    else:   # no sign the model was taught calls: JSON all through, constrained (as llama.cpp's generic)
        name = "generic"
    return ToolSyntax(name, tuple(specials))


def system_prompt(tools: list[dict], syntax: str = "hermes") -> str:
    """The tool list for a template that does not take one: Hermes' wording, or the generic
    syntax's JSON answers."""
    if syntax == "generic":
        lines = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call these functions:\n" + lines + "\n\nAnswer in JSON only. When a function "
                "can do what the user asks, call it: " + GENERIC_CALLS + '[{"name": "<function name>", '
                '"arguments": {...}}]}. Else reply: ' + GENERIC_TEXT + ' "<your reply to the user>"}.')
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nWhen a function can do what the user asks, call it: answer with only a json "
            "object with the function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")


def prepare_messages(messages: list[dict], tools: list[dict] | None, template: str | None,
                     tokenizer=None) -> list[dict]:
    """The conversation as the template renders it. Assistant calls and tool results stay
    structured for a template that takes tools (arguments as objects); for one that does
    not, they become text in the family's syntax, and the tool list joins the system message
    (generic syntax: the earlier answers as the JSON the model is held to)."""
    takes = template_takes_tools(template)
    syntax = syntax_for(template, tokenizer)   # (text only: the history is rendered, never constrained)
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            norm = [{"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}
                    for c in calls]
            if takes:
                m["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": n}
                                   for c, n in zip(calls, norm)]
            elif syntax.name == "generic":   # what the model answered: JSON all through
                m.pop("tool_calls")
                m["content"] = syntax.call_text(norm)
            else:
                m.pop("tool_calls")
                m["content"] = ((m.get("content") or "") + "\n" + syntax.call_text(norm)).strip()
        elif tools and not takes and syntax.name == "generic" and m.get("role") == "assistant":
            m["content"] = GENERIC_TEXT + json.dumps(m.get("content") or "", ensure_ascii=False) + "}"
        if m.get("role") == "tool" and not takes:
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if tools and not takes:
        text = system_prompt(tools, syntax.name)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def check_choice(choice, tools: list[dict] | None):
    """tool_choice -> "auto" | "none" | "required" | a function name; ValueError naming the problem."""
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise ValueError("tool_choice required needs tools")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ValueError('tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                         '{"name": ...}}')
    if not tools or name not in {t["function"]["name"] for t in tools}:
        raise ValueError(f"tool_choice names {name!r}, which is not in tools")
    return name


def check_message(m: dict, i: int) -> dict:
    """A chat message in the schema's shape, checked by the one message model
    (request/messages.py) -> the map its template renders; ValueError naming the problem."""
    from .messages import from_map
    return from_map(m, i).template()


def _generic_text(raw: str) -> tuple[str, bool]:
    """The generic syntax's reply, `{"response": "<text>"}`: (the text decoded so far, True)
    once `raw` opens one; ("", False) otherwise. A JSON escape not yet complete waits."""
    t = raw.lstrip()
    head = GENERIC_TEXT + '"'
    if not t.startswith(head):
        return "", False
    s, out, i = t[len(head):], [], 0
    while i < len(s):
        c = s[i]
        if c == '"':
            break
        if c != "\\":
            out.append(c)
            i += 1
            continue
        if i + 1 >= len(s):
            break
        e = s[i + 1]
        if e != "u":
            out.append({"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f"}.get(e, e))
            i += 2
            continue
        try:
            cp = int(s[i + 2:i + 6], 16) if len(s) >= i + 6 else None
        except ValueError:
            cp = None
        if cp is None:
            break
        if 0xD800 <= cp < 0xDC00:            # a surrogate pair: both halves, or wait
            try:
                lo = int(s[i + 8:i + 12], 16) if len(s) >= i + 12 and s[i + 6:i + 8] == "\\u" else None
            except ValueError:
                lo = None
            if lo is None:
                break
            out.append(chr(0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00)))
            i += 12
            continue
        out.append(chr(cp))
        i += 6
    return "".join(out), True


class ToolStream:
    """One answer's text on its way out when tools were offered. The text given out is the
    decoded answer with special tokens (a call's markers may be special tokens); from a call's
    marker on (Hermes' <tool_call> or Mistral's [TOOL_CALLS] anywhere, Llama 3's JSON only at
    the start) it is held back, and so is a tail that may still grow into a marker; at the
    end the calls are parsed out and what is left is content."""

    def __init__(self, syntax: ToolSyntax, tokenizer):
        self.syntax, self.tokenizer = syntax, tokenizer
        self.ids: list[int] = []
        self.emitted = 0        # characters of the raw text given out
        self.call_at: int | None = None   # where the first call starts in the raw text
        self._raw = ""
        # calls given out as they are written (`deltas`): [{"id", "name", "sent": the raw
        # position its arguments were given out to, "end": where they closed, or None}]
        self.streamed: list[dict] = []
        self._scan = _JsonValueEnd()
        self.repeated = False   # a call repeated an earlier one exactly: the list ended there

    def raw(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=False)

    def _safe(self, raw: str) -> int:
        """How much of `raw` may go out: up to a call's start, or a tail that may grow into one."""
        if self.call_at is None:
            self.call_at = self.syntax.find(raw)
        if self.call_at is not None:
            return self.call_at
        end = len(raw.rstrip("\ufffd"))                 # an incomplete character waits
        if self.syntax.name == "llama3":
            return end if self.syntax.starts(raw) is False else 0
        marker = self.syntax.marker
        for k in range(min(len(marker) - 1, end), 0, -1):   # a tail that begins the marker waits
            if marker.startswith(raw[end - k:end]):
                return end - k
        return end

    def push(self, token_ids: list[int], text: str) -> str:
        """The next event's tokens -> the content that may go out now."""
        self.ids += token_ids
        raw = self._raw = self.raw()
        if self.syntax.name == "generic":      # the reply's text, decoded from its JSON string as it comes
            said = _generic_text(raw.rstrip("\ufffd"))[0]
            out, self.emitted = said[self.emitted:], max(self.emitted, len(said))
            return out
        safe = max(self._safe(raw), self.emitted)
        out, self.emitted = raw[self.emitted:safe], safe
        return out

    def deltas(self) -> list[tuple[int, dict]]:
        """A call's parts as the model writes them, for doors that stream calls (OpenAI's
        chunks): (call index, {"id", "name"}) once its name is complete, then (index,
        {"arguments": text}) pieces of its arguments' JSON as they come (joined, they are the
        call's arguments), and (index, {"done": True}) when they close. After `push`; the text
        is what the grammar let the model write (a call is constrained from its marker on)."""
        text = self._raw.rstrip("\ufffd")
        start = self._calls_start(text, self.call_at)
        if start is None or self.repeated:
            return []
        out: list[tuple[int, dict]] = []
        while True:
            if self.streamed and self.streamed[-1]["end"] is None:
                c, k = self.streamed[-1], len(self.streamed) - 1
                end = self._scan.feed(text, c["sent"])
                upto = end if end is not None else self._scan.safe
                c["sent"] = max(c["sent"], self._scan.start if self._scan.start is not None else c["sent"])
                if upto > c["sent"]:
                    c["args"] += text[c["sent"]:upto]
                    if not c["held"]:
                        out.append((k, {"arguments": text[c["sent"]:upto]}))
                    c["sent"] = upto
                if end is None:
                    return out
                c["end"] = end
                if c["held"]:        # a call named as an earlier one: given out now, unless it repeats one
                    if any(_same_args(c["args"], e["args"]) for e in self.streamed[:-1] if e["name"] == c["name"]):
                        self.repeated = True      # an exact repeat ends the list (nothing after it goes out)
                        return out
                    out += [(k, {"id": c["id"], "name": c["name"]}), (k, {"arguments": c["args"]})]
                out.append((k, {"done": True}))
            head = self._open_call(text, start)
            if head is None:
                return out
            if not self.streamed[-1]["held"]:
                out.append(head)

    def _calls_start(self, text: str, call_at: int | None) -> int | None:
        """Where the answer's calls start in `text` (None: not a call list)."""
        if self.syntax.name == "generic":
            return len(text) - len(text.lstrip()) if text.lstrip().startswith(GENERIC_CALLS) else None
        return call_at

    def _open_call(self, text: str, start: int) -> tuple[int, dict] | None:
        """The next call's head in `text` (after the last call given out, else from `start`):
        given out as (call index, {"id", "name"}), its arguments to stream from its end."""
        m = CALL_HEAD.search(text, self.streamed[-1]["end"] if self.streamed else start)
        if m is None:
            return None
        try:
            name = json.loads('"' + m.group(1) + '"')
        except ValueError:
            return None
        # a call named as an earlier one is held until its arguments close: it may repeat that one
        held = any(c["name"] == name for c in self.streamed)
        call = {"id": "call_" + uuid.uuid4().hex[:24], "name": name, "sent": m.end(), "end": None, "args": "",
                "held": held}
        self.streamed.append(call)
        self._scan = _JsonValueEnd()
        return len(self.streamed) - 1, {"id": call["id"], "name": name}

    def name_ahead(self, ahead: list[int]) -> list[tuple[int, dict]]:
        """After `deltas`: the next call's (call index, {"id", "name"}) when the tokens its
        format forces next (`ahead`: certain to follow, not generated yet) complete its name,
        one step before `deltas` would see it; its arguments stream from `deltas` as they come.
        Nothing while a call's arguments are open."""
        if self.repeated or self.streamed and self.streamed[-1]["end"] is None:
            return []
        text = self.tokenizer.decode(self.ids + list(ahead), skip_special_tokens=False).rstrip("\ufffd")
        at = self.call_at
        if at is None and self.syntax.name != "generic":
            at = self.syntax.find(text)
        start = self._calls_start(text, at)
        head = None if start is None else self._open_call(text, start)
        return [] if head is None or self.streamed[-1]["held"] else [head]

    def finish(self) -> tuple[str, list[dict]]:
        """(content still to give out, calls). Calls given out already by `deltas` keep their ids."""
        content, calls = self._finish()
        calls = until_repeat(calls)
        for c, s in zip(calls, self.streamed):
            if c["name"] == s["name"]:
                c["id"] = s["id"]
        return content, calls

    def _finish(self) -> tuple[str, list[dict]]:
        raw = self.raw()
        if self.syntax.name == "generic":
            said, opened = _generic_text(raw)
            if opened:                       # a reply (cut short by the length limit, maybe)
                out, self.emitted = said[self.emitted:], len(said)
                return out, []
            content, calls = self.syntax.parse(raw)
            if calls:
                return "", calls
            if raw.lstrip().startswith(GENERIC_CALLS):
                return "", []                # a call cut short: not content
            return content, []               # no JSON at all (a response format won): as it is
        if self.call_at is None:
            self.call_at = self.syntax.find(raw)
        if self.call_at is None:
            out, self.emitted = raw[self.emitted:], len(raw)
            return out, []
        content, calls = self.syntax.parse(raw[self.call_at:])
        if not calls:
            out, self.emitted = raw[self.emitted:], len(raw)
            return out, []
        out = raw[self.emitted:self.call_at] + content
        self.emitted = len(raw)
        return (out if out.strip() else ""), calls


def _same_args(a, b) -> bool:
    """Two calls' arguments (JSON text or values) are the same value."""
    def value(x):
        if isinstance(x, str):
            try:
                return json.dumps(jsontext.loads(x), sort_keys=True)
            except ValueError:
                return x.strip()
        return json.dumps(x, sort_keys=True, default=str)
    return value(a) == value(b)


def until_repeat(calls: list[dict]) -> list[dict]:
    """The calls up to the first exact repeat of an earlier one (the same name and the same
    arguments): a small model asked for a call repeats it until the list's bound ("Make the
    garage brighter." four times, 11-14 with parallel calls), and a home would run each."""
    out: list[dict] = []
    for c in calls:
        if any(e["name"] == c["name"] and _same_args(e.get("arguments"), c.get("arguments")) for e in out):
            break
        out.append(c)
    return out


def name_cut(syntax: ToolSyntax, tokenizer, drafts: list[int], certain: list[bool]) -> int | None:
    """How many of an answer's first drafts (`speculate.chain_drafts`; `certain[i]`: drafts[i]
    is forced after the ones before it) its first call's name needs: the fewest after which a
    stream gives the name out (`ToolStream.name_ahead`, with the forced run that follows them
    as `ahead`); None when they never complete it."""
    for j in range(len(drafts) + 1):
        run = j
        while run < min(len(drafts), len(certain)) and certain[run]:
            run += 1
        stream = ToolStream(syntax, tokenizer)
        stream.ids = list(drafts[:j])
        if stream.name_ahead(drafts[j:run]):
            return j
    return None


# a call's head as every syntax writes it (constrained calls name the function first): its name
# complete, its arguments about to begin
CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class _JsonValueEnd:
    """Where a JSON value that starts at a given position ends, fed a growing text: `feed`
    returns the end (exclusive) once the value is complete, else None; `safe` is how far the
    text is certainly inside the value (a scalar is given out only whole)."""

    def __init__(self):
        self.pos = self.start = None
        self.depth = 0
        self.in_str = self.esc = False
        self.kind = None
        self.safe = 0

    def feed(self, text: str, start: int) -> int | None:
        if self.pos is None:
            while start < len(text) and text[start] in " \t\r\n":
                start += 1
            if start >= len(text):
                self.safe = start
                return None
            self.kind = text[start]
            self.pos = self.start = self.safe = start
        i = self.pos
        if self.kind not in '{["':                 # a number or a literal: whole, at its end
            j = i
            while j < len(text) and text[j] not in ",}] \t\r\n":
                j += 1
            return j if j < len(text) else None
        while i < len(text):
            ch = text[i]
            i += 1
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
                    if self.kind == '"' and self.depth == 0:
                        self.pos = self.safe = i
                        return i
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = self.safe = i
                    return i
        self.pos = self.safe = i
        return None


class LazyCall:
    """Auto tool choice: once the model writes a call's marker, the rest of the call is
    constrained (each tool's arguments to its schema), so a call it starts always parses.
    The engine feeds it the answer's tokens (`feed`) until it returns a matcher."""

    def __init__(self, marker: str, grammar: str, grammars, tokenizer, matcher=None):
        self.marker, self.grammar, self.grammars, self.tokenizer = marker, grammar, grammars, tokenizer
        # the matcher the call will use, built with the request (the front end's
        # Grammars.prepare), so that nothing compiles inside the engine loop
        self.matcher = matcher
        self.tail = ""

    def feed(self, token: int):
        """The next sampled token -> a matcher for the rest of the answer once the marker is
        complete (already past what followed it in that token), else None."""
        self.tail += self.tokenizer.decode([token], skip_special_tokens=False)
        at = self.tail.find(self.marker)
        if at < 0:
            self.tail = self.tail[-len(self.marker):]
            return None
        after = self.tail[at + len(self.marker):]
        m = self.matcher if self.matcher is not None else self.grammars.matcher(self.grammar)
        if after and not m.consume_tokens(self.grammars.lltok.tokenize_str(after)):
            return False            # what it wrote after the marker is no call: leave it free
        return m
