"""JSON schemas as a constrained answer is compiled from them: an object that lists its
properties is closed (as OpenAI's strict tools and Ollama, llama.cpp and vLLM compile it),
and a number is bounded (digits a client can parse)."""
from __future__ import annotations


def closed(schema):
    """A tool's argument schema with `additionalProperties: false` on every object that lists
    its properties and says nothing of others (as OpenAI's strict tools): a call holds the
    tool's arguments, not whatever else the model would add."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in ("properties", "items", "anyOf", "oneOf", "allOf", "$defs", "definitions",
                                 "prefixItems") or isinstance(v, (dict, list)) and k not in ("enum", "const",
                                                                                             "required", "examples",
                                                                                             "default")
           else v for k, v in schema.items()}
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: closed(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return _bounded_numbers(out)


# A number a constrained answer writes has at most 16 digits before the point and 10 after
# (llama.cpp's schema grammars allow 1-16): unbounded, a small model wrote a 54-digit
# "population" until its length limit, which no client could parse (docs/HTTP.md).
MAX_INTEGER = 10**16 - 1
NUMBER_STEP = 1e-10


def _bounded_numbers(node: dict) -> dict:
    """`node` with a range on each side a number or integer leaves open, and, for a number
    with neither range nor step, a step of NUMBER_STEP (llguidance bounds the digits then)."""
    kinds = node.get("type")
    kinds = {kinds} if isinstance(kinds, str) else set(kinds) if isinstance(kinds, list) else set()
    if not kinds & {"integer", "number"}:
        return node
    if "minimum" not in node and "exclusiveMinimum" not in node:
        node["minimum"] = -MAX_INTEGER
    if "maximum" not in node and "exclusiveMaximum" not in node:
        node["maximum"] = MAX_INTEGER
    if "number" in kinds and "multipleOf" not in node:
        node["multipleOf"] = NUMBER_STEP
    return node
