"""The rules of a request's fields, defined once (pydantic v2, strict: no "1" taken for 1, no
true for 1): the sampling fields (`Sampling`), which `SamplingParams` (model/params.py) checks
its own values against, so a request built in code meets them too; `FieldError`, naming the
field; and `validate`, which the request schema (request/schema.py) runs over a whole request.
A leaf of the package: it imports nothing of edgepaged's."""
from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

MAX_STOP = 16            # stop strings, stop token ids
MAX_SAMPLES = 8          # n: parallel samples of one prompt
MAX_LOGIT_BIAS = 300
MAX_TOP_LOGPROBS = 20
MAX_NAME_LEN = 128
MIN_TEMPERATURE = 1e-4   # a positive temperature below this samples greedily (0 does)
MAX_TEMPERATURE = 1e6    # (far past uniform already; 1e308 overflows float32)
MIN_PENALTY, MAX_PENALTY = 0.01, 100.0   # repetition_penalty: beyond these logits overflow or vanish

Num = StrictInt | StrictFloat


class FieldError(ValueError):
    """A request field that breaks its rule: `field` (the schema's name), `code` (bad_request
    for a wrong type or shape, invalid_params for a value out of range)."""

    def __init__(self, field: str | None, message: str, code: str = "bad_request"):
        super().__init__(message)
        self.field, self.message, self.code = field, message, code


def _rule(kind: str, rule: str, **constraints) -> Any:
    """A field: `kind` names its type in messages ("a number"), `rule` its range ("a
    number in [0, 1]"); the constraints are pydantic's (ge, le, gt, max_length)."""
    return Field(default=None, json_schema_extra={"kind": kind, "rule": rule}, **constraints)


class Sampling(BaseModel):
    """How the next token is drawn (SamplingParams' fields but max_tokens)."""
    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: Num | None = _rule("a number", f"a number in [0, {MAX_TEMPERATURE:g}]", ge=0,
                                    le=MAX_TEMPERATURE)
    top_k: StrictInt | None = _rule("an integer", "an integer >= 0 (0 = off)", ge=0)
    top_p: Num | None = _rule("a number", "in (0, 1]", gt=0, le=1)
    min_p: Num | None = _rule("a number", "in [0, 1]", ge=0, le=1)
    repetition_penalty: Num | None = _rule("a number", f"in [{MIN_PENALTY}, {MAX_PENALTY}]", ge=MIN_PENALTY,
                                           le=MAX_PENALTY)
    seed: StrictInt | None = _rule("an integer", "an integer in [0, 2**63)", ge=0, lt=2 ** 63)
    ignore_eos: StrictBool | None = _rule("a boolean", "a boolean")
    presence_penalty: Num | None = _rule("a number", "in [-2, 2]", ge=-2, le=2)
    frequency_penalty: Num | None = _rule("a number", "in [-2, 2]", ge=-2, le=2)
    logit_bias: dict[StrictInt, Num] | None = _rule(
        "a map of token ids to numbers", f"a map of at most {MAX_LOGIT_BIAS} token ids >= 0 to numbers in [-100, 100]",
        max_length=MAX_LOGIT_BIAS)
    logprobs: StrictInt | None = _rule("an integer", f"an integer in 0..{MAX_TOP_LOGPROBS}", ge=0, le=MAX_TOP_LOGPROBS)
    stop: list[StrictStr] | None = _rule(f"a string or a list of at most {MAX_STOP} strings",
                                         "a list of non-empty strings", max_length=MAX_STOP)
    stop_token_ids: list[StrictInt] | None = _rule(f"a list of at most {MAX_STOP} integers",
                                                   "a list of token ids >= 0", max_length=MAX_STOP)


SAMPLING_FIELDS = tuple(Sampling.model_fields)


class _SamplingParams(Sampling):
    """What `check_sampling` checks: the sampling fields and max_tokens."""
    max_tokens: StrictInt | None = _rule("an integer", "an integer >= 1", ge=1)


def _after(obj: BaseModel) -> None:
    """The rules pydantic's constraints do not say."""
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        v = getattr(obj, name)
        if isinstance(v, float) and not math.isfinite(v):
            raise _range(name, v, type(obj))
    if obj.stop is not None and not all(obj.stop):
        raise _range("stop", obj.stop, type(obj))
    if obj.stop_token_ids is not None and any(t < 0 for t in obj.stop_token_ids):
        raise _range("stop_token_ids", obj.stop_token_ids, type(obj))
    if obj.logit_bias is not None and any(k < 0 or not (-100 <= v <= 100 and math.isfinite(v))   # (an int past
                                          for k, v in obj.logit_bias.items()):                  # float's range)
        raise _range("logit_bias", obj.logit_bias, type(obj))
    fmt = getattr(obj, "format", None)
    if fmt is not None and not isinstance(fmt.get("type"), str):
        raise FieldError("format", "format must be a map with a type (json_object, json_schema, regex, lark)")


def _range(name: str, value, model: type[BaseModel]) -> FieldError:
    rule = model.model_fields[name].json_schema_extra["rule"]
    return FieldError(name, f"{name} must be {rule}, got {_shown(value)}", "invalid_params")


# pydantic's error types that mean "wrong type or shape" (the rest: a value out of range)
_SHAPE = {"int_type", "float_type", "bool_type", "string_type", "dict_type", "list_type", "literal_error",
          "missing", "extra_forbidden", "int_from_float", "model_type", "too_long", "is_instance_of",
          "union_tag_invalid", "model_attributes_type"}


def _error(e: ValidationError, data: dict, model: type[BaseModel]) -> FieldError:
    err = e.errors(include_url=False)[0]
    name = str(err["loc"][0]) if err["loc"] else None
    info = model.model_fields.get(name) if name else None
    if info is None:
        return FieldError(name, f"{name}: {err['msg']}")
    extra = info.json_schema_extra
    value = data.get(name)
    kinds = {e2["type"] for e2 in e.errors(include_url=False) if e2["loc"] and e2["loc"][0] == name}
    if kinds & _SHAPE:
        got = _shown(value) if kinds == {"literal_error"} else type(value).__name__
        return FieldError(name, f"{name} must be {extra['kind']}, got {got}"
                          if not isinstance(value, (list, dict)) else f"{name} must be {extra['kind']}")
    return FieldError(name, f"{name} must be {extra['rule']}, got {_shown(value)}", "invalid_params")


def _shown(value, most: int = 80) -> str:
    """A value as an error message quotes it: its repr, cut at `most` characters."""
    text = repr(value)
    return text if len(text) <= most else text[:most] + "…"


def validate(data: dict, model: type[BaseModel]) -> BaseModel:
    """`data` (the schema's names; None values are absent) checked against the rules ->
    the validated model; FieldError for the first field that breaks one."""
    data = {k: v for k, v in data.items() if v is not None}
    if isinstance(data.get("stop"), str):
        data["stop"] = [data["stop"]]
    bias = data.get("logit_bias")
    if isinstance(bias, dict) and any(isinstance(k, str) for k in bias):   # JSON's keys are strings
        try:
            data["logit_bias"] = {int(k): v for k, v in bias.items()}
        except (TypeError, ValueError):
            raise FieldError("logit_bias", "logit_bias must map token ids to numbers") from None
    try:
        obj = model.model_validate(data)
    except ValidationError as e:
        raise _error(e, data, model) from None
    _after(obj)
    return obj


def check_sampling(values: dict) -> None:
    """SamplingParams' values (and max_tokens) against the same rules (FieldError, a
    ValueError, naming the field)."""
    validate(values, _SamplingParams)
