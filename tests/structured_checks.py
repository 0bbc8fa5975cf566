"""Constraints used by the structured-output tests, each with an independent checker (Python's
json / re, not the grammar engine) of a finished output."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from vllm_lite.sampling_params import StructuredOutputsParams

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
CHOICES = ["red", "green", "blue dog", 'say "hi"']
GRAMMAR = 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [0-9]{1,3}'
GRAMMAR_AS_REGEX = r"\([0-9]{1,3}(\+[0-9]{1,3}){0,3}\)"


# xgrammar's JSON grammar, like vLLM's output, lets raw control characters into strings:
# strict=False accepts them (everything else about the JSON is checked).
def _person_ok(text: str) -> bool:
    value = json.loads(text, strict=False)
    assert list(value) == ["name", "age", "ok"], value  # the schema's property order
    return (set(value) == {"name", "age", "ok"} and isinstance(value["name"], str) and len(value["name"]) <= 8
            and type(value["age"]) is int and 0 <= value["age"] <= 120 and isinstance(value["ok"], bool))


def _json_object_ok(text: str) -> bool:
    return isinstance(json.loads(text, strict=False), dict)


# kind -> (params, checker of a complete output, bounded: every output must end with `stop`)
KINDS: dict[str, tuple[StructuredOutputsParams, Callable[[str], bool], bool]] = {
    "json": (StructuredOutputsParams(json=PERSON_SCHEMA, disable_any_whitespace=True), _person_ok, True),
    "json_object": (StructuredOutputsParams(json_object=True, disable_any_whitespace=True), _json_object_ok, False),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None, True),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES, True),
    "grammar": (StructuredOutputsParams(grammar=GRAMMAR), lambda t: re.fullmatch(GRAMMAR_AS_REGEX, t) is not None,
                True),
}
